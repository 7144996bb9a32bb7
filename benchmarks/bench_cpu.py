"""Load time, prefill and decode speed of a backend on a model (default: the embedded model, cpu).

    python benchmarks/bench_cpu.py [--model PATH] [--backend cpu] [-p 128] [-n 64] [-r 3]

Prefill: one forward pass over p prompt tokens from an empty cache (llama-bench's pp test).
Decode: n single-token steps after a 1-token prompt (llama-bench's tg test). Medians of r runs
after one warm-up; the spread is printed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import edgellm  # noqa: E402
from edgellm.bench.device import cpu_name  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("-p", type=int, default=128, help="prompt tokens")
    ap.add_argument("-n", type=int, default=64, help="generated tokens")
    ap.add_argument("-r", type=int, default=3, help="repetitions")
    a = ap.parse_args()

    t0 = time.perf_counter()
    m = edgellm.load(a.model, backend=a.backend, ctx=a.p + a.n + 8)
    m.forward([1], 0, all_logits=False)  # first call: weights converted lazily on some backends
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, m.config.vocab_size, a.p).tolist()

    def prefill() -> float:
        t = time.perf_counter()
        m.forward(prompt, 0, all_logits=False)
        return a.p / (time.perf_counter() - t)

    def decode() -> float:
        m.forward([1], 0, all_logits=False)
        tok = int(rng.integers(3, m.config.vocab_size))
        t = time.perf_counter()
        for i in range(a.n):
            logits = m.forward([tok], 1 + i, all_logits=False)
            tok = int(np.argmax(logits[-1]))
        return a.n / (time.perf_counter() - t)

    prefill(), decode()  # warm-up
    pp = [prefill() for _ in range(a.r)]
    tg = [decode() for _ in range(a.r)]

    def fmt(xs):
        return f"{statistics.median(xs):9.1f} tok/s  (min {min(xs):.1f}, max {max(xs):.1f})"

    print(f"model    {m.path}")
    print(f"backend  {m.backend.describe()}")
    print(f"machine  {cpu_name()}, {os.cpu_count()} cores")
    print(f"load     {load_s:.2f} s (to first token ready)")
    print(f"pp{a.p:<5} {fmt(pp)}")
    print(f"tg{a.n:<5} {fmt(tg)}")


if __name__ == "__main__":
    main()
