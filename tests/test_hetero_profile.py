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
    assert kinds == {op.kind for op in g.ops}  # every decode op kind measured
    assert all(v > 0 for v in p.measured.values())
    assert p.processors["cpu"].bandwidth > 0 and p.processors["cpu"].throughput > 0
    save_profile(p)
    assert cache_path().parent == tmp_path / "hetero"
    q = load_profile()
    assert q.measured == p.measured and q.processors == p.processors


def _gpu_profile(tmp_path, monkeypatch, tiny):
    """A stored profile with the CPU measured here and a GPU described by a cost model."""
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path))
    m = edgellm.load(tiny, backend="cpu-fast", ctx=64)
    p = profile_cpu(m, Profile(), kv_len=32, prefill=16)
    p.processors["cuda:0"] = ProcessorModel("cuda:0", 2e12, 4e14, 4e-6)
    p.links["cpu>cuda:0"] = Link(1e-5, 2e10)
    p.links["cuda:0>cpu"] = Link(1e-5, 2e10)
    save_profile(p)


def test_plan_gpu_memory_places_layers_within_the_budget(tiny, tmp_path, monkeypatch):
    _gpu_profile(tmp_path, monkeypatch, tiny)
    env_cmd = [sys.executable, "-m", "edgellm", "plan", str(tiny), "--ctx", "64", "--prefill", "16", "--json"]
    from edgellm.gguf_file import open_gguf
    from edgellm.backends.info import CudaInfo

    f = open_gguf(tiny)
    layer = sum(CudaInfo.tensor_bytes(f, n) for n in f.tensors if n.startswith("blk.1.")) + 2 * 64 * 64 * 2
    budget = int(2.5 * layer)
    r = subprocess.run(env_cmd + ["--gpu-memory", str(budget)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["memory_bytes"].get("cuda:0", 0) <= budget
    on_gpu = [u for u, d in p["placement"].items() if d == "cuda:0" and u.startswith("blk.")]
    assert 1 <= len(on_gpu) <= 2  # the GPU is far faster: it is filled as far as the budget allows
    assert p["predicted_decode_s"] > 0 and p["predicted_prefill_s"] > 0
    small = subprocess.run(env_cmd + ["--gpu-memory", str(layer // 2)], capture_output=True, text=True, timeout=300)
    assert small.returncode == 1 and "smaller than one layer" in small.stderr and "Traceback" not in small.stderr
