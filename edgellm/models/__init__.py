"""Model families: each turns a model file's metadata into a Graph (no per-model forward code)."""

from __future__ import annotations

from ..gguf_file import GGUFFile
from ..graph.ir import Graph
from .config import LLAMA_LIKE, ModelConfig, config_from_gguf

# arch -> the module of its builder, imported when a graph is built (a program read back from the
# cache builds none, and so imports no builder and no sympy)
BUILDERS = {arch: "llama" for arch in LLAMA_LIKE}


def build_graph(cfg: ModelConfig, f: GGUFFile, logits: str = "all") -> Graph:
    import importlib

    module = importlib.import_module(f".{BUILDERS[cfg.arch]}", __name__)
    return getattr(module, f"build_{BUILDERS[cfg.arch]}")(cfg, f, logits)


__all__ = ["BUILDERS", "ModelConfig", "build_graph", "config_from_gguf"]
