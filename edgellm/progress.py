"""Say on stderr that something slow is happening, only when it turns out to be slow."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator


@contextlib.contextmanager
def slow_notice(message: str, *, after: float = 1.0, stream=None) -> Iterator[None]:
    """Within the block, if it has not finished after `after` seconds, show `message` on stderr:
    a spinner with the elapsed time on a terminal, one plain line otherwise. Nothing is shown for a
    block that finishes in time (a warm start stays silent)."""
    stream = stream if stream is not None else sys.stderr
    done = threading.Event()
    tty = hasattr(stream, "isatty") and stream.isatty()

    def watch() -> None:
        if done.wait(after):
            return
        if not tty:
            print(f"edgellm: {message} ...", file=stream, flush=True)
            return
        from rich.console import Console

        console = Console(file=stream, stderr=True)
        t0 = time.perf_counter() - after
        with console.status(message) as status:
            while not done.wait(0.1):
                status.update(f"{message} ({time.perf_counter() - t0:.0f} s)")

    t = threading.Thread(target=watch, name="edgellm-slow-notice", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
