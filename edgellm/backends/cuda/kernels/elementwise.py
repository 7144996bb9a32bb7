"""Gated activations: out = act(gate) * up (SwiGLU: silu; GeGLU: GELU with the tanh approximation),
from one [T, 2F] gate|up tensor or from two [T, F] tensors; the one-input element-wise ops
(gelu, scale, softcap) and a residual add, computed in fp32; and rows gathered by a device index.

The last two replace torch ops on the run path (index_select, add_): a process's first call of a
torch CUDA op loads that op's kernels from libtorch's fatbinary (CUDA lazy loading), which took
tens of milliseconds each in a load's warm-up on the H100 (benchmarks/profile_warmup.py), against
a few for a Triton kernel read from its cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from ._common import check_2d, jit, out_buffer, pdl, pdl_prologue


ACT_CODES = {"silu": 1, "gelu_tanh": 2}  # the ACT / GLU constexpr of the kernels


@jit
def tanh_f32(z):
    # tanh from exp: exact limits (+-1) where exp overflows or underflows
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@jit
def gelu_tanh_f32(x):
    return 0.5 * x * (1.0 + tanh_f32(0.7978845608028654 * (x + 0.044715 * x * x * x)))


@jit
def gate_act(g, ACT: tl.constexpr):
    if ACT == 2:
        return gelu_tanh_f32(g)
    return g / (1.0 + tl.exp(-g))


@jit
def _silu_mul_kernel(g_ptr, stride_g, u_ptr, stride_u, out_ptr, stride_o, F, BLOCK: tl.constexpr, ACT: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < F
    g = tl.load(g_ptr + row * stride_g + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + c, mask=mask, other=0.0).to(tl.float32)
    y = gate_act(g, ACT) * u
    tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _unary_kernel(x_ptr, stride_x, out_ptr, stride_o, F, param, KIND: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < F
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    if KIND == 0:  # gelu (tanh approximation)
        y = gelu_tanh_f32(x)
    elif KIND == 1:  # scale
        y = x * param
    else:  # softcap: param * tanh(x / param)
        y = param * tanh_f32(x / param)
    tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=mask)


UNARY_KINDS = {"gelu": 0, "scale": 1, "softcap": 2}


def unary(x: torch.Tensor, kind: str, param: float = 0.0, out: torch.Tensor | None = None,
          config: dict | None = None) -> torch.Tensor:
    """gelu(x) | x * param (scale) | param * tanh(x / param) (softcap), row by row; out may be x."""
    check_2d(x, "x")
    if kind not in UNARY_KINDS:
        raise ValueError(f"unary op {kind!r}, expected one of {sorted(UNARY_KINDS)}")
    if kind == "softcap" and not param:
        raise ValueError("softcap needs a nonzero cap")
    T, F = x.shape
    out = out_buffer(out, (T, F), x.dtype, x.device)
    cfg = {**configs.ELEMENTWISE_DEFAULT, **(config or {})}
    if T and F:
        grid = (T, triton.cdiv(F, cfg["BLOCK"]))
        _unary_kernel[grid](x, x.stride(0), out, out.stride(0), F, float(param), KIND=UNARY_KINDS[kind],
                            BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"], **pdl())
    return out


def upload_fp16(host_x: torch.Tensor, out: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """out (device, fp16 [T, F]) = host_x (pinned host memory, float32 [T, F]) rounded to fp16, on
    the current stream: the kernel reads the pinned buffer over the link itself (mapped memory), so
    the upload does not wait on the link's copy engine behind copies queued earlier."""
    if host_x.device.type != "cpu" or not host_x.is_pinned():
        raise ValueError("upload_fp16 reads a pinned host tensor")
    if host_x.dim() != 2 or not host_x.is_contiguous():
        raise ValueError(f"host_x must be a contiguous [tokens, features] tensor, got shape {tuple(host_x.shape)}")
    check_2d(out, "out")
    T, F = host_x.shape
    out_buffer(out, (T, F), torch.float16, out.device)
    cfg = {**configs.ELEMENTWISE_DEFAULT, **(config or {})}
    if T and F:
        grid = (T, triton.cdiv(F, cfg["BLOCK"]))
        _unary_kernel[grid](host_x, host_x.stride(0), out, out.stride(0), F, 1.0, KIND=UNARY_KINDS["scale"],
                            BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"], **pdl())
    return out


def silu_mul(gate_up: torch.Tensor, up: torch.Tensor | None = None, out: torch.Tensor | None = None,
             config: dict | None = None, act: str = "silu") -> torch.Tensor:
    """act(gate) * up (act: silu or gelu_tanh). With up None, gate_up is [T, 2F]: gate in columns :F,
    up in F:."""
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
                               BLOCK=cfg["BLOCK"], ACT=ACT_CODES[act], num_warps=cfg["num_warps"], **pdl())
    return out


@jit
def _add_into_kernel(y_ptr, stride_y, r_ptr, stride_r, F, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < F
    y = tl.load(y_ptr + row * stride_y + c, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + c, (y + r).to(y_ptr.dtype.element_ty), mask=mask)


def add_into(y: torch.Tensor, r: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """y += r (both [T, F], rows may be strided), summed in fp32 and rounded once to y's dtype."""
    check_2d(y, "y")
    check_2d(r, "r")
    if y.shape != r.shape:
        raise ValueError(f"add_into: y {tuple(y.shape)} and r {tuple(r.shape)} differ")
    T, F = y.shape
    cfg = {**configs.ELEMENTWISE_DEFAULT, **(config or {})}
    if T and F:
        grid = (T, triton.cdiv(F, cfg["BLOCK"]))
        _add_into_kernel[grid](y, y.stride(0), r, r.stride(0), F, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"],
                               **pdl())
    return y


@jit
def _take_rows_kernel(x_ptr, stride_x, idx_ptr, out_ptr, stride_o, F, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    i = tl.program_id(0)
    src = tl.load(idx_ptr + i).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < F
    v = tl.load(x_ptr + src * stride_x + c, mask=mask, other=0.0)
    tl.store(out_ptr + i.to(tl.int64) * stride_o + c, v.to(out_ptr.dtype.element_ty), mask=mask)


def take_rows(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None,
              config: dict | None = None) -> torch.Tensor:
    """out[i] = x[index[i]] for an integer index tensor on the device (read by the kernel, so a
    CUDA graph replays it with the index of the step). Every index must be in 0..len(x) - 1: the
    kernel does not check (the caller writes the index)."""
    check_2d(x, "x")
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"take_rows: index must be a 1-D int32/int64 tensor, got {index.dtype} {tuple(index.shape)}")
    n, F = index.shape[0], x.shape[1]
    out = out_buffer(out, (n, F), x.dtype, x.device)
    cfg = {**configs.ELEMENTWISE_DEFAULT, **(config or {})}
    if n and F:
        grid = (n, triton.cdiv(F, cfg["BLOCK"]))
        _take_rows_kernel[grid](x, x.stride(0), index, out, out.stride(0), F, BLOCK=cfg["BLOCK"],
                                num_warps=cfg["num_warps"], **pdl())
    return out
