"""What a backend is, without importing it: its name, the ops it supports, and how much memory
it needs for a model (used by `edgellm plan`, which must not load torch or any weight)."""

from __future__ import annotations

import math
import re

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
    def kv_cache_bytes(cfg, ctx: int, chunk: int | None = None) -> int:
        """K and V caches at context ctx; with chunk (the prefill chunk), sliding-window layers hold
        rings of ModelConfig.kv_rows rows instead of ctx."""
        return 2 * cfg.kv_cache_rows(ctx, chunk) * cfg.kv_dim * 4

    @staticmethod
    def output_bytes(cfg, prefill: int) -> int:
        """Logits of the last position (generation), as a tensor and its numpy copy."""
        return 2 * cfg.vocab_size * 4

    @staticmethod
    def runtime_overhead_bytes(f: GGUFFile, cfg) -> int:
        """The file's tensor pages (memory-mapped, all read once at load and kept mapped), the
        tokenizer (about 400 bytes per vocabulary entry and merge, measured on SmolLM2) and the
        graphs and programs (about 16 MiB)."""
        vocab_entries = f.metadata.length("tokenizer.ggml.tokens") + f.metadata.length("tokenizer.ggml.merges")
        return f.total_tensor_bytes + 400 * vocab_entries + (16 << 20)



INT4_GROUPS = (32, 64, 128, 256)  # group sizes torch's _weight_int4pack_mm_for_cpu takes
_Q4_GROUP = re.compile(r"^Q4_G(\d+)(_SYM)?$")


def int4_group(type_name: str) -> tuple[int, bool] | None:
    """(group size, symmetric) of the 4-bit group formats the cpu-fast backend holds as int4 packs."""
    if type_name == "Q4_0":
        return 32, True
    if type_name == "Q4_1":
        return 32, False
    m = _Q4_GROUP.match(type_name)
    if m and int(m.group(1)) in INT4_GROUPS:
        return int(m.group(1)), m.group(2) is not None
    return None


class CpuFastInfo(CpuInfo):
    """The cpu-fast backend (backends/cpu_fast.py): 4-bit group formats as int4 packs, Q8_0 as
    two int4 packs, Q8_PC as int8, other matrices as bf16, vectors as float32; the embedding table is read from the file."""

    name = "cpu-fast"

    @staticmethod
    def tensor_bytes(f: GGUFFile, name: str) -> int:
        """Bytes one tensor of the file (or a slice of one, GGUFFile.tensor) takes in this backend's layout."""
        fmt, shape = f.shape_of(name)
        n = math.prod(shape)
        if len(shape) < 2:
            return 4 * n
        if name == "token_embd.weight" and "output.weight" in f.tensors:
            return 0  # looked up row by row in the memory-mapped file
        g = int4_group(fmt)
        if g is not None and shape[-1] % g[0] == 0:
            # codes + bf16 scale and offset per group (+ the offset's float32 rounding residue when it has one)
            return n // 2 + n // g[0] * (4 if g[1] else 8)
        if fmt == "Q8_0" and shape[-1] % 32 == 0:
            return n + n // 32 * 8  # two nibble planes, bf16 scale and offset each
        if fmt == "Q8_PC":
            return n + 2 * shape[0]
        return 2 * n

    @classmethod
    def resident_weight_bytes(cls, f: GGUFFile) -> int:
        return sum(cls.tensor_bytes(f, n) for n in f.tensors)

    @staticmethod
    def runtime_overhead_bytes(f: GGUFFile, cfg) -> int:
        """The file's pages are dropped after packing (only embedding rows are read later); the
        tokenizer and programs as for the cpu backend."""
        vocab_entries = f.metadata.length("tokenizer.ggml.tokens") + f.metadata.length("tokenizer.ggml.merges")
        return 400 * vocab_entries + (16 << 20)


# bytes per element of the layouts the cuda kernels read (kernels/packing.py); formats without a
# kernel layout are stored as Q8_0
_CUDA_LAYOUT_BYTES = {"F16": 2, "BF16": 2, "F32": 2, "Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q8_0": 34 / 32}


class CudaInfo:
    name = "cuda"
    SUPPORTED_OPS = frozenset({
        "embedding", "rms_norm", "add_rms_norm", "linear", "linear_qkv", "linear_swiglu", "swiglu",
        "rope_qkv_store", "attention", "last_row", "add", "mul", "silu", "rope", "rope_store", "kv_store",
        "gelu", "scale", "softcap",
        "rope_rows", "kv_store_rows", "attention_rows",  # the batched decode step (edgellm.session.SlotPool)
        "all_reduce", "all_gather",  # a tensor-parallel rank's sum over the ranks, its share of the logits
    })

    @staticmethod
    def tensor_bytes(f: GGUFFile, name: str) -> int:
        fmt, shape = f.shape_of(name)
        n = math.prod(shape)
        return 4 * n if len(shape) < 2 else int(n * _CUDA_LAYOUT_BYTES.get(fmt, 34 / 32))

    @classmethod
    def resident_weight_bytes(cls, f: GGUFFile) -> int:
        """2-D weights in their kernel layouts; vectors as float32."""
        return sum(cls.tensor_bytes(f, n) for n in f.tensors)

    @staticmethod
    def kv_cache_bytes(cfg, ctx: int, chunk: int | None = None) -> int:
        return 2 * cfg.kv_cache_rows(ctx, chunk) * cfg.kv_dim * 2  # fp16 (rings: see CpuInfo)

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
    # the residual add stays in the projection's epilogue and the RMSNorm apart (the same number of
    # dispatches), so that a decode program folds the norm into the next projection's GEMV: two
    # dispatches (and barriers) fewer per layer (WebgpuProgram._fold_norms)
    SKIP_PASSES = frozenset({"fuse_add_rms_norm"})

    @staticmethod
    def resident_weight_bytes(f: GGUFFile) -> int:
        """2-D weights in their kernel layouts; vectors as float32."""
        return sum(4 * t.n_elements if len(t.shape) < 2 else int(t.n_elements * _WEBGPU_LAYOUT_BYTES.get(t.type_name, 34 / 32))
                   for t in f.tensors.values())

    @staticmethod
    def kv_cache_bytes(cfg, ctx: int, chunk: int | None = None) -> int:
        # fp16 (float32 on adapters without shader-f16); rings: see CpuInfo
        return 2 * cfg.kv_cache_rows(ctx, chunk) * cfg.kv_dim * 2

    @staticmethod
    def output_bytes(cfg, prefill: int) -> int:
        return (prefill + 1) * cfg.vocab_size * 4  # float32 logits of a prefill chunk and of a decode step

    @staticmethod
    def runtime_overhead_bytes(f: GGUFFile, cfg) -> int:
        """RoPE tables, the decode attention workspace, the Vulkan/Metal driver's own: about 16 MiB."""
        return 16 << 20
