"""benchmarks/bench_serve.py's steady-state decode rate (the counterpart of llama-batched-bench's
S_TG), on stand-in streams whose arrival times follow known rates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_serve.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stream(start: float, rate: float, tokens: int, per_chunk: int = 1) -> dict:
    """A stream's first token at `start`, then one chunk every per_chunk / rate seconds."""
    chunks = tokens // per_chunk
    return {"ok": True, "tokens": tokens, "arrivals": [start + k * per_chunk / rate for k in range(chunks)]}


def test_steady_rate_is_the_sum_of_the_streams_rates_in_their_common_window(bench, rng):
    rates = rng.uniform(50, 400, 6)
    starts = rng.uniform(0, 0.2, 6)
    streams = [_stream(s, r, 512, per_chunk=1 + i % 3) for i, (s, r) in enumerate(zip(starts, rates))]
    got = bench.steady_decode(streams)
    lo = max(s["arrivals"][0] for s in streams)
    hi = min(s["arrivals"][-1] for s in streams)
    assert got["steady_window_s"] == pytest.approx(hi - lo)
    # each stream delivers rate * window tokens in the window, to within one chunk at either end
    slack = sum((1 + i % 3) for i in range(6)) / (hi - lo)
    assert abs(got["steady_tps"] - rates.sum()) <= slack


def test_no_steady_rate_when_the_streams_never_decode_together(bench):
    a = _stream(0.0, 100, 10)  # 0.0 .. 0.09 s
    b = _stream(0.5, 100, 10)  # starts after a ended
    assert bench.steady_decode([a, b])["steady_tps"] is None
    assert bench.steady_decode([])["steady_tps"] is None
    one = bench.steady_decode([_stream(0.0, 200, 64)])
    assert one["steady_tps"] == pytest.approx(200, rel=np.float64(2 / 64))
