#!/usr/bin/env bash
# 2026-11-27 (3): skinny GEMM probe: a wider grid at M=16 on 8B Q4_0 shapes, and ncu on the tuner's pick.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$W/site
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
echo "ncu: $NCU"
ts ncu
CFG='{"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "SPLIT_K": 4}'
timeout 200 $NCU --clock-control none -k regex:_gemm_kernel -s 5 -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section InstructionStats \
  python3 benchmarks/skinny_probe.py --shapes gate_up --fmts Q4_0 --ncu "$CFG" > $R/ncu_gate_up.txt 2>&1; echo "rc=$?"
grep -E "Throughput|Duration|Stall|Occupancy|Issued|Eligible|Registers|Shared Memory|Warp Cycles|Bank|Executed Ipc|L2 Hit|L1/TEX Hit" $R/ncu_gate_up.txt | head -60
ts sweep
timeout 330 python3 benchmarks/skinny_probe.py --quick --shapes gate_up,down --fmts Q4_0 --json $R/probe.json > $R/probe.txt 2>&1; echo "rc=$?"
grep -v skip $R/probe.txt | tail -30
ts done; touch $W/driver.done
