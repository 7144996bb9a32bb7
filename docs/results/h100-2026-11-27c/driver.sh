#!/usr/bin/env bash
# 2026-11-27: the GEMM's six-bit top bits read as words: correctness, 8B Q4_K_M rows steps vs HEAD.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; bash benchmarks/gpu_session.sh setup
export PYTHONPATH=$W/site
ts models
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
from bench_serve import synthetic_model; synthetic_model('llama-3.1-8b:Q4_K_M', '$W/models/8b-Q4_K_M-textvocab.gguf')"
mkdir -p $W/old && tar xzf .gpu/old_tree.tgz -C $W/old
export EDGELLM_CACHE_DIR=$W/cache
for tree in new old new2 old2; do
  d=$ROOT; case $tree in old*) d=$W/old;; esac
  ts "rows 8b-Q4_K_M $tree"
  (cd $d && timeout 100 python3 benchmarks/bench_rows.py --model $W/models/8b-Q4_K_M-textvocab.gguf --rows 8 16 32 --reps 100 \
    --json $R/rows_8b-Q4_K_M_$tree.json > $R/rows_8b-Q4_K_M_$tree.txt 2>&1); grep -E "gemm_skinny \('Q6|ms/step|single" $R/rows_8b-Q4_K_M_$tree.txt
done
ts stress; timeout 80 python3 benchmarks/gemm_stress.py --skinny --only Q6_K,Q4_K+Q6_K > $R/stress_skinny_q6.txt 2>&1; echo "rc=$?"; grep -v "| 0$" $R/stress_skinny_q6.txt | tail -5
ts tests; timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "Q6 or q6" > $R/gpu_tests_q6.txt 2>&1; tail -2 $R/gpu_tests_q6.txt
ts done; touch $W/driver.done
