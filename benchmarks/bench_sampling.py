"""Host time of one token's sampling (edgellm.sampling.Sampler) against a plain full-sort sampler
(the chain as written before 2026-11-28: a stable float64 sort of the whole vocabulary), on random
logits of the default model's and Llama 3's vocabulary sizes, for the CLI's defaults, the
server's (OpenAI defaults: no top-k, top-p 1), and a nucleus without top-k.

    python benchmarks/bench_sampling.py [--vocab 49152,128256] [--spread 3.0] [-n 200]
    python benchmarks/bench_sampling.py --decode [-m MODEL.gguf] [--backend cpu-fast] [-r 3]

--spread is the logits' standard deviation (3 is about a trained model's; small values make the
distribution flat, the nucleus large and the partition path slowest). Prints a Markdown table of
milliseconds per token (median of -n draws) and the speed-up.

--decode measures what a user meets instead: a model's sampled decode (64 tokens at temperature
1.5, so that no early end of turn cuts a run short), wall time per token after the first, with
edgellm's sampler and with the full-sort one swapped in, interleaved -r times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from edgellm.sampling import Sampler, SamplingParams

CASES = {
    "CLI defaults (top-k 40, top-p 0.95, min-p 0.05, T 0.8)": dict(),
    "server defaults (no top-k, top-p 1, T 1)": dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0),
    "nucleus (no top-k, top-p 0.9, min-p 0)": dict(top_k=0, top_p=0.9, min_p=0.0),
}


def full_sort(params: SamplingParams, seed: int):
    rng = np.random.default_rng(seed)

    def draw(logits):
        x = np.asarray(logits, dtype=np.float64)
        ids = np.argsort(-x, kind="stable")
        if params.top_k and params.top_k < len(ids):
            ids = ids[: params.top_k]
        vals = x[ids]
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        if params.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
            ids, vals, probs = ids[:keep], vals[:keep], probs[:keep]
        if params.min_p > 0:
            keep = probs >= params.min_p * probs[0]
            ids, vals = ids[keep], vals[keep]
        w = np.exp((vals - vals[0]) / params.temperature)
        return int(ids[rng.choice(len(ids), p=w / w.sum())])
    return draw


def per_token_ms(sample, logits: np.ndarray, n: int) -> float:
    sample(logits)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        sample(logits)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def decode(model: str | None, backend: str, repeats: int) -> None:
    import edgellm
    import edgellm.model as edgellm_model

    m = edgellm.load(model, backend=backend)
    ids = m.tokenizer.encode("Write a long story about a dragon who learns to cook.")

    class FullSort:
        def __init__(self, params):
            self.params, self.draw = params, full_sort(params, params.seed or 0)

        def __call__(self, logits, history=None):
            return self.draw(logits)

    def rate(seed: int) -> float | None:  # tokens/s after the first, or None for a run under 32 tokens
        it = m.generate_tokens(ids, 64, SamplingParams(seed=seed, temperature=1.5))
        if next(it, None) is None:
            return None
        t = time.perf_counter()
        n = sum(1 for _ in it)
        return n / (time.perf_counter() - t) if n >= 31 else None

    rates = {"edgellm": [], "full sort": []}
    for rep in range(repeats):
        for name, cls in (("edgellm", Sampler), ("full sort", FullSort)):
            edgellm_model.Sampler = cls
            r = next((v for seed in range(100 * rep, 100 * rep + 20) if (v := rate(seed)) is not None), None)
            if r is not None:
                rates[name].append(r)
    edgellm_model.Sampler = Sampler
    print(f"{m.path} on {backend}, vocabulary {m.config.vocab_size:,}: sampled decode tok/s (wall, per run)")
    for name, r in rates.items():
        print(f"  {name}: median {statistics.median(r):.1f} ({', '.join(f'{v:.1f}' for v in r)})" if r else f"  {name}: no run")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", default="49152,128256")
    ap.add_argument("--spread", type=float, default=3.0)
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--backend", default="cpu-fast")
    ap.add_argument("-r", type=int, default=3)
    a = ap.parse_args()
    if a.decode:
        decode(a.model, a.backend, a.r)
        return
    rng = np.random.default_rng(0)
    print("| vocabulary | parameters | full sort ms/token | edgellm ms/token | speed-up |")
    print("|---:|---|---:|---:|---:|")
    for v in [int(s) for s in a.vocab.split(",") if s]:
        logits = (rng.standard_normal(v) * a.spread).astype(np.float32)
        for name, kw in CASES.items():
            params = SamplingParams(seed=1, **kw)
            old = per_token_ms(full_sort(params, 1), logits, max(10, a.n // 10))
            new = per_token_ms(Sampler(params), logits, a.n)
            print(f"| {v:,} | {name} | {old:.2f} | {new:.3f} | {old / new:.0f}x |", flush=True)


if __name__ == "__main__":
    main()
