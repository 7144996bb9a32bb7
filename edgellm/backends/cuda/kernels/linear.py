"""y = x @ W.T for packed weights: decode matrix-vector kernels and a prefill matrix-matrix kernel.

Decode (tokens <= DECODE_MAX_TOKENS) streams the weights once: program p computes BLOCK_N output
rows of one token; the programs of all tokens for one row block are adjacent in the grid, so they
run together and share the weight tile through L2 (weights cross DRAM once for up to 8 tokens).
Quantized tiles are [blocks, rows, words of a block]: the threads of a warp read consecutive
blocks of one row (coalesced 16-byte loads) and each thread repeats over the rows, keeping its
block of x in registers. The dot product over a block stays inside one thread, the block scale is
applied once per block, and offsets (Q4_0's -8, Q4_1's minimum) become per-block sums of x
shared by all rows. Products accumulate in fp32 in a [blocks, rows] tile reduced across threads
once, after the K loop. (compile_check.py shows the compiled loops: per weight about 4
instructions for float Q4, 3.4 for float Q8_0, 0.1 for F16.)

The int8-activation path (llama.cpp's way) quantizes x per 32-block to int8 once
(`quantize_activations`) and takes 4-byte integer dot products (dp4a) of nibbles or int8 weights
with it: about one instruction per weight in the compiled loop. It adds x's rounding to int8
(relative error ~0.5% of a dot product), which llama.cpp accepts.

Prefill computes out^T = W @ x^T with tl.dot so that the dequantized weight tile (in registers) is
the MMA's left operand and the tokens are its N side (which may be as small as 16). Q4 weights are
split into their low- and high-nibble halves, each multiplied with the matching rows of x^T, so no
nibble interleaving is needed. With WEIGHT_B (a configuration key) the same tiles are multiplied the
other way round, out = x @ W^T, the dequantized weight the MMA's right operand, which Hopper's wgmma
reads from shared memory: the form whose 128-row tiles are correct on the H100 (configs.py).

The six-bit layouts (Q6, Q6M; packing.py) follow Q4's structure: a block's nibble words are read
as Q4's, its two words of top bits beside them (one 8-byte load), and one shift and one masked
merge per word rebuild four 6-bit codes, one per byte (`_q6_words`). The float path moves each
code under the exponent of 1.0 (1 + q/64, Q4's trick with a 6-bit field), the int8 path feeds the
bytes to dp4a; both keep a sum per 16-element half, since each half has its own scale (and
minimum), and fold the offset 32 into per-half sums of x. Prefill dequantizes to fp16 as Q4 does
(1024 + q, exact, minus 1056). compile_check: about 5 instructions per weight on the float path
(Q4: 3.6) and 2.1 on the int8 path (Q4: 1.2), i.e. per byte read about what Q4 costs.

The K-quants in their own terms (Q4K, Q5K, Q6K; packing.py) take the Q4_1 and Q6 paths with the
scales formed from codes: a block's scale (and minimum) is its 6-bit (Q6K: int8) code times the
super-block's D (and DMIN), multiplied in fp32 per block and row (`_q4k_scales`, `_q6_scales`),
where the converted layouts load an fp16 per block; the prefill tile rounds them to fp16 as the
converted layouts store them. Q5K's codes enter the six-bit paths as whole bytes (`_q5_words`: the
nibble words merged with one word of fifth bits per block), with Q4K's scales.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import configs
from ._common import (INTERPRET, USE_DP4A, check_2d, device_key, device_sm_count, dp4a, int_or_tensor, jit,
                      l2_prefetch, made_once, nibbles_f16, or_under_one, out_buffer, pdl, pdl_prologue, prefetch_lines,
                      six_bits_f16)
from .elementwise import ACT_CODES, gate_act
from .norm import NormTail, norm_tail_epilogue
from .packing import PackedWeight
from .rope import RopeStore, rope_cos_sin

# The GEMM's dequantization through packed PTX (nibbles_f16, six_bits_f16); otherwise the Triton
# operations, as the interpreter runs them. EDGELLM_NIBBLE_ASM=0 and EDGELLM_SIX_ASM=0 turn them
# off. The six-bit one is element-wise (each element its own shift): a form that assumed a thread's
# two packed elements to be neighbours in a block gave wrong Q6 tiles where the layout packed rows
# instead (K not a multiple of BLOCK_K); the element-wise form passed test_linear_six_bit_packed_ptx
# (every tile kind, K 160 and 512) on an H200 (2026-11-29) and took 8B Q4_K_M's 16-row step's
# kernels from 5,178 to 4,929 us (bench_rows.py --profile 16).
_NIBBLE_ASM = USE_DP4A and os.environ.get("EDGELLM_NIBBLE_ASM", "1") != "0"
_SIX_ASM = USE_DP4A and os.environ.get("EDGELLM_SIX_ASM", "1") != "0"
_FMT_CODE = {"F16": 0, "Q4_0": 1, "Q4_1": 2, "Q8_0": 3, "Q6": 4, "Q6M": 5, "Q4K": 6, "Q6K": 7, "Q5K": 8}


# ---------------------------------------------------------------------------------------------
# decode: float activations
# ---------------------------------------------------------------------------------------------

@jit
def _ld(ptr, mask, MASKED: tl.constexpr, STREAM: tl.constexpr = False):
    """A load that is masked only when the tile can overhang the matrix (a masked load first
    zeroes its registers); STREAM marks weights, read once, so they do not evict x from L2."""
    if MASKED:
        if STREAM:
            v = tl.load(ptr, mask=mask, other=0, eviction_policy="evict_first")
        else:
            v = tl.load(ptr, mask=mask, other=0)
    else:
        if STREAM:
            v = tl.load(ptr, eviction_policy="evict_first")
        else:
            v = tl.load(ptr)
    return v


@jit
def _dense_part(w_ptr, rows64, rmask, k, kmask, x, stride_w, MASKED: tl.constexpr):
    w = _ld(w_ptr + rows64[:, None] * stride_w + k[None, :], rmask[:, None] & kmask[None, :], MASKED, True)
    return w.to(tl.float32) * x[None, :]


@jit
def _q8_part(q_ptr, d_ptr, rows64, rmask, kb, kmask, x, stride_q, stride_d, MASKED: tl.constexpr):
    # a block's 32 bytes as [2, 16]: two 16-byte loads by one thread (a single [32] axis would be
    # split across two threads, which then need shuffles and a layout change per K-tile)
    h = tl.arange(0, 2)
    j = tl.arange(0, 16)
    mask2 = kmask[:, None] & rmask[None, :]
    off = rows64[None, :, None, None] * stride_q + kb[:, None, None, None] * 32 + h[None, None, :, None] * 16 \
        + j[None, None, None, :]
    q = _ld(q_ptr + off, mask2[:, :, None, None], MASKED, True)
    s = tl.sum(tl.sum(q.to(tl.float32) * x[:, None, :, :], axis=3), axis=2)
    d = _ld(d_ptr + rows64[None, :] * stride_d + kb[:, None], mask2, MASKED, True).to(tl.float32)
    return s * d


@jit
def _q4k_scales(c_ptr, p_ptr, rows64, kb, mask, stride_c, MASKED: tl.constexpr):
    """The Q4K layout's scale and minimum (float32, broadcast shapes of rows64 x kb) of sub-blocks kb
    of rows rows64: codes c (int16 [out, nb]: 6-bit scale, 6-bit minimum << 8) and the super-block's
    fp16 (D, DMIN) pair at p (one 4-byte word per super-block, row stride stride_c / 8 words):
    D * scale and -(DMIN * minimum), products in fp32 as llama.cpp forms them."""
    code = _ld(c_ptr + rows64 * stride_c + kb, mask, MASKED, True)
    pair = _ld(p_ptr.to(tl.pointer_type(tl.int32)) + rows64 * (stride_c // 8) + kb // 8, mask, MASKED, True)
    return _q4k_decode(code, pair)


@jit
def _q4k_decode(code, pair):
    """Q4K sub-block codes (int16) and their super-block's (D, DMIN) words (int32, broadcastable)
    as (D * scale, -(DMIN * minimum)) in float32."""
    code = code.to(tl.int32)
    dd = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dm = ((pair >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return dd * (code & 63).to(tl.float32), -(dm * ((code >> 8) & 63).to(tl.float32))


@jit
def _q4k_tile_scales(c_ptr, p_ptr, rows64, kb, k0, mask, rmask, stride_c, SUPER_ONCE: tl.constexpr):
    """A GEMM tile's Q4K scales and minimums (_q4k_scales) rounded to fp16, [rows, blocks, 1].
    SUPER_ONCE: the tile's sub-blocks kb lie in one super-block (BLOCK_K divides 256 and k0 is a
    multiple of it), whose (D, DMIN) word is loaded once a row, not once a sub-block (4 identical
    4-byte copies a row and K-step at BLOCK_K = 128, a quarter of the pipeliner's copy
    instructions). Skinny products at 16 rows on an H200 (skinny_probe.py, 2026-11-28): 8B Q4_K
    gate|up 55.9 us against 60.0, down 33.0 against 34.5."""
    if SUPER_ONCE:
        code = _ld(c_ptr + rows64[:, None] * stride_c + kb[None, :], mask, True, True)
        pair = _ld(p_ptr.to(tl.pointer_type(tl.int32)) + rows64 * (stride_c // 8) + k0 // 256, rmask, True, True)
        dk, mk = _q4k_decode(code, pair[:, None])
    else:
        dk, mk = _q4k_scales(c_ptr, p_ptr, rows64[:, None], kb[None, :], mask, stride_c, True)
    return dk.to(tl.float16)[:, :, None], mk.to(tl.float16)[:, :, None]


@jit
def _q6k_tile_scales(d_ptr, m_ptr, rows64, kb, k0, mask, rmask, stride_d, SUPER_ONCE: tl.constexpr):
    """A GEMM tile's Q6K block-half scales (_q6_scales) rounded to fp16, [rows, blocks]; SUPER_ONCE
    as for _q4k_tile_scales: the super-block's D loaded once a row, not once a sub-block."""
    if SUPER_ONCE:
        pair = _ld(d_ptr.to(tl.pointer_type(tl.int16)) + rows64[:, None] * (stride_d // 2) + kb[None, :], mask,
                   True, True)
        d_lo, d_hi = _q6k_decode(pair, _ld(m_ptr + rows64 * (stride_d // 16) + k0 // 256, rmask, True, True)[:, None])
    else:
        d_lo, d_hi = _q6_scales(d_ptr, m_ptr, rows64[:, None], kb[None, :], mask, stride_d, 7, True)
    return d_lo.to(tl.float16), d_hi.to(tl.float16)


@jit
def _q6k_decode(pair, dd):
    """Q6K's two int8 scale codes of a block (one int16) times the super-block's D (fp32,
    broadcastable): the block halves' scales in float32, as llama.cpp forms them."""
    pair = pair.to(tl.int32)
    dd = dd.to(tl.float32)
    return dd * ((pair << 24) >> 24).to(tl.float32), dd * (pair >> 8).to(tl.float32)


@jit
def _q4_scales(d_ptr, m_ptr, rows64, kb, mask2, stride_d, FMT: tl.constexpr, MASKED: tl.constexpr):
    """A decode GEMV's per-block scale and minimum (float32 [blocks, rows]) of a 4-bit layout:
    Q4_0's fp16 scale (minimum: unused, returned as the scale), Q4_1's fp16 pair of arrays, Q4K's
    codes and super-block pairs (_q4k_scales)."""
    if FMT == 6:
        d, mn = _q4k_scales(d_ptr, m_ptr, rows64[None, :], kb[:, None], mask2, stride_d, MASKED)
    else:
        d = _ld(d_ptr + rows64[None, :] * stride_d + kb[:, None], mask2, MASKED, True).to(tl.float32)
        if FMT == 2:
            mn = _ld(m_ptr + rows64[None, :] * stride_d + kb[:, None], mask2, MASKED, True).to(tl.float32)
        else:
            mn = d
    return d, mn


@jit
def _q6_scales(d_ptr, m_ptr, rows64, kb, mask, stride_d, FMT: tl.constexpr, MASKED: tl.constexpr):
    """The two per-16 scales (float32) of blocks kb of rows rows64 in a six-bit layout: Q6/Q6M's
    fp16 pair (one 4-byte load); Q6K's two int8 scale codes (one 2-byte load) times the super-block's
    D (fp32, row stride stride_d / 16), in fp32 as llama.cpp forms them."""
    if FMT == 7:
        pair = _ld(d_ptr.to(tl.pointer_type(tl.int16)) + rows64 * (stride_d // 2) + kb, mask, MASKED, True)
        d_lo, d_hi = _q6k_decode(pair, _ld(m_ptr + rows64 * (stride_d // 16) + kb // 8, mask, MASKED, True))
    else:
        d_lo, d_hi = _ld_pair(d_ptr + rows64 * stride_d + kb * 2, mask, MASKED)
    return d_lo, d_hi


@jit
def _q4_part(q_ptr, d_ptr, m_ptr, rows64, rmask, kb, kmask, xrow, xsum, stride_q, stride_d,
             FMT: tl.constexpr, MASKED: tl.constexpr, USE_ASM: tl.constexpr):
    # q as 32-bit words [blocks, rows, 4]: word w holds elements 4w..4w+3 (low nibbles) and
    # 16+4w..16+4w+3 (high nibbles). Nibble n becomes the float 1 + n/16 by moving it under the
    # exponent bits of 1.0 (one shift, one 3-input logic op): no int-to-float conversion, which
    # runs at a quarter of the FMA rate and would cap this loop near half the memory bandwidth.
    # The offset folds into the block sum: sum(n * x) = 16 * (sum((1 + n/16) * x) - sum(x)).
    w = tl.arange(0, 4)
    mask2 = kmask[:, None] & rmask[None, :]
    q = _ld(q_ptr + rows64[None, :, None] * stride_q + kb[:, None, None] * 4 + w[None, None, :],
            mask2[:, :, None], MASKED, True)
    acc = tl.zeros_like(q).to(tl.float32)
    for i in tl.static_range(8):  # nibble i of every word: bits 4i..4i+3 -> mantissa bits 19..22
        if i < 5:
            moved = q << (19 - 4 * i)
        else:
            moved = q >> (4 * i - 19)
        f = or_under_one(moved, USE_ASM).to(tl.float32, bitcast=True)
        # its element in each word w: 16 * (i % 2) + 4w + i // 2 (x reads hit L1: the row was just read)
        xi = _ld(xrow + kb[:, None] * 32 + (16 * (i % 2) + i // 2) + 4 * w[None, :], kmask[:, None], MASKED)
        acc += f * xi.to(tl.float32)[:, None, :]
    s = tl.sum(acc, axis=2)  # per block and row: sum of (1 + n/16) * x
    d, mn = _q4_scales(d_ptr, m_ptr, rows64, kb, mask2, stride_d, FMT, MASKED)
    if FMT == 1:
        r = (16.0 * d) * (s - 1.5 * xsum[:, None])  # n - 8 = 16 * ((1 + n/16) - 1.5)
    else:
        r = (16.0 * d) * (s - xsum[:, None]) + mn * xsum[:, None]
    return r


@jit
def _ld_pair(ptr, mask2, MASKED: tl.constexpr):
    """Two adjacent fp16 values at ptr [blocks, rows] (a block's per-16 scales or minimums): one
    4-byte load, as float32."""
    v = _ld(ptr[:, :, None] + tl.arange(0, 2)[None, None, :], mask2[:, :, None], MASKED, True).to(tl.float32)
    return tl.split(v)


@jit
def _q6_words(q_ptr, rows64, kb, mask2, stride_q, n_blocks, MASKED: tl.constexpr, CLEAN: tl.constexpr):
    """A Q6/Q6M block's codes as two tiles of 32-bit words [blocks, rows, 4]: byte i of word w of
    the first holds (bits 0..5) the code of element 4w + i, of the second element 16 + 4w + i.
    CLEAN zeroes bits 6..7 of every byte (dp4a needs whole bytes; the float path masks anyway)."""
    w = tl.arange(0, 4)
    m3 = mask2[:, :, None]
    row = q_ptr + rows64[None, :, None] * stride_q
    q = _ld(row + kb[:, None, None] * 4 + w[None, None, :], m3, MASKED, True)  # nibbles, as Q4_0
    # the two words of top bits (elements 0..15, 16..31), after the row's nibbles: one 8-byte load
    hh = _ld(row + n_blocks * 4 + kb[:, None, None] * 2 + tl.arange(0, 2)[None, None, :], m3, MASKED, True)
    h0, h1 = tl.split(hh)
    h0 = h0[:, :, None]
    h1 = h1[:, :, None]
    # bits 2w, 2w + 1 of every byte -> bits 4, 5 (w = 0: << 4, 1: << 2, 2: as is, 3: >> 2)
    lsh = tl.maximum(4 - 2 * w, 0)[None, None, :]
    rsh = tl.maximum(2 * w - 4, 0)[None, None, :]
    t0 = (h0 << lsh) >> rsh
    t1 = (h1 << lsh) >> rsh
    if CLEAN:
        a = (q & 0x0F0F0F0F) | (t0 & 0x30303030)
        b = ((q >> 4) & 0x0F0F0F0F) | (t1 & 0x30303030)
    else:  # one lop3 each: bits 4..7 from the top-bit word, 6..7 of them garbage
        a = (q & 0x0F0F0F0F) | (t0 & -252645136)  # 0xF0F0F0F0 as int32
        b = ((q >> 4) & 0x0F0F0F0F) | (t1 & -252645136)
    return a, b


@jit
def _q5_words(q_ptr, rows64, kb, mask2, stride_q, n_blocks, MASKED: tl.constexpr):
    """A Q5K block's codes as _q6_words gives a six-bit block's (bits 5..7 zero): the nibble words
    as Q4_0's, and the block's word of fifth bits after the row's nibbles, whose bits w and w + 4
    of byte i are bit 4 of elements 4w + i and 16 + 4w + i."""
    w = tl.arange(0, 4)
    row = q_ptr + rows64[None, :] * stride_q
    q = _ld(row[:, :, None] + kb[:, None, None] * 4 + w[None, None, :], mask2[:, :, None], MASKED, True)
    # loaded as [blocks, rows] and then widened: a [blocks, rows, 1] load took its own register
    # layout, converted through shared memory (compile_check: 254 registers, 72 barriers)
    t = _ld(row + n_blocks * 4 + kb[:, None], mask2, MASKED, True)[:, :, None]
    a = (q & 0x0F0F0F0F) | (((t >> w[None, None, :]) & 0x01010101) << 4)
    b = ((q >> 4) & 0x0F0F0F0F) | (((t >> (w[None, None, :] + 4)) & 0x01010101) << 4)
    return a, b


@jit
def _q6_part(q_ptr, d_ptr, m_ptr, rows64, rmask, kb, kmask, xrow, xs_lo, xs_hi, stride_q, stride_d, n_blocks,
             FMT: tl.constexpr, MASKED: tl.constexpr, USE_ASM: tl.constexpr):
    # the Q4 float trick with 6-bit codes: code q of byte i moved under the exponent of 1.0 gives the
    # float 1 + q/64 (one shift, one lop3); per half, sum((q - 32) x) = 64 (sum((1 + q/64) x) - 1.5 sum(x))
    mask2 = kmask[:, None] & rmask[None, :]
    if FMT == 8:
        a, b = _q5_words(q_ptr, rows64, kb, mask2, stride_q, n_blocks, MASKED)
    else:
        a, b = _q6_words(q_ptr, rows64, kb, mask2, stride_q, n_blocks, MASKED, False)
    w = tl.arange(0, 4)
    acc_lo = tl.zeros_like(a).to(tl.float32)
    acc_hi = tl.zeros_like(a).to(tl.float32)
    for i in tl.static_range(4):  # byte i of every word: bits 8i..8i+5 -> mantissa bits 17..22
        if i < 3:
            ma = a << (17 - 8 * i)
            mb = b << (17 - 8 * i)
        else:
            ma = a >> 7
            mb = b >> 7
        fa = or_under_one(ma, USE_ASM, True).to(tl.float32, bitcast=True)
        fb = or_under_one(mb, USE_ASM, True).to(tl.float32, bitcast=True)
        xp = xrow + kb[:, None] * 32 + i + 4 * w[None, :]  # element 4w + i (x reads hit L1)
        acc_lo += fa * _ld(xp, kmask[:, None], MASKED).to(tl.float32)[:, None, :]
        acc_hi += fb * _ld(xp + 16, kmask[:, None], MASKED).to(tl.float32)[:, None, :]
    s_lo = tl.sum(acc_lo, axis=2)
    s_hi = tl.sum(acc_hi, axis=2)
    if FMT == 8:  # Q5K: one scale and minimum per block; sum(q x) = 64 (sum((1 + q/64) x) - sum(x))
        d, mn = _q4k_scales(d_ptr, m_ptr, rows64[None, :], kb[:, None], mask2, stride_d, MASKED)
        xs = (xs_lo + xs_hi)[:, None]
        return (64.0 * d) * (s_lo + s_hi - xs) + mn * xs
    d_lo, d_hi = _q6_scales(d_ptr, m_ptr, rows64[None, :], kb[:, None], mask2, stride_d, FMT, MASKED)
    r = (64.0 * d_lo) * (s_lo - 1.5 * xs_lo[:, None]) + (64.0 * d_hi) * (s_hi - 1.5 * xs_hi[:, None])
    if FMT == 5:
        m_lo, m_hi = _ld_pair(m_ptr + rows64[None, :] * stride_d + kb[:, None] * 2, mask2, MASKED)
        r += m_lo * xs_lo[:, None] + m_hi * xs_hi[:, None]
    return r


@jit
def _prefetch_rows(a_q, a_d, b_q, b_d, qrb, drb, M, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr,
                   LINES: tl.constexpr, D_LINES: tl.constexpr):
    """Before a PDL wait: this program's rows of the weights (quants, and scales when D_LINES)
    asked of L2 (see l2_prefetch). The M programs of one row block share them: the first asks."""
    pid = tl.program_id(0)
    if pid % M == 0:
        r0 = ((pid // M) * BLOCK_N).to(tl.int64)
        nr = tl.minimum(N - r0, BLOCK_N)
        l2_prefetch(a_q.to(tl.pointer_type(tl.int8), bitcast=True) + r0 * qrb, nr * qrb, LINES)
        if GLU:
            l2_prefetch(b_q.to(tl.pointer_type(tl.int8), bitcast=True) + r0 * qrb, nr * qrb, LINES)
        if D_LINES > 0:
            l2_prefetch(a_d.to(tl.pointer_type(tl.int8), bitcast=True) + r0 * drb, nr * drb, D_LINES)
            if GLU:
                l2_prefetch(b_d.to(tl.pointer_type(tl.int8), bitcast=True) + r0 * drb, nr * drb, D_LINES)


@jit
def _gemv_kernel(x_ptr, stride_xm,
                 a_q, a_d, a_m, b_q, b_d, b_m,
                 bias_ptr, out_ptr, stride_om,
                 M, N, K, stride_q, stride_d,
                 pos_ptr, pos_val, ff_ptr, log2_theta, qo_ptr, stride_qo, kc_ptr, vc_ptr, stride_c, QD, KVD,
                 res_ptr, stride_r, sum_ptr, stride_s, nrm_ptr, stride_n, nw_ptr, eps, cnt_ptr,
                 nxq_ptr, nxd_ptr, nxs_ptr, pf_qrb, pf_drb,
                 FMT: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASKED: tl.constexpr, USE_ASM: tl.constexpr,
                 ROPE: tl.constexpr, POS_FROM_PTR: tl.constexpr, HEAD_DIM: tl.constexpr, N_ROT: tl.constexpr,
                 HAS_FF: tl.constexpr, NORM: tl.constexpr, NORM_QUANT: tl.constexpr, NORM_CHUNK: tl.constexpr,
                 PF_LINES: tl.constexpr, PF_D_LINES: tl.constexpr, PDL: tl.constexpr):
    if PF_LINES > 0:
        _prefetch_rows(a_q, a_d, b_q, b_d, pf_qrb, pf_drb, M, N, BLOCK_N, GLU, PF_LINES, PF_D_LINES)
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    tok = pid % M
    rows = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    xrow = x_ptr + tok.to(tl.int64) * stride_xm
    n_blocks = K // 32
    if FMT == 0:
        acc_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc_a = tl.zeros([BLOCK_K // 32, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_K // 32, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if FMT == 0:
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            x = _ld(xrow + k, kmask, MASKED).to(tl.float32)
            acc_a += _dense_part(a_q, rows64, rmask, k, kmask, x, stride_q, MASKED)
            if GLU:
                acc_b += _dense_part(b_q, rows64, rmask, k, kmask, x, stride_q, MASKED)
        elif FMT == 3:
            kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            kmask = kb < n_blocks
            xo = kb[:, None, None] * 32 + tl.arange(0, 2)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
            x = _ld(xrow + xo, kmask[:, None, None], MASKED).to(tl.float32)
            acc_a += _q8_part(a_q, a_d, rows64, rmask, kb, kmask, x, stride_q, stride_d, MASKED)
            if GLU:
                acc_b += _q8_part(b_q, b_d, rows64, rmask, kb, kmask, x, stride_q, stride_d, MASKED)
        elif FMT == 4 or FMT == 5 or FMT == 7 or FMT == 8:
            kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            kmask = kb < n_blocks
            xo = kb[:, None] * 32 + tl.arange(0, 16)[None, :]
            xs_lo = tl.sum(_ld(xrow + xo, kmask[:, None], MASKED).to(tl.float32), axis=1)
            xs_hi = tl.sum(_ld(xrow + xo + 16, kmask[:, None], MASKED).to(tl.float32), axis=1)
            acc_a += _q6_part(a_q, a_d, a_m, rows64, rmask, kb, kmask, xrow, xs_lo, xs_hi, stride_q, stride_d,
                              n_blocks, FMT, MASKED, USE_ASM)
            if GLU:
                acc_b += _q6_part(b_q, b_d, b_m, rows64, rmask, kb, kmask, xrow, xs_lo, xs_hi, stride_q, stride_d,
                                  n_blocks, FMT, MASKED, USE_ASM)
        else:
            kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            kmask = kb < n_blocks
            xsum = tl.sum(_ld(xrow + kb[:, None] * 32 + tl.arange(0, 32)[None, :], kmask[:, None],
                              MASKED).to(tl.float32), axis=1)
            acc_a += _q4_part(a_q, a_d, a_m, rows64, rmask, kb, kmask, xrow, xsum, stride_q, stride_d, FMT,
                              MASKED, USE_ASM)
            if GLU:
                acc_b += _q4_part(b_q, b_d, b_m, rows64, rmask, kb, kmask, xrow, xsum, stride_q, stride_d,
                                  FMT, MASKED, USE_ASM)
    _gemv_epilogue(acc_a, acc_b, rows, rmask, tok, bias_ptr, out_ptr, stride_om, FMT == 0, GLU, HAS_BIAS, BLOCK_N,
                   pos_ptr, pos_val, ff_ptr, log2_theta, qo_ptr, stride_qo, kc_ptr, vc_ptr, stride_c, QD, KVD,
                   ROPE, POS_FROM_PTR, HEAD_DIM, N_ROT, HAS_FF, M, N, res_ptr, stride_r, sum_ptr, stride_s,
                   nrm_ptr, stride_n, nw_ptr, eps, cnt_ptr, nxq_ptr, nxd_ptr, nxs_ptr, NORM, NORM_QUANT, NORM_CHUNK)


@jit
def _gemv_epilogue(acc_a, acc_b, rows, rmask, tok, bias_ptr, out_ptr, stride_om,
                   ROWS_FIRST: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                   pos_ptr, pos_val, ff_ptr, log2_theta, qo_ptr, stride_qo, kc_ptr, vc_ptr, stride_c, QD, KVD,
                   ROPE: tl.constexpr, POS_FROM_PTR: tl.constexpr, HEAD_DIM: tl.constexpr, N_ROT: tl.constexpr,
                   HAS_FF: tl.constexpr, M, N, res_ptr, stride_r, sum_ptr, stride_s, nrm_ptr, stride_n, nw_ptr, eps,
                   cnt_ptr, nxq_ptr, nxd_ptr, nxs_ptr, NORM: tl.constexpr, NORM_QUANT: tl.constexpr,
                   NORM_CHUNK: tl.constexpr):
    if ROWS_FIRST:  # accumulators are [rows, k] (dense) or [blocks, rows] (quantized)
        y = tl.sum(acc_a, axis=1)
    else:
        y = tl.sum(acc_a, axis=0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    if GLU:
        if ROWS_FIRST:
            u = tl.sum(acc_b, axis=1)
        else:
            u = tl.sum(acc_b, axis=0)
        y = gate_act(y, GLU) * u  # GLU: 1 silu, 2 gelu_tanh
    if ROPE:
        # y holds rows of the q|k|v projection: rotate (q, k) pairs (2i, 2i+1) of each head, then
        # write q to its buffer and k, v straight into row `pos` of the caches (rope_qkv_cache's
        # work, without a launch of its own). BLOCK_N is even, so pairs never straddle programs.
        if POS_FROM_PTR:
            pos = tl.load(pos_ptr).to(tl.int32) + tok
        else:
            pos = pos_val + tok
        y1, y2 = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        r0 = tl.min(rows, axis=0) + 2 * tl.arange(0, BLOCK_N // 2)
        pm = r0 < QD + 2 * KVD
        within = r0 % HEAD_DIM
        rot = (r0 < QD + KVD) & (within < N_ROT)
        cs, sn = rope_cos_sin(pos, within // 2, rot & pm, ff_ptr, log2_theta, N_ROT, HAS_FF)
        o1 = tl.where(rot, y1 * cs - y2 * sn, y1)
        o2 = tl.where(rot, y2 * cs + y1 * sn, y2)
        cache_row = pos.to(tl.int64) * stride_c
        dst = tl.where(r0 < QD, qo_ptr + tok.to(tl.int64) * stride_qo + r0,
                       tl.where(r0 < QD + KVD, kc_ptr + cache_row + (r0 - QD), vc_ptr + cache_row + (r0 - QD - KVD)))
        tl.store(dst, o1.to(qo_ptr.dtype.element_ty), mask=pm)
        tl.store(dst + 1, o2.to(qo_ptr.dtype.element_ty), mask=pm)
    elif NORM:
        # the residual add and the RMSNorm that follow this projection (NormTail)
        norm_tail_epilogue(y, rows, rmask, tok, M, N, tl.num_programs(0), res_ptr, stride_r, sum_ptr, stride_s,
                           nrm_ptr, stride_n, nw_ptr, eps, cnt_ptr, nxq_ptr, nxd_ptr, nxs_ptr, NORM_QUANT, NORM_CHUNK)
    else:
        tl.store(out_ptr + tok.to(tl.int64) * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


# ---------------------------------------------------------------------------------------------
# decode: int8 activations (x quantized per 32-block), integer dot products
# ---------------------------------------------------------------------------------------------

@dataclass
class QuantizedActivations:
    """x quantized per 32-block: xq int8 [M, K], xd fp32 [M, K/32] (scales), xs fp32 [M, K/32]
    (scale * sum of the block's int8 values, for the Q4_0 offset and the Q4_1 minimum)."""

    xq: torch.Tensor
    xd: torch.Tensor
    xs: torch.Tensor

    @property
    def shape(self):
        return tuple(self.xq.shape)


@jit
def _quantize_act_kernel(x_ptr, stride_xm, xq_ptr, xd_ptr, xs_ptr, K, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    tok = tl.program_id(0)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    n_blocks = K // 32
    bmask = b < n_blocks
    j = tl.arange(0, 32)
    off = b[:, None] * 32 + j[None, :]
    x = tl.load(x_ptr + tok.to(tl.int64) * stride_xm + off, mask=bmask[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    d = amax / 127.0
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    v = x * inv[:, None]
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))  # round half away from zero
    tl.store(xq_ptr + tok.to(tl.int64) * K + off, q.to(tl.int8), mask=bmask[:, None])
    row = tok.to(tl.int64) * n_blocks + b
    tl.store(xd_ptr + row, d, mask=bmask)
    tl.store(xs_ptr + row, d * tl.sum(q, axis=1), mask=bmask)


def quantize_activations(x: torch.Tensor, out: QuantizedActivations | None = None, config=None) -> QuantizedActivations:
    """Quantize x [M, K] to int8 per 32-element block (for linear(..., act_int8=True))."""
    check_2d(x, "x")
    M, K = x.shape
    if K % 32:
        raise ValueError(f"quantize_activations: K={K} is not a multiple of 32")
    cfg = {**configs.QUANT_ACT_DEFAULT, **(config or {})}
    if out is None:
        out = QuantizedActivations(torch.empty((M, K), dtype=torch.int8, device=x.device),
                                   torch.empty((M, K // 32), dtype=torch.float32, device=x.device),
                                   torch.empty((M, K // 32), dtype=torch.float32, device=x.device))
    elif out.shape != (M, K):
        raise ValueError(f"quantize_activations: out holds {out.shape}, expected {(M, K)}")
    if M:
        grid = (M, triton.cdiv(K // 32, cfg["BLOCKS"]))
        _quantize_act_kernel[grid](x, x.stride(0), out.xq, out.xd, out.xs, K,
                                   BLOCKS=cfg["BLOCKS"], num_warps=cfg["num_warps"], **pdl())
    return out


@jit
def _q8_part_i8(q_ptr, d_ptr, rows64, rmask, kb, kmask, xw, xdb, stride_q, stride_d, USE_ASM: tl.constexpr,
                MASKED: tl.constexpr):
    h = tl.arange(0, 2)  # a block's 8 words as [2, 4]: one thread, two 16-byte loads
    w = tl.arange(0, 4)
    mask2 = kmask[:, None] & rmask[None, :]
    off = rows64[None, :, None, None] * stride_q + kb[:, None, None, None] * 8 + h[None, None, :, None] * 4 \
        + w[None, None, None, :]
    q = _ld(q_ptr + off, mask2[:, :, None, None], MASKED, True)
    s = tl.sum(tl.sum(dp4a(q, xw[:, None, :, :], USE_ASM), axis=3), axis=2)
    d = _ld(d_ptr + rows64[None, :] * stride_d + kb[:, None], mask2, MASKED, True).to(tl.float32)
    return s.to(tl.float32) * d * xdb[:, None]


@jit
def _q4_part_i8(q_ptr, d_ptr, m_ptr, rows64, rmask, kb, kmask, xlo, xhi, xdb, xsb, stride_q, stride_d,
                FMT: tl.constexpr, USE_ASM: tl.constexpr, MASKED: tl.constexpr):
    w = tl.arange(0, 4)
    mask2 = kmask[:, None] & rmask[None, :]
    q = _ld(q_ptr + rows64[None, :, None] * stride_q + kb[:, None, None] * 4 + w[None, None, :],
            mask2[:, :, None], MASKED, True)
    lo = q & 0x0F0F0F0F  # elements 4w..4w+3 of the block, one per byte
    hi = (q >> 4) & 0x0F0F0F0F  # elements 16+4w..16+4w+3
    s = tl.sum(dp4a(lo, xlo[:, None, :], USE_ASM) + dp4a(hi, xhi[:, None, :], USE_ASM), axis=2)
    d, mn = _q4_scales(d_ptr, m_ptr, rows64, kb, mask2, stride_d, FMT, MASKED)
    if FMT == 1:
        r = d * (s.to(tl.float32) * xdb[:, None] - 8.0 * xsb[:, None])
    else:
        r = d * s.to(tl.float32) * xdb[:, None] + mn * xsb[:, None]
    return r


@jit
def _q6_part_i8(q_ptr, d_ptr, m_ptr, rows64, rmask, kb, kmask, xlo, xhi, xdb, isum_lo, isum_hi, stride_q, stride_d,
                n_blocks, FMT: tl.constexpr, USE_ASM: tl.constexpr, MASKED: tl.constexpr):
    # per half (16 elements, one scale): s * xd * (sum(q * xq) - 32 sum(xq)), integer inside the half
    mask2 = kmask[:, None] & rmask[None, :]
    if FMT == 8:  # Q5K: codes 0..31, one scale and minimum per block: xd * (d * sum(q * xq) + mn * sum(xq))
        a, b = _q5_words(q_ptr, rows64, kb, mask2, stride_q, n_blocks, MASKED)
        dot = tl.sum(dp4a(a, xlo[:, None, :], USE_ASM) + dp4a(b, xhi[:, None, :], USE_ASM), axis=2)
        d, mn = _q4k_scales(d_ptr, m_ptr, rows64[None, :], kb[:, None], mask2, stride_d, MASKED)
        return (d * dot.to(tl.float32) + mn * (isum_lo + isum_hi)[:, None].to(tl.float32)) * xdb[:, None]
    a, b = _q6_words(q_ptr, rows64, kb, mask2, stride_q, n_blocks, MASKED, True)
    dot_lo = tl.sum(dp4a(a, xlo[:, None, :], USE_ASM), axis=2) - 32 * isum_lo[:, None]
    dot_hi = tl.sum(dp4a(b, xhi[:, None, :], USE_ASM), axis=2) - 32 * isum_hi[:, None]
    d_lo, d_hi = _q6_scales(d_ptr, m_ptr, rows64[None, :], kb[:, None], mask2, stride_d, FMT, MASKED)
    r = d_lo * dot_lo.to(tl.float32) + d_hi * dot_hi.to(tl.float32)
    if FMT == 5:
        m_lo, m_hi = _ld_pair(m_ptr + rows64[None, :] * stride_d + kb[:, None] * 2, mask2, MASKED)
        r += m_lo * isum_lo[:, None].to(tl.float32) + m_hi * isum_hi[:, None].to(tl.float32)
    return r * xdb[:, None]


@jit
def _gemv_i8_kernel(xq_ptr, xd_ptr, xs_ptr,
                    a_q, a_d, a_m, b_q, b_d, b_m,
                    bias_ptr, out_ptr, stride_om,
                    M, N, K, stride_q, stride_d,
                    pos_ptr, pos_val, ff_ptr, log2_theta, qo_ptr, stride_qo, kc_ptr, vc_ptr, stride_c, QD, KVD,
                    res_ptr, stride_r, sum_ptr, stride_s, nrm_ptr, stride_n, nw_ptr, eps, cnt_ptr,
                    nxq_ptr, nxd_ptr, nxs_ptr, pf_qrb, pf_drb,
                    FMT: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr, MASKED: tl.constexpr,
                    ROPE: tl.constexpr, POS_FROM_PTR: tl.constexpr, HEAD_DIM: tl.constexpr, N_ROT: tl.constexpr,
                    HAS_FF: tl.constexpr, NORM: tl.constexpr, NORM_QUANT: tl.constexpr, NORM_CHUNK: tl.constexpr,
                    PF_LINES: tl.constexpr, PF_D_LINES: tl.constexpr, PDL: tl.constexpr):
    if PF_LINES > 0:
        _prefetch_rows(a_q, a_d, b_q, b_d, pf_qrb, pf_drb, M, N, BLOCK_N, GLU, PF_LINES, PF_D_LINES)
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    tok = pid % M
    rows = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    n_blocks = K // 32
    xrow = xq_ptr + tok.to(tl.int64) * (K // 4)  # int32 words
    srow = tok.to(tl.int64) * n_blocks
    acc_a = tl.zeros([BLOCK_K // 32, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_K // 32, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        kmask = kb < n_blocks
        xdb = _ld(xd_ptr + srow + kb, kmask, MASKED)
        if FMT == 3:
            xo = kb[:, None, None] * 8 + tl.arange(0, 2)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
            xw = _ld(xrow + xo, kmask[:, None, None], MASKED)
            acc_a += _q8_part_i8(a_q, a_d, rows64, rmask, kb, kmask, xw, xdb, stride_q, stride_d, USE_ASM, MASKED)
            if GLU:
                acc_b += _q8_part_i8(b_q, b_d, rows64, rmask, kb, kmask, xw, xdb, stride_q, stride_d, USE_ASM, MASKED)
        elif FMT == 4 or FMT == 5 or FMT == 7 or FMT == 8:
            xp = xrow + kb[:, None] * 8 + tl.arange(0, 4)[None, :]
            xlo = _ld(xp, kmask[:, None], MASKED)
            xhi = _ld(xp + 4, kmask[:, None], MASKED)
            ones = tl.full([BLOCK_K // 32, 4], 0x01010101, tl.int32)
            isum_lo = tl.sum(dp4a(xlo, ones, USE_ASM), axis=1)  # per-half sums of the int8 codes of x
            isum_hi = tl.sum(dp4a(xhi, ones, USE_ASM), axis=1)
            acc_a += _q6_part_i8(a_q, a_d, a_m, rows64, rmask, kb, kmask, xlo, xhi, xdb, isum_lo, isum_hi, stride_q,
                                 stride_d, n_blocks, FMT, USE_ASM, MASKED)
            if GLU:
                acc_b += _q6_part_i8(b_q, b_d, b_m, rows64, rmask, kb, kmask, xlo, xhi, xdb, isum_lo, isum_hi,
                                     stride_q, stride_d, n_blocks, FMT, USE_ASM, MASKED)
        else:
            xsb = _ld(xs_ptr + srow + kb, kmask, MASKED)
            xp = xrow + kb[:, None] * 8 + tl.arange(0, 4)[None, :]
            xlo = _ld(xp, kmask[:, None], MASKED)
            xhi = _ld(xp + 4, kmask[:, None], MASKED)
            acc_a += _q4_part_i8(a_q, a_d, a_m, rows64, rmask, kb, kmask, xlo, xhi, xdb, xsb, stride_q, stride_d,
                                 FMT, USE_ASM, MASKED)
            if GLU:
                acc_b += _q4_part_i8(b_q, b_d, b_m, rows64, rmask, kb, kmask, xlo, xhi, xdb, xsb, stride_q,
                                     stride_d, FMT, USE_ASM, MASKED)
    _gemv_epilogue(acc_a, acc_b, rows, rmask, tok, bias_ptr, out_ptr, stride_om, False, GLU, HAS_BIAS, BLOCK_N,
                   pos_ptr, pos_val, ff_ptr, log2_theta, qo_ptr, stride_qo, kc_ptr, vc_ptr, stride_c, QD, KVD,
                   ROPE, POS_FROM_PTR, HEAD_DIM, N_ROT, HAS_FF, M, N, res_ptr, stride_r, sum_ptr, stride_s,
                   nrm_ptr, stride_n, nw_ptr, eps, cnt_ptr, nxq_ptr, nxd_ptr, nxs_ptr, NORM, NORM_QUANT, NORM_CHUNK)


# ---------------------------------------------------------------------------------------------
# prefill: tensor-core matrix-matrix, weight dequantized in registers
# ---------------------------------------------------------------------------------------------

@jit
def _mma(w, xt, acc, WEIGHT_B: tl.constexpr):
    """acc + the product of a dequantized weight tile w [rows, k] with an x^T tile xt [k, tokens].
    Default: acc [rows, tokens] += w @ xt, the weight the MMA's left operand, which Hopper's wgmma
    takes from registers. WEIGHT_B: acc [tokens, rows] += xt^T @ w^T, the weight the right operand,
    which goes to the tensor cores through shared memory (see configs.GEMM_WEIGHT_B)."""
    if WEIGHT_B:  # (one return: the compiler visits statements after a return in a constexpr if)
        acc = tl.dot(tl.trans(xt), tl.trans(w), acc)
    else:
        acc = tl.dot(w, xt, acc)
    return acc


@jit
def _gemm_store(acc, rn, nmask, rm, mmask, pid_n, N, bias_ptr, out_ptr, stride_om, HAS_BIAS: tl.constexpr,
                GLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Writes a finished tile acc [weight rows rn, tokens rm] (fp32), + bias. GLU (1 silu, 2
    gelu_tanh): the tile's rows are interleaved gate/up pairs; writes act(gate) * up to output
    columns pid_n * BLOCK_N / 2 ... of out (N / 2 wide)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[:, None]
    rm64 = rm.to(tl.int64)[None, :]
    if GLU:
        g, u = tl.split(tl.permute(tl.reshape(acc, [BLOCK_N // 2, 2, BLOCK_M]), (0, 2, 1)))
        c = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + rm64 * stride_om + c[:, None], (gate_act(g, GLU) * u).to(out_ptr.dtype.element_ty),
                 mask=(c < N // 2)[:, None] & mmask[None, :])
    else:
        tl.store(out_ptr + rm64 * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=nmask[:, None] & mmask[None, :])


@jit
def _dot_halves(lo, hi, xcol, k0, K, mmask, acc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                WEIGHT_B: tl.constexpr, JOIN: tl.constexpr):
    """acc += the product of a weight tile given as its 32-blocks' first halves (lo: elements
    0..15 of each block, the low nibbles, [rows, blocks, 16]) and second halves (hi) with x^T's
    rows k0 .. k0 + BLOCK_K.

    JOIN: the halves joined back into one [rows, BLOCK_K] operand in K order, which moves no data
    (in the MMA operand each thread holds pieces of 16 consecutive k, and a block's halves are
    such pieces), and one product a K-step; Triton then issues it as a chain of asynchronous MMAs
    that the next K-step's dequantization overlaps. Otherwise one product per half (operand
    column c of lo is element (c // 16) * 32 + c % 16 of the K-tile, of hi that + 16), the
    second waiting for the first's MMAs to drain. On an H200 at 16 rows (skinny_probe.py,
    2026-11-28) joined products were 6-8% faster for Q4_0 and Q4_K; for the six-bit layouts
    mixed (Q6_K down 5% slower), which keep the two products. Measured only on skinny tiles: the
    larger (prefill) tiles keep the two products."""
    if JOIN:
        w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), [BLOCK_N, BLOCK_K])
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(xcol + k[:, None], mask=(k < K)[:, None] & mmask[None, :], other=0.0).to(tl.float16)
        acc = _mma(w, xt, acc, WEIGHT_B)
    else:
        lo = tl.reshape(lo, [BLOCK_N, BLOCK_K // 2])
        hi = tl.reshape(hi, [BLOCK_N, BLOCK_K // 2])
        c = tl.arange(0, BLOCK_K // 2)
        klo = k0 + (c // 16) * 32 + c % 16
        xm = (klo < K)[:, None] & mmask[None, :]
        xlo = tl.load(xcol + klo[:, None], mask=xm, other=0.0).to(tl.float16)
        xhi = tl.load(xcol + (klo + 16)[:, None], mask=xm, other=0.0).to(tl.float16)
        acc = _mma(lo, xlo, acc, WEIGHT_B)
        acc = _mma(hi, xhi, acc, WEIGHT_B)
    return acc


@jit
def _ld_blocks(ptr, rn64, kb, j, wm, stride, WIDTH: tl.constexpr, BLOCK_MAJOR: tl.constexpr):
    """A weight tile's quant bytes, [rows, blocks, WIDTH] (WIDTH bytes of each block, j = arange(WIDTH)).
    BLOCK_MAJOR: loaded [blocks, rows, WIDTH] and permuted, so that the pipeliner's shared-memory
    copy holds a block's rows WIDTH bytes apart and the MMA-operand reads of 8 rows (2 bytes each)
    fall in distinct banks; loaded [rows, blocks, WIDTH], a row's blocks sat BLOCK_K / 2 bytes
    apart and those reads were 4-way bank conflicts. Skinny products at 16 rows on an H200
    (2026-11-28) ran 0-7% faster with it; measured only there, the larger tiles keep the other
    order."""
    if BLOCK_MAJOR:
        q = tl.load(ptr + rn64[None, :, None] * stride + kb[:, None, None] * WIDTH + j[None, None, :],
                    mask=tl.trans(wm)[:, :, None], other=0)
        q = tl.permute(q, (1, 0, 2))
    else:
        q = tl.load(ptr + rn64[:, None, None] * stride + kb[None, :, None] * WIDTH + j[None, None, :],
                    mask=wm[:, :, None], other=0)
    return q


@jit
def _gemm_kernel(x_ptr, stride_xm, w_q, w_d, w_m, bias_ptr, out_ptr, stride_om,
                 M, N, K, stride_q, stride_d, ws_ptr, cnt_ptr, k_split, n_splits, shifts_ptr,
                 FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                 EVEN_K: tl.constexpr, WEIGHT_B: tl.constexpr, SKINNY: tl.constexpr, GLU: tl.constexpr,
                 NIBBLE_ASM: tl.constexpr, SIX_ASM: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # token blocks of one weight tile run together: the tile crosses DRAM once
    if not SPLIT:
        pid_n = pid // num_m
        k_lo = 0
        k_hi = K
    else:  # split-K: program (n, s, m) sums K range s (k_split columns, a multiple of BLOCK_K)
        pid_k = (pid // num_m) % n_splits
        pid_n = pid // (num_m * n_splits)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(K, k_lo + k_split)
    if GLU:  # gate|up weight (gate rows, then up rows): the tile's rows are pairs (gate c, up c)
        v = tl.arange(0, BLOCK_N)
        c = pid_n * (BLOCK_N // 2) + v // 2
        nmask = c < N // 2
        rn = c + (v % 2) * (N // 2)
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = rm < M
    rn64 = rn.to(tl.int64)
    xcol = x_ptr + rm.to(tl.int64)[None, :] * stride_xm  # x^T tile: [k, token]
    n_blocks = K // 32
    if WEIGHT_B:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # each element's top-bit shift in its block's word (six-bit layouts, Q5K), read from a table
    # (_shift_table) before the loop: computed from tl.arange in the loop, Triton sent the
    # dequantized tile through shared memory to the MMA (compile_check: 137 stores a K-step, 162
    # registers for Q6K; with the table 9 and 141)
    shifts = tl.load(shifts_ptr + (16 if FMT == 8 else 0) + tl.arange(0, 16))
    # SKINNY (the batched-decode tiles, BLOCK_M <= configs.SKINNY_M): the quants loaded
    # block-major (_ld_blocks) and, for the 4-bit layouts, one product a K-step (_dot_halves);
    # K-quant super-block fields once a row (_q4k_tile_scales) where a K-step stays in one super-block
    SUPER_ONCE: tl.constexpr = SKINNY and 256 % BLOCK_K == 0
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if FMT == 0:
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            w = tl.load(w_q + rn64[:, None] * stride_q + k[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
            xt = tl.load(xcol + k[:, None], mask=km[:, None] & mmask[None, :], other=0.0)
            acc = _mma(w.to(tl.float16), xt.to(tl.float16), acc, WEIGHT_B)
        else:
            # quants as [rows, blocks, bytes of a block]: 16-byte loads, one scale per block,
            # then merged to the [rows, k] operand (free: a block's bytes sit in one thread)
            # Every load of the K loop must be one the pipeliner copies ahead (cp.async, num_stages
            # deep): a load it leaves in place waits for DRAM each iteration. It copies a load only
            # in pieces of 4 bytes or more per thread; the scales (one fp16 per row and block) are
            # that wide only when known to be contiguous and aligned along the row: k0 is a
            # multiple of BLOCK_K (the hint), and with EVEN_K (K a multiple of BLOCK_K) the mask
            # does not vary along the row. Without them the scales of a 64-row, 64-column tile
            # were loaded in place (2 bytes per thread) in every iteration.
            kb = tl.multiple_of(k0 // 32, BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
            if EVEN_K:
                wm = tl.broadcast_to(nmask[:, None], [BLOCK_N, BLOCK_K // 32])
            else:
                wm = nmask[:, None] & (kb < n_blocks)[None, :]
            d = tl.load(w_d + rn64[:, None] * stride_d + kb[None, :], mask=wm, other=0.0).to(tl.float16)[:, :, None]
            if FMT == 3:
                j = tl.arange(0, 32)
                q = tl.load(w_q + rn64[:, None, None] * stride_q + kb[None, :, None] * 32 + j[None, None, :],
                            mask=wm[:, :, None], other=0)
                # int8 -> fp16 as above: 0x6400 | (q + 128) is 1024 + q + 128, exact
                h = (((q.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint16)) | 0x6400).to(tl.float16, bitcast=True)
                w = tl.reshape((h - 1152.0) * d, [BLOCK_N, BLOCK_K])
                k = k0 + tl.arange(0, BLOCK_K)
                km = k < K
                xt = tl.load(xcol + k[:, None], mask=km[:, None] & mmask[None, :], other=0.0)
                acc = _mma(w, xt.to(tl.float16), acc, WEIGHT_B)
            elif FMT == 8:
                # Q5K: the nibbles as Q4, each element's fifth bit from its block's word of them, bit
                # 8 (j % 4) + j // 4 (first half) and that + 4 (second half); one 4-byte load per
                # block (copied ahead: the row, n_blocks * 16 and kb * 4 are multiples of 4 bytes)
                j = tl.arange(0, 16)
                q = _ld_blocks(w_q, rn64, kb, j, wm, stride_q, 16, SKINNY)
                t = tl.load((w_q + rn64[:, None] * stride_q + n_blocks * 16 + kb[None, :] * 4).to(
                    tl.pointer_type(tl.int32)), mask=wm, other=0)[:, :, None]
                sh = shifts[None, None, :]
                t_lo = (t >> sh) & 1
                t_hi = (t >> (sh + 4)) & 1
                lo = ((q & 15).to(tl.int32) | (t_lo << 4) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
                hi = ((q >> 4).to(tl.int32) | (t_hi << 4) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
                dk, mk = _q4k_tile_scales(w_d, w_m, rn64, kb, k0, wm, nmask, stride_d, SUPER_ONCE)
                lo = (lo - 1024.0) * dk + mk
                hi = (hi - 1024.0) * dk + mk
                acc = _dot_halves(lo, hi, xcol, k0, K, mmask, acc, BLOCK_N, BLOCK_K, WEIGHT_B, SKINNY)
            elif FMT == 4 or FMT == 5 or FMT == 7:
                # Q6/Q6M/Q6K: the nibbles as Q4, each element's top two bits from its half's byte
                # 4h + (j % 4), bits 2 (j // 4) (see packing.py); per-16 scales d[2b], d[2b + 1]
                j = tl.arange(0, 16)
                rowp = w_q + rn64[:, None, None] * stride_q
                q = _ld_blocks(w_q, rn64, kb, j, wm, stride_q, 16, SKINNY)
                # a block's 8 bytes of top bits as two 32-bit words (one 8-byte load, copied ahead;
                # the row, n_blocks * 16 and kb * 8 are multiples of 8 bytes): element j's bits sit
                # at 8 (j % 4) + 2 (j // 4) of the first word (first half) and of the second (second
                # half). Read byte by byte (j % 4 of the eight, each four times) they cost a load
                # instruction per element and ran the skinny product at a third of Q4_1's rate.
                hw = tl.load((rowp + n_blocks * 16 + kb[None, :, None] * 8).to(tl.pointer_type(tl.int32))
                             + tl.arange(0, 2)[None, None, :], mask=wm[:, :, None], other=0)
                h_lo, h_hi = tl.split(hw)
                # code - 32 as exact fp16 (six_bits_f16: 0x6400 | q is 1024 + q, less 1056)
                lo, hi = six_bits_f16(q, h_lo[:, :, None], h_hi[:, :, None], shifts[None, None, :], SIX_ASM)
                # the per-16 scales (and minimums) of the tile's blocks as one contiguous [rows, 2 * blocks]
                # load (copied ahead like the quants), split into each block's first and second half
                pair = (kb * 2)[None, :, None] + tl.arange(0, 2)[None, None, :]
                if FMT == 7:  # Q6K: the int8 codes times the super-block's D, rounded to fp16 here
                    d_lo, d_hi = _q6k_tile_scales(w_d, w_m, rn64, kb, k0, wm, nmask, stride_d, SUPER_ONCE)
                else:
                    d_lo, d_hi = tl.split(tl.load(w_d + rn64[:, None, None] * stride_d + pair, mask=wm[:, :, None],
                                                  other=0.0).to(tl.float16))
                lo = lo * d_lo[:, :, None]
                hi = hi * d_hi[:, :, None]
                if FMT == 5:
                    m_lo, m_hi = tl.split(tl.load(w_m + rn64[:, None, None] * stride_d + pair, mask=wm[:, :, None],
                                                  other=0.0).to(tl.float16))
                    lo = lo + m_lo[:, :, None]
                    hi = hi + m_hi[:, :, None]
                acc = _dot_halves(lo, hi, xcol, k0, K, mmask, acc, BLOCK_N, BLOCK_K, WEIGHT_B, False)
            else:
                j = tl.arange(0, 16)
                q = _ld_blocks(w_q, rn64, kb, j, wm, stride_q, 16, SKINNY)
                # nibble -> exact fp16 (q - 8 for Q4_0) without int-to-float conversions (a
                # quarter-rate instruction that would outlast the MMAs; nibbles_f16), so the only
                # rounding is the product with the scale
                if FMT == 1:
                    lo, hi = nibbles_f16(q, 8, NIBBLE_ASM)
                    lo = lo * d
                    hi = hi * d
                elif FMT == 6:  # Q4K: each sub-block's scale and minimum from its codes (rounded to fp16 here)
                    lo, hi = nibbles_f16(q, 0, NIBBLE_ASM)
                    dk, mk = _q4k_tile_scales(w_d, w_m, rn64, kb, k0, wm, nmask, stride_d, SUPER_ONCE)
                    lo = lo * dk + mk
                    hi = hi * dk + mk
                else:
                    lo, hi = nibbles_f16(q, 0, NIBBLE_ASM)
                    mn = tl.load(w_m + rn64[:, None] * stride_d + kb[None, :], mask=wm,
                                 other=0.0).to(tl.float16)[:, :, None]
                    lo = lo * d + mn
                    hi = hi * d + mn
                acc = _dot_halves(lo, hi, xcol, k0, K, mmask, acc, BLOCK_N, BLOCK_K, WEIGHT_B, SKINNY)
    if WEIGHT_B:
        acc = tl.trans(acc)  # [rows, tokens], as the epilogue writes it
    omask = nmask[:, None] & mmask[None, :]
    if SPLIT:
        # each range's partial sum to its own float32 slice of the workspace [splits, M, N]; the
        # program that counts its tile's ranges complete reads them from L2 and adds them in range
        # order (the result does not depend on which program finished last), writes the output
        # and zeroes its counter for the next launch. (Float atomics adding into one [M, N] sum
        # instead gave wrong tiles on the H100 with triton 3.6.0, every run: gemm_stress.py --skinny.)
        # (the tile's own columns of the workspace, contiguous also where rn is not: GLU)
        mn = rm.to(tl.int64)[None, :] * N + (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[:, None]
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + mn, acc, mask=omask)
        tl.debug_barrier()  # every thread's stores come before this program's release of the counter
        cnt = cnt_ptr + pid_n * num_m + pid_m
        done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if done == n_splits - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(0, n_splits):
                acc += tl.load(ws_ptr + s * M * N + mn, mask=omask, other=0.0, cache_modifier=".cg")
            _gemm_store(acc, rn, nmask, rm, mmask, pid_n, N, bias_ptr, out_ptr, stride_om, HAS_BIAS, GLU,
                        BLOCK_N, BLOCK_M)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
    else:
        _gemm_store(acc, rn, nmask, rm, mmask, pid_n, N, bias_ptr, out_ptr, stride_om, HAS_BIAS, GLU, BLOCK_N, BLOCK_M)


# ---------------------------------------------------------------------------------------------
# wrappers
# ---------------------------------------------------------------------------------------------

def _weight_args(w: PackedWeight, dummy: torch.Tensor, row_offset: int = 0, int_words: bool = False):
    """(qs, d, m) for the kernel, starting at output row `row_offset`; absent arrays -> dummy."""
    qs = w.qs[row_offset:]
    if int_words:
        qs = qs.view(torch.int32)
    d = w.d[row_offset:] if w.d is not None else dummy
    m = w.m[row_offset:] if w.m is not None else dummy
    return qs, d, m


def _check_weight(x: torch.Tensor, w: PackedWeight, name: str = "w") -> None:
    if not isinstance(w, PackedWeight):
        raise TypeError(f"{name} must be a PackedWeight (see packing.repack), got {type(w).__name__}")
    if w.fmt not in _FMT_CODE:
        raise ValueError(f"{name}: no kernel for format {w.fmt}")
    if x.shape[1] != w.in_features:
        raise ValueError(f"x has {x.shape[1]} features but {name} {w.fmt} {w.shape} expects {w.in_features}")


def _decode_cfg(fmt: str, config, act_int8: bool = False, glu: bool = False, n_elements: int = 0,
                K: int = 0) -> dict:
    pick = configs.gemv_interpreter_config(fmt, act_int8, glu, K) if INTERPRET else configs.gemv_config(
        fmt, act_int8, glu, n_elements, K)
    cfg = {**pick, **(config or {})}
    if fmt != "F16" and cfg["BLOCK_K"] % 32:
        raise ValueError(f"BLOCK_K={cfg['BLOCK_K']} must be a multiple of 32 for {fmt}")
    return cfg


def _rope_args(rope, x, out) -> tuple[list, dict]:
    """Runtime arguments and constexprs of the GEMV's RoPE epilogue (inactive when rope is None)."""
    if rope is None:
        return [out, 0, out, 0.0, out, 0, out, out, 0, 0, 0], dict(ROPE=False, POS_FROM_PTR=False, HEAD_DIM=2,
                                                                     N_ROT=2, HAS_FF=False)
    pos_ptr, pos_val, from_ptr = int_or_tensor(rope.start_pos, x, "start_pos")
    ff = rope.freq_factors
    D = rope.head_dim
    return ([pos_ptr, pos_val, ff if ff is not None else out, math.log2(rope.theta), rope.q_out, rope.q_out.stride(0),
             rope.k_cache, rope.v_cache, rope.k_cache.stride(0), rope.n_heads * D, rope.n_kv_heads * D],
            dict(ROPE=True, POS_FROM_PTR=from_ptr, HEAD_DIM=D, N_ROT=rope.rot_dims, HAS_FF=ff is not None))


def _norm_args(norm, out) -> tuple[list, dict]:
    """Runtime arguments and constexprs of the GEMV's norm tail (inactive when norm is None)."""
    if norm is None:
        return [out, 0, out, 0, out, 0, out, 0.0, out, out, out, out], dict(NORM=False, NORM_QUANT=False, NORM_CHUNK=32)
    return norm.kernel_args()


def _prefetch_args(w: PackedWeight, rows_per_program: int, programs: int, glu: bool) -> tuple[list, dict]:
    """Runtime arguments and constexprs of the GEMV's weight prefetch (see l2_prefetch): bytes per
    row of the quants and of the scales, and how many 128-byte lines a program asks for."""
    if not w.qs.is_contiguous() or (w.d is not None and not w.d.is_contiguous()):
        return [0, 0], dict(PF_LINES=0, PF_D_LINES=0)  # a region of rows could reach past the storage
    qrb = w.qs.stride(0) * w.qs.element_size()
    drb = w.d.stride(0) * w.d.element_size() if w.d is not None else 0
    share = 2 if glu else 1
    lines = prefetch_lines(programs, rows_per_program * qrb, share)
    d_lines = prefetch_lines(programs, rows_per_program * drb, share) if lines and drb else 0
    return [qrb, drb], dict(PF_LINES=lines, PF_D_LINES=d_lines)


def _launch_gemv(x, wa, wb, b_offset, bias, out, glu, act_int8, xq, config, rope=None, norm=None, act="silu",
                 l2_prefetch=True):
    M, K = x.shape
    N = wa.out_features - b_offset if glu and wb is wa else wa.out_features
    fmt = wa.fmt
    cfg = _decode_cfg(fmt, config, act_int8, glu, N * K, K)
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    grid = (M * triton.cdiv(N, bn),)
    masked = N % bn != 0 or K % bk != 0  # unmasked loads when the tiles cover the matrix exactly
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    rope_rt, rope_ce = _rope_args(rope, x, out)
    norm_rt, norm_ce = _norm_args(norm, out)
    pf_rt, pf_ce = _prefetch_args(wa, bn, triton.cdiv(N, bn) if l2_prefetch else 0, glu)
    if act_int8 and fmt != "F16":
        if xq is None:
            xq = quantize_activations(x)
        elif xq.shape != (M, K):
            raise ValueError(f"xq holds activations of shape {xq.shape}, expected {(M, K)}")
        a = _weight_args(wa, out, 0, int_words=True)
        b = _weight_args(wb, out, b_offset, int_words=True) if glu else a
        stride_q = a[0].stride(0)
        stride_d = wa.d.stride(0)
        _gemv_i8_kernel[grid](xq.xq.view(torch.int32), xq.xd, xq.xs, *a, *b, bias_arg, out, out.stride(0),
                              M, N, K, stride_q, stride_d, *rope_rt, *norm_rt, *pf_rt,
                              FMT=_FMT_CODE[fmt], GLU=ACT_CODES[act] if glu else 0, HAS_BIAS=has_bias,
                              BLOCK_N=bn, BLOCK_K=bk, USE_ASM=USE_DP4A, MASKED=masked, num_warps=cfg["num_warps"], **rope_ce, **norm_ce,
                              **pf_ce, **pdl())
        return
    words = fmt in ("Q4_0", "Q4_1", "Q6", "Q6M", "Q4K", "Q5K", "Q6K")
    a = _weight_args(wa, out, 0, int_words=words)
    b = _weight_args(wb, out, b_offset, int_words=words) if glu else a
    stride_q = a[0].stride(0)
    stride_d = wa.d.stride(0) if wa.d is not None else 0
    _gemv_kernel[grid](x, x.stride(0), *a, *b, bias_arg, out, out.stride(0),
                       M, N, K, stride_q, stride_d, *rope_rt, *norm_rt, *pf_rt,
                       FMT=_FMT_CODE[fmt], GLU=ACT_CODES[act] if glu else 0, HAS_BIAS=has_bias, BLOCK_N=bn,
                       BLOCK_K=bk, MASKED=masked,
                       USE_ASM=USE_DP4A, num_warps=cfg["num_warps"], **rope_ce, **norm_ce, **pf_ce, **pdl())


# split-K GEMMs: per device, float32 workspaces for the partial sums (by size; each launch writes
# before it reads) and one array of tile counters, zero between launches (each launch leaves them
# so). Shared by every product on the device: launches that use them run one after another (one
# stream, as the programs and their CUDA graphs do).
_SPLITK_COUNTERS = 1 << 16
_splitk_buffers: dict[tuple, torch.Tensor] = {}


def _splitk_workspace(dev: torch.device, elements: int) -> tuple[torch.Tensor, torch.Tensor]:
    size = 1 << max(12, (elements - 1).bit_length())
    key = (str(dev), size)
    ws = _splitk_buffers.get(key)
    if ws is None:
        ws = _splitk_buffers[key] = torch.zeros(size, dtype=torch.float32, device=dev)
    cnt = _splitk_buffers.get((str(dev), "counters"))
    if cnt is None:
        cnt = _splitk_buffers[(str(dev), "counters")] = torch.zeros(_SPLITK_COUNTERS, dtype=torch.int32, device=dev)
    return ws, cnt


_shift_tables: dict[tuple, torch.Tensor] = {}


def _shift_table(dev) -> torch.Tensor:
    """int32 [32]: element j's top-bit shift in a six-bit block word (8 (j % 4) + 2 (j // 4)), then
    its fifth-bit shift in a Q5K word (8 (j % 4) + j // 4), on dev; made outside any capture (the
    backend makes it at load). Keyed by device index: "cuda" and "cuda:0" are one device."""
    def make():
        j = torch.arange(16, dtype=torch.int32)
        return torch.cat([8 * (j % 4) + 2 * (j // 4), 8 * (j % 4) + j // 4]).to(dev)
    return made_once(_shift_tables, device_key(dev), make, "linear's shift table", "call _shift_table(device) at load")


def _launch_gemm(x, w, bias, out, config, glu: int = 0):
    """The matrix-matrix kernel; glu (an ACT_CODES value): w is a gate|up weight and out, half its
    width, receives act(gate) * up."""
    M, K = x.shape
    N = w.out_features
    cfg = {**configs.gemm_default(M, N, device_sm_count(x), K, w.fmt), **(config or {})}
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if bk % 32:
        raise ValueError(f"BLOCK_K={bk} must be a multiple of 32")
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    k_split = triton.cdiv(triton.cdiv(K, bk), max(1, int(cfg.get("SPLIT_K", 1)))) * bk
    splits = triton.cdiv(K, k_split)  # no empty split
    ws = cnt = out
    if splits > 1:
        if tiles > _SPLITK_COUNTERS:
            raise ValueError(f"split-K GEMM: {tiles} output tiles, at most {_SPLITK_COUNTERS}")
        ws, cnt = _splitk_workspace(x.device, splits * M * N)
    qs, d, m = _weight_args(w, out)
    _gemm_kernel[(tiles * splits,)](x, x.stride(0), qs, d, m, bias if bias is not None else out, out, out.stride(0),
                                    M, N, K, w.qs.stride(0), w.d.stride(0) if w.d is not None else 0,
                                    ws, cnt, k_split, splits, _shift_table(x.device),
                                    FMT=_FMT_CODE[w.fmt], HAS_BIAS=bias is not None,
                                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=splits > 1, EVEN_K=K % bk == 0,
                                    WEIGHT_B=bool(cfg.get("WEIGHT_B", False)), SKINNY=bm <= configs.SKINNY_M,
                                    GLU=glu, NIBBLE_ASM=_NIBBLE_ASM, SIX_ASM=_SIX_ASM, num_warps=cfg["num_warps"],
                                    num_stages=cfg["num_stages"], **pdl())


def linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
           *, act_int8: bool = False, xq: QuantizedActivations | None = None, config: dict | None = None,
           decode_max_tokens: int = configs.DECODE_MAX_TOKENS, rope: RopeStore | None = None,
           norm: NormTail | None = None, l2_prefetch: bool = True) -> torch.Tensor:
    """out[M, N] = x[M, K] @ W.T (+ bias), for W packed by `repack`.

    M <= decode_max_tokens: matrix-vector kernel (act_int8: x quantized to int8 per 32-block and
    integer dot products, for every quantized layout; xq may pass x already quantized). Otherwise the
    tensor-core kernel. config overrides block sizes (see configs.py). Output dtype: out's, or x's.

    rope: W is a fused q|k|v projection and the result goes through rope_qkv_cache as `rope`
    describes (K and V into the caches, rotated q into rope.q_out, which is returned). Decode
    does it in the matrix-vector kernel's epilogue (style "norm"); otherwise two launches.

    norm: the residual add and RMSNorm that follow (see NormTail): the product is added into
    norm.residual (stored to norm.sum_out) and normalised into norm.out, which is returned; out is
    not written. Decode does it in the matrix-vector kernel (the last program normalises); otherwise
    the rms_norm kernel runs after the product.

    l2_prefetch: with PDL and set_l2_prefetch on, the matrix-vector kernel asks L2 for its first
    weight bytes before waiting for the previous kernel (False where that kernel streams weights
    itself: the lines would be evicted before they are read).
    """
    check_2d(x, "x")
    _check_weight(x, w)
    M = x.shape[0]
    if bias is not None and bias.numel() != w.out_features:
        raise ValueError(f"bias has {bias.numel()} elements, expected {w.out_features}")
    if rope is not None and norm is not None:
        raise ValueError("linear: rope and norm epilogues exclude each other")
    if rope is not None:
        rope = rope.checked(M, w.out_features, x)
        if M == 0:
            return rope.q_out
        if M <= decode_max_tokens and rope.fusable(x) and _decode_cfg(w.fmt, config, act_int8)["BLOCK_N"] % 2 == 0:
            _launch_gemv(x, w, None, 0, bias, rope.q_out, False, act_int8, xq, config, rope=rope,
                         l2_prefetch=l2_prefetch)
            return rope.q_out
        qkv = linear(x, w, bias, out, act_int8=act_int8, xq=xq, config=config, decode_max_tokens=decode_max_tokens)
        return rope.apply(qkv)
    if norm is not None:
        norm = norm.checked(M, w.out_features)
        if M == 0:
            return norm.out
        if M <= decode_max_tokens:
            _launch_gemv(x, w, None, 0, bias, norm.out, False, act_int8, xq, config, norm=norm,
                         l2_prefetch=l2_prefetch)
            return norm.out
        y = linear(x, w, bias, out, act_int8=act_int8, xq=xq, config=config, decode_max_tokens=decode_max_tokens)
        return norm.unfused(y)
    out = out_buffer(out, (M, w.out_features), x.dtype, x.device)
    if M == 0:
        return out
    if M <= decode_max_tokens:
        _launch_gemv(x, w, None, 0, bias, out, False, act_int8, xq, config, l2_prefetch=l2_prefetch)
    else:
        _launch_gemm(x, w, bias, out, config)
    return out


def skinny_glu(M: int) -> bool:
    """Whether an M-row product of a fused gate|up weight (above the GEMV's rows) takes the
    activation in the GEMM's epilogue: skinny products (M <= configs.SKINNY_M), unless
    EDGELLM_SKINNY_GLU=0."""
    import os

    return M <= configs.SKINNY_M and os.environ.get("EDGELLM_SKINNY_GLU", "1") != "0"


def linear_silu_mul(x: torch.Tensor, w_gate: PackedWeight, w_up: PackedWeight | None = None,
                    out: torch.Tensor | None = None, *, act_int8: bool = False,
                    xq: QuantizedActivations | None = None, config: dict | None = None,
                    decode_max_tokens: int = configs.DECODE_MAX_TOKENS, act: str = "silu",
                    l2_prefetch: bool = True) -> torch.Tensor:
    """act(x @ Wg.T) * (x @ Wu.T) in one kernel for decode (tokens <= decode_max_tokens); act is
    silu (SwiGLU) or gelu_tanh (GeGLU).

    w_up None: w_gate holds both, gate rows first then up rows (concat_packed([gate, up])). Then
    skinny products (up to configs.SKINNY_M tokens: batched decode steps) take the matrix-matrix
    kernel with the activation in its epilogue (each tile multiplies gate row c and up row c side
    by side; EDGELLM_SKINNY_GLU=0: a product, then silu_mul). Prefill: one matrix-matrix product
    (per half), then silu_mul.
    """
    check_2d(x, "x")
    _check_weight(x, w_gate, "w_gate")
    if w_up is None:
        if w_gate.out_features % 2:
            raise ValueError(f"fused gate/up weight has an odd number of rows ({w_gate.out_features})")
        F, wb, b_off = w_gate.out_features // 2, w_gate, w_gate.out_features // 2
    else:
        _check_weight(x, w_up, "w_up")
        if w_up.fmt != w_gate.fmt or w_up.shape != w_gate.shape:
            raise ValueError(f"gate {w_gate.fmt} {w_gate.shape} and up {w_up.fmt} {w_up.shape} differ")
        F, wb, b_off = w_gate.out_features, w_up, 0
    M = x.shape[0]
    out = out_buffer(out, (M, F), x.dtype, x.device)
    if M == 0:
        return out
    if M <= decode_max_tokens:
        _launch_gemv(x, w_gate, wb, b_off, None, out, True, act_int8, xq, config, act=act, l2_prefetch=l2_prefetch)
        return out
    if w_up is None and skinny_glu(M):
        _launch_gemm(x, w_gate, None, out, config, glu=ACT_CODES[act])
        return out
    from .elementwise import silu_mul
    if w_up is None:
        gu = linear(x, w_gate, config=config, decode_max_tokens=decode_max_tokens)
        return silu_mul(gu, out=out, act=act)
    g = linear(x, w_gate, config=config, decode_max_tokens=decode_max_tokens)
    u = linear(x, w_up, config=config, decode_max_tokens=decode_max_tokens)
    return silu_mul(g, u, out=out, act=act)
