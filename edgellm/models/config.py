"""Hyperparameters of a model, read from GGUF metadata and checked against its tensors; a Family
says what a model family changes about the shared decoder block."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from ..errors import MetadataError, MissingTensorError, TensorShapeError, UnsupportedArchitectureError
from ..gguf_file import GGUFFile


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_theta: float
    rope_dim: int
    rope_style: str  # 'norm' (pairs 2i, 2i+1: llama.cpp's layout for llama files) or 'neox' (halves)
    rope_pos_scale: float = 1.0  # linear rope scaling: positions are multiplied by this
    has_rope_freqs: bool = False  # Llama-3 style per-frequency factors (tensor rope_freqs.weight)
    tied_output: bool = False
    attn_bias: bool = False
    name: str = ""
    extra: dict = field(default_factory=dict)
    # -- what the other families change (defaults: the llama block) ----------------------------
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (attn_q_norm / attn_k_norm)
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before each residual add (Gemma)
    embed_scale: float = 1.0  # the embedding rows are multiplied by this (Gemma: sqrt(d_model))
    mlp_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    attn_scale: float | None = None  # softmax scale; None: 1/sqrt(head_dim)
    layer_window: tuple[int, ...] = ()  # per layer: sliding-window size, 0 = global attention (empty: all 0)
    rope_theta_local: float | None = None  # RoPE base of sliding-window layers (None: rope_theta)
    logit_softcap: float = 0.0  # final logits = cap * tanh(logits / cap) when > 0
    fused_qkv: bool = False  # q|k|v rows in one tensor attn_qkv (phi3)
    fused_gate_up: bool = False  # gate|up rows in one tensor ffn_up (phi3)
    rope_factors: str | None = None  # per-frequency RoPE factor tensor other than rope_freqs (long-RoPE)
    rope_mscale: float = 1.0  # long-RoPE attention factor on cos/sin
    # tensor parallelism: (rank, world). A rank's graph holds its share of the attention heads and
    # of the MLP's hidden columns, and sums the output and down projections over the ranks
    # (all_reduce); (0, 1) is the whole model
    shard: tuple[int, int] = (0, 1)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def window(self, layer: int) -> int:
        return self.layer_window[layer] if self.layer_window else 0

    def kv_rows(self, layer: int, ctx: int, chunk: int | None) -> int:
        """Rows of a layer's K/V cache. A global layer keeps every position (ctx rows). A sliding-
        window layer keeps a ring: position p lives in row p mod rows, and rows = window + chunk - 1
        hold what one program needs at once, chunk being the most tokens a program writes (its
        first query reads back window - 1 positions before the chunk; its last writes chunk - 1
        after it). chunk None: no ring (ctx rows everywhere)."""
        w = self.window(layer)
        return min(ctx, w + chunk - 1) if w and chunk else ctx

    def kv_cache_rows(self, ctx: int, chunk: int | None) -> int:
        """Cache rows over all layers (K and V each): what kv_cache_bytes multiplies by kv_dim."""
        return sum(self.kv_rows(i, ctx, chunk) for i in range(self.n_layers))

    def kv_rings(self, ctx: int, chunk: int | None) -> tuple[tuple[int, int], ...]:
        """The distinct (window, rows) of the layers whose cache is a ring (rows < ctx)."""
        return tuple(sorted({(self.window(i), self.kv_rows(i, ctx, chunk)) for i in range(self.n_layers)
                             if self.kv_rows(i, ctx, chunk) < ctx}))

    @property
    def rope_factor_tensor(self) -> str | None:
        return "rope_freqs.weight" if self.has_rope_freqs else self.rope_factors


@dataclass(frozen=True)
class Family:
    """What a model family changes about the shared decoder block (edgellm.models.blocks):
    the RoPE layout, attention biases, and a hook that reads the family's own metadata into
    ModelConfig fields (configure(file, fields) -> the fields to change)."""

    arch: str
    rope_style: str
    attn_bias: bool = False
    configure: Callable[[GGUFFile, dict], dict] | None = None


def read_config(f: GGUFFile, family: Family) -> ModelConfig:
    """The hyperparameters every family shares (llama.cpp's metadata keys), then the family's own."""
    arch = f.architecture
    n_layers = f.arch_get("block_count", kind=int)
    d = f.arch_get("embedding_length", kind=int)
    n_heads = f.arch_get("attention.head_count", kind=int)
    n_kv = f.arch_get("attention.head_count_kv", n_heads, kind=int)
    if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
        raise MetadataError(f"{f.path.name}: head_count {n_heads} is not a positive multiple of head_count_kv {n_kv}")
    head_dim = f.arch_get("attention.key_length", d // n_heads, kind=int)
    if f.arch_get("attention.value_length", head_dim, kind=int) != head_dim:
        raise MetadataError(f"{f.path.name}: attention.value_length differs from key_length; not supported")
    emb = f.tensors.get("token_embd.weight")
    if emb is None:
        raise MissingTensorError(f"{f.path.name}: tensor 'token_embd.weight' is missing")
    vocab = f.arch_get("vocab_size", emb.shape[0], kind=int)
    if "tokenizer.ggml.tokens" in f.metadata:
        vocab = f.metadata.length("tokenizer.ggml.tokens")
    scaling = f.arch_get("rope.scaling.type", "none", kind=str)
    pos_scale = 1.0
    if scaling == "linear":
        pos_scale = 1.0 / f.arch_get("rope.scaling.factor", kind=float)
    elif scaling not in ("none", "") and not (scaling in ("longrope", "su") and family.arch == "phi3"):
        raise UnsupportedArchitectureError(f"{f.path.name}: rope scaling '{scaling}' is not supported (none, linear)")
    window = f.arch_get("attention.sliding_window", 0, kind=int)  # Mistral-style: every layer slides
    fields = dict(
        arch=arch,
        n_layers=n_layers,
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn_dim=f.arch_get("feed_forward_length", kind=int),
        vocab_size=vocab,
        context_length=f.arch_get("context_length", 2048, kind=int),
        norm_eps=f.arch_get("attention.layer_norm_rms_epsilon", 1e-5, kind=float),
        rope_theta=f.arch_get("rope.freq_base", 10000.0, kind=float),
        rope_dim=f.arch_get("rope.dimension_count", head_dim, kind=int),
        rope_style=family.rope_style,
        rope_pos_scale=pos_scale,
        has_rope_freqs="rope_freqs.weight" in f.tensors,
        tied_output="output.weight" not in f.tensors,
        attn_bias=family.attn_bias,
        name=str(f.get("general.name", arch)),
        layer_window=(window,) * n_layers if window > 0 else (),
        attn_scale=f.arch_get("attention.scale", None, kind=float),
    )
    if family.configure is not None:
        fields.update(family.configure(f, fields))
    cfg = ModelConfig(**fields)
    check_tensors(f, cfg)
    return cfg


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder block structure reads, with its shape in numpy order (out, in)."""
    d, q, kv, ffn = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.ffn_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.vocab_size, d)
    if cfg.rope_factor_tensor:
        shapes[cfg.rope_factor_tensor] = (cfg.rope_dim // 2,)
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (d,)
        if cfg.fused_qkv:
            shapes[b + "attn_qkv.weight"] = (q + 2 * kv, d)
        else:
            shapes.update({b + "attn_q.weight": (q, d), b + "attn_k.weight": (kv, d), b + "attn_v.weight": (kv, d)})
        shapes.update({b + "attn_output.weight": (d, q), b + "ffn_norm.weight": (d,)})
        if cfg.fused_gate_up:
            shapes[b + "ffn_up.weight"] = (2 * ffn, d)
        else:
            shapes.update({b + "ffn_gate.weight": (ffn, d), b + "ffn_up.weight": (ffn, d)})
        shapes[b + "ffn_down.weight"] = (d, ffn)
        if cfg.attn_bias:
            shapes.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
        if cfg.qk_norm:
            shapes.update({b + "attn_q_norm.weight": (cfg.head_dim,), b + "attn_k_norm.weight": (cfg.head_dim,)})
        if cfg.post_norms:
            shapes.update({b + "post_attention_norm.weight": (d,), b + "post_ffw_norm.weight": (d,)})
    return shapes


def check_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    for name, shape in expected_tensors(cfg).items():
        t = f.tensors.get(name)
        if t is None:
            raise MissingTensorError(f"{f.path.name}: tensor '{name}' is missing (architecture {cfg.arch})")
        if tuple(t.shape) != shape:
            raise TensorShapeError(
                f"{f.path.name}: tensor '{name}' has shape {tuple(t.shape)}, but the metadata implies {shape}"
            )
