"""How edgellm's own weight formats (Q8_PC, Q4_G{g}[_SYM], FP4_E0M4[_G{g}]) are stored in a GGUF file.

GGUF has a fixed list of GGML tensor types, and ours are not in it. A tensor in one of our formats
is stored as raw bytes under the standard GGML type I8, with two metadata keys naming what the
bytes are:

  tensor  <name>                         GGML type I8, numpy shape logical[:-1] + (row_bytes,)
                                         (GGUF dims reversed, as always); the bytes are exactly
                                         `edgellm.quant.quantize(weights, format)`, one row per
                                         output channel
  key     edgellm.quant.<name>.format    string: the canonical format name, e.g. "Q8_PC", "Q4_G32",
                                         "Q4_G128_SYM", "FP4_E0M4" (accepted by `get_format`)
  key     edgellm.quant.<name>.shape     array of uint64: the logical shape, numpy order
                                         (outermost first), e.g. [out, in]
  key     edgellm.quant.version          uint32 = 1, present when the file holds any such tensor

edgellm's loader (`edgellm.gguf_file`) maps such a tensor back: `TensorData.type_name` is the
format name, `.shape` the logical shape, `.data` the uint8 rows of `row_bytes`. Readers that do not
know these keys (gguf-py, llama.cpp) see a well-formed GGUF with an int8 tensor of the stored
shape; llama.cpp cannot run such a model (its tensor shapes disagree with the hyperparameters),
which is the honest outcome for a format it has no kernel for. Files holding only GGML types get
none of these keys and are plain GGUF.

Per-tensor keys (rather than one array) keep the mapping readable with any GGUF dumper and let a
tool copy or drop one tensor with its description.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .base import QuantFormat
from .registry import get_format

PREFIX = "edgellm.quant."
VERSION_KEY = PREFIX + "version"
VERSION = 1


def format_key(tensor_name: str) -> str:
    return f"{PREFIX}{tensor_name}.format"


def shape_key(tensor_name: str) -> str:
    return f"{PREFIX}{tensor_name}.shape"


def is_own_format(fmt: Any) -> bool:
    """True for edgellm's own formats (no GGML type id): they need this module's storage."""
    return get_format(fmt).ggml_type is None


def is_storage_key(key: str) -> bool:
    """A metadata key written by this module (dropped when a file is re-quantized)."""
    return key.startswith(PREFIX)


def stored_array(raw: np.ndarray, fmt: QuantFormat, shape: tuple[int, ...]) -> np.ndarray:
    """Raw data from `fmt.quantize` -> the int8 array written to the GGUF (shape raw_shape(shape))."""
    raw = np.ascontiguousarray(raw)
    expected = fmt.raw_shape(shape)
    if raw.dtype not in (np.uint8, np.int8) or raw.size != math.prod(expected):
        raise ValueError(f"{fmt.name}: raw data {raw.shape} {raw.dtype} does not fit shape {shape}")
    return raw.view(np.int8).reshape(expected)


def tensor_metadata(tensor_name: str, fmt: QuantFormat, shape: tuple[int, ...]) -> dict[str, Any]:
    """The metadata keys describing one stored tensor: key -> value (format: str, shape: list of int)."""
    return {format_key(tensor_name): fmt.name, shape_key(tensor_name): [int(d) for d in shape]}


def own_format_of(metadata: Mapping[str, Any], tensor_name: str, stored_shape: tuple[int, ...],
                  source: str) -> tuple[str, tuple[int, ...]] | None:
    """For a tensor stored as I8: (format name, logical shape) when the metadata says it is one of
    our formats, else None. Raises ValueError (one line, naming the tensor) when the description
    disagrees with the stored bytes."""
    name = metadata.get(format_key(tensor_name))
    if name is None:
        return None
    where = f"{source}: tensor '{tensor_name}'"
    if not isinstance(name, str):
        raise ValueError(f"{where}: metadata '{format_key(tensor_name)}' is {name!r}, expected a format name")
    fmt = get_format(name)  # UnknownTensorTypeError for a name this edgellm does not know
    shape = metadata.get(shape_key(tensor_name))
    if (not isinstance(shape, list) or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise ValueError(f"{where}: metadata '{shape_key(tensor_name)}' is {shape!r}, expected a list of positive sizes")
    shape_t = tuple(shape)
    try:
        expected = fmt.raw_shape(shape_t)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if tuple(stored_shape) != expected:
        raise ValueError(f"{where}: stored as {tuple(stored_shape)} bytes, but {fmt.name} of logical shape "
                         f"{shape_t} takes {expected}")
    return fmt.name, shape_t
