"""GGML K-quant and 5/6-bit blocks as integer codes, and the code planes the GPU backends read.

Backend-neutral torch functions (on whatever device the tensors are): the cuda backend's layouts
(edgellm/backends/cuda/kernels/packing.py) and the webgpu backend's (edgellm/backends/webgpu/
codegen.py) are built from them, so both read the same bytes.

Code planes, per 32-element block (row-major, `nb = in / 32` blocks per row):
  six-bit (Q6, Q6M, Q6K)  the blocks' low four bits (nb * 16 bytes: byte j holds element j in its low
                          nibble and j + 16 in its high nibble, as GGML's 4-bit blocks), then their top
                          two bits (nb * 8 bytes: byte 4h + i holds, at bits 2w and 2w + 1, bits 4..5 of
                          element 16h + 4w + i).
  five-bit (Q5K)          the low four bits as above, then one 32-bit word of fifth bits per block
                          (nb * 4 bytes: bit 4h + w of byte i holds bit 4 of element 16h + 4w + i).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch


def tensor_of(a: np.ndarray) -> torch.Tensor:
    """A numpy array as a torch tensor sharing its memory; a read-only one (a map of the model
    file) without torch's warning that it is not writable: these functions only read it."""
    a = np.ascontiguousarray(a)
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def six_bit_codes(blocks: torch.Tensor, fmt: str):
    """Raw blocks [n, type size] of Q6_K, Q5_K or Q5_1 -> (q [n, block] uint8 in 0..63, element
    order; d [n, block / 16] float32; m [n, block / 16] float32 or None) with value = (q - 32) * d + m."""
    n = blocks.shape[0]
    dev = blocks.device
    if fmt == "Q6_K":  # see edgellm/quant/ggml_kquants.py for the block layout
        ql = blocks[:, :128].reshape(n, 2, 1, 64)
        low = torch.cat([ql & 15, ql >> 4], dim=2)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=dev).reshape(1, 1, 4, 1)) & 3
        q = low.reshape(n, 256) | (high.reshape(n, 256) << 4)
        sc = blocks[:, 192:208].contiguous().view(torch.int8).float()
        d = blocks[:, 208:210].contiguous().view(torch.float16).float()
        return q, d * sc, None
    if fmt == "Q5_K":
        from .ggml_kquants import _unpack_scales

        d = blocks[:, 0:2].contiguous().view(torch.float16).float()
        dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
        sc, mn = _unpack_scales(blocks[:, 4:16])  # [n, 8] each
        q = q5_k_codes(blocks) + 32
        step, mins = d * sc.float(), -(dmin * mn.float())
        return q, step.repeat_interleave(2, dim=1), mins.repeat_interleave(2, dim=1)
    # Q5_1: d | m | qh (bit j: bit 4 of element j) | 16 bytes of nibbles
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    qh = blocks[:, 4:8].contiguous().view(torch.int32)  # [n, 1]
    bit = (qh >> torch.arange(32, dtype=torch.int32, device=dev)) & 1
    lo = blocks[:, 8:24].to(torch.int32)
    q = (torch.cat([lo & 15, lo >> 4], dim=1) | (bit << 4)) + 32
    return q.to(torch.uint8), d.expand(n, 2), m.expand(n, 2)


def q5_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Raw Q5_K blocks [n, 176] -> their codes [n, 256] (uint8 in 0..31, element order)."""
    n = blocks.shape[0]
    qs = blocks[:, 48:176].reshape(n, 4, 1, 32)
    low = torch.cat([qs & 15, qs >> 4], dim=2).reshape(n, 8, 32)  # sub-block 2i low, 2i + 1 high nibbles
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).reshape(1, 8, 1)
    bit = (blocks[:, None, 16:48] >> shifts) & 1  # qh[l] bit j: bit 4 of element l of sub-block j
    return (low | (bit << 4)).reshape(n, 256)


def _nibble_plane(b: torch.Tensor) -> torch.Tensor:
    """Codes as blocks [rows, nb, 2, 16] (the two halves) -> their low four bits, as GGML's 4-bit
    blocks hold them: [rows, nb * 16], byte j of a block element j (low nibble) and j + 16 (high)."""
    rows, nb = b.shape[:2]
    return ((b[:, :, 0] & 15) | ((b[:, :, 1] & 15) << 4)).reshape(rows, nb * 16)


def _nibble_codes(qs: torch.Tensor, nb: int) -> torch.Tensor:
    """The low four bits of every code from the nibble plane at the start of rows qs: [rows, nb, 32]."""
    ql = qs[:, :nb * 16].reshape(qs.shape[0], nb, 16)
    return torch.cat([ql & 15, ql >> 4], dim=2)


def unpack_q4_codes(qs: torch.Tensor, n_in: int) -> torch.Tensor:
    """A 4-bit layout's codes (GGML's nibbles, as Q4_0, Q4_1, Q4K store them): qs [rows, nb * 16]
    -> codes [rows, in] (uint8, element order)."""
    return _nibble_codes(qs, n_in // 32).reshape(qs.shape[0], n_in)


def pack_q5_codes(q: torch.Tensor) -> torch.Tensor:
    """5-bit codes [rows, in] (uint8, element order) -> the Q5K rows of qs [rows, nb * 20]."""
    rows, n_in = q.shape
    nb = n_in // 32
    b = q.reshape(rows, nb, 2, 16)
    top = ((b >> 4) & 1).reshape(rows, nb, 2, 4, 4).permute(0, 1, 4, 2, 3).reshape(rows, nb, 4, 8)  # [.., i, 4h + w]
    weights = (1 << torch.arange(8, dtype=torch.int32, device=q.device)).to(torch.uint8)
    qh = (top * weights).sum(dim=3, dtype=torch.int32).to(torch.uint8)  # byte i of each block's word
    return torch.cat([_nibble_plane(b), qh.reshape(rows, nb * 4)], dim=1)


def unpack_q5_codes(qs: torch.Tensor, n_in: int) -> torch.Tensor:
    """The inverse of pack_q5_codes: qs [rows, nb * 20] -> codes [rows, in] (uint8)."""
    rows = qs.shape[0]
    nb = n_in // 32
    low = _nibble_codes(qs, nb)
    qh = qs[:, nb * 16:].reshape(rows, nb, 4, 1)  # [.., i, bit]
    bits = (qh >> torch.arange(8, dtype=torch.uint8, device=qs.device)) & 1  # [.., i, 4h + w]
    top = bits.reshape(rows, nb, 4, 2, 4).permute(0, 1, 3, 4, 2).reshape(rows, nb, 32)  # element 16h + 4w + i
    return (low | (top << 4)).reshape(rows, n_in)


def pack_q6_codes(q: torch.Tensor) -> torch.Tensor:
    """6-bit codes [rows, in] (uint8, element order) -> the Q6 rows of qs [rows, nb * 24]."""
    rows, n_in = q.shape
    nb = n_in // 32
    b = q.reshape(rows, nb, 2, 16)
    hb = (b >> 4).reshape(rows, nb, 2, 4, 4)  # [.., h, w, i]: top bits of element 16h + 4w + i
    qh = hb[:, :, :, 0] | (hb[:, :, :, 1] << 2) | (hb[:, :, :, 2] << 4) | (hb[:, :, :, 3] << 6)  # byte 4h + i
    return torch.cat([_nibble_plane(b), qh.reshape(rows, nb * 8)], dim=1)


def unpack_q6_codes(qs: torch.Tensor, n_in: int) -> torch.Tensor:
    """The inverse of pack_q6_codes: qs [rows, nb * 24] -> codes [rows, in] (uint8)."""
    rows = qs.shape[0]
    nb = n_in // 32
    low = _nibble_codes(qs, nb)
    qh = qs[:, nb * 16:].reshape(rows, nb, 2, 1, 4)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).reshape(1, 1, 1, 4, 1)
    high = ((qh >> shifts) & 3).reshape(rows, nb, 32)
    return (low | (high << 4)).reshape(rows, n_in)


# code offset that turns each layout's codes into six-bit codes of the same value ((q - 32) * d + m)
_SIX_BIT_OFFSET = {"Q4_0": 24, "Q4_1": 32, "Q8_0": 32, "Q6": 0, "Q6M": 0}


def as_six_bit(fmt: str, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, want: str):
    """A layout's codes (int16 [rows, in], element order) and fp16 scales (per 32 elements, or per
    16 for Q6/Q6M) and minimums as the six-bit layout `want` (Q6 or Q6M) holding exactly the same
    values: (packed qs, d per 16, m per 16 or None), or None where `want` cannot hold them. Q4_0
    codes + 24, Q4_1's + 32 (Q6M only), Q8_0's + 32 when all are in -32..31 (Q5_0's are), Q6 to
    Q6M with m = 0; every fp16 field copied."""
    if fmt not in _SIX_BIT_OFFSET or want not in ("Q6", "Q6M") or (want == "Q6" and m is not None):
        return None  # (Q6 has no minimums to hold Q4_1's or Q6M's)
    if fmt == "Q8_0" and codes.numel() and (int(codes.min()) < -32 or int(codes.max()) > 31):
        return None
    per16 = d if fmt in ("Q6", "Q6M") else d.repeat_interleave(2, dim=1)
    mins = None
    if want == "Q6M":
        mins = torch.zeros_like(per16) if m is None else (m if fmt == "Q6M" else m.repeat_interleave(2, dim=1))
    qs = pack_q6_codes((codes + _SIX_BIT_OFFSET[fmt]).to(torch.uint8))
    return qs, per16.contiguous(), None if mins is None else mins.contiguous()
