ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONUNBUFFERED=1 EDGELLM_PDL=0
export PYTHONPATH=$ROOT:$W/site:$W/lpy
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
date
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
timeout 120 "$ncu" --clock-control none -k regex:_gemm_kernel -s 5 -c 1 --section SpeedOfLight --section Occupancy \
  --section SchedulerStats --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
  python3 benchmarks/skinny_probe.py --shapes gate_up --fmts Q4_K --ncu '{"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "SPLIT_K": 4}' > $R/ncu_q4k_joined.txt 2>&1
date
timeout 240 python3 benchmarks/bench_rows.py --model llama-3.1-8b:Q4_K_M --rows 16 32 --profile 16 > $R/rows_profile.txt 2>&1
grep -E "^rows|check|profile|us  x" $R/rows_profile.txt | head -24
date
timeout 300 bash benchmarks/gpu_session.sh serve 8b:Q4_K_M --tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16 32 > $R/serve.log 2>&1
tail -25 $R/serve.log
date
