"""The compile step between a model's Graph and a backend: passes, delegation, memory plan.

    program = compile_graph(graph, supported_ops=backend.SUPPORTED_OPS, seq=512, ctx=4096)

- passes (cleanup, fusion) rewrite the graph;
- delegation cuts the op list into segments, each on the backend that supports its ops (the
  rest fall back to the cpu backend), and counts the tensors that cross each cut;
- the memory plan places every intermediate tensor in one arena (or shared objects), sized at
  the compile-time maximum of the graph's symbols (`seq` = the prefill chunk, `ctx`).
Everything here works from shapes and metadata alone: no weight is read.
"""

from __future__ import annotations

import sympy

from ..errors import GraphError
from ..graph.ir import DTYPE_BYTES, SEQ, Graph
from ..graph.ops import KV_LEN, RULES, flops
from .memory import MemoryPlan, UsageRecord, lower_bound, plan_all, plan_memory, validate_plan
from .passes import run_passes
from .program import CompiledGraph, Segment

__all__ = ["ALL_OPS", "FUSED_OPS", "CompiledGraph", "Segment", "check_graph", "compile_graph", "graph_flops",
           "partition", "tensor_bytes", "usage_records"]

FUSED_OPS = {"add_rms_norm", "swiglu", "linear_swiglu", "rope_store", "linear_qkv", "rope_qkv_store"}
ALL_OPS = set(RULES) | FUSED_OPS


def tensor_bytes(graph: Graph, name: str, sizes: dict[str, int]) -> int:
    t = graph.tensors[name]
    n = 1
    for d in t.concrete_shape(**sizes):
        n *= d
    return n * DTYPE_BYTES.get(t.dtype, 4)


def usage_records(graph: Graph, sizes: dict[str, int], in_place: frozenset = frozenset()) -> list[UsageRecord]:
    """One record per intermediate tensor (activations that are not graph outputs and do not
    alias state): produced at its op's index, live until the last op reading it.
    in_place: op kinds whose backend may read the result from the first input's storage (a
    reshape of contiguous data): that input then stays live as long as the result is read."""
    last = graph.last_uses()
    records = []
    for i, op in enumerate(graph.ops):
        for o in op.outputs:
            t = graph.tensors[o]
            if t.alias_of is not None or o in graph.outputs:
                continue
            if o not in last:  # produced, never read (a fused op's unused side output)
                last_use = i
            else:
                last_use = last[o]
            records.append(UsageRecord(o, max(tensor_bytes(graph, o, sizes), 1), i, last_use))
    if in_place:
        at = {r.tensor: k for k, r in enumerate(records)}
        for op in reversed(graph.ops):  # later reads first, so that chains pass them back to their root
            if op.kind in in_place and op.inputs and op.inputs[0] in at and op.outputs[0] in at:
                src, out = records[at[op.inputs[0]]], records[at[op.outputs[0]]]
                if out.last > src.last:
                    records[at[src.tensor]] = UsageRecord(src.tensor, src.size, src.first, out.last)
    return records


def check_graph(graph: Graph) -> None:
    """Reject a malformed graph: unknown op kinds, a read before any write (a cycle or a dangling
    tensor), an output no op produces, a tensor written twice."""
    seen: dict[str, str] = {}
    for op in graph.ops:
        if op.kind not in ALL_OPS:
            raise GraphError(f"op '{op.name}': unknown op kind '{op.kind}'")
        for o in op.outputs:
            if o in seen:
                raise GraphError(f"op '{op.name}': tensor '{o}' is already written by op '{seen[o]}'")
            if o not in graph.tensors:
                raise GraphError(f"op '{op.name}': output '{o}' has no tensor declaration (shape cannot be derived)")
            seen[o] = op.name
    graph.validate()


def partition(graph: Graph, supported: set[str], backend: str) -> list[Segment]:
    """Cut the op list into maximal runs on `backend` (ops it supports) or on 'cpu' (the rest)."""
    segments: list[Segment] = []
    producer_seg: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        where = backend if op.kind in supported else "cpu"
        if not segments or segments[-1].backend != where:
            segments.append(Segment(where, []))
        seg = segments[-1]
        seg.ops.append(i)
        for t in op.inputs:
            src = producer_seg.get(t)
            if src is not None and segments[src].backend != where and t not in seg.inputs_in:
                seg.inputs_in.append(t)
        for o in op.outputs:
            producer_seg[o] = len(segments) - 1
    return segments


def compile_graph(graph: Graph, *, supported_ops: set[str] | None = None, backend: str = "cpu",
                  seq: int = 512, ctx: int = 4096, fuse: bool = True, alignment: int = 256,
                  planner: str = "all", sizes: dict[str, int] | None = None,
                  skip_passes: frozenset = frozenset(), in_place: frozenset = frozenset()) -> CompiledGraph:
    """planner: "all" runs every memory planner and keeps the smallest plan (what `edgellm plan`
    reports); a strategy name (memory.STRATEGIES) runs only that one, as a model's load does:
    the min-cost-flow planner alone took 1.5 s of a 135M model's load and its plan is not used.
    sizes: values of further symbols (an imported network's batch, height, ...) for the plan.
    skip_passes: fusion passes the backend does without (its SKIP_PASSES).
    in_place: op kinds the backend may run in place (usage_records)."""
    check_graph(graph)
    original = len(graph.ops)
    g, reports = run_passes(graph, fuse=fuse, skip=frozenset(skip_passes))
    check_graph(g)
    supported = ALL_OPS if supported_ops is None else set(supported_ops)
    segments = partition(g, supported, backend)
    sizes = {"seq": seq, "ctx": ctx, **(sizes or {})}
    records = usage_records(g, sizes, frozenset(in_place))
    if not records:
        plans = {}
    elif planner == "all":
        plans = plan_all(records, alignment=alignment)
    else:
        plans = {planner: plan_memory(records, planner, alignment=alignment)}
    best = min(plans.values(), key=lambda p: p.total_bytes) if plans else MemoryPlan("naive", 0, {}, None, None)
    if records:
        validate_plan(best, records)
    return CompiledGraph(g, original, reports, segments, sizes, records, plans, best,
                         lower_bound(records, alignment=alignment) if records else 0)


def graph_flops(graph: Graph, seq: int, kv_len: int) -> int:
    """Arithmetic operations of one run of the graph over seq tokens attending to kv_len keys."""
    total = sympy.Integer(0)
    for op in graph.ops:
        total += flops(op.kind, [graph.tensors[i] for i in op.inputs], graph.tensors[op.outputs[0]], op.attrs)
    return int(total.subs({SEQ: seq, KV_LEN: kv_len}))
