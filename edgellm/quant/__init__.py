"""Quantization formats: physical weight layouts, each with `quantize` and the reference `dequantize`.

    from edgellm.quant import get_format, quantize, dequantize, FORMATS
    fmt = get_format("Q4_0")          # case-insensitive; unknown -> UnknownTensorTypeError
    raw = quantize(w, "Q4_0")         # float32 (..., n) -> uint8 (..., fmt.row_bytes(n))
    w2 = dequantize(raw, "Q4_0", w.shape)

Rows are the last axis and blocks run along it. Formats:
  GGML, as stored in GGUF (dequantize bit-equal to gguf-py; quantize byte-equal to gguf-py where
  gguf-py has a quantizer): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (float_formats.py,
  ggml_legacy.py), Q4_K, Q5_K, Q6_K (ggml_kquants.py: own simple quantizer)
  edgellm's own: Q8_PC (q8_pc.py), Q4_G{g} / Q4_G{g}_SYM (q4_group.py), FP4_E0M4[_G{g}] (fp4_e0m4.py)
Each module's docstring gives the byte layout, the quantizer and the error bound that
`fmt.error_bound(x)` evaluates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .base import QuantFormat, QuantizationError, QuantLayoutError
from .compare import TENSOR_KINDS, compare_fp4_int4
from .fp4_e0m4 import FP4E0M4
from .registry import FORMATS, get_format

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMATS", "QuantFormat", "QuantLayoutError", "QuantizationError", "TENSOR_KINDS",
    "compare_fp4_int4", "dequantize", "dequantize_fp16_bits", "dequantize_torch", "get_format", "quantize",
]


def quantize(x: np.ndarray, name: Any) -> np.ndarray:
    """float32 (..., n_cols) -> raw data in format `name` (uint8 (..., row_bytes); F32/F16 keep
    their dtype, BF16 gives uint16 bits)."""
    return get_format(name).quantize(x)


def dequantize(raw: np.ndarray, name: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Raw data in format `name` -> a new float32 array of `shape`."""
    return get_format(name).dequantize(raw, shape)


def dequantize_torch(raw: "torch.Tensor", name: Any, shape: tuple[int, ...]) -> "torch.Tensor":
    """Raw data (a uint8 torch tensor; F32/F16/BF16 may also be their own dtype) -> float32 tensor
    of `shape`, bitwise equal to `dequantize`. Every format supports it."""
    return get_format(name).dequantize_torch(raw, shape)


def dequantize_fp16_bits(raw: np.ndarray, name: Any, shape: tuple[int, ...]) -> np.ndarray:
    """FP4_E0M4 decoded through fp16 bit patterns (shift and OR); identical to `dequantize`."""
    fmt = get_format(name)
    if not isinstance(fmt, FP4E0M4):
        raise QuantLayoutError(f"dequantize_fp16_bits decodes FP4_E0M4 formats, not {fmt.name}")
    return fmt.dequantize_fp16_bits(raw, shape)
