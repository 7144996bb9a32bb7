"""RMSNorm with the residual add fused in: one read of x and the residual, one write of each result."""

from __future__ import annotations

import torch
import triton.language as tl

from ._common import check_2d, jit, next_pow2, out_buffer, pdl, pdl_prologue


@jit
def _rms_norm_kernel(x_ptr, stride_x, r_ptr, stride_r, w_ptr, out_ptr, stride_o, ro_ptr, stride_ro, D, eps,
                     xq_ptr, xd_ptr, xs_ptr,
                     HAS_RES: tl.constexpr, WRITE_RES: tl.constexpr, QUANT: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    mask = c < D
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(r_ptr + row * stride_r + c, mask=mask, other=0.0).to(tl.float32)
        if WRITE_RES:
            # normalise the sum as stored, so the fused op equals "add, store, then norm"
            xs = x.to(ro_ptr.dtype.element_ty)
            tl.store(ro_ptr + row * stride_ro + c, xs, mask=mask)
            x = xs.to(tl.float32)
    ms = tl.sum(x * x, axis=0) / D
    r = 1.0 / tl.sqrt(ms + eps)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    y = (x * r * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + c, y, mask=mask)
    if QUANT:
        # the row as stored, quantized to int8 per 32-block for the int8-activation GEMVs that read
        # it (quantize_activations' arithmetic; saves them a launch)
        b = tl.reshape(y.to(tl.float32), [BLOCK_D // 32, 32])
        amax = tl.max(tl.abs(b), axis=1)
        inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
        v = b * inv[:, None]
        q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))  # round half away from zero
        kb = tl.arange(0, BLOCK_D // 32)
        bm = kb < D // 32
        tl.store(xq_ptr + row * D + tl.reshape(c, [BLOCK_D // 32, 32]), q.to(tl.int8), mask=bm[:, None])
        d = amax / 127.0
        tl.store(xd_ptr + row * (D // 32) + kb, d, mask=bm)
        tl.store(xs_ptr + row * (D // 32) + kb, d * tl.sum(q, axis=1), mask=bm)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             config: dict | None = None, xq=None) -> torch.Tensor:
    """out = h / sqrt(mean(h^2) + eps) * weight, with h = x + residual (or x alone).

    With a residual and residual_out given, h is stored to residual_out (which may alias x or
    residual, for an in-place update of the residual stream) and the norm is taken of h as stored.
    xq (a QuantizedActivations of out's shape): also write out quantized to int8 per 32-block, as
    quantize_activations(out) would, for linear(..., act_int8=True, xq=xq)."""
    check_2d(x, "x")
    T, D = x.shape
    if weight.numel() != D or not weight.is_contiguous():
        raise ValueError(f"rms_norm weight has {weight.numel()} elements (contiguous), expected {D}")
    if residual is not None:
        check_2d(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    out = out_buffer(out, (T, D), x.dtype, x.device)
    if residual_out is not None:
        residual_out = out_buffer(residual_out, (T, D), x.dtype, x.device, "residual_out")
    if xq is not None and (xq.shape != (T, D) or D % 32):
        raise ValueError(f"xq holds activations of shape {xq.shape}, expected {(T, D)} with D a multiple of 32")
    if T == 0:
        return out
    block = max(32, next_pow2(D))
    nw = (config or {}).get("num_warps") or max(1, min(16, block // 256))
    has_res, write_res = residual is not None, residual is not None and residual_out is not None
    r = residual if has_res else x
    ro = residual_out if write_res else out
    qa = (xq.xq, xq.xd, xq.xs) if xq is not None else (out, out, out)
    _rms_norm_kernel[(T,)](x, x.stride(0), r, r.stride(0), weight, out, out.stride(0), ro, ro.stride(0), D,
                           float(eps), *qa, HAS_RES=has_res, WRITE_RES=write_res, QUANT=xq is not None,
                           BLOCK_D=block, num_warps=nw, **pdl())
    return out
