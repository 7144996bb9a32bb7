ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONUNBUFFERED=1 EDGELLM_PDL=0
export PYTHONPATH=$ROOT:$W/site:$W/lpy
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
for v in base join; do rm -rf /tmp/$v && mkdir /tmp/$v && cp -r $ROOT/edgellm $ROOT/benchmarks /tmp/$v/ && cp .gpu/${v}_linear.py /tmp/$v/edgellm/backends/cuda/kernels/linear.py; done
tree() { [ $1 = both ] && echo $ROOT || echo /tmp/$1; }
date
for v in base join both base2 both2; do
  t=$(tree ${v%2})
  PYTHONPATH=$t:$W/site:$W/lpy timeout 150 python3 $t/benchmarks/skinny_probe.py --tuner-only --shapes gate_up,down,qkv,o --fmts Q4_0,Q4_K,Q6_K --M 16 > $R/probe_$v.txt 2>&1
  grep "tuner's best" $R/probe_$v.txt | sed "s/^/$v /" | cut -c1-80
done
date
timeout 200 python3 benchmarks/gemm_stress.py --skinny --only Q4_0,Q4_K,Q6_K,Q4_K+Q6_K > $R/stress_new.txt 2>&1; tail -2 $R/stress_new.txt
date
for v in base both base2 both2; do
  t=$(tree ${v%2})
  PYTHONPATH=$t:$W/site:$W/lpy EDGELLM_CACHE_DIR=/tmp/cache_${v%2} timeout 200 python3 $t/benchmarks/bench_rows.py --model llama-3.1-8b:Q4_K_M --rows 16 32 > $R/rows_$v.txt 2>&1
  echo "== $v"; grep -E "^rows|check" $R/rows_$v.txt | tail -6
  [ $v = both ] && [ $(date +%s) -gt $(( $(stat -c %Y $R/probe_base.txt) + 420 )) ] && break
done
date
