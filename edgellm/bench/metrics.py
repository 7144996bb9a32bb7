"""The benchmark's metrics, as plain functions of measured times and of the model's graph.

Definitions (the ELIB set; llama-bench's pp/tg tests for the speeds):
  prefill tokens/s   p / (wall time of one forward over p tokens from an empty KV cache)
  TTFT               wall time from submitting those p tokens to holding the first (greedy) token id
  decode tokens/s    n / (wall time of n single-token steps from an empty cache, each fed the greedy
                     pick of the previous one);  TPOT = 1 / decode tokens/s
  TTLM               wall time of loading the model until a first token can be produced
  FLOP/s achieved    graph FLOPs of the work / its wall time; FLOPs are the sum of
                     edgellm.graph.ops.flops() over the model graph with seq and kv_len substituted
                     (prefill: seq = kv_len = p; decode: seq = 1, kv_len averaged over the n steps)
  MBU                (weight bytes read per token + KV-cache bytes read per token) / TPOT / peak
                     memory bandwidth; weight bytes are the stored (GGUF) bytes of every weight the
                     decode graph reads, an embedding table counting one row per token
  perplexity         llama.cpp's method: the token stream cut into chunks of n_ctx tokens, each run
                     from an empty cache, only the second half of each chunk scored; exp(mean NLL)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

SPREAD_FLAG = 0.10  # (max - min) / median above this is flagged in the report


# -- statistics -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stats:
    n: int
    median: float
    mean: float
    stddev: float  # sample standard deviation (0 for a single sample)
    min: float
    max: float

    @property
    def spread(self) -> float:
        """(max - min) / median: the relative range of the samples."""
        return (self.max - self.min) / self.median if self.median else math.inf

    @property
    def flagged(self) -> bool:
        return self.n > 1 and self.spread > SPREAD_FLAG

    def to_dict(self) -> dict:
        d = asdict(self)
        d["spread"] = self.spread if math.isfinite(self.spread) else None
        d["flagged"] = self.flagged
        return d


def summarize(samples: Sequence[float]) -> Stats | None:
    xs = [float(x) for x in samples if x is not None and math.isfinite(float(x))]
    if not xs:
        return None
    return Stats(n=len(xs), median=statistics.median(xs), mean=statistics.fmean(xs),
                 stddev=statistics.stdev(xs) if len(xs) > 1 else 0.0, min=min(xs), max=max(xs))


# -- arithmetic and memory traffic from the graph ---------------------------------------------------
def graph_flops(graph):
    """Total FLOPs of one run of `graph` as a sympy expression in seq and kv_len."""
    import sympy

    from ..graph.ops import flops

    total = sympy.Integer(0)
    for op in graph.ops:
        out = graph.tensors[op.outputs[0]]
        total += flops(op.kind, [graph.tensors[i] for i in op.inputs], out, op.attrs)
    return sympy.expand(total)


def flops_at(expr, seq: int, kv_len: float) -> float:
    """Evaluate a FLOP expression; kv_len may be fractional (an average over steps: FLOPs are
    linear in kv_len, so the value at the mean is the mean of the values)."""
    import sympy

    from ..graph.ir import CTX, SEQ
    from ..graph.ops import KV_LEN

    value = sympy.sympify(expr).subs({SEQ: int(seq), KV_LEN: sympy.Rational(kv_len).limit_denominator(10**6),
                                      CTX: int(math.ceil(kv_len))})
    return float(value)


def prefill_flops(expr, p: int) -> float:
    """FLOPs of a forward over p tokens from an empty cache (every query attends to kv_len = p keys,
    the causal mask not discounted, as ops.flops counts)."""
    return flops_at(expr, p, p)


def decode_kv_len(n: int) -> float:
    """Mean keys attended over n single-token steps from an empty cache: step i sees i+1 keys."""
    return (n + 1) / 2


def decode_flops_per_token(expr, n: int) -> float:
    return flops_at(expr, 1, decode_kv_len(n))


def weight_bytes_per_token(graph, stored_nbytes: Callable[[str], int], seq: int = 1) -> float:
    """Bytes of weights a forward over `seq` tokens reads, in their stored format. A weight read
    only by embedding ops contributes one row per token; any other weight is read whole."""
    consumers: dict[str, set[str]] = {}
    for op in graph.ops:
        for name in op.inputs:
            consumers.setdefault(name, set()).add(op.kind)
    total = 0.0
    for t in graph.weights():
        kinds = consumers.get(t.name, set())
        if not kinds:
            continue
        nbytes = stored_nbytes(t.source or t.name)
        if kinds == {"embedding"}:
            rows = int(t.shape[0])
            total += nbytes / rows * min(seq, rows)
        else:
            total += nbytes
    return total


def kv_bytes_per_token(graph, kv_len: float, bytes_per_element: float) -> float:
    """KV-cache bytes one decode step reads: every attention op reads kv_len rows of K and of V."""
    features = 0
    for op in graph.ops:
        if op.kind == "attention":
            features += int(graph.tensors[op.inputs[1]].shape[1]) + int(graph.tensors[op.inputs[2]].shape[1])
    return features * kv_len * bytes_per_element


def flop_rate(flops: float, seconds: float) -> float:
    return flops / seconds if seconds > 0 else math.nan


def mbu(weight_bytes: float, kv_bytes: float, tpot_s: float, peak_bytes_per_s: float) -> float:
    """Memory bandwidth utilisation of decode: bytes one token must read over the time it took,
    as a fraction of the device's peak bandwidth."""
    if tpot_s <= 0 or peak_bytes_per_s <= 0:
        return math.nan
    return (weight_bytes + kv_bytes) / tpot_s / peak_bytes_per_s


# -- perplexity ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood (nats) per scored token
    n_ctx: int
    n_chunks: int
    n_scored: int
    n_tokens: int  # tokens in the text

    def to_dict(self) -> dict:
        return asdict(self)


def choose_ppl_ctx(n_tokens: int, requested: int | None, model_ctx: int | None = None, default: int = 512) -> int:
    """The chunk size: `requested`, or 512, or less when the text has fewer than two chunks of 512."""
    from ..errors import EdgeLLMError

    if requested is not None:
        if n_tokens < 2 * requested:
            raise EdgeLLMError(f"the perplexity text has {n_tokens} tokens; --ppl-ctx {requested} needs at least "
                               f"{2 * requested} (two chunks): use a longer text or a smaller --ppl-ctx")
        n_ctx = requested
    else:
        n_ctx = min(default, n_tokens // 2)
        if n_ctx >= 64:
            n_ctx -= n_ctx % 16
        if n_ctx < 8:
            raise EdgeLLMError(f"the perplexity text has only {n_tokens} tokens; at least 16 are needed")
    if model_ctx is not None and n_ctx > model_ctx:
        raise EdgeLLMError(f"--ppl-ctx {n_ctx} exceeds the model's context length {model_ctx}")
    return n_ctx


def _log_softmax_at(row: np.ndarray, target: int) -> float:
    row = np.asarray(row, dtype=np.float64)
    m = float(row.max())
    return float(row[target] - m - math.log(float(np.exp(row - m).sum())))


def perplexity(logits_fn: Callable[[list[int]], np.ndarray], tokens: Sequence[int], n_ctx: int,
               bos_id: int | None = None, max_chunks: int | None = None) -> PerplexityResult:
    """llama.cpp's perplexity: chunk i is tokens[i*n_ctx:(i+1)*n_ctx] with its first token replaced
    by BOS when the model adds one (bos_id given); it runs from an empty cache (logits_fn returns
    [n_ctx, vocab] logits); positions j in [n_ctx/2, n_ctx-1) are scored on predicting token j+1
    (the first half only gives the scored tokens context). PPL = exp(mean NLL)."""
    from ..errors import EdgeLLMError

    tokens = [int(t) for t in tokens]
    n_chunks = len(tokens) // n_ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks < 1 or n_ctx < 2:
        raise EdgeLLMError(f"perplexity needs at least one chunk of {n_ctx} tokens, the text has {len(tokens)}")
    first = n_ctx // 2
    nll, count = 0.0, 0
    for c in range(n_chunks):
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
        run = list(chunk)
        if bos_id is not None:
            run[0] = int(bos_id)
        logits = np.asarray(logits_fn(run))
        if logits.shape[0] != n_ctx:
            raise EdgeLLMError(f"the engine returned logits for {logits.shape[0]} positions, expected {n_ctx}")
        for j in range(first, n_ctx - 1):
            nll -= _log_softmax_at(logits[j], chunk[j + 1])
            count += 1
    mean = nll / count
    return PerplexityResult(ppl=math.exp(mean), nll=mean, n_ctx=n_ctx, n_chunks=n_chunks, n_scored=count,
                            n_tokens=len(tokens))
