"""RMSNorm with the residual add fused in: one read of x and the residual, one write of each result."""

from __future__ import annotations

import torch
import triton.language as tl

from ._common import check_2d, jit, next_pow2, out_buffer, pdl, pdl_prologue


@jit
def _rms_norm_kernel(x_ptr, stride_x, r_ptr, stride_r, w_ptr, out_ptr, stride_o, ro_ptr, stride_ro, D, eps,
                     HAS_RES: tl.constexpr, WRITE_RES: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
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
    tl.store(out_ptr + row * stride_o + c, (x * r * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             config: dict | None = None) -> torch.Tensor:
    """out = h / sqrt(mean(h^2) + eps) * weight, with h = x + residual (or x alone).

    With a residual and residual_out given, h is stored to residual_out (which may alias x or
    residual, for an in-place update of the residual stream) and the norm is taken of h as stored."""
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
    if T == 0:
        return out
    block = next_pow2(D)
    nw = (config or {}).get("num_warps") or max(1, min(16, block // 256))
    has_res, write_res = residual is not None, residual is not None and residual_out is not None
    r = residual if has_res else x
    ro = residual_out if write_res else out
    _rms_norm_kernel[(T,)](x, x.stride(0), r, r.stride(0), weight, out, out.stride(0), ro, ro.stride(0), D,
                           float(eps), HAS_RES=has_res, WRITE_RES=write_res, BLOCK_D=block, num_warps=nw, **pdl())
    return out
