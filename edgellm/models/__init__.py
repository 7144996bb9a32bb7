"""Model families: each turns a model file's metadata into a Graph (no per-model forward code).
Every family is the shared decoder of blocks.py with its differences set in ModelConfig by the
family's file (llama.py, qwen3.py, gemma3.py, phi3.py)."""

from __future__ import annotations

from ..errors import UnsupportedArchitectureError
from ..gguf_file import GGUFFile
from ..graph.ir import Graph
from . import gemma3, llama, phi3, qwen3
from .config import Family, ModelConfig, read_config

FAMILIES: dict[str, Family] = {fam.arch: fam for mod in (llama, qwen3, gemma3, phi3) for fam in mod.FAMILIES}
SUPPORTED_ARCHITECTURES = tuple(sorted(FAMILIES))


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    arch = f.architecture
    if arch not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"{f.path.name}: architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return read_config(f, FAMILIES[arch])


def build_graph(cfg: ModelConfig, f: GGUFFile, logits: str = "all", kv_chunk: int | None = None) -> Graph:
    """kv_chunk: the prefill chunk the programs run with; given, sliding-window layers get ring
    caches of ModelConfig.kv_rows rows instead of the whole context."""
    # the shared decoder (and with it sympy) is imported when a graph is built: a program read
    # back from the cache builds none
    from .blocks import build_decoder

    return build_decoder(cfg, f, logits, kv_chunk)


__all__ = ["FAMILIES", "SUPPORTED_ARCHITECTURES", "ModelConfig", "build_graph", "config_from_gguf"]
