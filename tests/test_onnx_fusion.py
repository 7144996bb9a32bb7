"""Fusion passes for imported transformers and ConvNeXt (edgellm.compiler.passes: fuse_attention,
fuse_layer_norm, fuse_linear_act, fuse_mul_add, fuse_add_layer_norm) and the cuda kernels of their op kinds: small
torchvision architectures exported in the test, run by the cpu backend and by the cuda backend
(Triton's interpreter here) against onnxruntime on the same file; the fused graph's op kinds;
hand-written ONNX graphs for the other exporter forms and for what must stay unfused; the new
kernels against torch float64."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx_models import export, onnxruntime_run, randomize, rel_err, torchvision_models  # noqa: E402

import edgellm  # noqa: E402
from edgellm.onnx import load_onnx  # noqa: E402

RNG = np.random.default_rng(7)


def _interpreter_or_gpu():
    import os

    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")


def _small_vit(layers=2):
    tvm = torchvision_models()
    from torchvision.models.vision_transformer import VisionTransformer

    assert tvm is not None
    return randomize(VisionTransformer(image_size=32, patch_size=16, num_layers=layers, num_heads=4, hidden_dim=64,
                                       mlp_dim=128, num_classes=10))


def _small_convnext():
    tvm = torchvision_models()
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    assert tvm is not None
    m = ConvNeXt([CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 1)], layer_scale=0.5, num_classes=10)
    m = randomize(m)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the layer scales differ per channel, so the fused mul_add's broadcast matters
        for mod in m.modules():
            if hasattr(mod, "layer_scale"):
                mod.layer_scale.copy_(torch.rand(mod.layer_scale.shape, generator=g) + 0.25)
    return m


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("fusion")
    cache = {}

    def get(name):
        if name not in cache:
            if name.startswith("vit"):
                opset = int(name.split("_")[1])
                cache[name] = export(_small_vit(), d / f"{name}.onnx", 32, dynamic_hw=False, opset=opset)
            else:
                cache[name] = export(_small_convnext(), d / f"{name}.onnx", 32)
        return cache[name]
    return get


def _compiled(m):
    return next(iter(m.runner._bound.values())).compiled


@pytest.mark.parametrize("opset", [15, 17, 18])  # 15: LayerNorm decomposed by the exporter
def test_vit_attention_fused_cpu(models, opset):
    path = models(f"vit_{opset}")
    raw = edgellm.onnx.import_onnx(path).graph.op_counts()
    assert ("reduce_mean" in raw) == (opset < 17) and raw["softmax"] == 2
    x = RNG.standard_normal((2, 3, 32, 32)).astype(np.float32)
    ref = onnxruntime_run(path, {"input": x})[0]
    m = edgellm.load(path)
    out = m(x)["logits"]
    assert out.shape == ref.shape and rel_err(out, ref) < 1e-4
    counts = _compiled(m).graph.op_counts()
    # per layer: one attention op, the MLP's first projection with its GELU; no softmax / matmul / gelu left
    assert counts["sdpa"] == 2 and counts["linear_act"] == 2
    assert not {"softmax", "matmul", "gelu", "mul", "div", "erf", "reduce_mean", "sqrt", "pow"} & set(counts)
    # each residual add with the LayerNorm after it (the next layer's, or the encoder's last);
    # left apart: the first LayerNorm, after the position embedding's add (a broadcast over the batch)
    assert counts["add_layer_norm"] == 4 and counts["layer_norm"] == 1 and counts["add"] == 1
    unfused = edgellm.load(path, fuse=False)
    assert "sdpa" not in _compiled_counts(unfused, x)
    assert rel_err(unfused(x)["logits"], out) < 1e-5


def _compiled_counts(m, x):
    m(x)
    return _compiled(m).graph.op_counts()


@pytest.mark.parametrize("dtype,tol", [("f32", 1e-4), ("f16", 2e-2)])
def test_vit_cuda_backend_in_interpreter(models, dtype, tol):
    _interpreter_or_gpu()
    path = models("vit_17")
    m = load_onnx(path, backend="cuda", dtype=dtype)
    x = RNG.standard_normal((1, 3, 32, 32)).astype(np.float32)
    ref = onnxruntime_run(path, {"input": x})[0]
    assert rel_err(m(x)["logits"], ref) < tol
    c = _compiled(m)
    assert [s.backend for s in c.segments] == ["cuda"]
    assert c.graph.op_counts()["sdpa"] == 2 and c.graph.op_counts()["add_layer_norm"] == 4


def test_convnext_fused_cpu_and_cuda(models):
    path = models("convnext")
    x = RNG.standard_normal((2, 3, 32, 32)).astype(np.float32)
    ref = onnxruntime_run(path, {"input": x})[0]
    m = edgellm.load(path)
    assert rel_err(m(x)["logits"], ref) < 1e-4
    counts = _compiled(m).graph.op_counts()
    # per block: depthwise conv, layer_norm, linear_act, linear, mul_add (layer scale + residual)
    assert counts["mul_add"] == 3 and counts["linear_act"] == 3
    assert not {"mul", "add", "gelu"} & set(counts)
    _interpreter_or_gpu()
    mc = load_onnx(path, backend="cuda", dtype="f32")
    # batch 2: the transposed view's rows fall into two stride groups in the layer-norm kernel
    assert rel_err(mc(x)["logits"], ref) < 1e-4
    assert [s.backend for s in _compiled(mc).segments] == ["cuda"]
    assert rel_err(load_onnx(path, backend="cuda", dtype="f16")(x[:1])["logits"], ref[:1]) < 2e-2


# -- hand-written graphs: other exporter forms, and patterns that must stay as they are ---------------

def _model(tmp_path, nodes, inputs, outputs, inits=(), opset=17, name="m"):
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    path = tmp_path / f"{name}.onnx"
    onnx.save(m, str(path))
    return path


def _w(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _run_both(path, feeds, tol=1e-5):
    ref = onnxruntime_run(path, feeds)
    m = edgellm.load(path)
    out = list(m(feeds).values())
    for o, r in zip(out, ref):
        assert o.shape == r.shape and rel_err(o, r) < tol, rel_err(o, r)
    return _compiled(m).graph.op_counts()


@pytest.mark.parametrize("form", ["div_scores", "mul_both", "k_scaled_before_transpose", "no_scale"])
def test_attention_forms(tmp_path, form):
    """Scale on the scores (Div by sqrt(d), as opset-18 exports and hand-written models have it), on
    q and k^T separately (torch.onnx's MultiheadAttention), before k's transpose, or none."""
    d = 8
    nodes, inits = [], [("c", np.array(np.sqrt(d), dtype=np.float32)), ("r", np.array(d ** -0.25, dtype=np.float32))]
    q, kt = "q", "kt"
    if form == "k_scaled_before_transpose":
        nodes.append(helper.make_node("Mul", ["k", "r"], ["ks"]))
        nodes.append(helper.make_node("Transpose", ["ks"], ["kt"], perm=[0, 1, 3, 2]))
    else:
        nodes.append(helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]))
    if form in ("mul_both", "k_scaled_before_transpose"):
        nodes.append(helper.make_node("Mul", ["q", "r"], ["qs"]))
        q = "qs"
    if form == "mul_both":
        nodes.append(helper.make_node("Mul", ["r", "kt"], ["kts"]))
        kt = "kts"
    nodes.append(helper.make_node("MatMul", [q, kt], ["s"]))
    s = "s"
    if form == "div_scores":
        nodes.append(helper.make_node("Div", ["s", "c"], ["sd"]))
        s = "sd"
    nodes += [helper.make_node("Softmax", [s], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["o"])]
    shapes = [("q", [2, 3, 5, d]), ("k", [2, 3, 7, d]), ("v", [2, 3, 7, 4])]
    path = _model(tmp_path, nodes, shapes, ["o"], inits, opset=18)
    counts = _run_both(path, {n: _w(*s) for n, s in shapes})
    assert counts == {"sdpa": 1}


def test_attention_left_alone(tmp_path):
    """Probabilities read twice (returned as well), softmax over another axis, k not transposed:
    each stays the matmul / softmax / matmul it was."""
    d = 4
    shapes = [("q", [1, 2, 5, d]), ("k", [1, 2, 5, d]), ("v", [1, 2, 5, d])]
    feeds = {n: _w(*s) for n, s in shapes}
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    counts = _run_both(_model(tmp_path, nodes, shapes, ["o", "p"], name="twice"), feeds)
    assert "sdpa" not in counts and counts["softmax"] == 1
    nodes[2] = helper.make_node("Softmax", ["s"], ["p"], axis=2)
    counts = _run_both(_model(tmp_path, nodes, shapes, ["o"], name="axis"), feeds)
    assert "sdpa" not in counts and counts["softmax"] == 1
    nodes[0] = helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 2, 3])
    nodes[1] = helper.make_node("MatMul", ["q", "kt"], ["s"])
    nodes[2] = helper.make_node("Softmax", ["s"], ["p"], axis=-1)
    nodes[3] = helper.make_node("MatMul", ["p", "v"], ["o"])
    counts = _run_both(_model(tmp_path, nodes, [("q", [1, 2, 5, 5]), ("k", [1, 2, 5, 5]), ("v", [1, 2, 5, 4])], ["o"],
                                     name="notrans"),
                       {"q": _w(1, 2, 5, 5), "k": _w(1, 2, 5, 5), "v": _w(1, 2, 5, 4)})
    assert "sdpa" not in counts


def test_decomposed_layer_norm_fused(tmp_path):
    """torch.onnx at opset < 17 writes LayerNorm as ReduceMean / Sub / Pow / ReduceMean / Add /
    Sqrt / Div / Mul / Add: one layer_norm after the passes."""
    ln = torch.nn.Sequential(torch.nn.LayerNorm(24, eps=1e-5), torch.nn.Linear(24, 16), torch.nn.ReLU(),
                             torch.nn.LayerNorm(16, elementwise_affine=True, bias=False)).eval()
    with torch.no_grad():
        for p in ln.parameters():
            p.copy_(torch.randn(p.shape) * 0.5 + 0.3)
    path = tmp_path / "ln.onnx"
    torch.onnx.export(ln, (torch.randn(2, 5, 24),), str(path), dynamo=False, opset_version=15,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch", 1: "seq"}})
    raw = edgellm.onnx.import_onnx(path).graph.op_counts()
    assert raw.get("reduce_mean") == 4 and "layer_norm" not in raw  # the exporter's decomposed form
    counts = _run_both(path, {"x": _w(3, 7, 24)}, tol=1e-5)
    assert counts == {"layer_norm": 2, "linear_act": 1}


@pytest.mark.parametrize("axes,power", [([0], 2.0), ([-1], 4.0)])
def test_decomposed_layer_norm_left_alone(tmp_path, axes, power):
    """A mean over a leading axis (the weight is per column), or a fourth power, is not a LayerNorm."""
    inits = [("pw", np.array(power, dtype=np.float32)), ("eps", np.array(1e-5, dtype=np.float32)), ("w", _w(6))]
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=axes), helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Pow", ["d", "pw"], ["p"]), helper.make_node("ReduceMean", ["p"], ["v"], axes=axes),
             helper.make_node("Add", ["v", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["s"]),
             helper.make_node("Div", ["d", "s"], ["n"]), helper.make_node("Mul", ["n", "w"], ["y"])]
    path = _model(tmp_path, nodes, [("x", [3, 6])], ["y"], inits, opset=13)
    counts = _run_both(path, {"x": _w(3, 6)})
    assert "layer_norm" not in counts and counts["reduce_mean"] == 2


# -- the kernels, against torch float64 ---------------------------------------------------------------

@pytest.mark.parametrize("layout", ["nchw_to_nhwc_batch1", "nchw_to_nhwc_batch2", "contiguous", "three_groups"])
def test_triton_layer_norm_strided(layout):
    _interpreter_or_gpu()
    from edgellm.backends.cuda.kernels.layer_norm import layer_norm, row_strides

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    if layout.startswith("nchw"):
        n = 1 if layout.endswith("1") else 2
        base = torch.randn(n, 12, 5, 3, generator=g)
        x = base.to(dev).permute(0, 2, 3, 1)  # NHWC view of NCHW memory: channels have stride H*W
        assert row_strides(x) is not None
    elif layout == "contiguous":
        x = torch.randn(3, 7, 40, generator=g).to(dev)
    else:  # rows that collapse into three stride groups: copied first, same result
        x = torch.randn(4, 6, 5, 3, 9, generator=g).to(dev).permute(0, 2, 1, 3, 4)[:, :, ::2]
        assert row_strides(x) is None
    c = x.shape[-1]
    w, b = torch.randn(c, generator=g).to(dev), torch.randn(c, generator=g).to(dev)
    x.mul_(3).add_(1)  # a mean and spread far from 0 and 1
    want = torch.nn.functional.layer_norm(x.double(), (c,), w.double(), b.double(), 1e-5)
    got = layer_norm(x, w, b, 1e-5)
    assert got.is_contiguous() and got.shape == x.shape
    assert torch.isfinite(got).all() and (got.double() - want).abs().max() < 1e-4
    got = layer_norm(x, w, None, 1e-5)
    want = torch.nn.functional.layer_norm(x.double(), (c,), w.double(), None, 1e-5)
    assert (got.double() - want).abs().max() < 1e-4
    with pytest.raises(ValueError, match="layer_norm"):
        layer_norm(x, w[:-1], b, 1e-5)


@pytest.mark.parametrize("strided", [False, True])
def test_triton_add_layer_norm(strided):
    """(a + b, layer_norm(a + b)) in one pass; a and b in any layout (a transposed view here)."""
    _interpreter_or_gpu()
    from edgellm.backends.cuda.kernels.layer_norm import layer_norm

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(11)
    a = torch.randn(2, 7, 48, generator=g).to(dev) * 2 + 1
    b = (torch.randn(7, 2, 48, generator=g).to(dev).transpose(0, 1) if strided
         else torch.randn(2, 7, 48, generator=g).to(dev))
    w, bias = torch.randn(48, generator=g).to(dev), torch.randn(48, generator=g).to(dev)
    s, n = layer_norm(a, w, bias, 1e-6, residual=b)
    want_s = a.double() + b.double()
    want_n = torch.nn.functional.layer_norm(want_s, (48,), w.double(), bias.double(), 1e-6)
    assert s.is_contiguous() and n.is_contiguous()
    assert (s.double() - want_s).abs().max() < 1e-5 and (n.double() - want_n).abs().max() < 1e-4
    with pytest.raises(ValueError, match="residual"):
        layer_norm(a, w, bias, 1e-6, residual=b[:, :3])


def test_cuda_fused_kinds_match_reference():
    """The cuda table's sdpa / linear_act / mul_add against the cpu reference kernels (float64)."""
    _interpreter_or_gpu()
    from edgellm.backends.cpu_nd import ND_KERNELS
    from edgellm.backends.cuda.vision import CUDA_ND_KERNELS
    from edgellm.graph.ir import Op

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(9)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    cases = [
        (Op("a", "sdpa", ("q", "k", "v"), ("o",), {"scale": 0.3}), [r(2, 3, 5, 8), r(2, 3, 7, 8), r(2, 3, 7, 4)]),
        (Op("l", "linear_act", ("x", "w", "b"), ("o",), {"has_bias": True, "act": "gelu", "act_args": {"approximate": "none"}}),
         [r(2, 5, 16), r(12, 16), r(12)]),
        (Op("l", "linear_act", ("x", "w"), ("o",), {"has_bias": False, "act": "relu", "act_args": {}}), [r(7, 16), r(12, 16)]),
        (Op("m", "mul_add", ("a", "b", "c"), ("o",), {}), [r(6, 1, 1), r(2, 4, 3, 6).permute(0, 3, 1, 2), r(2, 6, 4, 3)]),
    ]
    cases.append((Op("n", "add_layer_norm", ("a", "b", "w", "bb"), ("s", "n"), {"axis": 2, "eps": 1e-5, "has_bias": True}),
                  [r(2, 5, 24), r(5, 2, 24).transpose(0, 1), r(24), r(24)]))
    for op, ins in cases:
        want = ND_KERNELS[op.kind](op, [t.double() for t in ins])
        got = CUDA_ND_KERNELS[op.kind](op, [t.to(dev) for t in ins])
        for gt, wt in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert gt.shape == wt.shape and torch.isfinite(gt).all()
            assert (gt.double().cpu() - wt).abs().max() < 1e-4 * max(1.0, float(wt.abs().max())), op.kind


def test_layout_chains_merged(tmp_path):
    """Reshape after reshape and transpose after transpose become one op each; a chain that comes
    back to its input's layout disappears; one read twice stays."""
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["a"]), helper.make_node("Reshape", ["a", "s2"], ["b"]),
             helper.make_node("Transpose", ["b"], ["c"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["c"], ["d"], perm=[1, 0, 2]),
             helper.make_node("Transpose", ["d"], ["e"], perm=[1, 2, 0]),  # e = b: (0,2,1) then (1,0,2) then (1,2,0)
             helper.make_node("Relu", ["e"], ["y"]),
             helper.make_node("Transpose", ["y"], ["t1"], perm=[2, 1, 0]),
             helper.make_node("Transpose", ["t1"], ["t2"], perm=[1, 0, 2]),
             helper.make_node("Sigmoid", ["t1"], ["z"])]
    inits = [("s1", np.array([6, 4], dtype=np.int64)), ("s2", np.array([2, 3, 4], dtype=np.int64))]
    path = _model(tmp_path, nodes, [("x", [4, 6])], ["t2", "z"], inits)
    counts = _run_both(path, {"x": _w(4, 6)})
    assert counts == {"reshape": 1, "relu": 1, "transpose": 2, "sigmoid": 1}


def test_packed_conv_weight_cache_follows_the_tensor():
    """The conv weights' packing is cached per source tensor: the same weight in another dtype gets
    its own, and a freed weight's entry goes with it (another model's weight of the same shape may
    reuse the address: it used to get the stale packing, f32 weights in an f16 model)."""
    import gc

    from edgellm.backends.cuda import vision

    vision._PACKED.clear()
    w = torch.randn(8, 3, 3, 3)
    a = vision._packed(w, 1, False)
    assert vision._packed(w, 1, False) is a and len(vision._PACKED) == 1
    b = vision._packed(w.half(), 1, False)  # a temporary: its entry is dropped with it
    assert b.dtype == torch.float16
    gc.collect()
    assert len(vision._PACKED) == 1
    del w, a
    gc.collect()
    assert not vision._PACKED


@pytest.mark.parametrize("dtype,act", [(torch.float32, "gelu"), (torch.float32, "relu"), (torch.float16, "gelu")])
def test_triton_gemm_act(dtype, act):
    """Our GEMM with bias + activation epilogue (EDGELLM_VISION_GEMM=triton) against float64: rows
    not a multiple of the tile, an input with a row stride (a slice of a wider tensor)."""
    _interpreter_or_gpu()
    from edgellm.backends.cuda.kernels.dense import gemm_act

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(13)
    wide = torch.randn(2, 19, 56, generator=g)
    x = wide[..., :40].to(dev, dtype)  # [2, 19, 40] with row stride 56
    w = (torch.randn(36, 40, generator=g) / 6).to(dev, dtype)
    b = torch.randn(36, generator=g).to(dev, dtype)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    want = torch.relu(want) if act == "relu" else torch.nn.functional.gelu(want)
    for bias, ref in ((b, want), (None, None)):
        got = gemm_act(x, w, bias, act)
        if ref is None:
            ref = torch.nn.functional.linear(x.double(), w.double())
            ref = torch.relu(ref) if act == "relu" else torch.nn.functional.gelu(ref)
        assert got.shape == (2, 19, 36) and got.dtype == dtype and torch.isfinite(got).all()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert (got.double().cpu() - ref.cpu()).abs().max() < tol * max(1.0, float(ref.abs().max()))
    with pytest.raises(ValueError, match="weight"):
        gemm_act(x, w[:, :-1], b, act)


def test_vit_with_triton_gemm_act(models, monkeypatch):
    _interpreter_or_gpu()
    from edgellm.backends.cuda.kernels import dense

    monkeypatch.setenv("EDGELLM_VISION_GEMM", "triton")
    calls = []
    real = dense.gemm_act
    monkeypatch.setattr(dense, "gemm_act", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    path = models("vit_17")
    m = load_onnx(path, backend="cuda", dtype="f32")
    x = RNG.standard_normal((1, 3, 32, 32)).astype(np.float32)
    assert rel_err(m(x)["logits"], onnxruntime_run(path, {"input": x})[0]) < 1e-4
    assert calls == ["gelu", "gelu"]  # each layer's first MLP projection


def test_onnx_ops_script_reports_counts(tmp_path):
    """benchmarks/onnx_ops.py: op counts before and after the passes, per model, as JSON (no GPU
    here: --kernels is skipped with a note)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "ops.json"
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "onnx_ops.py"), "--models", "resnet18", "--size", "32",
                        "--out", str(out)] + ([] if torch.cuda.is_available() else ["--kernels"]),
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["model"] == "resnet18" and row["ops_unfused"] == 50 and row["ops_fused"] == 24
    assert row["kinds_fused"]["conv2d"] == 20 and "relu" not in row["kinds_fused"]
    assert "resnet18" in r.stdout and ("needs a CUDA GPU" in r.stderr or torch.cuda.is_available())
