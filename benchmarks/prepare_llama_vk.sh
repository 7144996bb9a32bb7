#!/usr/bin/env bash
# Makes what gpu_session.sh build_llama_vk carries to a GPU machine without network (both ignored by
# git): .llama/llama_vk.tar.gz and .vk/*.deb. Run on a Debian/Ubuntu machine with network:
#
#   bash benchmarks/prepare_llama_vk.sh [llama_cpp_python-0.3.36.tar.gz]
#
# The archive: llama-cpp-python 0.3.36's sdist (pip download --no-binary :all: --no-deps
# llama-cpp-python==0.3.36, 76 MB; the same source as build_llama's CUDA build) with only what a
# Vulkan + CPU build of llama-bench on x86_64 configures and compiles: no models, docs, examples,
# tests, server/UI, other ggml backends, other CPU architectures, media files, or tools/mtmd's
# audio header (the archive is 3 MB).
# The debs: glslc, libshaderc1, libvulkan-dev and spirv-headers from Debian sid (glslc 2026.4 compiles
# every shader extension llama.cpp tests for, GL_NV_cooperative_matrix2 included; it needs glibc
# 2.38, e.g. Ubuntu 24.04), libvulkan1 1.3.239 from Debian 12 (the loader the webgpu backend uses),
# and in .vk/fallback/ glslc + libshaderc1 2023.2 from Debian 12 (glibc 2.34; none of those
# extensions). Package lists go to /tmp/apt-*, nothing is installed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT

sdist=${1:-}
if [ -z "$sdist" ]; then
  python3 -m pip download -q --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d "$T"
  sdist=$T/llama_cpp_python-0.3.36.tar.gz
fi
tar xzf "$sdist" -C "$T"
S=$T/llama_cpp_python-0.3.36
D=$T/trim/llama_cpp_python-0.3.36
L=$D/vendor/llama.cpp
mkdir -p "$D/vendor"
cp "$S/LICENSE.md" "$D/"
cp -a "$S/vendor/llama.cpp" "$D/vendor/"
# not configured with LLAMA_BUILD_{TESTS,EXAMPLES,SERVER,APP}=OFF; models, docs, Python, CI
rm -rf "$L"/{models,docs,examples,pocs,tests,app,benches,media,gguf-py,conversion,scripts,requirements,grammars,ci,skills,.devops,.github}
rm -f "$L"/*.py "$L"/*.nix "$L"/*.toml "$L"/*.ini "$L"/*.sh "$L"/Makefile "$L"/CMakePresets.json "$L"/CODEOWNERS
# tools/ added only with LLAMA_BUILD_SERVER, GGML_RPC or GGML_METAL
rm -rf "$L"/tools/{server,ui,cli,rpc,tuning}
for b in blas cann cuda et hexagon hip metal musa opencl openvino rpc sycl virtgpu webgpu zdnn zendnn; do
  rm -rf "$L/ggml/src/ggml-$b"
done
# x86_64 only; media and test data of tools/; the audio input of tools/mtmd (not llama-bench's; 4 MB)
rm -rf "$L"/ggml/src/ggml-cpu/arch/{arm,loongarch,powerpc,riscv,s390,wasm} "$L"/ggml/src/ggml-cpu/{spacemit,kleidiai}
find "$L/tools" -type f \( -name '*.jpeg' -o -name '*.jpg' -o -name '*.png' -o -name '*.mp3' -o -name '*.mp4' -o -name '*.wav' \) -delete
rm -f "$L/vendor/miniaudio/miniaudio.h"
find "$D" -name '*.md' ! -name README.md ! -name LICENSE.md -delete
find "$D" -name '.git*' -prune -exec rm -rf {} +
mkdir -p "$ROOT/.llama"
tar -C "$T/trim" -cf - llama_cpp_python-0.3.36 | gzip -9 >"$ROOT/.llama/llama_vk.tar.gz"

# apt-get download PKG... from SUITE into DIR, with its own package lists (amd64)
fetch() {
  local suite=$1 dir=$2 lists=/tmp/apt-$1
  shift 2
  mkdir -p "$lists/lists/partial" "$lists/cache/archives/partial" "$dir"
  echo "deb http://deb.debian.org/debian $suite main" >"$lists/sources.list"
  local o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists="$lists/lists"
           -oDir::Etc::SourceList="$lists/sources.list" -oDir::Etc::SourceParts=/nonexistent -oDir::Cache="$lists/cache")
  apt-get "${o[@]}" -qq update
  (cd "$dir" && apt-get "${o[@]}" -qq download "$@")
}
rm -rf "$ROOT/.vk"
fetch sid "$ROOT/.vk" glslc libshaderc1 libvulkan-dev spirv-headers
fetch bookworm "$ROOT/.vk" libvulkan1
fetch bookworm "$ROOT/.vk/fallback" glslc libshaderc1
ls -la "$ROOT/.llama/llama_vk.tar.gz" "$ROOT/.vk" "$ROOT/.vk/fallback"
