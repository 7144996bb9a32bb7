"""An independent float64 numpy forward pass of a llama-family GGUF model, for tests.

It shares no code with edgellm: weights come from gguf-py's reader and dequantizer, and the math
is written out plainly from the published definitions (llama.cpp's RoPE conventions: adjacent
pairs for llama files, halves for qwen2; Llama-3 rope_freqs divide the frequencies).
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class ReferenceLlama:
    def __init__(self, path):
        r = GGUFReader(str(path))
        self.meta = {}
        for k, f in r.fields.items():
            try:
                self.meta[k] = f.contents()
            except Exception:
                pass
        self.w = {}
        for t in r.tensors:
            a = dequantize(t.data, t.tensor_type)
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            self.w[t.name] = np.asarray(a, dtype=np.float64).reshape(shape)
        arch = self.meta["general.architecture"]
        g = lambda k, d=None: self.meta.get(f"{arch}.{k}", d)  # noqa: E731
        self.arch = arch
        self.n_layers = g("block_count")
        self.d = g("embedding_length")
        self.h = g("attention.head_count")
        self.kvh = g("attention.head_count_kv", self.h)
        self.hd = g("attention.key_length", self.d // self.h)
        self.eps = g("attention.layer_norm_rms_epsilon")
        self.theta = g("rope.freq_base", 10000.0)
        self.rdim = g("rope.dimension_count", self.hd)
        self.pos_scale = 1.0 / g("rope.scaling.factor", 1.0) if g("rope.scaling.type") == "linear" else 1.0
        self.neox = arch == "qwen2"

    def _norm(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def _rope(self, x, n_heads, positions):
        s = x.shape[0]
        x = x.reshape(s, n_heads, self.hd).copy()
        r = self.rdim
        freqs = self.theta ** (-np.arange(0, r, 2) / r)
        if "rope_freqs.weight" in self.w:
            freqs = freqs / self.w["rope_freqs.weight"]
        ang = (positions * self.pos_scale)[:, None] * freqs[None, :]
        c, sn = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        if self.neox:
            a, b = x[..., : r // 2].copy(), x[..., r // 2 : r].copy()
            x[..., : r // 2], x[..., r // 2 : r] = a * c - b * sn, a * sn + b * c
        else:
            a, b = x[..., 0:r:2].copy(), x[..., 1:r:2].copy()
            x[..., 0:r:2], x[..., 1:r:2] = a * c - b * sn, a * sn + b * c
        return x.reshape(s, n_heads * self.hd)

    def logits(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        s = len(ids)
        pos = np.arange(s, dtype=np.float64)
        x = self.w["token_embd.weight"][ids]
        for i in range(self.n_layers):
            p = f"blk.{i}."
            n = self._norm(x, self.w[p + "attn_norm.weight"])
            q, k, v = (n @ self.w[p + f"attn_{c}.weight"].T + self.w.get(p + f"attn_{c}.bias", 0.0) for c in "qkv")
            q, k = self._rope(q, self.h, pos), self._rope(k, self.kvh, pos)
            q = q.reshape(s, self.h, self.hd)
            k = k.reshape(s, self.kvh, self.hd)
            v = v.reshape(s, self.kvh, self.hd)
            out = np.zeros((s, self.h, self.hd))
            group = self.h // self.kvh
            mask = np.triu(np.full((s, s), -np.inf), 1)
            for hh in range(self.h):
                kk, vv = k[:, hh // group], v[:, hh // group]
                sc = q[:, hh] @ kk.T / np.sqrt(self.hd) + mask
                sc = np.exp(sc - sc.max(-1, keepdims=True))
                out[:, hh] = (sc / sc.sum(-1, keepdims=True)) @ vv
            x = x + out.reshape(s, -1) @ self.w[p + "attn_output.weight"].T
            m = self._norm(x, self.w[p + "ffn_norm.weight"])
            gate = m @ self.w[p + "ffn_gate.weight"].T
            up = m @ self.w[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ self.w[p + "ffn_down.weight"].T
        x = self._norm(x, self.w["output_norm.weight"])
        head = self.w.get("output.weight", self.w["token_embd.weight"])
        return x @ head.T


def chain_kept(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> set:
    """The ids the sampling chain keeps (llama.cpp's order, as edgellm.sampling: top-k, top-p over
    the top-k's probabilities or the whole row's, min-p against the best), in float64 from a full
    stable ranking: the reference for the backends' device samplers."""
    order = np.argsort(-x, kind="stable")
    if 0 < top_k < len(x):
        order = order[:top_k]
        probs = np.exp(x[order] - x[order[0]])
        probs /= probs.sum()
    else:
        probs = np.exp(x[order] - x[order[0]])
        probs /= np.exp(x - x.max()).sum()
    if top_p < 1.0:
        before = np.cumsum(probs) - probs
        order, probs = order[before < top_p], probs[before < top_p]
    if min_p > 0:
        order = order[probs >= min_p * probs.max()]
    return set(order.tolist())


def draws_fit(draws, probs: np.ndarray, alpha: float = 1e-5) -> tuple[bool, float]:
    """Pearson's chi-square test of token draws against their exact probabilities (cells expected
    fewer than 5 times pooled): (passes at significance alpha, the statistic). A correct sampler
    fails it once in 1/alpha runs."""
    from scipy.stats import chi2

    probs = np.asarray(probs, dtype=np.float64)
    keep = probs > 0
    counts = np.bincount(np.asarray(draws), minlength=len(probs))[keep]
    expect = probs[keep] * len(draws)
    small = expect < 5
    counts = np.append(counts[~small], counts[small].sum())
    expect = np.append(expect[~small], expect[small].sum())
    if expect[-1] == 0:
        counts, expect = counts[:-1], expect[:-1]
    stat = float(((counts - expect) ** 2 / expect).sum())
    return stat < chi2.ppf(1 - alpha, len(expect) - 1), stat
