"""Say on stderr that something slow is happening, only when it turns out to be slow."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator


@contextlib.contextmanager
def slow_notice(message: str, *, after: float = 1.0, stream=None) -> Iterator[None]:
    """Within the block, if it has not finished after `after` seconds, show `message` on stderr as
    a spinner with the elapsed time, cleared when the block ends. Only on a terminal: a pipe or a
    log gets nothing (scripts read stderr for errors). Nothing is shown for a block that finishes
    in time (a warm start stays silent)."""
    stream = stream if stream is not None else sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        yield
        return
    done = threading.Event()

    def watch() -> None:
        if done.wait(after):
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
