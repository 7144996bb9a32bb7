"""Ring KV caches of sliding-window layers on the cuda backend against the cpu reference with
full-context caches (tests/test_kv_ring.py checks the cpu rings). Without a GPU the Triton
kernels run in the interpreter on CPU tensors, at tiny sizes."""

from __future__ import annotations

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

# layer 0 slides over 4 positions, layer 1 is global; 20 tokens are five windows
SPEC = SyntheticSpec(arch="gemma3", n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=32,
                     vocab_size=128, sliding_window=4, swa_pattern=2, weight_type="F16", std=0.2, seed=44)
CTX, N = 24, 20
TOL = 5e-3  # fp16 activations and caches, relative to the logit scale (tests/test_cuda_backend.py)


@pytest.fixture(autouse=True)
def _cuda_device(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("EDGELLM_CUDA_DEVICE", "cpu")


@pytest.mark.parametrize("fuse", [True, False])  # the fused rope+store kernel; the unfused store
def test_cuda_ring_matches_full_cache(tmp_path, fuse):
    path = write_synthetic_gguf(tmp_path / "m.gguf", SPEC)
    ids = np.random.default_rng(SPEC.seed).integers(0, SPEC.vocab_size, N).tolist()
    ref = edgellm.load(path, ctx=CTX, prefill_chunk=CTX, cache=False).logits(ids)  # no ring anywhere
    m = edgellm.load(path, backend="cuda", ctx=CTX, prefill_chunk=3, cache=False, fuse=fuse)
    assert m.states["cache.k.0"].shape[0] == 4 + 3 - 1 and m.states["cache.k.1"].shape[0] == CTX
    scale = np.abs(ref).max()
    # seven prefill chunks, the ring wrapping three times
    got = m.logits(ids)
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert np.abs(got - ref).max() <= TOL * scale
    if not fuse:
        return
    # decode past the window (split-context decode attention reading the ring)
    steps = [m.forward(ids[:6], 0, all_logits=False)[-1]]
    steps += [m.forward([ids[i]], i, all_logits=False)[-1] for i in range(6, N)]
    assert np.abs(np.stack(steps) - ref[5:]).max() <= TOL * scale
