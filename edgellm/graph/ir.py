"""The graph IR: ops over logical tensors whose shapes are symbolic expressions.

One IR serves every model; a model family is a *builder* that emits a Graph from metadata
(edgellm.models), and a backend *executes* a Graph (edgellm.backends). Nothing here knows about
either.

Shapes are tuples of sympy expressions in the graph's symbols (`seq`: tokens processed in this
step, `ctx`: the KV-cache capacity). Each op's output shape is derived by its rule in
edgellm.graph.ops when the op is added, so every tensor in a graph has a known symbolic shape.
Activations are 2-D [tokens, features]: attention heads are an attribute of the ops that need
them, not an axis, which keeps layouts a backend decision (tensor virtualization).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import GraphError
from .shapes import shape_function

if TYPE_CHECKING:
    import sympy

Shape = tuple  # of sympy expressions, ints, or SymDims (graphs read back from the program cache)

# Every size symbol by name (positive integers). Language models use seq and ctx; imported networks
# (ONNX) add their own dynamic dimensions (batch, height, width, ...) through symbol(). Made on first
# use, with sympy: a program read back from the cache runs without importing sympy at all.
_SYMBOLS: dict = {}


def symbol(name: str) -> "sympy.Symbol":
    """The size symbol called `name` (a positive integer), registered on first use."""
    s = _SYMBOLS.get(name)
    if s is None:
        import sympy

        s = _SYMBOLS[name] = sympy.Symbol(name, integer=True, positive=True)
    return s


def __getattr__(name: str):
    """SEQ, CTX and SYMBOLS (the registry, with seq and ctx in it), made on first use."""
    if name in ("SEQ", "CTX", "SYMBOLS"):
        g = globals()
        g.setdefault("SEQ", symbol("seq"))
        g.setdefault("CTX", symbol("ctx"))
        g.setdefault("SYMBOLS", _SYMBOLS)
        return g[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i64": 8}


@dataclass
class Tensor:
    """A logical tensor. kind: 'input' (fed per call), 'weight' (from the model file), 'state'
    (persists across calls: the KV cache), or 'activation' (an intermediate or an output)."""

    name: str
    shape: Shape
    dtype: str
    kind: str
    # for weights: the stored format (GGML type name) and the source tensor in the model file
    storage: str | None = None
    source: str | None = None
    # for activations that alias a state tensor after an in-place update (kv_store)
    alias_of: str | None = None

    def numel(self, **sizes: int) -> int:
        return math.prod(self.concrete_shape(**sizes))

    def nbytes_expr(self) -> "sympy.Expr":
        import sympy

        return sympy.Mul(*self.shape, DTYPE_BYTES.get(self.dtype, 4))

    def concrete_shape(self, **sizes: int) -> tuple[int, ...]:
        try:
            return shape_function(self.shape)(sizes)
        except GraphError as e:
            raise GraphError(f"tensor '{self.name}': {e}") from None


def row_slice(source: str, start: int, stop: int) -> str:
    """The source name of rows start..stop-1 of a stored tensor (GGUFFile.tensor reads it)."""
    return f"{source}[{start}:{stop}]"


def col_slice(source: str, start: int, stop: int) -> str:
    """The source name of columns start..stop-1 of a stored 2-D tensor (whole blocks of its format:
    a tensor-parallel rank's share of a projection's inputs)."""
    return f"{source}[:,{start}:{stop}]"


@dataclass
class Op:
    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)


class Graph:
    """A topologically ordered list of ops over named tensors."""

    def __init__(self, name: str, meta: dict[str, Any] | None = None):
        self.name = name
        self.meta: dict[str, Any] = dict(meta or {})
        self.tensors: dict[str, Tensor] = {}
        self.ops: list[Op] = []
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self._counter = 0

    # -- construction -------------------------------------------------------------------------
    def _add_tensor(self, t: Tensor) -> str:
        if t.name in self.tensors:
            raise GraphError(f"graph '{self.name}': tensor '{t.name}' defined twice")
        self.tensors[t.name] = t
        return t.name

    def input(self, name: str, shape: Shape, dtype: str = "i32") -> str:
        self.inputs.append(name)
        return self._add_tensor(Tensor(name, tuple(shape), dtype, "input"))

    def weight(self, name: str, shape: Shape, storage: str, source: str | None = None) -> str:
        return self._add_tensor(Tensor(name, tuple(shape), "f32", "weight", storage=storage, source=source or name))

    def state(self, name: str, shape: Shape, dtype: str = "f32") -> str:
        return self._add_tensor(Tensor(name, tuple(shape), dtype, "state"))

    def op(self, kind: str, *inputs: str, name: str | None = None, out: str | None = None, **attrs: Any) -> str:
        """Append an op; its output shape and dtype come from the op's rule. Returns the output name."""
        from .ops import infer  # the op table depends on this module

        for i in inputs:
            if i not in self.tensors:
                raise GraphError(f"graph '{self.name}': op {kind} reads unknown tensor '{i}'")
        self._counter += 1
        op_name = name or f"{kind}_{self._counter}"
        shape, dtype, alias = infer(kind, [self.tensors[i] for i in inputs], attrs, op_name)
        out_name = out or f"{op_name}.out"
        self._add_tensor(Tensor(out_name, shape, dtype, "activation", alias_of=alias))
        self.ops.append(Op(op_name, kind, tuple(inputs), (out_name,), attrs))
        return out_name

    def output(self, name: str) -> None:
        if name not in self.tensors:
            raise GraphError(f"graph '{self.name}': output '{name}' is not a tensor of the graph")
        self.outputs.append(name)

    # -- queries ------------------------------------------------------------------------------
    def weights(self) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.kind == "weight"]

    def states(self) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.kind == "state"]

    def producers(self) -> dict[str, int]:
        return {o: i for i, op in enumerate(self.ops) for o in op.outputs}

    def last_uses(self) -> dict[str, int]:
        """For each tensor, the index of the last op that reads it (graph outputs: len(ops))."""
        last: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            for t in op.inputs:
                last[t] = i
        for t in self.outputs:
            last[t] = len(self.ops)
        return last

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for op in self.ops:
            counts[op.kind] = counts.get(op.kind, 0) + 1
        return counts

    def validate(self) -> None:
        """Every op reads tensors that exist before it runs; every output is produced."""
        available = {n for n, t in self.tensors.items() if t.kind in ("input", "weight", "state")}
        for op in self.ops:
            for t in op.inputs:
                if t not in available:
                    raise GraphError(
                        f"graph '{self.name}': op '{op.name}' ({op.kind}) reads '{t}' before any op produces it"
                    )
            available.update(op.outputs)
        for t in self.outputs:
            if t not in available:
                raise GraphError(f"graph '{self.name}': output '{t}' is never produced")

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self.ops)} ops, {len(self.tensors)} tensors)"
