"""The shape of every quantization format, and the small bit-level helpers the formats share.

A format stores a tensor row by row. Rows are the last axis: a weight of shape (out, in) is `out`
rows of `in` values, and every row is stored as `row_overhead` header bytes (only Q8_PC has any)
followed by `in // block_size` blocks of `type_size` bytes. Raw data is therefore a uint8 array of
shape (..., rows, row_bytes) -- exactly the shape `edgellm.gguf_file.TensorData.data` has for GGML
block types. Float formats (F32, F16, BF16) keep their numpy dtype instead (see float_formats.py).

A format subclass provides, for one chunk of rows:
  _quantize_rows(rows float32 (R, n))   -> uint8 (R, row_bytes)
  _dequantize_rows(data uint8 (R, row_bytes), n) -> float32 (R, n)
  _dequantize_rows_torch(...)           -> the same with torch tensors
and `error_bound(x)`, the documented per-value bound |x - dequantize(quantize(x))| <= bound.
Block formats only write the block functions; the row functions cut rows into blocks.

Every multi-byte field is little-endian (as in GGUF).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import EdgeLLMError, TensorShapeError

if TYPE_CHECKING:  # torch is imported only when a torch function is called
    import torch

FP16_MAX = 65504.0
_CHUNK_ELEMENTS = 1 << 20  # rows are processed in chunks of about this many values to bound temporaries


class QuantLayoutError(TensorShapeError, ValueError):
    """Data does not fit a format's layout: a row length that is not a whole number of blocks, or
    raw data of the wrong byte length or dtype."""


class QuantizationError(EdgeLLMError, ValueError):
    """Values a format cannot represent: NaN, infinity, or magnitudes beyond its scale fields' range."""


class QuantFormat:
    """One physical weight layout. Instances are immutable descriptions; the registry holds them."""

    name: str
    block_size: int  # values per block
    type_size: int  # bytes per block
    ggml_type: Any = None  # gguf.GGMLQuantizationType, or None for edgellm's own formats
    row_overhead: int = 0  # header bytes at the start of every row (Q8_PC's scale)
    can_quantize: bool = True
    max_abs_input: float | None = FP16_MAX  # larger magnitudes overflow the format's fp16 fields

    # -- description ---------------------------------------------------------------------------

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per value, block headers included (Q8_PC's per-row scale excluded)."""
        return 8.0 * self.type_size / self.block_size

    def row_bytes(self, n_cols: int) -> int:
        """Bytes one row of `n_cols` values takes."""
        n_cols = int(n_cols)
        if n_cols <= 0 or n_cols % self.block_size:
            raise QuantLayoutError(
                f"{self.name}: a row of {n_cols} values is not a whole number of blocks of {self.block_size}"
            )
        return self.row_overhead + n_cols // self.block_size * self.type_size

    def raw_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape `quantize` returns for a float array of `shape`."""
        shape = _check_shape(self, shape)
        return shape[:-1] + (self.row_bytes(shape[-1]),)

    def __repr__(self) -> str:
        return f"<quant format {self.name}: {self.block_size} values in {self.type_size} bytes>"

    # -- numpy -------------------------------------------------------------------------------

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """float32 values (..., n_cols) -> raw data (..., row_bytes) in this format."""
        if not self.can_quantize:
            raise QuantizationError(f"{self.name} can be read (dequantized) but edgellm cannot write it")
        x = np.asarray(x, dtype=np.float32)
        out_shape = self.raw_shape(x.shape)
        self._check_values(x)
        n = x.shape[-1]
        rows = x.reshape(-1, n)
        out = np.empty((rows.shape[0], out_shape[-1]), dtype=np.uint8)
        step = max(1, _CHUNK_ELEMENTS // n)
        # blocks of float32-subnormal values overflow 1/d (as in ggml); they decode to 0 all the same
        with np.errstate(over="ignore", invalid="ignore"):
            for i in range(0, rows.shape[0], step):
                out[i:i + step] = self._quantize_rows(rows[i:i + step])
        return out.reshape(out_shape)

    def dequantize(self, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Raw data -> a new float32 array of `shape`."""
        shape = _check_shape(self, shape)
        n = shape[-1]
        row_bytes = self.row_bytes(n)
        n_rows = math.prod(shape[:-1])
        data = self._raw_bytes(raw, n_rows * row_bytes, shape).reshape(n_rows, row_bytes)
        out = np.empty((n_rows, n), dtype=np.float32)
        step = max(1, _CHUNK_ELEMENTS // n)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf fields decode to NaN/inf, quietly
            for i in range(0, n_rows, step):
                out[i:i + step] = self._dequantize_rows(data[i:i + step], n)
        return out.reshape(shape)

    def error_bound(self, x: np.ndarray) -> np.ndarray:
        """Per-value bound (same shape as x) on |x - dequantize(quantize(x))|, derived in the module docstring."""
        x = np.asarray(x, dtype=np.float32)
        _check_shape(self, x.shape)
        n = x.shape[-1]
        self.row_bytes(n)
        blocks = x.reshape(-1, self.block_size).astype(np.float64)
        return self._block_error_bound(blocks).reshape(x.shape)

    def _raw_dtypes(self) -> tuple[np.dtype, ...]:
        return (np.dtype(np.uint8), np.dtype(np.int8))

    def _raw_bytes(self, raw: Any, expected: int, shape: tuple[int, ...]) -> np.ndarray:
        """The raw data as a flat uint8 array, checked for dtype and length."""
        raw = np.asarray(raw)
        if raw.dtype not in self._raw_dtypes():
            allowed = ", ".join(str(d) for d in self._raw_dtypes())
            raise QuantLayoutError(f"{self.name}: raw data must be {allowed}, got {raw.dtype}")
        flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        if flat.size != expected:
            raise QuantLayoutError(
                f"{self.name}: raw data for shape {shape} must be {expected} bytes, got {flat.size} "
                f"(array of shape {raw.shape}, {raw.dtype})"
            )
        return flat

    def _check_values(self, x: np.ndarray) -> None:
        if self.max_abs_input is None and np.isfinite(x).all():
            return
        amax = float(np.max(np.abs(x))) if x.size else 0.0  # NaN propagates through max
        if not math.isfinite(amax):
            raise QuantizationError(f"{self.name}: cannot quantize NaN or infinite values")
        if self.max_abs_input is not None and amax > self.max_abs_input:
            raise QuantizationError(
                f"{self.name}: cannot quantize |x| = {amax:g}: its scale fields hold magnitudes "
                f"up to {self.max_abs_input:g}"
            )

    # -- torch -------------------------------------------------------------------------------

    def dequantize_torch(self, raw: "torch.Tensor", shape: tuple[int, ...]) -> "torch.Tensor":
        """Like `dequantize`, with torch tensors (CPU, multi-threaded); bitwise equal to it."""
        import torch

        shape = _check_shape(self, shape)
        n = shape[-1]
        row_bytes = self.row_bytes(n)
        n_rows = math.prod(shape[:-1])
        if not isinstance(raw, torch.Tensor):
            raise QuantLayoutError(f"{self.name}: dequantize_torch needs a torch.Tensor, got {type(raw).__name__}")
        allowed = self._raw_torch_dtypes()
        if raw.dtype not in allowed:
            raise QuantLayoutError(
                f"{self.name}: raw data must be {', '.join(str(d) for d in allowed)}, got {raw.dtype}"
            )
        flat = raw.contiguous().reshape(-1).view(torch.uint8)
        if flat.numel() != n_rows * row_bytes:
            raise QuantLayoutError(
                f"{self.name}: raw data for shape {shape} must be {n_rows * row_bytes} bytes, got {flat.numel()} "
                f"(tensor of shape {tuple(raw.shape)}, {raw.dtype})"
            )
        return self._dequantize_rows_torch(flat.reshape(n_rows, row_bytes), n).reshape(shape)

    def _raw_torch_dtypes(self) -> tuple:
        import torch

        return (torch.uint8, torch.int8)

    # -- what subclasses provide -------------------------------------------------------------

    def _quantize_rows(self, rows: np.ndarray) -> np.ndarray:
        blocks = self._quantize_blocks(rows.reshape(-1, self.block_size))
        return blocks.reshape(rows.shape[0], -1)

    def _dequantize_rows(self, data: np.ndarray, n: int) -> np.ndarray:
        return self._dequantize_blocks(data.reshape(-1, self.type_size)).reshape(data.shape[0], n)

    def _dequantize_rows_torch(self, data: "torch.Tensor", n: int) -> "torch.Tensor":
        return self._dequantize_blocks_torch(data.reshape(-1, self.type_size)).reshape(data.shape[0], n)

    def _quantize_blocks(self, blocks: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _dequantize_blocks(self, blocks: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _dequantize_blocks_torch(self, blocks: "torch.Tensor") -> "torch.Tensor":
        raise NotImplementedError

    def _block_error_bound(self, blocks: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def _check_shape(fmt: QuantFormat, shape: Any) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in shape)
    except TypeError:
        raise QuantLayoutError(f"{fmt.name}: shape must be a tuple of ints, got {shape!r}") from None
    if not shape or min(shape) < 0:
        raise QuantLayoutError(f"{fmt.name}: needs a shape with at least one axis (rows last), got {shape}")
    return shape


# -- fp16 fields -------------------------------------------------------------------------------

def fp16_bytes(v: np.ndarray) -> np.ndarray:
    """float values (N,) or (N, 1) -> their fp16 (round to nearest even) as uint8 (N, 2)."""
    return np.ascontiguousarray(v, dtype=np.float32).astype("<f2").reshape(-1, 1).view(np.uint8)


def fp16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at byte `offset` of each block (N, type_size) -> float32 (N, 1)."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view("<f2").astype(np.float32)


def fp16_field_torch(blocks: "torch.Tensor", offset: int) -> "torch.Tensor":
    import torch

    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def fp16_round_up(v: np.ndarray) -> np.ndarray:
    """The smallest fp16 >= v (v finite float32), as float16."""
    v = np.asarray(v, dtype=np.float32)
    h = v.astype(np.float16)
    with np.errstate(over="ignore"):
        return np.where(h.astype(np.float32) < v, np.nextafter(h, np.float16(np.inf)), h)


def fp16_nearest_error(v):
    """Largest |v - fp16(v)| for round to nearest: half an fp16 ulp (2^-25 in the subnormal range)."""
    return np.maximum(np.abs(v) * 2.0**-11, 2.0**-25)


def fp16_directed_error(v):
    """Largest |v - fp16(v)| for rounding up or down: one fp16 ulp (2^-24 in the subnormal range)."""
    return np.maximum(np.abs(v) * 2.0**-10, 2.0**-24)


def fp16_round_down(v: np.ndarray) -> np.ndarray:
    """The largest fp16 <= v (v finite float32), as float16."""
    return -fp16_round_up(-np.asarray(v, dtype=np.float32))


# -- 4-bit packing (GGML's "halves" order) ------------------------------------------------------
# A block of 2B four-bit codes is stored in B bytes: byte i holds code i in its low nibble and
# code i + B in its high nibble.

def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 (N, 2B) -> uint8 (N, B)."""
    half = q.shape[-1] // 2
    return (q[:, :half] | (q[:, half:] << np.uint8(4))).astype(np.uint8)


def unpack_nibbles(b: np.ndarray) -> np.ndarray:
    """uint8 (N, B) -> codes (N, 2B) as uint8."""
    return np.concatenate([b & np.uint8(0x0F), b >> np.uint8(4)], axis=-1)


def unpack_nibbles_torch(b: "torch.Tensor") -> "torch.Tensor":
    import torch

    b = b.contiguous()  # torch is several times slower on strided slices with short rows
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def round_half_away(v: np.ndarray) -> np.ndarray:
    """Round to nearest, ties away from zero (C's roundf), exactly, in float32."""
    a = np.abs(v)
    whole = np.floor(a)
    return np.sign(v) * (whole + (a - whole >= np.float32(0.5)))


def safe_reciprocal(d: np.ndarray) -> np.ndarray:
    """1/d, and 0 where d is 0 (an all-zero block quantizes to zero codes)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def safe_divide(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """x/d, and 0 where d is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d == 0, np.float32(0), x / np.where(d == 0, np.float32(1), d)).astype(np.float32)
