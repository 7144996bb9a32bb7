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



# bytes per element of the layouts the cuda kernels read (kernels/packing.py); formats without a
# kernel layout are stored as Q8_0
_CUDA_LAYOUT_BYTES = {"F16": 2, "BF16": 2, "F32": 2, "Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q8_0": 34 / 32}


class CudaInfo:
    name = "cuda"
    SUPPORTED_OPS = frozenset({
        "embedding", "rms_norm", "add_rms_norm", "linear", "linear_qkv", "linear_swiglu", "swiglu",
        "rope_qkv_store", "attention", "last_row", "add", "mul", "silu", "rope", "rope_store", "kv_store",
        "gelu", "scale", "softcap",
    })

    @staticmethod
    def resident_weight_bytes(f: GGUFFile) -> int:
        """2-D weights in their kernel layouts; vectors as float32."""
        total = 0
        for t in f.tensors.values():
            if len(t.shape) < 2:
                total += 4 * t.n_elements
            else:
                total += int(t.n_elements * _CUDA_LAYOUT_BYTES.get(t.type_name, 34 / 32))
        return total

    @staticmethod
    def kv_cache_bytes(cfg, ctx: int) -> int:
        return 2 * cfg.n_layers * ctx * cfg.kv_dim * 2  # fp16

    @staticmethod
    def output_bytes(cfg, prefill: int) -> int:
        return (prefill + 1) * cfg.vocab_size * 4  # float32 logits of a prefill chunk and of a decode step

    @staticmethod
    def runtime_overhead_bytes(f: GGUFFile, cfg) -> int:
        """Decode attention workspaces and the CUDA graph's pool: a few MiB."""
        return 8 << 20


# bytes per element of the layouts the webgpu kernels read (webgpu/codegen.py); F32/BF16 become
# F16, Q4_K Q4_1, Q5_0 and formats without a layout of their own Q8_0
_WEBGPU_LAYOUT_BYTES = {"F16": 2, "BF16": 2, "F32": 2, "Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q4_K": 20 / 32,
                        "Q8_0": 34 / 32}


class WebgpuInfo:
    name = "webgpu"
    SUPPORTED_OPS = frozenset({
        "embedding", "rms_norm", "add_rms_norm", "linear", "linear_qkv", "linear_swiglu", "swiglu",
        "rope_qkv_store", "attention", "last_row", "add", "mul", "silu", "rope", "rope_store", "kv_store",
    })

    @staticmethod
    def resident_weight_bytes(f: GGUFFile) -> int:
        """2-D weights in their kernel layouts; vectors as float32."""
        return sum(4 * t.n_elements if len(t.shape) < 2 else int(t.n_elements * _WEBGPU_LAYOUT_BYTES.get(t.type_name, 34 / 32))
                   for t in f.tensors.values())

    @staticmethod
    def kv_cache_bytes(cfg, ctx: int) -> int:
        return 2 * cfg.n_layers * ctx * cfg.kv_dim * 2  # fp16 (float32 on adapters without shader-f16)

    @staticmethod
    def output_bytes(cfg, prefill: int) -> int:
        return (prefill + 1) * cfg.vocab_size * 4  # float32 logits of a prefill chunk and of a decode step

    @staticmethod
    def runtime_overhead_bytes(f: GGUFFile, cfg) -> int:
        """RoPE tables, the decode attention workspace, the Vulkan/Metal driver's own: about 16 MiB."""
        return 16 << 20
