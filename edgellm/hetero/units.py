"""A compiled graph cut into placement units: 'embed', 'blk.0' .. 'blk.{L-1}', 'head'.

An op belongs to the layer its name starts with (`blk.N.`); the embedding lookup to 'embed';
everything after the last layer (last row, final norm, output projection) to 'head'. A fused op
keeps its first op's name, so the residual add + next layer's norm belongs to the layer it ends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..graph.ir import Graph

_LAYER = re.compile(r"^blk\.(\d+)\.")
_STATE_LAYER = re.compile(r"\.(\d+)$")


def unit_of_op(name: str, kind: str, seen_layer: bool) -> str:
    m = _LAYER.match(name)
    if m:
        return f"blk.{m.group(1)}"
    return "head" if seen_layer else "embed"


def unit_of_state(name: str) -> str:
    """KV-cache tensors are named cache.k.N / cache.v.N."""
    m = _STATE_LAYER.search(name)
    return f"blk.{m.group(1)}" if m else "embed"


@dataclass
class Unit:
    name: str
    ops: list[int] = field(default_factory=list)
    weights: list[str] = field(default_factory=list)  # source tensors in the model file
    states: list[str] = field(default_factory=list)


def graph_units(graph: Graph) -> list[Unit]:
    units: dict[str, Unit] = {}
    seen_layer = False
    for i, op in enumerate(graph.ops):
        u = unit_of_op(op.name, op.kind, seen_layer)
        seen_layer |= u.startswith("blk.")
        unit = units.setdefault(u, Unit(u))
        unit.ops.append(i)
        for t in op.inputs:
            tt = graph.tensors[t]
            if tt.kind == "weight" and (tt.source or t) not in unit.weights:
                unit.weights.append(tt.source or t)
            if tt.kind == "state" and t not in unit.states:
                unit.states.append(t)
    return list(units.values())
