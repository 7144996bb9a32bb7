"""The command line as a new user meets it: missing modules, argument checks before loading,
escapes in --stop/--system, empty prompts, threads. Through `python -m edgellm` in a child process."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_fixtures import ROOT, child_env, edgellm, hf_folder, hide_modules, tiny_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    return {"gguf": tiny_gguf(d / "tiny.gguf"), "hf": hf_folder(d / "hf-folder"), "dir": d}


def one_line_error(r, *needles: str) -> str:
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


# -- 1. missing modules ----------------------------------------------------------------------------
def _third_party_imports() -> set[str]:
    mods = set()
    for f in (ROOT / "edgellm").rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Import):
                mods |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                mods.add(n.module.split(".")[0])
    return {m for m in mods if m not in sys.stdlib_module_names and m != "edgellm"}


def test_every_imported_package_is_declared():
    """Each third-party module edgellm imports belongs to a distribution in pyproject.toml's
    dependencies or extras (safetensors was missing: `edgellm quantize hf-folder/` crashed)."""
    import importlib.metadata as md

    tomllib = pytest.importorskip("tomllib")
    from edgellm.cli import PIP_NAMES

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = proj["dependencies"] + [r for extra in proj["optional-dependencies"].values() for r in extra]

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    declared = {norm(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in reqs}
    dists = md.packages_distributions()
    for mod in sorted(_third_party_imports()):
        names = dists.get(mod) or [PIP_NAMES.get(mod, mod).split()[0]]
        assert any(norm(n) in declared for n in names), f"edgellm imports {mod} ({names}) but pyproject.toml lacks it"


@pytest.mark.parametrize("command, hidden, install", [
    (["quantize", "{hf}", "{dir}/o1.gguf", "--type", "q4_g128", "--policy", "mixed-8-4-4"], "safetensors",
     "pip install safetensors"),
    (["quantize", "{gguf}", "{dir}/o2.gguf", "--type", "q8_0"], "gguf", "pip install gguf"),
    (["plan", "{gguf}"], "rich", "pip install rich"),
    (["info", "{gguf}"], "tokenizers", "pip install tokenizers"),
    (["run", "-m", "{gguf}", "-n", "2", "hi"], "torch", "pip install torch"),
])
def test_a_missing_module_is_one_line_naming_what_to_install(files, tmp_path, command, hidden, install):
    args = [a.format(**{k: str(v) for k, v in files.items()}) for a in command]
    r = edgellm(*args, env=child_env(hide_modules(tmp_path / "shim", hidden)))
    one_line_error(r, f"'{hidden}'", install)


# -- 3. arguments are checked before anything loads -------------------------------------------------
BAD = [
    (["run", "--temperature", "-1", "hi"], "--temperature"),
    (["run", "--top-p", "1.5", "hi"], "--top-p"),
    (["run", "--min-p", "x", "hi"], "--min-p"),
    (["run", "-n", "-1", "hi"], "--max-tokens"),
    (["run", "-c", "0", "hi"], "--ctx"),
    (["run", "-t", "0", "hi"], "--threads"),
    (["run", "--seed", "1.5", "hi"], "--seed"),
    (["run", "--backend", "tpu", "hi"], "--backend"),
    (["run", "--stop", r"\ud800", "hi"], "--stop"),
    (["plan", "--prefill", "0"], "--prefill"),
    (["plan", "--backend", "tpu"], "--backend"),
    (["info", "--tensorz"], "--tensorz"),
    (["quantize", "IN", "{dir}/o.gguf", "--type", "q9_9"], "q9_9"),
    (["quantize", "IN", "{dir}/o.gguf", "--type", "q4_0", "--policy", "best"], "best"),
    (["bench", "IN", "-r", "0"], "-r/--repetitions"),
    (["bench", "IN", "-t", "zero"], "--threads"),
]


def test_bad_arguments_fail_before_loading(files):
    """Each bad value is reported, naming its option, though the model named with it does not exist
    (a check after loading would report the file), and quickly."""
    missing = str(files["dir"] / "does-not-exist.gguf")
    for args, option in BAD:
        args = [missing if a == "IN" else a.format(dir=files["dir"]) for a in args]
        if args[0] in ("run", "plan", "info") and "IN" not in args:
            args[1:1] = ["-m", missing] if args[0] == "run" else [missing]
        t0 = time.perf_counter()
        r = edgellm(*args)
        assert time.perf_counter() - t0 < 5, args
        err = one_line_error(r, option)
        assert "does-not-exist" not in err, (args, err)


def test_text_for_a_file_without_vocabulary_fails_before_loading(files, tmp_path):
    """`edgellm run` with a text prompt on a file that has no vocabulary (llama.cpp's benchmark
    files, edgellm.synthetic's without a tokenizer) says so from the file's header, before the
    load: here torch is missing, which the load would need and report first (on a GPU the load
    compiled every kernel before this error came, 13 s on the H200)."""
    from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf

    from cli_fixtures import TINY

    path = write_synthetic_gguf(tmp_path / "novocab.gguf", SyntheticSpec(**{**TINY, "weight_type": "F32",
                                                                             "embed_type": "F32"}))
    r = edgellm("run", "-m", str(path), "-n", "2", "hello", env=child_env(hide_modules(tmp_path / "hide", "torch")))
    one_line_error(r, "novocab.gguf has no vocabulary", "token ids")


def test_default_model_override_names_a_missing_file(files):
    r = edgellm("info", env=child_env(EDGELLM_MODEL=str(files["dir"] / "gone.gguf")))
    one_line_error(r, "EDGELLM_MODEL=", "gone.gguf")
    r = edgellm("info", env=child_env(EDGELLM_MODEL=str(files["gguf"])))
    assert r.returncode == 0 and str(files["gguf"]) in r.stdout, r.stderr


# -- 4. empty prompts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, stdin", [(None, ""), (None, " \n\t\n"), ("", None), ("   ", None)])
def test_an_empty_prompt_is_refused(files, prompt, stdin):
    args = ["run", "-m", str(files["gguf"]), "-n", "2"] + ([prompt] if prompt is not None else [])
    one_line_error(edgellm(*args, input=stdin), "prompt is empty", "--allow-empty")


def test_allow_empty_runs_an_empty_prompt(files):
    r = edgellm("run", "-m", str(files["gguf"]), "-n", "3", "--temperature", "0", "--allow-empty", input="")
    assert r.returncode == 0, r.stderr
    assert "generated 3 tok" in r.stderr
    cores = _sysfs_physical_cores()
    assert cores is None or re.search(rf", {cores} threads[,;]", r.stderr)  # -t default: the physical cores


# -- 9. threads -----------------------------------------------------------------------------------------
def _sysfs_physical_cores() -> int | None:
    """Physical cores among the CPUs this process may use, from the kernel's topology files."""
    import os

    cores = set()
    for cpu in os.sched_getaffinity(0):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return None
    return len(cores)


def test_physical_cores_matches_the_kernel_topology(monkeypatch):
    from edgellm import arguments

    expected = _sysfs_physical_cores()
    if expected is None:
        pytest.skip("no /sys CPU topology here")
    assert arguments.physical_cores() == expected
    import psutil

    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: None)  # psutil cannot tell
    assert arguments.physical_cores() == len(__import__("os").sched_getaffinity(0))
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 64)  # more cores than this process may use
    assert arguments.physical_cores() == len(__import__("os").sched_getaffinity(0))


def test_threads_set_the_cpu_backend_threads(files):
    r = edgellm("run", "-m", str(files["gguf"]), "-n", "2", "--backend", "cpu", "-t", "1", "hi")
    assert r.returncode == 0, r.stderr
    assert ", 1 threads," in r.stderr  # the cpu backend's own description (torch.get_num_threads)


# -- 2. escapes in --stop and --system --------------------------------------------------------------
def test_unescape_agrees_with_python_literals_on_the_shared_escapes():
    """llama-cli's escapes are a subset of Python's string literal escapes: Python's own parser is
    the reference for them (random mixes of escapes, plain text and non-ASCII)."""
    import random

    from edgellm.arguments import unescape

    pieces = [r"\n", r"\t", r"\r", r"\\", r"\"", r"\'", r"\a", r"\b", r"\f", r"\v", r"\0", r"\x41", r"\x0a", r"\xe9",
              r"\u00e9", r"\u4e16", r"\U0001F916", "a", " ", "é", "世", "🤖", "\n", "x"]
    rng = random.Random(0)
    for _ in range(500):
        s = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert unescape(s) == ast.literal_eval('"""' + s + '"""'), s
    # llama-cli keeps what it does not know, and a real newline ($'\n') is just a character
    assert unescape(r"\d\q") == r"\d\q" and unescape("end\\") == "end\\" and unescape("a\nb") == "a\nb"
    assert unescape(r"\e[0m") == "\x1b[0m"


def test_system_and_stop_are_unescaped_by_the_parser():
    from edgellm.cli import build_parser

    a = build_parser().parse_args(["run", "--system", r"be brief\tplease\n", "--stop", r"\n\n", "--stop", "\n", "x"])
    assert a.system == "be brief\tplease\n" and a.stop == ["\n\n", "\n"]


def test_stop_with_escapes_stops_the_cli(files):
    """A stop string given with \\xHH / \\uXXXX escapes matches the text those characters spell."""
    base = ["run", "-m", str(files["gguf"]), "-n", "24", "--temperature", "1.5", "--top-k", "0", "--top-p", "1",
            "--min-p", "0", "--seed", "3", "-q", "hello"]
    r = edgellm(*base)
    assert r.returncode == 0, r.stderr
    text = r.stdout[:-1]  # the CLI ends the answer with a newline
    # the first two characters (no U+FFFD) that do not occur earlier: stopping there leaves text[:i]
    i = next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2] and text[i:i + 2] not in text[:i + 1])
    stop = "".join(f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}" for c in text[i:i + 2])
    r2 = edgellm(*base, "--stop", stop)
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout[:-1] == text[:i], (stop, text)


# -- 8. a character cut at the end of generation ------------------------------------------------------
def test_generation_cut_inside_a_character_prints_nothing_for_it(files, monkeypatch):
    """generate() ending inside an emoji (max_tokens reached) yields the text before it and no U+FFFD."""
    import edgellm

    m = edgellm.load(files["gguf"], ctx=64)
    tok = m.tokenizer
    ids = tok.encode("ok 🤖", add_bos=False)
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # the emoji's bytes span tokens: the last one cut

    def fake_tokens(prompt_ids, max_tokens, params=None, stats=None):  # the model "generates" these ids
        yield from ids[:-1]

    monkeypatch.setattr(m, "generate_tokens", fake_tokens)
    assert "".join(m.generate("hi", max_tokens=len(ids) - 1)) == "ok "


# -- 10. start and exit: only the chosen subcommand's imports, no interpreter teardown -----------------
def test_each_subcommand_gets_its_own_options_when_chosen(capsys):
    """Given argv, the parser builds the named subcommand in full (its --help lists its options) and
    lists the others; without argv, every subcommand in full."""
    from edgellm.cli import COMMANDS, build_parser

    for name, *_ in COMMANDS:
        with pytest.raises(SystemExit) as e:
            build_parser([name, "--help"]).parse_args([name, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: edgellm {name}") and "--" in out.split("\n", 1)[1], (name, out[:300])
    full = build_parser()
    assert full.parse_args(["quantize", "a.gguf", "b.gguf", "--type", "q8_0"]).type == "q8_0"
    assert full.parse_args(["serve", "--port", "9"]).port == 9 and full.parse_args(["run", "x"]).prompt == "x"
    r = edgellm("--help")
    assert r.returncode == 0 and all(f"    {name} " in r.stdout for name, *_ in COMMANDS), r.stdout


def test_run_does_not_import_the_other_subcommands():
    """`edgellm run` builds only run's options: quantize's, bench's, serve's and plan's modules (and
    what they import) stay unloaded."""
    code = ("import sys; from edgellm.cli import build_parser; build_parser(['run', 'x']).parse_args(['run', 'x']); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('edgellm.', 'gguf', 'yaml', 'psutil')))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    loaded = set(r.stdout.split())
    assert "edgellm.onnx.cli" in loaded  # run's own --input options
    for m in ("edgellm.quantize_model", "edgellm.bench.cli", "edgellm.serve.cli", "edgellm.chat_cli",
              "edgellm.cache_cli", "edgellm.hetero.plan", "gguf", "yaml"):
        assert m not in loaded, (m, sorted(loaded))


def test_exit_now_keeps_output_threads_and_atexit_work(tmp_path):
    """exit_now ends the process without the interpreter's teardown, but only after what the process
    still owes: unflushed output (no newline, in a pipe), atexit callbacks, threads that are not
    daemons; an idle thread pool that was never shut down does not hold it up."""
    script = f"""
import atexit, sys, threading, time
from pathlib import Path
from edgellm.cli import exit_now
d = Path({str(tmp_path)!r})
atexit.register(lambda: (d / "atexit").write_text("ran"))
def work():
    time.sleep(0.3)
    (d / "thread").write_text("done")
threading.Thread(target=work).start()
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(2)  # idle workers of a pool never shut down: told to stop, not waited on forever
assert pool.submit(lambda: 1).result() == 1
sys.stdout.write("partial line, not flushed")
sys.stderr.write("err text")
exit_now(3)
print("never")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "partial line, not flushed" and r.stderr == "err text"
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "done"


def test_run_into_a_closed_pipe_ends_quietly(files):
    """`edgellm run ... | head -c 5`: the reader goes away mid-answer; the CLI ends with no traceback."""
    p = subprocess.Popen([sys.executable, "-m", "edgellm", "run", "-m", str(files["gguf"]), "-n", "48",
                          "--temperature", "1.5", "--seed", "1", "-q", "hello"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=child_env())
    first = p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) in (0, 1) and len(first) == 1
    assert "Traceback" not in err, err
