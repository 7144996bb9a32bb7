"""`edgellm quantize`: write a model's weights in another format, from a GGUF or a Hugging Face folder.

    edgellm quantize IN OUT --type T [--policy P] [--rule PATTERN=TYPE ...] [--strict] [--force]

    from edgellm.quantize_model import quantize_model
    report = quantize_model("model-f16.gguf", "model-q4_0.gguf", type="q4_0")

IN is a GGUF file (F32/F16/BF16; an already quantized one is dequantized first, with a warning; a
tensor already in its target format is copied byte for byte) or a Hugging Face safetensors folder
(config.json + *.safetensors; llama, mistral and qwen2 architectures). Which format each tensor
gets (types, policies, rules, fallbacks) is decided in edgellm/quant/policy.py; how edgellm's own
formats are stored in a GGUF in edgellm/quant/storage.py. GGML types are written as GGUF's own, so a
file with only GGML types is plain GGUF that gguf-py and llama.cpp read.

Safety: IN is opened read-only and never written; OUT is written to a temporary file in its own
directory and renamed over OUT only when complete, so a failed run leaves no partial OUT. OUT may
not be IN (paths and symlinks resolved) and may not exist unless force.

A Hugging Face folder is converted the way llama.cpp's convert_hf_to_gguf.py does it: HF tensor
names mapped to GGUF names; for llama-architecture models (llama, mistral) the rows of q_proj and
k_proj permuted from HF's rotate-half RoPE layout to GGUF's interleaved one (qwen2 files keep HF's
layout: their RoPE is the neox style); Llama-3 rope scaling written as a rope_freqs tensor; the
hyperparameters the loader needs written as GGUF metadata; tokenizer.json (byte-level BPE) written
as a gpt2-style vocabulary (tokens, token types, merges, pre-tokenizer, bos/eos, chat template).

`python -m edgellm.quantize_model --compare-fp4 [MODEL]` prints the FP4_E0M4 vs int4 accuracy table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .errors import EdgeLLMError, ModelFileError, UnsupportedArchitectureError
from .quant import QuantFormat, dequantize, get_format, quantize
from .quant import storage
from .quant.policy import (
    POLICIES,
    TYPES,
    Choice,
    QuantizePolicyError,
    choose_types,
    make_policy,
    parse_rule,
)

__all__ = ["QuantizeError", "QuantizePolicyError", "QuantizeReport", "QuantizeWarning", "add_quantize_parser",
           "main", "open_source", "print_summary", "quantize_model"]

_FLOAT_SOURCE_TYPES = ("F32", "F16", "BF16", "F64")


class QuantizeError(EdgeLLMError, ValueError):
    """A bad quantize request about files: OUT equal to IN, OUT existing without force, ..."""


class QuantizeWarning(UserWarning):
    """Something the user should know, not fatal: a quantized source, a format fallback."""


# -- sources ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MetaItem:
    """One GGUF metadata key with its GGUF value type (and array item type)."""

    key: str
    value: Any
    vtype: Any  # gguf.GGUFValueType
    sub_type: Any = None


@dataclass
class SourceTensor:
    name: str  # the GGUF name
    shape: tuple[int, ...]  # numpy order
    type_name: str  # as stored in the source: F32, F16, BF16, Q4_1, Q8_PC, ...
    nbytes: int  # as stored in the source
    load: Callable[[], np.ndarray]  # -> float32 array of shape
    raw: Callable[[], np.ndarray] | None = None  # -> the stored raw data (GGUF sources), for copy-through


@dataclass
class Source:
    path: Path
    kind: str  # 'gguf' or 'safetensors'
    arch: str
    metadata: list[MetaItem]
    tensors: list[SourceTensor]
    alignment: int = 32

    @property
    def quantized_types(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors:
            if t.type_name not in _FLOAT_SOURCE_TYPES:
                counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts


def open_source(path: str | os.PathLike) -> Source:
    """A GGUF file or a Hugging Face safetensors folder, as metadata and lazily loaded tensors."""
    p = Path(path)
    if not os.path.exists(p):
        raise ModelFileError(f"input not found: {p}")
    if p.is_dir():
        return _open_hf_folder(p)
    if p.suffix == ".safetensors" or p.name == "config.json":
        raise ModelFileError(f"{p}: pass the folder holding config.json and the *.safetensors files, not one file")
    return _open_gguf_source(p)


# -- GGUF sources ----------------------------------------------------------------------------------

# keys recomputed for the output file, never copied from the input
_RECOMPUTED_KEYS = ("general.architecture", "general.alignment", "general.file_type", "general.quantization_version")


def _gguf_metadata_items(f) -> list[MetaItem]:
    """The metadata of an opened GGUFFile with each key's GGUF value type (read from the header)."""
    from gguf import GGUFValueType

    from .gguf_file import _HeaderParser

    p = _HeaderParser(f._map, f.path)
    p.pos = 4
    p.scalar("<I", "the version")
    p.scalar("<Q", "the tensor count")
    n_kv = p.scalar("<Q", "the metadata count")
    items = []
    for i in range(n_kv):
        key = p.string(f"metadata key #{i}")
        vtype = p.scalar("<I", f"the type of metadata '{key}'")
        sub = None
        if vtype == GGUFValueType.ARRAY:
            sub = GGUFValueType(p.scalar("<I", f"metadata '{key}'"))
            p.pos -= 4
        p.value(vtype, f"metadata '{key}'")
        items.append(MetaItem(key, f.metadata[key], GGUFValueType(vtype), sub))
    return items


def _open_gguf_source(path: Path) -> Source:
    from .gguf_file import open_gguf

    f = open_gguf(path)
    items = [m for m in _gguf_metadata_items(f)
             if m.key not in _RECOMPUTED_KEYS and not storage.is_storage_key(m.key) and not m.key.startswith("split.")]
    tensors = []
    for td in f.tensors.values():
        def load(td=td) -> np.ndarray:
            if td.format is None and td.data.dtype != np.uint8:  # F32, F16, F64: a plain cast
                return np.asarray(td.data, dtype=np.float32)
            return dequantize(td.data, td.type_name, td.shape)

        tensors.append(SourceTensor(td.name, tuple(td.shape), td.type_name, td.nbytes, load, raw=lambda td=td: td.data))
    return Source(path, "gguf", f.architecture, items, tensors, alignment=int(f.get("general.alignment", 32)))


# -- Hugging Face safetensors folders --------------------------------------------------------------

_HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_PERMUTED_ARCHS = ("llama",)  # HF's rotate-half q/k rows -> GGUF's interleaved pairs (llama.cpp's convert)
_HF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_HF_DTYPES = {"F32": ("F32", 4), "F16": ("F16", 2), "BF16": ("BF16", 2), "F64": ("F64", 8)}
# the order of a block's tensors in the output (llama.cpp's)
_BLOCK_ORDER = ["attn_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias",
                "attn_v.weight", "attn_v.bias", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight",
                "ffn_up.weight", "ffn_down.weight"]


def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as e:
        raise ModelFileError(f"cannot read {what} {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return data


def permute_qk_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of an HF q_proj/k_proj weight (or bias) for GGUF's llama RoPE layout.

    HF rotates the two halves of each head (dims i and i + d/2 form a pair); GGUF llama files
    (RoPE 'norm' style) rotate adjacent dims (2i, 2i + 1). Within each head, row i + j*d/2 moves to
    row 2i + j -- what llama.cpp's convert_hf_to_gguf.py does for LlamaModel."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelFileError(f"cannot permute {rows} rows into {n_head} heads of an even size")
    return np.ascontiguousarray(
        w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _rope_params(cfg: dict, where: str) -> tuple[float, dict | None]:
    """(rope theta, scaling dict or None) from a transformers 4 (rope_theta, rope_scaling) or 5
    (rope_parameters) config."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params
    rtype = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if rtype in (None, "default"):
        return float(theta), None
    if rtype not in ("linear", "llama3"):
        raise UnsupportedArchitectureError(f"{where}: rope scaling '{rtype}' is not supported (default, linear, llama3)")
    return float(theta), dict(scaling, rope_type=rtype)


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """Per-frequency divisors of Llama 3's rope scaling (the rope_freqs.weight tensor): 1 for
    wavelengths shorter than original_context/high_freq_factor, `factor` for those longer than
    original_context/low_freq_factor, and a smooth blend between."""
    factor = float(scaling.get("factor", 8.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, blended))
    return out.astype(np.float32)


def _open_hf_folder(folder: Path) -> Source:
    cfg_path = folder / "config.json"
    files = sorted(folder.glob("*.safetensors"))
    if not cfg_path.is_file():
        raise ModelFileError(f"not a safetensors model folder: {folder} has no config.json")
    if not files:
        raise ModelFileError(f"not a safetensors model folder: {folder} has no *.safetensors files")
    cfg = _read_json(cfg_path, "config")
    where = str(cfg_path)
    archs = cfg.get("architectures") or []
    arch = next((_HF_ARCHS[a] for a in archs if a in _HF_ARCHS), None) or _HF_MODEL_TYPES.get(cfg.get("model_type"))
    if arch is None:
        raise UnsupportedArchitectureError(
            f"{where}: architecture {archs or cfg.get('model_type')!r} is not supported "
            f"(supported: {', '.join(sorted(_HF_ARCHS))})")

    def need(key: str, kind=int):
        v = cfg.get(key)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise ModelFileError(f"{where}: '{key}' is {v!r}, expected {'a number' if kind is not int else 'an integer'}")
        return v

    n_layers, d, ffn = need("num_hidden_layers"), need("hidden_size"), need("intermediate_size")
    n_heads = need("num_attention_heads")
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or d // n_heads
    vocab = need("vocab_size")
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"{where}: hidden_act '{cfg.get('hidden_act')}' is not supported (silu)")
    if arch == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise UnsupportedArchitectureError(f"{where}: llama with attention_bias/mlp_bias is not supported")
    if arch == "qwen2" and cfg.get("use_sliding_window"):
        raise UnsupportedArchitectureError(f"{where}: qwen2 with use_sliding_window is not supported")
    theta, scaling = _rope_params(cfg, where)

    from gguf import GGUFValueType as V

    a = arch
    meta = [MetaItem("general.name", str(cfg.get("_name_or_path") or folder.name) or folder.name, V.STRING)]
    meta += [MetaItem(f"{a}.{k}", v, V.UINT32) for k, v in (
        ("block_count", n_layers), ("context_length", int(cfg.get("max_position_embeddings", 2048))),
        ("embedding_length", d), ("feed_forward_length", ffn), ("attention.head_count", n_heads),
        ("attention.head_count_kv", n_kv))]
    meta += [MetaItem(f"{a}.rope.freq_base", theta, V.FLOAT32),
             MetaItem(f"{a}.attention.layer_norm_rms_epsilon", eps, V.FLOAT32),
             MetaItem(f"{a}.vocab_size", vocab, V.UINT32),
             MetaItem(f"{a}.rope.dimension_count", head_dim, V.UINT32)]
    if head_dim != d // n_heads:
        meta += [MetaItem(f"{a}.attention.key_length", head_dim, V.UINT32),
                 MetaItem(f"{a}.attention.value_length", head_dim, V.UINT32)]
    if scaling is not None and scaling["rope_type"] == "linear":
        meta += [MetaItem(f"{a}.rope.scaling.type", "linear", V.STRING),
                 MetaItem(f"{a}.rope.scaling.factor", float(scaling["factor"]), V.FLOAT32)]

    # tensors: name -> (file, dtype, shape), mapped to GGUF names
    from safetensors import safe_open

    found: dict[str, tuple[Path, str, tuple[int, ...], str]] = {}
    for fpath in files:
        try:
            with safe_open(str(fpath), framework="pt") as sf:
                for key in sf.keys():
                    sl = sf.get_slice(key)
                    found[key] = (fpath, sl.get_dtype(), tuple(int(x) for x in sl.get_shape()), key)
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise ModelFileError(f"cannot read {fpath}: {e}") from None
    tied = bool(cfg.get("tie_word_embeddings", False)) or "lm_head.weight" not in found
    if "lm_head.weight" not in found and not cfg.get("tie_word_embeddings", True):
        raise ModelFileError(f"{folder}: lm_head.weight is missing and tie_word_embeddings is false")
    tensors: dict[str, SourceTensor] = {}
    for key, (fpath, dtype, shape, _) in found.items():
        if _HF_IGNORED.search(key):
            continue
        if key == "lm_head.weight" and tied:
            continue
        name = _HF_TOP.get(key)
        if name is None:
            m = _HF_LAYER_NAME.match(key)
            sub = _HF_LAYER.get(m[2]) if m else None
            if sub is None:
                raise ModelFileError(f"{fpath.name}: tensor '{key}' has no GGUF name for architecture {arch}")
            name = f"blk.{int(m[1])}.{sub}"
        if dtype not in _HF_DTYPES:
            raise ModelFileError(f"{fpath.name}: tensor '{key}' has dtype {dtype}; expected F32, F16 or BF16")
        n_perm = None
        if arch in _PERMUTED_ARCHS and name.endswith(("attn_q.weight", "attn_q.bias")):
            n_perm = n_heads
        elif arch in _PERMUTED_ARCHS and name.endswith(("attn_k.weight", "attn_k.bias")):
            n_perm = n_kv

        def load(fpath=fpath, key=key, n_perm=n_perm) -> np.ndarray:
            import torch

            with safe_open(str(fpath), framework="pt") as sf:
                x = sf.get_tensor(key).to(torch.float32).numpy()
            return permute_qk_rows(x, n_perm) if n_perm else x

        type_name, size = _HF_DTYPES[dtype]
        tensors[name] = SourceTensor(name, shape, type_name, size * math.prod(shape), load)
    if scaling is not None and scaling["rope_type"] == "llama3":
        factors = llama3_rope_factors(theta, head_dim, scaling)
        tensors["rope_freqs.weight"] = SourceTensor("rope_freqs.weight", factors.shape, "F32", factors.nbytes,
                                                    lambda f=factors: f)
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ModelFileError(f"{folder}: tensor 'model.embed_tokens.weight' is missing")
    meta += _hf_tokenizer_metadata(folder, cfg, arch, emb.shape[0])

    def order(name: str) -> tuple:
        m = re.match(r"^blk\.(\d+)\.(.+)$", name)
        if m:
            sub = m[2]
            return (1, int(m[1]), _BLOCK_ORDER.index(sub) if sub in _BLOCK_ORDER else 99, sub)
        top = ["token_embd.weight", "rope_freqs.weight"]
        return (0, top.index(name), 0, name) if name in top else (2, 0, 0, name)

    ordered = [tensors[n] for n in sorted(tensors, key=order)]
    return Source(folder, "safetensors", arch, meta, ordered)


# -- tokenizer.json -> GGUF vocabulary -------------------------------------------------------------

_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5


def _token_content(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _detect_pre(tj: dict, arch: str) -> str | None:
    """tokenizer.ggml.pre for a tokenizer.json's pre-tokenizer, by its split pattern."""
    from .tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT

    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    types = [s.get("type") for s in steps]
    patterns = [((s.get("pattern") or {}).get("Regex")) for s in steps if s.get("type") == "Split"]
    if patterns:
        if patterns[0] == _LLAMA3_SPLIT:
            return "llama-bpe"
        if patterns[0] == _QWEN2_SPLIT:
            return "qwen2"
        return None
    if types == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if types == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    return None


def _hf_tokenizer_metadata(folder: Path, cfg: dict, arch: str, n_embd_rows: int) -> list[MetaItem]:
    from gguf import GGUFValueType as V

    tj_path = folder / "tokenizer.json"
    none = [MetaItem("tokenizer.ggml.model", "none", V.STRING)]
    if not tj_path.is_file():
        return none
    tj = _read_json(tj_path, "tokenizer")
    model = tj.get("model") or {}
    decoder = tj.get("decoder") or {}
    byte_level = model.get("type") == "BPE" and not model.get("byte_fallback") and (
        decoder.get("type") == "ByteLevel" or "ByteLevel" in json.dumps(tj.get("pre_tokenizer")))
    if not byte_level:
        warnings.warn(f"{tj_path}: only byte-level BPE tokenizers are converted (this one is "
                      f"{model.get('type')}{' with byte fallback' if model.get('byte_fallback') else ''}); "
                      "writing tokenizer.ggml.model = 'none' (the model runs from token ids)", QuantizeWarning)
        return none
    ids: dict[int, tuple[str, int]] = {}
    for tok, i in (model.get("vocab") or {}).items():
        ids[int(i)] = (tok, _NORMAL)
    for added in tj.get("added_tokens") or []:
        ids[int(added["id"])] = (added["content"], _CONTROL if added.get("special") else _USER_DEFINED)
    n = max(max(ids) + 1 if ids else 0, n_embd_rows)
    if n > n_embd_rows:
        raise ModelFileError(f"{tj_path}: {n} tokens, but the embedding has only {n_embd_rows} rows")
    tokens = [ids.get(i, (f"[PAD{i}]", _UNUSED))[0] for i in range(n)]
    types = [ids.get(i, ("", _UNUSED))[1] for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    pre = _detect_pre(tj, arch)
    if pre is None:
        pre = "qwen2" if arch == "qwen2" else "default"
        warnings.warn(f"{tj_path}: pre-tokenizer not recognised; writing tokenizer.ggml.pre = '{pre}'", QuantizeWarning)
    tc = _read_json(folder / "tokenizer_config.json", "tokenizer config") \
        if (folder / "tokenizer_config.json").is_file() else {}
    index = {t: i for i, t in enumerate(tokens)}

    def token_id(name: str) -> int | None:
        text = _token_content(tc.get(f"{name}_token"))
        if text is not None and text in index:
            return index[text]
        v = cfg.get(f"{name}_token_id")
        if isinstance(v, list):
            v = v[0] if v else None
        return v if isinstance(v, int) and 0 <= v < n else None

    meta = [MetaItem("tokenizer.ggml.model", "gpt2", V.STRING), MetaItem("tokenizer.ggml.pre", pre, V.STRING),
            MetaItem("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
            MetaItem("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32)]
    if merges:
        meta.append(MetaItem("tokenizer.ggml.merges", merges, V.ARRAY, V.STRING))
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        i = token_id(name)
        if i is not None:
            meta.append(MetaItem(f"tokenizer.ggml.{key}", i, V.UINT32))
    add_bos = tc.get("add_bos_token")
    if not isinstance(add_bos, bool):
        post = tj.get("post_processor") or {}
        procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
        single = next((p.get("single") for p in procs if p.get("type") == "TemplateProcessing"), None) or []
        add_bos = bool(single) and "SpecialToken" in single[0]
    meta.append(MetaItem("tokenizer.ggml.add_bos_token", add_bos, V.BOOL))
    template = tc.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str) and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, str) and template:
        meta.append(MetaItem("tokenizer.chat_template", template, V.STRING))
    return meta


# -- the report ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorRecord:
    name: str
    shape: tuple[int, ...]
    source_type: str
    target_type: str
    source_bytes: int
    target_bytes: int
    reason: str  # '1-D', 'rule ...', 'policy ...', 'copied'
    fallback_from: str | None = None

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass
class QuantizeReport:
    input: Path
    output: Path
    policy: str
    type: str | None
    tensors: list[TensorRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    file_bytes: int = 0

    @property
    def params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def bytes_before(self) -> int:
        return sum(t.source_bytes for t in self.tensors)

    @property
    def bytes_after(self) -> int:
        return sum(t.target_bytes for t in self.tensors)

    @property
    def bpw_before(self) -> float:
        return 8.0 * self.bytes_before / max(self.params, 1)

    @property
    def bpw_after(self) -> float:
        return 8.0 * self.bytes_after / max(self.params, 1)

    def type_counts(self) -> dict[str, tuple[int, int, int]]:
        """target type -> (tensors, values, bytes), widest share first."""
        out: dict[str, list[int]] = {}
        for t in self.tensors:
            c = out.setdefault(t.target_type, [0, 0, 0])
            c[0] += 1
            c[1] += t.n_elements
            c[2] += t.target_bytes
        return {k: tuple(v) for k, v in sorted(out.items(), key=lambda kv: -kv[1][2])}

    @property
    def types(self) -> dict[str, str]:
        return {t.name: t.target_type for t in self.tensors}


# -- writing ---------------------------------------------------------------------------------------

_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
               "Q4_K": 14, "Q5_K": 16, "Q6_K": 18, "BF16": 32}  # llama.cpp's LlamaFileType (Q*_K: the _S mixes)
_QUANTIZATION_VERSION = 2  # ggml's block layouts, as llama.cpp's writer records them


def _byte_shape(fmt: QuantFormat, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of fmt's data for a tensor of `shape` as uint8 (rows last)."""
    if fmt.block_size == 1 and fmt.row_overhead == 0:  # F32, F16, BF16: raw_shape is the value shape
        return tuple(shape[:-1]) + (shape[-1] * fmt.type_size,)
    return fmt.raw_shape(shape)


def _stored_nbytes(fmt: QuantFormat, shape: tuple[int, ...]) -> int:
    return math.prod(_byte_shape(fmt, shape))


def _encode(x: np.ndarray, fmt: QuantFormat, shape: tuple[int, ...]) -> np.ndarray:
    """float32 weights -> the array written to the GGUF for fmt."""
    if fmt.name == "F32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if fmt.name == "F16":
        return np.ascontiguousarray(x, dtype=np.float32).astype(np.float16)
    raw = quantize(x, fmt)
    if fmt.ggml_type is None:
        return storage.stored_array(raw, fmt, shape)
    return np.ascontiguousarray(raw).view(np.uint8).reshape(_byte_shape(fmt, shape))


def _as_stored(raw: np.ndarray, fmt: QuantFormat, shape: tuple[int, ...]) -> np.ndarray:
    """Raw data already in fmt (copied through from a GGUF source) -> the array written."""
    if fmt.name in ("F32", "F16"):
        return np.ascontiguousarray(raw)
    if fmt.ggml_type is None:
        return storage.stored_array(raw, fmt, shape)
    return np.ascontiguousarray(raw).view(np.uint8).reshape(_byte_shape(fmt, shape))


def _check_paths(src: Path, dst: Path, force: bool) -> None:
    if not os.path.exists(src):
        raise ModelFileError(f"input not found: {src}")
    if dst.resolve() == src.resolve():
        raise QuantizeError(f"output {dst} is the input {src}: choose another output path (the input is never overwritten)")
    if dst.exists() or dst.is_symlink():
        if dst.is_dir():
            raise QuantizeError(f"output {dst} is a directory: give a .gguf file path")
        if dst.exists() and os.path.samefile(dst, src):
            raise QuantizeError(f"output {dst} is the input {src} (the same file): choose another output path")
        if not force:
            raise QuantizeError(f"output {dst} exists (use --force to overwrite it)")
    if not dst.parent.is_dir():
        raise QuantizeError(f"output directory {dst.parent} does not exist")
    if src.is_dir():
        # writing into the folder is fine, but never over one of its files
        if dst.resolve().parent == src.resolve() and dst.suffix in (".safetensors", ".json"):
            raise QuantizeError(f"output {dst} would overwrite a file of the input folder {src}")


def quantize_model(src: str | os.PathLike, dst: str | os.PathLike, type: str | None = None, *,
                   policy: str = "uniform", rules: Sequence[str] = (), strict: bool = False, force: bool = False,
                   progress: bool = False, on_warning: Callable[[str], None] | None = None) -> QuantizeReport:
    """Quantize the model at src (GGUF file or HF safetensors folder) into the GGUF file dst.

    type: the target format (see edgellm.quant.policy.TYPES); policy: 'uniform', 'mixed-8-4-4' or
    'llama.cpp'; rules: 'PATTERN=TYPE' strings, first match wins, before the policy; strict: a row
    length no block divides is an error instead of a fallback; force: replace an existing dst.
    Warnings go to on_warning(message) (default: warnings.warn with QuantizeWarning).
    Raises an EdgeLLMError subclass with a one-line message on bad input; dst is then untouched."""
    t0 = time.perf_counter()
    pol = make_policy(policy, type)
    parsed_rules = [parse_rule(r) for r in rules]
    src_p, dst_p = Path(src), Path(dst)
    _check_paths(src_p, dst_p, force)
    report = QuantizeReport(src_p, dst_p, pol.name, pol.requested.name if pol.requested else None)

    def warn(msg: str) -> None:
        report.warnings.append(msg)
        if on_warning is not None:
            on_warning(msg)
        else:
            warnings.warn(msg, QuantizeWarning, stacklevel=3)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", QuantizeWarning)
        source = open_source(src_p)
    for w in caught:
        warn(str(w.message))
    quantized = source.quantized_types
    if quantized:
        listing = ", ".join(f"{k} x{v}" for k, v in sorted(quantized.items()))
        warn(f"{src_p.name} is already quantized ({listing}): its tensors are dequantized first, so the result "
             "also carries the source's quantization error (tensors already in their target format are copied)")
    choices = choose_types({t.name: t.shape for t in source.tensors}, pol, parsed_rules, strict, warn)
    _write(source, choices, dst_p, report, progress, warn)
    report.seconds = time.perf_counter() - t0
    report.file_bytes = dst_p.stat().st_size
    return report


def _write(source: Source, choices: dict[str, Choice], dst: Path, report: QuantizeReport, progress: bool,
           warn: Callable[[str], None]) -> None:
    import gguf
    from gguf import GGUFValueType as V

    fd, tmp_name = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".partial")
    os.close(fd)
    tmp = Path(tmp_name)
    writer = None
    try:
        writer = gguf.GGUFWriter(tmp, source.arch)
        if source.alignment != gguf.GGUF_DEFAULT_ALIGNMENT:
            writer.add_custom_alignment(source.alignment)
        for m in source.metadata:
            if m.vtype == V.ARRAY and len(m.value) == 0:
                warn(f"metadata '{m.key}' is an empty array, which gguf-py cannot write; dropped")
                continue
            writer.add_key_value(m.key, m.value, m.vtype, m.sub_type)
        weights = [c.format for t, c in ((t, choices[t.name]) for t in source.tensors) if len(t.shape) >= 2]
        main = report.type and get_format(report.type)
        if main is not None and main.name in _FILE_TYPES and main in weights:
            writer.add_uint32("general.file_type", _FILE_TYPES[main.name])
        if any(f.ggml_type is not None and f.name not in ("F32", "F16", "BF16") for f in weights):
            writer.add_uint32("general.quantization_version", _QUANTIZATION_VERSION)
        own = [(t, choices[t.name].format) for t in source.tensors if choices[t.name].format.ggml_type is None]
        if own:
            writer.add_uint32(storage.VERSION_KEY, storage.VERSION)
            for t, fmt in own:
                for key, value in storage.tensor_metadata(t.name, fmt, t.shape).items():
                    if isinstance(value, list):
                        writer.add_key_value(key, value, V.ARRAY, V.UINT64)
                    else:
                        writer.add_key_value(key, value, V.STRING)
        for t in source.tensors:
            fmt = choices[t.name].format
            nbytes = _stored_nbytes(fmt, t.shape)
            if fmt.name == "F32":
                writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes)
            elif fmt.name == "F16":
                writer.add_tensor_info(t.name, t.shape, np.dtype(np.float16), nbytes)
            elif fmt.ggml_type is None:
                writer.add_tensor_info(t.name, fmt.raw_shape(t.shape), np.dtype(np.int8), nbytes,
                                       raw_dtype=gguf.GGMLQuantizationType.I8)
            else:
                writer.add_tensor_info(t.name, _byte_shape(fmt, t.shape), np.dtype(np.uint8), nbytes,
                                       raw_dtype=gguf.GGMLQuantizationType(int(fmt.ggml_type)))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with _progress_bar(progress, len(source.tensors)) as advance:
            for t in source.tensors:
                choice = choices[t.name]
                fmt = choice.format
                advance(t.name)
                copied = t.raw is not None and t.type_name == fmt.name
                try:
                    data = _as_stored(t.raw(), fmt, t.shape) if copied else _encode(t.load(), fmt, t.shape)
                except EdgeLLMError as e:
                    raise type(e)(f"tensor '{t.name}' ({fmt.name}): {e}") from None
                writer.write_tensor_data(data)
                report.tensors.append(TensorRecord(
                    t.name, t.shape, t.type_name, fmt.name, t.nbytes, int(data.nbytes),
                    "copied" if copied else choice.reason,
                    choice.requested.name if choice.requested is not None else None))
            advance(None)
        writer.close()
        writer = None
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, dst)
    except BaseException:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _progress_bar:
    """A rich progress bar over tensors on stderr (a no-op when disabled)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self._progress = None

    def __enter__(self) -> Callable[[str | None], None]:
        if not self.enabled:
            return lambda name: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("quantizing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  TextColumn("{task.description}"), console=Console(stderr=True), transient=True)
        self._progress.start()
        task = self._progress.add_task("", total=self.total)
        started = [False]

        def advance(name: str | None) -> None:
            if started[0]:
                self._progress.advance(task)
            started[0] = True
            self._progress.update(task, description=name or "")

        return advance

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()


# -- the command -----------------------------------------------------------------------------------

def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _console(stderr: bool = False):
    """A rich console that never wraps a line itself (soft wrap: a terminal wraps long lines, a pipe
    or file keeps paths and messages whole); off a terminal tables may be as wide as they need
    (rich would assume 80 columns)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    tty = getattr(stream, "isatty", lambda: False)()
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=None if tty else 1 << 16)


def print_summary(report: QuantizeReport, console=None) -> None:
    """The summary table: bytes and bits per weight before/after, and tensors per type."""
    from rich.table import Table

    console = console or _console()
    console.print(f"quantized {report.input} -> {report.output}: policy {report.policy}"
                  + (f", type {report.type.lower()}" if report.type else "") + f", {report.seconds:.1f} s",
                  highlight=False, markup=False)
    table = Table()
    for col in ("type", "tensors", "params", "bytes", "bits/weight"):
        table.add_column(col, justify="left" if col == "type" else "right")
    for name, (n, values, nbytes) in report.type_counts().items():
        table.add_row(name, str(n), f"{values / 1e6:.2f} M", _fmt_bytes(nbytes), f"{8 * nbytes / max(values, 1):.2f}")
    table.add_section()
    table.add_row("before", str(len(report.tensors)), f"{report.params / 1e6:.2f} M", _fmt_bytes(report.bytes_before),
                  f"{report.bpw_before:.2f}")
    table.add_row("after", str(len(report.tensors)), f"{report.params / 1e6:.2f} M", _fmt_bytes(report.bytes_after),
                  f"{report.bpw_after:.2f}")
    console.print(table)
    fallbacks = [t for t in report.tensors if t.fallback_from]
    console.print(f"file {report.output}: {_fmt_bytes(report.file_bytes)}; tensors {size_change(report)}"
                  + (f"; {len(fallbacks)} tensors fell back to a wider format" if fallbacks else ""),
                  highlight=False, markup=False)


def size_change(report: QuantizeReport) -> str:
    """The tensors' size after relative to before, worded for its direction: '1.48× larger', '0.68× the size'."""
    ratio = report.bytes_after / max(report.bytes_before, 1)
    return f"{ratio:.2f}× larger" if ratio > 1 else f"{ratio:.2f}× the size"


def _cmd_quantize(args: argparse.Namespace) -> int:
    err = _console(stderr=True)
    report = quantize_model(args.input, args.output, args.type, policy=args.policy, rules=args.rule or (),
                            strict=args.strict, force=args.force, progress=not args.quiet,
                            on_warning=lambda m: err.print(f"edgellm: warning: {m}", markup=False))
    if not args.quiet:
        print_summary(report)
    return 0


def _configure_quantize_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="IN", help="a GGUF file, or a Hugging Face folder (config.json + *.safetensors)")
    p.add_argument("output", metavar="OUT", help="the GGUF file to write")
    p.add_argument("--type", "-t", default=None, metavar="T",
                   help=f"target format: {', '.join(TYPES)} (also q4_g<group>[_sym], fp4_e0m4_g<group>; "
                        "q4_k_m and q5_k_m are llama-quantize's mixes: Q6_K for the head and some attn_v "
                        "and ffn_down); required except with --policy mixed-8-4-4 (default q4_g32 there)")
    p.add_argument("--policy", default="uniform", metavar="P",
                   help=f"{', '.join(POLICIES)} (default uniform: every weight gets --type; mixed-8-4-4: attention "
                        "8-bit, embedding and FFN 4-bit; llama.cpp: output Q6_K, tied embedding Q8_0)")
    p.add_argument("--rule", action="append", metavar="PATTERN=TYPE",
                   help="regex on the tensor name = type; first match wins, before the policy (repeatable), "
                        r"e.g. 'blk\.\d+\.attn_.*=q8_0'")
    p.add_argument("--strict", action="store_true",
                   help="a tensor whose rows do not fit the type's blocks is an error, not a fallback to a wider type")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")


def add_quantize_parser(subparsers, help: str | None = None) -> argparse.ArgumentParser:
    """Register `quantize` on an argparse subparsers object; its func(args) returns the exit status."""
    p = subparsers.add_parser(
        "quantize", help=help,
        description="Quantize a GGUF file or a Hugging Face safetensors folder into a GGUF file. Norms, biases and "
                    "other 1-D tensors stay F32. A tensor whose rows are not a whole number of the type's blocks "
                    "gets the next wider format that fits (q4_0 -> q8_0 -> f16; q4_g128 -> q4_g64 -> q4_g32 -> "
                    "q8_pc), with a warning, unless --strict.")
    _configure_quantize_parser(p)
    p.set_defaults(func=_cmd_quantize)
    return p


def _cmd_compare_fp4(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .quant import compare_fp4_int4

    path = args.model
    if path is None:
        from .default_model import default_model_path

        path = default_model_path()
    if os.path.isdir(path):
        source = open_source(path)
        weights: Any = {t.name: t.load() for t in source.tensors if len(t.shape) >= 2}
    else:
        from .gguf_file import open_gguf

        weights = open_gguf(path)
    g = args.group
    result = compare_fp4_int4(weights, group_size=g)
    table = Table(title=f"mean |error| of FP4_E0M4_G{g} vs Q4_G{g} and Q4_G{g}_SYM (groups of {g}) on {path}",
                  title_justify="left")
    for col in ("kind", "tensors", "values", "fp4_e0m4", "q4_g", "q4_g_sym", "fp4/int4"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for kind, row in result.items():
        table.add_row(kind, str(row["tensors"]), f"{row['values'] / 1e6:.2f} M", f"{row['fp4_e0m4_mae']:.3e}",
                      f"{row['q4_g_mae']:.3e}", f"{row['q4_g_sym_mae']:.3e}", f"{row['fp4_over_int4']:.3f}")
    _console().print(table)
    if not result:
        print(f"no llama-style weights with a whole number of groups of {g} in {path}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m edgellm.quantize_model IN OUT --type T ...`, or `... --compare-fp4 [MODEL] [--group G]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from .arguments import ArgumentParser

    p = ArgumentParser(prog="python -m edgellm.quantize_model")
    if "--compare-fp4" in argv:
        p.add_argument("--compare-fp4", action="store_true", required=True,
                       help="print the FP4_E0M4 vs int4 mean-error table per tensor kind")
        p.add_argument("model", nargs="?", default=None, help="a GGUF file or HF folder (default: the embedded model)")
        p.add_argument("--group", type=int, default=128, help="group size (default 128)")
        p.set_defaults(func=_cmd_compare_fp4)
    else:
        _configure_quantize_parser(p)
        p.set_defaults(func=_cmd_quantize)
    args = p.parse_args(argv)
    from .cli import run_command

    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
