"""A model larger than the GPU budget: edgellm's solved GPU+CPU placement against llama.cpp -ngl N.

    python benchmarks/bench_hetero_gpu.py --llama-bench PATH/llama-bench [--preset llama-3.1-8b]
        [--format Q8_0] [--caps 6,4] [-p 512] [-n 128] [-r 3] [--model-dir DIR]

Steps, on a machine with one GPU and no network:
1. writes (or reuses) the synthetic GGUF file of the preset's shape (random weights, `fast`);
2. profiles: GPU microbenchmarks (bandwidth, throughput, launch, pinned copies both ways) and the
   CPU's ops measured on a 2-layer file of the same layer shape (the signatures of its ops are the
   big model's), with the fitted CPU cost model for the rest; stored in the tuning cache;
3. per cap (GiB): solves the placement under --gpu-memory CAP, runs it (edgellm.hetero.executor)
   and measures pp (one forward over p tokens) and tg (n greedy single-token steps), median of r;
   llama-bench -ngl N with N the most layers whose Q8_0 bytes + f16 KV fit the same cap;
4. prints one table: tok/s of both, the ratio, and edgellm's predicted vs measured ms/token.
Threads: the physical cores for both engines.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402


def llama_bench_ngl(exe: str, path: str, ngl: int, p: int, n: int, r: int, threads: int) -> dict:
    cmd = [exe, "-m", path, "-ngl", str(ngl), "-p", str(p), "-n", str(n), "-r", str(r), "-fa", "1",
           "-t", str(threads), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    res = {}
    for row in json.loads(out.stdout):
        res["pp" if row["n_gen"] == 0 else "tg"] = row["avg_ts"]
    return res


def cpu_ops_by_kind(m, f, steps) -> str:
    """ms per step of each op kind in the decode program's CPU segments (each op timed alone, or
    inside the native call where a segment's step is one); for the matrix products also the
    file's bytes they read per second."""
    prog = m.programs["decode"]
    times: dict[str, float] = {}
    nbytes: dict[str, int] = {}
    saved, native = [], []
    for seg, proc, sub in prog.parts:
        if not seg.processor.startswith("cpu") or not hasattr(sub, "_kernels"):
            continue
        for op in sub.graph.ops:
            if op.kind in ("linear", "linear_qkv", "linear_swiglu"):
                nbytes[op.kind] = nbytes.get(op.kind, 0) + sum(f.tensors[n].nbytes for n in sub._weight_names(op))
        step = sub._native_step()
        if step is not None:
            step.profile(True)
            native.append(step)
            continue
        kernels = sub._kernels
        saved.append((sub, kernels))

        def timed(fn):
            def run(op, inputs):
                t0 = time.perf_counter()
                out = fn(op, inputs)
                times[op.kind] = times.get(op.kind, 0.0) + time.perf_counter() - t0
                return out
            return run
        sub._kernels = {k: timed(fn) for k, fn in kernels.items()}
    try:
        for toks, pos in steps:
            m.forward(toks, pos, all_logits=False)
    finally:
        for sub, kernels in saved:
            sub._kernels = kernels
        for step in native:
            for kind, ns in zip(step.kinds, step.op_ns.tolist()):
                times[kind] = times.get(kind, 0.0) + ns * 1e-9
            step.profile(False)
    parts = []
    for kind, t in sorted(times.items(), key=lambda kv: -kv[1]):
        ms = t / len(steps) * 1e3
        bw = f" ({nbytes[kind] / (t / len(steps)) / 1e9:.0f} GB/s)" if kind in nbytes else ""
        parts.append(f"{kind} {ms:.2f}{bw}")
    how = f"; {len(native)} segment(s) as one native call" if native else ""
    return ", ".join(parts) + f"; total {sum(times.values()) / len(steps) * 1e3:.2f} ms{how}"


def decode_breakdown(m, steps) -> str:
    """Where a decode step's wall time goes, nothing synchronised beyond what the step itself does:
    each segment's run (for a GPU segment its launches; for a CPU segment the native call and the
    Python around it), Python's garbage collections, and the rest of Model.forward (the head's
    logits read back, which waits for the GPU's work)."""
    import torch

    prog = m.programs["decode"]
    acc: dict[str, float] = {}

    def add(key, dt):
        acc[key] = acc.get(key, 0.0) + dt

    saved = []
    for k, (seg, _, sub) in enumerate(prog.parts):
        name = f"{k}:{seg.processor}"
        orig = sub.run

        def run(feed, orig=orig, name=name):
            t0 = time.perf_counter()
            out = orig(feed)
            add(f"{name} run", time.perf_counter() - t0)
            return out
        sub.run = run
        step = sub._native_step() if hasattr(sub, "_native_step") else None
        if step is not None:
            lib = step.lib

            class Timed:
                def __getattr__(self, attr, lib=lib):
                    return getattr(lib, attr)

                def edgellm_step(self, *args, lib=lib, name=name):
                    t0 = time.perf_counter()
                    lib.edgellm_step(*args)
                    add(f"{name} native call", time.perf_counter() - t0)
            step.lib = Timed()
        saved.append((sub, step, lib if step is not None else None))
    gc_t = [0.0, 0]

    def on_gc(phase, info, t=[0.0]):
        if phase == "start":
            t[0] = time.perf_counter()
        else:
            gc_t[0] += time.perf_counter() - t[0]
            gc_t[1] += 1
    gc.callbacks.append(on_gc)
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for toks, pos in steps:
            m.forward(toks, pos, all_logits=False)
        wall = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(on_gc)
        for sub, step, lib in saved:
            del sub.run
            if step is not None:
                step.lib = lib
    n = len(steps)
    runs = sum(v for k, v in acc.items() if k.endswith(" run"))
    parts = [f"{k} {v / n * 1e3:.2f}" for k, v in acc.items()]
    return (f"{wall / n * 1e3:.2f} ms a step: " + ", ".join(parts) + f", gc {gc_t[0] / n * 1e3:.2f} ({gc_t[1]} collections), "
            f"forward outside the segments {(wall - runs) / n * 1e3:.2f}")


def fit_ngl(f, cfg, cap: int, ctx: int) -> int:
    """llama.cpp's -ngl N that fits the cap: N repeating layers (their stored bytes + f16 KV), plus
    the output layer when all of them fit (-ngl n_layers+1), less 512 MiB for its buffers."""
    layer = [sum(t.nbytes for n, t in f.tensors.items() if n.startswith(f"blk.{i}.")) + 2 * 2 * ctx * cfg.kv_dim
             for i in range(cfg.n_layers)]
    room = cap - (512 << 20)
    n = 0
    while n < cfg.n_layers and sum(layer[cfg.n_layers - n - 1:]) <= room:
        n += 1
    out = f.tensors.get("output.weight") or f.tensors["token_embd.weight"]
    if n == cfg.n_layers and sum(layer) + out.nbytes <= room:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", default=None, help="llama-bench executable (CUDA build)")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--format", default="Q8_0")
    ap.add_argument("--caps", default="6,4", help="GPU memory caps in GiB")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--reuse-profile", action="store_true",
                    help="plan with the stored profile (the tuning cache's) instead of measuring one: the same "
                         "placement across runs that compare something else")
    ap.add_argument("--model-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "edgellm-synthetic"))
    a = ap.parse_args()

    from edgellm.omp import keep_pool_awake

    keep_pool_awake()  # as `edgellm run --gpu-memory` does, before torch loads the OpenMP runtime
    import torch

    import edgellm

    from dataclasses import replace
    from edgellm.backends.cpu_fast import physical_cores
    from edgellm.gguf_file import open_gguf
    from edgellm.hetero.executor import load_split
    from edgellm.hetero.plan import plan_split
    from edgellm.hetero.profile import Profile, load_profile, profile_cpu, profile_cuda, save_profile
    from edgellm.models import config_from_gguf
    from edgellm.synthetic import preset, write_synthetic_gguf

    threads = physical_cores()
    torch.set_num_threads(threads)
    os.makedirs(a.model_dir, exist_ok=True)
    spec = preset(a.preset, weight_type=a.format)
    path = os.path.join(a.model_dir, f"{a.preset}-{a.format}.gguf")
    small = os.path.join(a.model_dir, f"{a.preset}-{a.format}-2layers.gguf")
    for pth, sp in ((path, spec), (small, replace(spec, n_layers=2))):
        if not os.path.exists(pth):
            t = time.perf_counter()
            write_synthetic_gguf(pth, sp, fast=True)
            print(f"wrote {pth} ({os.path.getsize(pth) / 1e9:.2f} GB, {time.perf_counter() - t:.0f} s)", flush=True)

    prof = load_profile() if a.reuse_profile else Profile()
    if not {"cuda:0", "cpu", "cpu@prefill"} <= set(prof.processors):
        prof = profile_cuda(Profile(), "cuda:0")
        m2 = edgellm.load(small, backend="cpu-fast", ctx=a.ctx, prefill_chunk=a.p)
        profile_cpu(m2, prof, kv_len=a.ctx // 2, prefill=a.p)
        del m2
        save_profile(prof)
    print("profile:", {k: (f"{v.bandwidth / 1e9:.0f} GB/s", f"{v.throughput / 1e12:.1f} TFLOP/s",
                           f"{v.overhead_s * 1e6:.1f} us/op") for k, v in prof.processors.items()}, flush=True)

    f = open_gguf(path)
    cfg = config_from_gguf(f)
    rows = []
    for cap_gib in [float(c) for c in a.caps.split(",")]:
        cap = int(cap_gib * 2**30)
        plan = plan_split(path, gpu_memory=str(cap), devices="cuda:0,cpu", ctx=a.ctx, prefill=a.p, profile=prof)
        if cap_gib == float(a.caps.split(",")[0]):  # what the solver weighed, for the last layer
            from edgellm.compiler.compile import compile_graph
            from edgellm.hetero.plan import stream_options, unit_memory, unit_tables
            from edgellm.models import build_graph
            dec = compile_graph(build_graph(cfg, f, "last"), seq=1, ctx=a.ctx).graph
            pre = compile_graph(build_graph(cfg, f, "last"), seq=a.p, ctx=a.ctx).graph
            last = f"blk.{cfg.n_layers - 1}"
            opts = stream_options(f, dec, pre, "cuda:0", prof, ctx=a.ctx, prefill=a.p,
                                  gpu_pre_products=unit_tables(f, pre, "cuda:0", prof, a.p, a.p, products=True),
                                  mem_cpu=unit_memory(f, dec, "cpu", a.ctx))[last]
            print(f"  {last}: link {prof.link('cpu', 'cuda:0')}; decode ms cpu "
                  f"{unit_tables(f, dec, 'cpu', prof, 1, a.ctx // 2)[last] * 1e3:.2f}, cuda "
                  f"{unit_tables(f, dec, 'cuda:0', prof, 1, a.ctx // 2)[last] * 1e3:.2f}, "
                  + ", ".join(f"{o.name} {o.decode_s * 1e3:.2f}" for o in opts), flush=True)
        placement = dict(plan["placement"])
        n_gpu = sum(1 for u, d in placement.items() if u.startswith("blk.") and d.startswith("cuda"))
        n_stream = sum(1 for u, d in placement.items() if u.startswith("blk.") and d.startswith("rows cpu"))
        print(f"cap {cap_gib:g} GiB: {n_gpu} of {cfg.n_layers} layers on the GPU, {n_stream} streamed "
              f"({', '.join(sorted({d for d in placement.values() if d.startswith('rows')})) or 'none'}); "
              f"head on {placement.get('head')}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t_load = time.perf_counter()
        m = load_split(path, placement, ctx=a.ctx, prefill_chunk=a.p)
        t_load = time.perf_counter() - t_load
        mem_load = torch.cuda.memory_allocated() - base
        peak_load = torch.cuda.max_memory_allocated() - base
        rng = np.random.default_rng(0)
        prompt = rng.integers(3, cfg.vocab_size, a.p).tolist()
        m.forward(prompt, 0, all_logits=False)  # first runs: kernels load, graphs are captured, orders recorded
        for i in range(3):
            m.forward([1], i, all_logits=False)
        mem_warm = torch.cuda.memory_allocated() - base
        peak_warm = torch.cuda.max_memory_allocated() - base
        peaks = {"pp": 0, "tg": 0}  # each phase's peak (the first round's)
        pp, tg = [], []
        for _ in range(a.r):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            m.forward(prompt, 0, all_logits=False)
            pp.append(a.p / (time.perf_counter() - t))
            peaks["pp"] = max(peaks["pp"], torch.cuda.max_memory_allocated() - base)
            torch.cuda.reset_peak_memory_stats()
            tok = 1
            t = time.perf_counter()
            for i in range(a.n):
                tok = int(np.argmax(m.forward([tok], i, all_logits=False)[-1]))
            tg.append(a.n / (time.perf_counter() - t))
            peaks["tg"] = max(peaks["tg"], torch.cuda.max_memory_allocated() - base)
        # the peak of this model: weights, caches, slots, activations
        used = max(peak_load, peak_warm, *peaks.values()) / 2**30
        # where a step goes: each segment's wall time, the GPU synchronised after each
        for stage, steps in (("decode", [([1], i) for i in range(16)]), ("last", [(prompt, 0)])):
            prog = m.programs[stage]
            prog.time_segments()
            t = time.perf_counter()
            for toks, pos in steps:
                m.forward(toks, pos, all_logits=False)
            wall = (time.perf_counter() - t) / len(steps)
            segs = [f"{s.processor}[{len(s.ops)} ops] {sec / len(steps) * 1e3:.2f}"
                    for (s, _, _), sec in zip(prog.parts, prog.seconds)]
            print(f"  {stage} step {wall * 1e3:.2f} ms (segments synchronised): " + ", ".join(segs), flush=True)
            prog.time_segments(False)
        print("  decode, the CPU's ops by kind: " + cpu_ops_by_kind(m, f, [([1], i) for i in range(16)]), flush=True)
        print("  decode, unsynchronised: " + decode_breakdown(m, [([1], i) for i in range(32)]), flush=True)
        print(f"  GPU memory: after load {mem_load / 2**30:.2f} GiB (peak while loading {peak_load / 2**30:.2f}), "
              f"solver's weights + caches + reserve {sum(plan['memory_bytes'].get(p, 0) for p in plan['memory_bytes'] if p.startswith('cuda')) / 2**30:.2f}, "
              f"after the first prompt and steps "
              f"{mem_warm / 2**30:.2f} (peak {peak_warm / 2**30:.2f}), peak of a prompt {peaks['pp'] / 2**30:.2f}, "
              f"of decode {peaks['tg'] / 2**30:.2f} (cap {cap_gib:g})", flush=True)
        del m
        gc.collect()  # the programs hold cycles: the GPU memory goes back only once they are collected
        torch.cuda.empty_cache()
        ngl = fit_ngl(f, cfg, cap, a.ctx)
        ll = llama_bench_ngl(a.llama_bench, path, ngl, a.p, a.n, a.r, threads) if a.llama_bench else {"error": "no --llama-bench"}
        rows.append((cap_gib, f"{n_gpu} + {n_stream} streamed", used, statistics.median(pp), statistics.median(tg),
                     ngl, ll, plan["predicted_decode_s"], plan["predicted_prefill_s"]))
        print(json.dumps({"cap_GiB": cap_gib, "edgellm_gpu_layers": n_gpu, "edgellm_streamed_layers": n_stream,
                          "placement": placement, "load_s": round(t_load, 1), "gpu_GiB": round(used, 2),
                          "edgellm_pp": rows[-1][3], "edgellm_tg": rows[-1][4], "llama_ngl": ngl, "llama": ll,
                          "predicted_decode_ms": plan["predicted_decode_s"] * 1e3,
                          "predicted_prefill_ms": plan["predicted_prefill_s"] * 1e3}), flush=True)

    print(f"\n{time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, {threads} CPU threads, "
          f"{os.path.basename(path)} ({os.path.getsize(path) / 1e9:.2f} GB), ctx {a.ctx}, pp{a.p} tg{a.n}, median of {a.r}\n")
    print("| cap GiB | edgellm layers on GPU | GPU GiB used | edgellm pp tok/s | edgellm tg tok/s | llama.cpp -ngl | "
          "llama.cpp pp | llama.cpp tg | tg ratio | pp ratio | predicted / measured ms/token | "
          "predicted / measured ms/prompt |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cap, n_gpu, used, pp, tg, ngl, ll, pred_d, pred_p in rows:
        lpp, ltg = ll.get("pp"), ll.get("tg")
        r_tg = f"{tg / ltg:.2f}x" if ltg else ll.get("error", "-")
        r_pp = f"{pp / lpp:.2f}x" if lpp else "-"
        print(f"| {cap:g} | {n_gpu} | {used:.2f} | {pp:.1f} | {tg:.2f} | {ngl} | {lpp or '-'} | {ltg or '-'} | "
              f"{r_tg} | {r_pp} | {pred_d * 1e3:.1f} / {1e3 / tg:.1f} | {pred_p * 1e3:.0f} / {a.p * 1e3 / pp:.0f} |")


if __name__ == "__main__":
    main()
