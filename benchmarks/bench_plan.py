"""Memory planning numbers for docs/benchmarks.md.

    python benchmarks/bench_plan.py            # both parts
    python benchmarks/bench_plan.py --planners # intermediate bytes per planner, three model shapes
    python benchmarks/bench_plan.py --rss      # plan's peak estimate vs a real cpu run's peak RSS

Planners: the default model and synthetic Llama-3.2-1B / Llama-3.1-8B shapes (Q4_0 headers with
sparse data: planning reads no weights) at prefill 512 and 4096.
RSS: a child process imports edgellm and torch, records its RSS, loads the default model on cpu at the
given context, generates 16 tokens, and reports its peak RSS (ru_maxrss) minus the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from edgellm.compiler.report import plan_model  # noqa: E402
from edgellm.default_model import default_model_path  # noqa: E402
from edgellm.synthetic import preset, write_synthetic_gguf  # noqa: E402

MiB = 1 << 20

CHILD = r"""
import json, resource, sys
def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
import edgellm, torch  # the interpreter and the framework are the baseline, not the model's cost
base = rss()
m = edgellm.load(ctx=int(sys.argv[1]))
out = "".join(m.generate("What is the capital of France?", max_tokens=16, temperature=0))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"baseline": base, "peak": peak, "increase": peak - base}))
"""


def planners() -> None:
    tmp = tempfile.mkdtemp()
    models = {"smollm2-135m (default, Q4_1)": str(default_model_path())}
    for name in ("llama-3.2-1b", "llama-3.1-8b"):
        models[f"{name} (Q4_0)"] = str(write_synthetic_gguf(os.path.join(tmp, f"{name}.gguf"),
                                                            preset(name, weight_type="Q4_0"), header_only=True))
    print("| model | prefill | naive | greedy shared objects | greedy by size (arena) | min-cost flow | lower bound |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, path in models.items():
        for prefill in (512, 4096):
            t = time.perf_counter()
            p = plan_model(path, ctx=max(4096, prefill), prefill=prefill)
            dt = time.perf_counter() - t
            s = p["stages"][0]
            ib = s["intermediate_bytes"]
            cells = [f"{ib[k] / MiB:,.1f}" for k in ("naive", "greedy_shared", "greedy_by_size", "min_cost_flow")]
            print(f"| {label} | {prefill} | " + " | ".join(cells) + f" | {s['lower_bound_bytes'] / MiB:,.1f} |"
                  f"  <!-- {dt:.2f} s -->")
    print("(MiB of intermediate tensors, prefill stage; decode stage is below 1 MiB for all three)")


def rss(ctxs=(512, 4096)) -> None:
    print("| ctx | plan estimate | measured peak RSS increase | estimate / measured |")
    print("|---:|---:|---:|---:|")
    for ctx in ctxs:
        est = plan_model(str(default_model_path()), ctx=ctx, prefill=512)["estimated_peak_bytes"]
        r = subprocess.run([sys.executable, "-c", CHILD, str(ctx)], capture_output=True, text=True, check=True)
        got = json.loads(r.stdout.strip().splitlines()[-1])["increase"]
        print(f"| {ctx} | {est / MiB:,.1f} MiB | {got / MiB:,.1f} MiB | {est / got:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--planners", action="store_true")
    ap.add_argument("--rss", action="store_true")
    a = ap.parse_args()
    both = not (a.planners or a.rss)
    if a.planners or both:
        planners()
    if a.rss or both:
        rss()


if __name__ == "__main__":
    main()
