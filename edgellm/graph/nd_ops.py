"""N-D op kinds for imported networks (ONNX vision models): shape rules and arithmetic cost.

Tensors are N-D in the source network's own layout (NCHW for convolutions, as ONNX has it); every
dimension is a sympy expression in size symbols (batch, height, width, ...: see ir.symbol). The
rules are merged into edgellm.graph.ops.RULES, so these kinds are ops like any other.

Semantics (the cpu backend is the reference; ONNX's definitions where the name matches):
  conv2d(x[N,C,H,W], w[O,C/g,KH,KW], bias[O]?, residual[N,O,OH,OW]?;
         strides, pads (top, left, bottom, right), dilations, groups, auto_pad, has_bias, act, act_args,
         has_residual)                -> act(conv(x, w) + bias) + residual   (act, residual: fusion)
  relu / sigmoid / tanh / erf / sqrt / exp / neg / hardswish / silu (unary)   element-wise
  gelu(x; approximate 'none'|'tanh'), hardsigmoid(x; alpha, beta) = clip(alpha x + beta, 0, 1),
  clip(x; min, max)
  add / mul / sub / div / pow (a, b)   numpy broadcasting
  maxpool / avgpool(x; kernel, strides, pads, dilations, ceil_mode, count_include_pad, auto_pad)
  global_avgpool(x[N,C,...])            -> [N,C,1,1]   mean over the spatial axes
  linear(x[...,K], w[N,K])              -> [...,N]     (ops.py's rule; x of any rank >= 2)
  matmul(a[...,M,K], b[...,K,N])        -> [...,M,N]   batch axes broadcast
  reshape(x; shape) / transpose(x; perm) / concat(*xs; axis) / expand(x; shape)
  slice(x; starts, ends, axes, steps)   ends clamped to the dimension (ONNX's rule)
  gather(x; axis, index)                index a constant int (the axis is dropped) or list of ints
  softmax(x; axis), layer_norm(x, scale, bias?; axis, eps, has_bias)
  reduce_mean(x; axes, keepdims)
  Fused kinds (graph passes make them from the ops above; edgellm.compiler.passes):
  sdpa(q[...,Sq,D], k[...,Sk,D], v[...,Sk,Dv]; scale) -> [...,Sq,Dv]  softmax(scale q k^T) v
  linear_act(x[...,K], w[N,K], bias[N]?; has_bias, act, act_args) -> act(x @ w.T + bias)   (act: relu, gelu)
  mul_add(a, b, c)                       -> a * b + c   numpy broadcasting (layer scale + residual)
  add_layer_norm(a, b, scale, bias?; axis, eps, has_bias) -> (s, n): s = a + b (same shapes),
                                         n = layer_norm(s)   (a residual add and the next LayerNorm)
  resize(x; out_hw, mode 'nearest'|'linear', coord ('asymmetric'|'half_pixel'|'align_corners'|'pytorch_half_pixel'),
         nearest_mode)                   NCHW, spatial axes only
"""

from __future__ import annotations

from typing import Any

import sympy

from ..errors import GraphError
from .ir import Shape, Tensor

BIG = 2**62  # ONNX slices use huge ends for "to the end"


def _fail(op: str, msg: str) -> GraphError:
    return GraphError(f"op '{op}': {msg}")


def dims_equal(a, b) -> bool:
    """Whether two size expressions are equal for every value of their symbols. sympy.simplify on
    floor/ceiling expressions (every conv output size) takes seconds, so cheap tests go first: the
    same expression, a number, an expanded difference of zero, or a nonzero value at a sample point."""
    a, b = sympy.sympify(a), sympy.sympify(b)
    if a == b:
        return True
    d = a - b
    if d.is_number:
        return d == 0
    d = sympy.expand(d)
    if d == 0:
        return True
    syms = sorted(d.free_symbols, key=lambda s: s.name)
    for k, base in enumerate((7, 64, 225)):
        if d.subs({s: base + 13 * j + k for j, s in enumerate(syms)}) != 0:
            return False
    return sympy.simplify(d) == 0


_eq = dims_equal


def broadcast_shapes(op: str, *shapes: Shape) -> Shape:
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        dims = [s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0]
        d = sympy.Integer(1)
        for x in dims:
            if _eq(x, 1):
                continue
            if _eq(d, 1):
                d = sympy.sympify(x)
            elif not _eq(d, x):
                raise _fail(op, f"shapes {[tuple(s) for s in shapes]} do not broadcast (axis {k}: {d} vs {x})")
        out.append(d)
    return tuple(out)


def _axis(op: str, axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < rank:
        raise _fail(op, f"axis {axis} is out of range for rank {rank}")
    return a


def conv_out(size, k: int, stride: int, pad_total, dilation: int, ceil_mode: bool = False):
    span = size + pad_total - dilation * (k - 1) - 1
    return (sympy.ceiling(span / stride) if ceil_mode else sympy.floor(span / stride)) + 1


def same_pads(size: int, k: int, stride: int, dilation: int, upper: bool) -> tuple[int, int]:
    """auto_pad SAME_UPPER / SAME_LOWER on a concrete size: the output is ceil(size / stride)."""
    out = -(-size // stride)
    total = max((out - 1) * stride + dilation * (k - 1) + 1 - size, 0)
    small = total // 2
    return (small, total - small) if upper else (total - small, small)


def _spatial_out(op: str, x: Tensor, kernel, attrs, ceil_mode=False) -> list:
    strides, dil = attrs["strides"], attrs["dilations"]
    auto = attrs.get("auto_pad", "NOTSET")
    outs = []
    for k, (size, kk) in enumerate(zip(x.shape[2:], kernel)):
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            outs.append(sympy.ceiling(sympy.sympify(size) / strides[k]))
        elif auto == "VALID":
            outs.append(conv_out(size, kk, strides[k], 0, dil[k], ceil_mode))
        else:
            p = attrs["pads"]
            outs.append(conv_out(size, kk, strides[k], p[k] + p[k + len(kernel)], dil[k], ceil_mode))
    for o in outs:
        if o.is_number and o < 1:
            raise _fail(op, f"input '{x.name}' {x.shape} is too small for the kernel {tuple(kernel)}")
    return outs


def _conv2d(op, ins, attrs):
    x, w = ins[0], ins[1]
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise _fail(op, f"conv2d takes NCHW input and OIHW weight, got {x.shape} and {w.shape}")
    g = attrs["groups"]
    if not _eq(x.shape[1], w.shape[1] * g):
        raise _fail(op, f"input '{x.name}' has {x.shape[1]} channels, weight '{w.name}' expects {w.shape[1]}x{g} groups")
    oh, ow = _spatial_out(op, x, [int(w.shape[2]), int(w.shape[3])], attrs)
    out = (x.shape[0], w.shape[0], oh, ow)
    extra = ins[2:]
    if attrs.get("has_bias"):
        b, extra = extra[0], extra[1:]
        if len(b.shape) != 1 or not _eq(b.shape[0], w.shape[0]):
            raise _fail(op, f"bias '{b.name}' has shape {b.shape}, expected [{w.shape[0]}]")
    if attrs.get("has_residual"):
        r = extra[0]
        if len(r.shape) != 4 or not all(_eq(p, q) for p, q in zip(r.shape, out)):
            raise _fail(op, f"residual '{r.name}' has shape {r.shape}, expected {out}")
    return out, x.dtype, None


def _unary(op, ins, attrs):
    return ins[0].shape, ins[0].dtype, None


def _broadcast(op, ins, attrs):
    return broadcast_shapes(op, *[t.shape for t in ins]), ins[0].dtype, None


def _pool(op, ins, attrs):
    (x,) = ins
    if len(x.shape) != 4:
        raise _fail(op, f"pooling takes NCHW input, got '{x.name}' {x.shape}")
    oh, ow = _spatial_out(op, x, attrs["kernel"], attrs, attrs.get("ceil_mode", False))
    return (x.shape[0], x.shape[1], oh, ow), x.dtype, None


def _global_avgpool(op, ins, attrs):
    (x,) = ins
    if len(x.shape) < 3:
        raise _fail(op, f"global pooling needs spatial axes, got '{x.name}' {x.shape}")
    return (*x.shape[:2], *([sympy.Integer(1)] * (len(x.shape) - 2))), x.dtype, None


def _matmul(op, ins, attrs):
    a, b = ins
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise _fail(op, f"matmul of '{a.name}' {a.shape} and '{b.name}' {b.shape}: both need rank >= 2")
    if not _eq(a.shape[-1], b.shape[-2]):
        raise _fail(op, f"matmul: '{a.name}' has {a.shape[-1]} columns, '{b.name}' has {b.shape[-2]} rows")
    batch = broadcast_shapes(op, a.shape[:-2], b.shape[:-2]) if len(a.shape) > 2 or len(b.shape) > 2 else ()
    return (*batch, a.shape[-2], b.shape[-1]), a.dtype, None


def _reshape(op, ins, attrs):
    (x,) = ins
    shape = tuple(sympy.sympify(d) for d in attrs["shape"])
    if not _eq(sympy.Mul(*x.shape), sympy.Mul(*shape)):
        raise _fail(op, f"cannot reshape '{x.name}' {x.shape} to {shape}")
    return shape, x.dtype, None


def _transpose(op, ins, attrs):
    (x,) = ins
    perm = attrs["perm"]
    if sorted(perm) != list(range(len(x.shape))):
        raise _fail(op, f"perm {perm} is not a permutation of the axes of '{x.name}' {x.shape}")
    return tuple(x.shape[p] for p in perm), x.dtype, None


def _concat(op, ins, attrs):
    rank = len(ins[0].shape)
    ax = _axis(op, attrs["axis"], rank)
    for t in ins[1:]:
        if len(t.shape) != rank or not all(_eq(p, q) for k, (p, q) in enumerate(zip(t.shape, ins[0].shape)) if k != ax):
            raise _fail(op, f"cannot concatenate '{t.name}' {t.shape} with '{ins[0].name}' {ins[0].shape} on axis {ax}")
    shape = list(ins[0].shape)
    shape[ax] = sympy.Add(*[t.shape[ax] for t in ins])
    return tuple(shape), ins[0].dtype, None


def slice_bounds(dim, start: int, end: int, step: int):
    """ONNX Slice on one axis of (possibly symbolic) length dim: (start, length) after clamping."""
    dim = sympy.sympify(dim)

    def norm(v, lo, hi):
        if v >= BIG // 2:
            return hi
        if v <= -BIG // 2:
            return lo
        v = dim + v if v < 0 else sympy.Integer(v)
        return sympy.Max(lo, sympy.Min(v, hi))

    if step > 0:
        s, e = norm(start, 0, dim), norm(end, 0, dim)
        n = sympy.ceiling((e - s) / step)
    else:
        s, e = norm(start, 0, dim - 1), norm(end, -1, dim - 1)
        n = sympy.ceiling((s - e) / -step)
    return s, sympy.Max(n, 0)


def _slice(op, ins, attrs):
    (x,) = ins
    shape = list(x.shape)
    for st, en, ax, sp in zip(attrs["starts"], attrs["ends"], attrs["axes"], attrs["steps"]):
        a = _axis(op, ax, len(shape))
        _, n = slice_bounds(shape[a], st, en, sp)
        shape[a] = n
    return tuple(shape), x.dtype, None


def _gather(op, ins, attrs):
    (x,) = ins
    a = _axis(op, attrs["axis"], len(x.shape))
    idx = attrs["index"]
    shape = list(x.shape)
    if isinstance(idx, int):
        del shape[a]
    else:
        shape[a] = sympy.Integer(len(idx))
    return tuple(shape), x.dtype, None


def _expand(op, ins, attrs):
    (x,) = ins
    return broadcast_shapes(op, x.shape, tuple(sympy.sympify(d) for d in attrs["shape"])), x.dtype, None


def _softmax(op, ins, attrs):
    _axis(op, attrs["axis"], len(ins[0].shape))
    return ins[0].shape, ins[0].dtype, None


def _layer_norm(op, ins, attrs):
    x, scale = ins[0], ins[1]
    ax = _axis(op, attrs["axis"], len(x.shape))
    if not all(_eq(p, q) for p, q in zip(scale.shape[::-1], x.shape[ax:][::-1])):
        raise _fail(op, f"layer_norm scale '{scale.name}' {scale.shape} does not match '{x.name}' {x.shape} from axis {ax}")
    return x.shape, x.dtype, None


def _reduce_mean(op, ins, attrs):
    (x,) = ins
    axes = {_axis(op, a, len(x.shape)) for a in attrs["axes"]}
    keep = attrs.get("keepdims", True)
    shape = [(sympy.Integer(1) if k in axes else d) for k, d in enumerate(x.shape) if keep or k not in axes]
    return tuple(shape), x.dtype, None


def _resize(op, ins, attrs):
    (x,) = ins
    if len(x.shape) != 4:
        raise _fail(op, f"resize supports NCHW input, got '{x.name}' {x.shape}")
    if attrs["mode"] not in ("nearest", "linear"):
        raise _fail(op, f"resize mode {attrs['mode']!r} is not supported (nearest, linear)")
    oh, ow = attrs["out_hw"]
    return (x.shape[0], x.shape[1], sympy.sympify(oh), sympy.sympify(ow)), x.dtype, None


def _sdpa(op, ins, attrs):
    q, k, v = ins
    if not (len(q.shape) == len(k.shape) == len(v.shape) >= 2):
        raise _fail(op, f"sdpa: q '{q.name}' {q.shape}, k '{k.name}' {k.shape}, v '{v.name}' {v.shape} need one rank >= 2")
    if not all(_eq(a, b) and _eq(a, c) for a, b, c in zip(q.shape[:-2], k.shape[:-2], v.shape[:-2])):
        raise _fail(op, f"sdpa: batch axes of q '{q.name}' {q.shape}, k '{k.name}' {k.shape}, v '{v.name}' {v.shape} differ")
    if not _eq(q.shape[-1], k.shape[-1]) or not _eq(k.shape[-2], v.shape[-2]):
        raise _fail(op, f"sdpa: q '{q.name}' {q.shape}, k '{k.name}' {k.shape}, v '{v.name}' {v.shape} do not match")
    return (*q.shape[:-1], v.shape[-1]), q.dtype, None


def _add_layer_norm(op, ins, attrs):
    a, b = ins[0], ins[1]
    if len(a.shape) != len(b.shape) or not all(_eq(p, q) for p, q in zip(a.shape, b.shape)):
        raise _fail(op, f"add_layer_norm: '{a.name}' {a.shape} and '{b.name}' {b.shape} differ in shape")
    return _layer_norm(op, [a, *ins[2:]], attrs)


def _linear_act(op, ins, attrs):
    x, w = ins[0], ins[1]
    if len(x.shape) < 2 or len(w.shape) != 2 or not _eq(x.shape[-1], w.shape[1]):
        raise _fail(op, f"linear_act: input '{x.name}' {x.shape} and weight '{w.name}' {w.shape} do not match")
    if attrs.get("has_bias"):
        b = ins[2]
        if len(b.shape) != 1 or not _eq(b.shape[0], w.shape[0]):
            raise _fail(op, f"linear_act: bias '{b.name}' has shape {b.shape}, expected [{w.shape[0]}]")
    if attrs.get("act") not in ("relu", "gelu"):
        raise _fail(op, f"linear_act: act {attrs.get('act')!r} is not one of relu, gelu")
    return (*x.shape[:-1], w.shape[0]), x.dtype, None


UNARY = ("relu", "sigmoid", "tanh", "erf", "sqrt", "exp", "neg", "hardswish", "hardsigmoid", "gelu", "clip")
BINARY = ("add", "mul", "sub", "div", "pow")

ND_RULES: dict[str, Any] = {
    "conv2d": _conv2d,
    **{k: _unary for k in UNARY},
    **{k: _broadcast for k in ("sub", "div", "pow")},
    "maxpool": _pool,
    "avgpool": _pool,
    "global_avgpool": _global_avgpool,
    "matmul": _matmul,
    "reshape": _reshape,
    "transpose": _transpose,
    "concat": _concat,
    "slice": _slice,
    "gather": _gather,
    "expand": _expand,
    "softmax": _softmax,
    "layer_norm": _layer_norm,
    "reduce_mean": _reduce_mean,
    "resize": _resize,
    "sdpa": _sdpa,
    "linear_act": _linear_act,
    "mul_add": _broadcast,
    "add_layer_norm": _add_layer_norm,
}


def nd_flops(kind: str, inputs: list[Tensor], output: Tensor, attrs: dict[str, Any]) -> sympy.Expr | None:
    """Arithmetic operations of the N-D kinds (multiply and add counted separately); None: not one of them."""
    n_out = sympy.Mul(*output.shape)
    if kind == "conv2d":
        w = inputs[1].shape
        return 2 * n_out * w[1] * w[2] * w[3]
    if kind == "matmul":
        return 2 * n_out * inputs[0].shape[-1]
    if kind == "linear_act":
        return 2 * n_out * inputs[1].shape[1] + n_out
    if kind == "sdpa":  # q k^T and p v, plus the softmax
        q, k, v = (t.shape for t in inputs)
        return 2 * sympy.Mul(*q[:-1]) * k[-2] * (q[-1] + v[-1]) + 8 * sympy.Mul(*q[:-1]) * k[-2]
    if kind == "mul_add":
        return 2 * n_out
    if kind == "add_layer_norm":
        return 9 * n_out
    if kind in ("maxpool", "avgpool"):
        return n_out * attrs["kernel"][0] * attrs["kernel"][1]
    if kind == "global_avgpool":
        return sympy.Mul(*inputs[0].shape)
    if kind in UNARY or kind in BINARY or kind in ("softmax", "layer_norm", "reduce_mean"):
        return (8 if kind in ("layer_norm", "softmax") else 1) * n_out
    return None
