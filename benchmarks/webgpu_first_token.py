"""Where a webgpu process's first token goes: one load (the engine cache as it is), then three
generations of a 37-token prompt (one token, again, then eight), each timed, with the compute
pipelines the device makes during each counted and timed (Device.pipeline wrapped).

    python benchmarks/webgpu_first_token.py MODEL.gguf

A pipeline made at a step's first use is a cost of the first generation only: the second shows
what is left (on the H200 through Vulkan, 2026-12-01, a 1B Q4_0 file: 26 pipelines, 116-296 ms
of a first generation's 190-411 ms; the second 23 ms)."""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    a = ap.parse_args()

    import edgellm
    from edgellm.backends.webgpu import device as D

    made: list[float] = []
    orig = D.Device.pipeline

    def pipeline(self, source, layout):
        if source in self._pipelines:
            return self._pipelines[source]
        t = time.perf_counter()
        p = orig(self, source, layout)
        made.append(time.perf_counter() - t)
        return p

    D.Device.pipeline = pipeline
    t = time.perf_counter()
    m = edgellm.load(a.model, backend="webgpu")
    print(f"load {time.perf_counter() - t:.2f} s ({', '.join(m.cache_hits) or 'nothing cached'}); "
          f"pipelines made by the load: {len(made)} ({sum(made):.3f} s)")
    ids = [1 + (i * 7919) % (m.config.vocab_size - 2) for i in range(37)]
    for rep, n in enumerate((2, 2, 9)):
        n0 = len(made)
        t = time.perf_counter()
        out = list(m.generate_tokens(ids, n))
        dt = time.perf_counter() - t
        new = made[n0:]
        slow = ", ".join(f"{1e3 * d:.1f}" for d in sorted(new, reverse=True)[:5])
        print(f"generation {rep + 1} ({len(out)} tokens): {1e3 * dt:.1f} ms; pipelines made: {len(new)} "
              f"({1e3 * sum(new):.1f} ms{'; slowest ' + slow + ' ms' if new else ''})")


if __name__ == "__main__":
    main()
