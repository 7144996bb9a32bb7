"""Accuracy of FP4_E0M4 against group-wise int4 on real weights, per kind of tensor.

Weights are cut into groups of `group_size` consecutive values in row-major order: where a row
length is a multiple of the group this is the formats' own row-wise grouping; where it is not
(SmolLM2's 576-wide rows at group 128) groups run across row ends, identically for every format
compared, so the comparison stays fair.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from .registry import get_format

TENSOR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_WEIGHT_NAME = re.compile(r"^(?:blk\.\d+\.)?(?P<kind>[A-Za-z0-9_]+)\.weight$")  # blk.3.attn_q.weight, token_embd.weight


def _float_weights(weights: Any) -> Mapping[str, Any]:
    """name -> float array (lazily dequantized when given an opened GGUF file)."""
    if hasattr(weights, "tensors"):
        from . import dequantize

        return {name: (lambda t=t: dequantize(t.data, t.ggml_type, t.shape)) for name, t in weights.tensors.items()}
    return {name: (lambda a=a: np.asarray(a, dtype=np.float32)) for name, a in weights.items()}


def compare_fp4_int4(weights: Any, group_size: int = 128, kinds: tuple[str, ...] = TENSOR_KINDS) -> dict:
    """Mean absolute error of FP4_E0M4 vs Q4_G (asymmetric int4) and Q4_G_SYM at `group_size`.

    `weights`: an opened GGUF file (`edgellm.gguf_file.open_gguf`) or a mapping name -> float
    array, with llama-style names `blk.<i>.<kind>.weight` (or `<kind>.weight`, e.g. token_embd).
    Returns, for each kind found, {"tensors", "values", "fp4_e0m4_mae", "q4_g_mae",
    "q4_g_sym_mae", "fp4_over_int4"}; errors are against the float64 of the float32 weights."""
    formats = {
        "fp4_e0m4_mae": get_format(f"FP4_E0M4_G{group_size}"),
        "q4_g_mae": get_format(f"Q4_G{group_size}"),
        "q4_g_sym_mae": get_format(f"Q4_G{group_size}_SYM"),
    }
    sums: dict[str, dict[str, float]] = {}
    for name, load in _float_weights(weights).items():
        match = _WEIGHT_NAME.match(name)
        if match is None or match["kind"] not in kinds:
            continue
        x = load().reshape(-1)
        if x.size % group_size:
            continue
        groups = x.reshape(-1, group_size)
        acc = sums.setdefault(match["kind"], {"tensors": 0, "values": 0, **{k: 0.0 for k in formats}})
        acc["tensors"] += 1
        acc["values"] += x.size
        exact = groups.astype(np.float64)
        for key, fmt in formats.items():
            approx = fmt.dequantize(fmt.quantize(groups), groups.shape)
            acc[key] += float(np.abs(approx - exact).sum())
    result = {}
    for kind in kinds:
        if kind not in sums:
            continue
        acc = sums[kind]
        row = {"tensors": acc["tensors"], "values": acc["values"]}
        row.update({k: acc[k] / acc["values"] for k in formats})
        row["fp4_over_int4"] = row["fp4_e0m4_mae"] / row["q4_g_mae"]
        result[kind] = row
    return result
