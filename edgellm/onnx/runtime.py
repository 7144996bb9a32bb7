"""Run an imported network: compile its graph once per set of input sizes, execute op by op.

The graph's shapes are expressions in the network's size symbols (batch, height, ...). A call
binds them from the input arrays; for each distinct binding the compiled graph gets concrete op
attributes (symbolic reshape targets evaluated) and, on the cpu backend, a memory plan whose
arena holds every intermediate (the planner's offsets are used as they are, so a wrong plan
would corrupt the results the tests compare with onnxruntime).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import sympy
import torch

from ..compiler.compile import CompiledGraph, compile_graph
from ..backends.cuda.graphs import captured
from ..errors import EdgeLLMError, GraphError
from ..graph.ir import SYMBOLS, Graph, Op


class InputError(EdgeLLMError):
    """An input array is missing, extra, or of the wrong rank or size."""


def _concrete(v, subs):
    if isinstance(v, sympy.Basic):
        r = v.subs(subs)
        if not r.is_number:
            raise GraphError(f"value {v} is not known for sizes {subs}")
        return int(r) if r.is_Integer or r == int(r) else float(r)
    if isinstance(v, tuple):
        return tuple(_concrete(x, subs) for x in v)
    if isinstance(v, list):
        return [_concrete(x, subs) for x in v]
    return v


def bind_sizes(graph: Graph, arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """Size symbols from the input arrays' shapes; static dimensions are checked."""
    sizes: dict[str, int] = {}
    for name in graph.inputs:
        shape = graph.tensors[name].shape
        arr = arrays[name]
        if arr.ndim != len(shape):
            raise InputError(f"input '{name}': expected rank {len(shape)} {tuple(map(str, shape))}, got shape {arr.shape}")
        for k, (d, n) in enumerate(zip(shape, arr.shape)):
            if d.is_Integer:
                if int(d) != n:
                    raise InputError(f"input '{name}': dimension {k} must be {int(d)}, got {n} (shape {arr.shape})")
            elif d.is_Symbol:
                if sizes.setdefault(d.name, n) != n:
                    raise InputError(f"input '{name}': dimension {k} ('{d.name}') is {n}, another input has {sizes[d.name]}")
            else:
                raise InputError(f"input '{name}': dimension {k} is the expression {d}; not bindable")
    return sizes


@dataclass
class BoundProgram:
    compiled: CompiledGraph
    ops: list[Op]  # attrs with every size expression evaluated
    kernels: list[Callable]
    free_after: list[list[str]]
    views: dict[str, tuple[int, tuple[int, ...]]]  # planned tensor -> (byte offset, shape)
    sizes: dict[str, int] = field(default_factory=dict)
    delegated: list[str] = field(default_factory=list)  # names of the ops run by the cpu kernels
    recording: object = None  # a recording backend's replayable program (TensorOps.records)


class TensorOps:
    """How a backend holds the runner's tensors: torch tensors on a device (the cpu and cuda
    backends; this class), or another backend's handles (webgpu: edgellm.backends.webgpu.vision).

    records: False: every call runs the kernels op by op on values. True: the kernels, called once
    per input sizes on placeholder handles, record a program (record), and each call replays it."""

    records = False
    in_place: frozenset = frozenset()  # op kinds whose result may be the first input's storage (compile_graph)

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self._arena: torch.Tensor | None = None
        self.esize = torch.tensor([], dtype=dtype).element_size()

    def from_host(self, a: np.ndarray):
        return torch.as_tensor(np.ascontiguousarray(a)).to(self.device, self.dtype)

    def to_host(self, value) -> np.ndarray:
        return value.float().cpu().numpy()

    def reserve(self, plan_bytes: int) -> None:
        """An arena for a memory plan of plan_bytes (planned in float32 bytes)."""
        need = plan_bytes * self.esize // 4
        if self._arena is None or self._arena.numel() < need:
            self._arena = torch.empty(need, dtype=torch.uint8, device=self.device)

    def begin_op(self, op: Op) -> None:
        """Called before each op's kernel (a recording backend learns where its outputs go)."""

    def store(self, value, offset: int, shape: tuple[int, ...]):
        """The value in its planned place in the arena (offset in float32 plan bytes)."""
        off = offset * self.esize // 4
        view = self._arena[off: off + self.esize * math.prod(shape)].view(self.dtype).view(shape)
        view.copy_(value)
        return view

    def delegate(self, fn: Callable) -> Callable:
        """A cpu reference kernel for an op the backend does not run itself."""
        return _on_cpu(fn, self.device, self.dtype)


class GraphRunner:
    """Executes a graph with one backend's kernel table (and the cpu kernels for delegated ops).

    kernels: op kind -> f(op, inputs); supported: the kinds the backend runs itself (the rest are
    delegated to the cpu reference kernels, after moving their inputs to the host)."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor], kernels: dict[str, Callable],
                 supported: set[str], backend: str, device: torch.device, dtype: torch.dtype,
                 fuse: bool = True, use_arena: bool = True, graphs: bool = False,
                 tensor_ops: TensorOps | None = None):
        self.graph = graph
        self.weights = weights
        self.kernels = kernels
        self.supported = supported
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.fuse = fuse
        self.use_arena = use_arena
        self._bound: dict[tuple, BoundProgram] = {}
        self.tensor_ops = tensor_ops if tensor_ops is not None else TensorOps(device, dtype)
        self.graphs = graphs
        self._graphs: dict[tuple, tuple] = {}
        self._warmed: set[tuple] = set()
        self.graph_errors: dict[tuple, str] = {}  # sizes whose capture failed, and why

    def compile(self, sizes: dict[str, int]) -> CompiledGraph:
        return compile_graph(self.graph, supported_ops=self.supported, backend=self.backend, fuse=self.fuse,
                             sizes=sizes, in_place=self.tensor_ops.in_place)

    def bind(self, sizes: dict[str, int]) -> BoundProgram:
        key = tuple(sorted(sizes.items()))
        b = self._bound.get(key)
        if b is not None:
            return b
        from ..backends.cpu import CPU_KERNELS

        c = self.compile(sizes)
        subs = {SYMBOLS[k]: v for k, v in sizes.items()}
        g = c.graph
        ops = [Op(op.name, op.kind, op.inputs, op.outputs, {k: _concrete(v, subs) for k, v in op.attrs.items()})
               for op in g.ops]
        on_backend = {i for s in c.segments if s.backend == self.backend for i in s.ops}
        kernels, delegated = [], []
        for i, op in enumerate(ops):
            if i in on_backend and op.kind in self.kernels:
                kernels.append(self.kernels[op.kind])
            else:
                kernels.append(self.tensor_ops.delegate(CPU_KERNELS[op.kind]))
                delegated.append(op.name)
        last = g.last_uses()
        free: list[list[str]] = [[] for _ in ops]
        for name, i in last.items():
            if g.tensors[name].kind == "activation" and i < len(ops):
                free[i].append(name)
        views = {}
        if self.use_arena and c.plan.total_bytes:
            offsets = _offsets(c.plan)
            for name, off in offsets.items():
                views[name] = (off, g.tensors[name].concrete_shape(**sizes))
        b = BoundProgram(c, ops, kernels, free, views, dict(sizes), delegated)
        self._bound[key] = b
        return b

    def run(self, arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
        sizes = bind_sizes(self.graph, arrays)
        env = {n: self.tensor_ops.from_host(arrays[n]) for n in self.graph.inputs}
        return [self.tensor_ops.to_host(o) for o in self.execute(sizes, env)]

    def run_device(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Inputs already on the device in the backend's dtype; outputs stay there. With
        graphs=True (cuda), the op sequence is captured in a CUDA graph per input sizes at the
        second call and replayed after (inputs copied into the captured buffers)."""
        sizes = bind_sizes(self.graph, {n: np.empty(tuple(t.shape), dtype=np.uint8) for n, t in tensors.items()})
        if not self.graphs or self.device.type != "cuda":
            return self.execute(sizes, dict(tensors))
        key = tuple(sorted(sizes.items()))
        cg = self._graphs.get(key)
        if cg is None:
            if key not in self._warmed:  # first call eager: compiles, tunes and packs outside the capture
                self._warmed.add(key)
                return self.execute(sizes, dict(tensors))
            if key in self.graph_errors:
                return self.execute(sizes, dict(tensors))
            static_in = {n: t.clone() for n, t in tensors.items()}
            graph = torch.cuda.CUDAGraph()
            try:
                with captured(graph):
                    static_out = self.execute(sizes, dict(static_in))
            except Exception as e:  # an op that cannot be captured: run this size eagerly from now on
                self.graph_errors[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                torch.cuda.synchronize()
                return self.execute(sizes, dict(tensors))
            cg = self._graphs[key] = (graph, static_in, static_out)
        graph, static_in, static_out = cg
        for n, t in tensors.items():
            static_in[n].copy_(t)
        graph.replay()
        return static_out

    def execute(self, sizes: dict[str, int], env: dict) -> list:
        b = self.bind(sizes)
        ops = self.tensor_ops
        if ops.records:  # recorded once per input sizes (the kernels on placeholders), replayed per call
            if b.recording is None:
                b.recording = ops.record(b, self._run_ops)
            return ops.replay(b.recording, env)
        return self._run_ops(b, env)

    def _run_ops(self, b: BoundProgram, env: dict) -> list:
        g = b.compiled.graph
        ops = self.tensor_ops
        if b.views:
            ops.reserve(b.compiled.plan.total_bytes)
        for t in g.weights():
            env[t.name] = self.weights[t.source or t.name]
        with torch.inference_mode():
            for op, kern, free in zip(b.ops, b.kernels, b.free_after):
                ops.begin_op(op)
                try:
                    value = kern(op, [env[i] for i in op.inputs])
                except (RuntimeError, ValueError, IndexError) as e:
                    raise GraphError(f"op '{op.name}' ({op.kind}) failed: {str(e).splitlines()[0]}") from None
                values = value if isinstance(value, tuple) else (value,)  # a fused kind may have several outputs
                for name, value in zip(op.outputs, values):
                    v = b.views.get(name)
                    if v is not None:
                        value = ops.store(value, *v)
                    env[name] = value
                for n in free:
                    env.pop(n, None)
        return [env[o] for o in g.outputs]


def _offsets(plan) -> dict[str, int]:
    from ..backends.cpu import plan_offsets

    return plan_offsets(plan)


def _on_cpu(fn: Callable, device: torch.device, dtype: torch.dtype) -> Callable:
    """A cpu reference kernel for an op the backend delegates: inputs to the host in float32, back after."""
    if device.type == "cpu" and dtype == torch.float32:
        return fn

    def run(op, ins):
        y = fn(op, [x.float().cpu() for x in ins])
        return tuple(t.to(device, dtype) for t in y) if isinstance(y, tuple) else y.to(device, dtype)
    return run
