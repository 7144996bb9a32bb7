"""GGML's 32-value block formats, exactly as stored in GGUF files: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Block layouts (bytes, in order; d and m are fp16; q are the block's 32 codes, q[j] for value j):

  Q4_0  18 B  d | qs[16]            x[j] = d * (q[j] - 8)            q in 0..15
  Q4_1  20 B  d | m | qs[16]        x[j] = d * q[j] + m              q in 0..15
  Q5_0  22 B  d | qh[4] | qs[16]    x[j] = d * (q[j] - 16)           q in 0..31
  Q5_1  24 B  d | m | qh[4] | qs[16]   x[j] = d * q[j] + m           q in 0..31
  Q8_0  34 B  d | qs[32] (int8)     x[j] = d * q[j]                  q in -127..127

  qs[16]: byte i holds the low four bits of q[i] (low nibble) and of q[i + 16] (high nibble).
  qh[4]:  a little-endian uint32 whose bit j is bit 4 of q[j].

Dequantization is computed in float32 in the order written above (gguf-py's order), so it equals
gguf-py bit for bit; every product d*q is exact in float32 (11 x 5 significant bits), so a
fused multiply-add gives the same value too.

Quantization reproduces ggml's reference quantizer (and gguf-py's) byte for byte. The scale is
computed and used in float32, then stored rounded to fp16:
  Q4_0  v = the value of largest |v| in the block (the first one on ties), d = v / -8,
        q = min(15, trunc(x * (1/d) + 8.5))
  Q5_0  the same with 16 and 31
  Q4_1  d = (max - min) / 15, m = min, q = min(15, trunc((x - min) * (1/d) + 0.5))
  Q5_1  the same with 31
  Q8_0  d = max|x| / 127, q = roundf(x * (1/d))  (ties away from zero)
  (an all-zero block has d = 0 and codes that decode to 0)

Error bounds, per block (amax = max|x|, R = max - min; e(v) = max(|v| 2^-11, 2^-25) is the largest
fp16 round-to-nearest error at v, which the stored d and m carry):
  Q4_0  |err| <= amax/8 + 8 e(amax/8)          (a value of opposite sign to v near amax lands on
                                                 code 15 = +7d, one full step away; others d/2)
  Q5_0  |err| <= amax/16 + 16 e(amax/16)
  Q4_1  |err| <= R/30 + 15 e(R/15) + e(min)    (half a step, plus the fp16 rounding of d and m)
  Q5_1  |err| <= R/62 + 31 e(R/31) + e(min)
  Q8_0  |err| <= amax/254 + 127 e(amax/127)
each plus amax * 2^-20 for float32 rounding.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from .base import (
    QuantFormat,
    fp16_bytes,
    fp16_field,
    fp16_field_torch,
    pack_nibbles,
    round_half_away,
    fp16_nearest_error,
    safe_reciprocal,
    unpack_nibbles,
    unpack_nibbles_torch,
)

_F32_SLACK = 2.0**-20  # float32 rounding, relative to amax


def _signed_absmax(blocks: np.ndarray) -> np.ndarray:
    """Per block, the value of largest magnitude with its sign (the first one on ties), (N, 1)."""
    i = np.argmax(np.abs(blocks), axis=-1)[:, None]
    return np.take_along_axis(blocks, i, axis=-1)


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of 32 codes (N, 32) -> qh (N, 4): bit j of the little-endian uint32 is bit 4 of q[j]."""
    return np.packbits(q >> np.uint8(4), axis=-1, bitorder="little")


def _unpack_high_bits(qh: np.ndarray) -> np.ndarray:
    """qh (N, 4) -> bit 4 of each code, as 0 or 16, uint8 (N, 32)."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << np.uint8(4)


def _unpack_high_bits_torch(qh):
    import torch

    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device).repeat(qh.shape[-1])
    return ((qh.repeat_interleave(8, dim=-1) >> shifts) & 1) << 4


class _Legacy(QuantFormat):
    block_size = 32


class Q4_0(_Legacy):
    name, type_size, ggml_type = "Q4_0", 18, GGMLQuantizationType.Q4_0

    def _quantize_blocks(self, blocks):
        d = _signed_absmax(blocks) / np.float32(-8)
        q = np.trunc(blocks * safe_reciprocal(d) + np.float32(8.5)).astype(np.uint8).clip(0, 15)
        return np.concatenate([fp16_bytes(d), pack_nibbles(q)], axis=-1)

    def _dequantize_blocks(self, blocks):
        d = fp16_field(blocks, 0)
        q = unpack_nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
        return d * q.astype(np.float32)

    def _dequantize_blocks_torch(self, blocks):
        import torch

        d = fp16_field_torch(blocks, 0)
        q = unpack_nibbles_torch(blocks[:, 2:]).to(torch.int8) - 8
        return d * q.float()

    def _block_error_bound(self, blocks):
        return _symmetric_bound(blocks, 8, 8)


class Q4_1(_Legacy):
    name, type_size, ggml_type = "Q4_1", 20, GGMLQuantizationType.Q4_1

    def _quantize_blocks(self, blocks):
        lo = blocks.min(axis=-1, keepdims=True)
        d = (blocks.max(axis=-1, keepdims=True) - lo) / np.float32(15)
        q = np.trunc((blocks - lo) * safe_reciprocal(d) + np.float32(0.5)).astype(np.uint8).clip(0, 15)
        return np.concatenate([fp16_bytes(d), fp16_bytes(lo), pack_nibbles(q)], axis=-1)

    def _dequantize_blocks(self, blocks):
        d, m = fp16_field(blocks, 0), fp16_field(blocks, 2)
        return d * unpack_nibbles(blocks[:, 4:]).astype(np.float32) + m

    def _dequantize_blocks_torch(self, blocks):
        d, m = fp16_field_torch(blocks, 0), fp16_field_torch(blocks, 2)
        return d * unpack_nibbles_torch(blocks[:, 4:]).float() + m

    def _block_error_bound(self, blocks):
        return _asymmetric_bound(blocks, 15)


class Q5_0(_Legacy):
    name, type_size, ggml_type = "Q5_0", 22, GGMLQuantizationType.Q5_0

    def _quantize_blocks(self, blocks):
        d = _signed_absmax(blocks) / np.float32(-16)
        q = np.trunc(blocks * safe_reciprocal(d) + np.float32(16.5)).astype(np.uint8).clip(0, 31)
        return np.concatenate([fp16_bytes(d), _pack_high_bits(q), pack_nibbles(q & np.uint8(0x0F))], axis=-1)

    def _dequantize_blocks(self, blocks):
        d = fp16_field(blocks, 0)
        q = unpack_nibbles(blocks[:, 6:]) | _unpack_high_bits(blocks[:, 2:6])
        return d * (q.astype(np.int8) - np.int8(16)).astype(np.float32)

    def _dequantize_blocks_torch(self, blocks):
        import torch

        d = fp16_field_torch(blocks, 0)
        q = unpack_nibbles_torch(blocks[:, 6:]) | _unpack_high_bits_torch(blocks[:, 2:6])
        return d * (q.to(torch.int8) - 16).float()

    def _block_error_bound(self, blocks):
        return _symmetric_bound(blocks, 16, 16)


class Q5_1(_Legacy):
    name, type_size, ggml_type = "Q5_1", 24, GGMLQuantizationType.Q5_1

    def _quantize_blocks(self, blocks):
        lo = blocks.min(axis=-1, keepdims=True)
        d = (blocks.max(axis=-1, keepdims=True) - lo) / np.float32(31)
        q = np.trunc((blocks - lo) * safe_reciprocal(d) + np.float32(0.5)).astype(np.uint8).clip(0, 31)
        return np.concatenate(
            [fp16_bytes(d), fp16_bytes(lo), _pack_high_bits(q), pack_nibbles(q & np.uint8(0x0F))], axis=-1
        )

    def _dequantize_blocks(self, blocks):
        d, m = fp16_field(blocks, 0), fp16_field(blocks, 2)
        q = unpack_nibbles(blocks[:, 8:]) | _unpack_high_bits(blocks[:, 4:8])
        return d * q.astype(np.float32) + m

    def _dequantize_blocks_torch(self, blocks):
        d, m = fp16_field_torch(blocks, 0), fp16_field_torch(blocks, 2)
        q = unpack_nibbles_torch(blocks[:, 8:]) | _unpack_high_bits_torch(blocks[:, 4:8])
        return d * q.float() + m

    def _block_error_bound(self, blocks):
        return _asymmetric_bound(blocks, 31)


class Q8_0(_Legacy):
    name, type_size, ggml_type = "Q8_0", 34, GGMLQuantizationType.Q8_0

    def _quantize_blocks(self, blocks):
        d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
        q = round_half_away(blocks * safe_reciprocal(d)).astype(np.int8)
        return np.concatenate([fp16_bytes(d), q.view(np.uint8)], axis=-1)

    def _dequantize_blocks(self, blocks):
        d = fp16_field(blocks, 0)
        return np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32) * d

    def _dequantize_blocks_torch(self, blocks):
        import torch

        d = fp16_field_torch(blocks, 0)
        return blocks[:, 2:].contiguous().view(torch.int8).float() * d

    def _block_error_bound(self, blocks):
        return _symmetric_bound(blocks, 127, 127, steps=0.5)


def _symmetric_bound(blocks: np.ndarray, divisor: int, max_code: int, steps: float = 1.0) -> np.ndarray:
    """`steps` quantization steps d = amax/divisor, plus max_code times the fp16 rounding of d."""
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = amax / divisor
    bound = steps * d + max_code * fp16_nearest_error(d) + amax * _F32_SLACK
    return np.broadcast_to(bound, blocks.shape)


def _asymmetric_bound(blocks: np.ndarray, levels: int) -> np.ndarray:
    """Half a step d = R/levels, plus the fp16 rounding of d (times levels) and of the minimum."""
    lo = blocks.min(axis=-1, keepdims=True)
    d = (blocks.max(axis=-1, keepdims=True) - lo) / levels
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    bound = d / 2 + levels * fp16_nearest_error(d) + fp16_nearest_error(lo) + amax * _F32_SLACK
    return np.broadcast_to(bound, blocks.shape)
