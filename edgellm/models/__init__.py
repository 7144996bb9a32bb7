"""Model families: each turns a model file's metadata into a Graph (no per-model forward code)."""

from __future__ import annotations

from ..gguf_file import GGUFFile
from ..graph.ir import Graph
from .config import LLAMA_LIKE, ModelConfig, config_from_gguf
from .llama import build_llama

BUILDERS = {arch: build_llama for arch in LLAMA_LIKE}


def build_graph(cfg: ModelConfig, f: GGUFFile, logits: str = "all") -> Graph:
    return BUILDERS[cfg.arch](cfg, f, logits)


__all__ = ["BUILDERS", "ModelConfig", "build_graph", "config_from_gguf"]
