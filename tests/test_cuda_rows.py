"""Batched decode on the cuda backend: the row-wise kernels (rope_rows, kv_store_rows,
attention_rows; each row a different sequence with its own KV slot and position) against the cpu
backend's reference ops, and SlotPool.decode on cuda against the cpu backend and against each
sequence run alone. Without a GPU the kernels run in Triton's interpreter (tiny shapes)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from edgellm.backends.cpu import CPU_KERNELS  # noqa: E402
from edgellm.backends.cuda import kernels as K  # noqa: E402
from edgellm.graph.ir import Op  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")


def rand(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float16)).to(DEV)


def poisoned(shape):
    return torch.full(shape, float("nan"), dtype=torch.float16, device=DEV)


def ref(kind, inputs, **attrs):
    """The cpu backend's reference op on float32 copies of the inputs."""
    args = [t.float().cpu() if isinstance(t, torch.Tensor) and t.is_floating_point() else
            (t.cpu() if isinstance(t, torch.Tensor) else t) for t in inputs]
    return CPU_KERNELS[kind](Op("ref", kind, (), ("out",), attrs), args)


def close(got, want, tol, what):
    got = got.float().cpu()
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} elements not written"
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    assert err < tol, f"{what}: worst relative error {err:.2e} (tol {tol})"


def ints(values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


# slots of 37 rows (not a tile multiple); rows in no slot order, lengths 1..37
CTX, SLOTS = 37, 4
BASES = [2 * CTX, 0, 3 * CTX, CTX, 2 * CTX + 0]
POS = [36, 0, 13, 20, -1]  # the last row is padding (negative position): nothing stored, output 0


@pytest.mark.parametrize("style,D,H,n_rot,ff", [("norm", 32, 3, None, True), ("neox", 24, 2, 16, False)])
def test_rope_rows_matches_reference(rng, style, D, H, n_rot, ff):
    pos = [5, 0, 4090, 17, 33]
    x = rand(rng, len(pos), H * D)
    factors = torch.from_numpy(rng.uniform(1, 4, (n_rot or D) // 2).astype(np.float32)).to(DEV) if ff else None
    out = poisoned(tuple(x.shape))
    K.rope_rows(x, ints(pos), H, D, theta=1e4, style=style, freq_factors=factors, n_rot=n_rot, out=out)
    attrs = dict(n_heads=H, head_dim=D, rope_dim=n_rot or D, theta=1e4, style=style)
    want = ref("rope_rows", [x, ints(pos)] + ([factors] if ff else []), **attrs)
    close(out, want, 3e-3, "rope_rows")


def test_kv_store_rows_writes_only_its_rows(rng):
    F = 40
    cache = poisoned((SLOTS * CTX, F))
    x = rand(rng, len(POS), F)
    K.kv_store_rows(cache, x, ints(BASES), ints(POS))
    want = ref("kv_store_rows", [torch.full((SLOTS * CTX, F), float("nan")), x[:-1], ints(BASES[:-1]),
                                 ints(POS[:-1])])
    got = cache.float().cpu()
    written = ~torch.isnan(want[:, 0])
    assert torch.equal(~torch.isnan(got[:, 0]), written), "rows written other than base + pos of the real rows"
    assert torch.equal(got[written], want[written])


def test_rope_qkv_cache_rows_mode(rng):
    """The fused rope + K/V store of a rows step (what the backend launches for a layer)."""
    H, HKV, D = 4, 2, 16
    T = len(POS)
    q, k, v = rand(rng, T, H * D), rand(rng, T, HKV * D), rand(rng, T, HKV * D)
    kc, vc = poisoned((SLOTS * CTX, HKV * D)), poisoned((SLOTS * CTX, HKV * D))
    qo = poisoned((T, H * D))
    K.rope_qkv_cache(q, k, v, kc, vc, 0, H, HKV, D, theta=1e4, q_out=qo, positions=ints(POS), bases=ints(BASES))
    attrs = dict(head_dim=D, rope_dim=D, theta=1e4, style="norm")
    close(qo, ref("rope_rows", [q, ints(POS)], n_heads=H, **attrs), 3e-3, "q")
    krot = ref("rope_rows", [k, ints(POS)], n_heads=HKV, **attrs)
    nan = torch.full((SLOTS * CTX, HKV * D), float("nan"))
    want_k = ref("kv_store_rows", [nan.clone(), krot[:-1], ints(BASES[:-1]), ints(POS[:-1])])
    want_v = ref("kv_store_rows", [nan.clone(), v[:-1], ints(BASES[:-1]), ints(POS[:-1])])
    for got, want, what in ((kc, want_k, "k cache"), (vc, want_v, "v cache")):
        got = got.float().cpu()
        written = ~torch.isnan(want[:, 0])
        assert torch.equal(~torch.isnan(got[:, 0]), written), f"{what}: rows written other than base + pos"
        close(got[written], want[written], 3e-3, what)


@pytest.mark.parametrize("H,HKV,D,window,splits", [(4, 2, 16, 0, 1), (6, 2, 24, 0, 3), (4, 1, 16, 9, 2),
                                                    (3, 3, 16, 5, 1)])
def test_attention_rows_matches_reference(rng, H, HKV, D, window, splits):
    T = len(POS)
    kc, vc = rand(rng, SLOTS * CTX, HKV * D), rand(rng, SLOTS * CTX, HKV * D)
    q = rand(rng, T, H * D)
    out = poisoned((T, H * D))
    ws = K.decode_workspace(T, H, D, splits, DEV) if splits > 1 else None
    K.attention_rows(q, kc, vc, ints(POS), ints(BASES), H, HKV, 0.3, out=out, head_dim=D, window=window,
                     n_splits=splits, workspace=ws)
    attrs = dict(n_heads=H, n_kv_heads=HKV, head_dim=D, scale=0.3, **({"window": window} if window else {}))
    want = ref("attention_rows", [q[:-1], kc, vc, ints(BASES[:-1]), ints(POS[:-1])], **attrs)
    close(out[:-1], want, 3e-3, "attention_rows")
    assert torch.equal(out[-1].float().cpu(), torch.zeros(H * D)), "a padding row's output is not zero"


def test_attention_rows_splits_combined_in_the_kernel(rng, monkeypatch):
    """Split attention_rows combined by each (row, kv head)'s last split program, against the
    reduce kernel's combine (EDGELLM_ROWS_ATTN_COMBINE=0) and the reference; run twice, and the
    counters are left zero for the next launch."""
    import importlib

    att = importlib.import_module("edgellm.backends.cuda.kernels.attention")
    H, HKV, D, splits = 4, 2, 16, 5
    T = len(POS)
    kc, vc = rand(rng, SLOTS * CTX, HKV * D), rand(rng, SLOTS * CTX, HKV * D)
    q = rand(rng, T, H * D)
    ws = K.decode_workspace(T, H, D, splits, DEV)
    outs = {}
    for combine in ("0", "1", "1"):
        monkeypatch.setenv("EDGELLM_ROWS_ATTN_COMBINE", combine)
        out = poisoned((T, H * D))
        K.attention_rows(q, kc, vc, ints(POS), ints(BASES), H, HKV, 0.3, out=out, head_dim=D, n_splits=splits,
                         workspace=ws)
        outs.setdefault(combine, []).append(out.float().cpu())
    want = ref("attention_rows", [q[:-1], kc, vc, ints(BASES[:-1]), ints(POS[:-1])], n_heads=H, n_kv_heads=HKV,
               head_dim=D, scale=0.3)
    for got in outs["1"]:
        close(got[:-1], want, 3e-3, "combined in the kernel")
        assert torch.equal(got[-1], torch.zeros(H * D)), "a padding row's output is not zero"
        assert (got - outs["0"][0]).abs().max().item() < 1e-3
    assert not att._split_counters(DEV, T * HKV).any(), "the combine left its counters dirty"


@pytest.mark.parametrize("H,HKV,D,window,splits,style,n_rot,ff,pos_scale", [
    (4, 2, 16, 0, 1, "norm", None, False, 1.0), (6, 2, 24, 0, 3, "neox", 16, True, 1.0),
    (4, 1, 16, 9, 2, "norm", 8, False, 2.0), (3, 3, 32, 0, 4, "neox", None, False, 1.0)])
def test_attention_rows_with_rope_and_store(rng, H, HKV, D, window, splits, style, n_rot, ff, pos_scale):
    """attention_rows given the rows' own k and v (new_k, new_v) and q unrotated does rope_qkv_cache's
    rows-mode work itself: the same output as rope_qkv_cache then attention_rows, and the same
    cache rows written (rotated k, v at base + pos; nothing for the padding row), from one q|k|v
    buffer's views as the backend passes them."""
    T = len(POS)
    qkv = rand(rng, T, (H + 2 * HKV) * D)
    q, k, v = qkv[:, :H * D], qkv[:, H * D:(H + HKV) * D], qkv[:, (H + HKV) * D:]
    factors = torch.from_numpy(rng.uniform(1, 4, (n_rot or D) // 2).astype(np.float32)).to(DEV) if ff else None
    rope = dict(theta=1e4, style=style, freq_factors=factors, n_rot=n_rot, pos_scale=pos_scale)
    kc0, vc0 = rand(rng, SLOTS * CTX, HKV * D), rand(rng, SLOTS * CTX, HKV * D)
    ws = K.decode_workspace(T, H, D, splits, DEV) if splits > 1 else None
    # the reference: the two launches the backend made before
    kc1, vc1, qo = kc0.clone(), vc0.clone(), poisoned((T, H * D))
    K.rope_qkv_cache(q, k, v, kc1, vc1, 0, H, HKV, D, q_out=qo, positions=ints(POS), bases=ints(BASES), **rope)
    want = poisoned((T, H * D))
    K.attention_rows(qo, kc1, vc1, ints(POS), ints(BASES), H, HKV, 0.3, out=want, head_dim=D, window=window,
                     n_splits=splits, workspace=ws)
    kc2, vc2 = kc0.clone(), vc0.clone()
    out = poisoned((T, H * D))
    K.attention_rows(q, kc2, vc2, ints(POS), ints(BASES), H, HKV, 0.3, out=out, head_dim=D, window=window,
                     n_splits=splits, workspace=ws, new_k=k, new_v=v, **rope)
    close(out, want.float().cpu(), 3e-3, "attention_rows with rope")
    assert torch.equal(out[-1].float().cpu(), torch.zeros(H * D)), "a padding row's output is not zero"
    for got, ref_, what in ((kc2, kc1, "k cache"), (vc2, vc1, "v cache")):
        diff = (got.float() - ref_.float()).abs().max(-1).values.cpu()
        assert (diff <= 2e-3 * ref_.float().abs().max().item()).all(), f"{what}: rows differ {torch.nonzero(diff > 0)}"
    # the written rows are the rotated keys and values themselves, all of them
    assert not torch.equal(kc2, kc0)


def _quantized(rng, fmt, n_out, n_in):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gg_dequantize
    from gguf.quants import quantize as gg_quantize

    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    if fmt == "F16":
        raw, want_w = w.astype(np.float16), w.astype(np.float16).astype(np.float64)
    else:
        raw = gg_quantize(w, GGMLQuantizationType[fmt])
        want_w = gg_dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float64)
    return K.repack(raw, fmt, (n_out, n_in), device=DEV), want_w


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "F16"])
@pytest.mark.parametrize("M", [13, 32])
def test_skinny_linear_default_config(rng, fmt, M):
    """A batched decode step's linear layers: M rows (9..32, past the GEMV's 8) take the GEMM
    kernel with the skinny default tile (configs.gemm_default with N and the SM count)."""
    n_out, n_in = 70, 96
    pw, want_w = _quantized(rng, fmt, n_out, n_in)
    x = rand(rng, M, n_in)
    out = poisoned((M, n_out))
    K.linear(x, pw, out=out)
    want = torch.from_numpy(x.double().cpu().numpy() @ want_w.T)
    close(out, want, 3e-3, f"{fmt} M={M}")


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "F16"])
@pytest.mark.parametrize("split", [2, 3, 5])
def test_split_k_linear(rng, fmt, split):
    """Split-K: K in `split` ranges (the last one short when K does not divide), partial sums
    in the float32 workspace, the last program of a tile adding them and writing out + bias; run
    twice, and the tile counters are left zero for the next launch."""
    import importlib

    linear_mod = importlib.import_module("edgellm.backends.cuda.kernels.linear")
    n_out, n_in, M = 70, 416, 13  # 416 = 6.5 K-tiles of 64: ranges of 128 or 64 columns, one partial tile
    pw, want_w = _quantized(rng, fmt, n_out, n_in)
    x, bias = rand(rng, M, n_in), rand(rng, n_out)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=2, num_stages=3, SPLIT_K=split)
    want = torch.from_numpy(x.double().cpu().numpy() @ want_w.T + bias.double().cpu().numpy())
    for rep in range(2):
        out = poisoned((M, n_out))
        K.linear(x, pw, bias, out=out, config=cfg)
        close(out, want, 3e-3, f"{fmt} split {split} run {rep}")
    _, cnt = linear_mod._splitk_workspace(DEV, M * n_out)
    assert not cnt.any(), "split-K left its tile counters dirty"


def test_skinny_default_splits_k_on_a_long_row(rng):
    """The default config of a skinny product with a long K and few output tiles splits K
    (configs.gemm_default) and gives the product."""
    from edgellm.backends.cuda.kernels import configs
    from edgellm.backends.cuda.kernels._common import device_sm_count

    M, n_out, n_in = 16, 64, 2048
    x = rand(rng, M, n_in)
    assert configs.gemm_default(M, n_out, device_sm_count(x), n_in).get("SPLIT_K", 1) > 1
    pw, want_w = _quantized(rng, "Q4_0", n_out, n_in)
    out = poisoned((M, n_out))
    K.linear(x, pw, out=out)
    close(out, torch.from_numpy(x.double().cpu().numpy() @ want_w.T), 3e-3, "Q4_0 split by default")


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1"])
def test_skinny_linear_every_tune_candidate(rng, fmt):
    """A rows program's tuner may launch any of configs.skinny_candidates for a skinny product:
    each must give the product (and leave the split-K tile counters zero) on a weight no tile
    divides, K not a multiple of the wider K-tiles."""
    from edgellm.backends.cuda.kernels import configs
    from edgellm.backends.cuda.kernels._common import device_sm_count

    n_out, n_in, M = 70, 416, 16
    pw, want_w = _quantized(rng, fmt, n_out, n_in)
    x = rand(rng, M, n_in)
    want = torch.from_numpy(x.double().cpu().numpy() @ want_w.T)
    cands = configs.skinny_candidates(M, n_out, n_in, device_sm_count(x))
    assert {(c["BLOCK_N"], c["BLOCK_K"]) for c in cands} == {t[:2] for t in configs.SKINNY_TUNE_TILES}
    assert any(c.get("SPLIT_K", 1) > 1 for c in cands)
    _check_candidates(x, pw, want, cands, fmt)


def _check_candidates(x, pw, want, cands, what):
    """Each configuration's skinny product of x and pw against want, the split-K tile counters
    left zero after each."""
    import importlib

    linear_mod = importlib.import_module("edgellm.backends.cuda.kernels.linear")
    M, n_out = want.shape
    for cfg in cands:
        out = poisoned((M, n_out))
        K.linear(x, pw, out=out, config=cfg, decode_max_tokens=0)
        close(out, want, 3e-3, f"{what} {cfg}")
        _, cnt = linear_mod._splitk_workspace(DEV, M * n_out)
        assert not cnt.any(), f"{cfg} left its tile counters dirty"


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
def test_skinny_linear_every_tune_candidate_kquants(rng, monkeypatch, fmt):
    """As above for the native K-quant layouts (Q4K, Q5K, Q6K), whose skinny tiles read a
    super-block's fields once a row and whose K is whole 256-super-blocks: three of them, so that the
    64 x 256 tile's K-steps each start a super-block and the 128-wide ones split it. Rows are
    moved off centre and scaled apart so that the minimums and super-block scales matter."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gg_dequantize

    from edgellm.backends.cuda.kernels import configs
    from edgellm.backends.cuda.kernels._common import device_sm_count
    from edgellm.quant import quantize as eq_quantize

    n_out, n_in, M = 70, 768, 16
    w = rng.standard_normal((n_out, n_in)).astype(np.float32) * rng.uniform(0.01, 3, (n_out, 1)).astype(np.float32)
    w += rng.uniform(-1, 1, (n_out, 1)).astype(np.float32) * np.abs(w).max(axis=1, keepdims=True)
    raw = eq_quantize(w, fmt)
    want_w = gg_dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float64)
    monkeypatch.setenv("EDGELLM_KQUANTS", "native")
    pw = K.repack(raw, fmt, (n_out, n_in), device=DEV)
    assert pw.fmt == fmt.replace("_", "")
    x = rand(rng, M, n_in)
    want = torch.from_numpy(x.double().cpu().numpy() @ want_w.T)
    cands = configs.skinny_candidates(M, n_out, n_in, device_sm_count(x))
    assert {c["BLOCK_K"] for c in cands} >= {128, 256}
    _check_candidates(x, pw, want, cands, fmt)


def _native(rng, monkeypatch, fmt, n_out, n_in):
    """A weight packed in its native layout (K-quants quantized by edgellm.quant, which gguf's
    writer lacks) and its float64 dequantization by gguf's reader."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gg_dequantize

    from edgellm.quant import quantize as eq_quantize

    monkeypatch.setenv("EDGELLM_KQUANTS", "native")
    w = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.1
    if fmt == "F16":
        raw, want_w = w.astype(np.float16), w.astype(np.float16).astype(np.float64)
    else:
        raw = eq_quantize(w, fmt)
        want_w = gg_dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float64)
    return K.repack(raw, fmt, (n_out, n_in), device=DEV), want_w


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "Q6_K", "F16"])
@pytest.mark.parametrize("cfg", [dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=1), dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=3)])
def test_skinny_swiglu_in_the_gemm_epilogue(rng, monkeypatch, fmt, cfg):
    """A batched decode step's gate|up product with SiLU(gate) * up in its epilogue (each tile holds
    gate row c and up row c side by side): against float64 on the dequantized weights, F (the
    output width) no tile multiple, split-K and not, every output element written; run twice, the
    split-K counters left zero; and the same as the product followed by silu_mul
    (EDGELLM_SKINNY_GLU=0)."""
    import importlib

    linear_mod = importlib.import_module("edgellm.backends.cuda.kernels.linear")
    F, n_in, M = 44, 768, 13
    pw, want_w = _native(rng, monkeypatch, fmt, 2 * F, n_in)
    x = rand(rng, M, n_in)
    gu = x.double().cpu().numpy() @ want_w.T
    want = torch.from_numpy(gu[:, :F] / (1.0 + np.exp(-gu[:, :F])) * gu[:, F:])
    full = dict(BLOCK_M=16, num_warps=4, num_stages=3, **cfg)
    for rep in range(2):
        out = poisoned((M, F))
        K.linear_silu_mul(x, pw, out=out, config=full, decode_max_tokens=4)
        close(out, want, 3e-3, f"{fmt} {cfg} run {rep}")
    _, cnt = linear_mod._splitk_workspace(DEV, M * 2 * F)
    assert not cnt.any(), "split-K left its tile counters dirty"
    monkeypatch.setenv("EDGELLM_SKINNY_GLU", "0")
    apart = poisoned((M, F))
    K.linear_silu_mul(x, pw, out=apart, config=full, decode_max_tokens=4)
    assert (apart.float() - out.float()).abs().max().item() <= 2e-3 * want.abs().max().item()


# -- the rows program of a tiny model on the cuda backend -----------------------------------------
import edgellm  # noqa: E402
from edgellm.sampling import SamplingParams  # noqa: E402
from edgellm.backends.cuda.backend import SKINNY_TUNE_KERNEL  # noqa: E402
from edgellm.session import SlotPool  # noqa: E402
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf  # noqa: E402

# F16 weights: the interpreter runs the quantized GEMVs far slower, and the row-wise ops do not
# depend on the weight format (the linear kernels have tests of their own)
MODELS = {
    "llama-gqa-rope-freqs": SyntheticSpec(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                                          weight_type="F16", rope_freqs=True, std=0.1, seed=31),
    "qwen2-mqa-bias-untied-linear-rope": SyntheticSpec(arch="qwen2", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1,
                                                       ffn_dim=64, vocab_size=64, weight_type="F16", tied=False,
                                                       rope_linear_factor=2.0, std=0.1, seed=32),
}
MODEL_CTX = 24


@pytest.fixture(autouse=True)
def _cuda_device(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("EDGELLM_CUDA_DEVICE", "cpu")


@pytest.mark.parametrize("name", list(MODELS))
def test_slot_pool_decode_on_cuda_matches_cpu_and_each_sequence_alone(name, tmp_path, rng):
    spec = MODELS[name]
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    cpu = edgellm.load(path, backend="cpu", ctx=MODEL_CTX)
    cu = edgellm.load(path, backend="cuda", ctx=MODEL_CTX, prefill_chunk=8)
    pc, pg = SlotPool(cpu, 5), SlotPool(cu, 5)
    assert pg.batch is not None and pg.batch.rows_mode, "the cuda backend should compile the rows program"
    seqs = [rng.integers(0, spec.vocab_size, n).tolist() for n in (4, 2, 6, 1, 5)]
    for pool, m in ((pc, cpu), (pg, cu)):
        for slot, ids in zip(pool.slots, seqs):
            m.forward(ids, 0, all_logits=False, slot=slot)
    # rows in no slot order; 3 rows run as a bucket of 4, 5 as 8 (padding rows), 1 alone; the
    # bucket of 4 twice (on a GPU: captured, then replayed with other positions)
    last = {}
    for rows in ([3, 0, 4], [1, 2, 0, 4, 3], [1], [4, 2, 0]):
        steps_ids = {s: int(rng.integers(0, spec.vocab_size)) for s in rows}
        want = pc.decode([(pc.slots[s], t, len(seqs[s])) for s, t in steps_ids.items()])
        got = pg.decode([(pg.slots[s], t, len(seqs[s])) for s, t in steps_ids.items()])
        assert got.shape == want.shape and np.isfinite(got).all()
        assert np.abs(got - want).max() <= 5e-3 * np.abs(want).max(), f"rows {rows}"
        for s, t in steps_ids.items():
            seqs[s].append(t)
            last[s] = got[rows.index(s)]
        assert all(pg.slots[s].tokens == seqs[s] for s in rows)
    # each sequence alone, from an empty cache, on the single-sequence programs: the same logits
    for s, ids in enumerate(seqs):
        alone = cu.forward(ids, 0, all_logits=False)[-1]
        assert np.abs(alone - last[s]).max() <= 5e-3 * np.abs(alone).max(), f"slot {s}"
    # decode_tokens: the argmax of every row on the device, logits only where asked
    steps = [(pg.slots[s], 5, len(seqs[s])) for s in (2, 4)]
    tokens, logits = pg.decode_tokens(steps, [False, True])
    full = pg.decode(steps)  # the same step again: the same cache rows, the same logits
    assert tokens.tolist() == full.argmax(-1).tolist() and list(logits) == [1]
    np.testing.assert_allclose(logits[1], full[1], rtol=0, atol=1e-6)


def _watch_steps(s) -> list:
    """Each decode step the scheduler s starts, as (rows, rows reading their logits back, draws).
    On a GPU the steps overlap the delivery of the previous step's tokens."""
    seen = []
    decode_start = s.pool.decode_start
    s.pool.decode_start = lambda steps, need, draws=None: seen.append((len(steps), sum(need), draws)) or \
        decode_start(steps, need, draws)
    return seen


def _listener(events, done, i):
    """A request's event callback: its events into events[i], done[i] set at the final one."""
    from edgellm.serve.scheduler import Piece

    def on(ev):
        events[i].append(ev)
        if not isinstance(ev, Piece):
            done[i].set()
    return on


def test_scheduler_on_cuda_batches_greedy_requests_like_each_alone(tmp_path):
    """The server's scheduler on the cuda backend: concurrent greedy requests share batched steps
    (argmax on the device; the one asking for logprobs reads its logits) and each gets the
    tokens it gets alone."""
    import threading

    from edgellm.serve.scheduler import Done, Piece, Request, Scheduler
    from edgellm.synthetic import byte_bpe_vocab

    spec = SyntheticSpec(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=416,
                         weight_type="F16", std=0.1, seed=33)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec, byte_bpe_vocab(416))
    m = edgellm.load(path, backend="cuda", ctx=MODEL_CTX, prefill_chunk=8)
    s = Scheduler(m, 3, chunk=32)
    steps_seen = _watch_steps(s)
    prompts = [m.tokenizer.encode(t) for t in ("the sea", "a robot", "one")]
    events = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    for i, ids in enumerate(prompts):  # queued before the loop starts: they run together
        s.submit(Request(ids, 4, SamplingParams(temperature=0), ignore_eos=True, logprobs=0 if i == 1 else None,
                         on_event=_listener(events, done, i)))
    s.start()
    try:
        assert all(d.wait(300) for d in done)
    finally:
        s.stop()
    rows_seen = [(n, k) for n, k, _ in steps_seen]
    assert (3, 1) in rows_seen, f"no batched step of all three (steps: {rows_seen})"
    for ids, evs in zip(prompts, events):
        assert isinstance(evs[-1], Done) and evs[-1].completion_tokens == 4
        got = [t for e in evs if isinstance(e, Piece) for t in e.tokens]
        want = [int(np.argmax(m.forward(ids, 0, all_logits=False)[-1]))]
        for k in range(3):
            want.append(int(np.argmax(m.forward(want[-1:], len(ids) + k, all_logits=False)[-1])))
        assert got == want


def test_scheduler_on_cuda_draws_sampled_rows_on_the_device(tmp_path):
    """Sampled requests in batched steps on cuda: their tokens are drawn on the device (no logits
    read back, so the steps chain), each within its request's top-k of the logits the model gives
    for that sequence, and a seeded request gets the same tokens alone and in a batch."""
    import threading

    from edgellm.serve.scheduler import Done, Piece, Request, Scheduler
    from edgellm.synthetic import byte_bpe_vocab

    spec = SyntheticSpec(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=416,
                         weight_type="F16", std=0.1, seed=34)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec, byte_bpe_vocab(416))
    m = edgellm.load(path, backend="cuda", ctx=MODEL_CTX, prefill_chunk=8)
    prompts = [m.tokenizer.encode(t) for t in ("the sea", "a robot", "one")]
    params = [SamplingParams(temperature=1.2, top_k=4, top_p=1.0, min_p=0.0, seed=11),
              SamplingParams(temperature=0.9, top_k=0, top_p=0.9, min_p=0.0, seed=12),
              SamplingParams(temperature=0)]

    def serve(which):
        s = Scheduler(m, 3, chunk=32)
        seen = _watch_steps(s)
        events = {i: [] for i in which}
        done = {i: threading.Event() for i in which}
        for i in which:
            s.submit(Request(prompts[i], 5, params[i], ignore_eos=True, on_event=_listener(events, done, i)))
        s.start()
        try:
            assert all(d.wait(300) for d in done.values())
        finally:
            s.stop()
        for i in which:
            assert isinstance(events[i][-1], Done) and events[i][-1].completion_tokens == 5
        return {i: [t for e in events[i] if isinstance(e, Piece) for t in e.tokens] for i in which}, seen

    together, seen = serve([0, 1, 2])
    batched = [(n, k, d) for n, k, d in seen if n == 3]
    assert batched and all(k == 0 for _, k, _ in batched), "sampled rows should not read their logits back"
    assert [d is None for d in batched[0][2]] == [False, False, True]
    for i in (0, 1):  # all positions' logits from one prefill of the prompt and the answer
        logits = m.forward(prompts[i] + together[i][:-1], 0, all_logits=True)[len(prompts[i]) - 1:]
        for tok, row in zip(together[i], logits):
            order = np.argsort(-row)
            if params[i].top_k:
                assert tok in order[:params[i].top_k]
            else:  # within the top-p 0.9 nucleus
                probs = np.exp(row[order] - row.max())
                assert tok in order[:int(np.searchsorted(np.cumsum(probs / probs.sum()), 0.9)) + 2]
    alone, _ = serve([0])
    assert alone[0] == together[0]


@pytest.mark.skipif(not CUDA, reason="the tuner times kernels on a GPU (the cpu device has none)")
def test_rows_program_tunes_its_skinny_products_and_matches_the_defaults(tmp_path, rng, monkeypatch):
    """With tuning on, a rows program times the skinny GEMM's candidates for each row bucket past
    the GEMV (configs.skinny_candidates) and caches the picks; its steps give the logits of the
    same program with the default tiles (EDGELLM_TUNE=0)."""
    spec = SyntheticSpec(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=320,
                         weight_type="Q4_0", std=0.05, seed=34)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path / "cache"))
    logits = {}
    for tune in ("1", "0"):
        monkeypatch.setenv("EDGELLM_TUNE", tune)
        m = edgellm.load(path, backend="cuda", ctx=MODEL_CTX, prefill_chunk=8)
        pool = SlotPool(m, 16)
        picks = [p for p in m.backend.tuner.report() if p["kernel"] == SKINNY_TUNE_KERNEL]
        if tune == "1":
            assert {p["key"][3] for p in picks} == {8, 16}, picks  # the buckets of 5-8 and 9-16 rows
            assert all(p["source"] in ("tuned", "cached") for p in picks)
        else:
            assert not picks or all(p["source"] == "default" for p in picks)
        seqs = [rng.integers(0, spec.vocab_size, 3).tolist() for _ in range(16)] if tune == "1" else seqs
        for slot, ids in zip(pool.slots, seqs):
            m.forward(ids, 0, all_logits=False, slot=slot)
        logits[tune] = pool.decode([(slot, 7, 3) for slot in pool.slots])
    assert np.isfinite(logits["1"]).all()
    assert np.abs(logits["1"] - logits["0"]).max() <= 5e-3 * np.abs(logits["0"]).max()


def test_warmup_steps_at_every_attention_split_count(tmp_path, monkeypatch):
    """step_shapes finds, for each row count, every attention split count that a position of the
    context gives and the first position giving it (against all positions one by one), for the
    rows program and the single-sequence decode program; SlotPool.warmup runs a step at each split
    count once (besides the first and last positions of every row count it runs)."""
    from edgellm.backends.cuda.kernels import configs

    monkeypatch.setenv("EDGELLM_ROWS_ATTN_KEYS", "4")  # several split counts within MODEL_CTX positions
    monkeypatch.setattr(configs, "ATTN_DECODE_KEYS_PER_SPLIT", 8)
    path = write_synthetic_gguf(tmp_path / "m.gguf", MODELS["llama-gqa-rope-freqs"])
    m = edgellm.load(path, backend="cuda", ctx=MODEL_CTX, prefill_chunk=8)
    pool = SlotPool(m, 5)
    rows, single = pool.batch, pool.slots[0].programs["decode"]
    assert [min(5, rows.row_bucket(k)) for k in range(1, 6)] == [1, 2, 4, 4, 5]
    expected_steps, warmed = 0, set()
    for count in (1, 2, 4, 5):  # the row counts the warmup runs
        program = rows if count > 1 else single
        shapes = program.step_shapes(count, MODEL_CTX)
        if count > 1:
            every = [program._row_splits(program.row_bucket(count), p + 1) for p in range(MODEL_CTX)]
        else:
            every = [program._context_splits(p + 1) for p in range(MODEL_CTX)]
        assert shapes == {s: every.index(s) for s in sorted(set(every))}, (count, shapes, every)
        if count == 2:
            assert len(shapes) >= 3, shapes  # the test exercises several split counts
        positions = {0, MODEL_CTX - 1}
        for s, p in sorted(shapes.items()):
            if (count > 1, s) not in warmed:
                warmed.add((count > 1, s))
                positions.add(p)
        expected_steps += len(positions)
    assert pool.warmup() == expected_steps
