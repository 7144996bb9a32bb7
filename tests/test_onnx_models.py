"""torchvision architectures (random weights) exported to ONNX: edgellm's cpu backend against
onnxruntime on the same file and input, within 1e-4 relative (fp32)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
from onnx_models import ARCHS, export, onnxruntime_run, randomize, rel_err, torchvision_models  # noqa: E402

import edgellm  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tvm = torchvision_models()
    d = tmp_path_factory.mktemp("onnx_models")
    cache = {}

    def get(name):
        if name not in cache:
            kwargs, size, dyn = ARCHS[name]
            model = randomize(getattr(tvm, name)(**kwargs))
            cache[name] = (export(model, d / f"{name}.onnx", size, dyn), size)
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(ARCHS))
def test_architecture_matches_onnxruntime(exported, name):
    path, size = exported(name)
    m = edgellm.load(path)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, size, size)).astype(np.float32)  # batch 2: the exported batch was 1
    ref = onnxruntime_run(path, {"input": x})[0]
    out = m(x)
    assert list(out) == ["logits"]
    assert out["logits"].shape == ref.shape
    assert rel_err(out["logits"], ref) < 1e-4
    # the memory plan the run used covers the whole network's intermediates
    c = next(iter(m.runner._bound.values())).compiled
    assert len(c.records) > 10 and c.plan.total_bytes <= c.plans["naive"].total_bytes
    # GELU recomposed from x*(1+erf(x/sqrt2))*0.5; every relu/relu6/sigmoid follows a conv and is fused into it
    assert not {"erf", "sigmoid", "relu", "clip"} & set(c.graph.op_counts())


def test_dynamic_image_size_and_fusion(exported):
    path, _ = exported("resnet18")
    m = edgellm.load(path)
    x = np.random.default_rng(2).standard_normal((1, 3, 40, 48)).astype(np.float32)  # another height and width
    assert rel_err(m(x)["logits"], onnxruntime_run(path, {"input": x})[0]) < 1e-4
    g = next(iter(m.runner._bound.values())).compiled.graph
    counts = g.op_counts()
    # BatchNorm folded at import, relu and the residual add fused into the convolutions
    assert "relu" not in counts and "add" not in counts and counts["conv2d"] == 20
    assert sum(1 for op in g.ops if op.attrs.get("has_residual") and op.attrs.get("res_act") == "relu") == 8
    # the graph's shapes are expressions in the file's dynamic dimensions
    assert {s.name for s in g.tensors[g.inputs[0]].shape[0].free_symbols} == {"batch"}
    unfused = edgellm.load(path, fuse=False)
    assert rel_err(unfused(x)["logits"], m(x)["logits"]) < 1e-5


def test_plan_reports_memory(exported, capsys):
    from edgellm.cli import main

    path, _ = exported("mobilenet_v3_small")
    assert main(["plan", str(path), "--size", "batch=1,height=64,width=64"]) == 0
    out = capsys.readouterr().out
    for word in ("greedy_by_size", "naive", "lower bound", "conv2d"):
        assert word in out


@pytest.fixture(scope="module")
def small_mobilenet(tmp_path_factory):
    tvm = torchvision_models()
    model = randomize(tvm.mobilenet_v3_small(width_mult=0.25, num_classes=10))
    return export(model, tmp_path_factory.mktemp("small") / "mobilenet_v3_small_x025.onnx", 16)


@pytest.mark.parametrize("dtype,tol", [("f32", 1e-4), ("f16", 2e-2)])
def test_cuda_backend_in_interpreter(small_mobilenet, dtype, tol):
    """The cuda backend's Triton kernels (implicit-GEMM and depthwise conv with fused epilogues,
    global pooling) on a whole network, in Triton's interpreter at a tiny size."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from edgellm.backends.cuda.vision import TRITON_KINDS
    from edgellm.onnx import load_onnx

    m = load_onnx(small_mobilenet, backend="cuda", dtype=dtype)
    x = np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)
    ref = onnxruntime_run(small_mobilenet, {"input": x})[0]
    assert rel_err(m(x)["logits"], ref) < tol
    c = next(iter(m.runner._bound.values())).compiled
    assert [s.backend for s in c.segments] == ["cuda"]
    kinds = c.graph.op_counts()
    assert kinds["conv2d"] == 52 and set(kinds) & TRITON_KINDS == {"conv2d", "global_avgpool"}


def test_cli_run_top5_and_bench(exported, small_mobilenet, tmp_path, capsys):
    from PIL import Image

    from edgellm.cli import main
    from edgellm.onnx.cli import load_image

    path, _ = exported("resnet18")
    img = tmp_path / "cat.png"
    Image.fromarray(np.random.default_rng(4).integers(0, 255, (50, 70, 3), dtype=np.uint8)).save(img)
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(f"class_{i}" for i in range(1000)))
    assert main(["run", str(path), "--input", str(img), "--labels", str(labels), "--image-size", "32",
                 "--resize", "36", "-q"]) == 0
    out = capsys.readouterr().out.splitlines()
    x = load_image(str(img), size=32, resize=36)
    assert x.shape == (1, 3, 32, 32)
    ref = onnxruntime_run(path, {"input": x})[0][0]
    top = [int(line.split()[1]) for line in out[1:6]]
    assert top == list(np.argsort(-ref)[:5]) and out[1].split()[2] == f"class_{top[0]}"
    assert main(["run", str(path), "--input", str(tmp_path / "none.png")]) == 1
    assert "none.png" in capsys.readouterr().err
    assert main(["bench", str(small_mobilenet), "-r", "1", "--no-warmup"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[2] for r in rows] == ["1", "8"] and all(float(r[3]) > 0 for r in rows)
