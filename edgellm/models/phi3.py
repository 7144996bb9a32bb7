"""Phi-3 / Phi-4-mini: the llama block (RoPE on halves, possibly partial) whose q|k|v rows are one
tensor attn_qkv and gate|up rows one tensor ffn_up; both are split at load into row views of
the stored tensor (Builder.rows), so the graph and its fusions are the llama ones.

Long-RoPE files (Phi-3-*-128k) carry rope_factors_short / rope_factors_long per-frequency
factors and an attention factor that scales cos and sin. llama.cpp uses the long factors only
when the context exceeds the original training context; edgellm uses the short ones and reports
rope.scaling.original_context_length as the model's context length (the default --ctx stays
within it; the long factors are not implemented).
"""

from __future__ import annotations

from ..gguf_file import GGUFFile
from .config import Family


def configure(f: GGUFFile, c: dict) -> dict:
    out = dict(fused_qkv="blk.0.attn_qkv.weight" in f.tensors, fused_gate_up="blk.0.ffn_gate.weight" not in f.tensors)
    if "rope_factors_short.weight" in f.tensors:
        out["rope_factors"] = "rope_factors_short.weight"
        out["rope_mscale"] = f.arch_get("rope.scaling.attn_factor", 1.0, kind=float)
        out["context_length"] = f.arch_get("rope.scaling.original_context_length", c["context_length"], kind=int)
    return out


FAMILIES = [Family("phi3", rope_style="neox", configure=configure)]
