"""Token embedding: gather rows of a packed table, dequantized on the fly."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from ._common import jit, out_buffer, pdl, pdl_prologue, require_device
from .linear import _FMT_CODE, _q4k_scales
from .packing import PackedWeight


@jit
def _embedding_kernel(ids_ptr, q_ptr, d_ptr, m_ptr, out_ptr, stride_o, V, D, stride_q, stride_d,
                      FMT: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    ok = (tok >= 0) & (tok < V)  # an id outside the table reads nothing and gives a zero row
    tok = tl.where(ok, tok, 0)
    mask = (c < D) & ok
    if FMT == 0:
        v = tl.load(q_ptr + tok * stride_q + c, mask=mask, other=0.0).to(tl.float32)
    elif FMT == 3:
        q = tl.load(q_ptr + tok * stride_q + c, mask=mask, other=0).to(tl.float32)
        v = q * tl.load(d_ptr + tok * stride_d + c // 32, mask=mask, other=0.0).to(tl.float32)
    elif FMT == 8:  # Q5K (packing.py): nibbles as Q4, a word of fifth bits per block after them
        e = c % 32
        row = q_ptr + tok * stride_q
        byte = tl.load(row + (c // 32) * 16 + e % 16, mask=mask, other=0)
        nib = tl.where(e < 16, byte & 15, byte >> 4)
        top = tl.load(row + (D // 32) * 16 + (c // 32) * 4 + e % 4, mask=mask, other=0)
        top = (top >> (4 * (e // 16) + (e % 16) // 4).to(tl.uint8)) & 1
        dk, mk = _q4k_scales(d_ptr, m_ptr, tok, c // 32, mask, stride_d, True)
        v = (nib | (top << 4)).to(tl.float32) * dk + mk
    elif FMT == 4 or FMT == 5 or FMT == 7:  # Q6/Q6M/Q6K (packing.py): nibbles as Q4, the top two bits after
        e = c % 32
        row = q_ptr + tok * stride_q
        byte = tl.load(row + (c // 32) * 16 + e % 16, mask=mask, other=0)
        nib = tl.where(e < 16, byte & 15, byte >> 4)
        top = tl.load(row + (D // 32) * 16 + (c // 32) * 8 + (e // 16) * 4 + e % 4, mask=mask, other=0)
        top = (top >> (2 * ((e % 16) // 4)).to(tl.uint8)) & 3
        if FMT == 7:  # Q6K: the int8 scale code times the super-block's D
            dk = tl.load(d_ptr + tok * stride_d + c // 16, mask=mask, other=0).to(tl.float32) * \
                tl.load(m_ptr + tok * (stride_d // 16) + c // 256, mask=mask, other=0.0).to(tl.float32)
        else:
            dk = tl.load(d_ptr + tok * stride_d + c // 16, mask=mask, other=0.0).to(tl.float32)
        v = ((nib | (top << 4)).to(tl.float32) - 32.0) * dk
        if FMT == 5:
            v += tl.load(m_ptr + tok * stride_d + c // 16, mask=mask, other=0.0).to(tl.float32)
    else:
        byte = tl.load(q_ptr + tok * stride_q + (c // 32) * 16 + c % 16, mask=mask, other=0)
        nib = tl.where(c % 32 < 16, byte & 15, byte >> 4).to(tl.float32)
        if FMT == 6:  # Q4K: scale and minimum from the sub-block's codes and the super-block's pair
            dk, mk = _q4k_scales(d_ptr, m_ptr, tok, c // 32, mask, stride_d, True)
            v = nib * dk + mk
        else:
            d = tl.load(d_ptr + tok * stride_d + c // 32, mask=mask, other=0.0).to(tl.float32)
            if FMT == 1:
                v = (nib - 8.0) * d
            else:
                v = nib * d + tl.load(m_ptr + tok * stride_d + c // 32, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + c, v.to(out_ptr.dtype.element_ty), mask=c < D)


def embedding(ids: torch.Tensor, table: PackedWeight, out: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float16, config: dict | None = None) -> torch.Tensor:
    """out[t] = table[ids[t]] as `dtype` (or out's dtype); ids int32/int64 [T] on the device.
    Ids outside [0, vocab) give zero rows (the kernel cannot raise; check ids on the host)."""
    if not isinstance(table, PackedWeight):
        raise TypeError(f"table must be a PackedWeight, got {type(table).__name__}")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be a 1D int32/int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    require_device(ids, "ids")
    V, D = table.shape
    T = ids.shape[0]
    out = out_buffer(out, (T, D), dtype, ids.device)
    cfg = {**configs.EMBEDDING_DEFAULT, **(config or {})}
    if T:
        block = min(cfg["BLOCK_D"], triton.next_power_of_2(D))
        dummy = table.qs
        _embedding_kernel[(T, triton.cdiv(D, block))](
            ids.contiguous(), table.qs, table.d if table.d is not None else dummy,
            table.m if table.m is not None else dummy, out, out.stride(0), V, D,
            table.qs.stride(0), table.d.stride(0) if table.d is not None else 0,
            FMT=_FMT_CODE[table.fmt], BLOCK_D=block, num_warps=cfg["num_warps"], **pdl())
    return out
