# next GPU session, on branch wip/rows-attention-rope: A/B of the attention-side fusions at 16/32 rows
ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONUNBUFFERED=1 EDGELLM_PDL=0
export PYTHONPATH=$ROOT:$W/site:$W/lpy
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
setsid nohup bash benchmarks/gpu_session.sh build_llama > $R/build_llama.txt 2>&1 < /dev/null &
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_rows.py -k "attention_rows or rope or slot_pool or scheduler" > $R/tests.txt 2>&1; tail -2 $R/tests.txt
run() { tag=$1; shift; env "$@" timeout 200 python3 benchmarks/bench_rows.py --model llama-3.1-8b:Q4_K_M --rows 16 32 --lens 250 500 $PROF > $R/rows_$tag.txt 2>&1
  grep -E "^rows|check|profile|us  x" $R/rows_$tag.txt | sed "s/^/$tag /" | head -16; }
PROF="--profile 16"
run base_a EDGELLM_ROWS_ROPE_IN_ATTENTION=0 EDGELLM_ROWS_ATTN_COMBINE=0 EDGELLM_SKINNY_GLU=0
run rope_a EDGELLM_ROWS_ROPE_IN_ATTENTION=1 EDGELLM_ROWS_ATTN_COMBINE=1
run k128_a EDGELLM_ROWS_ATTN_KEYS=128 EDGELLM_ROWS_ATTN_PER_SM=4
PROF=""
run base_b EDGELLM_ROWS_ROPE_IN_ATTENTION=0 EDGELLM_ROWS_ATTN_COMBINE=0 EDGELLM_SKINNY_GLU=0
run rope_b EDGELLM_ROWS_ROPE_IN_ATTENTION=1
run k128_b EDGELLM_ROWS_ATTN_KEYS=128 EDGELLM_ROWS_ATTN_PER_SM=4
run k256 EDGELLM_ROWS_ATTN_KEYS=256 EDGELLM_ROWS_ATTN_PER_SM=4
run noglu_a EDGELLM_SKINNY_GLU=0
run glu_b EDGELLM_SKINNY_GLU=1
run noglu_b EDGELLM_SKINNY_GLU=0
bash benchmarks/gpu_session.sh wait_llama 300 | tail -1
# then the server with the best variant's env: gpu_session.sh serve 8b:Q4_K_M --tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16 32
