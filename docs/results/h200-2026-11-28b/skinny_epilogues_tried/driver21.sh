#!/bin/bash
# skinny GEMM epilogues, second try (one-load norm scale, spin on plain loads): which epilogue, PDL on/off
set -x
ROOT=$(cd "$(dirname "$0")/.." && pwd); W=/tmp/gpu-session; R=$W/res; mkdir -p $R $W/models
cd $ROOT
export OUT=$R PYTHONUNBUFFERED=1
bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
export PYTHONPATH=$ROOT:$W/site:$W/lpy
[ -x $W/lb/bin/llama-batched-bench ] || (setsid bash benchmarks/gpu_session.sh build_llama > $R/build_llama.txt 2>&1 &)
[ -e $W/models/8b-Q4_0-textvocab.gguf ] || python3 - > $R/models.txt 2>&1 <<'PY'
import sys; sys.path.insert(0, "benchmarks")
from bench_serve import synthetic_model as s
s("llama-3.1-8b:Q4_0", "/tmp/gpu-session/models/8b-Q4_0-textvocab.gguf")
s("llama-3.2-1b:Q4_0", "/tmp/gpu-session/models/1b-Q4_0-textvocab.gguf")
PY
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "skinny_epilogue" > $R/gpu_tests_kernels.txt 2>&1
variant() {  # NAME ENV...
  local name=$1; shift
  env "$@" timeout 150 python3 benchmarks/bench_rows.py --model $F --rows 16 32 > $R/rows_${m}_$name.txt 2>&1
  echo "$name $(grep -E '^rows +16:' $R/rows_${m}_$name.txt | awk '{print $3}')" >> $R/summary_$m.txt
}
m=8b; F=$W/models/8b-Q4_0-textvocab.gguf
variant off EDGELLM_SKINNY_EPILOGUES=0
variant on X=1
variant glu EDGELLM_SKINNY_EPILOGUES=glu
variant norm EDGELLM_SKINNY_EPILOGUES=norm
variant on_pdl0 EDGELLM_PDL=0
variant off_pdl0 EDGELLM_SKINNY_EPILOGUES=0 EDGELLM_PDL=0
variant on2 X=1
variant off2 EDGELLM_SKINNY_EPILOGUES=0
EDGELLM_PDL=0 timeout 150 python3 benchmarks/bench_rows.py --model $F --rows 16 --profile 16 > $R/prof_8b_on.txt 2>&1
m=1b; F=$W/models/1b-Q4_0-textvocab.gguf
variant off EDGELLM_SKINNY_EPILOGUES=0
variant on X=1
variant glu EDGELLM_SKINNY_EPILOGUES=glu
variant norm EDGELLM_SKINNY_EPILOGUES=norm
touch $W/driver.done
