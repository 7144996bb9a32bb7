"""edgellm's native CPU kernels (cpu_native.c: decode-step products of Q8_0, Q4_0 and Q4_1 weights
read from the file's own blocks): built at first use with the system's C compiler for
the machine it runs on, kept in the engine cache, called through ctypes.

The library is linked against the OpenMP runtime this process already has (torch's), found in
/proc/self/maps, so its parallel loops and torch's share one pool of threads instead of two pools
spinning against each other. Where there is no C compiler, no Linux, or the build fails, `library()`
returns None with the reason in `unavailable()`, and the callers keep torch's kernels.
EDGELLM_NATIVE=0 turns the native kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).with_name("cpu_native.c")
FLAGS = ["-O3", "-march=native", "-fPIC", "-fopenmp"]
# extra compiler flags (e.g. -DPREFETCH_BYTES=512 -DROWS_PER_TASK=32: the source's tunables), part of the build's key
EXTRA = os.environ.get("EDGELLM_NATIVE_CFLAGS", "").split()

_lock = threading.Lock()
_state: dict = {}


def _openmp_runtime() -> str | None:
    """The OpenMP runtime file torch loaded into this process (None: torch was built without one)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                name = os.path.basename(path)
                if name.startswith(("libgomp", "libiomp5", "libomp")) and ".so" in name:
                    return path
    except OSError:
        pass
    return None


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    return shutil.which(cc) if cc else (shutil.which("cc") or shutil.which("gcc"))


def _build(cc: str, omp: str, out: Path, extra: list[str]) -> None:
    """Compile into a temporary file beside `out`, then rename: a concurrent build or a reader
    never sees a partial library."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        # compiled with -fopenmp, but linked (without it) to the runtime torch loaded, by path,
        # instead of the compiler's default one
        obj = tmp[:-3] + ".o"
        for cmd in ([cc, *FLAGS, *extra, "-c", str(SOURCE), "-o", obj],
                    [cc, "-shared", obj, omp, f"-Wl,-rpath,{os.path.dirname(omp)}", "-lm", "-o", tmp]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd[:2])} ... failed on {SOURCE.name}: {r.stderr.strip()[-400:]}")
        os.replace(tmp, out)
    finally:
        for f in (tmp, tmp[:-3] + ".o"):
            if os.path.exists(f):
                os.unlink(f)


def _library_path(extra: list[str] | None = None) -> tuple[Path, str, str]:
    """Where this machine's build lives in the engine cache (keyed by the source, flags, compiler,
    OpenMP runtime, CPU features and Python), with the compiler and runtime it is built with.
    extra: compiler flags beyond FLAGS (default: EDGELLM_NATIVE_CFLAGS)."""
    extra = EXTRA if extra is None else extra
    if os.environ.get("EDGELLM_NATIVE", "1") == "0":
        raise RuntimeError("turned off (EDGELLM_NATIVE=0)")
    if platform.system() != "Linux":
        raise RuntimeError(f"built only on Linux (this is {platform.system()})")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    omp = _openmp_runtime()
    if omp is None:
        raise RuntimeError("torch has no OpenMP runtime loaded to share")
    from ..cache import cache_root

    ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    with open("/proc/cpuinfo") as f:  # -march=native: one build per kind of CPU
        cpu = next((ln for ln in f if ln.startswith("flags")), "")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS + extra), ver, omp, cpu, sys.version]).encode()).hexdigest()[:24]
    return cache_root() / "native" / f"cpu_native-{key}.so", cc, omp


def _load(extra: list[str] | None = None) -> ctypes.CDLL:
    extra = EXTRA if extra is None else extra
    out, cc, omp = _library_path(extra)
    if not out.exists():
        _build(cc, omp, out, extra)
    try:
        lib = ctypes.CDLL(str(out))
    except OSError:  # a damaged file in the cache: built again (a new file; the old one replaced)
        _build(cc, omp, out, extra)
        lib = ctypes.CDLL(str(out))
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.edgellm_q8_0_matmul.argtypes = [p, p, i64, i64, p, i64, p, p, p, c_int]
    lib.edgellm_q8_0_matmul.restype = None
    lib.edgellm_q4_matmul.argtypes = [p, p, i64, i64, c_int, p, i64, p, p, p, p, c_int]
    lib.edgellm_q4_matmul.restype = None
    lib.edgellm_quantize_q8.argtypes = [p, i64, i64, p, p, p]
    lib.edgellm_quantize_q8.restype = None
    lib.edgellm_step.argtypes = [p, i64, i64, i64, p, p, p, p, p, c_int, p]
    lib.edgellm_step.restype = None
    return lib


def variant(extra: list[str]) -> ctypes.CDLL:
    """A build with other compiler flags (benchmarks/native_probe.py compares them)."""
    return _load(extra)


def library() -> ctypes.CDLL | None:
    """The native library, built and loaded once per process; None where it cannot be."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"], _state["why"] = _load(), None
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                _state["lib"], _state["why"] = None, str(e)
        return _state["lib"]


def unavailable() -> str | None:
    """Why the native kernels are not used here (None when they are)."""
    library()
    return _state["why"]


# the formats the kernels read: bytes per block of 32 weights, and the 4-bit formats' offset kind
FORMATS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


class NativeRows:
    """A quantized matrix (FORMATS) as the native kernels read it: one or more parts stacked by
    rows, each a [rows, k/32 * block bytes] uint8 array of the file's blocks (memory-mapped views
    are kept as they are, nothing is copied)."""

    def __init__(self, parts: list[np.ndarray], k: int, fmt: str = "Q8_0", lib: ctypes.CDLL | None = None):
        if fmt not in FORMATS or k % 32:
            raise ValueError(f"native product: {fmt} with rows of {k} (known: {', '.join(FORMATS)}; k a multiple of 32)")
        self.k, self.fmt = k, fmt
        self.parts = [np.ascontiguousarray(p).view(np.uint8).reshape(p.shape[0], -1) for p in parts]
        for p in self.parts:
            if p.shape[1] != k // 32 * FORMATS[fmt]:
                raise ValueError(f"{fmt} rows of {p.shape[1]} bytes for k = {k}")
        self.n = sum(p.shape[0] for p in self.parts)
        self._ptrs = (ctypes.c_void_p * len(self.parts))(*[p.ctypes.data for p in self.parts])
        self._rows = (ctypes.c_int64 * len(self.parts))(*[p.shape[0] for p in self.parts])
        self._lib = lib or library()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x float32 [m, k] -> float32 [m, n] (into `out` when given: contiguous float32 [m, n])."""
        x = x.contiguous()
        if x.dtype != torch.float32:
            x = x.float()
        m = x.shape[0]
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"native {self.fmt} product: input of shape {tuple(x.shape)}, expected [m, {self.k}]")
        y = torch.empty((m, self.n), dtype=torch.float32) if out is None else out
        if y.shape != (m, self.n) or y.dtype != torch.float32 or not y.is_contiguous():
            raise ValueError(f"native {self.fmt} product: out of shape {tuple(y.shape)} {y.dtype}, expected contiguous float32 [{m}, {self.n}]")
        xq = torch.empty((m, self.k), dtype=torch.int8)
        xd = torch.empty((m, self.k // 32), dtype=torch.float32)
        threads = torch.get_num_threads()
        if self.fmt == "Q8_0":
            self._lib.edgellm_q8_0_matmul(self._ptrs, self._rows, len(self.parts), self.k, x.data_ptr(), m,
                                          y.data_ptr(), xq.data_ptr(), xd.data_ptr(), threads)
        else:
            xs = torch.empty((m, self.k // 32), dtype=torch.float32)
            self._lib.edgellm_q4_matmul(self._ptrs, self._rows, len(self.parts), self.k, int(self.fmt == "Q4_1"),
                                        x.data_ptr(), m, y.data_ptr(), xq.data_ptr(), xd.data_ptr(), xs.data_ptr(),
                                        threads)
        return y
