"""Write synthetic random-weight GGUF models (llama, qwen2, qwen3, gemma3, phi3 architectures) with gguf-py.

Used by the tests (small models compared with transformers) and by the benchmarks (models of
SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B shape, the shapes of ../shared/anchors, in any
weight format). Weights are normal with std 0.02 (never zeros); norms are near 1.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import EdgeLLMError
from .quant.policy import MIXES, more_bits


@dataclass(frozen=True)
class SyntheticSpec:
    arch: str = "llama"  # llama | mistral | qwen2 | qwen3 | gemma3 | phi3
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    vocab_size: int = 256
    head_dim: int | None = None  # None: d_model // n_heads (a different value writes attention.key_length)
    context_length: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied: bool = True
    attn_bias: bool | None = None  # None: True for qwen2
    rope_freqs: bool = False  # write a Llama-3 style rope_freqs.weight tensor
    rope_linear_factor: float | None = None
    weight_type: str = "F32"  # type of the 2-D projection weights
    embed_type: str | None = None  # None: weight_type
    output_type: str | None = None  # None: weight_type (only for untied models)
    type_overrides: dict[str, str] = field(default_factory=dict)  # tensor name -> type
    sliding_window: int = 0  # attention.sliding_window (gemma3: the local layers'; others: every layer)
    swa_pattern: int = 0  # gemma3: attention.sliding_window_pattern (every n-th layer global; 0: not written, 6)
    logit_softcap: float = 0.0  # gemma3: final_logit_softcapping
    rope_factors: bool = False  # phi3: long-RoPE rope_factors_short/long tensors and attn_factor
    std: float = 0.02
    seed: int = 0
    name: str = "synthetic"


# The shapes of the models in ../shared/anchors/llamacpp-h100.md
PRESETS = {
    "smollm2-135m": SyntheticSpec(n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                                  vocab_size=49152, context_length=8192, rope_theta=1e5, name="smollm2-135m"),
    "llama-3.2-1b": SyntheticSpec(n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                                  vocab_size=128256, context_length=131072, rope_theta=5e5, name="llama-3.2-1b"),
    "llama-3.1-8b": SyntheticSpec(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                                  vocab_size=128256, context_length=131072, rope_theta=5e5, tied=False,
                                  name="llama-3.1-8b"),
}


def quant_mix(spec: SyntheticSpec, ftype: str) -> SyntheticSpec:
    """The tensor types llama-quantize chooses for `ftype` on a llama-style model (src/llama-quant.cpp
    of llama.cpp; edgellm.quant.policy.KMix, as `edgellm quantize --type q4_k_m` applies it): Q4_K_M
    (Q5_K_M) is Q4_K (Q5_K) with Q6_K for attn_v and ffn_down in the layers more_bits names, and for
    the output matrix (the token embedding where the output is tied to it)."""
    if ftype.upper() not in MIXES:
        raise EdgeLLMError(f"unknown quantization mix '{ftype}' (known: {', '.join(MIXES)})")
    base = MIXES[ftype.upper()]
    six = {f"blk.{i}.{t}.weight": "Q6_K" for i in range(spec.n_layers) if more_bits(i, spec.n_layers)
           for t in ("attn_v", "ffn_down")}
    head = {"embed_type": "Q6_K"} if spec.tied else {"embed_type": base, "output_type": "Q6_K"}
    return replace(spec, weight_type=base, **head, type_overrides={**six, **spec.type_overrides})


def preset(name: str, **overrides) -> SyntheticSpec:
    """A preset's shape with `overrides`; weight_type may name a mix (MIXES: Q4_K_M), resolved as
    llama-quantize resolves it (quant_mix)."""
    if name not in PRESETS:
        raise EdgeLLMError(f"unknown synthetic model '{name}' (known: {', '.join(PRESETS)})")
    mix = overrides.get("weight_type", "")
    if mix.upper() in MIXES:
        return quant_mix(replace(PRESETS[name], **{k: v for k, v in overrides.items() if k != "weight_type"}), mix)
    return replace(PRESETS[name], **overrides)


def _rng(spec: SyntheticSpec, name: str) -> np.random.Generator:
    return np.random.default_rng([spec.seed, zlib.crc32(name.encode())])


def tensor_shapes(spec: SyntheticSpec) -> dict[str, tuple[int, ...]]:
    hd = spec.head_dim or spec.d_model // spec.n_heads
    d, q, kv, f = spec.d_model, spec.n_heads * hd, spec.n_kv_heads * hd, spec.ffn_dim
    bias = spec.attn_bias if spec.attn_bias is not None else spec.arch == "qwen2"
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (spec.vocab_size, d), "output_norm.weight": (d,)}
    if not spec.tied:
        shapes["output.weight"] = (spec.vocab_size, d)
    if spec.rope_freqs:
        shapes["rope_freqs.weight"] = (hd // 2,)
    if spec.rope_factors:
        shapes.update({"rope_factors_long.weight": (hd // 2,), "rope_factors_short.weight": (hd // 2,)})
    for i in range(spec.n_layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (d,), b + "attn_output.weight": (d, q), b + "ffn_norm.weight": (d,),
                       b + "ffn_down.weight": (d, f)})
        if spec.arch == "phi3":  # fused q|k|v and gate|up, as llama.cpp writes Phi-3
            shapes.update({b + "attn_qkv.weight": (q + 2 * kv, d), b + "ffn_up.weight": (2 * f, d)})
        else:
            shapes.update({b + "attn_q.weight": (q, d), b + "attn_k.weight": (kv, d), b + "attn_v.weight": (kv, d),
                           b + "ffn_gate.weight": (f, d), b + "ffn_up.weight": (f, d)})
        if bias:
            shapes.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
        if spec.arch in ("qwen3", "gemma3"):
            shapes.update({b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
        if spec.arch == "gemma3":
            shapes.update({b + "post_attention_norm.weight": (d,), b + "post_ffw_norm.weight": (d,)})
    return shapes


def tensor_type(spec: SyntheticSpec, name: str, shape: tuple[int, ...]) -> str:
    if name in spec.type_overrides:
        return spec.type_overrides[name]
    if len(shape) == 1:
        return "F32"
    if name == "token_embd.weight":
        return spec.embed_type or spec.weight_type
    if name == "output.weight":
        return spec.output_type or spec.weight_type
    return spec.weight_type


def make_tensor(spec: SyntheticSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = _rng(spec, name)
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name == "rope_freqs.weight":
        return np.linspace(1.0, 8.0, shape[0]).astype(np.float32)
    if name.startswith("rope_factors_"):
        return np.linspace(1.0, 3.0 if "short" in name else 20.0, shape[0]).astype(np.float32)
    return (spec.std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def random_blocks(ttype: str, shape: tuple[int, ...], rng: np.random.Generator, std: float) -> np.ndarray | None:
    """Valid random GGML blocks drawn directly (no float weights, no quantizer): uniform codes
    with a per-block scale near the one that gives `std`. Seconds for an 8B model where
    quantizing normal floats takes minutes; for speed benchmarks. None for other types."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    nb = cols // 32
    if ttype == "Q8_0":
        d = (std / 73.3 * (1 + 0.1 * rng.standard_normal((rows, nb, 1)))).astype(np.float16)
        q = rng.integers(-127, 128, (rows, nb, 32), dtype=np.int8)
        return np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=2).reshape(*shape[:-1], nb * 34)
    if ttype in ("Q4_0", "Q4_1"):
        d = (std / 4.6 * (1 + 0.1 * rng.standard_normal((rows, nb, 1)))).astype(np.float16)
        q = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
        parts = [d.view(np.uint8)]
        if ttype == "Q4_1":
            parts.append((-8 * d.astype(np.float32)).astype(np.float16).view(np.uint8))
        return np.concatenate(parts + [q], axis=2).reshape(*shape[:-1], nb * (18 if ttype == "Q4_0" else 20))
    if ttype in ("Q4_K", "Q5_K", "Q6_K") and cols % 256 == 0:
        # super-blocks of 256: random codes and 6-bit (Q4_K, Q5_K) or int8 (Q6_K) sub-block scales,
        # every bit pattern valid; the fp16 super-block scales sized so that values have about `std`
        ns = cols // 256
        if ttype in ("Q4_K", "Q5_K"):  # d, dmin, 12 bytes of scales and mins, (Q5_K: 32 bytes of fifth bits,) nibbles
            spread, size = (4.6, 144) if ttype == "Q4_K" else (9.2, 176)
            d = (std / spread / 32 * (1 + 0.1 * rng.standard_normal((rows, ns, 2)))).astype(np.float16)
            rest = rng.integers(0, 256, (rows, ns, size - 4), dtype=np.uint8)
            return np.concatenate([d.view(np.uint8), rest], axis=2).reshape(*shape[:-1], ns * size)
        rest = rng.integers(0, 256, (rows, ns, 208), dtype=np.uint8)  # ql, qh, int8 scales, then d
        d = (std / 18.5 / 64 * (1 + 0.1 * rng.standard_normal((rows, ns, 1)))).astype(np.float16)
        return np.concatenate([rest, d.view(np.uint8)], axis=2).reshape(*shape[:-1], ns * 210)
    return None


RESERVED_SPECIAL_TOKENS = 256  # as Llama 3's vocabulary: 128,000 BPE tokens and 256 special ones


def byte_bpe_vocab(vocab_size: int, pre: str = "llama-bpe", reserved_type: int = 3) -> Callable:
    """A tokenizer for write_synthetic_gguf with exactly vocab_size tokens (tokenizer.ggml.model
    'gpt2'), for synthetic models that peers load only with a vocabulary (llama-cpp-python's
    Llama(), transformers), shaped as a real byte-level BPE vocabulary: the 256 byte tokens,
    merges of common letter pairs, BOS/EOS control tokens, then longer tokens each made by one
    more merge (a token and a printable byte) up to the last RESERVED_SPECIAL_TOKENS rows, which
    are reserved control tokens (the embedding rows of a model shape). A load then meets what a
    real vocabulary costs (an earlier form made every row past 414 a control token: 127,844 special
    tokens for a 128k shape, which the tokenizer matches before BPE and which made loading its
    cached form 0.46 s on a CPU). reserved_type 1 makes the reserved tokens normal ones, which
    decode to their text: a random model's output then streams as text (bench_serve.py)."""
    from .tokenizer import BYTE_ALPHABET

    byte_tok = [BYTE_ALPHABET[b] for b in range(256)]
    space = byte_tok[ord(" ")]
    letters = "etaoinshrdlu"
    merges = [f"{a} {b}" for a in space + letters for b in letters]
    base = byte_tok + [m.replace(" ", "") for m in merges] + ["<|begin_of_text|>", "<|end_of_text|>"]
    if vocab_size < len(base):
        raise EdgeLLMError(f"byte_bpe_vocab: a vocabulary needs at least {len(base)} tokens, got {vocab_size}")
    n_reserved = min(RESERVED_SPECIAL_TOKENS, vocab_size - len(base))
    grown, grown_merges = _grown_tokens(base[256:-2], [space] + [chr(c) for c in range(33, 127)],
                                        vocab_size - len(base) - n_reserved, set(base))

    def add(writer) -> int:
        tokens = base + grown + [f"<|reserved_special_token_{i}|>" for i in range(n_reserved)]
        types = [1] * (len(base) - 2) + [3, 3] + [1] * len(grown) + [reserved_type] * n_reserved  # 1 normal, 3 control
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges + grown_merges)
        writer.add_bos_token_id(len(base) - 2)
        writer.add_eos_token_id(len(base) - 1)
        writer.add_add_bos_token(True)
        return len(tokens)

    return add


def _grown_tokens(seeds: list[str], chars: list[str], count: int, taken: set[str]) -> tuple[list[str], list[str]]:
    """count new tokens, each an existing token (a seed, then the tokens grown before it) followed
    by one byte token of chars, with the merge that makes it ("a b"), in merge order: every merge's
    parts and result are in the vocabulary, as BPE requires."""
    grown: list[str] = []
    merges: list[str] = []
    queue = list(seeds)
    i = 0
    while len(grown) < count:  # the queue outgrows i: every head gives new, longer tokens
        head = queue[i]
        i += 1
        for c in chars:
            t = head + c
            if t in taken:
                continue
            taken.add(t)
            grown.append(t)
            merges.append(f"{head} {c}")
            queue.append(t)
            if len(grown) == count:
                break
    return grown, merges


def write_synthetic_gguf(path: str | Path, spec: SyntheticSpec,
                         tokenizer: Callable | None = None, *, header_only: bool = False, fast: bool = False) -> Path:
    """Write a GGUF file for spec. tokenizer(writer) -> vocab size adds tokenizer metadata (and
    fixes the vocabulary size); without it the file has tokenizer.ggml.model = 'none', as
    llama.cpp's benchmark models do. header_only: write the header and leave the tensor data as a
    sparse hole of the right size (instant, for `edgellm plan` on large shapes; not for running).
    fast: draw Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K weights as random blocks (random_blocks) instead of
    quantizing."""
    import gguf

    path = Path(path)
    w = gguf.GGUFWriter(str(path), spec.arch)
    vocab = spec.vocab_size
    if tokenizer is not None:
        vocab = tokenizer(w)
        spec = replace(spec, vocab_size=vocab)
    else:
        w.add_tokenizer_model("none")
    hd = spec.head_dim or spec.d_model // spec.n_heads
    w.add_name(spec.name)
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.d_model)
    w.add_feed_forward_length(spec.ffn_dim)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hd)
    if spec.head_dim is not None and spec.head_dim != spec.d_model // spec.n_heads:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if spec.rope_linear_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.rope_linear_factor)
    if spec.sliding_window:
        w.add_sliding_window(spec.sliding_window)
    if spec.swa_pattern:
        w.add_sliding_window_pattern(spec.swa_pattern)
    if spec.logit_softcap:
        w.add_final_logit_softcapping(spec.logit_softcap)
    if spec.rope_factors:  # as llama.cpp's converter writes a Phi-3 long-RoPE model (trained context / 4)
        import math

        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(4) / math.log(spec.context_length // 4)))
        w.add_rope_scaling_orig_ctx_len(spec.context_length // 4)
    if header_only:
        total = 0
        for name, shape in tensor_shapes(spec).items():
            qtype = gguf.GGMLQuantizationType[tensor_type(spec, name, shape).upper()]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block * size
            byte_shape = list(shape[:-1]) + [shape[-1] // block * size]  # numpy order, as gguf-py expects
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
            total += -(-nbytes // w.data_alignment) * w.data_alignment
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        with open(path, "r+b") as fh:
            fh.seek(0, 2)
            start = -(-fh.tell() // w.data_alignment) * w.data_alignment
            fh.truncate(start + total)
        return path
    for name, shape in tensor_shapes(spec).items():
        ttype = tensor_type(spec, name, shape)
        qtype = gguf.GGMLQuantizationType[ttype.upper()]
        raw = random_blocks(ttype.upper(), shape, _rng(spec, name), spec.std) if fast and len(shape) == 2 else None
        if raw is not None:
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
            continue
        x = make_tensor(spec, name, shape)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            from .quant import quantize

            raw = quantize(x, ttype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
