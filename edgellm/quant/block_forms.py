"""GGML blocks re-expressed as the plain block types the simplest kernels read, as GGUF bytes:
Q4_K as Q4_1, Q5_0 as Q8_0, and any readable type as Q8_0 by requantization. The cpu-fast
backend's native kernels (Q4_0, Q4_1, Q8_0) and the webgpu backend's descriptors are fed from
them. numpy on [rows, row bytes] uint8 arrays (a slab of rows at a time where the rows are many).

  Q4_K -> Q4_1  each 32-value sub-block gets d = D * sc and m = -DMIN * mn, rounded to fp16
                (relative error <= 2^-11 of each value; 5 bits per weight instead of 4.5)
  Q5_0 -> Q8_0  exactly: q - 16 in -16..15, the same fp16 scale per 32
  X -> Q8_0     dequantized (edgellm.quant, gguf-py's values) and quantized again (llama.cpp's
                rounding): |error| <= d / 2 = amax / 254 of each block of 32, plus the fp16
                rounding of d over codes up to 127 (6% of that)
"""

from __future__ import annotations

import numpy as np

from ..errors import TensorShapeError

_FP16_MAX = 65504.0
_SLAB_ELEMENTS = 16 << 20  # requantization decodes this many values at a time


def _rows(raw: np.ndarray, rows: int, row_bytes: int, what: str) -> np.ndarray:
    a = np.ascontiguousarray(raw).view(np.uint8)
    if a.size != rows * row_bytes:
        raise TensorShapeError(f"{what}: {a.size} bytes are not {rows} rows of {row_bytes}")
    return a.reshape(rows, row_bytes)


def q4_k_as_q4_1(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4_K rows (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles per 256 values)
    as Q4_1 rows (fp16 d, fp16 m, 16 bytes of nibbles per 32). ValueError where a sub-block's
    scale or minimum does not fit fp16."""
    from .ggml_kquants import _unpack_scales

    if cols % 256:
        raise TensorShapeError(f"Q4_K weight ({rows}, {cols}): rows are not whole super-blocks of 256")
    nsb, nb = cols // 256, cols // 32
    b = _rows(raw, rows, nsb * 144, f"Q4_K weight ({rows}, {cols})").reshape(rows * nsb, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [N, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _unpack_scales(b[:, 4:16])  # [N, 8] each
    sub_d, sub_m = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
    for what, v in (("scale", sub_d), ("minimum", sub_m)):
        big = float(np.abs(v).max()) if v.size else 0.0
        if not np.isfinite(big) or big > _FP16_MAX:
            raise ValueError(f"Q4_K weight ({rows}, {cols}): a sub-block {what} of {big} does not fit in fp16")
    # 64-value chunks: 32 bytes whose low nibbles are sub-block 2j and high nibbles sub-block 2j + 1
    qs = b[:, 16:].reshape(rows * nsb, 4, 32)
    vals = np.stack([qs & 15, qs >> 4], axis=2).reshape(rows * nb, 32)  # value order
    out = np.empty((rows * nb, 20), np.uint8)
    out[:, 0:2] = sub_d.reshape(-1, 1).astype(np.float16).view(np.uint8)
    out[:, 2:4] = sub_m.reshape(-1, 1).astype(np.float16).view(np.uint8)
    out[:, 4:] = vals[:, :16] | (vals[:, 16:] << 4)  # byte i: value i (low nibble), i + 16 (high)
    return out.reshape(rows, nb * 20)


def q5_0_as_q8_0(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q5_0 rows (fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles per 32) as Q8_0 rows, exactly."""
    nb = cols // 32
    b = _rows(raw, rows, nb * 22, f"Q5_0 weight ({rows}, {cols})").reshape(rows * nb, 22)
    qh = b[:, 2:6].copy().view(np.uint32)  # [N, 1]: bit j is bit 4 of value j
    bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
    lo = b[:, 6:22].astype(np.int16)
    q = np.concatenate([lo & 15, lo >> 4], axis=1) | (bits << 4)
    out = np.empty((rows * nb, 34), np.uint8)
    out[:, 0:2] = b[:, 0:2]
    out[:, 2:] = (q - 16).astype(np.int8).view(np.uint8)
    return out.reshape(rows, nb * 34)


def as_q8_0(raw: np.ndarray, fmt: str, rows: int, cols: int) -> np.ndarray:
    """Rows of any type edgellm.quant reads, requantized to Q8_0 from their values (Q5_0 exactly)."""
    from . import dequantize, quantize

    if fmt.upper() == "Q5_0":
        return q5_0_as_q8_0(raw, rows, cols)
    if fmt.upper() == "Q8_0":
        return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // 32 * 34)
    a = np.ascontiguousarray(raw)
    a = a.reshape(rows, -1) if a.size else a.reshape(rows, 0)
    step = max(1, _SLAB_ELEMENTS // max(cols, 1))
    out = [quantize(np.asarray(dequantize(a[r:r + step], fmt, (min(step, rows - r), cols)), np.float32), "Q8_0")
           for r in range(0, rows, step)]
    return np.concatenate(out).reshape(rows, cols // 32 * 34) if out else np.empty((0, cols // 32 * 34), np.uint8)
