"""Per-op checks of the ONNX import and the N-D kernels: one-node (or few-node) ONNX graphs run
by edgellm against onnxruntime on the same file; the cuda conv/pool kernels in Triton's
interpreter against torch float64; malformed files and unsupported ops."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx_models import onnxruntime_run, rel_err  # noqa: E402

import edgellm  # noqa: E402
from edgellm.errors import EdgeLLMError, ModelFileError  # noqa: E402
from edgellm.onnx import UnsupportedOpError  # noqa: E402

RNG = np.random.default_rng(0)


def _model(tmp_path, nodes, inputs, outputs, inits=(), opset=17, name="m"):
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    path = tmp_path / f"{name}.onnx"
    onnx.save(m, str(path))
    return path


def _check(path, feeds, tol=1e-5):
    ref = onnxruntime_run(path, feeds)
    out = list(edgellm.load(path)(feeds).values())
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        assert rel_err(o, r) < tol, rel_err(o, r)


def _w(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


CONVS = [
    dict(group=1, strides=[1, 1], pads=[1, 1, 1, 1]),
    dict(group=1, strides=[2, 2], pads=[0, 1, 2, 1], dilations=[1, 2]),   # asymmetric pads, dilation
    dict(group=2, strides=[1, 2], pads=[1, 0, 1, 0]),                     # grouped
    dict(group=6, strides=[2, 2], pads=[1, 1, 1, 1]),                     # depthwise
    dict(group=1, strides=[2, 2], auto_pad="SAME_UPPER"),
]


@pytest.mark.parametrize("attrs", CONVS, ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()))
def test_conv(tmp_path, attrs):
    g = attrs["group"]
    w, b = _w(6, 6 // g, 3, 3), _w(6)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", **attrs)
    path = _model(tmp_path, [node], [("x", ["N", 6, "H", "W"])], ["y"], [("w", w), ("b", b)])
    _check(path, {"x": _w(2, 6, 9, 11)})


def test_batchnorm_folded_into_conv(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "bb", "mu", "var"], ["y"], name="bn", epsilon=1e-3),
             helper.make_node("BatchNormalization", ["y", "s", "bb", "mu", "var"], ["z"], name="bn2")]
    inits = [("w", _w(4, 3, 3, 3)), ("s", _w(4)), ("bb", _w(4)), ("mu", _w(4)), ("var", np.abs(_w(4)) + 0.5)]
    path = _model(tmp_path, nodes, [("x", [1, 3, 8, 8])], ["z"], inits)
    _check(path, {"x": _w(1, 3, 8, 8)})
    g = edgellm.onnx.import_onnx(path).graph
    assert g.op_counts() == {"conv2d": 1}  # both folded: BN after a folded BN is still a per-channel affine map
    nodes[0] = helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1])
    nodes.append(helper.make_node("Relu", ["c"], ["c2"], name="reads_conv"))  # conv output read twice: no fold
    path = _model(tmp_path, nodes, [("x", [1, 3, 8, 8])], ["z", "c2"], inits, name="m2")
    _check(path, {"x": _w(1, 3, 8, 8)})
    assert edgellm.onnx.import_onnx(path).graph.op_counts() == {"conv2d": 1, "mul": 2, "add": 2, "relu": 1}


@pytest.mark.parametrize("op,attrs", [
    ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2])),
    ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=0)),
    ("AveragePool", dict(kernel_shape=[3, 2], strides=[1, 2], pads=[1, 0, 1, 0], count_include_pad=1)),
    ("GlobalAveragePool", {}),
])
def test_pool(tmp_path, op, attrs):
    path = _model(tmp_path, [helper.make_node(op, ["x"], ["y"], name="p", **attrs)], [("x", [2, 3, 9, 10])], ["y"])
    _check(path, {"x": _w(2, 3, 9, 10)})


@pytest.mark.parametrize("op,attrs,extra", [
    ("Relu", {}, []), ("Sigmoid", {}, []), ("Tanh", {}, []), ("Erf", {}, []), ("HardSwish", {}, []),
    ("HardSigmoid", dict(alpha=0.3, beta=0.4), []), ("Clip", {}, [("lo", np.float32(0)), ("hi", np.float32(6))]),
    ("Softmax", dict(axis=1), []), ("Exp", {}, []),
])
def test_unary(tmp_path, op, attrs, extra):
    ins = ["x"] + [k for k, _ in extra]
    path = _model(tmp_path, [helper.make_node(op, ins, ["y"], name="u", **attrs)], [("x", [2, 5, 7])], ["y"], extra)
    _check(path, {"x": _w(2, 5, 7) * 4})


def test_gelu_opset20(tmp_path):
    path = _model(tmp_path, [helper.make_node("Gelu", ["x"], ["y"], name="g")], [("x", [3, 8])], ["y"], opset=20)
    _check(path, {"x": _w(3, 8) * 3})


@pytest.mark.parametrize("op", ["Add", "Mul", "Sub", "Div"])
def test_broadcasting_binary(tmp_path, op):
    path = _model(tmp_path, [helper.make_node(op, ["x", "c"], ["y"], name="b")], [("x", [2, 3, 4, 5])], ["y"],
                  [("c", np.abs(_w(3, 1, 5)) + 0.5)])
    _check(path, {"x": _w(2, 3, 4, 5)})


def test_gemm_matmul_layernorm(tmp_path):
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], name="gemm", transB=1, alpha=0.5, beta=2.0),
             helper.make_node("Reshape", ["g", "shp"], ["r"], name="r"),
             helper.make_node("MatMul", ["r", "m"], ["mm"], name="mm"),
             helper.make_node("LayerNormalization", ["mm", "s", "lb"], ["ln"], name="ln", axis=-1, epsilon=1e-5),
             helper.make_node("Transpose", ["ln"], ["t"], name="t", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "ln"], ["y"], name="mm2")]
    inits = [("w", _w(12, 6)), ("b", _w(12)), ("shp", np.array([0, 3, 4], dtype=np.int64)), ("m", _w(4, 5)),
             ("s", _w(5)), ("lb", _w(5))]
    path = _model(tmp_path, nodes, [("x", ["B", 6])], ["y"], inits)
    _check(path, {"x": _w(3, 6)})


def test_shape_subgraph_and_layout_ops(tmp_path):
    """Shape -> Gather -> Concat -> Reshape is evaluated at import; the reshape keeps a symbolic batch."""
    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Gather", ["s", "zero"], ["n"], name="gather", axis=0),
             helper.make_node("Unsqueeze", ["n", "zero1"], ["n1"], name="unsq"),
             helper.make_node("Concat", ["n1", "m1"], ["tgt"], name="cat", axis=0),
             helper.make_node("Reshape", ["x", "tgt"], ["flat"], name="reshape"),
             helper.make_node("Split", ["flat", "sp"], ["a", "b"], name="split", axis=1),
             helper.make_node("Slice", ["a", "st", "en", "ax", "step"], ["sl"], name="slice"),
             helper.make_node("Concat", ["sl", "b"], ["cc"], name="cat2", axis=1),
             helper.make_node("Unsqueeze", ["cc", "one"], ["u"], name="unsq2"),
             helper.make_node("Flatten", ["x"], ["f"], name="flatten", axis=2),
             helper.make_node("ReduceMean", ["f"], ["y2"], name="rm", axes=[1], keepdims=0),
             helper.make_node("Resize", ["x", "", "scales"], ["y3"], name="resize", mode="nearest"),
             helper.make_node("Resize", ["x", "", "", "sizes"], ["y4"], name="resize_lin", mode="linear")]
    inits = [("zero", np.array(0, dtype=np.int64)), ("zero1", i64(0)), ("m1", i64(-1)), ("sp", i64(20, 40)),
             ("st", i64(-2)), ("en", i64(-20)), ("ax", i64(1)), ("step", i64(-3)), ("one", i64(1)),
             ("scales", np.array([1, 1, 2, 1.5], dtype=np.float32)), ("sizes", i64(2, 3, 7, 5))]
    path = _model(tmp_path, nodes, [("x", ["batch", 3, 4, 5])], ["u", "y2", "y3", "y4"], inits, opset=13)
    _check(path, {"x": _w(2, 3, 4, 5)})
    g = edgellm.onnx.import_onnx(path).graph
    assert "shape" not in {op.kind for op in g.ops}
    reshape = next(op for op in g.ops if op.kind == "reshape")
    assert [str(d) for d in reshape.attrs["shape"]] == ["batch", "60"]


def test_malformed_files(tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x08\x07\x12\xff\xff\xff\xff\x0f garbage")
    with pytest.raises(ModelFileError, match="junk.onnx"):
        edgellm.load(junk)
    with pytest.raises(ModelFileError, match="missing.onnx"):
        edgellm.load(tmp_path / "missing.onnx")
    good = _model(tmp_path, [helper.make_node("Relu", ["x"], ["y"], name="r")], [("x", [2])], ["y"], name="good")
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(good.read_bytes()[:-7])
    with pytest.raises(ModelFileError, match="cut.onnx"):
        edgellm.load(cut)
    with pytest.raises(EdgeLLMError, match="dimension 0 must be 2"):
        edgellm.load(good)(np.zeros(3, dtype=np.float32))


def test_unsupported_ops_are_all_listed(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="ok"),
             helper.make_node("LpNormalization", ["a"], ["b"], name="norm_a"),
             helper.make_node("Relu", ["b"], ["c"], name="ok2"),
             helper.make_node("Hardmax", ["c"], ["y"], name="hard_b")]
    path = _model(tmp_path, nodes, [("x", [2, 3])], ["y"])
    with pytest.raises(UnsupportedOpError) as e:
        edgellm.load(path)
    msg = str(e.value)
    assert "norm_a (LpNormalization)" in msg and "hard_b (Hardmax)" in msg and "2 node(s)" in msg


def test_unsupported_forms_of_supported_ops_are_named(tmp_path):
    """Forms the kernels do not compute are refused at import, naming the node, never run wrongly:
    a dilated AveragePool (opset 19) and negative Gather indices on a dynamic axis."""
    pool = helper.make_node("AveragePool", ["x"], ["y"], name="dil_pool", kernel_shape=[2, 2], dilations=[2, 2])
    path = _model(tmp_path, [pool], [("x", [1, 2, 8, 8])], ["y"], opset=19, name="dilated")
    with pytest.raises(UnsupportedOpError, match=r"dilated\.onnx.*dil_pool.*AveragePool.*dilations"):
        edgellm.load(path)
    gather = helper.make_node("Gather", ["x", "i"], ["y"], name="neg_gather", axis=0)
    path = _model(tmp_path, [gather], [("x", ["batch", 3])], ["y"], inits=[("i", np.array([0, -1], np.int64))],
                  name="gather")
    with pytest.raises(UnsupportedOpError, match=r"neg_gather.*negative index on a dynamic axis"):
        edgellm.load(path)


# -- the cuda kernels, in Triton's interpreter (tiny shapes), against torch float64 ----------------

@pytest.fixture(scope="module")
def conv_kernels():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from edgellm.backends.cuda.kernels import conv

    return conv


def _kernel_device():
    """Where the kernel tests' tensors live: the GPU when there is one, else the host (interpreter)."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("case", [
    dict(c=5, o=7, groups=1, k=3, s=(1, 1), p=(1, 1, 1, 1), d=(1, 1), act="relu", res=True, res_act="relu"),
    dict(c=6, o=9, groups=3, k=3, s=(2, 1), p=(0, 1, 2, 1), d=(1, 2), act="hardswish", res=False, res_act=None),
    dict(c=8, o=8, groups=8, k=3, s=(2, 2), p=(1, 1, 1, 1), d=(1, 1), act="clip", res=False, res_act=None),
    dict(c=4, o=4, groups=4, k=5, s=(1, 1), p=(2, 2, 2, 2), d=(1, 1), act="silu", res=True, res_act=None),
    dict(c=3, o=10, groups=1, k=1, s=(1, 1), p=(0, 0, 0, 0), d=(1, 1), act="gelu", res=False, res_act=None),
])
@pytest.mark.parametrize("split_k", [None, 3])
def test_triton_conv_matches_reference(conv_kernels, case, split_k):
    import torch
    import torch.nn.functional as F

    from edgellm.backends.cpu_nd import activate

    g = torch.Generator().manual_seed(1)
    n, h, w = 2, 7, 9
    x = torch.randn(n, case["c"], h, w, generator=g)
    wt = torch.randn(case["o"], case["c"] // case["groups"], case["k"], case["k"], generator=g)
    b = torch.randn(case["o"], generator=g)
    t, l, bo, r = case["p"]
    ref = F.conv2d(F.pad(x.double(), (l, r, t, bo)), wt.double(), b.double(), case["s"], 0, case["d"], case["groups"])
    args = {"min": 0.0, "max": 6.0} if case["act"] == "clip" else {}
    ref = activate(ref, case["act"], args)
    res = torch.randn(ref.shape, generator=g) if case["res"] else None
    if res is not None:
        ref = activate(ref + res.double(), case["res_act"], {})
    depthwise = case["groups"] == case["c"] == case["o"]
    if depthwise and split_k:
        pytest.skip("the depthwise kernel has no reduction to split")
    wp = wt.reshape(case["o"], -1).contiguous() if depthwise else conv_kernels.pack_conv_weight(wt, case["groups"])
    dev = _kernel_device()
    x, wp, b = x.to(dev), wp.to(dev), b.to(dev)
    res = res.to(dev) if res is not None else None
    out = torch.full(ref.shape, float("nan"), device=dev)  # poisoned: every element must be written
    y = conv_kernels.conv2d(x, wp, b, res, out_channels=case["o"], kernel=(case["k"], case["k"]), strides=case["s"],
                            pads=(t, l), dilations=case["d"], groups=case["groups"], out_hw=tuple(ref.shape[2:]),
                            act=case["act"], act_args=args, res_act=case["res_act"],
                            depthwise_w=wp if depthwise else None, out=out, split_k=split_k).cpu()
    assert not torch.isnan(y).any()
    assert rel_err(y.numpy(), ref.numpy()) < 1e-5


@pytest.mark.parametrize("is_max,count_pad", [(True, False), (False, False), (False, True)])
def test_triton_pool_matches_reference(conv_kernels, is_max, count_pad):
    import torch
    import torch.nn.functional as F

    x = torch.randn(2, 3, 9, 10, generator=torch.Generator().manual_seed(2))
    if is_max:
        ref = F.max_pool2d(x, 3, 2, 1)
    else:
        ref = F.avg_pool2d(x, 3, 2, 1, count_include_pad=count_pad)
    dev = _kernel_device()
    out = torch.full(ref.shape, float("nan"), device=dev)
    y = conv_kernels.pool2d(x.to(dev), is_max=is_max, kernel=(3, 3), strides=(2, 2), pads=(1, 1), dilations=(1, 1),
                            out_hw=tuple(ref.shape[2:]), count_include_pad=count_pad, pads_end=(1, 1), out=out).cpu()
    assert rel_err(y.numpy(), ref.numpy()) < 1e-6
    gp = conv_kernels.global_avgpool(x.to(dev)).cpu()
    assert rel_err(gp.numpy(), x.double().mean((2, 3), keepdim=True).numpy()) < 1e-6


def test_external_data_is_memory_mapped(tmp_path):
    w = _w(8, 4, 3, 3)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    path = _model(tmp_path, nodes, [("x", [1, 4, 6, 6])], ["y"], [("w", w)], name="ext")
    m = onnx.load(str(path))
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="ext.bin",
              size_threshold=0)
    imp = edgellm.onnx.import_onnx(path)
    assert isinstance(imp.weights["w"], np.memmap) and np.array_equal(imp.weights["w"], w)
    _check(path, {"x": _w(1, 4, 6, 6)})
    (tmp_path / "ext.bin").write_bytes(b"\0" * 10)  # truncated external data: named in the error
    with pytest.raises(ModelFileError, match="'w'"):
        edgellm.load(path)
