"""CUDA graph capture with Python's cyclic garbage collector kept out of it.

torch.cuda.graph captures in the "global" mode: while a capture is open, any thread's CUDA call
that is not allowed during a capture (freeing another graph's executable, a synchronizing copy,
...) invalidates it. Models hold reference cycles, so a model no longer used is freed by the
cyclic collector, at whatever allocation triggers it, on whatever thread makes that allocation.
A collection running on another thread while a capture is open frees the old model's CUDA graphs
mid-capture ("operation not permitted when stream is capturing (function reset)", then
"operation failed due to a previous error during capture"); torch's own capture no longer runs
the collector first.

`captured(graph)` is torch.cuda.graph(graph) with the collector out of the way: automatic
collection is switched off for the capture (process-wide, so no thread starts one), and a
collection already running on another thread is waited for first. For the wait, a callback on
every collection (gc.callbacks, installed at the first capture) holds a lock from its start to
its end; the capture holds the same lock, so a collection that starts anyway (an explicit
gc.collect() on another thread) waits for the capture to end.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_quiet = threading.RLock()  # held by a collection in progress, and by an open capture
_installed = False
_install_lock = threading.Lock()


def _on_collection(phase: str, info: dict) -> None:
    if phase == "start":
        _quiet.acquire()
    elif phase == "stop":
        _quiet.release()


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            gc.callbacks.append(_on_collection)
            _installed = True


@contextlib.contextmanager
def captured(graph, **kwargs) -> Iterator[None]:
    import torch

    _install()
    was = gc.isenabled()
    gc.disable()
    try:
        with _quiet, torch.cuda.graph(graph, **kwargs):
            yield
    finally:
        if was:
            gc.enable()
