"""The persistent cache: what a model's load computes, kept on disk for the next load.

    ~/.cache/edgellm/            (EDGELLM_CACHE_DIR or XDG_CACHE_HOME move it; EDGELLM_CACHE=0: no cache)
      programs/<key>/<artifact>  compiled graphs + memory plans, the tokenizer, repacked weights,
                                 per model and run setup
      tune/                      tuned kernel configurations, per device (backends/cuda/tuning.py)
      triton/                    compiled Triton kernels (TRITON_CACHE_DIR, set by the cuda backend)

A program key hashes everything the artifacts depend on: the model file's content fingerprint,
the engine's version and source, the backend and device, the context size and the prefill chunk.
A changed file, engine, device or context is a different key, so a stale entry is never read.

Every artifact is one file: a header (magic, format, payload length, BLAKE2b digest of the
payload) then the payload. Writers write a temporary file beside it and rename it into place, so
concurrent loads each see a whole file or none; a reader checks length and digest and treats a
truncated or corrupt file as absent (it is removed and written anew). Large numeric artifacts
(a backend's repacked weights) are named arrays mapped back from the file without a copy
(put_arrays / get_arrays), checked with a digest computed in parallel. After each write the cache
is trimmed to its size bound (EDGELLM_CACHE_MAX_BYTES, default 8 GiB), least recently used
program entries first.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import shutil
import struct
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

MAGIC = b"EDGELLMC"
ARRAYS_MAGIC = b"EDGELLMA"  # an artifact of named arrays, memory-mapped by readers (put_arrays)
_ALIGN = 64
FORMAT = 1
_HEADER = struct.Struct("<8sIQ32s")  # magic, format, payload bytes, blake2b-256 of the payload
DEFAULT_MAX_BYTES = 8 << 30


def cache_root() -> Path:
    """``$EDGELLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/edgellm``, else ``~/.cache/edgellm``."""
    if os.environ.get("EDGELLM_CACHE_DIR"):
        return Path(os.environ["EDGELLM_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "edgellm"
    return Path.home() / ".cache" / "edgellm"


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels for edgellm: $TRITON_CACHE_DIR, else `triton/` in the
    engine's cache (the cuda backend sets the variable to it, so `edgellm cache` covers them)."""
    return os.environ.get("TRITON_CACHE_DIR") or str(cache_root() / "triton")


def enabled() -> bool:
    return os.environ.get("EDGELLM_CACHE", "1") != "0"


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


_CHUNK = 8 << 20


def _tree_digest(data) -> bytes:
    """SHA-256 over the SHA-256 digests of the payload's 8 MiB chunks, the chunks hashed on
    threads (hashlib releases the GIL): checking a 120 MiB weights artifact costs ~40 ms on 2
    cores, where one BLAKE2b pass costs ~130 ms of a load budgeted in seconds."""
    view = memoryview(data).cast("B")
    chunks = [view[i:i + _CHUNK] for i in range(0, len(view), _CHUNK)] or [view]
    if len(chunks) == 1:
        parts = [hashlib.sha256(chunks[0]).digest()]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(len(chunks), os.cpu_count() or 1)) as pool:
            parts = list(pool.map(lambda c: hashlib.sha256(c).digest(), chunks))
    return hashlib.sha256(b"".join(parts)).digest()


def write_text_atomic(path: str | os.PathLike, text: str) -> bool:
    """Write a small file whole: to a temporary name of this process, then renamed over `path`, so
    a reader never sees half of it. False (nothing written) where the folder cannot be written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def file_fingerprint(path: str | os.PathLike) -> str:
    """A content fingerprint of a model file, cheap enough for every load: BLAKE2b over its size,
    its first 8 MiB (the GGUF header: every key and tensor description), 64 evenly spaced 64 KiB
    samples of the weights and its last 1 MiB. Any re-quantization or re-export changes it; an edit
    of a few bytes inside a weight between samples would not (say `edgellm cache clear` then)."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=20)
    h.update(struct.pack("<Q", size))
    with open(path, "rb") as f:
        h.update(f.read(8 << 20))
        if size > (8 << 20):
            step = max((size - (8 << 20)) // 64, 1)
            for i in range(64):
                f.seek((8 << 20) + i * step)
                h.update(f.read(64 << 10))
            f.seek(max(size - (1 << 20), 0))
            h.update(f.read())
    return h.hexdigest()


@lru_cache(maxsize=1)
def engine_fingerprint() -> str:
    """The engine's version and a digest of its own source: a changed compiler or kernel makes
    every program entry stale, released version or not."""
    from . import __version__

    h = hashlib.blake2b(digest_size=12)
    h.update(__version__.encode())
    pkg = Path(__file__).parent
    for p in sorted(pkg.rglob("*.py")):
        h.update(str(p.relative_to(pkg)).encode())
        h.update(p.read_bytes())
    return f"{__version__}+{h.hexdigest()}"


def program_key(**fields) -> str:
    """The entry name for a load's setup (model fingerprint, backend, device, ctx, ...)."""
    fields = {**fields, "engine": engine_fingerprint(), "format": FORMAT}
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=16).hexdigest()


class ProgramCache:
    def __init__(self, root: str | os.PathLike | None = None, max_bytes: int | None = None):
        self.root = Path(root) if root is not None else cache_root()
        self.max_bytes = max_bytes if max_bytes is not None else int(
            os.environ.get("EDGELLM_CACHE_MAX_BYTES", DEFAULT_MAX_BYTES))
        self.programs = self.root / "programs"

    # -- artifacts ---------------------------------------------------------------------------------
    def get(self, key: str, name: str) -> bytes | None:
        """The artifact's payload, or None when it is absent, truncated or corrupt (then removed)."""
        path = self.programs / key / name
        try:
            data = path.read_bytes()
        except OSError:
            return None
        ok = len(data) >= _HEADER.size
        if ok:
            magic, fmt, n, digest = _HEADER.unpack_from(data)
            payload = data[_HEADER.size:]
            ok = magic == MAGIC and fmt == FORMAT and n == len(payload) and _digest(payload) == digest
        if not ok:
            try:
                path.unlink()
            except OSError:
                pass
            return None
        try:
            os.utime(path.parent)  # the entry's last use, for trimming
        except OSError:
            pass
        return payload

    def put(self, key: str, name: str, payload: bytes) -> None:
        """Write an artifact atomically; a failure to write (read-only or full disk) is not an
        error of the load that asked, so it is ignored."""
        d = self.programs / key
        tmp = d / f".{name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        try:
            d.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, FORMAT, len(payload), _digest(payload)))
                f.write(payload)
            os.replace(tmp, d / name)
        except OSError:
            tmp.unlink(missing_ok=True)
            return
        self.trim()

    def get_json(self, key: str, name: str):
        payload = self.get(key, name)
        if payload is None:
            return None
        try:
            return json.loads(payload)
        except ValueError:
            return None

    def put_json(self, key: str, name: str, value) -> None:
        self.put(key, name, json.dumps(value, separators=(",", ":")).encode())

    # -- array artifacts (memory-mapped) ---------------------------------------------------------
    def put_arrays(self, key: str, name: str, arrays: dict, meta=None) -> None:
        """Write named numpy arrays (and a JSON-able meta value) as one artifact that get_arrays
        maps back without copying. Same framing as put (header with length and digest, temporary
        file renamed into place), its own magic, and a digest made for size (_tree_digest)."""
        index, offset = {}, 0
        for n, a in arrays.items():
            offset = -(-offset // _ALIGN) * _ALIGN
            index[n] = [a.dtype.str, list(a.shape), offset]
            offset += a.nbytes
        head = json.dumps({"meta": meta, "arrays": index}, separators=(",", ":")).encode()
        start = -(-(_HEADER.size + 8 + len(head)) // _ALIGN) * _ALIGN  # array offsets count from here
        total = start + offset
        d = self.programs / key
        tmp = d / f".{name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        try:
            d.mkdir(parents=True, exist_ok=True)
            # the arrays go straight to the file (no second copy of them in memory); the digest is
            # taken from the written file, then the header written in front
            with open(tmp, "w+b") as f:
                f.truncate(total)
                f.seek(_HEADER.size)
                f.write(struct.pack("<Q", len(head)) + head)
                for n, a in arrays.items():
                    f.seek(start + index[n][2])
                    f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
                f.flush()
                with mmap.mmap(f.fileno(), total, access=mmap.ACCESS_READ) as mm:
                    digest = _tree_digest(memoryview(mm)[_HEADER.size:])
                f.seek(0)
                f.write(_HEADER.pack(ARRAYS_MAGIC, FORMAT, total - _HEADER.size, digest))
            os.replace(tmp, d / name)
        except (OSError, ValueError, BufferError):
            tmp.unlink(missing_ok=True)
            return
        self.trim()

    def get_arrays(self, key: str, name: str):
        """(meta, {name: array}) of an artifact put_arrays wrote, the arrays mapped copy-on-write
        from the file (writable, the file never changes); None when absent, truncated or corrupt
        (then removed)."""
        path = self.programs / key / name
        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):  # absent, or empty (an empty file cannot be mapped)
            return self._drop(path)
        try:
            magic, fmt, n, digest = _HEADER.unpack_from(mm)
            payload = memoryview(mm)[_HEADER.size:]
            if not (magic == ARRAYS_MAGIC and fmt == FORMAT and n == len(payload) and _tree_digest(payload) == digest):
                return self._drop(path)
            (hn,) = struct.unpack_from("<Q", payload)
            head = json.loads(bytes(payload[8:8 + hn]))
            start = -(-(_HEADER.size + 8 + hn) // _ALIGN) * _ALIGN
            arrays = {}
            for k, (dt, shape, off) in head["arrays"].items():
                dt = np.dtype(dt)
                arrays[k] = np.frombuffer(mm, dtype=dt, count=math.prod(shape), offset=start + off).reshape(shape)
        except (struct.error, ValueError, TypeError, KeyError):
            return self._drop(path)
        try:
            os.utime(path.parent)
        except OSError:
            pass
        return head["meta"], arrays

    @staticmethod
    def _drop(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass
        return None

    # -- housekeeping ------------------------------------------------------------------------------
    def entries(self) -> list[tuple[Path, int, float]]:
        """(entry folder, bytes, last use) of every program entry, least recently used first."""
        out = []
        if self.programs.is_dir():
            for d in self.programs.iterdir():
                if d.is_dir():
                    size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
                    out.append((d, size, d.stat().st_mtime))
        return sorted(out, key=lambda e: e[2])

    def trim(self) -> None:
        entries = self.entries()
        total = sum(e[1] for e in entries)
        for d, size, _ in entries:
            if total <= self.max_bytes:
                break
            shutil.rmtree(d, ignore_errors=True)
            total -= size

    def info(self) -> dict:
        def tree_bytes(p: Path) -> tuple[int, int]:
            files = [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else []
            return len(files), sum(f.stat().st_size for f in files)

        entries = self.entries()
        parts = {"programs": (len(entries), sum(e[1] for e in entries))}
        images = [f for f in self.programs.glob("*/replay") if f.is_file()] if self.programs.is_dir() else []
        parts["images"] = (len(images), sum(f.stat().st_size for f in images))  # within "programs"
        for sub in ("tune", "triton"):
            parts[sub] = tree_bytes(self.root / sub)
        return {"root": str(self.root), "max_bytes": self.max_bytes, "enabled": enabled(),
                "parts": {k: {"items": n, "bytes": b} for k, (n, b) in parts.items()}}

    def clear(self) -> int:
        """Remove everything under the cache root that edgellm put there; returns bytes freed."""
        freed = 0
        for sub in ("programs", "tune", "triton"):
            p = self.root / sub
            if p.is_dir():
                freed += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                shutil.rmtree(p, ignore_errors=True)
        return freed
