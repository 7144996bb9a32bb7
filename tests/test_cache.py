"""The persistent program cache (edgellm.cache): hits on a second load, misses on any change,
corrupt entries detected and rebuilt, concurrent loads, and the stats' one-time accounting."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import edgellm
from edgellm import cache as cache_mod
from edgellm.synthetic import SyntheticSpec, byte_bpe_vocab, write_synthetic_gguf

IDS = [3, 17, 5, 99, 42, 7, 1, 64]


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(d))
    monkeypatch.delenv("EDGELLM_CACHE", raising=False)
    return d


def _model(path: Path, seed: int = 0) -> Path:
    spec = SyntheticSpec(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=96, weight_type="Q8_0", seed=seed)
    return write_synthetic_gguf(path, spec, tokenizer=byte_bpe_vocab(512))


def test_second_load_reads_the_cache_and_gives_the_same_logits(tmp_path, cache_dir):
    path = _model(tmp_path / "m.gguf")
    first = edgellm.load(path, ctx=64)
    assert first.cache_hits == []
    second = edgellm.load(path, ctx=64)
    assert sorted(second.cache_hits) == ["compiled", "tokenizer"]
    uncached = edgellm.load(path, ctx=64, cache=False)
    assert uncached.cache_hits == []
    ref = uncached.logits(IDS)
    np.testing.assert_array_equal(second.logits(IDS), ref)
    np.testing.assert_array_equal(first.logits(IDS), ref)
    text = "hello world, caf\u00e9 <|im_start|>"
    assert second.tokenizer.encode(text) == uncached.tokenizer.encode(text)


def test_changed_file_engine_or_context_miss(tmp_path, cache_dir, monkeypatch):
    path = _model(tmp_path / "m.gguf")
    edgellm.load(path, ctx=64)
    assert "compiled" not in edgellm.load(path, ctx=128).cache_hits  # another context
    _model(path, seed=1)  # the same shapes, other weights: another file content
    changed = edgellm.load(path, ctx=64)
    assert changed.cache_hits == []
    np.testing.assert_array_equal(changed.logits(IDS), edgellm.load(path, ctx=64, cache=False).logits(IDS))
    monkeypatch.setattr(cache_mod, "engine_fingerprint", lambda: "0.0.0+another-engine")
    assert edgellm.load(path, ctx=64).cache_hits == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_corrupt_entries_are_detected_and_rewritten(tmp_path, cache_dir, damage):
    path = _model(tmp_path / "m.gguf")
    ref = edgellm.load(path, ctx=64, cache=False).logits(IDS)
    edgellm.load(path, ctx=64)
    files = sorted((cache_dir / "programs").rglob("*.json"))
    assert {f.name for f in files} == {"compiled.json", "tokenizer.json"}
    for f in files:
        data = bytearray(f.read_bytes())
        if damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "flip":
            data[len(data) // 2] ^= 0x40
        else:
            data = bytearray(os.urandom(len(data)))
        f.write_bytes(bytes(data))
    m = edgellm.load(path, ctx=64)
    assert m.cache_hits == []  # nothing damaged was used
    np.testing.assert_array_equal(m.logits(IDS), ref)
    again = edgellm.load(path, ctx=64)  # rewritten by the load that found them damaged
    assert sorted(again.cache_hits) == ["compiled", "tokenizer"]
    np.testing.assert_array_equal(again.logits(IDS), ref)


def test_a_payload_that_is_not_a_compiled_graph_is_a_miss(tmp_path, cache_dir):
    path = _model(tmp_path / "m.gguf")
    m = edgellm.load(path, ctx=64)
    key = next(p.name for p in (cache_dir / "programs").iterdir() if (p / "compiled.json").exists())
    # a well-formed file (right digest) holding the wrong data, e.g. from a buggy older writer
    cache_mod.ProgramCache().put_json(key, "compiled.json", {"all": {"graph": 1}, "last": {}, "decode": []})
    again = edgellm.load(path, ctx=64)
    assert "compiled" not in again.cache_hits
    np.testing.assert_array_equal(again.logits(IDS), m.logits(IDS))


def test_two_processes_loading_at_once_both_succeed(tmp_path, cache_dir):
    path = _model(tmp_path / "m.gguf")
    code = ("import sys, edgellm; m = edgellm.load(sys.argv[1], ctx=64); "
            "print(int(m.logits([3, 17, 5]).argmax(-1)[-1]))")
    env = {**os.environ, "EDGELLM_CACHE_DIR": str(cache_dir)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-500:] for o in outs]
    want = int(edgellm.load(path, ctx=64, cache=False).logits([3, 17, 5]).argmax(-1)[-1])
    assert [int(o[0].strip()) for o in outs] == [want, want]
    assert not list((cache_dir / "programs").rglob("*.tmp"))  # no temporary file left behind


def test_cache_is_bounded(tmp_path, cache_dir):
    pc = cache_mod.ProgramCache(max_bytes=5000)
    for i in range(6):
        pc.put(f"k{i}", "blob", bytes(2000))
        time.sleep(0.01)
    kept = sorted(p.name for p in (cache_dir / "programs").iterdir())
    assert kept == ["k4", "k5"]  # least recently used entries went first
    assert pc.get("k5", "blob") == bytes(2000)


def test_cache_cli_info_and_clear(tmp_path, cache_dir):
    path = _model(tmp_path / "m.gguf")
    edgellm.load(path, ctx=64)
    env = {**os.environ, "EDGELLM_CACHE_DIR": str(cache_dir)}
    info = subprocess.run([sys.executable, "-m", "edgellm", "cache", "info"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert info.returncode == 0 and str(cache_dir) in info.stdout and "programs" in info.stdout
    assert "1 entries" not in info.stdout and "2 entries" in info.stdout  # tokenizer + compiled stages
    clear = subprocess.run([sys.executable, "-m", "edgellm", "cache", "clear"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert clear.returncode == 0 and "freed" in clear.stdout
    assert not (cache_dir / "programs").exists()


def test_stats_keep_one_time_work_out_of_the_speeds(tmp_path, cache_dir):
    """A backend's first-run work (counted by its program in one_time_s, as the cuda backend does
    for kernel compiles and graph captures) goes to compile_s, not to prefill or decode time."""
    m = edgellm.load(_model(tmp_path / "m.gguf"), ctx=64)

    class FirstRunIsSlow:
        def __init__(self, inner, delay):
            self.inner, self.delay, self.one_time_s, self.seen = inner, delay, 0.0, False

        def run(self, inputs):
            if not self.seen:
                self.seen = True
                t0 = time.perf_counter()
                time.sleep(self.delay)  # a compile
                self.one_time_s += time.perf_counter() - t0
            return self.inner.run(inputs)

    # delays far above the real work of this tiny model, so a busy machine cannot blur them: counted
    # in the wrong place, each alone would exceed the bound asserted for that phase
    m.programs = {k: FirstRunIsSlow(p, 2.0 if k == "decode" else 1.5) for k, p in m.programs.items()}
    list(m.generate(IDS, max_tokens=6, temperature=0))
    s = m.last_stats
    assert s.compile_s >= 3.5 - 1e-3  # the prefill program's and the decode program's first runs
    assert s.prefill_s < 1.5 and s.decode_s < 2.0, s
    assert "first-run compile" in s.summary()


def test_a_cached_load_imports_neither_sympy_nor_graph_libraries(tmp_path, cache_dir):
    """A load that finds its program in the cache does only what a run needs: no symbolic
    algebra, no planners' graph library, no plotting (0.5 s here, 2.3 s on the H100 host)."""
    path = _model(tmp_path / "m.gguf")
    code = ("import sys, edgellm; m = edgellm.load(sys.argv[1], ctx=64); m.logits([3, 17]); "
            "print(sorted(m.cache_hits), [k for k in ('sympy', 'networkx', 'matplotlib', 'onnx') if k in sys.modules])")
    env = {**os.environ, "EDGELLM_CACHE_DIR": str(cache_dir)}
    runs = [subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                           timeout=300) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-500:]
    assert runs[0].stdout.split("]")[0] == "["  # the first load compiled
    assert runs[1].stdout.strip() == "['compiled', 'tokenizer'] []"


def _q4_model(path: Path) -> Path:
    # Q4_1 projections (cpu-fast's int4 packs, with the offset residue) and a Q8_0 embedding that is
    # also the output projection (its bf16 pack)
    spec = SyntheticSpec(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=96, weight_type="Q4_1",
                         embed_type="Q8_0", seed=3)
    return write_synthetic_gguf(path, spec, tokenizer=byte_bpe_vocab(512))


def test_cpu_fast_packed_weights_are_cached_and_mapped(tmp_path, cache_dir):
    path = _q4_model(tmp_path / "m.gguf")
    ref = edgellm.load(path, backend="cpu-fast", ctx=64, cache=False).logits(IDS)
    first = edgellm.load(path, backend="cpu-fast", ctx=64)
    assert "weights" not in first.cache_hits
    (entry,) = list((cache_dir / "programs").rglob("weights.bin"))
    second = edgellm.load(path, backend="cpu-fast", ctx=64)
    assert sorted(second.cache_hits) == ["compiled", "tokenizer", "weights"]
    assert second.backend.weights.built == 0  # nothing was repacked
    kinds = {p.kind for p in second.backend.weights._packs.values()}
    assert kinds == {"int4", "int4x2"}
    np.testing.assert_array_equal(first.logits(IDS), ref)
    np.testing.assert_array_equal(second.logits(IDS), ref)
    assert entry.exists()
    # the cpu backend keeps float32 weights: it neither reads nor writes the packs
    assert "weights" not in edgellm.load(path, ctx=64).cache_hits


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_packed_weights_are_rebuilt_with_identical_logits(tmp_path, cache_dir, damage):
    path = _q4_model(tmp_path / "m.gguf")
    ref = edgellm.load(path, backend="cpu-fast", ctx=64, cache=False).logits(IDS)
    edgellm.load(path, backend="cpu-fast", ctx=64)
    (f,) = list((cache_dir / "programs").rglob("weights.bin"))
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[: len(data) * 2 // 3]
    elif damage == "flip":
        data[len(data) - 100] ^= 0x01  # one bit of the last pack's data
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    else:
        data = bytearray()
    f.write_bytes(bytes(data))
    m = edgellm.load(path, backend="cpu-fast", ctx=64)
    assert "weights" not in m.cache_hits
    np.testing.assert_array_equal(m.logits(IDS), ref)
    again = edgellm.load(path, backend="cpu-fast", ctx=64)  # rewritten by the load that found it damaged
    assert "weights" in again.cache_hits
    np.testing.assert_array_equal(again.logits(IDS), ref)


def test_array_artifacts_round_trip(tmp_path, cache_dir):
    pc = cache_mod.ProgramCache()
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.integers(0, 255, 17, dtype=np.uint8),
              "c": rng.integers(-9, 9, (2, 2, 3)).astype(np.int16)}
    pc.put_arrays("k", "x.bin", arrays, {"note": [1, 2]})
    meta, got = pc.get_arrays("k", "x.bin")
    assert meta == {"note": [1, 2]} and set(got) == set(arrays)
    for k, a in arrays.items():
        assert got[k].dtype == a.dtype and got[k].ctypes.data % 64 == 0
        np.testing.assert_array_equal(got[k], a)
    got["a"][0, 0] = 7.0  # mapped copy-on-write: the file keeps its bytes
    np.testing.assert_array_equal(pc.get_arrays("k", "x.bin")[1]["a"], arrays["a"])
    assert pc.get_arrays("k", "absent.bin") is None


def test_triton_key_is_remembered_between_processes(tmp_path, monkeypatch):
    """Triton's cache key (a hash of its 450 MB library, computed once per process) is kept in the
    engine's cache under the size and mtime of Triton's files: the first process computes it with
    Triton's own function, a later one reads it; a changed file, or a corrupt entry, computes it
    again. The remembered value is Triton's own."""
    pytest.importorskip("triton")
    import triton
    import triton.runtime.cache as tc

    from edgellm.backends.cuda import triton_key as tk

    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("EDGELLM_CACHE", raising=False)
    real = tc.triton_key
    calls = []

    def tritons_own():
        calls.append(1)
        return f"{triton.__version__}-{len(calls)}"

    def new_process():
        monkeypatch.setattr(tc, "triton_key", tritons_own)
        return tk.memoize_triton_key()

    assert new_process() == f"{triton.__version__}-1" and len(calls) == 1
    assert tc.triton_key() == f"{triton.__version__}-1" and len(calls) == 1  # installed
    assert new_process() == f"{triton.__version__}-1" and len(calls) == 1  # read back
    sig = tk.stat_signature
    monkeypatch.setattr(tk, "stat_signature", lambda root: sig(root) + "-changed")
    assert new_process() == f"{triton.__version__}-2" and len(calls) == 2  # a file changed
    for f in (tmp_path / "programs").rglob("triton_key"):
        f.write_bytes(f.read_bytes()[:-3] + b"xyz")  # corrupt every stored entry
    assert new_process() == f"{triton.__version__}-3" and len(calls) == 3
    monkeypatch.setenv("EDGELLM_CACHE", "0")
    assert new_process() is None and tc.triton_key is tritons_own
    monkeypatch.setenv("EDGELLM_CACHE", "1")
    monkeypatch.setattr(tk, "stat_signature", sig)
    monkeypatch.setattr(tc, "triton_key", real)
    assert tk.memoize_triton_key() == real()  # Triton's real key, remembered

