"""FP4_E0M4: Transformer-Lite's E0M4 4-bit float (the paper's "M0E4"). edgellm's own format.

E0M4 = no sign bit, no exponent bits, four fraction bits. Per group, a scale and a bias move the
group's values into [1, 2): every float in [1, 2) has the same sign and exponent, so only the top
four fraction bits of each value need storing, and decoding rebuilds an fp16 by placing those
bits under a fixed exponent -- one shift and one OR, no int-to-float conversion.

The math, per group of g values (lo = min, hi = max, R = hi - lo):
  encode   y = 1 + (x - lo) / s            with s >= R, so y is in [1, 2]
           c = floor((y - 1) * 16)         the top four fraction bits of y, in 0..15 (y = 2 -> 15)
           c names the cell [1 + c/16, 1 + (c+1)/16) holding y; all 16 cells have width s/16.
  decode   y' = 1 + c/16 + 1/32            the cell's centre: the fifth fraction bit -- the
                                           rounding bit -- set, so |y - y'| <= 1/32
           x' = lo + (y' - 1) * s          so |x - x'| <= s/32
  As a kernel computes it:
           h  = 0x3C00 | (c << 6)          fp16 bits: 0x3C00 is 1.0 (sign 0, exponent 01111, all ten
                                           fraction bits 0); c lands in the top four fraction bits.
                                           As 1.0's fraction bits are zero, the OR is an exact add:
                                           h is the fp16 1 + c/16.
           x' = fp16(h) * s - b            with b = (31/32) * s - lo
  The constant the codes are ORed into (1.0, in general 2^n) is the "bias with zeroed low fraction
  bits": its fraction field must be zero where the codes go for the OR to be an add. n = 0 loses
  nothing, as the scale s absorbs any power of two.
  The stored bias b folds in both the group minimum and the half-cell rounding bit:
  (1 + c/16) s - (31/32) s + lo = lo + (c + 1/2) s/16 = lo + (y' - 1) s.

Block layout (one block per group; g a multiple of 8; type_size = 4 + g/2 bytes, 4 + 32/g bits
per value -- the same size as Q4_G{g}):
  offset 0: s fp16 | offset 2: b fp16 | offset 4: codes[g/2]
  byte i of codes: code i in the low nibble, code i + g/2 in the high nibble (GGML's order).
Names: FP4_E0M4 (g = 128, the default) and FP4_E0M4_G{g} for other groups.

Reference decode (`dequantize`): y = 1 + c/16 computed arithmetically in float32, then
x' = y * s - b in float32. `dequantize_fp16_bits` builds y from the fp16 bit pattern instead; the
two are identical (y is exactly representable in both). y * s is exact in float32 (5 x 11
significant bits), so a fused multiply-add gives the same value as multiply-then-subtract.

Quantizer (with the stored, rounded fields): s = smallest fp16 >= R (so the 16 cells cover the
group), b = nearest fp16 to (31/32) s - lo; then c is the nearest grid point for *those* s and b,
computed literally as the paper describes: y = (x + b)/s + 1/32 -- adding half of the last kept
bit is rounding by the fifth bit -- clamped into [1, 2), c = top four fraction bits of float32 y
(bits 22..19). An all-equal group has s = 0, c = 0 and decodes to -b = the value rounded to fp16.

Error bound: |err| <= s/32 + |b - b_exact| <= (R + u(R))/32 + e((31/32)(R + u(R)) + |lo|), where
u(v) = max(|v| 2^-10, 2^-24) and e(v) = max(|v| 2^-11, 2^-25) are the largest errors of rounding v
to fp16 up and to nearest; plus amax * 2^-20 for float32 rounding. Inputs need |x| <= 16384 so that
s (<= 2 amax) and b (<= 3 amax) stay in fp16 range.

Versus Q4_G{g}: both are uniform 16-level grids with per-group fp16 scale and offset. E0M4 centres
16 cells of width R/16 on the group (worst error R/32) where Q4_G/Q4_1 put 16 points R/15 apart
from min to max (worst error R/30) -- its small accuracy gain comes from that placement (an integer
format could place its grid the same way); its speed gain is the decode. Measured with
compare.compare_fp4_int4: about 3.4% lower MAE than Q4_G128 on normal, Laplace and t(3) data, but
1-3% higher on the default model (SmolLM2-135M Q4_1), whose weights already sit on Q4_1's min-to-max
grid of 32-value blocks, which Q4_G's grid often reproduces.
"""

from __future__ import annotations

import numpy as np

from .base import (
    QuantFormat,
    fp16_bytes,
    fp16_directed_error,
    fp16_field,
    fp16_field_torch,
    fp16_nearest_error,
    fp16_round_up,
    pack_nibbles,
    unpack_nibbles,
    unpack_nibbles_torch,
)
from .q4_group import check_group

ONE_FP16_BITS = 0x3C00  # fp16 1.0: exponent bits 01111, fraction bits all zero
CODE_SHIFT = 6  # a code's four bits sit at the top of fp16's ten fraction bits
DEFAULT_GROUP = 128
_SLACK_REL = 2.0**-20  # float32 rounding, relative to amax
_BELOW_TWO = np.nextafter(np.float32(2), np.float32(0))


def codes_to_y_arith(codes: np.ndarray) -> np.ndarray:
    """y = 1 + c/16 by arithmetic, float32."""
    return np.float32(1) + codes.astype(np.float32) / np.float32(16)


def codes_to_y_fp16_bits(codes: np.ndarray) -> np.ndarray:
    """y = 1 + c/16 by the shift-and-OR trick: the fp16 with bits 0x3C00 | c << 6, as float32."""
    bits = (codes.astype(np.uint16) << np.uint16(CODE_SHIFT)) | np.uint16(ONE_FP16_BITS)
    return bits.view(np.float16).astype(np.float32)


def top4_fraction_bits(y: np.ndarray) -> np.ndarray:
    """The top four fraction bits of float32 values y in [1, 2), as uint8 codes 0..15."""
    fraction = np.ascontiguousarray(y, dtype=np.float32).view(np.uint32) & np.uint32(0x7FFFFF)
    return (fraction >> np.uint32(19)).astype(np.uint8)


class FP4E0M4(QuantFormat):
    max_abs_input = 16384.0

    def __init__(self, group: int = DEFAULT_GROUP):
        self.block_size = check_group(group, "FP4_E0M4")
        self.type_size = 4 + self.block_size // 2
        self.name = "FP4_E0M4" if self.block_size == DEFAULT_GROUP else f"FP4_E0M4_G{self.block_size}"

    def _quantize_blocks(self, blocks):
        lo = blocks.min(axis=-1, keepdims=True)
        s = fp16_round_up(blocks.max(axis=-1, keepdims=True) - lo)
        s32 = s.astype(np.float32)
        b = (s32 * np.float32(31 / 32) - lo).astype(np.float16)
        with np.errstate(divide="ignore", invalid="ignore"):
            y = (blocks + b.astype(np.float32)) / s32 + np.float32(1 / 32)
        y = np.where(s32 == 0, np.float32(1), np.clip(y, np.float32(1), _BELOW_TWO))
        return np.concatenate([fp16_bytes(s), fp16_bytes(b), pack_nibbles(top4_fraction_bits(y))], axis=-1)

    def _dequantize_blocks(self, blocks, y_from_codes=codes_to_y_arith):
        s, b = fp16_field(blocks, 0), fp16_field(blocks, 2)
        return y_from_codes(unpack_nibbles(blocks[:, 4:])) * s - b

    def _dequantize_blocks_torch(self, blocks):
        s, b = fp16_field_torch(blocks, 0), fp16_field_torch(blocks, 2)
        y = 1 + unpack_nibbles_torch(blocks[:, 4:]).float() / 16
        return y * s - b

    def dequantize_fp16_bits(self, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """`dequantize` with y built by shift-and-OR into an fp16 bit pattern (a GPU kernel's way)."""
        bits_format = _BitsDecode(self)
        return bits_format.dequantize(raw, shape)

    def _block_error_bound(self, blocks):
        lo = blocks.min(axis=-1, keepdims=True)
        r = blocks.max(axis=-1, keepdims=True) - lo
        amax = np.abs(blocks).max(axis=-1, keepdims=True)
        s = r + fp16_directed_error(r)
        bound = s / 32 + fp16_nearest_error(31 / 32 * s + np.abs(lo)) + amax * _SLACK_REL
        return np.broadcast_to(bound, blocks.shape)


class _BitsDecode(FP4E0M4):
    """The same format, decoding through fp16 bit patterns."""

    def __init__(self, fmt: FP4E0M4):
        super().__init__(fmt.block_size)

    def _dequantize_blocks(self, blocks, y_from_codes=codes_to_y_fp16_bits):
        return super()._dequantize_blocks(blocks, y_from_codes)
