"""Read a GGUF model file: all metadata and memory-mapped tensors, kept in their stored formats.

The file is data: nothing in it is executed. Tensors are numpy views into one read-only memory
map of the file (no copy); quantized tensors stay in their GGML block layout until a backend
converts them into the layout its kernels want.

Shapes: GGUF lists dimensions in ggml order (innermost first, e.g. [in, out]); here every shape is
given in numpy order (outermost first, e.g. (out, in)), the order a dequantized array has.

edgellm's own formats (Q8_PC, Q4_G*, FP4_E0M4*) are stored as I8 tensors of raw bytes named by
`edgellm.quant.<tensor>.format` / `.shape` metadata (edgellm/quant/storage.py); they are mapped back
here: `type_name` is the format, `shape` the logical shape, `data` the uint8 rows of blocks.

The header is parsed here rather than with gguf-py's GGUFReader: that reader builds one numpy
array per string and takes ~4 s on a 50k-token vocabulary, this takes ~0.1 s. The tests check the
two agree on every key and tensor byte.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import MetadataError, ModelFileError, UnknownTensorTypeError

GGUF_MAGIC = b"GGUF"
_FLOAT_DTYPES = {
    "F32": np.float32, "F16": np.float16, "F64": np.float64,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
}
_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorData:
    """One stored tensor: its name, GGML type, logical shape (numpy order) and raw data."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # float types: their numpy dtype; block-quantized types: uint8 rows of blocks
    offset: int  # byte offset in the file
    format: str | None = None  # edgellm's own format (stored as I8, see edgellm/quant/storage.py), else None

    @property
    def type_name(self) -> str:
        return self.format or self.ggml_type.name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        if self.format is not None:
            return int(self.data.nbytes)
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return self.n_elements * size // block

    @property
    def bits_per_weight(self) -> float:
        if self.format is not None:
            return 8.0 * self.nbytes / max(self.n_elements, 1)
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return 8.0 * size / block


class _HeaderParser:
    """A bounds-checked reader of the GGUF header that reports a truncated file by what it was reading."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def _need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise ModelFileError(f"truncated GGUF header in {self.path}: the file ends inside {what}")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self._need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self._need(n, what)
        s = str(self.buf[self.pos:self.pos + n], "utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, n: int, what: str) -> list[str]:
        """n strings in a row (a vocabulary: 50k-260k of them), in one tight loop: the general
        value() path cost 13 us a string, a second of a small model's load."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = struct.Struct("<Q").unpack_from
        out = []
        append = out.append
        for _ in range(n):
            if pos + 8 > end:
                raise ModelFileError(f"truncated GGUF header in {self.path}: the file ends inside {what}")
            (k,) = length(buf, pos)
            pos += 8
            if pos + k > end:
                raise ModelFileError(f"truncated GGUF header in {self.path}: the file ends inside {what}")
            append(str(buf[pos:pos + k], "utf-8", errors="replace"))
            pos += k
        self.pos = pos
        return out

    def skip_strings(self, n: int, what: str) -> None:
        """Past n strings without making them (a seventh of strings()' time): the bounds checked alike."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = struct.Struct("<Q").unpack_from
        for _ in range(n):
            if pos + 8 > end:
                raise ModelFileError(f"truncated GGUF header in {self.path}: the file ends inside {what}")
            (k,) = length(buf, pos)
            pos += 8 + k
            if pos > end:
                raise ModelFileError(f"truncated GGUF header in {self.path}: the file ends inside {what}")
        self.pos = pos

    def value(self, vtype: int, what: str, defer: bool = False):
        """The next value. defer: a string array of LAZY_STRINGS or more items comes back as a
        _Deferred (its bytes, parsed on first use through Metadata)."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            itype = self.scalar("<I", what)
            n = self.scalar("<Q", what)
            if itype in _SCALARS:
                dt = np.dtype(_SCALARS[itype])
                self._need(n * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)  # copied by tolist()
                self.pos += n * dt.itemsize
                return arr.tolist()
            if n > len(self.buf):
                raise ModelFileError(f"corrupt GGUF header in {self.path}: {what} claims {n} items")
            if itype == _STRING and defer and n >= LAZY_STRINGS:
                start = self.pos
                self.skip_strings(n, what)
                return _Deferred(bytes(self.buf[start:self.pos]), n, what, self.path)
            if itype == _STRING:
                return self.strings(n, what)
            return [self.value(itype, what) for _ in range(n)]
        raise ModelFileError(f"corrupt GGUF header in {self.path}: {what} has unknown value type {vtype}")


# String arrays this long (a vocabulary's tokens, its merges: 50k-260k strings) are parsed when first
# read: a load whose tokenizer comes from the program cache never reads the merges, whose strings
# took a third of the header's parse (0.05 s of 0.12 s for a 128k vocabulary on the CI machine).
LAZY_STRINGS = 4096


class _Deferred:
    """A long string array's bytes as the file has them, parsed into a list on first use."""

    __slots__ = ("raw", "n", "what", "path")

    def __init__(self, raw: bytes, n: int, what: str, path: Path):
        self.raw, self.n, self.what, self.path = raw, n, what, path

    def parse(self) -> list[str]:
        return _HeaderParser(self.raw, self.path).strings(self.n, self.what)

    def __repr__(self) -> str:
        return f"<{self.n} strings, parsed when read>"


class Metadata(dict):
    """A GGUF file's metadata, key -> value, as a dict; long string arrays are parsed when first
    read (a value is never seen unparsed: item access, get, values, items, copies and comparisons
    all go through __getitem__). length(key) counts one without parsing it."""

    def __getitem__(self, key):
        v = dict.__getitem__(self, key)
        if type(v) is _Deferred:
            v = v.parse()
            dict.__setitem__(self, key, v)
        return v

    def get(self, key, default=None):
        return self[key] if key in self else default

    def length(self, key: str, default: int = 0) -> int:
        """len() of the value at key (0 if absent), without parsing a deferred array."""
        if key not in self:
            return default
        v = dict.__getitem__(self, key)
        return v.n if type(v) is _Deferred else len(v)

    def __iter__(self):  # overridden so that dict(m) and {**m} read the values through __getitem__
        return dict.__iter__(self)

    def values(self):
        return [self[k] for k in self]

    def items(self):
        return [(k, self[k]) for k in self]

    def copy(self) -> dict:
        return dict(self.items())

    def pop(self, key, *default):
        if key in self:
            v = self[key]
            dict.__delitem__(self, key)
            return v
        if default:
            return default[0]
        raise KeyError(key)

    def __eq__(self, other):
        return dict(self.items()) == other

    def __ne__(self, other):
        return not self == other

    __hash__ = None


class GGUFFile:
    """An opened GGUF file: `metadata` (key -> value) and `tensors` (name -> TensorData)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelFileError(f"model file not found: {self.path}")
        if self.path.is_dir():
            raise ModelFileError(f"model path is a directory, expected a .gguf file: {self.path}")
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise ModelFileError(f"cannot read model file {self.path}: {e.strerror}") from None
        if magic != GGUF_MAGIC:
            raise ModelFileError(f"not a GGUF file: {self.path} (starts with {magic!r}, expected {GGUF_MAGIC!r})")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        with open(self.path, "rb") as fh:  # the header through Python's mmap: slicing it is cheap
            header = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        p = _HeaderParser(header, self.path)
        p.pos = 4
        self.version = p.scalar("<I", "the version")
        if self.version not in (2, 3):
            raise ModelFileError(f"{self.path}: GGUF version {self.version} is not supported (expected 2 or 3)")
        n_tensors = p.scalar("<Q", "the tensor count")
        n_kv = p.scalar("<Q", "the metadata count")
        if max(n_tensors, n_kv) > size:
            raise ModelFileError(f"corrupt GGUF header in {self.path}: {n_tensors} tensors, {n_kv} metadata keys")
        self.metadata: Metadata = Metadata()
        for i in range(n_kv):
            key = p.string(f"metadata key #{i}")
            vtype = p.scalar("<I", f"the type of metadata '{key}'")
            dict.__setitem__(self.metadata, key, p.value(vtype, f"metadata '{key}'", defer=True))
        infos = []
        for i in range(n_tensors):
            name = p.string(f"tensor info #{i}")
            n_dims = p.scalar("<I", f"tensor info '{name}'")
            if n_dims > 8:
                raise ModelFileError(f"corrupt GGUF header in {self.path}: tensor '{name}' has {n_dims} dimensions")
            dims = [p.scalar("<Q", f"tensor info '{name}'") for _ in range(n_dims)]
            type_id = p.scalar("<I", f"tensor info '{name}'")
            offset = p.scalar("<Q", f"tensor info '{name}'")
            infos.append((name, dims, type_id, offset))
        alignment = self.metadata.get("general.alignment", 32)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFileError(f"{self.path}: general.alignment is {alignment!r}, expected a power of two")
        data_start = -(-p.pos // alignment) * alignment
        del p
        try:
            header.close()
        except BufferError:  # an array still views it; the map closes when that goes
            pass
        self.tensors: dict[str, TensorData] = {}
        for name, dims, type_id, offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise UnknownTensorTypeError(
                    f"{self.path}: tensor '{name}' has GGML type id {type_id}, which edgellm does not know"
                ) from None
            if name in self.tensors:
                raise ModelFileError(f"{self.path}: tensor '{name}' appears twice")
            shape = tuple(int(d) for d in reversed(dims))
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if shape and shape[-1] % block:
                raise UnknownTensorTypeError(
                    f"{self.path}: tensor '{name}' has rows of {shape[-1]}, not a whole number of "
                    f"{qtype.name} blocks of {block}"
                )
            start = data_start + offset
            nbytes = n // block * type_size
            if start + nbytes > size:
                raise ModelFileError(
                    f"truncated GGUF: {self.path} has {size} bytes but tensor '{name}' ends at byte {start + nbytes}"
                )
            raw = self._map[start:start + nbytes]
            if qtype == GGMLQuantizationType.I8:
                own = self._own_format(name, shape)
                if own is not None:  # edgellm's own format: uint8 rows under its logical shape
                    self.tensors[name] = TensorData(name, qtype, own[1], raw.reshape(shape), start, own[0])
                    continue
            if qtype.name in _FLOAT_DTYPES:
                data = raw.view(_FLOAT_DTYPES[qtype.name]).reshape(shape)
            else:
                data = raw.reshape(shape[:-1] + (shape[-1] // block * type_size,))
            self.tensors[name] = TensorData(name, qtype, shape, data, start)

    def _own_format(self, name: str, stored_shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]] | None:
        """(format, logical shape) of an I8 tensor holding one of edgellm's own formats, else None."""
        from .quant.storage import own_format_of

        try:
            return own_format_of(self.metadata, name, stored_shape, str(self.path))
        except UnknownTensorTypeError as e:
            raise UnknownTensorTypeError(f"{self.path}: tensor '{name}': {e}") from None
        except ValueError as e:
            raise ModelFileError(str(e)) from None

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture", kind=str))

    def get(self, key: str, default: Any = ..., *, kind: type | tuple[type, ...] | None = None) -> Any:
        """A metadata value; raises MetadataError naming the key when it is missing (and no default
        is given) or is not of the expected kind (int, float, str, list)."""
        if key not in self.metadata:
            if default is ...:
                raise MetadataError(f"{self.path.name}: metadata key '{key}' is missing")
            return default
        value = self.metadata[key]
        if kind is not None:
            kinds = kind if isinstance(kind, tuple) else (kind,)
            if float in kinds and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                want = " or ".join(k.__name__ for k in kinds)
                raise MetadataError(f"{self.path.name}: metadata key '{key}' is {value!r}, expected {want}")
        return value

    def arch_get(self, suffix: str, default: Any = ..., *, kind=None) -> Any:
        """`{architecture}.{suffix}`, e.g. arch_get('block_count', kind=int)."""
        return self.get(f"{self.architecture}.{suffix}", default, kind=kind)

    def tensor(self, source: str) -> TensorData:
        """A stored tensor by name, or a block of its rows: 'name[a:b]' (a graph weight that is part
        of a fused tensor, e.g. phi3's q/k/v rows of attn_qkv; see edgellm.graph.ir.row_slice).
        Rows are whole blocks of the stored format, so the slice is a view in the same format.
        'name[:,a:b]' is columns a..b-1 of a 2-D tensor (edgellm.graph.ir.col_slice: a tensor-
        parallel rank's inputs of a projection): whole blocks of the format, copied out."""
        name, axis, a, b = _parse_source(source)
        if axis is None:
            return self.tensors[source]
        if axis == 1:
            return self._columns(source, name, a, b)
        t = self.tensors[name]
        if not (len(t.shape) >= 1 and 0 <= a < b <= t.shape[0]):
            raise ModelFileError(f"{self.path.name}: rows {a}:{b} are outside tensor '{name}' of shape {t.shape}")
        if len(t.shape) == 1:
            return TensorData(source, t.ggml_type, (b - a,), t.data[a:b], t.offset, t.format)
        return TensorData(source, t.ggml_type, (b - a,) + tuple(t.shape[1:]), t.data[a:b], t.offset, t.format)

    def shape_of(self, source: str) -> tuple[str, tuple[int, ...]]:
        """(format name, shape) of a stored tensor or a slice of one (as `tensor` names them),
        without reading or copying its data."""
        name, axis, a, b = _parse_source(source)
        t = self.tensors[name]
        if axis is None:
            return t.type_name, tuple(t.shape)
        shape = list(t.shape)
        shape[axis] = b - a
        return t.type_name, tuple(shape)

    def _columns(self, source: str, name: str, a: int, b: int) -> TensorData:
        t = self.tensors[name]
        if len(t.shape) != 2 or not 0 <= a < b <= t.shape[1]:
            raise ModelFileError(f"{self.path.name}: columns {a}:{b} are outside tensor '{name}' of shape {t.shape}")
        if t.format is not None:
            raise ModelFileError(f"{self.path.name}: tensor '{name}' is in edgellm's own format {t.format}, whose "
                                 "columns cannot be cut (tensor parallelism needs a GGML type)")
        block, size = GGML_QUANT_SIZES[t.ggml_type]
        if a % block or b % block:
            raise ModelFileError(f"{self.path.name}: columns {a}:{b} of tensor '{name}' are not whole {t.type_name} "
                                 f"blocks of {block} values")
        if t.type_name in _FLOAT_DTYPES:
            data = np.ascontiguousarray(t.data[:, a:b])
        else:
            data = np.ascontiguousarray(t.data[:, a // block * size:b // block * size])
        return TensorData(source, t.ggml_type, (t.shape[0], b - a), data, t.offset, t.format)

    def stored_whole(self, t: TensorData) -> bool:
        """t's data is the file's own bytes from t.offset on, in one contiguous run (every stored
        tensor; not a column slice cut by `tensor`, which is a copy)."""
        d = t.data
        return d.flags.c_contiguous and d.__array_interface__["data"][0] == self._map.__array_interface__["data"][0] + t.offset

    @property
    def total_tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def release_pages(self) -> None:
        """Tell the kernel this process no longer needs the tensor pages it has read (a backend
        that copied the weights into its own layout): they leave the process's resident set and
        stay in the page cache; a later read maps them in again."""
        mm = getattr(self._map, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)


def _parse_source(source: str) -> tuple[str, int | None, int, int]:
    """'name' -> (name, None, 0, 0); 'name[a:b]' -> (name, 0, a, b) (rows); 'name[:,a:b]' ->
    (name, 1, a, b) (columns). See edgellm.graph.ir.row_slice / col_slice."""
    if not source.endswith("]") or "[" not in source:
        return source, None, 0, 0
    name, rng = source[:-1].rsplit("[", 1)
    axis = 1 if rng.startswith(":,") else 0
    a, b = (int(v) for v in rng[2 * axis:].split(":"))
    return name, axis, a, b


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)
