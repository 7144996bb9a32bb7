"""SwiGLU: out = silu(gate) * up, from one [T, 2F] gate|up tensor or from two [T, F] tensors."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from ._common import check_2d, jit, out_buffer, pdl, pdl_prologue


@jit
def _silu_mul_kernel(g_ptr, stride_g, u_ptr, stride_u, out_ptr, stride_o, F, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < F
    g = tl.load(g_ptr + row * stride_g + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + c, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, up: torch.Tensor | None = None, out: torch.Tensor | None = None,
             config: dict | None = None) -> torch.Tensor:
    """silu(gate) * up. With up None, gate_up is [T, 2F]: gate in columns :F, up in F:."""
    check_2d(gate_up, "gate")
    if up is None:
        if gate_up.shape[1] % 2:
            raise ValueError(f"gate_up has an odd width {gate_up.shape[1]}")
        F = gate_up.shape[1] // 2
        gate, up = gate_up[:, :F], gate_up[:, F:]
    else:
        check_2d(up, "up")
        if up.shape != gate_up.shape:
            raise ValueError(f"gate {tuple(gate_up.shape)} and up {tuple(up.shape)} differ")
        gate, F = gate_up, gate_up.shape[1]
    T = gate.shape[0]
    out = out_buffer(out, (T, F), gate.dtype, gate.device)
    cfg = {**configs.ELEMENTWISE_DEFAULT, **(config or {})}
    if T and F:
        grid = (T, triton.cdiv(F, cfg["BLOCK"]))
        _silu_mul_kernel[grid](gate, gate.stride(0), up, up.stride(0), out, out.stride(0), F,
                               BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"], **pdl())
    return out
