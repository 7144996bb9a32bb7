"""Dense fp16/fp32 GEMM with the bias and activation in its epilogue, for imported networks'
linear_act (x @ w.T + bias, then relu or erf-GELU: a transformer's or ConvNeXt's first MLP
projection) in one kernel instead of cuBLAS plus an element-wise pass over the [rows, 4C] result.

Opt-in (EDGELLM_VISION_GEMM=triton): cuBLAS's product is the default until timings on the GPU
show this kernel ahead for the shapes at hand. x is read as [M, K] with any row stride (its last
axis contiguous), w as stored by the linear op ([N, K], row-major); the tile is autotuned per
(M, N, K) on the GPU, fixed in the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, jit, require_device
from .conv import ACT_CODES, _act


@jit
def _gemm_act_kernel(x_ptr, stride_xm, w_ptr, b_ptr, y_ptr, M, N, K,
                     HAS_BIAS: tl.constexpr, ACT: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    acc = _act(acc, ACT, 0.0, 0.0)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bm, bn, bk, w, st in [(64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 128, 32, 8, 3),
                              (128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (32, 64, 64, 4, 3), (16, 64, 64, 4, 2),
                              (128, 256, 32, 8, 3), (64, 256, 32, 8, 3)]
]
_gemm_act_tuned = None if INTERPRET else triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "ACT"])(_gemm_act_kernel)


def gemm_act(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, act: str,
             block: tuple[int, int, int] | None = None) -> torch.Tensor:
    """act(x @ w.T + bias) over x's last axis; act 'relu' or 'gelu' (erf form). Returns a new
    contiguous tensor of shape [..., N] in x's dtype."""
    require_device(x, "linear input")
    if act not in ("relu", "gelu"):
        raise ValueError(f"gemm_act: act {act!r} has no fused kernel (relu, gelu)")
    k = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"gemm_act: weight {tuple(w.shape)} does not match the input's last axis ({k})")
    n = w.shape[0]
    if bias is not None and bias.numel() != n:
        raise ValueError(f"gemm_act: bias of {bias.numel()} values for {n} outputs")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w.contiguous()
    m = x2.shape[0]
    y = torch.empty((*x.shape[:-1], n), device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    args = (x2, x2.stride(0), w, bias if bias is not None else w, y, m, n, k, bias is not None, ACT_CODES[act],
            x.dtype == torch.float32)
    if _gemm_act_tuned is not None and block is None:
        _gemm_act_tuned[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))](*args)
        return y
    bm, bn, bk = block or (32, 32, 32)
    _gemm_act_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y
