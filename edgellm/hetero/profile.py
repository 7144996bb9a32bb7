"""The profiler: what each unit of a model costs on each processor, and moving activations.

Two sources, one table:
- measured: the model's own ops, run by the cpu-fast backend's programs with a timer around
  every kernel (decode: one token at a given context; prefill: one chunk), summed per op
  signature (kind, weight formats, shapes) so that the identical layers of a model share entries;
- predicted: a fitted cost model per processor, t = overhead + max(bytes / bandwidth, flops /
  throughput), for shapes not measured and for processors whose ops are not timed one by one (a
  GPU's decode step is one CUDA graph). The bandwidth, throughput and per-op overhead of the CPU are
  fitted to the measured ops (non-negative least squares); a GPU's come from microbenchmarks on it
  (a weight-streaming matrix-vector product, a large matrix product, an empty launch).
Transfers: latency + bytes / bandwidth per direction, measured with pinned host buffers where a
GPU exists; two 'cpu' processors share memory (cost 0).

Stored as JSON in <cache dir>/hetero/<device>.json (the cache folder of the kernel tuner:
$EDGELLM_CACHE_DIR, else ~/.cache/edgellm), keyed by processor and, for measured entries, by the
op signature (kind, weight formats and shapes, tokens, keys attended): ops of the same signature
cost the same in any model, so a small model of a large one's layer shape profiles its layers.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..graph.ir import Graph


@dataclass
class ProcessorModel:
    name: str
    bandwidth: float  # bytes / s
    throughput: float  # flop / s
    overhead_s: float  # per op

    def predict(self, nbytes: float, nflops: float, n_ops: int) -> float:
        return n_ops * self.overhead_s + max(nbytes / self.bandwidth, nflops / self.throughput)


@dataclass
class Link:
    latency_s: float
    bandwidth: float
    # how much longer the CPU's memory-bound work takes while this link copies out of host memory
    # (both read the host's DRAM; measured by profile_cuda, 1.0 where not measured)
    host_slowdown: float = 1.0

    def cost(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass
class Profile:
    processors: dict = field(default_factory=dict)  # name -> ProcessorModel
    links: dict = field(default_factory=dict)  # "src>dst" -> Link
    measured: dict = field(default_factory=dict)  # "proc|signature" -> seconds

    def link(self, src: str, dst: str) -> Link:
        if src.split(":")[0] == dst.split(":")[0] == "cpu":
            return Link(0.0, float("inf"))
        return self.links.get(f"{src}>{dst}") or self.links.get(f"{src.split(':')[0]}>{dst.split(':')[0]}") \
            or Link(20e-6, 10e9)  # unmeasured: a PCIe 4 x16 guess; stated by `describe`

    def collective(self, world: int) -> Link:
        """An all_reduce over `world` GPUs: latency + bytes / bandwidth (measured by
        profile_all_reduce inside a process group; unmeasured, an NVLink-class guess)."""
        return self.links.get(f"all_reduce*{world}") or Link(15e-6, 100e9)

    def to_json(self) -> str:
        return json.dumps({"processors": {k: asdict(v) for k, v in self.processors.items()},
                           "links": {k: asdict(v) for k, v in self.links.items()},
                           "measured": self.measured}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        d = json.loads(text)
        return cls({k: ProcessorModel(**v) for k, v in d.get("processors", {}).items()},
                   {k: Link(**v) for k, v in d.get("links", {}).items()}, dict(d.get("measured", {})))


def cache_path(device: str = "host") -> Path:
    from ..backends.cuda.tuning import default_cache_dir

    return default_cache_dir() / "hetero" / f"{''.join(c if c.isalnum() else '_' for c in device)}.json"


def load_profile(path: Path | None = None) -> Profile:
    path = path or cache_path()
    try:
        return Profile.from_json(path.read_text())
    except (OSError, ValueError, TypeError):
        return Profile()


def save_profile(p: Profile, path: Path | None = None) -> None:
    from ..cache import write_text_atomic

    write_text_atomic(path or cache_path(), p.to_json())  # a read-only cache folder: it stays in memory


# -- what an op moves and computes ----------------------------------------------------------------
def op_signature(graph: Graph, i: int, seq: int, kv_len: int) -> str:
    op = graph.ops[i]
    parts = [op.kind, f"s{seq}"]
    for t in op.inputs:
        tt = graph.tensors[t]
        if tt.kind == "weight":
            parts.append(f"{tt.storage}{tuple(int(d) for d in tt.concrete_shape())}")
    if op.kind == "attention":
        parts.append(f"kv{kv_len}")
    return "/".join(parts)


def op_cost_inputs(graph: Graph, i: int, f, info, seq: int, kv_len: int) -> tuple[float, float]:
    """(bytes read, flops) of op i on a backend described by `info` (its weight layout)."""
    from ..graph.ops import KV_LEN, flops
    from ..graph.ir import SEQ

    op = graph.ops[i]
    nbytes = 0.0
    for t in op.inputs:
        tt = graph.tensors[t]
        if tt.kind == "weight":
            nbytes += info.tensor_bytes(f, tt.source or t) if op.kind != "embedding" else 0
        elif tt.kind == "state":
            nbytes += kv_len * int(tt.concrete_shape(ctx=1)[-1]) * 4
        elif tt.kind == "activation":
            nbytes += 4 * tt.numel(seq=seq, ctx=kv_len)
    fl = flops(op.kind, [graph.tensors[t] for t in op.inputs], graph.tensors[op.outputs[0]], op.attrs)
    return nbytes, float(fl.subs({SEQ: seq, KV_LEN: kv_len}))


# -- measuring ------------------------------------------------------------------------------------
def measure_cpu_ops(model, stage: str, seq: int, start: int, repeats: int = 3) -> dict[int, float]:
    """Seconds per op of one run of a cpu-fast Model's stage program ('decode' or 'last'), the
    minimum over `repeats` runs (a busy machine only ever adds time)."""
    prog = model.programs[stage]
    times: dict[int, float] = {}
    ids = np.arange(3, 3 + seq) % model.config.vocab_size
    step = prog._native_step() if getattr(prog, "max_seq", None) == 1 else None
    if step is not None:  # the step is one native call: its ops timed inside it
        for _ in range(repeats):
            step.profile(True)
            try:
                prog.run({"tokens": ids.astype(np.int32), "start_pos": start})
                ns = step.op_ns.tolist()
            finally:
                step.profile(False)
            for i, t in zip(step.op_index, ns):
                times[i] = min(times.get(i, t * 1e-9), t * 1e-9)
        return times
    kernels = dict(prog._kernels)
    index = {id(op): i for i, op in enumerate(prog.graph.ops)}

    def timed(kind, fn):
        def run(op, inputs):
            t0 = time.perf_counter()
            out = fn(op, inputs)
            dt = time.perf_counter() - t0
            i = index[id(op)]
            times[i] = min(times.get(i, dt), dt)
            return out
        return run

    prog._kernels = {k: timed(k, fn) for k, fn in kernels.items()}
    try:
        for _ in range(repeats):
            prog.run({"tokens": ids.astype(np.int32), "start_pos": start})
    finally:
        prog._kernels = kernels
    return times


def fit_processor(name: str, samples: list[tuple[float, float, float]]) -> ProcessorModel:
    """Fit t = o + b / BW + f / FL (all non-negative) to (bytes, flops, seconds) samples."""
    from scipy.optimize import nnls

    a = np.array([[1.0, b, fl] for b, fl, _ in samples])
    t = np.array([s for _, _, s in samples])
    scale = a.max(axis=0)
    scale[scale == 0] = 1
    coef, _ = nnls(a / scale, t)
    coef = coef / scale
    bw = 1 / coef[1] if coef[1] > 0 else 1e13
    fl = 1 / coef[2] if coef[2] > 0 else 1e15
    return ProcessorModel(name, float(bw), float(fl), float(coef[0]))


def profile_cpu(model, profile: Profile, kv_len: int = 256, prefill: int = 64, name: str = "cpu") -> Profile:
    """Measure a cpu-fast model's ops (decode at kv_len, prefill of `prefill` tokens) and fit the
    CPU's cost models to them: one for a token's ops (`name`: the native decode kernels) and one
    for a prompt's (`name@prefill`: torch's packed kernels), whose costs per byte and per flop
    differ by an order of magnitude: one linear model over both (as before 2026-11-27) put the
    prompt's residue into a per-op overhead of ~25 ms, which then priced every unmeasured decode
    op (a 1B-shape layer on the 2-core machine: decode predicted 7.4x its measured time; fitted
    per stage, 1.0x)."""
    from ..backends.info import CpuFastInfo

    for stage, seq, start in (("decode", 1, kv_len - 1), ("last", prefill, 0)):
        if stage == "last" and prefill > model.compiled["last"].sizes["seq"]:
            continue
        g = model.programs[stage].graph
        times = measure_cpu_ops(model, stage, seq, start)
        samples = []
        for i, t in times.items():
            sig = op_signature(g, i, seq, start + seq)
            profile.measured[f"{name}|{sig}"] = t
            nbytes, nfl = op_cost_inputs(g, i, model.file, CpuFastInfo, seq, start + seq)
            samples.append((nbytes, nfl, t))
        key = name if stage == "decode" else f"{name}@prefill"
        profile.processors[key] = fit_processor(key, samples)
    return profile


def profile_cuda(profile: Profile, device: str = "cuda:0") -> Profile:
    """Microbenchmarks on a GPU: streaming bandwidth (fp16 matrix-vector over 1 GiB), fp16 matrix
    product throughput, an empty launch; pinned copies both ways for the link."""
    import torch

    dev = torch.device(device)

    def timeit(fn, n=20):
        fn()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / n

    w = torch.randn(16384, 32768, device=dev, dtype=torch.float16)
    x = torch.randn(32768, device=dev, dtype=torch.float16)
    bw = w.numel() * 2 / timeit(lambda: w @ x)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
    fl = 2 * 8192**3 / timeit(lambda: a @ a, 5)
    z = torch.zeros(1, device=dev)
    ov = timeit(lambda: z.add_(1), 200)
    profile.processors[device] = ProcessorModel(device, float(bw), float(fl), float(ov))
    del w, a
    for nbytes in (4096,):
        h = torch.empty(1 << 26, dtype=torch.uint8).pin_memory()  # 64 MiB copies, the size of the streamed pieces
        d = torch.empty(1 << 26, dtype=torch.uint8, device=dev)
        small_up = timeit(lambda: d[:nbytes].copy_(h[:nbytes], non_blocking=True), 200)
        big_up = timeit(lambda: d.copy_(h, non_blocking=True), 20)
        small_dn = timeit(lambda: h[:nbytes].copy_(d[:nbytes], non_blocking=True), 200)
        big_dn = timeit(lambda: h.copy_(d, non_blocking=True), 20)
        profile.links[f"cpu>{device}"] = Link(small_up, (1 << 26) / max(big_up - small_up, 1e-9),
                                              _host_slowdown(h, d, dev))
        profile.links[f"{device}>cpu"] = Link(small_dn, (1 << 26) / max(big_dn - small_dn, 1e-9))
    return profile


def _host_slowdown(h, d, dev) -> float:
    """The CPU's own products (six Q8_0 matrices of 14336 x 4096, one token, the kernel cpu-fast decodes
    with) timed alone and while the link copies pinned host memory to the GPU without pause:
    the ratio (both read the host's DRAM; 1.33 on the H100 machine, benchmarks/host_probe.py)."""
    import threading

    import numpy as np
    import torch

    from ..backends.cpu_fast import PackedLinear
    from ..quant import quantize

    from ..backends import cpu_native

    # six matrices, 370 MB together: read from DRAM (one could stay in a large last-level cache),
    # by the kernel a decode step uses (native where it is built)
    raw = quantize(np.random.default_rng(0).standard_normal((14336, 4096), dtype=np.float32), "Q8_0")
    copies = [raw] + [raw.copy() for _ in range(5)]
    if cpu_native.library() is not None:
        ws = [cpu_native.NativeRows([r], 4096) for r in copies]
    else:
        ws = [PackedLinear(r, "Q8_0", (14336, 4096)) for r in copies]
    x = torch.randn(1, 4096)

    def cpu(n=8):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            for w in ws:
                w(x)
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    cpu(2)
    alone = cpu()
    stop = threading.Event()
    stream = torch.cuda.Stream(dev)

    def copy():  # queues ~20 ms of copies at a time and sleeps while they run: it holds no lock
        with torch.cuda.stream(stream):
            while not stop.is_set():
                for _ in range(64):
                    d.copy_(h, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                while not ev.query():
                    time.sleep(0.0005)
    th = threading.Thread(target=copy, daemon=True)
    th.start()
    time.sleep(0.05)
    busy = cpu()
    stop.set()
    th.join()
    return float(max(busy / max(alone, 1e-9), 1.0))


def profile_all_reduce(profile: Profile, d_model: int, rows: int = 512) -> Profile:
    """The all_reduce of a tensor-parallel step, timed where it runs (inside an initialised NCCL
    process group, every rank calling this): a decode step's [1, d_model] float32 captured in a
    CUDA graph as the engine runs it (latency), and a prefill chunk's [rows, d_model] (bandwidth).
    Stored as the link 'all_reduce*world' (Profile.collective)."""
    import torch
    import torch.distributed as dist

    from ..backends.cuda.collective import one_shot
    from ..backends.cuda.graphs import captured

    world = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    shot = one_shot(dev, rows, d_model, 2)  # the engine's form where it runs (collective.py)
    src = shot.buffer(0) if shot is not None else torch.ones(rows, d_model, device=dev)
    src.fill_(1.0)
    out = torch.empty_like(src)

    def reduce(n_rows):
        if shot is not None:
            shot(src[:n_rows], out[:n_rows])
        else:
            dist.all_reduce(src[:n_rows])

    def timed(n_rows, n):
        g = torch.cuda.CUDAGraph()
        reduce(n_rows)  # the communicator's first use, outside the capture
        torch.cuda.synchronize()
        with captured(g):
            for _ in range(n):
                reduce(n_rows)
        g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    lat, t_big = timed(1, 200), timed(rows, 20)
    profile.links[f"all_reduce*{world}"] = Link(lat, rows * d_model * 4 / max(t_big - lat, 1e-9))
    return profile


def cpu_model_from_host() -> ProcessorModel:
    """A CPU cost model without a model run: a copy for bandwidth, a bf16 product for throughput."""
    import torch

    def best(fn, n=5):
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    src = torch.empty(32 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / best(lambda: dst.copy_(src))
    a = torch.randn(512, 512).bfloat16()
    fl = 2 * 512**3 / best(lambda: a @ a)
    return ProcessorModel("cpu", bw, fl, 5e-6)
