"""RMSNorm with the residual add fused in: one read of x and the residual, one write of each result.

Also with a tensor-parallel all_reduce fused in (Peers): x is then the sum of every rank's partial,
read from each rank's symmetric buffer over NVLink after a barrier, so the reduction costs no launch
of its own (edgellm/backends/cuda/collective.py).

Also the norm as a matrix-vector kernel's tail (NormTail): the decode GEMV that produces the
residual branch adds it into the residual stream in its epilogue, and the last of its programs to
finish normalises the whole row, so the add + norm costs no launch of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from ._common import check_2d, jit, next_pow2, out_buffer, pdl, pdl_prologue


@jit
def _store_int8_blocks(y, row, D, xq_ptr, xd_ptr, xs_ptr, c, BLOCK_D: tl.constexpr):
    """y (one row's chunk of BLOCK_D elements at columns c, a multiple of 32 from the row start)
    quantized to int8 per 32-block, as quantize_activations does (round half away from zero):
    xq int8 [., D], xd scales and xs scale * sum of the int8 values [., D / 32]."""
    b = tl.reshape(y.to(tl.float32), [BLOCK_D // 32, 32])
    amax = tl.max(tl.abs(b), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    v = b * inv[:, None]
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
    kb = tl.min(c, axis=0) // 32 + tl.arange(0, BLOCK_D // 32)
    bm = kb < D // 32
    tl.store(xq_ptr + row * D + tl.reshape(c, [BLOCK_D // 32, 32]), q.to(tl.int8), mask=bm[:, None])
    d = amax / 127.0
    tl.store(xd_ptr + row * (D // 32) + kb, d, mask=bm)
    tl.store(xs_ptr + row * (D // 32) + kb, d * tl.sum(q, axis=1), mask=bm)


@jit
def store_int8_tile(y, row, col0, width, rmask, xq_ptr, xd_ptr, xs_ptr, NCOL: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """y [BLOCK_R, BLOCK_C] (values as stored): row r's columns col0[r] .. col0[r] + NCOL - 1 of an
    activation [., width] quantized per 32-block as quantize_activations does (NCOL and col0 are
    multiples of 32; columns past NCOL and rows off rmask are not written). For kernels whose
    programs own whole 32-blocks of their output (attention: whole heads)."""
    b = tl.reshape(y.to(tl.float32), [BLOCK_R, BLOCK_C // 32, 32])
    amax = tl.max(tl.abs(b), axis=2)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    v = b * inv[:, :, None]
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
    j = tl.arange(0, BLOCK_C // 32)
    e = tl.arange(0, 32)
    bm = rmask[:, None] & (j[None, :] * 32 < NCOL)
    row64 = row.to(tl.int64)
    base = row64[:, None] * width + col0[:, None] + j[None, :] * 32
    tl.store(xq_ptr + base[:, :, None] + e[None, None, :], q.to(tl.int8), mask=bm[:, :, None])
    d = amax / 127.0
    sb = row64[:, None] * (width // 32) + col0[:, None] // 32 + j[None, :]
    tl.store(xd_ptr + sb, d, mask=bm)
    tl.store(xs_ptr + sb, d * tl.sum(q, axis=2), mask=bm)


@jit
def peer_barrier(pads, slot, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Wait until the program with the same slot on every other rank has arrived here: set this
    rank's flag in each peer's signal pad (0 -> 1, waiting while a previous flag there is still
    unread), then take each peer's flag from this rank's pad (1 -> 0), which leaves the pads zeroed
    for the next use (nothing for the host to reset between CUDA-graph replays). pads: the address
    of the ranks' signal-pad addresses (PyTorch symmetric memory's signal_pad_ptrs_dev), WORLD
    32-bit flags a slot. The writes the peers made before (earlier kernels) are visible after it."""
    table = pads.to(tl.pointer_type(tl.uint64))
    mine = tl.load(table + RANK).to(tl.pointer_type(tl.int32)) + slot * WORLD
    for r in tl.static_range(WORLD):
        if r != RANK:
            theirs = tl.load(table + r).to(tl.pointer_type(tl.int32)) + slot * WORLD + RANK
            while tl.atomic_cas(theirs, 0, 1, sem="release", scope="sys") != 0:
                pass
    for r in tl.static_range(WORLD):
        if r != RANK:
            while tl.atomic_cas(mine + r, 1, 0, sem="acquire", scope="sys") != 1:
                pass


@jit
def _peer_sum(addrs, stride, row, c, mask, WORLD: tl.constexpr):
    """Columns c of one row of the ranks' partials summed in rank order (so every rank gets the
    same bits), each read from its rank's buffer (addrs: int64 addresses, one a rank)."""
    x = tl.zeros(c.shape, tl.float32)
    for r in tl.static_range(WORLD):
        p = tl.load(addrs + r).to(tl.pointer_type(tl.float32))
        x += tl.load(p + row * stride + c, mask=mask, other=0.0, cache_modifier=".cv")
    return x


@jit
def _summed(x_ptr, stride_x, r_ptr, stride_r, ro_ptr, stride_ro, row, c, mask, HAS_RES: tl.constexpr,
            WRITE_RES: tl.constexpr, STORE: tl.constexpr, addrs, WORLD: tl.constexpr):
    """Columns c of one row of x (+ the residual) in fp32. With WRITE_RES the sum is rounded as
    residual_out stores it (the fused op equals "add, store, then norm") and, with STORE, stored.
    WORLD > 1: x is the sum of the ranks' partials at addrs (x_ptr's rows, this rank's among them)."""
    if WORLD > 1:
        x = _peer_sum(addrs, stride_x, row, c, mask, WORLD)
    else:
        x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(r_ptr + row * stride_r + c, mask=mask, other=0.0).to(tl.float32)
        if WRITE_RES:
            xs = x.to(ro_ptr.dtype.element_ty)
            if STORE:
                tl.store(ro_ptr + row * stride_ro + c, xs, mask=mask)
            x = xs.to(tl.float32)
    return x


@jit
def _rms_norm_kernel(x_ptr, stride_x, r_ptr, stride_r, w_ptr, out_ptr, stride_o, ro_ptr, stride_ro, D, eps,
                     xq_ptr, xd_ptr, xs_ptr, addrs, pads,
                     HAS_RES: tl.constexpr, WRITE_RES: tl.constexpr, QUANT: tl.constexpr, BLOCK_D: tl.constexpr,
                     SLICE: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    if WORLD > 1:  # the all_reduce fused in: the same program on every rank has its partial written
        peer_barrier(pads, tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), RANK, WORLD)
    c = tl.arange(0, BLOCK_D)
    mask = c < D
    x = _summed(x_ptr, stride_x, r_ptr, stride_r, ro_ptr, stride_ro, row, c, mask, HAS_RES, WRITE_RES,
                SLICE == BLOCK_D, addrs, WORLD)
    ms = tl.sum(x * x, axis=0) / D
    r = 1.0 / tl.sqrt(ms + eps)
    if SLICE < BLOCK_D:
        # split row: every program has the whole row's sum of squares (the row is a few KB, read
        # from L2 by each) and normalises, stores and quantizes only its SLICE columns
        c = tl.program_id(1) * SLICE + tl.arange(0, SLICE)
        mask = c < D
        x = _summed(x_ptr, stride_x, r_ptr, stride_r, ro_ptr, stride_ro, row, c, mask, HAS_RES, WRITE_RES, True,
                    addrs, WORLD)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    y = (x * r * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + c, y, mask=mask)
    if QUANT:
        # the row as stored, quantized to int8 per 32-block for the int8-activation GEMVs that read
        # it (quantize_activations' arithmetic; saves them a launch)
        _store_int8_blocks(y, row, D, xq_ptr, xd_ptr, xs_ptr, c, SLICE)


# Rows at least this wide are normalised by several programs, NORM_SLICE columns each (each reads
# the whole row for its sum of squares). One program per row took 4.9 us at width 4096 on the H100
# (2026-11-22 profile: 321 us of an 8B Q4_0 token's 2.2 ms in 65 norms), 1.4 us at width 576.
# Measured on the H100 (2026-11-25, bench_vs_llamacpp.py --variant, docs/results/h100-2026-11-25/
# vs_split.txt): decode 8B Q4_0 457.0 -> 498.4 tok/s, 1B Q4_0 1,672.9 -> 1,736.7. Prefill, whose
# many rows already fill the GPU, lost 3% with it (8B pp512 13,482 -> 13,076): only up to
# NORM_SPLIT_MAX_ROWS rows are split. EDGELLM_NORM_SPLIT=0 keeps one program per row.
NORM_SPLIT_MIN_D = 2048
NORM_SPLIT_MAX_ROWS = 32
NORM_SLICE = 512


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes two 2-D row-major views span intersect (views of one arena often share a
    storage without overlapping)."""
    def span(t):
        start = t.data_ptr()
        return start, start + ((t.shape[0] - 1) * t.stride(0) + t.shape[1]) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _norm_slice(T: int, D: int, block: int, ro, inputs) -> int:
    """Columns per program: the whole row, or NORM_SLICE when the row is wide and no program's
    writes can reach what another still reads (an in-place residual update needs one program)."""
    import os

    if (T > NORM_SPLIT_MAX_ROWS or D < NORM_SPLIT_MIN_D or block <= NORM_SLICE
            or os.environ.get("EDGELLM_NORM_SPLIT", "1") == "0"):
        return block
    if ro is not None and any(_overlaps(ro, t) for t in inputs):
        return block
    return NORM_SLICE


@dataclass
class Peers:
    """Where the ranks of a tensor-parallel group keep the partials of one all_reduce: addrs, an
    int64 device tensor of each rank's buffer address (rank order; the buffers are symmetric, one
    shape and row stride); pads, the address of the ranks' signal-pad address table; slots, the
    barrier slots a pad holds (WORLD flags each)."""
    addrs: torch.Tensor
    pads: int
    rank: int
    world: int
    slots: int


def norm_programs(rows: int, D: int) -> int:
    """The most programs rms_norm launches for up to `rows` rows of width D (Peers needs a barrier
    slot each): split rows take several programs each, more than NORM_SPLIT_MAX_ROWS rows one."""
    block = max(32, next_pow2(D))
    split = block // NORM_SLICE if D >= NORM_SPLIT_MIN_D and block > NORM_SLICE else 1
    return max(rows, min(rows, NORM_SPLIT_MAX_ROWS) * split)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             config: dict | None = None, xq=None, peers: Peers | None = None) -> torch.Tensor:
    """out = h / sqrt(mean(h^2) + eps) * weight, with h = x + residual (or x alone).

    With a residual and residual_out given, h is stored to residual_out (which may alias x or
    residual, for an in-place update of the residual stream) and the norm is taken of h as stored.
    xq (a QuantizedActivations of out's shape): also write out quantized to int8 per 32-block, as
    quantize_activations(out) would, for linear(..., act_int8=True, xq=xq).
    Up to NORM_SPLIT_MAX_ROWS rows of NORM_SPLIT_MIN_D or more columns are split over several
    programs each (not in place).
    peers: x is this rank's partial in a symmetric buffer (its rows from the start) and the norm
    takes the sum of every rank's partial (an all_reduce fused in; every rank must call it alike)."""
    check_2d(x, "x")
    T, D = x.shape
    if weight.numel() != D or not weight.is_contiguous():
        raise ValueError(f"rms_norm weight has {weight.numel()} elements (contiguous), expected {D}")
    if residual is not None:
        check_2d(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    out = out_buffer(out, (T, D), x.dtype, x.device)
    if residual_out is not None:
        residual_out = out_buffer(residual_out, (T, D), x.dtype, x.device, "residual_out")
    if xq is not None and (xq.shape != (T, D) or D % 32):
        raise ValueError(f"xq holds activations of shape {xq.shape}, expected {(T, D)} with D a multiple of 32")
    if T == 0:
        return out
    block = max(32, next_pow2(D))
    has_res, write_res = residual is not None, residual is not None and residual_out is not None
    r = residual if has_res else x
    ro = residual_out if write_res else out
    sl = _norm_slice(T, D, block, ro if write_res else None, (x, r) if has_res else (x,))
    if sl < block and (_overlaps(out, x) or (has_res and _overlaps(out, r))):
        sl = block  # the normalised output written over the input: one program per row
    nw = (config or {}).get("num_warps") or max(1, min(16 if sl == block else 4, block // 256))
    qa = (xq.xq, xq.xd, xq.xs) if xq is not None else (out, out, out)
    if peers is not None and T * (block // sl) > peers.slots:
        raise ValueError(f"rms_norm: {T * (block // sl)} programs, the peers' signal pads hold {peers.slots}")
    # without peers the address arguments are unused (WORLD 1 compiles them out)
    addrs, pads, rank, world = (peers.addrs, peers.pads, peers.rank, peers.world) if peers is not None else (x, 0, 0, 1)
    _rms_norm_kernel[(T, block // sl)](x, x.stride(0), r, r.stride(0), weight, out, out.stride(0), ro, ro.stride(0),
                                       D, float(eps), *qa, addrs, pads, HAS_RES=has_res, WRITE_RES=write_res,
                                       QUANT=xq is not None, BLOCK_D=block, SLICE=sl, RANK=rank, WORLD=world,
                                       num_warps=nw, **pdl())
    return out


@jit
def _head_rms_norm_kernel(x_ptr, stride_x, w_ptr, out_ptr, stride_o, D, eps, BLOCK_D: tl.constexpr,
                          PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    c = tl.arange(0, BLOCK_D)
    mask = c < D
    x = tl.load(x_ptr + row * stride_x + head * D + c, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + head * D + c, (x * r * w).to(out_ptr.dtype.element_ty), mask=mask)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """RMSNorm of each head_dim group of x [T, H * head_dim] (head_dim = weight.numel()): per-head
    q/k norm. x may be a column slice of a wider tensor (only its row stride is used); out may be x."""
    check_2d(x, "x")
    T, W = x.shape
    D = weight.numel()
    if not weight.is_contiguous() or W % D or x.stride(1) != 1:
        raise ValueError(f"head_rms_norm: width {W} is not a multiple of the weight's {D} (or x is not row-major)")
    out = out_buffer(out, (T, W), x.dtype, x.device)
    if T:
        block = max(32, next_pow2(D))
        nw = (config or {}).get("num_warps") or max(1, min(8, block // 256))
        _head_rms_norm_kernel[(T, W // D)](x, x.stride(0), weight, out, out.stride(0), D, float(eps), BLOCK_D=block,
                                           num_warps=nw, **pdl())
    return out


@dataclass
class NormTail:
    """add_rms_norm's work done by the matrix-vector kernel that produces its branch input y:
    sum_out = residual + y (rounded as stored), out = rms_norm(sum_out) * weight, and with xq the
    int8 copy of out (as rms_norm(..., xq=) writes it). Every program adds its rows; the last one to
    finish (counted in `counter`, an int32 that is zero between launches) normalises whole rows.
    sum_out may be residual itself (an in-place residual stream), but neither may overlap the
    kernel's input x: they are written while other programs still read x."""

    residual: torch.Tensor
    sum_out: torch.Tensor
    out: torch.Tensor
    weight: torch.Tensor
    eps: float
    counter: torch.Tensor
    xq: object = None  # QuantizedActivations

    def checked(self, T: int, width: int) -> "NormTail":
        for name in ("residual", "sum_out", "out"):
            t = getattr(self, name)
            check_2d(t, f"norm {name}")
            if tuple(t.shape) != (T, width):
                raise ValueError(f"norm {name} has shape {tuple(t.shape)}, expected {(T, width)}")
        if self.weight.numel() != width or not self.weight.is_contiguous():
            raise ValueError(f"norm weight has {self.weight.numel()} elements (contiguous), expected {width}")
        if self.counter.dtype != torch.int32 or self.counter.numel() < 1:
            raise ValueError("norm counter must be an int32 tensor (zero when no kernel runs)")
        if self.xq is not None and (tuple(self.xq.shape) != (T, width) or width % 32):
            raise ValueError(f"norm xq holds activations of shape {self.xq.shape}, expected {(T, width)} "
                             f"with a width that is a multiple of 32")
        return self

    def unfused(self, y: torch.Tensor) -> torch.Tensor:
        """The same result from y with the rms_norm kernel (prefill sizes)."""
        return rms_norm(y, self.weight, self.eps, residual=self.residual, out=self.out, residual_out=self.sum_out,
                        xq=self.xq)

    def kernel_args(self) -> tuple[list, dict]:
        qa = [self.xq.xq, self.xq.xd, self.xq.xs] if self.xq is not None else [self.out] * 3
        width = self.out.shape[1]
        return ([self.residual, self.residual.stride(0), self.sum_out, self.sum_out.stride(0), self.out,
                 self.out.stride(0), self.weight, float(self.eps), self.counter, *qa],
                dict(NORM=True, NORM_QUANT=self.xq is not None, NORM_CHUNK=min(next_pow2(width), NORM_TAIL_CHUNK)))


# columns the tail normalises per step: a chunk stays in the registers of a 1-warp program
NORM_TAIL_CHUNK = 1024


@jit
def norm_tail_epilogue(y, rows, rmask, tok, M, N, n_programs,
                       res_ptr, stride_r, sum_ptr, stride_s, n_ptr, stride_n, w_ptr, eps, cnt_ptr,
                       xq_ptr, xd_ptr, xs_ptr, QUANT: tl.constexpr, CHUNK: tl.constexpr):
    """In a GEMV epilogue: y (fp32, this program's rows of token tok) is rounded as the unfused
    kernel would store it and added to the residual; then the program counts itself done, and
    the last one normalises every token's row (reading the sums from L2: other SMs wrote them)."""
    y = y.to(sum_ptr.dtype.element_ty).to(tl.float32)
    a = tl.load(res_ptr + tok.to(tl.int64) * stride_r + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(sum_ptr + tok.to(tl.int64) * stride_s + rows, (a + y).to(sum_ptr.dtype.element_ty), mask=rmask)
    tl.debug_barrier()  # all of this program's stores come before its release of the counter
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if done == n_programs - 1:
        c0 = tl.arange(0, CHUNK)
        for t in range(M):  # M <= 8 tokens: int32 offsets suffice
            srow = sum_ptr + t * stride_s
            acc = tl.zeros([CHUNK], dtype=tl.float32)
            for k in range(0, N, CHUNK):
                x = tl.load(srow + k + c0, mask=k + c0 < N, other=0.0, cache_modifier=".cg").to(tl.float32)
                acc += x * x
            r = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
            for k in range(0, N, CHUNK):
                c = k + c0
                cm = c < N
                x = tl.load(srow + c, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
                w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
                out = (x * r * w).to(n_ptr.dtype.element_ty)
                tl.store(n_ptr + t * stride_n + c, out, mask=cm)
                if QUANT:
                    _store_int8_blocks(out, t, N, xq_ptr, xd_ptr, xs_ptr, c, CHUNK)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch
