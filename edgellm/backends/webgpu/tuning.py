"""Launch configurations of the decode GEMV: defaults per adapter, and (EDGELLM_TUNE=1) the
fastest of a few candidates timed on the adapter, cached on disk per adapter with the cuda
backend's Tuner (edgellm/backends/cuda/tuning.py: one JSON file per device string)."""

from __future__ import annotations

import os

from .device import Device


def default_gemv_config(dev: Device) -> dict:
    """Threads per output feature (TPR) as one subgroup's share where the adapter has subgroups
    (the reduction is then register shuffles), else 32 threads reducing in workgroup memory.
    On a software adapter, 2 threads per feature: lavapipe runs a workgroup barrier as a switch
    between all its SIMD batches, and fewer threads per feature mean fewer reduction steps
    (1536x576 Q8_0 GEMV, 2 cores: 32 threads per feature with barriers 14.8 ms, 2 per feature 0.9 ms)."""
    wg = 128
    if dev.info.software:
        return {"wg": 64, "rows_per_wg": 32, "subgroup": dev.has_subgroups}
    if dev.has_subgroups:
        tpr = min(32, dev.info.subgroup_min)
        return {"wg": wg, "rows_per_wg": wg // tpr, "subgroup": True}
    return {"wg": wg, "rows_per_wg": 4, "subgroup": False}


def gemv_candidates(dev: Device) -> list[dict]:
    out = []
    for wg in (64, 128, 256):
        for tpr in (4, 8, 16, 32, 64):
            if tpr > wg:
                continue
            sub = dev.has_subgroups and tpr <= dev.info.subgroup_min
            out.append({"wg": wg, "rows_per_wg": wg // tpr, "subgroup": sub})
    return out


_TUNED: dict[tuple, dict] = {}


def gemv_config(dev: Device, fmt: str, n_out: int, n_in: int) -> dict:
    """The configuration for one weight shape: the default, or with EDGELLM_TUNE=1 a cached or
    newly timed pick (see benchmarks/bench_webgpu.py, which times candidates with timestamp
    queries where the adapter has them)."""
    if os.environ.get("EDGELLM_TUNE", "0") != "1":
        return default_gemv_config(dev)
    key = (fmt, n_out, n_in)
    if key not in _TUNED:
        _TUNED[key] = _tuner(dev).cached("webgpu_gemv", key) or default_gemv_config(dev)
    return _TUNED[key]


def _tuner(dev: Device):
    from ..cuda.tuning import Tuner

    return Tuner("webgpu|" + dev.info.key(), enabled=True)
