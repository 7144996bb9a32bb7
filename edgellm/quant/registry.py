"""Format names -> format objects. Names are case-insensitive; group sizes are part of the name."""

from __future__ import annotations

import re
from functools import lru_cache

from gguf import GGMLQuantizationType

from ..errors import UnknownTensorTypeError
from .base import QuantFormat
from .float_formats import BF16, F16, F32
from .fp4_e0m4 import FP4E0M4
from .ggml_kquants import Q4_K, Q5_K, Q6_K
from .ggml_legacy import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
from .q4_group import Q4Group, Q4GroupSym
from .q8_pc import Q8_PC

_STANDARD_GROUPS = (32, 64, 128, 256)


def _build() -> dict[str, QuantFormat]:
    formats: list[QuantFormat] = [
        F32(), F16(), BF16(),
        Q4_0(), Q4_1(), Q5_0(), Q5_1(), Q8_0(),
        Q4_K(), Q5_K(), Q6_K(),
        Q8_PC(),
    ]
    formats += [Q4Group(g) for g in _STANDARD_GROUPS]
    formats += [Q4GroupSym(g) for g in _STANDARD_GROUPS]
    formats += [FP4E0M4(g) for g in _STANDARD_GROUPS]
    return {f.name: f for f in formats}


FORMATS: dict[str, QuantFormat] = _build()
"""The formats under their canonical names. Other group sizes are made on demand by get_format."""

_GROUP_NAME = re.compile(r"^(?:Q4_G(?P<q4>\d+)(?P<sym>_SYM)?|FP4_E0M4(?:_G(?P<fp4>\d+))?)$")


def _known_names() -> str:
    fixed = [n for n in FORMATS if not re.search(r"_G\d", n)]
    return ", ".join(fixed) + ", Q4_G<group>, Q4_G<group>_SYM, FP4_E0M4_G<group> (group a multiple of 8)"


@lru_cache(maxsize=None)
def _grouped(key: str) -> QuantFormat | None:
    match = _GROUP_NAME.match(key)
    if match is None:
        return None
    try:
        if match["q4"] is not None:
            return (Q4GroupSym if match["sym"] else Q4Group)(int(match["q4"]))
        return FP4E0M4(int(match["fp4"] or 128))
    except ValueError as e:
        raise UnknownTensorTypeError(f"quantization format '{key}': {e}") from None


def get_format(name: str | GGMLQuantizationType | QuantFormat) -> QuantFormat:
    """The format called `name` (case-insensitive; a GGMLQuantizationType or a format also work).

    Raises UnknownTensorTypeError naming the format and listing the known ones."""
    if isinstance(name, QuantFormat):
        return name
    if isinstance(name, GGMLQuantizationType):
        key = name.name
    elif isinstance(name, str):
        key = name.strip().upper()
    else:
        raise UnknownTensorTypeError(f"a quantization format is named by a string, got {name!r}")
    fmt = FORMATS.get(key) or _grouped(key)
    if fmt is not None:
        return FORMATS.get(fmt.name, fmt)
    if key in GGMLQuantizationType.__members__:
        raise UnknownTensorTypeError(
            f"GGML type {key} is not supported by edgellm.quant; supported: {_known_names()}"
        )
    raise UnknownTensorTypeError(f"unknown quantization format '{name}'; known: {_known_names()}")
