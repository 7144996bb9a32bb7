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


# -- the kernels on their own: rings filled as a run leaves them, everything else poisoned ---------
DEV = torch.device("cuda") if ON_GPU else torch.device("cpu")


def _rand(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.float16).to(DEV)


def _ring(full: torch.Tensor, rows: int, end: int) -> torch.Tensor:
    """The ring of `rows` rows after positions 0..end-1 were written in order: the last `rows`
    positions, position p in row p mod rows; rows never written are NaN."""
    ring = torch.full((rows, full.shape[1]), float("nan"), dtype=full.dtype, device=full.device)
    for p in range(max(0, end - rows), end):
        ring[p % rows] = full[p]
    return ring


def _attn64(q, k, v, positions, H, HKV, D, scale, window):
    """float64 causal sliding-window attention over full-length k, v (row = position)."""
    q, k, v = (t.double().cpu().numpy() for t in (q, k, v))
    out = np.zeros((len(positions), H, D))
    for t, p in enumerate(positions):
        lo = max(0, p - window + 1)
        for h in range(H):
            kv = h // (H // HKV)
            s = k[lo:p + 1, kv * D:(kv + 1) * D] @ q[t, h * D:(h + 1) * D] * scale
            e = np.exp(s - s.max())
            out[t, h] = (e / e.sum()) @ v[lo:p + 1, kv * D:(kv + 1) * D]
    return out.reshape(len(positions), H * D)


@pytest.mark.parametrize("decode", [False, True])
def test_attention_reads_a_ring(decode):
    from edgellm.backends.cuda import kernels as K

    rng = np.random.default_rng(3)
    H, HKV, D, W = 4, 2, 16, 4
    T, start, rows = (1, 12, 5) if decode else (3, 10, 7)  # rows: the window + the other queries
    k, v = _rand(rng, start + T, HKV * D), _rand(rng, start + T, HKV * D)
    kc, vc = _ring(k, rows, start + T), _ring(v, rows, start + T)
    q = _rand(rng, T, H * D)
    out = torch.full((T, H * D), float("nan"), dtype=torch.float16, device=DEV)
    if decode:
        K.attention_decode(q, kc, vc, start + T, H, HKV, 0.3, out=out, window=W,
                           config=dict(BLOCK_N=16, num_warps=4, num_stages=1, n_splits=2))
    else:
        K.attention_prefill(q, kc, vc, start, H, HKV, 0.3, out=out, window=W,
                            config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))
    ref = _attn64(q, k, v, list(range(start, start + T)), H, HKV, D, 0.3, W)
    got = out.double().cpu().numpy()
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= 3e-3 * np.abs(ref).max()
    with pytest.raises(ValueError, match="KV cache has"):  # a window the ring cannot hold
        K.attention_prefill(_rand(rng, rows - W + 2, H * D), kc, vc, start, H, HKV, 0.3, window=W)


def test_windowed_prefill_over_a_whole_context_cache():
    """A sliding-window layer whose cache holds the whole (short) context is no ring: a prefill of
    more than rows - window + 1 tokens from a start read on the device (as the programs pass it)
    is correct (the warm-up's first prefill at ctx 16 raised here on the GPU, 2026-11-26); on a
    ring the same call is refused."""
    from edgellm.backends.cuda import kernels as K

    rng = np.random.default_rng(5)
    H, HKV, D, W, rows, T = 4, 2, 16, 4, 16, 15
    k, v = _rand(rng, rows, HKV * D), _rand(rng, rows, HKV * D)
    q = _rand(rng, T, H * D)
    start = torch.zeros(1, dtype=torch.int32, device=DEV)
    out = torch.full((T, H * D), float("nan"), dtype=torch.float16, device=DEV)
    K.attention_prefill(q, k, v, start, H, HKV, 0.3, out=out, window=W, ring=False,
                        config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))
    ref = _attn64(q, k, v, list(range(T)), H, HKV, D, 0.3, W)
    got = out.double().cpu().numpy()
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= 3e-3 * np.abs(ref).max()
    with pytest.raises(ValueError, match="need 18 cache rows"):
        K.attention_prefill(q, k, v, start, H, HKV, 0.3, window=W)


def test_rope_store_writes_a_ring_with_scaled_rope():
    from edgellm.backends.cpu import _rope
    from edgellm.backends.cuda import kernels as K

    rng = np.random.default_rng(4)
    H, HKV, D, T, start, rows = 2, 1, 16, 3, 12, 5  # positions 12..14: rows 2, 3, 4
    q, k, v = _rand(rng, T, H * D), _rand(rng, T, HKV * D), _rand(rng, T, HKV * D)
    kc = torch.full((rows, HKV * D), float("nan"), dtype=torch.float16, device=DEV)
    vc = kc.clone()
    attrs = dict(head_dim=D, theta=1e4, style="neox", pos_scale=0.5, mscale=1.25)
    qo = K.rope_qkv_cache(q, k, v, kc, vc, start, H, HKV, D, theta=1e4, style="neox", ring=True,
                          pos_scale=0.5, mscale=1.25)
    ref_q = _rope(q.float().cpu(), start, None, {**attrs, "n_heads": H})
    ref_k = _rope(k.float().cpu(), start, None, {**attrs, "n_heads": HKV})
    assert (qo.float().cpu() - ref_q).abs().max() <= 3e-3 * ref_q.abs().max()
    assert (kc[2:].float().cpu() - ref_k).abs().max() <= 3e-3 * ref_k.abs().max()
    assert torch.equal(vc[2:], v) and kc[:2].isnan().all() and vc[:2].isnan().all()  # rows 0, 1 untouched
