"""Profiler and `edgellm plan --gpu-memory`: the fitted cost model, the cache, the placement."""

import json
import subprocess
import sys

import numpy as np
import pytest

import edgellm
from edgellm.hetero.profile import (Link, Profile, ProcessorModel, cache_path, fit_processor, load_profile,
                                    profile_cpu, save_profile)
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf


def test_fit_recovers_a_known_cost_model():
    rng = np.random.default_rng(0)
    bw, fl, ov = 40e9, 300e9, 8e-6
    samples = []
    for _ in range(60):
        b, f = float(rng.uniform(1e3, 1e8)), float(rng.uniform(1e3, 1e10))
        samples.append((b, f, ov + b / bw + f / fl))  # additive: the fit's own model form
    m = fit_processor("cpu", samples)
    assert m.bandwidth == pytest.approx(bw, rel=1e-3) and m.throughput == pytest.approx(fl, rel=1e-3)
    assert m.overhead_s == pytest.approx(ov, rel=1e-2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = SyntheticSpec(arch="llama", n_layers=4, d_model=128, ffn_dim=256, weight_type="Q4_0", embed_type="Q8_0")
    return write_synthetic_gguf(tmp_path_factory.mktemp("prof") / "m.gguf", spec)


def test_profile_measures_every_op_and_round_trips(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path))
    m = edgellm.load(tiny, backend="cpu-fast", ctx=64)
    p = profile_cpu(m, Profile(), kv_len=32, prefill=16)
    g = m.programs["decode"].graph
    decode_keys = [k for k in p.measured if k.split("|")[1].split("/")[1] == "s1"]
    kinds = {k.split("|")[1].split("/")[0] for k in decode_keys}
    # every decode op kind measured: inside the native step, which runs all but last_row (a view)
    assert m.programs["decode"]._step is not None
    assert kinds == {op.kind for op in g.ops} - {"last_row"}
    assert all(v > 0 for v in p.measured.values())
    assert p.processors["cpu"].bandwidth > 0 and p.processors["cpu"].throughput > 0
    # a token's ops and a prompt's fitted apart: the decode model prices the one-token ops it was
    # fitted to in total within a factor of two (one model over both stages gave ~7x)
    from edgellm.backends.info import CpuFastInfo
    from edgellm.hetero.profile import op_cost_inputs, op_signature

    assert "cpu@prefill" in p.processors
    t = {i: p.measured[f"cpu|{op_signature(g, i, 1, 32)}"] for i, op in enumerate(g.ops) if op.kind != "last_row"}
    pred = sum(p.processors["cpu"].predict(*op_cost_inputs(g, i, m.file, CpuFastInfo, 1, 32), 1) for i in t)
    assert 0.5 <= pred / sum(t.values()) <= 2.0
    save_profile(p)
    assert cache_path().parent == tmp_path / "hetero"
    q = load_profile()
    assert q.measured == p.measured and q.processors == p.processors
    # a second load reads its graphs back from the program cache (symbolic dimensions kept as
    # text): the profile measures the same ops and counts the same bytes and flops
    m2 = edgellm.load(tiny, backend="cpu-fast", ctx=64)
    assert "compiled" in m2.cache_hits
    p2 = profile_cpu(m2, Profile(), kv_len=32, prefill=16)
    assert set(p2.measured) == set(p.measured)


def _gpu_profile(tmp_path, monkeypatch, tiny):
    """A stored profile with the CPU measured here and a GPU described by a cost model, far faster
    than the CPU even on this tiny model's microsecond ops (whose decode step is one native call)."""
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path))
    m = edgellm.load(tiny, backend="cpu-fast", ctx=64)
    p = profile_cpu(m, Profile(), kv_len=32, prefill=16)
    p.processors["cuda:0"] = ProcessorModel("cuda:0", 2e12, 4e14, 1e-8)
    p.links["cpu>cuda:0"] = Link(1e-7, 2e10)
    p.links["cuda:0>cpu"] = Link(1e-7, 2e10)
    save_profile(p)


def test_plan_gpu_memory_places_layers_within_the_budget(tiny, tmp_path, monkeypatch):
    _gpu_profile(tmp_path, monkeypatch, tiny)
    env_cmd = [sys.executable, "-m", "edgellm", "plan", str(tiny), "--ctx", "64", "--prefill", "16", "--json"]
    from edgellm.gguf_file import open_gguf
    from edgellm.backends.info import CudaInfo

    from edgellm.compiler.compile import compile_graph
    from edgellm.hetero.plan import gpu_workspace
    from edgellm.models import build_graph, config_from_gguf

    f = open_gguf(tiny)
    layer = sum(CudaInfo.tensor_bytes(f, n) for n in f.tensors if n.startswith("blk.1.")) + 2 * 64 * 64 * 2
    pre = compile_graph(build_graph(config_from_gguf(f), f, "last"), seq=16, ctx=64).graph
    work = gpu_workspace(f, config_from_gguf(f), pre, ctx=64, prefill=16, stream=False)  # activations, not layers
    budget = int(2.5 * layer) + work
    r = subprocess.run(env_cmd + ["--gpu-memory", str(budget)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["memory_bytes"].get("cuda:0", 0) <= budget and p["gpu_workspace_bytes"] >= work
    on_gpu = [u for u, d in p["placement"].items() if d == "cuda:0" and u.startswith("blk.")]
    assert 1 <= len(on_gpu) <= 2  # the GPU is far faster: it is filled as far as the budget allows
    assert p["predicted_decode_s"] > 0 and p["predicted_prefill_s"] > 0
    small = subprocess.run(env_cmd + ["--gpu-memory", str(layer // 2)], capture_output=True, text=True, timeout=300)
    assert small.returncode == 1 and "smaller than one layer" in small.stderr and "Traceback" not in small.stderr


def test_plan_gpus_weighs_tensor_parallel_against_the_all_reduce(tmp_path):
    """Tensor parallel over 2 GPUs halves every layer's bytes and the head's and adds two
    all_reduces a layer and the logits' gather: predicted as the sharded graph's ops plus those
    collectives at the profile's link; the solver picks it while the link is fast and the pipeline
    (here: the model on one GPU) when it is slow."""
    from edgellm.hetero.plan import plan_gpus, unit_tables

    path = write_synthetic_gguf(tmp_path / "m.gguf", SyntheticSpec(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4,
                                                                   ffn_dim=1024, weight_type="Q8_0", seed=5))
    p = Profile()
    for g in ("cuda:0", "cuda:1"):
        p.processors[g] = ProcessorModel(g, 1e9, 1e12, 1e-9)  # slow memory: the bytes decide
    p.links["cuda:0>cuda:1"] = p.links["cuda:1>cuda:0"] = Link(1e-6, 1e10)
    gpus = ["cuda:0", "cuda:1"]
    p.links["all_reduce*2"] = Link(1e-7, 1e12)
    fast = plan_gpus(str(path), gpus, ctx=64, prefill=16, profile=p, gpu_memory="1GiB")
    assert fast["mode"] == "tensor" and fast["tensor"]["collectives_per_token"] == 4 * 2 + 1
    one = fast["pipeline"]["predicted_decode_s"]
    assert [r["on"] for r in fast["pipeline"]["runs"]] == ["cuda:0"]  # it fits one GPU: no transfers
    # the halved layers: the sharded graph's time with free all_reduces is between half and all of one GPU's
    from dataclasses import replace

    from edgellm.compiler.compile import compile_graph
    from edgellm.gguf_file import open_gguf
    from edgellm.models import build_graph, config_from_gguf

    f = open_gguf(path)
    g = compile_graph(build_graph(replace(config_from_gguf(f), shard=(0, 2)), f, "last"), seq=1, ctx=64).graph
    p.links["all_reduce*2"] = Link(0.0, float("inf"))
    free = sum(unit_tables(f, g, "cuda:0", p, 1, 32).values())
    assert 0.5 * one < free < one
    link = 8 * (1e-7 + 4 * 256 / 1e12) + (1e-7 + 4 * 256 / 1e12)  # d_model 256; the vocabulary 256 too
    assert fast["tensor"]["predicted_decode_s"] == pytest.approx(free + link, rel=1e-6)
    p.links["all_reduce*2"] = Link(1e-3, 1e12)  # a slow link: two of them a layer cost more than they save
    assert plan_gpus(str(path), gpus, ctx=64, prefill=16, profile=p, gpu_memory="1GiB")["mode"] == "pipeline"
    # one KV head cannot be shared by 2 GPUs: the pipeline, and why not tensor parallel
    p.links["all_reduce*2"] = Link(1e-7, 1e12)
    one_kv = write_synthetic_gguf(tmp_path / "mqa.gguf", SyntheticSpec(n_layers=2, d_model=256, n_heads=8, n_kv_heads=1,
                                                                       ffn_dim=1024, seed=6))
    mqa = plan_gpus(str(one_kv), gpus, ctx=64, prefill=16, profile=p, gpu_memory="1GiB")
    assert mqa["mode"] == "pipeline" and "needs a KV head for each rank" in mqa["tensor"]["unavailable"]
    from edgellm.hetero.plan import render_gpus

    assert "tensor parallel: not possible" in render_gpus(mqa)


def test_plan_devices_of_two_gpus_prints_both_splits(tiny, tmp_path, monkeypatch):
    """`edgellm plan --devices cuda:0,cuda:1` (a stored profile: no GPU needed) answers tensor parallel
    or pipelined with both predictions; the JSON's pick is the one the text names."""
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path))
    p = Profile()
    for g in ("cuda:0", "cuda:1"):
        p.processors[g] = ProcessorModel(g, 2e9, 4e12, 1e-9)
    p.links["all_reduce*2"] = Link(1e-7, 1e12)
    save_profile(p)
    cmd = [sys.executable, "-m", "edgellm", "plan", str(tiny), "--devices", "cuda:0,cuda:1", "--gpu-memory", "1GiB",
           "--ctx", "64", "--prefill", "16"]
    r = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["mode"] == "tensor" and d["gpus"] == ["cuda:0", "cuda:1"]
    assert 0 < d["tensor"]["predicted_decode_s"] < d["pipeline"]["predicted_decode_s"]
    assert d["tensor"]["all_reduce_link"]["measured"] is True
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0 and "tensor parallel" in text.stdout.splitlines()[0], text.stdout + text.stderr


def test_plan_streams_layers_the_gpu_cannot_hold_when_the_link_pays(tiny, tmp_path, monkeypatch):
    """Layers past the GPU budget run on the CPU with their prefill products streamed to the GPU
    over the link ('rows cpu 1.00 | cuda:0'), and with EDGELLM_STREAM_DECODE=1 a share of each
    decode product's rows too ('rows cpu SHARE | cuda:0'); the streaming slots come off the
    budget; with a slow link the same budget keeps those layers on the CPU alone."""
    from edgellm.backends.info import CudaInfo
    from edgellm.gguf_file import open_gguf
    from edgellm.hetero.plan import gpu_workspace, plan_split, stream_reservation, unit_products
    import edgellm.hetero.stream as stream
    from edgellm.compiler.compile import compile_graph
    from edgellm.models import build_graph, config_from_gguf

    monkeypatch.setattr(stream, "SLOT_BYTES", 2048)  # slots of a size against the tiny layers as on an 8B model
    _gpu_profile(tmp_path, monkeypatch, tiny)
    p = load_profile()
    f = open_gguf(tiny)
    layer = sum(CudaInfo.tensor_bytes(f, n) for n in f.tensors if n.startswith("blk.1.")) + 2 * 64 * 64 * 2
    dec = compile_graph(build_graph(config_from_gguf(f), f, "last"), seq=1, ctx=64).graph
    pre = compile_graph(build_graph(config_from_gguf(f), f, "last"), seq=16, ctx=64).graph
    slots = stream_reservation(f, dec)
    biggest = max(b for ps in unit_products(f, dec).values() for b, _, _ in ps)
    assert slots == stream.N_SLOTS * (min(biggest, 2048) + 1024)
    work = gpu_workspace(f, config_from_gguf(f), pre, ctx=64, prefill=16, stream=True)
    assert work > gpu_workspace(f, config_from_gguf(f), pre, ctx=64, prefill=16, stream=False) > 0
    budget = int(2.2 * layer) + slots + work

    def plan(**kw):  # prompts weigh as much as tokens here: the tiny model's prefill is as cheap as its decode
        return plan_split(str(tiny), gpu_memory=str(budget), devices="cuda:0,cpu", ctx=64, prefill=16, profile=p,
                          prefill_weight=1.0, **kw)

    def streamed(r):
        return {u: d for u, d in r["placement"].items() if d.startswith("rows cpu") and d.endswith("| cuda:0")
                and u.startswith("blk.")}

    # every CPU cost from a cost model, not the timings (a busy machine must not move the choice):
    # a CPU slow at arithmetic (prefill), a link far faster than it
    p.measured = {k: v for k, v in p.measured.items() if not k.startswith("cpu|")}
    p.processors["cpu"] = p.processors["cpu@prefill"] = ProcessorModel("cpu", 1e9, 1e8, 1e-5)
    p.links["cpu>cuda:0"] = Link(1e-6, 1e12, 1.2)
    fast = plan()
    on_gpu = [u for u, d in fast["placement"].items() if d == "cuda:0" and u.startswith("blk.")]
    assert streamed(fast) and on_gpu and len(streamed(fast)) + len(on_gpu) == 4  # (the head takes GPU room too)
    assert set(streamed(fast).values()) == {"rows cpu 1.00 | cuda:0"}  # by default decode stays on the CPU
    assert fast["memory_bytes"]["cuda:0"] <= budget
    off = plan(stream=False)
    assert not streamed(off) and fast["predicted_prefill_s"] < off["predicted_prefill_s"]
    # the objective weighs prefill: never worse than the placement without streaming
    w = 1.0
    assert fast["predicted_decode_s"] + w * fast["predicted_prefill_s"] <= \
        off["predicted_decode_s"] + w * off["predicted_prefill_s"] + 1e-12

    monkeypatch.setenv("EDGELLM_STREAM_DECODE", "1")
    both = plan()
    assert streamed(both) and fast["predicted_decode_s"] > both["predicted_decode_s"]
    for d in streamed(both).values():  # the GPU's share is the larger where its side is the faster one
        assert float(d.split()[2]) < 0.5

    p.links["cpu>cuda:0"] = Link(1e-3, 1e3)  # a link slower than anything the CPU does
    assert not streamed(plan())


def test_run_gpu_memory_places_the_model_and_answers_as_unsplit(tiny, tmp_path, monkeypatch):
    """`edgellm run --gpu-memory SIZE`: the solver's placement, loaded by the split executor and
    printed on stderr. With a stored profile whose GPU is slower than the CPU every unit lands on
    the CPU (this machine may have no GPU), and the greedy answer is cpu-fast's own. Without a
    GPU and without a profile of one, a one-line error."""
    import os
    import torch

    _gpu_profile(tmp_path, monkeypatch, tiny)
    p = load_profile()
    p.processors["cuda:0"] = ProcessorModel("cuda:0", 1e6, 1e6, 1.0)  # a second per op
    save_profile(p)
    from edgellm.synthetic import byte_bpe_vocab

    spec = SyntheticSpec(arch="llama", n_layers=4, d_model=128, ffn_dim=256, weight_type="Q4_0", embed_type="Q8_0")
    model = write_synthetic_gguf(tmp_path / "v.gguf", spec, tokenizer=byte_bpe_vocab(512))
    cmd = [sys.executable, "-m", "edgellm", "run", "-m", str(model), "--temperature", "0", "-n", "6", "--raw",
           "the quick brown fox"]
    placed = subprocess.run(cmd + ["--gpu-memory", "64MiB"], capture_output=True, text=True, timeout=300)
    plain = subprocess.run(cmd + ["--backend", "cpu-fast"], capture_output=True, text=True, timeout=300)
    assert placed.returncode == 0, placed.stderr
    assert plain.returncode == 0 and placed.stdout == plain.stdout and placed.stdout.strip()
    assert "placement of" in placed.stderr and "on cpu" in placed.stderr and "split:" in placed.stderr
    if not torch.cuda.is_available():
        env = {**os.environ, "EDGELLM_CACHE_DIR": str(tmp_path / "empty")}
        bare = subprocess.run(cmd + ["--gpu-memory", "6GiB"], capture_output=True, text=True, timeout=300, env=env)
        assert bare.returncode == 1 and "no GPU is visible" in bare.stderr and "Traceback" not in bare.stderr
