ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONUNBUFFERED=1 EDGELLM_PDL=0
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
rm -rf /tmp/kept && mkdir /tmp/kept && cp -r $ROOT/edgellm $ROOT/benchmarks /tmp/kept/ && cp .gpu/kept_linear.py /tmp/kept/edgellm/backends/cuda/kernels/linear.py
for v in kept new kept2 new2; do
  t=$ROOT; [ ${v%2} = kept ] && t=/tmp/kept
  PYTHONPATH=$t:$W/site:$W/lpy timeout 60 python3 $t/benchmarks/skinny_probe.py --tuner-only --shapes gate_up,down,qkv,o --fmts Q4_K --M 16 > $R/probe_pair_$v.txt 2>&1
  grep "tuner's best" $R/probe_pair_$v.txt | sed "s/^/$v /" | cut -c1-70
done
