"""The kernel-configuration tuner: choice, disk cache, EDGELLM_TUNE, failures. CPU only, with a fake timer."""

import json
import os
import warnings

import pytest

from edgellm.backends.cuda.tuning import Tuner, cuda_event_timer, default_cache_dir

DEVICE = "NVIDIA H200|sm90|triton-3.6.0"
DEFAULT = {"BLOCK": 64, "warps": 4}
CANDIDATES = [{"BLOCK": 32, "warps": 4}, {"BLOCK": 64, "warps": 4}, {"BLOCK": 128, "warps": 8}]


class Bench:
    """A fake kernel: `run` launches it, `timer` returns a time looked up from the last config run."""

    def __init__(self, times, fail=()):
        self.times, self.fail = times, set(fail)
        self.runs: list[dict] = []
        self.timed = 0
        self.last = None

    def run(self, cfg):
        self.runs.append(dict(cfg))
        if cfg["BLOCK"] in self.fail:
            raise RuntimeError(f"out of resources for BLOCK={cfg['BLOCK']}")
        self.last = cfg

    def timer(self, fn):
        self.timed += 1
        fn()
        return self.times[self.last["BLOCK"]]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("EDGELLM_TUNE", "EDGELLM_CACHE_DIR", "EDGELLM_PROGRESS"):
        monkeypatch.delenv(var, raising=False)


def tuner(bench, cache_dir, device=DEVICE, **kw):
    return Tuner(device, cache_dir=cache_dir, timer=bench.timer, **kw)


def pick(t, bench, key=(4096, 4096, "q4_1"), candidates=CANDIDATES, default=DEFAULT):
    return t.pick("matmul", key, candidates, default, bench.run)


def cache_file(cache_dir):
    (path,) = (cache_dir / "tune").glob("*.json")
    assert path.name == "NVIDIA_H200_sm90_triton-3.6.0.json"
    return path


def test_picks_fastest_and_dedupes(tmp_path):
    bench = Bench({32: 5.0, 64: 9.0, 128: 7.0})
    t = tuner(bench, tmp_path)
    assert pick(t, bench) == {"BLOCK": 32, "warps": 4}
    assert bench.timed == 3  # the default, listed again among the candidates, is timed once
    assert bench.runs[0] == DEFAULT  # the default is timed first
    (r,) = t.report()
    assert r == {"kernel": "matmul", "key": (4096, 4096, "q4_1"), "config": {"BLOCK": 32, "warps": 4},
                 "us": 5.0, "default_us": 9.0, "source": "tuned"}


def test_rounds_time_in_turn_and_keep_each_ones_least(tmp_path):
    """rounds=3: every configuration timed once per round, in turn (the default first each
    round), the least of its times kept: a configuration slow in its first round only (its
    pipeline's first pass) still wins; one that fails is dropped from later rounds."""
    seq = {32: [9.0, 4.0, 4.5], 64: [5.0, 5.0, 5.0], 128: [6.0, 6.5, 6.2]}

    class Drifting(Bench):
        def timer(self, fn):
            self.timed += 1
            fn()
            return seq[self.last["BLOCK"]].pop(0)
    bench = Drifting({}, fail=(256,))
    t = tuner(bench, tmp_path)
    got = t.pick("matmul", (1, 2), CANDIDATES + [{"BLOCK": 256, "warps": 8}], DEFAULT, bench.run, rounds=3)
    assert got == {"BLOCK": 32, "warps": 4}
    assert [r["BLOCK"] for r in bench.runs] == [64, 32, 128, 256] + [64, 32, 128] * 2
    assert t.report()[0]["us"] == 4.0 and t.report()[0]["default_us"] == 5.0
    assert all(not v for v in seq.values())


def test_cached_on_disk_and_reused_without_timing(tmp_path):
    bench = Bench({32: 5.0, 64: 9.0, 128: 3.0})
    assert pick(tuner(bench, tmp_path), bench) == {"BLOCK": 128, "warps": 8}

    data = json.loads(cache_file(tmp_path).read_text())
    assert data == {"matmul|4096,4096,q4_1": {"config": {"BLOCK": 128, "warps": 8}, "us": 3.0,
                                              "default_us": 9.0, "candidates": 3}}

    again = Bench({32: 5.0, 64: 9.0, 128: 3.0})
    t2 = tuner(again, tmp_path)
    assert pick(t2, again) == {"BLOCK": 128, "warps": 8}
    assert again.timed == 0 and again.runs == []
    assert t2.report()[0]["source"] == "cached"
    assert t2.cached("matmul", (4096, 4096, "q4_1")) == {"BLOCK": 128, "warps": 8}
    # another key, kernel or device is not cached
    assert t2.cached("matmul", (4096, 11008, "q4_1")) is None
    assert t2.cached("rmsnorm", (4096, 4096, "q4_1")) is None
    other = Bench({32: 1.0, 64: 2.0, 128: 3.0})
    assert pick(tuner(other, tmp_path, device="NVIDIA H100|sm90|triton-3.6.0"), other) == {"BLOCK": 32, "warps": 4}
    assert other.timed == 3


def test_stale_cached_config_is_retuned(tmp_path):
    bench = Bench({32: 5.0, 64: 9.0, 128: 3.0, 256: 1.0})
    pick(tuner(bench, tmp_path), bench)
    again = Bench(bench.times)
    new_candidates = [{"BLOCK": 32, "warps": 4}, {"BLOCK": 256, "warps": 8}]  # BLOCK=128 is no longer offered
    assert pick(tuner(again, tmp_path), again, candidates=new_candidates) == {"BLOCK": 256, "warps": 8}
    assert again.timed == 3


def test_tuning_off_returns_default_without_running(tmp_path, monkeypatch):
    bench = Bench({32: 5.0, 64: 9.0, 128: 3.0})
    pick(tuner(bench, tmp_path), bench)  # a cached choice exists, and must be ignored
    monkeypatch.setenv("EDGELLM_TUNE", "0")
    off = Bench(bench.times)
    t = tuner(off, tmp_path)
    assert not t.enabled
    assert pick(t, off) == DEFAULT
    assert off.runs == [] and off.timed == 0
    assert t.report()[0]["source"] == "default"
    monkeypatch.setenv("EDGELLM_TUNE", "1")
    assert tuner(off, tmp_path).enabled
    assert not tuner(off, tmp_path / "x", enabled=False).enabled


def test_failing_candidate_is_skipped(tmp_path):
    bench = Bench({32: 1.0, 64: 9.0, 128: 3.0}, fail={32})
    t = tuner(bench, tmp_path)
    assert pick(t, bench) == {"BLOCK": 128, "warps": 8}
    entry = json.loads(cache_file(tmp_path).read_text())["matmul|4096,4096,q4_1"]
    assert entry["config"] == {"BLOCK": 128, "warps": 8} and entry["candidates"] == 3


def test_candidates_compile_side_by_side_before_timing(tmp_path):
    """With a precompile hook (the cuda backend's: the launches' kernels compiled on a thread pool),
    an uncached pick hands it one launch of every distinct configuration before timing any (a
    failing one does not stop the others), and a cached pick does not call it."""
    bench = Bench({32: 1.0, 64: 9.0, 128: 3.0}, fail={32})
    t = tuner(bench, tmp_path)
    calls = []

    def precompile(launch):
        before = len(bench.runs)
        launch()
        calls.append((bench.runs[before:], bench.timed))
    t.precompile = precompile
    assert pick(t, bench) == {"BLOCK": 128, "warps": 8}
    assert calls == [([DEFAULT, CANDIDATES[0], CANDIDATES[2]], 0)]  # each config once, before the timer ran
    assert bench.timed == 3
    t2 = tuner(bench, tmp_path)
    t2.precompile = precompile
    assert pick(t2, bench) == {"BLOCK": 128, "warps": 8} and len(calls) == 1  # cached: nothing compiles


def test_prepare_compiles_every_uncached_key_in_one_batch(tmp_path):
    """Tuner.prepare hands the precompile hook one launch of each configuration of every key not
    cached yet (a key listed twice once), in a single call, and times nothing."""
    a, b = Bench({32: 5.0, 64: 9.0, 128: 7.0}), Bench({32: 1.0, 64: 2.0, 128: 3.0})
    t = tuner(a, tmp_path)
    assert pick(t, a) == {"BLOCK": 32, "warps": 4}  # this key is cached now
    calls = []
    t.precompile = lambda launch: calls.append(launch())
    a.runs.clear()
    jobs = [((4096, 4096, "q4_1"), CANDIDATES, DEFAULT, a.run), ((1024, 4096, "q4_1"), CANDIDATES, DEFAULT, b.run),
            ((1024, 4096, "q4_1"), CANDIDATES, DEFAULT, b.run)]
    t.prepare("matmul", jobs)
    assert len(calls) == 1 and a.runs == [] and b.runs == [DEFAULT, CANDIDATES[0], CANDIDATES[2]]
    assert b.timed == 0
    t.prepare("matmul", jobs[:1])
    assert len(calls) == 1  # every key cached: no call


def test_compile_threads_setting(monkeypatch):
    from edgellm.backends.cuda import precompile
    monkeypatch.setenv("EDGELLM_COMPILE_THREADS", "3")
    assert precompile.threads() == 3
    monkeypatch.setenv("EDGELLM_COMPILE_THREADS", "many")
    with pytest.raises(ValueError, match="EDGELLM_COMPILE_THREADS"):
        precompile.threads()
    monkeypatch.setenv("EDGELLM_COMPILE_THREADS", "1")
    assert not precompile.enabled()  # a pool of one: kernels compile at their first launch


def test_compile_pool_setting(monkeypatch):
    from edgellm.backends.cuda import precompile
    monkeypatch.setenv("EDGELLM_COMPILE_POOL", "threads")
    with pytest.raises(ValueError, match="EDGELLM_COMPILE_POOL"):
        precompile.pool_mode()
    monkeypatch.setenv("EDGELLM_COMPILE_POOL", "Thread")
    assert precompile.pool_mode() == "thread"
    monkeypatch.delenv("EDGELLM_COMPILE_POOL")
    assert precompile.pool_mode() == "process"


def test_early_compile_server_only_with_an_empty_kernel_cache_and_a_gpu(tmp_path, monkeypatch):
    """`edgellm run` starts the compile server while it imports only when Triton's cache is empty
    and the early context found a GPU: with kernels cached it does nothing; with none and no GPU
    its thread ends without a server."""
    import threading

    from edgellm.backends.cuda import early, precompile
    monkeypatch.setattr(early, "outcome", lambda timeout=None: {})  # as where the early context found no GPU
    full = tmp_path / "full"
    full.mkdir()
    (full / "kernel").mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(full))
    assert precompile.start_pool_if_cold() is False
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "empty"))
    assert precompile.start_pool_if_cold() is True
    for t in threading.enumerate():
        if t.name == "edgellm-compile-pool-early":
            t.join(20)
    assert precompile._pool is None and precompile._pool_thread is None


COMPILE_SERVER_SCRIPT = """
import os, signal, sys
print("script body ran", flush=True)  # no main guard: a worker must not run this again
from edgellm.backends.cuda import precompile as p
p.start_pool()
server = p._get_pool()
assert server is not None, p.pool_error()
bad = server.submit("edgellm.no_such_module", "kernel", "key", "{}", ["cuda", 90, 32])
try:
    bad.result(timeout=60)
    print("bad request: compiled?!")
except RuntimeError as e:
    print("bad request:", str(e).split(":")[0])
from edgellm.backends.cuda.kernels import norm
kernel = norm._rms_norm_kernel
elsewhere = server.submit(kernel.__module__, kernel.__qualname__, kernel.cache_key, "{}", ["cuda", 90, 32], None,
                          "/nonexistent/triton-cache")
try:
    elsewhere.result(timeout=60)
    print("other cache folder: compiled?!")
except RuntimeError as e:
    print("other cache folder:", "refused" if "Triton cache is" in str(e) else str(e))
p.stop_pool()  # a later compile starts a server again
server = p._get_pool()
assert server is not None, p.pool_error()
os.kill(server.proc.pid, signal.SIGKILL)
server.proc.wait()
server._reader.join(30)
late = None
try:
    late = server.submit("edgellm.no_such_module", "kernel", "key", "{}", ["cuda", 90, 32])
except RuntimeError as e:
    print("after the kill:", "refused")
print("pool after the kill:", p._get_pool(), "|", (p.pool_error() or "")[:40])
"""


def test_compile_server_answers_survives_and_leaves_the_main_module_alone(tmp_path):
    """The compile workers (precompile.py's server, compile_server.py) are forks of a server process
    of their own: a script without a main guard runs once (multiprocessing's spawn and fork server
    would import it again in every worker); a request the server cannot compile is answered with the
    error (the loading process then compiles in-process), as is one for another Triton cache folder
    than the server compiles into; a server that dies fails what is pending,
    and compiles stay in-process from then on."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "user_script.py"
    script.write_text(COMPILE_SERVER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(EDGELLM_COMPILE_THREADS="2", EDGELLM_COMPILE_POOL="process", EDGELLM_CACHE_DIR=str(tmp_path / "c"),
               PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert out.count("script body ran") == 1, r.stdout
    assert "bad request: ModuleNotFoundError" in out, r.stdout
    assert "other cache folder: refused" in out, r.stdout  # a result this process would not find
    assert "after the kill: refused" in out, r.stdout
    assert any(line.startswith("pool after the kill: None | the compile server exited") for line in out), r.stdout


def test_failing_default_is_skipped(tmp_path):
    bench = Bench({32: 4.0, 64: 1.0, 128: 3.0}, fail={64})
    t = tuner(bench, tmp_path)
    assert pick(t, bench) == {"BLOCK": 128, "warps": 8}
    assert t.report()[0]["default_us"] is None


def test_all_failing_returns_default_and_caches_nothing(tmp_path):
    bench = Bench({32: 1.0, 64: 2.0, 128: 3.0}, fail={32, 64, 128})
    t = tuner(bench, tmp_path)
    assert pick(t, bench) == DEFAULT
    assert t.report()[0]["source"] == "failed"
    assert t.cached("matmul", (4096, 4096, "q4_1")) is None
    assert not (tmp_path / "tune").exists() or not list((tmp_path / "tune").glob("*.json"))


def test_default_wins_ties(tmp_path):
    bench = Bench({32: 5.0, 64: 5.0, 128: 5.0})
    assert pick(tuner(bench, tmp_path), bench, candidates=CANDIDATES[::-1]) == DEFAULT


def test_corrupt_cache_warns_and_is_rewritten(tmp_path):
    path = tmp_path / "tune" / "NVIDIA_H200_sm90_triton-3.6.0.json"
    path.parent.mkdir()
    path.write_text("{not json")
    bench = Bench({32: 5.0, 64: 9.0, 128: 3.0})
    t = tuner(bench, tmp_path)
    with pytest.warns(RuntimeWarning, match="NVIDIA_H200_sm90_triton-3.6.0.json"):
        assert pick(t, bench) == {"BLOCK": 128, "warps": 8}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        pick(t, bench, key=(1, 2, "q8_0"))
    data = json.loads(path.read_text())
    assert set(data) == {"matmul|4096,4096,q4_1", "matmul|1,2,q8_0"}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_wrong_json_shape_is_corrupt(tmp_path):
    path = tmp_path / "tune" / "NVIDIA_H200_sm90_triton-3.6.0.json"
    path.parent.mkdir()
    path.write_text("[1, 2]")
    bench = Bench({32: 5.0, 64: 9.0, 128: 3.0})
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        assert pick(tuner(bench, tmp_path), bench) == {"BLOCK": 128, "warps": 8}
    assert isinstance(json.loads(path.read_text()), dict)


def test_unwritable_cache_dir_warns_and_keeps_results_in_memory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bench = Bench({32: 5.0, 64: 9.0, 128: 3.0})
    t = tuner(bench, blocker / "cache")
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        assert pick(t, bench) == {"BLOCK": 128, "warps": 8}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        assert pick(t, bench) == {"BLOCK": 128, "warps": 8}
        assert pick(t, bench, key=(1, 2, "q8_0")) == {"BLOCK": 128, "warps": 8}
    assert bench.timed == 6  # the repeated key came from memory


def test_session_saves_once_at_the_end_and_prints_nothing_off_a_terminal(tmp_path, capsys):
    bench = Bench({32: 5.0, 64: 9.0, 128: 3.0})
    t = tuner(bench, tmp_path)
    with t.tuning_session(total=3):
        for n in (1, 2, 3):
            pick(t, bench, key=(n, n, "q4_1"))
        assert not (tmp_path / "tune").exists()
    assert len(json.loads(cache_file(tmp_path).read_text())) == 3
    assert capsys.readouterr() == ("", "")


def test_progress_bar_forced_on(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_PROGRESS", "1")
    bench = Bench({32: 5.0, 64: 9.0, 128: 3.0})
    t = tuner(bench, tmp_path)
    with t.tuning_session(total=2):
        pick(t, bench, key=(1,))
        pick(t, bench, key=(2,))
    assert t._bar is None  # stopped at the end of the session
    assert pick(t, bench, key=(3,)) == {"BLOCK": 128, "warps": 8}  # outside a session too
    assert [r["key"] for r in t.report()] == [(1,), (2,), (3,)]


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "edgellm"
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    assert Tuner(DEVICE).path == tmp_path / "mine" / "tune" / "NVIDIA_H200_sm90_triton-3.6.0.json"


def test_cuda_event_timer():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.randn(256, 256, device="cuda")
    calls = []
    us = cuda_event_timer(lambda: calls.append(x @ x))
    assert us > 0 and 6 <= len(calls) <= 101
    # device time, not host time: a 64x larger product (4096 x 4096 x 1024) takes longer
    big = torch.randn(4096, 4096, device="cuda")
    us_big = cuda_event_timer(lambda: big @ big[:, :1024])
    assert us_big > 4 * us, (us, us_big)


def test_kernels_sent_ahead_are_settled_whatever_the_workers_answer(monkeypatch):
    """precompile.ahead leaves a placeholder per specialization for later batches to wait on: each
    must end with its worker's answer (the worker's seconds), or None where the worker failed or
    nothing was sent (the launch then compiles it in-process); none may stay pending, which would
    hold a load's batch for WORKER_TIMEOUT_S."""
    import threading
    from concurrent.futures import Future

    from edgellm.backends.cuda import precompile as p

    specs = [p.Spec(fn=None, data="{}", key=f"ahead-test-{i}") for i in range(3)]
    monkeypatch.setattr(p, "enabled", lambda: True)
    monkeypatch.setattr(p, "pool_mode", lambda: "process")
    monkeypatch.setattr(p, "collect", lambda launch: (specs, 0.0))
    answers = {s.key: Future() for s in specs[:2]}  # the third is not sent (say, found in Triton's cache)
    sent = []
    go = threading.Event()

    def submit(some, least=None, reuse=True):  # on ahead's thread, once the test has looked
        go.wait(10)
        sent.append(([s.key for s in some], least, reuse))
        return dict(answers)
    monkeypatch.setattr(p, "_submit_to_workers", submit)
    assert p.ahead(lambda: None) == 3
    with p._inflight_lock:
        placeholders = {s.key: p._inflight[s.key] for s in specs}
    assert p.ahead(lambda: None) == 0  # in flight already: not sent again
    go.set()
    for t in threading.enumerate():
        if t.name == "edgellm-compile-ahead":
            t.join(10)
    assert sent == [([s.key for s in specs], 1, False)]
    assert placeholders["ahead-test-2"].result(timeout=1) is None
    answers["ahead-test-0"].set_result({"seconds": 1.5, "launcher_s": 0.25})
    answers["ahead-test-1"].set_exception(RuntimeError("the worker could not compile it"))
    assert placeholders["ahead-test-0"].result(timeout=1) == {"seconds": 1.5, "launcher_s": 0.25}
    assert placeholders["ahead-test-1"].result(timeout=1) is None
    with p._inflight_lock:
        assert not any(k.startswith("ahead-test-") for k in p._inflight)
