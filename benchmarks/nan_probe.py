"""Where a cuda run first makes a non-finite value: every op's outputs checked after it runs.

    python benchmarks/nan_probe.py MODEL.gguf [--tokens 512] [--chunk 512]

Runs the model's logits over the first --tokens tokens of README.md (three times over) on the cuda
backend with CUDA graphs off, and prints the first op (in run order) whose output holds a NaN or
an infinity, with its kind, the output's dtype, the rows affected and the largest finite value;
then the same with the cpu backend's logits for comparison."""

from __future__ import annotations

import argparse
import os
import sys

os.environ["EDGELLM_CUDA_GRAPHS"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import edgellm  # noqa: E402
from edgellm.backends.cuda import backend as cb  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, nargs="+", default=[512, 64])
    a = ap.parse_args()
    found: list[str] = []
    plain = cb.CudaProgram._lower

    def lower(self, op):
        fn = plain(self, op)

        def checked(env, s, c):
            r = fn(env, s, c)
            if not found:
                for o in op.outputs:
                    t = env.get(o)
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        bad = ~torch.isfinite(t)
                        if bad.any():
                            rows = bad.reshape(t.shape[0], -1).any(-1).nonzero().flatten().tolist() if t.dim() > 1 else []
                            fin = t[torch.isfinite(t)]
                            found.append(f"{op.name} ({op.kind}) -> {o} {tuple(t.shape)} {t.dtype}: rows {rows[:8]}"
                                         f"{'...' if len(rows) > 8 else ''} of {t.shape[0]}, inputs "
                                         f"{[(i, tuple(env[i].shape), str(env[i].dtype), float(env[i].float().abs().max())) for i in op.inputs if isinstance(env.get(i), torch.Tensor) and env[i].is_floating_point()][:4]}"
                                         f", max finite {float(fin.abs().max()) if fin.numel() else 'none'}")
            return r
        return checked

    cb.CudaProgram._lower = lower
    text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")).read() * 3
    for chunk in a.chunk:
        found.clear()
        m = edgellm.load(a.model, backend="cuda", ctx=1024, prefill_chunk=chunk, cache=False, warmup=False)
        ids = (m.tokenizer.encode(text) if m.tokenizer else
               np.random.default_rng(0).integers(0, m.config.vocab_size, a.tokens).tolist())[:a.tokens]
        la = m.logits(ids)
        nan_rows = np.where(~np.isfinite(la).all(-1))[0]
        print(f"chunk {chunk}: non-finite logit rows {len(nan_rows)} (first {nan_rows[:5].tolist()}); "
              f"first op: {found[0] if found else 'none'}", flush=True)
        del m
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
