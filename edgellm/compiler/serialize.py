"""Compiled graphs to and from plain JSON data, for the program cache (edgellm.cache).

JSON, not pickle: a cache file is read back as data, never as code. A symbolic dimension is
written as its expression text and symbol names and read back as a SymDim (edgellm.graph.shapes),
so that running a cached program never imports sympy (0.5 s here, 2.3 s on the H100 host); the
classes that need sympy's expressions get them through SymDim's sympy protocol.
"""

from __future__ import annotations

from ..errors import GraphError
from ..graph.ir import Graph, Op, Tensor
from ..graph.shapes import SymDim, dim_text
from .memory import MemoryPlan, UsageRecord
from .passes import PassReport
from .program import CompiledGraph, Segment


def _dim_out(d) -> int | list:
    text, names = dim_text(d)
    return int(text) if not names else [text, list(names)]


def _dims_in(dims: list) -> tuple:
    return tuple(d if isinstance(d, int) else SymDim(d[0], tuple(d[1])) for d in dims)


def _attr_in(v):
    return tuple(_attr_in(x) for x in v) if isinstance(v, list) else v


def graph_to_data(g: Graph) -> dict:
    return {
        "name": g.name, "meta": g.meta, "inputs": g.inputs, "outputs": g.outputs, "counter": g._counter,
        "tensors": [[t.name, [_dim_out(d) for d in t.shape], t.dtype, t.kind, t.storage, t.source, t.alias_of]
                    for t in g.tensors.values()],
        "ops": [[op.name, op.kind, list(op.inputs), list(op.outputs), op.attrs] for op in g.ops],
    }


def graph_from_data(d: dict) -> Graph:
    g = Graph(d["name"], d["meta"])
    for name, dims, dtype, kind, storage, source, alias in d["tensors"]:
        g.tensors[name] = Tensor(name, _dims_in(dims), dtype, kind, storage, source, alias)
    g.ops = [Op(name, kind, tuple(ins), tuple(outs), {k: _attr_in(v) for k, v in attrs.items()})
             for name, kind, ins, outs, attrs in d["ops"]]
    g.inputs, g.outputs, g._counter = list(d["inputs"]), list(d["outputs"]), d["counter"]
    return g


def _plan_to_data(p: MemoryPlan) -> dict:
    return {"strategy": p.strategy, "total_bytes": p.total_bytes, "offsets": p.offsets, "objects": p.objects,
            "assignment": p.assignment, "alignment": p.alignment, "naive_bytes": p.naive_bytes,
            "lower_bound_bytes": p.lower_bound_bytes, "variant": p.variant}


def compiled_to_data(c: CompiledGraph) -> dict:
    return {
        "graph": graph_to_data(c.graph),
        "original_ops": c.original_ops,
        "pass_reports": [[r.name, r.ops_before, r.ops_after, r.counts_after] for r in c.pass_reports],
        "segments": [[s.backend, s.ops, s.inputs_in] for s in c.segments],
        "sizes": c.sizes,
        "records": [[r.tensor, r.size, r.first, r.last] for r in c.records],
        "plans": {k: _plan_to_data(p) for k, p in c.plans.items()},
        "plan": c.plan.strategy,
        "lower_bound": c.lower_bound,
    }


def compiled_from_data(d: dict) -> CompiledGraph:
    """The inverse of compiled_to_data; raises GraphError when the data is not a compiled graph
    (the cache treats that as a miss)."""
    try:
        plans = {k: MemoryPlan(**p) for k, p in d["plans"].items()}
        plan = plans[d["plan"]] if d["plan"] in plans else MemoryPlan("naive", 0, {}, None, None)
        g = graph_from_data(d["graph"])
        g.validate()
        return CompiledGraph(
            g, d["original_ops"], [PassReport(*r) for r in d["pass_reports"]],
            [Segment(b, list(ops), list(ins)) for b, ops, ins in d["segments"]], dict(d["sizes"]),
            [UsageRecord(*r) for r in d["records"]], plans, plan, d["lower_bound"])
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise GraphError(f"not a compiled graph: {type(e).__name__}: {e}") from None
