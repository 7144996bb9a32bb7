"""The cuda backend executes the same graphs as the cpu backend. On a machine without a GPU the
kernels run in Triton's interpreter on CPU tensors (EDGELLM_CUDA_DEVICE=cpu), on tiny models."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import edgellm  # noqa: E402
from edgellm.sampling import SamplingParams  # noqa: E402
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf  # noqa: E402

ON_GPU = torch.cuda.is_available()
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

MODELS = {
    "llama-q4_0-gqa2": SyntheticSpec(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=96, weight_type="Q4_0",
                                     embed_type="Q8_0", std=0.1, seed=21),
    "qwen2-q8_0-bias-untied": SyntheticSpec(arch="qwen2", n_layers=1, d_model=64, n_heads=4, n_kv_heads=1, ffn_dim=64,
                                            weight_type="Q8_0", tied=False, std=0.1, seed=22),
    "llama-f16-rope-freqs-q5": SyntheticSpec(n_layers=1, d_model=64, n_heads=2, n_kv_heads=2, ffn_dim=64,
                                             weight_type="F16", rope_freqs=True, type_overrides={
                                                 "blk.0.ffn_down.weight": "Q5_0"}, std=0.1, seed=23),
    # a Q4_K_M-like mix with the K-quants converted (EDGELLM_KQUANTS=converted): Q4_K (-> the Q4_1
    # layout) with a Q6_K v projection (q|k|v stacked as Q6M, exactly) and a Q5_0 down projection
    # (-> Q8_0, exact)
    "llama-q4_k-mixed": SyntheticSpec(n_layers=1, d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=256,
                                      weight_type="Q4_K", embed_type="Q8_0", type_overrides={
                                          "blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q5_0"},
                                      std=0.05, seed=24),
    # K-quants kept in their own terms (the default): Q4_K (the Q4K layout: gate|up, the embedding
    # and the tied output projection), a Q5_K o projection (Q5K), a Q6_K down projection (Q6K), and
    # a q|k|v stack of Q4_K with a Q6_K v (converted to one layout)
    "llama-q4_k-native": SyntheticSpec(n_layers=1, d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=256,
                                       weight_type="Q4_K", embed_type="Q4_K", type_overrides={
                                           "blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K",
                                           "blk.0.attn_output.weight": "Q5_K"},
                                       std=0.05, seed=25),
}


# heads of 32 (the attention kernels then write the output projection's int8 activations): for the
# decode-fusion test only (each whole-model case costs minutes in the interpreter)
HD32 = SyntheticSpec(n_layers=1, d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=96, weight_type="Q4_0",
                     embed_type="Q8_0", std=0.1, seed=23)


@pytest.fixture(autouse=True)
def _cuda_device(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("EDGELLM_CUDA_DEVICE", "cpu")


@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_logits_match_cpu(name, tmp_path, monkeypatch):
    spec = MODELS[name]
    monkeypatch.delenv("EDGELLM_KQUANTS", raising=False)
    if name == "llama-q4_k-mixed":
        monkeypatch.setenv("EDGELLM_KQUANTS", "converted")
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(spec.seed).integers(0, spec.vocab_size, 11).tolist()
    ref = edgellm.load(path, ctx=32).logits(ids)
    # two prefill chunks (of at most 8 tokens: the decode GEMVs); the K-quant model in the interpreter
    # in one chunk of 11 (the GEMM), its GEMVs taking over ten minutes there (they have kernel tests)
    slow = "q4_k" in name and not ON_GPU
    m = edgellm.load(path, backend="cuda", ctx=32, prefill_chunk=16 if slow else 8)
    fmts = {names: w.fmt for names, w in m.backend.weights._packed.items()}
    if name == "llama-q4_k-mixed":
        assert "Q4_1" in fmts.values() and not {"Q4K", "Q5K", "Q6K"} & set(fmts.values()), fmts
    if name.endswith("native"):
        assert {"Q4K", "Q5K", "Q6K"} <= set(fmts.values()), fmts
        assert fmts[("blk.0.ffn_down.weight",)] == "Q6K" and fmts[("token_embd.weight",)] == "Q4K", fmts
    got = m.logits(ids)
    assert got.shape == ref.shape and np.isfinite(got).all()
    # fp16 activations and caches: relative to the logit scale. The K-quant model is looser: measured
    # 0.60% on its decode steps with the Q4_K -> Q4_1 layout and q|k|v stacked as F16 (1.04% when every
    # K-quant was requantized to Q8_0), 0.12% (prefill and decode, interpreter) with the stack in Q6M
    tol = 1e-2 if "q4_k" in name else 5e-3
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    if slow:
        return
    # decode through the in-place fp16 cache: the same positions again, one token at a time
    steps = [m.forward(ids[:6], 0, all_logits=False)[-1]]
    steps += [m.forward([ids[i]], i, all_logits=False)[-1] for i in range(6, len(ids))]
    assert np.abs(np.stack(steps) - ref[5:]).max() <= tol * np.abs(ref).max()


def test_padded_prefill_matches_unpadded(tmp_path):
    """Prefill runs padded to a multiple of prefill_pad tokens (so prompts of nearby lengths share a
    CUDA graph): the logits of the real tokens, the last-token logits and the decode steps that
    follow must not see the padding rows. Repeated runs (captured and replayed on a GPU) agree."""
    spec = MODELS["llama-q4_0-gqa2"]
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(5).integers(0, spec.vocab_size, 11).tolist()
    ref = edgellm.load(path, backend="cuda", ctx=40, prefill_chunk=16)
    for prog in ("all", "last"):
        ref.programs[prog].prefill_pad = 0
    want = ref.logits(ids)
    want_next = ref.forward([ids[3]], 11, all_logits=False)
    m = edgellm.load(path, backend="cuda", ctx=40, prefill_chunk=16)
    for prog in ("all", "last"):
        m.programs[prog].prefill_pad = 8  # 11 tokens run as 16
    assert m.programs["all"]._padded(11, 0, 40) == 16 and m.programs["all"]._padded(11, 30, 40) == 11
    for _ in range(3):  # first run, capture, replay
        got = m.logits(ids)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
        last = m.forward(ids, 0, all_logits=False)
        np.testing.assert_allclose(last, want[-1:], rtol=0, atol=1e-3 * np.abs(want).max())
    # padding rows wrote K/V at positions 11..15: the next decode step overwrites row 11 first
    np.testing.assert_allclose(m.forward([ids[3]], 11, all_logits=False), want_next, rtol=0,
                               atol=1e-3 * np.abs(want_next).max())


def test_cuda_greedy_generation_matches_cpu(tmp_path):
    spec = MODELS["llama-q4_0-gqa2"]
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = [3, 17, 99, 5, 42]
    a = list(edgellm.load(path, ctx=32).generate_tokens(ids, 8, SamplingParams(temperature=0)))
    b = list(edgellm.load(path, backend="cuda", ctx=32).generate_tokens(ids, 8, SamplingParams(temperature=0)))
    assert a == b


def test_cuda_sampled_generation_draws_on_the_device(tmp_path):
    """A sampled generation loops on the device (the draw in the step, only token ids read back):
    each token is among the top-k of the logits the model gives for the sequence so far, a seed
    gives the same tokens again, another seed other tokens, and top-k 1 is the greedy answer."""
    spec = MODELS["llama-q4_0-gqa2"]
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = [3, 17, 99, 5, 42]
    m = edgellm.load(path, backend="cuda", ctx=32)
    loops = []
    prog = m.programs["decode"]
    orig = prog.loop_tokens
    prog.loop_tokens = lambda *a, **kw: (loops.append(a[3]), orig(*a, **kw))[1]
    p = SamplingParams(temperature=1.5, top_k=3, top_p=1.0, min_p=0.0, seed=7)
    got = list(m.generate_tokens(ids, 4, p))
    assert len(got) == 4 and loops and loops[-1] is not None and loops[-1].params == p
    # each token within the top 3 of its step's logits (all positions' logits from one prefill)
    logits = m.forward(ids + got[:-1], 0, all_logits=True)[len(ids) - 1:]
    for tok, row in zip(got, logits):
        assert tok in np.argsort(-row)[:3], (tok, np.sort(row)[-4:])
    assert list(m.generate_tokens(ids, 4, p)) == got
    assert list(m.generate_tokens(ids, 4, SamplingParams(temperature=1.5, top_k=3, seed=8))) != got
    greedy = list(m.generate_tokens(ids, 4, SamplingParams(temperature=0)))
    assert list(m.generate_tokens(ids, 4, SamplingParams(temperature=0.8, top_k=1, seed=3))) == greedy


@pytest.mark.skipif(not ON_GPU, reason="the warm-up's first-run work is the GPU's (compiles, captures)")
def test_load_warms_the_requests_draw(tmp_path):
    """load(sampling=...) warms the decode loop's step drawing as the requests will (`edgellm run`
    passes its sampling): the first such request has no first-run work left (compile_s 0), and
    draws the same tokens as a model whose warm-up took the argmax."""
    spec = MODELS["llama-q4_0-gqa2"]
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = [3, 17, 99, 5, 42]
    p = SamplingParams(temperature=0.8, top_k=40, seed=11)
    from edgellm.model import GenerationStats

    warm = edgellm.load(path, backend="cuda", ctx=32, sampling=p)
    stats = GenerationStats(prompt_tokens=len(ids))
    got = list(warm.generate_tokens(ids, 6, p, stats))  # the first request
    assert len(got) == 6 and stats.compile_s == 0.0, stats
    plain = edgellm.load(path, backend="cuda", ctx=32)
    stats = GenerationStats(prompt_tokens=len(ids))
    assert list(plain.generate_tokens(ids, 6, p, stats)) == got
    assert stats.compile_s > 0.0  # its first sampled request captured the loop's step itself


@pytest.mark.skipif(not ON_GPU, reason="the tuner times kernels on a GPU (the cpu device has none)")
def test_decode_gemvs_are_tuned_past_the_size_floor_only(tmp_path, monkeypatch):
    """With tuning on, the decode GEMVs whose weights reach configs.GEMV_TUNE_MIN_BYTES are timed
    (here the floor is lowered so that only the output projection, 8192 x 256 Q4_0, reaches it) and
    the smaller ones keep the default tile untimed; the tuned model's logits are the untuned one's."""
    spec = SyntheticSpec(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=8192,
                         weight_type="Q4_0", std=0.05, seed=35)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    from edgellm.backends.cuda.backend import _kernels

    monkeypatch.setattr(_kernels().configs, "GEMV_TUNE_MIN_BYTES", 512 << 10)  # output 1.1 MiB, blocks <= 0.3
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path / "cache"))
    ids = [3, 17, 99, 5, 42]
    logits = {}
    for tune in ("1", "0"):
        monkeypatch.setenv("EDGELLM_TUNE", tune)
        m = edgellm.load(path, backend="cuda", ctx=32)
        picks = [p for p in m.backend.tuner.report() if p["kernel"] == "gemv"]
        if tune == "1":
            assert picks and {p["key"][1] for p in picks} == {spec.vocab_size}, picks
            assert all(p["source"] in ("tuned", "cached") for p in picks), picks
        else:
            assert all(p["source"] == "default" for p in picks), picks
        m.forward(ids, 0, all_logits=False)
        logits[tune] = m.forward([7], len(ids), all_logits=False)
    assert np.isfinite(logits["1"]).all()
    assert np.abs(logits["1"] - logits["0"]).max() <= 5e-3 * np.abs(logits["0"]).max()


def test_cuda_unavailable_is_a_clear_error(tmp_path, monkeypatch):
    if ON_GPU:
        pytest.skip("a GPU is present")
    monkeypatch.delenv("EDGELLM_CUDA_DEVICE", raising=False)
    path = write_synthetic_gguf(tmp_path / "m.gguf", MODELS["llama-q4_0-gqa2"])
    with pytest.raises(edgellm.errors.BackendUnavailableError, match="--backend cpu"):
        edgellm.load(path, backend="cuda")


def test_unsupported_ops_are_delegated_to_cpu(tmp_path, monkeypatch):
    """A backend that lacks fused norm and gate/up kernels: the partitioner cuts the graph, those
    ops run on the cpu backend's kernels with transfers, and the logits stay right."""
    from edgellm.backends.info import CudaInfo

    monkeypatch.setattr(CudaInfo, "SUPPORTED_OPS", CudaInfo.SUPPORTED_OPS - {"add_rms_norm", "linear_swiglu"})
    spec = MODELS["llama-q4_0-gqa2"]
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(1).integers(0, spec.vocab_size, 7).tolist()
    ref = edgellm.load(path, ctx=32).logits(ids)
    m = edgellm.load(path, backend="cuda", ctx=32)
    c = m.compiled["all"]
    assert {s.backend for s in c.segments} == {"cuda", "cpu"} and c.transfers > 0
    assert m.programs["all"].delegated
    got = m.logits(ids)
    assert np.abs(got - ref).max() <= 5e-3 * np.abs(ref).max()
    steps = [m.forward(ids[:4], 0, all_logits=False)[-1]] + [m.forward([ids[i]], i, all_logits=False)[-1]
                                                             for i in range(4, len(ids))]
    assert np.abs(np.stack(steps) - ref[3:]).max() <= 5e-3 * np.abs(ref).max()


@pytest.mark.parametrize("name", ["llama-q4_0-gqa2", "llama-q4_0-hd32"])
def test_decode_fusions_match_unfused_program(tmp_path, monkeypatch, name):
    """The decode-stage kernel fusions (RoPE + KV write in the q|k|v GEMV epilogue, the int8 copy
    of the norm output written by the norm kernel and, with heads of 32-multiples, of the attention
    output by the attention kernel, the residual add + norm in the GEMV before it) give the logits
    of the unfused kernels, and the split-count buckets of decode attention (1 split, then more)
    agree with each other."""
    monkeypatch.setenv("EDGELLM_ACT_INT8", "1")  # every GEMV on int8 activations: the norm writes them
    monkeypatch.setenv("EDGELLM_NORM_TAIL", "1")  # opt-in
    spec = MODELS[name] if name in MODELS else HD32
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(5).integers(0, spec.vocab_size, 7).tolist()
    ref = edgellm.load(path, ctx=32).logits(ids)

    def decode_steps(fusion: str, keys_per_split: int):
        monkeypatch.setenv("EDGELLM_DECODE_FUSION", fusion)
        monkeypatch.setattr("edgellm.backends.cuda.kernels.configs.ATTN_DECODE_KEYS_PER_SPLIT", keys_per_split)
        m = edgellm.load(path, backend="cuda", ctx=256)  # up to 4 splits of 64 keys
        prog = m.programs["decode"]
        assert bool(prog._rope_into_gemv) == (fusion == "1") and bool(prog._xq_for) == (fusion == "1")
        assert bool(prog._norm_tail) == (fusion == "1")  # residual add + norm in the o / down GEMVs
        attn_out = {op.outputs[0] for op in prog.graph.ops if op.kind == "attention"}
        head_dim = spec.d_model // spec.n_heads
        assert bool(attn_out & set(prog._xq_for)) == (fusion == "1" and head_dim % 32 == 0)
        out = [m.forward([t], i, all_logits=False)[-1] for i, t in enumerate(ids)]
        return np.stack(out), prog
    fused, prog = decode_steps("1", 3)  # 1 split up to 3 keys, then 2, 3 splits
    assert prog._splits == 3
    plain, _ = decode_steps("0", 512)
    scale = np.abs(ref).max()
    # the first step (position 0, no rotation, one split) is the same arithmetic; later ones differ by
    # fp16 rounding (q|k rotated before rounding, split partials in fp32), which int8 re-quantization
    # of the next activations amplifies to ~1% (test_cuda_logits_match_cpu checks the float path tightly)
    assert np.abs(fused[0] - plain[0]).max() <= 1e-4 * scale
    assert np.abs(fused - plain).max() <= 2e-2 * scale
    # int8 activations against the float32 cpu reference
    assert np.abs(fused - ref).max() <= 3e-2 * scale and (fused.argmax(-1) == ref.argmax(-1)).mean() >= 0.8


def test_cuda_program_read_back_from_the_cache_gives_the_same_logits(tmp_path, monkeypatch):
    """A cached program (graphs with symbolic dimensions read back without sympy) runs on the
    cuda backend exactly as the freshly compiled one, prefill and decode."""
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path / "cache"))
    spec = MODELS["llama-q4_0-gqa2"]
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(5).integers(0, spec.vocab_size, 9).tolist()
    fresh = edgellm.load(path, backend="cuda", ctx=32, prefill_chunk=8, cache=False)
    edgellm.load(path, backend="cuda", ctx=32, prefill_chunk=8)  # fills the cache
    cached = edgellm.load(path, backend="cuda", ctx=32, prefill_chunk=8)
    assert "compiled" in cached.cache_hits
    np.testing.assert_array_equal(cached.logits(ids), fresh.logits(ids))
    a = list(fresh.generate_tokens(ids, 4, SamplingParams(temperature=0)))
    b = list(cached.generate_tokens(ids, 4, SamplingParams(temperature=0)))
    assert a == b


def test_gemvs_after_gemvs_skip_the_l2_prefetch(tmp_path, monkeypatch):
    """A decode GEMV launched right after another product (the down projection after gate|up) does
    not prefetch its weights before its PDL wait (the product before it streams through L2 then);
    every other product of the step does. Found here from the data flow: the products whose input
    comes from the gated product."""
    spec = MODELS["llama-q4_0-gqa2"]
    path = write_synthetic_gguf(tmp_path / "m.gguf", SyntheticSpec(**{**spec.__dict__, "n_layers": 2}))
    m = edgellm.load(path, backend="cuda", ctx=32, warmup=False, cache=False)
    prog = m.programs["decode"]
    producer = {t: op for op in prog.graph.ops for t in op.outputs}
    down = {op.name for op in prog.graph.ops
            if op.kind == "linear" and producer.get(op.inputs[0]) is not None
            and producer[op.inputs[0]].kind == "linear_swiglu"}
    assert len(down) == 2 and prog._after_gemv == down
    monkeypatch.setenv("EDGELLM_L2_PREFETCH_AFTER_GEMV", "1")
    m = edgellm.load(path, backend="cuda", ctx=32, warmup=False, cache=False)
    assert m.programs["decode"]._after_gemv == set()


def test_a_bad_prefetch_budget_is_a_clear_error(tmp_path, monkeypatch):
    path = write_synthetic_gguf(tmp_path / "m.gguf", MODELS["llama-q4_0-gqa2"])
    monkeypatch.setenv("EDGELLM_L2_PREFETCH_MB", "four")
    with pytest.raises(ValueError, match="EDGELLM_L2_PREFETCH_MB='four': expected a number of megabytes"):
        edgellm.load(path, backend="cuda", ctx=32, warmup=False, cache=False)


def _graph_in_a_cycle(x, capture):
    """A captured graph reachable only through a reference cycle: freed by the cyclic collector."""
    g = torch.cuda.CUDAGraph()
    with capture(g):
        x.add_(1)
    holder = {"graph": g}
    holder["self"] = holder


@pytest.mark.skipif(not ON_GPU, reason="captures CUDA graphs")
def test_a_capture_is_not_broken_by_a_collection_on_another_thread():
    """Models hold reference cycles, so an unused one's CUDA graphs are freed by the cyclic
    collector, on whichever thread allocates when it runs. A collection on another thread (the
    compile server's reader, an HTTP server's) during a capture would free a graph mid-capture,
    which the driver refuses and which invalidates the capture. backends/cuda/graphs.captured holds
    the collector off while it captures: with another thread allocating all along, every capture
    succeeds and replays the right sums."""
    import threading

    from edgellm.backends.cuda.graphs import captured

    x = torch.zeros(64, device="cuda")
    stop = threading.Event()

    def churn():  # allocations that would trigger collections
        while not stop.is_set():
            [[] for _ in range(2000)]
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        replays = 0
        for _ in range(40):
            _graph_in_a_cycle(x, captured)
            g = torch.cuda.CUDAGraph()
            with captured(g):
                for _ in range(64):
                    x.add_(1)
            g.replay()
            replays += 1
    finally:
        stop.set()
        t.join()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 64 * replays))  # (a capture records, it does not run)


def test_a_collection_on_another_thread_waits_for_an_open_capture():
    """backends/cuda/graphs.py's lock, without a GPU: while a capture holds it, a collection
    started on another thread waits (its start callback takes the lock) and runs after; the
    capturing thread's own collection is not held up (the lock is re-entrant)."""
    import gc
    import threading
    import time

    from edgellm.backends.cuda import graphs

    graphs._install()
    events = []
    with graphs._quiet:  # what captured() holds while a graph is captured
        gc.collect()
        events.append("own collection")
        t = threading.Thread(target=lambda: (gc.collect(), events.append("other thread's collection")))
        t.start()
        time.sleep(0.3)
        events.append("capture closed")
    t.join(10)
    assert events == ["own collection", "capture closed", "other thread's collection"]
