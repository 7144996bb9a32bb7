"""Test helpers: torchvision architectures with random weights, exported to ONNX in the test.

torchvision's PyPI wheels are built against CUDA torch; beside the CPU torch the project pins,
`import torchvision` fails in its C++ operator registration ('operator torchvision::nms does not
exist'). The model definitions are plain Python and need none of those operators, so
scripts/install.sh unpacks the wheel into .venv/torchvision-models (outside site-packages, so no
other library finds a half-working torchvision) and this helper imports `torchvision.models`
without running torchvision/__init__.py.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import numpy as np


# the architectures the tests export (random weights, small images): constructor kwargs, image size,
# whether height and width are dynamic in the exported file
ARCHS = {
    "resnet18": ({}, 32, True),
    "mobilenet_v2": ({}, 32, True),
    "mobilenet_v3_small": ({}, 32, True),
    "efficientnet_b0": ({}, 32, True),
    "convnext_tiny": ({}, 32, True),
    "vit_b_16": ({"image_size": 32}, 32, False),
}


def torchvision_models():
    """torchvision.models from the unpacked wheel (EDGELLM_TORCHVISION_MODELS names its folder
    elsewhere, e.g. on a GPU machine without a matching torchvision)."""
    import os

    bases = [Path(os.environ["EDGELLM_TORCHVISION_MODELS"])] if os.environ.get("EDGELLM_TORCHVISION_MODELS") else []
    bases += [Path(sys.prefix) / "torchvision-models", Path(__file__).resolve().parents[1] / ".venv" / "torchvision-models"]
    for base in bases:
        pkg_dir = base / "torchvision"
        if pkg_dir.is_dir():
            break
    else:
        import pytest  # (benchmarks/bench_onnx.py uses these helpers without pytest installed)

        pytest.skip("torchvision model definitions not installed (scripts/install.sh --test puts them in "
                    ".venv/torchvision-models)")
    if "torchvision" not in sys.modules:
        pkg = types.ModuleType("torchvision")
        pkg.__path__ = [str(pkg_dir)]
        sys.modules["torchvision"] = pkg
    return importlib.import_module("torchvision.models")


def randomize(model, seed: int = 0):
    """Random weights everywhere, including what torchvision initialises to constants (BatchNorm
    statistics and affine parameters, zero-initialised heads), so folding and every layer matter."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
        for p in model.parameters():
            if p.abs().max() == 0 or (p.dim() == 1 and bool((p == p.flatten()[0]).all())):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def export(model, path: Path, size: int, dynamic_hw: bool = True, batch: int = 1, opset: int = 17) -> Path:
    import torch

    axes = {0: "batch", 2: "height", 3: "width"} if dynamic_hw else {0: "batch"}
    torch.onnx.export(model, (torch.randn(batch, 3, size, size),), str(path), dynamo=False, opset_version=opset,
                      input_names=["input"], output_names=["logits"], dynamic_axes={"input": axes})
    return path


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def onnxruntime_run(path: Path, feeds: dict) -> list[np.ndarray]:
    import pytest

    ort = pytest.importorskip("onnxruntime")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, feeds)
