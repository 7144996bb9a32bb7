# the serving rounds that dipped on 2026-11-29 (1B Q4_0 16 streams, 8B Q4_0 32 streams), repeated with
# GET /metrics scraped around each round: model-thread iterations and event-loop lags over 0.1 s
ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONUNBUFFERED=1 EDGELLM_PDL=0
export PYTHONPATH=$ROOT:$W/site:$W/lpy
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
python3 -c "import prometheus_client" || echo "no prometheus_client"
mkdir -p $W/models
sv() { tag=$1; shift; date -u +"%T $tag"
  timeout 150 python3 benchmarks/bench_serve.py --backend cuda --synthetic "$@" --tokens 512 --ctx 1024 \
    --prompt-tokens 100 --clients 16 32 --json $R/$tag.json > $R/$tag.txt 2>&1
  grep -E "^ +(16|32) |N=(16|32): model" $R/$tag.txt | sed "s/^/$tag /"; }
for i in 1 2 3; do sv 1b_q40_$i llama-3.2-1b:Q4_0 --model-out $W/models/1b-Q4_0-textvocab.gguf; done
sv 8b_q40_1 llama-3.1-8b:Q4_0 --model-out $W/models/8b-Q4_0-textvocab.gguf
sv 1b_q40_4 llama-3.2-1b:Q4_0 --model-out $W/models/1b-Q4_0-textvocab.gguf
date -u +"%T end"
