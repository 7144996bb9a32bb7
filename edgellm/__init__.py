"""edgellm: run large generative models fast on GPUs with generated kernels."""

__version__ = "0.1.0"

from .errors import EdgeLLMError  # noqa: E402
from .model import Model, load  # noqa: E402

__all__ = ["EdgeLLMError", "Model", "load", "__version__"]
