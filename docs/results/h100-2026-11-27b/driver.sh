#!/usr/bin/env bash
# 2026-11-27: rows A/B (skinny tuning) alternating trees, then issue 15's serving table.
set -uo pipefail
cd "$ROOT"
W=/tmp/gpu-session; R=$W/res
export OUT=$R PYTHONUNBUFFERED=1
S="bash benchmarks/gpu_session.sh"
ts() { echo "== $(date -u +%H:%M:%S) $*"; }
ts setup; $S setup
export PYTHONPATH=$W/site
ts build_llama; (setsid $S build_llama > $R/build_llama.log 2>&1 &)
ts models
for item in 8b:Q4_0 8b:Q4_K_M 1b:Q4_K_M 1b:Q4_0; do
  n=${item%%:*}; f=${item##*:}; p=$(case $n in 1b) echo llama-3.2-1b;; 8b) echo llama-3.1-8b;; esac)
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
from bench_serve import synthetic_model; synthetic_model(sys.argv[1], sys.argv[2])" "$p:$f" "$W/models/$n-$f-textvocab.gguf" &
done
wait
mkdir -p $W/old && tar xzf .gpu/old_tree.tgz -C $W/old
export EDGELLM_CACHE_DIR=$W/cache
for m in 8b-Q4_0 8b-Q4_K_M; do
  for tree in new old new2 old2; do
    d=$ROOT; case $tree in old*) d=$W/old;; esac
    ts "rows $m $tree"
    (cd $d && timeout 300 python3 benchmarks/bench_rows.py --model $W/models/$m-textvocab.gguf --rows 8 16 32 --reps 100 \
      --json $R/rows_${m}_$tree.json > $R/rows_${m}_$tree.txt 2>&1); grep -E "tuned|ms/step" $R/rows_${m}_$tree.txt
  done
done
ts wait_llama; $S wait_llama 400 > /dev/null
for item in 8b:Q4_0 8b:Q4_K_M 1b:Q4_K_M 1b:Q4_0; do
  ts "serve $item"; timeout 540 $S serve $item --tokens 512 --ctx 1024 --prompt-tokens 100 > $R/serve_log_${item/:/_}.txt 2>&1
  tail -14 $R/serve_log_${item/:/_}.txt
done
ts done; touch $W/driver.done
