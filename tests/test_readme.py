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
FIXTURES = {
    "model.gguf": lambda p: tiny_gguf(p, chat_template=CHATML),
    "model-f16.gguf": lambda p: tiny_gguf(p, "F16", chat_template=CHATML),
    "hf-folder": hf_folder,
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
    proc = subprocess.Popen(["bash", "-c", "set -eo pipefail\n" + command], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{where} did not finish in {TIMEOUT_S} s (a README command must end by itself)")
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert r.returncode == 0, f"{where} failed with status {r.returncode}:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, f"{where} printed a traceback:\n{r.stderr[-3000:]}"
    assert r.stdout, f"{where} printed nothing on stdout"
    if re.match(r"(echo .*\| *)?edgellm run\b", command):  # a generation: the timing line on stderr ends it
        assert "generated" in r.stderr, f"{where}: no generation summary:\n{r.stderr[-2000:]}"


@pytest.mark.parametrize("line, code", PYTHON_BLOCKS, ids=[f"README.md:{n}" for n, _ in PYTHON_BLOCKS])
def test_readme_python_runs(line, code, fixtures, tmp_path):
    d, default, _ = fixtures
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(EDGELLM_MODEL=str(default)),
                       capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"README.md python block at line {line} failed:\n{r.stderr[-3000:]}"
