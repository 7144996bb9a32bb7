"""The cuda backend on a GPU: fidelity against the cpu backend, then speed on synthetic models.

    python benchmarks/gpu_check.py [--model SmolLM2.gguf] [--speed 135m,1b,8b] [--formats F16,Q8_0,Q4_0]
                                   [--json OUT.json]

Fidelity (with --model): greedy 64-token continuations of cpu and cuda (or each of
--fidelity-backends, e.g. cuda,webgpu) for a few chat prompts,
and top-1 agreement / logit error over 512 teacher-forced positions.
Speed (llama-bench's method): synthetic random-weight GGUF models (edgellm.synthetic presets);
prefill p tokens from an empty cache (last logits only), decode n single-token steps from an
empty context (greedy: the argmax runs on the device and only the token id comes back);
warm-up, then the median of r runs. MBU = (weight bytes as the kernels read them + KV bytes
read at the mean position) per token / time per token / measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import edgellm  # noqa: E402
from edgellm.sampling import SamplingParams  # noqa: E402
from edgellm.synthetic import preset, write_synthetic_gguf  # noqa: E402

PRESETS = {"135m": "smollm2-135m", "1b": "llama-3.2-1b", "8b": "llama-3.1-8b"}
FIDELITY_PROMPTS = ("What is the capital of France?", "Write a short poem about the ocean.",
                    "Explain in two sentences why the sky is blue.")


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n / statistics.median(ts)


def fidelity(path: str, backend: str = "cuda") -> dict:
    cpu = edgellm.load(path, backend="cpu", ctx=1024)
    gpu = edgellm.load(path, backend=backend, ctx=1024)
    out = {"backend": backend, "prompts": []}
    for prompt in FIDELITY_PROMPTS:
        ids = cpu.prompt_tokens(prompt)
        a = list(cpu.generate_tokens(ids, 64, SamplingParams(temperature=0)))
        b = list(gpu.generate_tokens(ids, 64, SamplingParams(temperature=0)))
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        out["prompts"].append({"prompt": prompt, "identical": a == b, "first_divergence": first_diff,
                               "cpu": cpu.tokenizer.decode(a), backend: gpu.tokenizer.decode(b)})
    text = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read() * 3
    ids = cpu.tokenizer.encode(text)[:513]
    la, lb = cpu.logits(ids[:512]), gpu.logits(ids[:512])
    out["teacher_forced_positions"] = 512
    out["top1_agreement"] = float((la.argmax(-1) == lb.argmax(-1)).mean())
    out["max_abs_logit_err"] = float(np.abs(la - lb).max())
    out["mean_abs_logit_err"] = float(np.abs(la - lb).mean())
    out["logit_scale"] = float(np.abs(la).max())
    return out


def weight_bytes_read(m) -> int:
    """Bytes of the weights a decode step reads: every packed weight once; an untied embedding
    table is read one row per token, so it counts as one row (tied, it is the output projection)."""
    total = m.backend.weights.nbytes
    if not m.config.tied_output:
        emb = m.backend.weights.packed("token_embd.weight")
        total -= emb.nbytes - emb.nbytes // emb.shape[0]
    return total


def speed(name: str, fmt: str, p: int, n: int, reps: int, bw: float, tmp: str) -> dict:
    spec = preset(PRESETS[name], weight_type=fmt)
    path = os.path.join(tmp, f"{name}-{fmt}.gguf")
    t = time.perf_counter()
    write_synthetic_gguf(path, spec, fast=True)
    gen_s = time.perf_counter() - t
    res = {"model": name, "format": fmt, "gen_s": gen_s, **measure(path, p, n, reps, bw)}
    os.remove(path)
    return res


def distinct_picks(picks: list[dict]) -> list[dict]:
    """The tuner's picks, each (kernel, key) once (a program asks again for every layer), with how
    many times it was asked."""
    out: dict[tuple, dict] = {}
    for p in picks:
        k = (p["kernel"], tuple(p["key"]))
        if k in out:
            out[k]["picks"] += 1
        else:
            out[k] = dict(p, key=list(p["key"]), picks=1)
    return list(out.values())


def measure(path: str, p, n, reps: int, bw: float) -> dict:
    """edgellm cuda on one GGUF file, llama-bench's way: prefill each of p tokens from an empty
    cache, decode each of n tokens from an empty context (p, n: an int or a list of ints)."""
    ps = [p] if isinstance(p, int) else list(p)
    ns = [n] if isinstance(n, int) else list(n)
    t = time.perf_counter()
    m = edgellm.load(path, backend="cuda", ctx=max(ps + ns) + 16, prefill_chunk=max(ps))
    rng = np.random.default_rng(0)
    prompts = {q: rng.integers(0, m.config.vocab_size, q).tolist() for q in ps}
    m.forward(prompts[ps[0]], 0, all_logits=False)  # compiles the prefill kernels
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t
    K = m.backend.K
    dec = m.programs["decode"]

    def prefill(q: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.programs["last"].run({"tokens": prompts[q], "start_pos": 0})
        torch.cuda.synchronize()
        return q / (time.perf_counter() - t0)

    def decode(k: int) -> float:
        gen = dec.greedy_tokens(1, 0, k)
        next(gen)  # the first call compiles and captures; time the steady state from here
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = sum(1 for _ in gen)
        return got / (time.perf_counter() - t0)

    def decode_host(k: int) -> float:
        tok = 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(k):
            out = dec.run({"tokens": [tok], "start_pos": i})
            tok = int(K.argmax(out["logits"])[0])  # logits stay on the device; one sync per token
        return k / (time.perf_counter() - t0)

    res = {"file_GB": os.path.getsize(path) / 1e9, "load_s": load_s}
    for q in ps:
        prefill(q), prefill(q)  # warm-up: the first run compiles, the second captures the CUDA graph
        pp = [prefill(q) for _ in range(reps)]
        res.update({f"pp{q}": statistics.median(pp), f"pp{q}_min": min(pp), f"pp{q}_max": max(pp)})
    wbytes = weight_bytes_read(m)
    cfg = m.config
    res["weight_bytes"] = wbytes
    for k in ns:
        decode(k)  # warm-up (captures the graphs of every context bucket it reaches)
        tg = [decode(k) for _ in range(reps)]
        tg_med = statistics.median(tg)
        kv_read = 2 * cfg.n_layers * (k / 2) * cfg.kv_dim * 2  # fp16 K and V rows at the mean position
        res.update({f"tg{k}": tg_med, f"tg{k}_min": min(tg), f"tg{k}_max": max(tg),
                    f"tg{k}_mbu": (wbytes + kv_read) * tg_med / bw})
    res[f"tg{ns[0]}_host_loop"] = statistics.median([decode_host(ns[0]) for _ in range(reps)])
    res["mbu"] = res[f"tg{ns[0]}_mbu"]
    tuner = getattr(m.backend, "tuner", None)
    if tuner is not None:  # which launch configurations the decode GEMVs ran with, and why
        res["tuning"] = distinct_picks(tuner.report())
    del m
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--fidelity-backends", default="cuda", help="backends checked against cpu with --model")
    ap.add_argument("--speed", default="135m,1b,8b")
    ap.add_argument("--formats", default="F16,Q8_0,Q4_0")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    report["triton"] = triton.__version__
    bw = copy_bandwidth()
    report["copy_bandwidth_GBps"] = bw / 1e9
    print(f"{report['device']}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    if a.model:
        for backend in a.fidelity_backends.split(","):
            f = fidelity(a.model, backend)
            report.setdefault("fidelity", []).append(f)
            print(json.dumps(f, indent=1), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        for name in [s for s in a.speed.split(",") if s]:
            for fmt in a.formats.split(","):
                try:
                    r = speed(name, fmt, a.p, a.n, a.r, bw, tmp)
                except Exception as e:  # record and go on
                    r = {"model": name, "format": fmt, "error": f"{type(e).__name__}: {e}"[:300]}
                rows.append(r)
                print(json.dumps(r), flush=True)
    report["speed"] = rows
    print(f"\n| model | format | pp{a.p} tok/s | tg{a.n} tok/s | ms/token | MBU | load s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['format']} | error: {r['error'][:80]} | | | | |")
            continue
        tg = r[f"tg{a.n}"]
        print(f"| {r['model']} | {r['format']} | {r[f'pp{a.p}']:,.0f} | {tg:,.1f} | {1e3 / tg:.2f} | "
              f"{100 * r['mbu']:.1f}% | {r['load_s']:.1f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
