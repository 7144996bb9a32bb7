"""Tensor virtualization for the WGSL kernels: storage descriptors and the accessors generated
from them (ML Drift's coordinate translation, done when a kernel's source is generated).

A kernel template (kernels.py) does its maths on *logical* tensors: an activation element
`X_ld(i)`, four at once `X_ld4(i4)`, a weight element `W_get(row, k)`, the dot product of one
weight block with activations `W_dot(row, b, xi)`. Where and how the values are stored — element
type, vector width of the loads, block format and its scales, the buffers a large weight is split
across — is one descriptor, which emits the binding declarations and those accessor functions.
A format is one descriptor, never a copy of every kernel.

Weight layouts (row-major, one row per output feature, `nb = cols / 32` blocks per row; the same
as the cuda backend's, kernels/packing.py there). Quants are read 16 bytes at a time (vec4<u32>),
scales are fp16 pairs in u32 words:
  F16   qs  8 halves per vec4                       value = q
  Q8_0  qs  32 int8 per 2 vec4, d fp16 [rows, nb]    value = q * d
  Q4_0  qs  32 nibbles per vec4, d                  value = (q - 8) * d
  Q4_1  qs  32 nibbles per vec4, d, m               value = q * d + m
  Q6    qs  per row: the blocks' nibbles (a vec4 each), then their top two bits (8 bytes each),
            the row padded to whole vec4; d fp16 [rows, 2 * nb]   value = (q - 32) * d
  Q6M   as Q6, and m fp16 [rows, 2 * nb]                          value = (q - 32) * d + m
In a 4-bit block, byte j holds element j (low nibble) and element j + 16 (high nibble), as GGML.
The six-bit layouts are the cuda backend's (edgellm/quant/code_planes.py builds both): one scale
(and minimum) per 16 elements, byte 4h + i of a block's top bits holding bits 4..5 of element
16h + 4w + i at bits 2w, 2w + 1, so word w of the nibbles meets its elements' top bits by one shift.
Other GGML types are converted at load (repack): Q5_0 exactly into Q8_0, F32/BF16 into F16, Q4_K
into Q4_1 and Q6_K into Q6 (fp16 sub-block scales), Q5_K and Q5_1 into Q6M (Q5_1 exactly); a
weight no layout holds (F16 rows not a multiple of 8, a sub-block scale beyond fp16) is dequantized
and requantized to Q8_0.

A weight whose arrays exceed the adapter's maximum storage binding is split by rows into parts,
each part its own bindings; the accessors choose the part (the kernel never knows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import TensorShapeError

FORMATS = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q6", "Q6M")
SIX_BIT = ("Q6", "Q6M")
_ARRAYS = {"F16": ("qs",), "Q8_0": ("qs", "d"), "Q4_0": ("qs", "d"), "Q4_1": ("qs", "d", "m"), "Q6": ("qs", "d"),
           "Q6M": ("qs", "d", "m")}
BLOCK = {"F16": 8, "Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q6": 32, "Q6M": 32}  # elements per W_dot block
_WORDS_PER_BLOCK = {"F16": 4, "Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q6": 6, "Q6M": 6}  # u32 words of quants per block
BYTES_PER_ELEMENT = {"F16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q6": 28 / 32, "Q6M": 32 / 32}

# helpers every weight accessor may call (emitted once per kernel)
# Integers become floats without conversion instructions (a quarter of the FMA rate on NVIDIA
# GPUs, which would bound a 4-bit GEMV near 70% of the H100's bandwidth): a value k < 2^23 OR-ed
# into the mantissa of 2^23 (0x4B000000) is the float 2^23 + k, and one exact subtraction leaves k
# (llama.cpp's trick). Signed bytes are biased by 128 first (XOR 0x80).
# two fp16 halves of a word as floats: unpack2x16float, which some adapters lack (wgpu's downlevel
# flag SHADER_F16_IN_F32: older OpenGL ES; lavapipe on a CPU without SSE). Device.pipeline puts
# H2_PORTABLE, the same conversion in integer and float arithmetic, in its place there.
H2_NATIVE = "fn h2(w: u32) -> vec2<f32> { return unpack2x16float(w); }\n"
H2_PORTABLE = """fn h2(w: u32) -> vec2<f32> { return vec2<f32>(f16_bits(w & 0xffffu), f16_bits(w >> 16u)); }
fn f16_bits(h: u32) -> f32 {  // an fp16 bit pattern's value (subnormals, infinities and NaNs kept)
    let s = (h & 0x8000u) << 16u; let e = (h >> 10u) & 31u; let m = h & 1023u;
    if (e == 0u) { return bitcast<f32>(bitcast<u32>(f32(m) * 5.9604645e-8) | s); }  // m * 2^-24
    if (e == 31u) { return bitcast<f32>(s | 0x7f800000u | (m << 13u)); }
    return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));
}
"""
HELPERS = """
fn i8x4(w: u32) -> vec4<f32> {
    let u = ((vec4<u32>(w, w >> 8u, w >> 16u, w >> 24u) & vec4<u32>(255u)) ^ vec4<u32>(128u)) | vec4<u32>(0x4B000000u);
    return bitcast<vec4<f32>>(u) - vec4<f32>(8388736.0);
}
fn lo4(w: u32, off: f32) -> vec4<f32> {  // low nibbles minus (off - 2^23): off 8388608 gives q, 8388616 q - 8
    let u = (vec4<u32>(w, w >> 8u, w >> 16u, w >> 24u) & vec4<u32>(15u)) | vec4<u32>(0x4B000000u);
    return bitcast<vec4<f32>>(u) - vec4<f32>(off);
}
fn hi4(w: u32, off: f32) -> vec4<f32> {
    let u = (vec4<u32>(w >> 4u, w >> 12u, w >> 20u, w >> 28u) & vec4<u32>(15u)) | vec4<u32>(0x4B000000u);
    return bitcast<vec4<f32>>(u) - vec4<f32>(off);
}
""" + H2_NATIVE + """fn b6(w: u32) -> vec4<f32> {  // four 6-bit codes, one per byte, minus 32
    let u = (vec4<u32>(w, w >> 8u, w >> 16u, w >> 24u) & vec4<u32>(63u)) | vec4<u32>(0x4B000000u);
    return bitcast<vec4<f32>>(u) - vec4<f32>(8388640.0);
}
fn q6lo(q: u32, h: u32, w: u32) -> u32 {  // word w of a block's nibbles, first half, with its top bits
    return (q & 0x0F0F0F0Fu) | (((h >> (2u * w)) & 0x03030303u) << 4u);
}
fn q6hi(q: u32, h: u32, w: u32) -> u32 {
    return ((q >> 4u) & 0x0F0F0F0Fu) | (((h >> (2u * w)) & 0x03030303u) << 4u);
}
"""


@dataclass(frozen=True)
class Binding:
    """One `@binding` of a kernel: name, WGSL type, and kind: 'storage' (read-write), 'read'
    (read-only storage: lets the driver use the GPU's read-only caches for it) or 'uniform'."""

    name: str
    wgsl_type: str
    kind: str = "storage"

    def decl(self, index: int) -> str:
        space = {"uniform": "uniform", "read": "storage, read"}.get(self.kind, "storage, read_write")
        return f"@group(0) @binding({index}) var<{space}> {self.name}: {self.wgsl_type};"


@dataclass(frozen=True)
class ActDesc:
    """An activation (or KV-cache, bias, norm weight) tensor read and written element-wise.

    dtype: f32, or f16 (needs the adapter's shader-f16); vec: 1, or 4 for a second view of the
    same storage read four elements at a time (rows must then be multiples of 4 elements).
    kind: the binding's kind (Binding.kind): 'storage', or 'read' for a tensor no kernel writes
    (an imported network's weights)."""

    name: str
    dtype: str = "f32"
    vec: int = 1
    kind: str = "storage"

    def bindings(self) -> list[Binding]:
        b = [Binding(self.name, f"array<{self.dtype}>", self.kind)]
        if self.vec == 4:
            b.append(Binding(self.name + "_v4", f"array<vec4<{self.dtype}>>", self.kind))
        return b

    def accessors(self) -> str:
        n, t = self.name, self.dtype
        src = f"fn {n}_ld(i: u32) -> f32 {{ return f32({n}[i]); }}\n"
        if self.kind != "read":
            src += f"fn {n}_st(i: u32, v: f32) {{ {n}[i] = {t}(v); }}\n"
        if self.vec == 4:
            src += f"fn {n}_ld4(i4: u32) -> vec4<f32> {{ return vec4<f32>({n}_v4[i4]); }}\n"
            if self.kind != "read":
                src += f"fn {n}_st4(i4: u32, v: vec4<f32>) {{ {n}_v4[i4] = vec4<{t}>(v); }}\n"
        else:
            src += (f"fn {n}_ld4(i4: u32) -> vec4<f32> {{ let i = i4 * 4u; return vec4<f32>({n}_ld(i), {n}_ld(i + 1u), "
                    f"{n}_ld(i + 2u), {n}_ld(i + 3u)); }}\n")
        return src


@dataclass(frozen=True)
class WeightDesc:
    """A 2-D weight (rows = output features, cols = input features) in one of FORMATS, its rows
    split into parts (`part_rows`) each small enough for one storage binding."""

    name: str
    fmt: str
    rows: int
    cols: int
    part_rows: tuple[int, ...]

    @property
    def arrays(self) -> tuple[str, ...]:
        return _ARRAYS[self.fmt]

    @property
    def block(self) -> int:
        return BLOCK[self.fmt]

    @property
    def nblocks(self) -> int:
        return self.cols // self.block

    @property
    def row_vec4(self) -> int:
        """vec4<u32> of quants per row (the six-bit layouts' rows padded to whole vec4)."""
        return -(-self.nblocks * _WORDS_PER_BLOCK[self.fmt] // 4)

    @property
    def units(self) -> int:
        """16-byte units of quants per row that a GEMV lane reads at a time (the six-bit layouts:
        a block's nibbles, its top bits read beside them)."""
        return self.nblocks if self.fmt in SIX_BIT else self.row_vec4

    @property
    def scales_per_block(self) -> int:
        return 2 if self.fmt in SIX_BIT else 1

    def bindings(self) -> list[Binding]:
        out = []
        for p in range(len(self.part_rows)):
            for a in self.arrays:
                out.append(Binding(f"{self.name}_{a}{p}", "array<vec4<u32>>" if a == "qs" else "array<u32>", "read"))
        return out

    # -- accessors ------------------------------------------------------------------------------
    def _select(self, body: str, ret: str, args: str, fname: str) -> str:
        """A function choosing the part that holds `row` (in body, %P stands for the part index and
        @r for the row within the part)."""
        lines = [f"fn {fname}({args}) -> {ret} {{"]
        start = 0
        for p, n in enumerate(self.part_rows):
            b = body.replace("%P", str(p)).replace("@r", f"(row - {start}u)" if start else "row")
            if p < len(self.part_rows) - 1:
                lines.append(f"    if (row < {start + n}u) {{ return {b}; }}")
            else:
                lines.append(f"    return {b};")
            start += n
        lines.append("}")
        return "\n".join(lines) + "\n"

    def accessors(self, x: str) -> str:
        """W_qs(row, v), W_d/W_m(row, b), W_get(row, k), W_get4(row, k) (elements k..k+3, k a
        multiple of 4), W_xblock(xi) (the activations one block multiplies, read through x's `_ld4`),
        W_dotv(row, b, xv) (block b of a row dotted with them) and W_dot(row, b, xi) (the two in one).
        The embedding template passes its output's name as x: it never calls the dot functions."""
        n, f = self.name, self.fmt
        src = self._select(f"{n}_qs%P[@r * {self.row_vec4}u + v]", "vec4<u32>", "row: u32, v: u32", f"{n}_qs")
        ns = self.nblocks * self.scales_per_block  # scales per row (the six-bit layouts: one per 16)
        for a in self.arrays[1:]:
            src += self._select(f"h2({n}_{a}%P[(@r * {ns}u + b) >> 1u])[(@r * {ns}u + b) & 1u]",
                                "f32", "row: u32, b: u32", f"{n}_{a}")
            if f in SIX_BIT:  # block b's two scales (or minimums): one word
                src += self._select(f"h2({n}_{a}%P[@r * {self.nblocks}u + b])", "vec2<f32>", "row: u32, b: u32",
                                    f"{n}_{a}pair")
        src += f"fn {n}_word(row: u32, w: u32) -> u32 {{ return {n}_qs(row, w >> 2u)[w & 3u]; }}\n"
        if f in SIX_BIT:  # block b's top bits of its first (h = 0) or second half
            src += f"fn {n}_top(row: u32, b: u32, h: u32) -> u32 {{ return {n}_word(row, {4 * self.nblocks}u + 2u * b + h); }}\n"
        if f == "F16":
            get = f"let w = {n}_word(row, k >> 1u); return h2(w)[k & 1u];"
            dot = (f"let q = {n}_qs(row, b);\n"
                   f"    return dot(vec4<f32>(h2(q.x), h2(q.y)), xv[0]) + dot(vec4<f32>(h2(q.z), h2(q.w)), xv[1]);")
        elif f == "Q8_0":
            get = (f"let w = {n}_word(row, k >> 2u); let s = (k & 3u) * 8u;\n"
                   f"    return f32(bitcast<i32>(w << (24u - s)) >> 24u) * {n}_d(row, k >> 5u);")
            dot = (f"let q0 = {n}_qs(row, 2u * b); let q1 = {n}_qs(row, 2u * b + 1u);\n"
                   f"    var s = dot(i8x4(q0.x), xv[0]) + dot(i8x4(q0.y), xv[1]);\n"
                   f"    s += dot(i8x4(q0.z), xv[2]) + dot(i8x4(q0.w), xv[3]);\n"
                   f"    s += dot(i8x4(q1.x), xv[4]) + dot(i8x4(q1.y), xv[5]);\n"
                   f"    s += dot(i8x4(q1.z), xv[6]) + dot(i8x4(q1.w), xv[7]);\n"
                   f"    return s * {n}_d(row, b);")
        elif f in SIX_BIT:
            mm = f" + {n}_m(row, 2u * b + h)" if f == "Q6M" else ""
            get = (f"let b = k >> 5u; let e = k & 31u; let j = e & 15u; let h = e >> 4u;\n"
                   f"    let lo = ({n}_word(row, b * 4u + (j >> 2u)) >> ((j & 3u) * 8u + h * 4u)) & 15u;\n"
                   f"    let hi = ({n}_top(row, b, h) >> ((j & 3u) * 8u + 2u * (j >> 2u))) & 3u;\n"
                   f"    return (f32(lo | (hi << 4u)) - 32.0) * {n}_d(row, 2u * b + h){mm};")
            ms = (f"\n    let m = {n}_mpair(row, b);\n"
                  f"    s += m.x * (sl.x + sl.y + sl.z + sl.w) + m.y * (sh.x + sh.y + sh.z + sh.w);") if f == "Q6M" else ""
            dot = (f"let q = {n}_qs(row, b); let t0 = {n}_top(row, b, 0u); let t1 = {n}_top(row, b, 1u);\n"
                   f"    var lo = 0.0; var hi = 0.0; var sl = vec4<f32>(0.0); var sh = vec4<f32>(0.0);\n"
                   f"    for (var k = 0u; k < 4u; k++) {{\n"
                   f"        lo += dot(b6(q6lo(q[k], t0, k)), xv[k]); hi += dot(b6(q6hi(q[k], t1, k)), xv[4u + k]);\n"
                   f"        sl += xv[k]; sh += xv[4u + k];\n"
                   f"    }}\n"
                   f"    let d = {n}_dpair(row, b);\n"
                   f"    var s = lo * d.x + hi * d.y;{ms}\n"
                   f"    return s;")
        else:  # Q4_0 / Q4_1
            e = "let b = k >> 5u; let e = k & 31u; let j = e & 15u;\n"
            e += f"    let q = f32(({n}_word(row, b * 4u + (j >> 2u)) >> ((j & 3u) * 8u + (e >> 4u) * 4u)) & 15u);\n"
            get = e + (f"    return (q - 8.0) * {n}_d(row, b);" if f == "Q4_0"
                       else f"    return q * {n}_d(row, b) + {n}_m(row, b);")
            if f == "Q4_0":  # (q - 8) straight from the mantissa trick: no sum of x needed
                dot = (f"let q = {n}_qs(row, b); var s = 0.0;\n"
                       f"    for (var k = 0u; k < 4u; k++) {{\n"
                       f"        s += dot(lo4(q[k], 8388616.0), xv[k]) + dot(hi4(q[k], 8388616.0), xv[4u + k]);\n"
                       f"    }}\n"
                       f"    return s * {n}_d(row, b);")
            else:
                dot = (f"let q = {n}_qs(row, b); var s = 0.0; var sx = vec4<f32>(0.0);\n"
                       f"    for (var k = 0u; k < 4u; k++) {{\n"
                       f"        let xl = xv[k]; let xh = xv[4u + k];\n"
                       f"        s += dot(lo4(q[k], 8388608.0), xl) + dot(hi4(q[k], 8388608.0), xh); sx += xl + xh;\n"
                       f"    }}\n"
                       f"    return s * {n}_d(row, b) + (sx.x + sx.y + sx.z + sx.w) * {n}_m(row, b);")
        if f == "F16":
            get4 = f"let w = {n}_word(row, k >> 1u); let v = {n}_word(row, (k >> 1u) + 1u); return vec4<f32>(h2(w), h2(v));"
        elif f == "Q8_0":
            get4 = f"return i8x4({n}_word(row, k >> 2u)) * {n}_d(row, k >> 5u);"
        elif f in SIX_BIT:
            mm = f" + vec4<f32>({n}_m(row, 2u * b + h))" if f == "Q6M" else ""
            get4 = (f"let b = k >> 5u; let e = k & 31u; let h = e >> 4u; let w = (e & 15u) >> 2u;\n"
                    f"    let q = {n}_word(row, b * 4u + w); let t = {n}_top(row, b, h);\n"
                    f"    return b6(select(q6lo(q, t, w), q6hi(q, t, w), h == 1u)) * {n}_d(row, 2u * b + h){mm};")
        else:
            get4 = (f"let b = k >> 5u; let e = k & 31u; let w = {n}_word(row, b * 4u + ((e & 15u) >> 2u));\n"
                    f"    let q = select(lo4(w, 8388608.0), hi4(w, 8388608.0), e >= 16u);\n")
            get4 += (f"    return (q - vec4<f32>(8.0)) * {n}_d(row, b);" if f == "Q4_0"
                     else f"    return q * {n}_d(row, b) + vec4<f32>({n}_m(row, b));")
        src += f"fn {n}_get(row: u32, k: u32) -> f32 {{\n    {get}\n}}\n"
        src += f"fn {n}_get4(row: u32, k: u32) -> vec4<f32> {{\n    {get4}\n}}\n"
        xv = self.block // 4
        src += f"fn {n}_dotv(row: u32, b: u32, xv: array<vec4<f32>, {xv}>) -> f32 {{\n    {dot}\n}}\n"
        src += (f"fn {n}_xblock(xi: u32) -> array<vec4<f32>, {xv}> {{\n"
                f"    var xv: array<vec4<f32>, {xv}>;\n"
                f"    for (var i = 0u; i < {xv}u; i++) {{ xv[i] = {x}_ld4((xi >> 2u) + i); }}\n"
                f"    return xv;\n}}\n")
        src += f"fn {n}_dot(row: u32, b: u32, xi: u32) -> f32 {{ return {n}_dotv(row, b, {n}_xblock(xi)); }}\n"
        return src


# -- host side: GGUF blocks -> descriptor arrays ---------------------------------------------------
@dataclass
class PackedArrays:
    """A weight's arrays in its descriptor's layout, as 2-D numpy arrays with one row per output
    feature (so that stacking weights and splitting into parts are row operations)."""

    fmt: str
    rows: int
    cols: int
    arrays: dict[str, np.ndarray]  # qs: uint8 [rows, row bytes]; d, m: float16 [rows, nb]
    source_fmt: str = ""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def _blocks(raw: np.ndarray, rows: int, cols: int, tsize: int) -> np.ndarray:
    nb = cols // 32
    if cols % 32 or raw.size != rows * nb * tsize:
        raise TensorShapeError(f"weight ({rows}, {cols}): {raw.size} bytes are not {rows} rows of {nb} blocks of {tsize}")
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, nb, tsize)


def pack_float(w: np.ndarray, fmt: str = "F16") -> PackedArrays:
    """A float (rows, cols) matrix as F16 or as Q8_0 (llama.cpp's rounding, fp16 scales)."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    if fmt == "F16":
        if cols % 8:
            raise TensorShapeError(f"F16 weight ({rows}, {cols}): rows must be a multiple of 8 elements")
        big = float(np.abs(w).max()) if w.size else 0.0
        if not np.isfinite(big) or big > 65504.0:
            raise TensorShapeError(f"weight ({rows}, {cols}): values up to {big} do not fit in fp16")
        return PackedArrays("F16", rows, cols, {"qs": w.astype(np.float16).view(np.uint8).reshape(rows, -1)})
    if cols % 32:
        raise TensorShapeError(f"Q8_0 weight ({rows}, {cols}): rows of {cols} are not whole blocks of 32")
    b = w.reshape(rows, cols // 32, 32)
    d = np.abs(b).max(axis=2, keepdims=True) / 127.0
    inv = np.where(d > 0, 1.0 / np.maximum(d, 1e-30), 0.0)
    v = b * inv
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)
    return PackedArrays("Q8_0", rows, cols, {"qs": q.view(np.uint8).reshape(rows, cols),
                                              "d": d.reshape(rows, -1).astype(np.float16)}, "F32")


def repack(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> PackedArrays:
    """One GGUF weight (raw blocks as stored, shape (rows, cols)) in a descriptor format."""
    from ...quant import dequantize
    from ...quant.block_forms import q4_k_as_q4_1, q5_0_as_q8_0

    rows, cols = (int(s) for s in shape)
    fmt = fmt.upper()
    if fmt == "F16" and cols % 8 == 0:
        return PackedArrays("F16", rows, cols, {"qs": np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)}, fmt)
    if fmt in ("F32", "BF16", "F16"):
        p = pack_float(np.asarray(dequantize(raw, fmt, shape), dtype=np.float32).reshape(rows, cols),
                       "F16" if cols % 8 == 0 else "Q8_0")
        p.source_fmt = fmt
        return p
    source = fmt
    if fmt == "Q5_0":  # exactly Q8_0: q - 16 in [-16, 15], the same fp16 scale per 32
        raw, fmt = q5_0_as_q8_0(raw, rows, cols), "Q8_0"
    elif fmt == "Q4_K":  # Q4_1 with fp16 sub-block scales and minimums (the cuda backend's conversion too)
        try:
            raw, fmt = q4_k_as_q4_1(raw, rows, cols), "Q4_1"
        except ValueError:  # a scale beyond fp16: requantized to Q8_0 below
            pass
    if fmt == "Q8_0":
        b = _blocks(raw, rows, cols, 34)
        return PackedArrays("Q8_0", rows, cols, {"qs": b[:, :, 2:].reshape(rows, cols).copy(),
                                                  "d": b[:, :, 0:2].copy().view(np.float16).reshape(rows, -1)}, source)
    if fmt == "Q4_0":
        b = _blocks(raw, rows, cols, 18)
        return PackedArrays("Q4_0", rows, cols, {"qs": b[:, :, 2:].reshape(rows, -1).copy(),
                                                  "d": b[:, :, 0:2].copy().view(np.float16).reshape(rows, -1)}, source)
    if fmt == "Q4_1":
        b = _blocks(raw, rows, cols, 20)
        return PackedArrays("Q4_1", rows, cols, {"qs": b[:, :, 4:].reshape(rows, -1).copy(),
                                                  "d": b[:, :, 0:2].copy().view(np.float16).reshape(rows, -1),
                                                  "m": b[:, :, 2:4].copy().view(np.float16).reshape(rows, -1)}, source)
    if fmt in _SIX_BIT_SOURCES:
        p = _six_bit(raw, fmt, rows, cols)
        if p is not None:
            return p
    # no layout of its own: dequantize, store as Q8_0 (half of F16's bytes, error well under a
    # 5- or 6-bit format's own)
    p = pack_float(np.asarray(dequantize(raw, fmt, shape), dtype=np.float32).reshape(rows, cols), "Q8_0")
    p.source_fmt = fmt
    return p


# GGML types stored in the six-bit layouts: block size and bytes, and the layout
_SIX_BIT_SOURCES = {"Q6_K": (256, 210), "Q5_K": (256, 176), "Q5_1": (32, 24)}


def _whole_vec4_rows(qs: np.ndarray) -> np.ndarray:
    """Six-bit quants [rows, nb * 24] padded to rows of whole vec4<u32> (16 bytes)."""
    pad = -qs.shape[1] % 16
    return np.concatenate([qs, np.zeros((qs.shape[0], pad), np.uint8)], axis=1) if pad else qs


def _six_bit(raw: np.ndarray, fmt: str, rows: int, cols: int) -> PackedArrays | None:
    """Q6_K as Q6, Q5_K and Q5_1 as Q6M (the 6-bit codes as stored, plus 32 for the 5-bit ones; a
    scale and minimum per 16 elements: d * scale and -dmin * min of Q5_K's and Q6_K's sub-blocks
    rounded to fp16, Q5_1's copied), or None where a scale or minimum does not fit fp16."""
    from ...quant.code_planes import pack_q6_codes, six_bit_codes, tensor_of

    block, tsize = _SIX_BIT_SOURCES[fmt]
    if cols % block or raw.size != rows * cols // block * tsize:
        raise TensorShapeError(f"{fmt} weight ({rows}, {cols}): {raw.size} bytes are not rows of {tsize}-byte blocks")
    blocks = tensor_of(np.asarray(raw).view(np.uint8).reshape(rows * cols // block, tsize))
    q, d, m = six_bit_codes(blocks, fmt)
    arrays = {"qs": pack_q6_codes(q.reshape(rows, cols)).numpy()}
    for name, v in (("d", d), ("m", m)):
        if v is None:
            continue
        v = v.reshape(rows, cols // 16).numpy()
        if not np.isfinite(v).all() or float(np.abs(v).max(initial=0.0)) > 65504.0:
            return None
        arrays[name] = v.astype(np.float16)
    arrays["qs"] = _whole_vec4_rows(arrays["qs"])
    return PackedArrays("Q6" if m is None else "Q6M", rows, cols, arrays, fmt)


def dequantize_packed(p: PackedArrays) -> np.ndarray:
    """The float32 (rows, cols) matrix packed arrays stand for (to stack mixed formats as F16)."""
    if p.fmt == "F16":
        return p.arrays["qs"].view(np.float16).astype(np.float32).reshape(p.rows, p.cols)
    nb = p.cols // 32
    if p.fmt in SIX_BIT:
        from ...quant.code_planes import tensor_of, unpack_q6_codes

        q = unpack_q6_codes(tensor_of(p.arrays["qs"][:, :nb * 24]), p.cols).numpy().astype(np.float32)
        v = (q.reshape(p.rows, 2 * nb, 16) - 32) * p.arrays["d"].astype(np.float32)[:, :, None]
        if p.fmt == "Q6M":
            v = v + p.arrays["m"].astype(np.float32)[:, :, None]
        return v.reshape(p.rows, p.cols)
    d = p.arrays["d"].astype(np.float32)[:, :, None]
    if p.fmt == "Q8_0":
        return (p.arrays["qs"].view(np.int8).reshape(p.rows, nb, 32).astype(np.float32) * d).reshape(p.rows, p.cols)
    q = p.arrays["qs"].reshape(p.rows, nb, 16)
    q = np.concatenate([q & 15, q >> 4], axis=2).astype(np.float32)
    v = (q - 8) * d if p.fmt == "Q4_0" else q * d + p.arrays["m"].astype(np.float32)[:, :, None]
    return v.reshape(p.rows, p.cols)


def _codes(p: PackedArrays):
    """A quantized layout's integer codes (torch int16 [rows, cols], element order)."""
    import torch

    from ...quant.code_planes import tensor_of, unpack_q4_codes, unpack_q6_codes

    if p.fmt == "Q8_0":
        return tensor_of(p.arrays["qs"].view(np.int8)).to(torch.int16)
    if p.fmt in SIX_BIT:  # (its rows' padding cut)
        return unpack_q6_codes(tensor_of(p.arrays["qs"][:, :p.cols // 32 * 24]), p.cols).to(torch.int16)
    return unpack_q4_codes(tensor_of(p.arrays["qs"]), p.cols).to(torch.int16)


def unify_six_bit(parts: list[PackedArrays]) -> list[PackedArrays] | None:
    """Parts of one stacked weight in different quantized layouts (a Q4_K_M file's q, k as Q4_1
    with its v as Q6) in the smallest six-bit layout that holds every part's values exactly (Q6,
    else Q6M: 7 or 8 bits per weight, not F16's 16), or None where none does."""
    from ...quant.code_planes import as_six_bit, tensor_of

    if any(p.fmt == "F16" for p in parts):
        return None
    for want in SIX_BIT:
        out = []
        for p in parts:
            m = p.arrays.get("m")
            got = as_six_bit(p.fmt, _codes(p), tensor_of(p.arrays["d"]), None if m is None else tensor_of(m), want)
            if got is None:
                break
            qs, d, m = got
            arrays = {"qs": _whole_vec4_rows(qs.numpy()), "d": d.numpy()} | ({"m": m.numpy()} if m is not None else {})
            out.append(PackedArrays(want, p.rows, p.cols, arrays, p.source_fmt))
        else:
            return out
    return None


def stack(parts: list[PackedArrays]) -> PackedArrays:
    """Weights stacked along the output axis (fused q|k|v, gate|up); mixed formats become F16."""
    if len(parts) == 1:
        return parts[0]
    cols = parts[0].cols
    if any(p.cols != cols for p in parts):
        raise TensorShapeError(f"cannot stack weights of {[p.cols for p in parts]} input features")
    if len({p.fmt for p in parts}) > 1:
        parts = [pack_float(dequantize_packed(p), "F16" if cols % 8 == 0 else "Q8_0") for p in parts]
        if len({p.fmt for p in parts}) > 1:
            raise TensorShapeError("cannot stack weights of mixed formats")
    arrays = {k: np.concatenate([p.arrays[k] for p in parts]) for k in parts[0].arrays}
    return PackedArrays(parts[0].fmt, sum(p.rows for p in parts), cols, arrays, parts[0].source_fmt)


def split_rows(p: PackedArrays, max_binding: int) -> tuple[int, ...]:
    """Rows per part so that every array of a part fits in one binding."""
    per_row = max(a.shape[1] * a.itemsize for a in p.arrays.values())
    fit = max(1, (max_binding - 64) // per_row)
    fit = max(2, fit - fit % 2)  # even, so a part's fp16 scale pairs never straddle parts
    parts, left = [], p.rows
    while left > 0:
        parts.append(min(fit, left))
        left -= parts[-1]
    return tuple(parts)


def part_arrays(p: PackedArrays, part_rows: tuple[int, ...]) -> list[dict[str, np.ndarray]]:
    """Each part's arrays, flattened to the bytes its bindings hold."""
    out, start = [], 0
    for n in part_rows:
        out.append({k: np.ascontiguousarray(a[start:start + n]).reshape(-1).view(np.uint8) for k, a in p.arrays.items()})
        start += n
    return out
