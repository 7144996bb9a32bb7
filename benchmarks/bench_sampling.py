"""Host time of one token's sampling (edgellm.sampling.Sampler) against a plain full-sort sampler
(the chain as written before 2026-11-28: a stable float64 sort of the whole vocabulary), on random
logits of the default model's and Llama 3's vocabulary sizes, for the CLI's defaults, the
server's (OpenAI defaults: no top-k, top-p 1), and a nucleus without top-k.

    python benchmarks/bench_sampling.py [--vocab 49152,128256] [--spread 3.0] [-n 200]
    python benchmarks/bench_sampling.py --decode [-m MODEL.gguf] [--backend cpu-fast|cuda] [-r 3] [--tokens 64]
    python benchmarks/bench_sampling.py --kernels [--vocab 128256] [--rows 1,16]   # cuda: device time

--spread is the logits' standard deviation (3 is about a trained model's; small values make the
distribution flat, the nucleus large and the partition path slowest). Prints a Markdown table of
milliseconds per token (median of -n draws) and the speed-up.

--decode measures what a user meets instead: a model's decode (64 tokens; temperature 1.5 where
sampled, so that no early end of turn cuts a run short), wall time per token after the first:
greedy; each parameter set above drawn on the device (backends that sample there: cuda, webgpu)
and on the host (EDGELLM_DEVICE_SAMPLING=0); the full-sort sampler swapped in; interleaved -r
times, each timed run after an untimed one of the same mode.
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
    "min-p alone (no top-k, top-p 1, min-p 0.05, T 1)": dict(top_k=0, top_p=1.0, min_p=0.05, temperature=1.0),
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


def decode(model: str | None, backend: str, repeats: int, tokens: int = 64) -> None:
    import os

    import edgellm
    import edgellm.model as edgellm_model

    m = edgellm.load(model, backend=backend)
    ids = m.tokenizer.encode("Write a long story about a dragon who learns to cook.")
    draws_on = getattr(m.programs["decode"], "draws_on_device", None)  # which parameters the device loop takes

    class FullSort:
        def __init__(self, params):
            self.params, self.draw = params, full_sort(params, params.seed or 0)

        def __call__(self, logits, history=None):
            return self.draw(logits)

        def device_draw(self):
            return None

    def rate(params: SamplingParams, seed: int) -> float | None:
        """tokens/s after the first, or None for a run under half the tokens (an early end of turn).
        An untimed run of the same parameters first: a GPU idle during the mode before (a host
        sampler's) lowers its clock, which a run of a few hundred ms would meet still rising (the
        first mode of each round, greedy, read 0.73-0.79 of its first round's rate after the host
        full sort on the H200, 2026-12-01)."""
        for _ in m.generate_tokens(ids, tokens, SamplingParams(**{**params.__dict__, "seed": seed})):
            pass
        it = m.generate_tokens(ids, tokens, SamplingParams(**{**params.__dict__, "seed": seed}))
        if next(it, None) is None:
            return None
        t = time.perf_counter()
        n = sum(1 for _ in it)
        return n / (time.perf_counter() - t) if n >= tokens // 2 - 1 else None

    # (name, parameters, sampler, draws on the device)
    modes = [("greedy", SamplingParams(temperature=0), Sampler, True)]
    for name, kw in CASES.items():
        params = SamplingParams(**{**kw, "temperature": max(kw.get("temperature", 0.8), 1.5)})
        if draws_on is not None and draws_on(params):
            modes.append((f"{name}, device draw", params, Sampler, True))
        modes.append((f"{name}, host draw", params, Sampler, False))
    modes.append(("CLI defaults, host full sort (before 2026-11-28)", SamplingParams(temperature=1.5), FullSort, False))
    rates = {name: [] for name, *_ in modes}
    for name, params, cls, device in modes:  # first runs: kernel compiles and CUDA graph captures
        edgellm_model.Sampler = cls
        os.environ["EDGELLM_DEVICE_SAMPLING"] = "1" if device else "0"
        for _ in m.generate_tokens(ids, tokens, params):
            pass
    for rep in range(repeats):
        for name, params, cls, device in modes:
            edgellm_model.Sampler = cls
            os.environ["EDGELLM_DEVICE_SAMPLING"] = "1" if device else "0"
            r = next((v for seed in range(100 * rep, 100 * rep + 20) if (v := rate(params, seed)) is not None), None)
            if r is not None:
                rates[name].append(r)
    edgellm_model.Sampler = Sampler
    os.environ.pop("EDGELLM_DEVICE_SAMPLING", None)
    print(f"{m.path} on {backend}, vocabulary {m.config.vocab_size:,}: decode tok/s after the first token "
          f"({tokens} tokens, temperature 1.5 where sampled; wall time, median of {repeats})")
    print("| sampling | tok/s | runs |")
    print("|---|---:|---|")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(r):.1f} | {', '.join(f'{v:.1f}' for v in r)} |" if r else
              f"| {name} | - | no run |")


def kernels(vocab: int, rows_list: list[int], spread: float) -> None:
    """Device time of one token choice per row on cuda (kernels/sampling.py), inside CUDA graphs as
    the decode loop runs it: argmax; a Gumbel-max draw with no cut (the server's defaults); the
    CLI's defaults (top-k 40: torch.topk, then the cut kernel, then the draw); a nucleus without
    top-k (a sort of the row, the cut, the draw)."""
    import torch

    from edgellm.backends.cuda import kernels as K
    from edgellm.backends.cuda.backend import DeviceChooser
    from edgellm.sampling import DeviceDraw

    dev = torch.device("cuda")
    print(f"| rows | vocabulary | choice | us per step (CUDA graph, median of 5 x 50) |")
    print("|---:|---:|---|---:|")
    for rows in rows_list:
        logits = (torch.randn(rows, vocab, device=dev) * spread).half()
        pos = torch.arange(rows, dtype=torch.int64, device=dev)
        cases = {"argmax": None, **{name: SamplingParams(**kw) for name, kw in CASES.items()}}
        for name, params in cases.items():
            draws = [None if params is None else DeviceDraw(params, 1 + i) for i in range(rows)]
            chooser = DeviceChooser(K, draws, dev, vocab)
            chooser(logits, pos)  # compile
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(50):
                    chooser(logits, pos)
            times = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / 50)
            print(f"| {rows} | {vocab:,} | {name} | {statistics.median(times):.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", default="49152,128256")
    ap.add_argument("--spread", type=float, default=3.0)
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--backend", default="cpu-fast")
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per --decode run (default 64)")
    ap.add_argument("--kernels", action="store_true", help="device time of the cuda token choice kernels")
    ap.add_argument("--rows", default="1,16", help="rows for --kernels (default 1,16)")
    a = ap.parse_args()
    if a.kernels:
        kernels(int(a.vocab.split(",")[-1]), [int(r) for r in a.rows.split(",")], a.spread)
        return
    if a.decode:
        decode(a.model, a.backend, a.r, a.tokens)
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
