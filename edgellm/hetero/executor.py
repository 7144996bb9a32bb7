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
from dataclasses import dataclass, field

import torch

from ..errors import EdgeLLMError, GraphError
from ..graph.ir import Graph, Tensor
from .units import unit_of_op, unit_of_state


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
        procs.append(placement[u])
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


class SplitProgram:
    def __init__(self, backend: "SplitBackend", graph: Graph, states: dict, plan, max_seq: int | None):
        from ..compiler.compile import compile_graph

        self.segments = split_segments(graph, backend.placement)
        self.parts = []
        for k, s in enumerate(self.segments):
            proc = backend.processor(s.processor)
            sub = subgraph(graph, s, f"{graph.name}.{k}.{s.processor}")
            st = {t.name: states[t.name] for t in sub.states()}
            sub_plan = None
            if proc.name == "cuda":  # the cuda backend lays out activations by a memory plan of its own
                sizes = max_seq or 1
                ctx = next(iter(states.values())).shape[0]
                sub_plan = compile_graph(sub, supported_ops=proc.SUPPORTED_OPS, backend="cuda", seq=sizes,
                                         ctx=ctx, fuse=False).plan
            self.parts.append((s, proc, proc.compile(sub, st, sub_plan, max_seq=max_seq)))
        self.graph = graph

    def run(self, inputs: dict) -> dict:
        env = dict(inputs)
        for seg, proc, prog in self.parts:
            feed = {k: env[k] for k in ("tokens", "start_pos") if k in env}  # the cuda backend steps by them
            for t in seg.inputs:
                v = env[t]
                if isinstance(v, torch.Tensor):
                    v = _move(v, proc)
                feed[t] = v
            env.update(prog.run(feed))
        return {t: env[t] for t in self.graph.outputs}


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
            states.update(self.processor(self.placement[u]).allocate_states(one, ctx))
        return states

    def compile(self, graph: Graph, states: dict, plan=None, max_seq: int | None = None) -> SplitProgram:
        return SplitProgram(self, graph, states, plan, max_seq)

    @staticmethod
    def to_numpy(t: torch.Tensor):
        return t.detach().to(torch.float32).cpu().numpy()

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for u, p in self.placement.items():
            if u.startswith("blk."):
                counts[p] = counts.get(p, 0) + 1
        return "split: " + ", ".join(f"{n} layers on {p}" for p, n in counts.items()) + \
            f"; head on {self.placement.get('head')}"


def load_split(path=None, placement: dict[str, str] | None = None, ctx: int | None = None, **kw):
    """A Model whose units run where `placement` says (unit -> processor)."""
    from ..model import load

    return load(path, backend=lambda f: SplitBackend(f, placement or {}), ctx=ctx, **kw)
