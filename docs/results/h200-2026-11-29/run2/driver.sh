# nibble asm A/B (GEMM 4-bit dequant through packed PTX) + capture fix, on wip/rows-attention-rope
ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONUNBUFFERED=1 EDGELLM_PDL=0
export PYTHONPATH=$ROOT:$W/site:$W/lpy
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
setsid nohup nice -n 19 bash benchmarks/gpu_session.sh build_llama > $R/build_llama.txt 2>&1 < /dev/null &
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "linear or gemm or glu" > $R/tests_lin.txt 2>&1; tail -2 $R/tests_lin.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_rows.py > $R/tests_rows.txt 2>&1; tail -2 $R/tests_rows.txt
run() { tag=$1; shift; env EDGELLM_CACHE_DIR=$W/cache_$1 "$@" timeout 200 python3 benchmarks/bench_rows.py --model llama-3.1-8b:Q4_K_M --rows 16 32 --lens 250 500 $PROF > $R/rows_$tag.txt 2>&1
  grep -E "^rows|check|profile|us  x" $R/rows_$tag.txt | sed "s/^/$tag /" | head -16; }
PROF="--profile 16"
run noasm_a EDGELLM_NIBBLE_ASM=0
run asm_a EDGELLM_NIBBLE_ASM=1
PROF=""
run noasm_b EDGELLM_NIBBLE_ASM=0
run asm_b EDGELLM_NIBBLE_ASM=1
run asmk128_a EDGELLM_NIBBLE_ASM=1 EDGELLM_ROWS_ATTN_KEYS=128 EDGELLM_ROWS_ATTN_PER_SM=4
run asmk128_b EDGELLM_NIBBLE_ASM=1 EDGELLM_ROWS_ATTN_KEYS=128 EDGELLM_ROWS_ATTN_PER_SM=4
bash benchmarks/gpu_session.sh wait_llama 300 | tail -1
EDGELLM_ROWS_ATTN_KEYS=128 EDGELLM_ROWS_ATTN_PER_SM=4 EDGELLM_CACHE_DIR=$W/cache_EDGELLM_NIBBLE_ASM=1 timeout 400 bash benchmarks/gpu_session.sh serve 8b:Q4_K_M --tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16 32 2>&1 | tail -25
