# next GPU session (main): check the element-wise six-bit PTX (EDGELLM_SIX_ASM=1), A/B it, serve 8B Q4_K_M with it
ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONUNBUFFERED=1 EDGELLM_PDL=0
export PYTHONPATH=$ROOT:$W/site:$W/lpy
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
setsid nohup nice -n 19 bash benchmarks/gpu_session.sh build_llama > $R/build_llama.txt 2>&1 < /dev/null &
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "six_bit or kquants or prefill or skinny" > $R/tests_lin.txt 2>&1; tail -2 $R/tests_lin.txt
grep -E "^FAILED" $R/tests_lin.txt | head -5
EDGELLM_SIX_ASM=1 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "six_bit or kquants" > $R/tests_six_on.txt 2>&1; tail -1 $R/tests_six_on.txt
run() { tag=$1; shift; env EDGELLM_CACHE_DIR=$W/cache_$1 "$@" timeout 200 python3 benchmarks/bench_rows.py --model llama-3.1-8b:Q4_K_M --rows 16 32 --lens 250 500 $PROF > $R/rows_$tag.txt 2>&1
  grep -E "^rows|check|profile|us  x" $R/rows_$tag.txt | sed "s/^/$tag /" | head -16; }
PROF="--profile 16"
run six1_a EDGELLM_SIX_ASM=1
run six0_a EDGELLM_SIX_ASM=0
PROF=""
run six1_b EDGELLM_SIX_ASM=1
run six0_b EDGELLM_SIX_ASM=0
bash benchmarks/gpu_session.sh wait_llama 400 | tail -1
for six in 1 0; do
  EDGELLM_SIX_ASM=$six EDGELLM_CACHE_DIR=$W/cache_EDGELLM_SIX_ASM=$six timeout 300 bash benchmarks/gpu_session.sh serve 8b:Q4_K_M --tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16 32 2>&1 | tail -9
  mv $R/serve_8b_Q4_K_M.json $R/serve_8b_Q4_K_M_six$six.json; mv $R/serve_8b_Q4_K_M.txt $R/serve_8b_Q4_K_M_six$six.txt
done
