"""Where a cpu-fast decode step goes when it runs as one native call (edgellm/backends/cpu_step.py).

    python benchmarks/profile_cpu_step.py [--model PATH] [-n 64] [--ctx 256] [--threads N]

Decodes n tokens greedily after a short prompt, first timing whole steps (model.forward, what a
user's decode loop pays), then with the step's per-op timers on (each op's wall time up to the
barrier that ends it, taken by one thread), and prints per op kind: ops per step, time per step,
share of the step, and for the products the bytes of weight blocks read and their rate. The same
steps through the interpreter (EDGELLM_NATIVE_STEP=0 in a second load) give the comparison.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import edgellm  # noqa: E402
from edgellm.backends.cpu_native import FORMATS  # noqa: E402
from edgellm.backends.cpu_step import FMT  # noqa: E402
from edgellm.bench.device import cpu_name  # noqa: E402


def decode_program(m):
    return next(p for p in m.programs.values() if getattr(p, "max_seq", None) == 1)


def steps_ms(m, n: int, start: int) -> float:
    tok = 7
    t0 = time.perf_counter()
    for i in range(n):
        tok = int(np.argmax(m.forward([tok], start + i, all_logits=False)[-1]))
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("-n", type=int, default=64, help="decode steps per measurement")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    results = {}
    for flag in ("1", "0"):
        os.environ["EDGELLM_NATIVE_STEP"] = flag
        m = edgellm.load(a.model, backend="cpu-fast", ctx=a.ctx)
        prompt = [1, 2, 3, 4, 5, 6, 7, 8]
        m.forward(prompt, 0, all_logits=False)
        steps_ms(m, 8, len(prompt))  # warm
        results[flag] = steps_ms(m, a.n, len(prompt) + 8)
        prog = decode_program(m)
        if flag == "1":
            step = prog._native_step()
            if step is None:
                sys.exit(f"the decode step is not native here: {prog.step_unavailable}")
            pos = len(prompt) + 8 + a.n
            m.forward([7], pos, all_logits=False)
            step.profile(True)
            for i in range(a.n):
                m.forward([7], pos + 1 + i, all_logits=False)
            ns = step.op_ns.numpy() / a.n
            step.profile(False)
            by_kind, count, nbytes = defaultdict(float), defaultdict(int), defaultdict(int)
            for k, (kind, t) in enumerate(zip(step.kinds, ns)):
                r = step.ops[k]
                if kind.startswith("linear"):  # products by shape and format
                    fmt = next(name for name, code in FMT.items() if code == r.fmt)
                    kind = f"{kind} {r.n}x{r.k} {fmt}"
                    nbytes[kind] += r.n * r.k // 32 * FORMATS[fmt]
                by_kind[kind] += t / 1e6
                count[kind] += 1
            total = ns.sum() / 1e6
        del m

    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu_name()}, {torch.get_num_threads()} threads, "
          f"model {os.path.basename(str(a.model or 'default'))}, ctx {a.ctx}, {a.n} steps")
    print(f"decode step (model.forward): native {results['1']:.2f} ms ({1e3 / results['1']:.1f} tok/s), "
          f"interpreter {results['0']:.2f} ms ({1e3 / results['0']:.1f} tok/s)")
    print(f"inside the native call: {total:.2f} ms a step\n")
    print("| op kind (products: rows x columns, format) | per step | ms a step | share | weight bytes | GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in sorted(by_kind, key=lambda k: -by_kind[k]):
        gb = f"{nbytes[kind] / 1e6:.1f} MB | {nbytes[kind] / (by_kind[kind] * 1e-3) / 1e9:.1f}" if nbytes[kind] else " | "
        print(f"| {kind} | {count[kind]} | {by_kind[kind]:.3f} | {by_kind[kind] / total:.0%} | {gb} |")


if __name__ == "__main__":
    main()
