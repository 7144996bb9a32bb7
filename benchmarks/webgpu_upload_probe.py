"""Where a webgpu load's buffer time goes: every Device.upload (weights) and Device.buffer call of
one edgellm.load timed, in a fresh engine cache, with the load's phases.

    python benchmarks/webgpu_upload_probe.py FILE.gguf          # tuning as configured
    EDGELLM_TUNE=0 python benchmarks/webgpu_upload_probe.py FILE.gguf

Prints the load phases, the calls' count, bytes and seconds per kind, and the slowest twelve of
each with their start (seconds into the load).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ["EDGELLM_CACHE_DIR"] = tempfile.mkdtemp()

import edgellm  # noqa: E402
from edgellm.backends.webgpu import device as D  # noqa: E402

LOG: list[tuple[str, int, float, float]] = []  # (kind, bytes, seconds, start)
_upload, _buffer = D.Device.upload, D.Device.buffer


def _timed(kind, fn):
    def call(self, *a, **kw):
        t = time.perf_counter()
        b = fn(self, *a, **kw)
        LOG.append((kind, b.size, time.perf_counter() - t, t))
        return b
    return call


def main() -> None:
    D.Device.upload, D.Device.buffer = _timed("upload", _upload), _timed("buffer", _buffer)
    t0 = time.perf_counter()
    m = edgellm.load(sys.argv[1], backend="webgpu")
    print("load", round(time.perf_counter() - t0, 2), {k: round(v, 2) for k, v in m.load_phases.items()})
    for kind in ("upload", "buffer"):
        xs = [r for r in LOG if r[0] == kind]
        print(kind, len(xs), "calls", round(sum(r[1] for r in xs) / 1e6), "MB", round(sum(r[2] for r in xs), 2), "s")
        for r in sorted(xs, key=lambda r: -r[2])[:12]:
            print("   ", kind, round(r[1] / 1e6, 1), "MB", round(r[2] * 1e3, 1), "ms at", round(r[3] - t0, 2))


if __name__ == "__main__":
    main()
