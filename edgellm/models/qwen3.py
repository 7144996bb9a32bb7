"""Qwen3: the llama block with per-head RMSNorm of q and k before RoPE (halves layout), no
attention biases; the output is tied or not as the file has it."""

from __future__ import annotations

from .config import Family

FAMILIES = [Family("qwen3", rope_style="neox", configure=lambda f, fields: {"qk_norm": True})]
