"""Where a webgpu decode token's time goes: host encoding or the GPU.

    python benchmarks/webgpu_decode_profile.py FILE.gguf [-n 64] [--steps]
    python benchmarks/webgpu_decode_profile.py FILE.gguf --prefill 512

--prefill N: instead, the prefill program ("last": a prompt chunk of N tokens, logits of the last)
timed whole on the GPU and, dispatch by dispatch, with the matrix products' FLOP rates.

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
    ap.add_argument("--prefill", type=int, default=0, metavar="N", help="profile the prefill of an N-token chunk instead")
    args = ap.parse_args()
    if args.prefill:
        profile_prefill(args.model, args.prefill, reps=6)
        return

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
        batch_gpu(dec, dev, args.n, qs, res)

    if dev.has_timestamps and args.steps:
        for _ in dec.loop_tokens(1, 0, args.n):  # the clock up
            pass
        step_profile(dec, dev, 1, lambda j: dec._write_step(1, args.n + j, hist=j))

    # the two ways loop_tokens submits, in turn (neither always first after an idle host phase),
    # after a loop that brings the GPU's clock up
    hows = {"batches in one command buffer each, one queued ahead": dec._encode_tokens,
            "one submission a step": lambda *a, **kw: None}  # loop_tokens' path for steps with host work
    for _ in dec.loop_tokens(1, 0, args.n):
        pass
    walls = {how: [] for how in hows}
    for _ in range(3):
        for how, encode in hows.items():
            dec._encode_tokens = encode
            gen = dec.loop_tokens(1, 0, args.n)
            next(gen)
            t0 = time.perf_counter()
            got = sum(1 for _ in gen)
            walls[how].append((time.perf_counter() - t0) / got)
    del dec._encode_tokens
    for how, w in walls.items():
        print(f"greedy wall per token ({how}): median {1e3 * statistics.median(w):.3f} ms "
              f"({1 / statistics.median(w):.0f} tok/s); weights {dec.matrix_bytes / 1e6:.0f} MB per token")


def batch_gpu(dec, dev, n: int, qs, res, tokens: int = 32) -> None:
    """The GPU's time per token when `tokens` steps, each with its argmax, go in one compute pass
    as loop_tokens records them (the program's _encode_tokens, each step's dispatches at its slot
    of the step buffer), between two timestamps: against the one-pass time above, what the step
    boundaries cost."""
    from edgellm.backends.webgpu import backend as B

    tokens = min(tokens, B.LOOP_BATCH)
    per = []
    for _ in range(4):
        encoded = dec._encode_tokens(n, 0, tokens, None, (qs, res))
        if encoded is None:  # steps that cannot be replayed
            return
        dev.write(dec.step_buf, encoded[1])
        dev.queue.submit([encoded[0]])
        ts = np.frombuffer(dev.read(res, 0, 16), np.uint64)
        per.append(float(ts[1] - ts[0]) * 1e-6 / tokens)
    print(f"GPU per token, {tokens} steps with their argmax in one pass: median {statistics.median(per):.3f} ms, "
          f"min {min(per):.3f} ms")


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


def _dispatches(prog, seq: int, splits: int) -> list:
    """The dispatches a step of `seq` tokens records (a choice's picks, each its own), prepared."""
    out = []
    for st in prog._steps:
        st.prepare()
        for d in st.dispatches(seq, splits):
            if hasattr(d, "grid_of") and all(int(v) for v in d.grid_of(seq, splits)):
                out.append(d)
    return out


def _weight_shape(d) -> tuple[int, int]:
    """(bytes, weight elements) of the weight a dispatch streams, from its resources' W_ bindings
    and its kernel's N and K constants (0, 0 where it reads none: an embedding, E_, is gathered)."""
    import re

    nbytes = 0
    if d.kernel.name == "embedding":
        return 0, 0
    for key, fn in getattr(d, "resources", {}).items():
        if key.startswith("W_"):
            try:
                nbytes += fn()[2]
            except Exception:  # noqa: BLE001
                pass
    if not nbytes:
        return 0, 0
    src = d.kernel.source
    n, k = re.search(r"const N: u32 = (\d+)u", src), re.search(r"const K: u32 = (\d+)u", src)
    return nbytes, (int(n[1]) * int(k[1]) * (2 if "glu" in d.kernel.name or "+ N" in src else 1) if n and k else 0)


QUERY_LIMIT = 4096  # timestamps a query set may hold (wgpu)


def step_profile(prog, dev, seq: int, write_step, reps: int = 6) -> None:
    """Each dispatch of a step of `seq` tokens in a compute pass of its own between two
    timestamps, `reps` steps recorded into one submit (the GPU kept busy, so that its clock
    stays up: the NVIDIA driver lowers it after about a second idle and raises it after a few
    tenths of a second of load; run right after a sustained loop); write_step(j) writes step j's
    uniform and returns its split count. Per dispatch the median, then the sums by kernel and
    the groups of one kernel over weights of one size (a layer's projection) with their read
    rate and, for steps of more than one token, their FLOP rate."""
    wgpu = dev.wgpu
    splits = write_step(0)
    ds = _dispatches(prog, seq, splits)
    reps = max(1, min(reps, QUERY_LIMIT // (2 * len(ds))))  # a query set holds at most 4096 timestamps
    qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=2 * len(ds) * reps)
    res = dev.device.create_buffer(size=16 * len(ds) * reps, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    enc = dev.device.create_command_encoder()
    for j in range(reps):
        splits = write_step(j)
        for i, d in enumerate(ds):
            q = 2 * (j * len(ds) + i)
            cpass = enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": q,
                                                             "end_of_pass_write_index": q + 1})
            d.encode(cpass, seq, splits)
            cpass.end()
    enc.resolve_query_set(qs, 0, 2 * len(ds) * reps, res, 0)
    dev.queue.submit([enc.finish()])
    raw = np.frombuffer(dev.read(res, 0, 16 * len(ds) * reps), np.uint64)
    ts = raw.astype(np.float64).reshape(reps, len(ds), 2)
    us = np.median(ts[:, :, 1] - ts[:, :, 0], axis=0) * 1e-3
    by_kind = collections.defaultdict(float)
    groups = collections.defaultdict(list)  # (kernel, weight bytes, elements) -> times
    for d, t in zip(ds, us):
        nbytes, elems = _weight_shape(d)
        by_kind[d.kernel.name] += t
        groups[d.kernel.name, nbytes, elems].append(t)
    what = "token" if seq == 1 else f"{seq}-token step"
    _print_first_layer(ds, us, seq, splits)
    print(f"dispatches timed alone: {len(ds)}, {us.sum() / 1e3:.3f} ms per {what} (median per dispatch over {reps})")
    for name, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {name}: {t / 1e3:.3f} ms ({100 * t / us.sum():.1f}%)")
    read = [(t, b) for (_, b, _), ts_ in groups.items() if b for t in ts_]
    if read:
        tb, bb = sum(t for t, _ in read), sum(b for _, b in read)
        print(f"  weight-reading dispatches: {len(read)}, {bb / 1e6:.0f} MB in {tb / 1e3:.3f} ms = {bb / tb / 1e3:.0f} GB/s")
    print("  per kernel and weight: count, median us, GB/s" + (", TFLOP/s" if seq > 1 else ""))
    for (name, b, e), ts_ in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        med = statistics.median(ts_)
        rate = f"  {b / med / 1e3:.0f} GB/s" if b else ""
        if b and e and seq > 1:
            rate += f"  {2 * seq * e / med / 1e6:.1f} TFLOP/s"
        print(f"  {len(ts_):4d} x {med:9.1f} us  {name}  {b / 1e6:.1f} MB{rate}")


# bindings that say what a dispatch does besides its kernel's own work (kernels.gemv_warp's folds)
_TAGS = {"A": "norm", "S": "+residual", "TOK": "embed", "KC": "rope+kv", "WS": "splits", "XQ": "int8-x",
         "YQ": "int8-y", "R": "residual"}


def _print_first_layer(ds: list, us, seq: int, splits: int) -> None:
    """The step's dispatches in order up to the second attention (the embedding's and the first
    layer's): kernel, what its bindings say it folds, grid, weight MB and time alone."""
    attn = [i for i, d in enumerate(ds) if d.kernel.name.startswith("attention") and "combine" not in d.kernel.name]
    end = attn[1] if len(attn) > 1 else len(ds)
    print(f"the first layer's dispatches ({splits} attention splits): kernel [folds] grid, MB, us alone")
    for d, t in zip(ds[:end], us[:end]):
        names = {b.name for b in d.kernel.bindings}
        tags = [v for k, v in _TAGS.items() if k in names] if d.kernel.name.startswith("gemv") else []
        nbytes, _ = _weight_shape(d)
        print(f"  {d.kernel.name:24s} [{' '.join(tags)}] {d.grid_of(seq, splits)}  {nbytes / 1e6:7.2f} MB  {t:6.1f} us")


def profile_prefill(model_path: str, n: int, reps: int) -> None:
    """The prefill program on one chunk of n tokens: its dispatches, the GPU's time for the whole
    chunk (one pass between two timestamps, median of `reps`), and with timestamps each dispatch
    timed alone (step_profile)."""
    import edgellm

    m = edgellm.load(model_path, backend="webgpu", ctx=n + 64, prefill_chunk=n)
    prog = m.programs["last"]
    dev = prog.dev
    ids = np.random.default_rng(0).integers(0, 1000, n)
    for _ in range(3):  # pipelines, bind groups, the clock up
        prog.run({"tokens": ids, "start_pos": 0})
    prog.tensor("logits", n).numpy()
    ds = _dispatches(prog, n, 1)
    print(f"dispatches per {n}-token chunk: {len(ds)} {dict(collections.Counter(d.kernel.name for d in ds).most_common())}")
    if not dev.has_timestamps:
        print("the adapter has no timestamp queries: no GPU times")
        return
    wgpu = dev.wgpu
    qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=2)
    res = dev.device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    gpu = []
    for _ in range(reps):
        prog._write_step(n, 0)
        enc = dev.device.create_command_encoder()
        cpass = enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": 0,
                                                         "end_of_pass_write_index": 1})
        for d in ds:
            d.encode(cpass, n, 1)
        cpass.end()
        enc.resolve_query_set(qs, 0, 2, res, 0)
        dev.queue.submit([enc.finish()])
        t = np.frombuffer(dev.read(res, 0, 16), np.uint64)
        gpu.append(float(t[1] - t[0]) * 1e-6)
    med = statistics.median(gpu)
    print(f"GPU per {n}-token chunk (one pass): median {med:.3f} ms, min {min(gpu):.3f} ms ({n / med * 1e3:.0f} tok/s)")
    step_profile(prog, dev, n, lambda j: prog._write_step(n, 0), reps)


if __name__ == "__main__":
    main()
