"""Convolution and pooling kernels for imported vision networks (NCHW tensors, fp16 or fp32).

- conv2d_igemm: convolution as an implicit GEMM on tensor cores (tl.dot): rows are output pixels
  (n, oh, ow), columns output channels, the reduction runs over (c, kh, kw) of one group; the
  im2col matrix is never built, its tile is gathered from the input per K step. The weight is
  repacked once at load to [groups, C/g*KH*KW, O/g] (K-major rows, as the dot reads them).
  Epilogue, fused (edgellm.compiler.passes.fuse_conv_epilogue): + bias, act, + residual, res_act.
- conv2d_depthwise: groups == channels (MobileNet, EfficientNet, ConvNeXt): no reduction over
  channels, so no GEMM; each program owns a block of output pixels of one (n, c) plane and
  accumulates the KH*KW taps in fp32. Same epilogue.
- pool2d (max / average with ONNX's padding and divisor rules) and global_avgpool.
Activations (ACT codes) match edgellm.backends.cpu_nd.ACTIVATIONS.
"""

from __future__ import annotations

import os as _os

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, device_sm_count, jit, require_device

ACT_CODES = {None: 0, "relu": 1, "clip": 2, "hardswish": 3, "hardsigmoid": 4, "sigmoid": 5, "silu": 6,
             "gelu": 7, "tanh": 8}


@jit
def _act(x, ACT: tl.constexpr, p0, p1):
    if ACT == 1:
        x = tl.maximum(x, 0.0)
    elif ACT == 2:
        x = tl.minimum(tl.maximum(x, p0), p1)
    elif ACT == 3:
        x = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0
    elif ACT == 4:
        x = tl.minimum(tl.maximum(p0 * x + p1, 0.0), 1.0)
    elif ACT == 5:
        x = 1.0 / (1.0 + tl.exp(-x))
    elif ACT == 6:
        x = x / (1.0 + tl.exp(-x))
    elif ACT == 7:
        x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACT == 8:
        x = 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0
    return x


@jit
def _conv_igemm_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr,
                       N, C, H, W, O, OH, OW, Cg, Og, K,
                       SH: tl.constexpr, SW: tl.constexpr, PT, PL, DH: tl.constexpr, DW: tl.constexpr,
                       KH: tl.constexpr, KW: tl.constexpr,
                       HAS_BIAS: tl.constexpr, ACT: tl.constexpr, a0, a1,
                       HAS_RES: tl.constexpr, RACT: tl.constexpr, r0, r1, IEEE: tl.constexpr,
                       ws_ptr, SPLIT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2) // SPLIT
    split = tl.program_id(2) % SPLIT
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output pixels
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels within the group
    M = N * OH * OW
    n = rows // (OH * OW)
    rem = rows % (OH * OW)
    oh = rem // OW
    ow = rem % OW
    row_ok = rows < M
    col_ok = cols < Og
    ih0 = oh * SH - PT
    iw0 = ow * SW - PL
    x_row = x_ptr + (n.to(tl.int64) * C + g * Cg) * H * W
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # split-K: this program reduces one of SPLIT consecutive ranges of whole K-tiles
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    k_lo = split * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        c = ks // (KH * KW)
        kr = ks % (KH * KW)
        kh = kr // KW
        kw = kr % KW
        ih = ih0[:, None] + kh[None, :] * DH
        iw = iw0[:, None] + kw[None, :] * DW
        ok = row_ok[:, None] & (ks < k_hi)[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        a = tl.load(x_row[:, None] + c[None, :] * H * W + ih * W + iw, mask=ok, other=0.0)
        b = tl.load(w_ptr + (g * K + ks[:, None]) * Og + cols[None, :],
                    mask=(ks < k_hi)[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    oc = g * Og + cols
    if SPLIT > 1:  # partial sums in fp32 [SPLIT, M, O]; _splitk_epilogue_kernel adds them up
        ws = ws_ptr + (split * M + rows).to(tl.int64)[:, None] * O + oc[None, :]
        tl.store(ws, acc, mask=row_ok[:, None] & col_ok[None, :])
    else:
        _conv_epilogue(acc, b_ptr, r_ptr, y_ptr, n, oh, ow, oc, row_ok, col_ok, O, OH, OW,
                       HAS_BIAS, ACT, a0, a1, HAS_RES, RACT, r0, r1)


@jit
def _conv_epilogue(acc, b_ptr, r_ptr, y_ptr, n, oh, ow, oc, row_ok, col_ok, O, OH, OW,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, a0, a1, HAS_RES: tl.constexpr, RACT: tl.constexpr,
                   r0, r1):
    """+ bias, act, + residual, res_act, stored to the NCHW output: rows (n, oh, ow) x channels oc."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + oc, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc = _act(acc, ACT, a0, a1)
    offs = (n.to(tl.int64)[:, None] * O + oc[None, :]) * OH * OW + (oh * OW + ow)[:, None]
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_RES:
        acc += tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc = _act(acc, RACT, r0, r1)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _splitk_epilogue_kernel(ws_ptr, b_ptr, r_ptr, y_ptr, M, O, OH, OW,
                            HAS_BIAS: tl.constexpr, ACT: tl.constexpr, a0, a1, HAS_RES: tl.constexpr,
                            RACT: tl.constexpr, r0, r1, SPLIT: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    oc = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = oc < O
    mask = row_ok[:, None] & col_ok[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + (s * M + rows).to(tl.int64)[:, None] * O + oc[None, :], mask=mask, other=0.0)
    n = rows // (OH * OW)
    rem = rows % (OH * OW)
    _conv_epilogue(acc, b_ptr, r_ptr, y_ptr, n, rem // OW, rem % OW, oc, row_ok, col_ok, O, OH, OW,
                   HAS_BIAS, ACT, a0, a1, HAS_RES, RACT, r0, r1)


@jit
def _conv_depthwise_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr,
                           NC, C, H, W, OH, OW,
                           SH: tl.constexpr, SW: tl.constexpr, PT, PL, DH: tl.constexpr, DW: tl.constexpr,
                           KH: tl.constexpr, KW: tl.constexpr,
                           HAS_BIAS: tl.constexpr, ACT: tl.constexpr, a0, a1,
                           HAS_RES: tl.constexpr, RACT: tl.constexpr, r0, r1,
                           BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    # a tile of BLOCK_C (n, c) planes x BLOCK_P output pixels; the taps are unrolled
    planes = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    pc_ok = planes < NC
    c = planes % C
    pix = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = pix < OH * OW
    oh = pix // OW
    ow = pix % OW
    x_plane = x_ptr + planes.to(tl.int64)[:, None] * H * W
    acc = tl.zeros((BLOCK_C, BLOCK_P), dtype=tl.float32)
    for kh in tl.static_range(KH):
        ih = oh * SH - PT + kh * DH
        for kw in tl.static_range(KW):
            iw = ow * SW - PL + kw * DW
            m = ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            xv = tl.load(x_plane + (ih * W + iw)[None, :], mask=pc_ok[:, None] & m[None, :], other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + c * KH * KW + kh * KW + kw, mask=pc_ok, other=0.0).to(tl.float32)
            acc += xv * wv[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=pc_ok, other=0.0).to(tl.float32)[:, None]
    acc = _act(acc, ACT, a0, a1)
    offs = planes.to(tl.int64)[:, None] * OH * OW + pix[None, :]
    mask = pc_ok[:, None] & ok[None, :]
    if HAS_RES:
        acc += tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc = _act(acc, RACT, r0, r1)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _pool_kernel(x_ptr, y_ptr, NC, H, W, OH, OW, PT, PL,
                 KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                 DH: tl.constexpr, DW: tl.constexpr, IS_MAX: tl.constexpr, COUNT_PAD: tl.constexpr,
                 PH_END, PW_END, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    planes = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    pc_ok = planes < NC
    pix = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = pix < OH * OW
    oh = pix // OW
    ow = pix % OW
    x_plane = x_ptr + planes.to(tl.int64)[:, None] * H * W
    if IS_MAX:
        acc = tl.full((BLOCK_C, BLOCK_P), float("-inf"), tl.float32)
    else:
        acc = tl.zeros((BLOCK_C, BLOCK_P), dtype=tl.float32)
    cnt = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for kh in tl.static_range(KH):
        ih = oh * SH - PT + kh * DH
        for kw in tl.static_range(KW):
            iw = ow * SW - PL + kw * DW
            inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            m = pc_ok[:, None] & (ok & inside)[None, :]
            if IS_MAX:
                v = tl.load(x_plane + (ih * W + iw)[None, :], mask=m, other=float("-inf")).to(tl.float32)
                acc = tl.maximum(acc, v)
            else:
                acc += tl.load(x_plane + (ih * W + iw)[None, :], mask=m, other=0.0).to(tl.float32)
                if COUNT_PAD:  # padding counts, the part of the window past the padded input does not
                    cnt += ((ih < H + PH_END) & (iw < W + PW_END)).to(tl.float32)
                else:
                    cnt += inside.to(tl.float32)
    if not IS_MAX:
        acc = acc / tl.maximum(cnt, 1.0)[None, :]
    offs = planes.to(tl.int64)[:, None] * OH * OW + pix[None, :]
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=pc_ok[:, None] & ok[None, :])


@jit
def _global_avgpool_kernel(x_ptr, y_ptr, NC, HW, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
    planes = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    pc_ok = planes < NC
    base = x_ptr + planes.to(tl.int64)[:, None] * HW
    acc = tl.zeros((BLOCK_C, BLOCK), dtype=tl.float32)
    for s in range(0, HW, BLOCK):
        idx = s + tl.arange(0, BLOCK)
        acc += tl.load(base + idx[None, :], mask=pc_ok[:, None] & (idx < HW)[None, :], other=0.0).to(tl.float32)
    tl.store(y_ptr + planes, (tl.sum(acc, axis=1) / HW).to(y_ptr.dtype.element_ty), mask=pc_ok)


# -- host side ---------------------------------------------------------------------------------------

# On the GPU the implicit GEMM's tile is chosen per shape by timing (Triton's autotuner, once per
# (rows, channels, reduction) at the first, eager call): late ResNet/MobileNet stages at batch 1
# have 49 rows and hundreds of channels, early ones thousands of rows and few channels.
_IGEMM_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bm, bn, bk, w, st in [(64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 128, 32, 8, 3),
                              (32, 64, 64, 4, 3), (16, 64, 64, 4, 2), (16, 32, 128, 4, 2), (32, 32, 64, 2, 3),
                              (128, 32, 32, 4, 3), (256, 64, 32, 8, 3)]
]
_conv_igemm_tuned = None if INTERPRET else triton.autotune(
    configs=_IGEMM_CONFIGS, key=["N", "OH", "OW", "Og", "K", "SH", "KH", "HAS_RES", "SPLIT"])(_conv_igemm_kernel)


def splitk_count(m: int, og: int, groups: int, k: int, sms: int) -> int:
    """K-ranges the implicit GEMM splits into: late ResNet stages at batch 1 are GEMMs of 49-196
    rows by 256-512 channels over K = 2,304-4,608, which 64x64 tiles cover in 8-16 programs,
    a tenth of an H100's SMs, each walking the whole K. Split until about one program per SM,
    keeping at least 256 of K per range (8 = the most; 1 where the tiles fill the GPU already).
    EDGELLM_CONV_SPLITK=N fixes the count (1: never split)."""
    env = _os.environ.get("EDGELLM_CONV_SPLITK")
    if env is not None:
        return max(1, int(env))
    tiles = triton.cdiv(m, 64) * triton.cdiv(og, 64) * groups
    split = 1
    while split < 8 and tiles * split * 2 <= sms and k // (split * 2) >= 256:
        split *= 2
    return split

# The depthwise tile, on the GPU, is also chosen by timing (once per shape, at the first eager call):
# planes x pixels per program from one plane of 64 pixels (late ConvNeXt / MobileNet stages at
# batch 1: 7x7 and 14x14 planes, hundreds of channels) to 16 planes of 256 (early stages, batch 8);
# the rule's own tiles (8 x 256 and 32 x 64, 4 warps) are among them, so tuning cannot pick worse.
# EDGELLM_DW_TUNE=0: the tile from _plane_tile's rule instead.
_DW_CONFIGS = [
    triton.Config({"BLOCK_C": bc, "BLOCK_P": bp}, num_warps=w)
    for bc, bp, w in [(1, 64, 2), (2, 64, 2), (4, 64, 4), (16, 64, 4), (32, 64, 4), (1, 128, 4), (2, 128, 4),
                      (8, 128, 4), (1, 256, 4), (2, 256, 4), (4, 256, 4), (8, 256, 4), (16, 256, 8)]
]
_conv_depthwise_tuned = None if INTERPRET else triton.autotune(
    configs=_DW_CONFIGS, key=["NC", "C", "OH", "OW", "SH", "KH", "HAS_RES"])(_conv_depthwise_kernel)


def _plane_tile(planes: int, pixels: int, min_programs: int = 0) -> tuple[int, int]:
    """(planes, pixels) per program for the per-plane kernels: about 1-2K elements a program, as
    many pixels as the plane has (small late-stage planes share a program across channels).
    min_programs: fewer planes, then fewer pixels, per program until the grid has at least this
    many programs (ConvNeXt's late stages at batch 1: 384 planes of 14x14 made 48 programs, a
    third of an H100's SMs)."""
    bp = min(256, triton.next_power_of_2(max(pixels, 16)))
    bc = max(1, min(triton.next_power_of_2(planes), 2048 // bp))
    while triton.cdiv(planes, bc) * triton.cdiv(pixels, bp) < min_programs and (bc > 1 or bp > 32):
        if bc > 1:
            bc //= 2
        else:
            bp //= 2
    return bc, bp


def _depthwise_min_programs(x: torch.Tensor) -> int:
    """Programs the depthwise grid should have at least, where its tile is not tuned: two per SM
    (EDGELLM_DW_MIN_PROGRAMS overrides; 0 keeps the tile sizes alone)."""
    env = _os.environ.get("EDGELLM_DW_MIN_PROGRAMS")
    if env is not None:
        return int(env)
    return 2 * device_sm_count(x)


def pack_conv_weight(w: torch.Tensor, groups: int) -> torch.Tensor:
    """[O, C/g, KH, KW] -> [g, C/g*KH*KW, O/g] contiguous: the B operand of the implicit GEMM."""
    o, cg, kh, kw = w.shape
    return w.reshape(groups, o // groups, cg * kh * kw).transpose(1, 2).contiguous()


def _act_args(act: str | None, args: dict | None) -> tuple[int, float, float]:
    args = args or {}
    if act == "clip":
        lo, hi = args.get("min"), args.get("max")
        return ACT_CODES[act], float("-inf") if lo is None else float(lo), float("inf") if hi is None else float(hi)
    if act == "hardsigmoid":
        return ACT_CODES[act], float(args.get("alpha", 1 / 6)), float(args.get("beta", 0.5))
    if act == "gelu" and args.get("approximate", "none") != "none":
        raise ValueError("gelu with approximate='tanh' has no fused kernel")
    return ACT_CODES[act], 0.0, 0.0


def conv2d(x: torch.Tensor, w_packed: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, *,
           out_channels: int, kernel: tuple[int, int], strides, pads, dilations, groups: int, out_hw,
           act=None, act_args=None, res_act=None, res_act_args=None, depthwise_w: torch.Tensor | None = None,
           block: tuple[int, int, int] | None = None, out: torch.Tensor | None = None,
           split_k: int | None = None) -> torch.Tensor:
    """y = res_act(act(conv(x, w) + bias) + residual); pads = (top, left) (the bottom/right padding
    only shows in out_hw). depthwise_w ([C, KH*KW]) selects the depthwise kernel. block: a fixed
    tile instead of the tuned one ((BLOCK_M, BLOCK_N, BLOCK_K); depthwise: (BLOCK_C, BLOCK_P)).
    split_k: K-ranges of the implicit GEMM summed by a second kernel (default: splitk_count's)."""
    require_device(x, "conv2d input")
    x = x.contiguous()
    n, c, h, wd = x.shape
    oh, ow = out_hw
    y = out if out is not None else torch.empty((n, out_channels, oh, ow), device=x.device, dtype=x.dtype)
    act_c, a0, a1 = _act_args(act, act_args)
    ract_c, r0, r1 = _act_args(res_act, res_act_args) if residual is not None else (0, 0.0, 0.0)
    b = bias if bias is not None else y
    r = residual.contiguous() if residual is not None else y
    kh, kw = kernel
    if depthwise_w is not None:
        dw_args = (x, depthwise_w, b, r, y, n * c, c, h, wd, oh, ow, strides[0], strides[1], pads[0], pads[1],
                   dilations[0], dilations[1], kh, kw, bias is not None, act_c, a0, a1, residual is not None, ract_c,
                   r0, r1)
        if _conv_depthwise_tuned is not None and block is None and _os.environ.get("EDGELLM_DW_TUNE", "1") != "0":
            def dw_grid(meta):
                return (triton.cdiv(n * c, meta["BLOCK_C"]), triton.cdiv(oh * ow, meta["BLOCK_P"]))
            _conv_depthwise_tuned[dw_grid](*dw_args)
            return y
        bc, bp = block[:2] if block is not None else _plane_tile(n * c, oh * ow, _depthwise_min_programs(x))
        grid = (triton.cdiv(n * c, bc), triton.cdiv(oh * ow, bp))
        _conv_depthwise_kernel[grid](*dw_args, BLOCK_C=bc, BLOCK_P=bp)
        return y
    cg, og = c // groups, out_channels // groups
    k = cg * kh * kw
    m = n * oh * ow
    if split_k is None:
        split_k = splitk_count(m, og, groups, k, device_sm_count(x))
    ws = torch.empty((split_k, m, out_channels), device=x.device, dtype=torch.float32) if split_k > 1 else y
    args = (x, w_packed, b, r, y, n, c, h, wd, out_channels, oh, ow, cg, og, k,
            strides[0], strides[1], pads[0], pads[1], dilations[0], dilations[1], kh, kw,
            bias is not None, act_c, a0, a1, residual is not None, ract_c, r0, r1, x.dtype == torch.float32,
            ws, split_k)
    if _conv_igemm_tuned is not None and block is None:
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(og, meta["BLOCK_N"]), groups * split_k)
        _conv_igemm_tuned[grid](*args)
    else:
        bm, bn, bk = block or (32, 32, 32)
        grid = (triton.cdiv(m, bm), triton.cdiv(og, bn), groups * split_k)
        _conv_igemm_kernel[grid](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    if split_k > 1:
        bm, bn = 32, 64
        _splitk_epilogue_kernel[(triton.cdiv(m, bm), triton.cdiv(out_channels, bn))](
            ws, b, r, y, m, out_channels, oh, ow, bias is not None, act_c, a0, a1, residual is not None, ract_c,
            r0, r1, split_k, BLOCK_M=bm, BLOCK_N=bn)
    return y


def pool2d(x: torch.Tensor, *, is_max: bool, kernel, strides, pads, dilations, out_hw, count_include_pad: bool,
           pads_end=(0, 0), out: torch.Tensor | None = None) -> torch.Tensor:
    require_device(x, "pool input")
    x = x.contiguous()
    n, c, h, w = x.shape
    oh, ow = out_hw
    y = out if out is not None else torch.empty((n, c, oh, ow), device=x.device, dtype=x.dtype)
    bc, bp = _plane_tile(n * c, oh * ow)
    _pool_kernel[(triton.cdiv(n * c, bc), triton.cdiv(oh * ow, bp))](
        x, y, n * c, h, w, oh, ow, pads[0], pads[1], kernel[0], kernel[1], strides[0], strides[1], dilations[0],
        dilations[1], is_max, count_include_pad, pads_end[0], pads_end[1], BLOCK_C=bc, BLOCK_P=bp)
    return y


def global_avgpool(x: torch.Tensor) -> torch.Tensor:
    require_device(x, "pool input")
    x = x.contiguous()
    n, c = x.shape[:2]
    hw = x[0, 0].numel()
    y = torch.empty((n, c) + (1,) * (x.dim() - 2), device=x.device, dtype=x.dtype)
    blk = min(256, triton.next_power_of_2(max(hw, 16)))
    bc = max(1, min(64, 4096 // blk))
    _global_avgpool_kernel[(triton.cdiv(n * c, bc),)](x, y, n * c, hw, BLOCK_C=bc, BLOCK=blk)
    return y
