"""Backends execute graphs. Each registers a name; `auto` picks the fastest available."""

from __future__ import annotations

from ..errors import BackendUnavailableError

BACKENDS = ("cpu", "cpu-fast", "cuda")


def _auto() -> str:
    """cuda when a GPU and triton are there, else cpu-fast (the float32 `cpu` is the reference)."""
    from .cuda.backend import CudaBackend

    return "cuda" if CudaBackend.available() else "cpu-fast"


def get_backend_info(name: str):
    """The backend's static description (name, supported ops, memory sizing), importing no framework."""
    from . import info

    if name == "auto":
        name = _auto()
    if name == "cpu":
        return info.CpuInfo
    if name == "cpu-fast":
        return info.CpuFastInfo
    if name == "cuda":
        return info.CudaInfo
    raise BackendUnavailableError(f"unknown backend '{name}' (available: {', '.join(BACKENDS)}, auto)")


def get_backend(name: str):
    if name == "auto":
        name = _auto()
    if name == "cpu":
        from .cpu import CpuBackend

        return CpuBackend
    if name == "cpu-fast":
        from .cpu_fast import CpuFastBackend

        return CpuFastBackend
    if name == "cuda":
        from .cuda.backend import CudaBackend

        return CudaBackend
    raise BackendUnavailableError(f"unknown backend '{name}' (available: {', '.join(BACKENDS)}, auto)")
