#!/usr/bin/env bash
# 2026-11-27 (2): six-bit prefill tile check, rows profiles (PDL off for honest kernel times), serving table.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup
export PYTHONPATH=$W/site
ts build_llama; (setsid bash benchmarks/gpu_session.sh build_llama > $R/build_llama.log 2>&1 &)
ts models; mkdir -p $W/models
for pf in llama-3.1-8b:8b llama-3.2-1b:1b; do p=${pf%%:*}; n=${pf##*:}
 for f in Q4_0 Q4_K_M; do
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
from bench_serve import synthetic_model; synthetic_model(sys.argv[1], sys.argv[2])" "$p:$f" "$W/models/$n-$f-textvocab.gguf" &
 done
done
wait
export EDGELLM_CACHE_DIR=$W/cache
ts stress; timeout 200 python3 benchmarks/gemm_stress.py > $R/stress.txt 2>&1; echo "rc=$?"; tail -4 $R/stress.txt
ts tests; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "Q6 or q6 or Q5 or q5" > $R/gpu_tests_q6.txt 2>&1; tail -2 $R/gpu_tests_q6.txt
for m in 8b-Q4_0 8b-Q4_K_M; do
  ts "rows $m"
  timeout 200 python3 benchmarks/bench_rows.py --model $W/models/$m-textvocab.gguf --rows 16 --reps 50 \
     --json $R/rows_$m.json > $R/rows_$m.txt 2>&1; grep -E "ms/step|single" $R/rows_$m.txt
  ts "profile $m (PDL off)"
  EDGELLM_PDL=0 timeout 150 python3 benchmarks/bench_rows.py --model $W/models/$m-textvocab.gguf --rows 16 --reps 20 --profile 16 \
     --json $R/prof_$m.json > $R/prof_$m.txt 2>&1; grep -A 22 "^profile" $R/prof_$m.txt
done
ts wait_llama; $S wait_llama 400 > /dev/null
for item in 8b:Q4_0 8b:Q4_K_M 1b:Q4_K_M 1b:Q4_0; do
  ts "serve $item"; timeout 540 $S serve $item --tokens 512 --ctx 1024 --prompt-tokens 100 > $R/serve_log_${item/:/_}.txt 2>&1
  tail -14 $R/serve_log_${item/:/_}.txt
done
ts done; touch $W/driver.done
