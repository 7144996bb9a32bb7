# issue 15 closing run (main, six-bit PTX on by default): GPU tests of the dequant forms, the 16/32-row
# step profile, then serve15 (all four files) and two more 8B Q4_K_M serve runs
ROOT=$(pwd); W=/tmp/gpu-session; R=$W/res; export OUT=$R
export PYTHONUNBUFFERED=1 EDGELLM_PDL=0
export PYTHONPATH=$ROOT:$W/site:$W/lpy
[ -d $W/site/gguf ] || bash benchmarks/gpu_session.sh setup > $R/setup.txt 2>&1
setsid nohup nice -n 19 bash benchmarks/gpu_session.sh build_llama > $R/build_llama.txt 2>&1 < /dev/null &
date -u +"%F %T start"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "six_bit or kquants or skinny" > $R/tests_lin.txt 2>&1; tail -1 $R/tests_lin.txt
grep -E "^FAILED" $R/tests_lin.txt | head -5
date -u +"%F %T rows"
timeout 200 python3 benchmarks/bench_rows.py --model llama-3.1-8b:Q4_K_M --rows 16 32 --lens 250 500 --profile 16 > $R/rows_8b_Q4_K_M.txt 2>&1
grep -E "^rows|check|profile|us  x" $R/rows_8b_Q4_K_M.txt | head -16
date -u +"%F %T serve15"
bash benchmarks/gpu_session.sh serve15 > $R/serve15_log.txt 2>&1; cat $R/serve15.md
for f in $R/serve_*.txt; do echo "== $f"; grep -E "^ +(1|16|32) " $f; done
cp $R/serve_8b_Q4_K_M.json $R/serve_8b_Q4_K_M_run1.json; cp $R/serve_8b_Q4_K_M.txt $R/serve_8b_Q4_K_M_run1.txt
for rep in 2 3; do
  date -u +"%F %T rep$rep"
  timeout 300 bash benchmarks/gpu_session.sh serve 8b:Q4_K_M --tokens 512 --ctx 1024 --prompt-tokens 100 --clients 1 16 32 > /dev/null 2>&1
  mv $R/serve_8b_Q4_K_M.json $R/serve_8b_Q4_K_M_run$rep.json; mv $R/serve_8b_Q4_K_M.txt $R/serve_8b_Q4_K_M_run$rep.txt
  grep -E "^ +(1|16|32) " $R/serve_8b_Q4_K_M_run$rep.txt
done
cp $R/serve_8b_Q4_K_M_run1.json $R/serve_8b_Q4_K_M.json; cp $R/serve_8b_Q4_K_M_run1.txt $R/serve_8b_Q4_K_M.txt
date -u +"%F %T end"
