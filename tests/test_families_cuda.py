"""The gemma3, qwen3 and phi3 graphs on the cuda backend against the cpu backend (which
tests/test_families.py checks against transformers). Without a GPU the Triton kernels run in the
interpreter on CPU tensors, at tiny sizes."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import edgellm  # noqa: E402
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf  # noqa: E402

ON_GPU = torch.cuda.is_available()
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

MODELS = {
    # layer 0 slides over 4 keys (8 tokens), layer 1 is global; GeGLU, q/k norms, post norms, softcap
    "gemma3-f16-mqa-hd16-softcap": SyntheticSpec(arch="gemma3", n_layers=2, d_model=32, n_heads=2, n_kv_heads=1,
                                                 head_dim=16, ffn_dim=32, vocab_size=128, sliding_window=4,
                                                 swa_pattern=2, logit_softcap=4.0, weight_type="F16", std=0.2,
                                                 seed=41),
    "qwen3-f16-q8_0-embed-untied": SyntheticSpec(arch="qwen3", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1,
                                                 head_dim=24, ffn_dim=32, vocab_size=128, tied=False,
                                                 weight_type="F16", embed_type="Q8_0", std=0.2, seed=42),
    "phi3-f16-mqa": SyntheticSpec(arch="phi3", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                  vocab_size=128, weight_type="F16", std=0.2, seed=43),
    # long-RoPE: per-frequency factors and the attention factor on cos/sin (the rope kernel's mscale)
    "phi3-longrope-f16": SyntheticSpec(arch="phi3", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                       vocab_size=128, tied=False, rope_factors=True, weight_type="F16", std=0.2,
                                       seed=46),  # seed 45 has a near-tied top-2 pair (4e-4 of the scale)
}


@pytest.fixture(autouse=True)
def _cuda_device(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("EDGELLM_CUDA_DEVICE", "cpu")


@pytest.mark.parametrize("name", list(MODELS))
def test_family_cuda_logits_match_cpu(name, tmp_path):
    spec = MODELS[name]
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(spec.seed).integers(0, spec.vocab_size, 8).tolist()
    ref = edgellm.load(path, ctx=16).logits(ids)
    m = edgellm.load(path, backend="cuda", ctx=16, prefill_chunk=5)  # two prefill chunks
    got = m.logits(ids)
    assert got.shape == ref.shape and np.isfinite(got).all()
    tol = 5e-3  # fp16 activations and caches, relative to the logit scale (tests/test_cuda_backend.py)
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    # decode through the fp16 cache, one token at a time (the window over cached keys)
    steps = [m.forward(ids[:6], 0, all_logits=False)[-1]]
    steps += [m.forward([ids[i]], i, all_logits=False)[-1] for i in range(6, len(ids))]
    assert np.abs(np.stack(steps) - ref[5:]).max() <= tol * np.abs(ref).max()


def test_residual_stream_past_float16_range(tmp_path, monkeypatch):
    """Gemma 3's residual stream outgrows float16 (the 270M file reaches 1.04e5; float16 ends at
    65,504): here the embedding rows, scaled by sqrt(d) into the stream, go past it from the first
    layer on. The cuda backend keeps the stream in float32, so its logits stay finite and match."""
    import edgellm.synthetic as synthetic

    plain = synthetic.make_tensor

    def big_embedding(spec, name, shape):
        t = plain(spec, name, shape)
        return t * 6e4 if name == "token_embd.weight" else t  # std 1.2e4: fits float16, x sqrt(32) does not

    monkeypatch.setattr(synthetic, "make_tensor", big_embedding)
    # untied: the output projection keeps ordinary weights, so the logits measure the stream alone
    spec = dataclasses.replace(MODELS["gemma3-f16-mqa-hd16-softcap"], tied=False, logit_softcap=0.0)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(7).integers(0, spec.vocab_size, 6).tolist()
    ref = edgellm.load(path, ctx=16).logits(ids)
    assert np.abs(ref).max() > 0  # the float32 reference
    m = edgellm.load(path, backend="cuda", ctx=16)
    got = m.logits(ids)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= 5e-3 * np.abs(ref).max()
    step = m.forward([ids[0]], 0, all_logits=False)[-1]  # the decode program's stream too
    assert np.abs(step - ref[0]).max() <= 5e-3 * np.abs(ref).max()
