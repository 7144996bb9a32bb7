"""The machine: device names, peak memory bandwidth (measured once per device and cached), versions."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edgellm"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def device_name(backend: str) -> str:
    """A stable name for the device a backend runs on (the key of the bandwidth cache)."""
    if backend == "cuda":
        import torch

        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"{cpu_name()} x{cpu_count()}"


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    line = out.stdout.strip().splitlines()
    return line[0].strip() if out.returncode == 0 and line else None


def nvidia_gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    line = out.stdout.strip().splitlines()
    return line[0].strip() if out.returncode == 0 and line else None


def measure_copy_bandwidth(backend: str, nbytes: int | None = None, repeats: int = 7) -> float:
    """Peak memory bandwidth in bytes/s: the best of `repeats` torch tensor copies of nbytes
    (bytes read + bytes written, as the anchors count it), after one warm-up copy."""
    import torch

    dev = torch.device("cuda" if backend == "cuda" else "cpu")
    if nbytes is None:
        nbytes = (1 << 30) if dev.type == "cuda" else (256 << 20)
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dst.copy_(src)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / best


def peak_bandwidth(backend: str, cache_file: Path | None = None) -> dict:
    """{'device', 'bytes_per_s', 'source'}: from the per-device cache, else measured and cached."""
    cache_file = cache_file or cache_root() / "bench" / "peak_bandwidth.json"
    name = device_name(backend)
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(name)
    if isinstance(entry, dict) and isinstance(entry.get("bytes_per_s"), (int, float)) and entry["bytes_per_s"] > 0:
        return {"device": name, "bytes_per_s": float(entry["bytes_per_s"]), "source": f"cache ({cache_file})",
                "measured_at": entry.get("measured_at")}
    bw = measure_copy_bandwidth(backend)
    when = time.strftime("%Y-%m-%dT%H:%M:%S")
    cached[name] = {"bytes_per_s": bw, "measured_at": when, "method": "torch copy_, read + write, best of 7"}
    from ..cache import write_text_atomic

    write_text_atomic(cache_file, json.dumps(cached, indent=1))  # unwritable: a re-measurement next time
    return {"device": name, "bytes_per_s": bw, "source": "measured", "measured_at": when}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("edgellm", "torch", "triton", "numpy", "gguf", "transformers", "llama_cpp_python"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    if out["edgellm"] is None:
        from .. import __version__

        out["edgellm"] = __version__
    return out


def _git(args: list[str], where: Path | None) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=where or Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit(where: Path | None = None) -> str | None:
    """The commit of the edgellm source tree, when it is a git checkout (read-only query)."""
    return _git(["rev-parse", "HEAD"], where) or None


def git_dirty(where: Path | None = None) -> bool | None:
    """Whether tracked files differ from that commit (the results then are not of the commit alone)."""
    out = _git(["status", "--porcelain", "--untracked-files=no"], where)
    return None if out is None else bool(out)


def host_info() -> dict:
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu_name(),
            "cpu_count": cpu_count(), "python_executable": sys.executable}
