"""Sampling and the generation loop."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from edgellm.sampling import Sampler, SamplingError, SamplingParams


def _freqs(params, logits, n=20000):
    s = Sampler(params)
    counts = np.bincount([s(logits) for _ in range(n)], minlength=len(logits))
    return counts / n


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


LOGITS = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, 0.9], dtype=np.float32)


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.standard_normal(1000).astype(np.float32)
        assert Sampler(SamplingParams(temperature=0))(x) == int(np.argmax(x))


def test_temperature_sampling_matches_softmax():
    p = _freqs(SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=1), LOGITS)
    ref = _softmax(LOGITS.astype(np.float64) / 0.7)
    assert np.abs(p - ref).max() < 0.015


def test_top_k_keeps_k_most_likely():
    p = _freqs(SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, seed=2), LOGITS)
    keep = np.argsort(-LOGITS)[:3]
    ref = np.zeros_like(p)
    ref[keep] = _softmax(LOGITS[keep].astype(np.float64))
    assert np.abs(p - ref).max() < 0.015
    assert p[np.setdiff1d(np.arange(len(LOGITS)), keep)].sum() == 0


def test_top_p_keeps_smallest_set_reaching_p():
    probs = np.array([0.5, 0.27, 0.13, 0.06, 0.04])
    logits = np.log(probs)
    p = _freqs(SamplingParams(temperature=1.0, top_k=0, top_p=0.85, min_p=0.0, seed=3), logits)
    # cumulative 0.5, 0.77, 0.90 -> the first three reach 0.85
    ref = np.array([0.5, 0.27, 0.13, 0, 0]) / 0.9
    assert np.abs(p - ref).max() < 0.015


def test_min_p_drops_tokens_below_fraction_of_best():
    probs = np.array([0.4, 0.3, 0.2, 0.07, 0.03])
    p = _freqs(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=4), np.log(probs))
    # threshold 0.2 * 0.4 = 0.08: the last two go
    ref = np.array([0.4, 0.3, 0.2, 0, 0]) / 0.9
    assert np.abs(p - ref).max() < 0.015


def test_repetition_penalty():
    logits = np.array([3.0, 2.9, -1.0, -1.1])
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=1.5))
    assert s(logits, history=[]) == 0
    assert s(logits, history=[0]) == 1  # 3.0 / 1.5 = 2.0 < 2.9
    s2 = Sampler(SamplingParams(temperature=0, repetition_penalty=1.5))
    assert s2(np.array([-1.0, -1.2]), history=[0]) == 1  # -1.0 * 1.5 = -1.5 < -1.2


@pytest.mark.parametrize("rep,freq,pres", [(1.0, 0.7, 0.0), (1.0, 0.0, 1.3), (1.3, 0.4, 0.5), (1.0, -0.6, -0.2)])
def test_frequency_and_presence_penalties(rng, rep, freq, pres):
    """llama.cpp's penalties over the last repeat_last_n tokens, written out here per token: the
    repetition penalty, then count * frequency_penalty and presence_penalty subtracted. Greedy picks
    the reference's argmax; sampled, seeded draws are the unpenalized sampler's on the reference's
    logits (the same chain after the penalties)."""
    V, last_n = 300, 16
    logits = (rng.standard_normal(V) * 2).astype(np.float32)
    history = rng.integers(0, 20, 40).tolist()  # repeats among the first 20 ids
    want = logits.astype(np.float64)
    window = history[-last_n:]
    for t in set(window):
        v = want[t]
        v = v / rep if v > 0 else v * rep
        want[t] = v - window.count(t) * freq - pres
    base = dict(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres, repeat_last_n=last_n)
    assert Sampler(SamplingParams(temperature=0, **base))(logits, history) == int(np.argmax(want))
    sampled = dict(temperature=1.2, top_k=0, top_p=0.9, min_p=0.0, seed=11)
    a = Sampler(SamplingParams(**sampled, **base))
    b = Sampler(SamplingParams(**sampled))
    assert [a(logits, history) for _ in range(30)] == [b(want) for _ in range(30)]
    assert not SamplingParams(**base).chain_only and SamplingParams(frequency_penalty=0.0).chain_only


def test_seed_reproducible():
    s1, s2 = Sampler(SamplingParams(seed=42, top_k=0, min_p=0)), Sampler(SamplingParams(seed=42, top_k=0, min_p=0))
    draws = [s1(LOGITS) for _ in range(50)]
    assert draws == [s2(LOGITS) for _ in range(50)]
    assert len(set(draws)) > 1


def _full_sort_sampler(params, seed):
    """The sampler chain written plainly (a stable sort of the whole vocabulary): the reference,
    kept in benchmarks/bench_sampling.py, which times the two."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_sampling.py"
    spec = importlib.util.spec_from_file_location("bench_sampling", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.full_sort(params, seed)


@pytest.mark.parametrize("kw", [dict(), dict(top_k=0), dict(top_k=0, min_p=0), dict(top_k=0, min_p=0, top_p=0.999),
                                dict(top_k=5000, top_p=0.5, min_p=0), dict(top_k=0, top_p=1.0, min_p=0.2)])
def test_sampler_draws_as_a_full_sort_does(kw):
    """On a 128k vocabulary (logits of a peaked and of a flat distribution, with tied values) the
    sampler's candidates, their order and so its seeded draws are the full-sort reference's."""
    rng = np.random.default_rng(7)
    params = SamplingParams(temperature=0.8, seed=11, **kw)
    ours, ref = Sampler(params), _full_sort_sampler(params, 11)
    for scale in (6.0, 0.3):
        x = (rng.standard_normal(128256) * scale).astype(np.float32)
        x[rng.integers(0, len(x), 2000)] = x[int(np.argmax(x))]  # ties with the best
        x[rng.integers(0, len(x), 500)] = np.sort(x)[-300]  # ties inside the candidates
        assert [ours(x) for _ in range(30)] == [ref(x) for _ in range(30)]


def test_whole_vocabulary_draw_matches_the_softmax():
    """No cut on a vocabulary of 6,000 (the draw by blocks of 256): likely tokens placed at the
    blocks' edges and at the end are drawn as often as the softmax says, the others never alone."""
    x = np.full(6000, -4.0, dtype=np.float32)
    hot = [0, 255, 256, 511, 3000, 5999]
    x[hot] = [1.0, 0.5, 0.8, 0.2, 0.0, 1.2]
    p = _freqs(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=9), x, n=20000)
    ref = _softmax(x.astype(np.float64))
    assert np.abs(p[hot] - ref[hot]).max() < 0.015
    assert abs(p.sum() - p[hot].sum() - (1 - ref[hot].sum())) < 0.015


def test_sampler_without_a_cut_matches_the_softmax():
    """No top-k, top-p or min-p: drawn from the whole vocabulary's softmax (candidates unsorted)."""
    x = np.array([2.0, -1.0, 0.5, 1.5, 0.0, -3.0, 1.0, 0.7], dtype=np.float32)
    p = _freqs(SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=5), x)
    assert np.abs(p - _softmax(x.astype(np.float64) / 0.9)).max() < 0.015


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=1.0),
                                dict(top_k=-2), dict(repetition_penalty=0), dict(frequency_penalty=2.5),
                                dict(presence_penalty=-3.0)])
def test_bad_sampling_params(kw):
    with pytest.raises(SamplingError, match=list(kw)[0]):
        SamplingParams(**kw)


# -- the generation loop on the default model -----------------------------------------------------

def test_generate_streams_decoded_tokens(default_model):
    tok = default_model.tokenizer
    ids = default_model.prompt_tokens("Write a haiku about the sea.")
    pieces = list(default_model.generate(ids, max_tokens=24, temperature=0))
    tokens = list(default_model.generate_tokens(ids, 24, SamplingParams(temperature=0)))
    assert "".join(pieces) == tok.decode(tokens, skip_special=True)
    assert len(pieces) > 1


def test_stop_strings_cut_output(default_model):
    ids = default_model.prompt_tokens("List the days of the week, one per line.")
    full = "".join(default_model.generate(ids, max_tokens=40, temperature=0))
    assert len(full) > 20
    stop = full[12:16]
    first = full.find(stop)
    out = "".join(default_model.generate(ids, max_tokens=40, temperature=0, stop=[stop]))
    assert out == full[:first]
    assert default_model.last_stats.stop_reason == "stop string"


def test_stops_at_end_of_turn(default_model):
    out = "".join(default_model.generate("Say just the word: yes", max_tokens=64, temperature=0))
    assert default_model.last_stats.stop_reason == "eos"
    assert "<|im_end|>" not in out


def test_cli_answers_paris():
    r = subprocess.run([sys.executable, "-m", "edgellm", "run", "--temperature", "0", "-n", "32",
                        "What is the capital of France?"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr


def test_cli_info_default_model():
    r = subprocess.run([sys.executable, "-m", "edgellm", "info"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for words in ("llama", "layers        30", "Q4_1", "Q8_0", "gpt2", "smollm", "chat template yes"):
        assert words in r.stdout, words
