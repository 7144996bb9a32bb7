ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONUNBUFFERED=1 EDGELLM_PDL=0
export PYTHONPATH=$ROOT:$W/site:$W/lpy
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
date
timeout 200 python3 benchmarks/skinny_probe.py --shapes gate_up,down,qkv,o --fmts Q4_K --M 16 --configs "$(cat .gpu/cfgs.json)" > $R/probe_k256_q4k.txt 2>&1
date
timeout 100 python3 benchmarks/skinny_probe.py --shapes down,gate_up --fmts Q6_K --M 16 --configs "$(cat .gpu/cfgs.json)" > $R/probe_k256_q6k.txt 2>&1
date
