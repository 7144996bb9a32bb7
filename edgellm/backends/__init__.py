"""Backends execute graphs. Each registers a name; `auto` picks the fastest available."""

from __future__ import annotations

from ..errors import BackendUnavailableError

BACKENDS = ("cpu",)


def get_backend_info(name: str):
    """The backend's static description (name, supported ops, memory sizing), importing no framework."""
    if name == "auto":
        name = "cpu"
    if name == "cpu":
        from .info import CpuInfo

        return CpuInfo
    raise BackendUnavailableError(f"unknown backend '{name}' (available: {', '.join(BACKENDS)}, auto)")


def get_backend(name: str):
    if name == "auto":
        name = "cpu"
    if name == "cpu":
        from .cpu import CpuBackend

        return CpuBackend
    raise BackendUnavailableError(f"unknown backend '{name}' (available: {', '.join(BACKENDS)}, auto)")
