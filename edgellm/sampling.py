"""Token sampling from next-token logits, in llama.cpp's order:
repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw (greedy when temperature <= 0)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import EdgeLLMError


class SamplingError(EdgeLLMError, ValueError):
    """A sampling parameter is out of range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        checks = [
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_k", self.top_k >= 0, ">= 0 (0 disables)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p < 1, "in [0, 1)"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("repeat_last_n", self.repeat_last_n >= 0, ">= 0"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise SamplingError(f"sampling parameter {name}={getattr(self, name)!r} must be {want}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        p = self.params
        x = np.asarray(logits, dtype=np.float64).copy()
        if p.repetition_penalty != 1.0 and history and p.repeat_last_n:
            ids = np.unique(np.asarray(history[-p.repeat_last_n :], dtype=np.int64))
            v = x[ids]
            x[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if p.greedy:
            return int(np.argmax(x))
        ids = np.argsort(-x, kind="stable")
        if p.top_k and p.top_k < len(ids):
            ids = ids[: p.top_k]
        vals = x[ids]
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, vals, probs = ids[:keep], vals[:keep], probs[:keep]
        if p.min_p > 0:
            keep = probs >= p.min_p * probs[0]
            ids, vals = ids[keep], vals[keep]
        scaled = (vals - vals[0]) / p.temperature
        w = np.exp(scaled)
        return int(ids[self.rng.choice(len(ids), p=w / w.sum())])
