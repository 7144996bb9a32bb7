ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONUNBUFFERED=1 EDGELLM_PDL=0
export PYTHONPATH=$ROOT:$W/site:$W/lpy
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
cat $R/setup.txt; date
setsid nohup bash benchmarks/gpu_session.sh build_llama > $R/build_llama.txt 2>&1 < /dev/null &
rm -rf /tmp/kept && mkdir /tmp/kept && cp -r $ROOT/edgellm $ROOT/benchmarks /tmp/kept/ && cp .gpu/pre555_linear.py /tmp/kept/edgellm/backends/cuda/kernels/linear.py
for v in kept new kept2 new2; do
  t=$ROOT; [ ${v%2} = kept ] && t=/tmp/kept
  PYTHONPATH=$t:$W/site:$W/lpy timeout 90 python3 $t/benchmarks/skinny_probe.py --tuner-only --shapes gate_up,down,qkv,o --fmts Q5_K,Q6_K --M 16 > $R/probe56_$v.txt 2>&1
  grep "tuner's best" $R/probe56_$v.txt | sed "s/^/$v /" | cut -c1-80
done
date
timeout 240 python3 benchmarks/bench_rows.py --model llama-3.1-8b:Q4_K_M --rows 1 16 32 --profile 16 > $R/rows.txt 2>&1
grep -E "^rows|check|profile|us  x" $R/rows.txt | head -30
date
bash benchmarks/gpu_session.sh wait_llama 400
for m in 8b:Q4_K_M 8b:Q4_0; do
  timeout 300 bash benchmarks/gpu_session.sh serve $m --tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16 32 > /dev/null 2>&1
  tail -25 $R/serve_${m%%:*}_${m##*:}.txt
done
date
