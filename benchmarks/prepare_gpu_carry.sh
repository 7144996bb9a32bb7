#!/usr/bin/env bash
# Makes what gpu_session.sh carries to a GPU machine without network for its CUDA steps (both
# ignored by git; a new checkout has neither). Run from a machine with network (or the CI
# machine's package mirror):
#
#   bash benchmarks/prepare_gpu_carry.sh            # .whl/ and .llama/llama_trim.tar.gz
#
# .whl/: the wheels the GPU image lacks, for its Python 3.12 on x86_64 (`gpu_session.sh setup`
# installs them into the session folder): gguf, tokenizers (and their pure-Python needs pyyaml,
# tqdm), rich (markdown-it-py, mdurl, pygments), psutil, diskcache (llama-cpp-python imports it),
# and the serving stack for `gpu_session.sh serve` (fastapi with opentelemetry-api and annotated-doc, starlette, uvicorn, prometheus-client, pydantic,
# pydantic-core, annotated-types, typing-inspection, anyio, sniffio, h11, click) and the webgpu
# backend's (wgpu, cffi, pycparser, rendercanvas; the Vulkan loader comes from .gl/). Versions follow
# what the CI install resolves today, pinned here so that a later run carries the same ones.
#
# .llama/llama_trim.tar.gz: llama-cpp-python 0.3.36's sdist (76 MB; its .git module pack alone is
# 38 MB) without what a CUDA + CPU build of llama-bench, llama-batched-bench, llama-quantize and the
# Python bindings' libllama neither configures nor compiles: models, docs, examples, tests,
# benches, the server and its UI, other ggml backends, the vendored .git, media files (4.6 MB).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT

WHEELS=(gguf==0.19.0 tokenizers==0.23.3 pyyaml==6.0.3 tqdm==4.70.1 rich==15.0.0 markdown-it-py==4.3.0
        mdurl==0.1.2 pygments==2.21.0 psutil==7.2.2 diskcache==5.6.3
        fastapi==0.165.0 opentelemetry-api==1.45.2 annotated-doc==0.0.7 starlette==1.10.0 uvicorn==0.54.0
        prometheus-client==0.26.0
        pydantic==2.14.4 pydantic-core
        annotated-types typing-inspection anyio==4.16.0 sniffio==1.3.1 h11==0.16.0 click==8.5.1
        wgpu==0.32.0 cffi==2.1.1 pycparser==3.12 rendercanvas==2.7.2)
mkdir -p "$ROOT/.whl"
for w in "${WHEELS[@]}"; do
  if [ "${w%%==*}" = pydantic-core ]; then  # the version pydantic 2.14.4 pins
    w="pydantic-core==$(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 -d "$T/p" pydantic==2.14.4 >/dev/null &&
        unzip -p "$T"/p/pydantic-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')"
  fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 -d "$ROOT/.whl" "$w"
done

python3 -m pip download -q --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d "$T"
tar xzf "$T/llama_cpp_python-0.3.36.tar.gz" -C "$T"
S=$T/llama_cpp_python-0.3.36
L=$S/vendor/llama.cpp
rm -rf "$S"/{examples,docker,docs,.git} "$L"/{models,docs,media,benches,tests,conversion,gguf-py,scripts,.github,.devops,.gemini}
rm -rf "$L"/tools/{ui,server,cli}
for b in blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
  rm -rf "$L/ggml/src/ggml-$b"
done
find "$L/tools" -type f \( -name '*.jpeg' -o -name '*.jpg' -o -name '*.png' -o -name '*.mp3' -o -name '*.mp4' -o -name '*.wav' \) -delete
mkdir -p "$ROOT/.llama"
tar -C "$T" -cf - llama_cpp_python-0.3.36 | gzip -9 >"$ROOT/.llama/llama_trim.tar.gz"
ls -la "$ROOT/.whl" "$ROOT/.llama/llama_trim.tar.gz"
du -sh "$ROOT/.whl"
