#!/bin/bash
# nibble pairs (one lop3 per two 4-bit weights) in the skinny GEMM: kernel A/B, stress, 8B Q4_K_M and Q4_0 rows steps
set -x
ROOT=$(cd "$(dirname "$0")/.." && pwd); W=/tmp/gpu-session; R=$W/res; mkdir -p $R $W/models
cd $ROOT
export OUT=$R PYTHONUNBUFFERED=1 EDGELLM_PDL=0 PYTHONPATH=$ROOT:$W/site:$W/lpy EDGELLM_CACHE_DIR=$W/cache
bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
(setsid bash benchmarks/gpu_session.sh build_llama > $R/build_llama.txt 2>&1 &)
F=$W/models/8b-Q4_K_M-textvocab.gguf
G=$W/models/8b-Q4_0-textvocab.gguf
(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_serve import synthetic_model as s; s('llama-3.1-8b:Q4_K_M', '$F')" > $R/model.txt 2>&1) &
(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_serve import synthetic_model as s; s('llama-3.1-8b:Q4_0', '$G')" > $R/model0.txt 2>&1) &
timeout 100 python3 benchmarks/skinny_probe.py --tuner-only --fmts Q4_K,Q4_0 --shapes gate_up,down,qkv,o --M 16 > $R/probe_pairs.txt 2>&1
EDGELLM_NIBBLE_PAIRS=0 timeout 100 python3 benchmarks/skinny_probe.py --tuner-only --fmts Q4_K,Q4_0 --shapes gate_up,down,qkv,o --M 16 > $R/probe_bytes.txt 2>&1
grep -E "best" $R/probe_pairs.txt $R/probe_bytes.txt
wait
timeout 100 python3 benchmarks/bench_rows.py --model $F --rows 16 32 --profile 16 > $R/rows_p.txt 2>&1
EDGELLM_NIBBLE_PAIRS=0 timeout 100 python3 benchmarks/bench_rows.py --model $F --rows 16 32 > $R/rows_b.txt 2>&1
timeout 60 python3 benchmarks/bench_rows.py --model $F --rows 16 32 > $R/rows_p2.txt 2>&1
timeout 100 python3 benchmarks/bench_rows.py --model $G --rows 16 32 > $R/rows0_p.txt 2>&1
EDGELLM_NIBBLE_PAIRS=0 timeout 100 python3 benchmarks/bench_rows.py --model $G --rows 16 32 > $R/rows0_b.txt 2>&1
for f in p b p2 0_p 0_b; do echo "$f $(grep -E '^rows +(16|32):' $R/rows$( [ ${f:0:1} = 0 ] && echo $f || echo _$f).txt | awk '{print $3}' | tr '\n' ' ') $(grep -o 'argmax agreement.*' $R/rows$( [ ${f:0:1} = 0 ] && echo $f || echo _$f).txt | head -1)"; done > $R/summary.txt
cat $R/summary.txt
timeout 120 python3 benchmarks/gemm_stress.py --skinny --only Q4_0,Q4_K > $R/stress.txt 2>&1
tail -3 $R/stress.txt
touch $W/driver.done
