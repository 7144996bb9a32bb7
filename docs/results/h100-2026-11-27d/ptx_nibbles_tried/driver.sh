#!/usr/bin/env bash
# 2026-11-27 (4): nibbles in PTX in the GEMM (Q4_0, Q4_1): correctness, per-product and rows-step A/B vs HEAD.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res; S="bash benchmarks/gpu_session.sh"
export OUT=$R PYTHONUNBUFFERED=1
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup > /dev/null
export PYTHONPATH=$W/site
ts build_llama; (setsid bash benchmarks/gpu_session.sh build_llama > $R/build_llama.log 2>&1 &)
mkdir -p $W/old && tar xzf .gpu/old_tree.tgz -C $W/old && cp benchmarks/skinny_probe.py $W/old/benchmarks/
ts models; mkdir -p $W/models
for f in Q4_0 Q4_K_M; do
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
from bench_serve import synthetic_model; synthetic_model(sys.argv[1], sys.argv[2])" "llama-3.1-8b:$f" "$W/models/8b-$f-textvocab.gguf" &
done
wait
export EDGELLM_CACHE_DIR=$W/cache
ts probe
for tree in new old; do d=$ROOT; [ $tree = old ] && d=$W/old
  (cd $d && timeout 150 python3 benchmarks/skinny_probe.py --tuner-only --fmts Q4_0,Q4_K --json $R/probe_$tree.json > $R/probe_$tree.txt 2>&1); echo "rc=$?"
  grep -E "tuner's best|WRONG" $R/probe_$tree.txt
done
ts stress; timeout 120 python3 benchmarks/gemm_stress.py --skinny --only Q4_0,Q4_K > $R/stress_skinny.txt 2>&1; echo "rc=$?"; tail -2 $R/stress_skinny.txt
timeout 150 python3 benchmarks/gemm_stress.py > $R/stress.txt 2>&1; echo "rc=$?"; tail -2 $R/stress.txt
for m in 8b-Q4_0 8b-Q4_K_M; do
  for tree in new old new2 old2; do d=$ROOT; case $tree in old*) d=$W/old;; esac
    ts "rows $m $tree"
    (cd $d && timeout 150 python3 benchmarks/bench_rows.py --model $W/models/$m-textvocab.gguf --rows 16 32 --reps 100 \
      --json $R/rows_${m}_$tree.json > $R/rows_${m}_$tree.txt 2>&1); grep -E "check|ms/step|single" $R/rows_${m}_$tree.txt
  done
done
ts tests; timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_kernels.py tests/test_cuda_rows.py > $R/gpu_tests.txt 2>&1; tail -3 $R/gpu_tests.txt
ts wait_llama; $S wait_llama 300 > /dev/null
for item in 8b:Q4_0 8b:Q4_K_M; do
  ts "serve $item"; timeout 300 $S serve $item --tokens 512 --ctx 1024 --prompt-tokens 100 > $R/serve_log_${item/:/_}.txt 2>&1
  tail -14 $R/serve_log_${item/:/_}.txt
done
ts done; touch $W/driver.done
