"""Memory planners for intermediate tensors (edgellm.compiler.memory).

Validity is checked here by brute force, pair by pair, independently of validate_plan.
"""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellm.compiler import memory as M
from edgellm.compiler.memory import (
    STRATEGIES,
    MemoryPlan,
    PlanError,
    UsageRecord,
    lower_bound,
    plan_all,
    plan_memory,
    validate_plan,
)
from edgellm.errors import GraphError

KiB = 1024


# ------------------------------------------------------------------------------------------------
# Independent brute-force checks


def _aligned(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def _live_together(a: UsageRecord, b: UsageRecord) -> bool:
    return a.first <= b.last and b.first <= a.last


def brute_check(plan: MemoryPlan, records: list[UsageRecord], alignment: int) -> None:
    """Assert ``plan`` is a correct placement of ``records``, checking every pair."""
    size = {r.tensor: _aligned(r.size, alignment) for r in records}
    names = {r.tensor for r in records}
    if plan.offsets is not None:
        assert plan.objects is None and plan.assignment is None
        assert set(plan.offsets) == names
        for r in records:
            off = plan.offsets[r.tensor]
            assert off >= 0 and off % alignment == 0, (plan.strategy, r, off)
            assert off + size[r.tensor] <= plan.total_bytes, (plan.strategy, r, off)
        for a, b in itertools.combinations(records, 2):
            if _live_together(a, b):
                oa, ob = plan.offsets[a.tensor], plan.offsets[b.tensor]
                disjoint = oa + size[a.tensor] <= ob or ob + size[b.tensor] <= oa
                assert disjoint, f"{plan.strategy}: {a} at {oa} and {b} at {ob} share bytes"
    else:
        assert plan.objects is not None and plan.assignment is not None
        assert set(plan.assignment) == names
        assert plan.total_bytes == sum(plan.objects)
        for r in records:
            o = plan.assignment[r.tensor]
            assert 0 <= o < len(plan.objects)
            assert size[r.tensor] <= plan.objects[o], (plan.strategy, r, plan.objects[o])
        for a, b in itertools.combinations(records, 2):
            if _live_together(a, b):
                assert plan.assignment[a.tensor] != plan.assignment[b.tensor], (
                    f"{plan.strategy}: {a} and {b} share object {plan.assignment[a.tensor]}"
                )


def brute_lower_bound(records: list[UsageRecord], alignment: int) -> int:
    if not records:
        return 0
    lo, hi = min(r.first for r in records), max(r.last for r in records)
    return max(
        sum(_aligned(r.size, alignment) for r in records if r.first <= t <= r.last)
        for t in range(lo, hi + 1)
    )


def check_all(records: list[UsageRecord], alignment: int) -> dict[str, MemoryPlan]:
    plans = plan_all(records, alignment=alignment)
    assert tuple(plans) == STRATEGIES
    naive = sum(_aligned(r.size, alignment) for r in records)
    lb = lower_bound(records, alignment=alignment)
    assert lb == brute_lower_bound(records, alignment)
    for name, plan in plans.items():
        assert plan.strategy == name
        brute_check(plan, records, alignment)
        validate_plan(plan, records)  # and the library's own check agrees
        assert lb <= plan.total_bytes <= naive, (name, lb, plan.total_bytes, naive)
    assert plans["naive"].total_bytes == naive
    best = plan_memory(records, alignment=alignment)
    assert best.total_bytes == min(p.total_bytes for p in plans.values())
    brute_check(best, records, alignment)
    return plans


# ------------------------------------------------------------------------------------------------
# Random inputs


@st.composite
def random_records(draw, max_n: int = 24):
    n = draw(st.integers(0, max_n))
    out = []
    for i in range(n):
        first = draw(st.integers(0, 30))
        last = first + draw(st.integers(0, 12))
        size = draw(st.one_of(st.integers(1, 5000), st.sampled_from([256, 512, 1024, 4096, 16384])))
        out.append(UsageRecord(f"t{i}", size, first, last))
    return out


@st.composite
def dag_records(draw, max_ops: int = 24):
    """A random DAG of ops (op k makes tensor k from earlier tensors), run in a random
    topological order; a tensor lives from its producer to its last consumer."""
    n = draw(st.integers(1, max_ops))
    inputs = [
        sorted(set(draw(st.lists(st.integers(0, k - 1), max_size=3)))) if k else [] for k in range(n)
    ]
    consumers = {k: [] for k in range(n)}
    for k, ins in enumerate(inputs):
        for i in ins:
            consumers[i].append(k)
    # Kahn's algorithm, hypothesis picking which ready op runs next
    missing = [len(ins) for ins in inputs]
    ready = [k for k in range(n) if missing[k] == 0]
    position = {}
    while ready:
        k = ready.pop(draw(st.integers(0, len(ready) - 1)))
        position[k] = len(position)
        for c in consumers[k]:
            missing[c] -= 1
            if missing[c] == 0:
                ready.append(c)
    assert len(position) == n
    sizes = draw(st.lists(st.integers(1, 3) .map(lambda m: m * 1000), min_size=n, max_size=n))
    records = []
    for k in sorted(range(n), key=lambda k: draw(st.integers(0, 3))):  # arbitrary record order
        last = max([position[c] for c in consumers[k]], default=position[k])
        records.append(UsageRecord(f"op{k}", sizes[k], position[k], last))
    return records


SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(random_records(), st.sampled_from([1, 4, 256]))
def test_random_lifetimes_all_plans_valid(records, alignment):
    check_all(records, alignment)


@SETTINGS
@given(dag_records())
def test_random_dag_orders_all_plans_valid(records):
    check_all(records, 256)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_records(max_n=60), st.integers(1, 8), st.integers(1, 3))
def test_min_cost_flow_windows_and_pruning_stay_valid(records, window, per_side):
    # tiny windows and few candidate classes: exercises the rolling-horizon and pruning paths
    with mock.patch.object(M, "MCF_WINDOW", window), mock.patch.object(
        M, "MCF_CANDIDATES_PER_SIDE", per_side
    ):
        plan = plan_memory(records, "min_cost_flow", alignment=256)
    brute_check(plan, records, 256)
    assert plan.total_bytes <= sum(_aligned(r.size, 256) for r in records)


def test_min_cost_flow_falls_back_above_cap():
    records = [UsageRecord(f"t{i}", 1000 + i, i, i + 2) for i in range(10)]
    with mock.patch.object(M, "MCF_MAX_RECORDS", 5):
        plan = plan_memory(records, "min_cost_flow")
    assert "fallback" in plan.variant
    brute_check(plan, records, 256)


def test_larger_layered_graph_valid():
    """~400 records shaped like a few transformer layers: several min-cost-flow windows."""
    records = []
    op = 0
    for layer in range(12):
        resid = (f"l{layer}.x", op)
        op += 1
        for j in range(30):
            size = [4096, 12288, 65536, 32768, 22016][j % 5] * 2
            span = [1, 1, 2, 3, 1][j % 5]
            records.append(UsageRecord(f"l{layer}.t{j}", size, op, op + span))
            op += 1
        records.append(UsageRecord(resid[0], 8192, resid[1], op))
    plans = plan_all(records)
    lb = lower_bound(records)
    naive = sum(_aligned(r.size, 256) for r in records)
    for plan in plans.values():
        brute_check(plan, records, 256)
        assert lb <= plan.total_bytes <= naive
    assert plans["greedy_by_size"].total_bytes < plans["naive"].total_bytes // 10


# ------------------------------------------------------------------------------------------------
# A tiny transformer block, worked out by hand
#
# Ops (attention fused into two ops, RMSNorm fused into the QKV matmul, hidden d = 4 KiB):
#   op0 qkv    = rmsnorm(x) @ Wqkv          op5 gate = norm2 @ Wg
#   op1 scores = softmax(q k^T)             op6 up   = norm2 @ Wu
#   op2 attn   = scores @ v                 op7 act  = silu(gate) * up
#   op3 h      = x + attn @ Wo              op8 out  = h + act @ Wd   (out is the graph output,
#   op4 norm2  = rmsnorm(h)                                           not an intermediate)
#
#   tensor  size    first..last          live at op:  0  1  2  3  4  5  6  7  8
#   qkv     12 KiB  0..2                 qkv          12 12 12
#   scores  16 KiB  1..2                 scores          16 16
#   attn     4 KiB  2..3                 attn               4  4
#   h        4 KiB  3..8                 h                     4  4  4  4  4  4
#   norm2    4 KiB  4..6                 norm2                    4  4  4
#   gate     8 KiB  5..7                 gate                        8  8  8
#   up       8 KiB  6..7                 up                             8  8
#   act      8 KiB  7..8                 act                               8  8
#                                        total       12 28 32  8  8 16 24 28 12
#
# lower bound = max column total = 32 KiB (op 2).
# naive = 12 + 16 + 4 + 4 + 4 + 8 + 8 + 8 = 64 KiB.
#
# greedy_shared, greedy-in-order variant (walk by first op; objects whose tensor died before
# the current first op return to the pool; take the smallest pooled object that fits, else
# grow the largest pooled one, else open a new one):
#   qkv    -> new O0=12
#   scores -> nothing pooled (qkv lives to op 2) -> new O1=16
#   attn   -> nothing pooled -> new O2=4
#   h      -> pool {O0:12, O1:16} (qkv, scores died at op 2) -> O0
#   norm2  -> pool {O1:16, O2:4} (attn died at 3) -> smallest that fits: O2
#   gate   -> pool {O1:16} -> O1
#   up     -> pool empty (norm2 is read by op 6) -> new O3=8
#   act    -> pool {O2:4} (norm2 died at 6) -> nothing fits, grow O2 to 8
#   objects 12 + 16 + 8 + 8 = 44 KiB
# greedy_shared, greedy-by-size variant (largest first, stable; take the smallest object idle
# over the whole lifetime, else open one):
#   scores 16 -> new O0=16
#   qkv 12    -> O0 busy at ops 1..2 -> new O1=12
#   gate 8    -> O0, O1 idle at 5..7 -> smallest: O1
#   up 8      -> O1 busy (gate) -> O0
#   act 8     -> O0 (up) and O1 (gate) busy at op 7 -> new O2=8
#   attn 4    -> O0, O1 busy at op 2; O2 (act 7..8) idle -> O2
#   h 4       -> O0 (up 6..7), O1 (gate 5..7), O2 (attn 2..3 / act 7..8) all busy -> new O3=4
#   norm2 4   -> O0 busy at 6, O1 busy at 5..6, O2 idle at 4..6 -> O2
#   objects 16 + 12 + 8 + 4 = 40 KiB; greedy_shared keeps the smaller: 40 KiB (by size).
#
# greedy_by_size (one arena; largest first; lowest offset that fits among the tensors whose
# lifetimes intersect; offsets in KiB):
#   scores 16 [1..2] -> 0..16
#   qkv 12   [0..2]  -> conflicts scores 0..16 -> 16..28
#   gate 8   [5..7]  -> no conflicts -> 0..8
#   up 8     [6..7]  -> gate 0..8 -> 8..16
#   act 8    [7..8]  -> gate 0..8, up 8..16 -> 16..24
#   attn 4   [2..3]  -> scores 0..16, qkv 16..28 -> 28..32
#   h 4      [3..8]  -> gate 0..8, up 8..16, act 16..24, attn 28..32: the 4 KiB gap 24..28 fits
#   norm2 4  [4..6]  -> gate 0..8, up 8..16, h 24..28: the gap 16..24 fits -> 16..20
#   arena = 32 KiB = the lower bound (so the best-fit pass is skipped: first fit kept).
#
# min_cost_flow (TFLite's network: a tensor opens a new object at the cost of its size, or
# takes the object of a tensor that died before it at cost max(0, own size - that size)):
#   qkv, scores, attn have no dead predecessor: new objects, 12 + 16 + 4 = 32.
#   Offers: qkv (12) and scores (16), dead after op 2, reach h, norm2, gate, up, act at cost 0;
#   attn (4), dead after op 3, reaches norm2 (cost 0) and gate, up, act (cost 4 each);
#   norm2 (4), dead after op 6, reaches only act (cost 4); h, gate, up, act die at op 7 or
#   later and reach nobody.
#   Five tensors (h, norm2, gate, up, act) but four offers: one opens an object, the cheapest
#   being h or norm2 (4). With h new: norm2 <- attn (0), gate, up <- qkv, scores (0), and act
#   <- norm2 (4): 8. (h takes qkv or scores instead: the three 8 KiB tensors can then get only
#   one cost-0 offer -> >= 4 + 4 + 4.) So the optimum is unique up to swapping gate and up:
#   objects [qkv, gate|up] = 12, [scores, up|gate] = 16, [attn, norm2, act] = 8, [h] = 4
#   -> 40 KiB.
#
# best = greedy_by_size, 32 KiB.

TINY_BLOCK = [
    UsageRecord("qkv", 12 * KiB, 0, 2),
    UsageRecord("scores", 16 * KiB, 1, 2),
    UsageRecord("attn", 4 * KiB, 2, 3),
    UsageRecord("h", 4 * KiB, 3, 8),
    UsageRecord("norm2", 4 * KiB, 4, 6),
    UsageRecord("gate", 8 * KiB, 5, 7),
    UsageRecord("up", 8 * KiB, 6, 7),
    UsageRecord("act", 8 * KiB, 7, 8),
]


def _groups(plan: MemoryPlan) -> set[frozenset[str]]:
    by_obj: dict[int, set[str]] = {}
    for t, o in plan.assignment.items():
        by_obj.setdefault(o, set()).add(t)
    return {frozenset(s) for s in by_obj.values()}


def test_tiny_block_by_hand():
    plans = check_all(TINY_BLOCK, 256)
    assert lower_bound(TINY_BLOCK) == 32 * KiB
    assert plans["naive"].total_bytes == 64 * KiB
    assert len(plans["naive"].objects) == 8

    gs = plans["greedy_shared"]
    assert gs.total_bytes == 40 * KiB
    assert gs.variant == "greedy by size"
    assert sorted(gs.objects) == [4 * KiB, 8 * KiB, 12 * KiB, 16 * KiB]
    assert _groups(gs) == {
        frozenset({"scores", "up"}),
        frozenset({"qkv", "gate"}),
        frozenset({"act", "attn", "norm2"}),
        frozenset({"h"}),
    }
    in_order_sizes, in_order_assign = M._greedy_in_order(M._Prepared(TINY_BLOCK, 256))
    assert in_order_sizes == [12 * KiB, 16 * KiB, 8 * KiB, 8 * KiB]
    assert in_order_assign == [0, 1, 2, 0, 2, 1, 3, 2]  # qkv scores attn h norm2 gate up act

    gbs = plans["greedy_by_size"]
    assert gbs.total_bytes == 32 * KiB
    assert gbs.variant == "first fit"
    assert gbs.offsets == {
        "scores": 0,
        "qkv": 16 * KiB,
        "gate": 0,
        "up": 8 * KiB,
        "act": 16 * KiB,
        "attn": 28 * KiB,
        "h": 24 * KiB,
        "norm2": 16 * KiB,
    }

    mcf = plans["min_cost_flow"]
    assert mcf.total_bytes == 40 * KiB
    groups = _groups(mcf)
    assert frozenset({"attn", "norm2", "act"}) in groups and frozenset({"h"}) in groups
    assert groups & {frozenset({"qkv", "gate"}), frozenset({"qkv", "up"})}

    best = plan_memory(TINY_BLOCK)
    assert best.strategy == "greedy_by_size" and best.total_bytes == 32 * KiB
    assert best.describe() == (
        "greedy_by_size: 32.0 KiB (naive 64.0 KiB, lower bound 32.0 KiB); one arena, first fit"
    )
    assert plans["greedy_shared"].describe().startswith("greedy_shared: 40.0 KiB (naive 64.0 KiB")


def test_alignment_rounds_sizes_up():
    records = [UsageRecord("a", 1, 0, 0), UsageRecord("b", 300, 0, 1), UsageRecord("c", 256, 1, 1)]
    plans = check_all(records, 256)
    assert plans["naive"].total_bytes == 256 + 512 + 256
    assert lower_bound(records) == 768
    assert plans["greedy_by_size"].total_bytes == 768
    assert all(o % 256 == 0 for o in plans["greedy_by_size"].offsets.values())
    assert lower_bound(records, alignment=1) == 556


def test_equal_first_keeps_given_order():
    ab = [UsageRecord("a", 512, 3, 4), UsageRecord("b", 512, 3, 4), UsageRecord("z", 512, 0, 1)]
    ba = [ab[1], ab[0], ab[2]]
    # processing order: z (first 0), then a/b in the order given
    assert plan_memory(ab, "naive").assignment == {"z": 0, "a": 1, "b": 2}
    assert plan_memory(ba, "naive").assignment == {"z": 0, "b": 1, "a": 2}
    # greedy in order: the first of a/b takes z's object, the second opens a new one
    assert plan_memory(ab, "greedy_shared").assignment == {"z": 0, "a": 0, "b": 1}
    assert plan_memory(ba, "greedy_shared").assignment == {"z": 0, "b": 0, "a": 1}


def test_empty_records():
    for plan in plan_all([]).values():
        assert plan.total_bytes == 0
        validate_plan(plan, [])
    assert lower_bound([]) == 0
    assert plan_memory([]).total_bytes == 0


# ------------------------------------------------------------------------------------------------
# validate_plan catches broken plans


def test_validate_catches_arena_overlap_naming_both():
    plan = plan_memory(TINY_BLOCK, "greedy_by_size")
    plan.offsets["up"] = plan.offsets["gate"]  # both live at ops 6..7
    with pytest.raises(PlanError, match=r"'gate'.*'up'|'up'.*'gate'") as e:
        validate_plan(plan, TINY_BLOCK)
    assert "share bytes" in str(e.value)
    assert isinstance(e.value, GraphError)


def test_validate_catches_object_overlap_naming_both():
    plan = plan_memory(TINY_BLOCK, "min_cost_flow")
    plan.assignment["norm2"] = plan.assignment["h"]
    with pytest.raises(PlanError, match=r"'h'.*'norm2'|'norm2'.*'h'"):
        validate_plan(plan, TINY_BLOCK)


def test_validate_catches_other_breakage():
    good = plan_memory(TINY_BLOCK, "greedy_by_size")

    missing = MemoryPlan(good.strategy, good.total_bytes, offsets=dict(good.offsets))
    del missing.offsets["attn"]
    with pytest.raises(PlanError, match="'attn'"):
        validate_plan(missing, TINY_BLOCK)

    unaligned = MemoryPlan(good.strategy, good.total_bytes, offsets=dict(good.offsets))
    unaligned.offsets["attn"] += 8
    with pytest.raises(PlanError, match="'attn'.*alignment"):
        validate_plan(unaligned, TINY_BLOCK)

    too_small = MemoryPlan(good.strategy, 28 * KiB, offsets=dict(good.offsets))
    with pytest.raises(PlanError, match="'attn'.*past the arena"):
        validate_plan(too_small, TINY_BLOCK)

    shared = plan_memory(TINY_BLOCK, "greedy_shared")
    o = shared.assignment["scores"]
    shared.objects[o] = 8 * KiB
    shared.total_bytes = sum(shared.objects)
    with pytest.raises(PlanError, match="'scores'.*needs 16384 bytes"):
        validate_plan(shared, TINY_BLOCK)

    with pytest.raises(PlanError, match="neither offsets nor objects"):
        validate_plan(MemoryPlan("x", 0), TINY_BLOCK)


# ------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "records, pattern",
    [
        ([UsageRecord("a", 0, 0, 1)], r"usage record 0 \(tensor 'a'\): size must be > 0"),
        ([UsageRecord("a", 4, 0, 1), UsageRecord("b", -5, 0, 1)], r"record 1 \(tensor 'b'\): size"),
        ([UsageRecord("a", 4, 3, 2)], r"tensor 'a'.*last op 2 is before first op 3"),
        (
            [UsageRecord("a", 4, 0, 1), UsageRecord("a", 8, 1, 2)],
            r"record 1 \(tensor 'a'\): duplicate tensor name.*record 0",
        ),
        ([UsageRecord("a", 4.5, 0, 1)], r"tensor 'a'.*size must be an int"),
        ([UsageRecord("", 4, 0, 1)], r"record 0: tensor name"),
        ([("a", 4, 0, 1)], r"record 0 is a tuple"),
    ],
)
def test_bad_records(records, pattern):
    for call in (
        lambda: plan_memory(records),
        lambda: plan_all(records),
        lambda: lower_bound(records),
        lambda: plan_memory(records, "naive"),
    ):
        with pytest.raises(PlanError, match=pattern):
            call()


def test_unknown_strategy_and_bad_alignment():
    with pytest.raises(PlanError, match=r"unknown memory planning strategy 'greedy'.*'min_cost_flow'"):
        plan_memory(TINY_BLOCK, "greedy")
    with pytest.raises(PlanError, match="alignment"):
        plan_memory(TINY_BLOCK, alignment=0)
    with pytest.raises(PlanError, match="alignment"):
        lower_bound(TINY_BLOCK, alignment=True)
