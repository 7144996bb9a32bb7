"""Where a decode token's time goes: every kernel of the cuda backend's decode step, measured.

    python benchmarks/profile_decode.py [--models 135m:Q4_0,1b:Q4_0,8b:Q4_0] [-n 64] [--ctx 128]
                                        [--variants "base EDGELLM_NORM_TAIL=0"] [--no-profile] [--json OUT.json]

For each synthetic model (edgellm.synthetic presets, random weights) it decodes greedily on the
device (one CUDA-graph replay per token), then profiles n more tokens with torch.profiler
(CUPTI records the kernels inside graph replays) and prints, per kernel and launch grid: launches
per token, device time per token, and the share of the step. Two passes: with programmatic
dependent launch (PDL) off, each kernel's own duration (with PDL a kernel is resident, and timed,
while it waits for its predecessor); and with PDL on (the default), the step time the user sees.
"gap" is the step time minus the kernels' busy time: launch latency between kernels.
The profiler adds about 1 us per kernel; --variants times settings side by side without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import edgellm  # noqa: E402
from edgellm.synthetic import preset, write_synthetic_gguf  # noqa: E402

PRESETS = {"135m": "smollm2-135m", "1b": "llama-3.2-1b", "8b": "llama-3.1-8b"}


def _busy_us(spans) -> float:
    """Union of kernel intervals (overlapping kernels counted once), in us."""
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy


def _kernels(prof, tmp: str) -> list[dict]:
    """Kernel events (name, grid, start, duration in us) from the profiler's trace: the trace keeps
    each launch's grid, which tells the GEMVs of a layer apart (they share one Triton kernel)."""
    path = os.path.join(tmp, "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as fh:
        trace = json.load(fh)
    os.remove(path)
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "kernel":
            grid = e.get("args", {}).get("grid")
            out.append({"name": e["name"], "grid": tuple(grid) if grid else None,
                        "ts": float(e["ts"]), "dur": float(e["dur"])})
    return out


def _variant(spec: str) -> dict:
    """'base' or comma-separated NAME=VALUE: EDGELLM_* environment variables, or attributes of
    the kernels' configs module (for A/B runs of one setting in one process)."""
    out = {}
    for item in spec.split("+") if spec != "base" else []:
        k, v = item.split("=", 1)
        out[k] = v
    return out


def _apply(variant: dict):
    from edgellm.backends.cuda.kernels import configs
    undo = []
    for k, v in variant.items():
        if k.startswith("EDGELLM_"):
            undo.append(("env", k, os.environ.get(k)))
            os.environ[k] = v
        else:
            undo.append(("cfg", k, getattr(configs, k)))
            setattr(configs, k, type(getattr(configs, k))(v))
    return undo


def _restore(undo) -> None:
    from edgellm.backends.cuda.kernels import configs
    for kind, k, old in reversed(undo):
        if kind == "cfg":
            setattr(configs, k, old)
        elif old is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = old


def _warm(path: str, n: int, ctx: int):
    m = edgellm.load(path, backend="cuda", ctx=ctx + n + 8, prefill_chunk=64)
    dec = m.programs["decode"]
    # warm-up: compile and capture the graph of every context bucket the timed run reaches
    for _ in dec.loop_tokens(1, 0, ctx + n):
        pass
    torch.cuda.synchronize()
    return m, dec


def time_decode(path: str, n: int, ctx: int, reps: int = 5) -> float:
    """us per greedy token from position ctx, no profiler (median of reps runs of n tokens)."""
    m, dec = _warm(path, n, ctx)
    ts = []
    for _ in range(reps):
        gen = dec.loop_tokens(1, ctx, n + 1)
        next(gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = sum(1 for _ in gen)
        ts.append(1e6 * (time.perf_counter() - t0) / got)
    del m, dec
    torch.cuda.empty_cache()
    return sorted(ts)[len(ts) // 2]


def profile_model(path: str, n: int, ctx: int, pdl: bool, tmp: str) -> dict:
    os.environ["EDGELLM_PDL"] = "1" if pdl else "0"
    m, dec = _warm(path, n, ctx)
    gen = dec.loop_tokens(1, ctx, n + 1)
    next(gen)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        got = sum(1 for _ in gen)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = _kernels(prof, tmp)
    per = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        key = f"{e['name']} {list(e['grid']) if e['grid'] else ''}"
        per[key][0] += 1
        per[key][1] += e["dur"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    span = (max(s[1] for s in spans) - min(s[0] for s in spans)) if spans else 0.0
    rows = sorted(({"kernel": k, "per_token": c / got, "us_per_token": t / got, "us_each": t / c}
                   for k, (c, t) in per.items()), key=lambda r: -r["us_per_token"])
    res = {"pdl": pdl, "tokens": got, "wall_us_per_token": 1e6 * wall / got, "span_us_per_token": span / got,
           "busy_us_per_token": _busy_us(spans) / got, "kernels_per_token": len(kernels) / got, "rows": rows}
    del m, dec
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="135m:Q4_0,1b:Q4_0,8b:Q4_0")
    ap.add_argument("-n", type=int, default=64, help="tokens profiled")
    ap.add_argument("--ctx", type=int, default=128, help="tokens in the cache before the profiled ones")
    ap.add_argument("--variants", default="base",
                    help="settings timed without the profiler, separated by spaces: 'base' or "
                         "NAME=VALUE[+NAME=VALUE] (EDGELLM_* variables or kernels.configs attributes)")
    ap.add_argument("--no-profile", action="store_true", help="only the timed variants")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "models": []}
    with tempfile.TemporaryDirectory() as tmp:
        for item in a.models.split(","):
            name, fmt = item.split(":")
            path = os.path.join(tmp, f"{name}-{fmt}.gguf")
            write_synthetic_gguf(path, preset(PRESETS[name], weight_type=fmt), fast=True)
            entry = {"model": name, "format": fmt, "variants": {}}
            for v in a.variants.split():
                undo = _apply(_variant(v))
                try:
                    entry["variants"][v] = us = time_decode(path, a.n, a.ctx)
                finally:
                    _restore(undo)
                print(f"{name} {fmt} [{v}]: {us:.1f} us/token, {1e6 / us:,.1f} tok/s (no profiler)", flush=True)
            for pdl in (() if a.no_profile else (False, True)):
                entry["pdl_on" if pdl else "pdl_off"] = r = profile_model(path, a.n, a.ctx, pdl, tmp)
                print(f"\n## {name} {fmt}, PDL {'on' if pdl else 'off'}: {r['wall_us_per_token']:.1f} us/token wall, "
                      f"kernel span {r['span_us_per_token']:.1f}, busy {r['busy_us_per_token']:.1f}, "
                      f"{r['kernels_per_token']:.0f} kernels/token", flush=True)
                if not pdl:
                    print("| kernel | per token | us/token | us each | share |\n|---|---:|---:|---:|---:|")
                    for row in r["rows"][:16]:
                        print(f"| {row['kernel'][:70]} | {row['per_token']:.0f} | {row['us_per_token']:.1f} | "
                              f"{row['us_each']:.2f} | {100 * row['us_per_token'] / r['span_us_per_token']:.0f}% |")
            report["models"].append(entry)
            os.remove(path)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
