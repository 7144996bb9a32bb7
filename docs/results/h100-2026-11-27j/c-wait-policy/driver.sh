#!/usr/bin/env bash
# 2026-11-27 (31): one profile, three OpenMP wait settings at 6 GiB (same placement).
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$ROOT:$W/site
if [ ! -x $W/lb/bin/llama-bench ]; then ts build; $S build_llama > $R/build.log 2>&1; tail -1 $R/build.log; fi
export EDGELLM_CACHE_DIR=$W/cache TRITON_CACHE_DIR=$W/tc
B="python3 benchmarks/bench_hetero_gpu.py -p 512 -n 64 -r 2 --model-dir $W/models --caps 6"
ts default; timeout 500 $B --llama-bench $W/lb/bin/llama-bench > $R/w_default.txt 2>&1; grep -v placement $R/w_default.txt | grep -v "^|---\|^$" | tail -9
ts active; OMP_WAIT_POLICY=ACTIVE timeout 300 $B --reuse-profile > $R/w_active.txt 2>&1; grep -v placement $R/w_active.txt | grep "unsync\|^| 6\|cap 6"
ts spin20M; GOMP_SPINCOUNT=20000000 timeout 300 $B --reuse-profile > $R/w_spin.txt 2>&1; grep -v placement $R/w_spin.txt | grep "unsync\|^| 6\|cap 6"
ts default2; timeout 300 $B --reuse-profile > $R/w_default2.txt 2>&1; grep -v placement $R/w_default2.txt | grep "unsync\|^| 6\|cap 6"
ts done; touch $W/driver.done
