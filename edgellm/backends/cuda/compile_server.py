"""The compile server: Triton compiles for a loading process, in forked worker processes.

    python -m edgellm.backends.cuda.compile_server WORKERS

Started by precompile.py (its `_Server`), never by a user. It imports Triton and the cuda kernel
modules once, forks WORKERS workers (this process is fresh and single-threaded when it forks, and
never touches a GPU), prints `{"ready": true}` and then reads one JSON request a line from stdin:
`{"id": N, "args": [module, qualname, fn_cache_key, specialization_data, target]}`. Each is
compiled by a worker (precompile.compile_in_worker: into Triton's on-disk cache, under the key the
loading process computes, with the launcher built beside it), and answered on stdout as
`{"id": N, "ok": true, "seconds": S, "launcher_s": L}` (L: the launcher's part of S) or
`{"id": N, "ok": false, "error": "..."}`, in the order they finish. End of stdin (the loading
process closed it, or exited) lets the workers go.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import threading
from concurrent.futures import ProcessPoolExecutor


def _warm() -> None:
    """What every worker inherits: Triton, the kernel modules, the remembered Triton key."""
    import importlib
    import pkgutil

    import triton  # noqa: F401 - imported before the fork, once

    from . import kernels

    for m in pkgutil.iter_modules(kernels.__path__):
        if m.name != "compile_check":
            importlib.import_module(f"{kernels.__name__}.{m.name}")
    try:
        from .triton_key import memoize_triton_key

        memoize_triton_key()
    except Exception:  # noqa: BLE001 - Triton's own key then: slower, same value
        pass


def _worker_init() -> None:
    """In each worker: its stdout is not the answers' pipe (only the server writes there, so the
    loading process sees the pipe close when the server goes), and on Linux it ends with the server."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _pid() -> int:
    import os

    return os.getpid()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    workers = max(1, int(argv[0])) if argv else 1
    _warm()
    from .precompile import compile_in_worker

    out = sys.stdout
    lock = threading.Lock()

    def answer(msg: dict) -> None:
        with lock:
            out.write(json.dumps(msg) + "\n")
            out.flush()

    # fork: the workers are copies of this process with everything above imported (and the fork
    # context starts them all now, before the executor's own thread exists)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_worker_init) as pool:
        for f in [pool.submit(_pid) for _ in range(workers)]:
            f.result()
        answer({"ready": True})
        for line in sys.stdin:
            try:
                req = json.loads(line)
                ident, args = req["id"], req["args"]
            except (ValueError, KeyError, TypeError):
                continue

            def done(f, ident=ident):
                try:
                    answer({"id": ident, "ok": True, **f.result()})
                except BaseException as e:  # noqa: BLE001 - reported to the loading process, which compiles it itself
                    answer({"id": ident, "ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"})

            pool.submit(compile_in_worker, *args).add_done_callback(done)
        pool.shutdown(wait=False, cancel_futures=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
