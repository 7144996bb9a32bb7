import os
import sys
import tempfile
from pathlib import Path

import pytest

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before triton is imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

# the tests' loads use a cache of their own, not the user's ~/.cache/edgellm
os.environ.setdefault("EDGELLM_CACHE_DIR", tempfile.mkdtemp(prefix="edgellm-test-cache-"))

sys.path.insert(0, os.path.dirname(__file__))  # tests/reference.py, tests/vocab_fixtures.py


@pytest.fixture
def rng(request):
    """A different random stream for every test (fresh inputs), reproducible from the test's name;
    torch's generator seeded the same way where torch is loaded."""
    import zlib

    import numpy as np

    seed = zlib.crc32(request.node.name.encode())
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def webgpu_dev():
    """The first WebGPU adapter's device (lavapipe on a machine without a GPU); skips without one."""
    from edgellm.backends.webgpu.device import get_device
    from edgellm.errors import BackendUnavailableError

    try:
        return get_device()
    except BackendUnavailableError as e:
        pytest.skip(f"no WebGPU adapter: {e}")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from edgellm.default_model import default_model_path as find

    return find()


@pytest.fixture(scope="session")
def default_model(default_model_path):
    import edgellm

    return edgellm.load(default_model_path, backend="cpu", ctx=512)


@pytest.fixture(scope="session")
def hf_default(default_model_path):
    """transformers' own reading of the default GGUF (float32, CPU): the independent reference."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d, name = str(default_model_path.parent), default_model_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    return model, tok
