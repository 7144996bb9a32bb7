#!/usr/bin/env bash
# 2026-11-27 (28): native decode step in the split's CPU segments (decode_rows), profiler reading the step's timers.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$ROOT:$W/site
ts build; ($S build_llama > $R/build.log 2>&1; touch $W/build.done) &
export EDGELLM_CACHE_DIR=$W/cache TRITON_CACHE_DIR=$W/tc
ts tests; timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_cpu_step.py tests/test_cpu_native.py tests/test_hetero_executor.py tests/test_hetero_profile.py > $R/gpu_tests.txt 2>&1; tail -3 $R/gpu_tests.txt
ts build_wait; while [ ! -e $W/build.done ]; do sleep 3; done; tail -1 $R/build.log
ts bench; timeout 1200 python3 benchmarks/bench_hetero_gpu.py --llama-bench $W/lb/bin/llama-bench --caps 6,4 -p 512 -n 64 -r 2 --model-dir $W/models > $R/hetero.txt 2>&1; grep -v placement $R/hetero.txt | tail -16
ts bench_step_off; EDGELLM_NATIVE_STEP=0 timeout 600 python3 benchmarks/bench_hetero_gpu.py --caps 6,4 -p 512 -n 64 -r 2 --model-dir $W/models > $R/hetero_step_off.txt 2>&1; grep -v placement $R/hetero_step_off.txt | tail -12
ts done; touch $W/driver.done
