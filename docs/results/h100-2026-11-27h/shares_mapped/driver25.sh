#!/usr/bin/env bash
# 2026-11-27 (25): decode shares with x read by a kernel from pinned memory (upload_fp16).
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$ROOT:$W/site EDGELLM_CACHE_DIR=$W/cache TRITON_CACHE_DIR=$W/tc
ts tests; timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_hetero_executor.py -k "stream or split or upload" > $R/gpu_tests.txt 2>&1; tail -2 $R/gpu_tests.txt
ts shares_mapped; EDGELLM_STREAM_DECODE=1 timeout 700 python3 benchmarks/bench_hetero_gpu.py --caps 6,4 -p 512 -n 64 -r 2 --model-dir $W/models > $R/shares_mapped.txt 2>&1; grep -v placement $R/shares_mapped.txt | tail -14
ts done; touch $W/driver.done
