"""edgellm: run large generative models fast on GPUs with generated kernels."""

__version__ = "0.1.0"

import os as _os

# The OpenMP runtime's idle threads (torch's and the native CPU kernels' one pool) spin this many
# times before they sleep, instead of GNU libgomp's default 300,000 (a few milliseconds). A split
# model's CPU segments start every few milliseconds, after the GPU's, and waking a sleeping pool
# cost 7-15% of decode speed on the H100 host (2026-11-27, docs/benchmarks.md). Read once, when the
# runtime loads: this takes effect where edgellm is imported before torch (the CLI, the server);
# a value the user set is kept.
_os.environ.setdefault("GOMP_SPINCOUNT", "2000000")

from .errors import EdgeLLMError  # noqa: E402

__all__ = ["EdgeLLMError", "Model", "load", "__version__"]


def __getattr__(name: str):
    # Model and load import numpy, torch, gguf...: loaded on first use, so that `edgellm --help`, argument
    # errors and a missing dependency's one-line message come before (and without) any of them
    if name in ("Model", "load"):
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module 'edgellm' has no attribute '{name}'")
