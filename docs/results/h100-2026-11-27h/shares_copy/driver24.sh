#!/usr/bin/env bash
# 2026-11-27 (24): decode shares with x read by a kernel from pinned memory (not queued behind weight copies).
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$ROOT:$W/site EDGELLM_CACHE_DIR=$W/cache TRITON_CACHE_DIR=$W/tc
ts mapped_check; timeout 120 python3 -c "
import torch
from edgellm.backends.cuda.backend import _kernels
K=_kernels(); h=torch.randn(3,4096).pin_memory(); d=torch.empty(3,4096,dtype=torch.float16,device='cuda')
K.unary(h,'scale',1.0,out=d); torch.cuda.synchronize(); print('mapped read ok', bool((d.cpu()==h.half()).all()))
" 2>&1 | tail -2
ts tests; timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_hetero_executor.py -k "stream or split" > $R/gpu_tests.txt 2>&1; tail -2 $R/gpu_tests.txt
ts shares_mapped; EDGELLM_STREAM_DECODE=1 timeout 700 python3 benchmarks/bench_hetero_gpu.py --caps 6,4 -p 512 -n 64 -r 2 --model-dir $W/models > $R/shares_mapped.txt 2>&1; grep -v placement $R/shares_mapped.txt | tail -14
ts shares_copy_small; EDGELLM_STREAM_DECODE=1 EDGELLM_STREAM_X=copy EDGELLM_STREAM_PIECE_MB=8 EDGELLM_STREAM_SLOTS=12 timeout 400 python3 benchmarks/bench_hetero_gpu.py --caps 6 -p 512 -n 64 -r 1 --model-dir $W/models > $R/shares_copy_small.txt 2>&1; grep -v placement $R/shares_copy_small.txt | tail -8
ts done; touch $W/driver.done
