ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONPATH=$ROOT:$W/site:$W/lpy PYTHONUNBUFFERED=1 EDGELLM_PDL=0
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup
timeout 200 python3 benchmarks/skinny_probe.py --tuner-only --shapes gate_up,down --fmts F16,Q8_0,Q4_0,Q4_K --M 16 2>&1 | tee $R/probe_fmts.txt
timeout 100 python3 benchmarks/skinny_probe.py --tuner-only --shapes gate_up --fmts F16,Q4_0,Q4_K --M 1 2>&1 | tee $R/probe_m1.txt
bash benchmarks/gpu_session.sh skinny_ncu F16 gate_up '{"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "SPLIT_K": 4}' 2>&1 | tail -400 > $R/ncu_f16.txt
