"""edgellm: run large generative models fast on GPUs with generated kernels."""

__version__ = "0.1.0"
