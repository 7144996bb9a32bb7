"""Stress check of the cuda prefill GEMM on wide outputs (vocabulary projections): each tile
configuration run repeatedly on Q8_0 and Q4_0 weights of 131,072 x 640 at M = 384 and 512, every
output element compared with a float32 product of the dequantized weights.

    python benchmarks/gemm_stress.py   (each configuration: Q8_0, Q4_0, Q4_1, F16 weights of
    131,072 and 16,384 rows x 640, and Q6_K (as Q6) of 768 columns, M = 64, 384, 512, six runs each)

2026-11-24, H100 (triton 3.6.0): intermittent wrong or unwritten tiles. Failures of 16 runs per
format: default (128x128x64, 8 warps, 3 stages) Q8_0 12; 2 stages Q4_0 4; 4 warps 0; 64x128x64 with
4 warps Q4_0 16; 128x64x64 0. The default model's 49,152-row output never showed it; Gemma 3's
262,144-row output in a 512-token prefill did (NaN logits at rows 384-511, benchmarks/nan_probe.py).
2026-11-27, H100: every tile 128 weight rows wide failed (128x128 with 4 warps, the large-M default
then, on all Q4_0 runs), every 64-row tile passed. With DISABLE_MMA_V3=1 (Triton's mma.sync instead
of Hopper's wgmma) every tile passed: the fault is in the wgmma path. Defaults since: configs.py.
For each failing (configuration, format, N, M) the first failing run's detail is printed at the
end: wrong and unwritten elements, the largest error, and which (token, row) tiles hold them. A
tile a format cannot hold (shared memory) is skipped and said so.

    python benchmarks/gemm_stress.py --skinny   (split-K: the GEMM at M = 4, 16, 32 rows on
    Q4_0, Q8_0, F16, Q4_K (as Q4_1), Q6_K (as Q6) and a Q4_K + Q6_K stack (as Q6M) weights of 2048 x 8192
    and 3072 x 2048, the skinny default configuration with split counts 1-16 and every configuration
    the tuner may pick (configs.skinny_candidates), ten runs each, and the tile counters left zero
    after each; --only Q6_K,Q4_K+Q6_K checks some of the formats; --weight-b every tile with the
    weight as the MMA's right operand, configs WEIGHT_B)
"""
import sys

import numpy as np
import torch
import triton

sys.path.insert(0, ".")
from edgellm.backends.cuda import kernels as K  # noqa: E402
from edgellm.backends.cuda.kernels import configs  # noqa: E402
from edgellm.backends.cuda.kernels.packing import repack  # noqa: E402
from edgellm.quant import dequantize  # noqa: E402
from edgellm.synthetic import random_blocks  # noqa: E402

rng = np.random.default_rng(0)
CONFIGS = [("default", None)] + [
    (f"{bm}x{bn}x{bk} w{w} s{st}", dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st))
    for bm, bn, bk, w, st in [(128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 64, 64, 8, 3), (128, 64, 64, 4, 3),
                              (64, 128, 64, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 2), (32, 64, 64, 4, 3),
                              (16, 64, 64, 4, 3), (16, 32, 64, 2, 3), (32, 32, 64, 2, 3),
                              (128, 64, 128, 4, 3), (256, 64, 64, 4, 3), (256, 64, 64, 8, 3), (256, 64, 128, 8, 3)]] + [
    (f"{bm}x{bn}x{bk} w{w} s{st} weight-B", dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st,
                                                  WEIGHT_B=True))
    for bm, bn, bk, w, st in [(128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 256, 64, 8, 3),
                              (256, 128, 64, 8, 3), (128, 64, 64, 4, 3)]]


def skinny() -> int:
    import importlib

    linear_mod = importlib.import_module("edgellm.backends.cuda.kernels.linear")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bad = 0
    print("format, N x K, M, config | failed runs of 10")
    fmts = ("Q4_0", "Q8_0", "F16", "Q4_K", "Q6_K", "Q4_K+Q6_K")
    if "--only" in sys.argv:  # --only FMT,FMT: some of them
        fmts = tuple(sys.argv[sys.argv.index("--only") + 1].split(","))
    for fmt in fmts:
        for N, Kd in ((2048, 8192), (3072, 2048)):
            parts, wfs = [], []
            for f in fmt.split("+"):  # a stack of two formats: one layout holding both (Q6M)
                n = N // len(fmt.split("+"))
                raw = random_blocks(f, (n, Kd), rng, 0.02) if f != "F16" else \
                    (0.02 * rng.standard_normal((n, Kd))).astype(np.float16).view(np.uint8)
                parts.append(repack(raw, f, (n, Kd), device="cuda"))
                wfs.append(torch.from_numpy(np.asarray(dequantize(raw, f, (n, Kd)), dtype=np.float32)).cuda())
            parts = K.unify_formats(parts)
            w = parts[0] if len(parts) == 1 else K.concat_packed(parts)
            wf = torch.cat(wfs)
            for M in (4, 16, 32):
                x = torch.randn(M, Kd, device="cuda").half()
                ref = x.float() @ wf.T
                default = configs.gemm_default(M, N, sms, Kd)
                # every configuration the tuner may pick for this product, and every split count
                # of the default tile
                cfgs = [("default", default)] + [
                    (f"{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} split {c.get('SPLIT_K', 1)}", c)
                    for c in configs.skinny_candidates(M, N, Kd, sms)
                    + [dict(default, SPLIT_K=sk) for sk in (1, 2, 4, 8, 16)]]
                if "--weight-b" in sys.argv:  # the same tiles with the weight as the MMA's right operand
                    cfgs = [(n + " weight-B", dict(c, WEIGHT_B=True)) for n, c in cfgs]
                for name, cfg in cfgs:
                    fails = 0
                    for _ in range(10):
                        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
                        K.linear(x, w, out=out, config=cfg, decode_max_tokens=0)
                        torch.cuda.synchronize()
                        fails += int((~torch.isclose(out.float(), ref, rtol=1e-2, atol=2e-2)).any())
                    _, cnt = linear_mod._splitk_workspace(x.device, M * N)
                    dirty = bool(cnt.any())
                    bad += fails + dirty
                    if fails or dirty or name == "default":
                        print(f"{fmt} ({w.fmt}), {N} x {Kd}, M={M}, {name} {cfg.get('SPLIT_K', 1)} | {fails}"
                              f"{' COUNTERS DIRTY' if dirty else ''}", flush=True)
            del wf
    print("skinny split-K:", "all runs correct" if not bad else f"{bad} failures")
    return 1 if bad else 0


if "--skinny" in sys.argv:
    sys.exit(skinny())

cases = []
# Q6_K (the Q6 layout) needs rows of whole 256-blocks: 768 columns
for fmt, cols in (("Q8_0", 640), ("Q4_0", 640), ("Q4_1", 640), ("F16", 640), ("Q6_K", 768)):
    for N in (131072, 16384):
        raw = random_blocks(fmt, (N, cols), rng, 0.02) if fmt != "F16" else \
            (0.02 * rng.standard_normal((N, cols))).astype(np.float16).view(np.uint8)
        w = repack(raw, fmt, (N, cols), device="cuda")
        wf = torch.from_numpy(np.asarray(dequantize(raw, fmt, (N, cols)), dtype=np.float32)).cuda()
        x = torch.randn(512, cols, device="cuda").half()
        cases.append((fmt, N, w, x, x.float() @ wf.T))
        del wf
print("config | failed runs of", len(cases) * 3 * 6, "| which (format, N, M)")
details = []
for name, cfg in CONFIGS:
    fails = {}
    skipped = set()
    for fmt, N, w, x, ref in cases:
        for M in ((16, 32) if cfg and cfg["BLOCK_N"] == 32 else (64, 384, 512)):
            for _ in range(6):
                out = torch.full((M, N), float("nan"), device="cuda")
                try:
                    K.linear(x[:M], w, out=out, config=cfg)
                except triton.runtime.errors.OutOfResources as e:  # a tile this format cannot hold
                    skipped.add(f"{fmt}: {e}")
                    break
                torch.cuda.synchronize()
                bad = ~torch.isclose(out, ref[:M], rtol=1e-2, atol=1e-2)
                if bad.any():
                    if (fmt, N, M) not in fails:  # what the first failing run got wrong
                        c = cfg or configs.gemm_default(M, N, torch.cuda.get_device_properties(0).multi_processor_count,
                                                         x.shape[1], w.fmt)
                        bm, bn = c["BLOCK_M"], c["BLOCK_N"]
                        rows, cols = bad.nonzero(as_tuple=True)
                        written = ~torch.isnan(out)
                        err = (out - ref[:M]).abs()[bad & written]
                        tiles = {(r // bm, col // bn) for r, col in zip(rows[:4096].tolist(), cols[:4096].tolist())}
                        details.append(f"{name} {fmt} N={N} M={M}: {int(bad.sum())} of {bad.numel()} wrong, "
                                       f"{int((~written).sum())} unwritten, max error {float(err.max()) if err.numel() else 0:.3g}"
                                       f" (|ref| max {float(ref[:M].abs().max()):.3g}), first tiles (token, row) "
                                       f"{sorted(tiles)[:6]} of {len(tiles)}")
                    fails[(fmt, N, M)] = fails.get((fmt, N, M), 0) + 1
                del out
    print(name, "|", sum(fails.values()), "|", fails, *(f"(skipped {s})" for s in sorted(skipped)), flush=True)
for line in details:
    print("  " + line)
