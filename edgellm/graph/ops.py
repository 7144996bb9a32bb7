"""The op set: for each op kind, its shape rule (symbolic) and its arithmetic cost.

Semantics (every backend implements these exactly; the cpu backend is the reference):
  embedding(table[V,D], ids[S])            -> [S,D]   rows of table
  rms_norm(x[S,D], w[D]; eps)              -> [S,D]   x / sqrt(mean(x^2) + eps) * w
  rms_norm(x[S,H*d], w[d]; eps)            -> [S,H*d] the same over each group of d features (per-head q/k norm)
  linear(x[S,K], w[N,K])                   -> [S,N]   x @ w.T
  add(a, b) / mul(a, b)                    -> shape of a; b is a's shape or [D] (broadcast over rows)
  silu(x)                                  -> x * sigmoid(x)
  gelu(x)                                  -> GELU, tanh approximation: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  scale(x; factor)                         -> x * factor
  softcap(x; cap)                          -> cap * tanh(x / cap)
  rope(x[S,H*d], start_pos[], (freqs[r/2]); n_heads, head_dim, rope_dim, theta, style, pos_scale)
                                           -> rotary embedding at positions start_pos .. start_pos+S-1;
                                              style 'norm' rotates pairs (2i, 2i+1), 'neox' pairs (i, i+r/2);
                                              frequency i is theta^(-2i/r) / freqs[i] (freqs optional);
                                              mscale (default 1) multiplies cos and sin (long-RoPE attn_factor)
  kv_store(cache[C,F], x[S,F], start_pos[]; ring=False)
                                           -> cache, rows start_pos.. overwritten in place (alias); with ring
                                              (a sliding-window layer's cache) position p goes to row p mod C
  attention(q[S,H*d], k[C,G*d], v[C,G*d], start_pos[]; n_heads, n_kv_heads, head_dim, scale, window=0)
                                           -> [S,H*d]; query i (position p = start_pos+i) attends to the keys
                                              of positions 0..p, and with window > 0 only to p-window+1..p
                                              (sliding window), key position j read from row j mod C (a ring
                                              when C is less than the positions: it holds the last C written);
                                              query head h reads kv head h // (H/G)
  last_row(x[S,D])                         -> [1,D]   the last row
Row-wise forms, for one decode step of several sequences (row i: its own KV slot and position):
  rope_rows(x[S,H*d], pos[S], (freqs); as rope) -> row i rotated at position pos[i]
  kv_store_rows(cache[C,F], x[S,F], base[S], pos[S]) -> cache, row base[i]+pos[i] := x[i] (alias)
  attention_rows(q[S,H*d], k[C,G*d], v[C,G*d], base[S], pos[S]; as attention)
                                           -> [S,H*d]; query i attends to cache rows base[i] .. base[i]+pos[i]
"""

from __future__ import annotations

from typing import Any, Callable

import sympy

from ..errors import GraphError
from .ir import SEQ, Shape, Tensor
from .nd_ops import ND_RULES, broadcast_shapes, dims_equal, nd_flops

KV_LEN = sympy.Symbol("kv_len", integer=True, positive=True)  # keys attended to (start_pos + seq)


def _same(a, b) -> bool:
    return dims_equal(a, b)


def _fail(op: str, msg: str) -> GraphError:
    return GraphError(f"op '{op}': {msg}")


def _rank(op: str, t: Tensor, rank: int) -> None:
    if len(t.shape) != rank:
        raise _fail(op, f"tensor '{t.name}' has shape {t.shape}, expected rank {rank}")


def _embedding(op, ins, attrs):
    table, ids = ins
    _rank(op, table, 2)
    _rank(op, ids, 1)
    return (ids.shape[0], table.shape[1]), "f32", None


def _rms_norm(op, ins, attrs):
    x, w = ins
    _rank(op, x, 2)
    width, group = sympy.sympify(x.shape[-1]), sympy.sympify(w.shape[-1])
    if not (_same(width, group) or (width.is_Integer and group.is_Integer and width % group == 0)):
        raise _fail(op, f"norm weight '{w.name}' has {w.shape[-1]} features, input '{x.name}' has {x.shape[-1]} "
                        "(expected the same, or a divisor: one norm per group of features)")
    return x.shape, "f32", None


def _linear(op, ins, attrs):
    x, w = ins
    if len(x.shape) < 2:  # language models: [S, K]; imported networks: [..., K]
        _rank(op, x, 2)
    _rank(op, w, 2)
    if not _same(x.shape[-1], w.shape[1]):
        raise _fail(op, f"'{x.name}' has {x.shape[-1]} features but weight '{w.name}' expects {w.shape[1]}")
    return (*x.shape[:-1], w.shape[0]), "f32", None


def _elementwise(op, ins, attrs):
    a = ins[0]
    for b in ins[1:]:
        ok = len(b.shape) == len(a.shape) and all(_same(p, q) for p, q in zip(a.shape, b.shape))
        ok = ok or (len(b.shape) == 1 and _same(b.shape[0], a.shape[-1]))
        if not ok:  # N-D operands (imported networks): numpy broadcasting
            return broadcast_shapes(op, *[t.shape for t in ins]), a.dtype, None
    return a.shape, a.dtype, None


def _unary_with(attr):
    def rule(op, ins, attrs):
        if attr not in attrs or not float(attrs[attr]):
            raise _fail(op, f"needs a nonzero '{attr}' attribute")
        return _elementwise(op, ins, attrs)
    return rule


def _rope(op, ins, attrs):
    x = ins[0]
    _rank(op, x, 2)
    h, d = attrs["n_heads"], attrs["head_dim"]
    if not _same(x.shape[1], h * d):
        raise _fail(op, f"'{x.name}' has {x.shape[1]} features, expected n_heads*head_dim = {h * d}")
    r = attrs.get("rope_dim", d)
    if r % 2 or r > d:
        raise _fail(op, f"rope_dim {r} must be even and at most head_dim {d}")
    if attrs.get("style") not in ("norm", "neox"):
        raise _fail(op, f"rope style {attrs.get('style')!r}, expected 'norm' or 'neox'")
    if len(ins) > 2 and not _same(ins[2].shape[0], r // 2):
        raise _fail(op, f"rope frequency factors '{ins[2].name}' have {ins[2].shape[0]} entries, expected {r // 2}")
    return x.shape, x.dtype, None


def _kv_store(op, ins, attrs):
    cache, x = ins[0], ins[1]
    if cache.kind != "state" and cache.alias_of is None:
        raise _fail(op, f"kv_store writes into '{cache.name}', which is not a state tensor")
    if not _same(cache.shape[1], x.shape[1]):
        raise _fail(op, f"'{x.name}' has {x.shape[1]} features, cache '{cache.name}' has {cache.shape[1]}")
    return cache.shape, cache.dtype, cache.alias_of or cache.name


def _attention(op, ins, attrs):
    q, k, v = ins[0], ins[1], ins[2]
    h, g, d = attrs["n_heads"], attrs["n_kv_heads"], attrs["head_dim"]
    if h % g:
        raise _fail(op, f"n_heads {h} is not a multiple of n_kv_heads {g}")
    if not _same(q.shape[1], h * d):
        raise _fail(op, f"query '{q.name}' has {q.shape[1]} features, expected {h}*{d}")
    for t in (k, v):
        if not _same(t.shape[1], g * d):
            raise _fail(op, f"'{t.name}' has {t.shape[1]} features, expected {g}*{d}")
    if int(attrs.get("window", 0)) < 0:
        raise _fail(op, f"window {attrs['window']} must be >= 0 (0: no sliding window)")
    return q.shape, "f32", None


def _rows(op, rows, *index):
    """Row-wise ops: each index tensor holds one entry per row of `rows`."""
    for t in index:
        _rank(op, t, 1)
        if not _same(t.shape[0], rows.shape[0]):
            raise _fail(op, f"index '{t.name}' has {t.shape[0]} entries, expected one per row of '{rows.name}'")


def _rope_rows(op, ins, attrs):
    _rows(op, ins[0], ins[1])
    return _rope(op, ins, attrs)


def _kv_store_rows(op, ins, attrs):
    _rows(op, ins[1], ins[2], ins[3])
    return _kv_store(op, ins, attrs)


def _attention_rows(op, ins, attrs):
    _rows(op, ins[0], ins[3], ins[4])
    return _attention(op, ins, attrs)


def _last_row(op, ins, attrs):
    (x,) = ins
    _rank(op, x, 2)
    return (sympy.Integer(1), x.shape[1]), x.dtype, None


def _all_gather(op, ins, attrs):
    (x,) = ins
    _rank(op, x, 2)
    world = attrs.get("world")
    if not isinstance(world, int) or world < 1:
        raise _fail(op, f"needs the number of ranks as an integer 'world' attribute, got {world!r}")
    return (x.shape[0], x.shape[1] * world), x.dtype, None


Rule = Callable[[str, list[Tensor], dict[str, Any]], tuple[Shape, str, str | None]]

RULES: dict[str, Rule] = {
    "embedding": _embedding,
    "rms_norm": _rms_norm,
    "linear": _linear,
    "add": _elementwise,
    "mul": _elementwise,
    "silu": _elementwise,
    "gelu": _elementwise,
    "scale": _unary_with("factor"),
    "softcap": _unary_with("cap"),
    "rope": _rope,
    "kv_store": _kv_store,
    "attention": _attention,
    "last_row": _last_row,
    "rope_rows": _rope_rows,
    "kv_store_rows": _kv_store_rows,
    "attention_rows": _attention_rows,
    "all_reduce": _elementwise,  # the sum of this tensor over the tensor-parallel ranks
    "all_gather": _all_gather,  # the ranks' column blocks side by side, in rank order
}
RULES.update({k: v for k, v in ND_RULES.items() if k not in RULES})  # N-D kinds of imported networks


def infer(kind: str, inputs: list[Tensor], attrs: dict[str, Any], op_name: str):
    rule = RULES.get(kind)
    if rule is None:
        raise GraphError(f"op '{op_name}': unknown op kind '{kind}' (known: {', '.join(sorted(RULES))})")
    shape, dtype, alias = rule(op_name, inputs, attrs)
    return tuple(sympy.sympify(d) for d in shape), dtype, alias


def flops(kind: str, inputs: list[Tensor], output: Tensor, attrs: dict[str, Any]) -> sympy.Expr:
    """Arithmetic operations (multiply and add counted separately) as an expression in seq/kv_len."""
    n_out = sympy.Mul(*output.shape)
    nd = nd_flops(kind, inputs, output, attrs)
    if nd is not None:
        return nd
    if kind == "linear":
        return 2 * n_out * inputs[1].shape[1]
    if kind in ("attention", "attention_rows"):
        # QK^T and PV over kv_len keys per query (causal masking halves this in prefill; not counted)
        keys = sympy.Min(KV_LEN, attrs["window"]) if attrs.get("window") else KV_LEN  # a sliding window reads fewer
        return 4 * output.shape[0] * keys * attrs["n_heads"] * attrs["head_dim"]
    if kind == "rms_norm":
        return 4 * n_out
    if kind in ("add", "mul", "scale", "silu", "gelu", "softcap", "rope", "rope_rows"):
        return (1 if kind in ("add", "mul", "scale") else 4) * n_out
    return sympy.Integer(0)


__all__ = ["RULES", "infer", "flops", "KV_LEN", "SEQ"]
