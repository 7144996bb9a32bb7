"""RoPE on Q and K fused with the KV-cache write: one launch reads q, k, v once, writes the rotated
q and writes rotated k and v straight into their rows of the preallocated caches.

The same kernel serves the batched decode step of several sequences (rows mode, `positions` and
`bases` given): row t is its own sequence, rotated at positions[t] and stored at cache row
bases[t] + positions[t]; a row with a negative position is padding (its K/V are not stored)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton.language as tl

from . import configs
from ._common import check_2d, int_or_tensor, jit, next_pow2, out_buffer, pdl, pdl_prologue


@jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, stride_q, stride_k, stride_v, qo_ptr, stride_qo,
                 kc_ptr, vc_ptr, stride_c, pos_ptr, start_pos, ff_ptr, log2_theta,
                 H, base_ptr, ring_rows, pos_scale, mscale,
                 HEAD_DIM: tl.constexpr, N_ROT: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
                 D_PAD: tl.constexpr, NEOX: tl.constexpr, POS_FROM_PTR: tl.constexpr, HAS_FF: tl.constexpr,
                 ROWS: tl.constexpr, RING: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)  # 0..H-1: query heads; H..H+HKV-1: key/value heads
    if ROWS:  # row t is its own sequence: its own position and cache slot (base)
        pos = tl.load(pos_ptr + t).to(tl.int32)
    elif POS_FROM_PTR:
        pos = tl.load(pos_ptr).to(tl.int32) + t
    else:
        pos = start_pos + t
    i = tl.arange(0, HALF_PAD)
    im = i < N_ROT // 2
    if SCALED:  # linear position scaling, and long-RoPE's attention factor on cos and sin
        cs, sn = rope_cos_sin(pos.to(tl.float32) * pos_scale, i, im, ff_ptr, log2_theta, N_ROT, HAS_FF)
        cs, sn = cs * mscale, sn * mscale
    else:
        cs, sn = rope_cos_sin(pos, i, im, ff_ptr, log2_theta, N_ROT, HAS_FF)
    if NEOX:
        o1 = i
        o2 = i + N_ROT // 2
    else:
        o1 = 2 * i
        o2 = 2 * i + 1
    t64 = t.to(tl.int64)
    # two calls rather than one call on selected pointers: q and the cache may differ in dtype
    if h < H:
        _rotate_head(q_ptr + t64 * stride_q + h * HEAD_DIM, qo_ptr + t64 * stride_qo + h * HEAD_DIM,
                     cs, sn, o1, o2, im, t >= 0, HEAD_DIM, N_ROT, REST_PAD)
    else:
        kvh = h - H
        if ROWS:  # a padding row (pos < 0) stores nothing
            keep = pos >= 0
            row = (tl.load(base_ptr + t).to(tl.int64) + tl.maximum(pos, 0)) * stride_c + kvh * HEAD_DIM
        elif RING:  # a sliding-window layer's ring cache: position p in row p mod ring_rows
            keep = t >= 0
            row = (pos % ring_rows).to(tl.int64) * stride_c + kvh * HEAD_DIM
        else:
            keep = t >= 0
            row = pos.to(tl.int64) * stride_c + kvh * HEAD_DIM
        _rotate_head(k_ptr + t64 * stride_k + kvh * HEAD_DIM, kc_ptr + row,
                     cs, sn, o1, o2, im & keep, keep, HEAD_DIM, N_ROT, REST_PAD)
        dd = tl.arange(0, D_PAD)
        dm = (dd < HEAD_DIM) & keep
        vv = tl.load(v_ptr + t64 * stride_v + kvh * HEAD_DIM + dd, mask=dm, other=0.0)
        tl.store(vc_ptr + row + dd, vv.to(vc_ptr.dtype.element_ty), mask=dm)


@jit
def rope_cos_sin(pos, i, im, ff_ptr, log2_theta, N_ROT: tl.constexpr, HAS_FF: tl.constexpr):
    """cos and sin of pos * theta^(-2i/N_ROT) [/ ff[i]] for pair indices i (masked by im); pos may
    be a scalar or a tensor shaped like i. Shared by this kernel and the GEMV's RoPE epilogue."""
    inv_freq = tl.exp2(i.to(tl.float32) * (-2.0 / N_ROT) * log2_theta)
    if HAS_FF:
        inv_freq = inv_freq / tl.load(ff_ptr + i, mask=im, other=1.0).to(tl.float32)
    ang = pos.to(tl.float32) * inv_freq
    # reduce to [-pi, pi] so that fast sin/cos stay accurate at large positions; 2*pi is split as
    # 6.28125 (exact in 8 bits, so n * 6.28125 is exact for n < 2**16) + 0.00193530717958647...
    n = tl.floor(ang * 0.15915494309189535 + 0.5)
    ang = ang - n * 6.28125 - n * 0.0019353071795864769
    return tl.cos(ang), tl.sin(ang)


@jit
def _rotate_head(src, dst, cs, sn, o1, o2, im, keep, HEAD_DIM: tl.constexpr, N_ROT: tl.constexpr,
                 REST_PAD: tl.constexpr):
    x1 = tl.load(src + o1, mask=im, other=0.0).to(tl.float32)
    x2 = tl.load(src + o2, mask=im, other=0.0).to(tl.float32)
    tl.store(dst + o1, (x1 * cs - x2 * sn).to(dst.dtype.element_ty), mask=im)
    tl.store(dst + o2, (x2 * cs + x1 * sn).to(dst.dtype.element_ty), mask=im)
    if N_ROT < HEAD_DIM:  # partial rotary: the remaining dimensions pass through
        r = N_ROT + tl.arange(0, REST_PAD)
        rm = (r < HEAD_DIM) & keep
        tl.store(dst + r, tl.load(src + r, mask=rm, other=0.0).to(dst.dtype.element_ty), mask=rm)


def rope_qkv_cache(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos,
                   n_heads: int, n_kv_heads: int, head_dim: int, *, theta: float = 10000.0, style: str = "norm",
                   freq_factors: torch.Tensor | None = None, n_rot: int | None = None,
                   q_out: torch.Tensor | None = None, config: dict | None = None,
                   positions: torch.Tensor | None = None, bases: torch.Tensor | None = None,
                   ring: bool = False, pos_scale: float = 1.0, mscale: float = 1.0) -> torch.Tensor:
    """Rotate Q and K of T tokens at positions start_pos..start_pos+T-1 and store K, V in the caches.

    q [T, n_heads*head_dim], k and v [T, n_kv_heads*head_dim]; or k = v = None and q the fused
    [T, (n_heads + 2*n_kv_heads)*head_dim] projection (q | k | v columns). Caches are
    [ctx, n_kv_heads*head_dim]; rows start_pos.. are written in place. start_pos is an int or a
    one-element int tensor on the device (read by the kernel, so a CUDA graph can replay it).
    style "norm": rotate pairs (x[2i], x[2i+1]) (llama GGUF); "neox": pairs (x[i], x[i+n_rot/2]).
    Frequencies are theta^(-2i/n_rot), divided by freq_factors[i] when given (llama 3 scaling).
    Positions are multiplied by pos_scale (linear scaling) and cos/sin by mscale (long-RoPE's
    attention factor). ring: the caches are rings (a sliding-window layer's), position p written
    to row p mod their rows. Only the first n_rot (default head_dim) dimensions rotate. Returns the rotated q
    (q_out, or a new [T, n_heads*head_dim] tensor; q_out may be q itself to rotate in place).

    Rows mode (positions and bases, int32 device tensors of at least T entries; start_pos unused):
    each row t is a different sequence, rotated at positions[t], its K and V stored at cache row
    bases[t] + positions[t]; rows with positions[t] < 0 are padding and store nothing.
    """
    H, HKV, D = int(n_heads), int(n_kv_heads), int(head_dim)
    check_2d(q, "q")
    T = q.shape[0]
    if k is None and v is None:
        if q.shape[1] != (H + 2 * HKV) * D:
            raise ValueError(f"fused qkv has width {q.shape[1]}, expected (n_heads + 2*n_kv_heads)*head_dim = "
                             f"{(H + 2 * HKV) * D}")
        qkv = q
        q, k, v = qkv[:, :H * D], qkv[:, H * D:(H + HKV) * D], qkv[:, (H + HKV) * D:]
    elif k is None or v is None:
        raise ValueError("give both k and v, or neither (fused qkv)")
    else:
        check_2d(k, "k")
        check_2d(v, "v")
        if q.shape[1] != H * D or k.shape != (T, HKV * D) or v.shape != (T, HKV * D):
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match "
                             f"T={T}, n_heads={H}, n_kv_heads={HKV}, head_dim={D}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_2d(c, name)
        if c.shape[1] != HKV * D:
            raise ValueError(f"{name} has width {c.shape[1]}, expected n_kv_heads*head_dim = {HKV * D}")
    if k_cache.shape != v_cache.shape or k_cache.stride(0) != v_cache.stride(0):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in layout")
    n_rot = _rope_args(D, n_rot, style, freq_factors)
    rows = positions is not None
    if rows:
        if ring:
            raise ValueError("rows mode does not take ring caches")
        _check_rows(T, q, positions=positions, bases=bases)
        pos_ptr, pos_val, from_ptr = positions, 0, True
    else:
        pos_ptr, pos_val, from_ptr = int_or_tensor(start_pos, q, "start_pos")
        if ring and T > k_cache.shape[0]:
            raise ValueError(f"{T} tokens do not fit in a ring KV cache of {k_cache.shape[0]} rows")
        if not ring and not from_ptr and not 0 <= pos_val <= k_cache.shape[0] - T:
            raise ValueError(f"tokens {pos_val}..{pos_val + T - 1} do not fit in a KV cache of {k_cache.shape[0]} rows")
    q_out = out_buffer(q_out, (T, H * D), q.dtype, q.device, "q_out")
    if T == 0:
        return q_out
    cfg = {**configs.ROPE_DEFAULT, **(config or {})}
    ff = freq_factors if freq_factors is not None else q
    _rope_kernel[(T, H + HKV)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), q_out, q_out.stride(0),
        k_cache, v_cache, k_cache.stride(0), pos_ptr, pos_val, ff, math.log2(theta), H,
        bases if rows else pos_ptr, k_cache.shape[0], float(pos_scale), float(mscale),
        HEAD_DIM=D, N_ROT=n_rot, HALF_PAD=next_pow2(n_rot // 2), REST_PAD=next_pow2(max(1, D - n_rot)),
        D_PAD=next_pow2(D), NEOX=style == "neox", POS_FROM_PTR=from_ptr, HAS_FF=freq_factors is not None,
        ROWS=rows, RING=bool(ring), SCALED=pos_scale != 1.0 or mscale != 1.0, num_warps=cfg["num_warps"], **pdl())
    return q_out


def _rope_args(D: int, n_rot, style: str, freq_factors) -> int:
    """The rotated dimensions (n_rot, default head_dim D), with the style and frequency factors
    checked against them."""
    n_rot = D if n_rot is None else int(n_rot)
    if n_rot % 2 or not 0 < n_rot <= D:
        raise ValueError(f"n_rot={n_rot} must be even and in (0, head_dim={D}]")
    if style not in ("norm", "neox"):
        raise ValueError(f"rope style must be 'norm' or 'neox', got {style!r}")
    if freq_factors is not None and freq_factors.numel() != n_rot // 2:
        raise ValueError(f"freq_factors has {freq_factors.numel()} elements, expected n_rot/2 = {n_rot // 2}")
    return n_rot


def _check_rows(T: int, like: torch.Tensor, **index) -> None:
    """Per-row index tensors (positions, bases) of a rows-mode launch: int32/int64 on like's device,
    at least T entries."""
    for name, t in index.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got "
                             f"{type(t).__name__ if not isinstance(t, torch.Tensor) else (t.dtype, tuple(t.shape))}")
        if t.numel() < T or t.device != like.device:
            raise ValueError(f"{name} has {t.numel()} entries on {t.device}, expected at least {T} on {like.device}")


def rope_rows(x: torch.Tensor, positions: torch.Tensor, n_heads: int, head_dim: int, *, theta: float = 10000.0,
              style: str = "norm", freq_factors: torch.Tensor | None = None, n_rot: int | None = None,
              out: torch.Tensor | None = None, config: dict | None = None, pos_scale: float = 1.0) -> torch.Tensor:
    """RoPE of x [T, n_heads*head_dim], row t at its own position positions[t] (the rope_rows op:
    each row a different sequence's decode token). Arguments as rope_qkv_cache; nothing is stored."""
    H, D = int(n_heads), int(head_dim)
    check_2d(x, "x")
    T = x.shape[0]
    if x.shape[1] != H * D:
        raise ValueError(f"x has width {x.shape[1]}, expected n_heads*head_dim = {H * D}")
    n_rot = _rope_args(D, n_rot, style, freq_factors)
    _check_rows(T, x, positions=positions)
    out = out_buffer(out, (T, H * D), x.dtype, x.device)
    if T == 0:
        return out
    cfg = {**configs.ROPE_DEFAULT, **(config or {})}
    ff = freq_factors if freq_factors is not None else x
    # query heads only (no key/value heads: grid axis 1 is H), so the caches are never touched
    _rope_kernel[(T, H)](
        x, x, x, x.stride(0), x.stride(0), x.stride(0), out, out.stride(0),
        out, out, 0, positions, 0, ff, math.log2(theta), H, positions, 1, float(pos_scale), 1.0,
        HEAD_DIM=D, N_ROT=n_rot, HALF_PAD=next_pow2(n_rot // 2), REST_PAD=next_pow2(max(1, D - n_rot)),
        D_PAD=next_pow2(D), NEOX=style == "neox", POS_FROM_PTR=True, HAS_FF=freq_factors is not None,
        ROWS=True, RING=False, SCALED=pos_scale != 1.0, num_warps=cfg["num_warps"], **pdl())
    return out


@dataclass
class RopeStore:
    """rope_qkv_cache's arguments, for a kernel that produces the fused q|k|v projection and
    rotates/stores it in its epilogue (linear(..., rope=RopeStore(...)))."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    start_pos: object  # int or one-element int tensor on the device
    n_heads: int
    n_kv_heads: int
    head_dim: int
    theta: float = 10000.0
    style: str = "norm"
    freq_factors: torch.Tensor | None = None
    n_rot: int | None = None
    q_out: torch.Tensor | None = None

    @property
    def rot_dims(self) -> int:
        return self.head_dim if self.n_rot is None else int(self.n_rot)

    def checked(self, T: int, width: int, like: torch.Tensor) -> "RopeStore":
        """Validate against a [T, width] projection (by running rope_qkv_cache's checks on an empty
        view) and return a copy whose q_out is allocated."""
        H, HKV, D = int(self.n_heads), int(self.n_kv_heads), int(self.head_dim)
        if width != (H + 2 * HKV) * D:
            raise ValueError(f"fused qkv has width {width}, expected (n_heads + 2*n_kv_heads)*head_dim = "
                             f"{(H + 2 * HKV) * D}")
        q_out = out_buffer(self.q_out, (T, H * D), self.k_cache.dtype,
                           like.device, "q_out")
        probe = torch.empty((0, width), dtype=q_out.dtype, device=like.device)
        rope_qkv_cache(probe, None, None, self.k_cache, self.v_cache, self.start_pos, H, HKV, D, theta=self.theta,
                       style=self.style, freq_factors=self.freq_factors, n_rot=self.n_rot, q_out=q_out[:0])
        if not isinstance(self.start_pos, torch.Tensor) and not 0 <= int(self.start_pos) <= self.k_cache.shape[0] - T:
            raise ValueError(f"tokens {self.start_pos}..{int(self.start_pos) + T - 1} do not fit in a KV cache of "
                             f"{self.k_cache.shape[0]} rows")
        return replace(self, q_out=q_out)

    def fusable(self, like: torch.Tensor) -> bool:
        """Whether a GEMV epilogue can do it: adjacent pairs, and q_out and the caches of one dtype."""
        return (self.style == "norm" and self.q_out.dtype == self.k_cache.dtype == self.v_cache.dtype
                and self.q_out.stride(1) == 1)

    def apply(self, qkv: torch.Tensor) -> torch.Tensor:
        return rope_qkv_cache(qkv, None, None, self.k_cache, self.v_cache, self.start_pos, self.n_heads,
                              self.n_kv_heads, self.head_dim, theta=self.theta, style=self.style,
                              freq_factors=self.freq_factors, n_rot=self.n_rot, q_out=self.q_out)


@jit
def _store_rows_kernel(x_ptr, stride_x, c_ptr, stride_c, pos_ptr, base_ptr, F, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_prologue(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dst = c_ptr + (tl.load(base_ptr + t).to(tl.int64) + tl.maximum(pos, 0)) * stride_c
    src = x_ptr + t.to(tl.int64) * stride_x
    for f0 in range(0, F, BLOCK):
        f = f0 + tl.arange(0, BLOCK)
        fm = (f < F) & (pos >= 0)  # a padding row (pos < 0) stores nothing
        tl.store(dst + f, tl.load(src + f, mask=fm, other=0.0).to(c_ptr.dtype.element_ty), mask=fm)


def kv_store_rows(cache: torch.Tensor, x: torch.Tensor, bases: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The kv_store_rows op: cache row bases[t] + positions[t] := x[t] for each row t of x [T, F]
    (rows with positions[t] < 0 are padding and store nothing). Returns the cache."""
    check_2d(cache, "cache")
    check_2d(x, "x")
    T, F = x.shape
    if cache.shape[1] != F:
        raise ValueError(f"x has {F} features, the cache {cache.shape[1]}")
    _check_rows(T, x, positions=positions, bases=bases)
    if T:
        _store_rows_kernel[(T,)](x, x.stride(0), cache, cache.stride(0), positions, bases, F,
                                 BLOCK=min(1024, next_pow2(F)), num_warps=1, **pdl())
    return cache
