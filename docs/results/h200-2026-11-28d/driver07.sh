ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONUNBUFFERED=1 EDGELLM_PDL=0
export PYTHONPATH=$ROOT:$W/site:$W/lpy
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
date
timeout 150 python3 benchmarks/gemm_stress.py --skinny --only Q4_0,Q4_K,Q6_K,Q4_K+Q6_K > $R/stress_k256.txt 2>&1; tail -3 $R/stress_k256.txt
date
timeout 200 python3 benchmarks/bench_rows.py --model llama-3.1-8b:Q4_K_M --rows 16 32 --profile 16 > $R/rows_k256.txt 2>&1
grep -E "^rows|check|profile|us  x" $R/rows_k256.txt | head -16
date
