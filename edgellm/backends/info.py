"""What a backend is, without importing it: its name, the ops it supports, and how much memory
it needs for a model (used by `edgellm plan`, which must not load torch or any weight)."""

from __future__ import annotations

from ..gguf_file import GGUFFile


class CpuInfo:
    name = "cpu"
    SUPPORTED_OPS = None  # every op (the reference backend)

    # -- what a run costs, from the file header alone (edgellm plan) ---------------------------
    @staticmethod
    def resident_weight_bytes(f: GGUFFile) -> int:
        """Every tensor held as float32."""
        return sum(t.n_elements * 4 for t in f.tensors.values())

    @staticmethod
    def kv_cache_bytes(cfg, ctx: int) -> int:
        return 2 * cfg.n_layers * ctx * cfg.kv_dim * 4

    @staticmethod
    def output_bytes(cfg, prefill: int) -> int:
        """Logits of the last position (generation), as a tensor and its numpy copy."""
        return 2 * cfg.vocab_size * 4

    @staticmethod
    def runtime_overhead_bytes(f: GGUFFile, cfg) -> int:
        """The file's tensor pages (memory-mapped, all read once at load and kept mapped), the
        tokenizer (about 400 bytes per vocabulary entry and merge, measured on SmolLM2) and the
        graphs and programs (about 16 MiB)."""
        vocab_entries = len(f.metadata.get("tokenizer.ggml.tokens", ())) + len(f.metadata.get("tokenizer.ggml.merges", ()))
        return f.total_tensor_bytes + 400 * vocab_entries + (16 << 20)

