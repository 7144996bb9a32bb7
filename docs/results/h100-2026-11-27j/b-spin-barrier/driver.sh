#!/usr/bin/env bash
# 2026-11-27 (30): the step's own spin barrier; split 8B Q8_0 at 6 and 4 GiB against llama.cpp.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$ROOT:$W/site
if [ ! -x $W/lb/bin/llama-bench ]; then ts build; $S build_llama > $R/build.log 2>&1; tail -1 $R/build.log; fi
export EDGELLM_CACHE_DIR=$W/cache TRITON_CACHE_DIR=$W/tc
ts tests; timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cpu_step.py tests/test_cpu_native.py tests/test_hetero_executor.py > $R/gpu_tests.txt 2>&1; tail -2 $R/gpu_tests.txt
B="python3 benchmarks/bench_hetero_gpu.py -p 512 -n 64 -r 2 --model-dir $W/models"
ts bench; timeout 900 $B --llama-bench $W/lb/bin/llama-bench --caps 6,4 > $R/hetero.txt 2>&1; grep -v placement $R/hetero.txt | tail -24
ts omp_active; OMP_WAIT_POLICY=ACTIVE timeout 400 $B --caps 6 > $R/hetero_omp_active.txt 2>&1; grep -v placement $R/hetero_omp_active.txt | tail -9
ts done; touch $W/driver.done
