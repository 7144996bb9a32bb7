"""The split executor: a model whose units run on different processors.

    m = load_split(path, {"embed": "cpu", "blk.0": "cuda:0", ..., "head": "cuda:0"}, ctx=4096)
    m.logits(ids); m.generate(...)            # the Model API, unchanged

`SplitBackend` has the backend protocol (allocate_states, compile, to_numpy, describe), so the
Model's stage programs (prefill chunks, decode) are split programs: the compiled graph's op list is
cut where the placement changes processor; each segment becomes a subgraph compiled by its
processor's own backend ('cpu' / 'cpu:N': the cpu-fast backend; 'cuda' / 'cuda:N': the cuda
backend), whose inputs are the activations crossing the cut. Each layer's KV cache is allocated on
the processor that runs the layer and written in place there. Crossing activations are copied
once per cut (through pinned host buffers when one side is a GPU: non-blocking copies ordered on
the device's stream). Several 'cpu:N' processors in one process share the CPU's threads: that
exercises the partition logic (CI), it does not add speed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from ..errors import EdgeLLMError, GraphError
from ..graph.ir import Graph, Tensor
from .units import unit_of_op, unit_of_state


def parse_choice(choice: str) -> tuple[str, float, str | None]:
    """A placement value: 'cpu' -> ('cpu', 1.0, None); the solver's row split 'rows cpu 0.50 | cpu:1'
    -> ('cpu', 0.5, 'cpu:1'): the unit runs on the first processor, which multiplies that share of
    each matrix's rows while the second multiplies the rest, at the same time. With a GPU second
    ('rows cpu 0.45 | cuda:0') the GPU's rows are streamed to it from host memory (stream.py)."""
    if not choice.startswith("rows "):
        return choice, 1.0, None
    try:
        left, other = choice[5:].split("|")
        main, share = left.split()
        return main.strip(), float(share), other.strip()
    except ValueError:
        raise EdgeLLMError(f"placement: cannot read '{choice}' (expected 'rows PROC SHARE | PROC')") from None


@dataclass
class Segment:
    processor: str
    ops: list[int]
    inputs: list[str] = field(default_factory=list)  # graph inputs and activations from earlier segments
    outputs: list[str] = field(default_factory=list)  # read by later segments, or graph outputs


def op_processors(graph: Graph, placement: dict[str, str]) -> list[str]:
    procs, seen_layer = [], False
    for op in graph.ops:
        u = unit_of_op(op.name, op.kind, seen_layer)
        seen_layer |= u.startswith("blk.")
        if u not in placement:
            raise EdgeLLMError(f"placement: no processor for unit '{u}' (op '{op.name}')")
        procs.append(parse_choice(placement[u])[0])
    return procs


def split_segments(graph: Graph, placement: dict[str, str]) -> list[Segment]:
    procs = op_processors(graph, placement)
    segs: list[Segment] = []
    for i, p in enumerate(procs):
        if not segs or segs[-1].processor != p:
            segs.append(Segment(p, []))
        segs[-1].ops.append(i)
    producer = {o: k for k, s in enumerate(segs) for i in s.ops for o in graph.ops[i].outputs}
    for k, s in enumerate(segs):
        for i in s.ops:
            for t in graph.ops[i].inputs:
                kind = graph.tensors[t].kind
                crossing = kind == "activation" and producer.get(t, k) != k
                if (kind == "input" or crossing) and t not in s.inputs:
                    s.inputs.append(t)
                    if crossing and t not in segs[producer[t]].outputs:
                        segs[producer[t]].outputs.append(t)
    for t in graph.outputs:
        if t not in segs[producer[t]].outputs:
            segs[producer[t]].outputs.append(t)
    return segs


def subgraph(graph: Graph, seg: Segment, name: str) -> Graph:
    g = Graph(name, graph.meta)
    for t in seg.inputs:
        src = graph.tensors[t]
        g.tensors[t] = Tensor(t, src.shape, src.dtype, "input")
        g.inputs.append(t)
    for i in seg.ops:
        op = graph.ops[i]
        for t in (*op.inputs, *op.outputs):
            if t not in g.tensors:
                g.tensors[t] = graph.tensors[t]
        g.ops.append(op)
    g.outputs = list(seg.outputs)
    g.validate()
    return g


def compile_segment(proc, sub: Graph, states: dict, max_seq: int | None):
    """A segment's subgraph compiled by its processor's backend, with the segment's own states; the
    cuda backend lays out activations by a memory plan, made here for the subgraph."""
    from ..compiler.compile import compile_graph

    plan = None
    if proc.name == "cuda":
        ctx = max(t.shape[0] for t in states.values())  # the context (sliding-window rings are shorter)
        plan = compile_graph(sub, supported_ops=proc.SUPPORTED_OPS, backend="cuda", seq=max_seq or 1, ctx=ctx,
                             fuse=False).plan
    return proc.compile(sub, {t.name: states[t.name] for t in sub.states()}, plan, max_seq=max_seq)


class SplitProgram:
    def __init__(self, backend: "SplitBackend", graph: Graph, states: dict, plan, max_seq: int | None):
        self.segments = split_segments(graph, backend.placement)
        self.parts = []
        for k, s in enumerate(self.segments):
            proc = backend.processor(s.processor)
            sub = subgraph(graph, s, f"{graph.name}.{k}.{s.processor}")
            prog = compile_segment(proc, sub, states, max_seq)
            splits = {u: parse_choice(c) for u, c in backend.placement.items()
                      if parse_choice(c)[2] and parse_choice(c)[0] == s.processor}  # this segment's row splits
            if splits:
                _split_products(prog, backend, splits)
            self.parts.append((s, proc, prog))
        self.graph = graph
        self.backend = backend
        self.seconds: list[float] | None = None

    def run(self, inputs: dict) -> dict:
        if self.backend._streamers:
            from .stream import STREAM_ALL_TOKENS

            kind = "prefill" if len(inputs["tokens"]) > STREAM_ALL_TOKENS else "decode"
            for st in self.backend._streamers.values():
                st.begin_step(kind)
        env = dict(inputs)
        timed = self.seconds is not None
        for k, (seg, proc, prog) in enumerate(self.parts):
            t0 = time.perf_counter() if timed else 0.0
            feed = {k: env[k] for k in ("tokens", "start_pos") if k in env}  # the cuda backend steps by them
            for t in seg.inputs:
                v = env[t]
                if isinstance(v, torch.Tensor):
                    v = _move(v, proc)
                feed[t] = v
            env.update(prog.run(feed))
            if timed:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.seconds[k] += time.perf_counter() - t0
        return {t: env[t] for t in self.graph.outputs}

    def time_segments(self, on: bool = True) -> None:
        """Accumulate each segment's wall time (the GPU synchronised after each: slower, for
        profiles) into self.seconds, in segment order."""
        self.seconds = [0.0] * len(self.parts) if on else None


def _split_products(prog, backend: "SplitBackend", splits: dict) -> None:
    """Row splits: the products of a split unit multiply the first share of the rows here and the
    rest on the other processor at the same time, then the two parts are joined. Here is a
    cpu-fast program (the unit's attention, norms and KV cache stay on the CPU). The other side is
    a cpu-fast processor (a worker thread: torch's kernels release the interpreter lock), or a GPU
    multiplying from weights streamed out of host memory (stream.py), which for a prefill chunk
    takes every row."""
    from .stream import STREAM_ALL_TOKENS, share_rows

    if not hasattr(prog, "product"):
        raise EdgeLLMError("placement: a row split runs its unit on a cpu-fast processor (cpu, cpu:N): "
                           "'rows cpu SHARE | OTHER'")
    own = prog.product
    plan: dict[tuple, tuple] = {}  # names -> (cut, n, other, streamed)
    for op in prog.graph.ops:
        if op.kind not in ("linear", "linear_qkv", "linear_swiglu"):
            continue
        names = prog._weight_names(op)
        unit = "blk." + names[0].split(".")[1] if names[0].startswith("blk.") else "head"  # the output projection
        if unit not in splits:
            continue
        main, share, other = splits[unit]
        n = sum(prog.weights.file.shape_of(t)[1][0] for t in names)
        streamed = other.split(":")[0] == "cuda"
        cut = share_rows(n, share) if streamed else max(1, min(n - 1, int(round(n * share))))
        if cut > 0:
            prog.weights.pack(names, rows=(0, cut))
        if streamed:
            st = backend.streamer(other)
            if cut < n:
                st.prepare(names, (cut, n))
            st.prepare(names, (0, n))  # prefill chunks stream every row
        else:
            backend.processor(other).weights.pack(names, rows=(cut, n))
        prog.weights._packs.pop((names, None), None)  # the whole matrix is not held here
        plan[names] = (cut, n, other, streamed)

    def product(names, x):
        p = plan.get(names)
        if p is None:
            return own(names, x)
        cut, n, other, streamed = p
        if streamed:
            st = backend.streamer(other)
            if x.shape[0] > STREAM_ALL_TOKENS:
                return st.start((names, (0, n)), x).result()
            there = st.start((names, (cut, n)), x) if cut < n else None
        else:
            there = backend.pool().submit(backend.processor(other).weights.pack(names, rows=(cut, n)), x)
        here = prog.weights.pack(names, rows=(0, cut))(x) if cut > 0 else None
        if there is None:
            return here
        got = there.result()
        return got if here is None else torch.cat([here, got], dim=1)

    own_rows = prog.decode_rows

    def decode_rows(names):
        """A one-token product runs wholly here where this processor holds all of its rows for
        decode (a unit whose decode is the CPU's and whose prompt chunks stream to a GPU)."""
        p = plan.get(names)
        if p is None:
            return own_rows(names)
        cut, n, _, _ = p
        return prog.weights.pack(names, rows=(0, cut)).native if cut == n else None

    prog.product = product
    prog.decode_rows = decode_rows


def _move(t: torch.Tensor, proc) -> torch.Tensor:
    dev = getattr(proc, "device", torch.device("cpu"))
    if t.device == dev:
        return t
    if dev.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev).float() if dev.type == "cpu" else t.to(dev)


class SplitBackend:
    """The backend protocol over several processors, one backend instance each."""

    name = "split"
    SUPPORTED_OPS = None

    def __init__(self, f, placement: dict[str, str]):
        self.file = f
        self.placement = dict(placement)
        self._procs: dict[str, object] = {}
        self._pool = None
        self._streamers: dict[str, object] = {}

    def streamer(self, name: str):
        """The streamed products of one GPU (stream.py): made once, shared by every program."""
        st = self._streamers.get(name)
        if st is None:
            from .stream import StreamedProducts

            proc = self.processor(name)  # the device, as the cuda backend chose it
            st = self._streamers[name] = StreamedProducts(self.file, proc.device)
        return st

    def pool(self):
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgellm-split")
        return self._pool

    def processor(self, name: str):
        proc = self._procs.get(name)
        if proc is None:
            kind = name.split(":")[0]
            if kind == "cpu":
                from ..backends.cpu_fast import CpuFastBackend

                # one packed copy per distinct 'cpu:N' processor (CI splits cpu+cpu)
                proc = CpuFastBackend(self.file, threads=torch.get_num_threads())
            elif kind == "cuda":
                from ..backends.cuda.backend import CudaBackend

                if ":" in name:
                    torch.cuda.set_device(int(name.split(":")[1]))
                    os.environ.setdefault("EDGELLM_CUDA_DEVICE", name)
                proc = CudaBackend(self.file)
            else:
                raise EdgeLLMError(f"placement: unknown processor '{name}' (cpu, cpu:N, cuda, cuda:N)")
            self._procs[name] = proc
        return proc

    def allocate_states(self, graph: Graph, ctx: int) -> dict:
        states = {}
        for t in graph.states():
            u = unit_of_state(t.name)
            if u not in self.placement:
                raise GraphError(f"placement: no processor for the cache '{t.name}' (unit {u})")
            one = Graph("state", graph.meta)
            one.tensors[t.name] = t
            states.update(self.processor(parse_choice(self.placement[u])[0]).allocate_states(one, ctx))
        return states

    def compile(self, graph: Graph, states: dict, plan=None, max_seq: int | None = None) -> SplitProgram:
        return SplitProgram(self, graph, states, plan, max_seq)

    @staticmethod
    def to_numpy(t: torch.Tensor):
        return t.detach().to(torch.float32).cpu().numpy()

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for u, p in self.placement.items():
            p = parse_choice(p)[0] if not p.startswith("rows ") else p
            if u.startswith("blk."):
                counts[p] = counts.get(p, 0) + 1
        return "split: " + ", ".join(f"{n} layers on {p}" for p, n in counts.items()) + \
            f"; head on {self.placement.get('head')}"


def load_split(path=None, placement: dict[str, str] | None = None, ctx: int | None = None, **kw):
    """A Model whose units run where `placement` says (unit -> processor)."""
    from ..model import load

    return load(path, backend=lambda f: SplitBackend(f, placement or {}), ctx=ctx, **kw)
