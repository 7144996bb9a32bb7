"""Hyperparameters of a model, read from GGUF metadata and checked against its tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

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

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


# Architectures whose blocks are the llama block (RMSNorm, RoPE, GQA attention, SwiGLU):
# arch name -> (rope style, attention biases)
LLAMA_LIKE = {
    "llama": ("norm", False),
    "mistral": ("norm", False),
    "qwen2": ("neox", True),
}


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    arch = f.architecture
    if arch not in LLAMA_LIKE:
        raise UnsupportedArchitectureError(
            f"{f.path.name}: architecture '{arch}' is not supported (supported: {', '.join(sorted(LLAMA_LIKE))})"
        )
    style, bias = LLAMA_LIKE[arch]
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
        vocab = len(f.metadata["tokenizer.ggml.tokens"])
    scaling = f.arch_get("rope.scaling.type", "none", kind=str)
    pos_scale = 1.0
    if scaling == "linear":
        pos_scale = 1.0 / f.arch_get("rope.scaling.factor", kind=float)
    elif scaling not in ("none", ""):
        raise UnsupportedArchitectureError(f"{f.path.name}: rope scaling '{scaling}' is not supported (none, linear)")
    ffn = f.arch_get("feed_forward_length", kind=int)
    cfg = ModelConfig(
        arch=arch,
        n_layers=n_layers,
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn_dim=ffn,
        vocab_size=vocab,
        context_length=f.arch_get("context_length", 2048, kind=int),
        norm_eps=f.arch_get("attention.layer_norm_rms_epsilon", 1e-5, kind=float),
        rope_theta=f.arch_get("rope.freq_base", 10000.0, kind=float),
        rope_dim=f.arch_get("rope.dimension_count", head_dim, kind=int),
        rope_style=style,
        rope_pos_scale=pos_scale,
        has_rope_freqs="rope_freqs.weight" in f.tensors,
        tied_output="output.weight" not in f.tensors,
        attn_bias=bias,
        name=str(f.get("general.name", arch)),
    )
    check_tensors(f, cfg)
    return cfg


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the llama block structure reads, with its shape in numpy order (out, in)."""
    d, q, kv, ffn = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.ffn_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.vocab_size, d)
    if cfg.has_rope_freqs:
        shapes["rope_freqs.weight"] = (cfg.rope_dim // 2,)
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        shapes.update({
            b + "attn_norm.weight": (d,),
            b + "attn_q.weight": (q, d),
            b + "attn_k.weight": (kv, d),
            b + "attn_v.weight": (kv, d),
            b + "attn_output.weight": (d, q),
            b + "ffn_norm.weight": (d,),
            b + "ffn_gate.weight": (ffn, d),
            b + "ffn_up.weight": (ffn, d),
            b + "ffn_down.weight": (d, ffn),
        })
        if cfg.attn_bias:
            shapes.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
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
