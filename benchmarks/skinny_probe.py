"""Where the skinny GEMM (the serving rows step's products, M = 16) spends its time, on a GPU.

    python benchmarks/skinny_probe.py [--shapes gate_up,down] [--fmts Q4_0,Q4_K] [--M 16]
                                      [--quick | --tuner-only | --configs JSON_LIST] [--json OUT]
    ncu --clock-control none -k regex:_gemm_kernel -s 5 -c 1 --section ... \\
        python benchmarks/skinny_probe.py --shapes gate_up --ncu CONFIG_JSON

Sweep: the 8B Llama shapes (gate|up 28672 x 4096, down 4096 x 14336, q|k|v 6144 x 4096, o 4096 x
4096; 1b_gate_up etc. the 1B ones) at M rows: the tuner's candidates (configs.skinny_candidates) and a wider grid (BLOCK_N
64-256, BLOCK_K 64-256, 2-8 warps, 2-5 stages, split-K 1-16; --quick a smaller one, --tuner-only
none: an A/B of kernel code), each timed in a CUDA graph over copies of the weight rotated past
the L2 (bench_kernels.graph_time) and checked against the decode GEMV kernel's output for the same
rows (another kernel). Prints per shape the tuner's best and the ten fastest, with the weight read
rate; --ncu runs one configuration a few times for Nsight Compute. H100 results, 2026-11-27:
docs/results/h100-2026-11-27d/skinny_probe/.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kernels import graph_time, rotated_copies  # noqa: E402

from edgellm.backends.cuda import kernels as K  # noqa: E402
from edgellm.backends.cuda.kernels import configs  # noqa: E402
from edgellm.backends.cuda.kernels.packing import repack  # noqa: E402
from edgellm.synthetic import random_blocks  # noqa: E402

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096),
          # the Llama-3.2-1B shapes
          "1b_gate_up": (16384, 2048), "1b_down": (2048, 8192), "1b_qkv": (3072, 2048), "1b_o": (2048, 2048)}


def weight(fmt: str, n: int, k: int, rng):
    raw = random_blocks(fmt, (n, k), rng, 0.02)
    if raw is None:  # float formats: random_blocks makes only block formats
        raw = (rng.standard_normal((n, k), dtype=np.float32) * 0.02).astype(np.float16 if fmt == "F16" else np.float32)
    return repack(raw, fmt, (n, k), device="cuda")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="gate_up,down,qkv,o")
    p.add_argument("--fmts", default="Q4_0")
    p.add_argument("--M", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="a smaller grid")
    p.add_argument("--tuner-only", action="store_true", help="only the tuner's candidates (an A/B of kernel code)")
    p.add_argument("--configs", default=None,
                   help="a JSON list of configurations to time instead of the tuner's and the grid "
                        "(e.g. prefill tiles with --M 512); the first is the baseline")
    p.add_argument("--weight-b", action="store_true",
                   help="every configuration with WEIGHT_B (the weight the MMA's right operand)")
    p.add_argument("--ncu", default=None, help="run one configuration (JSON) a few times, for ncu")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if a.ncu:
        cfg = json.loads(a.ncu)
        n, k = SHAPES[a.shapes.split(",")[0]]
        w = weight(a.fmts.split(",")[0], n, k, rng)
        x = torch.randn((a.M, k), device="cuda").half()
        y = torch.empty((a.M, n), device="cuda", dtype=torch.float16)
        for _ in range(8):
            K.linear(x, w, out=y, config=cfg, decode_max_tokens=0)
        torch.cuda.synchronize()
        return 0
    grid = dict(bn=(64, 128, 256), bk=(64, 128, 256), warps=(2, 4, 8), stages=(2, 3, 4, 5), split=(1, 2, 4, 8, 16))
    if a.quick:
        grid = dict(bn=(64, 128, 256), bk=(128, 256), warps=(4, 8), stages=(3, 4), split=(1, 2, 4, 8))
    if a.tuner_only:
        grid = dict(bn=(), bk=(), warps=(), stages=(), split=())
    res = []
    for fmt in a.fmts.split(","):
        for what in a.shapes.split(","):
            n, k = SHAPES[what]
            w = weight(fmt, n, k, rng)
            pool = rotated_copies(w)
            x = torch.randn((a.M, k), device="cuda").half()
            y = torch.empty((a.M, n), device="cuda", dtype=torch.float16)
            # the reference: the decode GEMV kernel (another kernel's code) over the same rows
            step = configs.DECODE_MAX_TOKENS
            ref = torch.cat([K.linear(x[i:i + step], w).float() for i in range(0, a.M, step)])

            def run(c):
                def fn():
                    for q in pool:
                        K.linear(x, q, out=y, config=c, decode_max_tokens=0)
                return graph_time(fn, inner=len(pool), reps=5, min_ms=10)
            tuner = configs.skinny_candidates(a.M, n, k, sms) if not a.configs else json.loads(a.configs)[:1]
            cands = [] if a.configs else [dict(BLOCK_M=16 if a.M <= 16 else 32, BLOCK_N=bn, BLOCK_K=bk, num_warps=wp, num_stages=st,
                          SPLIT_K=sk)
                     for bn, bk, wp, st, sk in itertools.product(*grid.values()) if -(-k // bk) // sk >= 2]
            rows = []
            if a.weight_b:
                tuner = [dict(c, WEIGHT_B=True) for c in tuner]
                cands = [dict(c, WEIGHT_B=True) for c in cands]
            for c in tuner + cands + (json.loads(a.configs)[1:] if a.configs else []):
                try:
                    t = run(c)
                    y.fill_(float("nan"))
                    K.linear(x, w, out=y, config=c, decode_max_tokens=0)
                    err = float((y.float() - ref).abs().max() / ref.abs().max())
                except Exception as e:  # a tile this device cannot hold
                    print(f"  skip {c}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                    continue
                rows.append({"fmt": fmt, "shape": what, "M": a.M, "cfg": c, "us": t * 1e6,
                             "GBps": w.nbytes / t / 1e9, "tuner": c in tuner, "err": err})
            rows.sort(key=lambda r: r["us"])
            tb = min((r for r in rows if r["tuner"]), key=lambda r: r["us"])
            print(f"{fmt} {what} {n}x{k} M={a.M} ({w.nbytes / 1e6:.1f} MB): {'baseline' if a.configs else "tuner's best"} {tb['us']:.1f} us "
                  f"({tb['GBps']:.0f} GB/s) {tb['cfg']}", flush=True)
            for r in rows[:10 if not a.configs else len(rows)]:
                print(f"   {r['us']:7.1f} us {r['GBps']:5.0f} GB/s err {r['err']:.1e} {r['cfg']}", flush=True)
            bad = [r for r in rows if not r["err"] < 1e-2]
            if bad:
                print(f"   WRONG: {len(bad)} configurations, e.g. {bad[0]['cfg']} err {bad[0]['err']}", flush=True)
            res += rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
