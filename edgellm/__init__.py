"""edgellm: run large generative models fast on GPUs with generated kernels."""

__version__ = "0.1.0"

from .errors import EdgeLLMError  # noqa: E402

__all__ = ["EdgeLLMError", "Model", "load", "__version__"]


def __getattr__(name: str):
    # Model and load import numpy, torch, gguf...: loaded on first use, so that `edgellm --help`, argument
    # errors and a missing dependency's one-line message come before (and without) any of them
    if name in ("Model", "load"):
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module 'edgellm' has no attribute '{name}'")
