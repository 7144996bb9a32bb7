"""`edgellm bench`: metric formulas against hand-computed values, the sweep end to end on the
default model, failures recorded without stopping the sweep, bad input rejected up front."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from edgellm.bench import metrics
from edgellm.bench.cli import main as bench_main
from edgellm.errors import EdgeLLMError

STUBS = "edgellm.bench.stubs"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Bandwidth and quantization caches in the test's own directory (children inherit the env)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


# -- statistics -------------------------------------------------------------------------------------
def test_summarize_median_spread_and_flag():
    s = metrics.summarize([10.0, 12.0, 11.0, 30.0])
    assert s.n == 4 and s.median == 11.5 and s.min == 10.0 and s.max == 30.0
    assert s.mean == pytest.approx(15.75)
    assert s.stddev == pytest.approx(math.sqrt(((10 - 15.75) ** 2 + (12 - 15.75) ** 2 + (11 - 15.75) ** 2
                                                + (30 - 15.75) ** 2) / 3))
    assert s.spread == pytest.approx(20.0 / 11.5) and s.flagged
    quiet = metrics.summarize([100.0, 105.0, 101.0])  # (105 - 100) / 101 = 5% <= 10%
    assert quiet.median == 101.0 and quiet.spread == pytest.approx(5 / 101) and not quiet.flagged
    edge = metrics.summarize([100.0, 111.0, 105.0])  # 11/105 = 10.5% > 10%
    assert edge.flagged
    one = metrics.summarize([3.0])
    assert one.stddev == 0.0 and one.spread == 0.0 and not one.flagged
    assert metrics.summarize([]) is None
    assert metrics.summarize([float("nan"), 2.0]).n == 1


# -- FLOPs, bytes, MBU ---------------------------------------------------------------------------------
def test_mbu_formula():
    # 100 MB of weights + 2 MB of KV per token at 10 ms per token on a 20 GB/s device: 10.2 GB/s = 51%
    assert metrics.mbu(100e6, 2e6, 0.010, 20e9) == pytest.approx(0.51)
    assert math.isnan(metrics.mbu(1.0, 0.0, 0.0, 1e9))
    assert metrics.flop_rate(3e9, 1.5) == pytest.approx(2e9)


def _synthetic(tmp_path: Path, **kw) -> tuple[Path, object]:
    from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf

    spec = SyntheticSpec(**kw)
    return write_synthetic_gguf(tmp_path / f"m-{abs(hash(tuple(sorted(kw.items()))))}.gguf", spec), spec


@pytest.mark.parametrize("tied", [True, False])
def test_flops_and_bytes_from_the_graph_match_hand_counts(tmp_path, tied):
    from edgellm.gguf_file import open_gguf
    from edgellm.models import build_graph, config_from_gguf

    L, D, H, G, F, V = 2, 64, 4, 2, 128, 256
    d = D // H
    path, _ = _synthetic(tmp_path, n_layers=L, d_model=D, n_heads=H, n_kv_heads=G, ffn_dim=F, vocab_size=V, tied=tied)
    f = open_gguf(path)
    g = build_graph(config_from_gguf(f), f, "last")
    expr = metrics.graph_flops(g)

    def hand(S, K):  # K: keys attended (kv_len)
        per_layer = (2 * S * D * H * d + 2 * 2 * S * D * G * d + 2 * S * H * d * D  # q, k, v, o projections
                     + 3 * 2 * S * D * F                                           # gate, up, down
                     + 4 * S * K * H * d                                           # attention QK^T and PV
                     + 2 * 4 * S * D                                               # two RMS norms
                     + 4 * S * H * d + 4 * S * G * d                               # rope on q and k
                     + 2 * S * D + 4 * S * F + S * F)                              # residuals, silu, mul
        return L * per_layer + 4 * D + 2 * V * D                                   # final norm + head, last row

    assert metrics.prefill_flops(expr, 16) == hand(16, 16)
    # decode of n = 4 tokens from an empty cache: kv_len 1, 2, 3, 4 -> mean 2.5
    assert metrics.decode_kv_len(4) == 2.5
    assert metrics.decode_flops_per_token(expr, 4) == pytest.approx(sum(hand(1, k) for k in (1, 2, 3, 4)) / 4)

    total = sum(t.nbytes for t in f.tensors.values())
    embd = f.tensors["token_embd.weight"].nbytes
    want = total if tied else total - embd + embd / V  # an untied embedding: one row per token
    assert metrics.weight_bytes_per_token(g, lambda n: f.tensors[n].nbytes) == pytest.approx(want)
    # KV: every layer reads kv_len rows of K and of V, G*d features each, 4-byte elements
    assert metrics.kv_bytes_per_token(g, 2.5, 4) == pytest.approx(L * 2 * G * d * 2.5 * 4)


# -- perplexity ---------------------------------------------------------------------------------------
def test_perplexity_llamacpp_method_on_a_toy_model():
    from edgellm.bench.stubs import ToyEngine

    eng = ToyEngine(vocab=8)
    eng.load("unused", "cpu", 64)
    tokens = [0, 1, 2, 5, 4, 5, 6, 7, 3, 3, 1, 2, 0, 7, 6, 5, 1]  # 17 tokens: 2 chunks of 8, one left over

    def logp(inp, target):  # the toy's row for input token t: 0.25*k, plus 2 at (t+1) % 8
        row = [0.25 * k + (2.0 if k == (inp + 1) % 8 else 0.0) for k in range(8)]
        return row[target] - math.log(sum(math.exp(r) for r in row))

    # n_ctx 8: positions 4, 5, 6 of each chunk predict tokens 5, 6, 7 of the chunk
    pairs = [(4, 5), (5, 6), (6, 7), (0, 7), (7, 6), (6, 5)]
    nll = -sum(logp(i, t) for i, t in pairs) / len(pairs)
    r = eng.perplexity(tokens, 8)
    assert (r.n_chunks, r.n_scored, r.n_ctx, r.n_tokens) == (2, 6, 8, 17)
    assert r.nll == pytest.approx(nll, rel=1e-6)
    assert r.ppl == pytest.approx(math.exp(nll), rel=1e-6)
    one = eng.perplexity(tokens, 8, max_chunks=1)
    assert one.ppl == pytest.approx(math.exp(-sum(logp(i, t) for i, t in pairs[:3]) / 3), rel=1e-6)
    # BOS replaces each chunk's first token before the run, never a scored target
    seen = []
    metrics.perplexity(lambda ids: (seen.append(list(ids)), eng.logits(ids))[1], tokens, 8, bos_id=1)
    assert [s[0] for s in seen] == [1, 1] and seen[0][1:] == tokens[1:8]


def test_perplexity_chunk_size_choice():
    assert metrics.choose_ppl_ctx(5000, None) == 512
    assert metrics.choose_ppl_ctx(300, None) == 144  # 150, rounded down to a multiple of 16
    assert metrics.choose_ppl_ctx(40, None) == 20
    assert metrics.choose_ppl_ctx(64, 32) == 32
    with pytest.raises(EdgeLLMError, match="needs at least 128"):
        metrics.choose_ppl_ctx(100, 64)
    with pytest.raises(EdgeLLMError, match="context length"):
        metrics.choose_ppl_ctx(10000, 1024, model_ctx=512)


# -- the sweep, end to end -----------------------------------------------------------------------------
def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def test_tiny_sweep_on_the_default_model(tmp_path, default_model_path, capsys):
    from edgellm.gguf_file import open_gguf

    text = Path(__file__).resolve().parent.parent / "edgellm" / "data" / "perplexity_text.txt"
    short = tmp_path / "short.txt"
    short.write_text(text.read_text()[:600])
    out = tmp_path / "out"
    rc = bench_main([str(default_model_path), "-p", "16", "-n", "4", "-r", "2", "--backend", "cpu",
                     "--engine", "edgellm", "--ppl", str(short), "--ppl-ctx", "16", "--ppl-chunks", "2",
                     "-o", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0
    for name in ("results.json", "results.csv", "report.md", "prefill_tokens_per_s.png", "decode_tokens_per_s.png",
                 "mbu.png", "perplexity_vs_bpw.png"):
        assert (out / name).is_file(), name
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:8] == PNG
    res = _results(out)
    assert res["environment"]["versions"]["python"] and res["environment"]["versions"]["torch"]
    assert res["plan"]["prompt_lengths"] == [16] and res["plan"]["repetitions"] == 2
    assert res["devices"]["cpu"]["bytes_per_s"] > 0 and res["devices"]["cpu"]["device"]
    (c,) = res["configurations"]
    assert c["status"] == "ok" and c["engine"] == "edgellm" and c["quant"] == "Q4_1"
    assert [r["status"] for r in c["runs"]] == ["ok", "ok"]
    tests = {t["name"]: t for t in c["tests"]}
    pp, tg = tests["pp16"], tests["tg4"]
    assert pp["tokens_per_s"]["n"] == 2 and pp["tokens_per_s"]["median"] > 0 and pp["ttft_s"]["median"] > 0
    assert pp["flop_per_s"]["median"] > 0
    assert tg["tokens_per_s"]["median"] > 0
    # each sample's TPOT is the inverse of its tokens/s (medians of two noisy samples need not be)
    assert tg["tpot_s"]["min"] == pytest.approx(1 / tg["tokens_per_s"]["max"], rel=1e-6)
    assert tg["tpot_s"]["max"] == pytest.approx(1 / tg["tokens_per_s"]["min"], rel=1e-6)
    assert tg["mbu"] > 0  # its bound depends on the copy bandwidth measured on a possibly busy machine
    tensors = open_gguf(default_model_path).tensors.values()  # tied embedding: every weight is read whole
    assert tg["weight_bytes_per_token"] == pytest.approx(sum(t.nbytes for t in tensors))
    assert c["ttlm_s"]["median"] > 0 and c["peak_rss_bytes"] > 0
    ppl = c["perplexity"]
    assert math.isfinite(ppl["ppl"]) and ppl["ppl"] > 1 and ppl["n_ctx"] == 16 and ppl["n_chunks"] == 2
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["test"] for r in rows] == ["pp16", "tg4"] and float(rows[0]["tokens_per_s_median"]) > 0
    report = (out / "report.md").read_text()
    assert "pp16" in report and "tg4" in report and "perplexity_vs_bpw.png" in report
    assert "| edgellm | cpu | pp16 |" in printed
    # the measured bandwidth was cached per device
    cache = json.loads((Path(os.environ["XDG_CACHE_HOME"]) / "edgellm" / "bench" / "peak_bandwidth.json").read_text())
    assert res["devices"]["cpu"]["device"] in cache


def test_failures_are_recorded_and_the_sweep_goes_on(tmp_path, default_model_path):
    out = tmp_path / "out"
    engines = f"{STUBS}:CrashEngine,{STUBS}:SleepEngine,{STUBS}:RaiseEngine,{STUBS}:ToyEngine,llama.cpp"
    t0 = time.perf_counter()
    rc = bench_main([str(default_model_path), "--engine", engines, "--backend", "cpu,cuda", "-p", "8", "-n", "2",
                     "-r", "2", "--timeout", "8", "--no-ppl", "--peak-bw", "10", "-o", str(out), "--no-progress"])
    assert rc == 0
    assert time.perf_counter() - t0 < 120
    by = {(c["engine"], c["backend"]): c for c in _results(out)["configurations"]}
    crash, sleep, raised, toy = by["crash", "cpu"], by["sleep", "cpu"], by["raise", "cpu"], by["toy", "cpu"]
    assert crash["status"] == "crash" and "exited with status 3" in crash["error"] and "load" in crash["error"]
    assert sleep["status"] == "timeout" and "timed out after 8 s" in sleep["error"]
    assert raised["status"] == "error" and "RaiseEngine always fails" in raised["error"]
    # a configuration that failed is not retried in later repetitions; the others go on
    assert [r["status"] for r in crash["runs"]] == ["crash", "skipped"]
    assert toy["status"] == "ok" and [r["status"] for r in toy["runs"]] == ["ok", "ok"]
    assert all(t["tokens_per_s"]["median"] > 0 for t in toy["tests"])
    # a backend an engine lacks, and an engine that is not installed, are reported, not run
    assert by["toy", "cuda"]["status"] == "unavailable" and "cuda" in by["toy", "cuda"]["error"]
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert by["llama.cpp", "cpu"]["status"] == "unavailable"
        assert "llama-cpp-python is not installed" in by["llama.cpp", "cpu"]["error"]
    report = (out / "report.md").read_text()
    assert "**crash**" in report and "**timeout**" in report and "timed out after 8 s" in report


def test_sigterm_keeps_finished_results(tmp_path, default_model_path):
    """A sweep stopped by SIGTERM (a `timeout`, a scheduler) or Ctrl-C still writes its report: the
    finished configurations with their numbers, the rest marked interrupted, no job left running."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "edgellm.bench", str(default_model_path), "--engine",
           f"{STUBS}:ToyEngine,{STUBS}:SleepEngine", "-p", "8", "-n", "2", "-r", "1", "--timeout", "300",
           "--no-ppl", "--peak-bw", "10", "-o", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not any((out / "logs").glob("*sleep*-rep1.log")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)  # the sleep job is running now
    proc.send_signal(signal.SIGTERM)
    printed, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, printed
    by = {c["engine"]: c for c in _results(out)["configurations"]}
    assert by["toy"]["status"] == "ok" and all(t["tokens_per_s"]["median"] > 0 for t in by["toy"]["tests"])
    assert by["sleep"]["status"] == "interrupted"
    assert "**interrupted**" in (out / "report.md").read_text() and "interrupted" in printed


def test_out_of_memory_is_recorded(tmp_path, default_model_path):
    from edgellm.bench.runner import run_job

    out = run_job({"job": "run", "engine": f"{STUBS}:OOMEngine", "backend": "cpu", "model": str(default_model_path),
                   "ctx": 16, "pp": [4], "tg": [2]}, 60, tmp_path)
    assert out.status == "oom" and "MemoryError" in out.error and out.returncode == 1


def test_engine_preload_is_imported_before_edgellm_and_numpy(tmp_path, monkeypatch, default_model_path):
    """An engine's preload modules come first in the child (llama-cpp-python's CUDA build needs its
    libraries loaded before numpy's and torch's); a preload that cannot be imported is no crash."""
    from edgellm.bench.runner import run_job

    (tmp_path / "edgellm_preload_probe.py").write_text(
        "import sys\nLOADED = sorted(m for m in ('edgellm', 'numpy', 'torch') if m in sys.modules)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    job = {"job": "run", "engine": f"{STUBS}:PreloadEngine", "backend": "cpu", "model": str(default_model_path),
           "ctx": 16, "pp": [4], "tg": [2]}
    out = run_job(job, 120, tmp_path / "w")
    assert out.status == "ok", out.log
    assert out.result["info"]["loaded_before_preload"] == []
    out = run_job(dict(job, engine=f"{STUBS}:MissingPreloadEngine"), 120, tmp_path / "w2")
    assert out.status == "error" and "no_such_module_for_edgellm" in out.error, out.log


def test_git_commit_and_dirty_state(tmp_path):
    """results.json records the commit and whether tracked files differed from it."""
    import subprocess

    from edgellm.bench.device import git_commit, git_dirty

    assert git_commit(tmp_path) is None and git_dirty(tmp_path) is None  # not a checkout
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(git + ["init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "a.txt").write_text("one")
    subprocess.run(git + ["add", "a.txt"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "a"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_commit(tmp_path) == head and len(head) == 40
    (tmp_path / "b.txt").write_text("untracked")  # not part of the measured code
    assert git_dirty(tmp_path) is False
    (tmp_path / "a.txt").write_text("two")
    assert git_dirty(tmp_path) is True


def test_quantized_variants_come_from_the_cache(tmp_path):
    from edgellm.bench.quantize import cached_path

    src, _ = _synthetic(tmp_path, vocab_size=64)
    q8, _ = _synthetic(tmp_path, vocab_size=64, weight_type="Q8_0")
    cache = tmp_path / "qcache"
    cache.mkdir()
    shutil.copy(q8, cached_path(src, "Q8_0", cache))  # as if produced by an earlier run
    out = tmp_path / "out"
    rc = bench_main([str(src), "--quant", "source,q8_0", "--quant-cache", str(cache), "--engine", f"{STUBS}:ToyEngine",
                     "-p", "8", "-n", "2", "-r", "1", "--no-ppl", "--peak-bw", "10", "-o", str(out), "--no-progress"])
    assert rc == 0
    confs = _results(out)["configurations"]
    assert [(c["quant"], c["quantized"], c["status"]) for c in confs] == [("F32", False, "ok"), ("Q8_0", True, "ok")]
    assert confs[1]["bits_per_weight"] < confs[0]["bits_per_weight"]


def test_produce_quantized_adapter(tmp_path, monkeypatch):
    from edgellm.bench.quantize import QuantizationUnavailable, produce_quantized
    from edgellm.errors import UnknownTensorTypeError

    src = tmp_path / "src.gguf"
    src.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    calls = []

    def quantize_model(s, d, qtype):
        calls.append(qtype)
        if qtype == "Q6_K":
            raise UnknownTensorTypeError("Q6_K output is not supported")
        Path(d).write_bytes(Path(s).read_bytes() + qtype.encode())

    monkeypatch.setitem(sys.modules, "edgellm.quantize_model",
                        types.SimpleNamespace(quantize_model=quantize_model))
    p1 = produce_quantized(src, "Q8_0", tmp_path / "c")
    p2 = produce_quantized(src, "Q8_0", tmp_path / "c")
    assert p1 == p2 and p1.read_bytes().endswith(b"Q8_0") and calls == ["Q8_0"]
    os.utime(src, ns=(1, 1))  # a changed source gets a new cache entry
    assert produce_quantized(src, "Q8_0", tmp_path / "c") != p1 and calls == ["Q8_0", "Q8_0"]
    with pytest.raises(QuantizationUnavailable, match="Q6_K output is not supported"):
        produce_quantized(src, "Q6_K", tmp_path / "c")
    assert not list((tmp_path / "c").glob("*partial*"))
    with pytest.raises(QuantizationUnavailable, match="takes no policy"):  # this fake has no policy argument
        produce_quantized(src, "Q4_0", tmp_path / "c", policy="llama.cpp")
    monkeypatch.setitem(sys.modules, "edgellm.quantize_model", None)  # the feature is absent
    with pytest.raises(QuantizationUnavailable, match="not available"):
        produce_quantized(src, "Q4_0", tmp_path / "c")


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["-p", "0"], "-p/--n-prompt: values must be positive"),
    (["-n", "16,-4"], "-n/--n-gen: values must be positive"),
    (["-r", "0"], "-r/--repetitions: values must be positive"),
    (["-r", "two"], "-r/--repetitions: 'two' is not a whole number"),
    (["--engine", "edgellm,vllm"], "--engine: unknown engine 'vllm'"),
    (["--engine", "edgellm.bench.metrics:Stats"], "not a subclass"),
    (["--quant", "q4_0,q9_9"], "--quant: unknown quantization format 'q9_9'"),
    (["--backend", "cpu,tpu"], "--backend: unknown backend 'tpu'"),
    (["--ppl", "/nonexistent/text.txt"], "cannot read perplexity text /nonexistent/text.txt"),
    (["--ppl-ctx", "0"], "--ppl-ctx: values must be positive"),
    (["--timeout", "-1"], "--timeout must be a positive number"),
    (["--peak-bw", "fast"], "--peak-bw: 'fast' is not a number"),
    (["--quant", "q4_0", "--quant-policy", "best"], "--quant-policy: unknown policy 'best'"),
    (["/nonexistent/model.gguf"], "model file /nonexistent/model.gguf does not exist"),
])
def test_bad_input_is_one_clear_line(args, message, capsys, tmp_path):
    rc = bench_main(args + ["--no-progress", "-o", str(tmp_path / "never")])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("edgellm: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "never" / "results.json").exists()


def test_unwritable_output_and_unreadable_text(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert bench_main(["-o", str(blocker / "out"), "--no-progress"]) == 1
    assert "output directory" in capsys.readouterr().err
    assert bench_main(["--ppl", str(tmp_path), "--no-progress"]) == 1  # a directory
    assert "cannot read perplexity text" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00 not utf-8 \xff")
    assert bench_main(["--ppl", str(bad), "--no-progress"]) == 1
    assert "is not UTF-8" in capsys.readouterr().err


def test_engine_names_and_plugins():
    from edgellm.bench.engines import ENGINES, engine_class
    from edgellm.bench.stubs import ToyEngine

    assert engine_class("llama-cpp") is ENGINES["llama.cpp"] and engine_class("EdgeLLM") is ENGINES["edgellm"]
    assert engine_class(f"{STUBS}:ToyEngine") is ToyEngine
    ok, _ = engine_class("edgellm").available("cpu")
    assert ok
    ok, reason = engine_class("edgellm").available("nosuch")
    assert not ok and "nosuch" in reason


def test_main_cli_has_bench_when_wired(capsys):
    from edgellm import cli

    if "add_bench_parser" not in open(cli.__file__).read():
        pytest.skip("edgellm.cli does not register `bench` yet")
    assert cli.main(["bench", "-p", "0"]) == 1
    assert capsys.readouterr().err.startswith("edgellm: error: -p/--n-prompt")


# -- against llama.cpp -------------------------------------------------------------------------------
def test_llama_cpp_engine_greedy_path_matches_its_logits(default_model_path):
    """The timed path (llama_decode through the C API, argmax over its logits in place) picks the
    argmax of the logits llama.cpp's high-level API computes for the same tokens, in prefill and decode."""
    pytest.importorskip("llama_cpp")
    from edgellm.bench.engines import LlamaCppEngine

    e = LlamaCppEngine(threads=2)
    e.prepare("cpu")
    e.load(str(default_model_path), "cpu", 64)
    try:
        rng = np.random.default_rng()
        ids = rng.integers(0, e.vocab_size(), 12).tolist()
        for _ in range(2):  # again on a cleared cache
            e.prefill(ids)
            assert e.next_token() == int(np.argmax(e.logits(ids)[-1]))
        e.decode(6)
        seq = [int(e.llm.token_bos())]
        for tok in e.tokens_out:
            assert tok == int(np.argmax(e.logits(seq)[-1])), (seq, e.tokens_out)
            seq.append(tok)
        assert len(e.tokens_out) == 6
    finally:
        e.close()


def test_perplexity_agrees_with_llama_cpp(tmp_path, default_model_path):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "out"
    rc = bench_main([str(default_model_path), "--engine", "edgellm,llama.cpp", "--backend", "cpu", "-p", "8", "-n", "2",
                     "-r", "1", "--ppl-ctx", "128", "--ppl-chunks", "4", "--peak-bw", "10", "-o", str(out),
                     "--no-progress"])
    assert rc == 0
    res = _results(out)
    (a,) = [x for x in res["perplexity_agreement"] if x["engine"] == "edgellm" and x["reference"] == "llama.cpp"]
    assert abs(a["relative_difference"]) < 0.01, a
    assert "Perplexity against the reference engine" in (out / "report.md").read_text()
