"""Every command in the README's ```bash blocks runs, as written, and succeeds (the docs test).

A command runs in a fresh folder holding the small files README examples name (FIXTURES), with
`edgellm` on PATH running this checkout. One documented environment override keeps it fast:
EDGELLM_MODEL (README: "Command line") points the default model at a small synthetic model with a
chat template, so `edgellm run "..."` or `edgellm bench -r 5 ...` as written takes seconds. A
command that .ci/run itself runs (scripts/test.sh: the test suite) is covered by CI, not here.
New README commands are picked up automatically; a failure names the README line."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_fixtures import CHATML, ROOT, child_env, hf_folder, tiny_gguf

README = ROOT / "README.md"
TIMEOUT_S = 240


def readme_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) for every command line of the ```bash blocks (a trailing backslash
    continues a command on the next line; blank and comment-only lines are skipped)."""
    out, block, pending, start = [], False, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            block = not block and line.strip()[3:].strip() in ("bash", "sh", "shell", "console")
            continue
        if not block:
            continue
        if not pending:
            start = n
            if not line.strip() or line.strip().startswith("#"):
                continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, (pending + line).strip()))
        pending = ""
    return out


def readme_python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, code) for every ```python block."""
    blocks = re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)
    return [(text[:m.start()].count("\n") + 1, m.group(1)) for m in blocks]


def _ci_commands() -> str:
    return (ROOT / ".ci" / "run").read_text() if (ROOT / ".ci" / "run").is_file() else ""


COMMANDS = readme_commands(README.read_text())
PYTHON_BLOCKS = readme_python_blocks(README.read_text())


# Files README commands name, made small: name -> maker(path)
def tiny_onnx(path: Path) -> None:
    """A small classifier: conv 3->8 (3x3), relu, global average pool, flatten, gemm 8->10, with
    dynamic batch and image size, random weights (the `onnx` package's own writer)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name) for name, shape in
             (("w", (8, 3, 3, 3)), ("b", (8,)), ("fc_w", (10, 8)), ("fc_b", (10,)))]
    nodes = [helper.make_node("Conv", ["input", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], transB=1, name="fc")]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def tiny_image(path: Path) -> None:
    import numpy as np
    from PIL import Image

    Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(path)


FIXTURES = {
    "model.gguf": lambda p: tiny_gguf(p, chat_template=CHATML),
    "model-f16.gguf": lambda p: tiny_gguf(p, "F16", chat_template=CHATML),
    "hf-folder": hf_folder,
    "model.onnx": tiny_onnx,
    "cat.jpg": tiny_image,
    "labels.txt": lambda p: p.write_text("".join(f"class {i}\n" for i in range(10))),
    "x.npy": lambda p: __import__("numpy").save(p, __import__("numpy").random.default_rng(2).standard_normal(
        (1, 3, 16, 16)).astype("float32")),
}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme-fixtures")
    for name, make in FIXTURES.items():
        make(d / name)
    default = tiny_gguf(d / "default-model.gguf", chat_template=CHATML, name="tiny-default", n_layers=1)
    bindir = d / "bin"
    bindir.mkdir()
    exe = bindir / "edgellm"  # `edgellm` as installed, running this checkout with this interpreter
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m edgellm \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    py = bindir / "python"  # `python` as in an activated .venv
    py.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    py.chmod(py.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return d, default, bindir


def test_readme_has_commands():
    assert len(COMMANDS) >= 10, COMMANDS
    assert any(c.startswith("edgellm bench") for _, c in COMMANDS)


@pytest.mark.parametrize("line, command", COMMANDS, ids=[f"README.md:{n}" for n, _ in COMMANDS])
def test_readme_command_runs(line, command, fixtures, tmp_path):
    where = f"README.md line {line}: `{command}`"
    if command.split("#")[0].strip() and command.split("#")[0].strip() in _ci_commands():
        pytest.skip(f"{where} is run by .ci/run")
    d, default, bindir = fixtures
    if re.search(r"cuda|--gpu-memory", command) and not _has_gpu():
        pytest.skip(f"{where} needs a GPU (the GPU machine's sessions run it)")
    if command.startswith("bash scripts/"):
        cwd = ROOT  # the scripts work on the checkout (and its .venv, made by scripts/install.sh)
        if not (ROOT / ".venv" / "bin" / "edgellm").exists():
            pytest.skip(f"{where}: no .venv in the checkout (scripts/install.sh makes it; CI has it)")
    else:
        cwd = tmp_path
        for name in FIXTURES:  # the files this command names
            if re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", command):
                (shutil.copytree if (d / name).is_dir() else shutil.copy)(d / name, cwd / name)
    env = child_env(EDGELLM_MODEL=str(default), PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    # its own process group, so that a timeout ends the command's children too (bench's workers)
    typed = next((text for prefix, text in TYPED.items() if command.startswith(prefix)), None)
    serve = command.startswith("edgellm serve")
    script = ("exec " if serve else "set -eo pipefail\n") + command  # the server itself gets the SIGTERM
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.PIPE if typed else subprocess.DEVNULL, start_new_session=True)
    if serve:  # a server runs until stopped: it must answer, then stop cleanly
        _serve_answers_then_stops(proc, where)
        return
    try:
        out, err = proc.communicate(typed, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{where} did not finish in {TIMEOUT_S} s (a README command must end by itself)")
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert r.returncode == 0, f"{where} failed with status {r.returncode}:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, f"{where} printed a traceback:\n{r.stderr[-3000:]}"
    assert r.stdout, f"{where} printed nothing on stdout"
    if re.match(r"(echo .*\| *)?edgellm run\b(?!.*\.onnx)", command):  # a generation: its timing line ends it
        assert "generated" in r.stderr, f"{where}: no generation summary:\n{r.stderr[-2000:]}"


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# commands that read a person's input: what the person types
TYPED = {"edgellm chat": "What is the capital of France?\n/exit\n"}


def _serve_answers_then_stops(proc: subprocess.Popen, where: str) -> None:
    """The README's server (on its default address, 127.0.0.1:8080) answers /health, a chat
    request gets an answer, and SIGTERM stops it with status 0."""
    import json
    import urllib.request

    base = "http://127.0.0.1:8080"
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{where} exited with status {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{where} did not answer /health within {TIMEOUT_S} s")
            time.sleep(0.5)
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        body = json.dumps({"model": model, "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
        req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["message"]["content"] is not None and answer["usage"]["completion_tokens"] > 0
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, f"{where}: SIGTERM did not stop it cleanly:\n{proc.stderr.read()[-3000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("line, code", PYTHON_BLOCKS, ids=[f"README.md:{n}" for n, _ in PYTHON_BLOCKS])
def test_readme_python_runs(line, code, fixtures, tmp_path):
    d, default, _ = fixtures
    for name in FIXTURES:  # the files this block names
        if re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", code):
            (shutil.copytree if (d / name).is_dir() else shutil.copy)(d / name, tmp_path / name)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(EDGELLM_MODEL=str(default)),
                       capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"README.md python block at line {line} failed:\n{r.stderr[-3000:]}"
