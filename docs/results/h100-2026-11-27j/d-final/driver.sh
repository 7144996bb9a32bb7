#!/usr/bin/env bash
# 2026-11-27 (32): GOMP_SPINCOUNT default from edgellm; split 8B Q8_0 at 6 and 4 GiB against llama.cpp, profiled in process.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$ROOT:$W/site
if [ ! -x $W/lb/bin/llama-bench ]; then ts build; $S build_llama > $R/build.log 2>&1; tail -1 $R/build.log; fi
export EDGELLM_CACHE_DIR=$W/cache TRITON_CACHE_DIR=$W/tc
B="python3 benchmarks/bench_hetero_gpu.py -p 512 -n 64 -r 2 --model-dir $W/models"
ts bench; timeout 900 $B --llama-bench $W/lb/bin/llama-bench --caps 6,4 > $R/hetero.txt 2>&1; grep -v placement $R/hetero.txt | grep -v "^$" | tail -24
ts done; touch $W/driver.done
