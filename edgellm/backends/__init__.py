"""Backends execute graphs. Each registers a name; `auto` picks the fastest available."""

from __future__ import annotations

from ..errors import BackendUnavailableError

BACKENDS = ("cpu", "cpu-fast", "cuda", "webgpu")


def _auto() -> str:
    """cuda when a GPU and triton are there, else webgpu on a hardware adapter, else cpu-fast (the
    float32 `cpu` is the reference). A software WebGPU adapter (lavapipe) is never picked: it is
    slower than the cpu backends."""
    from .cuda.backend import CudaBackend

    if CudaBackend.available():
        return "cuda"
    from .webgpu.device import hardware_adapter_available

    return "webgpu" if hardware_adapter_available() else "cpu-fast"


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
    if name == "webgpu":
        return info.WebgpuInfo
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
    if name == "webgpu":
        from .webgpu.backend import WebgpuBackend

        return WebgpuBackend
    raise BackendUnavailableError(f"unknown backend '{name}' (available: {', '.join(BACKENDS)}, auto)")
