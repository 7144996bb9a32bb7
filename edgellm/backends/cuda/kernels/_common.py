"""Shared pieces of the Triton kernel templates: how kernels are compiled, small helpers.

Triton's interpreter (TRITON_INTERPRET=1, which must be set before triton is first imported)
runs the kernels on CPU tensors, slowly, for tests; otherwise they compile for the GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INTERPRET = bool(knobs.runtime.interpret)
jit = triton.jit


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int(array of shape (1,)),
    which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted"): every loop with a
    run-time bound fails. Same conversion, through .item(); only done when that bug is present."""
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.zeros(1, dtype=np.int32))
        return
    except TypeError:
        pass
    if getattr(interpreter, "_edgellm_index_fix", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._edgellm_index_fix = True


if INTERPRET:
    _fix_interpreter_index()


def require_device(t: torch.Tensor, name: str) -> None:
    if t.device.type == "cpu" and not INTERPRET:
        raise ValueError(f"{name} is on the CPU: the Triton kernels need a GPU tensor "
                         f"(or TRITON_INTERPRET=1 set before triton is imported, to run them interpreted)")


# dp4a (4 int8 products summed into an int32) is one instruction on NVIDIA GPUs; the interpreter
# cannot run inline PTX, so there (and on other vendors) the same sum is computed with shifts.
USE_DP4A = (not INTERPRET) and torch.version.hip is None


@jit
def dp4a(a, b, USE_ASM: tl.constexpr):
    """Elementwise: for int32 words a, b holding 4 signed bytes each, sum_i a.byte[i] * b.byte[i]."""
    if USE_ASM:
        r = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r",
                                      [a, b], dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = ((a << 24) >> 24) * ((b << 24) >> 24)
        r += ((a << 16) >> 24) * ((b << 16) >> 24)
        r += ((a << 8) >> 24) * ((b << 8) >> 24)
        r += (a >> 24) * (b >> 24)
    return r


@jit
def or_under_one(moved, USE_ASM: tl.constexpr, SIX: tl.constexpr = False):
    """Elementwise on int32: (moved & 0x00780000) | 0x3F800000, the float 1 + n/16 for the nibble
    n in bits 19..22 (SIX: (moved & 0x007E0000) | 0x3F800000, the float 1 + q/64 for the 6-bit q
    in bits 17..22). One lop3 with both constants inline; written as two operations, the
    compiler emits two logic instructions (SASS takes one immediate per instruction)."""
    if USE_ASM:
        if SIX:
            r = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x007E0000, 0x3F800000, 0xEA;", "=r,r",
                                          [moved], dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00780000, 0x3F800000, 0xEA;", "=r,r",
                                          [moved], dtype=tl.int32, is_pure=True, pack=1)
    else:
        if SIX:
            r = (moved & 0x007E0000) | 0x3F800000
        else:
            r = (moved & 0x00780000) | 0x3F800000
    return r


def _nibble_asm(mask: str, tail: str) -> tl.constexpr:
    """PTX of one nibbles_f16 step: the two bytes in $1 (16 bits) as byte 0 and byte 2 of a word,
    the masked nibbles under the fp16 exponent of 1024, then `tail` (an f16x2 op on t) into $0."""
    return tl.constexpr("{.reg .b32 t, a, c; cvt.u32.u16 t, $1; prmt.b32 t, t, 0, 0x7170; "
                        f"lop3.b32 t, t, {mask}, 0x64006400, 0xEA; {tail}}}")


# low nibble: 1024 + n - (1024 + OFF); high nibble (in place, 1024 + 16 n): / 16 - (64 + OFF)
_NIB_LO0 = _nibble_asm("0x000F000F", "mov.b32 c, 0x64006400; sub.rn.f16x2 $0, t, c;")
_NIB_LO8 = _nibble_asm("0x000F000F", "mov.b32 c, 0x64086408; sub.rn.f16x2 $0, t, c;")
_NIB_HI0 = _nibble_asm("0x00F000F0", "mov.b32 a, 0x2C002C00; mov.b32 c, 0xD400D400; fma.rn.f16x2 $0, t, a, c;")
_NIB_HI8 = _nibble_asm("0x00F000F0", "mov.b32 a, 0x2C002C00; mov.b32 c, 0xD480D480; fma.rn.f16x2 $0, t, a, c;")


@jit
def nibbles_f16(q, OFF: tl.constexpr, USE_ASM: tl.constexpr):
    """(low nibble - OFF, high nibble - OFF) of each byte of q (uint8), exact fp16 values; OFF 0 or 8.

    USE_ASM: two bytes a few packed instructions (_nibble_asm): prmt pairs the bytes in one word,
    lop3 puts a nibble of each under the fp16 exponent of 1024 (0x6400 | n is 1024 + n), and one
    f16x2 sub or fma leaves the exact value. Written as Triton operations the compiler extracted,
    shifted and re-packed each byte on its own: for Q4K's 16-row GEMM tile 755 instructions a
    K-step against 564 (compile_check gemm-m16-skinny)."""
    if USE_ASM:
        if OFF == 8:
            lo = tl.inline_asm_elementwise(_NIB_LO8, "=r,h", [q], dtype=tl.float16, is_pure=True, pack=2)
            hi = tl.inline_asm_elementwise(_NIB_HI8, "=r,h", [q], dtype=tl.float16, is_pure=True, pack=2)
        else:
            lo = tl.inline_asm_elementwise(_NIB_LO0, "=r,h", [q], dtype=tl.float16, is_pure=True, pack=2)
            hi = tl.inline_asm_elementwise(_NIB_HI0, "=r,h", [q], dtype=tl.float16, is_pure=True, pack=2)
    else:  # the same exponent trick one element at a time (no int-to-float conversion)
        lo = ((q & 15).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + OFF)
        hi = ((q >> 4).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + OFF)
    return lo, hi


def _six_asm(mask: str, up: int, hmask: str, tail: str) -> tl.constexpr:
    """PTX of one six_bits_f16 step on two elements (any two: Triton packs a thread's consecutive
    registers, which a layout may hold along any dimension): $1 their nibble bytes (16 bits), $2 and
    $3 their top-bit words, $4 and $5 their shifts in them. The nibbles as in _nibble_asm; each top-bit
    pair shifted down, the two put in bytes 0 and 2, moved up by `up` under the nibbles and merged
    with them under the fp16 exponent of 1024; then `tail` on u into $0."""
    return tl.constexpr("{.reg .b32 t, y, z, u, a, c; cvt.u32.u16 t, $1; prmt.b32 t, t, 0, 0x7170; "
                        f"shr.b32 y, $2, $4; shr.b32 z, $3, $5; prmt.b32 y, y, z, 0x5410; shl.b32 y, y, {up}; "
                        f"lop3.b32 u, y, {hmask}, 0x64006400, 0xEA; lop3.b32 u, t, {mask}, u, 0xEA; {tail}}}")


# low six-bit value: 1024 + q - 1056; high (in place, 1024 + 16 q): / 16 - 96; both q - 32
_SIX_LO = _six_asm("0x000F000F", 4, "0x00300030", "mov.b32 c, 0x64206420; sub.rn.f16x2 $0, u, c;")
_SIX_HI = _six_asm("0x00F000F0", 8, "0x03000300",
                   "mov.b32 a, 0x2C002C00; mov.b32 c, 0xD600D600; fma.rn.f16x2 $0, u, a, c;")


@jit
def six_bits_f16(q, h_lo, h_hi, sh, USE_ASM: tl.constexpr):
    """The six-bit codes minus 32 (exact fp16) of a Q6-layout tile: q (uint8) the nibbles (low:
    the element, high: the element 16 on), h_lo / h_hi (int32, broadcast) the words holding the two
    top bits of the first and second 16 at bit sh (int32, see packing.py). USE_ASM: two elements
    a few packed instructions each (_six_asm), as nibbles_f16."""
    if USE_ASM:
        lo = tl.inline_asm_elementwise(_SIX_LO, "=r,h,r,r,r,r", [q, h_lo, sh], dtype=tl.float16, is_pure=True,
                                       pack=2)
        hi = tl.inline_asm_elementwise(_SIX_HI, "=r,h,r,r,r,r", [q, h_hi, sh], dtype=tl.float16, is_pure=True,
                                       pack=2)
    else:  # the exponent trick one element at a time: 0x6400 | q is 1024 + q, less 1056 is q - 32
        lo = ((q & 15).to(tl.int32) | (((h_lo >> sh) & 3) << 4) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        hi = ((q >> 4).to(tl.int32) | (((h_hi >> sh) & 3) << 4) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        lo = lo - 1056.0
        hi = hi - 1056.0
    return lo, hi


def device_key(dev) -> tuple:
    """A device as a cache key: "cuda" and "cuda:0" are one device."""
    dev = torch.device(dev)
    index = dev.index if dev.index is not None or dev.type != "cuda" else torch.cuda.current_device()
    return dev.type, index


def made_once(cache: dict, key, make, what: str, hint: str) -> torch.Tensor:
    """cache[key], made by make() on first use: a per-device constant that CUDA graphs keep the
    address of. Never inside a capture, where make()'s fill would only be recorded (run at the
    graph's replay, not now) and its memory would belong to that graph: there it raises, naming
    `what` and `hint` (the call that makes it when the program is built)."""
    t = cache.get(key)
    if t is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what} must be made before a CUDA graph capture ({hint})")
        t = cache[key] = make()
    return t


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int | None) -> int:
    if INTERPRET or not torch.cuda.is_available():
        return 4  # small, so interpreted tests split work into several programs
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sm_count(t: torch.Tensor) -> int:
    return sm_count(t.device.index if t.device.type == "cuda" else None)


def int_or_tensor(value, dummy: torch.Tensor, name: str):
    """(pointer argument, int argument, FROM_PTR flag) for a scalar given as an int or as a device
    tensor holding one integer; a tensor lets a CUDA graph replay read a value that changes."""
    if isinstance(value, torch.Tensor):
        if value.numel() < 1 or value.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int or an int32/int64 tensor with one element, "
                             f"got {value.dtype} tensor of shape {tuple(value.shape)}")
        return value, 0, True
    return dummy, int(value), False


def check_2d(t: torch.Tensor, name: str) -> None:
    require_device(t, name)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2D [tokens, features], got shape {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous rows (stride 1 on the last axis), got strides {t.stride()}")


def out_buffer(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device, name: str = "out"):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if len(shape) == 2 and shape[1] > 1 and out.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous rows, got strides {out.stride()}")
    return out


# Programmatic dependent launch (Hopper): a kernel launched with it may start while its
# predecessor finishes; it waits (griddepcontrol.wait) before touching any activation, so the
# overlap only hides launch latency (NOTES.md: 2.0 -> 1.3 us per small launch in a CUDA graph).
# Off by default; the backend turns it on with set_pdl(True) after checking it on its device.
_PDL = False


def set_pdl(enabled: bool) -> None:
    global _PDL
    _PDL = bool(enabled) and not INTERPRET


def pdl() -> dict:
    """Launch keywords for every kernel: the PDL constexpr and Triton's launch_pdl option."""
    return {"PDL": _PDL, "launch_pdl": _PDL}


@jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# Weight prefetch under PDL: a decode GEMV launched with PDL becomes resident while its predecessor
# (a norm, the attention, another GEMV) still runs, and waits there for it. Its weights do not
# depend on that predecessor, so before waiting each program asks L2 for the first bytes of its
# rows (prefetch.global.L2: no registers held, nothing waited on); the stream of weights from DRAM
# starts during the predecessor's latency-bound tail instead of after it. At most this many bytes
# per launch (the programs' share each), so the prefetched lines stay in the 50 MB L2 until read.
# Set by the backend with set_l2_prefetch (EDGELLM_L2_PREFETCH_MB); 0: off. Only with PDL on.
_L2_PREFETCH_BYTES = 0


def set_l2_prefetch(nbytes: int) -> None:
    global _L2_PREFETCH_BYTES
    _L2_PREFETCH_BYTES = max(0, int(nbytes)) if not INTERPRET else 0


def prefetch_lines(programs: int, region_bytes: int, share: int = 1) -> int:
    """The PF_LINES constexpr of a launch of `programs` programs each owning `region_bytes` of
    weights (`share`: regions per program, e.g. 2 for a gated pair): a power of two number of
    128-byte lines, within the launch's budget; 0 when prefetch is off or PDL is."""
    if not (_PDL and _L2_PREFETCH_BYTES) or programs <= 0 or region_bytes <= 0:
        return 0
    cap = min(_L2_PREFETCH_BYTES // (programs * share * 128), 1024)
    need = -(-region_bytes // 128)
    if cap <= 0:
        return 0
    if need <= cap:  # the whole region: the next power of two (the extra lines repeat the last)
        return min(next_pow2(need), 1024)
    return 1 << (cap.bit_length() - 1)  # a prefix of the region, within the budget


@jit
def l2_prefetch(base, nbytes, LINES: tl.constexpr):
    """Ask L2 for bytes [0, min(nbytes, 128 LINES)) from `base` (any pointer type), one 128-byte
    line per element (past nbytes the last line repeats; a repeated prefetch costs nothing)."""
    off = tl.minimum(tl.arange(0, LINES).to(tl.int64) * 128, tl.maximum(nbytes - 1, 0))
    p = base.to(tl.pointer_type(tl.int8), bitcast=True) + off
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0 unused", "=r,l", [p], dtype=tl.int32,
                              is_pure=False, pack=1)
