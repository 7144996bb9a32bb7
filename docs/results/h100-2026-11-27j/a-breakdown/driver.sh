#!/usr/bin/env bash
# 2026-11-27 (29): split 8B Q8_0: decode step breakdown, GPU memory by phase, slots and OMP variants.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$ROOT:$W/site
ts build; ($S build_llama > $R/build.log 2>&1; touch $W/build.done) &
export EDGELLM_CACHE_DIR=$W/cache TRITON_CACHE_DIR=$W/tc
ts tests; timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_hetero_executor.py > $R/gpu_tests.txt 2>&1; tail -3 $R/gpu_tests.txt
nproc; lscpu | grep -i "model name\|numa node(s)\|socket"
ts build_wait; while [ ! -e $W/build.done ]; do sleep 3; done; tail -1 $R/build.log
B="python3 benchmarks/bench_hetero_gpu.py -p 512 -n 64 -r 2 --model-dir $W/models"
ts bench; timeout 900 $B --llama-bench $W/lb/bin/llama-bench --caps 6,4 > $R/hetero.txt 2>&1; grep -v placement $R/hetero.txt | tail -22
ts slots2; EDGELLM_STREAM_SLOTS=2 timeout 400 $B --caps 6 > $R/hetero_slots2.txt 2>&1; grep -v placement $R/hetero_slots2.txt | tail -10
ts omp_active; OMP_WAIT_POLICY=ACTIVE timeout 400 $B --caps 6 > $R/hetero_omp_active.txt 2>&1; grep -v placement $R/hetero_omp_active.txt | tail -10
ts done; touch $W/driver.done
