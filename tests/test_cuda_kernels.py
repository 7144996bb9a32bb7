"""The cuda backend's Triton kernels against float64 references written here, independently.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors; this module sets
TRITON_INTERPRET=1 for that before triton is imported. With CUDA the same tests run on the GPU.
Shapes are deliberately not multiples of the block sizes; outputs are poisoned with NaN first so
that an element the kernel never wrote fails; inputs are fresh random values, never zeros.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run this module on its own "
                    "or set TRITON_INTERPRET=1 in the environment", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gg_dequantize  # noqa: E402
from gguf.quants import quantize as gg_quantize  # noqa: E402

from edgellm.backends.cuda import kernels as K  # noqa: E402
from reference import chain_kept as host_chain_kept, draws_fit  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
QFORMATS = ["Q4_0", "Q4_1", "Q8_0"]
ALL_FORMATS = QFORMATS + ["F16"]


def poisoned(shape, dtype=torch.float16):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def check(out: torch.Tensor, ref: np.ndarray, tol: float, what: str = ""):
    """Every element written (finite), relative Frobenius error and worst element under tol."""
    got = out.detach().double().cpu().numpy()
    assert got.shape == ref.shape, f"{what}: shape {got.shape} vs {ref.shape}"
    assert np.isfinite(got).all(), f"{what}: {np.count_nonzero(~np.isfinite(got))} elements not written/finite"
    scale = np.linalg.norm(ref)
    assert scale > 0
    rel = np.linalg.norm(got - ref) / scale
    worst = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert rel < tol and worst < 4 * tol, f"{what}: relative error {rel:.2e}, worst element {worst:.2e} (tol {tol})"


def make_weight(rng, fmt, n_out, n_in):
    """(PackedWeight on DEV, float64 reference matrix from gguf-py's dequantizer; for the six-bit
    layouts Q6 and Q6M, from codes and scales drawn here, see make_q6)."""
    if fmt in ("Q6", "Q6M"):
        return make_q6(rng, n_out, n_in, fmt == "Q6M")
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    if fmt in ("F16", "BF16", "F32"):
        if fmt == "F16":
            raw = w.astype(np.float16)
            ref = raw.astype(np.float64)
        elif fmt == "F32":
            raw = w
            ref = w.astype(np.float16).astype(np.float64)  # repacked to fp16
        else:
            t = torch.from_numpy(w).bfloat16()
            raw = t.view(torch.uint8).reshape(n_out, n_in * 2)
            ref = t.double().numpy()
        return K.repack(raw, fmt, (n_out, n_in), device=DEV), ref
    raw = gg_quantize(w, GGMLQuantizationType[fmt])
    ref = gg_dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float64)
    return K.repack(raw, fmt, (n_out, n_in), device=DEV), ref


def rand(rng, *shape, dtype=torch.float16):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype).to(DEV)


def np64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


GEMV_CFG = dict(BLOCK_N=8, BLOCK_K=64, num_warps=4)  # K=160: two full K-tiles and a partial one
GEMM_CFG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)


# ------------------------------------------------------------------------------------------- repack

@pytest.mark.parametrize("fmt", ALL_FORMATS + ["BF16", "F32"])
def test_repack_layout_matches_gguf(rng, fmt):
    pw, ref = make_weight(rng, fmt, 5, 64)
    assert pw.shape == (5, 64)
    np.testing.assert_allclose(np64(K.dequantize(pw)), ref, rtol=0, atol=1e-6)
    expect = {"F16": 128, "BF16": 128, "F32": 128, "Q8_0": 64 + 4, "Q4_0": 32 + 4, "Q4_1": 32 + 8}[fmt]
    assert pw.nbytes == 5 * expect
    if fmt.startswith("Q4"):
        assert pw.qs.view(torch.int32).shape == (5, 8)  # rows are whole 32-bit words


@pytest.mark.parametrize("fmt", ["Q5_0", "Q4_K"])
def test_repack_converted_formats_match_gguf(rng, fmt, monkeypatch):
    """Q5_0 becomes the Q8_0 layout exactly; Q4_K the Q4_1 layout with its per-32 scale and minimum
    products rounded to fp16. Checked against gguf-py's dequantizer, then through the GEMV."""
    from edgellm.quant import quantize as eq_quantize

    monkeypatch.setenv("EDGELLM_KQUANTS", "converted")  # Q4_K's default is its own layout (Q4K)
    w = rng.standard_normal((6, 512)).astype(np.float32) * rng.uniform(0.01, 3, (6, 1)).astype(np.float32)
    raw = eq_quantize(w, fmt)  # edgellm's quantizer (gguf-py has none for Q4_K); gguf-py reads it back
    ref = gg_dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float64)
    pw = K.repack(raw, fmt, (6, 512), device=DEV)
    assert pw.source_fmt == fmt and pw.fmt == {"Q5_0": "Q8_0", "Q4_K": "Q4_1"}[fmt]
    got = np64(K.dequantize(pw))
    if fmt == "Q5_0":
        np.testing.assert_array_equal(got, ref)
    else:  # fp16 rounding (2^-11 relative) of each sub-block's scale d and minimum m: |dq| <= 15
        err = np.abs(got - ref).reshape(6, 16, 32).max(axis=2)
        bound = 2.0 ** -11 * (15 * np.abs(np64(pw.d)) + np.abs(np64(pw.m))) * 1.001 + 1e-7
        assert (err <= bound).all(), (err / bound).max()
        assert err.max() > 0  # really rounded: this is not the exact path
        assert pw.nbytes == 6 * 512 * 5 // 8  # 5 bits per weight
    x = rand(rng, 1, 512)
    out = poisoned((1, 6))
    K.linear(x, pw, out=out, config=dict(BLOCK_N=2, BLOCK_K=256, num_warps=1))
    check(out, np64(x) @ ref.T, 2e-3, f"{fmt} GEMV")


def test_pack_float_q8_0_matches_gguf(rng):
    w = rng.standard_normal((7, 96)).astype(np.float32)
    w[2, :32] = 0.0  # an all-zero block
    pw = K.pack_float(torch.from_numpy(w).to(DEV), "Q8_0")
    ref = gg_dequantize(gg_quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    np.testing.assert_allclose(np64(K.dequantize(pw)), ref, rtol=0, atol=1e-6)
    assert pw.nbytes == 7 * 3 * 34
    np.testing.assert_array_equal(np64(K.pack_float(torch.from_numpy(w).to(DEV)).qs), w.astype(np.float16))


def test_repack_rejects_bad_input():
    with pytest.raises(K.UnsupportedFormatError, match="Q3_K"):
        K.repack(np.zeros((2, 110), np.uint8), "Q3_K", (2, 256))
    assert isinstance(K.UnsupportedFormatError("x"), NotImplementedError)
    from edgellm.errors import TensorShapeError
    with pytest.raises(TensorShapeError, match="expected uint8"):
        K.repack(np.zeros((2, 17), np.uint8), "Q4_0", (2, 32))
    with pytest.raises(TensorShapeError, match="whole blocks"):
        K.repack(np.zeros((2, 18), np.uint8), "Q4_0", (2, 40))


# ------------------------------------------------------------------------------------------- linear

@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_linear_decode(rng, fmt):
    pw, w = make_weight(rng, fmt, 37, 160)
    x = rand(rng, 2, 160)
    bias = rand(rng, 37, dtype=torch.float32)
    out = poisoned((2, 37))
    K.linear(x, pw, bias=bias, out=out, config=GEMV_CFG)
    check(out, np64(x) @ w.T + np64(bias), 2e-3, f"{fmt} decode")


@pytest.mark.parametrize("fmt", ["Q4_0", "F16"])
def test_linear_decode_default_config_fp32_input(rng, fmt):
    pw, w = make_weight(rng, fmt, 37, 160)
    x = rand(rng, 1, 160, dtype=torch.float32)
    out = poisoned((1, 37), torch.float32)
    K.linear(x, pw, out=out)
    check(out, np64(x) @ w.T, 1e-4, f"{fmt} decode fp32")


def _q8_act_ref(x: np.ndarray) -> np.ndarray:
    """x as llama.cpp's int8-per-32-block quantization leaves it (round half away from zero)."""
    b = x.reshape(x.shape[0], -1, 32)
    d = np.abs(b).max(axis=2, keepdims=True) / 127.0
    q = np.sign(b) * np.floor(np.abs(b) / np.where(d > 0, d, 1) + 0.5)
    return (q * d).reshape(x.shape)


@pytest.mark.parametrize("fmt", QFORMATS)
def test_linear_decode_int8_activations(rng, fmt):
    pw, w = make_weight(rng, fmt, 37, 160)
    x = rand(rng, 2, 160)
    out = poisoned((2, 37))
    K.linear(x, pw, out=out, act_int8=True, config=GEMV_CFG)
    check(out, _q8_act_ref(np64(x)) @ w.T, 2e-3, f"{fmt} int8 decode")


@pytest.mark.skipif(not CUDA, reason="every tuner candidate compiles its own kernel: GPU only (minutes in the interpreter)")
@pytest.mark.parametrize("fmt,int8", [(f, False) for f in ALL_FORMATS + ["Q6", "Q6M"]]
                         + [(f, True) for f in QFORMATS + ["Q6", "Q6M"]])
def test_linear_decode_every_tune_candidate(rng, fmt, int8):
    """The backend's tuner may launch any of configs.gemv_tune_candidates: each must give the same
    answer on a matrix no tile divides (rows 2 * 3 * 37, 130 blocks of 32 columns), with a bias,
    as a fused gate/up and with the RoPE epilogue."""
    from edgellm.backends.cuda.kernels import configs
    n_out, n_in, T = 222, 4160, 2
    pw, w = make_weight(rng, fmt, n_out, n_in)
    x = rand(rng, T, n_in)
    bias = rand(rng, n_out, dtype=torch.float32)
    xr = _q8_act_ref(np64(x)) if int8 else np64(x)
    ref = xr @ w.T
    H, HKV, D = 5, 1, 32  # (5 + 2) * 32 = 224 rows for the rope case
    pq, wq = make_weight(rng, fmt, (H + 2 * HKV) * D, n_in)
    qkv = xr @ wq.T
    pos = np.arange(7, 7 + T, dtype=np.float64)
    q_ref = _rope_ref(qkv[:, :H * D].reshape(T, H, D), pos, D, 1e4, False, None).reshape(T, -1)
    bad = []
    for cfg in configs.gemv_tune_candidates(fmt, int8) + configs.gemv_tune_candidates(fmt, int8, glu=True):
        try:
            out = poisoned((T, n_out))
            K.linear(x, pw, bias=bias, out=out, act_int8=int8, config=cfg)
            check(out, ref + np64(bias), 3e-3, "linear")
            g = poisoned((T, n_out // 2))
            K.linear_silu_mul(x, pw, out=g, act_int8=int8, config=cfg)
            check(g, _silu(ref[:, :n_out // 2]) * ref[:, n_out // 2:], 4e-3, "gate/up")
            kc, vc = poisoned((16, HKV * D)), poisoned((16, HKV * D))
            q = K.linear(x, pq, act_int8=int8, config=cfg,
                         rope=K.RopeStore(kc, vc, 7, H, HKV, D, theta=1e4, q_out=poisoned((T, H * D))))
            check(q, q_ref, 3e-3, "rope q")
            check(vc[7:7 + T], qkv[:, (H + HKV) * D:], 3e-3, "rope v")
        except AssertionError as e:
            bad.append(f"{cfg}: {str(e).splitlines()[0]}")
    assert not bad, f"{len(bad)} tune candidates give wrong results for {fmt} (int8={int8}):\n" + "\n".join(bad)


def test_quantize_activations(rng):
    x = rand(rng, 3, 96)
    qa = K.quantize_activations(x)
    xr = np64(x).reshape(3, 3, 32)
    d = np.abs(xr).max(axis=2) / 127
    np.testing.assert_allclose(np64(qa.xd), d, rtol=1e-6)
    q = qa.xq.cpu().numpy().reshape(3, 3, 32).astype(np.float64)
    np.testing.assert_allclose(q, np.sign(xr) * np.floor(np.abs(xr) / d[..., None] + 0.5), atol=0)
    np.testing.assert_allclose(np64(qa.xs), d * q.sum(axis=2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_linear_prefill(rng, fmt):
    pw, w = make_weight(rng, fmt, 37, 160)
    x = rand(rng, 19, 160)
    bias = rand(rng, 37)
    out = poisoned((19, 37))
    K.linear(x, pw, bias=bias, out=out, config=GEMM_CFG)
    check(out, np64(x) @ w.T + np64(bias), 2e-3, f"{fmt} prefill")


@pytest.mark.parametrize("fmt", ALL_FORMATS + ["Q6", "Q6M"])
@pytest.mark.parametrize("tile", ["GEMM_DEFAULT_LARGE_M", "GEMM_DEFAULT_HUGE_M", "GEMM_WIDE_WEIGHT_B", "weight-B 128x64",
                                  "weight-B split"])
def test_linear_prefill_large_m_tiles(rng, fmt, tile):
    """The tiles configs.gemm_default gives long prompts (128 and 256 tokens x 64 weight rows, and
    the weight as the MMA's right operand in 128 x 128 and 128 x 64 tiles, K split in two): a token
    count, rows and columns none of them divides, every output element written."""
    from edgellm.backends.cuda.kernels import configs
    cfg = {"weight-B 128x64": dict(configs.GEMM_DEFAULT_LARGE_M, WEIGHT_B=True),
           "weight-B split": dict(configs.GEMM_WIDE_WEIGHT_B, SPLIT_K=2)}.get(tile) or getattr(configs, tile)
    pw, w = make_weight(rng, fmt, 70, 160)
    M = cfg["BLOCK_M"] + 3
    x = rand(rng, M, 160)
    out = poisoned((M, 70))
    K.linear(x, pw, out=out, config=cfg)
    check(out, np64(x) @ w.T, 2e-3, f"{fmt} prefill {tile}")


def test_linear_prefill_default_config(rng):
    pw, w = make_weight(rng, "Q4_0", 37, 160)
    x = rand(rng, 9, 160)
    out = poisoned((9, 37))
    K.linear(x, pw, out=out)
    check(out, np64(x) @ w.T, 2e-3, "Q4_0 prefill default config")


def _silu(v):
    return v / (1 + np.exp(-v))


def check_silu_mul_decode(x, wg, g, wu, u, fused, int8, cfg, what):
    """linear_silu_mul on gate and up weights (stacked with fused, else apart) against
    silu(x g^T) * (x u^T) in float64, x as the int8 path quantizes it where int8."""
    out = poisoned((x.shape[0], g.shape[0]))
    if fused:
        K.linear_silu_mul(x, K.concat_packed([wg, wu]), out=out, act_int8=int8, config=cfg)
    else:
        K.linear_silu_mul(x, wg, wu, out=out, act_int8=int8, config=cfg)
    xr = _q8_act_ref(np64(x)) if int8 else np64(x)
    check(out, _silu(xr @ g.T) * (xr @ u.T), 3e-3, f"{what} gate/up decode")


@pytest.mark.parametrize("fmt,fused,int8", [("Q4_0", False, False), ("Q8_0", True, False),
                                            ("F16", False, False), ("Q4_1", True, True)])
def test_linear_silu_mul_decode(rng, fmt, fused, int8):
    wg, g = make_weight(rng, fmt, 21, 96)
    wu, u = make_weight(rng, fmt, 21, 96)
    x = rand(rng, 1, 96)
    check_silu_mul_decode(x, wg, g, wu, u, fused, int8, GEMV_CFG, fmt)


def test_linear_silu_mul_prefill(rng):
    wg, g = make_weight(rng, "Q4_0", 21, 96)
    wu, u = make_weight(rng, "Q4_0", 21, 96)
    x = rand(rng, 11, 96)
    out = poisoned((11, 21))
    K.linear_silu_mul(x, K.concat_packed([wg, wu]), out=out, config=GEMM_CFG)
    check(out, _silu(np64(x) @ g.T) * (np64(x) @ u.T), 3e-3, "gate/up prefill")


# ---------------------------------------------------------------------------------------- elementwise

def test_silu_mul(rng):
    gu = rand(rng, 3, 2 * 37)
    out = poisoned((3, 37))
    K.silu_mul(gu, out=out, config=dict(BLOCK=16, num_warps=1))
    r = np64(gu)
    check(out, _silu(r[:, :37]) * r[:, 37:], 2e-3, "silu_mul fused")
    g, u = rand(rng, 3, 37), rand(rng, 3, 37)
    out2 = K.silu_mul(g, u, out=poisoned((3, 37)))
    check(out2, _silu(np64(g)) * np64(u), 2e-3, "silu_mul separate")


def test_add_into(rng):
    """y += r in fp32, rounded once; strided rows (a column slice) included."""
    wide = rand(rng, 3, 80)
    y, r = wide[:, 5:42], rand(rng, 3, 37)
    before = np64(wide)
    K.add_into(y, r, config=dict(BLOCK=16, num_warps=1))
    check(y, before[:, 5:42] + np64(r), 1e-3, "add_into")
    outside = np.r_[0:5, 42:80]
    assert np.array_equal(np64(wide)[:, outside], before[:, outside]), "add_into wrote outside y"
    with pytest.raises(ValueError, match="differ"):
        K.add_into(rand(rng, 3, 37), rand(rng, 2, 37))


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_take_rows(rng, idx_dtype):
    """out[i] = x[index[i]] for an index on the device, in any order and with repeats; out may be
    of another float type (the prefill's last real row into a float32 buffer)."""
    x = rand(rng, 9, 37)
    idx = torch.tensor([8, 0, 3, 3], dtype=idx_dtype, device=DEV)
    out = poisoned((4, 37), torch.float32)
    K.take_rows(x, idx, out=out, config=dict(BLOCK=16, num_warps=1))
    check(out, np64(x)[[8, 0, 3, 3]], 1e-6, "take_rows")
    with pytest.raises(ValueError, match="1-D int32/int64"):
        K.take_rows(x, idx.float())


@pytest.mark.parametrize("with_res", [False, True])
def test_rms_norm(rng, with_res):
    x, w = rand(rng, 3, 100), rand(rng, 100, dtype=torch.float32)
    res = rand(rng, 3, 100) if with_res else None
    out, rout = poisoned((3, 100)), (poisoned((3, 100)) if with_res else None)
    K.rms_norm(x, w, 1e-5, residual=res, out=out, residual_out=rout)
    h = np64(x) + (np64(res) if with_res else 0)
    ref = h / np.sqrt((h * h).mean(axis=1, keepdims=True) + 1e-5) * np64(w)
    check(out, ref, 2e-3, "rms_norm")
    if with_res:
        check(rout, h, 1e-3, "residual sum")


@pytest.mark.parametrize("D", [96, 128])
def test_rms_norm_writes_int8_activations(rng, D):
    """rms_norm(..., xq=) equals quantize_activations of its own output, bit for bit."""
    x, res, w = rand(rng, 3, D), rand(rng, 3, D), rand(rng, D, dtype=torch.float32)
    xq = K.QuantizedActivations(torch.full((3, D), 99, dtype=torch.int8, device=DEV),
                                poisoned((3, D // 32), torch.float32), poisoned((3, D // 32), torch.float32))
    out = K.rms_norm(x, w, 1e-5, residual=res, out=poisoned((3, D)), xq=xq)
    ref = K.quantize_activations(out)
    assert torch.equal(xq.xq, ref.xq) and torch.equal(xq.xd, ref.xd) and torch.equal(xq.xs, ref.xs)
    assert (xq.xq.abs() <= 127).all() and xq.xq.abs().max() == 127
    with pytest.raises(ValueError, match="expected"):
        K.rms_norm(rand(rng, 3, 80), rand(rng, 80, dtype=torch.float32), 1e-5,
                   xq=K.quantize_activations(rand(rng, 3, 96)))


@pytest.mark.parametrize("D,quant", [(2048, True), (3072, False)])
def test_rms_norm_split_rows(rng, D, quant):
    """Wide rows are normalised by several programs (NORM_SLICE columns each): the same results as
    one program per row, every element written, int8 copy bit for bit quantize_activations'; an
    in-place residual update falls back to one program and stays right."""
    from edgellm.backends.cuda.kernels import norm as N
    assert D >= N.NORM_SPLIT_MIN_D
    x, res, w = rand(rng, 2, D), rand(rng, 2, D), rand(rng, D, dtype=torch.float32)
    h = np64(x) + np64(res)
    ref = _norm_ref(h, np64(w), 1e-5)
    xq = K.QuantizedActivations(torch.full((2, D), 99, dtype=torch.int8, device=DEV),
                                poisoned((2, D // 32), torch.float32), poisoned((2, D // 32), torch.float32)) \
        if quant else None
    rout = poisoned((2, D))
    out = K.rms_norm(x, w, 1e-5, residual=res, out=poisoned((2, D)), residual_out=rout, xq=xq)
    check(out, ref, 2e-3, "split rms_norm")
    check(rout, h, 1e-3, "split residual sum")
    if quant:
        qref = K.quantize_activations(out)
        assert torch.equal(xq.xq, qref.xq) and torch.equal(xq.xd, qref.xd) and torch.equal(xq.xs, qref.xs)
    check(K.rms_norm(x, w, 1e-5, out=poisoned((2, D))), _norm_ref(np64(x), np64(w), 1e-5), 2e-3, "split, no residual")
    out2 = poisoned((2, D))
    K.rms_norm(x, w, 1e-5, residual=res, out=out2, residual_out=res)  # in place: one program per row
    check(res, h, 1e-3, "in-place residual")
    check(out2, ref, 2e-3, "in-place rms_norm")


@pytest.mark.parametrize("T,D", [(2, 2048), (3, 100)])
def test_rms_norm_sums_the_peers_partials(rng, T, D):
    """The all_reduce fused into the residual add + RMSNorm (Peers): rank 1 of 3, the other ranks'
    flags already in its signal pad as if they had arrived, sums the three ranks' partials read
    through the address table, adds the residual and normalises; afterwards its own pad is zeroed
    (ready for the next step) and each peer's pad holds rank 1's flag in the slot of every program
    it launched, nothing else."""
    from edgellm.backends.cuda.kernels.norm import Peers, norm_programs

    world, rank, slots = 3, 1, 32
    parts = [rand(rng, T, D, dtype=torch.float32) for _ in range(world)]
    res, w = rand(rng, T, D, dtype=torch.float32), rand(rng, D, dtype=torch.float32)
    pads = [torch.zeros(slots * world, dtype=torch.int32, device=DEV) for _ in range(world)]
    used = norm_programs(T, D)
    for s in range(used):
        for r in range(world):
            if r != rank:
                pads[rank][s * world + r] = 1
    table = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=DEV)
    addrs = torch.tensor([p.data_ptr() for p in parts], dtype=torch.int64, device=DEV)
    peers = Peers(addrs, table.data_ptr(), rank, world, slots)
    out, rout = poisoned((T, D)), poisoned((T, D), torch.float32)
    K.rms_norm(parts[rank], w, 1e-5, residual=res, out=out, residual_out=rout, peers=peers)
    h = sum(np64(p) for p in parts) + np64(res)
    check(rout, h, 1e-6, "summed partials + residual")
    check(out, _norm_ref(h, np64(w), 1e-5), 2e-3, "rms_norm of the sum")
    assert not pads[rank].any(), "the arrived flags were not all taken"
    for r in range(world):
        if r != rank:
            want = torch.zeros(slots * world, dtype=torch.int32)
            want[torch.arange(used) * world + rank] = 1
            assert torch.equal(pads[r].cpu(), want), f"rank {r}'s pad"
    with pytest.raises(ValueError, match="signal pads hold 1"):
        K.rms_norm(parts[rank], w, 1e-5, residual=res, out=out, residual_out=rout,
                   peers=Peers(addrs, table.data_ptr(), rank, world, 1))


def test_rms_norm_in_place_residual(rng):
    x, w, res = rand(rng, 2, 64), rand(rng, 64), rand(rng, 2, 64)
    h = np64(x) + np64(res)
    out = poisoned((2, 64))
    K.rms_norm(x, w, 1e-6, residual=res, out=out, residual_out=res)
    check(res, h, 1e-3, "residual in place")
    check(out, h / np.sqrt((h * h).mean(axis=1, keepdims=True) + 1e-6) * np64(w), 2e-3, "rms_norm in place")


def _norm_ref(s: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return s / np.sqrt((s * s).mean(axis=1, keepdims=True) + eps) * w


@pytest.mark.parametrize("fmt,int8,T,in_place,chunk", [("Q4_0", False, 1, True, None), ("F16", False, 2, False, None),
                                                       ("Q8_0", True, 3, True, None), ("Q4_1", True, 1, True, 64)])
def test_linear_norm_tail(rng, fmt, int8, T, in_place, chunk, monkeypatch):
    """The GEMV's norm tail gives add_rms_norm of its product: the residual sum as stored, the norm of
    it and its int8 copy (bit for bit what quantize_activations makes of the norm written); the
    counter is back at zero, so a second launch with other inputs is right too. N = 224 rows: no
    tile divides it; chunk 64 makes the last program normalise in several steps."""
    from edgellm.backends.cuda.kernels import norm as norm_mod
    if chunk:
        monkeypatch.setattr(norm_mod, "NORM_TAIL_CHUNK", chunk)
    N, Kin = 224, 160
    pw, w = make_weight(rng, fmt, N, Kin)
    nw = torch.from_numpy(rng.uniform(0.5, 1.5, N).astype(np.float32)).to(DEV)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    for _ in range(2):
        x, res = rand(rng, T, Kin), rand(rng, T, N)
        res_before = np64(res)
        xq = K.QuantizedActivations(torch.full((T, N), 99, dtype=torch.int8, device=DEV),
                                    poisoned((T, N // 32), torch.float32), poisoned((T, N // 32), torch.float32))
        sum_out = res if in_place else poisoned((T, N))
        nt = K.NormTail(res, sum_out, poisoned((T, N)), nw, 1e-5, counter, xq if int8 else None)
        got = K.linear(x, pw, act_int8=int8, config=GEMV_CFG, norm=nt)
        assert got is nt.out
        y = (_q8_act_ref(np64(x)) if int8 else np64(x)) @ w.T
        s_ref = res_before + y.astype(np.float16).astype(np.float64)
        check(sum_out, s_ref, 1e-3, f"{fmt} residual sum")
        check(nt.out, _norm_ref(np64(sum_out), np64(nw), 1e-5), 2e-3, f"{fmt} norm")
        if int8:
            ref = K.quantize_activations(nt.out)
            assert torch.equal(xq.xq, ref.xq) and torch.equal(xq.xd, ref.xd) and torch.equal(xq.xs, ref.xs)
        assert int(counter.item()) == 0


def test_linear_norm_tail_prefill_and_bad_input(rng):
    """More tokens than a GEMV takes: the product, then the rms_norm kernel (same results)."""
    pw, w = make_weight(rng, "Q8_0", 64, 96)
    x, res, nw = rand(rng, 11, 96), rand(rng, 11, 64), rand(rng, 64, dtype=torch.float32)
    s_ref = np64(res) + (np64(x) @ w.T).astype(np.float16).astype(np.float64)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    nt = K.NormTail(res, poisoned((11, 64)), poisoned((11, 64)), nw, 1e-6, counter)
    K.linear(x, pw, config=GEMM_CFG, norm=nt)
    check(nt.sum_out, s_ref, 2e-3, "prefill residual sum")
    check(nt.out, _norm_ref(s_ref, np64(nw), 1e-6), 3e-3, "prefill norm")
    with pytest.raises(ValueError, match="norm residual has shape"):
        K.linear(x[:1], pw, norm=K.NormTail(res[:, :32], res[:1], res[:1], nw, 1e-6, counter))
    with pytest.raises(ValueError, match="exclude each other"):
        K.linear(x[:1], pw, norm=nt, rope=K.RopeStore(res, res, 0, 1, 1, 2))


# --------------------------------------------------------------------------------------------- rope

def _rope_ref(x: np.ndarray, pos: np.ndarray, n_rot: int, theta: float, neox: bool, ff=None) -> np.ndarray:
    """x [T, heads, D] rotated at positions pos [T] (float64)."""
    half = n_rot // 2
    inv = theta ** (-2.0 * np.arange(half) / n_rot)
    if ff is not None:
        inv = inv / ff
    ang = pos[:, None, None] * inv[None, None, :]
    c, s = np.cos(ang), np.sin(ang)
    y = x.copy()
    i1 = np.arange(half) if neox else 2 * np.arange(half)
    i2 = i1 + half if neox else i1 + 1
    a, b = x[..., i1], x[..., i2]
    y[..., i1] = a * c - b * s
    y[..., i2] = b * c + a * s
    return y


@pytest.mark.parametrize("style,D,H,HKV,fused,ff,n_rot", [
    ("norm", 64, 6, 2, False, True, None),
    ("neox", 32, 3, 3, True, False, None),
    ("neox", 32, 2, 1, False, False, 16),
])
def test_rope_qkv_cache(rng, style, D, H, HKV, fused, ff, n_rot):
    T, ctx, start = 5, 67, 41
    q, k, v = rand(rng, T, H * D), rand(rng, T, HKV * D), rand(rng, T, HKV * D)
    kc, vc = poisoned((ctx, HKV * D)), poisoned((ctx, HKV * D))
    factors = torch.from_numpy(rng.uniform(1, 8, (n_rot or D) // 2).astype(np.float32)).to(DEV) if ff else None
    start_t = torch.tensor([start], dtype=torch.int32, device=DEV)
    if fused:
        qo = K.rope_qkv_cache(torch.cat([q, k, v], 1), None, None, kc, vc, start_t, H, HKV, D,
                              theta=1e4, style=style, freq_factors=factors, n_rot=n_rot)
    else:
        qo = poisoned((T, H * D))
        K.rope_qkv_cache(q, k, v, kc, vc, start, H, HKV, D, theta=5e5, style=style, freq_factors=factors,
                         n_rot=n_rot, q_out=qo)
    theta = 1e4 if fused else 5e5
    pos = np.arange(start, start + T, dtype=np.float64)
    f = np64(factors) if ff else None
    nr = n_rot or D
    check(qo, _rope_ref(np64(q).reshape(T, H, D), pos, nr, theta, style == "neox", f).reshape(T, -1), 2e-3, "q")
    check(kc[start:start + T], _rope_ref(np64(k).reshape(T, HKV, D), pos, nr, theta, style == "neox", f)
          .reshape(T, -1), 2e-3, "k cache")
    check(vc[start:start + T], np64(v), 1e-6, "v cache")
    assert torch.isnan(kc[:start]).all() and torch.isnan(kc[start + T:]).all(), "wrote outside rows start..start+T"
    assert torch.isnan(vc[:start]).all() and torch.isnan(vc[start + T:]).all()


@pytest.mark.parametrize("fmt,int8,ff,n_rot,T,as_tensor", [
    ("Q4_0", False, True, None, 1, True),
    ("Q8_0", True, False, 16, 2, True),
    ("F16", False, False, None, 3, False),
    ("Q4_1", True, True, None, 1, False),
])
def test_linear_rope_epilogue(rng, fmt, int8, ff, n_rot, T, as_tensor):
    """linear(..., rope=RopeStore) in decode (the GEMV's epilogue rotates q|k and writes k, v into the
    caches) against the float64 projection followed by the rope reference."""
    H, HKV, D, K_in, ctx, start = 3, 1, 32, 96, 40, 29
    pw, w = make_weight(rng, fmt, (H + 2 * HKV) * D, K_in)
    x = rand(rng, T, K_in)
    kc, vc = poisoned((ctx, HKV * D)), poisoned((ctx, HKV * D))
    qo = poisoned((T, H * D))
    factors = torch.from_numpy(rng.uniform(1, 8, (n_rot or D) // 2).astype(np.float32)).to(DEV) if ff else None
    pos_arg = torch.tensor([start], dtype=torch.int32, device=DEV) if as_tensor else start
    rope = K.RopeStore(kc, vc, pos_arg, H, HKV, D, theta=1e4, freq_factors=factors, n_rot=n_rot, q_out=qo)
    got = K.linear(x, pw, act_int8=int8, rope=rope, config=dict(BLOCK_N=4, BLOCK_K=64, num_warps=1))
    assert got is qo
    xr = _q8_act_ref(np64(x)) if int8 else np64(x)
    qkv = xr @ w.T
    pos = np.arange(start, start + T, dtype=np.float64)
    f = np64(factors) if ff else None
    nr = n_rot or D
    q_ref = _rope_ref(qkv[:, :H * D].reshape(T, H, D), pos, nr, 1e4, False, f).reshape(T, -1)
    k_ref = _rope_ref(qkv[:, H * D:(H + HKV) * D].reshape(T, HKV, D), pos, nr, 1e4, False, f).reshape(T, -1)
    check(qo, q_ref, 3e-3, f"{fmt} q")
    check(kc[start:start + T], k_ref, 3e-3, f"{fmt} k cache")
    check(vc[start:start + T], qkv[:, (H + HKV) * D:], 3e-3, f"{fmt} v cache")
    assert torch.isnan(kc[:start]).all() and torch.isnan(kc[start + T:]).all(), "wrote outside rows start..start+T"
    assert torch.isnan(vc[:start]).all() and torch.isnan(vc[start + T:]).all()
    # neox pairs cannot be formed inside a GEMV program: the same call falls back to two launches
    kc2, vc2 = poisoned((ctx, HKV * D)), poisoned((ctx, HKV * D))
    q2 = K.linear(x, pw, act_int8=int8, rope=K.RopeStore(kc2, vc2, pos_arg, H, HKV, D, theta=1e4, style="neox",
                                                           freq_factors=factors, n_rot=n_rot))
    q2_ref = _rope_ref(qkv[:, :H * D].reshape(T, H, D), pos, nr, 1e4, True, f).reshape(T, -1)
    check(q2, q2_ref, 3e-3, f"{fmt} neox fallback q")


def test_linear_rope_rejects_bad_input(rng):
    pw, _ = make_weight(rng, "Q8_0", 5 * 32, 64)
    x = rand(rng, 1, 64)
    kc, vc = poisoned((8, 32)), poisoned((8, 32))
    with pytest.raises(ValueError, match="expected \\(n_heads"):
        K.linear(x, pw, rope=K.RopeStore(kc, vc, 0, 4, 1, 32))
    with pytest.raises(ValueError, match="do not fit"):
        K.linear(x, pw, rope=K.RopeStore(kc, vc, 8, 3, 1, 32))


def test_rope_large_positions(rng):
    # positions near 100k: the angle reduction keeps fast sin/cos accurate
    T, H, D = 2, 1, 32
    q, k, v = rand(rng, T, H * D), rand(rng, T, H * D), rand(rng, T, H * D)
    kc, vc = poisoned((100_003, D)), poisoned((100_003, D))
    qo = K.rope_qkv_cache(q, k, v, kc, vc, 100_000, H, H, D, theta=1e4)
    ref = _rope_ref(np64(q).reshape(T, H, D), np.arange(100_000, 100_002.0), D, 1e4, False).reshape(T, -1)
    check(qo, ref, 3e-3, "q at large positions")


# ---------------------------------------------------------------------------------------- attention

def _attn_ref(q, kc, vc, positions, H, HKV, D, scale, window=0):
    """q [T, H*D] at `positions`, caches [ctx, HKV*D]: causal softmax attention in float64."""
    T = q.shape[0]
    G = H // HKV
    out = np.zeros((T, H, D))
    qr = q.reshape(T, H, D)
    for t in range(T):
        p = positions[t]
        lo = max(0, p - window + 1) if window else 0
        for h in range(H):
            kv = h // G
            k = kc[lo:p + 1, kv * D:(kv + 1) * D]
            v = vc[lo:p + 1, kv * D:(kv + 1) * D]
            s = k @ qr[t, h] * scale
            e = np.exp(s - s.max())
            out[t, h] = (e / e.sum()) @ v
    return out.reshape(T, H * D)


@pytest.mark.parametrize("T,H,HKV,D,seq,as_tensor,splits", [
    (1, 4, 4, 64, 67, True, None),   # GQA ratio 1, default splits
    (1, 6, 2, 32, 67, False, 3),     # ratio 3, chunk boundaries inside the context
    (2, 6, 2, 64, 40, True, 4),      # two tokens, causal between them; last split empty
])
def test_attention_decode(rng, T, H, HKV, D, seq, as_tensor, splits):
    ctx = 80
    q = rand(rng, T, H * D)
    kc, vc = poisoned((ctx, HKV * D)), poisoned((ctx, HKV * D))
    kc[:seq], vc[:seq] = rand(rng, seq, HKV * D), rand(rng, seq, HKV * D)  # rows >= seq stay NaN
    out = poisoned((T, H * D))
    sl = torch.tensor([seq], dtype=torch.int32, device=DEV) if as_tensor else seq
    cfg = dict(BLOCK_N=16, num_warps=4, num_stages=1, n_splits=splits)
    K.attention_decode(q, kc, vc, sl, H, HKV, 1 / math.sqrt(D), out=out, config=cfg)
    ref = _attn_ref(np64(q), np64(kc), np64(vc), list(range(seq - T, seq)), H, HKV, D, 1 / math.sqrt(D))
    check(out, ref, 3e-3, "attention decode")


def test_attention_decode_window(rng):
    T, H, HKV, D, seq = 1, 3, 1, 32, 50
    q = rand(rng, T, H * D)
    kc, vc = rand(rng, 64, HKV * D), rand(rng, 64, HKV * D)
    kc[:20] = float("nan")  # rows outside the window must not be read
    vc[:20] = float("nan")
    out = poisoned((T, H * D))
    K.attention_decode(q, kc, vc, seq, H, HKV, 0.3, out=out, window=16,
                       config=dict(BLOCK_N=16, num_warps=4, num_stages=1, n_splits=4))
    check(out, _attn_ref(np64(q), np64(kc), np64(vc), [seq - 1], H, HKV, D, 0.3, window=16), 3e-3, "window")


@pytest.mark.parametrize("T,H,HKV,D,start,as_tensor", [
    (5, 3, 1, 64, 0, False),     # GQA ratio 3, fresh prompt
    (7, 2, 2, 32, 13, True),     # ratio 1, continuing after 13 cached tokens
])
def test_attention_prefill(rng, T, H, HKV, D, start, as_tensor):
    ctx = 67
    q = rand(rng, T, H * D)
    kc, vc = poisoned((ctx, HKV * D)), poisoned((ctx, HKV * D))
    kc[:start + T], vc[:start + T] = rand(rng, start + T, HKV * D), rand(rng, start + T, HKV * D)
    out = poisoned((T, H * D))
    sp = torch.tensor([start], dtype=torch.int64, device=DEV) if as_tensor else start
    K.attention_prefill(q, kc, vc, sp, H, HKV, 1 / math.sqrt(D), out=out,
                        config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))
    ref = _attn_ref(np64(q), np64(kc), np64(vc), list(range(start, start + T)), H, HKV, D, 1 / math.sqrt(D))
    check(out, ref, 3e-3, "attention prefill")


def test_attention_prefill_default_config_window(rng):
    T, H, HKV, D, start = 6, 4, 2, 64, 3
    q = rand(rng, T, H * D)
    kc, vc = rand(rng, 16, HKV * D), rand(rng, 16, HKV * D)
    out = poisoned((T, H * D))
    K.attention_prefill(q, kc, vc, start, H, HKV, out=out, window=4)
    ref = _attn_ref(np64(q), np64(kc), np64(vc), list(range(start, start + T)), H, HKV, D, 1 / math.sqrt(D), 4)
    check(out, ref, 3e-3, "attention prefill window")


def _poisoned_xq(T, W):
    return K.QuantizedActivations(torch.full((T, W), 99, dtype=torch.int8, device=DEV),
                                  poisoned((T, W // 32), torch.float32), poisoned((T, W // 32), torch.float32))


@pytest.mark.parametrize("path,T,H,HKV,D", [("prefill", 3, 4, 2, 64), ("single", 1, 6, 2, 32),
                                            ("split", 2, 4, 1, 64)])
def test_attention_writes_int8_activations(rng, path, T, H, HKV, D):
    """attention(..., xq=) writes the output's int8 copy bit for bit as quantize_activations of
    the output it stored (the output projection's int8 GEMV then needs no quantize launch)."""
    seq = 40
    q = rand(rng, T, H * D)
    kc, vc = rand(rng, 48, HKV * D), rand(rng, 48, HKV * D)
    out, xq = poisoned((T, H * D)), _poisoned_xq(T, H * D)
    if path == "split":
        K.attention_decode(q, kc, vc, seq, H, HKV, out=out, xq=xq,
                           config=dict(BLOCK_N=16, num_warps=4, num_stages=1, n_splits=3))
        ref = _attn_ref(np64(q), np64(kc), np64(vc), list(range(seq - T, seq)), H, HKV, D, 1 / math.sqrt(D))
    else:
        start = seq - T
        K.attention_prefill(q, kc, vc, start, H, HKV, out=out, xq=xq,
                            config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))
        ref = _attn_ref(np64(q), np64(kc), np64(vc), list(range(start, seq)), H, HKV, D, 1 / math.sqrt(D))
    check(out, ref, 3e-3, f"attention {path}")
    want = K.quantize_activations(out)
    assert torch.equal(xq.xq, want.xq) and torch.equal(xq.xd, want.xd) and torch.equal(xq.xs, want.xs)
    with pytest.raises(ValueError, match="multiple of 32"):
        K.attention_prefill(rand(rng, 1, 2 * 16), rand(rng, 4, 16), rand(rng, 4, 16), 0, 2, 1, xq=_poisoned_xq(1, 32))


# ------------------------------------------------------------------------------------------ embedding

@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_embedding(rng, fmt):
    table, ref = make_weight(rng, fmt, 50, 96)
    ids = torch.tensor([3, 49, 0, 3, 17], dtype=torch.int32, device=DEV)
    out = poisoned((5, 96))
    K.embedding(ids, table, out=out, config=dict(BLOCK_D=64, num_warps=2))
    check(out, ref[ids.cpu().numpy()], 1e-3, f"{fmt} embedding")


# ------------------------------------------------------------------------------------------- sampling

def test_argmax(rng):
    logits = rand(rng, 3, 1000, dtype=torch.float32)
    logits[1, 999] = 50.0  # maximum in the last, partial block
    logits[2, 5] = logits[2, 700] = 60.0  # a tie: the first index wins, as torch.argmax
    out = torch.full((3,), -1, dtype=torch.int64, device=DEV)
    K.argmax(logits, out=out, config=dict(BLOCK=256, num_warps=4))
    assert out.tolist() == torch.argmax(logits.cpu(), dim=1).tolist()
    assert out.tolist()[1:] == [999, 5]
    assert K.argmax(logits.half()).tolist() == torch.argmax(logits.half().cpu().float(), dim=1).tolist()


def test_argmax_step_updates_decode_inputs(rng):
    """argmax(..., step=) also stores the token and advances position and cache length (the greedy
    loop's next inputs), in the kernel."""
    logits = rand(rng, 1, 777, dtype=torch.float32)
    tokens = torch.full((4,), -5, dtype=torch.int32, device=DEV)
    start = torch.tensor([41], dtype=torch.int32, device=DEV)
    seq = torch.tensor([42], dtype=torch.int32, device=DEV)
    out = torch.full((1,), -1, dtype=torch.int64, device=DEV)
    K.argmax(logits, out=out, step=(tokens[:1], start, seq), config=dict(BLOCK=128, num_warps=4))
    best = int(torch.argmax(logits.cpu()))
    assert out.tolist() == [best] and tokens.tolist() == [best, -5, -5, -5]
    assert start.tolist() == [42] and seq.tolist() == [43]
    with pytest.raises(ValueError, match="one row"):
        K.argmax(rand(rng, 2, 10, dtype=torch.float32), step=(tokens[:1], start, seq))


SAMPLING_ROWS = [(40, 0.95, 0.05), (0, 0.9, 0.0), (0, 1.0, 0.1), (0, 1.0, 0.0), (5, 1.0, 0.0), (100, 0.5, 0.02),
                 (1, 1.0, 0.0), (0, 0.3, 0.0)]


@pytest.mark.parametrize("full_sort_from", [None, 8])
def test_sampling_cuts_keep_the_chains_candidates(rng, full_sort_from, monkeypatch):
    """The cut of each row keeps exactly the tokens that top-k -> top-p -> min-p keep (reference:
    a full stable ranking in float64), with each row's own parameters, by a top-k, a sort, or the
    16-way rounds on the logits' keys."""
    from edgellm.backends.cuda.kernels import sampling

    if full_sort_from is not None:  # and every row by the rounds (_cuts_by_rounds) instead of a sort
        monkeypatch.setattr(sampling, "FULL_SORT_FROM", full_sort_from)
        monkeypatch.setattr(sampling, "ROUNDS_ROWS", 1 << 20)
    V = 3001
    logits = rand(rng, len(SAMPLING_ROWS), V, dtype=torch.float32) * 3.0
    top_k = torch.tensor([r[0] for r in SAMPLING_ROWS], device=DEV)
    top_p = torch.tensor([r[1] for r in SAMPLING_ROWS], dtype=torch.float32, device=DEV)
    min_p = torch.tensor([r[2] for r in SAMPLING_ROWS], dtype=torch.float32, device=DEV)
    need = K.ranked_need([r[0] for r in SAMPLING_ROWS], [r[1] for r in SAMPLING_ROWS], V)
    assert need == V  # rows with top-p and no top-k need the whole ranking
    out = torch.full((len(SAMPLING_ROWS),), float("nan"), device=DEV)
    cut = K.cuts(logits, top_k, top_p, min_p, need, out=out).cpu()
    x = logits.cpu().numpy()
    for i, (k, p, mp) in enumerate(SAMPLING_ROWS):
        kept = set(np.flatnonzero(x[i] >= cut[i].item()).tolist())
        assert kept == host_chain_kept(x[i].astype(np.float64), k, p, mp), (i, k, p, mp, len(kept))
    # rows that cut by top-k alone need only the top-k prefix
    rows = [(40, 1.0, 0.0), (7, 0.8, 0.05)]
    assert K.ranked_need([r[0] for r in rows], [r[1] for r in rows], V) == 40
    cut = K.cuts(logits[:2], torch.tensor([40, 7], device=DEV), torch.tensor([1.0, 0.8], device=DEV),
                 torch.tensor([0.0, 0.05], device=DEV), 40).cpu()
    for i, (k, p, mp) in enumerate(rows):
        assert set(np.flatnonzero(x[i] >= cut[i].item()).tolist()) == host_chain_kept(x[i].astype(np.float64), k, p, mp)


# the interpreter runs the bitonic passes slowly: a GPU takes every case, CI the smaller ones
@pytest.mark.parametrize("V,need,rows", [(3001, 40, 2), (64, 40, 1), (4096, 1, 2), (130, 100, 1)] +
                         ([(9000, 5, 1), (9000, 256, 2), (131072 + 77, 40, 3)] if CUDA else []))
def test_ranked_prefix_is_the_rows_top_k(rng, V, need, rows):
    """ranked_prefix's two passes give each row's `need` largest logits, best first, as torch.topk
    (rows spanning one chunk, several, and a chunk not filled; fp16 logits with ties)."""
    from edgellm.backends.cuda.kernels.sampling import ranked_prefix

    for dtype in (torch.float32, torch.float16):
        logits = rand(rng, rows, V, dtype=dtype) * 3.0
        got = ranked_prefix(logits, need)
        assert got.shape[0] == rows and got.shape[1] >= need and torch.isfinite(got[:, :need]).all()
        want = torch.topk(logits.float().cpu(), need, dim=1).values
        assert torch.equal(got[:, :need].cpu(), want), (dtype, (got[:, :need].cpu() - want).abs().max())


def test_sample_draws_the_tempered_distribution(rng):
    """Draws over many positions follow softmax(x / T) over the kept tokens (an exact float64
    reference), never leave them; a temperature-0 row is the argmax; a seed and position give the
    same token again and another seed other tokens."""
    V, N, temp = 37, (4000 if CUDA else 700), 0.7  # the interpreter runs a program at a time
    row = rand(rng, 1, V, dtype=torch.float32) * 2.0
    logits = row.repeat(N + 1, 1)
    cut_value = float(torch.sort(row[0], descending=True).values[9])  # the ten best tokens
    temperature = torch.full((N + 1,), temp, device=DEV)
    temperature[N] = 0.0
    cut = torch.full((N + 1,), cut_value, device=DEV)
    seed = torch.full((N + 1,), int(rng.integers(1, 2**62)), dtype=torch.int64, device=DEV)
    pos = torch.arange(N + 1, dtype=torch.int32, device=DEV)
    out = torch.full((N + 1,), -1, dtype=torch.int64, device=DEV)
    draws = K.sample(logits, temperature, cut, seed, pos, out=out, config=dict(BLOCK=64, num_warps=1)).cpu()
    x = row[0].cpu().double().numpy()
    assert int(draws[N]) == int(np.argmax(x))
    kept = x >= cut_value
    assert kept.sum() == 10 and bool(kept[draws[:N].numpy()].all())
    want = np.where(kept, np.exp((x - x.max()) / temp), 0.0)
    want /= want.sum()
    fits, stat = draws_fit(draws[:N].numpy(), want)  # Pearson's chi-square against the exact probabilities
    assert fits, (stat, np.bincount(draws[:N].numpy(), minlength=V), want * N)
    again = K.sample(logits[:50], temperature[:50], cut[:50], seed[:50], pos[:50]).cpu()
    assert torch.equal(again, draws[:50])
    other = K.sample(logits[:50], temperature[:50], cut[:50], seed[:50] + 1, pos[:50]).cpu()
    assert not torch.equal(other, draws[:50])


def test_sample_rows_and_step(rng):
    """Rows of different vocabulary-wide logits with their own parameters, in one launch over
    several blocks; step= stores the token and advances position and length as argmax's does."""
    V = 5000
    logits = rand(rng, 3, V, dtype=torch.float16) * 4
    temperature = torch.tensor([0.0, 1.0, 0.5], device=DEV)
    cut = K.cuts(logits, torch.tensor([0, 1, 3], device=DEV), torch.ones(3, device=DEV), torch.zeros(3, device=DEV), 3)
    seed = torch.tensor([1, 2, 3], dtype=torch.int64, device=DEV)
    pos = torch.tensor([5, 6, 7], dtype=torch.int64, device=DEV)
    tok = K.sample(logits, temperature, cut, seed, pos, config=dict(BLOCK=1024, num_warps=4)).cpu()
    ranked = torch.argsort(logits.float().cpu(), dim=1, descending=True)
    assert int(tok[0]) == int(ranked[0, 0]) and int(tok[1]) == int(ranked[1, 0])  # greedy; top-k 1
    assert int(tok[2]) in ranked[2, :3].tolist()
    tokens = torch.full((2,), -5, dtype=torch.int32, device=DEV)
    start = torch.tensor([41], dtype=torch.int32, device=DEV)
    seq = torch.tensor([42], dtype=torch.int32, device=DEV)
    got = K.sample(logits[2:], temperature[2:], cut[2:], seed[2:], start, step=(tokens[:1], start, seq))
    assert int(got[0]) in ranked[2, :3].tolist() and tokens.tolist() == [int(got[0]), -5]
    assert start.tolist() == [42] and seq.tolist() == [43]
    with pytest.raises(ValueError, match="seed must be"):
        K.sample(logits, temperature, cut, seed.int(), pos)


# ------------------------------------------------------------------------------ GPU code generation

@pytest.mark.skipif(os.environ.get("EDGELLM_SM90_COMPILE") != "1",
                    reason="compiles every kernel for sm_90 (~40 s): set EDGELLM_SM90_COMPILE=1")
def test_kernels_compile_for_sm90():
    """The interpreter does not see code generation: compile every kernel for the H100 with
    Triton's own ptxas (no GPU needed) and check for register spills."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "edgellm.backends.cuda.kernels.compile_check", "--arch", "90"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[1:] if line.strip()]
    assert len(rows) >= 30, r.stdout
    for row in rows:
        # columns: case words..., kernel, regs, spill, smem, mix...
        i = next(j for j, tok in enumerate(row) if tok.startswith("_"))
        assert row[i + 2] == "0", f"register spill in {' '.join(row[:i + 1])}"


@pytest.mark.parametrize("pool", ["process", "thread"])
def test_parallel_compile_gives_the_kernels_the_launches_use(tmp_path, pool):
    """A first load compiles its kernels side by side before the steps launch them
    (backends/cuda/precompile.py): collected with every launch compile-only, compiled for sm_90 in
    the compile server's worker processes (pool "process": into Triton's cache, read back here) or
    on this process's threads (Triton's own ptxas: no GPU needed). The launches afterwards must find
    every kernel compiled (none compiled at launch), and each must be the kernel a plain compile at
    launch makes (same registers, shared memory and instruction mix), with an empty Triton cache for
    each run."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    only = "gemv Q4_0,gemv-int8 Q8_0,rms_norm,attn-decode"

    def run(parallel: int, cache: str) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(tmp_path / cache)
        env["EDGELLM_CACHE_DIR"] = str(tmp_path / "engine")
        env["EDGELLM_COMPILE_POOL"] = pool
        r = subprocess.run([sys.executable, "-m", "edgellm.backends.cuda.kernels.compile_check", "--arch", "90",
                            "--only", only, "--parallel", str(parallel)],
                           cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout.splitlines()

    parallel, plain = run(3, "a"), run(0, "b")
    head = next(line for line in parallel if line.startswith("parallel compile:"))
    assert "; 0 failed;" in head, head
    n = int(head.split()[2])
    in_workers = int(head.split("failed; ")[1].split()[0])
    assert in_workers == (n if pool == "process" else 0), head
    assert "compiled at launch after the parallel compile: 0" in parallel, "\n".join(parallel)

    def table(lines):
        return sorted(line for line in lines if line.split()[:1] and line.split()[0] in
                      {"gemv", "gemv-int8", "rms_norm", "attn-decode", "attn-decode-window"})
    assert table(parallel) == table(plain) and len(table(plain)) >= 5, (parallel, plain)
    assert n >= 5  # one specialization per distinct kernel launch of the cases


def test_kernels_sent_ahead_compile_once_and_are_found_by_the_launches(tmp_path):
    """precompile.ahead (a load sends its token choice's kernels to the compile workers as soon as
    it knows the vocabulary) returns without waiting; a later parallel compile of the same kernels
    and others must wait for those in flight rather than send them again (each specialization sent
    to the workers at most once), and the launches afterwards must find every kernel compiled.
    sm_90 through Triton's own ptxas, an empty Triton cache."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), EDGELLM_CACHE_DIR=str(tmp_path / "engine"),
               EDGELLM_COMPILE_POOL="process")
    r = subprocess.run([sys.executable, "-m", "edgellm.backends.cuda.kernels.compile_check", "--arch", "90",
                        "--only", "rms_norm,attn-decode,argmax", "--parallel", "2", "--ahead", "attn-decode,argmax"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()

    def number(prefix: str) -> int:
        return int(next(line for line in out if line.startswith(prefix)).split(prefix)[1].split()[0])
    ahead = number("sent ahead:")
    head = next(line for line in out if line.startswith("parallel compile:"))
    n = int(head.split()[2])
    sent = number("sent to the compile workers:")
    assert "; 0 failed;" in head, head
    assert ahead >= 4 and n > ahead, r.stdout  # the attention and argmax kernels ahead, rms_norm after
    assert ahead <= sent <= n, r.stdout  # nothing sent twice
    assert "compiled at launch after the parallel compile: 0" in out, r.stdout


# ------------------------------------------------------------------------- six-bit layouts (Q6, Q6M)

def make_q6(rng, n_out, n_in, with_min):
    """A Q6 / Q6M PackedWeight from codes and scales drawn here, and its float64 matrix computed
    here from them: (q - 32) * d [+ m], one d (and m) per 16 elements."""
    from edgellm.quant.code_planes import pack_q6_codes
    q = rng.integers(0, 64, (n_out, n_in)).astype(np.uint8)
    d = (rng.uniform(0.5, 1.5, (n_out, n_in // 16)) * rng.choice([-1, 1], (n_out, n_in // 16)) * 0.03).astype(np.float16)
    ref = (q.astype(np.float64) - 32).reshape(n_out, -1, 16) * d.astype(np.float64)[:, :, None]
    m = None
    if with_min:
        m = (rng.standard_normal((n_out, n_in // 16)) * 0.5).astype(np.float16)
        ref = ref + m.astype(np.float64)[:, :, None]
    pw = K.PackedWeight("Q6M" if with_min else "Q6", (n_out, n_in),
                        qs=pack_q6_codes(torch.from_numpy(q)).to(DEV), d=torch.from_numpy(d).to(DEV),
                        m=None if m is None else torch.from_numpy(m).to(DEV))
    return pw, ref.reshape(n_out, n_in)


_SIX_TSIZE = {"Q6_K": (256, 210), "Q5_K": (256, 176), "Q5_1": (32, 24)}


def _random_six_bit_blocks(rng, fmt, n_out, n_in):
    """Random raw bytes of `fmt` blocks with valid fp16 scales: every magnitude from subnormal to the
    largest whose products with the 6- or 8-bit integer scales still fit fp16, both signs."""
    block, tsize = _SIX_TSIZE[fmt]
    n = n_out * n_in // block
    raw = rng.integers(0, 256, (n, tsize), dtype=np.uint8)
    limit = {"Q6_K": 65504 / 128, "Q5_K": 65504 / 63, "Q5_1": 65504}[fmt]

    def f16(count):
        mag = np.exp(rng.uniform(np.log(6e-8), np.log(limit), count))
        mag[:4] = [6e-8, 1.0, limit * 0.999, 2 ** -14][:count]  # a subnormal, the largest that fits
        return (mag * rng.choice([-1, 1], count)).astype(np.float16)

    fields = {"Q6_K": [208], "Q5_K": [0, 2], "Q5_1": [0, 2]}[fmt]
    for off in fields:
        raw[:, off:off + 2] = f16(n).reshape(n, 1).view(np.uint8)
    return raw.reshape(n_out, n_in // block * tsize)


@pytest.mark.parametrize("fmt", ["Q6_K", "Q5_K", "Q5_1"])
def test_repack_six_bit_random_blocks(rng, fmt, monkeypatch):
    """Q6_K -> Q6, Q5_K and Q5_1 -> Q6M from random raw blocks (every code and 6-bit scale pattern,
    extreme fp16 scales and minimums) against edgellm.quant's and gguf-py's decoders: equal but for
    the fp16 rounding of each 16-element scale d * scale (and minimum dmin * min); Q5_1's fields
    are copied, so it is exact. Repacking in slabs of rows gives the same bytes."""
    from edgellm.backends.cuda.kernels import packing
    from edgellm.quant import dequantize as eq_dequantize
    monkeypatch.setenv("EDGELLM_KQUANTS", "converted")  # Q6_K's default is its own layout (Q6K)
    n_out, n_in = 6, 512
    raw = _random_six_bit_blocks(rng, fmt, n_out, n_in)
    ref = eq_dequantize(raw, fmt, (n_out, n_in)).astype(np.float64)
    np.testing.assert_array_equal(ref, gg_dequantize(raw, GGMLQuantizationType[fmt]).reshape(n_out, n_in))
    pw = K.repack(raw, fmt, (n_out, n_in), device=DEV)
    assert pw.fmt == ("Q6" if fmt == "Q6_K" else "Q6M") and pw.source_fmt == fmt
    assert pw.qs.shape == (n_out, n_in // 32 * 24) and pw.d.shape == (n_out, n_in // 16)
    assert pw.nbytes * 8 == n_out * n_in * (7 if fmt == "Q6_K" else 8)  # bits per weight
    got = np64(K.dequantize(pw))
    if fmt == "Q5_1":
        np.testing.assert_array_equal(got, ref)
    else:
        e = lambda v: 2.0 ** -11 * np.abs(v) + 2.0 ** -25  # largest fp16 rounding error at v
        d = np64(pw.d)  # per 16: |err| <= |q - 32| e(d) + e(m), plus float32 rounding
        bound = (32 * e(d) + (e(np64(pw.m)) if pw.m is not None else 0))[:, :, None] * 1.001
        err = np.abs(got - ref).reshape(n_out, n_in // 16, 16)
        assert (err <= bound + 2.0 ** -22 * np.abs(ref).reshape(err.shape)).all()
        assert err.max() > 0  # really rounded
    monkeypatch.setattr(packing, "_REPACK_SLAB_ELEMENTS", 2 * n_in)  # three slabs of two rows
    pw2 = K.repack(raw, fmt, (n_out, n_in), device=DEV)
    for k in pw.tensors:
        assert torch.equal(pw.tensors[k], pw2.tensors[k]), k


def test_repack_six_bit_rejects_scales_beyond_fp16(rng, monkeypatch):
    """Converted to Q6, a sub-block scale d * scale must fit fp16 (the Q6K layout keeps D and the
    int8 scales apart: there it is exact, test_repack_kquants_native_hold_the_file_exactly)."""
    monkeypatch.setenv("EDGELLM_KQUANTS", "converted")
    raw = _random_six_bit_blocks(rng, "Q6_K", 2, 256)
    raw[1, 208:210] = np.array([60000], np.float16).view(np.uint8)
    raw[1, 192:208] = 127  # d * scale = 7.6e6
    with pytest.raises(ValueError, match=r"Q6_K weight \(2, 256\): a scale"):
        K.repack(raw, "Q6_K", (2, 256), device=DEV)


@pytest.mark.parametrize("layout", ["native", "converted"])
def test_repack_q6_k_from_quantizer_through_gemv(rng, monkeypatch, layout):
    """A Q6_K matrix from edgellm's quantizer (as in a file): the GEMV on its Q6K (or, converted, Q6)
    layout against gguf-py's decode of the file bytes."""
    from edgellm.quant import quantize as eq_quantize
    monkeypatch.setenv("EDGELLM_KQUANTS", layout)
    w = rng.standard_normal((24, 256)).astype(np.float32) * rng.uniform(0.01, 3, (24, 1)).astype(np.float32)
    raw = eq_quantize(w, "Q6_K")
    ref = gg_dequantize(raw, GGMLQuantizationType.Q6_K).astype(np.float64)
    pw = K.repack(raw, "Q6_K", (24, 256), device=DEV)
    assert pw.fmt == {"native": "Q6K", "converted": "Q6"}[layout]
    x = rand(rng, 1, 256)
    out = poisoned((1, 24))
    K.linear(x, pw, out=out, config=dict(BLOCK_N=8, BLOCK_K=128, num_warps=1))
    check(out, np64(x) @ ref.T, 1e-3, "Q6_K GEMV")


@pytest.mark.parametrize("fmt,masked", [("Q6", True), ("Q6", False), ("Q6M", True), ("Q6M", False)])
def test_linear_decode_six_bit(rng, fmt, masked):
    """Every decode path on the six-bit layouts: float and int8 activations, 1 and 8 tokens, tiles
    that overhang the matrix (37 x 160: masked loads) or cover it exactly (40 x 256)."""
    n_out, n_in = (37, 160) if masked else (40, 256)
    pw, w = make_q6(rng, n_out, n_in, fmt == "Q6M")
    bias = rand(rng, n_out, dtype=torch.float32)
    for T in (1, 8):
        x = rand(rng, T, n_in)
        for int8 in (False, True):
            out = poisoned((T, n_out))
            K.linear(x, pw, bias=bias, out=out, act_int8=int8, config=GEMV_CFG)
            xr = _q8_act_ref(np64(x)) if int8 else np64(x)
            check(out, xr @ w.T + np64(bias), 2e-3, f"{fmt} decode T={T} int8={int8}")


@pytest.mark.parametrize("fmt,fused,int8", [("Q6", True, False), ("Q6M", False, True), ("Q6M", True, False),
                                            ("Q6", False, True)])
def test_linear_silu_mul_decode_six_bit(rng, fmt, fused, int8):
    wg, g = make_q6(rng, 21, 96, fmt == "Q6M")
    wu, u = make_q6(rng, 21, 96, fmt == "Q6M")
    x = rand(rng, 2, 96)
    check_silu_mul_decode(x, wg, g, wu, u, fused, int8, GEMV_CFG, fmt)


def check_tensor_core_paths(rng, pw, w, rows: int, what: str):
    """The GEMM on a 37-row weight: 19 tokens with the test tiles and a bias, then `rows` tokens
    with the default tiles (decode_max_tokens=0), against the float64 product."""
    n_out, n_in = w.shape
    x = rand(rng, 19, n_in)
    bias = rand(rng, n_out)
    out = poisoned((19, n_out))
    K.linear(x, pw, bias=bias, out=out, config=GEMM_CFG)
    check(out, np64(x) @ w.T + np64(bias), 2e-3, f"{what} prefill")
    out = poisoned((rows, n_out))
    K.linear(x[:rows], pw, out=out, decode_max_tokens=0)  # default tiles
    check(out, np64(x[:rows]) @ w.T, 2e-3, f"{what} default config, {rows} tokens")


@pytest.mark.parametrize("fmt", ["Q6", "Q6M"])
def test_linear_prefill_six_bit(rng, fmt):
    """The tensor-core path: the weight tile dequantized to fp16 in registers (rounding each
    (q - 32) * d and + m to fp16: 2^-11 relative)."""
    pw, w = make_q6(rng, 37, 160, fmt == "Q6M")
    check_tensor_core_paths(rng, pw, w, 9, fmt)


@pytest.mark.skipif(not CUDA, reason="inline PTX: the interpreter runs the Triton form (the tests above)")
@pytest.mark.parametrize("fmt", ["Q6", "Q6M", "Q6K"])
@pytest.mark.parametrize("n_in", [160, 512])
def test_linear_six_bit_packed_ptx(rng, monkeypatch, fmt, n_in):
    """The six-bit dequantization through packed PTX (six_bits_f16, on unless EDGELLM_SIX_ASM=0) in every
    tile shape: the prefill and default tiles, the large-M and weight-B ones, and the 16-row skinny
    tile; K a multiple of BLOCK_K and not (where Triton packs a thread's rows, not neighbours in a
    block, into one instruction)."""
    from edgellm.backends.cuda.kernels import configs
    if fmt == "Q6K" and n_in % 256:
        pytest.skip("Q6_K super-blocks are 256 wide")
    monkeypatch.setattr(K.linear_module, "_SIX_ASM", True)
    pw, w = make_kquant(fmt, rng, 37, n_in, monkeypatch) if fmt == "Q6K" else make_q6(rng, 37, n_in, fmt == "Q6M")
    check_tensor_core_paths(rng, pw, w, 16, f"{fmt} packed PTX")
    for cfg in (configs.GEMM_DEFAULT_LARGE_M, configs.GEMM_WIDE_WEIGHT_B, dict(configs.GEMM_WIDE_WEIGHT_B, SPLIT_K=2)):
        M = cfg["BLOCK_M"] + 3
        x = rand(rng, M, n_in)
        out = poisoned((M, 37))
        K.linear(x, pw, out=out, config=cfg)
        check(out, np64(x) @ w.T, 2e-3, f"{fmt} packed PTX {cfg}")


@pytest.mark.parametrize("fmt", ["Q6", "Q6M"])
def test_embedding_six_bit(rng, fmt):
    pw, w = make_q6(rng, 11, 96, fmt == "Q6M")
    ids = torch.tensor([3, 0, 10, 3, 7], dtype=torch.int32, device=DEV)
    out = K.embedding(ids, pw, out=poisoned((5, 96), torch.float32))
    np.testing.assert_allclose(np64(out), w[[3, 0, 10, 3, 7]], rtol=1e-6, atol=0)


def test_unify_formats_mixed_stacks(rng, monkeypatch):
    """Stacked parts in different formats take the smallest common layout that holds every part
    exactly: Q4_K_M's q, k (Q4_K -> Q4_1) with a Q6_K v -> Q6M; Q4_0 with Q5_0 (as Q8_0) -> Q6;
    Q4_0 with Q4_1 -> Q4_1; a full-range Q8_0 with Q6 -> F16. The stacked GEMV then matches the
    parts' own matrices."""
    from edgellm.quant import quantize as eq_quantize

    monkeypatch.setenv("EDGELLM_KQUANTS", "converted")  # the native layouts: test_kquants_native_in_mixed_stacks

    def kq(fmt, n):
        w = rng.standard_normal((n, 256)).astype(np.float32) * 0.2
        return K.repack(eq_quantize(w, fmt), fmt, (n, 256), device=DEV)

    q, k, v = kq("Q4_K", 16), kq("Q4_K", 8), kq("Q6_K", 8)
    assert (q.fmt, v.fmt) == ("Q4_1", "Q6")
    cases = [([q, k, v], "Q6M", 8), ([make_weight(rng, "Q4_0", 8, 256)[0], make_weight(rng, "Q5_0", 16, 256)[0]], "Q6", 7),
             ([make_weight(rng, "Q4_0", 8, 256)[0], make_weight(rng, "Q4_1", 8, 256)[0]], "Q4_1", 5),
             ([make_weight(rng, "Q8_0", 8, 256)[0], v], "F16", 16)]
    for parts, want, bits in cases:
        conv = K.unify_formats(parts)
        assert [c.fmt for c in conv] == [want] * len(parts)
        for p, c in zip(parts, conv):
            a, b = np64(K.dequantize(p)), np64(K.dequantize(c))
            if want == "F16":
                np.testing.assert_allclose(b, a, rtol=2.0 ** -11, atol=0)
            else:
                np.testing.assert_array_equal(b, a)
        w = K.concat_packed(conv)
        assert w.nbytes * 8 == w.out_features * 256 * bits
        ref = np.concatenate([np64(K.dequantize(p)) for p in parts])
        x = rand(rng, 2, 256)
        out = poisoned((2, w.out_features))
        K.linear(x, w, out=out, config=GEMV_CFG)
        check(out, np64(x) @ ref.T, 2e-3, f"stack as {want}")
    assert K.unify_formats([q, k]) == [q, k]  # one format: as they are


# ------------------------------------------------------------------- L2 weight prefetch under PDL

def test_prefetch_lines_stay_within_the_budget(monkeypatch):
    """The GEMV's prefetch request per program: a power of two of 128-byte lines, the whole region
    when the launch's budget allows, otherwise a prefix whose total over the programs is within the
    budget; nothing when prefetch or PDL is off."""
    from edgellm.backends.cuda.kernels import _common as C
    monkeypatch.setattr(C, "_PDL", True)
    monkeypatch.setattr(C, "_L2_PREFETCH_BYTES", 4 << 20)
    rng = np.random.default_rng()
    for _ in range(200):
        programs = int(rng.integers(1, 20000))
        region = int(rng.integers(1, 64 << 10))
        share = int(rng.integers(1, 3))
        lines = C.prefetch_lines(programs, region, share)
        need = -(-region // 128)
        if lines:
            assert lines & (lines - 1) == 0 and lines <= 1024
            # bytes asked of L2: at most the region per program (the extra lines repeat its last one)
            asked = min(lines, need) * 128
            assert programs * share * asked <= (4 << 20) + programs * share * 128
            if need <= (4 << 20) // (programs * share * 128) and need <= 1024:
                assert lines >= need  # the whole region fits the budget: all of it
        else:
            assert (4 << 20) // (programs * share * 128) == 0
    assert C.prefetch_lines(100, 4096) == 32
    monkeypatch.setattr(C, "_PDL", False)
    assert C.prefetch_lines(100, 4096) == 0
    monkeypatch.setattr(C, "_PDL", True)
    monkeypatch.setattr(C, "_L2_PREFETCH_BYTES", 0)
    assert C.prefetch_lines(100, 4096) == 0


def test_gemv_prefetch_is_issued_before_the_pdl_wait(tmp_path):
    """With PDL on, the decode GEMV's L2 prefetches (CCTL.E.PF2 in SASS) must come before its
    griddepcontrol.wait (ACQBULK), or they overlap nothing; compiled for sm_90 with Triton's own
    ptxas (no GPU needed), for the int8 and the float path."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sass = tmp_path / "sass"
    r = subprocess.run([sys.executable, "-m", "edgellm.backends.cuda.kernels.compile_check", "--arch", "90", "--pdl",
                        "--only", "gemv-int8 Q4_0,glu Q8_0", "--sass", str(sass)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(p for p in sass.glob("*_gemv*kernel.sass"))
    assert len(files) == 2, files
    for f in files:
        lines = f.read_text().splitlines()
        pf = [i for i, line in enumerate(lines) if "CCTL.E.PF2" in line]
        wait = [i for i, line in enumerate(lines) if "ACQBULK" in line]
        assert pf and wait, f.name
        assert max(pf) < min(wait), f"{f.name}: a prefetch after the PDL wait"


def test_prefill_gemm_copies_every_weight_load_ahead(tmp_path):
    """The prefill GEMM's K loop must issue every weight load (quants, scales, minimums) as an
    asynchronous copy the pipeliner runs num_stages ahead where each thread's piece is 4 bytes or
    more; a load left in place (tt.load in the compiled TTGIR) waits for DRAM in every iteration, as
    the scales of each quantized format did (one fp16 per thread, too narrow to copy). Compiled for
    sm_90 with Triton's own ptxas, 512 tokens: a 128 x 64 x 128 tile (scales 4 bytes a thread)
    copies everything ahead; the large-M default (128 x 64 x 64, chosen for correctness: see
    configs.GEMM_DEFAULT_LARGE_M) copies its quants ahead, its [64, 2] scales stay in place (the Q4K
    layout: its [64, 2] scale codes; its super-block pairs are copied)."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sass = tmp_path / "sass"
    fmts = ["Q4_0", "Q4_1", "Q8_0", "Q6", "Q6M", "Q4K", "Q6K"]
    r = subprocess.run([sys.executable, "-m", "edgellm.backends.cuda.kernels.compile_check", "--arch", "90",
                        "--only", ",".join(f"gemm{t} {f}" for f in fmts for t in ("", "-k128")), "--sass",
                        str(sass)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    wide = sorted(sass.glob("gemm-k128_*_gemm_kernel.ttgir"))
    default = sorted(sass.glob("gemm_*_gemm_kernel.ttgir"))
    assert len(wide) == len(default) == len(fmts), (wide, default)
    def k_loop(ir: str) -> list[str]:  # the K loop's lines: from the first scf.for to its scf.yield
        lines = ir.splitlines()
        first = next(i for i, line in enumerate(lines) if "scf.for" in line)
        end = next(i for i in range(first, len(lines)) if "scf.yield" in lines[i])
        return lines[first:end]

    for f in wide:
        ir = f.read_text()
        assert "ttg.async_copy_global_to_local" in ir, f.name
        assert not [line for line in k_loop(ir) if " tt.load " in line], f"{f.name}: a load in place in the K loop"
    for f in default:
        ir = f.read_text()
        assert "ttg.async_copy_global_to_local" in ir, f.name
        in_place = [line for line in k_loop(ir) if " tt.load " in line]
        # the scales may stay in place (fp16; the Q4K and Q6K layouts' scale codes), the quants may not
        assert all(any(f"x!tt.ptr<{t}>" in line for t in ("f16", "i16", "i8")) for line in in_place), \
            f"{f.name}: quants loaded in place"


# ------------------------------------------------ Q4_K and Q6_K in their own terms (the Q4K, Q6K layouts)

_KQ_SOURCE = {"Q4K": "Q4_K", "Q5K": "Q5_K", "Q6K": "Q6_K"}


def make_kquant(fmt, rng, n_out, n_in, monkeypatch, extreme=False):
    """A Q4_K, Q5_K or Q6_K weight from edgellm's quantizer, repacked into the Q4K / Q5K / Q6K layout
    (the default), with gguf-py's dequantization as the float64 reference. extreme: rows
    scaled by 1e-4 .. 1e3, so that super-block scales (and minimums) span fp16's range; Q4_K and
    Q5_K rows are moved off centre so that their minimums matter."""
    from edgellm.quant import quantize as eq_quantize

    src = _KQ_SOURCE[fmt]
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    w *= (10.0 ** rng.uniform(-4, 3, (n_out, 1)) if extreme else rng.uniform(0.01, 3, (n_out, 1))).astype(np.float32)
    if src in ("Q4_K", "Q5_K"):
        w += rng.uniform(-1, 1, (n_out, 1)).astype(np.float32) * np.abs(w).max(axis=1, keepdims=True)
    raw = eq_quantize(w, src)
    ref = gg_dequantize(raw, GGMLQuantizationType[src]).astype(np.float64)
    monkeypatch.setenv("EDGELLM_KQUANTS", "native")  # the default, whatever the caller's environment
    pw = K.repack(raw, src, (n_out, n_in), device=DEV)
    monkeypatch.delenv("EDGELLM_KQUANTS")
    return pw, ref


@pytest.mark.parametrize("fmt", ["Q4K", "Q5K", "Q6K"])
@pytest.mark.parametrize("extreme", [False, True])
def test_repack_kquants_native_hold_the_file_exactly(rng, monkeypatch, fmt, extreme):
    """The Q4K, Q5K and Q6K layouts keep the K-quant's codes and super-block fields as stored: their
    values are gguf-py's (the same fp32 products, no fp16 rounding of the sub-block scales), at
    4.625, 5.625 and 6.625 bits per weight; EDGELLM_KQUANTS=converted makes them Q4_1, Q6M and Q6."""
    from edgellm.quant import quantize as eq_quantize

    pw, ref = make_kquant(fmt, rng, 6, 768, monkeypatch, extreme)
    assert pw.fmt == fmt and pw.source_fmt == _KQ_SOURCE[fmt]
    assert pw.nbytes * 8 == 6 * 768 * {"Q4K": 4.625, "Q5K": 5.625, "Q6K": 6.625}[fmt]
    got = np64(K.dequantize(pw))
    assert (np.abs(got - ref) <= 1e-6 * np.abs(ref).max(axis=1, keepdims=True)).all()
    raw = eq_quantize(ref.astype(np.float32), _KQ_SOURCE[fmt])
    from edgellm.backends.cuda.kernels import packing
    with monkeypatch.context() as mp:
        mp.setattr(packing, "_REPACK_SLAB_ELEMENTS", 2 * 768)  # slabs of two rows: the same bytes
        again = K.repack(raw, _KQ_SOURCE[fmt], (6, 768), device=DEV)
    whole = K.repack(raw, _KQ_SOURCE[fmt], (6, 768), device=DEV)
    assert again.fmt == whole.fmt == fmt and all(torch.equal(again.tensors[k], whole.tensors[k]) for k in whole.tensors)
    monkeypatch.setenv("EDGELLM_KQUANTS", "converted")
    assert K.repack(raw, _KQ_SOURCE[fmt], (6, 768), device=DEV).fmt == {"Q4K": "Q4_1", "Q5K": "Q6M", "Q6K": "Q6"}[fmt]
    monkeypatch.setenv("EDGELLM_KQUANTS", "q4k-please")
    with pytest.raises(ValueError, match="EDGELLM_KQUANTS"):
        K.repack(raw, _KQ_SOURCE[fmt], (6, 768), device=DEV)



@pytest.mark.parametrize("fmt", ["Q4K", "Q5K", "Q6K"])
@pytest.mark.parametrize("masked", [False, True])
def test_linear_decode_kquants_native(rng, monkeypatch, fmt, masked):
    """Every decode path on Q4K, Q5K and Q6K against the float64 product: float and int8 activations, 1
    and 8 tokens, tiles that overhang the matrix (37 rows, a partial K tile) or cover it, rows of
    extreme scales (float32 output: their products pass fp16's range)."""
    n_out, n_in = (37, 768) if masked else (40, 512)
    pw, w = make_kquant(fmt, rng, n_out, n_in, monkeypatch, extreme=masked)
    bias = rand(rng, n_out, dtype=torch.float32)
    cfg = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4)
    for T in (1, 8):
        x = rand(rng, T, n_in)
        for int8 in (False, True):
            out = poisoned((T, n_out), torch.float32)
            K.linear(x, pw, bias=bias, out=out, act_int8=int8, config=cfg)
            xr = _q8_act_ref(np64(x)) if int8 else np64(x)
            check(out, xr @ w.T + np64(bias), 2e-3, f"{fmt} decode T={T} int8={int8}")


@pytest.mark.parametrize("fmt,fused,int8", [("Q4K", True, False), ("Q4K", False, True), ("Q5K", True, False),
                                            ("Q5K", False, True), ("Q6K", True, False), ("Q6K", False, True)])
def test_linear_silu_mul_decode_kquants_native(rng, monkeypatch, fmt, fused, int8):
    wg, g = make_kquant(fmt, rng, 21, 512, monkeypatch)
    wu, u = make_kquant(fmt, rng, 21, 512, monkeypatch)
    x = rand(rng, 2, 512)
    check_silu_mul_decode(x, wg, g, wu, u, fused, int8, dict(BLOCK_N=4, BLOCK_K=256, num_warps=4), fmt)


@pytest.mark.parametrize("fmt", ["Q4K", "Q5K", "Q6K"])
def test_linear_prefill_and_skinny_kquants_native(rng, monkeypatch, fmt):
    """The tensor-core paths on Q4K, Q5K and Q6K (each sub-block's scale (and minimum) rounded to fp16 in
    the tile, as the converted layouts store them): prefill tiles and the default configurations,
    and the skinny product of a 16-row batched decode step."""
    pw, w = make_kquant(fmt, rng, 37, 512, monkeypatch)
    check_tensor_core_paths(rng, pw, w, 16, fmt)  # 16 tokens: the skinny product


@pytest.mark.parametrize("fmt", ["Q4K", "Q5K", "Q6K"])
def test_embedding_kquants_native(rng, monkeypatch, fmt):
    pw, w = make_kquant(fmt, rng, 11, 512, monkeypatch, extreme=True)
    ids = torch.tensor([3, 0, 10, 3, 7], dtype=torch.int32, device=DEV)
    out = K.embedding(ids, pw, out=poisoned((5, 512), torch.float32))
    ref = w[[3, 0, 10, 3, 7]]
    assert (np.abs(np64(out) - ref) <= 1e-6 * np.abs(ref).max(axis=1, keepdims=True)).all()


def test_kquants_native_in_mixed_stacks(rng, monkeypatch):
    """Q4K, Q5K or Q6K parts stacked with a part in another format (a Q4_K_M file's q, k with a Q6_K
    v) take their converted layout first (fp16 scales, as EDGELLM_KQUANTS=converted repacks them),
    then the common one; parts of one native layout alone stay in it."""
    q, wq = make_kquant("Q4K", rng, 16, 512, monkeypatch)
    k, wk = make_kquant("Q4K", rng, 8, 512, monkeypatch)
    alone = K.unify_formats([q, k])
    assert [p.fmt for p in alone] == ["Q4K", "Q4K"]
    stack = K.concat_packed(alone)
    assert (np.abs(np64(K.dequantize(stack)) - np.concatenate([wq, wk])) <= 1e-6 * np.abs(wq).max()).all()
    for v, wv in (make_q6(rng, 8, 512, False), make_kquant("Q6K", rng, 8, 512, monkeypatch),
                  make_kquant("Q5K", rng, 8, 512, monkeypatch)):
        mixed = K.unify_formats([q, k, v])
        assert {p.fmt for p in mixed} == {"Q6M"}
        got = np64(K.dequantize(K.concat_packed(mixed)))
        ref = np.concatenate([wq, wk, wv])
        assert np.abs(got - ref).max() <= 2.0 ** -10 * np.abs(ref).max()
