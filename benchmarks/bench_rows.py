"""Batched decode on the cuda backend (the rows program of edgellm.session.SlotPool), on a GPU.

    python benchmarks/bench_rows.py [--model llama-3.2-1b:Q4_0] [--rows 1 2 4 8 16 32] [--ctx 1024]
                                    [--profile N ...] [--gemm-sweep] [--set NAME=VALUE] [--json OUT.json]

1. check: every slot holds its own prompt (lengths differ); one rows step over all slots is
   compared with each slot's single-token program at the same position (logits, argmax).
2. steps: ms per rows step (SlotPool.decode_tokens, greedy: what the server runs, host work and
   the token read-back included) for each row count, its aggregate tok/s, and the weights' read
   rate (resident weights / step time); beside it the single-sequence greedy decode loop (as
   `edgellm run`) of the same file. (A step of one row runs the slot's single-token program.)
3. --profile N [N ...]: torch.profiler over steps of N rows (CUPTI records the kernels inside the
   graph replays): per kernel and grid, launches and device time per step; the step's wall time,
   its span on the device and the kernels' busy time (wall - busy: host work and launch gaps).
4. --gemm-sweep: the GEMM kernel at M = 4, 8, 16 and 32 rows on the model's weight shapes (q|k|v
   and gate|up stacked, as the rows program runs them), every candidate tile and split-K count
   timed (CUDA graph, weights rotated past the L2), best vs the default (configs.gemm_default),
   and the decode GEMV beside it at M <= 8, to set the skinny-GEMM defaults.
A synthetic file of the preset's shape is written once (no network needed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

DRY = "--dry-run" in sys.argv  # a tiny model through Triton's interpreter on the CPU: checks this script
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["EDGELLM_CUDA_DEVICE"] = "cpu"

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import edgellm  # noqa: E402
from edgellm.sampling import SamplingParams  # noqa: E402
from edgellm.backends.cuda.backend import SKINNY_TUNE_KERNEL  # noqa: E402
from edgellm.session import SlotPool  # noqa: E402
from edgellm.synthetic import SyntheticSpec, preset, write_synthetic_gguf  # noqa: E402


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def model_file(spec: str, folder: str) -> str:
    name, _, fmt = spec.partition(":")
    path = os.path.join(folder, f"{name}-{fmt}{'-dry' if DRY else ''}.gguf")
    if not os.path.exists(path):
        print(f"writing {path}", flush=True)
        spec = (SyntheticSpec(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64,
                              weight_type=fmt, std=0.1) if DRY else preset(name, weight_type=fmt))
        write_synthetic_gguf(path, spec, fast=True)
    return path


def check(m, pool, rng, lens=(2, 200)) -> dict:
    vocab = m.config.vocab_size
    lens = [int(x) for x in rng.integers(min(lens[0], m.ctx // 2 - 1), min(lens[1], m.ctx // 2), pool.n)]
    for slot, n in zip(pool.slots, lens):
        m.forward(rng.integers(0, vocab, n).tolist(), 0, all_logits=False, slot=slot)
    order = list(rng.permutation(pool.n))
    steps = [(pool.slots[i], int(rng.integers(0, vocab)), lens[i]) for i in order]
    rows = pool.decode(steps)
    alone = np.stack([m.forward([t], p, all_logits=False, slot=s)[-1] for s, t, p in steps])
    err = float(np.abs(rows - alone).max() / np.abs(alone).max())
    agree = float((rows.argmax(-1) == alone.argmax(-1)).mean())
    print(f"check: {pool.n} rows vs each slot's single-token program: max |diff| / max |logit| = {err:.2e}, "
          f"argmax agreement {agree:.3f}", flush=True)
    return {"rows": pool.n, "rel_err": err, "argmax_agree": agree}


def time_steps(m, pool, row_counts, reps: int, weight_bytes: int) -> list[dict]:
    out = []
    vocab = m.config.vocab_size
    for n in row_counts:
        slots = pool.slots[:n]
        pos = [len(s.tokens) for s in slots]
        need = [False] * n
        for _ in range(3):  # compile, capture, replay
            pool.decode_tokens([(s, 1, p) for s, p in zip(slots, pos)], need)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            pool.decode_tokens([(s, int(i % vocab), p) for i, (s, p) in enumerate(zip(slots, pos))], need)
        dt = (time.perf_counter() - t0) / reps
        r = {"rows": n, "ms_per_step": dt * 1e3, "agg_tps": n / dt, "weights_GBps": weight_bytes / dt / 1e9}
        print(f"rows {n:3d}: {r['ms_per_step']:8.3f} ms/step  {r['agg_tps']:9.1f} tok/s aggregate  "
              f"weights read at {r['weights_GBps']:7.0f} GB/s", flush=True)
        out.append(r)
    return out


def profile_steps(m, pool, rows: int, reps: int) -> dict:
    import tempfile
    from collections import defaultdict

    from profile_decode import _busy_us, _kernels
    from torch.profiler import ProfilerActivity, profile

    slots = pool.slots[:rows]
    pos = [len(s.tokens) for s in slots]
    need = [False] * rows
    for _ in range(3):
        pool.decode_tokens([(s, 1, p) for s, p in zip(slots, pos)], need)
    sync()
    with profile(activities=[ProfilerActivity.CPU if DRY else ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(reps):
            pool.decode_tokens([(s, 1 + i, p) for s, p in zip(slots, pos)], need)
        sync()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        kernels = _kernels(prof, tmp)
    per = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        entry = per[f"{e['name'][:60]} {list(e['grid']) if e['grid'] else ''}"]
        entry[0] += 1
        entry[1] += e["dur"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    busy = _busy_us(spans) / reps
    # each step's span on the device: from its first kernel (the embedding read) to the start of
    # the next step's; wall - span is host time between steps, span - busy the gaps between kernels
    starts = sorted(e["ts"] for e in kernels if e["name"].startswith("_embedding"))
    end = max((b for _, b in spans), default=0.0)
    span = sum(min(max((b for a, b in spans if s0 <= a < s1), default=s0), s1) - s0
               for s0, s1 in zip(starts, starts[1:] + [end + 1.0])) / max(1, len(starts))
    table = sorted(({"kernel": k, "per_step": c / reps, "us_per_step": t / reps} for k, (c, t) in per.items()),
                   key=lambda r: -r["us_per_step"])
    res = {"rows": rows, "wall_us_per_step": 1e6 * wall / reps, "busy_us_per_step": busy, "span_us_per_step": span,
           "kernels_per_step": len(kernels) / reps, "kernels": table}
    print(f"profile, {rows} rows: wall {res['wall_us_per_step']:.1f} us/step, device span {span:.1f}, "
          f"kernels busy {busy:.1f} us/step, "
          f"{res['kernels_per_step']:.0f} kernels/step", flush=True)
    for r in table[:25]:
        print(f"  {r['us_per_step']:8.1f} us  x{r['per_step']:5.1f}  {r['kernel']}", flush=True)
    return res


def single_stream(m, tokens: int) -> float:
    from edgellm.model import GenerationStats

    greedy = SamplingParams(temperature=0)
    list(m.generate_tokens([1, 2, 3], 8, greedy))
    st = GenerationStats(prompt_tokens=3)
    list(m.generate_tokens([1, 2, 3], tokens, greedy, st))
    print(f"single sequence, greedy decode loop (as `edgellm run`): {st.decode_tps:.1f} tok/s", flush=True)
    return st.decode_tps


def gemm_sweep(m, rows=(4, 8, 16, 32)) -> list[dict]:
    """Each weight shape of the rows program (q|k|v and gate|up stacked, as it runs them) at M rows:
    the default skinny config, every candidate tile and split-K count, and for M <= 8 the decode
    GEMV (float and int8 activations) that a rows step of that size runs now."""
    from bench_kernels import graph_time, rotated_copies

    from edgellm.backends.cuda import kernels as K
    from edgellm.backends.cuda.kernels import configs

    W = m.backend.weights
    blk = "blk.0."
    head = "output.weight" if "output.weight" in m.file.tensors else "token_embd.weight"
    shapes = {"qkv": [blk + "attn_q.weight", blk + "attn_k.weight", blk + "attn_v.weight"],
              "o": [blk + "attn_output.weight"], "gate_up": [blk + "ffn_gate.weight", blk + "ffn_up.weight"],
              "down": [blk + "ffn_down.weight"], "head": [head]}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cands = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=3, SPLIT_K=sk)
             for bm in (16, 32) for bn in (32, 64) for bk in (64, 128) for w in (2, 4) for sk in (1, 2, 4, 8, 16)]
    out = []
    for what, names in shapes.items():
        w = W.packed(*names)
        pool = rotated_copies(w)  # rotated through so that each launch reads DRAM, not the L2
        for M in rows:
            x = torch.randn((M, w.in_features), device="cuda").half()
            y = torch.empty((M, w.out_features), device="cuda", dtype=torch.float16)

            def run(c, **kw):
                def fn():
                    for p in pool:
                        K.linear(x, p, out=y, config=c, **kw)
                return graph_time(fn, inner=len(pool), reps=5, min_ms=10)
            r = {"weight": what, "shape": list(w.shape), "fmt": w.fmt, "M": M}
            if M <= configs.DECODE_MAX_TOKENS:
                r["gemv_us"] = run(None) * 1e6
                if w.fmt != "F16":
                    r["gemv_i8_us"] = run(None, act_int8=True) * 1e6
            default = configs.gemm_default(M, w.out_features, sms, w.in_features)
            t_def = run(default, decode_max_tokens=0)  # the GEMM kernel at any M
            best, t_best = default, t_def
            for c in cands:
                if c["BLOCK_M"] > max(16, M) or (what == "head" and c["SPLIT_K"] > 1):
                    continue
                try:
                    t = run(c, decode_max_tokens=0)
                except Exception as e:  # a tile that does not compile here
                    print(f"  skip {c}: {type(e).__name__}", flush=True)
                    continue
                if t < t_best:
                    best, t_best = c, t
            r.update({"default": default, "default_us": t_def * 1e6, "best": best, "best_us": t_best * 1e6,
                      "default_GBps": w.nbytes / t_def / 1e9, "best_GBps": w.nbytes / t_best / 1e9})
            gemv = "".join(f", {k[:-3]} {r[k]:.1f} us" for k in ("gemv_us", "gemv_i8_us") if k in r)
            print(f"gemm {what:7s} {str(tuple(w.shape)):15s} {w.fmt} M={M:2d}: default {t_def * 1e6:7.1f} us "
                  f"({r['default_GBps']:5.0f} GB/s), best {t_best * 1e6:7.1f} us ({r['best_GBps']:5.0f} GB/s) "
                  f"{best}{gemv}", flush=True)
            out.append(r)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b:Q4_0", help="PRESET:FMT of edgellm.synthetic, or a .gguf path")
    p.add_argument("--folder", default="/tmp/edgellm-bench-rows", help="where synthetic files are written")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--ctx", type=int, default=1024, help="context per slot")
    p.add_argument("--reps", type=int, default=50, help="timed steps per row count")
    p.add_argument("--lens", type=int, nargs=2, default=[2, 200], metavar=("LO", "HI"),
                   help="cached tokens of each slot before the timed steps: drawn in [LO, HI) (attention's keys)")
    p.add_argument("--profile", type=int, nargs="*", default=[], metavar="ROWS",
                   help="profile the kernels of steps of these row counts")
    p.add_argument("--gemm-sweep", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="set an attribute of the cuda kernels' configs module first (A/B of a default)")
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="a tiny model in Triton's interpreter (no GPU)")
    args = p.parse_args()
    if DRY:
        args.rows, args.reps, args.ctx, args.gemm_sweep = [1, 3], 1, 16, False
    elif not torch.cuda.is_available():
        sys.exit("bench_rows: needs a GPU")
    from edgellm.backends.cuda.kernels import configs
    for item in args.set:
        name, _, value = item.partition("=")
        if not hasattr(configs, name):
            sys.exit(f"bench_rows: configs has no attribute {name!r}")
        setattr(configs, name, type(getattr(configs, name))(value))
        print(f"configs.{name} = {getattr(configs, name)!r}", flush=True)
    os.makedirs(args.folder, exist_ok=True)
    path = args.model if args.model.endswith(".gguf") else model_file(args.model, args.folder)
    m = edgellm.load(path, backend="cuda", ctx=args.ctx)
    print(f"{path}: {m.backend.describe()}", flush=True)
    pool = SlotPool(m, max(args.rows))
    if pool.batch is None:
        sys.exit("bench_rows: the cuda backend did not compile the rows program")
    tuner = getattr(m.backend, "tuner", None)
    picks = [p for p in (tuner.report() if tuner is not None else []) if p["kernel"] == SKINNY_TUNE_KERNEL]
    for key, p in {p["key"]: p for p in picks}.items():  # the tuner's skinny-GEMM picks (rows buckets)
        us = f"{p['us']:.1f} us (default {p['default_us']:.1f})" if p.get("us") and p.get("default_us") else ""
        print(f"tuned gemm_skinny {key}: {p['source']} {us} {p['config']}", flush=True)
    rng = np.random.default_rng(0)
    res = {"model": path, "device": "interpreter" if DRY else torch.cuda.get_device_name(0),
           "skinny_picks": [dict(p, key=list(p["key"])) for p in picks], "check": check(m, pool, rng, args.lens)}
    wbytes = m.backend.resident_weight_bytes(m.file)
    res["steps"] = time_steps(m, pool, args.rows, args.reps, wbytes)
    res["single_tps"] = single_stream(m, 4 if DRY else 128)
    for r in res["steps"]:
        print(f"rows {r['rows']:3d}: {r['agg_tps'] / res['single_tps']:.2f}x the single sequence's tok/s")
    res["profile"] = [profile_steps(m, pool, n, 20) for n in args.profile if n <= pool.n]
    if args.gemm_sweep:
        res["gemm"] = gemm_sweep(m)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0 if res["check"]["argmax_agree"] >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
