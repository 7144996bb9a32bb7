"""Block sizes: the default each kernel launches with, and the candidates a tuner may time.

Defaults are guesses for the H100 from NOTES.md's probe ("small programs won: 1-8 warps, 2-16 rows
each, K-tile 512-2048; split-K lost"). A tuner picks per (kernel, format, shape, device) from the
candidate lists and passes the winner as `config=` to the wrapper.
"""

from __future__ import annotations

# Decode matrix-vector (tokens <= DECODE_MAX_TOKENS): rows per program, K-tile, warps.
DECODE_MAX_TOKENS = 8

# Quantized tiles are [blocks, rows, words of a block]: the 32 threads of a warp read 32
# consecutive blocks of one row (512 contiguous bytes for Q4) and each thread repeats over the
# BLOCK_N rows, reusing its block of x. With one warp and BLOCK_K = 1024 every thread owns one
# block and the compiled K loop has no barrier (compile_check shows this); with several warps
# some formats get a barrier and a shared-memory exchange of x per K-tile. Candidates for the
# tuner include them anyway.
# Tuned on an H200 (2026-11-22, `bench_kernels.py --tune --model llama8b`), then re-timed on the
# H100 (the reference machine) by the load-time tuner (2026-11-25, `bench_vs_llamacpp.py --variant
# tune1:EDGELLM_TUNE=1`, raw docs/results/h100-2026-11-25/vs_tune.json): the defaults below are the
# H100's picks, so a device the tuner has not seen yet starts from them. Per-kernel times on the
# H100 (device time, L2 flushed), the H200 default -> the H100 pick: F16 2048x8192 16.3 -> 15.6 us,
# fused gate/up 8192x2048 31.8 -> 27.4 us; int8 Q8_0 2048x2048 4.9 -> 4.3 us, 2048x8192 10.6 -> 9.8 us.
GEMV_DEFAULT = {
    "F16": dict(BLOCK_N=2, BLOCK_K=1024, num_warps=4),
    "Q8_0": dict(BLOCK_N=2, BLOCK_K=1024, num_warps=1),
    "Q4_0": dict(BLOCK_N=8, BLOCK_K=1024, num_warps=1),
    "Q4_1": dict(BLOCK_N=8, BLOCK_K=1024, num_warps=1),
    "Q4K": dict(BLOCK_N=8, BLOCK_K=1024, num_warps=1),  # not measured: Q4_1's (the same nibbles, codes for scales)
    # Q6 (Q6_K) and Q6M (Q5_K, Q5_1, mixed stacks): not measured, Q4_0's tiles. A block is 24 + 4
    # (Q6M: + 4) bytes in three arrays instead of Q4_0's 16 + 2 in two, and the float loop does about
    # 3.6 instructions per weight (Q4: 3); if BLOCK_N=8 spills or stalls, the tuner's smaller tiles win.
    "Q6": dict(BLOCK_N=8, BLOCK_K=1024, num_warps=1),
    "Q6K": dict(BLOCK_N=8, BLOCK_K=1024, num_warps=1),  # as Q6
    "Q5K": dict(BLOCK_N=8, BLOCK_K=1024, num_warps=1),  # as Q6 (its codes take the six-bit loop)
    "Q6M": dict(BLOCK_N=8, BLOCK_K=1024, num_warps=1),
}
# Float-activation Q4 GEMV runs on small matrices (below the backend's int8 threshold) and on the
# output projection; the best tile differs by size (H200, whole decode step): SmolLM2-135M Q4_0
# 1279.6 tok/s with the tile above, 1721.1 with BLOCK_N=2/BLOCK_K=512. For the large output
# projections the H100 tuner picked 16 rows with 512-column tiles and one warp (128256x2048 Q4_0
# 71.9 -> 62.3 us, 128256x4096 137.4 -> 124.9 us against the H200's BLOCK_K=4096/4 warps).
# LARGE_GEMV_ELEMENTS picks between them.
LARGE_GEMV_ELEMENTS = 4 << 20
GEMV_SMALL_DEFAULT = {
    "Q4_0": dict(BLOCK_N=2, BLOCK_K=512, num_warps=1),
    "Q4_1": dict(BLOCK_N=2, BLOCK_K=512, num_warps=1),  # not measured: Q4_0's layout plus one array
    "Q4K": dict(BLOCK_N=2, BLOCK_K=512, num_warps=1),  # as Q4_1
    "Q6": dict(BLOCK_N=2, BLOCK_K=512, num_warps=1),  # not measured: Q4_0's
    "Q6K": dict(BLOCK_N=2, BLOCK_K=512, num_warps=1),  # as Q6
    "Q5K": dict(BLOCK_N=2, BLOCK_K=512, num_warps=1),  # as Q6
    "Q6M": dict(BLOCK_N=2, BLOCK_K=512, num_warps=1),
}
GEMV_LARGE_DEFAULT = {
    "Q4_0": dict(BLOCK_N=16, BLOCK_K=512, num_warps=1),
    "Q4_1": dict(BLOCK_N=16, BLOCK_K=512, num_warps=1),
    "Q4K": dict(BLOCK_N=16, BLOCK_K=512, num_warps=1),  # as Q4_1
    # not measured; the 8B Q4_K_M output projection (128256 x 4096, Q6_K) runs here. Q4_0's
    # BLOCK_N=16 spills registers with 6-bit codes (compile_check: 255 registers, ~140 spill
    # stores); 8 rows take 127 (Q6M 167) and none
    "Q6": dict(BLOCK_N=8, BLOCK_K=4096, num_warps=4),
    "Q6K": dict(BLOCK_N=8, BLOCK_K=4096, num_warps=4),  # as Q6
    "Q5K": dict(BLOCK_N=8, BLOCK_K=4096, num_warps=4),  # as Q6
    "Q6M": dict(BLOCK_N=8, BLOCK_K=4096, num_warps=4),
}

# The fused gate/up kernel (two weight matrices per program) wants its own tile: in a whole F16
# decode step (H200) the plain tile made gate/up slower (8B: 171.9 tok/s with it, 217.3 with
# BLOCK_N=4/BLOCK_K=512/1 warp); on the H100 the tuner's pick is the plain tile's (above).
GEMV_GLU_DEFAULT: dict[str, dict] = {
    "F16": dict(BLOCK_N=2, BLOCK_K=1024, num_warps=4),
    # not measured: the plain tile's BLOCK_N=8 spills with two 6-bit weights (compile_check), 4 does not
    "Q6": dict(BLOCK_N=4, BLOCK_K=1024, num_warps=1),
    "Q6K": dict(BLOCK_N=4, BLOCK_K=1024, num_warps=1),  # as Q6
    "Q5K": dict(BLOCK_N=4, BLOCK_K=1024, num_warps=1),  # as Q6
    "Q6M": dict(BLOCK_N=4, BLOCK_K=1024, num_warps=1),
}

# int8 activations (x quantized per 32-block, dp4a): about 1 instruction per weight instead of ~4
# (float Q4) or ~3.4 (float Q8_0), per compile_check's count of the compiled loop.
GEMV_I8_DEFAULT = {
    "Q8_0": dict(BLOCK_N=2, BLOCK_K=2048, num_warps=1),
    "Q4_0": dict(BLOCK_N=2, BLOCK_K=2048, num_warps=1),
    "Q4_1": dict(BLOCK_N=2, BLOCK_K=2048, num_warps=1),  # not tuned: Q4_0's layout plus one array
    "Q4K": dict(BLOCK_N=2, BLOCK_K=2048, num_warps=1),  # as Q4_1
    "Q6": dict(BLOCK_N=2, BLOCK_K=2048, num_warps=1),  # not tuned: Q4_0's
    "Q6K": dict(BLOCK_N=2, BLOCK_K=2048, num_warps=1),  # as Q6
    "Q5K": dict(BLOCK_N=2, BLOCK_K=2048, num_warps=1),  # as Q6
    "Q6M": dict(BLOCK_N=2, BLOCK_K=2048, num_warps=1),
}


GEMV_FIT_K = 1  # 0: keep the tiles as listed whatever the row length (for A/B measurements)


def gemv_config(fmt: str, act_int8: bool = False, glu: bool = False, n_elements: int = 0, K: int = 0) -> dict:
    """The default decode GEMV tile for a weight format, path (int8 activations or float, fused
    gate/up or not), size (rows x columns) and row length K."""
    int8 = act_int8 and fmt != "F16"
    if glu and fmt in GEMV_GLU_DEFAULT and not int8:
        cfg = dict(GEMV_GLU_DEFAULT[fmt])
    elif int8:
        cfg = dict(GEMV_I8_DEFAULT[fmt])
    elif n_elements >= LARGE_GEMV_ELEMENTS and fmt in GEMV_LARGE_DEFAULT:
        cfg = dict(GEMV_LARGE_DEFAULT[fmt])
    elif n_elements and fmt in GEMV_SMALL_DEFAULT:
        cfg = dict(GEMV_SMALL_DEFAULT[fmt])
    else:
        cfg = dict(GEMV_DEFAULT[fmt])
    return _fit_k(cfg, fmt, K)


def _fit_k(cfg: dict, fmt: str, K: int) -> dict:
    # a K-tile longer than the row leaves whole warps masked off, and the float-Q4 loop is bound by
    # instruction issue: the large tile (4096 columns, 4 warps) ran the 128256 x 2048 output
    # projection at 44% of copy bandwidth and SmolLM2's 49152 x 576 one at 15% (H100 profile,
    # 2026-11-22). Halve tile and warps together until the tile fits the row.
    if fmt != "F16" and K and GEMV_FIT_K:
        fit = max(32, 1 << (int(K) - 1).bit_length())
        while cfg["BLOCK_K"] > fit and cfg["num_warps"] > 1:
            cfg["BLOCK_K"] //= 2
            cfg["num_warps"] //= 2
    return cfg


def gemv_interpreter_config(fmt: str, act_int8: bool = False, glu: bool = False, K: int = 0) -> dict:
    """The decode GEMV tile under Triton's interpreter: it runs programs one after another in
    Python at a cost per operation almost independent of the tile, so the largest of the tiles
    the GPU uses (default and tuner candidates, each tested on both) runs fastest there. With the
    H100's two-row defaults a whole-model test took more than seven times longer interpreted
    (test_cuda_logits_match_cpu's first model: over 5 minutes against 43 s)."""
    tiles = [gemv_config(fmt, act_int8, glu)] + gemv_tune_candidates(fmt, act_int8 and fmt != "F16", glu)
    cfg = dict(max(tiles, key=lambda c: (c["BLOCK_N"] * c["BLOCK_K"], c["BLOCK_N"])))
    return _fit_k(cfg, fmt, K)


# Decode GEMVs with fewer weight bytes than this are not tuned (the default tile runs): they take
# 3-5 us, launch and latency, whatever the tile. Measured on the H200 (benchmarks/tune_gain.py,
# 2026-11-29): the SmolLM2-135M shape's GEMVs (0.3-1.0 MB) gained 0-0.25 us a launch from their
# tuned tiles and the Llama-3.2-1B shape's 2.4-3.5 MB ones nothing, while their 24 candidates took
# ~3 s of a first load's compile; the 9.4 MB ones gained 0.8-1.3 us (8B's 0.5-1.5).
GEMV_TUNE_MIN_BYTES = 4 << 20


def gemv_tune_candidates(fmt: str, act_int8: bool = False, glu: bool = False) -> list[dict]:
    """What the backend times at first load for one decode GEMV (tuning.py), besides the default.
    Each distinct tile compiles once per Triton cache (about a second), so the list keeps to the
    tiles that won somewhere on the H100 or the H200 plus their neighbours: six per path.
    BLOCK_N stays even (the RoPE epilogue rotates pairs of rows inside one program)."""
    if fmt == "F16":
        tiles = ((2, 1024, 4), (4, 1024, 4), (8, 1024, 2), (4, 512, 1), (2, 512, 1), (16, 1024, 4))
    elif act_int8:
        tiles = ((2, 1024, 1), (2, 2048, 1), (4, 2048, 1), (4, 1024, 1), (2, 4096, 4), (8, 4096, 4))
    elif fmt in ("Q6", "Q6M", "Q6K", "Q5K"):  # 16 rows of 6-bit codes spill registers on the float path (compile_check)
        tiles = ((2, 512, 1), (8, 1024, 1), (8, 4096, 4), (2, 2048, 2), (4, 1024, 1), (4, 512, 1))
    else:
        tiles = ((2, 512, 1), (8, 1024, 1), (16, 512, 1), (2, 2048, 2), (4, 1024, 1), (16, 4096, 4))
    return [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w) for bn, bk, w in tiles]


def gemv_candidates(fmt: str) -> list[dict]:
    out = []
    if fmt == "F16":
        for bn in (2, 4, 8, 16):
            for bk in (256, 512, 1024):
                for w in (1, 2, 4):
                    if bn * bk // (32 * w) >= 8:  # at least a 16-byte load per thread
                        out.append(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w))
        return out
    for bn in (2, 4, 8, 16):
        for w in (1, 2, 4, 8):
            for per_thread in (1, 2):  # blocks of a row per thread
                out.append(dict(BLOCK_N=bn, BLOCK_K=1024 * w * per_thread, num_warps=w))
    return out


# Prefill matrix-matrix: the kernel computes out^T = W @ x^T, so BLOCK_N (weight rows) is the MMA's
# M side and BLOCK_M (tokens) its N side.
# Some tiles give intermittently wrong results for quantized weights on the H100 (triton 3.6.0;
# benchmarks/gemm_stress.py, 2026-11-24, 144 runs each): 128x128 with 8 warps (the default until
# then) failed 16-17, 64x128 with 4 warps 17-43, for Q8_0, Q4_0 and Q4_1 (F16 never); 128x128 and
# 128x64 with 4 warps, 128x64 with 8, 64x64 and 32x64 with 4 warps never failed. The defaults are
# from the second group, at the same speed (M=512, N=14336, K=4096: 227 vs 234 us Q4_0, 234 vs
# 221 us Q8_0; M=96: 94 vs 92 us), and the tuner's candidates keep to the shapes that passed.
# 2026-11-27 (same check, 180 runs each, the kernel with every weight load copied ahead and the
# six-bit word reads): every tile 128 weight rows wide failed - 128 tokens x 128 rows with 4 warps,
# the large-M default then, on every Q4_0 run (30 of 30), 8 warps on Q4_1/Q8_0, 64 x 128 on Q4_0 and
# Q4_1 - while every tile 64 rows wide (128 x 64 with 4 or 8 warps, 64 x 64, 32 x 64, 16 x 64) and
# F16 and Q6_K everywhere passed (docs/results/h100-2026-11-27d/serve/stress.txt). The large-M
# default is now 128 tokens x 64 rows, and the candidates keep to 64-row tiles. (The skinny tiles,
# M <= 32, pass at 128 rows too: gemm_stress.py --skinny.)
# Later the same day (gemm_stress.py with DISABLE_MMA_V3=1, which makes Triton use the warp-level
# mma.sync instead of Hopper's warpgroup wgmma): every tile passed all 180 runs, so the wrong tiles
# come from the wgmma path (a weight operand dequantized in registers); F16, whose weight tile goes
# to the tensor cores from shared memory, never failed. mma.sync is no way out: 128 x 128 on it ran
# pp512 at the 128 x 64 wgmma tile's speed (1B Q4_0 57.6k against 59.4k tok/s; 76.2k with 128 x
# 128 wgmma). Among the tiles that pass, a wider token side amortises the dequantization: at 512
# tokens 256 tokens x 64 rows took the 8B Q4_0 products 5-11% under 128 x 64 (gate|up 572 against
# 644 us, down 286 / 312, o 82 / 87) and Q8_0's up to 20% (gate|up 345 / 434), Q4_K's 12% (633 /
# 716; `skinny_probe.py --M 512 --configs ...`, docs/results/h100-2026-11-27e/). In whole prefills
# (pp512) the wider tile everywhere took 8B Q8_0 from 15.9k to 17.1k tok/s, left 8B and 1B Q4_0 where
# they were, and took 1B Q8_0 from 76.9k to 61.5k: its 2,048-wide products have 64 programs of 256
# tokens for 132 SMs. So a quantized product takes 256 x 64 only where that still gives
# GEMM_HUGE_M_WAVES programs per SM (the MLP's wide gate|up product), else 128 x 64. With that rule
# (alternating with the tree before, same machine, 2026-11-27 09:36-09:42 UTC): 8B Q8_0 17.6-17.9k
# against 16.0-16.1k, 8B Q4_0 12.4k against 11.7k, 1B Q4_0 62.4k against 59.8-61.0k, 1B Q8_0 74-84k
# against 74-76k. F16 stays at 128 x 64: 128 x 128 (correct for F16) ran 1B F16 at 103-104k against
# 111-117k.
# The kernel can also take the weight as the MMA's right operand (WEIGHT_B: acc[tokens, rows] +=
# x @ W^T), which wgmma reads from shared memory, as F16's: every weight-B tile passed every stress
# run, 128 rows wide included (docs/results/h100-2026-11-27e/stress_weight_b.txt: 128 x 128 with 4 and
# 8 warps, 64 x 128, 128 x 256, 256 x 128, 128 x 64). At 512 tokens on the 8B shapes it was the
# fastest tile for the 4-bit layouts' wide gate|up product (128 x 128, 4 warps: Q4_0 467 us against
# 572 for 256 x 64 and 636 for 128 x 64; Q4_K 523 / 633 / 714) and for every other Q8_0 product
# (128 x 64: down 229 against 275 us, q|k|v 87 / 91, o 62 / 67), while Q8_0's gate|up stays fastest
# at 256 x 64 (342 against 365) and the 4-bit layouts' narrower products gain nothing from it
# (`skinny_probe.py --M 512 --configs`, probe512_weight_b.txt). In whole prefills (pp512, against the
# 256 x 64 rule above, alternating, 2026-11-27 09:57-10:02 UTC) the 4-bit layouts' gate|up on the
# weight-B 128 x 128 tile took 8B Q4_0 from 12.3k to 13.3k tok/s, 8B Q4_K_M from 10.5k to 11.2k and
# 1B Q4_0 from 61.6-63.6k to 66.6-66.8k; Q8_0's narrower products on weight-B 128 x 64 moved nothing
# (8B 17.6-17.7k both ways, 1B within its spread), so Q8_0 keeps the tiles above.
GEMM_DEFAULT = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
GEMM_DEFAULT_LARGE_M = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)  # M >= 128
GEMM_DEFAULT_HUGE_M = dict(BLOCK_M=256, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)  # M >= 256
GEMM_HUGE_M_WAVES = 2
GEMM_WIDE_WEIGHT_B = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3, WEIGHT_B=True)
# The MLP's down product (K several times N) has one program per SM or fewer at 128 x 128 (8B: 4 x 32
# at 512 tokens, 1B: 4 x 16), each a long K loop. Split-K (the skinny GEMM's, float32 partial sums
# added by each tile's last program) into the fewest power-of-two ranges giving GEMM_SPLIT_PER_SM
# programs per SM: at 512 tokens on the H100 (skinny_probe.py --M 512, probe_splitk.txt) the
# weight-B 128 x 128 tile split 2 ran 8B down in 247 us (Q4_0) and 186 us (Q8_0) against 315 and
# 277 for 128 x 64, split 4 the 1B down in 79 and 64 us against 98 and 108. Whole pp512 against the
# tree before (2026-11-27 10:19-10:21 UTC): 8B Q4_0 14.7k against 13.3k tok/s, 1B Q8_0 98.4k / 97.8k
# against 85.9k. (q|k|v and o, K = N, gained 0-10% alone from split-K or weight-B: not taken.)
GEMM_SPLIT_PER_SM = 1.5


# A skinny product (M <= SKINNY_M rows: a batched decode step of that many sequences) streams the
# weights once for all rows and is bound by that stream: it needs enough programs in flight to
# fill the GPU, and with 64-row weight tiles a 2048-wide projection has only 32. K is split
# (split-K: SPLIT_K ranges whose float32 partial sums the last program of a tile adds) into the
# fewest power-of-two ranges that give the grid SPLITK_PROGRAMS_PER_SM programs per SM, keeping at
# least SPLITK_MIN_ITERS K-tiles per range. Measured on the H100 (2026-11-26, the Llama-3.2-1B
# shapes in Q4_0, `benchmarks/bench_rows.py --gemm-sweep`: every tile of 16/32 x 32/64 x 64/128,
# 2/4 warps, 1-16 ranges): the best at M = 4-32 was 64 x 64 with 4 warps (2 warps within a few
# percent) and 8 ranges for q|k|v (3,072 x 2,048) and o (2,048 x 2,048), 2 for gate|up (16,384 x
# 2,048), 16 for down (2,048 x 8,192) and none for the 128,256-row output: what this rule picks.
SKINNY_M = 32
SKINNY_TILE = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
SPLITK_PROGRAMS_PER_SM = 3.5
SPLITK_MIN_ITERS = 4
# A rows step (batched decode) of up to this many rows runs the decode GEMV (with its fusions),
# larger ones the skinny GEMM. Whole steps on the H100 (2026-11-26, Llama-3.2-1B shape Q4_0,
# `bench_rows.py --set ROWS_GEMV_MAX_TOKENS=...`): 4 rows 1.21 ms with the GEMV, 1.52 ms with the
# GEMM (although the products alone were faster with the GEMM: 44 against 66 us a layer); 8 rows
# 1.98 ms with the GEMV, 1.50 ms with the GEMM.
ROWS_GEMV_MAX_TOKENS = 4


def gemm_default(M: int, N: int = 0, sms: int = 0, K: int = 0, fmt: str = "") -> dict:
    """Per token count: dequantizing a weight tile costs the same whatever BLOCK_M, so larger
    token tiles amortise it (compile_check: ~5 instructions per weight per K-step). With the
    output width N, K and the device's SM count, skinny products (M <= SKINNY_M) take the
    skinny tile and split K (see above). fmt: the weight's packed format; from 128 tokens F16
    keeps 128 x 64; a quantized wide product (256 tokens or more, two programs per SM at 256 x 64)
    takes 256 x 64 for Q8_0 and the 128 x 128 weight-B tile for the 4- and 6-bit layouts, a long
    reduction (K >= 2 N) the weight-B tile with K split, the others 128 x 64 (see above)."""
    if M >= 128:
        huge = GEMM_DEFAULT_HUGE_M
        if fmt == "F16":
            return dict(GEMM_DEFAULT_LARGE_M)
        wide = M >= huge["BLOCK_M"] and (not sms or
                                         -(-M // huge["BLOCK_M"]) * -(-N // huge["BLOCK_N"]) >= GEMM_HUGE_M_WAVES * sms)
        if wide:
            return dict(huge if fmt == "Q8_0" else GEMM_WIDE_WEIGHT_B)
        if K >= 2 * N and N:  # a long reduction over few tiles: split K (see GEMM_SPLIT_PER_SM)
            cfg = dict(GEMM_WIDE_WEIGHT_B)
            split = _split_k(M, N, K, sms, cfg, GEMM_SPLIT_PER_SM)
            if split > 1:
                cfg["SPLIT_K"] = split
            return cfg
        return dict(GEMM_DEFAULT_LARGE_M)
    cfg = dict(GEMM_DEFAULT, BLOCK_M=max(16, min(64, 1 << (M - 1).bit_length())))
    if M <= SKINNY_M and N and sms:
        cfg.update(SKINNY_TILE)
        split = _split_k(M, N, K, sms, cfg)
        if split > 1:
            cfg["SPLIT_K"] = split
    return cfg


def _split_k(M: int, N: int, K: int, sms: int, cfg: dict, per_sm: float = SPLITK_PROGRAMS_PER_SM) -> int:
    """The fewest power-of-two K ranges giving the grid SPLITK_PROGRAMS_PER_SM programs per SM,
    keeping at least SPLITK_MIN_ITERS K-tiles a range (see above)."""
    programs = -(-M // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])
    k_iters = -(-K // cfg["BLOCK_K"]) if K else 0
    split = 1
    while programs * split < per_sm * sms and k_iters // (2 * split) >= SPLITK_MIN_ITERS:
        split *= 2
    return split


# The tiles the tuner times for a skinny product (rows programs: one per row bucket that takes the
# GEMM kernel, per weight format and shape), each with the split count of the rule above and its
# neighbours (half, double): (BLOCK_N, BLOCK_K, num_warps). The first is SKINNY_TILE. Wider tiles
# put more weight bytes in flight per pipeline stage: on the 1B shapes at 16 rows 128 x 128 took
# gate|up from 21.2 to 17.4 us (2026-11-26, bench_rows.py --gemm-sweep). Every one of them is
# checked for wrong or unwritten tiles by `benchmarks/gemm_stress.py --skinny` on the GPU and by
# tests/test_cuda_rows.py in the interpreter. 64 x 256 reads a whole K-quant super-block's scale
# codes (16 bytes a row) a K-step instead of a third of a sector: on an H200 at 16 rows
# (skinny_probe.py --configs, 2026-11-28) 8B Q4_K down 34.8 us against 42.3 for 128 x 128, q|k|v
# 19.4 against 24.6, gate|up 65.1 against 66.9; Q6_K slower (68.7 against 59.6 on down), which
# the tuner's timing leaves to the other tiles.
SKINNY_TUNE_TILES = ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 4), (32, 128, 4), (64, 256, 4))


def skinny_candidates(M: int, N: int, K: int, sms: int) -> list[dict]:
    """The skinny-GEMM configurations the tuner times for an M-row product of an N x K weight
    (M <= SKINNY_M): SKINNY_TUNE_TILES, each with split counts near the rule's (at least two
    K-tiles a range)."""
    bm = max(16, min(32, 1 << (M - 1).bit_length()))
    out = []
    for bn, bk, warps in SKINNY_TUNE_TILES:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=3)
        base = _split_k(M, N, K, sms, cfg)
        k_iters = -(-K // bk)
        for split in sorted({max(1, base // 2), base, base * 2}):
            if split == 1:
                out.append(dict(cfg))
            elif k_iters // split >= 2:
                out.append(dict(cfg, SPLIT_K=split))
    return out


def gemm_candidates(fmt: str) -> list[dict]:
    out = []
    for bm in (16, 32, 64, 128):
        for bk in (32, 64, 128):
            for w, s in ((4, 3), (4, 4)):  # see GEMM_DEFAULT: 8 warps and 128-row tiles failed on the H100
                if bm * bk <= 128 * 128:
                    out.append(dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=bk, num_warps=w, num_stages=s))
    return out


QUANT_ACT_DEFAULT = dict(BLOCKS=16, num_warps=4)

RMS_NORM_DEFAULT = dict(num_warps=None)  # None: from the row length

ROPE_DEFAULT = dict(num_warps=1)

# Flash-decoding: key rows per inner tile, query rows (tokens x group heads) per program, warps.
# n_splits None: about two programs per SM, fixed for a given device and model (CUDA-graph safe).
# Context buckets of the decode step: up to this many cached keys attention runs as one program
# per KV head (no combine kernel); each further such run of keys adds a split. The decode CUDA
# graph is captured once per bucket (split count).
ATTN_DECODE_KEYS_PER_SPLIT = 512
# A rows step's attention (batched decode, one program per row, kv head and split; the splits
# combined in the kernel): keys per split and the programs per SM the splits may fill
# (kernels/attention.py rows_splits). 8B Q4_K_M, 16 rows at 250-500 cached keys each on an H200
# (bench_rows.py --profile 16, 2026-11-29): attention 493 us a step with 128 and 4 (4 splits)
# against 567 us with 512 and 2 (none).
ROWS_ATTN_KEYS_PER_SPLIT = 128
ROWS_ATTN_PROGRAMS_PER_SM = 4.0
ATTN_DECODE_DEFAULT = dict(BLOCK_N=64, num_warps=4, num_stages=2, n_splits=None)
ATTN_DECODE_CANDIDATES = [dict(BLOCK_N=bn, num_warps=w, num_stages=s, n_splits=ns)
                          for bn in (32, 64, 128) for w in (2, 4, 8) for s in (1, 2, 3) for ns in (None, 16, 32, 64)]

ATTN_PREFILL_DEFAULT = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
# Decode attention over up to ATTN_DECODE_KEYS_PER_SPLIT keys runs as one prefill-kernel program
# per KV head (BLOCK_M from the query rows): key tiles of this length. It is latency-bound (a
# handful of programs walk the context one tile after another). Measured on an H100 (2026-11-22,
# whole decode steps at 128-192 cached tokens, `profile_decode.py --variants`): 128-key tiles
# saved 17-25 us per token on Llama-3.2-1B shapes (8 KV heads) and 66 us on Llama-3.1-8B, and cost
# 23 us on SmolLM2-135M (3 KV heads), where 64 stays.
ATTN_DECODE_SINGLE_BLOCK_N = 128
ATTN_DECODE_SINGLE_BLOCK_N_FEW_HEADS = 64  # fewer than 8 KV heads

ATTN_PREFILL_CANDIDATES = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                           for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]


def attn_decode_single_block_n(n_kv_heads: int) -> int:
    return ATTN_DECODE_SINGLE_BLOCK_N if n_kv_heads >= 8 else ATTN_DECODE_SINGLE_BLOCK_N_FEW_HEADS

ELEMENTWISE_DEFAULT = dict(BLOCK=1024, num_warps=4)
EMBEDDING_DEFAULT = dict(BLOCK_D=1024, num_warps=4)
ARGMAX_DEFAULT = dict(BLOCK=4096, num_warps=8)
