"""Graph passes: cleanup and fusion, as rewrites of a Graph (backends then lower fused ops to
fused kernels; nothing is special-cased inside a backend).

Each pass takes a Graph and returns a new Graph (the input is not modified). Fused op kinds and
their semantics (the cpu backend implements each as the composition it replaces):

  add_rms_norm(a, b, w; eps)          -> (s, n):  s = a + b, n = rms_norm(s, w)     residual + norm
  swiglu(gate, up; act)               -> act(gate) * up  (act: 'silu' SwiGLU, default; 'gelu_tanh' GeGLU)
  linear_swiglu(x, wg, wu; act)       -> act(x @ wg.T) * (x @ wu.T)                   gate/up + activation·mul
  linear(x, w, bias?, residual?; has_bias, has_residual)
                                      -> x @ w.T (+ bias) (+ residual)                element-wise into producer
  rope_store(x, start, cache, freqs?; ring?) -> cache with rows start.. = rope(x)   RoPE + layout + KV write
                                         (ring: as kv_store's, positions wrap around the cache)
  linear_qkv(x, wq, wk, wv, bq?, bk?, bv?; has_bias)
                                      -> [S, (H + 2G) d]: the q | k | v projections side by side
  rope_qkv_store(qkv, start, kc, vc, freqs?, qnorm?, knorm?; n_heads, n_kv_heads, ..., qk_norm_eps?)
                                      -> (q, kc, vc): q rotated; rotated k and v written to the caches
                                         (with qk_norm_eps: q and k per-head RMSNormed first; with ring,
                                         both caches are rings as kv_store's)

Imported networks' fused kinds (sdpa, linear_act, mul_add, add_layer_norm: attention, activation
epilogue, layer scale + residual, residual + LayerNorm) are described in edgellm.graph.nd_ops
with the other N-D kinds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

from ..errors import GraphError
from ..graph.ir import Graph, Op


def _clone(g: Graph) -> Graph:
    out = Graph(g.name, g.meta)
    out.tensors = {k: copy.copy(v) for k, v in g.tensors.items()}
    out.ops = [Op(o.name, o.kind, tuple(o.inputs), tuple(o.outputs), dict(o.attrs)) for o in g.ops]
    out.inputs, out.outputs = list(g.inputs), list(g.outputs)
    out._counter = g._counter
    return out


def _consumers(g: Graph) -> dict[str, list[int]]:
    cons: dict[str, list[int]] = {}
    for i, op in enumerate(g.ops):
        for t in op.inputs:
            cons.setdefault(t, []).append(i)
    return cons


def _rename_uses(g: Graph, old: str, new: str) -> None:
    for op in g.ops:
        if old in op.inputs:
            op.inputs = tuple(new if t == old else t for t in op.inputs)
    g.outputs = [new if t == old else t for t in g.outputs]


def _drop_unused_tensors(g: Graph) -> None:
    used = set(g.inputs) | set(g.outputs)
    for op in g.ops:
        used.update(op.inputs)
        used.update(op.outputs)
    for name in [n for n, t in g.tensors.items() if n not in used and t.kind in ("activation", "weight")]:
        del g.tensors[name]


# -- cleanup --------------------------------------------------------------------------------------

def remove_identities(g: Graph) -> Graph:
    """Drop ops that return their input unchanged: single-input add/mul/concat, scale by one,
    reshape/transpose to the same layout."""
    g = _clone(g)
    keep = []
    for op in g.ops:
        ident = (
            (op.kind in ("add", "mul", "concat") and len(op.inputs) == 1)
            or (op.kind == "scale" and op.attrs.get("factor") == 1)
            or (op.kind in ("reshape", "transpose") and g.tensors[op.inputs[0]].shape == g.tensors[op.outputs[0]].shape
                and op.attrs.get("perm") in (None, tuple(range(len(g.tensors[op.inputs[0]].shape)))))
        )
        if ident:
            _rename_uses(g, op.outputs[0], op.inputs[0])
        else:
            keep.append(op)
    g.ops = keep
    _drop_unused_tensors(g)
    return g


def eliminate_dead_code(g: Graph) -> Graph:
    """Drop ops whose outputs nothing reads (ops writing state are kept: their effect persists)."""
    g = _clone(g)
    live = set(g.outputs)
    keep: list[Op] = []
    for op in reversed(g.ops):
        writes_state = any(g.tensors[o].alias_of for o in op.outputs)
        if writes_state or any(o in live for o in op.outputs):
            keep.append(op)
            live.update(op.inputs)
    g.ops = keep[::-1]
    _drop_unused_tensors(g)
    return g


# -- fusion ---------------------------------------------------------------------------------------

def _single_consumer(cons, t) -> int | None:
    c = cons.get(t, [])
    return c[0] if len(c) == 1 else None


def fuse_linear_bias(g: Graph) -> Graph:
    """Fold the bias add that follows a linear into the linear, before the passes that group
    linears (fuse_qkv: q, k and v projections with biases, as qwen2 has, are one op only once
    their biases are theirs)."""
    return fuse_linear_epilogue(g, residual=False)


def fuse_linear_epilogue(g: Graph, *, residual: bool = True) -> Graph:
    """Fold a bias add and/or (residual) a residual add that follows a linear into the linear (its
    epilogue)."""
    g = _clone(g)
    changed = True
    while changed:
        changed = False
        cons = _consumers(g)
        for i, op in enumerate(g.ops):
            if op.kind != "linear" or op.outputs[0] in g.outputs:
                continue
            j = _single_consumer(cons, op.outputs[0])
            if j is None or g.ops[j].kind != "add":
                continue
            nxt = g.ops[j]
            other = [t for t in nxt.inputs if t != op.outputs[0]]
            if len(other) != 1:
                continue
            other_t = g.tensors[other[0]]
            if other_t.kind == "weight" and len(other_t.shape) == 1 and not op.attrs.get("has_bias"):
                slot = "has_bias"
            elif residual and len(other_t.shape) == 2 and not op.attrs.get("has_residual"):
                slot = "has_residual"
                if g.producers().get(other[0], -1) > i:  # the residual must exist before the linear runs
                    continue
            else:
                continue
            bias = [op.inputs[2]] if op.attrs.get("has_bias") else []
            res = [op.inputs[-1]] if op.attrs.get("has_residual") else []
            if slot == "has_bias":
                bias = other
            else:
                res = other
            op.inputs = (op.inputs[0], op.inputs[1], *bias, *res)
            op.attrs[slot] = True
            _rename_uses(g, nxt.outputs[0], op.outputs[0])
            del g.ops[j]
            changed = True
            break
    _drop_unused_tensors(g)
    return g


def fuse_add_rms_norm(g: Graph) -> Graph:
    """s = add(a, b); n = rms_norm(s, w)  ->  (s, n) = add_rms_norm(a, b, w)."""
    g = _clone(g)
    cons = _consumers(g)
    out: list[Op] = []
    skip: set[int] = set()
    for i, op in enumerate(g.ops):
        if i in skip:
            continue
        if op.kind == "add" and len(op.inputs) == 2 and all(len(g.tensors[t].shape) == 2 for t in op.inputs):
            width = g.tensors[op.outputs[0]].shape[-1]
            norm = next((j for j in cons.get(op.outputs[0], []) if g.ops[j].kind == "rms_norm"
                         and g.ops[j].inputs[0] == op.outputs[0]
                         and g.tensors[g.ops[j].inputs[1]].shape[-1] == width), None)  # not a per-group norm
            if norm is not None:
                n = g.ops[norm]
                # the norm moves up to the add: its weight is a weight, so nothing it reads comes later
                out.append(Op(op.name + "+norm", "add_rms_norm", (*op.inputs, n.inputs[1]),
                              (op.outputs[0], n.outputs[0]), dict(n.attrs)))
                skip.add(norm)
                continue
        out.append(op)
    g.ops = out
    return g


GATE_ACTS = {"silu": "silu", "gelu": "gelu_tanh"}  # activation op kind -> the gated ops' act attribute


def fuse_swiglu(g: Graph) -> Graph:
    """a = silu(gate); y = mul(a, up)  ->  y = swiglu(gate, up); then, when gate and up are linears of
    the same input read by nothing else, y = linear_swiglu(x, wg, wu). The same for gelu (GeGLU),
    with act='gelu_tanh'."""
    g = _clone(g)
    cons = _consumers(g)
    prod = g.producers()
    drop: set[int] = set()
    for i, op in enumerate(g.ops):
        if op.kind not in GATE_ACTS or (op.kind == "gelu" and op.attrs.get("approximate", "none") != "tanh"):
            continue  # the gated kernels' gelu is the tanh form
        attrs = {} if op.kind == "silu" else {"act": GATE_ACTS[op.kind]}
        j = _single_consumer(cons, op.outputs[0])
        if j is None or g.ops[j].kind != "mul":
            continue
        mul = g.ops[j]
        up = next(t for t in mul.inputs if t != op.outputs[0]) if mul.inputs.count(op.outputs[0]) == 1 else None
        if up is None:
            continue
        gate = op.inputs[0]
        gi, ui = prod.get(gate), prod.get(up)
        lin_g = g.ops[gi] if gi is not None else None
        lin_u = g.ops[ui] if ui is not None else None
        if (lin_g and lin_u and lin_g.kind == lin_u.kind == "linear" and len(lin_g.inputs) == len(lin_u.inputs) == 2
                and lin_g.inputs[0] == lin_u.inputs[0] and len(cons[gate]) == 1 and len(cons[up]) == 1):
            g.ops[j] = Op(mul.name + "+gate_up", "linear_swiglu", (lin_g.inputs[0], lin_g.inputs[1], lin_u.inputs[1]),
                          mul.outputs, dict(attrs))
            drop.update((i, gi, ui))
        else:
            g.ops[j] = Op(mul.name + "+" + op.kind, "swiglu", (gate, up), mul.outputs, dict(attrs))
            drop.add(i)
    g.ops = [op for k, op in enumerate(g.ops) if k not in drop]
    _drop_unused_tensors(g)
    return g


def fuse_rope_store(g: Graph) -> Graph:
    """k = rope(x, start, freqs?); c = kv_store(cache, k, start)  ->  c = rope_store(x, start, cache, freqs?)
    when k is read by nothing else: the rotated K goes straight into the cache."""
    g = _clone(g)
    cons = _consumers(g)
    drop: set[int] = set()
    for i, op in enumerate(g.ops):
        if op.kind != "rope":
            continue
        j = _single_consumer(cons, op.outputs[0])
        if j is None or g.ops[j].kind != "kv_store" or g.ops[j].inputs[1] != op.outputs[0]:
            continue
        st = g.ops[j]
        freqs = op.inputs[2:]
        attrs = dict(op.attrs)
        if st.attrs.get("ring"):  # the store's own attribute: the cache is a ring
            attrs["ring"] = True
        g.ops[j] = Op(st.name + "+rope", "rope_store", (op.inputs[0], op.inputs[1], st.inputs[0], *freqs),
                      st.outputs, attrs)
        drop.add(i)
    g.ops = [op for k, op in enumerate(g.ops) if k not in drop]
    _drop_unused_tensors(g)
    return g


def fuse_qkv(g: Graph) -> Graph:
    """Three projections of one input (q, k, v, each maybe with a bias) whose results meet in
    rope(q), rope_store(k) and kv_store(v) at the same start position become one linear_qkv
    (the weights are concatenated at load) and one rope_qkv_store: per layer, two kernels instead
    of six. A per-head RMSNorm of q and of k before RoPE (qwen3, gemma3) moves into the
    rope_qkv_store too (its weights are the op's last two inputs, attribute qk_norm_eps)."""
    g = _clone(g)
    prod = g.producers()
    cons = _consumers(g)
    drop: set[int] = set()
    new_at: dict[int, list[Op]] = {}

    def head_norm(t: str) -> tuple[str, int | None]:
        """(the tensor before a per-head rms_norm producing t that only RoPE reads, its op) or (t, None)."""
        i = prod.get(t)
        if (i is not None and g.ops[i].kind == "rms_norm" and len(cons.get(t, [])) == 1
                and g.tensors[g.ops[i].inputs[1]].shape[-1] != g.tensors[t].shape[-1]
                and len(cons.get(g.ops[i].inputs[0], [])) == 1):
            return g.ops[i].inputs[0], i
        return t, None

    def linear_of(t: str) -> int | None:
        i = prod.get(t)
        return i if i is not None and g.ops[i].kind == "linear" and i not in drop else None

    for i, op in enumerate(g.ops):
        if op.kind != "rope_store" or i in drop:
            continue
        k_pre, k_norm = head_norm(op.inputs[0])
        k_lin_i = linear_of(k_pre)
        start, kc = op.inputs[1], op.inputs[2]
        freqs = op.inputs[3:]
        if k_lin_i is None:
            continue
        x_in = g.ops[k_lin_i].inputs[0]
        # the V store and the Q rope of the same layer: same start, linears of the same input
        v_st = next((j for j, o in enumerate(g.ops) if o.kind == "kv_store" and o.inputs[2] == start and j not in drop
                     and linear_of(o.inputs[1]) is not None and g.ops[prod[o.inputs[1]]].inputs[0] == x_in), None)
        q_rope = next((j for j, o in enumerate(g.ops) if o.kind == "rope" and o.inputs[1] == start and j not in drop
                       and linear_of(head_norm(o.inputs[0])[0]) is not None
                       and g.ops[prod[head_norm(o.inputs[0])[0]]].inputs[0] == x_in), None)
        if v_st is None or q_rope is None:
            continue
        rq = g.ops[q_rope]
        q_pre, q_norm = head_norm(rq.inputs[0])
        if (q_norm is None) != (k_norm is None):
            continue
        if bool(op.attrs.get("ring")) != bool(g.ops[v_st].attrs.get("ring")):
            continue
        norms: tuple[str, ...] = ()
        if q_norm is not None:
            qn, kn = g.ops[q_norm], g.ops[k_norm]
            if qn.attrs["eps"] != kn.attrs["eps"]:
                continue
            norms = (qn.inputs[1], kn.inputs[1])
        lin = {"q": g.ops[prod[q_pre]], "k": g.ops[k_lin_i], "v": g.ops[prod[g.ops[v_st].inputs[1]]]}
        if any(len(cons.get(l.outputs[0], [])) != 1 or l.attrs.get("has_residual") for l in lin.values()):
            continue
        biased = [bool(l.attrs.get("has_bias")) for l in lin.values()]
        if any(biased) and not all(biased):
            continue
        x = lin["q"].inputs[0]
        weights = tuple(l.inputs[1] for l in lin.values())
        biases = tuple(l.inputs[2] for l in lin.values()) if all(biased) else ()
        n_q = g.tensors[rq.outputs[0]].shape[1]
        n_kv = g.tensors[op.inputs[0]].shape[1]
        qkv_name = lin["q"].outputs[0].replace("attn_q", "attn_qkv")
        while qkv_name in g.tensors:
            qkv_name += "_"
        from ..graph.ir import Tensor

        g.tensors[qkv_name] = Tensor(qkv_name, (g.tensors[x].shape[0], n_q + 2 * n_kv), "f32", "activation")
        first = min(prod[q_pre], k_lin_i, prod[g.ops[v_st].inputs[1]])
        last = max(i, q_rope, v_st)
        new_at[first] = [Op(lin["q"].name + "+kv", "linear_qkv", (x, *weights, *biases), (qkv_name,),
                            {"has_bias": bool(biases)})]
        attrs = dict(rq.attrs)
        attrs["n_kv_heads"] = op.attrs["n_heads"]
        if op.attrs.get("ring"):  # both caches are rings
            attrs["ring"] = True
        if norms:
            attrs["qk_norm_eps"] = g.ops[q_norm].attrs["eps"]
        new_at[last] = [Op(rq.name + "+store", "rope_qkv_store",
                           (qkv_name, start, kc, g.ops[v_st].inputs[0], *freqs, *norms),
                           (rq.outputs[0], op.outputs[0], g.ops[v_st].outputs[0]), attrs)]
        drop.update({prod[q_pre], k_lin_i, prod[g.ops[v_st].inputs[1]], q_rope, i, v_st})
        drop.update(n for n in (q_norm, k_norm) if n is not None)
    out: list[Op] = []
    for k, op in enumerate(g.ops):
        out.extend(new_at.get(k, []))
        if k not in drop:
            out.append(op)
    g.ops = out
    _drop_unused_tensors(g)
    return g


# activations an N-D op's epilogue can apply (conv2d's act / res_act attrs; see graph.nd_ops)
EPILOGUE_ACTS = ("relu", "clip", "hardswish", "hardsigmoid", "sigmoid", "silu", "gelu", "tanh")


def _act_attrs(op: Op) -> dict:
    return {k: v for k, v in op.attrs.items() if k in ("min", "max", "alpha", "beta", "approximate")}


def fuse_silu(g: Graph) -> Graph:
    """s = sigmoid(x); y = mul(x, s)  ->  y = silu(x) (how exporters spell SiLU / Swish)."""
    g = _clone(g)
    cons = _consumers(g)
    drop: set[int] = set()
    for i, op in enumerate(g.ops):
        if op.kind != "sigmoid" or op.outputs[0] in g.outputs:
            continue
        j = _single_consumer(cons, op.outputs[0])
        if j is None or g.ops[j].kind != "mul" or set(g.ops[j].inputs) != {op.inputs[0], op.outputs[0]}:
            continue
        g.ops[j] = Op(g.ops[j].name + "+sigmoid", "silu", (op.inputs[0],), g.ops[j].outputs, {})
        drop.add(i)
    g.ops = [op for k, op in enumerate(g.ops) if k not in drop]
    _drop_unused_tensors(g)
    return g


def fuse_conv_epilogue(g: Graph) -> Graph:
    """Fold what follows a conv2d into its epilogue: an activation (act), then a residual add of a
    tensor of the output's shape that exists before the conv runs (has_residual), then an
    activation after the residual (res_act, as ResNet's relu(conv + identity))."""
    g = _clone(g)
    changed = True
    while changed:
        changed = False
        cons = _consumers(g)
        prod = g.producers()
        for i, op in enumerate(g.ops):
            if op.kind != "conv2d" or op.outputs[0] in g.outputs:
                continue
            j = _single_consumer(cons, op.outputs[0])
            if j is None:
                continue
            nxt = g.ops[j]
            a = op.attrs
            if nxt.kind in EPILOGUE_ACTS and not a.get("has_residual") and not a.get("act"):
                a["act"], a["act_args"] = nxt.kind, _act_attrs(nxt)
            elif nxt.kind in EPILOGUE_ACTS and a.get("has_residual") and not a.get("res_act"):
                a["res_act"], a["res_act_args"] = nxt.kind, _act_attrs(nxt)
            elif nxt.kind == "add" and not a.get("has_residual") and len(nxt.inputs) == 2 \
                    and nxt.inputs.count(op.outputs[0]) == 1:
                other = next(t for t in nxt.inputs if t != op.outputs[0])
                if g.tensors[other].shape != g.tensors[op.outputs[0]].shape or prod.get(other, -1) > i:
                    continue
                op.inputs = (*op.inputs, other)
                a["has_residual"] = True
            else:
                continue
            _rename_uses(g, nxt.outputs[0], op.outputs[0])
            del g.ops[j]
            changed = True
            break
    _drop_unused_tensors(g)
    return g


# -- imported networks (N-D ops): attention, layer norm, linear activation, layer scale ------------

def _scalar_of(g: Graph, t: str) -> float | None:
    """The value of a one-element constant (the importer lists them in graph.meta['scalars'])."""
    if g.tensors.get(t) is None or g.tensors[t].kind != "weight":
        return None
    v = g.meta.get("scalars", {}).get(t)
    return None if v is None else float(v)


def _scaled_by(g: Graph, prod: dict, cons: dict, t: str) -> tuple[str, float]:
    """Follow t back through multiplications / divisions by constant scalars that nothing else
    reads: (the tensor before them, the product of their factors)."""
    factor = 1.0
    while True:
        i = prod.get(t)
        op = g.ops[i] if i is not None else None
        if op is None or op.kind not in ("mul", "div") or len(op.inputs) != 2 or len(cons.get(t, [])) != 1 \
                or t in g.outputs:
            return t, factor
        c = _scalar_of(g, op.inputs[1])
        if c is not None and op.inputs[0] != op.inputs[1] and _same_shape(g, op.inputs[0], t):
            factor = factor / c if op.kind == "div" else factor * c
            t = op.inputs[0]
            continue
        c = _scalar_of(g, op.inputs[0]) if op.kind == "mul" else None
        if c is None or not _same_shape(g, op.inputs[1], t):  # (a scalar of higher rank would add axes)
            return t, factor
        factor, t = factor * c, op.inputs[1]


def _same_shape(g: Graph, a: str, b: str) -> bool:
    sa, sb = g.tensors[a].shape, g.tensors[b].shape
    return len(sa) == len(sb) and all(_dims_equal(p, q) for p, q in zip(sa, sb))


def fuse_attention(g: Graph) -> Graph:
    """s = matmul(q, transpose(k)) (either side scaled by constants, or the scores scaled);
    p = softmax(s, last axis); o = matmul(p, v)  ->  o = sdpa(q, k, v; scale): one attention op
    (flash attention on the GPU) where exporters write five to nine. The transpose swaps the last
    two axes of k; the scores and probabilities must be read by nothing else."""
    g = _clone(g)
    prod = g.producers()
    cons = _consumers(g)
    changed = False
    for j, sm in enumerate(g.ops):
        if sm.kind != "softmax" or sm.outputs[0] in g.outputs:
            continue
        rank = len(g.tensors[sm.inputs[0]].shape)
        if sm.attrs["axis"] != rank - 1 or rank < 2:
            continue
        nxt = _single_consumer(cons, sm.outputs[0])
        if nxt is None or g.ops[nxt].kind != "matmul" or g.ops[nxt].inputs[0] != sm.outputs[0] \
                or g.ops[nxt].inputs[1] == sm.outputs[0]:
            continue
        scores, scale = _scaled_by(g, prod, cons, sm.inputs[0])
        mi = prod.get(scores)
        if mi is None or g.ops[mi].kind != "matmul" or len(cons.get(scores, [])) != 1 or scores in g.outputs:
            continue
        q, sq = _scaled_by(g, prod, cons, g.ops[mi].inputs[0])
        kt, sk = _scaled_by(g, prod, cons, g.ops[mi].inputs[1])
        ti = prod.get(kt)
        perm = tuple(range(rank - 2)) + (rank - 1, rank - 2)
        if ti is None or g.ops[ti].kind != "transpose" or tuple(g.ops[ti].attrs["perm"]) != perm:
            continue
        k, sk2 = _scaled_by(g, prod, cons, g.ops[ti].inputs[0]) if len(cons.get(kt, [])) == 1 else (g.ops[ti].inputs[0], 1.0)
        v = g.ops[nxt].inputs[1]
        shapes = [g.tensors[t].shape for t in (q, k, v)]
        if not all(len(sh) == rank for sh in shapes) or not all(
                all(_dims_equal(a, b) for a, b in zip(sh[:-2], shapes[0][:-2])) for sh in shapes[1:]):
            continue  # batch axes that broadcast: left to the matmuls
        mm = g.ops[nxt]
        g.ops[nxt] = Op(mm.name + "+attention", "sdpa", (q, k, v), mm.outputs, {"scale": scale * sq * sk * sk2})
        changed = True
    if not changed:
        return g
    return eliminate_dead_code(g)  # the scores' chain: read by nothing now


def _dims_equal(a, b) -> bool:
    from ..graph.nd_ops import dims_equal

    return dims_equal(a, b)


def fuse_layer_norm(g: Graph) -> Graph:
    """The decomposed LayerNorm older exporters write (opset < 17):
    m = reduce_mean(x); d = x - m; v = reduce_mean(d ** 2); n = d / sqrt(v + eps); y = n * w (+ b)
    -> y = layer_norm(x, w, b?; axis, eps). The reductions run over the trailing axes."""
    g = _clone(g)
    prod = g.producers()
    cons = _consumers(g)

    def only(t, kind):
        c = _single_consumer(cons, t)
        return c if c is not None and g.ops[c].kind == kind and t not in g.outputs else None

    changed = False
    for i, rm in enumerate(g.ops):
        if rm.kind != "reduce_mean" or not rm.attrs.get("keepdims", True):
            continue
        x = rm.inputs[0]
        rank = len(g.tensors[x].shape)
        axes = tuple(sorted(a % rank for a in rm.attrs["axes"]))
        if axes != tuple(range(rank - len(axes), rank)):
            continue
        sub = only(rm.outputs[0], "sub")
        if sub is None or g.ops[sub].inputs != (x, rm.outputs[0]):
            continue
        d = g.ops[sub].outputs[0]
        dc = cons.get(d, [])
        if len(dc) != 2 or d in g.outputs:
            continue
        pw = next((c for c in dc if g.ops[c].kind == "pow" and g.ops[c].inputs[0] == d), None)
        dv = next((c for c in dc if g.ops[c].kind == "div" and g.ops[c].inputs[0] == d), None)
        if pw is None or dv is None or _scalar_of(g, g.ops[pw].inputs[1]) != 2.0:
            continue
        rm2 = only(g.ops[pw].outputs[0], "reduce_mean")
        if rm2 is None or tuple(sorted(a % rank for a in g.ops[rm2].attrs["axes"])) != axes \
                or not g.ops[rm2].attrs.get("keepdims", True):
            continue
        ad = only(g.ops[rm2].outputs[0], "add")
        if ad is None:
            continue
        eps = next((_scalar_of(g, t) for t in g.ops[ad].inputs if t != g.ops[rm2].outputs[0]), None)
        sq = only(g.ops[ad].outputs[0], "sqrt")
        if eps is None or sq is None or g.ops[dv].inputs[1] != g.ops[sq].outputs[0]:
            continue
        mul = only(g.ops[dv].outputs[0], "mul")
        if mul is None:
            continue
        n_out = g.ops[dv].outputs[0]
        w = next((t for t in g.ops[mul].inputs if t != n_out), None)
        norm_shape = g.tensors[x].shape[rank - len(axes):]
        wt = g.tensors.get(w)
        if wt is None or wt.kind != "weight" or len(wt.shape) > len(axes) or not all(
                _dims_equal(a, b) for a, b in zip(wt.shape[::-1], norm_shape[::-1])) or len(wt.shape) != len(axes):
            continue
        last, bias = mul, None
        ba = only(g.ops[mul].outputs[0], "add")
        if ba is not None:
            b = next((t for t in g.ops[ba].inputs if t != g.ops[mul].outputs[0]), None)
            bt = g.tensors.get(b)
            if bt is not None and bt.kind == "weight" and len(bt.shape) == len(axes) and all(
                    _dims_equal(p, q) for p, q in zip(bt.shape, norm_shape)):
                last, bias = ba, b
        end = g.ops[last]
        if not _same_shape(g, x, end.outputs[0]):
            continue  # constants of higher rank broadcast the result to more axes
        g.ops[last] = Op(end.name + "+layer_norm", "layer_norm", (x, w, *([bias] if bias else [])), end.outputs,
                         {"axis": rank - len(axes), "eps": eps, "has_bias": bias is not None})
        changed = True
    if not changed:
        return g
    return eliminate_dead_code(g)


def fuse_add_layer_norm(g: Graph) -> Graph:
    """s = add(a, b) (same shapes, no broadcasting); n = layer_norm(s)  ->  (s, n) =
    add_layer_norm(a, b, scale, bias?): a transformer's residual add and the LayerNorm after it in
    one pass (s stays available to whatever else reads it: the next residual add)."""
    g = _clone(g)
    cons = _consumers(g)
    out: list[Op] = []
    skip: set[int] = set()
    for i, op in enumerate(g.ops):
        if i in skip:
            continue
        if op.kind == "add" and len(op.inputs) == 2 and op.inputs[0] != op.inputs[1]:
            shapes = [g.tensors[t].shape for t in (*op.inputs, op.outputs[0])]
            same = all(len(sh) == len(shapes[2]) and all(_dims_equal(p, q) for p, q in zip(sh, shapes[2]))
                       for sh in shapes[:2])
            norm = next((j for j in cons.get(op.outputs[0], []) if g.ops[j].kind == "layer_norm"
                         and g.ops[j].inputs[0] == op.outputs[0]
                         and g.ops[j].attrs["axis"] % len(shapes[2]) == len(shapes[2]) - 1), None) if same else None
            if norm is not None and len(shapes[2]) >= 2:
                n = g.ops[norm]
                # the norm moves up to the add: its scale and bias are weights, so nothing it reads comes later
                out.append(Op(op.name + "+layer_norm", "add_layer_norm", (*op.inputs, *n.inputs[1:]),
                              (op.outputs[0], n.outputs[0]), dict(n.attrs)))
                skip.add(norm)
                continue
        out.append(op)
    g.ops = out
    return g


def merge_layout_chains(g: Graph) -> Graph:
    """reshape(reshape(x)) -> reshape(x); transpose(transpose(x, p1), p2) -> transpose(x, p1[p2]),
    where the inner result is read by nothing else: exporters' layout chains (ViT's attention
    writes reshape / unsqueeze / transpose / squeeze in a row) get shorter."""
    g = _clone(g)
    changed = True
    while changed:
        changed = False
        cons = _consumers(g)
        prod = g.producers()
        for j, op in enumerate(g.ops):
            if op.kind not in ("reshape", "transpose"):
                continue
            i = prod.get(op.inputs[0])
            inner = g.ops[i] if i is not None else None
            if inner is None or inner.kind != op.kind or len(cons.get(inner.outputs[0], [])) != 1 \
                    or inner.outputs[0] in g.outputs:
                continue
            attrs = dict(op.attrs)
            if op.kind == "transpose":
                attrs["perm"] = tuple(inner.attrs["perm"][p] for p in op.attrs["perm"])
            src = inner.inputs[0]
            if _same_shape(g, src, op.outputs[0]) and attrs.get("perm", tuple(range(len(g.tensors[src].shape)))) == \
                    tuple(range(len(g.tensors[src].shape))) and op.outputs[0] not in g.outputs:
                _rename_uses(g, op.outputs[0], src)  # the chain comes back to its input's layout
                del g.ops[j]
            else:
                g.ops[j] = Op(op.name, op.kind, inner.inputs, op.outputs, attrs)
            del g.ops[i]
            changed = True
            break
    _drop_unused_tensors(g)
    return g


LINEAR_ACTS = ("relu", "gelu")


def fuse_linear_act(g: Graph) -> Graph:
    """y = linear(x, w, bias?); z = relu / gelu(y)  ->  z = linear_act(x, w, bias?; act): the
    activation as the product's epilogue. (Gated activations, act(gate) * up, are fuse_swiglu's.)"""
    g = _clone(g)
    cons = _consumers(g)
    drop: set[int] = set()
    for i, op in enumerate(g.ops):
        if op.kind != "linear" or op.attrs.get("has_residual") or op.outputs[0] in g.outputs:
            continue
        j = _single_consumer(cons, op.outputs[0])
        if j is None or g.ops[j].kind not in LINEAR_ACTS or g.ops[j].inputs[0] != op.outputs[0]:
            continue
        act = g.ops[j]
        g.ops[j] = Op(op.name + "+" + act.kind, "linear_act", op.inputs, act.outputs,
                      {"has_bias": bool(op.attrs.get("has_bias")), "act": act.kind, "act_args": _act_attrs(act)})
        drop.add(i)
    g.ops = [op for k, op in enumerate(g.ops) if k not in drop]
    _drop_unused_tensors(g)
    return g


def fuse_mul_add(g: Graph) -> Graph:
    """m = mul(a, b); y = add(m, c)  ->  y = mul_add(a, b, c) on N-D tensors (rank >= 3: a layer
    scale times a branch plus the residual, as ConvNeXt's blocks end); one element-wise pass."""
    g = _clone(g)
    cons = _consumers(g)
    drop: set[int] = set()
    for i, op in enumerate(g.ops):
        if op.kind != "mul" or len(op.inputs) != 2 or op.outputs[0] in g.outputs:
            continue
        j = _single_consumer(cons, op.outputs[0])
        if j is None or g.ops[j].kind != "add" or len(g.ops[j].inputs) != 2 or g.ops[j].inputs.count(op.outputs[0]) != 1:
            continue
        out = g.tensors[g.ops[j].outputs[0]]
        if len(out.shape) < 3 or len(g.tensors[op.outputs[0]].shape) != len(out.shape):
            continue
        c = next(t for t in g.ops[j].inputs if t != op.outputs[0])
        g.ops[j] = Op(g.ops[j].name + "+mul", "mul_add", (*op.inputs, c), g.ops[j].outputs, {})
        drop.add(i)
    g.ops = [op for k, op in enumerate(g.ops) if k not in drop]
    _drop_unused_tensors(g)
    return g


def rope_qkv_extras(op: Op, ins: list) -> tuple:
    """(freqs or None, (q norm weight, k norm weight) or None) of a rope_qkv_store's inputs (the
    layout the fusion gives it: qkv, start, kc, vc, freqs?, qnorm?, knorm?)."""
    norms = tuple(ins[-2:]) if "qk_norm_eps" in op.attrs else None
    rest = ins[4:len(ins) - (2 if norms else 0)]
    return (rest[0] if rest else None), norms


@dataclass
class PassReport:
    name: str
    ops_before: int
    ops_after: int
    counts_after: dict[str, int] = field(default_factory=dict)


CLEANUP: list[tuple[str, Callable[[Graph], Graph]]] = [
    ("remove_identities", remove_identities),
    ("eliminate_dead_code", eliminate_dead_code),
]
FUSION: list[tuple[str, Callable[[Graph], Graph]]] = [
    ("fuse_rope_store", fuse_rope_store),
    ("fuse_linear_bias", fuse_linear_bias),
    ("fuse_qkv", fuse_qkv),
    ("fuse_swiglu", fuse_swiglu),
    ("fuse_add_rms_norm", fuse_add_rms_norm),
    ("fuse_linear_epilogue", fuse_linear_epilogue),
    ("fuse_silu", fuse_silu),
    ("fuse_conv_epilogue", fuse_conv_epilogue),
    ("fuse_attention", fuse_attention),
    ("fuse_layer_norm", fuse_layer_norm),
    ("fuse_linear_act", fuse_linear_act),
    ("fuse_mul_add", fuse_mul_add),
    ("fuse_add_layer_norm", fuse_add_layer_norm),
    ("merge_layout_chains", merge_layout_chains),
]


def run_passes(g: Graph, passes=None, *, fuse: bool = True, skip: frozenset = frozenset()) -> tuple[Graph, list[PassReport]]:
    """Cleanup then (optionally) fusion, without the passes named in `skip` (a backend's choice:
    e.g. webgpu keeps the residual add in the projection's epilogue and the RMSNorm apart, to fold
    the norm into the next projection); returns the new graph and one report per pass."""
    passes = passes if passes is not None else CLEANUP + (FUSION if fuse else [])
    passes = [(name, fn) for name, fn in passes if name not in skip]
    reports = []
    for name, fn in passes:
        before = len(g.ops)
        g = fn(g)
        try:
            g.validate()
        except GraphError as e:
            raise GraphError(f"pass {name} produced an invalid graph: {e}") from None
        reports.append(PassReport(name, before, len(g.ops), g.op_counts()))
    return g, reports
