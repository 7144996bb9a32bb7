"""benchmarks/bench_serve.py's steady-state decode rate (the counterpart of llama-batched-bench's
S_TG), on stand-in streams whose arrival times follow known rates; benchmarks/serve_table.py's
ratios and target checks on stand-in runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_serve.py"


def _load(path: Path):
    """A script of benchmarks/ as a module (they are not a package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load(BENCH)


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


TABLE = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_table.py"


@pytest.fixture(scope="module")
def serve_table():
    return _load(TABLE)


def _run(rng, own: float, one: float, steady16: float, llama16: float, failed: int = 0) -> dict:
    """A bench_serve.py --json result with the given rates (other fields drawn at random)."""
    rows = [{"clients": n, "requests": n, "ok": n - (failed if n == 16 else 0), "errors": [],
             "decode_tps": float(x), "steady_tps": float(s), "aggregate_tps": float(rng.uniform(1, 9))}
            for n, x, s in ((1, one, one), (16, steady16 * 0.9, steady16), (32, steady16 * 1.6, steady16 * 1.7))]
    llama = {str(n): {"pl": n, "speed_tg": float(v), "speed": float(v) * 1.3}
             for n, v in ((1, own * 0.7), (16, llama16), (32, llama16 * 1.6))}
    return {"tokens": 512, "rows": rows, "single": {"decode_tps": float(own)}, "llama_batched_bench": llama}


def test_serve_table_ratios_and_targets(serve_table, rng):
    own = float(rng.uniform(300, 2000))
    met = serve_table.summarise(_run(rng, own, own * 0.95, own * 6.5, own * 6.5 / 1.6))
    assert met["one_vs_own"] == pytest.approx(0.95) and met["vs_own_16"] == pytest.approx(6.5)
    assert met["vs_llama_16"] == pytest.approx(1.6) and met["vs_llama_32"] == pytest.approx(1.7)
    assert all(serve_table.targets_met(met).values())
    short = serve_table.summarise(_run(rng, own, own * 0.85, own * 5.9, own * 5.9 / 1.4))
    assert serve_table.targets_met(short) == {"16 streams >= 6x one": False, "16 streams >= 1.5x llama.cpp": False,
                                              "one stream within 10%": False}
    failed = serve_table.summarise(_run(rng, own, own, own * 7, own, failed=1))
    assert not failed["ok"] and "requests failed" in serve_table.table([("f", failed)])
    no_llama = _run(rng, own, own, own * 7, own)
    del no_llama["llama_batched_bench"]
    s = serve_table.summarise(no_llama)
    assert s["vs_llama_16"] is None and serve_table.targets_met(s)["16 streams >= 1.5x llama.cpp"] is None
    assert "unmeasured" in serve_table.table([("f", s)])


def test_serve_table_reads_files_and_refuses_others(serve_table, rng, tmp_path, capsys):
    import json
    good = tmp_path / "serve_8b_Q4_0.json"
    good.write_text(json.dumps(_run(rng, 480.0, 490.0, 3400.0, 2100.0)))
    md = tmp_path / "t.md"
    assert serve_table.main([str(good), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "| 8b_Q4_0 | 490.0 / 480.0 (1.02×) | 3,400.0 | 7.08× | 2,100.0 | 1.62× |" in out
    assert md.read_text().strip() == out.strip()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="bad.json: not a bench_serve JSON file"):
        serve_table.main([str(bad)])
    other = tmp_path / "other.json"
    other.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="other.json: not a bench_serve JSON file"):
        serve_table.main([str(other)])
