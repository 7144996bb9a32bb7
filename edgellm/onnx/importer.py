"""ONNX file -> edgellm Graph (N-D tensors, symbolic shapes) + weights (numpy, memory-mapped where
the file's external data allows).

The `onnx` package parses the protobuf; nothing from the file is executed. Three kinds of nodes:
  - shape arithmetic (Shape, Gather, Concat, ... over shapes and constants) is evaluated here, on
    the host, once: its values are numpy arrays whose elements may be sympy expressions in the
    dynamic dimensions, so a Reshape fed by such a subgraph gets a symbolic target shape
    (Transformer-Lite's way: shape ops on the host, tensor ops on the device);
  - BatchNormalization after a Conv is folded into that Conv's weight and bias;
  - every other node becomes IR ops (edgellm.graph.nd_ops), with its output shape derived by the
    op's rule.
Dynamic input dimensions (dim_param) become size symbols of the same name (ir.symbol).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import sympy

from ..errors import EdgeLLMError, GraphError, ModelFileError
from ..graph.ir import Graph, symbol
from ..graph.nd_ops import BIG, dims_equal


class UnsupportedOpError(EdgeLLMError):
    """The ONNX file uses operators (or operator variants) edgellm has no op for."""


@dataclass
class ImportedModel:
    graph: Graph
    weights: dict[str, np.ndarray]
    inputs: dict[str, tuple]  # ONNX input name -> symbolic shape
    outputs: dict[str, str]  # ONNX output name -> graph tensor name
    symbols: list[str] = field(default_factory=list)  # dynamic dimension names
    path: str = ""
    opset: int = 0


def _sym_name(s: str) -> str:
    n = re.sub(r"\W", "_", s).strip("_") or "dim"
    return n if not n[0].isdigit() else "d" + n


def _load_proto(path: str):
    import onnx

    if not os.path.isfile(path):
        raise ModelFileError(f"{path}: no such file")
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends: say which file, not where protobuf failed
        raise ModelFileError(f"{path}: not a readable ONNX model ({type(e).__name__}: {str(e)[:200]})") from None
    if not model.graph.node or not model.graph.output:
        raise ModelFileError(f"{path}: not an ONNX model (no graph nodes or outputs found)")
    try:
        onnx.checker.check_model(model)
    except Exception as e:
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        if "Field 'shape' of 'type' is required" in msg:  # outputs declared without a shape: we derive them
            return model
        raise ModelFileError(f"{path}: invalid ONNX model: {msg}") from None
    return model


def _initializer_array(t, base_dir: str, path: str) -> np.ndarray:
    import onnx
    from onnx import numpy_helper

    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    shape = tuple(int(d) for d in t.dims)
    if t.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        loc = os.path.realpath(os.path.join(base_dir, info.get("location", "")))
        if not loc.startswith(os.path.realpath(base_dir) + os.sep):
            raise ModelFileError(f"{path}: initializer '{t.name}' points outside the model's folder ({info.get('location')})")
        offset = int(info.get("offset", 0))
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if not os.path.isfile(loc) or os.path.getsize(loc) < offset + n:
            raise ModelFileError(f"{path}: external data of initializer '{t.name}' ({loc}) is missing or truncated")
        return np.memmap(loc, dtype=dtype, mode="r", offset=offset, shape=shape)
    if t.raw_data and dtype != object:
        # a view on the protobuf's bytes: no copy (little-endian, as ONNX stores it)
        return np.frombuffer(t.raw_data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
    return numpy_helper.to_array(t)


def _attrs(node) -> dict[str, Any]:
    import onnx

    out = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode()
        elif a.type == onnx.AttributeProto.TENSOR:
            from onnx import numpy_helper

            v = numpy_helper.to_array(v)
        out[a.name] = v
    return out


def _is_sym(v: np.ndarray) -> bool:
    return v.dtype == object


def _sym_array(values) -> np.ndarray:
    a = np.empty(len(values), dtype=object)
    for k, v in enumerate(values):
        a[k] = sympy.sympify(v)
    return a


def _simplify(a: np.ndarray) -> np.ndarray:
    if not _is_sym(a):
        return a
    out = np.empty(a.shape, dtype=object)
    for idx, v in np.ndenumerate(a):
        v = sympy.sympify(v)
        out[idx] = int(v) if v.is_Integer else v
    if all(isinstance(v, int) for v in out.flat):
        return out.astype(np.int64)
    return out


def _int_div(a, b):
    a, b = sympy.sympify(a), sympy.sympify(b)
    if a.is_Integer and b.is_Integer:
        return sympy.Integer(int(int(a) / int(b)))  # ONNX integer Div truncates
    return sympy.floor(a / b)


class _Importer:
    # ops evaluated on the host when every input is known there (shape arithmetic, constants)
    HOST_ONLY = {"Shape", "Size", "Constant", "ConstantOfShape", "Equal", "Where", "Range", "Cast", "Floor", "Ceil"}

    def __init__(self, model, path: str):
        self.model = model
        self.path = path
        self.base_dir = os.path.dirname(os.path.abspath(path))
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        self.g = Graph(os.path.splitext(os.path.basename(path))[0], {"format": "onnx", "opset": self.opset})
        self.host: dict[str, np.ndarray] = {}
        self.weights: dict[str, np.ndarray] = {}
        self.alias: dict[str, str] = {}  # ONNX value name -> graph tensor (Identity, folded BN)
        self.consumers: dict[str, int] = {}
        self.symbols: list[str] = []

    # -- values -----------------------------------------------------------------------------------
    def name(self, v: str) -> str:
        while v in self.alias:
            v = self.alias[v]
        return v

    def known(self, v: str) -> np.ndarray | None:
        return self.host.get(self.name(v)) if v else None

    def tensor(self, v: str, node) -> str:
        """The graph tensor for ONNX value v; host constants become weights on first use."""
        v = self.name(v)
        if v in self.g.tensors:
            return v
        arr = self.host.get(v)
        if arr is None:
            raise GraphError(f"{self.path}: node '{node.name}' ({node.op_type}) reads '{v}', which nothing produces")
        if _is_sym(arr):
            raise UnsupportedOpError(f"{self.path}: node '{node.name}' ({node.op_type}) uses the shape value '{v}' "
                                     f"as tensor data; only constant data is supported")
        self.weights[v] = arr if arr.dtype == np.float32 else arr.astype(np.float32)
        self.g.weight(v, tuple(sympy.Integer(d) for d in arr.shape), storage="F32", source=v)
        if arr.size == 1:  # a scalar constant: its value is known to the graph passes (graph.meta['scalars'])
            self.g.meta.setdefault("scalars", {})[v] = float(self.weights[v].reshape(-1)[0])
        return v

    def shape_of(self, v: str) -> tuple:
        v = self.name(v)
        if v in self.g.tensors:
            return self.g.tensors[v].shape
        return tuple(sympy.Integer(d) for d in self.host[v].shape)

    def emit(self, kind: str, node, inputs: list[str], out: str | None = None, suffix: str = "", **attrs) -> str:
        out = out if out is not None else node.output[0]
        try:
            return self.g.op(kind, *[self.tensor(i, node) for i in inputs], name=(node.name or out) + suffix,
                             out=out, **attrs)
        except GraphError as e:
            raise GraphError(f"{self.path}: node '{node.name}' ({node.op_type}): {e}") from None

    def _host_int_list(self, v: str, node, what: str) -> list:
        a = self.known(v)
        if a is None:
            raise UnsupportedOpError(f"{self.path}: node '{node.name}' ({node.op_type}): {what} '{v}' is computed from "
                                     f"run-time data; only values known at import are supported")
        return [int(x) if not isinstance(x, sympy.Basic) or x.is_Integer else x for x in a.reshape(-1).tolist()]

    # -- the walk -----------------------------------------------------------------------------------
    def run(self) -> ImportedModel:
        gp = self.model.graph
        for t in gp.initializer:
            self.host[t.name] = _initializer_array(t, self.base_dir, self.path)
        for t in gp.sparse_initializer:
            raise UnsupportedOpError(f"{self.path}: sparse initializer '{t.values.name}' is not supported")
        unsupported = [(n.name or f"#{k}", n.op_type + (f" ({n.domain})" if n.domain not in ("", "ai.onnx") else ""))
                       for k, n in enumerate(gp.node)
                       if n.domain not in ("", "ai.onnx") or (n.op_type not in CONVERTERS and n.op_type not in HOST_EVAL)]
        if unsupported:
            kinds = sorted({k for _, k in unsupported})
            listed = ", ".join(f"{n} ({k})" for n, k in unsupported)
            raise UnsupportedOpError(f"{self.path}: {len(unsupported)} node(s) use unsupported operators "
                                     f"{kinds}: {listed}")
        inputs = {}
        for vi in gp.input:
            if vi.name in self.host:
                continue  # an initializer listed as input (older exporters): a constant
            tt = vi.type.tensor_type
            if tt.elem_type != 1:  # FLOAT
                raise UnsupportedOpError(f"{self.path}: input '{vi.name}' has element type {tt.elem_type}; "
                                         f"only float32 inputs are supported")
            dims = []
            for k, d in enumerate(tt.shape.dim):
                if d.HasField("dim_value") and d.dim_value > 0:
                    dims.append(sympy.Integer(d.dim_value))
                else:
                    nm = _sym_name(d.dim_param) if d.dim_param else _sym_name(f"{vi.name}_{k}")
                    if nm not in self.symbols:
                        self.symbols.append(nm)
                    dims.append(symbol(nm))
            inputs[vi.name] = tuple(dims)
            self.g.input(vi.name, tuple(dims), dtype="f32")
        for n in gp.node:
            for i in n.input:
                if i:
                    self.consumers[i] = self.consumers.get(i, 0) + 1
        for o in gp.output:
            self.consumers[o.name] = self.consumers.get(o.name, 0) + 1
        for node in gp.node:
            self.convert(node)
        self.recompose_gelu()
        outputs = {}
        for o in gp.output:
            t = self.name(o.name)
            if t not in self.g.tensors or self.g.tensors[t].kind != "activation":
                raise UnsupportedOpError(f"{self.path}: output '{o.name}' is not computed from the inputs "
                                         f"(a constant or an input); not supported")
            if t in self.g.outputs:
                raise UnsupportedOpError(f"{self.path}: outputs share the tensor '{t}'")
            self.g.output(t)
            outputs[o.name] = t
        self.g.validate()
        return ImportedModel(self.g, self.weights, inputs, outputs, self.symbols, self.path, self.opset)

    def _scalar(self, t: str, value: float) -> bool:
        a = self.weights.get(t)
        return a is not None and a.size == 1 and abs(float(a.reshape(-1)[0]) - value) < 1e-6 * max(1.0, abs(value))

    def recompose_gelu(self) -> None:
        """Exporters write GELU as x * (1 + erf(x / sqrt 2)) * 0.5 (five ops); it is one op here (one
        kernel on the device). Needs the constants' values, so it happens at import, not in a pass."""
        g = self.g
        cons: dict[str, list[int]] = {}
        for i, op in enumerate(g.ops):
            for t in op.inputs:
                cons.setdefault(t, []).append(i)

        def only(t, kind):
            c = cons.get(t, [])
            return c[0] if len(c) == 1 and g.ops[c[0]].kind == kind and t not in g.outputs else None

        drop: set[int] = set()
        for i, d in enumerate(g.ops):
            if d.kind != "div" or len(d.inputs) != 2 or not self._scalar(d.inputs[1], 2 ** 0.5):
                continue
            x = d.inputs[0]
            e = only(d.outputs[0], "erf")
            a = only(g.ops[e].outputs[0], "add") if e is not None else None
            if a is None or not any(self._scalar(t, 1.0) for t in g.ops[a].inputs):
                continue
            m1 = only(g.ops[a].outputs[0], "mul")
            if m1 is None or x not in g.ops[m1].inputs:
                continue
            m2 = only(g.ops[m1].outputs[0], "mul")
            if m2 is None or not any(self._scalar(t, 0.5) for t in g.ops[m2].inputs):
                continue
            last = g.ops[m2]
            g.ops[m2] = type(last)(last.name + "+gelu", "gelu", (x,), last.outputs, {"approximate": "none"})
            drop.update((i, e, a, m1))
        if drop:
            g.ops = [op for k, op in enumerate(g.ops) if k not in drop]
            used = {t for op in g.ops for t in op.inputs} | {t for op in g.ops for t in op.outputs}
            for name in [n for n, t in g.tensors.items() if n not in used and t.kind in ("activation", "weight")]:
                del g.tensors[name]
                self.weights.pop(name, None)

    def convert(self, node) -> None:
        ins = list(node.input)
        host_ins = [self.known(i) if i else None for i in ins]
        foldable = node.op_type in HOST_EVAL and all(h is not None for i, h in zip(ins, host_ins) if i)
        if node.op_type in ("Shape", "Size") and ins and self.name(ins[0]) in self.g.tensors:
            foldable = True
        if foldable:
            try:
                results = HOST_EVAL[node.op_type](self, node, host_ins, _attrs(node))
            except _NotOnHost:
                results = None
            if results is not None:
                for o, r in zip(node.output, results):
                    self.host[o] = _simplify(np.asarray(r) if not isinstance(r, np.ndarray) else r)
                return
        conv = CONVERTERS.get(node.op_type)
        if conv is None:
            raise UnsupportedOpError(f"{self.path}: node '{node.name}' ({node.op_type}) computes on run-time data; "
                                     f"edgellm supports it only on shapes and constants known at import")
        conv(self, node, _attrs(node))


class _NotOnHost(Exception):
    """A host evaluation that needs run-time sizes (e.g. Expand to a symbolic batch): emit an op."""


# -- host evaluation (shape subgraphs, constants) ---------------------------------------------------

def _h_shape(im, node, h, a):
    shp = im.shape_of(node.input[0])
    start, end = a.get("start", 0), a.get("end", None)
    return [_sym_array(shp[start:end])]


def _h_binary(fn):
    def ev(im, node, h, a):
        x, y = h
        if _is_sym(x) or _is_sym(y):
            x, y = x.astype(object), y.astype(object)
            if node.op_type == "Div" and not (np.issubdtype(h[0].dtype, np.floating) or np.issubdtype(h[1].dtype, np.floating)):
                return [np.vectorize(_int_div, otypes=[object])(x, y)]
            return [np.vectorize(fn, otypes=[object])(x, y)]
        if node.op_type == "Div" and np.issubdtype(x.dtype, np.integer) and np.issubdtype(y.dtype, np.integer):
            return [np.trunc(x / y).astype(x.dtype)]
        return [np.asarray(fn(x, y)).astype(np.result_type(x, y))]
    return ev


def _h_equal(im, node, h, a):
    x, y = np.broadcast_arrays(h[0].astype(object), h[1].astype(object))
    out = np.empty(x.shape, dtype=bool)
    for idx in np.ndindex(x.shape):
        a, b = sympy.sympify(x[idx]), sympy.sympify(y[idx])
        if dims_equal(a, b):
            out[idx] = True
        elif (a - b).is_number or (a - b).is_nonzero:
            out[idx] = False
        else:  # e.g. batch == 2: true for some sizes only, so not decidable at import
            raise _NotOnHost()
    return [out]


def _h_gather(im, node, h, a):
    return [np.take(h[0], h[1].astype(np.int64), axis=a.get("axis", 0))]


def _h_concat(im, node, h, a):
    arrs = [x for x in h if x is not None]
    if any(_is_sym(x) for x in arrs):
        arrs = [x.astype(object) for x in arrs]
    return [np.concatenate(arrs, axis=a["axis"])]


def _axes(im, node, h, a, k=1):
    if len(node.input) > k and node.input[k]:
        return [int(x) for x in h[k].reshape(-1)]
    return list(a.get("axes", []))


def _h_unsqueeze(im, node, h, a):
    x = h[0]
    axes = sorted(ax % (x.ndim + len(_axes(im, node, h, a))) for ax in _axes(im, node, h, a))
    for ax in axes:
        x = np.expand_dims(x, ax)
    return [x]


def _h_squeeze(im, node, h, a):
    axes = _axes(im, node, h, a)
    return [np.squeeze(h[0], axis=tuple(axes) if axes else None)]


def _h_slice(im, node, h, a):
    x = h[0]
    starts, ends = [int(v) for v in h[1]], [int(v) for v in h[2]]
    axes = [int(v) for v in h[3]] if len(h) > 3 and h[3] is not None else list(range(len(starts)))
    steps = [int(v) for v in h[4]] if len(h) > 4 and h[4] is not None else [1] * len(starts)
    idx = [slice(None)] * x.ndim
    for s, e, ax, st in zip(starts, ends, axes, steps):
        idx[ax % x.ndim] = slice(s, None if (st > 0 and e >= BIG // 2) or (st < 0 and e <= -BIG // 2) else e, st)
    return [x[tuple(idx)]]


def _h_cast(im, node, h, a):
    import onnx

    dt = onnx.helper.tensor_dtype_to_np_dtype(a["to"])
    if _is_sym(h[0]):
        if np.issubdtype(dt, np.integer):
            return [h[0]]
        raise _NotOnHost()
    return [h[0].astype(dt)]


def _h_constant(im, node, h, a):
    if "value" in a:
        return [np.asarray(a["value"])]
    for k, dt in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64),
                  ("value_ints", np.int64)):
        if k in a:
            return [np.asarray(a[k], dtype=dt)]
    raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Constant) has no supported value attribute")


def _h_constant_of_shape(im, node, h, a):
    shape = h[0].reshape(-1).tolist()
    if any(isinstance(d, sympy.Basic) and not d.is_Integer for d in shape):
        raise _NotOnHost()
    v = a.get("value", np.zeros(1, dtype=np.float32))
    return [np.full([int(d) for d in shape], v.reshape(-1)[0], dtype=v.dtype)]


def _h_where(im, node, h, a):
    c, x, y = h
    if _is_sym(x) or _is_sym(y):
        x, y = x.astype(object), y.astype(object)
    return [np.where(c.astype(bool), x, y)]


def _h_reshape(im, node, h, a):
    if _is_sym(h[1]):
        raise _NotOnHost()
    shape = [int(d) for d in h[1]]
    shape = [h[0].shape[k] if d == 0 and not a.get("allowzero") else d for k, d in enumerate(shape)]
    return [h[0].reshape(shape)]


def _h_expand(im, node, h, a):
    if _is_sym(h[1]):
        raise _NotOnHost()
    shape = np.broadcast_shapes(h[0].shape, tuple(int(d) for d in h[1]))
    return [np.broadcast_to(h[0], shape).copy()]


def _h_range(im, node, h, a):
    s, l, d = (x.reshape(-1)[0] for x in h)
    if any(isinstance(v, sympy.Basic) and not v.is_number for v in (s, l, d)):
        raise _NotOnHost()
    return [np.arange(s, l, d, dtype=h[0].dtype)]


def _h_unary(fn):
    def ev(im, node, h, a):
        if _is_sym(h[0]):
            raise _NotOnHost()
        return [fn(h[0]).astype(h[0].dtype)]
    return ev


def _h_transpose(im, node, h, a):
    return [np.transpose(h[0], a.get("perm"))]


HOST_EVAL: dict[str, Callable] = {
    "Shape": _h_shape,
    "Size": lambda im, node, h, a: [np.asarray(sympy.Mul(*im.shape_of(node.input[0])), dtype=object)],
    "Constant": _h_constant,
    "ConstantOfShape": _h_constant_of_shape,
    "Gather": _h_gather,
    "Concat": _h_concat,
    "Unsqueeze": _h_unsqueeze,
    "Squeeze": _h_squeeze,
    "Slice": _h_slice,
    "Cast": _h_cast,
    "Add": _h_binary(lambda x, y: x + y),
    "Sub": _h_binary(lambda x, y: x - y),
    "Mul": _h_binary(lambda x, y: x * y),
    "Div": _h_binary(lambda x, y: x / y),
    "Mod": _h_binary(lambda x, y: sympy.Mod(x, y) if isinstance(x, sympy.Basic) or isinstance(y, sympy.Basic)
                     else np.mod(x, y)),
    "Equal": _h_equal,
    "Where": _h_where,
    "Reshape": _h_reshape,
    "Expand": _h_expand,
    "Range": _h_range,
    "Identity": lambda im, node, h, a: [h[0]],
    "Transpose": _h_transpose,
    "Sqrt": _h_unary(np.sqrt),
    "Floor": _h_unary(np.floor),
    "Ceil": _h_unary(np.ceil),
    "Neg": _h_unary(np.negative),
}


# -- converters: ONNX node -> IR ops ----------------------------------------------------------------

def _c_identity(im, node, a):
    im.alias[node.output[0]] = im.name(node.input[0])


def _c_dropout(im, node, a):
    if len(node.output) > 1 and node.output[1] and im.consumers.get(node.output[1]):
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Dropout): its mask output is used; not supported")
    _c_identity(im, node, a)


def _c_cast(im, node, a):
    if a["to"] != 1:
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Cast) to element type {a['to']} on run-time data; "
                                 f"only float32 tensors are supported")
    _c_identity(im, node, a)


def _two_d(im, node, name, vals, default):
    v = list(vals) if vals is not None else list(default)
    if len(v) != len(default):
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' ({node.op_type}): {name} {v} — only 2-D spatial ops "
                                 f"(NCHW) are supported")
    return tuple(int(x) for x in v)


def _spatial_attrs(im, node, a, kernel) -> dict:
    return {
        "strides": _two_d(im, node, "strides", a.get("strides"), (1, 1)),
        "pads": _two_d(im, node, "pads", a.get("pads"), (0, 0, 0, 0)),
        "dilations": _two_d(im, node, "dilations", a.get("dilations"), (1, 1)),
        "auto_pad": a.get("auto_pad", "NOTSET"),
        "kernel": kernel,
    }


def _c_conv(im, node, a):
    wshape = im.shape_of(node.input[1])
    if len(wshape) != 4:
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Conv) is {len(wshape) - 2}-D; only 2-D convolution "
                                 f"is supported")
    attrs = _spatial_attrs(im, node, a, (int(wshape[2]), int(wshape[3])))
    del attrs["kernel"]
    ins = [node.input[0], node.input[1]]
    has_bias = len(node.input) > 2 and bool(node.input[2])
    if has_bias:
        ins.append(node.input[2])
    im.emit("conv2d", node, ins, groups=int(a.get("group", 1)), has_bias=has_bias, **attrs)


def _c_batchnorm(im, node, a):
    x, scale, bias, mean, var = node.input[:5]
    eps = float(a.get("epsilon", 1e-5))
    consts = [im.known(v) for v in (scale, bias, mean, var)]
    if any(c is None for c in consts):
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (BatchNormalization) with run-time statistics "
                                 f"(training mode) is not supported")
    gamma, beta, mu, sigma2 = (c.astype(np.float64) for c in consts)
    s = gamma / np.sqrt(sigma2 + eps)
    shift = beta - mu * s
    src = im.name(x)
    prod = im.g.producers().get(src)
    conv = im.g.ops[prod] if prod is not None else None
    w_name = conv.inputs[1] if conv is not None and conv.kind == "conv2d" else None
    if (conv is not None and conv.kind == "conv2d" and im.consumers.get(x, 0) == 1 and w_name in im.weights
            and conv.outputs[0] not in im.g.outputs and not conv.attrs.get("act")):
        # fold: w' = w * s (per output channel), b' = (b - mean) * s + beta
        w = im.weights[w_name].astype(np.float64)
        b = im.weights[conv.inputs[2]].astype(np.float64) if conv.attrs.get("has_bias") else np.zeros(w.shape[0])
        new_w, new_b = f"{w_name}:bn:{node.output[0]}", f"{conv.name}.bias:bn:{node.output[0]}"
        im.host[new_w] = (w * s[:, None, None, None]).astype(np.float32)
        im.host[new_b] = (b * s + shift).astype(np.float32)
        conv.inputs = (conv.inputs[0], im.tensor(new_w, node), im.tensor(new_b, node))
        conv.attrs["has_bias"] = True
        im.alias[node.output[0]] = conv.outputs[0]
        return
    rank = len(im.shape_of(x))
    cshape = (-1,) + (1,) * (rank - 2)
    im.host[node.output[0] + ":scale"] = s.astype(np.float32).reshape(cshape)
    im.host[node.output[0] + ":shift"] = shift.astype(np.float32).reshape(cshape)
    t = im.emit("mul", node, [x, node.output[0] + ":scale"], out=node.output[0] + ":scaled", suffix=":scale")
    im.emit("add", node, [t, node.output[0] + ":shift"])


def _c_unary(kind, **fixed):
    def conv(im, node, a):
        attrs = dict(fixed)
        if kind == "hardsigmoid":
            attrs = {"alpha": float(a.get("alpha", 0.2)), "beta": float(a.get("beta", 0.5))}
        if kind == "gelu":
            attrs = {"approximate": a.get("approximate", "none")}
        im.emit(kind, node, [node.input[0]], **attrs)
    return conv


def _c_clip(im, node, a):
    lo, hi = a.get("min"), a.get("max")
    if len(node.input) > 1 and node.input[1]:
        v = im.known(node.input[1])
        if v is None:
            raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Clip): run-time min is not supported")
        lo = float(v.reshape(-1)[0])
    if len(node.input) > 2 and node.input[2]:
        v = im.known(node.input[2])
        if v is None:
            raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Clip): run-time max is not supported")
        hi = float(v.reshape(-1)[0])
    im.emit("clip", node, [node.input[0]], min=None if lo is None else float(lo), max=None if hi is None else float(hi))


def _c_binary(kind):
    def conv(im, node, a):
        im.emit(kind, node, [node.input[0], node.input[1]])
    return conv


def _c_pool(kind):
    def conv(im, node, a):
        if len(node.output) > 1 and node.output[1] and im.consumers.get(node.output[1]):
            raise UnsupportedOpError(f"{im.path}: node '{node.name}' ({node.op_type}): the indices output is not supported")
        kernel = _two_d(im, node, "kernel_shape", a.get("kernel_shape"), (1, 1))
        attrs = _spatial_attrs(im, node, a, kernel)
        if kind == "avgpool" and attrs["dilations"] != (1, 1):  # opset 19's dilated average pooling
            raise UnsupportedOpError(f"{im.path}: node '{node.name}' (AveragePool) with dilations "
                                     f"{attrs['dilations']} is not supported (only 1, 1)")
        im.emit(kind, node, [node.input[0]], ceil_mode=bool(a.get("ceil_mode", 0)),
                count_include_pad=bool(a.get("count_include_pad", 0)), **attrs)
    return conv


def _c_gemm(im, node, a):
    A, B = node.input[0], node.input[1]
    if a.get("transA", 0):
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Gemm) with transA=1 is not supported")
    alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
    wb = im.known(B)
    if wb is None:
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Gemm) with a run-time B is not supported")
    w = wb if a.get("transB", 0) else wb.T
    if alpha != 1.0:
        w = w * alpha
    wname = im.name(B) if a.get("transB", 0) and alpha == 1.0 else f"{B}:gemm:{node.name}"
    if wname not in im.host:
        im.host[wname] = np.ascontiguousarray(w, dtype=np.float32)
    has_c = len(node.input) > 2 and bool(node.input[2])
    y = im.emit("linear", node, [A, wname], out=node.output[0] + (":mm" if has_c else ""))
    if has_c:
        c = im.known(node.input[2])
        cname = node.input[2]
        if c is not None and beta != 1.0:
            cname = f"{node.input[2]}:beta:{node.name}"
            im.host[cname] = (c * beta).astype(np.float32)
        im.emit("add", node, [y, cname], suffix=":bias")


def _c_matmul(im, node, a):
    wb = im.known(node.input[1])
    if wb is not None and wb.ndim == 2 and im.known(node.input[0]) is None:
        # a constant right operand: a linear layer, weight stored [N, K] as linear wants
        wname = f"{node.input[1]}:T"
        if wname not in im.host:
            im.host[wname] = np.ascontiguousarray(wb.T, dtype=np.float32)
        im.emit("linear", node, [node.input[0], wname])
        return
    im.emit("matmul", node, [node.input[0], node.input[1]])


def _resolve_reshape(im, node, in_shape, target) -> tuple:
    out = []
    for k, d in enumerate(target):
        out.append(in_shape[k] if (isinstance(d, int) and d == 0) else d)
    if sum(1 for d in out if isinstance(d, int) and d == -1) > 1:
        raise GraphError(f"{im.path}: node '{node.name}' (Reshape): more than one -1 in {target}")
    if any(isinstance(d, int) and d == -1 for d in out):
        known = sympy.Mul(*[sympy.sympify(d) for d in out if not (isinstance(d, int) and d == -1)])
        rest = sympy.Mul(*in_shape) / known
        out = [rest if (isinstance(d, int) and d == -1) else d for d in out]
    return tuple(sympy.sympify(d) for d in out)


def _c_reshape(im, node, a):
    target = im._host_int_list(node.input[1], node, "the target shape")
    im.emit("reshape", node, [node.input[0]], shape=_resolve_reshape(im, node, im.shape_of(node.input[0]), target))


def _c_flatten(im, node, a):
    shp = im.shape_of(node.input[0])
    ax = int(a.get("axis", 1)) % (len(shp) + 1) if shp else 0
    im.emit("reshape", node, [node.input[0]], shape=(sympy.Mul(*shp[:ax]), sympy.Mul(*shp[ax:])))


def _c_squeeze(im, node, a):
    shp = im.shape_of(node.input[0])
    if len(node.input) > 1 and node.input[1]:
        axes = im._host_int_list(node.input[1], node, "the axes")
    else:
        axes = list(a.get("axes", []))
    axes = {ax % len(shp) for ax in axes} if axes else {k for k, d in enumerate(shp) if d == 1}
    im.emit("reshape", node, [node.input[0]], shape=tuple(d for k, d in enumerate(shp) if k not in axes))


def _c_unsqueeze(im, node, a):
    shp = list(im.shape_of(node.input[0]))
    if len(node.input) > 1 and node.input[1]:
        axes = im._host_int_list(node.input[1], node, "the axes")
    else:
        axes = list(a.get("axes", []))
    rank = len(shp) + len(axes)
    for ax in sorted(ax % rank for ax in axes):
        shp.insert(ax, sympy.Integer(1))
    im.emit("reshape", node, [node.input[0]], shape=tuple(shp))


def _c_transpose(im, node, a):
    rank = len(im.shape_of(node.input[0]))
    perm = tuple(int(p) for p in a.get("perm", list(range(rank))[::-1]))
    im.emit("transpose", node, [node.input[0]], perm=perm)


def _c_concat(im, node, a):
    rank = len(im.shape_of(node.input[0]))
    im.emit("concat", node, [i for i in node.input if i], axis=int(a["axis"]) % rank)


def _c_split(im, node, a):
    shp = im.shape_of(node.input[0])
    ax = int(a.get("axis", 0)) % len(shp)
    if len(node.input) > 1 and node.input[1]:
        sizes = im._host_int_list(node.input[1], node, "the split sizes")
    elif "split" in a:
        sizes = list(a["split"])
    else:
        n = len(node.output)
        if not shp[ax].is_Integer:
            raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Split) of a dynamic axis into equal parts")
        d = int(shp[ax])
        part = -(-d // n)
        sizes = [min(part, d - k * part) for k in range(n)]
    start = 0
    for out, size in zip(node.output, sizes):
        im.emit("slice", node, [node.input[0]], out=out, suffix=f":{out}", starts=(start,), ends=(start + size,),
                axes=(ax,), steps=(1,))
        start += size


def _c_slice(im, node, a):
    starts = im._host_int_list(node.input[1], node, "the starts")
    ends = im._host_int_list(node.input[2], node, "the ends")
    rank = len(im.shape_of(node.input[0]))
    axes = im._host_int_list(node.input[3], node, "the axes") if len(node.input) > 3 and node.input[3] \
        else list(range(len(starts)))
    steps = im._host_int_list(node.input[4], node, "the steps") if len(node.input) > 4 and node.input[4] \
        else [1] * len(starts)
    if any(not isinstance(v, int) for v in starts + ends + steps):
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Slice) with bounds that depend on dynamic sizes")
    im.emit("slice", node, [node.input[0]], starts=tuple(starts), ends=tuple(ends),
            axes=tuple(ax % rank for ax in axes), steps=tuple(steps))


def _c_gather(im, node, a):
    idx = im.known(node.input[1])
    if idx is None or _is_sym(idx):
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Gather) with run-time indices is not supported")
    rank = len(im.shape_of(node.input[0]))
    ax = int(a.get("axis", 0)) % rank
    dim = im.shape_of(node.input[0])[ax]
    if idx.ndim == 0:
        i = int(idx)
        if i < 0:
            if not dim.is_Integer:
                raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Gather): negative index on a dynamic axis")
            i += int(dim)
        im.emit("gather", node, [node.input[0]], axis=ax, index=i)
    elif idx.ndim == 1:
        if (idx < 0).any() and not dim.is_Integer:
            raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Gather): negative index on a dynamic axis")
        vals = [int(v) + (int(dim) if v < 0 else 0) for v in idx]
        im.emit("gather", node, [node.input[0]], axis=ax, index=vals)
    else:
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Gather) with {idx.ndim}-D indices is not supported")


def _c_expand(im, node, a):
    shape = im._host_int_list(node.input[1], node, "the shape")
    im.emit("expand", node, [node.input[0]], shape=tuple(sympy.sympify(d) for d in shape))


def _c_softmax(im, node, a):
    rank = len(im.shape_of(node.input[0]))
    default = -1 if im.opset >= 13 else 1
    ax = int(a.get("axis", default)) % rank
    if im.opset < 13 and ax != rank - 1:
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Softmax, opset {im.opset}) over axes {ax}.. is not supported")
    im.emit("softmax", node, [node.input[0]], axis=ax)


def _c_layernorm(im, node, a):
    rank = len(im.shape_of(node.input[0]))
    has_bias = len(node.input) > 2 and bool(node.input[2])
    if len(node.output) > 1 and any(o and im.consumers.get(o) for o in node.output[1:]):
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (LayerNormalization): mean/inv-std outputs not supported")
    im.emit("layer_norm", node, [i for i in node.input[:3] if i], axis=int(a.get("axis", -1)) % rank,
            eps=float(a.get("epsilon", 1e-5)), has_bias=has_bias)


def _c_reduce_mean(im, node, a):
    rank = len(im.shape_of(node.input[0]))
    if len(node.input) > 1 and node.input[1]:
        axes = im._host_int_list(node.input[1], node, "the axes")
    else:
        axes = list(a.get("axes", []))
    if not axes:
        if a.get("noop_with_empty_axes", 0):
            return _c_identity(im, node, a)
        axes = list(range(rank))
    im.emit("reduce_mean", node, [node.input[0]], axes=tuple(sorted(ax % rank for ax in axes)),
            keepdims=bool(a.get("keepdims", 1)))


def _c_resize(im, node, a):
    shp = im.shape_of(node.input[0])
    if len(shp) != 4:
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Resize) of a rank-{len(shp)} tensor; only NCHW")
    scales = im.known(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    sizes = im.known(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    if scales is not None and scales.size == 0:
        scales = None
    scale_hw = None
    if sizes is not None and sizes.size:
        s = sizes.reshape(-1).tolist()
        out_hw = (sympy.sympify(s[2]), sympy.sympify(s[3]))
    elif scales is not None:
        sc = [float(v) for v in scales.reshape(-1)]
        if sc[0] != 1 or sc[1] != 1:
            raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Resize) scales batch or channels ({sc})")
        scale_hw = (sc[2], sc[3])
        out_hw = tuple(sympy.floor(shp[2 + k] * sympy.Rational(str(sc[2 + k]))) for k in range(2))
    else:
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Resize) without constant scales or sizes")
    mode = a.get("mode", "nearest")
    coord = a.get("coordinate_transformation_mode", "half_pixel")
    if coord not in ("half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"):
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Resize) coordinate mode {coord!r} is not supported")
    if mode not in ("nearest", "linear"):
        raise UnsupportedOpError(f"{im.path}: node '{node.name}' (Resize) mode {mode!r} is not supported")
    im.emit("resize", node, [node.input[0]], out_hw=out_hw, mode=mode, coord=coord, scale_hw=scale_hw,
            nearest_mode=a.get("nearest_mode", "round_prefer_floor"))


def _c_global_avgpool(im, node, a):
    im.emit("global_avgpool", node, [node.input[0]])


CONVERTERS: dict[str, Callable] = {
    "Identity": _c_identity,
    "Dropout": _c_dropout,
    "Cast": _c_cast,
    "Conv": _c_conv,
    "BatchNormalization": _c_batchnorm,
    "Relu": _c_unary("relu"),
    "Sigmoid": _c_unary("sigmoid"),
    "Tanh": _c_unary("tanh"),
    "Erf": _c_unary("erf"),
    "Sqrt": _c_unary("sqrt"),
    "Exp": _c_unary("exp"),
    "Neg": _c_unary("neg"),
    "HardSwish": _c_unary("hardswish"),
    "HardSigmoid": _c_unary("hardsigmoid"),
    "Gelu": _c_unary("gelu"),
    "Clip": _c_clip,
    "Add": _c_binary("add"),
    "Mul": _c_binary("mul"),
    "Sub": _c_binary("sub"),
    "Div": _c_binary("div"),
    "Pow": _c_binary("pow"),
    "MaxPool": _c_pool("maxpool"),
    "AveragePool": _c_pool("avgpool"),
    "GlobalAveragePool": _c_global_avgpool,
    "Gemm": _c_gemm,
    "MatMul": _c_matmul,
    "Reshape": _c_reshape,
    "Flatten": _c_flatten,
    "Squeeze": _c_squeeze,
    "Unsqueeze": _c_unsqueeze,
    "Transpose": _c_transpose,
    "Concat": _c_concat,
    "Split": _c_split,
    "Slice": _c_slice,
    "Gather": _c_gather,
    "Expand": _c_expand,
    "Softmax": _c_softmax,
    "LayerNormalization": _c_layernorm,
    "ReduceMean": _c_reduce_mean,
    "Resize": _c_resize,
}


def import_onnx(path: str | os.PathLike) -> ImportedModel:
    """Read an ONNX file into a Graph and its weights. Raises ModelFileError for unreadable or
    invalid files and UnsupportedOpError listing every node whose operator edgellm lacks."""
    path = str(path)
    return _Importer(_load_proto(path), path).run()
