"""LayerNorm over the last axis of an N-D tensor in any layout (imported vision networks).

ConvNeXt normalises the channels of an NCHW tensor by transposing it to NHWC, normalising the
last axis and transposing back. On the device the transpose is a view (a permutation of
strides), so the normalised axis has stride H*W and the rows (pixels) stride 1. torch's
layer_norm copies such a view to contiguous first (a second kernel and a round trip through
memory); this kernel reads the rows through their strides instead: each program loads a tile of
BLOCK_R rows x all C columns (consecutive rows are consecutive in memory for the channels-first
view, so the loads stay coalesced), reduces over the columns in fp32 and writes the rows
contiguously ([rows, C], the layout the following linear reads).

With a residual the kernel also adds it first and writes the sum (add_layer_norm: a transformer's
residual add and the next LayerNorm in one pass).

Rows are the leading axes collapsed into at most two groups (outer, inner) with one stride each:
row r sits at (r // R_INNER) * stride_outer + (r % R_INNER) * stride_inner.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import device_sm_count, jit, require_device


@jit
def _layer_norm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, s_ptr, R, C,
                       X_INNER, xs_outer, xs_inner, xs_col, R_INNER, rs_outer, rs_inner, rs_col, eps,
                       HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < R
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    xoff = (rows // X_INNER).to(tl.int64) * xs_outer + (rows % X_INNER).to(tl.int64) * xs_inner
    x = tl.load(x_ptr + xoff[:, None] + cols[None, :].to(tl.int64) * xs_col, mask=mask, other=0.0).to(tl.float32)
    out_off = rows[:, None].to(tl.int64) * C + cols[None, :]
    if HAS_RES:  # s = x + r, written out (the residual stream), then normalised
        roff = (rows // R_INNER).to(tl.int64) * rs_outer + (rows % R_INNER).to(tl.int64) * rs_inner
        r = tl.load(r_ptr + roff[:, None] + cols[None, :].to(tl.int64) * rs_col, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(s_ptr.dtype.element_ty)  # the stored (rounded) sum is what gets normalised
        tl.store(s_ptr + out_off, x, mask=mask)
        x = x.to(tl.float32)
    mean = tl.sum(x, axis=1) / C
    d = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(d * d, axis=1) / C
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = d * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = y + b[None, :]
    tl.store(y_ptr + out_off, y.to(y_ptr.dtype.element_ty), mask=mask)


def row_strides(x: torch.Tensor) -> tuple[int, int, int] | None:
    """(R_INNER, stride_outer, stride_inner) of x's leading axes (all but the last) collapsed into
    at most two groups of one stride each; None when they do not collapse so."""
    dims = [(s, st) for s, st in zip(x.shape[:-1], x.stride()[:-1]) if s != 1]
    groups: list[list[int]] = []  # [size, stride] of each group, outermost first
    for s, st in dims:
        if groups and groups[-1][1] == st * s:
            groups[-1] = [groups[-1][0] * s, st]
        else:
            groups.append([s, st])
    if not groups:
        return 1, 0, 0
    if len(groups) == 1:
        return groups[0][0], 0, groups[0][1]
    if len(groups) == 2:
        return groups[1][0], groups[0][1], groups[1][1]
    return None


def _strided(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    rs = row_strides(x)
    if rs is None:
        x = x.contiguous()
        rs = row_strides(x)
    return x, rs


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None):
    """layer_norm over the last axis of x (any strides: a transposed view is read in place); the
    result is contiguous, of x's shape and dtype. With residual (x's shape, any strides): returns
    (s, layer_norm(s)) for s = x + residual, both contiguous."""
    require_device(x, "layer_norm input")
    c = x.shape[-1]
    if weight.numel() != c or (bias is not None and bias.numel() != c):
        raise ValueError(f"layer_norm: weight {tuple(weight.shape)} / bias {None if bias is None else tuple(bias.shape)} "
                         f"do not match the last axis ({c}) of the input {tuple(x.shape)}")
    if residual is not None and tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"layer_norm: residual {tuple(residual.shape)} is not of the input's shape {tuple(x.shape)}")
    x, (x_inner, xs_outer, xs_inner) = _strided(x)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    s = torch.empty_like(y) if residual is not None else y
    r, (r_inner, rs_outer, rs_inner) = _strided(residual) if residual is not None else (x, (x_inner, xs_outer, xs_inner))
    rows = x.numel() // c if c else 0
    if rows:
        block_c = triton.next_power_of_2(c)
        block_r = max(1, min(64, 4096 // block_c))
        # at least two programs per SM where the rows allow; rows read through a column stride
        # (a transposed view) keep 16 a tile so each column's load covers whole 32-byte sectors
        floor = 16 if x.stride(-1) != 1 else 1
        while block_r > floor and triton.cdiv(rows, block_r) < 2 * device_sm_count(x):
            block_r //= 2
        grid = (triton.cdiv(rows, block_r),)
        _layer_norm_kernel[grid](x, r, weight, bias if bias is not None else weight, y, s, rows, c,
                                 max(x_inner, 1), xs_outer, xs_inner, x.stride(-1),
                                 max(r_inner, 1), rs_outer, rs_inner, r.stride(-1), eps,
                                 residual is not None, bias is not None, BLOCK_R=block_r, BLOCK_C=block_c,
                                 num_warps=4 if block_r * block_c <= 4096 else 8)
    return (s, y) if residual is not None else y
