"""The native decode step (edgellm/backends/cpu_step.py): a one-token program lowered to one call
of the native library, against the float32 reference backend and the interpreter it replaces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edgellm
from edgellm.backends import cpu_native
from edgellm.errors import GraphError
from edgellm.synthetic import SyntheticSpec, quant_mix, write_synthetic_gguf

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason=f"no native library: {cpu_native.unavailable()}")

SMALL = dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=320)
# families and features the step lowers: formats of the products and the embedding, biases,
# untied output, RoPE frequency factors, long-RoPE factors, heads wider than d_model / n_heads,
# per-head q/k norms, multi-query attention
CASES = {
    "llama-q4_1": SyntheticSpec(arch="llama", weight_type="Q4_1", embed_type="Q8_0", seed=3, **SMALL),
    "qwen2-q4_0-bias": SyntheticSpec(arch="qwen2", weight_type="Q4_0", embed_type="Q4_0", seed=4, **SMALL),
    "llama-q8_0-untied-freqs": SyntheticSpec(arch="llama", weight_type="Q8_0", embed_type="Q4_1", output_type="Q4_0",
                                             tied=False, rope_freqs=True, seed=5, **SMALL),
    "phi3-longrope": SyntheticSpec(arch="phi3", weight_type="Q8_0", rope_factors=True, seed=6, **SMALL),
    "qwen3-qk-norm-head48": SyntheticSpec(arch="qwen3", weight_type="Q4_1", embed_type="Q8_0", head_dim=48, seed=7,
                                          **SMALL),
    "mistral-mqa": SyntheticSpec(arch="mistral", weight_type="Q4_0", embed_type="Q8_0", seed=8,
                                 **{**SMALL, "n_kv_heads": 1}),
    # K-quant files (llama-quantize's mixes), read through their plain block forms (Q4_K as Q4_1,
    # Q6_K and Q5_K as Q8_0; q|k|v of Q4_K with a Q6_K v as one Q8_0 stack): an untied Q4_K
    # embedding, a tied Q6_K one shared with the LM head, and Q5_0 / Q5_1 parts (llama-quantize's
    # fallbacks where a row is no whole super-block)
    "llama-q4_k_m-untied": quant_mix(SyntheticSpec(arch="llama", seed=9, tied=False,
                                                   **{**SMALL, "d_model": 256, "ffn_dim": 512}), "Q4_K_M"),
    "llama-q5_k_m-tied": quant_mix(SyntheticSpec(arch="llama", seed=10, **{**SMALL, "d_model": 256, "ffn_dim": 512}),
                                   "Q5_K_M"),
    "qwen2-q4_k_m-fallbacks": quant_mix(SyntheticSpec(arch="qwen2", seed=11, type_overrides={
        "blk.0.attn_k.weight": "Q5_0", "blk.1.ffn_up.weight": "Q5_1"}, **{**SMALL, "d_model": 256, "ffn_dim": 512}),
        "Q4_K_M"),
}


def _decode_program(model):
    progs = [p for p in model.programs.values() if getattr(p, "max_seq", None) == 1]
    assert len(progs) == 1
    return progs[0]


def _decode(model, ids):
    return np.stack([np.asarray(model.forward([t], i, all_logits=False)).ravel() for i, t in enumerate(ids)])


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_step_decodes_as_the_reference(tmp_path, monkeypatch, case):
    """Every decode step's logits close to the float32 reference's (as close as the interpreter's:
    both quantize the products' inputs to int8) and the KV caches written alike; the step's buffers are poisoned first, so a value it failed to write would show."""
    path = write_synthetic_gguf(tmp_path / f"{case}.gguf", CASES[case])
    ref = edgellm.load(path, backend="cpu", ctx=64)
    fast = edgellm.load(path, backend="cpu-fast", ctx=64)
    prog = _decode_program(fast)
    step = prog._native_step()
    assert step is not None, prog.step_unavailable
    for name, t in step.buf.items():
        if name not in prog.states:
            t.fill_(float("nan"))
    for s in (step.tmp, step.scores, step.xd, step.xs):
        s.fill_(float("nan"))
    ids = [3, 17, 5, 9, 30, 2, 11, 40, 7]
    a, b = _decode(ref, ids), _decode(fast, ids)
    assert np.isfinite(b).all()
    assert "decode step one native call" in fast.backend.describe()
    err = np.abs(a - b).max(1) / np.abs(a).max(1)
    # the products' int8 inputs: the interpreter errs as much (up to 4-5% at the first position of
    # these random models, where one key gives attention no averaging)
    assert (err <= 0.06).all(), err

    monkeypatch.setenv("EDGELLM_NATIVE_STEP", "0")
    interp = edgellm.load(path, backend="cpu-fast", ctx=64)
    c = _decode(interp, ids)
    assert _decode_program(interp).step_unavailable.endswith("(EDGELLM_NATIVE_STEP=0)")
    err_interp = np.abs(a - c).max(1) / np.abs(a).max(1)
    assert err.mean() <= 1.5 * err_interp.mean() + 1e-3, (err, err_interp)
    for name, cache in prog.states.items():  # the caches' written rows
        other = _decode_program(interp).states[name][:len(ids)]
        assert torch.allclose(cache[:len(ids)], other, rtol=0.05, atol=0.05 * float(other.abs().max())), name

    # (greedy answers: tests/test_cpu_fast.py's default model, which now decodes through the step;
    # a random model's near-tied logits would make them a coin toss)


def test_step_matches_the_interpreter_on_the_same_inputs(tmp_path):
    """One step from identical caches and input: the native step and the interpreter differ only
    by rounding (the norms' and attention's float orders; a product's int8 input may then round one
    code apart), far below the logits' scale."""
    spec = SyntheticSpec(arch="llama", weight_type="Q8_0", embed_type="Q8_0", seed=12, **SMALL)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    fast = edgellm.load(path, backend="cpu-fast", ctx=32)
    fast.forward([5, 6, 7, 8], 0, all_logits=False)  # the prompt program fills the caches
    prog = _decode_program(fast)
    saved = {n: t.clone() for n, t in prog.states.items()}
    inputs = {"tokens": np.array([9], np.int32), "start_pos": 4}
    native = prog.run(inputs)
    for n, t in prog.states.items():
        t.copy_(saved[n])
    interp = super(type(prog), prog).run(inputs)
    for name in native:
        a, b = native[name], interp[name]
        assert a.shape == b.shape
        assert (a - b).abs().max() <= 0.02 * b.abs().max(), name


def test_unsupported_graphs_keep_the_interpreter(tmp_path):
    """A family with an op the step lacks (gemma3: a scaled embedding, soft-capped logits) runs
    through the interpreter, and says why."""
    spec = SyntheticSpec(arch="gemma3", weight_type="Q4_0", embed_type="Q8_0", logit_softcap=30.0, seed=2, **SMALL)
    path = write_synthetic_gguf(tmp_path / "g.gguf", spec)
    ref = edgellm.load(path, backend="cpu", ctx=32)
    fast = edgellm.load(path, backend="cpu-fast", ctx=32)
    ids = [3, 4, 5]
    a, b = _decode(ref, ids), _decode(fast, ids)
    prog = _decode_program(fast)
    assert prog._step is None and "op '" in prog.step_unavailable
    assert f"decode step interpreted: {prog.step_unavailable}" in fast.backend.describe()
    assert np.abs(a - b).max() <= 0.05 * np.abs(a).max()


def test_native_step_rejects_bad_positions_and_tokens(tmp_path):
    spec = SyntheticSpec(arch="llama", weight_type="Q4_0", embed_type="Q8_0", seed=1, **SMALL)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    fast = edgellm.load(path, backend="cpu-fast", ctx=16)
    prog = _decode_program(fast)
    fast.forward([1], 0, all_logits=False)
    assert prog._step is not None
    rows = min(t.shape[0] for t in prog.states.values())
    with pytest.raises(GraphError, match=f"position {rows} outside"):
        prog.run({"tokens": np.array([1], np.int32), "start_pos": rows})
    with pytest.raises(GraphError, match="token id 256 outside the vocabulary of 256"):
        prog.run({"tokens": np.array([256], np.int32), "start_pos": 1})
    with pytest.raises(GraphError, match="token id -1"):
        prog.run({"tokens": np.array([-1], np.int32), "start_pos": 1})


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_step_gives_the_same_result_on_any_number_of_threads(tmp_path, threads):
    """The step's barrier and task counters (cpu_native.c: step_barrier_wait): one step from the
    same caches on 1, 3 and 8 threads (8: more than the machine's cores in CI, where waiting threads
    must yield theirs) gives bitwise the logits and cache rows of 2 threads; each row of a product
    and each head is computed whole by one thread, whichever it is, so nothing may differ."""
    spec = SyntheticSpec(arch="llama", weight_type="Q4_1", embed_type="Q8_0", seed=21, **SMALL)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    fast = edgellm.load(path, backend="cpu-fast", ctx=32)
    fast.forward([5, 6, 7, 8, 9], 0, all_logits=False)
    prog = _decode_program(fast)
    saved = {n: t.clone() for n, t in prog.states.items()}
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (2, threads):
            torch.set_num_threads(n)
            for name, t in prog.states.items():
                t.copy_(saved[name])
            out = prog.run({"tokens": np.array([11], np.int32), "start_pos": 5})
            outs.append(({k: v.clone() for k, v in out.items()}, {k: t.clone() for k, t in prog.states.items()}))
    finally:
        torch.set_num_threads(before)
    assert prog._native_step() is not None
    (a, ca), (b, cb) = outs
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for name in ca:  # the rows written (the prompt's and the step's; the rest were never set)
        assert torch.equal(ca[name][:6], cb[name][:6]), name
