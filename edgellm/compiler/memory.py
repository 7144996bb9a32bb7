"""Memory planning for intermediate tensors: which tensors may share bytes, and where each lives.

Input is one :class:`UsageRecord` per intermediate tensor: its size in bytes and the inclusive
range ``[first, last]`` of op indices (in execution order) during which it must stay intact —
``first`` is the op that writes it, ``last`` the last op that reads it. Two tensors *conflict*
when those ranges intersect; conflicting tensors must not share bytes, the others may.

This follows TFLite GPU's memory management (Pisarchyk & Lee, "Efficient Memory Management for
Deep Neural Net Inference", 2020), which ML Drift also uses. Two kinds of plan exist:

* **shared objects** (``objects`` + ``assignment``): a handful of buffers, each reused by tensors
  whose lifetimes do not intersect. Needed where a tensor must be its own allocation (textures,
  APIs without sub-buffer views). ``total_bytes`` is the sum of the object sizes.
* **one arena** (``offsets``): a single buffer, each tensor at a byte offset. ``total_bytes`` is
  the arena size. Any shared-object plan can be laid out as an arena of the same size, so the
  best arena is never larger; the greedy arena is usually the smallest plan found.

Strategies (``STRATEGIES``):

``naive``
    Every tensor its own object; the reference the others are reported against.
``greedy_shared``
    Shared objects, greedy. Two variants of the paper are run and the smaller plan is kept (the
    plan's ``variant`` says which; the second only runs if the first is above the lower bound):

    * *greedy in order* (TFLite ``GreedyInOrderAssignment``): walk tensors by ``first``; objects
      whose last tensor has died go back to a pool; a new tensor takes the smallest pooled object
      at least as large as itself, else the largest pooled object (grown to fit), else a new one.
    * *greedy by size for shared objects*: walk tensors from the largest down; each takes the
      smallest existing object that is idle during its whole lifetime (objects never grow since
      the tensors come largest first), else a new object.
``greedy_by_size``
    One arena, greedy by size (TFLite ``GreedyBySizeAssignment``, ML Drift's offset calculation):
    largest tensors first; each is placed among the already placed tensors whose lifetimes
    intersect its own. Two gap rules are run and the smaller arena kept (``variant``; the second
    only if the first is above the lower bound):
    *first fit* (the lowest offset where it fits) and *best fit* (the smallest gap that fits, the
    paper's rule); if no gap fits, the tensor goes just above the highest conflicting tensor.
``min_cost_flow``
    Shared objects from TFLite GPU's min-cost-flow formulation, solved by networkx's network
    simplex (``networkx.min_cost_flow``). Every tensor ``j`` must get an object exactly once: it
    either opens a new one (cost ``size_j``) or inherits the object of a tensor ``i`` that died
    before ``j`` was born (cost ``max(0, size_j - size_i)``); each tensor hands its object on at
    most once. The chains ``i -> j -> k ...`` of the flow are the objects, each as large as its
    largest tensor. The flow cost only approximates that total (growth is counted per step, and
    a chain that shrinks then grows pays twice), as in TFLite: a heuristic, not an optimum.
    Differences from TFLite's graph, all to keep networkx fast in pure Python:

    * tensors that die offering objects of one size are interchangeable for every later tensor,
      so they are pooled into one node per size class (a new node, fed by the previous one, once
      a tensor has drawn from it); with every class a candidate this changes no optimum;
    * a tensor is offered only the ``MCF_CANDIDATES_PER_SIDE`` nearest classes at least as large
      as itself and as many smaller ones;
    * tensors are planned in consecutive windows of ``MCF_WINDOW`` (in order of ``first``), one
      flow per window (rolling horizon): a window may inherit any object left free by earlier
      windows, priced at that object's actual size so far. Inputs of at most ``MCF_WINDOW``
      records are one flow. After a flow, a tensor that drew from a class takes, among that
      class's free objects, the smallest already large enough, else the largest (grown).
    * above ``MCF_MAX_RECORDS`` records it falls back to greedy in order (``variant`` says so).

All sizes are rounded up to ``alignment`` (so every arena offset is a multiple of it), and
``lower_bound`` — the most bytes live at any one op — bounds every plan from below.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from edgellm.errors import GraphError

__all__ = [
    "STRATEGIES",
    "MemoryPlan",
    "PlanError",
    "UsageRecord",
    "lower_bound",
    "plan_all",
    "plan_memory",
    "validate_plan",
]

STRATEGIES = ("naive", "greedy_shared", "greedy_by_size", "min_cost_flow")

#: When "best" finds two plans of equal size, the earlier one here wins (one arena before
#: several objects; naive last).
_TIE_ORDER = ("greedy_by_size", "greedy_shared", "min_cost_flow", "naive")

#: min_cost_flow: tensors per flow problem (see the module docstring).
MCF_WINDOW = 32
#: min_cost_flow: size classes offered to a tensor on each side of its own size.
MCF_CANDIDATES_PER_SIDE = 3
#: min_cost_flow: above this many records, fall back to greedy in order.
MCF_MAX_RECORDS = 20000


def plan_offsets(plan: "MemoryPlan") -> dict[str, int]:
    """Byte offsets in one arena for an arena plan, or for a shared-objects plan (objects laid end to end)."""
    if plan.offsets is not None:
        return dict(plan.offsets)
    if plan.objects is None or plan.assignment is None:
        return {}
    base, acc = [], 0
    for size in plan.objects:
        base.append(acc)
        acc += size
    return {t: base[k] for t, k in plan.assignment.items()}


class PlanError(GraphError):
    """Usage records or a memory plan are malformed, or a plan lets live tensors share bytes."""


@dataclass(frozen=True)
class UsageRecord:
    """One intermediate tensor: ``size`` bytes, live from op ``first`` to op ``last`` inclusive."""

    tensor: str
    size: int
    first: int
    last: int


@dataclass
class MemoryPlan:
    """Where every intermediate tensor lives.

    Arena plans set ``offsets``; shared-object plans set ``objects`` and ``assignment``.
    ``naive_bytes`` and ``lower_bound_bytes`` are filled in by the planners for reporting.
    """

    strategy: str
    total_bytes: int
    offsets: dict[str, int] | None = None
    objects: list[int] | None = None
    assignment: dict[str, int] | None = None
    alignment: int = 256
    naive_bytes: int | None = None
    lower_bound_bytes: int | None = None
    variant: str | None = None

    @property
    def is_arena(self) -> bool:
        return self.offsets is not None

    def describe(self) -> str:
        """One line, e.g. ``greedy_by_size: 12.3 MiB (naive 40.1 MiB, lower bound 12.0 MiB)``."""
        extra = []
        if self.naive_bytes is not None:
            extra.append(f"naive {_fmt_bytes(self.naive_bytes)}")
        if self.lower_bound_bytes is not None:
            extra.append(f"lower bound {_fmt_bytes(self.lower_bound_bytes)}")
        text = f"{self.strategy}: {_fmt_bytes(self.total_bytes)}"
        if extra:
            text += f" ({', '.join(extra)})"
        how = []
        if self.objects is not None:
            how.append(f"{len(self.objects)} shared objects")
        elif self.offsets is not None:
            how.append("one arena")
        if self.variant:
            how.append(self.variant)
        if how:
            text += "; " + ", ".join(how)
        return text


def _fmt_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    raise AssertionError  # unreachable


# --------------------------------------------------------------------------------------------
# Input checking and preparation


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_alignment(alignment: object) -> int:
    if not _is_int(alignment) or int(alignment) <= 0:
        raise PlanError(f"alignment must be a positive int (bytes), got {alignment!r}")
    return int(alignment)


def _check_strategy(strategy: object, allow_best: bool) -> str:
    allowed = STRATEGIES + (("best",) if allow_best else ())
    if strategy not in allowed:
        raise PlanError(
            f"unknown memory planning strategy {strategy!r}; expected one of "
            + ", ".join(repr(s) for s in allowed)
        )
    return strategy  # type: ignore[return-value]


class _Prepared:
    """Checked records in processing order: stable-sorted by ``first`` (ties keep input order)."""

    def __init__(self, records: Iterable[UsageRecord], alignment: int):
        self.alignment = alignment = _check_alignment(alignment)
        recs = list(records)
        seen: dict[str, int] = {}
        for i, r in enumerate(recs):
            if not isinstance(r, UsageRecord):
                raise PlanError(f"usage record {i} is a {type(r).__name__}, expected UsageRecord")
            if not isinstance(r.tensor, str) or not r.tensor:
                raise PlanError(f"usage record {i}: tensor name must be a non-empty str, got {r.tensor!r}")
            label = f"usage record {i} (tensor {r.tensor!r})"
            for field in ("size", "first", "last"):
                v = getattr(r, field)
                if not _is_int(v):
                    raise PlanError(f"{label}: {field} must be an int, got {v!r}")
            if r.size <= 0:
                raise PlanError(f"{label}: size must be > 0 bytes, got {r.size}")
            if r.last < r.first:
                raise PlanError(
                    f"{label}: last op {r.last} is before first op {r.first} (need first <= last)"
                )
            if r.tensor in seen:
                raise PlanError(
                    f"{label}: duplicate tensor name, already used by usage record {seen[r.tensor]}"
                )
            seen[r.tensor] = i
        order = sorted(range(len(recs)), key=lambda i: recs[i].first)
        self.n = len(recs)
        self.names = [recs[i].tensor for i in order]
        self.raw_sizes = [int(recs[i].size) for i in order]
        self.sizes = [-(-s // alignment) * alignment for s in self.raw_sizes]
        self.firsts = [int(recs[i].first) for i in order]
        self.lasts = [int(recs[i].last) for i in order]
        self.naive_bytes = sum(self.sizes)
        self._lower_bound: int | None = None

    @property
    def lower_bound(self) -> int:
        if self._lower_bound is None:
            # +size when a tensor is born, -size the op after its last use; at equal times the
            # deaths come first (a tensor whose last op is t-1 is not live at t).
            events = [(f, s) for f, s in zip(self.firsts, self.sizes)]
            events += [(l + 1, -s) for l, s in zip(self.lasts, self.sizes)]
            events.sort()
            live = best = 0
            for _, delta in events:
                live += delta
                best = max(best, live)
            self._lower_bound = best
        return self._lower_bound

    def compressed_times(self) -> tuple[np.ndarray, np.ndarray]:
        """Lifetimes renumbered onto the distinct ``first`` values; overlap is preserved."""
        firsts = np.asarray(self.firsts, dtype=np.int64)
        lasts = np.asarray(self.lasts, dtype=np.int64)
        uniq = np.unique(firsts)
        cf = np.searchsorted(uniq, firsts)
        cl = np.searchsorted(uniq, lasts, side="right") - 1
        return cf, cl

    def by_size_desc(self) -> list[int]:
        """Largest first; equal sizes keep processing order (stable)."""
        sizes = self.sizes
        return sorted(range(self.n), key=lambda k: -sizes[k])

    def plan(self, strategy: str, **kw) -> MemoryPlan:
        return MemoryPlan(
            strategy=strategy,
            alignment=self.alignment,
            naive_bytes=self.naive_bytes,
            lower_bound_bytes=self.lower_bound,
            **kw,
        )

    def objects_plan(self, strategy: str, obj_sizes: list[int], assign: list[int], variant: str | None):
        return self.plan(
            strategy,
            total_bytes=sum(obj_sizes),
            objects=list(obj_sizes),
            assignment={self.names[k]: assign[k] for k in range(self.n)},
            variant=variant,
        )


# --------------------------------------------------------------------------------------------
# Strategies. Each works on the prepared records (indices k in processing order).


def _naive(p: _Prepared) -> MemoryPlan:
    return p.objects_plan("naive", p.sizes, list(range(p.n)), None)


def _greedy_in_order(p: _Prepared) -> tuple[list[int], list[int]]:
    obj_sizes: list[int] = []
    assign = [0] * p.n
    pool: list[tuple[int, int]] = []  # idle objects, sorted (size, id)
    busy: list[tuple[int, int]] = []  # heap of (last op of its current tensor, id)
    for k in range(p.n):
        f, l, s = p.firsts[k], p.lasts[k], p.sizes[k]
        while busy and busy[0][0] < f:
            _, o = heapq.heappop(busy)
            bisect.insort(pool, (obj_sizes[o], o))
        if pool:
            pos = bisect.bisect_left(pool, (s, -1))
            if pos < len(pool):
                _, o = pool.pop(pos)  # smallest idle object that is large enough
            else:
                _, o = pool.pop()  # none large enough: grow the largest idle one
                obj_sizes[o] = s
        else:
            o = len(obj_sizes)
            obj_sizes.append(s)
        assign[k] = o
        heapq.heappush(busy, (l, o))
    return obj_sizes, assign


def _greedy_by_size_objects(p: _Prepared) -> tuple[list[int], list[int]]:
    cf, cl = p.compressed_times()
    n_times = int(cf.max()) + 1 if p.n else 0
    cap = 16
    busy = np.zeros((cap, n_times), dtype=bool)  # busy[o, t]: object o holds a live tensor at t
    obj_sizes: list[int] = []
    obj_sizes_np = np.zeros(cap, dtype=np.int64)
    assign = [0] * p.n
    for k in p.by_size_desc():
        a, b = int(cf[k]), int(cl[k]) + 1
        nobj = len(obj_sizes)
        o = -1
        if nobj:
            idle = np.flatnonzero(~busy[:nobj, a:b].any(axis=1))
            if idle.size:
                # objects came largest first and never grow: all fit; take the smallest
                o = int(idle[np.argmin(obj_sizes_np[idle])])
        if o < 0:
            o = nobj
            if o == cap:
                cap *= 2
                busy = np.concatenate([busy, np.zeros_like(busy)])
                obj_sizes_np = np.concatenate([obj_sizes_np, np.zeros_like(obj_sizes_np)])
            obj_sizes.append(p.sizes[k])
            obj_sizes_np[o] = p.sizes[k]
        busy[o, a:b] = True
        assign[k] = o
    return obj_sizes, assign


def _greedy_shared(p: _Prepared) -> MemoryPlan:
    in_order = _greedy_in_order(p)
    if sum(in_order[0]) == p.lower_bound:  # optimal already
        return p.objects_plan("greedy_shared", *in_order, "greedy in order")
    by_size = _greedy_by_size_objects(p)
    if sum(by_size[0]) < sum(in_order[0]):
        return p.objects_plan("greedy_shared", *by_size, "greedy by size")
    return p.objects_plan("greedy_shared", *in_order, "greedy in order")


def _arena_greedy_by_size(p: _Prepared, first_fit: bool) -> tuple[int, list[int]]:
    n = p.n
    pf = np.empty(n, dtype=np.int64)
    pl = np.empty(n, dtype=np.int64)
    po = np.empty(n, dtype=np.int64)
    pe = np.empty(n, dtype=np.int64)
    offsets = [0] * n
    placed = 0
    total = 0
    for k in p.by_size_desc():
        f, l, s = p.firsts[k], p.lasts[k], p.sizes[k]
        off = 0
        if placed:
            hit = np.flatnonzero((pf[:placed] <= l) & (pl[:placed] >= f))
            if hit.size:
                srt = np.argsort(po[hit], kind="stable")
                o_hit, e_hit = po[hit][srt], pe[hit][srt]
                reach = np.maximum.accumulate(e_hit)  # highest byte used by these and lower ones
                below = np.concatenate(([0], reach[:-1]))  # ... by those strictly before each
                gaps = o_hit - below  # free bytes just under each conflicting tensor
                fits = np.flatnonzero(gaps >= s)
                if fits.size == 0:
                    off = int(reach[-1])  # above the highest conflicting tensor
                elif first_fit:
                    off = int(below[fits[0]])
                else:  # smallest gap that fits; the lowest of equal ones
                    off = int(below[fits[np.argmin(gaps[fits])]])
        pf[placed], pl[placed], po[placed], pe[placed] = f, l, off, off + s
        placed += 1
        offsets[k] = off
        total = max(total, off + s)
    return total, offsets


def _greedy_by_size(p: _Prepared) -> MemoryPlan:
    total, offsets = _arena_greedy_by_size(p, first_fit=True)
    variant = "first fit"
    if total > p.lower_bound:  # not optimal: try the paper's best fit too
        bf_total, bf_offsets = _arena_greedy_by_size(p, first_fit=False)
        if bf_total < total:
            total, offsets, variant = bf_total, bf_offsets, "best fit"
    return p.plan(
        "greedy_by_size",
        total_bytes=total,
        offsets={p.names[k]: offsets[k] for k in range(p.n)},
        variant=variant,
    )


def _min_cost_flow(p: _Prepared) -> MemoryPlan:
    n = p.n
    if n > MCF_MAX_RECORDS:
        sizes, assign = _greedy_in_order(p)
        variant = f"fallback to greedy in order (> {MCF_MAX_RECORDS} records)"
        return p.objects_plan("min_cost_flow", sizes, assign, variant)
    unit = 0
    for s in p.sizes:
        unit = math.gcd(unit, s)
    w = [s // unit for s in p.sizes]  # costs in units of the common divisor: small integers
    st = _FlowState(p, w)
    for a in range(0, n, MCF_WINDOW):
        st.solve_window(a, min(n, a + MCF_WINDOW))
    obj_sizes = [m * unit for m in st.obj_max]
    windows = -(-n // MCF_WINDOW)
    variant = f"{windows} windows of {MCF_WINDOW} tensors" if windows > 1 else None
    return p.objects_plan("min_cost_flow", obj_sizes, st.assign, variant)


class _FlowState:
    """Objects built so far by min_cost_flow, and the tensors whose objects can be handed on."""

    def __init__(self, p: _Prepared, w: list[int]):
        self.p, self.w = p, w
        self.assign = [-1] * p.n
        self.obj_max: list[int] = []  # per object: its size so far, in cost units
        self.tails: list[int] = []  # tensors that have not handed their object on yet

    def solve_window(self, a: int, b: int) -> None:
        """Give objects to tensors a..b-1 (processing order) by one min-cost flow."""
        import networkx as nx

        p, w, assign, obj_max = self.p, self.w, self.assign, self.obj_max
        firsts, lasts = p.firsts, p.lasts
        # A tensor offers its object from the op after its last use. Its cost class is what the
        # flow believes the object's size is: the object's known size for tensors placed by an
        # earlier window, the tensor's own size (as in TFLite) for tensors of this window.
        offers = [(lasts[i], obj_max[assign[i]], i) for i in self.tails]
        offers += [(lasts[j], w[j], j) for j in range(a, b)]
        offers.sort()
        # Offers of one class are interchangeable for every later tensor, so they are pooled:
        # one node per class, and a new node (fed by the previous one) only once a tensor has
        # drawn from the current one. This is TFLite's bipartite graph with equal left vertices
        # merged; the optimum is unchanged when every class is a candidate.
        src = -1
        g = nx.DiGraph()
        g.add_node(src, demand=-(b - a))
        edges = []
        pool: dict[int, int] = {}  # class -> current pool node
        pool_tapped: dict[int, bool] = {}
        pool_supply: dict[int, int] = {}
        classes: list[int] = []  # classes offered so far, sorted
        taps: list[list[tuple[int, int]]] = []  # per tensor of the window: (pool node, class)
        next_node = b - a  # right vertex of tensor j is j - a; pool nodes follow
        k = 0
        per_side = MCF_CANDIDATES_PER_SIDE
        for j in range(a, b):
            f = firsts[j]
            while k < len(offers) and offers[k][0] < f:
                c = offers[k][1]
                k += 1
                node = pool.get(c)
                if node is None or pool_tapped[node]:
                    new = next_node
                    next_node += 1
                    if node is None:
                        bisect.insort(classes, c)
                    else:
                        edges.append((node, new, {"weight": 0}))  # unused offers carry forward
                    pool[c] = node = new
                    pool_tapped[node] = False
                    pool_supply[node] = 0
                pool_supply[node] += 1
            rj = j - a
            g.add_node(rj, demand=1)
            edges.append((src, rj, {"capacity": 1, "weight": w[j]}))  # a new object
            mine = []
            if classes:
                pos = bisect.bisect_left(classes, w[j])
                for c in classes[max(0, pos - per_side) : pos + per_side]:
                    node = pool[c]
                    pool_tapped[node] = True
                    mine.append((node, c))
                    edges.append((node, rj, {"capacity": 1, "weight": max(0, w[j] - c)}))
            taps.append(mine)
        for node, count in pool_supply.items():
            edges.append((src, node, {"capacity": count, "weight": 0}))
        g.add_edges_from(edges)
        flow = nx.min_cost_flow(g)

        # Turn pooled flow back into tensor -> object: a tensor drawing from class c takes one
        # of the class-c offers already made (the flow guarantees there is one), the object
        # that grows least, preferring the smallest that is already large enough.
        avail: dict[int, list[int]] = {}
        k = 0
        consumed = set()
        for j in range(a, b):
            f = firsts[j]
            while k < len(offers) and offers[k][0] < f:
                avail.setdefault(offers[k][1], []).append(offers[k][2])
                k += 1
            rj = j - a
            chosen = None
            for node, c in taps[j - a]:
                if flow[node][rj]:
                    chosen = c
                    break
            if chosen is None:
                assign[j] = len(obj_max)
                obj_max.append(w[j])
                continue
            cands = avail[chosen]
            fit = [t for t in cands if obj_max[assign[t]] >= w[j]]
            if fit:
                t = min(fit, key=lambda t: obj_max[assign[t]])
            else:
                t = max(cands, key=lambda t: obj_max[assign[t]])
            cands.remove(t)
            consumed.add(t)
            o = assign[t]
            assign[j] = o
            obj_max[o] = max(obj_max[o], w[j])
        self.tails = [t for t in self.tails if t not in consumed]
        self.tails += [j for j in range(a, b) if j not in consumed]


_PLANNERS = {
    "naive": _naive,
    "greedy_shared": _greedy_shared,
    "greedy_by_size": _greedy_by_size,
    "min_cost_flow": _min_cost_flow,
}


# --------------------------------------------------------------------------------------------
# Public API


def plan_all(records: Iterable[UsageRecord], *, alignment: int = 256) -> dict[str, MemoryPlan]:
    """Every strategy's plan, keyed by strategy name (in ``STRATEGIES`` order)."""
    p = _Prepared(records, alignment)
    return {name: _PLANNERS[name](p) for name in STRATEGIES}


def plan_memory(
    records: Iterable[UsageRecord], strategy: str = "best", *, alignment: int = 256
) -> MemoryPlan:
    """Plan with one strategy, or with ``"best"``: run all, keep the smallest valid plan.

    Ties under ``"best"`` prefer one arena, then greedy shared objects, then min-cost flow, then
    naive.
    """
    _check_strategy(strategy, allow_best=True)
    recs = list(records)
    p = _Prepared(recs, alignment)
    if strategy != "best":
        return _PLANNERS[strategy](p)
    best: MemoryPlan | None = None
    errors = []
    for name in _TIE_ORDER:
        plan = _PLANNERS[name](p)
        try:
            validate_plan(plan, recs)
        except PlanError as e:  # a planner bug; never expected, but never hand out a bad plan
            errors.append(f"{name}: {e}")
            continue
        if best is None or plan.total_bytes < best.total_bytes:
            best = plan
    if best is None:
        raise PlanError("no memory planner produced a valid plan: " + "; ".join(errors))
    return best


def lower_bound(records: Iterable[UsageRecord], *, alignment: int = 256) -> int:
    """The most bytes (sizes rounded up to ``alignment``) live at any single op."""
    return _Prepared(records, alignment).lower_bound


def validate_plan(plan: MemoryPlan, records: Iterable[UsageRecord]) -> None:
    """Raise :class:`PlanError` unless ``plan`` is a correct placement of ``records``.

    Checks that every tensor is placed (and no unknown one), that arena offsets are non-negative
    multiples of ``plan.alignment``, that each tensor (its size rounded up to the alignment) fits
    in its object or in the arena, and that no two tensors with intersecting lifetimes share a
    byte (arena) or an object (shared objects). Messages name the tensors involved.
    """
    p = _Prepared(records, plan.alignment)
    n, names = p.n, p.names
    if plan.offsets is not None:
        placement: dict = plan.offsets
        kind = "offsets"
    elif plan.objects is not None and plan.assignment is not None:
        placement = plan.assignment
        kind = "assignment"
    else:
        raise PlanError(f"plan {plan.strategy!r} has neither offsets nor objects + assignment")
    missing = [t for t in names if t not in placement]
    if missing:
        raise PlanError(f"plan {plan.strategy!r} places no memory for tensor(s) {missing[:5]!r}")
    known = set(names)
    unknown = [t for t in placement if t not in known]
    if unknown:
        raise PlanError(f"plan {plan.strategy!r} {kind} name unknown tensor(s) {unknown[:5]!r}")
    for t in names:
        if not _is_int(placement[t]):
            raise PlanError(f"plan {plan.strategy!r}: {kind}[{t!r}] must be an int, got {placement[t]!r}")

    def who(k: int) -> str:
        return f"{names[k]!r} (ops {p.firsts[k]}..{p.lasts[k]})"

    if plan.offsets is not None:
        _validate_arena(plan, p, who)
        return

    objects = plan.objects
    if any(not _is_int(s) or s < 0 for s in objects):
        raise PlanError(f"plan {plan.strategy!r}: object sizes must be non-negative ints, got {objects!r}")
    if plan.total_bytes != sum(objects):
        raise PlanError(
            f"plan {plan.strategy!r}: total_bytes {plan.total_bytes} != sum of object sizes {sum(objects)}"
        )
    per_object: dict[int, list[int]] = {}
    for k in range(n):
        o = int(plan.assignment[names[k]])
        if not 0 <= o < len(objects):
            raise PlanError(
                f"plan {plan.strategy!r}: tensor {who(k)} assigned to object {o}, "
                f"but there are {len(objects)} objects"
            )
        if p.sizes[k] > objects[o]:
            raise PlanError(
                f"plan {plan.strategy!r}: tensor {who(k)} needs {p.sizes[k]} bytes but its "
                f"object {o} has {objects[o]}"
            )
        per_object.setdefault(o, []).append(k)
    for o, ks in per_object.items():
        ks.sort(key=lambda k: p.firsts[k])
        # sorted by first: any overlap shows up between a tensor and the longest-lived before it
        longest = ks[0]
        for k in ks[1:]:
            if p.firsts[k] <= p.lasts[longest]:
                raise PlanError(
                    f"plan {plan.strategy!r}: tensors {who(longest)} and {who(k)} are live at the "
                    f"same time but share object {o}"
                )
            if p.lasts[k] > p.lasts[longest]:
                longest = k


def _validate_arena(plan: MemoryPlan, p: _Prepared, who) -> None:
    n, names = p.n, p.names
    off = np.array([int(plan.offsets[t]) for t in names], dtype=np.int64)
    size = np.asarray(p.sizes, dtype=np.int64)
    end = off + size
    for k in range(n):
        if off[k] < 0 or off[k] % p.alignment:
            raise PlanError(
                f"plan {plan.strategy!r}: tensor {who(k)} has offset {off[k]}, not a non-negative "
                f"multiple of the alignment {p.alignment}"
            )
        if end[k] > plan.total_bytes:
            raise PlanError(
                f"plan {plan.strategy!r}: tensor {who(k)} spans bytes {off[k]}..{end[k]} "
                f"(rounded size {size[k]}), past the arena's {plan.total_bytes} bytes"
            )
    firsts = np.asarray(p.firsts, dtype=np.int64)  # non-decreasing (processing order)
    lasts = np.asarray(p.lasts, dtype=np.int64)
    # tensors k' > k with first[k'] <= last[k] are exactly the later ones live together with k
    hi = np.searchsorted(firsts, lasts, side="right")
    for k in range(n):
        if hi[k] <= k + 1:
            continue
        lo_, hi_ = k + 1, hi[k]
        clash = np.flatnonzero((off[lo_:hi_] < end[k]) & (off[k] < end[lo_:hi_]))
        if clash.size:
            j = lo_ + int(clash[0])
            raise PlanError(
                f"plan {plan.strategy!r}: tensors {who(k)} at bytes {off[k]}..{end[k]} and "
                f"{who(j)} at bytes {off[j]}..{end[j]} are live at the same time and share bytes"
            )
