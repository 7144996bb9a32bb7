"""What the compile step produces: a compiled graph with its delegation segments and memory
plan (a light module: a program read back from the cache needs it without the compiler)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..graph.ir import Graph
from .memory import MemoryPlan, UsageRecord
from .passes import PassReport


@dataclass
class Segment:
    backend: str
    ops: list[int]  # indices into the graph's op list
    inputs_in: list[str] = field(default_factory=list)  # activations transferred in at the cut


@dataclass
class CompiledGraph:
    graph: Graph
    original_ops: int
    pass_reports: list[PassReport]
    segments: list[Segment]
    sizes: dict[str, int]
    records: list[UsageRecord]
    plans: dict[str, MemoryPlan]
    plan: MemoryPlan
    lower_bound: int

    @property
    def transfers(self) -> int:
        return sum(len(s.inputs_in) for s in self.segments)

    def kernel_counts(self) -> dict[str, int]:
        return self.graph.op_counts()
