"""Stand-in engines for testing the benchmark harness itself (not models): use them as
`--engine edgellm.bench.stubs:ToyEngine` and so on. None of them imports torch.

  ToyEngine     a fixed-logits "model": logits at a position depend only on the token there
  CrashEngine   the process dies (os._exit(3)) while loading, like a native crash
  RaiseEngine   loading raises an exception
  SleepEngine   loading sleeps for an hour (for --timeout)
  OOMEngine     loading raises MemoryError
  PreloadEngine asks the child to import 'edgellm_preload_probe' first (a module the test puts
                on PYTHONPATH) and reports, in info(), the packages loaded before it
  MissingPreloadEngine  the same with a preload module that does not exist
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np

from .engines import Engine


class ToyEngine(Engine):
    """Logits at a position depend only on the token there: every row is the base pattern
    0.25 * (k % 8) over the vocabulary, plus 2 at the token that follows the input ((t + 1) % V)."""

    name = "toy"
    backends = ("cpu",)

    def __init__(self, threads: int | None = None, vocab: int | None = None):
        super().__init__(threads)
        self.vocab = vocab

    def load(self, model_path: str, backend: str, ctx: int) -> None:
        self.backend, self.ctx = backend, ctx
        if self.vocab is None:  # the vocabulary of the file, so real token ids fit
            from ..gguf_file import open_gguf

            f = open_gguf(model_path)
            tokens = f.get("tokenizer.ggml.tokens", None)
            self.vocab = len(tokens) if tokens else 8
        self._last = None

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        out = np.tile((np.arange(self.vocab) % 8).astype(np.float32) * 0.25, (len(ids), 1))
        out[np.arange(len(ids)), (ids + 1) % self.vocab] += 2.0
        return out

    def prefill(self, ids: Sequence[int]) -> None:
        self._last = self.logits(ids)[-1]

    def next_token(self) -> int:
        return int(np.argmax(self._last))

    def decode(self, n: int) -> None:
        tok = 0
        for _ in range(n):
            tok = int(np.argmax(self.logits([tok])[0]))

    def vocab_size(self) -> int:
        return self.vocab

    def kv_bytes_per_element(self) -> float | None:
        return 4.0


class CrashEngine(ToyEngine):
    name = "crash"

    def load(self, model_path: str, backend: str, ctx: int) -> None:
        os._exit(3)


class RaiseEngine(ToyEngine):
    name = "raise"

    def load(self, model_path: str, backend: str, ctx: int) -> None:
        raise RuntimeError("RaiseEngine always fails to load")


class SleepEngine(ToyEngine):
    name = "sleep"

    def load(self, model_path: str, backend: str, ctx: int) -> None:
        time.sleep(3600)


class OOMEngine(ToyEngine):
    name = "oom"

    def load(self, model_path: str, backend: str, ctx: int) -> None:
        raise MemoryError("OOMEngine: simulated out of memory")


class PreloadEngine(ToyEngine):
    name = "preload"
    preload = ("edgellm_preload_probe",)

    def info(self) -> dict:
        import importlib

        d = super().info()
        d["loaded_before_preload"] = getattr(importlib.import_module(self.preload[0]), "LOADED", None)
        return d


class MissingPreloadEngine(PreloadEngine):
    preload = ("no_such_module_for_edgellm",)
