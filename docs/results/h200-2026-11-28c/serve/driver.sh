#!/bin/bash
# the six-bit shift table through the server: 8B Q4_K_M and Q4_0 (edgellm serve, PDL off) while llama.cpp
# builds, then llama-batched-bench on the same files with the same -npp/-ntg/-npl
set -x
ROOT=$(cd "$(dirname "$0")/.." && pwd); W=/tmp/gpu-session; R=$W/res; mkdir -p $R $W/models
cd $ROOT
export OUT=$R PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT:$W/site:$W/lpy
bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
(setsid bash benchmarks/gpu_session.sh build_llama > $R/build_llama.txt 2>&1 &)
for spec in 8b:llama-3.1-8b:Q4_K_M 8b:llama-3.1-8b:Q4_0; do
  IFS=: read short name fmt <<< "$spec"
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_serve import synthetic_model as s; s('$name:$fmt', '$W/models/$short-$fmt-textvocab.gguf')" > $R/model_${short}_$fmt.txt 2>&1 &
done
wait
for item in 8b:Q4_K_M 8b:Q4_0; do
  bash benchmarks/gpu_session.sh serve $item --tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16 32 > /dev/null 2>&1
done
bash benchmarks/gpu_session.sh wait_llama 400 > $R/wait_llama.txt 2>&1
for item in 8b:Q4_K_M 8b:Q4_0; do
  f=$W/models/${item%%:*}-${item##*:}-textvocab.gguf
  npp=$(grep -o 'prompt [0-9]* tokens' $R/serve_${item%%:*}_${item##*:}.txt | head -1 | awk '{print $2}')
  timeout 90 $W/lb/bin/llama-batched-bench -m $f -c $((32 * (npp + 512) + 64)) -b 2048 -ub 512 -ngl 99 \
    -npp $npp -ntg 512 -npl 1,16,32 --output-format jsonl > $R/llama_bb_${item%%:*}_${item##*:}.txt 2>&1
done
touch $W/driver.done
