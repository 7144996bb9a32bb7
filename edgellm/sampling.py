"""Token sampling from next-token logits, in llama.cpp's order:
penalties -> top-k -> top-p -> min-p -> temperature -> draw (greedy when temperature <= 0).
The penalties, over the last repeat_last_n tokens of the history (prompt and answer), are llama.cpp's:
the repetition penalty divides a repeated token's positive logit (multiplies a negative one), then
the frequency penalty subtracts its count times frequency_penalty and the presence penalty
subtracts presence_penalty once (OpenAI's frequency_penalty and presence_penalty)."""

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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self):
        checks = [
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_k", self.top_k >= 0, ">= 0 (0 disables)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p < 1, "in [0, 1)"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("repeat_last_n", self.repeat_last_n >= 0, ">= 0"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise SamplingError(f"sampling parameter {name}={getattr(self, name)!r} must be {want}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalized(self) -> bool:
        """Whether the history changes the logits (a penalty over its last repeat_last_n tokens)."""
        return self.repeat_last_n > 0 and (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                                           or self.presence_penalty != 0.0)

    @property
    def chain_only(self) -> bool:
        """The draw depends on the logits alone (no penalty over the history): a backend that
        samples on the device can take it there (DeviceDraw)."""
        return not self.penalized


def device_sampling_enabled() -> bool:
    """Whether backends that can draw sampled tokens on their device do (EDGELLM_DEVICE_SAMPLING=0
    sends the logits to the host sampler instead, for comparisons)."""
    import os

    return os.environ.get("EDGELLM_DEVICE_SAMPLING", "1") != "0"


@dataclass(frozen=True)
class DeviceDraw:
    """A sequence's sampling as a backend that draws on the device takes it: the chain's parameters
    and a 63-bit seed for its random numbers (each token's draw keyed by the seed and the token's
    position). The seed comes from the sequence's Sampler (Sampler.device_draw), so a seeded
    request draws the same tokens on every run of the same backend; the device's numbers are not
    the host sampler's, so the tokens differ from those of a backend sampling on the host."""
    params: SamplingParams
    seed: int


def ranked_need(top_k, top_p, vocab: int) -> int:
    """How many ranked logits a device draw's cut needs for rows with these top_k and top_p values
    (host numbers): the largest top-k among rows that cut by rank, the whole vocabulary where a row
    cuts by top-p without a top-k, 0 where min-p alone (or nothing) cuts."""
    need = 0
    for k, p in zip(top_k, top_p):
        if 0 < k < vocab:
            need = max(need, int(k))
        elif p < 1.0:
            return vocab
    return need


# a device draw's per-row parameters, in the order and types the device kernels read them
DEVICE_DRAW_FIELDS = (("temperature", "float32"), ("top_k", "int64"), ("top_p", "float32"),
                      ("min_p", "float32"), ("seed", "int64"), ("cut", "float32"))


def device_draw_rows(draws: list, vocab: int) -> tuple[tuple | None, dict[str, list]]:
    """(plan, values) of a token choice on the device for rows drawn as `draws` (a DeviceDraw, or
    None for the argmax, per row). plan names the work (None: the argmax alone; else the ranked
    logits needed, whether rows cut, whether any cuts by rank), which depends on host numbers only,
    so a captured step holding it is keyed by it; values: each DEVICE_DRAW_FIELDS field per row."""
    if not any(d is not None and not d.params.greedy for d in draws):
        return None, {}
    rows = [(0.0, 0, 1.0, 0.0, 0) if d is None or d.params.greedy else
            (d.params.temperature, d.params.top_k, d.params.top_p, d.params.min_p, d.seed) for d in draws]
    need = ranked_need([r[1] for r in rows], [r[2] for r in rows], vocab)
    cut_rows = need > 0 or any(r[3] > 0 for r in rows)
    any_top_k = any(0 < r[1] < vocab for r in rows)
    values = {name: list(v) for name, v in zip(("temperature", "top_k", "top_p", "min_p", "seed"), zip(*rows))}
    values["cut"] = [float("-inf")] * len(rows)
    return (need, cut_rows, any_top_k), values


def _rank(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids ordered by their logits x[ids], largest first, ties by lower id (a stable sort's order).
    Float32 logits (fp16 ones too, exactly) sort as one 64-bit key per id, the value's order-
    preserving bits above the id: a plain sort, 8x faster than a stable one (ties are common in
    logits computed in fp16)."""
    v = x[ids]
    if v.dtype != np.float32:
        v32 = v.astype(np.float32)
        if not np.array_equal(v32, v):  # not exactly float32 (a repetition penalty's quotients)
            ids = np.sort(ids)
            return ids[np.argsort(-x[ids], kind="stable")]
        v = v32
    u = (v + np.float32(0.0)).view(np.uint32)  # + 0: -0.0 ranks with 0.0
    up = np.where(u >> np.uint32(31), ~u, u | np.uint32(0x80000000))  # unsigned order = float order
    key = ((~up).astype(np.uint64) << np.uint64(32)) | ids.astype(np.uint64)
    key.sort()
    return (key & np.uint64(0xFFFFFFFF)).astype(np.int64)


def _ranked_prefix(x: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest logits, largest first, ties by lower id: np.argsort(-x,
    kind="stable")[:k], by a partition (O(V)) and a sort of the k alone (a full stable sort of a
    128k vocabulary took 11 ms a token on the 2-core CPU, the partition 0.1 ms)."""
    n = len(x)
    if k >= n:
        return _rank(x, np.arange(n))
    kth = np.partition(x, n - k)[n - k]  # the k-th largest value
    above = np.flatnonzero(x > kth)
    return _rank(x, np.concatenate([above, np.flatnonzero(x == kth)[: k - len(above)]]))


class Sampler:
    """Draws a token as llama.cpp's sampler chain does (see the module docstring). The candidates
    are found without sorting the vocabulary: the top-k by a partition; without top-k, the shortest
    ranked prefix that holds the top-p nucleus (grown from 256 ids) within the min-p set."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self._device_draw = None

    def device_draw(self) -> DeviceDraw | None:
        """This sequence's draws for a backend sampling on the device (the same for every call on
        this Sampler); None where the draw needs the host (a repetition penalty)."""
        if not self.params.chain_only:
            return None
        if self._device_draw is None:
            self._device_draw = DeviceDraw(self.params, int(self.rng.integers(1, 2**62)))
        return self._device_draw

    def __call__(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        p = self.params
        x = np.asarray(logits).reshape(-1)
        if p.penalized and history:
            x = x.astype(np.float64)  # a copy: the caller's logits stay as they are
            ids, counts = np.unique(np.asarray(history[-p.repeat_last_n :], dtype=np.int64), return_counts=True)
            v = x[ids]
            if p.repetition_penalty != 1.0:
                v = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
            x[ids] = v - counts * p.frequency_penalty - p.presence_penalty
        if p.greedy:
            return int(np.argmax(x))
        n = len(x)
        if np.isnan(x).any():  # NaN ranks last, as in a full sort
            ids = np.argsort(-x.astype(np.float64), kind="stable")
            ids = ids[: p.top_k] if p.top_k and p.top_k < n else ids
            return self._draw(ids, x[ids].astype(np.float64), None)
        if p.top_k and p.top_k < n:
            ids = _ranked_prefix(x, p.top_k)
            return self._draw(ids, x[ids].astype(np.float64), None)
        # no top-k: the probabilities are over the whole vocabulary; only a ranked prefix is needed
        best = x.max()
        limit = n if p.min_p <= 0 else int(np.count_nonzero(x >= float(best) + np.log(p.min_p)))  # the min-p set
        if p.top_p >= 1.0 and limit == n:  # the whole vocabulary's softmax: no ranking at all
            return self._choice(np.exp((x - best) / x.dtype.type(p.temperature)))
        mass = float(np.exp(x - best).sum(dtype=np.float64))  # exp in the logits' precision, summed in float64
        best = float(best)
        k = min(limit, 256)
        while True:
            ids = _ranked_prefix(x, k)
            reached = np.exp(x[ids].astype(np.float64) - best).sum() / mass >= p.top_p
            if reached or k >= limit:
                break
            k = min(limit, 8 * k)
        return self._draw(ids, x[ids].astype(np.float64), mass)

    def _draw(self, ids: np.ndarray, vals: np.ndarray, mass: float | None) -> int:
        """Top-p, min-p and temperature over candidates ids (ranked, best first, unless all of the
        vocabulary) whose logits are vals; mass: the probability mass (relative to the best
        token's) of the set top-p is measured against, None for the candidates' own."""
        p = self.params
        best = float(vals.max())
        probs = np.exp(vals - best)
        probs /= probs.sum() if mass is None else mass
        if p.top_p < 1.0:
            keep = min(int(np.searchsorted(np.cumsum(probs), p.top_p) + 1), len(ids))
            ids, vals, probs = ids[:keep], vals[:keep], probs[:keep]
        if p.min_p > 0:
            keep = probs >= p.min_p * probs.max()
            ids, vals = ids[keep], vals[keep]
        return int(ids[self._choice(np.exp((vals - vals.max()) / p.temperature))])

    def _choice(self, w: np.ndarray) -> int:
        """An index drawn with probabilities w / w.sum() by one uniform number: for a few candidates
        Generator.choice(len(w), p=...)'s draw exactly (the same cumulative sums), without its
        checks of p; for a whole vocabulary, the block of 256 the number falls in (from the
        blocks' sums), then the index within it (two short cumulative sums, not one of 128k)."""
        u = self.rng.random()
        if len(w) <= 4096:
            w = w.astype(np.float64, copy=False)
            cdf = np.cumsum(w / w.sum())
            cdf /= cdf[-1]
            return min(int(cdf.searchsorted(u, side="right")), len(w) - 1)
        n = len(w)
        blocks = np.add.reduceat(w, np.arange(0, n, 256), dtype=np.float64)
        cb = np.cumsum(blocks)
        target = u * cb[-1]
        b = min(int(cb.searchsorted(target, side="right")), len(cb) - 1)
        inner = np.cumsum(w[256 * b:256 * (b + 1)], dtype=np.float64)
        rest = target - (cb[b - 1] if b else 0.0)
        return min(256 * b + int(inner.searchsorted(rest, side="right")), n - 1)
