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
