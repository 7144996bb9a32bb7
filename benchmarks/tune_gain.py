"""What the load-time GEMV tuner gains: per tuned key (its pick's time against the default tile's,
as the tuner timed them) and over whole decode steps (the device decode loop's tokens/s).

    EDGELLM_CACHE_DIR=$(mktemp -d) python benchmarks/tune_gain.py MODEL.gguf TAG
    EDGELLM_TUNE=0 EDGELLM_CACHE_DIR=$(mktemp -d) python benchmarks/tune_gain.py MODEL.gguf TAG-default

Run it once with tuning on and once with EDGELLM_TUNE=0, each from an empty cache, and compare the
"decode" lines; a third run on the first run's cache measures the tuned tiles again. Prints one
"pick" line per tuned (kernel, key) and a "load ... decode ..." line (the best of three 256-token
loops after 16 to warm up; ctx 1024).
"""

from __future__ import annotations

import argparse
import time

import edgellm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("tag")
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    t0 = time.perf_counter()
    m = edgellm.load(a.model, backend="cuda", ctx=1024)
    load_s = time.perf_counter() - t0
    tuner = getattr(getattr(m, "backend", None), "tuner", None)
    seen = {}
    for p in (tuner.report() if tuner is not None else []):
        k = (p["kernel"], p["key"])
        if k not in seen and p["us"] is not None:
            seen[k] = p
    for (kernel, key), p in seen.items():
        d = p["default_us"]
        gain = f"{d - p['us']:.2f}" if d else "n/a"
        print(f"{a.tag} pick {kernel} {key} {p['source']} us={p['us']:.2f} default={d if d is None else round(d, 2)} "
              f"gain={gain} cfg={p['config']}")
    prog = m.programs["decode"]
    for _ in prog.loop_tokens(1, 0, 16):
        pass
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        n = sum(1 for _ in prog.loop_tokens(1, 0, a.tokens))
        best = min(best, (time.perf_counter() - t) / n)
    print(f"{a.tag} load {load_s:.2f} s decode {1 / best:.1f} tok/s ({best * 1e6:.1f} us/token)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
