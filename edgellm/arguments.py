"""Command-line argument checking shared by every subcommand: argparse `type=` validators (so a bad
value is reported before anything loads), llama-cli style escapes in text options, the thread
count default, and a parser whose errors are one line.

Subcommand modules import from here, never from cli.py (data flows one way)."""

from __future__ import annotations

import argparse
import os
import re


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit status 1, as every other edgellm error."""

    def error(self, message: str):
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# -- numbers -----------------------------------------------------------------------------------------
def _number(kind, text: str):
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"'{text}' is not {what}") from None


def at_least(lo, kind=int):
    """type=: a number >= lo."""
    def check(text: str):
        v = _number(kind, text)
        if not v >= lo:  # also rejects nan
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {text}")
        return v
    check.__name__ = f"{kind.__name__} >= {lo}"
    return check


def positive(kind=int):
    """type=: a number > 0."""
    def check(text: str):
        v = _number(kind, text)
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return v
    check.__name__ = f"positive {kind.__name__}"
    return check


def between(lo: float, hi: float):
    """type=: a float in [lo, hi]."""
    def check(text: str):
        v = _number(float, text)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo:g} and {hi:g}, got {text}")
        return v
    check.__name__ = f"float in [{lo:g}, {hi:g}]"
    return check


def byte_size(text: str) -> str:
    """type=: a size such as 6GiB, 512MiB or 1.5GB (checked here, kept as text)."""
    from .errors import EdgeLLMError
    from .hetero.solver import parse_bytes

    try:
        if parse_bytes(text) <= 0:
            raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text}")
    except EdgeLLMError:
        raise argparse.ArgumentTypeError(f"expected a size such as 6GiB or 512MiB, got '{text}'") from None
    return text


def backend_name(text: str) -> str:
    """type=: a registered backend name or auto (checked by name only: nothing is imported)."""
    from .backends import BACKENDS

    name = text.strip().lower()
    known = tuple(b for b in BACKENDS if b != "auto") + ("auto",)
    if name not in known:
        raise argparse.ArgumentTypeError(f"unknown backend '{text}' (known: {', '.join(known)})")
    return name


# -- text with escapes -------------------------------------------------------------------------------
_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "a": "\a", "b": "\b", "f": "\f",
           "v": "\v", "0": "\0", "e": "\x1b"}
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.S)


def unescape(text: str) -> str:
    """Interpret the escapes llama-cli interprets in prompts and stop strings: \\n \\t \\r \\\\ \\" \\'
    \\xHH, plus \\a \\b \\f \\v \\0 \\e \\uXXXX \\UXXXXXXXX. An unknown escape (\\d) and a lone trailing
    backslash stay as written, as in llama-cli; real control characters ($'\\n') pass through."""
    def sub(m: re.Match) -> str:
        e = m.group(1)
        if e[0] in "xuU" and len(e) > 1:
            cp = int(e[1:], 16)
            if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
                raise argparse.ArgumentTypeError(f"\\{e} is not a Unicode character")
            return chr(cp)
        return _SIMPLE.get(e, m.group(0))

    return _ESCAPE.sub(sub, text)


# -- threads -----------------------------------------------------------------------------------------
def physical_cores() -> int:
    """Physical cores this process may run on: psutil's physical count, at most the CPUs in the
    affinity mask (a container or taskset limit), at least 1. Hyper-threads share a core's FMA
    units, so one thread per physical core is what matrix code runs fastest with."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        allowed = os.cpu_count() or 1
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except ImportError:
        physical = None
    return max(1, min(physical or allowed, allowed))
