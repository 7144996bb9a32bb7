#!/usr/bin/env bash
# 2026-11-27 (19): issue 18 streamed row splits (pieces): bench_hetero_gpu vs llama-bench -ngl, GPU tests.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$ROOT:$W/site
touch $W/build.done
export EDGELLM_CACHE_DIR=$W/cache TRITON_CACHE_DIR=$W/tc
ts models; mkdir -p $W/models; [ -e $W/models/llama-3.1-8b-Q8_0-2layers.gguf ] || timeout 200 python3 -c "
from dataclasses import replace
from edgellm.synthetic import preset, write_synthetic_gguf
s = preset('llama-3.1-8b', weight_type='Q8_0')
write_synthetic_gguf('$W/models/llama-3.1-8b-Q8_0.gguf', s, fast=True)
write_synthetic_gguf('$W/models/llama-3.1-8b-Q8_0-2layers.gguf', replace(s, n_layers=2), fast=True)
" 2>&1 | tail -2
ts tests; skip
ts build_wait; while [ ! -e $W/build.done ]; do sleep 3; done; tail -1 $R/build.log
ts bench; timeout 1500 python3 benchmarks/bench_hetero_gpu.py --caps ${CAPS:-6,4} -p 512 -n 64 -r 2 --model-dir $W/models > $R/hetero.txt 2>&1; grep -v "^{" $R/hetero.txt | tail -14
ts done; touch $W/driver.done
