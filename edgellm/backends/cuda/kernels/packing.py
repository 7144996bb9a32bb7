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
  Q4K   qs uint8 [out, in/2]   d int16 [out, nb]  m fp16 [out, nb / 4]  value = q * (D * sc) - (DMIN * mn)
        Q4_K in its own terms: the nibbles as in Q4_0, d holds each 32-element sub-block's 6-bit scale
        sc (bits 0..5) and 6-bit minimum mn (bits 8..13), m each 256-element super-block's fp16 D and
        DMIN, one (D, DMIN) pair per 8 blocks (4.625 bits per weight; the kernels multiply in fp32,
        as llama.cpp does).
  Q5K   qs uint8 [out, nb * 20]   d int16 [out, nb]  m fp16 [out, nb / 4]  value = q * (D * sc) - (DMIN * mn)
        Q5_K in its own terms: codes 0..31, their low four bits as Q4_0's nibbles (nb * 16 bytes),
        then one 32-bit word of fifth bits per block (nb * 4 bytes): bit 4h + w of byte i holds bit 4
        of element 16h + 4w + i, so that word w of a block's nibbles meets its elements' fifth bits
        at bits w and w + 4 of every byte of that word (one shift and mask per half). Scales and
        minimums as Q4K (Q5_K's are Q4_K's): 5.625 bits per weight.
  Q6K   qs uint8 [out, nb * 24] as Q6  d int8 [out, in/16]  m fp32 [out, in/256]  value = (q - 32) * D * sc
        Q6_K in its own terms: the codes as Q6 stores them, each 16 elements' int8 scale sc as stored,
        each 256-element super-block's fp16 D held as fp32 (exactly; a 4-byte load the prefill
        tile's pipeliner copies ahead, a 2-byte one it would not): 6.625 bits per weight.
  Q4K, Q5K and Q6K are made from Q4_K, Q5_K and Q6_K by default (EDGELLM_KQUANTS=converted: the
  conversions below instead; see kquant_layout). H100, 2026-11-28, decode tg128 native against
  converted: 8B Q4_K_M 416.8 against 410.0 tok/s (prefill 12,358 against 12,622), 1B Q4_K_M the
  same within 1%; 8B Q5_K_M 371.8 against 329.0 (prefill +9%), 1B Q5_K_M 1,541.5 against 1,407.8.
Two GGML types are converted into these layouts rather than given their own:
  Q5_0 -> Q8_0 exactly (q - 16 fits in int8, same fp16 scale per 32);
  Q4_K -> Q4_1: each 32-element sub-block gets d = super-block d * 6-bit scale and m = -dmin * 6-bit
  min, rounded to fp16 (relative error <= 2^-11 of each value; 5 bits per weight instead of 4.5).
Six-bit codes (Q6_K, Q5_K, Q5_1, and stacks of parts in different formats):
  Q6    qs uint8 [out, nb * 24]   d fp16 [out, 2 * nb]               value = (q - 32) * d
  Q6M   qs uint8 [out, nb * 24]   d fp16 [out, 2 * nb]  m fp16 [out, 2 * nb]   value = (q - 32) * d + m
  with q in 0..63 and one scale (and minimum) per 16 elements: d[2b] for elements 0..15 of block b,
  d[2b + 1] for elements 16..31. A row of qs is the blocks' low four bits (nb * 16 bytes, byte j of a
  block: element j low nibble, element j + 16 high nibble, as in Q4_0), then their top two bits
  (nb * 8 bytes): byte 4h + i of a block holds, at bits 2w and 2w + 1, bits 4..5 of element
  16h + 4w + i (h: which half, w = 0..3). So 32-bit word w of a block's nibbles (elements 4w..4w+3 and
  16+4w..16+4w+3, one per byte) meets the top bits of the same elements in bits 2w, 2w+1 of every
  byte of the block's two high-bit words: one shift and one masked merge per word rebuild four
  whole 6-bit codes, one per byte (ready for dp4a, or for the exponent trick of the float path).
  Why this layout: Q6_K's 16-element sub-blocks need a scale per 16 (d * scale, rounded to fp16 as
  Q4_K -> Q4_1 rounds; the two per-16 scales line up with a block's low and high nibble halves), and
  the 4-bit part keeps Q4_0's arrangement, so the decode and prefill kernels reuse Q4's structure.
  Q6 is 7 bits per weight (Q6_K: 6.5625; the old Q8_0 requantization: 8.5, lossy), Q6M 8.
  Conversions (exact but for that fp16 rounding of d * scale and dmin * min):
    Q6_K -> Q6   q as stored, d = d * scale per 16
    Q5_K -> Q6M  q + 32, d = d * scale and m = -dmin * min of the 32-element sub-block, twice
    Q5_1 -> Q6M  q + 32, d and m of the block, twice (exact: the fields are copied)
  and, in stacks (`unify_formats`), packed Q4_0 -> Q6 (q + 24), Q4_1 -> Q6M (q + 32), Q8_0 -> Q6 when
  every code is in -32..31 (Q5_0's are), Q6 -> Q6M (m = 0): all exact copies of the fp16 fields.
Other types (Q2_K, Q3_K, IQ*) have no layout here: see `pack_float`.
In the 4-bit layouts, byte j (0..15) of a block holds element j in its low nibble and element
j + 16 in its high nibble, exactly as in GGML: a block's 16 bytes give its first half from the
low nibbles and its second half from the high nibbles, so both halves pair with contiguous runs
of x. Row byte counts are multiples of 16, so rows start 16-byte aligned and `qs.view(torch.int32)`
is the same data as 32-bit words (the decode kernels read Q4 that way).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from ....errors import TensorShapeError
from ....quant.code_planes import (as_six_bit, pack_q5_codes, pack_q6_codes, q5_k_codes, six_bit_codes, tensor_of,
                                   unpack_q4_codes, unpack_q5_codes, unpack_q6_codes)

# GGML type name -> (block elements, bytes per block)
_BLOCK = {"F16": (1, 2), "BF16": (1, 2), "F32": (1, 4), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34),
          "Q5_0": (32, 22), "Q4_K": (256, 144), "Q5_1": (32, 24), "Q5_K": (256, 176), "Q6_K": (256, 210)}
SUPPORTED_FORMATS = frozenset(_BLOCK)
PACKED_FORMATS = ("F16", "Q4_0", "Q4_1", "Q8_0", "Q6", "Q6M", "Q4K", "Q5K", "Q6K")  # what PackedWeight.fmt can be after repacking
_SIX_BIT = ("Q6_K", "Q5_K", "Q5_1")  # GGML types repacked into Q6 / Q6M
# six-bit repacking decodes a slab of this many weights at a time (a few bytes of temporaries each)
_REPACK_SLAB_ELEMENTS = 16 << 20
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
        raw = tensor_of(raw)  # a read-only map of the model file: only ever read from here
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
        return _repack_q4_k(raw, n_out, n_in, native=kquant_layout() == "native")
    if fmt == "Q6_K" and kquant_layout() == "native":
        return _repack_q6_k_native(raw, n_out, n_in)
    if fmt == "Q5_K" and kquant_layout() == "native":
        return _repack_q5_k_native(raw, n_out, n_in)
    if fmt in _SIX_BIT:
        return _repack_six_bit(raw, fmt, n_out, n_in)
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


def kquant_layout() -> str:
    """How Q4_K, Q5_K and Q6_K weights are laid out for the kernels, from EDGELLM_KQUANTS: "native"
    (default: the Q4K, Q5K and Q6K layouts, the scales' codes and the super-block's fp16 fields as
    stored) or "converted" (Q4_K as Q4_1, Q5_K as Q6M, Q6_K as Q6, each sub-block's scale (and
    minimum) multiplied out and rounded to fp16)."""
    mode = os.environ.get("EDGELLM_KQUANTS", "native").strip().lower()
    if mode not in ("converted", "native"):
        raise ValueError(f"EDGELLM_KQUANTS={mode!r}: expected 'converted' or 'native'")
    return mode


def _repack_q4_k(raw: torch.Tensor, n_out: int, n_in: int, native: bool = False) -> PackedWeight:
    """Q4_K super-blocks (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles) -> the
    Q4_1 layout, one (d * scale, -dmin * min) pair per 32-element sub-block; with native, the Q4K
    layout (the codes and the super-block pair as stored, no rounding)."""
    from ....quant.ggml_kquants import _unpack_scales

    nsb = n_in // 256
    blocks = raw.contiguous().reshape(n_out * nsb, 144)
    sc, mn = _unpack_scales(blocks[:, 4:16])  # [N, 8] each
    # 64-element chunks: 32 bytes whose low nibbles are sub-block 2j and high nibbles sub-block 2j + 1
    qs = blocks[:, 16:].reshape(n_out * nsb, 4, 32)
    vals = torch.stack([qs & 15, qs >> 4], dim=2).reshape(n_out * nsb * 8, 32)  # element order
    packed = (vals[:, :16] | (vals[:, 16:] << 4)).reshape(n_out, n_in // 2)  # byte i: element i, i + 16
    nb = n_in // 32
    if native:
        codes = (sc.to(torch.int16) | (mn.to(torch.int16) << 8)).reshape(n_out, nb)
        pair = blocks[:, 0:4].contiguous().view(torch.float16).reshape(n_out, 2 * nsb)  # (D, DMIN) per super-block
        return PackedWeight("Q4K", (n_out, n_in), qs=packed.contiguous(), d=codes.contiguous(), m=pair.contiguous(),
                            source_fmt="Q4_K")
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [N, 1]
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    sub_d = d * sc.float()
    sub_m = -(dmin * mn.float())
    for what, v in (("scale", sub_d), ("minimum", sub_m)):
        big = v.abs().max().item() if v.numel() else 0.0
        if not np.isfinite(big) or big > _FP16_MAX:
            raise ValueError(f"Q4_K weight {(n_out, n_in)}: a sub-block {what} of {big} does not fit in fp16")
    return PackedWeight("Q4_1", (n_out, n_in), qs=packed.contiguous(),
                        d=sub_d.reshape(n_out, nb).half(), m=sub_m.reshape(n_out, nb).half(), source_fmt="Q4_K")


def _checked_f16(v: torch.Tensor, what: str) -> torch.Tensor:
    big = v.abs().max().item() if v.numel() else 0.0
    if not np.isfinite(big) or big > _FP16_MAX:
        raise ValueError(f"{what} of {big} does not fit in fp16 (max {_FP16_MAX})")
    return v.half()


def _in_slabs(raw: torch.Tensor, n_out: int, n_in: int, fmt: str, pack) -> list:
    """pack(blocks [r * blocks per row, type size], r) -> a tuple of [r, ...] tensors (or None), for
    each slab of rows of raw in turn (an 8B model's Q6_K output matrix has 525M weights: its
    temporaries are a few bytes per weight); each tuple entry's slabs concatenated by rows."""
    block, tsize = _BLOCK[fmt]
    rows = max(1, _REPACK_SLAB_ELEMENTS // n_in)
    outs = []
    for r0 in range(0, n_out, rows):
        slab = raw[r0:r0 + rows].contiguous()
        r = slab.shape[0]
        outs.append(pack(slab.reshape(r * (n_in // block), tsize), r))
    return [None if parts[0] is None else parts[0] if len(parts) == 1 else torch.cat(parts, 0) for parts in zip(*outs)]


def _repack_six_bit(raw: torch.Tensor, fmt: str, n_out: int, n_in: int) -> PackedWeight:
    """Q6_K, Q5_K, Q5_1 rows -> Q6 / Q6M (see the module docstring), with torch ops on raw's device."""
    what = f"{fmt} weight {(n_out, n_in)}"

    def pack(blocks, r):
        q, d, m = six_bit_codes(blocks, fmt)
        return (pack_q6_codes(q.reshape(r, n_in)), _checked_f16(d.reshape(r, n_in // 16), f"{what}: a scale"),
                None if m is None else _checked_f16(m.reshape(r, n_in // 16), f"{what}: a minimum"))

    qs, d, m = _in_slabs(raw, n_out, n_in, fmt, pack)
    return PackedWeight("Q6M" if m is not None else "Q6", (n_out, n_in), qs=qs, d=d, m=m, source_fmt=fmt)


def _repack_q6_k_native(raw: torch.Tensor, n_out: int, n_in: int) -> PackedWeight:
    """Q6_K rows -> the Q6K layout: the codes packed as Q6, the int8 scales as stored, each
    super-block's fp16 D as fp32."""
    def pack(blocks, r):
        q, _, _ = six_bit_codes(blocks, "Q6_K")
        return (pack_q6_codes(q.reshape(r, n_in)), blocks[:, 192:208].contiguous().view(torch.int8).reshape(r, n_in // 16),
                blocks[:, 208:210].contiguous().view(torch.float16).reshape(r, n_in // 256).float())

    qs, d, m = _in_slabs(raw, n_out, n_in, "Q6_K", pack)
    return PackedWeight("Q6K", (n_out, n_in), qs=qs, d=d, m=m, source_fmt="Q6_K")


def _repack_q5_k_native(raw: torch.Tensor, n_out: int, n_in: int) -> PackedWeight:
    """Q5_K rows -> the Q5K layout: the codes packed as Q5K, the 6-bit scale and minimum codes as
    Q4K keeps them, each super-block's fp16 (D, DMIN) pair as stored."""
    from ....quant.ggml_kquants import _unpack_scales

    def pack(blocks, r):
        sc, mn = _unpack_scales(blocks[:, 4:16])  # [r * blocks, 8] each
        return (pack_q5_codes(q5_k_codes(blocks).reshape(r, n_in)),
                (sc.to(torch.int16) | (mn.to(torch.int16) << 8)).reshape(r, n_in // 32),
                blocks[:, 0:4].contiguous().view(torch.float16).reshape(r, n_in // 128))

    qs, d, m = _in_slabs(raw, n_out, n_in, "Q5_K", pack)
    return PackedWeight("Q5K", (n_out, n_in), qs=qs, d=d, m=m, source_fmt="Q5_K")


def q6k_scales(w: PackedWeight) -> torch.Tensor:
    """A Q6K weight's per-16 scale (float32 [out, in / 16]): D * sc."""
    return w.m.float().repeat_interleave(16, dim=1) * w.d.float()


def q6k_as_q6(w: PackedWeight) -> PackedWeight:
    """A Q6K weight in the Q6 layout, each scale rounded to fp16 (as the default Q6_K -> Q6 repack)."""
    return PackedWeight("Q6", w.shape, qs=w.qs, d=_checked_f16(q6k_scales(w), f"Q6_K weight {w.shape}: a scale"),
                        source_fmt=w.source_fmt)


def _codes_of(w: PackedWeight) -> torch.Tensor:
    """The integer codes of a quantized PackedWeight, [out, in] int16, element order."""
    n_out, n_in = w.shape
    if w.fmt == "Q8_0":
        return w.qs.to(torch.int16)
    if w.fmt in ("Q6", "Q6M", "Q6K"):
        return unpack_q6_codes(w.qs, n_in).to(torch.int16)
    if w.fmt == "Q5K":
        return unpack_q5_codes(w.qs, n_in).to(torch.int16)
    return unpack_q4_codes(w.qs, n_in).to(torch.int16)


def q4k_scales(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4K (or Q5K) weight's per-32 scale and minimum (float32 [out, nb]): D * sc and -(DMIN * mn)."""
    n_out, nb = w.d.shape
    codes = w.d.to(torch.int32)
    pair = w.m.float().reshape(n_out, nb // 8, 2)
    dd = pair[:, :, 0].repeat_interleave(8, dim=1)
    dm = pair[:, :, 1].repeat_interleave(8, dim=1)
    return dd * (codes & 63).float(), -(dm * ((codes >> 8) & 63).float())


def q4k_as_q4_1(w: PackedWeight) -> PackedWeight:
    """A Q4K weight in the Q4_1 layout, each scale and minimum rounded to fp16 (as the default
    Q4_K -> Q4_1 repack rounds them); for stacks with parts in other formats."""
    d, m = q4k_scales(w)
    what = f"Q4_K weight {w.shape}: a sub-block scale or minimum"
    return PackedWeight("Q4_1", w.shape, qs=w.qs, d=_checked_f16(d, what), m=_checked_f16(m, what),
                        source_fmt=w.source_fmt)


def q5k_as_q6m(w: PackedWeight) -> PackedWeight:
    """A Q5K weight in the Q6M layout, each scale and minimum rounded to fp16 (as the converted
    Q5_K -> Q6M repack); for stacks with parts in other formats."""
    d, m = q4k_scales(w)
    what = f"Q5_K weight {w.shape}: a sub-block scale or minimum"
    return PackedWeight("Q6M", w.shape, qs=pack_q6_codes((_codes_of(w) + 32).to(torch.uint8)),
                        d=_checked_f16(d, what).repeat_interleave(2, dim=1).contiguous(),
                        m=_checked_f16(m, what).repeat_interleave(2, dim=1).contiguous(), source_fmt=w.source_fmt)


def _converted(w: PackedWeight) -> PackedWeight:
    """A native K-quant layout's converted counterpart (Q4K -> Q4_1, Q5K -> Q6M, Q6K -> Q6); others as they are."""
    return {"Q4K": q4k_as_q4_1, "Q5K": q5k_as_q6m, "Q6K": q6k_as_q6}.get(w.fmt, lambda p: p)(w)


def convert_packed(w: PackedWeight, fmt: str) -> PackedWeight | None:
    """w in the layout `fmt`, holding exactly the same values (every fp16 field is copied or
    multiplied by a power of two), or None where `fmt` cannot hold them: Q4_0 -> Q4_1 (m = -8 d),
    Q4_0 -> Q6 / Q6M (q + 24), Q4_1 -> Q6M (q + 32), Q8_0 -> Q6 / Q6M when every code is in -32..31,
    Q6 -> Q6M (m = 0)."""
    if w.fmt == fmt:
        return w
    six = fmt in ("Q6", "Q6M")
    if w.fmt == "Q4_0" and fmt == "Q4_1":
        m = -8.0 * w.d.float()
        if m.abs().max().item() > _FP16_MAX:
            return None
        return PackedWeight("Q4_1", w.shape, qs=w.qs, d=w.d, m=m.half(), source_fmt=w.source_fmt)
    if six and w.fmt != "F16":
        got = as_six_bit(w.fmt, _codes_of(w), w.d, w.m, fmt)
        if got is not None:
            qs, d, m = got
            return PackedWeight(fmt, w.shape, qs=qs, d=d, m=m, source_fmt=w.source_fmt)
    return None


# the layouts a stack of parts in different formats may take, smallest first (bits per weight)
_STACK_LAYOUTS = ("Q4_1", "Q6", "Q6M")


def unify_formats(parts: list[PackedWeight]) -> list[PackedWeight]:
    """Parts of one stacked weight (q|k|v, gate|up) in a common layout, so that `concat_packed`
    can stack them: their own when they agree, else the smallest of Q4_1, Q6, Q6M that holds every
    part exactly (Q4_K_M files: q, k Q4_K -> Q4_1 with v Q6_K -> Q6 become Q6M, 8 bits per weight),
    else F16 (values rounded to fp16)."""
    if len({p.fmt for p in parts}) <= 1:
        return list(parts)
    parts = [_converted(p) for p in parts]
    if len({p.fmt for p in parts}) <= 1:
        return parts
    for fmt in _STACK_LAYOUTS:
        conv = [convert_packed(p, fmt) for p in parts]
        if all(c is not None for c in conv):
            return conv
    return [pack_float(dequantize(p, torch.float32), "F16") for p in parts]


def pack_float(w: torch.Tensor, fmt: str = "F16") -> PackedWeight:
    """Pack a float (out, in) matrix as F16 or as Q8_0 (llama.cpp's rounding, fp16 scales).

    For weights in a format without a kernel layout (Q2_K, Q3_K, IQ*): dequantize them and pack the
    result here; Q8_0 keeps half of F16's bytes, its error well under that of a 2- to 4-bit format."""
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
    if w.fmt in ("Q6", "Q6M", "Q6K"):
        q = unpack_q6_codes(w.qs, n_in).float().reshape(n_out, n_in // 16, 16)
        d = q6k_scales(w) if w.fmt == "Q6K" else w.d.float()
        v = (q - 32) * d.reshape(n_out, n_in // 16, 1)
        if w.fmt == "Q6M":
            v = v + w.m.float().reshape(n_out, n_in // 16, 1)
        return v.reshape(n_out, n_in).to(dtype)
    if w.fmt in ("Q4K", "Q5K"):
        d, m = q4k_scales(w)
        q = _codes_of(w).float().reshape(n_out, n_in // 32, 32)
        return (q * d[:, :, None] + m[:, :, None]).reshape(n_out, n_in).to(dtype)
    d = w.d.float().reshape(n_out, n_in // 32, 1)
    if w.fmt == "Q8_0":
        return (w.qs.float().reshape(n_out, n_in // 32, 32) * d).reshape(n_out, n_in).to(dtype)
    q = _codes_of(w).float().reshape(n_out, n_in // 32, 32)
    v = (q - 8) * d if w.fmt == "Q4_0" else q * d + w.m.float().reshape(n_out, n_in // 32, 1)
    return v.reshape(n_out, n_in).to(dtype)
