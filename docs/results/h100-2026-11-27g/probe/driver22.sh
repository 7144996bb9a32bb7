#!/usr/bin/env bash
# 2026-11-27 (22): native Q8_0 kernel variants x memory kinds x threads on the H100 host (nothing else running).
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$ROOT:$W/site EDGELLM_CACHE_DIR=$W/cache
cat /sys/kernel/mm/transparent_hugepage/enabled
ts probe; timeout 400 python3 benchmarks/native_probe.py --threads 16,12,8 --json $R/native_probe.json 2>&1 | tee $R/native_probe.txt
ts host_probe; timeout 200 python3 benchmarks/host_probe.py --json $R/host_probe.json > $R/host_probe.txt 2>&1; grep "GBs" $R/host_probe.txt
ts done; touch $W/driver.done
