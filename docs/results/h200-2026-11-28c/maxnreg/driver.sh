#!/bin/bash
# register caps on the skinny GEMM (occupancy 4 -> 5-8 programs an SM): skinny_probe, baseline first
set -x
ROOT=$(cd "$(dirname "$0")/.." && pwd); W=/tmp/gpu-session; R=$W/res; mkdir -p $R
cd $ROOT
export OUT=$R PYTHONUNBUFFERED=1 EDGELLM_PDL=0 PYTHONPATH=$ROOT:$W/site:$W/lpy EDGELLM_CACHE_DIR=$W/cache
bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
B='"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3'
C="[{$B, \"BLOCK_K\": 128, \"SPLIT_K\": 4}, {$B, \"BLOCK_K\": 128, \"SPLIT_K\": 4, \"maxnreg\": 96}, {$B, \"BLOCK_K\": 128, \"SPLIT_K\": 4, \"maxnreg\": 80}, {$B, \"BLOCK_K\": 128, \"SPLIT_K\": 4, \"maxnreg\": 64}, {$B, \"BLOCK_K\": 64, \"SPLIT_K\": 4, \"maxnreg\": 80}, {$B, \"BLOCK_K\": 128, \"SPLIT_K\": 8, \"maxnreg\": 80}]"
timeout 100 python3 benchmarks/skinny_probe.py --fmts Q4_K --shapes gate_up,down --M 16 --configs "$C" > $R/probe_q4k.txt 2>&1
timeout 60 python3 benchmarks/skinny_probe.py --fmts Q4_0 --shapes gate_up --M 16 --configs "$C" > $R/probe_q40.txt 2>&1
cat $R/probe_q4k.txt $R/probe_q40.txt | grep -v skip
touch $W/driver.done
