"""Weight repacking: GGUF rows of GGML blocks -> the physical layouts the kernels read.

A `PackedWeight` is the physical descriptor of one logical (out, in) weight (y = x @ W.T).
GGML interleaves each block's scale with its quants (18 bytes per Q4_0 block), which leaves the
quants 2-byte aligned; here scales and quants become separate row-major arrays, so a thread can
read 16 bytes of quants with one aligned load and the scales come from their own small array.

Layouts (all row-major, one row per output feature, `nb = in / 32` blocks per row):
  F16   qs fp16 [out, in]                              (F32 and BF16 are converted to fp16)
  Q8_0  qs int8 [out, in]      d fp16 [out, nb]          value = q * d
  Q4_0  qs uint8 [out, in/2]   d fp16 [out, nb]          value = (q - 8) * d
  Q4_1  qs uint8 [out, in/2]   d fp16 [out, nb]  m fp16 [out, nb]   value = q * d + m
Two GGML types are converted into these layouts rather than given their own:
  Q5_0 -> Q8_0 exactly (q - 16 fits in int8, same fp16 scale per 32);
  Q4_K -> Q4_1: each 32-element sub-block gets d = super-block d * 6-bit scale and m = -dmin * 6-bit
  min, rounded to fp16 (relative error <= 2^-11 of each value; 5 bits per weight instead of 4.5).
Other K-quants (Q5_K, Q6_K) and Q5_1 have no exact layout here: see `pack_float`.
In the 4-bit layouts, byte j (0..15) of a block holds element j in its low nibble and element
j + 16 in its high nibble, exactly as in GGML: a block's 16 bytes give its first half from the
low nibbles and its second half from the high nibbles, so both halves pair with contiguous runs
of x. Row byte counts are multiples of 16, so rows start 16-byte aligned and `qs.view(torch.int32)`
is the same data as 32-bit words (the decode kernels read Q4 that way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ....errors import TensorShapeError

# GGML type name -> (block elements, bytes per block)
_BLOCK = {"F16": (1, 2), "BF16": (1, 2), "F32": (1, 4), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34),
          "Q5_0": (32, 22), "Q4_K": (256, 144)}
SUPPORTED_FORMATS = frozenset(_BLOCK)
PACKED_FORMATS = ("F16", "Q4_0", "Q4_1", "Q8_0")  # what PackedWeight.fmt can be after repacking
_FP16_MAX = 65504.0


class UnsupportedFormatError(NotImplementedError):
    """`repack` has no kernel layout for this GGML type; dequantize to fp16 and repack as F16."""


@dataclass
class PackedWeight:
    """A weight of logical shape (out, in) stored in a kernel layout (see the module docstring)."""

    fmt: str  # one of PACKED_FORMATS
    shape: tuple[int, int]  # (out, in)
    qs: torch.Tensor
    d: torch.Tensor | None = None
    m: torch.Tensor | None = None
    source_fmt: str = ""  # the GGML type it came from
    layout: str = field(default="")

    def __post_init__(self):
        if not self.layout:
            self.layout = f"{self.fmt.lower()}.rowmajor"
        if not self.source_fmt:
            self.source_fmt = self.fmt

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in (("qs", self.qs), ("d", self.d), ("m", self.m)) if v is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to(self, device) -> "PackedWeight":
        moved = {k: v.to(device) for k, v in self.tensors.items()}
        return PackedWeight(self.fmt, self.shape, source_fmt=self.source_fmt, layout=self.layout, **moved)


def can_repack(fmt: str) -> bool:
    return fmt.upper() in SUPPORTED_FORMATS


def _as_torch(raw) -> torch.Tensor:
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(raw))
    if not isinstance(raw, torch.Tensor):
        raise TypeError(f"raw weight data must be a torch tensor or numpy array, got {type(raw).__name__}")
    return raw


def _to_f16(w: torch.Tensor, what: str) -> torch.Tensor:
    w32 = w.float()
    big = w32.abs().max().item() if w32.numel() else 0.0
    if not np.isfinite(big) or big > _FP16_MAX:
        raise ValueError(f"{what}: values up to {big} do not fit in fp16 (max {_FP16_MAX}); "
                         f"keep this weight in the CPU backend or in a float32 layout")
    return w32.half()


def repack(raw, fmt: str, shape, device=None) -> PackedWeight:
    """Repack one weight, given as GGUF stores it, into its kernel layout.

    raw: uint8 rows of blocks (out, in / block * type_size), or for float types either such bytes
    or the typed (out, in) array; fmt: GGML type name ("Q4_0", "F16", ...); shape: (out, in).
    Raises UnsupportedFormatError (a NotImplementedError) for types without a kernel layout.
    """
    fmt = fmt.upper()
    if fmt not in _BLOCK:
        raise UnsupportedFormatError(
            f"no kernel layout for GGML type {fmt}; supported: {', '.join(sorted(_BLOCK))}. "
            f"Dequantize it to fp16 and repack as F16 instead.")
    if len(shape) != 2:
        raise TensorShapeError(f"repack expects a 2D weight (out, in), got shape {tuple(shape)}")
    n_out, n_in = (int(s) for s in shape)
    block, tsize = _BLOCK[fmt]
    if n_in % block:
        raise TensorShapeError(f"{fmt} weight of shape {(n_out, n_in)}: rows of {n_in} are not whole blocks of {block}")
    raw = _as_torch(raw)
    if device is not None:
        raw = raw.to(device)
    row_bytes = n_in // block * tsize

    if fmt in ("F16", "BF16", "F32"):
        want = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[fmt]
        if raw.dtype == torch.uint8:
            if tuple(raw.shape) != (n_out, row_bytes):
                raise TensorShapeError(f"{fmt} weight {(n_out, n_in)}: raw bytes have shape {tuple(raw.shape)}, "
                                       f"expected {(n_out, row_bytes)}")
            w = raw.contiguous().view(want)
        else:
            if raw.dtype != want or tuple(raw.shape) != (n_out, n_in):
                raise TensorShapeError(f"{fmt} weight: got a {raw.dtype} array of shape {tuple(raw.shape)}, "
                                       f"expected {want} {(n_out, n_in)}")
            w = raw
        w = w.contiguous() if fmt == "F16" else _to_f16(w, f"{fmt} weight {(n_out, n_in)}")
        return PackedWeight("F16", (n_out, n_in), qs=w.contiguous(), source_fmt=fmt)

    if raw.dtype != torch.uint8 or tuple(raw.shape) != (n_out, row_bytes):
        raise TensorShapeError(f"{fmt} weight {(n_out, n_in)}: raw data is {raw.dtype} {tuple(raw.shape)}, "
                               f"expected uint8 {(n_out, row_bytes)}")
    if fmt == "Q4_K":
        return _repack_q4_k(raw, n_out, n_in)
    nb = n_in // 32
    blocks = raw.contiguous().reshape(n_out, nb, tsize)

    def f16(lo):  # the fp16 field at byte offset lo of every block -> [out, nb]
        return blocks[:, :, lo:lo + 2].contiguous().view(torch.float16).reshape(n_out, nb)

    if fmt == "Q8_0":
        qs = blocks[:, :, 2:34].contiguous().view(torch.int8).reshape(n_out, n_in)
        return PackedWeight("Q8_0", (n_out, n_in), qs=qs, d=f16(0))
    if fmt == "Q4_0":
        qs = blocks[:, :, 2:18].reshape(n_out, nb * 16).contiguous()
        return PackedWeight("Q4_0", (n_out, n_in), qs=qs, d=f16(0))
    if fmt == "Q5_0":
        qh = blocks[:, :, 2:6].contiguous().view(torch.int32)  # [out, nb, 1]: bit j = high bit of element j
        bits = (qh >> torch.arange(32, dtype=torch.int32, device=raw.device)) & 1  # [out, nb, 32]
        lo = blocks[:, :, 6:22].to(torch.int32)
        q = torch.cat([lo & 15, lo >> 4], dim=2) | (bits << 4)
        qs = (q - 16).to(torch.int8).reshape(n_out, n_in)
        return PackedWeight("Q8_0", (n_out, n_in), qs=qs, d=f16(0), source_fmt="Q5_0")
    # Q4_1
    qs = blocks[:, :, 4:20].reshape(n_out, nb * 16).contiguous()
    return PackedWeight("Q4_1", (n_out, n_in), qs=qs, d=f16(0), m=f16(2))


def _repack_q4_k(raw: torch.Tensor, n_out: int, n_in: int) -> PackedWeight:
    """Q4_K super-blocks (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles) -> the
    Q4_1 layout, one (d * scale, -dmin * min) pair per 32-element sub-block."""
    from ....quant.ggml_kquants import _unpack_scales

    nsb = n_in // 256
    blocks = raw.contiguous().reshape(n_out * nsb, 144)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [N, 1]
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    sc, mn = _unpack_scales(blocks[:, 4:16])  # [N, 8] each
    sub_d = d * sc.float()
    sub_m = -(dmin * mn.float())
    for what, v in (("scale", sub_d), ("minimum", sub_m)):
        big = v.abs().max().item() if v.numel() else 0.0
        if not np.isfinite(big) or big > _FP16_MAX:
            raise ValueError(f"Q4_K weight {(n_out, n_in)}: a sub-block {what} of {big} does not fit in fp16")
    # 64-element chunks: 32 bytes whose low nibbles are sub-block 2j and high nibbles sub-block 2j + 1
    qs = blocks[:, 16:].reshape(n_out * nsb, 4, 32)
    vals = torch.stack([qs & 15, qs >> 4], dim=2).reshape(n_out * nsb * 8, 32)  # element order
    packed = vals[:, :16] | (vals[:, 16:] << 4)  # byte i: element i (low), element i + 16 (high)
    nb = n_in // 32
    return PackedWeight("Q4_1", (n_out, n_in), qs=packed.reshape(n_out, nb * 16).contiguous(),
                        d=sub_d.reshape(n_out, nb).half(), m=sub_m.reshape(n_out, nb).half(), source_fmt="Q4_K")


def pack_float(w: torch.Tensor, fmt: str = "F16") -> PackedWeight:
    """Pack a float (out, in) matrix as F16 or as Q8_0 (llama.cpp's rounding, fp16 scales).

    For weights in a format without a kernel layout (K-quants, Q5_*): dequantize them and pack the
    result here; Q8_0 keeps half of F16's bytes, its error well under that of a 5- or 6-bit format."""
    if w.dim() != 2:
        raise TensorShapeError(f"pack_float expects a 2D weight, got shape {tuple(w.shape)}")
    n_out, n_in = w.shape
    fmt = fmt.upper()
    if fmt == "F16":
        return PackedWeight("F16", (n_out, n_in), qs=_to_f16(w, f"weight {(n_out, n_in)}").contiguous())
    if fmt != "Q8_0":
        raise UnsupportedFormatError(f"pack_float packs F16 or Q8_0, not {fmt}")
    if n_in % 32:
        raise TensorShapeError(f"Q8_0 weight {(n_out, n_in)}: rows of {n_in} are not whole blocks of 32")
    b = w.float().reshape(n_out, n_in // 32, 32)
    d = b.abs().amax(dim=2, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d.clamp_min(1e-30), torch.zeros_like(d))
    v = b * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)  # round half away from zero, as roundf
    return PackedWeight("Q8_0", (n_out, n_in), qs=q.to(torch.int8).reshape(n_out, n_in),
                        d=d.reshape(n_out, n_in // 32).half(), source_fmt="F32")


def concat_packed(weights: list[PackedWeight]) -> PackedWeight:
    """Stack weights of one format along the output axis (fused Q/K/V, fused gate/up)."""
    if not weights:
        raise ValueError("concat_packed needs at least one weight")
    fmt, n_in = weights[0].fmt, weights[0].in_features
    for w in weights:
        if w.fmt != fmt or w.in_features != n_in:
            raise ValueError(f"concat_packed: cannot stack {w.fmt} {w.shape} with {fmt} (*, {n_in})")
    parts = {k: torch.cat([w.tensors[k] for w in weights], 0) for k in weights[0].tensors}
    n_out = sum(w.out_features for w in weights)
    return PackedWeight(fmt, (n_out, n_in), source_fmt=weights[0].source_fmt, **parts)


def dequantize(w: PackedWeight, dtype=torch.float32) -> torch.Tensor:
    """The (out, in) matrix a PackedWeight stands for, with torch ops (for fallbacks and debugging)."""
    n_out, n_in = w.shape
    if w.fmt == "F16":
        return w.qs.to(dtype)
    d = w.d.float().reshape(n_out, n_in // 32, 1)
    if w.fmt == "Q8_0":
        return (w.qs.float().reshape(n_out, n_in // 32, 32) * d).reshape(n_out, n_in).to(dtype)
    q = w.qs.reshape(n_out, n_in // 32, 16)
    q = torch.cat([q & 15, q >> 4], dim=2).float()
    v = (q - 8) * d if w.fmt == "Q4_0" else q * d + w.m.float().reshape(n_out, n_in // 32, 1)
    return v.reshape(n_out, n_in).to(dtype)
