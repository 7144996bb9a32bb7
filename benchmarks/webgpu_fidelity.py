"""How closely the webgpu backend's decode kernels follow the cpu backend on the default model:
greedy continuations of six chat prompts and top-1 agreement over 512 teacher-forced positions
of README text, the positions run in chunks of GEMV_MAX_ROWS tokens so that the decode GEMVs
(not the prefill's tiled products) compute every one of them (--chunk 512: the prefill's products).

    EDGELLM_WEBGPU_GEMV=warp:2:64:1:stage:int8x2 python benchmarks/webgpu_fidelity.py [--tokens 64]

Any EDGELLM_WEBGPU_* setting applies (a software adapter takes the GPU's kernels only when
EDGELLM_WEBGPU_GEMV names them). The issue's bar: identical greedy text, or >= 99% top-1 where
float rounding legitimately diverges.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--positions", type=int, default=512, help="teacher-forced positions")
    ap.add_argument("--backend", default="webgpu", help="the backend compared with cpu (e.g. cpu-fast)")
    ap.add_argument("--chunk", type=int, default=0, help="webgpu prefill chunk (default GEMV_MAX_ROWS: the decode "
                    "GEMVs compute every position; e.g. 512 for the prefill's tiled products)")
    args = ap.parse_args()

    import edgellm
    from bench_webgpu import CHAT_PROMPTS
    from edgellm.backends.webgpu.backend import GEMV_MAX_ROWS
    from edgellm.sampling import SamplingParams
    from gpu_check import FIDELITY_PROMPTS

    ctx = args.positions + args.tokens + 64
    cpu = edgellm.load(backend="cpu", ctx=ctx, prefill_chunk=GEMV_MAX_ROWS)
    gpu = edgellm.load(backend=args.backend, ctx=ctx, prefill_chunk=args.chunk or GEMV_MAX_ROWS)
    env = {k: v for k, v in os.environ.items() if k.startswith("EDGELLM_WEBGPU")}
    print(f"{args.backend}: {gpu.backend.describe()}; prefill chunk {args.chunk or GEMV_MAX_ROWS}; {env}", flush=True)
    same = 0
    prompts = list(dict.fromkeys([*CHAT_PROMPTS, *FIDELITY_PROMPTS]))
    greedy = SamplingParams(temperature=0)
    for prompt in prompts:
        ids = cpu.prompt_tokens(prompt)
        a = list(cpu.generate_tokens(ids, args.tokens, greedy))
        b = list(gpu.generate_tokens(ids, args.tokens, greedy))
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        same += a == b
        print(json.dumps({"prompt": prompt, "identical": a == b, "first_divergence": diff,
                          "cpu": cpu.tokenizer.decode(a), args.backend: gpu.tokenizer.decode(b)}), flush=True)
    text = open(os.path.join(ROOT, "README.md")).read() * 3
    ids = cpu.tokenizer.encode(text)[:args.positions]
    la, lb = cpu.logits(ids), gpu.logits(ids)
    top1 = float((la.argmax(-1) == lb.argmax(-1)).mean())
    err = float(np.abs(la - lb).max() / np.abs(la).max())
    print(f"greedy: {same} of {len(prompts)} prompts identical over {args.tokens} tokens; teacher-forced: top-1 "
          f"agreement {100 * top1:.2f}% over {len(ids)} positions, largest logit error {100 * err:.2f}% of the largest logit")


if __name__ == "__main__":
    main()
