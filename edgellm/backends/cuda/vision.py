"""The cuda backend's kernels for imported networks (N-D op kinds of edgellm.graph.nd_ops).

Convolution (implicit GEMM on tensor cores, depthwise), pooling and global pooling are Triton
kernels (kernels/conv.py) with the conv epilogue fused; layer_norm of a transposed view is one
(kernels/layer_norm.py: it reads the view in place), and so is add_layer_norm (the residual
add and the LayerNorm after it, one pass). The fused kinds of compiler.passes run as
one op each: sdpa through torch's scaled_dot_product_attention (flash attention), linear_act as
the cuBLAS product and one activation kernel, mul_add as one addcmul. The remaining kinds (layout changes,
element-wise, softmax, layer norm, matmul) run as the cpu reference kernels do, on device
tensors through torch: correct and on the GPU, but not yet generated kernels of ours.
Weights are repacked once, on first use, into the layout the conv kernels read.
"""

from __future__ import annotations

import os
import weakref
from typing import Callable

import torch

from ...errors import BackendUnavailableError
from ...graph.ir import Op
from ..cpu_nd import ND_KERNELS, spatial_pads

_PACKED: dict[tuple, tuple] = {}  # key -> (weak reference to the source weight, packed weight)


def vision_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    from triton import knobs

    if knobs.runtime.interpret or os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")  # Triton's interpreter: the same kernels on CPU tensors (tests)
    raise BackendUnavailableError("the cuda backend needs an NVIDIA GPU (or TRITON_INTERPRET=1 to interpret "
                                  "its kernels on the CPU)")


def _packed(w: torch.Tensor, groups: int, depthwise: bool) -> torch.Tensor:
    """The weight in the conv kernels' layout, packed once. The cache entry remembers (weakly) the
    tensor it was packed from: after a model is freed, another model's weight (or the same model in
    another dtype) can sit at the same address with the same shape, and must not get its packing."""
    from .kernels.conv import pack_conv_weight

    key = (w.data_ptr(), tuple(w.shape), w.dtype, w.device, groups, depthwise)
    hit = _PACKED.get(key)
    if hit is not None and hit[0]() is w:
        return hit[1]
    p = w.reshape(w.shape[0], -1).contiguous() if depthwise else pack_conv_weight(w, groups)

    def forget(ref, key=key):  # the source weight is gone: free its packing too
        if _PACKED.get(key, (None,))[0] is ref:
            del _PACKED[key]
    _PACKED[key] = (weakref.ref(w, forget), p)
    return p


def _conv2d(op: Op, i: list) -> torch.Tensor:
    from .kernels.conv import conv2d

    a = op.attrs
    x, w = i[0], i[1]
    k = 2
    bias = None
    if a.get("has_bias"):
        bias, k = i[2], 3
    res = i[k] if a.get("has_residual") else None
    kh, kw = int(w.shape[2]), int(w.shape[3])
    t, l, b, r = spatial_pads(a, tuple(x.shape[2:]), (kh, kw))
    (sh, sw), (dh, dw) = a["strides"], a["dilations"]
    oh = (x.shape[2] + t + b - dh * (kh - 1) - 1) // sh + 1
    ow = (x.shape[3] + l + r - dw * (kw - 1) - 1) // sw + 1
    g = a["groups"]
    depthwise = g == x.shape[1] and g == w.shape[0]
    if a.get("act") == "gelu" and a.get("act_args", {}).get("approximate", "none") != "none" or \
            a.get("res_act") == "gelu" and a.get("res_act_args", {}).get("approximate", "none") != "none":
        return ND_KERNELS["conv2d"](op, i)
    wp = _packed(w, g, depthwise)
    return conv2d(x, wp, bias, res, out_channels=w.shape[0], kernel=(kh, kw), strides=(sh, sw), pads=(t, l),
                  dilations=(dh, dw), groups=g, out_hw=(oh, ow), act=a.get("act"), act_args=a.get("act_args"),
                  res_act=a.get("res_act"), res_act_args=a.get("res_act_args"),
                  depthwise_w=wp if depthwise else None)


def _pool(op: Op, i: list) -> torch.Tensor:
    from .kernels.conv import pool2d

    a, x = op.attrs, i[0]
    kh, kw = a["kernel"]
    t, l, b, r = spatial_pads(a, tuple(x.shape[2:]), (kh, kw))
    (sh, sw), (dh, dw) = a["strides"], a["dilations"]
    ceil = a.get("ceil_mode", False)

    def out(size, lo, hi, k, s, d):
        span = size + lo + hi - d * (k - 1) - 1
        o = (-(-span // s) if ceil else span // s) + 1
        if ceil and (o - 1) * s >= size + lo:  # ONNX/PyTorch: the last window must start inside the input
            o -= 1
        return o
    oh, ow = out(x.shape[2], t, b, kh, sh, dh), out(x.shape[3], l, r, kw, sw, dw)
    return pool2d(x, is_max=op.kind == "maxpool", kernel=(kh, kw), strides=(sh, sw), pads=(t, l),
                  dilations=(dh, dw), out_hw=(oh, ow), count_include_pad=bool(a.get("count_include_pad")),
                  pads_end=(b, r))


def _global_avgpool(op: Op, i: list) -> torch.Tensor:
    from .kernels.conv import global_avgpool

    return global_avgpool(i[0])


def _layer_norm(op: Op, i: list) -> torch.Tensor:
    """The last axis of a strided view (ConvNeXt's NCHW -> NHWC transpose) through our kernel, which
    reads the view in place; a contiguous input, or several normalised axes, through torch's."""
    x = i[0]
    if op.attrs["axis"] % x.dim() == x.dim() - 1 and not x.is_contiguous():
        from .kernels.layer_norm import layer_norm

        return layer_norm(x, i[1], i[2] if op.attrs.get("has_bias") else None, op.attrs["eps"])
    return ND_KERNELS["layer_norm"](op, i)


def _add_layer_norm(op: Op, i: list):
    """(a + b, layer_norm(a + b)) in one pass of our kernel (the last axis normalised)."""
    from .kernels.layer_norm import layer_norm

    if op.attrs["axis"] % i[0].dim() != i[0].dim() - 1:
        return ND_KERNELS["add_layer_norm"](op, i)
    return layer_norm(i[0], i[2], i[3] if op.attrs.get("has_bias") else None, op.attrs["eps"], residual=i[1])


def _linear_act(op: Op, i: list) -> torch.Tensor:
    """cuBLAS's product and one activation kernel; with EDGELLM_VISION_GEMM=triton, our GEMM with
    the bias and activation in its epilogue (kernels/dense.py; one kernel, for A/B timing)."""
    bias = i[2] if op.attrs.get("has_bias") else None
    act, approx = op.attrs["act"], op.attrs.get("act_args", {}).get("approximate", "none")
    if os.environ.get("EDGELLM_VISION_GEMM") == "triton" and (act == "relu" or approx == "none"):
        from .kernels.dense import gemm_act

        return gemm_act(i[0], i[1], bias, act)
    y = torch.nn.functional.linear(i[0], i[1], bias)
    if act == "relu":
        return y.relu_()
    return torch.nn.functional.gelu(y, approximate=approx)


def _mul_add(op: Op, i: list) -> torch.Tensor:
    """a * b + c in one element-wise pass, written contiguous (the next convolution reads NCHW)."""
    a, b, c = i
    out = torch.empty(torch.broadcast_shapes(a.shape, b.shape, c.shape), device=c.device, dtype=c.dtype)
    return torch.addcmul(c, a, b, out=out)


# op kind -> kernel; every kind here runs on the device (the Triton ones first, torch for the rest)
CUDA_ND_KERNELS: dict[str, Callable] = {
    **{k: v for k, v in ND_KERNELS.items()},
    "conv2d": _conv2d,
    "maxpool": _pool,
    "avgpool": _pool,
    "global_avgpool": _global_avgpool,
    "linear": lambda op, i: torch.nn.functional.linear(i[0], i[1], i[2] if op.attrs.get("has_bias") else None)
    + (i[-1] if op.attrs.get("has_residual") else 0),
    "add": lambda op, i: i[0] + i[1],
    "mul": lambda op, i: i[0] * i[1],
    "silu": lambda op, i: torch.nn.functional.silu(i[0]),
    "layer_norm": _layer_norm,
    "linear_act": _linear_act,
    "mul_add": _mul_add,
    "add_layer_norm": _add_layer_norm,
    # flash attention on the GPU (fp16, head dim <= 256); torch's math kernel elsewhere
    "sdpa": lambda op, i: torch.nn.functional.scaled_dot_product_attention(i[0], i[1], i[2], scale=op.attrs["scale"]),
}
TRITON_KINDS = {"conv2d", "maxpool", "avgpool", "global_avgpool", "layer_norm", "add_layer_norm"}
