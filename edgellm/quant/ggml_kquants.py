"""GGML's 256-value "K" super-block formats, exactly as stored in GGUF files: Q4_K, Q5_K, Q6_K.

A super-block of 256 values is cut into sub-blocks, each with its own small integer scale (and min)
which are themselves scaled by the super-block's fp16 `d` (and `dmin`).

Q4_K, 144 bytes: d fp16 | dmin fp16 | scales[12] | qs[128]
  8 sub-blocks of 32; value l of sub-block j:  x = d*sc[j] * q - dmin*m[j],  q in 0..15, sc, m in 0..63
  scales[12] packs the eight 6-bit sc and m (k = 0..3):
    byte k     = sc[k]  | (sc[k+4] >> 4) << 6
    byte k+4   = m[k]   | (m[k+4]  >> 4) << 6
    byte k+8   = (sc[k+4] & 15) | (m[k+4] & 15) << 4
  qs[128]: four chunks of 32 bytes; chunk i holds sub-block 2i in the low nibbles and sub-block
    2i+1 in the high nibbles (byte 32i + l: value l of each).
Q5_K, 176 bytes: d | dmin | scales[12] | qh[32] | qs[128]
  as Q4_K with q in 0..31: the low four bits as in Q4_K, bit 4 of value l of sub-block j is bit j
  of qh[l].
Q6_K, 210 bytes: ql[128] | qh[64] | scales[16] (int8) | d fp16
  16 sub-blocks of 16 with int8 scales: x = (d*scales[e // 16]) * (q - 32), q in 0..63.
  Value e = 128h + 32s + l (h in 0..1, s in 0..3, l in 0..31):
    low four bits: nibble s // 2 of ql[64h + 32(s % 2) + l];  top two bits: bits 2s, 2s+1 of qh[32h + l].

Dequantization is float32 in the order written above (gguf-py's), so it equals gguf-py bit for bit.

Quantization (edgellm's own, simple, min/max based -- ggml's search for the best scales is not
reproduced; the bytes differ from llama.cpp's but decode with any Q*_K reader). Every fp16 and
integer scale is rounded *up*, so the grid always covers the sub-block and codes never clip:
  Q4_K / Q5_K (L = 15 / 31 steps): per sub-block j, lo_j = min(0, min x), hi_j = max x.
    dmin = fp16_up(max_j(-lo_j) / 63),  m_j = ceil(-lo_j / dmin)   so the offset dmin*m_j >= -lo_j
    s_j = (hi_j + dmin*m_j) / L,  d = fp16_up(max_j s_j / 63),  sc_j = ceil(s_j / d)  so d*sc_j >= s_j
    q = round((x + dmin*m_j) / (d*sc_j)), in 0..L
  Bound: |err| <= d*sc_j / 2 < (s_j + d) / 2. With R_j = hi_j - lo_j and u(v) = max(|v| 2^-10, 2^-24)
    (the largest error of rounding v up to fp16): dmin <= delta = D/63 + u(D/63), D = max_j(-lo_j);
    s_j <= (R_j + delta)/L;  d <= S/63 + u(S/63), S = max_k (R_k + delta)/L;  so
    |err| <= (R_j + delta)/(2L) + (S/63 + u(S/63))/2
  Q6_K: per sub-block of 16, s_j = max|x| / 31, d = fp16_up(max_j s_j / 127), scale_j = ceil(s_j/d),
    q - 32 = round(x / (d*scale_j)) in -31..31.
  Bound: |err| <= amax_j/62 + (S/127 + u(S/127))/2,  S = max_k amax_k / 31
  each plus amax * 2^-20 for float32 rounding.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from .base import (
    QuantFormat,
    fp16_bytes,
    fp16_field,
    fp16_directed_error,
    fp16_field_torch,
    fp16_round_up,
    pack_nibbles,
    safe_divide,
    unpack_nibbles,
    unpack_nibbles_torch,
)

QK_K = 256
_SLACK_REL = 2.0**-20  # float32 rounding, relative to amax


# -- Q4_K / Q5_K shared parts --------------------------------------------------------------------

def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins (N, 8) -> the 12-byte field."""
    return np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
    ], axis=-1).astype(np.uint8)


def _unpack_scales(b):
    """The 12-byte field (N, 12) -> scales, mins (N, 8); works for numpy arrays and torch tensors."""
    lo_sc, lo_m, packed = b[:, 0:4], b[:, 4:8], b[:, 8:12]
    sc_hi = (packed & 15) | ((lo_sc >> 6) << 4)
    m_hi = (packed >> 4) | ((lo_m >> 6) << 4)
    if isinstance(b, np.ndarray):
        cat = np.concatenate
    else:
        import torch

        cat = torch.cat
    return cat([lo_sc & 63, sc_hi], -1), cat([lo_m & 63, m_hi], -1)


def _quantize_min_scale(blocks: np.ndarray, levels: int):
    """The Q4_K/Q5_K quantizer: (N, 256) -> d, dmin (N, 1) float16; sc, m (N, 8) uint8; q (N, 256) uint8."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), np.float32(0))
    hi = sub.max(axis=-1)
    dmin = fp16_round_up(np.max(-lo, axis=-1, keepdims=True) / np.float32(63))
    m = np.ceil(safe_divide(-lo, dmin.astype(np.float32))).clip(0, 63).astype(np.uint8)
    offset = dmin.astype(np.float32) * m.astype(np.float32)
    s = (hi + offset) / np.float32(levels)
    d = fp16_round_up(np.max(s, axis=-1, keepdims=True) / np.float32(63))
    sc = np.ceil(safe_divide(s, d.astype(np.float32))).clip(0, 63).astype(np.uint8)
    step = d.astype(np.float32) * sc.astype(np.float32)
    q = np.rint(safe_divide(sub + offset[..., None], step[..., None])).clip(0, levels).astype(np.uint8)
    return d, dmin, sc, m, q.reshape(n, QK_K)


def _min_scale_bound(blocks: np.ndarray, levels: int) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)
    r = sub.max(axis=-1) - lo
    dmin = np.max(-lo, axis=-1, keepdims=True) / 63
    delta = dmin + fp16_directed_error(dmin)
    d = np.max(r + delta, axis=-1, keepdims=True) / levels / 63
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    bound = (r + delta) / (2 * levels) + (d + fp16_directed_error(d)) / 2 + amax * _SLACK_REL
    return np.broadcast_to(bound[..., None], sub.shape).reshape(blocks.shape)


def _min_scale_decode(d, dmin, sc, m, q):
    """x = d*sc*q - dmin*m for (N, 8, 32) codes; numpy or torch, float32 in gguf-py's order."""
    n = q.shape[0]
    d_sc = (d * sc).reshape(n, 8, 1)
    d_m = (dmin * m).reshape(n, 8, 1)
    return (d_sc * q - d_m).reshape(n, QK_K)


class Q4_K(QuantFormat):
    name, block_size, type_size, ggml_type = "Q4_K", QK_K, 144, GGMLQuantizationType.Q4_K

    def _quantize_blocks(self, blocks):
        d, dmin, sc, m, q = _quantize_min_scale(blocks, 15)
        qs = pack_nibbles(q.reshape(-1, 64)).reshape(q.shape[0], 128)
        return np.concatenate([fp16_bytes(d), fp16_bytes(dmin), _pack_scales(sc, m), qs], axis=-1)

    def _dequantize_blocks(self, blocks):
        n = blocks.shape[0]
        sc, m = _unpack_scales(blocks[:, 4:16])
        q = unpack_nibbles(blocks[:, 16:].reshape(-1, 32)).reshape(n, 8, 32)
        return _min_scale_decode(fp16_field(blocks, 0), fp16_field(blocks, 2),
                                 sc.astype(np.float32), m.astype(np.float32), q.astype(np.float32))

    def _dequantize_blocks_torch(self, blocks):
        n = blocks.shape[0]
        sc, m = _unpack_scales(blocks[:, 4:16])
        q = unpack_nibbles_torch(blocks[:, 16:].reshape(-1, 32)).reshape(n, 8, 32)
        return _min_scale_decode(fp16_field_torch(blocks, 0), fp16_field_torch(blocks, 2),
                                 sc.float(), m.float(), q.float())

    def _block_error_bound(self, blocks):
        return _min_scale_bound(blocks, 15)


def _q5k_high_bits(qh, torch=None):
    """qh (N, 32) -> bit 4 of every value (N, 8, 32) as 0 or 16: bit j of qh[l] is value l of sub-block j."""
    if torch is None:
        shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    else:
        shifts = torch.arange(8, dtype=torch.uint8, device=qh.device).reshape(1, 8, 1)
    return ((qh[:, None, :] >> shifts) & 1) << 4


class Q5_K(QuantFormat):
    name, block_size, type_size, ggml_type = "Q5_K", QK_K, 176, GGMLQuantizationType.Q5_K

    def _quantize_blocks(self, blocks):
        d, dmin, sc, m, q = _quantize_min_scale(blocks, 31)
        n = q.shape[0]
        high = (q >> 4).reshape(n, 8, 32)
        qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8).reshape(1, 8, 1), axis=1)
        qs = pack_nibbles((q & 15).reshape(-1, 64)).reshape(n, 128)
        return np.concatenate([fp16_bytes(d), fp16_bytes(dmin), _pack_scales(sc, m), qh.astype(np.uint8), qs], axis=-1)

    def _dequantize_blocks(self, blocks):
        n = blocks.shape[0]
        sc, m = _unpack_scales(blocks[:, 4:16])
        q = unpack_nibbles(blocks[:, 48:].reshape(-1, 32)).reshape(n, 8, 32) | _q5k_high_bits(blocks[:, 16:48])
        return _min_scale_decode(fp16_field(blocks, 0), fp16_field(blocks, 2),
                                 sc.astype(np.float32), m.astype(np.float32), q.astype(np.float32))

    def _dequantize_blocks_torch(self, blocks):
        import torch

        n = blocks.shape[0]
        sc, m = _unpack_scales(blocks[:, 4:16])
        q = unpack_nibbles_torch(blocks[:, 48:].reshape(-1, 32)).reshape(n, 8, 32)
        q = q | _q5k_high_bits(blocks[:, 16:48], torch)
        return _min_scale_decode(fp16_field_torch(blocks, 0), fp16_field_torch(blocks, 2),
                                 sc.float(), m.float(), q.float())

    def _block_error_bound(self, blocks):
        return _min_scale_bound(blocks, 31)


class Q6_K(QuantFormat):
    name, block_size, type_size, ggml_type = "Q6_K", QK_K, 210, GGMLQuantizationType.Q6_K

    def _quantize_blocks(self, blocks):
        n = blocks.shape[0]
        sub = blocks.reshape(n, 16, 16)
        s = np.abs(sub).max(axis=-1) / np.float32(31)
        d = fp16_round_up(np.max(s, axis=-1, keepdims=True) / np.float32(127))
        scale = np.ceil(safe_divide(s, d.astype(np.float32))).clip(0, 127).astype(np.int8)
        step = d.astype(np.float32) * scale.astype(np.float32)
        q = (np.rint(safe_divide(sub, step[..., None])).clip(-31, 31) + 32).astype(np.uint8)
        q = q.reshape(n, 2, 4, 32)  # [h, s, l]: value 128h + 32s + l
        low, high = q & 15, q >> 4
        ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(n, 128)
        qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
        return np.concatenate([ql, qh, scale.view(np.uint8), fp16_bytes(d)], axis=-1)

    def _dequantize_blocks(self, blocks):
        n = blocks.shape[0]
        ql = blocks[:, :128].reshape(n, 2, 1, 64)
        low = np.concatenate([ql & 15, ql >> 4], axis=2)  # (n, 2, 2, 64): value 128h + 64k + b
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
        high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3  # value 128h + 32s + l
        q = (low.reshape(n, QK_K) | (high.reshape(n, QK_K) << 4)).astype(np.int8) - np.int8(32)
        scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        d_sc = (fp16_field(blocks, 208) * scales).reshape(n, 16, 1)
        return (d_sc * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)

    def _dequantize_blocks_torch(self, blocks):
        import torch

        n = blocks.shape[0]
        ql = blocks[:, :128].reshape(n, 2, 1, 64)
        low = torch.cat([ql & 15, ql >> 4], dim=2)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qh.device).reshape(1, 1, 4, 1)) & 3
        q = (low.reshape(n, QK_K) | (high.reshape(n, QK_K) << 4)).to(torch.int8) - 32
        scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
        d_sc = (fp16_field_torch(blocks, 208) * scales).reshape(n, 16, 1)
        return (d_sc * q.reshape(n, 16, 16).float()).reshape(n, QK_K)

    def _block_error_bound(self, blocks):
        n = blocks.shape[0]
        amax = np.abs(blocks.reshape(n, 16, 16)).max(axis=-1)
        d = np.max(amax, axis=-1, keepdims=True) / 31 / 127
        bound = amax / 62 + (d + fp16_directed_error(d)) / 2 + np.max(amax, axis=-1, keepdims=True) * _SLACK_REL
        return np.broadcast_to(bound[..., None], (n, 16, 16)).reshape(blocks.shape)
