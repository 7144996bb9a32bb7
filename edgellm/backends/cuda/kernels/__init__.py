"""Triton kernel templates of the cuda backend.

Every activation is a 2D [tokens, features] tensor (fp16; fp32 accepted); weights are packed once
by `repack` into a `PackedWeight` (see packing.py for the layouts). Each wrapper checks shapes,
allocates its output unless `out=` is given, and launches without synchronising, so the calls can
be captured in a CUDA graph (pass device tensors for start_pos / seq_len, and preallocated
buffers). Block sizes come from configs.py; `config=` overrides them (for tuning).

set_pdl(True) launches every kernel with programmatic dependent launch (Hopper; each kernel
waits for its predecessor before touching activations), which hides part of the launch latency
inside CUDA graphs; set_l2_prefetch(BYTES) lets the decode GEMVs ask L2 for their weights
before that wait (at most BYTES a launch).

With TRITON_INTERPRET=1 set before triton is imported, the kernels run in Triton's interpreter on
CPU tensors (correct but slow, for tests); without it, CPU tensors are refused with a clear error.
`python -m edgellm.backends.cuda.kernels.compile_check` compiles every kernel for sm_90 without a
GPU and prints registers, spills and the instruction mix of each.
"""

from ._common import INTERPRET, USE_DP4A, set_l2_prefetch, set_pdl
from .attention import (attention_decode, attention_prefill, attention_rows, decode_workspace, default_decode_splits,
                        prepare_attention_rows, rows_splits)
from .elementwise import add_into, silu_mul, take_rows, unary, upload_fp16
from .embedding import embedding
from . import linear as linear_module
from .linear import QuantizedActivations, linear, linear_silu_mul, quantize_activations
from .norm import NormTail, head_rms_norm, rms_norm
from .packing import (PACKED_FORMATS, SUPPORTED_FORMATS, PackedWeight, UnsupportedFormatError, can_repack,
                      convert_packed, unify_formats,
                      concat_packed, dequantize, pack_float, repack)
from .rope import RopeStore, kv_store_rows, rope_qkv_cache, rope_rows
from .sampling import argmax, cuts, ranked_need, sample

__all__ = [
    "INTERPRET", "USE_DP4A", "add_into", "take_rows", "PACKED_FORMATS", "SUPPORTED_FORMATS", "PackedWeight", "UnsupportedFormatError",
    "NormTail", "QuantizedActivations", "RopeStore", "argmax", "attention_decode", "attention_prefill", "can_repack",
    "concat_packed", "convert_packed", "unify_formats", "decode_workspace", "default_decode_splits", "dequantize", "embedding", "linear",
    "linear_silu_mul", "pack_float", "quantize_activations", "repack", "rms_norm", "rope_qkv_cache", "cuts", "ranked_need", "sample", "set_l2_prefetch", "set_pdl", "silu_mul",
    "unary", "upload_fp16", "head_rms_norm", "attention_rows", "kv_store_rows", "rope_rows", "rows_splits",
    "prepare_attention_rows",
]
