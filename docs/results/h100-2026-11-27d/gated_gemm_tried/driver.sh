#!/usr/bin/env bash
# 2026-11-27 (5): the gated skinny GEMM (gate|up + silu in one launch): correctness, rows A/B vs HEAD, serving.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$W/site
ts build_llama; (setsid bash benchmarks/gpu_session.sh build_llama > $R/build_llama.log 2>&1 &)
mkdir -p $W/old && tar xzf .gpu/old_tree.tgz -C $W/old
ts models; mkdir -p $W/models
for f in Q4_0 Q4_K_M; do
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
from bench_serve import synthetic_model; synthetic_model(sys.argv[1], sys.argv[2])" "llama-3.1-8b:$f" "$W/models/8b-$f-textvocab.gguf" &
done
wait
export EDGELLM_CACHE_DIR=$W/cache
ts tests; timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_rows.py -k "gated or skinny or split_k" > $R/gpu_tests_gated.txt 2>&1; tail -2 $R/gpu_tests_gated.txt
for m in 8b-Q4_0 8b-Q4_K_M; do
  for tree in new old; do d=$ROOT; [ $tree = old ] && d=$W/old
    ts "rows $m $tree"
    (cd $d && timeout 200 python3 benchmarks/bench_rows.py --model $W/models/$m-textvocab.gguf --rows 16 32 --reps 100 \
      --json $R/rows_${m}_$tree.json > $R/rows_${m}_$tree.txt 2>&1); grep -E "check|ms/step|single" $R/rows_${m}_$tree.txt
  done
done
ts "profile 8b-Q4_0 new (PDL on)"
timeout 100 python3 benchmarks/bench_rows.py --model $W/models/8b-Q4_0-textvocab.gguf --rows 16 --reps 20 --profile 16 \
   --json $R/prof_8b-Q4_0.json > $R/prof_8b-Q4_0.txt 2>&1; grep -A 14 "^profile" $R/prof_8b-Q4_0.txt
ts stress; timeout 100 python3 benchmarks/gemm_stress.py > $R/stress.txt 2>&1; echo "rc=$?"; grep -v "| 0 |" $R/stress.txt | tail -3
ts wait_llama; $S wait_llama 300 > /dev/null
for item in 8b:Q4_0 8b:Q4_K_M; do
  ts "serve $item"; timeout 300 $S serve $item --tokens 512 --ctx 1024 --prompt-tokens 100 > $R/serve_log_${item/:/_}.txt 2>&1
  tail -14 $R/serve_log_${item/:/_}.txt
done
ts kernel_tests; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "gemm or prefill or silu or linear" > $R/gpu_tests_kernels.txt 2>&1; tail -2 $R/gpu_tests_kernels.txt
ts done; touch $W/driver.done
