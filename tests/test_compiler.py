"""The compile step: passes preserve results, delegation, bad graphs, `edgellm plan`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import edgellm
from edgellm.compiler.compile import ALL_OPS, check_graph, compile_graph, partition, usage_records
from edgellm.compiler.passes import run_passes
from edgellm.errors import GraphError
from edgellm.graph.ir import SEQ, Graph, Op
from edgellm.synthetic import write_synthetic_gguf

from test_models import FLOAT64_ONLY, SYNTHETIC


def test_passes_preserve_default_model_logits(default_model):
    plain = edgellm.load(default_model.path, ctx=128, fuse=False)
    ids = default_model.tokenizer.encode("Passes must not change what the model computes, not even a little.")
    fused = default_model.logits(ids)
    unfused = plain.logits(ids)
    assert np.abs(fused - unfused).max() <= 1e-4
    # the fused program really is different: fewer kernels, fused kinds present
    kinds = default_model.compiled["all"].graph.op_counts()
    assert {"add_rms_norm", "linear_swiglu", "linear_qkv", "rope_qkv_store"} <= set(kinds)
    assert len(default_model.compiled["all"].graph.ops) < len(plain.compiled["all"].graph.ops)


@pytest.mark.parametrize("name", ["llama-q4_0-untied", "qwen2-f32-bias", "llama-f16-gqa3-untied"])
def test_passes_preserve_synthetic_logits(name, tmp_path):
    spec = {**SYNTHETIC, **FLOAT64_ONLY}[name]
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(0).integers(0, spec.vocab_size, 21).tolist()
    a = edgellm.load(path, ctx=64, fuse=True, prefill_chunk=8).logits(ids)  # 3 chunks, fused, planned arena
    b = edgellm.load(path, ctx=64, fuse=False, prefill_chunk=64).logits(ids)
    assert np.abs(a - b).max() <= 1e-4


def test_intermediates_live_in_the_arena(default_model):
    prog = default_model.programs["all"]
    arena = prog.arena
    assert arena is not None and prog.offsets
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
    name = next(iter(prog.offsets))
    v = prog._view(name, 4, default_model.ctx)
    assert lo <= v.data_ptr() < hi
    assert v.data_ptr() - lo == prog.offsets[name]


def _tiny_graph() -> Graph:
    g = Graph("tiny")
    x = g.input("x", (SEQ, 8), "f32")
    w = g.weight("w", (8, 8), "F32")
    a = g.op("linear", x, w, name="lin")
    b = g.op("silu", a, name="act")
    g.output(g.op("add", b, x, name="res"))
    return g


def test_bad_graphs_rejected_naming_op_and_tensor():
    g = _tiny_graph()
    # a cycle: the first op reads what the last one writes
    g.ops[0] = Op("lin", "linear", (g.ops[2].outputs[0], "w"), g.ops[0].outputs, {})
    with pytest.raises(GraphError, match=r"'lin'.*res\.out"):
        check_graph(g)
    g = _tiny_graph()
    g.ops[1] = Op("act", "silu", ("ghost",), g.ops[1].outputs, {})
    with pytest.raises(GraphError, match=r"'act'.*'ghost'"):
        check_graph(g)
    g = _tiny_graph()
    g.ops.append(Op("extra", "silu", ("res.out",), ("undeclared",), {}))
    with pytest.raises(GraphError, match=r"'extra'.*'undeclared'.*shape cannot be derived"):
        check_graph(g)
    g = _tiny_graph()
    g.ops[1] = Op("act", "frobnicate", g.ops[1].inputs, g.ops[1].outputs, {})
    with pytest.raises(GraphError, match=r"'act'.*frobnicate"):
        check_graph(g)
    with pytest.raises(GraphError, match=r"'bad'.*'x'"):  # shape rule rejects mismatched features
        h = Graph("h")
        x = h.input("x", (SEQ, 8), "f32")
        w = h.weight("w", (4, 6), "F32")
        h.op("linear", x, w, name="bad")


def test_delegation_cuts_and_counts_transfers():
    g = _tiny_graph()
    segs = partition(g, {"linear", "add"}, "gpu")
    assert [(s.backend, s.ops) for s in segs] == [("gpu", [0]), ("cpu", [1]), ("gpu", [2])]
    # silu reads the linear's output across a cut; add reads silu's across the next
    assert segs[1].inputs_in == ["lin.out"] and segs[2].inputs_in == ["act.out"]
    c = compile_graph(g, supported_ops={"linear", "add"}, backend="gpu", seq=4, ctx=4, fuse=False)
    assert c.transfers == 2


def test_usage_records_and_plan_for_default_model(default_model):
    c = default_model.compiled["last"]
    recs = usage_records(c.graph, c.sizes)
    assert recs and all(r.first <= r.last and r.size > 0 for r in recs)
    assert c.plan.total_bytes >= c.lower_bound
    assert c.plan.total_bytes <= c.plan.naive_bytes
    assert set(c.plans) == {"greedy_by_size"}  # a load runs only the planner it uses
    assert set(ALL_OPS) >= set(c.graph.op_counts())


def test_plan_command_json():
    r = subprocess.run([sys.executable, "-m", "edgellm", "plan", "--json", "--ctx", "2048", "--prefill", "256"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["ctx"] == 2048 and p["prefill"] == 256
    # KV cache: 2 (K, V) x 30 layers x 2048 positions x 192 (3 kv heads x 64) x 4 bytes
    assert p["kv_cache_bytes"] == 2 * 30 * 2048 * 192 * 4
    pre = p["stages"][0]
    assert pre["ops_compiled"] < pre["ops_builder"]
    ib = pre["intermediate_bytes"]
    assert set(ib) == {"naive", "greedy_shared", "greedy_by_size", "min_cost_flow"}
    assert pre["lower_bound_bytes"] <= min(ib.values()) <= ib["naive"]
    assert p["weights_by_format"]["Q4_1"]["tensors"] == 210
    assert p["estimated_peak_bytes"] == sum(p[k] for k in ("weight_bytes_resident", "kv_cache_bytes", "arena_bytes",
                                                            "output_bytes", "runtime_overhead_bytes"))


def test_plan_command_table_and_errors(tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgellm", "plan"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for words in ("passes", "kernels per stage", "delegation", "intermediate memory", "estimated peak memory",
                  "greedy_by_size", "min_cost_flow", "lower bound"):
        assert words in r.stdout, words
    bad = subprocess.run([sys.executable, "-m", "edgellm", "plan", str(tmp_path / "none.gguf")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "not found" in bad.stderr and "Traceback" not in bad.stderr


def test_run_passes_reports_each_pass(default_model):
    g, reports = run_passes(default_model.graphs["all"])
    assert [r.name for r in reports][:2] == ["remove_identities", "eliminate_dead_code"]
    assert reports[-1].ops_after == len(g.ops)
