"""The webgpu backend's WGSL kernels against the cpu backend's reference kernels (torch, float32).

Weights are quantized by gguf-py and dequantized by gguf-py for the reference, so the storage
descriptors' repacking and accessors are checked against the format's own reader. Shapes are off
the kernels' tile sizes; outputs are poisoned with NaN first so that an element never written
fails; inputs are fresh random values. Runs on any WebGPU adapter (in CI: Mesa's lavapipe);
skips with the reason where there is none.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

wgpu = pytest.importorskip("wgpu", reason="the webgpu backend needs the wgpu package (pip install 'edgellm[webgpu]')")

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gg_dequantize  # noqa: E402
from gguf.quants import quantize as gg_quantize  # noqa: E402

from edgellm.backends.cpu import CPU_KERNELS  # noqa: E402
from edgellm.graph.ir import Op  # noqa: E402
from edgellm.backends.webgpu import codegen, kernels  # noqa: E402
from edgellm.backends.webgpu.backend import DeviceWeight  # noqa: E402
from edgellm.backends.webgpu.launch import Chain, Launch, read_f32, upload_f32  # noqa: E402
from reference import chain_kept, draws_fit  # noqa: E402

FORMATS = ["F16", "Q8_0", "Q4_0", "Q4_1", "Q6_K", "Q5_1"]  # Q6_K -> the Q6 layout, Q5_1 -> Q6M
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")  # rows of whole 256-element super-blocks


def cols_for(fmt: str, k: int) -> int:
    """k, rounded up to whole super-blocks for the K-quants."""
    return -(-k // 256) * 256 if fmt in KQUANTS else k


@pytest.fixture(scope="module")
def dev(webgpu_dev):
    return webgpu_dev


def quantized(rng, rows: int, cols: int, fmt: str):
    """(raw GGUF data, the float32 matrix gguf-py reads back from it)."""
    w = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    if fmt == "F16":
        raw = w.astype(np.float16)
        return raw, raw.astype(np.float32)
    t = GGMLQuantizationType[fmt]
    if fmt in KQUANTS:  # gguf-py reads K-quants but does not write them: edgellm's quantizer
        from edgellm.quant import quantize

        raw = quantize(w, fmt)
    else:
        raw = gg_quantize(w, t)
    return raw, gg_dequantize(raw, t).reshape(rows, cols).astype(np.float32)


def nan_buffer(dev, n: int):
    return upload_f32(dev, np.full(n, np.nan, np.float32))


def ref(kind: str, inputs: list, **attrs):
    out = CPU_KERNELS[kind](Op("ref", kind, (), (), attrs), inputs)
    return out


def check(got: np.ndarray, want, tol: float = 2e-4):
    want = np.asarray(want.detach().numpy() if isinstance(want, torch.Tensor) else want, dtype=np.float32)
    got = got.reshape(want.shape)
    assert np.isfinite(got).all(), f"{np.isnan(got).sum()} of {got.size} elements not written"
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= tol * scale, f"max error {err} (scale {scale})"


# -- matrix products ---------------------------------------------------------------------------
def _linear_case(dev, rng, fmt, rows, n_out, k, *, glu=False, bias=False, residual=False, parts=None):
    k = cols_for(fmt, k)
    raw, dense = quantized(rng, 2 * n_out if glu else n_out, k, fmt)
    p = codegen.repack(raw, fmt, dense.shape)
    if p.fmt != fmt:  # converted (Q6_K's sub-block scales rounded to fp16: test_repack_other_formats)
        dense = codegen.dequantize_packed(p)
    w = DeviceWeight(p, dev, max_binding=parts)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    bufs = {kk: b for kk, (b, _, _) in w.resources().items()}
    bufs.update(X=upload_f32(dev, x), Y=nan_buffer(dev, rows * n_out))
    b = r = None
    if bias:
        b = rng.standard_normal(n_out).astype(np.float32)
        bufs["B"] = upload_f32(dev, b)
    if residual:
        r = rng.standard_normal((rows, n_out)).astype(np.float32)
        bufs["R"] = upload_f32(dev, r)
    X, D = torch.from_numpy(x), torch.from_numpy(dense)
    if glu:
        want = ref("linear_swiglu", [X, D[:n_out], D[n_out:]])
    else:
        ins = [X, D] + ([torch.from_numpy(b)] if bias else []) + ([torch.from_numpy(r)] if residual else [])
        want = ref("linear", ins, has_bias=bias, has_residual=residual)
    return w, bufs, want


def test_timing_after_an_idle_gap_raises_the_clock_first(dev, rng, monkeypatch):
    """Launch.time on a hardware adapter: after the GPU idled past CLOCK_IDLE_S it dispatches the
    kernel back to back for CLOCK_WARMUP_S before the timed pass (GPUs run idle clocks until
    loaded), and not again right after; the timing still comes back positive."""
    from edgellm.backends.webgpu import launch

    monkeypatch.setattr(type(dev.info), "software", property(lambda self: False))
    monkeypatch.setattr(launch, "CLOCK_WARMUP_S", 0.05)
    monkeypatch.setattr(launch, "MIN_PASS_S", 0.0)
    w, bufs, _ = _linear_case(dev, rng, "Q8_0", 1, 16, 64)
    L = Launch(dev, kernels.gemv(w.desc(), 16, "step.seq", rows_per_wg=16, wg=64), bufs)
    L.set_step(seq=1)
    passes = []
    real = launch.Chain._encode
    monkeypatch.setattr(launch.Chain, "_encode",
                        lambda self, cpass, repeat: (passes.append(repeat), real(self, cpass, repeat)))
    monkeypatch.setattr(dev, "_timed_at", 0.0, raising=False)
    t0 = time.perf_counter()
    assert L.time((1, 1, 1), repeat=3) > 0
    assert time.perf_counter() - t0 >= 0.05 and passes.count(16) >= 1 and passes[-1] == 3
    passes.clear()
    assert L.time((1, 1, 1), repeat=3) > 0
    assert 16 not in passes


def test_a_short_timed_pass_is_timed_again_longer(dev, rng, monkeypatch):
    """Launch.time on a hardware adapter: a pass of `repeat` dispatches shorter than MIN_PASS_S
    is followed by one of about MIN_PASS_S (the GPU kept busy, so its clock stays up), and the
    faster per-dispatch time of the two comes back; a pass already that long is not repeated."""
    from edgellm.backends.webgpu import launch

    monkeypatch.setattr(type(dev.info), "software", property(lambda self: False))
    monkeypatch.setattr(dev, "_timed_at", 1e18, raising=False)  # no clock warm-up
    w, bufs, _ = _linear_case(dev, rng, "Q8_0", 1, 16, 64)
    L = Launch(dev, kernels.gemv(w.desc(), 16, "step.seq", rows_per_wg=16, wg=64), bufs)
    L.set_step(seq=1)
    passes, times = [], []
    real = launch.Chain._time
    monkeypatch.setattr(launch.Chain, "_time", lambda self, repeat: (
        passes.append(repeat), times.append(real(self, repeat)), times[-1])[-1])
    one = L.time((1, 1, 1), repeat=2)
    monkeypatch.setattr(launch, "MIN_PASS_S", 40 * one)
    t = L.time((1, 1, 1), repeat=2)
    assert passes[-2] == 2 and passes[-1] > 2 and passes[-1] <= launch.MAX_REPEAT
    assert t == min(times[-2:]) > 0
    monkeypatch.setattr(launch, "MIN_PASS_S", 0.0)
    passes.clear()
    L.time((1, 1, 1), repeat=2)
    assert passes == [2]


def test_prefill_timing_operands_made_once_per_product(dev, rng, monkeypatch):
    """tuning._time_prefill: the candidates and rounds of one product's timing share one x, y and
    int8-x (x uploaded once, random, not zeros); another product's shape makes new ones."""
    from edgellm.backends.webgpu import launch, tuning

    uploads = []
    real = launch.upload_f32
    monkeypatch.setattr(launch, "upload_f32", lambda d, a: uploads.append(np.array(a)) or real(d, a))
    monkeypatch.setattr(tuning, "_PREFILL_IO", {})
    w, _, _ = _linear_case(dev, rng, "Q8_0", 1, 48, 64)
    cfgs = [{"int8": 2, "tm": 64, "tn": 64}, {"tm": 64, "tn": 64, "tk": 16}, {"int8": 1, "tm": 64, "tn": 64}]
    for cfg in cfgs + cfgs:
        assert tuning._time_prefill(dev, w, 48, False, 40, cfg) > 0
    assert len(uploads) == 1 and uploads[0].shape == (40 * 64,) and np.count_nonzero(uploads[0]) == 40 * 64
    assert tuning._time_prefill(dev, w, 48, False, 24, cfgs[0]) > 0
    assert len(uploads) == 2 and uploads[1].shape == (24 * 64,)


def test_tuner_weight_copies_are_the_weight(dev, rng, monkeypatch):
    """tuning.weight_copies on a hardware adapter: copies of a weight's buffers, made on the device,
    up to TIMING_BYTES in all, each byte-identical to the weight; one (the weight itself) on a
    software adapter."""
    from edgellm.backends.webgpu import tuning

    w, _, _ = _linear_case(dev, rng, "Q8_0", 1, 48, 64)
    nbytes = sum(b.size for b, _, _ in w.resources().values())
    monkeypatch.setattr(type(dev.info), "software", property(lambda self: True))  # as lavapipe, on any adapter
    assert len(tuning.weight_copies(dev, w)) == 1
    monkeypatch.setattr(type(dev.info), "software", property(lambda self: False))
    monkeypatch.setattr(tuning, "TIMING_BYTES", 5 * nbytes - 1)
    copies = tuning.weight_copies(dev, w)
    assert len(copies) == 5 and copies[0] == {k: b for k, (b, _, _) in w.resources().items()}
    for c in copies[1:]:
        assert c.keys() == copies[0].keys()
        for k, b in c.items():
            assert b is not copies[0][k] and dev.read(b, 0, b.size) == dev.read(copies[0][k], 0, b.size)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("subgroup,nr", [(False, 1), (True, 1), (False, 3)])
def test_gemv(dev, rng, fmt, subgroup, nr):
    """nr: features per thread (x read once for them); 77 features are not a multiple of any
    workgroup's rows, so the last workgroup computes features past the end and must not store them."""
    if subgroup and not dev.has_subgroups:
        pytest.skip("the adapter has no subgroups")
    rows, n_out, k = 3, 77, 96 if fmt == "F16" else 160
    w, bufs, want = _linear_case(dev, rng, fmt, rows, n_out, k, bias=True, residual=True)
    tpr = 4 if subgroup else 8
    per_wg = 64 * nr // tpr
    kern = kernels.gemv(w.desc(), n_out, "step.seq", bias=True, residual=True, rows_per_wg=per_wg, wg=64,
                        subgroup=subgroup, rows_per_thread=nr)
    L = Launch(dev, kern, bufs)
    L.set_step(seq=rows)
    L.run((-(-n_out // per_wg), 1, rows))
    check(read_f32(dev, bufs["Y"], rows * n_out), want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("subgroup,rows_per_warp,stage,pipeline,unroll,split", [
    (False, 1, False, False, 4, 1), (True, 1, False, False, 4, 1), (True, 3, True, False, 4, 1),
    (False, 2, True, False, 4, 1), (True, 3, True, True, 2, 1), (False, 2, False, True, 1, 1),
    (True, 2, False, False, 1, 4), (False, 3, False, True, 2, 2)])
def test_gemv_warp(dev, rng, fmt, subgroup, rows_per_warp, stage, pipeline, unroll, split):
    """The subgroup-per-rows GEMV: 77 features are not a multiple of any workgroup's rows (the
    last warps compute rows past the end and must not store them); 1,056 inputs are 33 blocks,
    so the lanes' last stride along a row is partial (pipeline: the step after the last loads
    clamped units it never uses; split: several subgroups share a row group)."""
    if subgroup and not dev.has_subgroups:
        pytest.skip("the adapter has no subgroups")
    rows, n_out, k = 3, 77, 1056
    w, bufs, want = _linear_case(dev, rng, fmt, rows, n_out, k, bias=True, residual=True)
    sg = min(32, dev.info.subgroup_min) if subgroup else 8
    kern = kernels.gemv_warp(w.desc(), n_out, "step.seq", bias=True, residual=True, rows_per_warp=rows_per_warp,
                             wg=4 * sg, sg=sg, subgroup=subgroup, stage=stage, pipeline=pipeline, unroll=unroll,
                             split=split)
    L = Launch(dev, kern, bufs)
    L.set_step(seq=rows)
    L.run((-(-n_out // kern.rows_per_group), 1, rows))
    check(read_f32(dev, bufs["Y"], rows * n_out), want)


def test_portable_f16_unpack(dev, monkeypatch):
    """On an adapter without unpack2x16float (wgpu's SHADER_F16_IN_F32) every kernel's h2 is the
    portable conversion (Device.pipeline): all 65,536 fp16 bit patterns read as numpy reads them
    (signed zeros, subnormals, infinities, NaNs), and GEMVs over F16 weights and Q8_0 / Q4_1
    blocks (fp16 scales) match the reference so."""
    monkeypatch.setattr(dev, "has_f16_unpack", False)
    monkeypatch.setattr(dev, "_pipelines", {})
    words = np.arange(1 << 16, dtype=np.uint32)[::2] | (np.arange(1 << 16, dtype=np.uint32)[1::2] << 16)
    src = (codegen.HELPERS + "@group(0) @binding(0) var<storage, read> W: array<u32>;\n"
           "@group(0) @binding(1) var<storage, read_write> O: array<vec2<f32>>;\n"
           "@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {\n"
           "    if (g.x < arrayLength(&W)) { O[g.x] = h2(W[g.x]); }\n}\n")
    assert codegen.H2_NATIVE in src
    lay = dev.layout(("read", "storage"))
    w, o = dev.upload(words), nan_buffer(dev, 1 << 16)
    bg = dev.device.create_bind_group(layout=lay, entries=[
        {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}} for i, b in enumerate((w, o))])
    enc = dev.device.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(dev.pipeline(src, lay))
    cp.set_bind_group(0, bg)
    cp.dispatch_workgroups(len(words) // 64)
    cp.end()
    dev.queue.submit([enc.finish()])
    got = read_f32(dev, o, 1 << 16)
    want = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert (got[~nan].view(np.uint32) == want[~nan].view(np.uint32)).all()  # bit for bit, -0.0 included
    rng = np.random.default_rng(5)
    for fmt in ("F16", "Q8_0", "Q4_1"):
        rows, n_out, k = 2, 45, 256
        wd, bufs, ref_y = _linear_case(dev, rng, fmt, rows, n_out, k, bias=True)
        kern = kernels.gemv_warp(wd.desc(), n_out, "step.seq", bias=True, rows_per_warp=2, wg=64, sg=8,
                                 subgroup=False, unroll=2)
        L = Launch(dev, kern, bufs)
        L.set_step(seq=rows)
        L.run((-(-n_out // kern.rows_per_group), 1, rows))
        check(read_f32(dev, bufs["Y"], rows * n_out), ref_y)
    assert all(codegen.H2_NATIVE in s for s in dev._pipelines)  # the sources as rendered; compiled portable


@pytest.mark.parametrize("fmt,norm,glu,stage,pipeline,split", [
    ("Q8_0", "rms", False, False, False, 1), ("Q4_0", "add_rms", False, True, False, 1),
    ("F16", "add_rms", True, False, False, 1), ("Q4_1", "rms", True, True, False, 1),
    ("Q8_0", "add_rms", True, True, True, 1), ("F16", "rms", False, False, True, 4), ("Q4_0", "add_rms", True, False, False, 2)])
def test_gemv_warp_folded_norm(dev, rng, fmt, norm, glu, stage, pipeline, split):
    """RMSNorm (of A, or of A + B with the sum written to S) folded into the GEMV's prologue,
    against the cpu backend's rms_norm then linear on the same values."""
    if not dev.subgroup_size:
        pytest.skip("the adapter's subgroup size is unknown")
    rows, n_out, k = 3, 45, 544
    raw, dense = quantized(rng, 2 * n_out if glu else n_out, k, fmt)
    w = DeviceWeight(codegen.repack(raw, fmt, dense.shape), dev)
    a = rng.standard_normal((rows, k)).astype(np.float32)
    b = rng.standard_normal((rows, k)).astype(np.float32)
    g = (1.0 + 0.3 * rng.standard_normal(k)).astype(np.float32)
    bufs = {kk: bb for kk, (bb, _, _) in w.resources().items()}
    bufs.update(A=upload_f32(dev, a), G=upload_f32(dev, g), Y=nan_buffer(dev, rows * n_out))
    if norm == "add_rms":
        bufs.update(B=upload_f32(dev, b), S=nan_buffer(dev, rows * k))
    x = torch.from_numpy(a + b if norm == "add_rms" else a)
    normed = ref("rms_norm", [x, torch.from_numpy(g)], eps=1e-5)
    D = torch.from_numpy(dense)
    want = ref("linear_swiglu", [normed, D[:n_out], D[n_out:]]) if glu else ref("linear", [normed, D])
    sg = min(32, dev.subgroup_size)
    kern = kernels.gemv_warp(w.desc(), n_out, "step.seq", rows_per_warp=2, wg=4 * sg, sg=sg, unroll=2, glu=glu,
                             norm=norm, eps=1e-5, stage=stage, pipeline=pipeline, split=split)
    L = Launch(dev, kern, bufs)
    L.set_step(seq=rows)
    L.run((-(-n_out // kern.rows_per_group), 1, rows))
    check(read_f32(dev, bufs["Y"], rows * n_out), want)
    if norm == "add_rms":
        check(read_f32(dev, bufs["S"], rows * k), a + b)


@pytest.mark.parametrize("fmt,norm,rows_per_warp,split,unroll,planes", [
    ("Q8_0", None, 2, 1, 1, 1), ("Q8_0", "add_rms", 3, 1, 2, 1), ("Q8_0", None, 1, 4, 2, 1), ("Q8_0", "rms", 2, 2, 1, 1),
    ("Q4_0", None, 4, 1, 2, 1), ("Q4_0", "add_rms", 2, 2, 1, 1), ("Q4_1", "rms", 3, 1, 2, 1), ("Q6_K", None, 2, 1, 1, 1),
    ("Q5_1", "add_rms", 2, 2, 2, 1), ("Q8_0", "add_rms", 2, 1, 2, 2), ("Q4_0", None, 4, 2, 1, 2),
    ("Q4_1", "rms", 3, 1, 2, 2), ("Q6_K", None, 2, 1, 1, 2), ("Q5_1", None, 1, 1, 2, 2),
    ("Q4_0", "add_rms", 2, 1, 1, -1), ("Q8_0", None, 2, 1, 2, -2)])
def test_gemv_warp_int8_activations(dev, rng, fmt, norm, rows_per_warp, split, unroll, planes):
    """x staged as int8 blocks (gemv_warp's int8; Q6_K as the Q6 layout, Q5_1 as Q6M): against
    numpy computing the same thing (x, or its RMSNorm, rounded per 32-block to amax / 127 steps
    as pack4x8snorm does, and with planes 2 the residual rounded to steps 254 times finer, times
    the dequantized weight, in float64), much closer to that than to the float product, which
    it must still approximate (two planes: within 1/100 of one plane's error of it); 77
    features, 1,056 inputs (33 blocks; 1,280 for Q6_K's super-blocks), 3 rows. x is staged a vec4
    a thread with the block's maximum and sums shuffled between its 8 lanes; planes -1, -2: one
    or two planes without subgroups (a block a thread, sums in workgroup memory)."""
    if not dev.subgroup_size:
        pytest.skip("the adapter's subgroup size is unknown")
    subgroup = planes > 0
    planes = abs(planes)
    rows, n_out, k = 3, 77, cols_for(fmt, 1056)
    raw, dense = quantized(rng, n_out, k, fmt)
    packed = codegen.repack(raw, fmt, dense.shape)
    w = DeviceWeight(packed, dev)
    dense = codegen.dequantize_packed(packed)  # the layout's own values (Q6_K's scales rounded to fp16)
    a = rng.standard_normal((rows, k)).astype(np.float32)
    b = rng.standard_normal((rows, k)).astype(np.float32)
    g = (1.0 + 0.3 * rng.standard_normal(k)).astype(np.float32)
    bufs = {kk: bb for kk, (bb, _, _) in w.resources().items()}
    bufs["Y"] = nan_buffer(dev, rows * n_out)
    if norm:
        bufs.update(A=upload_f32(dev, a), G=upload_f32(dev, g))
        x = (a + b).astype(np.float64) if norm == "add_rms" else a.astype(np.float64)
        if norm == "add_rms":
            bufs.update(B=upload_f32(dev, b), S=nan_buffer(dev, rows * k))
        x = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-5) * g
    else:
        bufs["X"] = upload_f32(dev, a)
        x = a.astype(np.float64)
    blocks = x.reshape(rows, k // 32, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    xq = np.floor(0.5 + 127 * np.clip(blocks / amax, -1, 1)) * (amax / 127)
    one_plane_err = np.abs((xq.reshape(rows, k) - x) @ dense.astype(np.float64).T).max()
    if planes == 2:
        r = blocks - xq
        xq = xq + np.floor(0.5 + 127 * np.clip(r * 254 / amax, -1, 1)) * (amax / 127 / 254)
    emu = xq.reshape(rows, k) @ dense.astype(np.float64).T
    exact = x @ dense.astype(np.float64).T
    sg = min(32, dev.subgroup_size)
    kern = kernels.gemv_warp(w.desc(), n_out, "step.seq", rows_per_warp=rows_per_warp, wg=4 * sg * split, sg=sg,
                             unroll=unroll, stage=True, int8=True, norm=norm, eps=1e-5, split=split, planes=planes,
                             subgroup=subgroup)
    L = Launch(dev, kern, bufs)
    L.set_step(seq=rows)
    L.run((-(-n_out // kern.rows_per_group), 1, rows))
    got = read_f32(dev, bufs["Y"], rows * n_out).reshape(rows, n_out)
    assert np.isfinite(got).all()
    quant_err = np.abs(emu - exact).max()
    if planes == 1:
        assert np.abs(got - emu).max() <= 0.1 * quant_err, (np.abs(got - emu).max(), quant_err)
        assert quant_err <= 0.02 * np.abs(exact).max()
    else:  # the emulation's own error is float32-sized here: the kernel within that of it
        assert quant_err <= 0.01 * one_plane_err, (quant_err, one_plane_err)
        assert np.abs(got - emu).max() <= 1e-4 * np.abs(exact).max(), (np.abs(got - emu).max(), quant_err)


@pytest.mark.parametrize("fmt,planes,rows_per_warp,unroll", [("Q8_0", 2, 2, 1), ("Q8_0", 1, 1, 4), ("Q4_0", 2, 4, 2),
                                                             ("Q4_1", 1, 2, 2), ("Q6_K", 2, 2, 1), ("Q5_1", 2, 1, 2)])
def test_gemv_warp_reads_x_quantized_ahead(dev, rng, fmt, planes, rows_per_warp, unroll):
    """gemv_warp's xq: quantize_x first, then the GEMV reading x's codes, scales and sums from its
    arrays (no staging): the same numbers as the GEMV that quantizes x in its own prologue (the
    same rounding), and as numpy's product of x so rounded with the dequantized weight; bias and
    residual applied; 77 features, 3 rows, outputs poisoned first."""
    if not dev.subgroup_size:
        pytest.skip("the adapter's subgroup size is unknown")
    rows, n_out, k = 3, 77, cols_for(fmt, 1056)
    raw, dense = quantized(rng, n_out, k, fmt)
    packed = codegen.repack(raw, fmt, dense.shape)
    w = DeviceWeight(packed, dev)
    dense = codegen.dequantize_packed(packed).astype(np.float64)
    x = (rng.standard_normal((rows, k)) * np.exp(rng.uniform(-2, 2, (rows, 1)))).astype(np.float32)
    b, r = rng.standard_normal(n_out).astype(np.float32), rng.standard_normal((rows, n_out)).astype(np.float32)
    nb, sums = k // 32, kernels.int8_x_sums(packed.fmt)
    bufs = {kk: bb for kk, (bb, _, _) in w.resources().items()}
    bufs.update(X=upload_f32(dev, x), B=upload_f32(dev, b), R=upload_f32(dev, r), XQ=nan_buffer(dev, rows * k // 4),
                XD=nan_buffer(dev, rows * nb), XS=nan_buffer(dev, 2 * rows * nb), XQ2=nan_buffer(dev, rows * k // 4))
    q = Launch(dev, kernels.quantize_x(k, "step.seq", planes=planes, sums=sums), bufs)
    q.set_step(seq=rows)
    q.run((-(-nb // 64), rows, 1))
    sg = min(32, dev.subgroup_size)
    got = {}
    for ahead in (True, False):
        kern = kernels.gemv_warp(w.desc(), n_out, "step.seq", rows_per_warp=rows_per_warp, wg=4 * sg, sg=sg,
                                 unroll=unroll, stage=not ahead, int8=True, planes=planes, xq=ahead, bias=True,
                                 residual=True)
        assert ("XQ" in [bd.name for bd in kern.bindings]) == ahead and ("var<workgroup>" in kern.source) != ahead
        bufs["Y"] = nan_buffer(dev, rows * n_out)
        L = Launch(dev, kern, bufs)
        L.set_step(seq=rows)
        L.run((-(-n_out // kern.rows_per_group), 1, rows))
        got[ahead] = read_f32(dev, bufs["Y"], rows * n_out).reshape(rows, n_out)
        assert np.isfinite(got[ahead]).all()
    xq, _ = _int8_emulation(x, planes)
    emu = xq @ dense.T + b + r
    scale = np.abs(emu).max()
    assert np.abs(got[True] - got[False]).max() <= 1e-5 * scale
    assert np.abs(got[True] - emu).max() <= (2e-3 if planes == 1 else 1e-4) * scale


@pytest.mark.parametrize("fmt,planes,sums,rows_per_warp", [("Q8_0", 2, False, 4), ("Q4_0", 1, True, 8),
                                                            ("Q4_1", 2, True, 8), ("Q8_0", 1, False, 4)])
def test_gemv_warp_quantizes_its_output(dev, rng, fmt, planes, sums, rows_per_warp):
    """gemv_warp's qout: a gate|up GEMV also stores y as int8 blocks for the next GEMV's xq: y as
    the plain GEMV's (and the float64 swiglu), its codes, scales, sums and residual plane exactly
    quantize_x's of that y; 96 features (3 blocks; with 64 rows a workgroup the second's upper
    half lies past them), 3 rows, every output poisoned first."""
    if not dev.subgroup_size:
        pytest.skip("the adapter's subgroup size is unknown")
    rows, n_out, k = 3, 96, 160
    w, bufs, want = _linear_case(dev, rng, fmt, rows, n_out, k, glu=True)
    nb = n_out // 32
    for pre in ("Y", "X"):
        bufs.update({pre + "Q": nan_buffer(dev, rows * n_out // 4), pre + "D": nan_buffer(dev, rows * nb),
                     pre + "S": nan_buffer(dev, 2 * rows * nb), pre + "Q2": nan_buffer(dev, rows * n_out // 4)})
    sg = min(32, dev.subgroup_size)
    kern = kernels.gemv_warp(w.desc(), n_out, "step.seq", rows_per_warp=rows_per_warp, wg=8 * sg, sg=sg, unroll=2,
                             glu=True, qout=(planes, sums))
    assert kern.rows_per_group == 8 * rows_per_warp
    L = Launch(dev, kern, bufs)
    L.set_step(seq=rows)
    L.run((-(-n_out // kern.rows_per_group), 1, rows))
    y = read_f32(dev, bufs["Y"], rows * n_out)
    check(y, want)
    bufs["X"] = bufs["Y"]
    q = Launch(dev, kernels.quantize_x(n_out, "step.seq", planes=planes, sums=sums), bufs)
    q.set_step(seq=rows)
    q.run((1, rows, 1))
    for name, n in (("Q", rows * n_out), ("D", 4 * rows * nb), ("S", 8 * rows * nb), ("Q2", rows * n_out)):
        if (name == "S" and not sums) or (name == "Q2" and planes == 1):
            continue
        got, ref_ = dev.read(bufs["Y" + name], 0, n), dev.read(bufs["X" + name], 0, n)
        assert bytes(got) == bytes(ref_), name
    with pytest.raises(ValueError, match="qout"):  # 16 rows a workgroup
        kernels.gemv_warp(w.desc(), n_out, "1u", rows_per_warp=2, wg=8 * sg, sg=sg, glu=True, qout=(1, False))
    with pytest.raises(ValueError, match="qout"):  # 80 features
        kernels.gemv_warp(w.desc(), 80, "1u", rows_per_warp=4, wg=8 * sg, sg=sg, glu=True, qout=(1, False))


def test_gemv_warp_int8_needs_an_integer_format_staged():
    w = codegen.WeightDesc("W", "F16", 64, 64, (64,))
    with pytest.raises(ValueError, match="int8 activations need a weight in Q8_0, Q4_0"):
        kernels.gemv_warp(w, 64, "1u", stage=True, int8=True)
    w = codegen.WeightDesc("W", "Q4_0", 64, 64, (64,))
    with pytest.raises(ValueError, match="got Q4_0, stage False"):
        kernels.gemv_warp(w, 64, "1u", stage=False, int8=True)
    with pytest.raises(ValueError, match="x quantized ahead"):
        kernels.gemv_warp(w, 64, "1u", xq=True, int8=True, norm="rms")
    with pytest.raises(ValueError, match="x quantized ahead"):
        kernels.gemv_warp(w, 64, "1u", xq=True, stage=True)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_gemv_warp_swiglu_split_weight(dev, rng, fmt):
    """glu through decode_gemv's warp configuration, the weight split over binding parts."""
    from edgellm.backends.webgpu import tuning

    rows, n_out, k = 2, 40, 128
    w, bufs, want = _linear_case(dev, rng, fmt, rows, n_out, k, glu=True, parts=4096)
    assert len(w.part_rows) > 1
    cfg = tuning.warp_config(dev, rows_per_warp=2, wg=64)
    kern = kernels.decode_gemv(w.desc(), n_out, "step.seq", cfg, glu=True)
    L = Launch(dev, kern, bufs)
    L.set_step(seq=rows)
    L.run((-(-n_out // cfg["rows_per_wg"]), 1, rows))
    check(read_f32(dev, bufs["Y"], rows * n_out), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_swiglu_split_weight(dev, rng, fmt):
    """gate|up stacked, the weight split by rows across bindings (a small binding limit)."""
    rows, n_out, k = 2, 45, 64
    parts = 4096 if fmt in KQUANTS else 1024  # rows of 256 elements: a few parts, not dozens
    w, bufs, want = _linear_case(dev, rng, fmt, rows, n_out, k, glu=True, parts=parts)
    assert len(w.part_rows) > 2
    kern = kernels.gemv(w.desc(), n_out, "step.seq", glu=True, rows_per_wg=16, wg=64, rows_per_thread=2)
    L = Launch(dev, kern, bufs)
    L.set_step(seq=rows)
    L.run((-(-n_out // 16), 1, rows))
    check(read_f32(dev, bufs["Y"], rows * n_out), want)


@pytest.mark.parametrize("fmt,tiles", [(f, (64, 64, 32)) for f in FORMATS] + [("Q4_1", (128, 64, 16)), ("F16", (128, 128, 4)),
                                                                              ("Q8_0", (64, 128, 8))]
                         + [(f, (128, 64, 32, "pre")) for f in FORMATS] + [("Q8_0", (128, 128, 16, "pre")),
                                                                          ("Q4_0", (64, 64, 16, "pre"))])
@pytest.mark.parametrize("glu", [False, True])
def test_gemm(dev, rng, fmt, tiles, glu):
    """Rows and features off the tiles, k = 96 (several k-steps; with tk 32, three; with the
    register prefetch, "pre", the last tile's loads skipped)."""
    tm, tn, tk, *pre = tiles
    rows, n_out, k = 71, 70, 96
    w, bufs, want = _linear_case(dev, rng, fmt, rows, n_out, k, glu=glu, bias=not glu, residual=not glu)
    kern = kernels.gemm(w.desc(), n_out, "step.seq", glu=glu, bias=not glu, residual=not glu, tm=tm, tn=tn, tk=tk,
                        pre=bool(pre))
    L = Launch(dev, kern, bufs)
    L.set_step(seq=rows)
    L.run((-(-n_out // tn), -(-rows // tm), 1))
    check(read_f32(dev, bufs["Y"], rows * n_out), want)


@pytest.mark.parametrize("lanes", [1, 8])
@pytest.mark.parametrize("fmt,prologue,planes,rows", [("Q8_0", "rms", 2, 1), ("Q4_0", "add_rms", 2, 3),
                                                     ("Q5_1", "rms", 1, 2), ("Q8_0", "combine128", 2, 1),
                                                     ("Q4_0", "combine128", 1, 2), ("Q6_K", "add_rms", 1, 1),
                                                     ("Q8_0", "combine16", 2, 2), ("Q4_1", "plain", 2, 2),
                                                     ("Q8_0", "plain", 1, 1)])
def test_quantize_x_prologue_then_xq(dev, rng, fmt, prologue, planes, rows, lanes):
    """The prologue a decode GEMV folds (an RMSNorm, the residual add with it, the attention
    splits' merge) done once by quantize_x, then gemv_warp's xq reading the codes: the same
    numbers as the GEMV folding that prologue itself (its x staged and quantized per workgroup),
    and float64 numpy's product of x so made and rounded; S (the residual sum) written whole;
    outputs poisoned first. 37 features; 1,024 inputs (2,112 with a norm; 8 heads of 128 for the merge, or 64 of 16,
    a block spanning two heads; 5 splits: the 8-lane variant's merge reads them 4 at a time);
    "plain": x itself. lanes: a thread a block, or a vec4 a thread with 8 lanes a block."""
    if not dev.subgroup_size or dev.subgroup_size < lanes:
        pytest.skip(f"the adapter's subgroups are not {lanes} lanes or more")
    # a norm's row: 2,112 inputs, three workgroups of the 8-lane variant, the last partly past the row
    n_out, k = 37, cols_for(fmt, 2112 if prologue.endswith("rms") else 1024)
    raw, dense = quantized(rng, n_out, k, fmt)
    packed = codegen.repack(raw, fmt, dense.shape)
    w = DeviceWeight(packed, dev)
    dense = codegen.dequantize_packed(packed).astype(np.float64)
    nb, sums = k // 32, kernels.int8_x_sums(packed.fmt)
    bufs = {kk: bb for kk, (bb, _, _) in w.resources().items()}
    bufs.update(XQ=nan_buffer(dev, rows * k // 4), XD=nan_buffer(dev, rows * nb), XS=nan_buffer(dev, 2 * rows * nb),
                XQ2=nan_buffer(dev, rows * k // 4))
    splits, opts, qopts = 1, {}, {}
    if prologue.startswith("combine"):
        d = int(prologue[7:])
        h, splits = k // d, 5
        acc = rng.standard_normal((rows, h, splits, d))
        m, l = rng.uniform(-3, 3, (rows, h, splits)), rng.uniform(0.5, 4.0, (rows, h, splits))
        ws = np.concatenate([acc, m[..., None], l[..., None]], axis=-1).astype(np.float32)
        e = np.exp(ws[..., d].astype(np.float64) - ws[..., d].max(-1, keepdims=True))
        x = ((e[..., None] * ws[..., :d]).sum(2) / (e * ws[..., d + 1]).sum(-1)[..., None]).reshape(rows, k)
        bufs["WS"] = upload_f32(dev, ws)
        opts["combine"], qopts["combine"] = (h, d, 8, 1), (h, d)
    elif prologue == "plain":
        x = (rng.standard_normal((rows, k)) * np.exp(rng.uniform(-2, 2, (rows, 1)))).astype(np.float32)
        bufs["X"] = upload_f32(dev, x)
        x = x.astype(np.float64)
    else:
        a = rng.standard_normal((rows, k)).astype(np.float32)
        b = rng.standard_normal((rows, k)).astype(np.float32)
        g = (1.0 + 0.3 * rng.standard_normal(k)).astype(np.float32)
        bufs.update(A=upload_f32(dev, a), G=upload_f32(dev, g))
        s = a.astype(np.float64) + (b if prologue == "add_rms" else 0)
        if prologue == "add_rms":
            bufs.update(B=upload_f32(dev, b), S=nan_buffer(dev, rows * k))
        x = s / np.sqrt((s * s).mean(axis=1, keepdims=True) + 1e-5) * g
        opts = qopts = {"norm": prologue, "eps": 1e-5}
    q = kernels.quantize_x(k, "step.seq", planes=planes, sums=sums, lanes=lanes, **qopts)
    Q = Launch(dev, q, bufs)
    Q.set_step(seq=rows, n_splits=splits)
    sg = min(32, dev.subgroup_size)
    got = {}
    for ahead in (True, False):
        kern = kernels.gemv_warp(w.desc(), n_out, "step.seq", rows_per_warp=2, wg=4 * sg, sg=sg, unroll=2,
                                 stage=not ahead, int8=True, planes=planes, xq=ahead, **({} if ahead else opts))
        bufs["Y"] = nan_buffer(dev, rows * n_out)
        L = Launch(dev, kern, bufs)
        L.set_step(seq=rows, n_splits=splits)
        grid = (-(-n_out // kern.rows_per_group), 1, rows)
        if ahead:  # quantize_x then the GEMV, as one chain of dispatches (launch.Chain: the tuner's timing)
            qgrid = kernels.quantize_x_grid(k, rows, norm=prologue.endswith("rms"), lanes=lanes)
            Chain(dev, [(Q, qgrid), (L, grid)]).run()
            if prologue == "add_rms":
                check(read_f32(dev, bufs["S"], rows * k), a + b)
        else:
            L.run(grid)
        got[ahead] = read_f32(dev, bufs["Y"], rows * n_out).reshape(rows, n_out)
        assert np.isfinite(got[ahead]).all()
    xq, _ = _int8_emulation(x, planes)
    emu = xq @ dense.T
    scale = np.abs(emu).max()
    assert np.abs(got[True] - got[False]).max() <= 2e-5 * scale
    assert np.abs(got[True] - emu).max() <= (2e-3 if planes == 1 else 1e-4) * scale


def _int8_emulation(x: np.ndarray, planes: int) -> tuple[np.ndarray, np.ndarray]:
    """x rounded as the int8 activations are, in float64 (amax / 127 steps per 32-block,
    pack4x8snorm's rounding; planes 2: the residual in steps 254 times finer); and the block
    codes' half sums (the second plane's weighted by 1/254), for the quantizer's own check."""
    rows, k = x.shape
    blocks = x.astype(np.float64).reshape(rows, k // 32, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    q1 = np.floor(0.5 + 127 * np.clip(blocks / amax, -1, 1))
    xq = q1 * (amax / 127)
    codes = q1 * 254
    if planes == 2:
        q2 = np.floor(0.5 + 127 * np.clip((blocks - xq) * 254 / amax, -1, 1))
        xq = xq + q2 * (amax / 127 / 254)
        codes = codes + q2
    return xq.reshape(rows, k), codes


@pytest.mark.parametrize("fmt,tiles,planes,glu", [
    ("Q8_0", (64, 64), 1, False), ("Q4_0", (128, 64), 1, False), ("Q4_1", (64, 128), 1, True), ("Q6_K", (64, 64), 1, False),
    ("Q5_1", (128, 128), 1, True), ("Q8_0", (128, 64), 2, True), ("Q4_0", (64, 64), 2, False), ("Q6_K", (64, 128), 2, True),
    ("Q5_1", (64, 64), 2, False), ("Q4_K", (64, 64), 1, False)])
def test_gemm_int8(dev, rng, fmt, tiles, planes, glu):
    """quantize_x then gemm_int8 (Q6_K as the Q6 layout, Q5_1 and Q4_K as Q6M): the quantizer's
    codes, scales and sums against numpy's rounding of the same x, and the product against numpy
    computing the same thing in float64 (x so rounded, times the dequantized weight, plus bias
    and residual, or swiglu), much closer to that than to the float product, which it must still
    approximate; rows and features off the tiles (71 x 70 or 35 x 45, 352 inputs: 11 k-steps)."""
    tm, tn = tiles
    (rows, n_out), k = (35, 45) if glu else (71, 70), cols_for(fmt, 352)
    raw, dense = quantized(rng, 2 * n_out if glu else n_out, k, fmt)
    packed = codegen.repack(raw, fmt, dense.shape)
    dense = codegen.dequantize_packed(packed).astype(np.float64)
    w = DeviceWeight(packed, dev)
    x = (rng.standard_normal((rows, k)) * np.exp(rng.uniform(-2, 2, (rows, 1)))).astype(np.float32)
    nb = k // 32
    sums = kernels.int8_x_sums(packed.fmt)
    bufs = {kk: bb for kk, (bb, _, _) in w.resources().items()}
    bufs.update(X=upload_f32(dev, x), XQ=nan_buffer(dev, rows * k // 4), XD=nan_buffer(dev, rows * nb),
                Y=nan_buffer(dev, rows * n_out))
    if sums:
        bufs["XS"] = nan_buffer(dev, 2 * rows * nb)
    if planes == 2:
        bufs["XQ2"] = nan_buffer(dev, rows * k // 4)
    q = Launch(dev, kernels.quantize_x(k, "step.seq", planes=planes, sums=sums), bufs)
    q.set_step(seq=rows)
    q.run((-(-nb // 64), rows, 1))
    xq, codes = _int8_emulation(x, planes)
    amax = np.abs(x.astype(np.float64).reshape(rows, nb, 32)).max(axis=2)
    got_d = np.frombuffer(dev.read(bufs["XD"], 0, 4 * rows * nb), np.float32).reshape(rows, nb)
    np.testing.assert_allclose(got_d, amax / (127 if planes == 1 else 127 * 254), rtol=1e-6)
    got_q = np.frombuffer(dev.read(bufs["XQ"], 0, rows * k), np.int8).reshape(rows, nb, 32).astype(np.float64)
    if planes == 1:
        np.testing.assert_array_equal(got_q * 254, codes)
    if sums:
        got_s = np.frombuffer(dev.read(bufs["XS"], 0, 8 * rows * nb), np.int32).reshape(rows, nb, 2)
        want_s = codes.reshape(rows, nb, 2, 16).sum(axis=3) / (254 if planes == 1 else 1)
        if planes == 1:
            np.testing.assert_array_equal(got_s, want_s)
        else:  # a residual at a rounding tie in float32 (the kernel) against float64 (numpy): one code apart
            assert np.abs(got_s - want_s).max() <= 2 and (got_s == want_s).mean() > 0.97
    b = r = None
    if not glu:
        b, r = rng.standard_normal(n_out).astype(np.float32), rng.standard_normal((rows, n_out)).astype(np.float32)
        bufs.update(B=upload_f32(dev, b), R=upload_f32(dev, r))

    def product(xx):
        y = xx @ dense.T
        if glu:
            g, u = y[:, :n_out], y[:, n_out:]
            return g / (1 + np.exp(-g)) * u
        return y + b + r
    emu, exact = product(xq), product(x.astype(np.float64))
    kern = kernels.gemm_int8(w.desc(), n_out, "step.seq", glu=glu, bias=not glu, residual=not glu, tm=tm, tn=tn, planes=planes)
    L = Launch(dev, kern, bufs)
    L.set_step(seq=rows)
    L.run((-(-n_out // tn), -(-rows // tm), 1))
    got = read_f32(dev, bufs["Y"], rows * n_out).reshape(rows, n_out)
    assert np.isfinite(got).all()
    scale = np.abs(exact).max()
    quant_err = np.abs(emu - exact).max()
    assert np.abs(got - emu).max() <= 2e-5 * scale + (0.05 * quant_err if planes == 1 else 0), (np.abs(got - emu).max(), quant_err)
    assert quant_err <= (0.02 if planes == 1 else 1e-4) * scale, (quant_err, scale)


def test_gemm_int8_refuses_float_weights(dev, rng):
    w, _, _ = _linear_case(dev, rng, "F16", 1, 16, 64)
    with pytest.raises(ValueError, match="int8 products need a weight in Q8_0"):
        kernels.gemm_int8(w.desc(), 16, "step.seq")


@pytest.mark.parametrize("switch", ["1", "0"])
def test_precompile(dev, rng, monkeypatch, switch):
    """Device.precompile: with EDGELLM_WEBGPU_PRECOMPILE=1 the kernels' pipelines are compiled
    (in threads) into the device's cache, a kernel that does not compile is skipped without an
    error (its first use reports it), and a precompiled pipeline runs correctly; with 0 nothing
    is compiled ahead."""
    monkeypatch.setenv("EDGELLM_WEBGPU_PRECOMPILE", switch)
    n_out = 33 + 2 * int(switch) + int(rng.integers(0, 1000)) * 4  # sources this process has not compiled
    w, bufs, want = _linear_case(dev, rng, "Q8_0", 9, n_out, 64)
    good = [kernels.gemm(w.desc(), n_out, "step.seq", tm=64, tn=64, tk=16), kernels.quantize_x(32 * n_out, "step.seq")]
    bad = kernels.Kernel("broken", good[0].source.replace("fn main(", "fn main(oops "), good[0].bindings, 256)
    dev.precompile(good + [bad])
    assert all((k.source in dev._pipelines) == (switch == "1") for k in good)
    assert bad.source not in dev._pipelines
    L = Launch(dev, good[0], bufs)
    L.set_step(seq=9)
    L.run((-(-n_out // 64), 1, 1))
    check(read_f32(dev, bufs["Y"], 9 * n_out), want)


# -- row-wise kernels -----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "F16", "Q6_K", "Q5_1"])
def test_embedding(dev, rng, fmt):
    vocab, d, rows = 53, cols_for(fmt, 96), 5
    raw, dense = quantized(rng, vocab, d, fmt)
    p = codegen.repack(raw, fmt, dense.shape)
    dense = codegen.dequantize_packed(p)  # the layout's values (Q6_K's scales rounded to fp16)
    w = DeviceWeight(p, dev)
    ids = rng.integers(0, vocab, rows)
    bufs = {kk: b for kk, (b, _, _) in w.resources().items()}
    bufs.update(Y=nan_buffer(dev, rows * d), TOK=dev.upload(ids.astype(np.uint32)))
    L = Launch(dev, kernels.embedding(w.desc(), "step.seq"), bufs)
    L.set_step(seq=rows)
    L.run((1, rows, 1))
    check(read_f32(dev, bufs["Y"], rows * d), ref("embedding", [torch.from_numpy(dense), torch.from_numpy(ids)]))


@pytest.mark.parametrize("add,c,vec,sub", [(False, 333, None, False), (True, 333, None, True), (False, 1028, None, True),
                                           (True, 1028, None, False), (True, 4096, 1, True), (False, 4096, 4, True)])
def test_rms_norm(dev, rng, add, c, vec, sub):
    """rms_norm (+ residual add) against the cpu backend's, rows of a length off the workgroup's
    reach (333: scalar loads; 1028: vec4 loads, the last chunk one vec4 long), reduced through
    subgroups where the adapter has them or in workgroup memory."""
    rows = 3
    a, b = rng.standard_normal((2, rows, c)).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(c)).astype(np.float32)
    bufs = dict(A=upload_f32(dev, a), G=upload_f32(dev, g), O=nan_buffer(dev, rows * c))
    if add:
        bufs.update(B=upload_f32(dev, b), S=nan_buffer(dev, rows * c))
    sg = dev.subgroup_size if sub else 0
    L = Launch(dev, kernels.rms_norm(c, 1e-5, "step.seq", add=add, sg=sg, vec=vec), bufs)
    L.set_step(seq=rows)
    L.run((rows, 1, 1))
    A, B, G = (torch.from_numpy(v) for v in (a, b, g))
    if add:
        s, n = ref("add_rms_norm", [A, B, G], eps=1e-5)
        check(read_f32(dev, bufs["S"], rows * c), s)
    else:
        n = ref("rms_norm", [A, G], eps=1e-5)
    check(read_f32(dev, bufs["O"], rows * c), n)


@pytest.mark.parametrize("kind", ["add", "mul", "silu", "swiglu", "add_bias"])
def test_elementwise(dev, rng, kind):
    rows, c = 3, 301
    a, b = rng.standard_normal((2, rows, c)).astype(np.float32)
    if kind == "add_bias":
        b = b[0]
    bufs = dict(A=upload_f32(dev, a), B=upload_f32(dev, b), Y=nan_buffer(dev, rows * c))
    op = "add" if kind == "add_bias" else kind
    L = Launch(dev, kernels.elementwise(op, c, "step.seq", b_rows=kind != "add_bias"), bufs)
    L.set_step(seq=rows)
    L.run((-(-rows * c // 256), 1, 1))
    ins = [torch.from_numpy(a)] + ([] if kind == "silu" else [torch.from_numpy(b)])
    check(read_f32(dev, bufs["Y"], rows * c), ref(op, ins))


def test_last_row_and_argmax(dev, rng):
    rows, c = 4, 1000
    x = rng.standard_normal((rows, c)).astype(np.float32)
    x[-1, 17] = x[-1, 801] = 9.0  # a tie: the first index wins, as numpy's argmax
    bufs = dict(X=upload_f32(dev, x), Y=nan_buffer(dev, c))
    L = Launch(dev, kernels.last_row(c), bufs)
    L.set_step(seq=rows)
    L.run((-(-c // 256), 1, 1))
    last = read_f32(dev, bufs["Y"], c)
    check(last, ref("last_row", [torch.from_numpy(x)]))
    tok, hist = dev.upload(np.array([12345], np.uint32)), dev.upload(np.full(8, 12345, np.uint32))
    _argmax(dev, bufs["Y"], c, tok, hist)
    assert int(np.frombuffer(dev.read(tok, 0, 4), np.uint32)[0]) == int(np.argmax(x[-1])) == 17
    assert np.frombuffer(dev.read(hist, 0, 32), np.uint32).tolist() == [12345] * 5 + [17] + [12345] * 2


def _argmax(dev, x_buf, n: int, tok, hist) -> None:
    """kernels.argmax's two dispatches over n floats of x_buf (history slot 5)."""
    nwg = kernels.argmax_parallelism(n)
    bufs = dict(X=x_buf, TOK=tok, HIST=hist, PART=dev.upload(np.full(2 * nwg, 7, np.uint32)))
    k_part, k_pick = kernels.argmax(n)
    for k, grid in ((k_part, (nwg, 1, 1)), (k_pick, (1, 1, 1))):
        A = Launch(dev, k, bufs)
        A.dev.write(A.step_buf, np.array([1, 0, 1, 1, 1, 5, 0, 0], np.uint32))  # p0 = 5: the history slot
        A.run(grid)


@pytest.mark.parametrize("n", [5, 1024, 4099, 128256, 151936])
def test_argmax_over_a_vocabulary(dev, rng, n):
    """argmax's two passes (many workgroups, then one) over vocabulary-sized rows: numpy's
    argmax, the first of tied maxima (one in another workgroup's chunk, one past the last
    whole chunk), negative rows."""
    x = (rng.standard_normal(n) - 50).astype(np.float32)
    j = int(rng.integers(0, n))
    x[j] = -1.0
    tied = [j]
    if n > 4 * 256:
        k = n - 3 if j < n - 3 else 0
        x[k] = -1.0
        tied.append(k)
    tok, hist = dev.upload(np.array([12345], np.uint32)), dev.upload(np.full(8, 12345, np.uint32))
    _argmax(dev, upload_f32(dev, x), n, tok, hist)
    assert int(np.frombuffer(dev.read(tok, 0, 4), np.uint32)[0]) == int(np.argmax(x)) == min(tied)
    assert int(np.frombuffer(dev.read(hist, 0, 32), np.uint32)[5]) == min(tied)


def _draws(dev, x: np.ndarray, positions, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7):
    """The sampled token for logits x at each position: the dispatches of kernels.sample_plan."""
    n = len(x)
    nwg = kernels.sample_parallelism(n)
    tok, hist = dev.upload(np.array([12345], np.uint32)), dev.upload(np.full(4, 12345, np.uint32))
    bufs = dict(X=upload_f32(dev, x), TOK=tok, HIST=hist,
                SAMP=dev.upload(kernels.sample_words(temperature, top_k, top_p, min_p, seed)),
                STATE=dev.upload(kernels.sample_state()), PART=dev.upload(np.full(kernels.sample_part_words(n), 7, np.uint32)))
    launches = {name: Launch(dev, k, bufs) for name, k in kernels.sample_kernels(n).items()}
    out = []
    for pos in positions:
        for name, parallel in kernels.sample_plan(top_k, top_p, min_p, n):
            launches[name].set_step(start=int(pos))
            launches[name].run((nwg if parallel else 1, 1, 1))
        out.append(int(np.frombuffer(dev.read(tok, 0, 4), np.uint32)[0]))
    return out, np.frombuffer(dev.read(hist, 0, 16), np.uint32).tolist()


@pytest.mark.parametrize("cut", ["top_k", "top_p", "min_p", "all"])
def test_sample_keeps_the_chains_candidates(dev, rng, cut):
    """At a high temperature the draws spread evenly over the kept tokens: over 60 positions they
    hit every token that top-k -> top-p -> min-p keep (reference: the chain in float64) and no
    other. Each cut's parameter lies between two of this row's ranked tokens, keeping four."""
    x = rng.standard_normal(3001).astype(np.float32) * 3.0
    x64 = np.sort(x.astype(np.float64))[::-1]
    probs = np.exp(x64 - x64[0]) / np.exp(x64 - x64[0]).sum()
    cum = np.cumsum(probs)
    top_k, top_p, min_p = {
        "top_k": (4, 1.0, 0.0),
        "top_p": (0, float(cum[2] + cum[3]) / 2, 0.0),
        "min_p": (0, 1.0, float(probs[3] + probs[4]) / 2 / probs[0]),
        "all": (40, 0.999, float(probs[3] + probs[4]) / 2 / probs[0]),
    }[cut]
    want = chain_kept(x.astype(np.float64), top_k, top_p, min_p)
    assert len(want) == 4
    got, _ = _draws(dev, x, range(60), temperature=1e4, top_k=top_k, top_p=top_p, min_p=min_p)
    assert set(got) == want


@pytest.mark.parametrize("n,top_k,tied", [(140_001, 4, True), (9_000, kernels.SAMPLE_TOPK_MAX, True),
                                          (5_000, kernels.SAMPLE_TOPK_MAX + 1, False)])
def test_sample_top_k_ranks_as_a_stable_sort(dev, rng, n, top_k, tied):
    """Top-k keeps exactly k tokens, ties broken by the lower id (the chain's stable ranking), on
    rows spanning many workgroups (140,001 logits: the largest chunks a workgroup, 128 of them),
    with the tie at the cut in different workgroups (kept: the two of lower id), and at the
    ranked path's largest k (min-p then narrows the kept set to four: the ranked path's kept
    candidates sorted, their prefix taken); one past it takes the threshold passes. High temperature: 60 draws hit every kept
    token and no other."""
    x = (rng.standard_normal(n) * 0.5).astype(np.float32)
    order = rng.permutation(n)
    top = 3.0 + np.sort(rng.random(top_k + 4))[::-1].astype(np.float32)
    x[order[:top_k + 4]] = top
    if tied:  # four ranks about the cut share one value, far apart in the row: the cut falls inside the tie
        x[order[top_k - 2:top_k + 2]] = top[top_k - 2]
    min_p = 0.0
    if top_k > 4:  # keep four: min-p between the 4th and 5th probabilities
        x64 = np.sort(x.astype(np.float64))[::-1][:top_k]
        probs = np.exp(x64 - x64[0])
        min_p = float(probs[3] + probs[4]) / 2
    want = chain_kept(x.astype(np.float64), top_k, 1.0, min_p)
    assert len(want) == 4
    got, _ = _draws(dev, x, range(60), temperature=1e4, top_k=top_k, min_p=min_p)
    assert set(got) == want


def test_sample_top_k_ranks_nan_last(dev, rng):
    """A NaN logit ranks below every number (the host sampler's full-sort order): a top-k over a
    row with NaNs among its largest values keeps the k best numbers."""
    x = rng.standard_normal(5000).astype(np.float32)
    best = np.argsort(-x, kind="stable")[:4]
    x[rng.choice(np.setdiff1d(np.arange(5000), best), 3, replace=False)] = np.nan
    got, _ = _draws(dev, x, range(60), temperature=1e4, top_k=4)
    assert set(got) == set(best.tolist())


def test_sample_draws_the_tempered_distribution_and_greedy(dev, rng):
    """Draws over positions follow softmax(x / T) over the top-k (Pearson's chi-square against an
    exact float64 reference); a seed and position give the same token again; temperature 0 is the
    argmax, written to the history slot as argmax does."""
    V, N, temp = 37, 300, 0.7
    x = rng.standard_normal(V).astype(np.float32) * 2.0
    got, _ = _draws(dev, x, range(N), temperature=temp, top_k=10)
    kept = np.zeros(V, bool)
    kept[list(chain_kept(x.astype(np.float64), 10, 1.0, 0.0))] = True
    assert kept.sum() == 10 and kept[got].all()
    want = np.where(kept, np.exp((x - x.max()) / temp), 0.0)
    want /= want.sum()
    fits, stat = draws_fit(got, want)  # Pearson's chi-square against the exact probabilities
    assert fits, (stat, np.bincount(got, minlength=V), want * N)
    assert _draws(dev, x, range(20), temperature=temp, top_k=10)[0] == got[:20]
    assert _draws(dev, x, range(20), temperature=temp, top_k=10, seed=8)[0] != got[:20]
    greedy, hist = _draws(dev, x, [3], temperature=0.0, top_k=10)
    assert greedy == [int(np.argmax(x))] and hist == [int(np.argmax(x))] + [12345] * 3  # HIST[step.p0 = 0]


# -- RoPE, KV cache, attention --------------------------------------------------------------------
def _cache(dev, a: np.ndarray, kv: str):
    return dev.upload(a.astype(np.float16)) if kv == "f16" else upload_f32(dev, a)


def _read_cache(dev, buf, n: int, kv: str) -> np.ndarray:
    if kv == "f16":
        return np.frombuffer(dev.read(buf, 0, -(-2 * n // 4) * 4), np.float16)[:n].astype(np.float32)
    return read_f32(dev, buf, n)


@pytest.mark.parametrize("style,rope_dim,freqs,kv", [("norm", 16, False, "f32"), ("neox", 12, True, "f32"),
                                                     ("norm", 16, True, "f16")])
def test_rope_qkv_store(dev, rng, style, rope_dim, freqs, kv):
    """RoPE on q and k, k and v written to the cache rows of their positions (float32 or fp16 cache)."""
    from edgellm.backends.webgpu.backend import WebgpuBackend

    if kv == "f16" and not dev.has_f16:
        pytest.skip("the adapter has no shader-f16")
    h, g, d, rows, start, ctx = 5, 1, 16, 3, 6, 20
    qkv = rng.standard_normal((rows, (h + 2 * g) * d)).astype(np.float32)
    kc0, vc0 = rng.standard_normal((2, ctx, g * d)).astype(np.float32)  # rows outside start.. must survive
    if kv == "f16":
        kc0, vc0 = kc0.astype(np.float16).astype(np.float32), vc0.astype(np.float16).astype(np.float32)
    ff = (1 + rng.random(rope_dim // 2)).astype(np.float32) if freqs else None
    attrs = dict(n_heads=h, n_kv_heads=g, head_dim=d, rope_dim=rope_dim, theta=10000.0, style=style)
    # the tables as the backend makes them (float64 angles), from a stand-in for the weight file
    be = WebgpuBackend.__new__(WebgpuBackend)
    be.dev, be._tables = dev, {}
    be.weights = type("W", (), {"vector_host": staticmethod(lambda n: ff.astype(np.float64))})()
    cos, sin = be.rope_tables(attrs, rope_dim, "ff" if freqs else None, ctx)
    S = kernels.RopeSegment
    segs = [S(h, 0, "Q", True), S(g, h * d, "KC", True), S(g, (h + g) * d, "VC", False)]
    bufs = dict(X=upload_f32(dev, qkv), COS=cos, SIN=sin, Q=nan_buffer(dev, rows * h * d),
                KC=_cache(dev, kc0, kv), VC=_cache(dev, vc0, kv))
    L = Launch(dev, kernels.rope(segs, qkv.shape[1], d, rope_dim, style == "neox", "step.seq", kv), bufs)
    L.set_step(seq=rows, start=start)
    L.run((h + 2 * g, rows, 1))
    kc_ref, vc_ref = torch.from_numpy(kc0.copy()), torch.from_numpy(vc0.copy())
    ins = [torch.from_numpy(qkv), start, kc_ref, vc_ref] + ([torch.from_numpy(ff)] if freqs else [])
    q, _, _ = ref("rope_qkv_store", ins, **attrs)
    check(read_f32(dev, bufs["Q"], rows * h * d), q, 1e-5)
    if kv == "f16":  # the reference's values rounded as the cache stores them
        kc_ref, vc_ref = kc_ref.half().float(), vc_ref.half().float()
    check(_read_cache(dev, bufs["KC"], ctx * g * d, kv), kc_ref, 1e-5 if kv == "f32" else 1e-3)
    check(_read_cache(dev, bufs["VC"], ctx * g * d, kv), vc_ref, 0)


@pytest.mark.parametrize("fmt,rows_per_warp,rope_dim,freqs,kv,bias,norm,stage,style,split",
                         [("Q8_0", 2, 16, False, "f32", False, None, False, "norm", 1),
                          ("Q4_0", 4, 12, True, "f16", False, "rms", True, "norm", 1),
                          ("F16", 2, 16, True, "f32", True, None, True, "norm", 1),
                          ("Q4_1", 2, 8, False, "f16", False, "rms", False, "norm", 1),
                          ("Q8_0", 2, 16, False, "f32", True, "rms", True, "norm", 1),
                          ("Q8_0", 2, 16, False, "f32", True, "rms", True, "neox", 1),
                          ("Q4_0", 4, 12, True, "f16", False, None, False, "neox", 1),
                          ("Q8_0", 2, 16, False, "f32", True, "rms", False, "neox", 4),
                          ("F16", 2, 16, True, "f16", False, None, False, "norm", 2)])
def test_gemv_warp_rope_epilogue(dev, rng, fmt, rows_per_warp, rope_dim, freqs, kv, bias, norm, stage, style, split):
    """The q|k|v GEMV with rope_qkv_store's work in its epilogue (kernels.RopeFold): q rotated into
    Y, k rotated and v copied into the cache rows of their positions (rows outside them survive),
    against the cpu backend's (rms_norm,) linear then rope_qkv_store on the same values; partial
    rotary dimensions, frequency factors, a bias, a folded norm, a float32 or fp16 cache, adjacent
    or neox pairs; split: several subgroups per row group."""
    from edgellm.backends.webgpu.backend import WebgpuBackend

    if not dev.subgroup_size:
        pytest.skip("the adapter's subgroup size is unknown")
    if kv == "f16" and not dev.has_f16:
        pytest.skip("the adapter has no shader-f16")
    h, g, d, rows, start, ctx, k = 5, 1, 16, 3, 6, 20, 96
    n_out = (h + 2 * g) * d
    raw, dense = quantized(rng, n_out, k, fmt)
    w = DeviceWeight(codegen.repack(raw, fmt, dense.shape), dev)
    a = rng.standard_normal((rows, k)).astype(np.float32)
    gam = (1.0 + 0.3 * rng.standard_normal(k)).astype(np.float32)
    bv = rng.standard_normal(n_out).astype(np.float32)
    kc0, vc0 = rng.standard_normal((2, ctx, g * d)).astype(np.float32)
    if kv == "f16":
        kc0, vc0 = kc0.astype(np.float16).astype(np.float32), vc0.astype(np.float16).astype(np.float32)
    ff = (1 + rng.random(rope_dim // 2)).astype(np.float32) if freqs else None
    attrs = dict(n_heads=h, n_kv_heads=g, head_dim=d, rope_dim=rope_dim, theta=10000.0, style=style)
    be = WebgpuBackend.__new__(WebgpuBackend)
    be.dev, be._tables = dev, {}
    be.weights = type("W", (), {"vector_host": staticmethod(lambda n: ff.astype(np.float64))})()
    cos, sin = be.rope_tables(attrs, rope_dim, "ff" if freqs else None, ctx)
    bufs = {kk: bb for kk, (bb, _, _) in w.resources().items()}
    bufs.update(Y=nan_buffer(dev, rows * h * d), KC=_cache(dev, kc0, kv), VC=_cache(dev, vc0, kv), COS=cos, SIN=sin)
    if norm:
        bufs.update(A=upload_f32(dev, a), G=upload_f32(dev, gam))
    else:
        bufs["X"] = upload_f32(dev, a)
    if bias:
        bufs["BIAS" if norm else "B"] = upload_f32(dev, bv)
    x = torch.from_numpy(a)
    if norm:
        x = ref("rms_norm", [x, torch.from_numpy(gam)], eps=1e-5)
    qkv = ref("linear", [x, torch.from_numpy(dense)] + ([torch.from_numpy(bv)] if bias else []), has_bias=bias)
    kc_ref, vc_ref = torch.from_numpy(kc0.copy()), torch.from_numpy(vc0.copy())
    q, _, _ = ref("rope_qkv_store", [qkv, start, kc_ref, vc_ref] + ([torch.from_numpy(ff)] if freqs else []), **attrs)
    sg = min(32, dev.subgroup_size)
    kern = kernels.gemv_warp(w.desc(), n_out, "step.seq", rows_per_warp=rows_per_warp, wg=4 * sg, sg=sg, unroll=2,
                             bias=bias, norm=norm, eps=1e-5, stage=stage, split=split,
                             rope=kernels.RopeFold(h * d, g * d, d, rope_dim, style == "neox"),
                             dtypes={"KC": kv, "VC": kv})
    L = Launch(dev, kern, bufs)
    L.set_step(seq=rows, start=start)
    L.run((-(-n_out // kern.rows_per_group), 1, rows))
    check(read_f32(dev, bufs["Y"], rows * h * d), q)
    if kv == "f16":
        kc_ref, vc_ref = kc_ref.half().float(), vc_ref.half().float()
    tol = 2e-4 if kv == "f32" else 1e-3
    check(_read_cache(dev, bufs["KC"], ctx * g * d, kv), kc_ref, tol)
    check(_read_cache(dev, bufs["VC"], ctx * g * d, kv), vc_ref, tol)


@pytest.mark.parametrize("fmt,rows_per_warp,splits,rows,unroll", [
    ("Q8_0", 2, 3, 1, 1), ("Q4_0", 4, 8, 2, 1), ("F16", 1, 1, 1, 1), ("Q8_0", 2, 3, 1, 4), ("Q4_0", 4, 8, 2, 4),
    ("F16", 1, 1, 1, 4), ("Q8_0", 2, 7, 2, 2)])
def test_gemv_warp_combines_attention_splits(dev, rng, fmt, rows_per_warp, splits, rows, unroll):
    """The output projection's GEMV reading the attention output still split over the context
    (gemv_warp's combine): the splits merged as softmax partials, then the projection and the
    residual, against float64 numpy on the same partial values; unroll: that many splits loaded
    per step of the merge (split counts not a multiple of it)."""
    if not dev.subgroup_size:
        pytest.skip("the adapter's subgroup size is unknown")
    h, d, n_out, max_splits = 6, 16, 40, 8
    k = h * d
    raw, dense = quantized(rng, n_out, k, fmt)
    w = DeviceWeight(codegen.repack(raw, fmt, dense.shape), dev)
    acc = rng.standard_normal((rows, h, splits, d))
    m = rng.uniform(-3, 3, (rows, h, splits))
    l = rng.uniform(0.5, 4.0, (rows, h, splits))
    ws = np.concatenate([acc, m[..., None], l[..., None]], axis=-1).astype(np.float32)  # [rows, h, splits, d + 2]
    res = rng.standard_normal((rows, n_out)).astype(np.float32)
    e = np.exp(m.astype(np.float32).astype(np.float64) - m.max(-1, keepdims=True))
    x = (e[..., None] * ws[..., :d]).sum(2) / (e * ws[..., d + 1]).sum(-1)[..., None]  # [rows, h, d]
    want = x.reshape(rows, k) @ dense.astype(np.float64).T + res
    bufs = {kk: bb for kk, (bb, _, _) in w.resources().items()}
    bufs.update(WS=upload_f32(dev, ws), R=upload_f32(dev, res), Y=nan_buffer(dev, rows * n_out))
    sg = min(32, dev.subgroup_size)
    kern = kernels.gemv_warp(w.desc(), n_out, "step.seq", rows_per_warp=rows_per_warp, wg=4 * sg, sg=sg, unroll=2,
                             residual=True, stage=True, combine=(h, d, max_splits, unroll))
    L = Launch(dev, kern, bufs)
    L.set_step(seq=rows, n_splits=splits)
    L.run((-(-n_out // kern.rows_per_group), 1, rows))
    check(read_f32(dev, bufs["Y"], rows * n_out), want)


@pytest.mark.parametrize("fmt,efmt,stage,rope", [("Q8_0", "Q4_0", False, False), ("Q4_0", "Q8_0", True, True),
                                                ("F16", "Q4_1", True, False)])
def test_gemv_warp_embedding_prologue(dev, rng, fmt, efmt, stage, rope):
    """The first projection's GEMV reading its input straight from the embedding weight (rows of
    the step's tokens), RMSNorm folded in, the embedding rows written to S: against the cpu
    backend's embedding, rms_norm and linear (and rope_qkv_store, the epilogue too)."""
    from edgellm.backends.webgpu.backend import WebgpuBackend

    if not dev.subgroup_size:
        pytest.skip("the adapter's subgroup size is unknown")
    h, g, d, rows, start, ctx, k, vocab = 3, 1, 16, 3, 4, 12, 96, 50
    n_out = (h + 2 * g) * d
    raw, dense = quantized(rng, n_out, k, fmt)
    w = DeviceWeight(codegen.repack(raw, fmt, dense.shape), dev)
    eraw, edense = quantized(rng, vocab, k, efmt)
    e = DeviceWeight(codegen.repack(eraw, efmt, edense.shape), dev)
    tok = rng.integers(0, vocab, rows).astype(np.uint32)
    gam = (1.0 + 0.3 * rng.standard_normal(k)).astype(np.float32)
    bufs = {kk: bb for kk, (bb, _, _) in w.resources().items()}
    bufs.update({kk: bb for kk, (bb, _, _) in e.resources("E").items()})
    bufs.update(G=upload_f32(dev, gam), S=nan_buffer(dev, rows * k), TOK=dev.upload(tok),
                Y=nan_buffer(dev, rows * (h * d if rope else n_out)))
    emb = ref("embedding", [torch.from_numpy(edense), torch.from_numpy(tok.astype(np.int64))])
    y = ref("linear", [ref("rms_norm", [emb, torch.from_numpy(gam)], eps=1e-5), torch.from_numpy(dense)])
    opts = {}
    if rope:
        attrs = dict(n_heads=h, n_kv_heads=g, head_dim=d, rope_dim=d, theta=10000.0, style="norm")
        be = WebgpuBackend.__new__(WebgpuBackend)
        be.dev, be._tables = dev, {}
        cos, sin = be.rope_tables(attrs, d, None, ctx)
        kc0, vc0 = rng.standard_normal((2, ctx, g * d)).astype(np.float32)
        bufs.update(KC=upload_f32(dev, kc0), VC=upload_f32(dev, vc0), COS=cos, SIN=sin)
        kc_ref, vc_ref = torch.from_numpy(kc0.copy()), torch.from_numpy(vc0.copy())
        y, _, _ = ref("rope_qkv_store", [y, start, kc_ref, vc_ref], **attrs)
        opts["rope"] = kernels.RopeFold(h * d, g * d, d, d)
    sg = min(32, dev.subgroup_size)
    kern = kernels.gemv_warp(w.desc(), n_out, "step.seq", rows_per_warp=2, wg=4 * sg, sg=sg, unroll=2, norm="rms",
                             eps=1e-5, stage=stage, embed=e.desc("E"), **opts)
    L = Launch(dev, kern, bufs)
    L.set_step(seq=rows, start=start)
    L.run((-(-n_out // kern.rows_per_group), 1, rows))
    check(read_f32(dev, bufs["Y"], rows * (h * d if rope else n_out)), y)
    check(read_f32(dev, bufs["S"], rows * k), emb, 1e-6)
    if rope:
        check(read_f32(dev, bufs["KC"], ctx * g * d), kc_ref)
        check(read_f32(dev, bufs["VC"], ctx * g * d), vc_ref)


def test_gemv_warp_rope_epilogue_refuses_odd_rows():
    """A rotation pair must lie in one lane: an odd rows_per_warp is refused, naming the cause."""
    w = codegen.WeightDesc("W", "Q8_0", 64, 32, (64,))
    with pytest.raises(ValueError, match="even rows_per_warp"):
        kernels.gemv_warp(w, 64, "1u", rows_per_warp=1, rope=kernels.RopeFold(32, 16, 16, 16))


@pytest.mark.parametrize("rows,start,splits,kv", [(7, 0, 1, "f32"), (5, 9, 1, "f32"), (1, 70, 1, "f32"),
                                                  (1, 300, 3, "f32"), (6, 40, 1, "f16"), (1, 300, 4, "f16")])
def test_attention(dev, rng, rows, start, splits, kv):
    """Causal prefill (from an empty and a filled cache) and decode, whole and split over the context;
    GQA with 3 query heads per KV head; head_dim 80 (not a multiple of the 64 threads); float32 or
    fp16 cache (the reference reads the same fp16-rounded values)."""
    _check_attention(dev, rng, kernels.attention, rows, start, splits, kv, 80)


def _check_attention(dev, rng, template, rows: int, start: int, splits: int, kv: str, d: int, **opts) -> None:
    """A decode/prefill attention template (kernels.attention or attention_warp) on 6 query heads
    over 2 KV heads and a 320-row cache, whole (splits 1) or split over the context and merged by
    attention_combine, against the cpu reference; outputs poisoned first."""
    if kv == "f16" and not dev.has_f16:
        pytest.skip("the adapter has no shader-f16")
    h, g, ctx = 6, 2, 320
    q = rng.standard_normal((rows, h * d)).astype(np.float32)
    kc, vc = rng.standard_normal((2, ctx, g * d)).astype(np.float32)
    if kv == "f16":
        kc, vc = kc.astype(np.float16).astype(np.float32), vc.astype(np.float16).astype(np.float32)
    scale = 1 / math.sqrt(d)
    n = start + rows
    bufs = dict(Q=upload_f32(dev, q), KC=_cache(dev, kc, kv), VC=_cache(dev, vc, kv), O=nan_buffer(dev, rows * h * d))
    if splits == 1:
        L = Launch(dev, template(h, g, d, scale, "step.seq", partial=False, cache_dtype=kv, **opts), bufs)
        L.set_step(seq=rows, start=start)
        L.run((h, rows, 1))
    else:
        bufs["WS"] = nan_buffer(dev, rows * h * splits * (d + 2))
        split_len = -(-n // splits)
        P = Launch(dev, template(h, g, d, scale, "step.seq", partial=True, cache_dtype=kv, **opts), bufs)
        P.set_step(seq=rows, start=start, split_len=split_len, n_splits=splits)
        P.run((h, rows, splits))
        C = Launch(dev, kernels.attention_combine(h, d, "step.seq"), bufs)
        C.set_step(seq=rows, start=start, split_len=split_len, n_splits=splits)
        C.run((h, rows, 1))
    want = ref("attention", [torch.from_numpy(q), torch.from_numpy(kc), torch.from_numpy(vc), start],
               n_heads=h, n_kv_heads=g, head_dim=d, scale=scale)
    check(read_f32(dev, bufs["O"], rows * h * d), want, 1e-5)


@pytest.mark.parametrize("d,splits", [(6, 5), (8, 5), (128, 9), (64, 1)])
def test_attention_combine(dev, rng, d, splits):
    """attention_combine on random partials (unnormalised outputs, maxima, sums per head and
    split) against float64 numpy's merge: a vec4 a thread with the splits read 4 at a time
    (online softmax; split counts off that), or a thread per element where the head size is
    not a multiple of 4; every output written (poisoned first)."""
    h, rows = 3, 2
    acc = rng.standard_normal((rows, h, splits, d))
    m, l = rng.uniform(-30, 30, (rows, h, splits)), rng.uniform(0.5, 4.0, (rows, h, splits))
    ws = np.concatenate([acc, m[..., None], l[..., None]], axis=-1).astype(np.float32)
    w64 = ws.astype(np.float64)
    e = np.exp(w64[..., d] - w64[..., d].max(-1, keepdims=True))
    want = (e[..., None] * w64[..., :d]).sum(2) / (e * w64[..., d + 1]).sum(-1)[..., None]
    bufs = {"WS": upload_f32(dev, ws), "O": nan_buffer(dev, rows * h * d)}
    C = Launch(dev, kernels.attention_combine(h, d, "step.seq"), bufs)
    C.set_step(seq=rows, n_splits=splits)
    C.run((h, rows, 1))
    check(read_f32(dev, bufs["O"], rows * h * d), want.reshape(-1), 1e-5)


@pytest.mark.parametrize("rows,start,splits,kv,d,ahead,warps", [
    (1, 70, 1, "f32", 64, 2, 4), (1, 300, 3, "f32", 128, 2, 4), (3, 40, 1, "f16", 64, 3, 4), (1, 300, 4, "f16", 128, 1, 4),
    (2, 5, 1, "f32", 256, 2, 4), (1, 33, 5, "f32", 64, 2, 4), (2, 100, 2, "f32", 16, 2, 4), (1, 300, 3, "f16", 128, 4, 8),
    (2, 90, 2, "f32", 64, 2, 8), (1, 200, 4, "f32", 128, 4, 2)])
def test_attention_warp(dev, rng, rows, start, splits, kv, d, ahead, warps):
    """The lane-group decode attention against the cpu reference: whole and split over the
    context (a split past the keys a row sees is empty: 34 keys in 5 splits of 7), a few rows,
    GQA with 3 query heads per KV head, head sizes whose key rows a group of D / 4 lanes reads
    (several keys per subgroup at once: 64 on 32 lanes, 16 on 8) or a whole subgroup reads in
    two or more 16-byte steps (128 on a subgroup of 8 or 16, 256), float32 or fp16 cache,
    outputs poisoned first; 2, 4 or 8 subgroups a workgroup (the tuner's candidates)."""
    if not dev.subgroup_size:
        pytest.skip("the adapter's subgroup size is unknown")
    _check_attention(dev, rng, kernels.attention_warp, rows, start, splits, kv, d,
                     sg=min(32, dev.subgroup_size), keys_ahead=ahead, warps=warps)


@pytest.mark.parametrize("rows,start,splits,kv,d,warps,planes,sums", [
    (1, 300, 5, "f32", 64, 4, 1, True), (1, 40, 1, "f16", 64, 4, 2, False), (2, 200, 7, "f16", 128, 2, 2, True),
    (1, 33, 5, "f32", 64, 8, 1, False), (1, 300, 3, "f32", 256, 2, 1, True), (2, 90, 2, "f32", 32, 4, 2, True)])
def test_attention_warp_finish(dev, rng, rows, start, splits, kv, d, warps, planes, sums):
    """attention_warp split over the context with its splits merged by each head's last workgroup
    to finish (finish "o": O as the cpu reference's attention; finish "q": that O quantized for the
    output projection, byte for byte quantize_x's of it, dequantized within a rounding step of
    the reference), run twice on fresh queries (the arrival counters back at zero after each run:
    read back), a split past the keys a row sees empty (34 keys in 5 splits), head sizes 32 to
    256 (the merge's lanes per element and splits per lane vary), GQA, outputs poisoned first."""
    if not dev.subgroup_size:
        pytest.skip("the adapter's subgroup size is unknown")
    if kv == "f16" and not dev.has_f16:
        pytest.skip("the adapter has no shader-f16")
    sg = min(32, dev.subgroup_size)
    h, g, ctx = 6, 2, 320
    n, scale = start + rows, 1 / math.sqrt(d)
    k, nb = h * d, h * d // 32
    kc, vc = rng.standard_normal((2, ctx, g * d)).astype(np.float32)
    if kv == "f16":
        kc, vc = kc.astype(np.float16).astype(np.float32), vc.astype(np.float16).astype(np.float32)
    bufs = dict(KC=_cache(dev, kc, kv), VC=_cache(dev, vc, kv), CNT=dev.upload(np.zeros(rows * h, np.uint32)))
    kerns = {f: kernels.attention_warp(h, g, d, scale, "step.seq", partial=True, cache_dtype=kv, sg=sg, warps=warps,
                                       finish=f, max_splits=8, planes=planes, sums=sums) for f in ("o", "q")}
    for _ in range(2):
        q = rng.standard_normal((rows, h * d)).astype(np.float32)
        bufs.update(Q=upload_f32(dev, q), WS=nan_buffer(dev, rows * h * splits * (d + 2)), O=nan_buffer(dev, rows * k),
                    XQ=nan_buffer(dev, rows * k // 4), XD=nan_buffer(dev, rows * nb), XS=nan_buffer(dev, 2 * rows * nb),
                    XQ2=nan_buffer(dev, rows * k // 4))
        got = {}
        for f in ("o", "q"):
            L = Launch(dev, kerns[f], bufs)
            L.set_step(seq=rows, start=start, split_len=-(-n // splits), n_splits=splits)
            L.run((h, rows, splits))
            assert not np.frombuffer(dev.read(bufs["CNT"], 0, 4 * rows * h), np.uint32).any()
            if f == "o":
                got["o"] = read_f32(dev, bufs["O"], rows * k)
            else:
                got["q"] = {nm: bytes(dev.read(bufs["X" + nm], 0, sz)) for nm, sz in
                            (("Q", rows * k), ("D", 4 * rows * nb), ("S", 8 * rows * nb), ("Q2", rows * k))
                            if (nm != "S" or sums) and (nm != "Q2" or planes == 2)}
        want = ref("attention", [torch.from_numpy(q), torch.from_numpy(kc), torch.from_numpy(vc), start],
                   n_heads=h, n_kv_heads=g, head_dim=d, scale=scale)
        check(got["o"], want, 1e-5)
        # the same O quantized by quantize_x: the same bytes
        xb = {"X": upload_f32(dev, got["o"]), **{"X" + nm: nan_buffer(dev, len(b) // 4) for nm, b in got["q"].items()}}
        Q = Launch(dev, kernels.quantize_x(k, "step.seq", planes=planes, sums=sums), xb)
        Q.set_step(seq=rows)
        Q.run((-(-nb // 64), rows, 1))
        for nm, b in got["q"].items():
            assert bytes(dev.read(xb["X" + nm], 0, len(b))) == b, nm
        codes = np.frombuffer(got["q"]["Q"], np.int8).astype(np.float64).reshape(rows, nb, 32)
        dq = np.frombuffer(got["q"]["D"], np.float32).astype(np.float64).reshape(rows, nb, 1)
        if planes == 2:
            codes = 254 * codes + np.frombuffer(got["q"]["Q2"], np.int8).reshape(rows, nb, 32)
        emu, _ = _int8_emulation(want.numpy().reshape(rows, k).astype(np.float32), planes)
        step = np.abs(want.numpy().astype(np.float64)).reshape(rows, nb, 32).max(-1).max() / 127
        assert np.abs((codes * dq).reshape(rows, k) - emu).max() <= step * (1.01 if planes == 1 else 0.02)


def test_attention_warp_refuses_head_sizes_it_cannot_split():
    assert not kernels.attention_warp_fits(80, 32) and kernels.attention_warp_fits(128, 32)
    with pytest.raises(ValueError, match="head_dim 80"):
        kernels.attention_warp(4, 2, 80, 0.1, "1u", partial=False)


# -- storage descriptors ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["F32", "BF16", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_repack_other_formats(rng, fmt):
    """Formats without a layout of their own become F16 (F32, BF16), Q8_0 (Q5_0, exactly), Q4_1
    (Q4_K), Q6 (Q6_K) or Q6M (Q5_K, Q5_1), within fp16 rounding of their sub-block scales (Q5_1
    exactly); checked against gguf-py's values."""
    rows, cols = 4, 256
    w = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    t = GGMLQuantizationType[fmt]
    if fmt == "F32":
        raw = w
    elif fmt in ("Q4_K", "Q5_K", "Q6_K"):  # gguf-py reads K-quants but does not write them: edgellm's quantizer
        from edgellm.quant import quantize

        raw = quantize(w, fmt)
    else:
        raw = gg_quantize(w, t)
    want = gg_dequantize(raw, t).reshape(rows, cols) if fmt != "F32" else w
    p = codegen.repack(raw, fmt, (rows, cols))
    got = codegen.dequantize_packed(p)
    assert p.fmt == {"F32": "F16", "BF16": "F16", "Q4_K": "Q4_1", "Q6_K": "Q6", "Q5_K": "Q6M",
                     "Q5_1": "Q6M"}.get(fmt, "Q8_0")
    tol = 0 if fmt in ("Q5_0", "Q5_1") else {"F16": 1e-3}.get(p.fmt, 1e-2 if p.fmt == "Q8_0" else 2e-3) * float(
        np.abs(want).max())
    assert float(np.abs(got - want).max()) <= tol


def test_descriptor_accessors_pick_the_part(dev):
    """A weight split in three parts: the generated W_qs chooses the part by row."""
    d = codegen.WeightDesc("W", "Q4_0", 10, 64, (4, 4, 2))
    src = d.accessors("X")
    assert "W_qs0" in src and "W_qs2" in src and "if (row < 4u)" in src and "if (row < 8u)" in src
    assert len(d.bindings()) == 6  # qs and d per part


@pytest.mark.parametrize("rows,start,d,kv,wgb", [(37, 0, 80, "f32", 28), (21, 13, 64, "f32", 28), (19, 3, 128, "f16", 28),
                                              (29, 5, 128, "f32", 14)])
def test_attention_tiled(dev, rng, rows, start, d, kv, wgb):
    """Causal prefill attention in tiles: query rows off the tile, keys off the key tile, GQA;
    wgb KiB of workgroup memory (14: the tiles halved to 8 x 8 to fit)."""
    if kv == "f16" and not dev.has_f16:
        pytest.skip("the adapter has no shader-f16")
    h, g = 6, 2
    scale, bufs, want = _prefill_attention_case(dev, rng, rows, start, h, g, d, 64, kv)
    L = Launch(dev, kernels.attention_tiled(h, g, d, scale, "step.seq", cache_dtype=kv, workgroup_bytes=wgb * 1024), bufs)
    L.set_step(seq=rows, start=start)
    bm = kernels.attention_tile_rows(d, wgb * 1024)
    assert bm == (16 if wgb == 28 else 8)
    L.run((h, -(-rows // bm), 1))
    check(read_f32(dev, bufs["O"], rows * h * d), want, 1e-5)


def _prefill_attention_case(dev, rng, rows, start, h, g, d, ctx, kv):
    """(scale, buffers Q, KC, VC (cache dtype kv), O poisoned, the float64 reference's output)."""
    q = rng.standard_normal((rows, h * d)).astype(np.float32)
    kc, vc = rng.standard_normal((2, ctx, g * d)).astype(np.float32)
    if kv == "f16":
        kc, vc = kc.astype(np.float16).astype(np.float32), vc.astype(np.float16).astype(np.float32)
    scale = 1 / math.sqrt(d)
    bufs = dict(Q=upload_f32(dev, q), KC=_cache(dev, kc, kv), VC=_cache(dev, vc, kv), O=nan_buffer(dev, rows * h * d))
    want = ref("attention", [torch.from_numpy(q), torch.from_numpy(kc), torch.from_numpy(vc), start],
               n_heads=h, n_kv_heads=g, head_dim=d, scale=scale)
    return scale, bufs, want


@pytest.mark.parametrize("rows,start,d,kv,wgb", [(37, 0, 128, "f32", 28), (21, 13, 64, "f32", 28), (70, 3, 128, "f16", 28),
                                              (9, 40, 64, "f16", 20), (33, 0, 64, "f32", 20)])
def test_attention_blocked(dev, rng, rows, start, d, kv, wgb):
    """Causal prefill attention in register blocks: query rows off the 32-row tile, keys off the
    key tile (32 keys a tile at head size 64 in 28 KiB, else 16), a start past 0, GQA 6:2, against
    the float64 reference; every output element written (poisoned first)."""
    if kv == "f16" and not dev.has_f16:
        pytest.skip("the adapter has no shader-f16")
    h, g = 6, 2
    bn = kernels.attention_blocked_keys(d, wgb * 1024)
    assert bn == (32 if wgb == 28 and d == 64 else 16)
    assert kernels.attention_blocked_keys(128, 20 * 1024) == 0 and kernels.attention_blocked_keys(96, 28 * 1024) == 0
    scale, bufs, want = _prefill_attention_case(dev, rng, rows, start, h, g, d, 128, kv)
    L = Launch(dev, kernels.attention_blocked(h, g, d, scale, "step.seq", cache_dtype=kv, workgroup_bytes=wgb * 1024),
               bufs)
    L.set_step(seq=rows, start=start)
    L.run((h, -(-rows // kernels.BLOCKED_ROWS), 1))
    check(read_f32(dev, bufs["O"], rows * h * d), want, 1e-5)
    with pytest.raises(ValueError, match="a multiple of 64"):
        kernels.attention_blocked(h, g, 80, scale, "step.seq")


def test_mixed_stacks_take_one_six_bit_layout(rng):
    """Parts of one stacked weight in different layouts (a Q4_K_M file's q, k as Q4_1 with a Q6_K v
    as Q6; Q4_0 with Q5_0 as Q8_0) take the smallest six-bit layout that holds each exactly (Q6M,
    Q6), with the same values; F16 parts or Q8_0 codes past six bits do not."""
    def part(fmt, rows):
        raw, dense = quantized(rng, rows, 256, fmt)
        return codegen.repack(raw, fmt, dense.shape)

    for fmts, want in ((("Q4_K", "Q4_K", "Q6_K"), "Q6M"), (("Q4_0", "Q5_0"), "Q6"), (("Q4_1", "Q6_K"), "Q6M")):
        parts = [part(f, 6 + 2 * i) for i, f in enumerate(fmts)]
        got = codegen.unify_six_bit(parts)
        assert [p.fmt for p in got] == [want] * len(parts), fmts
        for a, b in zip(parts, got):
            np.testing.assert_array_equal(codegen.dequantize_packed(b), codegen.dequantize_packed(a))
        st = codegen.stack(got)
        assert st.fmt == want and st.rows == sum(p.rows for p in parts)
    assert codegen.unify_six_bit([part("Q4_0", 4), part("F16", 4)]) is None
    assert codegen.unify_six_bit([part("Q4_0", 4), part("Q8_0", 4)]) is None  # Q8_0 codes span -127..127
