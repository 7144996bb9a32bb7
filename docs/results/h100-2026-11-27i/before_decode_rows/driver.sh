#!/usr/bin/env bash
# 2026-11-27 (27): cpu-fast decode step as one native call: GPU-host tests, CPU step profile, bench vs llama-bench -ngl, A/B at 6 GiB.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$ROOT:$W/site
ts build; ($S build_llama > $R/build.log 2>&1; touch $W/build.done) &
export EDGELLM_CACHE_DIR=$W/cache TRITON_CACHE_DIR=$W/tc
lscpu | grep -i "model name"; nvidia-smi --query-gpu=name --format=csv,noheader
ts tests; timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_cpu_step.py tests/test_cpu_native.py tests/test_hetero_executor.py > $R/gpu_tests.txt 2>&1; tail -3 $R/gpu_tests.txt
ts build_wait; while [ ! -e $W/build.done ]; do sleep 3; done; tail -2 $R/build.log; ls $W/lb/bin | head -3
ts profile; timeout 120 python3 benchmarks/profile_cpu_step.py > $R/profile_cpu_step.txt 2>&1; tail -14 $R/profile_cpu_step.txt
ts bench; timeout 1200 python3 benchmarks/bench_hetero_gpu.py --llama-bench $W/lb/bin/llama-bench --caps 6,4 -p 512 -n 64 -r 2 --model-dir $W/models > $R/hetero.txt 2>&1; tail -30 $R/hetero.txt
ts bench_step_off; EDGELLM_NATIVE_STEP=0 timeout 600 python3 benchmarks/bench_hetero_gpu.py --caps 6,4 -p 512 -n 64 -r 2 --model-dir $W/models > $R/hetero_step_off.txt 2>&1; tail -14 $R/hetero_step_off.txt
ts done; touch $W/driver.done
