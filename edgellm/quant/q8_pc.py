"""Q8_PC: per-output-channel symmetric int8 (ML Drift's "q8"). edgellm's own format, not a GGML type.

Row layout (a row is one output channel; n values, row_bytes = 4 + n):
  offset 0: scale, float32 little-endian
  offset 4: q[0..n-1], int8, one per value
  x[j] = scale * q[j]

The scale is float32 (not fp16) because it is paid once per row: it costs nothing measurable and
keeps the format free of fp16 range limits. In the format description block_size = type_size = 1
(any row length is allowed) and row_overhead = 4; bits_per_weight = 8 excludes the per-row 32 bits.
Stored in a GGUF file, the tensor is a uint8 array of shape (rows, 4 + n).

Quantization: scale = max|row| / 127 in float32, q = round_half_even(x / scale), in -127..127
(an all-zero row has scale 0 and q = 0).
Bound: |err| <= scale/2 = max|row| / 254, plus max|row| * 2^-20 for float32 rounding.
"""

from __future__ import annotations

import numpy as np

from .base import QuantFormat, safe_divide


class Q8_PC(QuantFormat):
    name, block_size, type_size, row_overhead = "Q8_PC", 1, 1, 4
    max_abs_input = None  # the float32 scale holds any finite float32

    def _quantize_rows(self, rows):
        scale = np.abs(rows).max(axis=-1, keepdims=True) / np.float32(127)
        q = np.rint(safe_divide(rows, scale)).clip(-127, 127).astype(np.int8)
        return np.concatenate([scale.astype("<f4").view(np.uint8), q.view(np.uint8)], axis=-1)

    def _dequantize_rows(self, data, n):
        scale = np.ascontiguousarray(data[:, :4]).view("<f4")
        return np.ascontiguousarray(data[:, 4:]).view(np.int8).astype(np.float32) * scale

    def _dequantize_rows_torch(self, data, n):
        import torch

        scale = data[:, :4].contiguous().view(torch.float32)
        return data[:, 4:].contiguous().view(torch.int8).float() * scale

    def error_bound(self, x):
        x = np.asarray(x, dtype=np.float32)
        self.raw_shape(x.shape)
        amax = np.abs(x.astype(np.float64)).max(axis=-1, keepdims=True)
        return np.broadcast_to(amax / 254 + amax * 2.0**-20, x.shape)
