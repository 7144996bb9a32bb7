"""The automatic quantization step: each requested type is produced once, before the sweep, by
edgellm's quantization feature (edgellm.quantize_model), and cached on disk.

The cache key is the source file's identity (a hash of its first and last MiB, its size and its
modification time) and the type, so an edited or replaced source is re-quantized."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
from pathlib import Path

from ..errors import EdgeLLMError

SOURCE = "source"  # the --quant name of the file as given


class QuantizationUnavailable(EdgeLLMError):
    """The quantization feature is missing or cannot produce the requested type."""


def source_key(path: str | os.PathLike) -> str:
    path = Path(path)
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > (1 << 20):
            f.seek(max(st.st_size - (1 << 20), 1 << 20))
            h.update(f.read(1 << 20))
    h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def cached_path(src: str | os.PathLike, qtype: str, cache_dir: str | os.PathLike, policy: str | None = None) -> Path:
    src = Path(src)
    tag = f"{qtype.upper()}" + (f".{policy}" if policy else "")
    return Path(cache_dir) / f"{src.stem}.{source_key(src)}.{tag}.gguf"


def _quantizer():
    try:
        mod = importlib.import_module("edgellm.quantize_model")
    except ImportError as e:
        raise QuantizationUnavailable(f"the quantization feature is not available (edgellm.quantize_model: {e})") from None
    fn = getattr(mod, "quantize_model", None)
    if not callable(fn):
        raise QuantizationUnavailable("edgellm.quantize_model has no quantize_model(src, dst, type) function")
    return fn


def produce_quantized(src: str | os.PathLike, qtype: str, cache_dir: str | os.PathLike,
                      policy: str | None = None) -> Path:
    """The GGUF file of `src` quantized to `qtype` (with the quantizer's `policy`, default its own),
    made once by edgellm.quantize_model and cached under cache_dir. Raises QuantizationUnavailable
    (with the reason) when it cannot be made."""
    src = Path(src)
    dst = cached_path(src, qtype, cache_dir, policy)
    if dst.is_file():
        return dst
    fn = _quantizer()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.stem}.partial-{os.getpid()}.gguf")
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    extra = {"policy": policy} if policy else {}
    try:
        if policy and "policy" not in params:
            raise QuantizationUnavailable(f"the quantizer takes no policy (asked for '{policy}')")
        fn(str(src), str(tmp), qtype, **extra)  # quantize_model(src, dst, type, *, policy=...)
        if not tmp.is_file():
            raise QuantizationUnavailable(f"quantizing to {qtype} wrote no file")
        os.replace(tmp, dst)
    except EdgeLLMError as e:
        raise QuantizationUnavailable(f"{qtype}: {e}") from None
    except NotImplementedError as e:
        raise QuantizationUnavailable(f"{qtype} is not supported by the quantizer: {e}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst
