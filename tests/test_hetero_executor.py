"""The split executor: a model placed over two processors gives the unsplit model's logits."""

import numpy as np
import pytest
import torch

import edgellm
from edgellm.hetero.executor import load_split
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf
from markers import ON_GPU_OR_SLOW

SPEC = SyntheticSpec(arch="llama", n_layers=4, weight_type="Q4_1", embed_type="Q8_0", seed=7)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("split") / "m.gguf", SPEC)


def _placement(pattern):
    return {"embed": pattern[0], **{f"blk.{i}": p for i, p in enumerate(pattern[1:-1])}, "head": pattern[-1]}


@pytest.mark.parametrize("pattern", [
    ("cpu", "cpu", "cpu:1", "cpu:1", "cpu", "cpu:1"),      # three cuts, head on the second processor
    ("cpu:1", "cpu", "cpu", "cpu", "cpu", "cpu"),          # only the embedding elsewhere
])
def test_split_logits_equal_unsplit(model_path, pattern):
    ids = np.random.default_rng(1).integers(0, SPEC.vocab_size, 11).tolist()
    ref = edgellm.load(model_path, backend="cpu-fast", ctx=32, prefill_chunk=8)
    m = load_split(model_path, _placement(pattern), ctx=32, prefill_chunk=8)
    prog = m.programs["decode"]
    assert len(prog.segments) == sum(a != b for a, b in zip(pattern, pattern[1:])) + 1
    # each layer's KV cache lives in the processor that owns it, and it is a different tensor
    assert m.states["cache.k.2"].data_ptr() != ref.states["cache.k.2"].data_ptr()
    np.testing.assert_array_equal(m.logits(ids), ref.logits(ids))
    # decode through the in-place caches on both sides
    a = [m.forward(ids[:5], 0, all_logits=False)[-1]] + [m.forward([t], 5 + i, all_logits=False)[-1]
                                                         for i, t in enumerate(ids[5:])]
    b = [ref.forward(ids[:5], 0, all_logits=False)[-1]] + [ref.forward([t], 5 + i, all_logits=False)[-1]
                                                           for i, t in enumerate(ids[5:])]
    np.testing.assert_array_equal(np.stack(a), np.stack(b))


def test_split_model_matches_float32_reference(model_path):
    ids = np.random.default_rng(2).integers(0, SPEC.vocab_size, 9).tolist()
    ref = edgellm.load(model_path, backend="cpu", ctx=32).logits(ids)
    got = load_split(model_path, _placement(("cpu", "cpu:1", "cpu", "cpu:1", "cpu", "cpu")), ctx=32).logits(ids)
    assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max()


def test_unplaced_unit_is_a_clear_error(model_path):
    with pytest.raises(edgellm.EdgeLLMError, match="no processor for"):
        load_split(model_path, {"embed": "cpu", "blk.0": "cpu"}, ctx=16)


@ON_GPU_OR_SLOW
def test_cuda_and_cpu_split_matches_reference(tmp_path, monkeypatch):
    """One layer on the cuda backend (on a GPU, or its kernels in Triton's interpreter on CPU
    tensors: 2026-11-24, passed in 876 s on the busy 2-core machine), the rest on cpu-fast: the
    split model follows the float32 reference."""
    pytest.importorskip("triton")
    import torch

    if not torch.cuda.is_available():
        monkeypatch.setenv("EDGELLM_CUDA_DEVICE", "cpu")
    spec = SyntheticSpec(arch="llama", n_layers=2, d_model=64, ffn_dim=128, weight_type="Q4_0", embed_type="Q8_0", seed=9)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(3).integers(0, spec.vocab_size, 5).tolist()
    ref = edgellm.load(path, backend="cpu", ctx=16).logits(ids)
    m = load_split(path, {"embed": "cpu", "blk.0": "cuda", "blk.1": "cpu", "head": "cpu"}, ctx=16)
    assert [s.processor for s in m.programs["decode"].segments] == ["cpu", "cuda", "cpu"]
    got = m.logits(ids)
    assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max()
    steps = [m.forward(ids[:3], 0, all_logits=False)[-1]] + [m.forward([ids[i]], i, all_logits=False)[-1] for i in (3, 4)]
    assert np.abs(np.stack(steps) - ref[2:]).max() <= 0.02 * np.abs(ref).max()


def test_row_split_unit_matches_unsplit(model_path, monkeypatch):
    """blk.1's products: 40% of the rows on one processor, the rest on the other at the same time.
    Both models' decode steps through the interpreter (a program with a split product is not
    lowered to the native step; the unsplit one would be, with other rounding in its norms)."""
    monkeypatch.setenv("EDGELLM_NATIVE_STEP", "0")
    ids = np.random.default_rng(4).integers(0, SPEC.vocab_size, 7).tolist()
    ref = edgellm.load(model_path, backend="cpu-fast", ctx=32)
    placement = _placement(("cpu", "cpu", "rows cpu 0.40 | cpu:1", "cpu", "cpu", "cpu"))
    m = load_split(model_path, placement, ctx=32)
    here = m.backend.processor("cpu").weights._packs
    there = m.backend.processor("cpu:1").weights._packs
    split_keys = [k for k in here if k[0][0].startswith("blk.1.")]
    assert split_keys and all(k[1] is not None and k[1][0] == 0 for k in split_keys)  # only the first share
    assert all(k[0][0].startswith("blk.1.") and k[1][0] > 0 for k in there)  # the other holds only the rest
    a, b = m.logits(ids), ref.logits(ids)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
    # the same prompt then decode steps on both (a decode step's products read int8-rounded inputs,
    # so they are compared with the unsplit model's decode steps, not its prompt logits)
    steps = [[mm.forward(ids[:4], 0, all_logits=False)[-1]] + [mm.forward([ids[i]], i, all_logits=False)[-1]
                                                               for i in (4, 5, 6)] for mm in (m, ref)]
    np.testing.assert_allclose(np.stack(steps[0]), np.stack(steps[1]), rtol=0, atol=1e-5 * np.abs(b).max())
    assert np.abs(np.stack(steps[1]) - b[3:]).max() <= 0.05 * np.abs(b).max()
    monkeypatch.delenv("EDGELLM_NATIVE_STEP")
    m = load_split(model_path, placement, ctx=32)  # the segment with the split stays interpreted
    m.forward(ids[:4], 0, all_logits=False)
    m.forward([ids[4]], 4, all_logits=False)
    (prog,) = [p for s, _, p in m.programs["decode"].parts if "blk.1.attn_norm.weight" in str(p.graph.ops)]
    assert prog._step is None and "not multiplied natively here" in prog.step_unavailable


def test_streamed_row_split_matches_unsplit(monkeypatch, tmp_path):
    """'rows cpu 0.50 | cuda': the layer runs on cpu-fast, which multiplies half of each product's
    rows while the cuda kernels (Triton's interpreter here) multiply the rest from weights copied
    into a few rotating slots; a prefill chunk streams every row. Prefill and decode steps
    alternate, so the slots' prefetched contents are wrong at every change of kind (and must be
    noticed): the logits stay the unsplit model's, within fp16 products."""
    pytest.importorskip("triton")
    import torch

    if not torch.cuda.is_available():
        monkeypatch.setenv("EDGELLM_CUDA_DEVICE", "cpu")
    import edgellm.hetero.stream as stream

    monkeypatch.setattr(stream, "SLOT_BYTES", 4096)  # gate|up (9 KiB) and the head (17 KiB) in pieces
    spec = SyntheticSpec(arch="llama", n_layers=3, d_model=64, ffn_dim=128, weight_type="Q4_0", embed_type="Q8_0",
                         seed=12)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(5).integers(0, spec.vocab_size, 26).tolist()
    ref = edgellm.load(path, backend="cpu", ctx=32, prefill_chunk=16)
    m = load_split(path, {"embed": "cpu", "blk.0": "rows cpu 0.50 | cuda", "blk.1": "cpu",
                          "blk.2": "rows cpu 0.25 | cuda", "head": "rows cpu 0.40 | cuda"}, ctx=32, prefill_chunk=16)
    st = m.backend._streamers["cuda"]
    # the CPU holds only its share of the split layers' rows; the GPU side every row, for prefill
    cpu_keys = [k for k in m.backend.processor("cpu").weights._packs if k[0][0].startswith(("blk.0.", "blk.2."))]
    assert cpu_keys and all(k[1] is not None and k[1][0] == 0 for k in cpu_keys)
    assert {k[1][0] for k in st._pieces} >= {0} and any(k[1][0] > 0 for k in st._pieces)
    assert max(len(p) for p in st._pieces.values()) >= 3 and st.slot_bytes_needed() <= 4096 + 3 * 256

    def run(model, plan):
        out, pos = [], 0
        for n in plan:
            out.append(model.forward(ids[pos:pos + n], pos, all_logits=False)[-1])
            pos += n
        return np.stack(out)

    plan = [12, 1, 1, 1, 9, 1]  # prefill (streams all rows), decode x3, prefill again, decode
    want = run(ref, plan)
    got = run(m, plan)
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
    assert set(st._orders) == {"prefill", "decode"} and st.bytes_copied > 0
    # every call's slot held what it multiplied: the products agree with cpu-fast's at 1e-2 too
    fast = run(edgellm.load(path, backend="cpu-fast", ctx=32, prefill_chunk=16), plan)
    assert np.abs(got - fast).max() <= 0.01 * np.abs(fast).max()


def test_streamed_prompts_with_cpu_decode_use_the_native_step(monkeypatch, tmp_path):
    """'rows cpu 1.00 | cuda': the unit's decode products are all the CPU's, its prompt chunks
    stream every row to the GPU (Triton's interpreter here): the CPU segment's decode step is
    still lowered to one native call, and the logits follow cpu-fast's."""
    pytest.importorskip("triton")
    import torch

    if not torch.cuda.is_available():
        monkeypatch.setenv("EDGELLM_CUDA_DEVICE", "cpu")
    spec = SyntheticSpec(arch="llama", n_layers=2, d_model=64, ffn_dim=128, weight_type="Q8_0", embed_type="Q8_0",
                         seed=13)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    ids = np.random.default_rng(6).integers(0, spec.vocab_size, 12).tolist()
    placement = {"embed": "cpu", "blk.0": "rows cpu 1.00 | cuda", "blk.1": "rows cpu 1.00 | cuda", "head": "cpu"}
    m = load_split(path, placement, ctx=32, prefill_chunk=16)
    fast = edgellm.load(path, backend="cpu-fast", ctx=32, prefill_chunk=16)
    got, want = ([mm.forward(ids[:9], 0, all_logits=False)[-1]]
                 + [mm.forward([t], 9 + i, all_logits=False)[-1] for i, t in enumerate(ids[9:])] for mm in (m, fast))
    progs = [p for _, _, p in m.programs["decode"].parts]
    assert len(progs) == 1 and progs[0]._step is not None, progs[0].step_unavailable
    assert m.backend._streamers["cuda"].bytes_copied > 0  # the prompt streamed its rows
    assert np.abs(np.stack(got) - np.stack(want)).max() <= 0.02 * np.abs(np.stack(want)).max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads pinned host memory from a GPU kernel: needs a GPU")
def test_upload_fp16_reads_pinned_memory_from_the_kernel():
    """The streamed products' x upload: a kernel reads the pinned buffer itself (not a copy queued
    on the link's copy engine); every element written, rounded as torch rounds."""
    from edgellm.backends.cuda.backend import _kernels

    K = _kernels()
    for t, f in ((1, 4096), (3, 14336), (37, 576)):
        h = (torch.randn(t, f) * 30).pin_memory()
        d = torch.full((t, f), float("nan"), dtype=torch.float16, device="cuda")
        K.upload_fp16(h, d)
        torch.cuda.synchronize()
        assert torch.equal(d.cpu(), h.half())
    with pytest.raises(ValueError, match="pinned"):
        K.upload_fp16(torch.randn(2, 8), torch.empty(2, 8, dtype=torch.float16, device="cuda"))
