"""edgellm cuda and llama.cpp (llama-bench) on the same GGUF files, in the same run.

    python benchmarks/bench_vs_llamacpp.py --llama-bench PATH/llama-bench MODEL.gguf [...]
        [-p 512] [-n 128] [-r 5] [--fa 1] [--json OUT.json]

For each file: llama-bench -ngl 99 -p P -n N -fa FA -r R (its own warm-up and mean/stddev), then
edgellm's measurement of the same two tests (benchmarks/gpu_check.py's `measure`: warm-up, median
of R). Prints one table with both engines' tokens/s and the ratio, plus edgellm's MBU against a
measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))

from gpu_check import copy_bandwidth, measure  # noqa: E402


def llama_bench(exe: str, path: str, p: int, n: int, r: int, fa: int) -> dict:
    cmd = [exe, "-m", path, "-ngl", "99", "-p", str(p), "-n", str(n), "-fa", str(fa), "-r", str(r), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    res = {}
    for row in json.loads(out.stdout):
        key = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
        res[key], res[key + "_sd"] = row["avg_ts"], row["stddev_ts"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--fa", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    bw = copy_bandwidth()
    import torch

    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    rows = []
    for path in a.models:
        name = os.path.basename(path).removesuffix(".gguf")
        lc = llama_bench(a.llama_bench, path, a.p, a.n, a.r, a.fa)
        try:
            ours = measure(path, a.p, a.n, a.r, bw)
        except Exception as e:
            ours = {"error": f"{type(e).__name__}: {e}"[:200]}
        rows.append({"model": name, "llama.cpp": lc, "edgellm": ours})
        print(json.dumps(rows[-1]), flush=True)
    pp, tg = f"pp{a.p}", f"tg{a.n}"
    print(f"\n| model | llama.cpp {pp} | edgellm {pp} | ratio | llama.cpp {tg} | edgellm {tg} | ratio | edgellm MBU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lc, us = r["llama.cpp"], r["edgellm"]

        def cell(d, k):
            return f"{d[k]:,.1f}" if k in d else d.get("error", "-")[:40]

        def ratio(k):
            return f"{us[k] / lc[k]:.2f}x" if k in us and k in lc else "-"

        mbu = f"{100 * us['mbu']:.1f}%" if "mbu" in us else "-"
        print(f"| {r['model']} | {cell(lc, pp)} | {cell(us, pp)} | {ratio(pp)} | {cell(lc, tg)} | {cell(us, tg)} | "
              f"{ratio(tg)} | {mbu} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"copy_bandwidth": bw, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
