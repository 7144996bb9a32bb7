#!/bin/bash
# issue 15, 8B Q4_K_M at 16 rows: main vs the six-bit shift table (.gpu/b), kernel profiles, gemm_stress, then serve
set -x
ROOT=$(cd "$(dirname "$0")/.." && pwd); W=/tmp/gpu-session; R=$W/res; mkdir -p $R $W/models
cd $ROOT
export OUT=$R PYTHONUNBUFFERED=1 EDGELLM_PDL=0 PYTHONPATH=$ROOT:$W/site:$W/lpy
bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
(setsid bash benchmarks/gpu_session.sh build_llama > $R/build_llama.txt 2>&1 &)
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_serve import synthetic_model as s; s('llama-3.1-8b:Q4_K_M', '$W/models/8b-Q4_K_M-textvocab.gguf')" > $R/model.txt 2>&1
F=$W/models/8b-Q4_K_M-textvocab.gguf
A="env PYTHONPATH=$ROOT:$W/site:$W/lpy EDGELLM_CACHE_DIR=$W/cache_a"
B="env PYTHONPATH=$ROOT/.gpu/b:$W/site:$W/lpy EDGELLM_CACHE_DIR=$W/cache_b"
$A timeout 150 python3 benchmarks/bench_rows.py --model $F --rows 16 32 --profile 16 > $R/rows_a.txt 2>&1
$B timeout 150 python3 .gpu/b/benchmarks/bench_rows.py --model $F --rows 16 32 --profile 16 > $R/rows_b.txt 2>&1
$A timeout 60 python3 benchmarks/bench_rows.py --model $F --rows 16 32 > $R/rows_a2.txt 2>&1
$B timeout 60 python3 .gpu/b/benchmarks/bench_rows.py --model $F --rows 16 32 > $R/rows_b2.txt 2>&1
(cd .gpu/b && $B timeout 200 python3 benchmarks/gemm_stress.py --skinny --only Q6_K,Q4_K+Q6_K > $R/stress_b.txt 2>&1)
for f in a b a2 b2; do echo "$f $(grep -E '^rows +(16|32):' $R/rows_$f.txt | awk '{print $3}' | tr '\n' ' ') $(grep -o 'argmax agreement.*' $R/rows_$f.txt | head -1)"; done > $R/summary.txt
cat $R/summary.txt
touch $W/driver.done
