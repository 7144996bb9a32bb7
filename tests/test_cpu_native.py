"""The native CPU kernels (edgellm/backends/cpu_native.c) against float64 products of the format's
own dequantization, and the cpu-fast backend using them against the cpu reference."""

import numpy as np
import pytest
import torch

import edgellm
from edgellm.backends import cpu_native
from edgellm.backends.cpu_native import NativeRows
from edgellm.quant import dequantize, quantize
from edgellm.sampling import SamplingParams
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf

pytestmark = pytest.mark.skipif(cpu_native.library() is None,
                                reason=f"native kernels not built here: {cpu_native.unavailable()}")


def _native_bound(x: np.ndarray, wq: np.ndarray) -> np.ndarray:
    """The input is quantized per block of 32 to int8 with step amax/127: each element moves by at
    most amax/254, and the rounded input meets the whole weight (its block offsets take the rounded
    block sums), so a product moves by at most sum over blocks of amax_b/254 * sum_b |w| (the
    integer block sums are exact; float32 accumulation adds ~1e-6 relative)."""
    m, k = x.shape
    n = wq.shape[0]
    step = np.abs(x).reshape(m, k // 32, 32).max(-1) / 254
    scaled = np.abs(wq.reshape(n, k // 32, 32)).sum(-1)
    return step @ scaled.T + 1e-5 * (np.abs(x) @ np.abs(wq).T) + 1e-7


def _rounded_input(x: np.ndarray) -> np.ndarray:
    """x as the native kernels round it (float32: step amax/127, lrintf of x * 127/amax), in float64."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint((xb * inv).astype(np.float32))
    return (q.astype(np.float64) * (amax / np.float32(127.0)).astype(np.float32)).reshape(m, k)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("n,k,cuts", [(203, 544, (0, 203)), (64, 32, (0, 64)), (131, 96, (0, 17, 60, 131)),
                                      (1000, 256, (0, 3, 1000))])
def test_native_product_matches_dequantized_float64(fmt, n, k, cuts):
    """Row counts off the 4-row and 16-row groups, k off wide vector multiples, the matrix split
    into parts (a fused product's stacked weights) at odd rows; rows with extreme scales; every
    output element written (the output is poisoned with NaN first)."""
    rng = np.random.default_rng(n * 7 + k + len(fmt))
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    w[1] *= 3e3  # a large scale
    w[2] *= 1e-4  # a tiny one
    w[3, :32] = 0  # an all-zero block
    raw = quantize(w, fmt)
    wq = dequantize(raw, fmt, (n, k)).astype(np.float64)
    parts = [raw[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    prod = NativeRows(parts, k, fmt)
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
        bound = _native_bound(x, wq)
        assert (np.abs(y - ref) <= bound).all(), float((np.abs(y - ref) / bound).max())
        # exactly the rounded input times the whole weight (the offsets on the rounded sums)
        emu = _rounded_input(x) @ wq.T
        assert (np.abs(y - emu) <= 2e-6 * (np.abs(x) @ np.abs(wq).T) + 1e-6).all(), float(np.abs(y - emu).max())


def test_native_product_rejects_wrong_shapes():
    raw = quantize(np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32), "Q8_0")
    prod = NativeRows([raw], 64)
    with pytest.raises(ValueError, match=r"expected \[m, 64\]"):
        prod(torch.randn(2, 32))
    with pytest.raises(ValueError, match="out of shape"):
        prod(torch.randn(2, 64), out=torch.empty(2, 7))
    with pytest.raises(ValueError, match="bytes for k = 96"):
        NativeRows([raw], 96)
    with pytest.raises(ValueError, match="known: Q8_0"):
        NativeRows([raw], 64, "Q6_K")


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_cpu_fast_decodes_natively_as_the_reference(tmp_path, fmt):
    """A model on cpu-fast: its decode products run on the native kernels (few input rows), its
    prompt on torch's packs; logits of every decode step close to the float32 reference's and the
    same greedy tokens."""
    spec = SyntheticSpec(arch="llama", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=320,
                         weight_type=fmt, embed_type="Q8_0", seed=11)
    path = write_synthetic_gguf(tmp_path / f"{fmt}.gguf", spec)
    ref = edgellm.load(path, backend="cpu", ctx=64)
    fast = edgellm.load(path, backend="cpu-fast", ctx=64)
    packs = fast.backend.weights._packs.values()
    assert packs and all(p.native is not None for p in packs if p.type_name in ("Q8_0", "Q4_0", "Q4_1"))
    assert any(p.type_name == fmt for p in packs) and "native for" in fast.backend.describe()
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
        y = NativeRows([raw], 64)(torch.ones(1, 64))
        assert np.allclose(y.numpy()[0], dequantize(raw, "Q8_0", (8, 64)).sum(1), rtol=1e-2, atol=1e-3)
    finally:
        cpu_native._state.clear()
        cpu_native._state.update(saved)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
def test_plain_c_build_matches_the_vector_build(fmt):
    """The build without x86 vector extensions (what a CPU without AVX2 gets: the plain C loops and
    the software fp16 conversion) gives the vector build's products to float32 rounding."""
    try:
        plain = cpu_native.variant(["-mno-avx2", "-mno-f16c", "-mno-fma"])
    except RuntimeError as e:  # a compiler for another architecture rejects the x86 flags
        pytest.skip(f"no x86 plain build here: {e}")
    rng = np.random.default_rng(5)
    n, k = 37, 160
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[0, :32] *= 1e-3  # fp16 subnormal scales: the software conversion's rare path
    raw = quantize(w, fmt)
    x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32))
    a = NativeRows([raw], k, fmt)(x).numpy()
    b = NativeRows([raw], k, fmt, lib=plain)(x).numpy()
    assert np.allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(a).max())



def test_split_runs_keep_the_openmp_pool_awake_and_nothing_else_changes_it():
    """edgellm/omp.py: a split run (`edgellm run --gpu-memory`) sets GOMP_SPINCOUNT before torch
    loads the OpenMP runtime, unless the user chose a value; importing edgellm alone, or too late
    (torch already loaded), leaves the environment as it was."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}

    def run(code, **extra):
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              check=True).stdout.split()

    show = "print(ok, os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    assert run("import os, sys, edgellm; ok = None; " + show) == ["None", "None", "False"]
    assert run("import os, sys; from edgellm.omp import keep_pool_awake; ok = keep_pool_awake(); " + show) == \
        ["True", "2000000", "False"]
    assert run("import os, sys; from edgellm.omp import keep_pool_awake; ok = keep_pool_awake(); " + show,
               GOMP_SPINCOUNT="7") == ["False", "7", "False"]
    assert run("import os, sys, torch; from edgellm.omp import keep_pool_awake; ok = keep_pool_awake(); " + show) == \
        ["False", "None", "True"]
