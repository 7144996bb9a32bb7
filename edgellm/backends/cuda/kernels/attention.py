"""Attention over the preallocated KV cache, with grouped-query heads (GQA).

Both kernels give one program all G = n_heads / n_kv_heads query heads of one KV head, for one
or several tokens: the program's query rows are (token, head-in-group) pairs, so each K/V tile is
loaded once for the whole group and multiplied with tl.dot on the tensor cores.

Decode is flash-decoding: the context is cut into n_splits chunks processed by separate programs,
each writing a partial (unnormalised output, running max, running sum); a second kernel combines
them. The grid depends only on n_splits (fixed per device and model), never on the sequence
length: the chunk length is computed on the device from seq_len, which may be read from a device
tensor, so one captured CUDA graph serves every step. Splits past seq_len do no work.

Causality: query t of T attends to the keys of positions 0..pos(t), pos(t) = start + t, where
start is start_pos (prefill) or seq_len - T (decode). window > 0 limits that to the last `window`
positions, and the key of position j is read from row j mod (cache rows): a sliding-window layer's
cache may be a ring shorter than the context (ModelConfig.kv_rows), holding the last rows written.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from . import configs
from ._common import (check_2d, device_key, device_sm_count, int_or_tensor, jit, made_once, next_pow2, out_buffer,
                      pdl, pdl_prologue)
from .norm import store_int8_tile
from .rope import rope_cos_sin

_LOG2E = 1.4426950408889634


@jit
def _attn_tiles(q, kc_ptr, vc_ptr, stride_c, kvh, lo, hi, pos, scale_log2, window, acc, m_i, l_i,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                ring_rows=1, RING: tl.constexpr = False):
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    kbase = kc_ptr + kvh * HEAD_DIM
    vbase = vc_ptr + kvh * HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nm = n < hi
        if RING:  # position n lives in row n mod ring_rows
            n64 = (n % ring_rows).to(tl.int64)
        else:
            n64 = n.to(tl.int64)
        kt = tl.load(kbase + n64[None, :] * stride_c + d[:, None], mask=dm[:, None] & nm[None, :], other=0.0)
        s = tl.dot(q, kt) * scale_log2
        vis = nm[None, :] & (n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            vis = vis & (n[None, :] > pos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vbase + n64[:, None] * stride_c + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@jit
def _attn_decode_split_kernel(q_ptr, stride_q, kc_ptr, vc_ptr, stride_c, po_ptr, pml_ptr,
                              seq_ptr, seq_val, T, H, scale_log2, window, ring_rows,
                              G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_SPLITS: tl.constexpr,
                              SEQ_FROM_PTR: tl.constexpr, HAS_WINDOW: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    pm = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if SEQ_FROM_PTR:
        seq_len = tl.load(seq_ptr).to(tl.int32)
    else:
        seq_len = seq_val
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)  # row = token * G + head-in-group
    rmask = rows < T * G
    t = rows // G
    h = kvh * G + rows % G
    pos = seq_len - T + t
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    q = tl.load(q_ptr + t.to(tl.int64)[:, None] * stride_q + h[:, None] * HEAD_DIM + d[None, :],
                mask=rmask[:, None] & dm[None, :], other=0.0).to(kc_ptr.dtype.element_ty)
    chunk = tl.cdiv(tl.cdiv(seq_len, N_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    if HAS_WINDOW:
        lo = tl.maximum(lo, seq_len - T - window + 1)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attn_tiles(q, kc_ptr, vc_ptr, stride_c, kvh, lo, hi, pos, scale_log2, window, acc, m_i, l_i,
                                HEAD_DIM, BLOCK_D, BLOCK_N, HAS_WINDOW, ring_rows, HAS_WINDOW)
    part = ((t * H + h) * N_SPLITS + split).to(tl.int64)  # partial index of (token, head, split)
    tl.store(po_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=rmask[:, None] & dm[None, :])
    tl.store(pml_ptr + part * 2, m_i, mask=rmask)
    tl.store(pml_ptr + part * 2 + 1, l_i, mask=rmask)


@jit
def _attn_decode_reduce_kernel(po_ptr, pml_ptr, out_ptr, stride_o, seq_ptr, seq_val, H,
                               xq_ptr, xd_ptr, xs_ptr,
                               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                               N_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, SEQ_FROM_PTR: tl.constexpr,
                               QUANT: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    r = tl.program_id(0)  # token * H + head
    t = r // H
    h = r % H
    if SEQ_FROM_PTR:
        seq_len = tl.load(seq_ptr).to(tl.int32)
    else:
        seq_len = seq_val
    chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len, N_SPLITS), BLOCK_N) * BLOCK_N, BLOCK_N)
    n_active = tl.cdiv(seq_len, chunk)
    s = tl.arange(0, SPLITS_PAD)
    sm = (s < n_active) & (s < N_SPLITS)
    part = r.to(tl.int64) * N_SPLITS + s
    m = tl.load(pml_ptr + part * 2, mask=sm, other=float("-inf"))
    l = tl.load(pml_ptr + part * 2 + 1, mask=sm, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(sm, tl.exp2(m - m_max), 0.0)
    total = tl.sum(w * l, axis=0)
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    o = tl.load(po_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    y = res.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + h * HEAD_DIM + d, y, mask=dm)
    if QUANT:  # the int8 copy the output projection reads (a whole head is whole 32-blocks)
        zero = tl.zeros([1], dtype=tl.int32)
        store_int8_tile(y[None, :], zero + t, zero + h * HEAD_DIM, H * HEAD_DIM, zero == 0, xq_ptr, xd_ptr, xs_ptr,
                        HEAD_DIM, 1, BLOCK_D)


@jit
def _attn_prefill_kernel(q_ptr, stride_q, kc_ptr, vc_ptr, stride_c, out_ptr, stride_o,
                         pos_ptr, pos_val, T, scale_log2, window, ring_rows, xq_ptr, xd_ptr, xs_ptr, xq_width,
                         G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         POS_FROM_PTR: tl.constexpr, HAS_WINDOW: tl.constexpr, QUANT: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_prologue(PDL)
    pm = tl.program_id(0)
    kvh = tl.program_id(1)
    if POS_FROM_PTR:
        start_pos = tl.load(pos_ptr).to(tl.int32)
    else:
        start_pos = pos_val
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)  # row = token * G + head-in-group
    rmask = rows < T * G
    t = rows // G
    h = kvh * G + rows % G
    pos = start_pos + t
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    qmask = rmask[:, None] & dm[None, :]
    q = tl.load(q_ptr + t.to(tl.int64)[:, None] * stride_q + h[:, None] * HEAD_DIM + d[None, :],
                mask=qmask, other=0.0).to(kc_ptr.dtype.element_ty)
    t_first = (pm * BLOCK_M) // G
    t_last = tl.minimum(pm * BLOCK_M + BLOCK_M - 1, T * G - 1) // G
    hi = start_pos + t_last + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(start_pos + t_first - window + 1, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attn_tiles(q, kc_ptr, vc_ptr, stride_c, kvh, lo, hi, pos, scale_log2, window, acc, m_i, l_i,
                                HEAD_DIM, BLOCK_D, BLOCK_N, HAS_WINDOW, ring_rows, HAS_WINDOW)
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    y = res.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_o + h[:, None] * HEAD_DIM + d[None, :], y, mask=qmask)
    if QUANT:  # the int8 copy the output projection reads (each row is one whole head)
        store_int8_tile(y, t, h * HEAD_DIM, xq_width, rmask, xq_ptr, xd_ptr, xs_ptr, HEAD_DIM, BLOCK_M, BLOCK_D)


def _xq_args(xq, T: int, width: int, D: int, out: torch.Tensor) -> tuple[tuple, bool]:
    """Kernel arguments for the int8 copy of the output (see quantize_activations), or dummies."""
    if xq is None:
        return (out, out, out), False
    if xq.shape != (T, width) or D % 32:
        raise ValueError(f"attention: xq holds activations of shape {xq.shape}, expected {(T, width)} "
                         f"with a head_dim ({D}) that is a multiple of 32")
    return (xq.xq, xq.xd, xq.xs), True


def _check_attn(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim):
    check_2d(q, "q")
    H, HKV = int(n_heads), int(n_kv_heads)
    if H % HKV:
        raise ValueError(f"n_heads={H} is not a multiple of n_kv_heads={HKV}")
    D = q.shape[1] // H if head_dim is None else int(head_dim)
    if q.shape[1] != H * D:
        raise ValueError(f"q has width {q.shape[1]}, expected n_heads*head_dim = {H * D}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_2d(c, name)
        if c.shape[1] != HKV * D:
            raise ValueError(f"{name} has width {c.shape[1]}, expected n_kv_heads*head_dim = {HKV * D}")
    if k_cache.shape != v_cache.shape or k_cache.stride(0) != v_cache.stride(0) or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape, dtype and row stride")
    if k_cache.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"KV caches must be fp16 or bf16, got {k_cache.dtype}")
    return H, HKV, D


def _check_rows(start: int | None, T: int, rows: int, window: int) -> None:
    """Queries at start..start+T-1 (start None: read on the device, unchecked) read keys the cache
    holds: every position up to theirs, or with a window, the window before the first query and the
    T positions after it, position j in row j mod rows (a ring)."""
    if start is None:
        if window and T + window - 1 > rows:
            raise ValueError(f"{T} queries with a window of {window} need {T + window - 1} cache rows, "
                             f"the cache has {rows}")
        return
    if start < 0:
        raise ValueError(f"start position {start} is negative")
    need = min(start, window - 1) + T if window else start + T
    if need > rows:
        raise ValueError(f"tokens {start}..{start + T - 1} read {need} keys; the KV cache has {rows} rows")


def default_decode_splits(q: torch.Tensor, n_kv_heads: int, ctx: int, T: int = 1, n_heads: int | None = None,
                          config: dict | None = None) -> int:
    """The number of context splits attention_decode uses: about two programs per SM."""
    cfg = {**configs.ATTN_DECODE_DEFAULT, **(config or {})}
    if cfg.get("n_splits"):
        return int(cfg["n_splits"])
    G = (n_heads // n_kv_heads) if n_heads else 1
    m_blocks = triton.cdiv(T * G, max(16, next_pow2(T * G)))
    want = triton.cdiv(2 * device_sm_count(q), n_kv_heads * m_blocks)
    return max(1, min(want, triton.cdiv(ctx, cfg["BLOCK_N"]), 128))


def decode_workspace(T: int, n_heads: int, head_dim: int, n_splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial-result buffers for attention_decode (allocate once, reuse across steps)."""
    return (torch.empty((T * n_heads * n_splits * head_dim,), dtype=torch.float32, device=device),
            torch.empty((T * n_heads * n_splits * 2,), dtype=torch.float32, device=device))


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len,
                     n_heads: int, n_kv_heads: int, scale: float | None = None, out: torch.Tensor | None = None,
                     *, head_dim: int | None = None, window: int = 0, workspace=None,
                     config: dict | None = None, xq=None) -> torch.Tensor:
    """Attention of the last T tokens (q [T, n_heads*head_dim], usually T = 1) over cache rows
    0..seq_len-1, causal among the T tokens; seq_len counts the tokens already written to the
    caches, these T included. seq_len is an int or a one-element int tensor on the device.
    xq (a QuantizedActivations [T, n_heads*head_dim]): also write the output quantized to int8 per
    32-block, as quantize_activations(out) would, for the output projection's int8 GEMV."""
    H, HKV, D = _check_attn(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim)
    T = q.shape[0]
    G = H // HKV
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = out_buffer(out, (T, H * D), q.dtype, q.device)
    seq_ptr, seq_val, from_ptr = int_or_tensor(seq_len, q, "seq_len")
    _check_rows(seq_val - T if not from_ptr else None, T, k_cache.shape[0], window)
    if T == 0:
        return out
    cfg = {**configs.ATTN_DECODE_DEFAULT, **(config or {})}
    n_splits = default_decode_splits(q, HKV, k_cache.shape[0], T, H, cfg)
    block_m = max(16, next_pow2(T * G))
    if block_m > 64:
        block_m = 64
    block_d = max(16, next_pow2(D))
    po, pml = workspace if workspace is not None else decode_workspace(T, H, D, n_splits, q.device)
    if po.numel() < T * H * n_splits * D or pml.numel() < T * H * n_splits * 2:
        raise ValueError("attention_decode workspace is too small; make it with decode_workspace()")
    grid = (triton.cdiv(T * G, block_m), HKV, n_splits)
    _attn_decode_split_kernel[grid](q, q.stride(0), k_cache, v_cache, k_cache.stride(0), po, pml,
                                    seq_ptr, seq_val, T, H, scale * _LOG2E, int(window), k_cache.shape[0],
                                    G=G, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
                                    N_SPLITS=n_splits, SEQ_FROM_PTR=from_ptr, HAS_WINDOW=window > 0,
                                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl())
    qa, quant = _xq_args(xq, T, H * D, D, out)
    _attn_decode_reduce_kernel[(T * H,)](po, pml, out, out.stride(0), seq_ptr, seq_val, H, *qa,
                                         QUANT=quant, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_N=cfg["BLOCK_N"], N_SPLITS=n_splits,
                                         SPLITS_PAD=next_pow2(n_splits), SEQ_FROM_PTR=from_ptr,
                                         num_warps=max(1, min(4, block_d // 32)), **pdl())
    return out


def attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos,
                      n_heads: int, n_kv_heads: int, scale: float | None = None, out: torch.Tensor | None = None,
                      *, head_dim: int | None = None, window: int = 0, config: dict | None = None,
                      xq=None, ring: bool = True) -> torch.Tensor:
    """Causal attention of T = q.shape[0] tokens at positions start_pos..start_pos+T-1 over the
    cache rows 0..(own position); the caches must already hold rows 0..start_pos+T-1.
    xq: also write the output's int8 copy (see attention_decode). ring False: the caller knows
    the cache holds every position of the context (no row is reused), so a window does not bound
    T by the cache's rows when start_pos is read on the device."""
    H, HKV, D = _check_attn(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim)
    T = q.shape[0]
    G = H // HKV
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = out_buffer(out, (T, H * D), q.dtype, q.device)
    pos_ptr, pos_val, from_ptr = int_or_tensor(start_pos, q, "start_pos")
    _check_rows(pos_val if not from_ptr else None, T, k_cache.shape[0], window if ring or not from_ptr else 0)
    if T == 0:
        return out
    cfg = {**configs.ATTN_PREFILL_DEFAULT, **(config or {})}
    block_m = cfg["BLOCK_M"]
    grid = (triton.cdiv(T * G, block_m), HKV)
    qa, quant = _xq_args(xq, T, H * D, D, out)
    _attn_prefill_kernel[grid](q, q.stride(0), k_cache, v_cache, k_cache.stride(0), out, out.stride(0),
                               pos_ptr, pos_val, T, scale * _LOG2E, int(window), k_cache.shape[0], *qa, H * D,
                               QUANT=quant, G=G, HEAD_DIM=D, BLOCK_D=max(16, next_pow2(D)), BLOCK_M=block_m,
                               BLOCK_N=cfg["BLOCK_N"], POS_FROM_PTR=from_ptr, HAS_WINDOW=window > 0,
                               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl())
    return out


# ---------------------------------------------------------------------------------------------
# rows: one decode token of each of several sequences (the attention_rows op)
# ---------------------------------------------------------------------------------------------

@jit
def _rope_cols(pos, ff_ptr, log2_theta, pos_scale, BLOCK_D: tl.constexpr, N_ROT: tl.constexpr, NEOX: tl.constexpr,
               HAS_FF: tl.constexpr, SCALED: tl.constexpr):
    """Per column d of a head (1-D, BLOCK_D): its pair partner, whether it is the pair's first, and
    cos / sin of its pair's angle at position pos (1 and 0 from column N_ROT: not rotated), as
    rope_qkv_cache rotates. Computed once a program for its q heads and its key alike."""
    d = tl.arange(0, BLOCK_D)
    if NEOX:  # pairs (i, i + N_ROT / 2)
        first = d < N_ROT // 2
        i = tl.where(first, d, d - N_ROT // 2)
        partner = tl.where(first, d + N_ROT // 2, d - N_ROT // 2)
    else:  # pairs (2i, 2i + 1)
        first = d % 2 == 0
        i = d // 2
        partner = tl.where(first, d + 1, d - 1)
    rot = d < N_ROT
    if SCALED:
        p = pos.to(tl.float32) * pos_scale
    else:
        p = pos
    cs, sn = rope_cos_sin(p, tl.where(rot, i, 0), rot, ff_ptr, log2_theta, N_ROT, HAS_FF)
    cs = tl.where(rot, cs, 1.0)
    sn = tl.where(rot, tl.where(first, -sn, sn), 0.0)  # the sign of the partner's term folded in
    return tl.where(rot, partner, d), cs, sn


@jit
def _rope_tile(ptr, mask, partner, cs, sn, BLOCK_D: tl.constexpr):
    """RoPE of head vectors at ptr + columns (ptr [heads, 1] or a scalar; mask [.., BLOCK_D] as the
    load's) with _rope_cols' partner, cos and signed sin: x * cos + x[partner] * sin, in fp32."""
    d = tl.arange(0, BLOCK_D)[None, :]
    x = tl.load(ptr + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(ptr + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    return x * cs[None, :] + xp * sn[None, :]


@jit
def _attn_rows_kernel(q_ptr, stride_q, kc_ptr, vc_ptr, stride_c, out_ptr, stride_o, po_ptr, pml_ptr,
                      pos_ptr, base_ptr, H, scale_log2, window,
                      k_ptr, v_ptr, stride_kv, ff_ptr, log2_theta, pos_scale, cnt_ptr,
                      G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, N_SPLITS: tl.constexpr, COMBINE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      ROPE: tl.constexpr, N_ROT: tl.constexpr, NEOX: tl.constexpr, HAS_FF: tl.constexpr,
                      SCALED: tl.constexpr, PDL: tl.constexpr):
    """Program (row, kv head, split): the G query heads of one row over its split of the row's own
    keys, cache rows base..base+pos. One split writes the normalised output; several write
    partials that _attn_decode_reduce_kernel combines (a split with no keys writes m = -inf,
    l = 0, which the combine weighs 0), or with COMBINE the last split program of the (row, kv
    head) to finish (cnt_ptr: one int32 counter each, zero between launches). A padding row
    (pos < 0) has no keys: output 0.

    ROPE: q is the projection's, not yet rotated, and the row's own key and value (at pos) are not
    in the cache yet: each program rotates its q heads and the row's key (k_ptr, v_ptr: the
    projection's k and v, row stride stride_kv), takes keys below pos from the cache and the own
    key from registers (in the split that holds pos), and split 0 stores the rotated key and the
    value to cache row base + pos (rope_qkv_cache's rows-mode work, without its launch). No
    program reads that row in this launch."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(pos_ptr + row).to(tl.int32)
    base = tl.load(base_ptr + row).to(tl.int64)
    n_keys = tl.maximum(pos + 1, 0)
    r = tl.arange(0, BLOCK_M)  # query head within the group
    rmask = r < G
    h = kvh * G + r
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    qmask = rmask[:, None] & dm[None, :]
    row64 = row.to(tl.int64)
    if ROPE:
        partner, cs, sn = _rope_cols(pos, ff_ptr, log2_theta, pos_scale, BLOCK_D, N_ROT, NEOX, HAS_FF, SCALED)
        q = _rope_tile(q_ptr + row64 * stride_q + h[:, None] * HEAD_DIM, qmask, partner, cs, sn,
                       BLOCK_D).to(kc_ptr.dtype.element_ty)
    else:
        q = tl.load(q_ptr + row64 * stride_q + h[:, None] * HEAD_DIM + d[None, :], mask=qmask,
                    other=0.0).to(kc_ptr.dtype.element_ty)
    chunk = tl.cdiv(tl.cdiv(n_keys, N_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_keys)
    if HAS_WINDOW:
        lo = tl.maximum(lo, pos - window + 1)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    qpos = tl.zeros([BLOCK_M], dtype=tl.int32) + pos
    kbase = kc_ptr + base * stride_c
    vbase = vc_ptr + base * stride_c
    if ROPE:  # the keys below pos from the cache, the own key below
        acc, m_i, l_i = _attn_tiles(q, kbase, vbase, stride_c, kvh, lo, tl.minimum(hi, pos), qpos, scale_log2,
                                    window, acc, m_i, l_i, HEAD_DIM, BLOCK_D, BLOCK_N, HAS_WINDOW)
        dm2 = dm[None, :]
        kn = _rope_tile(k_ptr + row64 * stride_kv + kvh * HEAD_DIM, dm2, partner, cs, sn,
                        BLOCK_D).to(kc_ptr.dtype.element_ty)
        vn = tl.load(v_ptr + row64 * stride_kv + kvh * HEAD_DIM + d[None, :], mask=dm2,
                     other=0.0).to(vc_ptr.dtype.element_ty)
        own = (pos >= 0) & (pos >= lo) & (pos < hi)
        # one more key, as _attn_tiles takes a tile: fp16 operands, fp32 sums, p rounded as v's type
        s = tl.sum(q.to(tl.float32) * kn.to(tl.float32), axis=1) * scale_log2
        s = tl.where(own & rmask, s, float("-inf"))
        m_new = tl.maximum(m_i, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p.to(vn.dtype).to(tl.float32)[:, None] * vn.to(tl.float32)
        m_i = m_new
        put = dm2 & (pos >= 0) & (split == 0)
        crow = (base + tl.maximum(pos, 0)) * stride_c + kvh * HEAD_DIM
        tl.store(kc_ptr + crow + d[None, :], kn, mask=put)
        tl.store(vc_ptr + crow + d[None, :], vn, mask=put)
    else:
        acc, m_i, l_i = _attn_tiles(q, kbase, vbase, stride_c, kvh, lo, hi, qpos, scale_log2, window, acc, m_i, l_i,
                                    HEAD_DIM, BLOCK_D, BLOCK_N, HAS_WINDOW)
    if N_SPLITS == 1:
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row64 * stride_o + h[:, None] * HEAD_DIM + d[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        part = ((row64 * H + h) * N_SPLITS + split).to(tl.int64)  # partial of (row, head, split)
        tl.store(po_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=qmask)
        tl.store(pml_ptr + part * 2, m_i, mask=rmask)
        tl.store(pml_ptr + part * 2 + 1, l_i, mask=rmask)
        if COMBINE:
            # the program that counts its (row, kv head)'s splits complete combines their partials
            # from L2 in split order (the result does not depend on which finished last), writes
            # the output and zeroes its counter for the next launch: no reduce kernel
            tl.debug_barrier()  # every thread's stores come before the counter's release
            cnt = cnt_ptr + row * tl.num_programs(1) + kvh
            done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if done == N_SPLITS - 1:
                first = ((row64 * H + h) * N_SPLITS).to(tl.int64)
                m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                for sp in range(0, N_SPLITS):
                    m_all = tl.maximum(m_all, tl.load(pml_ptr + (first + sp) * 2, mask=rmask, other=float("-inf"),
                                                      cache_modifier=".cg"))
                m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
                o = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                total = tl.zeros([BLOCK_M], dtype=tl.float32)
                for sp in range(0, N_SPLITS):
                    ps = first + sp
                    w = tl.exp2(tl.load(pml_ptr + ps * 2, mask=rmask, other=float("-inf"), cache_modifier=".cg")
                                - m_all)
                    total += w * tl.load(pml_ptr + ps * 2 + 1, mask=rmask, other=0.0, cache_modifier=".cg")
                    o += w[:, None] * tl.load(po_ptr + ps[:, None] * HEAD_DIM + d[None, :], mask=qmask, other=0.0,
                                              cache_modifier=".cg")
                res = o / tl.where(total > 0, total, 1.0)[:, None]
                tl.store(out_ptr + row64 * stride_o + h[:, None] * HEAD_DIM + d[None, :],
                         res.to(out_ptr.dtype.element_ty), mask=qmask)
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")


def _rows_combine_in_kernel() -> bool:
    """Whether attention_rows' splits are combined by their last program (EDGELLM_ROWS_ATTN_COMBINE=0:
    by the reduce kernel, one launch more)."""
    return os.environ.get("EDGELLM_ROWS_ATTN_COMBINE", "1") != "0"


_counters: dict[tuple, torch.Tensor] = {}
_ones_cache: dict[tuple, torch.Tensor] = {}


def _ones(dev: torch.device, n: int) -> torch.Tensor:
    """A float32 tensor of n ones on dev, made once (a CUDA graph keeps its address)."""
    return made_once(_ones_cache, (device_key(dev), n), lambda: torch.ones(n, dtype=torch.float32, device=dev),
                     "attention_rows' RoPE factors of 1", "prepare_attention_rows(device, n_rot)")


_N_COUNTERS = 1 << 16


def _split_counters(dev: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters (_N_COUNTERS, at least n), one buffer per device made once (a CUDA graph
    keeps its address), shared by the launches (each leaves its counters zero). Keyed by device
    index: "cuda" and "cuda:0" are one device."""
    if n > _N_COUNTERS:
        raise ValueError(f"attention_rows: {n} (row, kv head) pairs split, at most {_N_COUNTERS}")
    return made_once(_counters, device_key(dev), lambda: torch.zeros(_N_COUNTERS, dtype=torch.int32, device=dev),
                     "attention_rows' split counters", "prepare_attention_rows(device)")


def prepare_attention_rows(dev: torch.device, n_rot: int = 0) -> None:
    """Makes attention_rows' per-device constants (the split counters; with n_rot, RoPE factors of
    1 for n_rot rotated dimensions) now, so that a CUDA graph captured later only records launches."""
    _split_counters(dev, 1)
    if n_rot:
        _ones(dev, n_rot // 2)


def rows_splits(q: torch.Tensor, n_rows: int, n_kv_heads: int, max_keys: int, config: dict | None = None) -> int:
    """Context splits of an attention_rows step whose longest row attends to max_keys keys: one
    per configs.ROWS_ATTN_KEYS_PER_SPLIT keys, but no more than fills about
    configs.ROWS_ATTN_PROGRAMS_PER_SM programs per SM (rows x kv heads x splits); the environment's
    EDGELLM_ROWS_ATTN_KEYS and EDGELLM_ROWS_ATTN_PER_SM override them. A CUDA graph is captured
    per (rows, splits)."""
    cfg = {**configs.ATTN_DECODE_DEFAULT, **(config or {})}
    if cfg.get("n_splits"):
        return int(cfg["n_splits"])
    per = int(os.environ.get("EDGELLM_ROWS_ATTN_KEYS", configs.ROWS_ATTN_KEYS_PER_SPLIT))
    per_sm = float(os.environ.get("EDGELLM_ROWS_ATTN_PER_SM", configs.ROWS_ATTN_PROGRAMS_PER_SM))
    want = triton.cdiv(max(int(max_keys), 1), max(1, per))
    cap = max(1, math.ceil(per_sm * device_sm_count(q) / max(1, n_rows * n_kv_heads)))
    return max(1, min(want, cap, 128))


def attention_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                   bases: torch.Tensor, n_heads: int, n_kv_heads: int, scale: float | None = None,
                   out: torch.Tensor | None = None, *, head_dim: int | None = None, window: int = 0,
                   n_splits: int = 1, workspace=None, config: dict | None = None,
                   new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None, theta: float = 10000.0,
                   style: str = "norm", freq_factors: torch.Tensor | None = None, n_rot: int | None = None,
                   pos_scale: float = 1.0) -> torch.Tensor:
    """Decode attention of T rows, each a different sequence (the attention_rows op): q row t
    (q [T, n_heads*head_dim]) attends to cache rows bases[t] .. bases[t] + positions[t] (its own
    slot, up to and including its own position; window > 0: only the last `window` of them).
    positions and bases are int32/int64 device tensors of at least T entries (read by the kernel,
    so a CUDA graph replays any values); a row with positions[t] < 0 is padding and gets zeros.
    n_splits > 1 cuts each row's keys into that many chunks (flash-decoding) and needs a
    workspace from decode_workspace(T, n_heads, head_dim, n_splits).

    new_k, new_v ([T, n_kv_heads*head_dim], a row stride of their own; e.g. views of a q|k|v
    projection): the rows' own keys and values, not yet in the cache, and q not yet rotated. The
    kernel then does rope_qkv_cache's rows-mode work too (RoPE of q and k as theta, style,
    freq_factors, n_rot and pos_scale say; k and v stored at cache row bases[t] + positions[t])."""
    from .rope import _check_rows, _rope_args

    H, HKV, D = _check_attn(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim)
    T = q.shape[0]
    G = H // HKV
    _check_rows(T, q, positions=positions, bases=bases)
    rope = new_k is not None or new_v is not None
    if rope:
        if new_k is None or new_v is None:
            raise ValueError("attention_rows: give both new_k and new_v, or neither")
        for name, t in (("new_k", new_k), ("new_v", new_v)):
            check_2d(t, name)
            if t.shape[0] < T or t.shape[1] != HKV * D:
                raise ValueError(f"attention_rows {name} has shape {tuple(t.shape)}, expected ({T}, {HKV * D})")
        if new_k.stride(0) != new_v.stride(0):
            raise ValueError("attention_rows: new_k and new_v must share a row stride")
        n_rot = _rope_args(D, n_rot, style, freq_factors)
        if freq_factors is None:
            # factors of 1 (exact): their load keeps the cos / sin at one column a thread; computed
            # from arange alone, Triton computed them in the q tile's layout, 16 columns a thread
            # with libdevice's slow-path local arrays (compile_check attn-rows-rope: 765 IMAD, 103
            # local loads against 174 and 6)
            freq_factors = _ones(q.device, n_rot // 2)
    else:
        n_rot = D
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = out_buffer(out, (T, H * D), q.dtype, q.device)
    n_splits = max(1, int(n_splits))
    if T == 0:
        return out
    cfg = {**configs.ATTN_DECODE_DEFAULT, **(config or {})}
    block_d = max(16, next_pow2(D))
    combine = n_splits > 1 and _rows_combine_in_kernel()
    cnt = out
    if n_splits > 1:
        po, pml = workspace if workspace is not None else decode_workspace(T, H, D, n_splits, q.device)
        if po.numel() < T * H * n_splits * D or pml.numel() < T * H * n_splits * 2:
            raise ValueError("attention_rows workspace is too small; make it with decode_workspace()")
        if combine:
            cnt = _split_counters(q.device, T * HKV)
    else:
        po = pml = out
    _attn_rows_kernel[(T, HKV, n_splits)](q, q.stride(0), k_cache, v_cache, k_cache.stride(0), out, out.stride(0),
                                          po, pml, positions, bases, H, scale * _LOG2E, int(window),
                                          new_k if rope else q, new_v if rope else q,
                                          new_k.stride(0) if rope else 0,
                                          freq_factors if freq_factors is not None else q, math.log2(theta),
                                          float(pos_scale), cnt,
                                          G=G, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=max(16, next_pow2(G)),
                                          BLOCK_N=cfg["BLOCK_N"], N_SPLITS=n_splits, COMBINE=combine,
                                          HAS_WINDOW=window > 0,
                                          ROPE=rope, N_ROT=n_rot, NEOX=style == "neox",
                                          HAS_FF=freq_factors is not None, SCALED=pos_scale != 1.0,
                                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl())
    if n_splits > 1 and not combine:
        # every split wrote its partial (empty ones m = -inf): combine all of them, which the
        # reduce kernel does for a "sequence length" of n_splits tiles
        _attn_decode_reduce_kernel[(T * H,)](po, pml, out, out.stride(0), out, n_splits * cfg["BLOCK_N"], H,
                                             out, out, out, QUANT=False,
                                             HEAD_DIM=D, BLOCK_D=block_d, BLOCK_N=cfg["BLOCK_N"], N_SPLITS=n_splits,
                                             SPLITS_PAD=next_pow2(n_splits), SEQ_FROM_PTR=False,
                                             num_warps=max(1, min(4, block_d // 32)), **pdl())
    return out
