"""Reference kernels of the N-D op kinds (edgellm.graph.nd_ops): torch, float32, any device.

Each kernel is f(op, inputs) -> output (a tuple for a kind with several outputs), merged into the cpu backend's kernel table. They are
written against torch tensors only, so the cuda backend reuses them on device tensors for the
layout ops it has no Triton kernel for.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..graph.ir import Op


def _hardsigmoid(x: torch.Tensor, alpha: float = 1 / 6, beta: float = 0.5) -> torch.Tensor:
    return (alpha * x + beta).clamp(0.0, 1.0)


# activation name -> f(x, **args); shared by the unfused kinds and conv2d's fused epilogue
ACTIVATIONS: dict[str, Callable] = {
    "relu": lambda x: torch.relu(x),
    "sigmoid": lambda x: torch.sigmoid(x),
    "tanh": lambda x: torch.tanh(x),
    "silu": lambda x: F.silu(x),
    "hardswish": lambda x: F.hardswish(x),
    "hardsigmoid": _hardsigmoid,
    "gelu": lambda x, approximate="none": F.gelu(x, approximate=approximate),
    "clip": lambda x, min=None, max=None: x.clamp(min, max),
}


def activate(x: torch.Tensor, act: str | None, args: dict | None) -> torch.Tensor:
    return x if act is None else ACTIVATIONS[act](x, **(args or {}))


def spatial_pads(a: dict, size: tuple[int, int], kernel: tuple[int, int]) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) for concrete spatial sizes, auto_pad resolved."""
    auto = a.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        from ..graph.nd_ops import same_pads  # with sympy: not imported on a language model's path

        (t, b), (l, r) = (same_pads(size[k], kernel[k], a["strides"][k], a["dilations"][k], auto == "SAME_UPPER")
                          for k in range(2))
        return t, l, b, r
    if auto == "VALID":
        return 0, 0, 0, 0
    return tuple(a["pads"])


def _conv2d(op: Op, i: list) -> torch.Tensor:
    a = op.attrs
    x, w = i[0], i[1]
    k = 2
    bias = None
    if a.get("has_bias"):
        bias, k = i[2], 3
    t, l, b, r = spatial_pads(a, tuple(x.shape[2:]), tuple(w.shape[2:]))
    if (t, l) == (b, r):
        y = F.conv2d(x, w, bias, a["strides"], (t, l), a["dilations"], a["groups"])
    else:
        y = F.conv2d(F.pad(x, (l, r, t, b)), w, bias, a["strides"], 0, a["dilations"], a["groups"])
    y = activate(y, a.get("act"), a.get("act_args"))
    if a.get("has_residual"):
        y = activate(y + i[k], a.get("res_act"), a.get("res_act_args"))
    return y


def _pool(op: Op, i: list) -> torch.Tensor:
    a, x = op.attrs, i[0]
    kh, kw = a["kernel"]
    t, l, b, r = spatial_pads(a, tuple(x.shape[2:]), (kh, kw))
    ceil = a.get("ceil_mode", False)
    if op.kind == "maxpool":
        xp = F.pad(x, (l, r, t, b), value=float("-inf"))
        return F.max_pool2d(xp, (kh, kw), a["strides"], 0, a["dilations"], ceil_mode=ceil)
    if a.get("count_include_pad", False):
        return F.avg_pool2d(F.pad(x, (l, r, t, b)), (kh, kw), a["strides"], 0, ceil_mode=ceil, count_include_pad=True)
    # the divisor counts only real elements: pool the values and a mask of ones, then divide
    xp = F.pad(x, (l, r, t, b))
    ones = F.pad(torch.ones_like(x[:1, :1]), (l, r, t, b))
    s = F.avg_pool2d(xp, (kh, kw), a["strides"], 0, ceil_mode=ceil, divisor_override=1)
    n = F.avg_pool2d(ones, (kh, kw), a["strides"], 0, ceil_mode=ceil, divisor_override=1)
    return s / n


def _slice(op: Op, i: list) -> torch.Tensor:
    from ..graph.nd_ops import slice_bounds  # with sympy: not imported on a language model's path

    x = i[0]
    a = op.attrs
    for st, en, ax, sp in zip(a["starts"], a["ends"], a["axes"], a["steps"]):
        ax = ax % x.dim()
        s, n = (int(v) for v in slice_bounds(x.shape[ax], st, en, sp))
        if sp > 0:
            x = x.narrow(ax, s, n) if sp == 1 else x.narrow(ax, s, (n - 1) * sp + 1 if n else 0)[
                (slice(None),) * ax + (slice(None, None, sp),)]
        else:
            idx = torch.arange(s, s + sp * n, sp, device=x.device) if n else torch.empty(0, dtype=torch.long)
            x = x.index_select(ax, idx)
    return x


def _gather(op: Op, i: list) -> torch.Tensor:
    idx, ax = op.attrs["index"], op.attrs["axis"]
    if isinstance(idx, int):
        return i[0].select(ax, idx)
    return i[0].index_select(ax % i[0].dim(), torch.tensor(idx, device=i[0].device))


def _layer_norm(op: Op, i: list) -> torch.Tensor:
    x, scale = i[0], i[1]
    ax = op.attrs["axis"] % x.dim()
    return F.layer_norm(x, tuple(x.shape[ax:]), scale, i[2] if op.attrs.get("has_bias") else None, op.attrs["eps"])


def resize_tables(a: dict, h: int, w: int, device=None) -> tuple:
    """Resize's source rows and columns for output (out_hw) from input (h, w): nearest: (row
    index per output row, column index per output column); linear: (y0, y1, fy, x0, x1, fx): the
    two neighbours and the weight of the second (float64). Shared with the webgpu kernel."""
    oh, ow = (int(v) for v in a["out_hw"])
    coord = a["coord"]

    def src(n_out, n_in, scale):
        o = torch.arange(n_out, dtype=torch.float64, device=device)
        if coord == "align_corners":
            return o * ((n_in - 1) / (n_out - 1)) if n_out > 1 else torch.zeros_like(o)
        if coord == "asymmetric":
            return o / scale
        if coord == "pytorch_half_pixel" and n_out == 1:
            return torch.zeros_like(o)
        return (o + 0.5) / scale - 0.5  # half_pixel

    sh, sw = a.get("scale_hw") or (oh / h, ow / w)
    ys, xs = src(oh, h, sh), src(ow, w, sw)
    if a["mode"] == "nearest":
        rnd = {"round_prefer_floor": lambda v: torch.ceil(v - 0.5), "round_prefer_ceil": lambda v: torch.floor(v + 0.5),
               "floor": torch.floor, "ceil": torch.ceil}[a.get("nearest_mode", "round_prefer_floor")]
        return rnd(ys).long().clamp(0, h - 1), rnd(xs).long().clamp(0, w - 1)
    ys, xs = ys.clamp(0, h - 1), xs.clamp(0, w - 1)
    y0, x0 = ys.floor().long(), xs.floor().long()
    y1, x1 = (y0 + 1).clamp(max=h - 1), (x0 + 1).clamp(max=w - 1)
    return y0, y1, ys - y0, x0, x1, xs - x0


def _resize(op: Op, i: list) -> torch.Tensor:
    a, x = op.attrs, i[0]
    t = resize_tables(a, x.shape[2], x.shape[3], x.device)
    if a["mode"] == "nearest":
        yi, xi = t
        return x[:, :, yi][:, :, :, xi]
    y0, y1, fy, x0, x1, fx = t
    fy = fy.to(x.dtype)[:, None]
    fx = fx.to(x.dtype)[None, :]
    rows0, rows1 = x[:, :, y0], x[:, :, y1]
    top = rows0[:, :, :, x0] * (1 - fx) + rows0[:, :, :, x1] * fx
    bot = rows1[:, :, :, x0] * (1 - fx) + rows1[:, :, :, x1] * fx
    return top * (1 - fy) + bot * fy


def _sdpa(op: Op, i: list) -> torch.Tensor:
    """softmax(scale q k^T) v, as the matmul / softmax / matmul it replaces."""
    q, k, v = i
    return torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * op.attrs["scale"], dim=-1) @ v


def _add_layer_norm(op: Op, i: list) -> tuple[torch.Tensor, torch.Tensor]:
    s = i[0] + i[1]
    return s, _layer_norm(op, [s, *i[2:]])


def _linear_act(op: Op, i: list) -> torch.Tensor:
    y = F.linear(i[0], i[1], i[2] if op.attrs.get("has_bias") else None)
    return activate(y, op.attrs["act"], op.attrs.get("act_args"))


def _shape(op: Op, x: torch.Tensor) -> list[int]:
    # symbolic attributes (shapes in batch, height, ...) arrive evaluated for this run's sizes
    return [int(d) for d in op.attrs["shape"]]


ND_KERNELS: dict[str, Callable] = {
    "conv2d": _conv2d,
    "relu": lambda op, i: torch.relu(i[0]),
    "sigmoid": lambda op, i: torch.sigmoid(i[0]),
    "tanh": lambda op, i: torch.tanh(i[0]),
    "erf": lambda op, i: torch.erf(i[0]),
    "sqrt": lambda op, i: torch.sqrt(i[0]),
    "exp": lambda op, i: torch.exp(i[0]),
    "neg": lambda op, i: -i[0],
    "hardswish": lambda op, i: F.hardswish(i[0]),
    "hardsigmoid": lambda op, i: _hardsigmoid(i[0], op.attrs["alpha"], op.attrs["beta"]),
    "gelu": lambda op, i: F.gelu(i[0], approximate=op.attrs.get("approximate", "none")),
    "clip": lambda op, i: i[0].clamp(op.attrs.get("min"), op.attrs.get("max")),
    "sub": lambda op, i: i[0] - i[1],
    "div": lambda op, i: i[0] / i[1],
    "pow": lambda op, i: torch.pow(i[0], i[1]),
    "maxpool": _pool,
    "avgpool": _pool,
    "global_avgpool": lambda op, i: i[0].mean(dim=tuple(range(2, i[0].dim())), keepdim=True),
    "matmul": lambda op, i: torch.matmul(i[0], i[1]),
    "reshape": lambda op, i: i[0].reshape(_shape(op, i[0])),
    "transpose": lambda op, i: i[0].permute(*op.attrs["perm"]),
    "concat": lambda op, i: torch.cat(i, dim=op.attrs["axis"]),
    "slice": _slice,
    "gather": _gather,
    "expand": lambda op, i: i[0].expand(*torch.broadcast_shapes(i[0].shape, _shape(op, i[0]))),
    "softmax": lambda op, i: torch.softmax(i[0], dim=op.attrs["axis"]),
    "layer_norm": _layer_norm,
    "reduce_mean": lambda op, i: i[0].mean(dim=tuple(op.attrs["axes"]), keepdim=op.attrs.get("keepdims", True)),
    "resize": _resize,
    "sdpa": _sdpa,
    "linear_act": _linear_act,
    "mul_add": lambda op, i: i[0] * i[1] + i[2],
    "add_layer_norm": _add_layer_norm,
}

__all__ = ["ND_KERNELS", "ACTIVATIONS", "activate", "resize_tables", "spatial_pads"]
