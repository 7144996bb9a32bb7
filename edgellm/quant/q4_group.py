"""Q4_G{g} and Q4_G{g}_SYM: group-wise int4 with any group size g. edgellm's own formats.

Rows of fixed-size blocks like GGML; one block per group of g values (g a multiple of 8, so a
block's codes fill whole 32-bit words). Codes are packed in GGML's order: byte i holds code i in
its low nibble and code i + g/2 in its high nibble.

Q4_G{g} (asymmetric, "like Q4_1 with any group"), 4 + g/2 bytes per block, 4 + 16/g bits per value:
  offset 0: d fp16 | offset 2: m fp16 | offset 4: codes[g/2]
  x[j] = d * q[j] + m,  q in 0..15   (float32, Q4_1's order; Q4_G32 has exactly Q4_1's layout,
  so Q4_1 readers and kernels read it)
Q4_G{g}_SYM (symmetric, "like Q4_0 with any group"), 2 + g/2 bytes per block:
  offset 0: d fp16 | offset 2: codes[g/2]
  x[j] = d * (q[j] - 8),  q in 0..15  (Q4_G32_SYM has exactly Q4_0's layout)

Quantization (edgellm's own: codes are chosen against the *stored* fp16 fields, and fields are
rounded in the direction that keeps every value inside the grid):
  asymmetric: m = largest fp16 <= min, d = smallest fp16 >= (max - m)/15, q = round((x - m)/d).
    Bound: |err| <= d/2 <= (d0 + u(d0))/2 with d0 = (R + u(min))/15, R = max - min, and
    u(v) = max(|v| 2^-10, 2^-24) the largest error of rounding v up or down to fp16.
  symmetric: v = the value of largest |v| (first on ties), d = v / -8 rounded away from zero to
    fp16 (so v is code 0 exactly), q = clip(round(x/d), -8, 7) + 8.
    Bound: |err| <= |d| <= amax/8 + u(amax/8) (a value of opposite sign near amax clips to +7d;
    every other value is within |d|/2).
  each plus amax * 2^-20 for float32 rounding.
"""

from __future__ import annotations

import numpy as np

from .base import (
    QuantFormat,
    fp16_bytes,
    fp16_directed_error,
    fp16_field,
    fp16_field_torch,
    fp16_round_down,
    fp16_round_up,
    pack_nibbles,
    safe_divide,
    unpack_nibbles,
    unpack_nibbles_torch,
)

_SLACK_REL = 2.0**-20  # float32 rounding, relative to amax


def check_group(group: int, family: str) -> int:
    group = int(group)
    if group < 8 or group % 8:
        raise ValueError(f"{family}: group size must be a positive multiple of 8, got {group}")
    return group


class Q4Group(QuantFormat):
    """Asymmetric group-wise int4: per group an fp16 scale d and fp16 minimum m."""

    def __init__(self, group: int):
        self.block_size = check_group(group, "Q4_G")
        self.type_size = 4 + self.block_size // 2
        self.name = f"Q4_G{self.block_size}"

    def _quantize_blocks(self, blocks):
        m = fp16_round_down(blocks.min(axis=-1, keepdims=True))
        m32 = m.astype(np.float32)
        d = fp16_round_up((blocks.max(axis=-1, keepdims=True) - m32) / np.float32(15))
        q = np.rint(safe_divide(blocks - m32, d.astype(np.float32))).clip(0, 15).astype(np.uint8)
        return np.concatenate([fp16_bytes(d), fp16_bytes(m), pack_nibbles(q)], axis=-1)

    def _dequantize_blocks(self, blocks):
        d, m = fp16_field(blocks, 0), fp16_field(blocks, 2)
        return d * unpack_nibbles(blocks[:, 4:]).astype(np.float32) + m

    def _dequantize_blocks_torch(self, blocks):
        d, m = fp16_field_torch(blocks, 0), fp16_field_torch(blocks, 2)
        return d * unpack_nibbles_torch(blocks[:, 4:]).float() + m

    def _block_error_bound(self, blocks):
        lo = blocks.min(axis=-1, keepdims=True)
        r = blocks.max(axis=-1, keepdims=True) - lo
        amax = np.abs(blocks).max(axis=-1, keepdims=True)
        d0 = (r + fp16_directed_error(lo)) / 15
        bound = (d0 + fp16_directed_error(d0)) / 2 + amax * _SLACK_REL
        return np.broadcast_to(bound, blocks.shape)


class Q4GroupSym(QuantFormat):
    """Symmetric group-wise int4: per group one fp16 scale d."""

    def __init__(self, group: int):
        self.block_size = check_group(group, "Q4_G_SYM")
        self.type_size = 2 + self.block_size // 2
        self.name = f"Q4_G{self.block_size}_SYM"

    def _quantize_blocks(self, blocks):
        i = np.argmax(np.abs(blocks), axis=-1)[:, None]
        v = np.take_along_axis(blocks, i, axis=-1)
        d = (-np.sign(v) * fp16_round_up(np.abs(v) / np.float32(8))).astype(np.float16)
        q = (np.rint(safe_divide(blocks, d.astype(np.float32))).clip(-8, 7) + 8).astype(np.uint8)
        return np.concatenate([fp16_bytes(d), pack_nibbles(q)], axis=-1)

    def _dequantize_blocks(self, blocks):
        d = fp16_field(blocks, 0)
        return d * (unpack_nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)).astype(np.float32)

    def _dequantize_blocks_torch(self, blocks):
        import torch

        d = fp16_field_torch(blocks, 0)
        return d * (unpack_nibbles_torch(blocks[:, 2:]).to(torch.int8) - 8).float()

    def _block_error_bound(self, blocks):
        amax = np.abs(blocks).max(axis=-1, keepdims=True)
        bound = amax / 8 + fp16_directed_error(amax / 8) + amax * _SLACK_REL
        return np.broadcast_to(bound, blocks.shape)
