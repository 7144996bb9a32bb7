"""Where a webgpu decode token's time goes: host encoding or the GPU.

    python benchmarks/webgpu_decode_profile.py FILE.gguf [-n 64]

For the single-token decode program: dispatches per token (kinds counted), the host's time to
record and submit one token's commands (`_record`, the GPU not waited for), the GPU's time per
token (timestamp queries at the start and end of each token's compute pass, where the adapter has
them), and the wall time per token of greedy decoding (which overlaps the host's recording of
the next token with the GPU's work on this one). Wall ~ host: the host is the bound; wall ~ GPU:
the kernels and the barriers between them are.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--steps", action="store_true", help="also each dispatch of a token timed alone (step_profile)")
    args = ap.parse_args()

    import edgellm

    m = edgellm.load(args.model, backend="webgpu", ctx=args.n * 2 + 64)
    dec = m.programs["decode"]
    dev = dec.dev
    gen = dec.loop_tokens(1, 0, args.n)
    for _ in gen:  # pipelines and bind groups made; the KV cache holds n rows
        pass
    kinds = collections.Counter()
    for st in dec._steps:
        k = getattr(st, "kernel", None)
        if k is None and hasattr(st, "variants"):
            k = st.pick(1, 1)[0].kernel
        kinds[k.name if k is not None else type(st).__name__] += 1
    print("dispatches per token:", sum(kinds.values()), dict(kinds.most_common()))

    # host: record + submit n tokens without waiting, then wait once
    t = []
    for j in range(args.n):
        t0 = time.perf_counter()
        dec._record(1, dec._write_step(1, args.n + j, hist=j), with_argmax=True)
        t.append(time.perf_counter() - t0)
    dev.read(dec.hist_buf, 0, 4)
    print(f"host record+submit per token: median {1e3 * statistics.median(t):.3f} ms, min {1e3 * min(t):.3f} ms")
    host_breakdown(dec, dev, args.n)

    # GPU: one token's pass between two timestamps
    if dev.has_timestamps:
        wgpu = dev.wgpu
        qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=2)
        res = dev.device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
        gpu = []
        for j in range(8):
            splits = dec._write_step(1, args.n + j, hist=j)
            for st in dec._steps:
                st.prepare()
            enc = dev.device.create_command_encoder()
            cpass = enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": 0,
                                                             "end_of_pass_write_index": 1})
            for st in dec._steps:
                st.encode(cpass, 1, splits)
            cpass.end()
            enc.resolve_query_set(qs, 0, 2, res, 0)
            dev.queue.submit([enc.finish()])
            ts = np.frombuffer(dev.read(res, 0, 16), np.uint64)
            gpu.append(float(ts[1] - ts[0]) * 1e-6)
        print(f"GPU per token (one pass): median {statistics.median(gpu):.3f} ms, min {min(gpu):.3f} ms")

    if dev.has_timestamps and args.steps:
        step_profile(dec, dev, args.n)

    walls = []
    for _ in range(3):
        gen = dec.loop_tokens(1, 0, args.n)
        next(gen)
        t0 = time.perf_counter()
        got = sum(1 for _ in gen)
        walls.append((time.perf_counter() - t0) / got)
    print(f"greedy wall per token: median {1e3 * statistics.median(walls):.3f} ms ({1 / statistics.median(walls):.0f} tok/s); "
          f"weights {dec.matrix_bytes / 1e6:.0f} MB per token")


def host_breakdown(dec, dev, n: int, tokens: int = 32) -> None:
    """The host's parts of recording one token through the replayed dispatch list (the backend's
    _flat, when it applies): the Python loop of wgpu-native calls, the pass's end, the command
    buffer's finish (wgpu-core's validation, resource tracking and barriers, and the driver's
    recording), the submit; medians over `tokens` tokens, per token and per dispatch."""
    from edgellm.backends.webgpu import backend as B

    flat = dec._flat(1, dec._write_step(1, n, hist=0), True, None)
    if flat is None:
        print("host breakdown: no replayed dispatch list (host ops, or EDGELLM_WEBGPU_RAW=0)")
        return
    from edgellm.backends.webgpu.launch import replay_dispatches

    parts = []
    for j in range(tokens):
        dec._write_step(1, n + j, hist=j)
        t0 = time.perf_counter()
        enc = dev.device.create_command_encoder()
        cpass = enc.begin_compute_pass()
        t1 = time.perf_counter()
        replay_dispatches(cpass, flat, B._RAW)
        t2 = time.perf_counter()
        cpass.end()
        t3 = time.perf_counter()
        cb = enc.finish()
        t4 = time.perf_counter()
        dev.queue.submit([cb])
        t5 = time.perf_counter()
        parts.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4))
    dev.read(dec.hist_buf, 0, 4)
    med = [statistics.median(p[i] for p in parts) for i in range(5)]
    names = ("begin", "loop", "end", "finish", "submit")
    print(f"host per token, {len(flat)} dispatches replayed: " + ", ".join(
        f"{k} {1e6 * v:.0f} us ({1e6 * v / len(flat):.2f}/dispatch)" for k, v in zip(names, med)))


def step_profile(dec, dev, n: int, tokens: int = 6) -> None:
    """Each recorded dispatch of a decode token in a compute pass of its own between two
    timestamps, for `tokens` tokens recorded into one submit (the GPU kept busy, so that its
    clock stays up: the NVIDIA driver lowers it after about a second idle and raises it after
    a few tenths of a second of load), right after a sustained greedy loop; per step the
    median, then the sums by kernel and the steps that took longest (with the weight bytes a
    GEMV reads, where the step's resources name a weight)."""
    wgpu = dev.wgpu
    steps = dec._steps
    qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=2 * len(steps) * tokens)
    res = dev.device.create_buffer(size=16 * len(steps) * tokens,
                                   usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    gen = dec.loop_tokens(1, 0, n)  # the clock up
    for _ in gen:
        pass
    enc = dev.device.create_command_encoder()
    picked = []
    for j in range(tokens):
        splits = dec._write_step(1, n + j, hist=j)
        for i, st in enumerate(steps):
            st.prepare()
            q = 2 * (j * len(steps) + i)
            cpass = enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": q,
                                                             "end_of_pass_write_index": q + 1})
            st.encode(cpass, 1, splits)
            cpass.end()
            if j == 0:
                picked.append(st)
    enc.resolve_query_set(qs, 0, 2 * len(steps) * tokens, res, 0)
    dev.queue.submit([enc.finish()])
    raw = np.frombuffer(dev.read(res, 0, 16 * len(steps) * tokens), np.uint64)
    ts = raw.astype(np.float64).reshape(tokens, len(steps), 2)
    us = np.median(ts[:, :, 1] - ts[:, :, 0], axis=0) * 1e-3
    by_kind = collections.defaultdict(float)
    rows = []
    for st, t in zip(picked, us):
        one = st.pick(1, splits)[0] if hasattr(st, "variants") else st  # a choice: the dispatch this step made
        k = getattr(one, "kernel", None)
        name = k.name if k is not None else type(st).__name__
        nbytes = 0
        for key, fn in getattr(one, "resources", {}).items():
            if key.startswith("W_"):  # a streamed weight (an embedding, E_, is gathered: a row a token)
                try:
                    nbytes += fn()[2]
                except Exception:  # noqa: BLE001
                    pass
        by_kind[name] += t
        rows.append((t, name, nbytes))
    print(f"steps timed alone: {us.sum() / 1e3:.3f} ms per token (median per step over {tokens} tokens)")
    for name, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {name}: {t / 1e3:.3f} ms")
    gemv = [(t, b) for t, name, b in rows if b]
    if gemv:
        tb = sum(t for t, _ in gemv)
        bb = sum(b for _, b in gemv)
        print(f"  weight-reading steps: {len(gemv)}, {bb / 1e6:.0f} MB in {tb / 1e3:.3f} ms = {bb / tb / 1e3:.0f} GB/s")
    groups = collections.defaultdict(list)  # the steps of one kernel over weights of one size (a layer's projection)
    for t, name, b in rows:
        groups[name, b].append(t)
    print("  per kernel and weight size: count, median us, GB/s")
    for (name, b), ts_ in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        med = statistics.median(ts_)
        print(f"  {len(ts_):4d} x {med:8.1f} us  {name}  {b / 1e6:.1f} MB" + (f"  {b / med / 1e3:.0f} GB/s" if b else ""))


if __name__ == "__main__":
    main()
