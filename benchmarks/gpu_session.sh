#!/usr/bin/env bash
# One GPU session's measurements on a lent H100/H200 (the device tool), as steps that fit its
# 10-minute calls: bash benchmarks/gpu_session.sh STEP [ARGS...]. State lives in /tmp/gpu-session
# (GPU_SESSION_DIR), which survives between calls while the machine stays warm.
#
# Carried into the call (ignored by git; `bash benchmarks/prepare_gpu_carry.sh` makes both): .whl/
# (wheels the image lacks: gguf, tokenizers, rich, the serving stack, wgpu, and diskcache, which
# llama-cpp-python imports) and
# .llama/llama_trim.tar.gz (llama-cpp-python 0.3.36's sdist without the vendored llama.cpp's
# models/, docs/, examples/ and backends other than CUDA/CPU: 6 MB instead of 76 MB).
# For build_llama_vk also (both made by benchmarks/prepare_llama_vk.sh): .llama/llama_vk.tar.gz
# (the same sdist kept for a Vulkan + CPU build on x86_64: no other backends or CPU architectures,
# no media, no tools/mtmd audio header; 3 MB) and
# .vk/*.deb, the Vulkan build tools unpacked into $W/vk (not into /): glslc + libshaderc1 2026.4,
# libvulkan-dev 1.4.363 (headers), spirv-headers 1.4.363 (Debian sid; glslc needs glibc >= 2.38),
# libvulkan1 1.3.239 (the loader the webgpu backend uses too, from .gl/); .vk/fallback/ holds
# glslc 2023.2 (Debian 12, glibc >= 2.34) for an older image: its build lacks llama.cpp's
# cooperative-matrix and integer-dot shaders, so its prefill is not llama.cpp's best.
#
#   setup                 install the carried wheels
#   build_llama           llama.cpp CUDA (sm_90, with PyTorch's NCCL for -sm tensor): llama-bench and
#                         libllama.so; the Python bindings of the same sdist load that library (run
#                         it under setsid: about 5 min)
#   wait_llama [SECONDS]  wait for build_llama
#   build_llama_vk        llama.cpp Vulkan (GGML_VULKAN=ON, GGML_CUDA=OFF): llama-bench and llama-quantize, static
#                         but for the loader, into $W/lbvk, make -j$JOBS (16); prints which shader
#                         extensions glslc supports (GL_NV_cooperative_matrix2 expected). Run it under
#                         setsid: 10.5 min at -j2 on 2 CPU cores, so a few minutes on 16
#   wait_llama_vk [SECONDS]  wait for build_llama_vk, then list the Vulkan devices llama-bench sees
#                         (needs the .gl/ debs unpacked into / as for the webgpu backend). Run it as
#                         VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json \
#                           /tmp/gpu-session/lbvk/bin/llama-bench -m FILE.gguf -ngl 99 -fa 1 -p 512 -n 128
#                         or through benchmarks/bench_webgpu.py --llama-bench (same files, same run)
#   build_llama_py        llama-cpp-python itself with CUDA, as a user installs it
#                         (CMAKE_ARGS=-DGGML_CUDA=on pip install), into the session's site folder
#                         (run it under setsid: about 5 min); wait_llama_py [SECONDS] waits for it
#   llama_check           load + evaluate a 1B-shape Q4_0 model through the bindings, with llama_cpp
#                         imported first, after numpy + torch, and after edgellm (which import order
#                         crashes, if any)
#   models NAME:FMT,...   write synthetic models (edgellm.synthetic presets) into the session folder
#   tests                 the cuda backend's kernel and whole-model tests on the GPU
#   vs NAME:FMT,... [bench_vs_llamacpp options]   edgellm cuda vs llama-bench on those models
#   table13 [bench_webgpu options]  issue 13's table in one run (after build_llama_vk): webgpu, edgellm
#                         cuda and llama.cpp Vulkan on the nine synthetic files and 1B/8B Q4_K_M (made
#                         by the Vulkan build's llama-quantize); $OUT/table13*. 15-25 min on an H200:
#                         run it under setsid and poll
#   table17 [bench_vs_llamacpp options]  issue 17's table in one run (after build_llama): the nine
#                         synthetic files (135M, 1B, 8B x F16, Q8_0, Q4_0), then 1B and 8B Q4_K_M
#                         made by the build's llama-quantize from the F16 files; JSON in
#                         $OUT/table17*.json. 15-20 min on an H100: run it under setsid and poll
#   start [bench_start options]  time to load and to first token, cold and warm: edgellm cuda
#                         (and llama.cpp CUDA when build_llama_py has finished) on the default model
#                         and synthetic files (benchmarks/bench_start.py; issue 14's table)
#   serve NAME:FMT [bench_serve options]  edgellm serve --backend cuda under N = 1, 4, 16, 32 streaming
#                         clients, edgellm's single-stream decode and llama-batched-bench (from build_llama)
#                         on the same synthetic file, one table (benchmarks/bench_serve.py; issue 15)
#   serve15 [bench_serve options]  issue 15's table in one run (after build_llama): `serve` on 8B and
#                         1B, Q4_0 and Q4_K_M (--tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16
#                         32 unless given), then benchmarks/serve_table.py over the four JSON files
#                         ($OUT/serve15.md: ratios and targets); four serve runs of 1.5-2 min each
#                         on an H200; start build_llama first (setsid), write the models meanwhile
#   skinny_ncu [FMT] [SHAPE] [CFG_JSON]  Nsight Compute on one skinny product at 16 rows (skinny_probe.py
#                         --ncu; default Q4_K gate_up, the 128 x 128 x 128 split-4 tile): speed of light,
#                         occupancy, scheduler and warp state with every stall reason, source counters
#                         (where the stalls sit); $OUT/ncu_FMT_SHAPE.txt
#   sampling [NAME:FMT] [BACKEND]  token choice on the device (benchmarks/bench_sampling.py): the cuda
#                         kernels' device times (--kernels), then the decode loop on a synthetic file
#                         with a 128k text vocabulary (default 1b:Q4_0) per sampling mode, drawn on the
#                         GPU and on the host; BACKEND cuda (default) or webgpu (needs the .gl/ debs
#                         unpacked into / and VK_DRIVER_FILES, as for the webgpu backend)
#   bench_1b              edgellm bench: the Llama-3.2-1B shape in q4_0 and q8_0, edgellm cuda vs
#                         llama.cpp CUDA (llama-cpp-python from build_llama_py) vs transformers
#                         (issue 5's GPU report)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=${GPU_SESSION_DIR:-/tmp/gpu-session}
OUT=${OUT:-$W/out}
mkdir -p "$W/models" "$OUT"
export PYTHONPATH="$ROOT:$W/site:$W/lpy"
export PYTHONUNBUFFERED=1

model_path() { echo "$W/models/${1%%:*}-${1##*:}.gguf"; }
preset_of() { case "$1" in 135m) echo smollm2-135m;; 1b) echo llama-3.2-1b;; 8b) echo llama-3.1-8b;; *) echo "$1";; esac; }

# wait_done FLAG SECONDS LOG...: wait for a background build's done-flag, or show its logs' tails
wait_done() {
  local flag=$1 secs=$2
  shift 2
  for _ in $(seq "$secs"); do [ -e "$flag" ] && return 0; sleep 1; done
  echo "build not done: no $flag"; tail -5 "$@" 2>/dev/null; exit 1
}

step=${1:?step}
shift
case "$step" in
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" "$ROOT"/.whl/*.whl
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  ;;
build_llama)
  rm -f "$W/llama.done"
  tar xzf "$ROOT/.llama/llama_trim.tar.gz" -C "$W"
  S=$W/llama_cpp_python-0.3.36
  # NCCL for llama.cpp's all_reduce (-sm tensor, its tensor parallelism): the headers and library
  # PyTorch's wheels ship, under the unversioned name CMake's find_library looks for
  NR=$W/nccl
  rm -rf "$NR"
  mkdir -p "$NR/lib"
  ND=$(python3 -c 'import glob, os, torch
base = os.path.dirname(os.path.dirname(torch.__file__))
hits = sorted(glob.glob(os.path.join(base, "nvidia", "**", "libnccl.so.2"), recursive=True))
print(os.path.dirname(os.path.dirname(hits[0])) if hits else "")' 2>/dev/null)
  if [ -n "$ND" ] && [ -e "$ND/include/nccl.h" ] && [ -e "$ND/lib/libnccl.so.2" ]; then
    ln -s "$ND/include" "$NR/include"
    ln -s "$ND/lib/libnccl.so.2" "$NR/lib/libnccl.so.2"
    ln -s "$ND/lib/libnccl.so.2" "$NR/lib/libnccl.so"
  fi
  cmake -S "$S/vendor/llama.cpp" -B "$W/lb" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DNCCL_ROOT="$NR" >"$W/cmake.log" 2>&1 || { tail -20 "$W/cmake.log"; exit 1; }
  grep -i "nccl" "$W/cmake.log" || echo "cmake said nothing of NCCL"
  cmake --build "$W/lb" -j"${JOBS:-16}" --target llama-bench llama-batched-bench llama-quantize llama >"$W/build.log" 2>&1 || { tail -30 "$W/build.log"; exit 1; }
  mkdir -p "$W/lpy/llama_cpp/lib"
  cp -r "$S/llama_cpp/." "$W/lpy/llama_cpp/"
  find "$W/lb" -name 'lib*.so*' -exec ln -sf {} "$W/lpy/llama_cpp/lib/" \;
  touch "$W/llama.done"
  ;;
wait_llama)
  wait_done "$W/llama.done" "${1:-400}" "$W/build.log" "$W/cmake.log"
  ls "$W/lb/bin"
  ;;
build_llama_vk)
  rm -f "$W/llama_vk.done"
  P=$W/vk
  lib=$P/usr/lib/x86_64-linux-gnu
  rm -rf "$P" "$W/vksrc" && mkdir -p "$P" "$W/vksrc"
  for d in "$ROOT"/.vk/*.deb; do dpkg -x "$d" "$P" || exit 1; done
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' "$lib" "$P/usr/bin/glslc" >"$P/glslc"
  chmod +x "$P/glslc"
  if ! "$P/glslc" --version >/dev/null 2>&1; then
    echo "glslc $(basename "$ROOT"/.vk/glslc_*.deb) does not run here: falling back to .vk/fallback (no cooperative-matrix shaders)"
    for d in "$ROOT"/.vk/fallback/*.deb; do dpkg -x "$d" "$P" || exit 1; done
  fi
  "$P/glslc" --version | head -3
  tar xzf "$ROOT/.llama/llama_vk.tar.gz" -C "$W/vksrc"
  cmake -S "$W/vksrc/llama_cpp_python-0.3.36/vendor/llama.cpp" -B "$W/lbvk" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_VULKAN=ON -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_PREFIX_PATH="$P/usr" \
    -DVulkan_INCLUDE_DIR="$P/usr/include" -DVulkan_LIBRARY="$lib/libvulkan.so" -DVulkan_GLSLC_EXECUTABLE="$P/glslc" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >"$W/cmake_vk.log" 2>&1 || { tail -20 "$W/cmake_vk.log"; exit 1; }
  grep 'by glslc' "$W/cmake_vk.log"
  cmake --build "$W/lbvk" -j"${JOBS:-16}" --target llama-bench llama-quantize >"$W/build_vk.log" 2>&1 || { tail -30 "$W/build_vk.log"; exit 1; }
  touch "$W/llama_vk.done"
  ;;
wait_llama_vk)
  wait_done "$W/llama_vk.done" "${1:-400}" "$W/build_vk.log" "$W/cmake_vk.log"
  VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json} \
    "$W/lbvk/bin/llama-bench" --list-devices
  ;;
build_llama_py)
  rm -f "$W/llama_py.done"
  tar xzf "$ROOT/.llama/llama_trim.tar.gz" -C "$W"
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=off -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" CMAKE_BUILD_PARALLEL_LEVEL=16 \
    python3 -m pip wheel -v --no-build-isolation --no-deps --no-index -w "$W/wheels" "$W/llama_cpp_python-0.3.36" \
    >"$W/pip_build.log" 2>&1 || { tail -30 "$W/pip_build.log"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$W/site" "$W"/wheels/llama_cpp_python-*.whl
  touch "$W/llama_py.done"
  ;;
wait_llama_py)
  wait_done "$W/llama_py.done" "${1:-400}" "$W/pip_build.log"
  ls "$W/site/llama_cpp/lib"
  ;;
llama_check)
  f=$W/models/llama-3.2-1b-Q4_0-vocab.gguf
  [ -e "$f" ] || python3 -c "import sys; from edgellm.synthetic import preset, write_synthetic_gguf, byte_bpe_vocab
write_synthetic_gguf(sys.argv[1], preset('llama-3.2-1b', weight_type='Q4_0'), byte_bpe_vocab(128256), fast=True)" "$f"
  for first in "" "import numpy, torch" "import edgellm.bench.worker"; do
    echo "== llama_cpp after: '${first:-nothing}'"
    PYTHONPATH="$W/site:$ROOT" timeout 120 python3 -X faulthandler -c "$first
import llama_cpp, time
t = time.perf_counter()
llm = llama_cpp.Llama(model_path='$f', n_ctx=640, n_batch=640, n_ubatch=512, n_gpu_layers=-1, seed=0, verbose=False)
llm.eval(list(range(1, 513)))
print('ok: gpu offload', llama_cpp.llama_supports_gpu_offload(), 'load+pp512', round(time.perf_counter() - t, 2), 's')
if not '$first':  # per decode token: llama_decode alone (as llama-bench tg), + argmax, via Llama.eval
    import numpy as np
    one, n = (llama_cpp.llama_token * 1)(), llm.n_vocab()
    def tg(read):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
        t = time.perf_counter()
        for i in range(128):
            one[0] = 600 + i
            llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(one, 1))
            llama_cpp.llama_synchronize(llm.ctx)
            if read: np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n,)).argmax()
        return (time.perf_counter() - t) / 128 * 1e3
    def ev():
        llm.reset(); t = time.perf_counter()
        for i in range(128): llm.eval([600 + i]); llama_cpp.llama_synchronize(llm.ctx)
        return (time.perf_counter() - t) / 128 * 1e3
    for name, f in (('decode', lambda: tg(False)), ('decode+argmax', lambda: tg(True)), ('Llama.eval', ev)):
        f(); print(f'{name}: {min(f() for _ in range(3)):.3f} ms/token')
" 2>&1 | tail -25
    echo "rc=${PIPESTATUS[0]}"
  done
  ;;
models)
  for item in ${1//,/ }; do
    python3 -c "import sys; from edgellm.synthetic import preset, write_synthetic_gguf as w
w(sys.argv[1], preset(sys.argv[2], weight_type=sys.argv[3]), fast=True)" \
      "$(model_path "$item")" "$(preset_of "${item%%:*}")" "${item##*:}" &
  done
  wait
  ls -la "$W/models"
  ;;
tests)
  python3 -m pytest -q -p no:cacheprovider "$ROOT/tests/test_cuda_kernels.py" "$ROOT/tests/test_cuda_backend.py" 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -8
  ;;
vs)
  models=()
  for item in ${1//,/ }; do models+=("$(model_path "$item")"); done
  shift
  python3 "$ROOT/benchmarks/bench_vs_llamacpp.py" --llama-bench "$W/lb/bin/llama-bench" "${models[@]}" "$@"
  ;;
table13)
  # issue 13's table in one run (after build_llama_vk; the .gl/ debs unpacked into / and
  # VK_DRIVER_FILES set, as for the webgpu backend): webgpu, edgellm cuda and llama.cpp's Vulkan
  # build on the nine synthetic files (135M, 1B, 8B x Q4_0, Q8_0, F16), then 1B and 8B Q4_K_M made by
  # the Vulkan build's llama-quantize from the F16 files; the default model's check first. Extra
  # arguments go to bench_webgpu.py (e.g. --set EDGELLM_WEBGPU_INT8=1). JSON and text in $OUT/table13*;
  # 15-25 min on an H200: run it under setsid and poll
  lbvk=$W/lbvk/bin
  python3 "$ROOT/benchmarks/bench_webgpu.py" --models smollm2-135m,llama-3.2-1b,llama-3.1-8b --formats Q4_0,Q8_0,F16 \
    --skip gemv,gemm -p 512 -n 128 -r 3 --bandwidth "${BANDWIDTH:-4.4e12}" --cuda --llama-bench "$lbvk/llama-bench" \
    --model-dir "$W/models" --json "$OUT/table13_plain.json" "$@" 2>&1 | tee "$OUT/table13_plain.txt"
  kq=()
  for name in llama-3.2-1b llama-3.1-8b; do
    f16=$W/models/$name-F16.gguf q=$W/models/$name-Q4_K_M.gguf
    [ -e "$q" ] || "$lbvk/llama-quantize" "$f16" "$q" Q4_K_M >"$OUT/quantize_$name.txt" 2>&1 || { tail -3 "$OUT/quantize_$name.txt"; continue; }
    kq+=(--file "$q")
  done
  python3 "$ROOT/benchmarks/bench_webgpu.py" --models "" --skip check,gemv,gemm -p 512 -n 128 -r 3 \
    --bandwidth "${BANDWIDTH:-4.4e12}" --cuda --llama-bench "$lbvk/llama-bench" "${kq[@]}" \
    --json "$OUT/table13_kquants.json" "$@" 2>&1 | tee "$OUT/table13_kquants.txt"
  ;;
table17)
  for part in "smollm2-135m,llama-3.2-1b,llama-3.1-8b F16,Q8_0,Q4_0 plain" "llama-3.2-1b,llama-3.1-8b Q4_K_M kquants"; do
    set -- $part "$@"
    python3 "$ROOT/benchmarks/bench_vs_llamacpp.py" --llama-bench "$W/lb/bin/llama-bench" \
      --llama-quantize "$W/lb/bin/llama-quantize" --synthetic "$1" --formats "$2" --model-dir "$W/models" \
      --json "$OUT/table17_$3.json" "${@:4}" | tee "$OUT/table17_$3.txt"
    shift 3
  done
  ;;
start)
  engines=edgellm
  [ -e "$W/llama_py.done" ] && engines=edgellm,llama.cpp
  python3 "$ROOT/benchmarks/bench_start.py" --backend cuda --engines "$engines" --model-dir "$W/models" \
    -o "$OUT/start_cuda.json" "$@"
  ;;
serve)
  item=${1:?NAME:FMT}
  shift
  lbb=()
  [ -x "$W/lb/bin/llama-batched-bench" ] && lbb=(--llama-batched-bench "$W/lb/bin/llama-batched-bench")
  python3 "$ROOT/benchmarks/bench_serve.py" --backend cuda --synthetic "$(preset_of "${item%%:*}"):${item##*:}" \
    --model-out "$W/models/${item%%:*}-${item##*:}-textvocab.gguf" --single "${lbb[@]}" \
    --json "$OUT/serve_${item%%:*}_${item##*:}.json" "$@" | tee "$OUT/serve_${item%%:*}_${item##*:}.txt"
  ;;
serve15)
  wait_done "$W/llama.done" 600 "$W/build.log" "$W/cmake.log"
  opts=("$@")
  [ ${#opts[@]} -gt 0 ] || opts=(--tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16 32)
  for item in 8b:Q4_0 8b:Q4_K_M 1b:Q4_0 1b:Q4_K_M; do
    bash "$0" serve "$item" "${opts[@]}" > /dev/null
  done
  python3 "$ROOT/benchmarks/serve_table.py" "$OUT"/serve_8b_Q4_0.json "$OUT"/serve_8b_Q4_K_M.json \
    "$OUT"/serve_1b_Q4_0.json "$OUT"/serve_1b_Q4_K_M.json --markdown "$OUT/serve15.md"
  ;;
skinny_ncu)
  fmt=${1:-Q4_K}
  shape=${2:-gate_up}
  cfg=${3:-'{"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "SPLIT_K": 4}'}
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
  [ -n "$ncu" ] || { echo "no ncu on this machine"; exit 1; }
  timeout 300 "$ncu" --clock-control none -k regex:_gemm_kernel -s 5 -c 1 --print-details all \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats \
    --section WarpStateStats --section SourceCounters --section InstructionStats --section LaunchStats \
    python3 "$ROOT/benchmarks/skinny_probe.py" --shapes "$shape" --fmts "$fmt" --ncu "$cfg" | tee "$OUT/ncu_${fmt}_$shape.txt"
  ;;
sampling)
  item=${1:-1b:Q4_0}
  be=${2:-cuda}
  f=$W/models/${item%%:*}-${item##*:}-textvocab.gguf
  python3 -c "import sys; sys.path.insert(0, '$ROOT/benchmarks'); from bench_serve import synthetic_model as s
s('$(preset_of "${item%%:*}"):${item##*:}', '$f')"
  [ "$be" = cuda ] && python3 "$ROOT/benchmarks/bench_sampling.py" --kernels --rows 1,16 | tee "$OUT/sampling_kernels.txt"
  python3 "$ROOT/benchmarks/bench_sampling.py" --decode -m "$f" --backend "$be" -r 2 --tokens 128 \
    | tee "$OUT/sampling_${item%%:*}_${item##*:}_$be.txt"
  ;;
bench_1b)
  f=$W/models/llama-3.2-1b-F16-vocab.gguf
  [ -e "$f" ] || python3 -c "import sys; from edgellm.synthetic import preset, write_synthetic_gguf, byte_bpe_vocab
write_synthetic_gguf(sys.argv[1], preset('llama-3.2-1b', weight_type='F16'), byte_bpe_vocab(128256), fast=True)" "$f"
  timeout -s TERM "${BENCH_SECONDS:-480}" python3 -m edgellm.bench "$f" --quant q4_0,q8_0 \
    --engine edgellm,llama.cpp,transformers --backend cuda -p 512 -n 128 -r 2 --no-ppl --timeout 150 \
    -o "$W/bench_1b_gpu" "$@"
  (cd "$W" && find bench_1b_gpu -name '*.md' -o -name '*.csv' -o -name '*.json' -o -name '*.png' -o -name '*.log' \
    | tar czf "$OUT/bench_1b_gpu.tar.gz" -T -)
  ;;
*)
  echo "unknown step $step" >&2
  exit 2
  ;;
esac
