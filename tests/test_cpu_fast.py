"""The cpu-fast backend against the float32 references: each packed layout against a float64
product of the format's own dequantization; whole models against the cpu reference backend."""

import numpy as np
import pytest
import torch

import edgellm
from edgellm.backends import get_backend, get_backend_info
from edgellm.backends.cpu_fast import PackedLinear
from edgellm.gguf_file import open_gguf
from edgellm.quant import dequantize, quantize
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf

# bf16 keeps 8 significant bits: the input is rounded once (2^-9 relative) and the kernel's output
# once more, so a product is within ~2^-8 of sum |x| |w| (plus the bf16 scales of 4-bit groups)
BF16_REL = 2.0**-7


@pytest.mark.parametrize("fmt,kind", [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q4_G64", "int4"),
                                      ("Q4_G128_SYM", "int4"), ("Q8_PC", "int8"), ("Q8_0", "int4x2"),
                                      ("Q6_K", "bf16"), ("F16", "bf16")])
def test_packed_linear_matches_dequantized_product(fmt, kind):
    rng = np.random.default_rng(abs(hash(fmt)) % 2**32)
    n, k = 200, 512  # rows off any tile size
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    raw = quantize(w, fmt)
    wq = dequantize(raw, fmt, (n, k)).astype(np.float64)  # the format's own reading
    p = PackedLinear(raw, fmt, (n, k))
    assert p.kind == kind
    for m in (1, 7):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = p(torch.from_numpy(x)).numpy()
        assert y.shape == (m, n) and y.dtype == np.float32 and np.isfinite(y).all()
        ref = x.astype(np.float64) @ wq.T
        bound = BF16_REL * (np.abs(x) @ np.abs(wq).T) + 1e-6
        assert (np.abs(y - ref) <= bound).all(), float((np.abs(y - ref) / bound).max())


@pytest.fixture(scope="module")
def fast_default(default_model_path):
    return edgellm.load(default_model_path, backend="cpu-fast", ctx=512)


def test_default_model_logits_and_greedy_answer(default_model, fast_default):
    """Tolerance: |logit - reference| <= 4% of the largest reference logit (measured 2.5% on this
    prompt; bf16 activations cost ~1.5%, bf16 group scales the rest), the same top token at >= 95%
    of positions, and the same greedy answer."""
    q = "What is the capital of France?"
    ids = default_model.prompt_tokens(q)
    ref = default_model.logits(ids)
    got = fast_default.logits(ids)
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert np.abs(got - ref).max() <= 0.04 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.95
    a = "".join(default_model.generate(q, max_tokens=24, temperature=0))
    b = "".join(fast_default.generate(q, max_tokens=24, temperature=0))
    assert a == b and "Paris" in b


def test_rope_tables_match_libm_and_another_process():
    """RopeTables against Python's math.cos/sin on float64 angles (an independent libm), to one
    float32 rounding at positions across the whole table (both halves: the table once came out
    different in ~6% of its first half's values in some processes), scaled positions and a
    long-RoPE factor included; and the same bytes when a second process builds it."""
    import hashlib
    import math
    import subprocess
    import sys

    from edgellm.backends.cpu_fast import RopeTables

    a = {"theta": 100000.0, "head_dim": 64, "rope_dim": 48, "pos_scale": 0.5, "mscale": 1.25}
    cos, sin = RopeTables(4096)._table(None, a)
    assert cos.shape == sin.shape == (4096, 24)
    for p in (1, 7, 1000, 2047, 2048, 4095):
        for i in (0, 5, 23):
            ang = p * 0.5 * 100000.0 ** (-2 * i / 48)
            for got, want in ((cos[p, i], 1.25 * math.cos(ang)), (sin[p, i], 1.25 * math.sin(ang))):
                assert abs(float(got) - want) <= np.spacing(np.float32(abs(want))) + 1e-12, (p, i, float(got), want)
    code = ("import hashlib; from edgellm.backends.cpu_fast import RopeTables; "
            f"c, s = RopeTables(4096)._table(None, {a!r}); "
            "print(hashlib.md5(c.numpy().tobytes() + s.numpy().tobytes()).hexdigest())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == hashlib.md5(cos.numpy().tobytes() + sin.numpy().tobytes()).hexdigest()


def test_default_model_holds_packed_weights(default_model_path, fast_default):
    """What `edgellm plan` predicts the backend holds is what it holds; far below float32."""
    f = open_gguf(default_model_path)
    held = fast_default.backend.weights.nbytes
    assert held == pytest.approx(get_backend_info("cpu-fast").resident_weight_bytes(f), rel=0.01)
    assert held < 0.3 * get_backend_info("cpu").resident_weight_bytes(f)
    kinds = {p.kind for p in fast_default.backend.weights._packs.values()}
    assert kinds == {"int4", "int4x2"}  # Q4_1 projections; the Q8_0 tied output as two nibble planes


@pytest.mark.parametrize("spec", [
    SyntheticSpec(arch="qwen2", weight_type="Q4_0", embed_type="Q8_0", tied=False, output_type="Q8_0", seed=3),
    SyntheticSpec(arch="llama", weight_type="Q4_1", rope_freqs=True, n_layers=3, seed=4,
                  type_overrides={"blk.1.attn_k.weight": "Q8_0"}),  # mixed formats inside one fused q|k|v
], ids=["qwen2-bias-untied", "llama-mixed-qkv"])
def test_synthetic_models_match_reference_prefill_and_decode(tmp_path, spec):
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(spec.seed).integers(0, spec.vocab_size, 13).tolist()
    ref = edgellm.load(path, backend="cpu", ctx=32).logits(ids)
    m = edgellm.load(path, backend="cpu-fast", ctx=32, prefill_chunk=8)  # two prefill chunks
    got = m.logits(ids)
    scale = np.abs(ref).max()
    # 3%: the second chunk (5 rows) and the decode steps run the native kernels, whose int8 input
    # blocks (llama.cpp's scheme) move each input by up to 1/254 of its block's largest value:
    # up to 2.6% of the largest logit on these 64-wide models (torch's bf16 packs: under 2%)
    assert np.abs(got - ref).max() <= 0.03 * scale
    # decode, one token at a time, through the in-place cache
    steps = [m.forward(ids[:6], 0, all_logits=False)[-1]]
    steps += [m.forward([ids[i]], i, all_logits=False)[-1] for i in range(6, len(ids))]
    assert np.abs(np.stack(steps) - ref[5:]).max() <= 0.03 * scale


def test_auto_without_gpu_is_cpu_fast():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: auto is cuda")
    from edgellm.backends.cpu_fast import CpuFastBackend

    assert get_backend("auto") is CpuFastBackend
    assert get_backend_info("auto").name == "cpu-fast"


def test_k_quant_file_decodes_natively_and_its_converted_rows_come_back_from_the_cache(tmp_path, monkeypatch):
    """A Q4_K_M file: its K-quant matrices are packed from their plain block forms (Q4_K as Q4_1 int4
    packs, Q6_K as Q8_0), never as bf16, and the decode step is one native call; a second load
    maps the packs and the converted rows back from the program cache and gives the same logits."""
    from edgellm.synthetic import quant_mix

    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path / "cache"))
    spec = quant_mix(SyntheticSpec(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=512, tied=False,
                                   seed=13), "Q4_K_M")
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = [3, 17, 5, 9, 30, 2, 11]
    logits = []
    for load in range(2):
        m = edgellm.load(path, backend="cpu-fast", ctx=32)
        packs = m.backend.weights._packs.values()
        assert {p.kind for p in packs} <= {"int4", "int4x2"}, {p.kind for p in packs}
        assert all(p.blocks is not None and p.native is not None for p in packs)
        assert ("weights" in m.cache_hits) == (load == 1)
        m.forward(ids[:4], 0, all_logits=False)
        steps = [m.forward([t], 4 + i, all_logits=False) for i, t in enumerate(ids[4:])]
        prog = next(p for p in m.programs.values() if getattr(p, "max_seq", None) == 1)
        assert prog._step is not None, prog.step_unavailable
        logits.append(np.stack(steps))
    np.testing.assert_array_equal(logits[0], logits[1])
    ref = edgellm.load(path, backend="cpu", ctx=32)
    ref.forward(ids[:4], 0, all_logits=False)
    want = np.stack([ref.forward([t], 4 + i, all_logits=False) for i, t in enumerate(ids[4:])])
    assert np.abs(logits[0] - want).max() <= 0.06 * np.abs(want).max()
