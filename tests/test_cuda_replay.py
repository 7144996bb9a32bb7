"""Start-up images on a GPU: a model recorded after a cuda run and replayed through the driver
without torch gives the torch backend's own tokens and logits (bitwise: the same kernels with the
same arguments in the same order), and `edgellm run` replays it from the second run on, falling
back to the full load where the image lacks a step. Skipped without an NVIDIA GPU; the host-side
logic is tested everywhere by tests/test_replay.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

QUESTION = "What is the capital of France?"


@pytest.fixture(autouse=True)
def _default_model():
    from edgellm.default_model import default_model_path
    from edgellm.errors import ModelFileError

    try:
        default_model_path()
    except ModelFileError as e:
        pytest.skip(f"the trained default model: {e}")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty program cache, with Triton's kernel cache kept where it was (no recompiles)."""
    from edgellm.cache import cache_root

    monkeypatch.setenv("TRITON_CACHE_DIR", os.environ.get("TRITON_CACHE_DIR", str(cache_root() / "triton")))
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_replayed_model_matches_the_torch_backend(fresh_cache):
    import edgellm
    from edgellm.backends.cuda.replay import load_replay
    from edgellm.backends.cuda.replay_record import record
    from edgellm.sampling import SamplingParams

    m = edgellm.load(backend="cuda", ctx=1024)
    ids = m.prompt_tokens(QUESTION)
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=7)
    logits = m.forward(ids, 0, all_logits=False).copy()
    want_g = list(m.generate_tokens(ids, 40, greedy))
    want_s = list(m.generate_tokens(ids, 40, sampled))
    record(m, len(ids), 40, greedy)
    line = record(m, len(ids), 40, sampled)  # the second image holds the first one's steps too
    assert "start-up image saved" in line
    r = load_replay(ctx=1024)
    assert r is not None and "start-up image" in r.cache_hits
    try:
        assert r.backend.prepare(len(ids), 40, greedy, r.kv_chunk)
        assert r.backend.prepare(len(ids), 40, sampled, r.kv_chunk)
        assert not r.backend.prepare(len(ids), 900, greedy, r.kv_chunk)  # a context bucket not recorded
        got = r.forward(ids, 0, all_logits=False)
        assert np.isfinite(got).all() and np.array_equal(got, logits)
        assert list(r.generate_tokens(ids, 40, greedy)) == want_g
        assert list(r.generate_tokens(ids, 40, sampled)) == want_s
        text = "".join(r.generate(QUESTION, max_tokens=16, temperature=0))
        assert "Paris" in text
    finally:
        r.backend.close()


def test_a_damaged_image_is_not_replayed(fresh_cache):
    import edgellm
    from edgellm.backends.cuda.replay import ARTIFACT, load_replay
    from edgellm.backends.cuda.replay_record import record
    from edgellm.sampling import SamplingParams

    m = edgellm.load(backend="cuda", ctx=512)
    ids = m.prompt_tokens(QUESTION)
    record(m, len(ids), 8, SamplingParams(temperature=0.0))
    (image,) = Path(fresh_cache).rglob(ARTIFACT)
    data = bytearray(image.read_bytes())
    data[len(data) // 2] ^= 0xFF
    image.write_bytes(bytes(data))
    assert load_replay(ctx=512) is None
    assert not image.exists()  # the cache dropped the damaged entry


def _run(env, *extra):
    cmd = [sys.executable, "-m", "edgellm", "run", "--backend", "cuda", "--temperature", "0", *extra, QUESTION]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    return p.stdout, p.stderr


def test_edgellm_run_replays_from_the_second_run(fresh_cache):
    env = dict(os.environ)
    out1, err1 = _run(env, "-n", "8")
    assert "start-up image saved" in err1, err1
    out2, err2 = _run(env, "-n", "8")
    assert out2 == out1 and "start-up image" in err2.splitlines()[-1], err2
    out3, err3 = _run(env, "-n", "700")  # past the recorded context bucket: loaded in full, recorded anew
    assert "start-up image saved" in err3 and "cached: " in err3 and out3.startswith(out1.strip()[:20])
    out4, err4 = _run(env, "-n", "700")
    assert out4 == out3 and "start-up image" in err4.splitlines()[-1], err4
    out5, _ = _run({**env, "EDGELLM_REPLAY": "0"}, "-n", "8")
    assert out5 == out1
