#!/bin/bash
# skinny GEMM epilogues, third try (atomic wait again, one-load norm scale): A/B interleaved, PDL on/off, then serving
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
PY
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "skinny_epilogue" > $R/gpu_tests_kernels.txt 2>&1
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_rows.py -k "slot_pool or scheduler" > $R/gpu_tests_rows.txt 2>&1
variant() {  # NAME ENV...
  local name=$1; shift
  env "$@" timeout 100 python3 benchmarks/bench_rows.py --model $F --rows 16 32 > $R/rows_${m}_$name.txt 2>&1
  echo "$name $(grep -E '^rows +(16|32):' $R/rows_${m}_$name.txt | awk '{print $3}' | tr '\n' ' ') $(grep -o 'argmax agreement.*' $R/rows_${m}_$name.txt)" >> $R/summary_$m.txt
}
m=8b; F=$W/models/8b-Q4_0-textvocab.gguf
variant on X=1
variant off EDGELLM_SKINNY_EPILOGUES=0
variant on_pdl0 EDGELLM_PDL=0
variant off_pdl0 EDGELLM_SKINNY_EPILOGUES=0 EDGELLM_PDL=0
variant on2 X=1
variant off2 EDGELLM_SKINNY_EPILOGUES=0
EDGELLM_PDL=0 timeout 100 python3 benchmarks/bench_rows.py --model $F --rows 16 --profile 16 > $R/prof_8b_on.txt 2>&1
cat $R/summary_8b.txt
BEST=$(python3 - <<'PY'
rows = [l.split() for l in open("/tmp/gpu-session/res/summary_8b.txt")]
env = {"on": "X=1", "on2": "X=1", "off": "EDGELLM_SKINNY_EPILOGUES=0", "off2": "EDGELLM_SKINNY_EPILOGUES=0",
       "on_pdl0": "EDGELLM_PDL=0", "off_pdl0": "EDGELLM_SKINNY_EPILOGUES=0 EDGELLM_PDL=0"}
ok = [r for r in rows if len(r) > 2 and "1.000" in " ".join(r)]
print(env[min(ok, key=lambda r: float(r[1]))[0]])
PY
)
echo "serving with: $BEST" > $R/serve_env.txt
bash benchmarks/gpu_session.sh wait_llama 300 > $R/wait_llama.txt 2>&1
env $BEST bash benchmarks/gpu_session.sh serve 8b:Q4_0 --tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16 32 > /dev/null 2>&1
touch $W/driver.done
