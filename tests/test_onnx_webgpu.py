"""Imported networks on the webgpu backend: each N-D kernel (edgellm/backends/webgpu/nd_kernels.py,
through vision.py's lowering) against the cpu reference kernels run in float64 on the same fresh
random inputs, the output buffers first filled with NaN so that an element never written fails;
then whole torchvision architectures (random weights, small images) against onnxruntime on the
same file and input, within 1e-4 relative. The GEMM-based kinds run both ways: tiled in
workgroup memory (what a GPU gets) and untiled (what a software adapter gets). Runs on any WebGPU
adapter (in CI: Mesa's lavapipe); skips with the reason where there is none.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("wgpu", reason="the webgpu backend needs the wgpu package (pip install 'edgellm[webgpu]')")

from edgellm.backends.cpu import CPU_KERNELS  # noqa: E402
from edgellm.errors import BackendUnavailableError  # noqa: E402
from edgellm.graph.ir import Op  # noqa: E402


@pytest.fixture(scope="module")
def dev(webgpu_dev):
    return webgpu_dev


def run(dev, kind: str, inputs: list, weights=(), tiled=None, n_out: int = 1, dtype="f32", **attrs):
    """The webgpu kernel's outputs and the cpu kernel's (float64) for one op on these inputs
    (dtype f16: float16 storage; the reference gets the inputs rounded to float16 too)."""
    from edgellm.backends.webgpu.vision import run_op

    if dtype == "f16":
        inputs = [np.asarray(a, dtype=np.float16).astype(np.float32) for a in inputs]
    op = Op("t", kind, tuple(f"i{k}" for k in range(len(inputs))), tuple(f"o{k}" for k in range(n_out)), attrs)
    want = CPU_KERNELS[kind](op, [torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in inputs])
    want = [w.numpy() for w in (want if isinstance(want, tuple) else (want,))]
    got = run_op(op, inputs, [w.shape for w in want], tiled=tiled, weights=weights, dev=dev, dtype=dtype)
    return got, want


def check(got, want, tol: float = 1e-5):
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert np.isfinite(g).all(), f"{(~np.isfinite(g)).sum()} of {g.size} elements not written (or not finite)"
        scale = max(1.0, float(np.abs(w).max()))
        err = float(np.abs(g.astype(np.float64) - w).max())
        assert err <= tol * scale, f"max error {err} (scale {scale})"


def f32(rng, *shape, lo=None):
    a = rng.standard_normal(shape).astype(np.float32)
    return (np.abs(a) + lo).astype(np.float32) if lo is not None else a


# -- convolution --------------------------------------------------------------------------------
CONVS = [  # (N, C, H, W, O, KH, KW, groups, strides, pads (t, l, b, r), dilations)
    (2, 5, 9, 11, 7, 3, 3, 1, (1, 1), (1, 1, 1, 1), (1, 1)),
    (1, 6, 13, 10, 70, 3, 3, 2, (2, 1), (0, 1, 2, 1), (1, 2)),   # grouped, asymmetric pads, dilation, N > 64
    (2, 12, 7, 9, 12, 5, 3, 4, (1, 2), (2, 1, 2, 0), (2, 1)),    # grouped 3 channels per group
    (2, 8, 9, 9, 8, 3, 3, 8, (2, 2), (1, 1, 1, 1), (1, 1)),      # depthwise
    (1, 4, 8, 7, 8, 3, 3, 4, (1, 1), (2, 2, 2, 2), (2, 2)),      # depthwise, two outputs per channel
    (3, 33, 6, 5, 17, 1, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1)),    # 1x1, K not a multiple of 16
    (1, 3, 19, 23, 16, 7, 7, 1, (2, 2), (3, 3, 3, 3), (1, 1)),   # a stem: M > 64
]
EPILOGUES = [dict(), dict(act="relu"), dict(act="clip", act_args={"min": 0.0, "max": 6.0}),
             dict(act="hardswish"), dict(act="hardsigmoid", act_args={"alpha": 0.2, "beta": 0.5}),
             dict(act="sigmoid"), dict(act="silu"), dict(act="gelu", act_args={"approximate": "none"}),
             dict(act="gelu", act_args={"approximate": "tanh"}), dict(act="tanh"),
             dict(has_residual=True), dict(act="relu", has_residual=True, res_act="relu"),
             dict(has_residual=True, res_act="hardswish")]


def _conv(dev, rng, case, epi, tiled, bias=True):
    N, C, H, W, O, KH, KW, g, st, pads, dil = case
    x, w, b = f32(rng, N, C, H, W), f32(rng, O, C // g, KH, KW), f32(rng, O)
    oh = (H + pads[0] + pads[2] - dil[0] * (KH - 1) - 1) // st[0] + 1
    ow = (W + pads[1] + pads[3] - dil[1] * (KW - 1) - 1) // st[1] + 1
    ins = [x, w] + ([b] if bias else [])
    if epi.get("has_residual"):
        ins.append(f32(rng, N, O, oh, ow))
    attrs = dict(strides=st, pads=pads, dilations=dil, groups=g, has_bias=bias, **epi)
    got, want = run(dev, "conv2d", ins, weights=(1, 2) if bias else (1,), tiled=tiled, **attrs)
    check(got, want)


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
@pytest.mark.parametrize("case", range(len(CONVS)))
def test_conv2d_geometry(dev, rng, case, tiled):
    _conv(dev, rng, CONVS[case], dict(act="relu", has_residual=True), tiled, bias=case % 2 == 0)


@pytest.mark.parametrize("epi", range(len(EPILOGUES)))
def test_conv2d_epilogue(dev, rng, epi):
    """Every activation code of the fused epilogue, on a GEMM conv and on a depthwise one."""
    _conv(dev, rng, CONVS[0], EPILOGUES[epi], tiled=epi % 2 == 0)
    _conv(dev, rng, CONVS[3], EPILOGUES[epi], tiled=False)


def test_conv2d_same_upper(dev, rng):
    x, w = f32(rng, 1, 4, 9, 10), f32(rng, 6, 4, 3, 3)
    got, want = run(dev, "conv2d", [x, w], weights=(1,), strides=(2, 2), pads=(0, 0, 0, 0), dilations=(1, 1),
                    groups=1, auto_pad="SAME_UPPER")
    check(got, want)


# -- pooling ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,attrs", [
    ("maxpool", dict(kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), dilations=(1, 1))),
    ("maxpool", dict(kernel=(2, 3), strides=(2, 1), pads=(0, 1, 1, 0), dilations=(2, 1), ceil_mode=True)),
    ("avgpool", dict(kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), dilations=(1, 1))),
    ("avgpool", dict(kernel=(3, 2), strides=(2, 2), pads=(1, 0, 1, 1), dilations=(1, 1), count_include_pad=True,
                     ceil_mode=True)),
    ("avgpool", dict(kernel=(2, 2), strides=(2, 2), pads=(0, 0, 0, 0), dilations=(1, 1), ceil_mode=True)),
])
def test_pool(dev, rng, kind, attrs):
    got, want = run(dev, kind, [f32(rng, 2, 3, 9, 8)], **attrs)
    check(got, want)


@pytest.mark.parametrize("tiled,hw", [(False, (5, 7)), (True, (5, 7)), (True, (17, 9))])
def test_global_avgpool(dev, rng, tiled, hw):
    got, want = run(dev, "global_avgpool", [f32(rng, 2, 5, *hw)], tiled=tiled)
    check(got, want)


# -- matrix products ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_linear(dev, rng, tiled):
    x, w, b = f32(rng, 3, 23, 70), f32(rng, 77, 70), f32(rng, 77)
    check(*run(dev, "linear", [x, w, b], weights=(1, 2), tiled=tiled, has_bias=True))
    r = f32(rng, 3, 23, 77)
    check(*run(dev, "linear", [x, w, r], weights=(1,), tiled=tiled, has_residual=True))
    for act, args in (("relu", {}), ("gelu", {"approximate": "none"}), ("gelu", {"approximate": "tanh"})):
        check(*run(dev, "linear_act", [x, w, b], weights=(1, 2), tiled=tiled, has_bias=True, act=act, act_args=args))


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
@pytest.mark.parametrize("sa,sb", [((5, 33), (33, 70)), ((2, 3, 9, 20), (3, 20, 11)), ((2, 1, 9, 20), (1, 4, 20, 6)),
                                   ((4, 65, 17), (17, 66))])
def test_matmul_broadcast(dev, rng, tiled, sa, sb):
    check(*run(dev, "matmul", [f32(rng, *sa), f32(rng, *sb)], tiled=tiled))


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_split_k_products(dev, rng, monkeypatch, splits, tiled):
    """Split-K (EDGELLM_WEBGPU_SPLITK forces the count; on a GPU nd.splitk_count picks it): partial
    sums of K ranges, then the epilogue kernel adds them with bias, activation and residual."""
    from edgellm.backends.webgpu import nd_kernels as nd

    monkeypatch.setenv("EDGELLM_WEBGPU_SPLITK", str(splits))
    assert nd.splitk_count(49, 512, 1, 4608) == splits
    _conv(dev, rng, CONVS[1], dict(act="relu", has_residual=True, res_act="hardswish"), tiled)  # grouped, 3 x 3
    _conv(dev, rng, CONVS[5], dict(act="silu"), tiled)  # 1 x 1, K = 33: ranges of 16 and an empty one
    x, w, b, r = f32(rng, 3, 23, 70), f32(rng, 77, 70), f32(rng, 77), f32(rng, 3, 23, 77)
    check(*run(dev, "linear_act", [x, w, b], weights=(1, 2), tiled=tiled, has_bias=True, act="gelu",
               act_args={"approximate": "none"}))
    check(*run(dev, "linear", [x, w, r], weights=(1,), tiled=tiled, has_residual=True))
    check(*run(dev, "matmul", [f32(rng, 2, 3, 9, 40), f32(rng, 3, 40, 11)], tiled=tiled))


def test_split_k_count():
    """Few long tiles split (resnet18's last stage at batch 1), many tiles or short K do not."""
    from edgellm.backends.webgpu import nd_kernels as nd

    assert nd.splitk_count(49, 512, 1, 4608) == 16  # 8 tiles, K = 4,608
    assert nd.splitk_count(196, 256, 1, 2304) == 9  # 16 tiles: 256 // 16 = 16, K // 256 = 9
    assert nd.splitk_count(12544, 64, 1, 147) == 1  # 196 tiles: enough already
    assert nd.splitk_count(49, 512, 1, 200) == 1  # K too short to share


def test_matmul_weight_operand(dev, rng):
    check(*run(dev, "matmul", [f32(rng, 3, 7, 20), f32(rng, 20, 9)], weights=(1,)))


# -- element-wise -----------------------------------------------------------------------------------
BROADCASTS = [((2, 3, 4, 5), (3, 1, 1)), ((4, 1), (1, 5)), ((2, 3, 4, 5), ()), ((1, 6, 1), (5, 1, 7)),
              ((2, 3, 4, 5), (2, 3, 4, 5))]


@pytest.mark.parametrize("kind", ["add", "mul", "sub", "div", "pow"])
@pytest.mark.parametrize("shapes", range(len(BROADCASTS)))
def test_binary_broadcasting(dev, rng, kind, shapes):
    sa, sb = BROADCASTS[shapes]
    a, b = f32(rng, *sa), f32(rng, *sb)
    if kind == "div":
        b = np.where(b < 0, b - 0.5, b + 0.5).astype(np.float32)
    if kind == "pow":
        a = f32(rng, *sa, lo=0.1)
    check(*run(dev, kind, [a, b], weights=(1,) if shapes % 2 else ()))


def test_pow_integer_exponents(dev, rng):
    a = f32(rng, 3, 8)
    for e in (2.0, 3.0, 0.0, -1.0):
        a2 = np.where(np.abs(a) < 0.1, 0.5, a).astype(np.float32)
        check(*run(dev, "pow", [a2, np.array(e, np.float32)], weights=(1,)))


def test_mul_add(dev, rng):
    check(*run(dev, "mul_add", [f32(rng, 6, 1, 1), f32(rng, 2, 6, 5, 4), f32(rng, 2, 6, 5, 4)], weights=(0,)))


@pytest.mark.parametrize("kind,attrs", [("relu", {}), ("sigmoid", {}), ("tanh", {}), ("silu", {}), ("hardswish", {}),
                                        ("hardsigmoid", {"alpha": 0.25, "beta": 0.4}), ("gelu", {"approximate": "none"}),
                                        ("gelu", {"approximate": "tanh"}), ("clip", {"min": -0.5, "max": 1.5}),
                                        ("clip", {"min": 0.0}), ("erf", {}), ("sqrt", {}), ("exp", {}), ("neg", {})])
def test_unary(dev, rng, kind, attrs):
    x = f32(rng, 3, 37, 11) * 3
    x[0, 0, :5] = [1e-4, -0.03, 0.0625, 20.0, -40.0]  # near zero, at the tanh series' bound, far out
    if kind == "sqrt":
        x = np.abs(x) + 0.01
    check(*run(dev, kind, [x.astype(np.float32)], **attrs))


# -- rows ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("tiled", [False, True], ids=["row-per-thread", "row-per-workgroup"])
@pytest.mark.parametrize("axis", [-1, 1, 0])
def test_softmax(dev, rng, axis, tiled):
    check(*run(dev, "softmax", [f32(rng, 3, 7, 19) * 4], axis=axis, tiled=tiled))
    check(*run(dev, "softmax", [f32(rng, 3, 2, 197) * 4], axis=axis, tiled=tiled))


@pytest.mark.parametrize("tiled", [False, True], ids=["row-per-thread", "row-per-workgroup"])
@pytest.mark.parametrize("axis,bias", [(-1, True), (2, False), (1, True)])
def test_layer_norm(dev, rng, axis, bias, tiled):
    for last in (24, 150):
        x = f32(rng, 2, 5, 6, last) + 0.7
        norm_shape = x.shape[axis % 4:]
        ins = [x, f32(rng, *norm_shape)] + ([f32(rng, *norm_shape)] if bias else [])
        check(*run(dev, "layer_norm", ins, weights=(1, 2), axis=axis, eps=1e-6, has_bias=bias, tiled=tiled))


@pytest.mark.parametrize("tiled", [False, True], ids=["row-per-thread", "row-per-workgroup"])
@pytest.mark.parametrize("cols", [48, 200])
def test_add_layer_norm(dev, rng, cols, tiled):
    a, b = f32(rng, 2, 5, cols), f32(rng, 2, 5, cols)
    got, want = run(dev, "add_layer_norm", [a, b, f32(rng, cols), f32(rng, cols)], weights=(2, 3), n_out=2, axis=-1,
                    eps=1e-5, has_bias=True, tiled=tiled)
    check(got, want)


@pytest.mark.parametrize("tiled", [False, True], ids=["row-per-thread", "row-per-workgroup"])
@pytest.mark.parametrize("sk", [9, 150])  # fewer keys than the workgroup's threads, and more
def test_sdpa(dev, rng, tiled, sk):
    q, k, v = f32(rng, 2, 3, 7, 16), f32(rng, 2, 3, sk, 16), f32(rng, 2, 3, sk, 12)
    check(*run(dev, "sdpa", [q * 2, k * 2, v], scale=0.25, tiled=tiled))


@pytest.mark.parametrize("axes,keep", [((-1,), True), ((1, 3), False), ((0, 2), True)])
def test_reduce_mean(dev, rng, axes, keep):
    check(*run(dev, "reduce_mean", [f32(rng, 2, 5, 6, 7)], axes=axes, keepdims=keep))


# -- layout -------------------------------------------------------------------------------------------
def test_layout_copies(dev, rng):
    x = f32(rng, 2, 3, 4, 5)
    check(*run(dev, "reshape", [x], shape=(6, 20)))
    check(*run(dev, "transpose", [x], perm=(0, 2, 3, 1)))
    check(*run(dev, "transpose", [x], perm=(3, 1, 0, 2)))
    check(*run(dev, "expand", [f32(rng, 3, 1, 5)], shape=(2, 3, 4, 5)))
    check(*run(dev, "slice", [x], starts=(1, -1), ends=(3, -6), axes=(2, 3), steps=(1, -2)))
    check(*run(dev, "slice", [x], starts=(0,), ends=(2**62,), axes=(1,), steps=(2,)))
    check(*run(dev, "gather", [x], axis=1, index=2))
    check(*run(dev, "gather", [x], axis=-1, index=[4, 0, 2, 4]))
    check(*run(dev, "concat", [x, f32(rng, 2, 3, 2, 5), f32(rng, 2, 3, 1, 5)], axis=2))


# -- float16 storage --------------------------------------------------------------------------------
@pytest.fixture
def f16(dev):
    if not dev.has_f16:
        pytest.skip("the adapter has no shader-f16")
    return "f16"


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_f16_storage_kernels(dev, rng, f16, tiled):
    """Float16 storage, float32 maths: within float16's rounding of the float64 reference on the
    same (float16-rounded) inputs; odd element counts (the two-byte stores' neighbours)."""
    tol = 2e-3
    for case in (CONVS[1], CONVS[3]):
        N, C, H, W, O, KH, KW, g, st, pads, dil = case
        ins = [f32(rng, N, C, H, W), f32(rng, O, C // g, KH, KW), f32(rng, O)]
        check(*run(dev, "conv2d", ins, weights=(1, 2), tiled=tiled, dtype=f16, strides=st, pads=pads, dilations=dil,
                   groups=g, has_bias=True, act="hardswish"), tol)
    check(*run(dev, "linear_act", [f32(rng, 3, 7, 33), f32(rng, 21, 33), f32(rng, 21)], weights=(1, 2), tiled=tiled,
               dtype=f16, has_bias=True, act="gelu", act_args={"approximate": "none"}), tol)
    check(*run(dev, "matmul", [f32(rng, 2, 9, 20), f32(rng, 2, 20, 11)], tiled=tiled, dtype=f16), tol)
    check(*run(dev, "mul", [f32(rng, 3, 1, 5), f32(rng, 2, 3, 7, 5)], dtype=f16), tol)
    check(*run(dev, "mul_add", [f32(rng, 5, 1, 1), f32(rng, 1, 5, 3, 3), f32(rng, 1, 5, 3, 3)], weights=(0,), dtype=f16), tol)
    check(*run(dev, "layer_norm", [f32(rng, 3, 5, 77), f32(rng, 77), f32(rng, 77)], weights=(1, 2), tiled=tiled, dtype=f16,
               axis=-1, eps=1e-5, has_bias=True), tol)
    check(*run(dev, "add_layer_norm", [f32(rng, 3, 99), f32(rng, 3, 99), f32(rng, 99)], weights=(2,), n_out=2,
               tiled=tiled, dtype=f16, axis=-1, eps=1e-5, has_bias=False), tol)
    check(*run(dev, "softmax", [f32(rng, 3, 101)], tiled=tiled, dtype=f16, axis=-1), tol)
    check(*run(dev, "sdpa", [f32(rng, 1, 2, 5, 8), f32(rng, 1, 2, 7, 8), f32(rng, 1, 2, 7, 3)], dtype=f16, scale=0.3), tol)
    check(*run(dev, "maxpool", [f32(rng, 1, 3, 7, 7)], dtype=f16, kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1),
               dilations=(1, 1)), tol)
    check(*run(dev, "global_avgpool", [f32(rng, 1, 3, 9, 11)], tiled=tiled, dtype=f16), tol)
    check(*run(dev, "concat", [f32(rng, 1, 3, 5), f32(rng, 1, 1, 5)], dtype=f16, axis=1), tol)
    check(*run(dev, "transpose", [f32(rng, 3, 5, 7)], dtype=f16, perm=(2, 0, 1)), tol)
    check(*run(dev, "resize", [f32(rng, 1, 2, 5, 7)], dtype=f16, out_hw=(9, 13), mode="linear", coord="half_pixel"), tol)


# -- whole networks -------------------------------------------------------------------------------------
pytest.importorskip("onnx")
from onnx_models import ARCHS, export, onnxruntime_run, randomize, rel_err, torchvision_models  # noqa: E402

import edgellm  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx_webgpu")
    cache = {}

    def get(name):
        if name not in cache:
            kwargs, size, dyn = ARCHS[name]
            model = randomize(getattr(torchvision_models(), name)(**kwargs))
            cache[name] = (export(model, d / f"{name}.onnx", size, dyn), size)
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(ARCHS))
def test_architecture_matches_onnxruntime(dev, exported, name):
    path, size = exported(name)
    m = edgellm.load(path, backend="webgpu")
    x = np.random.default_rng(1).standard_normal((2, 3, size, size)).astype(np.float32)
    out = m(x)
    ref = onnxruntime_run(path, {"input": x})[0]
    assert out["logits"].shape == ref.shape
    assert rel_err(out["logits"], ref) < 1e-4
    b = next(iter(m.runner._bound.values()))
    assert [s.backend for s in b.compiled.segments] == ["webgpu"]  # every op on the GPU
    assert not b.delegated and not b.recording.delegated
    assert "delegated" not in m.describe()
    # one dispatch per op, but for reshapes read in place (ViT's attention has dozens)
    reshapes = sum(op.kind == "reshape" for op in b.ops)
    assert b.recording.dispatches >= len(b.ops) - reshapes and b.recording.aliases <= reshapes
    if name == "vit_b_16":
        assert b.recording.aliases >= 12


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "convnext_tiny"])
def test_f16_storage_network(dev, f16, exported, name):
    """Float16 activations and weights (float32 maths): within 1e-2 of onnxruntime's float32."""
    from edgellm.onnx import load_onnx

    path, size = exported(name)
    m = load_onnx(path, backend="webgpu", dtype="f16")
    x = np.random.default_rng(8).standard_normal((2, 3, size, size)).astype(np.float32)
    assert rel_err(m(x)["logits"], onnxruntime_run(path, {"input": x})[0]) < 1e-2
    assert "float16 storage" in m.describe() and "delegated" not in m.describe()


def test_f16_needs_the_adapter_feature(dev, exported, monkeypatch):
    from edgellm.onnx import load_onnx

    monkeypatch.setattr(dev, "has_f16", False)
    with pytest.raises(BackendUnavailableError, match="shader-f16"):
        load_onnx(exported("mobilenet_v3_small")[0], backend="webgpu", dtype="f16")


def test_in_place_reshape_keeps_its_input_live(exported):
    """compile_graph(in_place={'reshape'}): a reshape's input stays live while the result is read,
    so reading the result from the input's bytes is safe; without it the plans are as before."""
    from edgellm.compiler.compile import usage_records
    from edgellm.onnx.importer import import_onnx
    from edgellm.onnx.runtime import GraphRunner

    path, _ = exported("vit_b_16")
    runner = GraphRunner(import_onnx(path).graph, {}, {}, set(), "cpu", torch.device("cpu"), torch.float32)
    g = runner.compile({"batch": 1}).graph
    plain, kept = usage_records(g, {"batch": 1}), usage_records(g, {"batch": 1}, frozenset({"reshape"}))
    last = {r.tensor: r.last for r in plain}
    kept_last = {r.tensor: r.last for r in kept}
    assert [(r.tensor, r.first, r.size) for r in plain] == [(r.tensor, r.first, r.size) for r in kept]
    extended = 0
    for op in g.ops:
        if op.kind == "reshape" and op.inputs[0] in last and op.outputs[0] in last:
            assert kept_last[op.inputs[0]] >= kept_last[op.outputs[0]]
            extended += kept_last[op.inputs[0]] > last[op.inputs[0]]
    assert extended >= 12 and all(kept_last[t] >= last[t] for t in last)


def test_dynamic_sizes_and_tiled_network(dev, exported, monkeypatch):
    """Another image size records another program; the tiled GEMM on a whole network."""
    path, _ = exported("mobilenet_v3_small")
    monkeypatch.setenv("EDGELLM_WEBGPU_TILED", "1")
    m = edgellm.load(path, backend="webgpu")
    assert m.tensor_ops.tiled
    for shape in ((1, 3, 40, 48), (2, 3, 32, 32)):
        x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
        assert rel_err(m(x)["logits"], onnxruntime_run(path, {"input": x})[0]) < 1e-4
    assert len(m.runner._bound) == 2


@pytest.mark.parametrize("attrs", [dict(mode="nearest", coord="asymmetric", nearest_mode="floor"),
                                   dict(mode="nearest", coord="half_pixel", nearest_mode="round_prefer_ceil"),
                                   dict(mode="linear", coord="half_pixel"), dict(mode="linear", coord="align_corners"),
                                   dict(mode="linear", coord="pytorch_half_pixel")])
@pytest.mark.parametrize("out_hw", [(11, 7), (4, 13)])
def test_resize(dev, rng, attrs, out_hw):
    check(*run(dev, "resize", [f32(rng, 2, 3, 6, 9)], out_hw=out_hw, **attrs))


def test_delegated_op_between_gpu_ops(dev, tmp_path, monkeypatch):
    """An op kind without a WGSL kernel (here resize, its kernel taken out of the table) runs on
    the cpu between GPU kernels, reading from and writing to the arena; with the kernel, on the GPU."""
    from onnx import TensorProto, helper, numpy_helper

    from edgellm.backends.webgpu.vision import WebgpuNd

    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Resize", ["r", "", "scales"], ["z"], mode="nearest"),
             helper.make_node("Sigmoid", ["z"], ["s"]),
             helper.make_node("Mul", ["s", "z"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 7])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"),
                           numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")])
    import onnx

    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "resize.onnx"
    onnx.save(model, str(path))
    x = rng.standard_normal((1, 3, 6, 7)).astype(np.float32)
    ref = onnxruntime_run(path, {"x": x})[0]
    m = edgellm.load(path, backend="webgpu")
    assert rel_err(m(x)["y"], ref) < 1e-5 and "delegated" not in m.describe()
    table = WebgpuNd.kernels
    monkeypatch.setattr(WebgpuNd, "kernels", lambda self: {k: v for k, v in table(self).items() if k != "resize"})
    m = edgellm.load(path, backend="webgpu")
    assert rel_err(m(x)["y"], ref) < 1e-5
    assert "1 of 3 ops delegated to the cpu: resize" in m.describe()


@pytest.mark.parametrize("dtype,tol", [("f32", 1e-4), ("f16", 1e-2)])
def test_ops_larger_than_a_binding_are_delegated(dev, exported, monkeypatch, dtype, tol):
    """An op with a tensor over the adapter's largest storage binding runs on the cpu instead,
    its neighbours on the GPU reading and writing the same arena (float16 storage too)."""
    from edgellm.onnx import load_onnx

    if dtype == "f16" and not dev.has_f16:
        pytest.skip("the adapter has no shader-f16")
    path, size = exported("mobilenet_v3_small")
    monkeypatch.setattr(dev, "max_binding", 4 * 20000)
    m = load_onnx(path, backend="webgpu", dtype=dtype)
    x = np.random.default_rng(7).standard_normal((1, 3, size, size)).astype(np.float32)
    assert rel_err(m(x)["logits"], onnxruntime_run(path, {"input": x})[0]) < tol
    b = next(iter(m.runner._bound.values()))
    assert 0 < len(b.recording.delegated) < len(b.ops) // 2
    assert f"{len(b.recording.delegated)} of {len(b.ops)} ops delegated to the cpu: conv2d, linear" in m.describe()


def test_unavailable_adapter_is_a_clear_error(exported, monkeypatch):
    from edgellm.backends.webgpu import vision

    def none():
        raise BackendUnavailableError("the webgpu backend found no adapter (none)")
    monkeypatch.setattr(vision, "get_device", none)
    path, _ = exported("mobilenet_v3_small")
    with pytest.raises(BackendUnavailableError, match="no adapter"):
        edgellm.load(path, backend="webgpu")
    with pytest.raises(BackendUnavailableError, match="cpu, cuda, webgpu"):
        edgellm.load(path, backend="cpu-fast")


def test_cli_run_plan_bench(dev, exported, tmp_path, capsys):
    from edgellm.cli import main

    path, _ = exported("mobilenet_v3_small")
    x = np.random.default_rng(6).standard_normal((1, 3, 32, 32)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(path), "--input", str(tmp_path / "x.npy"), "--backend", "webgpu"]) == 0
    cap = capsys.readouterr()
    ref = onnxruntime_run(path, {"input": x})[0]
    assert f"shape {ref.shape}" in cap.out and "webgpu (" in cap.err
    assert main(["plan", str(path), "--backend", "webgpu", "--size", "batch=1,height=32,width=32"]) == 0
    assert "segments      webgpu:" in capsys.readouterr().out
    assert main(["bench", str(path), "--backend", "webgpu", "-r", "1", "--no-warmup"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[1:3] for r in rows] == [["webgpu", "1"], ["webgpu", "8"]] and all(float(r[3]) > 0 for r in rows)
