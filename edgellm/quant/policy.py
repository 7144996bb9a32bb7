"""Which format each tensor of a model gets when it is quantized: types, policies, rules, fallbacks.

The order of decisions for one tensor (first that applies wins):
  1. a tensor with fewer than two axes (norms, biases, rope_freqs) stays F32, always;
  2. a user rule `PATTERN=TYPE` whose regex matches the name (`re.search`; first matching rule);
  3. the policy:
     uniform       every weight (2-D or more) gets the requested type.
     mixed-8-4-4   ML Drift's 8/4/4: attention weights (attn_q/k/v/output) 8-bit, embedding and
                   feed-forward 4-bit. The 4-bit type is the requested one (default Q4_G32; it
                   must be a 4-bit type). The 8-bit type is Q8_0 when the 4-bit type is a GGML
                   type (the file stays readable by llama.cpp) and Q8_PC (per-channel int8, ML
                   Drift's own q8) when it is one of edgellm's formats. The LM head
                   (output.weight) is counted with the embedding: 4-bit.
     llama.cpp     llama-quantize's defaults for the simple types: every weight gets the requested
                   type, except the LM head: an untied output.weight gets Q6_K (Q8_0 where its
                   rows are not a whole number of 256-value blocks), and a tied token_embd (which
                   is the LM head too) is kept at 8-bit, Q8_0. A requested type of 8 bits or more
                   is never narrowed.
     A requested mix, Q4_K_M or Q5_K_M (llama-quantize's file types of those names; with the
     uniform or llama.cpp policy), gives every weight Q4_K or Q5_K except where llama-quantize
     (src/llama-quant.cpp) gives more bits on a llama-style model: Q6_K for the LM head (output.weight,
     or a tied token_embd) and for attn_v and ffn_down in the first and last eighth of the layers
     and every third layer between (more_bits).
  4. the fallback: a format whose block does not divide the tensor's row length is replaced by the
     next wider format that fits, with a warning naming the tensor (an error with strict=True):
       Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (llama.cpp's own choices),
       Q4_0, Q4_1, Q5_0, Q5_1 -> Q8_0 -> F16,
       Q4_G{g}[_SYM], FP4_E0M4_G{g} -> the same with g/2 (down to 32) -> Q8_PC,
       and F32, F16, BF16, Q8_PC fit any row.
     The chain is followed until a format fits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import EdgeLLMError, UnknownTensorTypeError
from .base import QuantFormat
from .registry import get_format


class QuantizePolicyError(EdgeLLMError, ValueError):
    """A bad quantization request: unknown type or policy, malformed rule, a row no format fits."""


# The types `edgellm quantize --type` offers (lower case, as typed on the command line). Other
# group sizes (Q4_G64, FP4_E0M4_G32, ...) are accepted too.
TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k",
         "q4_k_m", "q5_k_m", "q8_pc", "q4_g32", "q4_g32_sym", "q4_g128", "q4_g128_sym", "fp4_e0m4")
# mixes of types named by llama-quantize's file types: the main type of each (the rest: KMix)
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
POLICIES = ("uniform", "mixed-8-4-4", "llama.cpp")
MIXED_DEFAULT_4BIT = "Q4_G32"

ATTENTION_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv")
_KIND = re.compile(r"^(?:blk\.\d+\.)?(?P<kind>[A-Za-z0-9_]+)\.(?:weight|bias)$")

_GGML_FALLBACK = {
    "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
    "Q4_0": "Q8_0", "Q4_1": "Q8_0", "Q5_0": "Q8_0", "Q5_1": "Q8_0",
    "Q8_0": "F16",
}
_GROUPED = re.compile(r"^(?P<base>Q4_G|FP4_E0M4_G)(?P<g>\d+)(?P<sym>_SYM)?$")


def known_types_text() -> str:
    return ", ".join(TYPES) + " (and q4_g<group>[_sym], fp4_e0m4_g<group>)"


def resolve_type(name: str, what: str = "type") -> QuantFormat:
    """The format a --type / rule names; QuantizePolicyError listing the known ones otherwise."""
    if name.strip().upper() in MIXES:
        raise QuantizePolicyError(f"{what} '{name}' names a mix of types for a whole file (llama-quantize's), "
                                  f"not one tensor's type; give a single type here (e.g. {MIXES[name.strip().upper()].lower()})")
    try:
        fmt = get_format(name)
    except UnknownTensorTypeError:
        raise QuantizePolicyError(f"unknown {what} '{name}'; known: {known_types_text()}") from None
    if not fmt.can_quantize:
        raise QuantizePolicyError(f"{what} '{name}' can be read but not written; known: {known_types_text()}")
    return fmt


def tensor_kind(name: str) -> str:
    """'attn_q', 'ffn_down', 'token_embd', 'output', ... (the name without block prefix and suffix)."""
    m = _KIND.match(name)
    return m["kind"] if m else name


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern
    format: QuantFormat
    text: str


def parse_rule(text: str) -> Rule:
    """'PATTERN=TYPE' (the last '=' splits; PATTERN a Python regex searched in the tensor name)."""
    pattern, sep, type_name = text.rpartition("=")
    if not sep or not pattern or not type_name.strip():
        raise QuantizePolicyError(f"malformed rule '{text}': expected PATTERN=TYPE, e.g. 'blk\\.\\d+\\.attn_.*=q8_0'")
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise QuantizePolicyError(f"malformed rule '{text}': bad regular expression ({e})") from None
    return Rule(regex, resolve_type(type_name.strip(), what=f"type in rule '{text}'"), text)


def fallback_of(fmt: QuantFormat) -> QuantFormat | None:
    """The next wider format after fmt in the fallback chain (None: fmt fits every row)."""
    if fmt.block_size == 1:
        return None
    if fmt.name in _GGML_FALLBACK:
        return get_format(_GGML_FALLBACK[fmt.name])
    m = _GROUPED.match(fmt.name)
    if m:
        g = int(m["g"])
        if g // 2 >= 32 and (g // 2) % 8 == 0:
            return get_format(f"{m['base']}{g // 2}{m['sym'] or ''}")
        return get_format("Q8_PC")
    if fmt.name == "FP4_E0M4":  # the default group, 128
        return get_format("FP4_E0M4_G64")
    return get_format("F16")


def fits(fmt: QuantFormat, shape: tuple[int, ...]) -> bool:
    return bool(shape) and shape[-1] > 0 and shape[-1] % fmt.block_size == 0


@dataclass(frozen=True)
class Choice:
    """The format chosen for one tensor and why."""

    format: QuantFormat
    reason: str  # '1-D', 'rule <text>', 'policy <name>'
    requested: QuantFormat | None = None  # set when a fallback replaced it

    @property
    def fell_back(self) -> bool:
        return self.requested is not None


class Policy:
    """Base: a name and the format for each weight (2-D or more) before rules and fallbacks."""

    name = ""

    def __init__(self, requested: QuantFormat | None):
        self.requested = requested

    def prepare(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Called with every tensor's shape before the first choose (a policy that depends on
        the model's depth reads it here)."""

    def choose(self, name: str, shape: tuple[int, ...], tied: bool) -> QuantFormat:
        raise NotImplementedError


class Uniform(Policy):
    name = "uniform"

    def __init__(self, requested):
        if requested is None:
            raise QuantizePolicyError("--type is required with --policy uniform; known: " + known_types_text())
        super().__init__(requested)

    def choose(self, name, shape, tied):
        return self.requested


def _is_4bit(fmt: QuantFormat) -> bool:
    """4-bit codes (block headers aside): Q4_0, Q4_1, Q4_K, Q4_G*, FP4_E0M4*."""
    return fmt.name.startswith(("Q4_", "FP4_"))


class Mixed844(Policy):
    name = "mixed-8-4-4"

    def __init__(self, requested):
        four = requested if requested is not None else get_format(MIXED_DEFAULT_4BIT)
        if not _is_4bit(four):
            raise QuantizePolicyError(
                f"--policy mixed-8-4-4 takes a 4-bit --type for embedding and feed-forward, got '{four.name.lower()}' "
                "(4-bit: q4_0, q4_1, q4_k, q4_g32, q4_g32_sym, q4_g128, q4_g128_sym, fp4_e0m4)")
        super().__init__(four)
        self.eight = get_format("Q8_0" if four.ggml_type is not None else "Q8_PC")

    def choose(self, name, shape, tied):
        return self.eight if tensor_kind(name) in ATTENTION_KINDS else self.requested


class LlamaCpp(Policy):
    name = "llama.cpp"

    def __init__(self, requested):
        if requested is None:
            raise QuantizePolicyError("--type is required with --policy llama.cpp; known: " + known_types_text())
        super().__init__(requested)

    def choose(self, name, shape, tied):
        if self.requested.bits_per_weight >= 8:
            return self.requested
        if name == "output.weight":
            return get_format("Q6_K" if fits(get_format("Q6_K"), shape) else "Q8_0")
        if name == "token_embd.weight" and tied:
            return get_format("Q8_0")
        return self.requested


def more_bits(i: int, n: int) -> bool:
    """llama-quantize's use_more_bits: layer i of n is in the first or last eighth, or every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


_LAYER = re.compile(r"^blk\.(\d+)\.")


class KMix(LlamaCpp):
    """llama-quantize's Q4_K_M and Q5_K_M on a llama-style model: the main type, Q6_K for the LM
    head and for attn_v and ffn_down where more_bits says so (counted over the layers that have
    them, as llama-quantize counts them)."""

    def __init__(self, mix: str):
        super().__init__(get_format(MIXES[mix]))
        self.mix = mix
        self.name = f"llama.cpp {mix.lower()}"
        self.six = get_format("Q6_K")
        self.more: set[str] = set()

    def prepare(self, shapes):
        for kind in ("attn_v", "ffn_down"):
            layers = sorted(int(m[1]) for n in shapes if (m := _LAYER.match(n)) and tensor_kind(n) == kind
                            and n.endswith(".weight"))
            self.more |= {f"blk.{i}.{kind}.weight" for k, i in enumerate(layers) if more_bits(k, len(layers))}

    def choose(self, name, shape, tied):
        if name == "output.weight" or (name == "token_embd.weight" and tied) or name in self.more:
            return self.six
        return self.requested


_POLICY_CLASSES = {"uniform": Uniform, "mixed-8-4-4": Mixed844, "llama.cpp": LlamaCpp}


def make_policy(name: str, requested: str | QuantFormat | None) -> Policy:
    cls = _POLICY_CLASSES.get(str(name).strip().lower())
    if cls is None:
        raise QuantizePolicyError(f"unknown policy '{name}'; known: {', '.join(POLICIES)}")
    if isinstance(requested, str) and requested.strip().upper() in MIXES:
        if cls is Mixed844:
            raise QuantizePolicyError(f"--type {requested.strip().lower()} is a mix of its own (llama-quantize's); "
                                      "use it with --policy uniform or llama.cpp, not mixed-8-4-4")
        return KMix(requested.strip().upper())
    fmt = resolve_type(requested) if isinstance(requested, str) else requested
    return cls(fmt)


def choose_types(shapes: dict[str, tuple[int, ...]], policy: Policy, rules: Iterable[Rule] = (),
                 strict: bool = False, warn: Callable[[str], None] | None = None) -> dict[str, Choice]:
    """The format of every tensor (name -> shape, numpy order) under rules, policy and fallbacks.
    Calls warn(message) once per kind of fallback (requested format, row length, format used),
    naming every tensor concerned; raises QuantizePolicyError at the first one with strict=True."""
    rules = list(rules)
    tied = "output.weight" not in shapes
    policy.prepare({name: tuple(shape) for name, shape in shapes.items()})
    f32 = get_format("F32")
    out: dict[str, Choice] = {}
    fallbacks: dict[tuple[str, int, str], list[str]] = {}
    for name, shape in shapes.items():
        shape = tuple(shape)
        if len(shape) < 2:
            out[name] = Choice(f32, "1-D")
            continue
        rule = next((r for r in rules if r.pattern.search(name)), None)
        if rule is not None:
            fmt, reason = rule.format, f"rule {rule.text}"
        else:
            fmt, reason = policy.choose(name, shape, tied), f"policy {policy.name}"
        if fits(fmt, shape):
            out[name] = Choice(fmt, reason)
            continue
        wide = fmt
        while wide is not None and not fits(wide, shape):
            wide = fallback_of(wide)
        wide = wide or get_format("F16")
        if strict:
            raise QuantizePolicyError(
                f"tensor '{name}' has rows of {shape[-1]} values, not a whole number of {fmt.name} blocks of "
                f"{fmt.block_size} (--strict; without it, {wide.name} would be used)")
        fallbacks.setdefault((fmt.name, shape[-1], wide.name), []).append(name)
        out[name] = Choice(wide, reason, requested=fmt)
    if warn is not None:
        for (requested, n, used), names in fallbacks.items():
            block = get_format(requested).block_size
            warn(f"{_name_list(names)}: rows of {n} values are not a whole number of {requested} blocks of "
                 f"{block}; stored as {used} instead")
    return out


def _name_list(names: list[str]) -> str:
    """Tensor names, with blk.<i>. runs collapsed: 'token_embd.weight, blk.0-29.ffn_down.weight'."""
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    for n in names:
        m = re.match(r"^blk\.(\d+)\.(.+)$", n)
        key = m[2] if m else n
        if key not in groups:
            groups[key] = []
            order.append(key)
        if m:
            groups[key].append(int(m[1]))
    parts = []
    for key in order:
        blocks = groups[key]
        if not blocks:
            parts.append(key)
        elif len(blocks) == 1:
            parts.append(f"blk.{blocks[0]}.{key}")
        elif blocks == list(range(blocks[0], blocks[-1] + 1)):
            parts.append(f"blk.{blocks[0]}-{blocks[-1]}.{key}")
        else:
            parts.append(f"blk.{{{','.join(map(str, blocks))}}}.{key}")
    return "tensor" + ("s " if len(names) > 1 else " ") + ", ".join(parts)
