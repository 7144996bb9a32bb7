"""Stress check of the cuda prefill GEMM on wide outputs (vocabulary projections): each tile
configuration run repeatedly on Q8_0 and Q4_0 weights of 131,072 x 640 at M = 384 and 512, every
output element compared with a float32 product of the dequantized weights.

    python benchmarks/gemm_stress.py

2026-11-24, H100 (triton 3.6.0): intermittent wrong or unwritten tiles. Failures of 16 runs per
format: default (128x128x64, 8 warps, 3 stages) Q8_0 12; 2 stages Q4_0 4; 4 warps 0; 64x128x64 with
4 warps Q4_0 16; 128x64x64 0. The default model's 49,152-row output never showed it; Gemma 3's
262,144-row output in a 512-token prefill did (NaN logits at rows 384-511, benchmarks/nan_probe.py).
"""
import sys

import numpy as np
import torch

sys.path.insert(0, ".")
from edgellm.backends.cuda import kernels as K  # noqa: E402
from edgellm.backends.cuda.kernels.packing import repack  # noqa: E402
from edgellm.quant import dequantize  # noqa: E402
from edgellm.synthetic import random_blocks  # noqa: E402

rng = np.random.default_rng(0)
cases = []
for fmt in ("Q8_0", "Q4_0"):
    N = 131072
    raw = random_blocks(fmt, (N, 640), rng, 0.02)
    w = repack(raw, fmt, (N, 640), device="cuda")
    wf = torch.from_numpy(np.asarray(dequantize(raw, fmt, (N, 640)), dtype=np.float32)).cuda()
    x = torch.randn(512, 640, device="cuda").half()
    cases.append((fmt, w, x, (x.float() @ wf.T)))
    del wf
for name, cfg in [("default", None), ("stages2", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=2)),
                  ("w4", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)),
                  ("bm64w4", dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)),
                  ("bn64", dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3))]:
    fails = {}
    for fmt, w, x, ref in cases:
        for M in (384, 512):
            for _ in range(8):
                out = torch.full((M, w.out_features), float("nan"), device="cuda")
                K.linear(x[:M], w, out=out, config=cfg)
                torch.cuda.synchronize()
                if (~torch.isclose(out, ref[:M], rtol=1e-2, atol=1e-2)).any():
                    fails[fmt] = fails.get(fmt, 0) + 1
    print(name, "failures of 16 per format:", fails, flush=True)
