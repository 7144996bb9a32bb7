"""The llama block as it is: Llama 2/3, SmolLM2 and Mistral (adjacent-pair RoPE), Qwen2 (RoPE on
halves, q/k/v biases). Mistral-style files with attention.sliding_window slide every layer."""

from __future__ import annotations

from .config import Family

FAMILIES = [
    Family("llama", rope_style="norm"),
    Family("mistral", rope_style="norm"),
    Family("qwen2", rope_style="neox", attn_bias=True),
]
