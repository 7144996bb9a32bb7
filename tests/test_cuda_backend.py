"""The cuda backend executes the same graphs as the cpu backend. On a machine without a GPU the
kernels run in Triton's interpreter on CPU tensors (EDGELLM_CUDA_DEVICE=cpu), on tiny models."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import edgellm  # noqa: E402
from edgellm.sampling import SamplingParams  # noqa: E402
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf  # noqa: E402

ON_GPU = torch.cuda.is_available()
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

MODELS = {
    "llama-q4_0-gqa2": SyntheticSpec(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=96, weight_type="Q4_0",
                                     embed_type="Q8_0", std=0.1, seed=21),
    "qwen2-q8_0-bias-untied": SyntheticSpec(arch="qwen2", n_layers=1, d_model=64, n_heads=4, n_kv_heads=1, ffn_dim=64,
                                            weight_type="Q8_0", tied=False, std=0.1, seed=22),
    "llama-f16-rope-freqs-q5": SyntheticSpec(n_layers=1, d_model=64, n_heads=2, n_kv_heads=2, ffn_dim=64,
                                             weight_type="F16", rope_freqs=True, type_overrides={
                                                 "blk.0.ffn_down.weight": "Q5_0"}, std=0.1, seed=23),
}


@pytest.fixture(autouse=True)
def _cuda_device(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("EDGELLM_CUDA_DEVICE", "cpu")


@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_logits_match_cpu(name, tmp_path):
    spec = MODELS[name]
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(spec.seed).integers(0, spec.vocab_size, 11).tolist()
    ref = edgellm.load(path, ctx=32).logits(ids)
    m = edgellm.load(path, backend="cuda", ctx=32, prefill_chunk=8)  # two prefill chunks
    got = m.logits(ids)
    assert got.shape == ref.shape and np.isfinite(got).all()
    # fp16 activations and caches: relative to the logit scale
    assert np.abs(got - ref).max() <= 5e-3 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    # decode through the in-place fp16 cache: the same positions again, one token at a time
    steps = [m.forward(ids[:6], 0, all_logits=False)[-1]]
    steps += [m.forward([ids[i]], i, all_logits=False)[-1] for i in range(6, len(ids))]
    assert np.abs(np.stack(steps) - ref[5:]).max() <= 5e-3 * np.abs(ref).max()


def test_cuda_greedy_generation_matches_cpu(tmp_path):
    spec = MODELS["llama-q4_0-gqa2"]
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = [3, 17, 99, 5, 42]
    a = list(edgellm.load(path, ctx=32).generate_tokens(ids, 8, SamplingParams(temperature=0)))
    b = list(edgellm.load(path, backend="cuda", ctx=32).generate_tokens(ids, 8, SamplingParams(temperature=0)))
    assert a == b


def test_cuda_unavailable_is_a_clear_error(tmp_path, monkeypatch):
    if ON_GPU:
        pytest.skip("a GPU is present")
    monkeypatch.delenv("EDGELLM_CUDA_DEVICE", raising=False)
    path = write_synthetic_gguf(tmp_path / "m.gguf", MODELS["llama-q4_0-gqa2"])
    with pytest.raises(edgellm.errors.BackendUnavailableError, match="--backend cpu"):
        edgellm.load(path, backend="cuda")


def test_unsupported_ops_are_delegated_to_cpu(tmp_path, monkeypatch):
    """A backend that lacks fused norm and gate/up kernels: the partitioner cuts the graph, those
    ops run on the cpu backend's kernels with transfers, and the logits stay right."""
    from edgellm.backends.info import CudaInfo

    monkeypatch.setattr(CudaInfo, "SUPPORTED_OPS", CudaInfo.SUPPORTED_OPS - {"add_rms_norm", "linear_swiglu"})
    spec = MODELS["llama-q4_0-gqa2"]
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(1).integers(0, spec.vocab_size, 7).tolist()
    ref = edgellm.load(path, ctx=32).logits(ids)
    m = edgellm.load(path, backend="cuda", ctx=32)
    c = m.compiled["all"]
    assert {s.backend for s in c.segments} == {"cuda", "cpu"} and c.transfers > 0
    assert m.programs["all"].delegated
    got = m.logits(ids)
    assert np.abs(got - ref).max() <= 5e-3 * np.abs(ref).max()
    steps = [m.forward(ids[:4], 0, all_logits=False)[-1]] + [m.forward([ids[i]], i, all_logits=False)[-1]
                                                             for i in range(4, len(ids))]
    assert np.abs(np.stack(steps) - ref[3:]).max() <= 5e-3 * np.abs(ref).max()
