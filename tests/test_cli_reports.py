"""What edgellm's reports say: bench's exit status when nothing ran, quantize's size wording, no
wrapping off a terminal, and the bench plots' titles, bar values and re-quantized points."""

from __future__ import annotations

import json
import re

import pytest

from cli_fixtures import child_env, edgellm, hide_modules, tiny_gguf


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("reports")


# -- 5. bench with nothing measured ----------------------------------------------------------------
def test_bench_fails_when_no_configuration_produced_a_result(work, tmp_path):
    """llama.cpp engine on a machine without llama-cpp-python: every configuration is unavailable,
    so the command fails with one line saying why (the results are still written)."""
    model = tiny_gguf(work / "bench.gguf")
    env = child_env(hide_modules(tmp_path / "shim", "llama_cpp"))
    r = edgellm("bench", str(model), "--engine", "llama.cpp", "-p", "8", "-n", "2", "-r", "1", "--no-ppl",
                "--no-progress", "-o", str(tmp_path / "out"), env=env)
    assert r.returncode == 1, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgellm: error: no configuration produced a result"), err
    assert "llama.cpp" in err[0] and "pip install llama-cpp-python" in err[0]
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [c["status"] for c in res["configurations"]] == ["unavailable"]
    assert not list((tmp_path / "out").glob("*.png"))  # no "no data" pictures


# -- 6 and 7. quantize's summary ---------------------------------------------------------------------
def _tensor_bytes(path) -> int:
    """The tensor data bytes of a GGUF file, read by gguf-py (the format's own reader)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


@pytest.mark.parametrize("src_type, dst_type, word", [("Q4_1", "q8_0", "larger"), ("Q8_0", "q4_0", "the size")])
def test_quantize_summary_words_the_size_change_and_does_not_wrap(work, src_type, dst_type, word):
    src = tiny_gguf(work / f"src-{src_type}.gguf", src_type, embed_type=src_type)
    deep = work / ("a-folder-with-a-long-name-" * 4) / "sub"
    deep.mkdir(parents=True, exist_ok=True)
    dst = deep / f"out-{dst_type}.gguf"
    r = edgellm("quantize", str(src), str(dst), "--type", dst_type)
    assert r.returncode == 0, r.stderr
    ratio = _tensor_bytes(dst) / _tensor_bytes(src)
    assert (ratio > 1) == (word == "larger")
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(f"file {dst}: ")  # the path whole on one line, though it is over 100 columns
    assert f"tensors {ratio:.2f}× {word}" in last, last
    assert "smaller" not in r.stdout
    assert f"quantized {src} -> {dst}: policy uniform" in r.stdout


def test_plan_titles_do_not_wrap(work):
    r = edgellm("plan", "--backend", "cpu", str(tiny_gguf(work / "plan.gguf")))
    assert r.returncode == 0, r.stderr
    lines = [ln.strip() for ln in r.stdout.splitlines()]
    for title in ("passes (prefill graph): ops before → after", "kernels per stage", "delegation: subgraphs per stage",
                  "intermediate memory per planner", "weights by stored format", "estimated peak memory of a cpu run"):
        assert title in lines, title


# -- 7. the bench plots -----------------------------------------------------------------------------
def _results() -> dict:
    """A two-quantization result as run_bench assembles it: a Q4_1 file, and Q8_0 made from it."""
    def conf(quant, quantized, bpw, pp, tg, ppl):
        return {"id": f"smol/{quant}/edgellm/cpu", "model": "smol", "quant": quant, "quantized": quantized,
                "requantized_from": "Q4_1" if quantized else None, "bits_per_weight": bpw, "engine": "edgellm",
                "backend": "cpu", "status": "ok", "perplexity": {"ppl": ppl},
                "tests": [{"name": "pp16", "kind": "pp", "tokens_per_s": {"median": pp, "min": pp * 0.9, "max": pp * 1.1}},
                          {"name": "tg8", "kind": "tg", "tokens_per_s": {"median": tg, "min": tg * 0.95, "max": tg},
                           "mbu": 0.25, "mbu_samples": [0.24, 0.26]}]}

    return {"started": "2026-11-24T08:30:00+0000", "devices": {"cpu": {"device": "Test CPU 9000"}},
            "configurations": [conf("Q4_1", False, 5.0, 1234.5, 45.67, 21.5), conf("Q8_0", True, 8.5, 987.6, 38.9, 21.3)]}


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_plots_name_model_device_date_values_and_requantized_points(tmp_path):
    import matplotlib.pyplot as plt

    from edgellm.bench.report import make_figures, write_plots

    res = _results()
    figs = make_figures(res)
    try:
        for key, fig in figs.items():
            title = fig.axes[0].get_title()
            assert "smol" in title and "Test CPU 9000" in title and "2026-11-24" in title, (key, title)
        # each bar carries its median
        assert {"1,234", "988"} <= set(_texts(figs["prefill"].axes[0])), _texts(figs["prefill"].axes[0])
        assert {"45.7", "38.9"} <= set(_texts(figs["decode"].axes[0]))
        assert {"25.0"} <= set(_texts(figs["mbu"].axes[0]))
        ppl = _texts(figs["ppl"].axes[0]) + [t.get_text().replace("\n", " ") for t in figs["ppl"].texts]
        assert "Q8_0 (from Q4_1)" in ppl and "Q4_1" in ppl  # the re-quantized point says so, the original not
        assert any("re-quantized from an already-quantized file" in t and "Q8_0 from smol (Q4_1)" in t for t in ppl)
    finally:
        for fig in figs.values():
            plt.close(fig)
    written = write_plots(res, tmp_path)
    assert all((tmp_path / name).read_bytes()[:4] == b"\x89PNG" for name in written.values())


def test_report_says_which_points_were_requantized():
    from edgellm.bench.report import markdown

    res = _results()
    res.update(elapsed_s=1, command=None, environment={"versions": {}, "host": {"cpu": "x", "cpu_count": 2,
               "platform": "linux"}}, plan={"prompt_lengths": [16], "gen_lengths": [8], "repetitions": 1,
               "timeout_s": 10})
    for c in res["configurations"]:
        c.update(size_bytes=1, ttlm_s=None, peak_rss_bytes=None, device_peak_bytes=None, path=c["id"])
        c["perplexity"].update(n_tokens=100, n_chunks=2, n_ctx=32, n_scored=30)
        for t in c["tests"]:
            t["tokens_per_s"].update(stddev=0.0, flagged=False)
    md = markdown(res)
    assert re.search(r"re-quantized from an already-quantized file.*Q8_0 from smol \(Q4_1\)", md), md
    res["configurations"][1]["requantized_from"] = None  # made from a float file: nothing to say
    assert "re-quantized" not in markdown(res)
