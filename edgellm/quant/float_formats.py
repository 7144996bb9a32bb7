"""Unquantized float formats: F32, F16, BF16 (GGML types 0, 1, 30).

Raw representation (what `quantize` returns and `dequantize` accepts):
  F32   float32 (..., n)          4 bytes per value; also accepted: its uint8 bytes (..., 4n)
  F16   float16 (..., n)          2 bytes, IEEE binary16; also accepted: uint16 bits or uint8 bytes
  BF16  uint16 bits (..., n)      2 bytes, the top half of a float32; also accepted: uint8 bytes
                                  (..., 2n), which is how GGUF files and gguf-py hold BF16

Conversions, matching ggml and gguf-py bit for bit:
  F16:  float32 -> fp16 round to nearest even (numpy's astype).
  BF16: round to nearest even on the float32 bits, NaN forced to a quiet NaN (sign and top payload
        bits kept, bit 22 set). Decoding a BF16 is exact: its bits shifted left by 16.

Error bounds (values within the format's normal range):
  F32 0;  F16 |x| * 2^-11 (or 2^-25 for subnormal fp16);  BF16 |x| * 2^-8 (or 2^-134).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType

from .base import QuantFormat, _check_shape

if TYPE_CHECKING:
    import torch


class _FloatFormat(QuantFormat):
    block_size = 1
    max_abs_input = None  # F16 overflows to inf like any cast; no scale fields to protect
    storage_dtype: np.dtype

    def quantize(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        self.raw_shape(x.shape)
        return self._encode(x)

    def raw_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return _check_shape(self, shape)

    def _raw_dtypes(self) -> tuple[np.dtype, ...]:
        return (np.dtype(self.storage_dtype), np.dtype(np.uint8))

    def _quantize_rows(self, rows: np.ndarray) -> np.ndarray:  # used only by the generic wrapper
        return self._encode(rows).view(np.uint8)

    def _dequantize_rows(self, data: np.ndarray, n: int) -> np.ndarray:
        return self._decode(np.ascontiguousarray(data))

    def _encode(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _decode(self, data: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class F32(_FloatFormat):
    name, type_size, ggml_type = "F32", 4, GGMLQuantizationType.F32
    storage_dtype = np.dtype("<f4")

    def _encode(self, x):
        return x.astype(np.float32, copy=True)

    def _decode(self, data):
        return data.view("<f4").astype(np.float32, copy=True)

    def _raw_torch_dtypes(self):
        import torch

        return (torch.float32, torch.uint8)

    def _dequantize_rows_torch(self, data, n):
        import torch

        return data.view(torch.float32).clone()

    def _block_error_bound(self, blocks):
        return np.zeros_like(blocks)


class F16(_FloatFormat):
    name, type_size, ggml_type = "F16", 2, GGMLQuantizationType.F16
    storage_dtype = np.dtype("<f2")

    def _raw_dtypes(self):
        return (np.dtype("<f2"), np.dtype("<u2"), np.dtype(np.uint8))

    def _encode(self, x):
        return x.astype(np.float16)

    def _decode(self, data):
        return data.view("<f2").astype(np.float32)

    def _raw_torch_dtypes(self):
        import torch

        return (torch.float16, torch.int16, torch.uint16, torch.uint8)

    def _dequantize_rows_torch(self, data, n):
        import torch

        return data.view(torch.float16).float()

    def _block_error_bound(self, blocks):
        return np.maximum(np.abs(blocks) * 2.0**-11, 2.0**-25)


class BF16(_FloatFormat):
    name, type_size, ggml_type = "BF16", 2, GGMLQuantizationType.BF16
    storage_dtype = np.dtype("<u2")

    def _encode(self, x):
        bits = np.ascontiguousarray(x).view(np.uint32).astype(np.uint64)
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        bits = np.where(is_nan, (bits & 0xFFFF0000) | 0x00400000, bits)
        lsb = (bits >> 16) & 1  # ties go to the even bf16
        return ((bits + 0x7FFF + lsb) >> 16).astype("<u2")

    def _decode(self, data):
        return (data.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)

    def _raw_torch_dtypes(self):
        import torch

        return (torch.bfloat16, torch.int16, torch.uint16, torch.uint8)

    def _dequantize_rows_torch(self, data: "torch.Tensor", n: int) -> "torch.Tensor":
        import torch

        # shifting the bits keeps every pattern (NaN payloads included) exactly as numpy does
        return (data.view(torch.int16).to(torch.int32) << 16).view(torch.float32)

    def _block_error_bound(self, blocks):
        return np.maximum(np.abs(blocks) * 2.0**-8, 2.0**-134)
