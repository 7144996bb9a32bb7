#!/usr/bin/env bash
# 2026-11-27 (26): the streamed products' staging change, GPU tests only.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
$S setup > /dev/null
export PYTHONPATH=$ROOT:$W/site EDGELLM_CACHE_DIR=$W/cache TRITON_CACHE_DIR=$W/tc
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_hetero_executor.py tests/test_cpu_native.py > $R/gpu_tests.txt 2>&1; tail -3 $R/gpu_tests.txt
touch $W/driver.done
