"""Gemma 3 (text): the llama block with
- the embedding scaled by sqrt(d_model);
- RMSNorm weights read as stored: llama.cpp's converter writes Gemma's (1 + w), so the plain
  rms_norm op applies;
- per-head q/k RMSNorm, and RMSNorm of the attention and MLP outputs before each residual add;
- a GELU(tanh)-gated MLP;
- sliding-window (local) layers with their own RoPE base, every `pattern`-th layer global;
- the softmax scale as llama.cpp computes it (the file carries no query_pre_attn_scalar);
- final logit softcapping when the file has it.
Files without tokenizer.chat_template get Gemma's turn format (edgellm.chat_builtin.BUILTIN_TEMPLATES).
"""

from __future__ import annotations

import math

from ..gguf_file import GGUFFile
from .config import Family

SWA_PATTERN = 6  # llama.cpp and transformers: layers 5, 11, 17, ... are global, the rest slide
LOCAL_ROPE_BASE = 10000.0  # Gemma 3's rope_local_base_freq (llama.cpp's default for these files)


def configure(f: GGUFFile, c: dict) -> dict:
    window = f.arch_get("attention.sliding_window", 0, kind=int)
    pattern = f.arch_get("attention.sliding_window_pattern", SWA_PATTERN, kind=(int, list))
    n = c["n_layers"]
    # an int: every pattern-th layer is global; a list: per layer, true where the layer slides
    slides = [bool(pattern[i]) for i in range(n)] if isinstance(pattern, list) else [(i + 1) % pattern != 0
                                                                                      for i in range(n)]
    # llama.cpp: 1/sqrt(key_length), except the 27B model (62 layers), scaled by 1/sqrt(d_model / n_heads)
    scale = c["attn_scale"]
    if scale is None:
        scale = 1.0 / math.sqrt(c["d_model"] / c["n_heads"] if n == 62 else c["head_dim"])
    return dict(
        qk_norm=True,
        post_norms=True,
        embed_scale=math.sqrt(c["d_model"]),
        mlp_act="gelu_tanh",
        attn_scale=scale,
        layer_window=tuple(window if window > 0 and slides[i] else 0 for i in range(n)),
        rope_theta_local=f.arch_get("rope.freq_base_swa", LOCAL_ROPE_BASE, kind=float),
        logit_softcap=f.arch_get("final_logit_softcapping", 0.0, kind=float),
        norm_eps=f.arch_get("attention.layer_norm_rms_epsilon", 1e-6, kind=float),
    )


FAMILIES = [Family("gemma3", rope_style="neox", configure=configure)]
