"""Ring KV caches of sliding-window layers: a local layer keeps window + chunk - 1 rows, not the
whole context, and every way of running the model gives the logits of a full-context cache (the
cpu reference at prefill_chunk = ctx, where no layer's cache is a ring; tests/test_families.py
checks that one against transformers): chunked prefill, one program longer than the window,
decode past the window, prefix reuse after a rewind; cpu, cpu-fast and cuda (the Triton
interpreter at tiny sizes)."""

from __future__ import annotations

import numpy as np
import pytest

import edgellm
from edgellm.synthetic import SyntheticSpec, byte_bpe_vocab, write_synthetic_gguf

# layers 0 and 1 slide over 8 positions, layer 2 is global; 56 tokens are seven windows
SPEC = SyntheticSpec(arch="gemma3", n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, head_dim=24, ffn_dim=64,
                     vocab_size=512, sliding_window=8, swa_pattern=3, rope_theta=1e6, norm_eps=1e-6,
                     weight_type="F16", std=0.1, seed=7)
CTX, N = 64, 56
TOL = 1e-5  # the same float32 arithmetic over the same keys: only summation order may differ


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # a vocabulary: the server streams text
    return write_synthetic_gguf(tmp_path_factory.mktemp("ring") / "gemma3-swa8.gguf", SPEC, byte_bpe_vocab(512))


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(SPEC.seed).integers(0, SPEC.vocab_size, N).tolist()


@pytest.fixture(scope="module")
def full(path, ids):
    """Logits of every position with full-context caches (one program: no ring anywhere)."""
    m = edgellm.load(path, ctx=CTX, prefill_chunk=CTX, cache=False)
    assert all(t.shape[0] == CTX for t in m.states.values())
    return m.logits(ids)


def close(got, ref, tol=TOL) -> float:
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert err <= tol, f"max |dlogit| {err:.2e} of the logit scale"
    return err


def test_ring_sizes_and_bytes(path):
    m = edgellm.load(path, ctx=CTX, prefill_chunk=5, cache=False)
    kv = SPEC.n_kv_heads * SPEC.head_dim
    rows = {name: t.shape[0] for name, t in m.states.items()}
    # local layers: the window (8) before a chunk's first query + the chunk's other 4 tokens
    assert rows == {"cache.k.0": 12, "cache.v.0": 12, "cache.k.1": 12, "cache.v.1": 12,
                    "cache.k.2": CTX, "cache.v.2": CTX}
    held = sum(t.numel() * t.element_size() for t in m.states.values())
    assert held == 2 * (12 + 12 + CTX) * kv * 4
    from edgellm.backends import get_backend_info

    info = get_backend_info("cpu")
    assert info.kv_cache_bytes(m.config, CTX, 5) == held
    assert info.kv_cache_bytes(m.config, CTX) == 2 * 3 * CTX * kv * 4  # what a full cache would take
    # `edgellm plan` reports both and what the rings save
    from edgellm.compiler.report import plan_model, render_plan

    p = plan_model(str(path), ctx=CTX, prefill=5)
    assert p["kv_cache_bytes"] == held and p["kv_cache_bytes_full_context"] == 2 * 3 * CTX * kv * 4
    assert p["kv_rings"] == [{"window": 8, "rows": 12, "layers": 2}]
    assert "saved" in render_plan(p)


@pytest.mark.parametrize("backend", ["cpu", "cpu-fast"])
def test_ring_prefill_and_decode_match_full_cache(path, ids, full, backend):
    ref = full if backend == "cpu" else edgellm.load(path, ctx=CTX, prefill_chunk=CTX, cache=False,
                                                     backend=backend).logits(ids)
    # cpu-fast against itself: its products round their input to bf16, so a float32 difference in
    # the last bit (a window's keys summed in another order) can move an input by one bf16 step
    # (2^-8); a stale or missing key moves logits by tens of percent
    tol = TOL if backend == "cpu" else 1e-2
    for chunk in (5, 32):  # many chunks; a program (32 tokens) four windows long
        m = edgellm.load(path, ctx=CTX, prefill_chunk=chunk, cache=False, backend=backend)
        assert m.states["cache.k.0"].shape[0] == 8 + chunk - 1
        close(m.logits(ids), ref, tol)
    # decode past the window, wrapping the ring several times
    steps = [m.forward(ids[:20], 0, all_logits=False)[-1]]
    steps += [m.forward([ids[i]], i, all_logits=False)[-1] for i in range(20, N)]
    close(np.stack(steps), ref[19:], tol)


def test_prefix_reuse_after_rewind_is_exact(path, ids, full):
    m = edgellm.load(path, ctx=CTX, prefill_chunk=5, cache=False)  # rings of 12 rows
    slot = m.default_slot
    other = np.random.default_rng(1).integers(0, SPEC.vocab_size, 8).tolist()
    m.forward(ids[:40], 0, all_logits=False)  # the rings hold positions 28..39
    # a rewind to 38: its window (31..37) is still held, so 38 tokens are reused
    new = ids[:38] + other
    n = slot.reusable_prefix(new)
    assert n == 38
    close(m.forward(new[n:], n, all_logits=True), _full_logits(path, new)[n:])
    # a rewind to 30 needs positions 23..29, which later ones (up to 45) overwrote: nothing is reused...
    new = ids[:30] + other
    assert slot.reusable_prefix(new) == 0
    ref = _full_logits(path, new)
    # ...and a run from there is refused: what it would read is gone (the rows hold later positions)
    with pytest.raises(edgellm.errors.EdgeLLMError, match="no longer hold the window"):
        m.forward(new[30:], 30, all_logits=True)
    slot.ring_from.clear()  # pretend they were still held: the answer would be wrong
    stale = m.forward(new[30:], 30, all_logits=True)
    assert np.abs(stale - ref[30:]).max() > 100 * TOL * np.abs(ref).max()
    close(m.forward(new, 0, all_logits=True), ref)  # from the start: right
    # a chat turn on the slot goes the same way: generate_tokens reuses only what the rings hold
    m.forward(ids[:40], 0, all_logits=False)
    stats = edgellm.model.GenerationStats()
    list(m.generate_tokens(ids[:30] + other, 1, stats=stats, reuse_prefix=True))
    assert stats.cached_tokens == 0


def _full_logits(path, ids):
    return edgellm.load(path, ctx=CTX, prefill_chunk=CTX, cache=False).logits(ids)


def test_server_slots_keep_their_own_rings(path, ids):
    """edgellm serve's slot pool: a model whose rows stage cannot read rings gives each slot its own
    caches (rings included) and decodes them one at a time; interleaved requests past the window
    get the greedy tokens of a full-context cache."""
    from edgellm.sampling import SamplingParams
    from edgellm.serve.scheduler import Request, Scheduler
    from edgellm.session import SlotPool

    m = edgellm.load(path, ctx=CTX, prefill_chunk=5, cache=False)
    pool = SlotPool(m, 2)
    assert pool.batch is None and pool.slots[1].states["cache.k.0"].shape[0] == 12
    with pytest.raises(edgellm.errors.EdgeLLMError, match="sliding-window"):
        pool.decode([(pool.slots[0], 1, 0)])
    full = edgellm.load(path, ctx=CTX, prefill_chunk=CTX, cache=False)

    def greedy(prompt, n):
        out = []
        for _ in range(n):
            out.append(int(np.argmax(full.logits(prompt + out)[-1])))
        return out

    prompts = [ids[:14], ids[20:31]]
    got = [[] for _ in prompts]
    s = Scheduler(m, 2, chunk=4).start()
    try:
        done = []
        for p, g in zip(prompts, got):
            ev = __import__("threading").Event()
            done.append(ev)

            def on_event(e, g=g, ev=ev):
                if hasattr(e, "tokens"):
                    g.extend(e.tokens)
                else:
                    ev.set()
            s.submit(Request(p, 20, SamplingParams(temperature=0), ignore_eos=True, on_event=on_event))
        assert all(ev.wait(120) for ev in done)
    finally:
        s.stop()
    assert got == [greedy(p, 20) for p in prompts]


def test_webgpu_refuses_sliding_window_files(path):
    """The WGSL attention reads every cached row: a sliding-window file is refused with a one-line
    error rather than answered wrongly."""
    pytest.importorskip("wgpu")
    from edgellm.backends.webgpu.backend import WebgpuBackend

    if not WebgpuBackend.available():
        pytest.skip("no WebGPU adapter")
    with pytest.raises(edgellm.errors.EdgeLLMError, match="sliding-window attention layer.*--backend cpu"):
        edgellm.load(path, backend="webgpu", ctx=CTX, prefill_chunk=5, cache=False)
