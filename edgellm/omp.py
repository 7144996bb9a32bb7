"""The OpenMP runtime's idle threads, for a model split between the CPU and a GPU.

A split model's token runs CPU layers, then a few milliseconds of GPU layers, then CPU layers again
(edgellm/hetero/executor.py). Between them the CPU's thread pool (torch's and the native kernels'
one OpenMP pool) idles, and GNU libgomp puts an idle thread to sleep after GOMP_SPINCOUNT spins
(default 300,000, a few milliseconds); waking a sleeping pool at every CPU segment cost the split
7-15% of its decode speed on the H100 host (2026-11-27, docs/benchmarks.md). Spinning longer there
pays; everywhere else (a CPU-only model, the test suite's concurrent processes) longer spinning
only takes cores from other work. So it is set for split runs only (`edgellm run --gpu-memory`,
benchmarks/bench_hetero_gpu.py), and only where the user has not chosen a value. libgomp reads
the variable once, when it loads (with torch): this must run before torch is imported.
"""

from __future__ import annotations

import os
import sys

SPLIT_SPINCOUNT = "2000000"


def keep_pool_awake(spins: str = SPLIT_SPINCOUNT) -> bool:
    """Set GOMP_SPINCOUNT (unless the user set it) for this process. True when it takes effect:
    torch (and with it the OpenMP runtime) not loaded yet and no value of the user's."""
    if "torch" in sys.modules or "GOMP_SPINCOUNT" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = spins
    return True
