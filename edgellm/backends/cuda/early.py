"""The GPU's context made while Python is still importing.

The first CUDA call of a process makes the driver initialise and create the device's primary
context: 0.3-0.45 s on the H100 host (2026-11-26, docs/benchmarks.md), spent inside torch's lazy
initialisation with the GIL held, after `import torch` (1.2-2.5 s there) has finished. The driver
does the same work when asked through its C API directly, and ctypes releases the GIL around a
foreign call, so a thread started before torch is imported creates the context while the main
thread imports: torch's runtime later finds the primary context already made and binds it.

Torch-free on purpose (ctypes and the standard library only): the caller starts it before the
first `import torch`. Only where one GPU is visible (the runtime's device 0 and the driver's
ordinal 0 are then the same device); elsewhere, and where there is no driver, it does nothing.
EDGELLM_EARLY_CONTEXT=0 turns it off.
"""

from __future__ import annotations

import ctypes
import os
import threading

_thread: threading.Thread | None = None
_result: dict = {}


def _create() -> None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        _result["skipped"] = "no CUDA driver"
        return
    count, dev, ctx = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_void_p()
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        _result["skipped"] = "the driver did not initialise"
        return
    if count.value != 1:
        _result["skipped"] = f"{count.value} devices visible"
        return
    if lib.cuDeviceGet(ctypes.byref(dev), 0) != 0 or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
        _result["skipped"] = "no primary context"
        return
    _result["context"] = ctx.value  # retained for the process's life, as the runtime's own


def start_context() -> bool:
    """Start creating the GPU's primary context on a daemon thread; True when started (once per
    process). Does not wait: the runtime's first call waits in the driver if it is still going."""
    global _thread
    if _thread is not None or os.environ.get("EDGELLM_EARLY_CONTEXT", "1") == "0":
        return False
    if os.environ.get("EDGELLM_CUDA_DEVICE", "cuda") != "cuda":  # a chosen device (or the interpreter's cpu)
        return False
    _thread = threading.Thread(target=_create, name="edgellm-cuda-context", daemon=True)
    _thread.start()
    return True


def start_for(backend) -> bool:
    """start_context() when `backend` (a name) may run on the cuda backend: 'cuda' or 'auto'."""
    return backend in ("cuda", "auto") and start_context()


def outcome(timeout: float | None = None) -> dict:
    """What the thread did ({'context': handle} or {'skipped': reason}); {} if not started or not done."""
    if _thread is not None:
        _thread.join(timeout)
    return dict(_result)
