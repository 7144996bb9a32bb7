"""The native CPU kernels (edgellm/backends/cpu_native.c) against float64 products of the format's
own dequantization, and the cpu-fast backend using them against the cpu reference."""

import numpy as np
import pytest
import torch

import edgellm
from edgellm.backends import cpu_native
from edgellm.backends.cpu_native import Q8_0Rows
from edgellm.quant import dequantize, quantize
from edgellm.sampling import SamplingParams
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf

pytestmark = pytest.mark.skipif(cpu_native.library() is None,
                                reason=f"native kernels not built here: {cpu_native.unavailable()}")


def _q8_0_bound(x: np.ndarray, wq: np.ndarray) -> np.ndarray:
    """The input is quantized per block of 32 to int8 with step amax/127: each element moves by at
    most amax/254, so a product moves by at most sum over blocks of amax_b/254 * sum_b |w| (the
    integer block sums are exact; float32 accumulation adds ~1e-6 relative)."""
    m, k = x.shape
    n = wq.shape[0]
    step = np.abs(x).reshape(m, k // 32, 32).max(-1) / 254
    return step @ np.abs(wq).reshape(n, k // 32, 32).sum(-1).T + 1e-5 * (np.abs(x) @ np.abs(wq).T) + 1e-7


@pytest.mark.parametrize("n,k,cuts", [(203, 544, (0, 203)), (64, 32, (0, 64)), (131, 96, (0, 17, 60, 131)),
                                      (1000, 256, (0, 3, 1000))])
def test_q8_0_product_matches_dequantized_float64(n, k, cuts):
    """Row counts off the 4-row and 16-row groups, k off wide vector multiples, the matrix split
    into parts (a fused product's stacked weights) at odd rows; rows with extreme scales; every
    output element written (the output is poisoned with NaN first)."""
    rng = np.random.default_rng(n * 7 + k)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[1] *= 3e3  # a large scale
    w[2] *= 1e-4  # a tiny one
    w[3, :32] = 0  # an all-zero block
    raw = quantize(w, "Q8_0")
    wq = dequantize(raw, "Q8_0", (n, k)).astype(np.float64)
    parts = [raw[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    prod = Q8_0Rows(parts, k)
    assert prod.n == n
    for m in (1, 3, 9):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :32] *= 50  # one block of the input far larger than the rest
        if m > 1:
            x[1, 32:64] = 0  # an all-zero input block
        out = torch.full((m, n), float("nan"))
        y = prod(torch.from_numpy(x), out=out).numpy()
        assert np.isfinite(y).all()
        ref = x.astype(np.float64) @ wq.T
        bound = _q8_0_bound(x, wq)
        assert (np.abs(y - ref) <= bound).all(), float((np.abs(y - ref) / bound).max())


def test_q8_0_product_rejects_wrong_shapes():
    raw = quantize(np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32), "Q8_0")
    prod = Q8_0Rows([raw], 64)
    with pytest.raises(ValueError, match=r"expected \[m, 64\]"):
        prod(torch.randn(2, 32))
    with pytest.raises(ValueError, match="out of shape"):
        prod(torch.randn(2, 64), out=torch.empty(2, 7))
    with pytest.raises(ValueError, match="bytes for k = 96"):
        Q8_0Rows([raw], 96)


def test_cpu_fast_decodes_q8_0_natively_as_the_reference(tmp_path):
    """A Q8_0 model on cpu-fast: its decode products run on the native kernel (few input rows),
    its prompt on torch's packs; logits of every decode step close to the float32 reference's and
    the same greedy tokens."""
    spec = SyntheticSpec(arch="llama", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=320,
                         weight_type="Q8_0", embed_type="Q8_0", seed=11)
    path = write_synthetic_gguf(tmp_path / "q8.gguf", spec)
    ref = edgellm.load(path, backend="cpu", ctx=64)
    fast = edgellm.load(path, backend="cpu-fast", ctx=64)
    packs = fast.backend.weights._packs.values()
    assert packs and all(p.native is not None for p in packs if p.type_name == "Q8_0")
    assert "native Q8_0" in fast.backend.describe()
    ids = [3, 17, 5, 9, 30, 2, 11]
    a, b = ref.logits(ids), fast.logits(ids)  # the prompt: several rows per product
    assert np.abs(a - b).max() <= 0.03 * np.abs(a).max()
    ref.forward(ids[:3], 0, all_logits=False)
    fast.forward(ids[:3], 0, all_logits=False)
    for pos in range(3, len(ids)):  # decode steps: one row per product, the native kernel
        a, b = ref.forward([ids[pos]], pos, all_logits=False), fast.forward([ids[pos]], pos, all_logits=False)
        assert np.abs(a - b).max() <= 0.03 * np.abs(a).max()
    greedy = SamplingParams(temperature=0)
    assert list(ref.generate_tokens(ids, 12, greedy)) == list(fast.generate_tokens(ids, 12, greedy))


def test_native_off_keeps_torch_kernels(monkeypatch):
    saved = dict(cpu_native._state)
    try:
        monkeypatch.setenv("EDGELLM_NATIVE", "0")
        cpu_native._state.clear()
        assert cpu_native.library() is None
        assert "EDGELLM_NATIVE=0" in cpu_native.unavailable()
    finally:
        cpu_native._state.clear()
        cpu_native._state.update(saved)


def test_a_damaged_library_in_the_cache_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path))
    saved = dict(cpu_native._state)
    try:
        cpu_native._state.clear()
        built = cpu_native._library_path()[0]
        assert built.parent.parent == tmp_path
        built.parent.mkdir(parents=True)
        built.write_bytes(b"not a shared library")
        lib = cpu_native.library()
        assert lib is not None and built.stat().st_size > 1000
        raw = quantize(np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32), "Q8_0")
        y = Q8_0Rows([raw], 64)(torch.ones(1, 64))
        assert np.allclose(y.numpy()[0], dequantize(raw, "Q8_0", (8, 64)).sum(1), rtol=1e-2, atol=1e-3)
    finally:
        cpu_native._state.clear()
        cpu_native._state.update(saved)
