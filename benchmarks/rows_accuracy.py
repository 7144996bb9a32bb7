"""Accuracy of the cuda backend's three paths against the cpu backend (float32 reference), on a GPU.

    python benchmarks/rows_accuracy.py MODEL.gguf

Eight random prompts plus one token each: the logits of the prefill program (edgellm.load(...).logits),
of a batched decode step (edgellm.session.SlotPool.decode) at 1, 3 and 8 rows, and of each slot's
single-token decode program, each as max |difference| / max |reference logit| against the cpu
backend. Rows steps of up to configs.ROWS_GEMV_MAX_TOKENS rows and the single-token program take
the decode GEMV (int8 activations for the formats that use them), larger rows steps the GEMM.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import edgellm  # noqa: E402
from edgellm.session import SlotPool  # noqa: E402


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    path = sys.argv[1]
    t0 = time.time()
    cpu = edgellm.load(path, backend="cpu", ctx=64)
    m = edgellm.load(path, backend="cuda", ctx=64)
    print(f"{path}: loaded in {time.time() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    vocab = m.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (3, 5, 2, 7, 4, 6, 3, 5)]
    toks = [int(t) for t in rng.integers(0, vocab, len(prompts))]
    refs = [cpu.logits(pr + [t])[-1] for pr, t in zip(prompts, toks)]
    pre = [m.logits(pr + [t])[-1] for pr, t in zip(prompts, toks)]
    print("prefill vs cpu:", " ".join(f"{rel(a, b):.1e}" for a, b in zip(pre, refs)), flush=True)
    for n in (1, 3, 8):
        pool = SlotPool(m, len(prompts))
        for s, pr in zip(pool.slots[:n], prompts):
            m.forward(pr, 0, all_logits=False, slot=s)
        rows = pool.decode([(s, t, len(pr)) for s, t, pr in zip(pool.slots[:n], toks, prompts)])
        print(f"rows {n} vs cpu:", " ".join(f"{rel(rows[i], refs[i]):.1e}" for i in range(n)), flush=True)
        single = [m.forward([t], len(pr), all_logits=False, slot=s)[-1]
                  for s, t, pr in zip(pool.slots[:n], toks, prompts)]
        print("single-token program vs cpu:", " ".join(f"{rel(single[i], refs[i]):.1e}" for i in range(n)),
              flush=True)
        del pool
    return 0


if __name__ == "__main__":
    sys.exit(main())
