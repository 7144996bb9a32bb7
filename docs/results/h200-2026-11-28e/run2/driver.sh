ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONUNBUFFERED=1 EDGELLM_PDL=0
export PYTHONPATH=$ROOT:$W/site:$W/lpy
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
cat $R/setup.txt; date
setsid nohup bash benchmarks/gpu_session.sh build_llama > $R/build_llama.txt 2>&1 < /dev/null &
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_rows.py -k "swiglu_in or split_over or split_norm or slot_pool or scheduler_on_cuda" > $R/tests.txt 2>&1; tail -3 $R/tests.txt
date
run() { # tag split glu model rows...
  tag=$1; sp=$2; glu=$3; m=$4; shift 4
  EDGELLM_ROWS_NORM_SPLIT=$sp EDGELLM_SKINNY_GLU=$glu timeout 200 python3 benchmarks/bench_rows.py --model $m --rows "$@" > $R/rows_$tag.txt 2>&1
  grep -E "^rows|check|profile|us  x" $R/rows_$tag.txt | sed "s/^/$tag /" | head -24
}
run 8b_both_a 1 1 llama-3.1-8b:Q4_K_M 16 32 --profile 16
run 8b_none_a 0 0 llama-3.1-8b:Q4_K_M 16 32
run 8b_split 1 0 llama-3.1-8b:Q4_K_M 16 32
run 8b_glu 0 1 llama-3.1-8b:Q4_K_M 16 32
run 8b_both_b 1 1 llama-3.1-8b:Q4_K_M 16 32
run 8b_none_b 0 0 llama-3.1-8b:Q4_K_M 16 32
run 1b_both 1 1 llama-3.2-1b:Q4_0 16 32
run 1b_none 0 0 llama-3.2-1b:Q4_0 16 32
date
bash benchmarks/gpu_session.sh wait_llama 300 | tail -2
timeout 300 bash benchmarks/gpu_session.sh serve 8b:Q4_K_M --tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16 32 > /dev/null 2>&1
tail -12 $R/serve_8b_Q4_K_M.txt
date
