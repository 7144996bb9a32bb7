#!/bin/bash
# int8 skinny GEMM: kernel A/B (skinny_probe, float vs int8), then 8B Q4_K_M rows steps int8 on/off
set -x
ROOT=$(cd "$(dirname "$0")/.." && pwd); W=/tmp/gpu-session; R=$W/res; mkdir -p $R $W/models
cd $ROOT
export OUT=$R PYTHONUNBUFFERED=1 EDGELLM_PDL=0 PYTHONPATH=$ROOT:$W/site:$W/lpy EDGELLM_CACHE_DIR=$W/cache
bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
F=$W/models/8b-Q4_K_M-textvocab.gguf
[ -e $F ] || (python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_serve import synthetic_model as s; s('llama-3.1-8b:Q4_K_M', '$F')" > $R/model.txt 2>&1; touch $W/model.done) &
timeout 150 python3 benchmarks/skinny_probe.py --tuner-only --fmts Q4_K --shapes gate_up,down,qkv,o --M 16 > $R/probe_float.txt 2>&1
timeout 150 python3 benchmarks/skinny_probe.py --tuner-only --fmts Q4_K --shapes gate_up,down,qkv,o --M 16 --act-int8 > $R/probe_int8.txt 2>&1
grep -E "best" $R/probe_float.txt $R/probe_int8.txt
wait
timeout 120 python3 benchmarks/bench_rows.py --model $F --rows 16 32 --profile 16 > $R/rows_i8.txt 2>&1
EDGELLM_SKINNY_I8=0 timeout 100 python3 benchmarks/bench_rows.py --model $F --rows 16 32 > $R/rows_f.txt 2>&1
timeout 60 python3 benchmarks/bench_rows.py --model $F --rows 16 32 > $R/rows_i8b.txt 2>&1
for f in i8 f i8b; do echo "$f $(grep -E '^rows +(16|32):' $R/rows_$f.txt | awk '{print $3}' | tr '\n' ' ') $(grep -o 'argmax agreement.*' $R/rows_$f.txt | head -1) $(grep -o 'max |diff|.*= [0-9.e-]*' $R/rows_$f.txt | head -1)"; done > $R/summary.txt
cat $R/summary.txt
touch $W/driver.done
