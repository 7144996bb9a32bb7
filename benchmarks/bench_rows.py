"""Batched decode on the cuda backend (the rows program of edgellm.session.SlotPool), on a GPU.

    python benchmarks/bench_rows.py [--model llama-3.2-1b:Q4_0] [--rows 1 2 4 8 16 32] [--ctx 1024]
                                    [--gemm-sweep] [--json OUT.json]

1. check: every slot holds its own prompt (lengths differ); one rows step over all slots is
   compared with each slot's single-token program at the same position (logits, argmax).
2. steps: ms per rows step (SlotPool.decode_tokens, greedy: what the server runs, host work and
   the token read-back included) for each row count, its aggregate tok/s, and the weights' read
   rate (resident weights / step time); beside it the single-sequence greedy decode loop (as
   `edgellm run`) of the same file. (A step of one row runs the slot's single-token program.)
3. --gemm-sweep: the linear kernel at M = 16 and 32 rows on the model's weight shapes, every
   candidate tile timed (CUDA graph, weights rotated past the L2), best vs the default
   (configs.gemm_default), to set the skinny-GEMM default.
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


def check(m, pool, rng) -> dict:
    vocab = m.config.vocab_size
    lens = [int(x) for x in rng.integers(2, min(200, m.ctx // 2), pool.n)]
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


def single_stream(m, tokens: int) -> float:
    from edgellm.model import GenerationStats

    greedy = SamplingParams(temperature=0)
    list(m.generate_tokens([1, 2, 3], 8, greedy))
    st = GenerationStats(prompt_tokens=3)
    list(m.generate_tokens([1, 2, 3], tokens, greedy, st))
    print(f"single sequence, greedy decode loop (as `edgellm run`): {st.decode_tps:.1f} tok/s", flush=True)
    return st.decode_tps


def gemm_sweep(m, rows=(16, 32)) -> list[dict]:
    from bench_kernels import graph_time, l2_bytes

    from edgellm.backends.cuda import kernels as K
    from edgellm.backends.cuda.kernels import configs

    cfg = m.config
    W = m.backend.weights
    names = {"q": "blk.0.attn_q.weight", "k": "blk.0.attn_k.weight", "o": "blk.0.attn_output.weight",
             "gate": "blk.0.ffn_gate.weight", "down": "blk.0.ffn_down.weight"}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cands = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
             for bm in (16, 32) for bn in (32, 64, 128) for bk in (64, 128) for w in (2, 4) for st in (3,)]
    out = []
    for what, name in names.items():
        w = W.packed(name)
        # copies of the weight, rotated through so that each launch reads DRAM, not the L2
        raw = m.file.tensor(name)
        n_copies = min(16, max(1, -(-4 * l2_bytes() // max(w.nbytes, 1))))
        pool = [w] + [K.repack(np.ascontiguousarray(raw.data), raw.type_name, raw.shape, device="cuda")
                      for _ in range(n_copies - 1 if K.can_repack(raw.type_name) else 0)]
        for M in rows:
            x = torch.randn((M, w.in_features), device="cuda").half()
            y = torch.empty((M, w.out_features), device="cuda", dtype=torch.float16)

            def run(c):
                def fn():
                    for p in pool:
                        K.linear(x, p, out=y, config=c)
                return graph_time(fn, inner=len(pool), reps=5, min_ms=10)
            default = configs.gemm_default(M, w.out_features, sms)
            t_def = run(default)
            best, t_best = default, t_def
            for c in cands:
                if c["BLOCK_M"] < min(32, max(16, M)) and M > 16:
                    continue
                try:
                    t = run(c)
                except Exception as e:  # a tile that does not compile here
                    print(f"  skip {c}: {type(e).__name__}", flush=True)
                    continue
                if t < t_best:
                    best, t_best = c, t
            r = {"weight": what, "shape": list(w.shape), "fmt": w.fmt, "M": M, "default": default,
                 "default_us": t_def * 1e6, "best": best, "best_us": t_best * 1e6,
                 "default_GBps": w.nbytes / t_def / 1e9, "best_GBps": w.nbytes / t_best / 1e9}
            print(f"gemm {what:5s} {str(tuple(w.shape)):14s} {w.fmt} M={M:2d}: default {t_def * 1e6:8.1f} us "
                  f"({r['default_GBps']:5.0f} GB/s), best {t_best * 1e6:8.1f} us ({r['best_GBps']:5.0f} GB/s) {best}",
                  flush=True)
            out.append(r)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b:Q4_0", help="PRESET:FMT of edgellm.synthetic, or a .gguf path")
    p.add_argument("--folder", default="/tmp/edgellm-bench-rows", help="where synthetic files are written")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--ctx", type=int, default=1024, help="context per slot")
    p.add_argument("--reps", type=int, default=50, help="timed steps per row count")
    p.add_argument("--gemm-sweep", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="a tiny model in Triton's interpreter (no GPU)")
    args = p.parse_args()
    if DRY:
        args.rows, args.reps, args.ctx, args.gemm_sweep = [1, 3], 1, 16, False
    elif not torch.cuda.is_available():
        sys.exit("bench_rows: needs a GPU")
    os.makedirs(args.folder, exist_ok=True)
    path = args.model if args.model.endswith(".gguf") else model_file(args.model, args.folder)
    m = edgellm.load(path, backend="cuda", ctx=args.ctx)
    print(f"{path}: {m.backend.describe()}", flush=True)
    pool = SlotPool(m, max(args.rows))
    if pool.batch is None:
        sys.exit("bench_rows: the cuda backend did not compile the rows program")
    rng = np.random.default_rng(0)
    res = {"model": path, "device": "interpreter" if DRY else torch.cuda.get_device_name(0),
           "check": check(m, pool, rng)}
    wbytes = m.backend.resident_weight_bytes(m.file)
    res["steps"] = time_steps(m, pool, args.rows, args.reps, wbytes)
    res["single_tps"] = single_stream(m, 4 if DRY else 128)
    for r in res["steps"]:
        print(f"rows {r['rows']:3d}: {r['agg_tps'] / res['single_tps']:.2f}x the single sequence's tok/s")
    if args.gemm_sweep:
        res["gemm"] = gemm_sweep(m)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0 if res["check"]["argmax_agree"] >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
