"""The webgpu backend for imported networks (ONNX): the N-D op kinds as WGSL kernels (nd_kernels.py)
behind the ONNX runner's tensor interface (edgellm.onnx.runtime.TensorOps).

How a network runs: for each set of input sizes, the runner calls the kernels below once on
placeholder tensors (NdTensor: a range of a wgpu buffer), and each call *records* its dispatches
(pipeline, bind group, grid) instead of computing; every intermediate lives in one arena buffer
laid out by the runner's memory plan (the planned byte offsets are the bindings' offsets), the
inputs and outputs in buffers of their own, weights uploaded once at load. A call then writes
the inputs, replays the recording into one command encoder and one compute pass (one submit),
and reads back only the outputs.

On the GPU (float32): conv2d (implicit GEMM, grouped, strided, dilated, padded, with the fused
epilogue: bias, activation, residual add, activation after it), depthwise convolution, maxpool,
avgpool, global_avgpool, linear / linear_act / matmul (tiled GEMM, bias and activation in the
epilogue), the element-wise kinds (add, sub, mul, div, pow with numpy broadcasting; mul_add),
the activations (relu, clip, hardswish, hardsigmoid, sigmoid, silu, gelu, tanh, erf, sqrt, exp,
neg), softmax (any axis), layer_norm, add_layer_norm, sdpa, reduce_mean, resize (nearest, linear),
and the layout kinds as strided copies (transpose, expand, slice, gather, concat; reshape too,
but a reshape usually reads its input's storage in place, no dispatch: the plan keeps the input
live while the result is read (compile_graph's in_place) and WebgpuNd._may_alias checks it).

Delegated to the cpu reference kernels (edgellm.backends.cpu_nd; the replay submits what it has
recorded, reads the op's inputs back, runs the kernel on the host and writes its outputs to their
planned place): any kind not in WEBGPU_KINDS (every kind the ONNX importer emits has a kernel
today); an op whose weight operand is a computed tensor where the kernel binds it read-only
(conv2d's weight and bias, linear's bias, layer norm's scale and bias); an op with a tensor larger
than the adapter's largest storage binding. `OnnxModel.describe()` counts and names them;
`edgellm plan model.onnx --backend webgpu` shows the segments.

Storage: float32, or (dtype 'f16', adapters with shader-f16) float16 activations and weights
with float32 maths in every kernel (each tensor keeps its float32-sized slot in the arena, so
the plan and its offsets are the same; a weight past float16's range stays float32).

Tiling: on a hardware adapter the GEMM stages its tiles in workgroup memory; on a software one
(lavapipe) every thread reads its operands directly (no barriers, which lavapipe runs slowly).
EDGELLM_WEBGPU_TILED=0/1 overrides, as for language models.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np

from ...errors import BackendUnavailableError, GraphError
from ...graph.ir import Op
from . import nd_kernels as nd
from .device import Device, get_device
from .launch import dynamic_offsets, encode_dispatch, grid2, raw_pass_functions

WEBGPU_KINDS = frozenset({
    "conv2d", "maxpool", "avgpool", "global_avgpool", "linear", "linear_act", "matmul", "sdpa", "softmax",
    "layer_norm", "add_layer_norm", "reduce_mean", "mul_add", *nd.BINARY, *nd.ACTS, "hardsigmoid", "reshape",
    "transpose", "expand", "slice", "gather", "concat", "resize",
})

ROW_WG = 64  # threads of the workgroup-per-row variants (layer norm, softmax) on GPUs
SDPA_ROWS_BELOW = 8192  # attention with fewer query rows than this takes a workgroup per row on GPUs
_RAW: list = []  # [raw_pass_functions()], made at the first replay (importing this module loads no wgpu)


class NdTensor:
    """A contiguous row-major tensor in a wgpu buffer (byte offset), stored as float32 or float16
    (dtype 'f32' / 'f16'); weights also keep their host array (what a delegated op reads,
    without a read-back)."""

    def __init__(self, buffer, offset: int, shape: tuple[int, ...], host: np.ndarray | None = None,
                 dtype: str = "f32"):
        self.buffer, self.offset, self.shape, self.host = buffer, int(offset), tuple(int(s) for s in shape), host
        self.dtype = dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == "f16" else 4

    def binding(self) -> dict:
        return {"buffer": self.buffer, "offset": self.offset, "size": max(16, -(-self.itemsize * self.size // 16) * 16)}

    def read(self, dev: Device) -> np.ndarray:
        if self.host is not None:
            return np.asarray(self.host, dtype=np.float32).reshape(self.shape)
        if self.size == 0:
            return np.zeros(self.shape, np.float32)
        n = self.itemsize * self.size
        raw = np.frombuffer(dev.read(self.buffer, self.offset, -(-n // 4) * 4), np.float16 if self.dtype == "f16" else np.float32)
        return raw[:self.size].astype(np.float32).reshape(self.shape)

    def write(self, dev: Device, a) -> None:
        """Host values into the tensor's storage (float16 storage: rounded; an odd count is padded by
        one element, which lies inside the float32-sized slot every tensor is given)."""
        data = np.ascontiguousarray(np.asarray(a), dtype=np.float16 if self.dtype == "f16" else np.float32).reshape(-1)
        if data.size % 2 and self.dtype == "f16":
            data = np.concatenate([data, np.zeros(1, np.float16)])
        if data.size:
            dev.write(self.buffer, data, self.offset)


class Recording:
    """A network's dispatches for one set of input sizes: ('gpu', pipeline, bind group, grid, label
    'op name:kernel name', the bind group's dynamic offsets) or
    ('host', op, cpu kernel, input tensors, output tensors) steps, in order."""

    def __init__(self):
        self.steps: list[tuple] = []
        self.inputs: dict[str, NdTensor] = {}
        self.outputs: list = []
        self.arena = None
        self.delegated: list[str] = []
        self.aliases = 0  # reshapes that read their input in place (no copy)
        self.keep: list = []  # buffers made while recording (a resize's coordinates, split-K workspaces)

    @property
    def dispatches(self) -> int:
        return sum(1 for s in self.steps if s[0] == "gpu")


def _dt(tensors: dict) -> dict | None:
    """Binding name -> storage type, for the tensors not stored as float32 (nd_kernels' dtypes)."""
    d = {k: t.dtype for k, t in tensors.items() if isinstance(t, NdTensor) and t.dtype != "f32"}
    return d or None


def _strides(shape) -> tuple[int, ...]:
    return nd._contiguous(tuple(shape))


def _broadcast_strides(shape, out_shape) -> tuple[int, ...]:
    """Strides reading a tensor of `shape` at the coordinates of `out_shape` (numpy broadcasting)."""
    shape = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    st = _strides(shape)
    return tuple(0 if s == 1 and o != 1 else t for s, o, t in zip(shape, out_shape, st))


class WebgpuNd:
    """The runner's TensorOps for webgpu (records = True: see the module docstring), and the
    kernel table (`kernels()`: op kind -> f(op, inputs) recording the op's dispatches)."""

    records = True
    in_place = frozenset({"reshape"})  # planned with its input live while it is read (_may_alias)

    def __init__(self, dev: Device | None = None, tiled: bool | None = None, dtype: str = "f32"):
        self.dev = dev or get_device()
        if dtype not in ("f32", "f16"):
            raise GraphError(f"webgpu: storage type {dtype!r} is not one of f32, f16")
        if dtype == "f16" and not self.dev.has_f16:
            raise BackendUnavailableError(f"webgpu: float16 storage needs the adapter's shader-f16 feature, which "
                             f"{self.dev.info.name} lacks; use float32")
        self.dtype = dtype  # activations' and weights' storage (the kernels compute in float32)
        want = os.environ.get("EDGELLM_WEBGPU_TILED")
        if tiled is None:
            tiled = (want == "1") if want in ("0", "1") else not self.dev.info.software
        self.tiled = tiled
        self._rec: Recording | None = None
        self._bound = None
        self._outs: list[tuple[str, tuple[int, ...], tuple | None]] = []

    # -- TensorOps -------------------------------------------------------------------------------
    def from_host(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    def to_host(self, value) -> np.ndarray:
        return value.read(self.dev) if isinstance(value, NdTensor) else np.asarray(value, dtype=np.float32)

    def weight(self, a: np.ndarray, dtype: str | None = None) -> NdTensor:
        """A weight uploaded once, in the storage type (float16 storage: a weight with values past
        float16's range stays float32)."""
        host = np.ascontiguousarray(a, dtype=np.float32)
        dtype = dtype or self.dtype
        if dtype == "f16" and host.size and not float(np.abs(host).max()) <= 65504.0:
            dtype = "f32"
        data = host.astype(np.float16 if dtype == "f16" else np.float32).reshape(-1)
        return NdTensor(self.dev.upload(data if data.size else np.zeros(4, np.float32)), 0, host.shape, host, dtype)

    def reserve(self, plan_bytes: int) -> None:
        if self._rec is not None and self._rec.arena is None:
            self._rec.arena = self.dev.buffer(int(plan_bytes) + 256)

    def begin_op(self, op: Op) -> None:
        b = self._bound
        g = b.compiled.graph
        self._op = op
        self._alias_next = False
        self._outs = [(n, tuple(g.tensors[n].concrete_shape(**b.sizes)), b.views.get(n)) for n in op.outputs]

    def store(self, value, offset: int, shape: tuple[int, ...]):
        if self._alias_next:  # a reshape that reads its input's storage in place (_may_alias)
            self._alias_next = False
            return value
        slot = NdTensor(self._rec.arena, offset, shape, dtype=self.dtype)
        if isinstance(value, NdTensor) and value.buffer is slot.buffer and value.offset == offset:
            return value
        self._copy(value, slot)
        return slot

    def delegate(self, fn: Callable) -> Callable:
        def run(op, ins):
            return self._host(op, ins, fn)
        return run

    def record(self, b, run_ops: Callable) -> Recording:
        """The bound program's recording: the runner's op loop over placeholders."""
        from ...backends.webgpu.backend import _device_errors

        rec = Recording()
        self._rec, self._bound = rec, b
        self._records = {r.tensor: r for r in b.compiled.records}
        g = b.compiled.graph
        env = {}
        for n in g.inputs:
            shape = tuple(g.tensors[n].concrete_shape(**b.sizes))
            rec.inputs[n] = env[n] = NdTensor(self.dev.buffer(4 * math.prod(shape)), 0, shape, dtype=self.dtype)
        try:
            with _device_errors(f"recording '{g.name}' for sizes {b.sizes}"):
                rec.outputs = run_ops(b, env)
        finally:
            self._rec = self._bound = None
        return rec

    def replay(self, rec: Recording, env: dict) -> list:
        from ...backends.webgpu.backend import _device_errors

        dev = self.dev
        with _device_errors("running the network"):
            for n, t in rec.inputs.items():
                t.write(dev, env[n])
            if not _RAW:
                _RAW.append(raw_pass_functions())
            raw = _RAW[0]
            enc = dev.device.create_command_encoder()
            cpass = enc.begin_compute_pass()
            for st in rec.steps:
                if st[0] == "gpu":
                    encode_dispatch(cpass, st[1], st[2], st[3], raw, st[5])
                    continue
                cpass.end()
                dev.queue.submit([enc.finish()])
                _, op, fn, ins, outs = st
                self._run_host(op, fn, ins, outs)
                enc = dev.device.create_command_encoder()
                cpass = enc.begin_compute_pass()
            cpass.end()
            dev.queue.submit([enc.finish()])
        return list(rec.outputs)

    # -- recording helpers -------------------------------------------------------------------------
    def _out(self, k: int = 0) -> NdTensor:
        name, shape, view = self._outs[k]
        if view is not None:
            return NdTensor(self._rec.arena, view[0], shape, dtype=self.dtype)
        return NdTensor(self.dev.buffer(4 * math.prod(shape)), 0, shape, dtype=self.dtype)

    def _dispatch(self, kern, tensors: dict, grid: tuple[int, int, int]) -> None:
        if 0 in grid:
            return
        import wgpu

        dev = self.dev
        try:
            layout = dev.layout(kern.kinds)
            pipeline = dev.pipeline(kern.source, layout)
            entries = [{"binding": i, "resource": tensors[bd.name].binding()} for i, bd in enumerate(kern.bindings)]
            bg = dev.device.create_bind_group(layout=layout, entries=entries)
        except wgpu.GPUError as e:  # a driver's refusal (a limit, a shader it cannot compile): name the op
            from .backend import _first_line

            raise GraphError(f"op '{self._op.name}' ({self._op.kind}): the webgpu kernel '{kern.name}' failed: "
                             f"{_first_line(e)}") from None
        self._rec.steps.append(("gpu", pipeline, bg, tuple(int(v) for v in grid), f"{self._op.name}:{kern.name}",
                                dynamic_offsets(kern.kinds)))

    def _fits(self, op: Op, ins: list) -> bool:
        """Whether every operand and result fits in one storage binding (else the op is delegated)."""
        sizes = [t.size for t in ins if isinstance(t, NdTensor)] + [math.prod(s) for _, s, _ in self._outs]
        return 4 * max(sizes, default=0) + 16 <= self.dev.max_binding

    def _flat(self, kern, tensors: dict, threads: int, per_group: int = 256) -> None:
        x, y = grid2(-(-threads // per_group), self.dev.max_groups)
        self._dispatch(kern, tensors, (x, y, 1))

    def _host(self, op: Op, ins: list, fn: Callable):
        from ..cpu import CPU_KERNELS

        fn = fn or CPU_KERNELS[op.kind]
        outs = [self._out(k) for k in range(len(op.outputs))]
        self._rec.steps.append(("host", op, fn, list(ins), outs))
        self._rec.delegated.append(op.name)
        return tuple(outs) if len(outs) > 1 else outs[0]

    def _run_host(self, op: Op, fn: Callable, ins: list, outs: list) -> None:
        import torch

        args = [torch.from_numpy(t.read(self.dev)) if isinstance(t, NdTensor) else t for t in ins]
        with torch.inference_mode():
            y = fn(op, args)
        for t, v in zip(outs, y if isinstance(y, tuple) else (y,)):
            if tuple(v.shape) != t.shape:
                raise GraphError(f"op '{op.name}' ({op.kind}) on the cpu gave shape {tuple(v.shape)}, expected {t.shape}")
            t.write(self.dev, v.float().numpy())

    def _copy(self, src: NdTensor, dst: NdTensor) -> None:
        """src's elements into dst (same count, any shapes): one flat copy."""
        self._elementwise("a", [src], dst.shape, [(1,)], dst, flat=True)

    def _elementwise(self, expr: str, ins: list[NdTensor], shape, strides, y: NdTensor, offsets=None, y_strides=None,
                     y_offset: int = 0, flat: bool = False) -> NdTensor:
        if flat:  # same elements, another shape (reshape): one flat copy
            shape, strides = (math.prod(shape),), [(1,)] * len(ins)
        tensors = dict(zip("ABC", ins))
        tensors["Y"] = y
        kern = nd.elementwise(expr, tuple(shape), [tuple(s) for s in strides], list(offsets or [0] * len(ins)),
                              tuple(y_strides) if y_strides is not None else None, y_offset,
                              tuple(t.host is not None for t in ins), dtypes=_dt(tensors))
        self._flat(kern, tensors, math.prod(shape))
        return y

    @staticmethod
    def _weight(t) -> bool:
        return isinstance(t, NdTensor) and t.host is not None

    # -- the kernel table -------------------------------------------------------------------------
    def kernels(self) -> dict[str, Callable]:
        table = {k: self._binary for k in nd.BINARY}
        table.update({k: self._unary for k in nd.ACTS})
        table.update(hardsigmoid=self._unary, conv2d=self._conv2d, maxpool=self._pool, avgpool=self._pool,
                     global_avgpool=self._global_avgpool, linear=self._linear, linear_act=self._linear,
                     matmul=self._matmul, sdpa=self._sdpa, softmax=self._softmax, layer_norm=self._layer_norm,
                     add_layer_norm=self._layer_norm, reduce_mean=self._reduce_mean, mul_add=self._mul_add,
                     reshape=self._reshape, transpose=self._transpose, expand=self._expand, slice=self._slice,
                     gather=self._gather, concat=self._concat, resize=self._resize)
        assert set(table) == WEBGPU_KINDS

        def guarded(fn):
            def run(op, ins):
                return fn(op, ins) if self._fits(op, ins) else self._host(op, ins, None)
            return run
        return {k: guarded(fn) for k, fn in table.items()}

    def _conv2d(self, op: Op, ins: list):
        from ..cpu_nd import spatial_pads

        a = op.attrs
        x, w = ins[0], ins[1]
        k, bias = 2, None
        if a.get("has_bias"):
            bias, k = ins[2], 3
        res = ins[k] if a.get("has_residual") else None
        if not self._weight(w) or (bias is not None and not self._weight(bias)):
            return self._host(op, ins, None)
        y = self._out()
        N, C, H, W = x.shape
        O, Cg, KH, KW = w.shape
        t, l, _, _ = spatial_pads(a, (H, W), (KH, KW))
        (sh, sw), (dh, dw), G = a["strides"], a["dilations"], a["groups"]
        geom = dict(N=N, C=C, H=H, W=W, O=O, OH=y.shape[2], OW=y.shape[3], KH=KH, KW=KW, SH=sh, SW=sw, PT=t, PL=l,
                    DH=dh, DW=dw, G=G)
        epi = dict(bias=bias is not None, act=a.get("act"), act_args=a.get("act_args"), residual=res is not None,
                   res_act=a.get("res_act"), res_act_args=a.get("res_act_args"))
        tensors = {"X": x, "W": w, "Y": y, "B": bias, "R": res}
        if G == C and Cg == 1:
            self._flat(nd.depthwise(geom, **epi, dtypes=_dt(tensors)), tensors, y.size)
        else:
            self._gemm("conv", geom, (N * y.shape[2] * y.shape[3], O // G, G, Cg * KH * KW), tensors, epi,
                       f"(i / {y.shape[2] * y.shape[3]}u) % {O}u")
        return y

    def _gemm(self, kind: str, geom: dict, mnzk: tuple[int, int, int, int], tensors: dict, epi: dict, channel: str,
              weight_b: bool = True) -> None:
        """One product through nd.gemm; split over K (nd.splitk_count) into a float32 workspace of
        the recording's own and summed by nd.gemm_splitk_epilogue where its tiles are few and long."""
        m, n, z, k = mnzk
        y = tensors["Y"]
        splits = nd.splitk_count(m, n, z, k, auto=self.tiled)
        if splits > 1 and 4 * splits * y.size + 16 > self.dev.max_binding:
            splits = 1
        if splits == 1:
            kern, grid = nd.gemm(kind, geom, tiled=self.tiled, weight_b=weight_b, **epi, dtypes=_dt(tensors))
            self._dispatch(kern, tensors, grid)
            return
        part = NdTensor(self.dev.buffer(4 * splits * y.size), 0, (splits * y.size,))
        self._rec.keep.append(part)
        kern, grid = nd.gemm(kind, geom, tiled=self.tiled, weight_b=weight_b, splits=splits,
                             dtypes=_dt({**tensors, "P": part}))
        self._dispatch(kern, {**tensors, "P": part}, grid)
        et = {"P": part, "Y": y, "B": tensors.get("B"), "R": tensors.get("R")}
        self._flat(nd.gemm_splitk_epilogue(y.size, splits, channel, **epi, dtypes=_dt(et)), et, y.size)

    def _pool(self, op: Op, ins: list):
        from ..cpu_nd import spatial_pads

        a, x = op.attrs, ins[0]
        kh, kw = a["kernel"]
        t, l, b, r = spatial_pads(a, tuple(x.shape[2:]), (kh, kw))
        y = self._out()
        N, C, H, W = x.shape
        geom = dict(N=N, C=C, H=H, W=W, OH=y.shape[2], OW=y.shape[3], KH=kh, KW=kw, SH=a["strides"][0],
                    SW=a["strides"][1], PT=t, PL=l, PB=b, PR=r, DH=a["dilations"][0], DW=a["dilations"][1])
        kern = nd.pool(geom, is_max=op.kind == "maxpool", count_include_pad=bool(a.get("count_include_pad")),
                       dtypes=_dt({"X": x, "Y": y}))
        self._flat(kern, {"X": x, "Y": y}, y.size)
        return y

    def _global_avgpool(self, op: Op, ins: list):
        x = ins[0]
        y = self._out()
        rows, cols = x.shape[0] * x.shape[1], math.prod(x.shape[2:])
        kern, per_row = nd.global_avgpool(rows, cols, tiled=self.tiled, dtypes=_dt({"X": x, "Y": y}))
        self._flat(kern, {"X": x, "Y": y}, rows, 1 if per_row else 256)
        return y

    def _linear(self, op: Op, ins: list):
        a = op.attrs
        x, w = ins[0], ins[1]
        bias = ins[2] if a.get("has_bias") else None
        res = ins[-1] if a.get("has_residual") else None
        if bias is not None and not self._weight(bias):
            return self._host(op, ins, None)
        y = self._out()
        geom = dict(M=math.prod(x.shape[:-1]), N=w.shape[0], K=w.shape[1])
        tensors = {"X": x, "W": w, "Y": y, "B": bias, "R": res}
        epi = dict(bias=bias is not None, act=a.get("act"), act_args=a.get("act_args"), residual=res is not None)
        self._gemm("linear", geom, (geom["M"], geom["N"], 1, geom["K"]), tensors, epi, f"i % {geom['N']}u",
                   weight_b=self._weight(w))
        return y

    def _matmul(self, op: Op, ins: list):
        a, b = ins
        y = self._out()
        M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
        zdims = y.shape[:-2]
        za = _broadcast_strides(a.shape[:-2], zdims)
        zb = _broadcast_strides(b.shape[:-2], zdims)
        geom = dict(M=M, N=N, K=K, zdims=zdims, zsa=tuple(s * M * K for s in za), zsb=tuple(s * K * N for s in zb))
        tensors = {"X": a, "W": b, "Y": y}
        self._gemm("matmul", geom, (M, N, math.prod(zdims), K), tensors, {}, "0u", weight_b=self._weight(b))
        return y

    def _sdpa(self, op: Op, ins: list):
        q, k, v = ins
        y = self._out()
        tensors = {"Q": q, "K": k, "V": v, "Y": y}
        geom = (math.prod(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], op.attrs["scale"])
        wg = next((w for w in (ROW_WG, 32) if nd.sdpa_rows_fits(v.shape[-1], w)), 0)
        rows = math.prod(q.shape[:-1])
        # a workgroup per query row where a thread per row would leave the GPU nearly idle (fewer
        # than 32 workgroups): on the H100, ViT-B/16 at batch 1 (2,364 rows) 22.8 -> 5.1 ms; at
        # batch 8 (18,912 rows on 74 workgroups) the thread per row was faster (57.7 vs 70.2 ms a call)
        if self.tiled and wg and rows < SDPA_ROWS_BELOW:
            self._flat(nd.sdpa_rows(*geom, wg=wg, dtypes=_dt(tensors)), tensors, rows, 1)
        else:
            self._flat(nd.sdpa(*geom, dtypes=_dt(tensors)), tensors, rows)
        return y

    def _softmax(self, op: Op, ins: list):
        x = ins[0]
        y = self._out()
        ax = op.attrs["axis"] % len(x.shape)
        outer, inner = math.prod(x.shape[:ax]), math.prod(x.shape[ax + 1:])
        if self.tiled and inner == 1 and x.shape[ax] > ROW_WG:  # a workgroup per row (GPUs)
            self._flat(nd.softmax(outer, x.shape[ax], 1, wg=ROW_WG, dtypes=_dt({"X": x, "Y": y})), {"X": x, "Y": y},
                       outer, 1)
        else:
            self._flat(nd.softmax(outer, x.shape[ax], inner, dtypes=_dt({"X": x, "Y": y})), {"X": x, "Y": y},
                       outer * inner)
        return y

    def _layer_norm(self, op: Op, ins: list):
        a = op.attrs
        add = op.kind == "add_layer_norm"
        x = ins[0]
        rest = ins[2:] if add else ins[1:]
        scale = rest[0]
        bias = rest[1] if a.get("has_bias") else None
        ax = a["axis"] % len(x.shape)
        rows, cols = math.prod(x.shape[:ax]), math.prod(x.shape[ax:])
        if not self._weight(scale) or (bias is not None and not self._weight(bias)) or scale.size != cols \
                or (bias is not None and bias.size != cols):
            return self._host(op, ins, None)
        wg = ROW_WG if self.tiled and cols > ROW_WG else 0  # a workgroup per row (GPUs)
        if add:
            s, n = self._out(0), self._out(1)
            tensors = {"X": x, "X2": ins[1], "G": scale, "Bi": bias, "Y": n, "S": s}
        else:
            tensors = {"X": x, "G": scale, "Bi": bias, "Y": self._out()}
        kern = nd.layer_norm(rows, cols, a["eps"], bias=bias is not None, add=add,
                             weights=(self._weight(x), add and self._weight(ins[1])), wg=wg, dtypes=_dt(tensors))
        self._flat(kern, tensors, rows, 1 if wg else 256)
        return (s, n) if add else tensors["Y"]

    def _reduce_mean(self, op: Op, ins: list):
        x = ins[0]
        y = self._out()
        axes = tuple(sorted({ax % len(x.shape) for ax in op.attrs["axes"]}))
        self._flat(nd.reduce_mean(x.shape, axes, dtypes=_dt({"X": x, "Y": y})), {"X": x, "Y": y}, y.size)
        return y

    def _binary(self, op: Op, ins: list):
        y = self._out()
        return self._elementwise(nd.BINARY[op.kind], ins, y.shape, [_broadcast_strides(t.shape, y.shape) for t in ins], y)

    def _mul_add(self, op: Op, ins: list):
        y = self._out()
        return self._elementwise("a * b + c", ins, y.shape, [_broadcast_strides(t.shape, y.shape) for t in ins], y)

    def _unary(self, op: Op, ins: list):
        y = self._out()
        args = {k: v for k, v in op.attrs.items() if k in ("min", "max", "alpha", "beta", "approximate")}
        return self._elementwise(nd.act_expr(op.kind, args, "a"), ins, y.shape, [_strides(y.shape)], y)

    def _resize(self, op: Op, ins: list):
        from ..cpu_nd import resize_tables

        x = ins[0]
        y = self._out()
        N, C, H, W = x.shape
        linear = op.attrs["mode"] != "nearest"
        tables = np.concatenate([t.numpy().astype(np.float32) for t in resize_tables(op.attrs, H, W)])
        self._rec.keep.append(t := self.weight(tables, "f32"))  # indices: exact in float32 only
        kern = nd.resize(N * C, H, W, y.shape[2], y.shape[3], linear=linear, dtypes=_dt({"X": x, "T": t, "Y": y}))
        self._flat(kern, {"X": x, "T": t, "Y": y}, y.size)
        return y

    # -- layout: strided copies -------------------------------------------------------------------------
    def _reshape(self, op: Op, ins: list):
        x = ins[0]
        name, shape, view = self._outs[0]
        if view is not None and self._may_alias(x, name):
            self._alias_next = True
            self._rec.aliases += 1
            return NdTensor(x.buffer, x.offset, shape, x.host, x.dtype)
        y = self._out()
        return self._elementwise("a", ins, y.shape, [(1,)], y, flat=True)

    def _may_alias(self, x: NdTensor, name: str) -> bool:
        """Whether the planned tensor `name` (this op's result) can be x's storage read in place:
        nothing the memory plan writes while it is live (ops after this one up to its last use)
        overlaps x's bytes. Inputs, weights and outputs have buffers no op of a replay rewrites."""
        r = self._records.get(name)
        if r is None or x.buffer is not self._rec.arena:
            return r is not None
        lo, hi = x.offset, x.offset + x.itemsize * x.size
        views = self._bound.views
        for o in self._records.values():
            if r.first < o.first <= r.last and o.tensor in views:
                off = views[o.tensor][0]
                if off < hi and lo < off + o.size:
                    return False
        return True

    def _transpose(self, op: Op, ins: list):
        x = ins[0]
        y = self._out()
        xs = _strides(x.shape)
        return self._elementwise("a", ins, y.shape, [tuple(xs[p] for p in op.attrs["perm"])], y)

    def _expand(self, op: Op, ins: list):
        y = self._out()
        return self._elementwise("a", ins, y.shape, [_broadcast_strides(ins[0].shape, y.shape)], y)

    def _slice(self, op: Op, ins: list):
        from ...graph.nd_ops import slice_bounds

        x = ins[0]
        y = self._out()
        xs = list(_strides(x.shape))
        st, off = list(xs), 0
        a = op.attrs
        for start, end, ax, sp in zip(a["starts"], a["ends"], a["axes"], a["steps"]):
            ax = ax % len(x.shape)
            s, _ = (int(v) for v in slice_bounds(x.shape[ax], start, end, sp))
            off += s * xs[ax]
            st[ax] = xs[ax] * sp
        return self._elementwise("a", ins, y.shape, [tuple(st)], y, offsets=[off])

    def _gather(self, op: Op, ins: list):
        x = ins[0]
        y = self._out()
        ax = op.attrs["axis"] % len(x.shape)
        idx = op.attrs["index"]
        xs = _strides(x.shape)
        rest = tuple(s for d, s in enumerate(xs) if d != ax)
        if isinstance(idx, int):
            return self._elementwise("a", ins, y.shape, [rest], y, offsets=[(idx % x.shape[ax]) * xs[ax]])
        ys = _strides(y.shape)
        sub = tuple(d for k, d in enumerate(y.shape) if k != ax)
        ys_rest = tuple(s for k, s in enumerate(ys) if k != ax)
        for j, i in enumerate(idx):
            self._elementwise("a", ins, sub, [rest], y, offsets=[(i % x.shape[ax]) * xs[ax]], y_strides=ys_rest,
                              y_offset=j * ys[ax])
        return y

    def _concat(self, op: Op, ins: list):
        y = self._out()
        ax = op.attrs["axis"] % len(y.shape)
        ys = _strides(y.shape)
        at = 0
        for t in ins:
            if t.size:
                self._elementwise("a", [t], t.shape, [_strides(t.shape)], y, y_strides=ys, y_offset=at * ys[ax])
            at += t.shape[ax]
        return y


def run_op(op: Op, inputs: list[np.ndarray], out_shapes: list[tuple[int, ...]], *, tiled: bool | None = None,
           weights: tuple[int, ...] = (), fill: float = float("nan"), dev: Device | None = None,
           dtype: str = "f32") -> list[np.ndarray]:
    """One op through its webgpu kernel on host arrays (tests): inputs uploaded (those at the
    positions in `weights` as weights), outputs in buffers of their own first filled with `fill`
    (NaN: an element never written shows), read back after one replay."""
    ex = WebgpuNd(dev, tiled, dtype)
    npt = np.float16 if dtype == "f16" else np.float32
    table = ex.kernels()
    if op.kind not in table:
        raise GraphError(f"op '{op.name}': kind {op.kind} has no webgpu kernel")
    rec = Recording()
    ex._rec = rec
    ex._op = op
    ins = []
    for k, a in enumerate(inputs):
        a = np.ascontiguousarray(a, dtype=np.float32)
        if k in weights:
            ins.append(ex.weight(a))
        else:
            ins.append(NdTensor(ex.dev.upload(np.concatenate([a.reshape(-1), np.zeros(4, np.float32)]).astype(npt)), 0,
                                a.shape, dtype=dtype))
    outs = []
    for k, shape in enumerate(out_shapes):
        n = math.prod(shape)
        outs.append(NdTensor(ex.dev.upload(np.full(max(n, 4), fill, npt)), 0, shape, dtype=dtype))
    ex._outs = [(f"out{k}", s, None) for k, s in enumerate(out_shapes)]
    ex._out = lambda k=0: outs[k]  # the filled buffers
    got = table[op.kind](op, ins)
    rec.outputs = list(got) if isinstance(got, tuple) else [got]
    ex._rec = None
    ex.replay(rec, {})
    return [t.read(ex.dev) for t in rec.outputs]
