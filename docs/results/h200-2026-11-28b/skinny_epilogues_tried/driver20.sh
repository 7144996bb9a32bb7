#!/bin/bash
# skinny GEMM epilogues (act(gate)*up, add + RMSNorm) for batched decode: tests, rows A/B, serving vs llama-batched-bench
set -x
ROOT=$(cd "$(dirname "$0")/.." && pwd); W=/tmp/gpu-session; R=$W/res; mkdir -p $R $W/models
cd $ROOT
export OUT=$R PYTHONUNBUFFERED=1
bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
export PYTHONPATH=$ROOT:$W/site:$W/lpy
(setsid bash benchmarks/gpu_session.sh build_llama > $R/build_llama.txt 2>&1 &)
python3 - > $R/models.txt 2>&1 <<'PY' &
import sys; sys.path.insert(0, "benchmarks")
from bench_serve import synthetic_model as s
s("llama-3.1-8b:Q4_0", "/tmp/gpu-session/models/8b-Q4_0-textvocab.gguf")
s("llama-3.2-1b:Q4_0", "/tmp/gpu-session/models/1b-Q4_0-textvocab.gguf")
PY
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "skinny or norm_tail or silu_mul or split" > $R/gpu_tests_kernels.txt 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_rows.py > $R/gpu_tests_rows.txt 2>&1
wait
for m in 8b 1b; do
  F=$W/models/$m-Q4_0-textvocab.gguf
  for v in on off nowait on2; do
    case $v in on|on2) E="";; off) E="EDGELLM_SKINNY_EPILOGUES=0";; nowait) E="EDGELLM_NORM_EPILOGUE_WAIT=0";; esac
    env $E timeout 150 python3 benchmarks/bench_rows.py --model $F --rows 16 32 > $R/rows_${m}_$v.txt 2>&1
  done
  EDGELLM_PDL=0 timeout 150 python3 benchmarks/bench_rows.py --model $F --rows 16 --profile 16 > $R/prof_${m}_on.txt 2>&1
done
bash benchmarks/gpu_session.sh wait_llama 400 > $R/wait_llama.txt 2>&1
bash benchmarks/gpu_session.sh serve 8b:Q4_0 --tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16 32 > /dev/null 2>&1
touch $W/driver.done
bash benchmarks/gpu_session.sh serve 1b:Q4_0 --tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16 32 > /dev/null 2>&1
touch $W/driver.done2
