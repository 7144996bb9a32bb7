"""llama-bench's JSON output read by benchmarks/bench_vs_llamacpp.py, and bench_webgpu.py's
--llama-bench rows, with a stand-in llama-bench (a script printing a captured output: no GPU)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

# Captured 2026-11-24: llama-bench of llama-cpp-python 0.3.36's llama.cpp built with GGML_VULKAN
# (benchmarks/gpu_session.sh build_llama_vk), on Mesa's llvmpipe, a 3-layer synthetic Q4_0 file:
# llama-bench -m tiny-Q4_0.gguf -ngl 99 -fa 1 -p 64 -n 16 -r 2 -o json
SAMPLE = """[
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "gpu_info": "llvmpipe (LLVM 15.0.6, 256 bits)",
    "backends": "Vulkan",
    "model_filename": "tiny-Q4_0.gguf",
    "model_type": "llama ?B (guessed) Q4_0",
    "model_size": 1091200,
    "model_n_params": 1928960,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 99,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": 1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 64,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-11-24T19:05:44Z",
    "avg_ns": 898843772,
    "stddev_ns": 63189177,
    "avg_ts": 71.378968,
    "stddev_ts": 5.017977,
    "samples_ns": [ 854162287, 943525258 ],
    "samples_ts": [ 74.9272, 67.8307 ]
  },
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "gpu_info": "llvmpipe (LLVM 15.0.6, 256 bits)",
    "backends": "Vulkan",
    "model_filename": "tiny-Q4_0.gguf",
    "model_type": "llama ?B (guessed) Q4_0",
    "model_size": 1091200,
    "model_n_params": 1928960,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 99,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": 1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 16,
    "n_depth": 0,
    "test_time": "2026-11-24T19:06:00Z",
    "avg_ns": 424571840,
    "stddev_ns": 82614591,
    "avg_ts": 38.412218,
    "stddev_ts": 7.474376,
    "samples_ns": [ 482989178, 366154502 ],
    "samples_ts": [ 33.127, 43.6974 ]
  }
]"""


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


@pytest.fixture(scope="module")
def vs():
    return _module("bench_vs_llamacpp")


@pytest.fixture(scope="module")
def webgpu():
    return _module("bench_webgpu")


def test_parse_captured_output(vs):
    assert vs.parse_llama_bench(SAMPLE) == {"pp64": 71.378968, "pp64_sd": 5.017977,
                                            "tg16": 38.412218, "tg16_sd": 7.474376}


@pytest.mark.parametrize("text, match", [
    ("ggml_vulkan: No devices found.", "not JSON"),
    ("[]", "non-empty list"),
    ('{"n_prompt": 64}', "non-empty list"),
    ('[{"n_prompt": 64, "n_gen": 0, "avg_ts": 1.0}]', "stddev_ts"),
])
def test_parse_rejects_what_is_not_a_result(vs, text, match):
    with pytest.raises(ValueError, match=match):
        vs.parse_llama_bench(text)


def _fake_llama_bench(tmp_path: Path, stdout: str, rc: int = 0, stderr: str = "") -> Path:
    """A llama-bench stand-in: records its arguments, prints `stdout`, exits `rc`."""
    (tmp_path / "out.txt").write_text(stdout)
    exe = tmp_path / "llama-bench"
    exe.write_text(f"""#!/bin/sh
printf '%s\\n' "$@" > {tmp_path / 'argv.txt'}
cat {tmp_path / 'out.txt'}
printf '%s\\n' '{stderr}' >&2
exit {rc}
""")
    exe.chmod(0o755)
    return exe


def _args(exe: Path, **kw):
    return argparse.Namespace(**{"llama_bench": str(exe), "p": 64, "n": 16, "r": 2, "fa": 1, "timeout": 60, **kw})


def test_llama_row_runs_llama_bench_and_counts_bandwidth(webgpu, tmp_path):
    exe = _fake_llama_bench(tmp_path, SAMPLE)
    row = webgpu.llama_row(_args(exe), "/models/tiny-Q4_0.gguf", "tiny", "Q4_0", bw=1e12, wbytes=2e6)
    argv = (tmp_path / "argv.txt").read_text().split()
    assert argv == ["-m", "/models/tiny-Q4_0.gguf", "-ngl", "99", "-p", "64", "-n", "16", "-fa", "1", "-r", "2",
                    "-o", "json"]
    assert row["backend"] == "llama.cpp-vulkan" and (row["model"], row["fmt"]) == ("tiny", "Q4_0")
    assert (row["pp64"], row["tg16"]) == (71.378968, 38.412218)
    assert row["decode_GBps"] == pytest.approx(2e6 * 38.412218 / 1e9)
    assert row["decode_pct_bw"] == pytest.approx(100 * 2e6 * 38.412218 / 1e12)

    webgpu.print_tables({"models": [row]}, 64, 16)  # a row without load time prints "-" there


def test_llama_row_failure_is_a_row_with_the_error(webgpu, tmp_path):
    exe = _fake_llama_bench(tmp_path, "", rc=1, stderr="ggml_vulkan: No devices found.")
    row = webgpu.llama_row(_args(exe), "/models/x.gguf", "x", "Q8_0", bw=1e12, wbytes=2e6)
    assert row == {"model": "x", "fmt": "Q8_0", "backend": "llama.cpp-vulkan", "error": "ggml_vulkan: No devices found."}
    exe = _fake_llama_bench(tmp_path, SAMPLE)
    row = webgpu.llama_row(_args(exe, p=512, n=128), "/models/x.gguf", "x", "Q8_0", bw=1e12, wbytes=None)
    assert row["error"] == "llama-bench reported no pp512, tg128"


def test_table_row_of_llama_bench(webgpu, tmp_path, capsys):
    row = webgpu.llama_row(_args(_fake_llama_bench(tmp_path, SAMPLE)), "/m/t.gguf", "tiny", "Q4_0", 1e12, None)
    webgpu.print_tables({"models": [row]}, 64, 16)
    line = [x for x in capsys.readouterr().out.splitlines() if "llama.cpp-vulkan" in x]
    assert line == ["| tiny | Q4_0 | llama.cpp-vulkan | 71 | 38.4 | - | - | - | - | - |"]  # no load or tuning time
    assert json.loads(json.dumps(row))["tg16_sd"] == 7.474376  # the --json file keeps the spread


def test_table_row_reports_the_tuning_apart(webgpu, capsys):
    """An edgellm row's load column, and the tuning's part of it (load_phases) beside it."""
    row = {"model": "tiny", "fmt": "Q8_0", "backend": "webgpu", "pp64": 100.0, "tg16": 20.0, "load_s": 12.34,
           "load_phases": {"weights": 3.0, "tuning": 7.25}}
    webgpu.print_tables({"models": [row, {**row, "backend": "cuda", "load_phases": {}}]}, 64, 16)
    out = capsys.readouterr().out.splitlines()
    assert [x for x in out if "| webgpu |" in x][0].endswith("| 12.3 | 7.2 |")
    assert [x for x in out if "| cuda |" in x][0].endswith("| 12.3 | - |")


def test_mixes_made_by_llama_quantize_from_the_f16_file(vs, tmp_path, monkeypatch):
    """--llama-quantize: a mix format is made by the given quantizer from the shape's F16 file
    (written first), named NAME-FMT-lq.gguf, and reused by the next run; other formats are
    edgellm's own files; a failing quantizer stops the run with its message, leaving no file."""
    from edgellm.synthetic import PRESETS, SyntheticSpec

    monkeypatch.setitem(PRESETS, "tiny", SyntheticSpec(n_layers=1, d_model=256, n_heads=2, n_kv_heads=2, ffn_dim=256))
    log = tmp_path / "calls.txt"
    fake = tmp_path / "llama-quantize"
    fake.write_text(f"""#!{sys.executable}
import shutil, sys
from gguf import GGUFReader
assert {{t.tensor_type.name for t in GGUFReader(sys.argv[1]).tensors if len(t.shape) == 2}} == {{"F16"}}
open({str(log)!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[3] == "Q5_K_M":
    print("main: failed to quantize: unsupported here", file=sys.stderr); sys.exit(1)
shutil.copy(sys.argv[1], sys.argv[2])
""")
    fake.chmod(0o755)
    d = tmp_path / "models"
    paths = vs.synthetic_models("tiny", "Q8_0,Q4_K_M", str(d), str(fake))
    assert [Path(p).name for p in paths] == ["tiny-Q8_0.gguf", "tiny-Q4_K_M-lq.gguf"]
    assert all(Path(p).is_file() for p in paths) and (d / "tiny-F16.gguf").is_file()
    assert log.read_text().split() == [str(d / "tiny-F16.gguf"), str(d / "tiny-Q4_K_M-lq.gguf.tmp"), "Q4_K_M"]
    vs.synthetic_models("tiny", "Q4_K_M", str(d), str(fake))
    assert len(log.read_text().splitlines()) == 1  # the file is reused
    with pytest.raises(SystemExit, match="failed to quantize: unsupported here"):
        vs.synthetic_models("tiny", "Q5_K_M", str(d), str(fake))
    assert not list(d.glob("tiny-Q5_K_M*"))
    assert [Path(p).name for p in vs.synthetic_models("tiny", "Q4_K_M", str(d))] == ["tiny-Q4_K_M.gguf"]
