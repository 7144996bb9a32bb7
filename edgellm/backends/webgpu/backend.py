"""The webgpu backend: executes a compiled Graph with the WGSL kernel templates of kernels.py.

- Weights are uploaded once, repacked into a storage descriptor's layout (codegen.py): F16,
  Q8_0, Q4_0 and Q4_1 as themselves, F32/BF16 as F16, Q5_0 as Q8_0 (exact), Q4_K as Q4_1, Q6_K
  as Q6 and Q5_K, Q5_1 as Q6M (the cuda backend's six-bit layouts; fp16 sub-block scales).
  Projections a fused op reads together (q|k|v, gate|up) are
  stacked at load. A weight larger than one storage binding is split by rows across bindings.
- Activations are float32 in ONE arena buffer laid out by the compile step's memory plan; each
  kernel binds the ranges of its tensors. The KV cache is one float32 buffer per layer and K/V,
  written in place at the position offset.
- A step is recorded into one command encoder and one compute pass (dispatches are ordered; wgpu
  puts the barriers between them), so a decode token is one submit; greedy decoding appends
  the argmax kernel, which writes the next token straight into the token buffer, and only its
  4 bytes are read back.
- Ops without a kernel here are delegated to the cpu backend's reference kernels: the pass is
  cut, their inputs read back, their outputs written to the device.
- Decode programs fold ops into the GEMV of a projection (WebgpuProgram._plan_folds), each one
  dispatch and one barrier fewer per token: the RMSNorm before a projection into its prologue,
  RoPE and the KV-cache write into the q|k|v projection's epilogue, the merge of split attention
  into the attention itself (its last workgroup per head; or into the output projection's
  prologue), the embedding into the first projection's prologue; a one-token program's last_row
  copy becomes an alias. A layer is then 5 dispatches: q|k|v, attention, output, gate|up, down.
  EDGELLM_WEBGPU_FOLD=0 turns every fold off, 1 (the default) on, a comma list of FOLDS enables
  only those (A/B measurements).
  Where the tuned configuration says so (tuning.prologue_ahead), a folded norm or split merge
  runs instead as a dispatch of its own before the GEMV, once rather than in every workgroup:
  for int8 x in the dispatch that quantizes x (kernels.quantize_x), for float x the op's own
  kernel.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import time
from typing import Callable, Collection, Iterator

import numpy as np

from ...errors import BackendUnavailableError, EdgeLLMError, GraphError
from ...gguf_file import GGUFFile
from ...graph.ir import Graph, Op
from ...graph.shapes import shape_function
from ...sampling import device_sampling_enabled
from ...compiler.memory import plan_offsets
from ...compiler.passes import rope_qkv_extras
from ..info import WebgpuInfo
from . import codegen, kernels
from .device import Device, get_device
from .launch import grid2 as _grid2
from .tuning import (prefill_attention_grid, prefill_attention_kind, prefill_int8_planes, prologue_ahead, quantize_lanes,
                     staged, timing_s as tuning_timing_s)
from .launch import dynamic_offsets, encode_dispatch, raw_pass_functions, replay_dispatches

GEMV_MAX_ROWS = 4  # steps of at most this many tokens use the matrix-vector kernel
PREFETCH_AHEAD = 2  # weight sets packed ahead of the program build per worker thread (WebgpuWeights.prefetch)
SPLIT_KEYS = 64  # decode attention: one split per this many cached keys ...
MAX_SPLITS = 32  # ... up to this many
LOOP_BATCH = 32  # loop_tokens: at most this many decode steps a submission
LOOP_BATCH_S = 0.025  # loop_tokens: once timed, a batch holds about this much decoding (at least a step)
# steps of at most this many splits merge them in the output projection's GEMV (the "combine"
# fold); steps of more run attention_combine as a dispatch of its own
COMBINE_IN_GEMV_SPLITS = MAX_SPLITS


def combine_unroll() -> int:
    """Splits the output projection's merge loads at once (kernels._combine_wgsl's unroll): 1, as
    measured; EDGELLM_WEBGPU_COMBINE_UNROLL=4 issues four splits' loads together (8B Q8_0 decode
    270.7 against 270.4 tok/s, H200 through Vulkan, 2026-11-30: no change)."""
    v = os.environ.get("EDGELLM_WEBGPU_COMBINE_UNROLL", "1")
    if not v.isdigit() or not 1 <= int(v) <= MAX_SPLITS:
        raise GraphError(f"EDGELLM_WEBGPU_COMBINE_UNROLL={v!r}: expected an integer from 1 to {MAX_SPLITS}")
    return int(v)


def split_keys() -> int:
    """Cached keys a decode attention split takes (SPLIT_KEYS; EDGELLM_WEBGPU_SPLIT_KEYS overrides):
    a step of kv_len keys runs ceil(kv_len / this) splits, at most MAX_SPLITS."""
    v = os.environ.get("EDGELLM_WEBGPU_SPLIT_KEYS", "").strip()
    if not v:
        return SPLIT_KEYS
    if not v.isdigit() or int(v) < 1:
        raise GraphError(f"EDGELLM_WEBGPU_SPLIT_KEYS={v!r}: expected a positive integer (keys a split)")
    return int(v)


FOLDS = ("last_row", "norm", "rope", "combine", "embed", "qout", "finish")  # the kinds of WebgpuProgram._plan_folds


def fold_kinds() -> set[str]:
    """The decode folds EDGELLM_WEBGPU_FOLD enables: 1 (the default) all, 0 none, or a comma list
    of FOLDS (A/B measurement of each)."""
    v = os.environ.get("EDGELLM_WEBGPU_FOLD", "1").strip()
    if v == "1":
        return set(FOLDS)
    if v == "0":
        return set()
    kinds = {x.strip() for x in v.split(",") if x.strip()}
    if kinds - set(FOLDS):
        raise GraphError(f"EDGELLM_WEBGPU_FOLD={v!r}: unknown fold {sorted(kinds - set(FOLDS))}; use 1, 0 or a comma "
                         f"list of {', '.join(FOLDS)}")
    return kinds


class DeviceMemoryError(EdgeLLMError):
    """A tensor does not fit in the adapter's buffers or bindings."""


class WebgpuError(EdgeLLMError):
    """The WebGPU implementation refused or failed an operation (a driver or limit problem)."""


def _device_errors(what: str):
    """Turn wgpu's errors into one-line edgellm errors naming what was being done."""
    import contextlib

    @contextlib.contextmanager
    def guard():
        import wgpu

        try:
            yield
        except wgpu.GPUOutOfMemoryError as e:
            raise DeviceMemoryError(f"webgpu: out of GPU memory {what}: {_first_line(e)}") from None
        except wgpu.GPUError as e:
            raise WebgpuError(f"webgpu: {what} failed: {_first_line(e)}") from None
    return guard()


def _first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip() and x.strip() != "Caused by:"]
    return " | ".join(lines[:3])[:300] or type(e).__name__


class WebgpuTensor:
    """A tensor on the device: a range of a buffer, row-major float32 (or float16: the KV cache
    where the adapter has shader-f16)."""

    def __init__(self, dev: Device, buf, offset: int, shape: tuple[int, ...], dtype: str = "f32"):
        self.dev, self.buffer, self.offset, self.shape = dev, buf, int(offset), tuple(int(s) for s in shape)
        self.dtype = dtype
        self._np = np.float16 if dtype == "f16" else np.float32

    @property
    def nbytes(self) -> int:
        return (2 if self.dtype == "f16" else 4) * math.prod(self.shape)

    def numpy(self) -> np.ndarray:
        if self.nbytes == 0:
            return np.zeros(self.shape, np.float32)
        raw = np.frombuffer(self.dev.read(self.buffer, self.offset, -(-self.nbytes // 4) * 4), self._np)
        return raw[:math.prod(self.shape)].astype(np.float32).reshape(self.shape)

    def write(self, a: np.ndarray) -> None:
        self.dev.write(self.buffer, np.ascontiguousarray(a, dtype=self._np).reshape(-1), self.offset)


class DeviceWeight:
    """A weight on the device: its descriptor's parts, each a dict of array name -> buffer."""

    def __init__(self, p: codegen.PackedArrays, dev: Device, max_binding: int | None = None):
        self.fmt, self.rows, self.cols, self.source_fmt = p.fmt, p.rows, p.cols, p.source_fmt
        self.part_rows = codegen.split_rows(p, max_binding or dev.max_binding)
        self.buffers = [{k: dev.upload(a) for k, a in part.items()} for part in codegen.part_arrays(p, self.part_rows)]
        self.nbytes = p.nbytes

    def desc(self, name: str = "W") -> codegen.WeightDesc:
        return codegen.WeightDesc(name, self.fmt, self.rows, self.cols, self.part_rows)

    def resources(self, name: str = "W") -> dict:
        out = {}
        for p, bufs in enumerate(self.buffers):
            for k, b in bufs.items():
                out[f"{name}_{k}{p}"] = (b, 0, b.size)
        return out


class WebgpuWeights:
    """Weights on the device in descriptor layouts, converted on first use, shared by all programs.

    Weights whose layout is not the file's own (K-quants, Q5_0/Q5_1, F32/BF16, stacks of mixed
    formats: conversions in numpy and torch that take most of an 8B K-quant file's load) are kept
    as host arrays until save() hands them to the program cache; restore() adopts a cached set
    (memory-mapped), so a later load of the same file uploads them without converting."""

    def __init__(self, f: GGUFFile, dev: Device):
        self.file, self.dev = f, dev
        self._mats: dict[tuple[str, ...], DeviceWeight] = {}
        self._vectors: dict[tuple[str, ...], object] = {}
        self._cached: dict[tuple[str, ...], codegen.PackedArrays] = {}  # from the program cache
        self._built: dict[tuple[str, ...], codegen.PackedArrays] = {}  # converted by this load
        self.keep_converted = False  # hold converted weights for save() (set when a cache is attached)
        self._pending: dict[tuple[str, ...], object] = {}  # packings running in threads (prefetch)
        self._queue: list[tuple[str, ...]] = []  # sets prefetch will submit as pending ones are taken
        self._pool = None
        self._window = 0  # sets pending at most (PREFETCH_AHEAD per worker)

    def matrix(self, *names: str) -> DeviceWeight:
        w = self._mats.get(names)
        if w is None:
            p = self._cached.get(names)
            if p is None:
                fut = self._pending.pop(names, None)
                if fut is not None:
                    self._refill()
                p, converted = fut.result() if fut is not None else self._pack(names)
                if converted and self.keep_converted:
                    self._built[names] = p
            w = self._mats[names] = DeviceWeight(p, self.dev)
        return w

    def prefetch(self, sets: list[tuple[str, ...]]) -> None:
        """Start packing these weight sets in threads, ahead of the matrix() calls that take them
        (numpy and torch release the GIL in their loops: an 8B file's conversions, and the file's
        own layouts' strided copies out of the mapped blocks, on the host's cores at once, not one
        after another), at most PREFETCH_AHEAD per worker packed and not yet taken (host memory
        stays a few weights' worth, not the model's). Sets already held are left to matrix()."""
        todo = [n for n in dict.fromkeys(sets)
                if n not in self._mats and n not in self._cached and n not in self._pending
                and all(x in self.file.tensors for x in n)]
        workers = min(8, os.cpu_count() or 1)
        if len(todo) < 2 or workers < 2:
            return
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edgellm-pack")
            self._window = PREFETCH_AHEAD * workers
        self._queue.extend(todo)
        self._refill()

    def _refill(self) -> None:
        """Submit queued sets until a window's worth are pending; the pool ends when the queue does."""
        while self._queue and len(self._pending) < self._window:
            n = self._queue.pop(0)
            if n not in self._mats and n not in self._pending:
                self._pending[n] = self._pool.submit(self._pack, n)
        if not self._queue and self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _pack(self, names: tuple[str, ...]) -> tuple[codegen.PackedArrays, bool]:
        """The named weights stacked by rows in one descriptor layout, and whether any was converted
        from its file format (not only sliced out of the file's blocks)."""
        parts = []
        for n in names:
            t = self.file.tensors[n]
            if len(t.shape) != 2:
                raise GraphError(f"webgpu: weight '{n}' has shape {t.shape}, expected 2-D")
            parts.append(codegen.repack(np.asarray(t.data), t.type_name, tuple(t.shape)))
        converted = any(p.source_fmt.upper() != p.fmt for p in parts)
        if len({p.fmt for p in parts}) > 1:
            # mixed formats (Q4_K_M files: q, k Q4_K as Q4_1, v Q6_K as Q6): one six-bit layout
            # that holds each part's values exactly
            parts, converted = codegen.unify_six_bit(parts) or parts, True
        if len({p.fmt for p in parts}) > 1 and all(p.cols % 8 == 0 for p in parts):
            # else as F16 from the file's own values (not from a Q8_0 requantization of them)
            from ...quant import dequantize

            parts = [codegen.pack_float(np.asarray(dequantize(self.file.tensors[n].data, self.file.tensors[n].type_name,
                                                              self.file.tensors[n].shape), np.float32), "F16")
                     for n in names]
        return codegen.stack(parts), converted

    # -- the program cache (WebgpuBackend.load_weight_cache / save_weight_cache) -------------------
    def restore(self, meta: dict, arrays: dict[str, np.ndarray]) -> int:
        """Adopt converted weights from a cache artifact (save's form); returns how many. A malformed
        entry raises (KeyError, ValueError, TypeError) and nothing is adopted."""
        cached = {}
        for i, e in enumerate(meta["weights"]):
            names = tuple(str(n) for n in e["names"])
            rows, cols = int(e["rows"]), int(e["cols"])
            shapes = [tuple(self.file.tensors[n].shape) for n in names]
            if any(len(s) != 2 or s[1] != cols for s in shapes) or sum(s[0] for s in shapes) != rows:
                raise ValueError(f"cached weight {names}: ({rows}, {cols}) is not the file's {shapes}")
            mine = {k: arrays[f"{i}.{k}"] for k in e["arrays"]}
            if any(a.ndim != 2 or a.shape[0] != rows for a in mine.values()) or "qs" not in mine:
                raise ValueError(f"cached weight {names}: arrays of the wrong shape")
            cached[names] = codegen.PackedArrays(str(e["fmt"]), rows, cols, mine, str(e["source_fmt"]))
        self._cached.update(cached)
        return len(cached)

    def save(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Every converted weight this load holds (adopted or built) as (meta, arrays)."""
        entries, arrays = [], {}
        for i, (names, p) in enumerate({**self._cached, **self._built}.items()):
            entries.append({"names": list(names), "fmt": p.fmt, "rows": p.rows, "cols": p.cols,
                            "source_fmt": p.source_fmt, "arrays": sorted(p.arrays)})
            arrays.update({f"{i}.{k}": a for k, a in p.arrays.items()})
        return {"weights": entries}, arrays

    def release_host(self) -> None:
        """Drop the host copies once the device holds them (after save)."""
        self._cached.clear()
        self._built.clear()
        self.keep_converted = False

    def vector(self, *names: str):
        """1-D tensors (norm weights, biases, rope factors) as float32, concatenated."""
        v = self._vectors.get(names)
        if v is None:
            from ...quant import dequantize

            parts = [np.asarray(dequantize(self.file.tensors[n].data, self.file.tensors[n].type_name,
                                           self.file.tensors[n].shape), dtype=np.float32).reshape(-1) for n in names]
            v = self._vectors[names] = self.dev.upload(np.concatenate(parts))
        return v

    def vector_host(self, name: str) -> np.ndarray:
        from ...quant import dequantize

        t = self.file.tensors[name]
        return np.asarray(dequantize(t.data, t.type_name, t.shape), dtype=np.float64).reshape(-1)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._mats.values()) + sum(v.size for v in self._vectors.values())


class _Dispatch:
    """One kernel bound to its tensors: pipeline and bind group made at first use."""

    def __init__(self, prog: "WebgpuProgram", kernel: kernels.Kernel, resources: dict[str, Callable], grid: Callable):
        self.prog, self.kernel, self.resources, self.grid = prog, kernel, resources, grid
        self.pipeline = None
        self.bind_group = None
        self.arena_gen = -1
        self._grids: dict[tuple[int, int], tuple[int, int, int]] = {}

    def prepare(self) -> None:
        dev, be = self.prog.dev, self.prog.backend
        if self.pipeline is None:
            self.pipeline = dev.pipeline(self.kernel.source, dev.layout(self.kernel.kinds))
        if self.bind_group is None or self.arena_gen != be.arena_gen:
            entries = []
            for i, b in enumerate(self.kernel.bindings):
                key = b.name[:-3] if b.name.endswith("_v4") else b.name
                if key == "step":
                    buf, off, size = self.prog.step_buf, 0, kernels.STEP_BYTES
                else:
                    buf, off, size = self.resources[key]()
                entries.append({"binding": i, "resource": {"buffer": buf, "offset": off, "size": size}})
            self.bind_group = dev.device.create_bind_group(layout=dev.layout(self.kernel.kinds), entries=entries)
            self.arena_gen = be.arena_gen

    def grid_of(self, seq: int, splits: int) -> tuple[int, int, int]:
        g = self._grids.get((seq, splits))
        if g is None:  # the grid functions evaluate symbolic shapes: once per step shape, not per token
            g = self._grids[seq, splits] = tuple(int(v) for v in self.grid(seq, splits))
        return g

    def encode(self, cpass, seq: int, splits: int) -> None:
        g = self.grid_of(seq, splits)
        if g[0] * g[1] * g[2] == 0:
            return
        encode_dispatch(cpass, self.pipeline, self.bind_group, g, _RAW, dynamic_offsets(self.kernel.kinds))

    def dispatches(self, seq: int, splits: int) -> list["_Dispatch"]:
        return [self]


# wgpu-native's compute-pass functions without wgpu-py's wrapper (launch.raw_pass_functions);
# a module global so that tests can turn it off (monkeypatch backend._RAW = None)
_RAW = raw_pass_functions()


class WebgpuProgram:
    """A compiled graph bound to device weights, caches and the arena; one dispatch per op."""

    def __init__(self, backend: "WebgpuBackend", graph: Graph, states: dict[str, WebgpuTensor], plan, max_seq: int):
        self.backend, self.graph, self.states, self.max_seq = backend, graph, states, int(max_seq)
        self.dev: Device = backend.dev
        self.offsets = plan_offsets(plan) if plan is not None else {}
        backend.reserve_arena(plan.total_bytes if plan is not None else 0)
        self.ctx = next(iter(states.values())).shape[0] if states else 1
        # shape functions compiled once per distinct shape (graph.shapes), without sympy: a program
        # read back from the cache then runs without importing it
        self._shape = {n: shape_function(t.shape) for n, t in graph.tensors.items() if t.kind == "activation"}
        # a step's uniform values: run and _record use the first slot, loop_tokens one slot a step
        # of its batch (Device.step_stride apart, each step's dispatches at its slot's dynamic
        # offset), batches in turn in the two halves
        self.step_buf = self.dev.buffer(2 * LOOP_BATCH * self.dev.step_stride, uniform=True)
        self._readbacks: list = []  # loop_tokens' mappable token-id buffers (_readback)
        self.tok_buf = self.dev.buffer(4 * max(self.max_seq, 1))
        self._outputs = {}
        for name in graph.outputs:
            shape = self.shape(name, self.max_seq)
            if 4 * math.prod(shape) > self.dev.max_binding:
                raise DeviceMemoryError(f"webgpu: output '{name}' of {math.prod(shape)} floats exceeds the adapter's "
                                        f"{self.dev.max_binding}-byte storage binding; use a smaller prefill chunk")
            self._outputs[name] = self.dev.buffer(4 * math.prod(shape))
        self.delegated: list[str] = []
        self.matrix_bytes = 0  # bytes of the weight matrices one step reads (a decode token's traffic)
        self._steps: list = []
        self._flat_cache: dict = {}
        self._flat_key: tuple | None = None
        self._alias: dict[str, str] = {}  # tensor -> the tensor whose storage it is (an absorbed copy)
        self._private: dict[str, object] = {}  # tensor -> a buffer of its own, outside the memory plan
        self._folds: dict[str, Op] = {}  # linear op name -> the RMSNorm op folded into its GEMV (prologue)
        self._ropes: dict[str, Op] = {}  # linear_qkv op name -> the rope_qkv_store done in its GEMV (epilogue)
        self._combines: dict[str, Op] = {}  # linear op name -> the split attention it merges (prologue)
        self._embeds: dict[str, Op] = {}  # linear op name -> the embedding its folded norm reads from the weight
        self._qouts: dict[str, tuple[int, bool]] = {}  # linear op name -> (planes, sums) of x its gate|up GEMV quantized
        self._finished: dict[str, Op | None] = {}  # attention op name -> its output projection (or None): splits merged by the attention
        self._attn_quant: dict[str, tuple[int, bool]] = {}  # linear op name -> (planes, sums) of x its attention quantized
        self.split_keys = split_keys()
        absorbed = self._plan_folds()
        for op in graph.ops:
            if op.name not in absorbed:
                self._steps.extend(self._lower(op))
        self._has_host_ops = any(isinstance(st, _HostOp) for st in self._steps)
        self.dev.precompile([d.kernel for st in self._steps for d in getattr(st, "variants", (st,)) if hasattr(d, "kernel")])
        self._argmax: list[_Dispatch] | None = None  # the greedy token choice's dispatches (kernels.argmax)
        self._samplers: dict[str, _Dispatch] = {}  # kernels.sample_kernels' dispatches, made at first use
        self._sampler_kernels: dict | None = None  # kernels.sample_kernels' sources, with the sampler's buffers
        if self.max_seq == 1 and "logits" in graph.outputs:
            n = self.shape("logits", 1)[-1]
            self.hist_buf = self.dev.buffer(4 * self.ctx)
            nwg = kernels.argmax_parallelism(n)
            part = self.dev.buffer(8 * nwg)
            res = {**self._token_resources(), "PART": lambda: (part, 0, part.size)}
            k_part, k_pick = kernels.argmax(n)
            self._argmax = [_Dispatch(self, k_part, res, lambda s, k: (nwg, 1, 1)),
                            _Dispatch(self, k_pick, res, lambda s, k: (1, 1, 1))]

    # -- tensors ------------------------------------------------------------------------------
    def shape(self, name: str, seq: int) -> tuple[int, ...]:
        return self._shape[name]({"seq": seq, "ctx": self.ctx})

    def _rows_expr(self, name: str) -> str:
        d = self.graph.tensors[name].shape[0]
        if _is_seq(d):
            return "step.seq"
        try:
            return f"{int(d)}u"
        except TypeError:
            raise GraphError(f"webgpu: tensor '{name}' has rows {d}; the kernels take [seq, n] or [k, n]") from None

    def _res(self, name: str) -> Callable:
        """A function giving (buffer, byte offset, byte size) of a tensor's storage (called when the
        bind groups are made, after every program of the model has reserved its arena); its
        `dtype` attribute is the tensor's element type there."""
        name = self._alias.get(name, name)
        t = self.graph.tensors[name]
        dev = self.dev
        if name in self._private:
            pb = self._private[name]
            fn, dtype = (lambda: (pb, 0, pb.size)), "f32"
        elif t.kind == "weight":
            src = t.source or name
            fn, dtype = (lambda: (lambda b: (b, 0, b.size))(self.backend.weights.vector(src))), "f32"
        elif t.kind == "state" or t.alias_of is not None:
            st = self.states[t.alias_of or name]
            fn, dtype = (lambda: (st.buffer, st.offset, -(-st.nbytes // 16) * 16)), st.dtype
        elif name in self._outputs:
            b = self._outputs[name]
            fn, dtype = (lambda: (b, 0, b.size)), "f32"
        elif name in self.offsets:
            off = self.offsets[name]
            size = -(-4 * math.prod(self.shape(name, self.max_seq)) // 16) * 16  # the plan's float32 slot
            if size > dev.max_binding:
                raise DeviceMemoryError(f"webgpu: tensor '{name}' needs {size} bytes, more than the adapter's "
                                        f"{dev.max_binding}-byte storage binding; use a smaller prefill chunk")
            fn, dtype = (lambda: (self.backend.arena_buffer, off, max(size, 16))), self.backend.act_dtype
        else:
            raise GraphError(f"webgpu: no storage planned for tensor '{name}'")
        fn.dtype = dtype
        return fn

    def tensor(self, name: str, seq: int) -> WebgpuTensor:
        fn = self._res(name)
        buf, off, _ = fn()
        return WebgpuTensor(self.dev, buf, off, self.shape(name, seq), fn.dtype)

    def _rows(self, name: str) -> Callable[[int], int]:
        return lambda seq: self.shape(name, seq)[0]

    # -- lowering -------------------------------------------------------------------------------
    def _wname(self, t: str) -> str:
        return self.graph.tensors[t].source or t

    def _lower(self, op: Op) -> list:
        if op.attrs.get("window") or op.attrs.get("ring"):
            # the WGSL attention reads every cached row: a sliding window (and its ring cache) would
            # be silently ignored, so such files are refused rather than answered wrongly
            raise GraphError(f"webgpu: op '{op.name}' ({op.kind}) belongs to a sliding-window attention layer, which the webgpu "
                             "kernels do not support yet; run this model with --backend cpu, cpu-fast or cuda")
        if op.kind not in self.backend.SUPPORTED_OPS:
            return [self._delegate(op)]
        dev, a, ins, outs = self.dev, op.attrs, op.inputs, op.outputs
        W = self.backend.weights
        R = self._res
        limit = dev.max_groups
        kind = op.kind
        if kind == "embedding":
            w = W.matrix(self._wname(ins[0]))
            rows = self._rows(outs[0])
            res = {**_const(w.resources()), "Y": R(outs[0]), "TOK": lambda: (self.tok_buf, 0, self.tok_buf.size)}
            k = kernels.embedding(w.desc(), self._rows_expr(outs[0]), dtypes=_dtypes(res))
            return [_Dispatch(self, k, res, lambda s, n: (-(-w.cols // 256), rows(s), 1))]
        if kind in ("rms_norm", "add_rms_norm"):
            add = kind == "add_rms_norm"
            normed = outs[1] if add else outs[0]
            cols = self.shape(normed, 1)[-1]
            rows = self._rows(normed)
            res = {"A": R(ins[0]), "G": R(ins[2] if add else ins[1]), "O": R(normed)}
            if add:
                res.update(B=R(ins[1]), S=R(outs[0]))
            # vec4 views double the storage bindings (the Step uniform aside)
            vec = 4 if cols % 4 == 0 and 2 * len(res) <= self.dev.max_storage_buffers else 1
            k = kernels.rms_norm(cols, a["eps"], self._rows_expr(normed), add=add, sg=self.dev.subgroup_size, vec=vec,
                                 dtypes=_dtypes(res))
            return [_Dispatch(self, k, res, lambda s, n: (*_grid2(rows(s), limit), 1))]
        if kind in ("linear", "linear_qkv", "linear_swiglu"):
            return [self._lower_linear(op)]
        if kind in ("add", "mul", "silu", "swiglu"):
            cols = self.shape(outs[0], 1)[-1]
            rows = self._rows(outs[0])
            b_rows = True
            res = {"A": R(ins[0]), "Y": R(outs[0])}
            if kind != "silu":
                tb = self.graph.tensors[ins[1]]
                b_rows = len(tb.shape) == 2 and tb.shape[0] == self.graph.tensors[outs[0]].shape[0]
                res["B"] = R(ins[1])
            k = kernels.elementwise(kind, cols, self._rows_expr(outs[0]), b_rows=b_rows, dtypes=_dtypes(res))
            return [_Dispatch(self, k, res, lambda s, n: (*_grid2(-(-rows(s) * cols // 256), limit), 1))]
        if kind == "last_row":
            cols = self.shape(outs[0], 1)[-1]
            res = {"X": R(ins[0]), "Y": R(outs[0])}
            return [_Dispatch(self, kernels.last_row(cols, dtypes=_dtypes(res)), res, lambda s, n: (-(-cols // 256), 1, 1))]
        if kind in ("rope_qkv_store", "rope", "rope_store", "kv_store"):
            return [self._lower_rope(op)]
        if kind == "attention":
            return self._lower_attention(op)
        raise GraphError(f"webgpu: no kernel for op '{op.name}' ({kind})")

    def _plan_folds(self) -> set[str]:
        """Ops of a decode program done inside another op's kernel, each one dispatch (and the
        barrier before it) fewer per token; returns the names of the ops absorbed. The kinds
        (EDGELLM_WEBGPU_FOLD: 1 all, the default; 0 none; or a comma list of these):
        - "last_row": a single-token program's last_row copies its only row: its output is made
          the input's storage (the copy's dispatch gone);
        - "norm": an RMSNorm (plain, or add + RMSNorm) computed in the prologue of the GEMV that
          alone reads it (_fold_norm);
        - "rope": RoPE and the KV-cache write (rope_qkv_store) done in the epilogue of the q|k|v
          projection's GEMV that alone feeds it (_fold_rope; the cuda backend's decode fusion);
        - "combine": where a one-token step splits attention over the context, the splits are
          merged in the prologue of the output projection's GEMV, not by attention_combine
          (_fold_combine; the op stays, its combine dispatch goes);
        - "embed": the embedding whose rows a folded RMSNorm normalises is read from its weight
          in that GEMV's prologue, which also writes the rows out (_fold_embed);
        - "qout": where a GEMV reads x quantized ahead (gemv_warp's xq) from a gate|up GEMV's
          output alone, that GEMV quantizes it in its epilogue instead of a quantize_x dispatch
          (decided as the gate|up GEMV is lowered: _qout_reader);
        - "finish": a one-token step's split attention (the lane-group kernel) merges its splits
          in each head's last workgroup to finish (kernels.attention_warp's finish), writing its
          output, or that output quantized where the output projection alone reads it as int8
          x (its quantize_x dispatch gone too); takes the place of "combine" (_finishing_attention).
        Prefill programs (matrix-matrix products) keep every op its own dispatch."""
        if self.max_seq > GEMV_MAX_ROWS:
            return set()
        kinds = fold_kinds()
        readers: dict[str, list[Op]] = {}
        for op in self.graph.ops:
            for t in op.inputs:
                readers.setdefault(t, []).append(op)
        absorbed: set[str] = set()
        if "last_row" in kinds and self.max_seq == 1:
            for i, op in enumerate(self.graph.ops):
                if op.kind == "last_row" and self._alias_copy(i, readers):
                    absorbed.add(op.name)
        for op in self.graph.ops:
            if "norm" in kinds and op.kind in ("rms_norm", "add_rms_norm"):
                lin = self._fold_norm(op, readers)
                if lin is not None:
                    self._folds[lin.name] = op
                    absorbed.add(op.name)
        for op in self.graph.ops:
            if "rope" in kinds and op.kind == "linear_qkv":
                rope = self._fold_rope(op, readers)
                if rope is not None:
                    self._ropes[op.name] = rope
                    absorbed.add(rope.name)
            if "finish" in kinds and self.max_seq == 1 and op.kind == "attention" and self._finish_ok(op):
                self._finished[op.name] = self._output_projection(op, readers)
            elif "combine" in kinds and self.max_seq == 1 and op.kind == "attention":
                lin = self._fold_combine(op, readers)
                if lin is not None:
                    self._combines[lin.name] = op
        if "embed" in kinds:
            for op in self.graph.ops:
                emb = self._fold_embed(op, readers) if op.name in self._folds else None
                if emb is not None:
                    self._embeds[op.name] = emb
                    absorbed.add(emb.name)
        return absorbed

    def _span(self, t: str) -> tuple[int, int] | None:
        """The byte range of a tensor's storage in the arena (None: storage of its own)."""
        t = self._alias.get(t, t)
        if t not in self.offsets or t in self._private:
            return None
        return self.offsets[t], self.offsets[t] + 4 * math.prod(self.shape(t, self.max_seq))

    def _overlap(self, reads, writes) -> bool:
        """Whether any tensor written shares arena bytes with any tensor read."""
        rs = [x for x in map(self._span, reads) if x is not None]
        ws = [x for x in map(self._span, writes) if x is not None]
        return any(r[0] < w[1] and w[0] < r[1] for r in rs for w in ws)

    def _alias_copy(self, i: int, readers: dict) -> bool:
        """last_row of a one-token program (op i): its output becomes its input's storage where no
        op writes over the input's bytes while the output is still read (the plan reused the
        input's slot once the copy was made)."""
        op = self.graph.ops[i]
        src, dst = op.inputs[0], op.outputs[0]
        if dst in self.graph.outputs or src not in self.offsets or dst not in self.offsets:
            return False
        if self.shape(src, 1) != self.shape(dst, 1):
            return False
        names = [o.name for o in self.graph.ops]
        last = max((names.index(r.name) for r in readers.get(dst, [])), default=i)
        if any(self._overlap([src], later.outputs) for later in self.graph.ops[i + 1:last + 1]):
            return False
        self._alias[dst] = self._alias.get(src, src)
        return True

    def _gemv_warp_config(self, lin: Op):
        """(device weight, default warp GEMV configuration) of a projection, or None where its
        default decode GEMV is not kernels.gemv_warp (the folds need it). The folds are decided on
        the default; a tuned configuration is then timed with them (tuning.gemv_config's fold)
        among gemv_warp's candidates."""
        from .tuning import default_gemv_config

        w = self._linear_weight(lin)
        cfg = default_gemv_config(self.dev, w.cols, w.fmt)
        return (w, cfg) if cfg.get("kind") == "warp" else None

    def _gemv_bindings(self, lin: Op, w: DeviceWeight, norm_op: Op | None, rope: bool) -> int:
        """Storage bindings of a projection's warp GEMV with the given folds (kernels.gemv_warp)."""
        n = len(w.desc().bindings()) + 1  # the weight's arrays, Y
        if norm_op is None:
            n += 2  # X and its vec4 view
        else:
            n += 4 + (3 if norm_op.kind == "add_rms_norm" else 0)  # A, G (vec4 views), B, S
        n += bool(lin.attrs.get("has_bias")) + bool(lin.kind == "linear" and lin.attrs.get("has_residual"))
        return n + (4 if rope else 0)  # KC, VC, COS, SIN

    def _fold_norm(self, op: Op, readers: dict) -> Op | None:
        """The projection whose warp GEMV computes this RMSNorm (kernels.gemv_warp's norm
        prologue), or None: the GEMV alone reads the norm's output, over its whole input row (a
        bias is bound as BIAS), and the norm's inputs stored apart from what the GEMV writes
        (its output, and for add + RMSNorm the residual sum, which the first workgroup writes
        while the others still read the addends)."""
        if set(op.attrs) - {"eps"}:
            return None
        normed = op.outputs[-1]
        users = readers.get(normed, [])
        if len(users) != 1 or normed in self.graph.outputs or normed not in self.offsets:
            return None
        lin = users[0]
        if lin.kind not in ("linear", "linear_qkv", "linear_swiglu") or lin.inputs[0] != normed:
            return None
        wc = self._gemv_warp_config(lin)
        if wc is None:
            return None
        w = wc[0]
        gamma = self.graph.tensors[op.inputs[-1]]
        if w.cols % 4 or tuple(gamma.shape)[-1:] != (w.cols,) or \
                self._gemv_bindings(lin, w, op, False) > self.dev.max_storage_buffers:
            return None
        # the memory plan was made for the norm running first: its addends may share storage
        # with what the GEMV now writes while other workgroups still read them
        reads = list(op.inputs[:-1])
        if any(self._alias.get(t, t) not in self.offsets for t in reads):
            return None
        writes = list(lin.outputs) + (list(op.outputs[:1]) if op.kind == "add_rms_norm" else [])
        return None if self._overlap(reads, writes) else lin

    def _fold_rope(self, lin: Op, readers: dict) -> Op | None:
        """The rope_qkv_store that this q|k|v projection's warp GEMV does in its epilogue
        (kernels.RopeFold), or None: the store alone reads the projection's output, without the
        long-RoPE factor or q/k norms, and the GEMV's rows per subgroup are even (a rotation pair
        in one lane: adjacent features for style 'norm'; for 'neox' the lane's two features are
        the head's rows i and i + n_rot / 2). The rotated q, written while other workgroups still
        read the GEMV's input (or a folded norm's), gets a buffer of its own where the plan put it
        over that input."""
        rd = readers.get(lin.outputs[0], [])
        if len(rd) != 1 or rd[0].kind != "rope_qkv_store" or rd[0].inputs[0] != lin.outputs[0]:
            return None
        rope = rd[0]
        a = rope.attrs
        _, qk_norms = rope_qkv_extras(rope, list(rope.inputs))
        if (a.get("style") not in ("norm", "neox") or a.get("mscale", 1.0) != 1.0 or qk_norms or a.get("ring") or a.get("window")
                or lin.outputs[0] in self.graph.outputs or rope.outputs[0] in self.graph.outputs):
            return None
        wc = self._gemv_warp_config(lin)
        if wc is None:
            return None
        w, cfg = wc
        d, h, g = a["head_dim"], a["n_heads"], a["n_kv_heads"]
        n_rot = a.get("rope_dim", d)
        if cfg["rows_per_warp"] % 2 or w.rows != (h + 2 * g) * d or d % 2 or n_rot % 2 or n_rot > d:
            return None
        norm_op = self._folds.get(lin.name)
        if self._gemv_bindings(lin, w, norm_op, True) > self.dev.max_storage_buffers:
            return None
        q = rope.outputs[0]
        # the GEMV reads the norm's inputs where it folds the norm, its output where the tuned
        # configuration makes the norm ahead (tuning.prologue_ahead): q apart from both
        reads = (list(norm_op.inputs[:-1]) if norm_op is not None else []) + [lin.inputs[0]]
        if self._overlap(reads, [q]):
            self._private[q] = self.dev.buffer(-(-4 * math.prod(self.shape(q, self.max_seq)) // 16) * 16)
        return rope

    def _fold_combine(self, attn: Op, readers: dict) -> Op | None:
        """The output projection whose warp GEMV merges this attention's splits (kernels.gemv_warp's
        combine), or None: it alone reads the attention output, as its whole input row, without
        bias, and x staged with the per-(head, split) weights fits the workgroup memory."""
        from .tuning import can_stage

        lin = self._output_projection(attn, readers)
        if lin is None:
            return None
        wc = self._gemv_warp_config(lin)
        if wc is None:
            return None
        w, cfg = wc
        h, d = attn.attrs["n_heads"], attn.attrs["head_dim"]
        red = 0 if cfg["subgroup"] else 4 * cfg["wg"] * cfg["rows_per_warp"]
        if (w.cols != h * d or d % 4 or not can_stage(self.dev, w.cols)
                or 4 * w.cols + 8 * h * MAX_SPLITS + red > self.dev.max_workgroup_memory
                or self._gemv_bindings(lin, w, None, False) > self.dev.max_storage_buffers):
            return None
        return lin

    def _finish_ok(self, attn: Op) -> bool:
        """Whether this decode attention runs the lane-group kernel, which can finish its merge,
        on an API whose storage barrier orders memory device-wide (naga's SPIR-V and HLSL do; its
        Metal barrier, mem_device, orders it for the threadgroup only: Metal keeps "combine")."""
        return bool(self._warp_attention_sg(attn)) and self.dev.info.backend in ("Vulkan", "D3D12")

    def _output_projection(self, attn: Op, readers: dict) -> Op | None:
        """The output projection that alone reads this attention's output, as its whole input row,
        without bias or a folded norm (the one that may merge its splits or take it quantized by
        the attention), or None."""
        rd = readers.get(attn.outputs[0], [])
        if len(rd) != 1 or rd[0].kind != "linear" or rd[0].inputs[0] != attn.outputs[0] or rd[0].attrs.get("has_bias"):
            return None
        if rd[0].name in self._folds or attn.outputs[0] in self.graph.outputs:
            return None
        return rd[0]

    def _fold_embed(self, lin: Op, readers: dict) -> Op | None:
        """The embedding (of the step's tokens) that this projection's GEMV, with a plain RMSNorm
        folded, reads from the weight itself (kernels.gemv_warp's embed), or None. Its rows are
        still written (the first workgroup of each row), for the readers after the GEMV (the
        residual stream); they must not share storage with what the GEMV writes."""
        norm_op = self._folds[lin.name]
        producer = {t: op for op in self.graph.ops for t in op.outputs}
        emb = producer.get(norm_op.inputs[0])
        if norm_op.kind != "rms_norm" or emb is None or emb.kind != "embedding" or emb.inputs[1] != "tokens":
            return None
        out = emb.outputs[0]
        if out in self.graph.outputs or out not in self.offsets or self._alias.get(out, out) != out:
            return None
        names = [o.name for o in self.graph.ops]
        if any(names.index(r.name) < names.index(lin.name) for r in readers.get(out, []) if r is not norm_op):
            return None
        w, _ = self._gemv_warp_config(lin)
        e = self.backend.weights.matrix(self._wname(emb.inputs[0]))
        rope = lin.name in self._ropes
        # A and G (with vec4 views) become G, S, the embedding's arrays and TOK
        n = self._gemv_bindings(lin, w, norm_op, rope) - 4 + 2 + 1 + len(e.desc("E").bindings()) + 1
        if e.cols != w.cols or n > self.dev.max_storage_buffers:
            return None
        writes = [self._ropes[lin.name].outputs[0]] if rope else list(lin.outputs)
        return None if self._overlap([out], writes) else emb

    @staticmethod
    def _combined_in_gemv(splits: int) -> bool:
        """Whether a step of this many attention splits merges them in the output projection."""
        return 1 < splits <= COMBINE_IN_GEMV_SPLITS

    def _linear_weight(self, op: Op) -> DeviceWeight:
        """A projection's device weight (q|k|v and gate|up stacked)."""
        ins = op.inputs
        sel = ins[1:4] if op.kind == "linear_qkv" else ins[1:3] if op.kind == "linear_swiglu" else ins[1:2]
        return self.backend.weights.matrix(*(self._wname(t) for t in sel))

    def _linear_config(self, op: Op) -> tuple:
        """A projection's (device weight, bias tensors, output features, folds, GEMV configuration)."""
        a, ins = op.attrs, op.inputs
        glu = op.kind == "linear_swiglu"
        w = self._linear_weight(op)
        if op.kind == "linear_qkv":
            bias = ins[4:7] if a.get("has_bias") else ()
        elif glu:
            bias = ()
        else:
            bias = (ins[2],) if a.get("has_bias") else ()
        n_out = w.rows // 2 if glu else w.rows
        norm_op, attn = self._folds.get(op.name), self._combines.get(op.name)
        fold = {}
        if norm_op is not None:
            fold["norm"] = "add_rms" if norm_op.kind == "add_rms_norm" else "rms"
        if attn is not None:
            fold["combine"] = (attn.attrs["n_heads"], attn.attrs["head_dim"])
        if op.name in self._ropes:
            fold["rope"] = True
        cfg = self.backend.gemv_config(w, n_out, glu, fold, tune=self.max_seq <= GEMV_MAX_ROWS)
        if cfg.get("kind", "block") == "block":
            cfg = {**cfg, "x_vec": 4 if w.cols % 4 == 0 else 1}
        if op.name in self._embeds or self.max_seq > GEMV_MAX_ROWS:
            cfg = staged(cfg)  # x made or quantized in the GEMV's prologue
        return w, bias, n_out, fold, cfg

    def _qout_reader(self, op: Op, w: DeviceWeight, n_out: int, fold: dict) -> tuple[tuple[int, bool], dict] | None:
        """Where the one GEMV reading this gate|up GEMV's output takes x quantized (its xq): the
        int8 planes and block sums it takes, and this GEMV's configuration quantizing its output
        in its epilogue instead (kernels.gemv_warp's qout, 32-row blocks a workgroup; tuned: where
        that times no slower than this GEMV's pick plus the quantize_x dispatch it saves,
        tuning.gemv_qout_config); else None."""
        from .tuning import gemv_qout_config

        out = op.outputs[0]
        if ("qout" not in fold_kinds() or op.kind != "linear_swiglu" or self.max_seq > GEMV_MAX_ROWS
                or out in self.graph.outputs or n_out % 32 or op.name in self._embeds):
            return None
        readers = [o for o in self.graph.ops if out in o.inputs]
        if len(readers) != 1 or readers[0].kind != "linear" or readers[0].inputs[0] != out:
            return None
        down = readers[0]
        if down.name in self._folds or down.name in self._combines or down.name in self._embeds:
            return None
        wd, _, _, _, dcfg = self._linear_config(down)
        if not dcfg.get("xq") or wd.cols != n_out:
            return None
        q = (dcfg.get("planes", 1), kernels.int8_x_sums(wd.fmt))
        cfg = gemv_qout_config(self.dev, w, n_out, True, fold, q)
        if cfg is None:
            return None
        norm_op = None if prologue_ahead(cfg) else self._folds.get(op.name)
        n = self._gemv_bindings(op, w, norm_op, False) + len(kernels.int8_x_parts(*q))
        if cfg.get("xq"):  # x's two bindings (X and its vec4 view) become its quantized arrays
            n += len(kernels.int8_x_parts(cfg.get("planes", 1), kernels.int8_x_sums(w.fmt))) - 2
        if n > self.dev.max_storage_buffers:
            return None
        self._qouts[down.name] = q
        return q, cfg

    def _lower_linear(self, op: Op):
        R, a, ins, outs = self._res, op.attrs, op.inputs, op.outputs
        glu = op.kind == "linear_swiglu"
        norm_op = self._folds.get(op.name)
        w, bias, n_out, fold, cfg = self._linear_config(op)
        qout = self._qout_reader(op, w, n_out, fold) if glu else None
        if qout is not None:
            qout, cfg = qout
        self.matrix_bytes += w.nbytes
        res_in = ins[-1] if op.kind == "linear" and a.get("has_residual") else None
        rows_expr, rows = self._rows_expr(outs[0]), self._rows(outs[0])
        rope_op, attn, emb = self._ropes.get(op.name), self._combines.get(op.name), self._embeds.get(op.name)
        W = self.backend.weights
        # a prologue made ahead (tuning.prologue_ahead): the norm or the split merge by a dispatch
        # of its own before the GEMV (quantize_x with it, or the op's own kernel), not in the GEMV
        pre_norm = norm_op if prologue_ahead(cfg) else None
        if pre_norm is not None:
            norm_op = None
        res = {**_const(w.resources()), "X": R(ins[0]), "Y": R(outs[0])}
        if norm_op is not None:  # x = rms_norm(A [+ B]) * G, computed in the GEMV (_fold_norms)
            del res["X"]
            res.update(A=R(norm_op.inputs[0]), G=R(norm_op.inputs[-1]))
            if norm_op.kind == "add_rms_norm":
                res.update(B=R(norm_op.inputs[1]), S=R(norm_op.outputs[0]))
        if bias:  # bound as BIAS where a folded norm's second addend is B (kernels.gemv_warp)
            names = tuple(self._wname(t) for t in bias)
            res["BIAS" if norm_op is not None else "B"] = lambda: (lambda b: (b, 0, b.size))(W.vector(*names))
        if res_in is not None:
            res["R"] = R(res_in)
        opts = dict(bias=bool(bias), residual=res_in is not None, glu=glu)
        if norm_op is not None:
            opts.update(norm=fold["norm"], eps=norm_op.attrs["eps"])
        if qout is not None:  # y also quantized for the down projection's xq (its quantize_x dispatch gone)
            opts["qout"] = qout
            res.update({"Y" + k[1:]: v for k, v in self._int8_x(n_out, *qout, key="int8_y").items()})
        if emb is not None:  # x's rows from the embedding weight at the step's tokens, written to S (_fold_embed)
            e = W.matrix(self._wname(emb.inputs[0]))
            del res["A"]
            res.update(_const(e.resources("E")), S=R(emb.outputs[0]), TOK=lambda: (self.tok_buf, 0, self.tok_buf.size))
            opts["embed"] = e.desc("E")
        if rope_op is not None:  # q rotated into the rope's output, k and v into the caches (_fold_rope)
            ra = rope_op.attrs
            d, n_rot = ra["head_dim"], ra.get("rope_dim", ra["head_dim"])
            freqs, _ = rope_qkv_extras(rope_op, list(rope_op.inputs))
            cos, sin = self.backend.rope_tables(ra, n_rot, None if freqs is None else self._wname(freqs), self.ctx)
            res.update(Y=R(rope_op.outputs[0]), KC=R(rope_op.inputs[2]), VC=R(rope_op.inputs[3]),
                       COS=lambda: (cos, 0, cos.size), SIN=lambda: (sin, 0, sin.size))
            opts["rope"] = kernels.RopeFold(ra["n_heads"] * d, ra["n_kv_heads"] * d, d, n_rot, ra["style"] == "neox")

        def gemv(c: dict, r: dict, **extra) -> _Dispatch:
            k = kernels.decode_gemv(w.desc(), n_out, rows_expr, c, **opts, **extra, dtypes=_dtypes(r))
            return _Dispatch(self, k, r, lambda s, n: (*_grid2(-(-n_out // c["rows_per_wg"]), self.dev.max_groups), rows(s)))

        ws = None
        if attn is not None:
            wsb = self.backend.workspace(attn.attrs["n_heads"] * MAX_SPLITS * (attn.attrs["head_dim"] + 2) * 4)
            ws = {"WS": lambda: (wsb, 0, wsb.size)}
        if op.name in self._qouts:  # x quantized by the gate|up GEMV that made it (its qout)
            planes, sums = self._qouts[op.name]
            xres = self._int8_x(w.cols, planes, sums, key="int8_y")
            return gemv(cfg, {**{k: v for k, v in res.items() if k != "X"}, **xres})
        if cfg.get("xq"):  # x quantized by its own dispatch, the GEMV reading its codes (gemv_warp's xq)
            planes = cfg.get("planes", 1)
            if op.name in self._attn_quant:  # ... or by the attention that made it (its finish "q")
                takes = (planes, kernels.int8_x_sums(w.fmt))
                if self._attn_quant[op.name] != takes:
                    raise GraphError(f"webgpu: '{op.name}' reads x quantized as {self._attn_quant[op.name]}, "
                                     f"its GEMV takes {takes}")
                xres = self._int8_x(w.cols, *takes)
                return gemv(cfg, {**{k: v for k, v in res.items() if k != "X"}, **xres})
            gq, xres = self._quantize_x(w, {"X": res["X"]}, planes, rows_expr, rows, norm=pre_norm)
            gx = gemv(cfg, {**{k: v for k, v in res.items() if k != "X"}, **xres})
            if attn is not None:  # steps with split attention: its partials merged as x is quantized
                gqc, _ = self._quantize_x(w, ws, planes, rows_expr, rows, combine=fold["combine"])
                return _Choice(lambda s, n: (gqc, gx) if self._combined_in_gemv(n) else (gq, gx), gq, gqc, gx)
            return _Choice(lambda s, n: (gq, gx), gq, gx)
        if cfg.get("ahead"):  # the folded op's own kernel first, then the GEMV on its output
            gv = gemv(staged(cfg), res)
            if attn is not None:
                h, d = fold["combine"]
                cres = {**ws, "O": res["X"]}
                comb = _Dispatch(self, kernels.attention_combine(h, d, rows_expr, dtypes=_dtypes(cres)), cres,
                                 lambda s, n: (h, rows(s), 1))
                return _Choice(lambda s, n: (comb, gv) if self._combined_in_gemv(n) else (gv,), comb, gv)
            pre = self._lower(pre_norm) if pre_norm is not None else []
            return _Choice(lambda s, n: (*pre, gv), *pre, gv)
        gv = gemv(cfg, res)
        if attn is not None:  # steps with split attention read its partials and merge them (_fold_combine)
            cres = {**{k: v for k, v in res.items() if k != "X"}, **ws}
            gc = gemv({**cfg, "stage": True}, cres, combine=(*fold["combine"], MAX_SPLITS, combine_unroll()))
            return _Choice(lambda s, n: (gc,) if self._combined_in_gemv(n) else (gv,), gv, gc)
        if (self.max_seq <= GEMV_MAX_ROWS or not _is_seq(self.graph.tensors[outs[0]].shape[0])
                or not self.backend.prefill_tiled):
            return gv
        planes = prefill_int8_planes(self.dev, w.fmt, w.cols)
        pcfg = self.backend.prefill_config(w, n_out, glu, self.max_seq, planes) if planes else {}
        if "int8" in pcfg:  # x quantized to int8 blocks, then packed dot products (kernels.gemm_int8)
            planes, icfg = pcfg["int8"], {k: v for k, v in pcfg.items() if k != "int8"}
            gq, xres = self._quantize_x(w, {"X": res["X"]}, planes, rows_expr, rows)
            mres = {**{k: v for k, v in res.items() if k != "X"}, **xres}
            gm = _Dispatch(self, kernels.gemm_int8(w.desc(), n_out, rows_expr, **icfg, planes=planes, **opts,
                                                   dtypes=_dtypes(mres)),
                           mres, lambda s, n: (-(-n_out // icfg["tn"]), -(-rows(s) // icfg["tm"]), 1))
            return _Choice(lambda s, n: (gv,) if s <= GEMV_MAX_ROWS else (gq, gm), gv, gq, gm)
        gcfg = pcfg or self.backend.gemm_config(w, n_out, glu, self.max_seq)
        gm = _Dispatch(self, kernels.gemm(w.desc(), n_out, rows_expr, **gcfg, **opts, dtypes=_dtypes(res)), res,
                       lambda s, n: (-(-n_out // gcfg["tn"]), -(-rows(s) // gcfg["tm"]), 1))
        return _Choice(lambda s, n: (gv,) if s <= GEMV_MAX_ROWS else (gm,), gv, gm)

    def _quantize_x(self, w: DeviceWeight, xin: dict, planes: int, rows_expr: str, rows, norm: Op | None = None,
                    combine: tuple[int, int] | None = None) -> tuple:
        """The dispatch quantizing a product's x for weight w into int8 blocks (kernels.quantize_x),
        and the resources of its arrays (_int8_x) for the product to bind. x is xin["X"]; or with
        `norm` (an RMSNorm op made ahead of its GEMV) that op's output, computed here from its
        inputs (the residual sum written to its first output); or with `combine` (heads,
        head_dim) the attention partials of xin["WS"] merged."""
        sums = kernels.int8_x_sums(w.fmt)
        xres = self._int8_x(w.cols, planes, sums)
        opts = {}
        if norm is not None:
            R = self._res
            xin = {"A": R(norm.inputs[0]), "G": R(norm.inputs[-1])}
            if norm.kind == "add_rms_norm":
                xin.update(B=R(norm.inputs[1]), S=R(norm.outputs[0]))
            opts = {"norm": "add_rms" if norm.kind == "add_rms_norm" else "rms", "eps": norm.attrs["eps"]}
        elif combine is not None:
            opts = {"combine": combine}
        qres = {**xin, **xres}
        lanes = quantize_lanes(self.dev)
        gq = _Dispatch(self, kernels.quantize_x(w.cols, rows_expr, planes=planes, sums=sums, lanes=lanes, **opts,
                                                dtypes=_dtypes(qres)),
                       qres, lambda s, n: kernels.quantize_x_grid(w.cols, rows(s), norm=norm is not None, lanes=lanes))
        return gq, xres

    def _int8_x(self, cols: int, planes: int, sums: bool, key: str = "int8_x") -> dict:
        """Resources of x quantized for an int8 prefill product (kernels.quantize_x's XQ, XD, XS,
        XQ2): regions of the backend's workspace `key` ("int8_x"; "int8_y" for a gate|up GEMV's
        qout, which may itself read x from "int8_x"), sized here for this program's rows
        (the largest request sizes it before anything is bound), looked up again at each bind."""
        sizes = kernels.int8_x_sizes(self.max_seq, cols, planes, sums)
        offs, end = {}, 0
        for k, n in sizes.items():
            offs[k] = end
            end += -(-n // 256) * 256  # bindings start at multiples of 256 bytes
        self.backend.workspace(end, key)
        return {k: (lambda k=k: (self.backend.workspace(end, key), offs[k], sizes[k])) for k in sizes}

    def _lower_rope(self, op: Op):
        a, ins, outs, R = op.attrs, op.inputs, op.outputs, self._res
        S = kernels.RopeSegment
        if op.kind == "kv_store":
            cols = self.shape(ins[1], 1)[-1]
            segs, x, d, r = [S(1, 0, "KC", False)], ins[1], cols, 0
            res = {"X": R(ins[1]), "KC": R(ins[0])}
            freqs = None
            rows = self._rows(ins[1])
        else:
            d, r = a["head_dim"], a.get("rope_dim", a["head_dim"])
            if op.kind == "rope_qkv_store":
                h, g = a["n_heads"], a["n_kv_heads"]
                segs = [S(h, 0, "Q", True), S(g, h * d, "KC", True), S(g, (h + g) * d, "VC", False)]
                res = {"X": R(ins[0]), "Q": R(outs[0]), "KC": R(ins[2]), "VC": R(ins[3])}
                freqs = ins[4] if len(ins) > 4 else None
            elif op.kind == "rope":
                segs = [S(a["n_heads"], 0, "Q", True)]
                res = {"X": R(ins[0]), "Q": R(outs[0])}
                freqs = ins[2] if len(ins) > 2 else None
            else:  # rope_store(x, start, cache, freqs?)
                segs = [S(a["n_heads"], 0, "KC", True)]
                res = {"X": R(ins[0]), "KC": R(ins[2])}
                freqs = ins[3] if len(ins) > 3 else None
            x = ins[0]
            rows = self._rows(ins[0])
        cos, sin = self.backend.rope_tables(a, r, None if freqs is None else self._wname(freqs), self.ctx)
        res["COS"] = lambda: (cos, 0, cos.size)
        res["SIN"] = lambda: (sin, 0, sin.size)
        x_cols = self.shape(x, 1)[-1]
        k = kernels.rope(segs, x_cols, d, r, a.get("style") == "neox", self._rows_expr(x), dtypes=_dtypes(res))
        n_heads = sum(s.n for s in segs)
        return _Dispatch(self, k, res, lambda s, n: (n_heads, rows(s), 1))

    def _decode_attention_kernel(self, op: Op, cache_dtype: str):
        """The attention template of steps of a few rows: kernels.attention_warp (lane groups per
        key, no barrier per key) where the adapter's subgroup size is known and the head size
        splits over it, its subgroups and keys at once tuned for this attention's shape
        (tuning.attention_config; a prefill program takes the cached pick); else
        kernels.attention (a thread per key). EDGELLM_WEBGPU_ATTN=thread keeps the latter
        (benchmarks compare them)."""
        from .tuning import attention_config

        a = op.attrs
        sg = self._warp_attention_sg(op)
        if sg:
            cfg = attention_config(self.dev, a["n_heads"], a["n_kv_heads"], a["head_dim"], sg, cache_dtype,
                                   tune=self.max_seq <= GEMV_MAX_ROWS)
            return functools.partial(kernels.attention_warp, sg=sg, **cfg)
        return kernels.attention

    def _warp_attention_sg(self, op: Op) -> int:
        """The subgroup lanes kernels.attention_warp runs this attention on, or 0 where it runs
        kernels.attention (no known subgroup size, a head size it cannot split, or
        EDGELLM_WEBGPU_ATTN=thread)."""
        sub = self.dev.subgroup_size
        if not sub or os.environ.get("EDGELLM_WEBGPU_ATTN", "warp") == "thread":
            return 0
        sg = min(32, sub)
        return sg if kernels.attention_warp_fits(op.attrs["head_dim"], sg) else 0

    def _lower_attention(self, op: Op) -> list:
        a, ins, outs, R = op.attrs, op.inputs, op.outputs, self._res
        h, g, d = a["n_heads"], a["n_kv_heads"], a["head_dim"]
        rows_expr, rows = self._rows_expr(ins[0]), self._rows(ins[0])
        res = {"Q": R(ins[0]), "KC": R(ins[1]), "VC": R(ins[2]), "O": R(outs[0])}
        attention = self._decode_attention_kernel(op, _dtypes(res).get("KC", "f32"))
        direct = _Dispatch(self, attention(h, g, d, a["scale"], rows_expr, partial=False, dtypes=_dtypes(res)), res,
                           lambda s, n: (h, rows(s), 1))
        if self.max_seq != 1:
            if not self.backend.prefill_tiled or self.max_seq <= GEMV_MAX_ROWS:
                return [direct]
            wb = self.dev.max_workgroup_memory - 4096
            cache_dtype = _dtypes(res).get("KC", "f32")
            kind = prefill_attention_kind(self.dev, h, g, d, cache_dtype, wb)
            tiled = _Dispatch(self, kernels.PREFILL_ATTENTIONS[kind](h, g, d, a["scale"], rows_expr, cache_dtype=cache_dtype,
                                                                     dtypes=_dtypes(res), workgroup_bytes=wb),
                              res, lambda s, n: prefill_attention_grid(kind, h, d, rows(s), wb))
            return [_Choice(lambda s, n: (direct,) if s <= GEMV_MAX_ROWS else (tiled,), direct, tiled)]
        ws = self.backend.workspace(h * MAX_SPLITS * (d + 2) * 4)
        wres = {**res, "WS": lambda: (ws, 0, ws.size)}
        if op.name in self._finished:  # one split: the whole attention, unless it also quantizes its output
            fin, mode = self._finishing_attention(op, attention, wres)
            return [fin] if mode == "q" else [_Choice(lambda s, n: (direct,) if n == 1 else (fin,), direct, fin)]
        part = _Dispatch(self, attention(h, g, d, a["scale"], rows_expr, partial=True, dtypes=_dtypes(wres)), wres,
                         lambda s, n: (h, rows(s), n))
        comb = _Dispatch(self, kernels.attention_combine(h, d, rows_expr, dtypes=_dtypes(wres)), wres, lambda s, n: (h, rows(s), 1))
        if any(a is op for a in self._combines.values()):  # the output projection merges the splits
            return [_Choice(lambda s, n: (direct,) if n == 1 else (part,) if self._combined_in_gemv(n) else (part, comb),
                            direct, part, comb)]
        return [_Choice(lambda s, n: (direct,) if n == 1 else (part, comb), direct, part, comb)]

    def _finishing_attention(self, op: Op, attention, wres: dict) -> tuple:
        """A one-token step's attention split over the context whose last workgroup per head merges
        the splits (kernels.attention_warp's finish; one split included): its output written, or
        quantized into the int8 x of the output projection where that GEMV reads x so (xq).
        Returns the dispatch and its finish ("o" or "q")."""
        a = op.attrs
        h, g, d = a["n_heads"], a["n_kv_heads"], a["head_dim"]
        rows_expr, rows = self._rows_expr(op.inputs[0]), self._rows(op.inputs[0])
        cnt = self.backend.workspace(4 * h, "attention_count")  # zero between dispatches (the kernel resets it)
        res = {**wres, "CNT": lambda: (cnt, 0, cnt.size)}
        mode, planes, sums = "o", 1, True
        lin = self._finished[op.name]
        if lin is not None and d % 32 == 0 and lin.name not in self._qouts:
            w, _, _, _, cfg = self._linear_config(lin)
            if cfg.get("xq"):
                mode, planes, sums = "q", cfg.get("planes", 1), kernels.int8_x_sums(w.fmt)
                del res["O"]
                res.update(self._int8_x(w.cols, planes, sums))
                self._attn_quant[lin.name] = (planes, sums)
        k = attention(h, g, d, a["scale"], rows_expr, partial=True, finish=mode, max_splits=MAX_SPLITS, planes=planes,
                      sums=sums, dtypes=_dtypes(res))
        return _Dispatch(self, k, res, lambda s, n: (h, rows(s), n)), mode

    def _delegate(self, op: Op):
        """An op without a kernel here runs on the cpu backend's reference kernel (its inputs read
        back, its outputs written to the device). A KV-cache write must stay on the device."""
        from ..cpu import CPU_KERNELS

        if any(self.graph.tensors[o].alias_of for o in op.outputs):
            raise GraphError(f"webgpu: op '{op.name}' ({op.kind}) writes state and cannot be delegated to the cpu")
        self.delegated.append(op.name)
        return _HostOp(self, op, CPU_KERNELS[op.kind])

    # -- execution ----------------------------------------------------------------------------
    def _step_words(self, seq: int, start: int, hist: int = 0) -> tuple[np.ndarray, int]:
        """A step's uniform values (kernels.STEP_BYTES) and its attention splits."""
        kv_len = start + seq
        splits = 1
        if self.max_seq == 1:
            splits = max(1, min(MAX_SPLITS, -(-kv_len // self.split_keys)))
        split_len = -(-kv_len // splits) if splits > 1 else self.ctx
        return np.array([seq, start, kv_len, split_len, splits, hist, 0, 0], np.uint32), splits

    def _write_step(self, seq: int, start: int, hist: int = 0) -> int:
        words, splits = self._step_words(seq, start, hist)
        self.dev.write(self.step_buf, words)
        return splits

    def _flat(self, seq: int, splits: int, with_argmax: bool, chooser: list | None) -> list | None:
        """A step's dispatches as (pipeline, bind group, x, y, z) of wgpu-native handles, made once
        per step shape (tokens, splits, token choice) and arena binding, then replayed by _record
        with wgpu-native's own calls: a decode token's few hundred dispatches cost the Python
        loop's ~1.5 us each instead of ~6 us through the steps' objects (lavapipe machine,
        2026-11-29). None where a step runs on the host or the raw calls are unavailable."""
        if _RAW is None or self._has_host_ops:
            return None
        gen = self.backend.arena_gen
        if self._flat_key != (gen, chooser):  # a new arena, or another chooser (held here, so its id stays its own)
            self._flat_cache, self._flat_key = {}, (gen, chooser)
        key = (seq, splits, with_argmax)
        flat = self._flat_cache.get(key)
        if flat is None:
            steps = list(self._steps) + (list(chooser or self._argmax) if with_argmax else [])
            flat = []
            for st in steps:
                st.prepare()
                for d in st.dispatches(seq, splits):
                    x, y, z = d.grid_of(seq, splits)
                    if x * y * z:
                        flat.append((d.pipeline._internal, d.bind_group._internal, x, y, z,
                                     len(dynamic_offsets(d.kernel.kinds))))
            self._flat_cache[key] = flat
        return flat

    def _record(self, seq: int, splits: int, with_argmax: bool = False, chooser: list | None = None) -> None:
        """Encode and submit one step; with_argmax: then the token choice (the dispatches of
        chooser, default the argmax) into the token buffer and the history."""
        dev = self.dev
        flat = self._flat(seq, splits, with_argmax, chooser)
        if flat is not None:
            enc = dev.device.create_command_encoder()
            cpass = enc.begin_compute_pass()
            replay_dispatches(cpass, flat, _RAW)
            cpass.end()
            dev.queue.submit([enc.finish()])
            return
        for st in self._steps:
            st.prepare()
        enc = dev.device.create_command_encoder()
        cpass = enc.begin_compute_pass()
        for st in self._steps:
            if isinstance(st, _HostOp):
                cpass.end()
                dev.queue.submit([enc.finish()])
                st.run(seq)
                enc = dev.device.create_command_encoder()
                cpass = enc.begin_compute_pass()
            else:
                st.encode(cpass, seq, splits)
        if with_argmax:
            for d in chooser or self._argmax:
                d.prepare()
                d.encode(cpass, seq, splits)
        cpass.end()
        dev.queue.submit([enc.finish()])

    def _encode_tokens(self, start: int, hist: int, k: int, chooser: list | None, timestamps=None, slot: int = 0,
                       readback=None):
        """k decode steps, each with its token choice, at positions start.. (history slots hist..) as
        one compute pass, and the steps' uniform values: step j's dispatches read slot j of the
        step buffer (its dynamic offset), which the caller writes with the returned words before
        submitting. One pass, no copy between steps (until 2026-11-30 each step's values were
        copied into one slot ahead of a pass of its own: on the H200 through Vulkan the greedy
        wall per 1B token was 0.94-1.00 ms against 0.83-0.91 ms this way, the GPU's own time per
        token the same 0.79 ms; benchmarks/webgpu_decode_profile.py). timestamps: (query set,
        buffer) that the pass's start and end times are written to and resolved into (the
        profile's). None where steps cannot be replayed (_flat)."""
        words = np.zeros((k, self.dev.step_stride // 4), np.uint32)
        flats = []
        for j in range(k):
            w, splits = self._step_words(1, start + j, hist + j)
            flat = self._flat(1, splits, True, chooser)
            if flat is None:
                return None
            words[j, :w.size] = w
            flats.append(flat)
        enc = self.dev.device.create_command_encoder()
        cpass = enc.begin_compute_pass(**({} if timestamps is None else {"timestamp_writes": {
            "query_set": timestamps[0], "beginning_of_pass_write_index": 0, "end_of_pass_write_index": 1}}))
        for j, flat in enumerate(flats):
            replay_dispatches(cpass, flat, _RAW, (slot + j) * self.dev.step_stride)
        cpass.end()
        if timestamps is not None:
            enc.resolve_query_set(timestamps[0], 0, 2, timestamps[1], 0)
        if readback is not None:
            enc.copy_buffer_to_buffer(self.hist_buf, 4 * hist, readback, 0, 4 * k)
        return enc.finish(), words.reshape(-1)

    def run(self, inputs: dict[str, object]) -> dict[str, WebgpuTensor]:
        """One step over the given tokens at start_pos. The returned tensors are the program's own
        buffers, valid until its next run."""
        ids = np.asarray(inputs["tokens"], dtype=np.int64).reshape(-1)
        seq, start = int(ids.size), int(inputs["start_pos"])
        if seq > self.max_seq:
            raise GraphError(f"webgpu program '{self.graph.name}' was compiled for {self.max_seq} tokens, got {seq}")
        if start + seq > self.ctx:
            raise GraphError(f"tokens {start}..{start + seq} exceed the KV cache of {self.ctx}")
        self._host_start = start
        with _device_errors(f"running '{self.graph.name}' on {seq} tokens"):
            self.dev.write(self.tok_buf, ids.astype(np.uint32))
            self._record(seq, self._write_step(seq, start))
        return {name: self.tensor(name, seq) for name in self.graph.outputs}

    def draws_on_device(self, params) -> bool:  # loop_tokens draws any sampled generation (kernels.sample_kernels)
        return device_sampling_enabled() and self._argmax is not None

    def _token_resources(self) -> dict:
        return {"X": self._res("logits"), "TOK": lambda: (self.tok_buf, 0, self.tok_buf.size),
                "HIST": lambda: (self.hist_buf, 0, self.hist_buf.size)}

    def _sample_dispatches(self, p) -> list:
        """The dispatches of a sampled step with SamplingParams p (kernels.sample_plan); the
        sampler's buffers and pipelines are made at the first sampled generation."""
        n = self.shape("logits", 1)[-1]
        nwg = kernels.sample_parallelism(n)
        if self._sampler_kernels is None:
            self.samp_buf = self.dev.buffer(4 * kernels.SAMPLE_WORDS)
            self.state_buf = self.dev.buffer(4 * kernels.STATE_WORDS)
            self.part_buf = self.dev.buffer(4 * kernels.sample_part_words(n))
            self._sampler_res = {**self._token_resources(), "SAMP": lambda: (self.samp_buf, 0, self.samp_buf.size),
                                 "STATE": lambda: (self.state_buf, 0, self.state_buf.size),
                                 "PART": lambda: (self.part_buf, 0, self.part_buf.size)}
            self._sampler_kernels = kernels.sample_kernels(n)
        plan = kernels.sample_plan(p.top_k, p.top_p, p.min_p, n)
        for name, parallel in plan:  # each kernel's dispatch (and pipeline) made at its first use
            if name not in self._samplers:
                self._samplers[name] = _Dispatch(self, self._sampler_kernels[name], self._sampler_res,
                                                 lambda s, c, g=nwg if parallel else 1: (g, 1, 1))
        return [self._samplers[name] for name, _ in plan]

    def loop_tokens(self, first_token: int, start: int, n: int, draw=None, stop: Collection[int] = ()) -> Iterator[int]:
        """Decode on the device: each step's token choice (the argmax, or a draw as `draw`, an
        edgellm.sampling.DeviceDraw, says: kernels.sample_kernels) writes the next token into the token
        buffer the next step's embedding reads, so no step waits for the host. Steps go in batches,
        a batch one command buffer (_encode_tokens), and one batch is always queued ahead: the next
        is encoded and submitted before this one's token ids are read back, so the GPU never waits
        for that read. Batches grow 1, 2, 4, ... (the first token comes at once) up to LOOP_BATCH
        steps and, once a batch has been timed, to about LOOP_BATCH_S of decoding: past an
        end-of-generation token the caller stops at, the rest of its batch and the batch queued
        after it still run (their cache rows lie beyond the tokens kept), and no more is submitted
        unless the caller reads on. Yields n tokens after first_token at position start. stop (the
        cuda backend's argument) changes nothing here: what runs past a stop token is bounded by
        the batches, whatever the tokens."""
        if self._argmax is None:
            raise GraphError("loop_tokens runs on the single-token decode program")
        chooser = None
        if draw is not None and not draw.params.greedy:
            p = draw.params
            chooser = self._sample_dispatches(p)
            self.dev.write(self.samp_buf, kernels.sample_words(p.temperature, p.top_k, p.top_p, p.min_p, draw.seed))
            self.dev.write(self.state_buf, kernels.sample_state())  # the cut of a step without cuts
        if start + n > self.ctx:
            raise GraphError(f"{start + n} tokens exceed the context of {self.ctx}")
        self.dev.write(self.tok_buf, np.array([first_token], np.uint32))
        if n <= 0:
            return
        with _device_errors(f"greedy decoding at position {start}"):
            first = self._encode_tokens(start, 0, 1, chooser, slot=self._slot(0), readback=self._readback(0))
        if first is None:  # steps with host work: a submission a step
            yield from self._loop_steps(start, n, chooser)
            return
        yield from self._loop_batches(start, n, chooser, first)

    def _readback(self, i: int):
        """loop_tokens' mappable buffers for a batch's token ids, two used in turn (one batch's
        read while the next batch is queued), made at the first batched loop."""
        if not self._readbacks:
            U = self.dev.wgpu.BufferUsage
            self._readbacks = [self.dev.device.create_buffer(size=4 * LOOP_BATCH, usage=U.MAP_READ | U.COPY_DST)
                               for _ in range(2)]
        return self._readbacks[i % 2]

    @staticmethod
    def _slot(b: int) -> int:
        """The first step slot of loop_tokens' batch b: batches take the step buffer's halves in turn."""
        return (b % 2) * LOOP_BATCH

    def _loop_batches(self, start: int, n: int, chooser, first) -> Iterator[int]:
        """loop_tokens where steps replay (_encode_tokens; `first`, the first step's batch, encoded):
        each batch submitted before the one ahead of it is read, reads waiting for their own
        submission (Device.submission_reader)."""
        queued = collections.deque()  # (steps, batch number, submission index) submitted, not yet read
        io = self.dev.submission_reader()

        def submit(encoded, k: int, b: int) -> None:
            # batch b's step values in half b % 2 of the step buffer (_slot): the batch before it,
            # which may still run, reads the other half
            self.dev.write(self.step_buf, encoded[1], self._slot(b) * self.dev.step_stride)
            queued.append((k, b, io.submit(encoded[0])))

        with _device_errors(f"greedy decoding at position {start}"):
            submit(first, 1, 0)
        pos, k, b, per_step, last = 1, 1, 1, None, None
        while queued:
            with _device_errors(f"greedy decoding at position {start + pos}"):
                if pos < n:  # the next batch goes in before this one's ids are read
                    k = min(2 * k, LOOP_BATCH, n - pos)
                    if per_step:
                        k = max(1, min(k, int(LOOP_BATCH_S / per_step)))
                    submit(self._encode_tokens(start + pos, pos, k, chooser, slot=self._slot(b),
                                               readback=self._readback(b)), k, b)
                    pos, b = pos + k, b + 1
                kk, bb, index = queued.popleft()
                ids = np.frombuffer(io.read(self._readback(bb), 4 * kk, index), np.uint32)
            now = time.perf_counter()
            if last is not None and queued:  # a batch's time from its predecessor's read: the GPU's, the next queued
                per_step = (now - last) / kk
            last = now
            for t in ids:
                yield int(t)

    def _loop_steps(self, start: int, n: int, chooser) -> Iterator[int]:
        """loop_tokens where steps cannot be replayed (host work in a step): a submission a step,
        read back in batches as loop_tokens' growth."""
        i, k = 0, 1
        while i < n:
            with _device_errors(f"greedy decoding at position {start + i}"):
                for j in range(i, i + k):
                    self._host_start = start + j
                    # the step's values are written in queue order: after the previous step's commands
                    self._record(1, self._write_step(1, start + j, hist=j), with_argmax=True, chooser=chooser)
                ids = np.frombuffer(self.dev.read(self.hist_buf, 4 * i, 4 * k), np.uint32)
            for t in ids:
                yield int(t)
            i += k
            k = min(2 * k, LOOP_BATCH, n - i)


class _Choice:
    """Variants of one op chosen per step: pick(seq, splits) gives the dispatches to record (GEMV
    or GEMM by token count; attention direct, or split over the context and combined, by the
    step's split count)."""

    def __init__(self, pick, *variants):
        self.pick, self.variants = pick, variants

    def prepare(self) -> None:
        for v in self.variants:
            v.prepare()

    def encode(self, cpass, seq: int, splits: int) -> None:
        for v in self.pick(seq, splits):
            v.encode(cpass, seq, splits)

    def dispatches(self, seq: int, splits: int) -> list[_Dispatch]:
        return list(self.pick(seq, splits))


class _HostOp:
    def __init__(self, prog: WebgpuProgram, op: Op, fn):
        self.prog, self.op, self.fn = prog, op, fn

    def prepare(self) -> None:
        pass

    def run(self, seq: int) -> None:
        import torch

        prog, op = self.prog, self.op
        args = []
        for t in op.inputs:
            tt = prog.graph.tensors[t]
            if t == "start_pos":
                args.append(prog._host_start)
            elif t == "tokens":
                ids = np.frombuffer(prog.dev.read(prog.tok_buf, 0, 4 * seq), np.uint32).astype(np.int64)
                args.append(torch.from_numpy(ids))
            elif tt.kind == "weight":
                args.append(prog.backend.cpu_weights().get(tt.source or t))
            else:
                args.append(torch.from_numpy(prog.tensor(t, seq).numpy()))
        with torch.inference_mode():
            result = self.fn(op, args)
        for name, value in zip(op.outputs, (result,) if len(op.outputs) == 1 else result):
            prog.tensor(name, seq).write(value.float().numpy())


def _dtypes(res: dict) -> dict:
    """Binding name -> element type of the tensor each resource holds (kernels.py's `dtypes`)."""
    return {k: getattr(v, "dtype", "f32") for k, v in res.items()}


def _is_seq(d) -> bool:
    """Whether a dimension (int, sympy expression, or a cached graph's SymDim) is the token count."""
    return not isinstance(d, int) and str(d) == "seq"


def _const(res: dict) -> dict:
    return {k: (lambda v=v: v) for k, v in res.items()}


class WebgpuBackend(WebgpuInfo):
    def __init__(self, f: GGUFFile):
        self.dev = get_device()
        self.file = f
        self.weights = WebgpuWeights(f, self.dev)
        self._timing_at_start = tuning_timing_s()
        self.arena_buffer = None
        self.arena_gen = 0
        self._arena_need = 256
        self._tables: dict[tuple, tuple] = {}
        self._workspaces: dict = {}
        self._cpu_weights = None
        # tiled GEMM for prefill on GPUs; a software adapter runs prefill as GEMVs, which need no
        # workgroup barriers (lavapipe, SmolLM2 prompt of 37 tokens: 80 s with the GEMM). Override
        # with EDGELLM_WEBGPU_TILED=0/1 (the tiled GEMM and the tiled causal attention together).
        want = os.environ.get("EDGELLM_WEBGPU_TILED")
        self.prefill_tiled = (want == "1") if want in ("0", "1") else not self.dev.info.software
        # the KV cache in fp16 where the adapter has shader-f16 (half the memory and the attention's
        # reads; the cuda backend's choice too); EDGELLM_WEBGPU_KV=f32 keeps it in float32
        self.kv_dtype = "f16" if self.dev.has_f16 and os.environ.get("EDGELLM_WEBGPU_KV", "f16") != "f32" else "f32"
        # activations in the arena: float32 (the cpu reference's type) unless EDGELLM_WEBGPU_ACT=f16 on
        # an adapter with shader-f16 (half the activation traffic; the storage descriptors change,
        # the kernels' float32 maths does not)
        self.act_dtype = "f16" if self.dev.has_f16 and os.environ.get("EDGELLM_WEBGPU_ACT", "f32") == "f16" else "f32"

    def max_logit_rows(self, vocab: int) -> int:
        """The most rows of logits one program may output: a power of two whose float32 rows fit
        one storage binding (Model caps its all-logits prefill program's chunk with it)."""
        fit = max(1, (self.dev.max_binding - 64) // (4 * max(1, vocab)))
        return 1 << (fit.bit_length() - 1)

    @property
    def tune_s(self) -> float:
        """Seconds spent timing launch configurations since this backend was made (a first load
        on this adapter; cached picks time nothing)."""
        return tuning_timing_s() - self._timing_at_start

    @staticmethod
    def available() -> bool:
        try:
            get_device()
            return True
        except BackendUnavailableError:
            return False

    # -- shared buffers --------------------------------------------------------------------------
    def reserve_arena(self, nbytes: int) -> None:
        """One arena for every program (programs never run at the same time): sized to the largest
        plan, (re)made before the first run; bind groups are remade when it grows."""
        need = int(nbytes) + 256
        if need > self._arena_need or self.arena_buffer is None:
            self._arena_need = max(need, self._arena_need)
            if self._arena_need > self.dev.max_buffer:
                raise DeviceMemoryError(f"webgpu: the activations need {self._arena_need} bytes, more than the "
                                        f"adapter's largest buffer ({self.dev.max_buffer}); use a smaller prefill chunk")
            self.arena_buffer = self.dev.buffer(self._arena_need)
            self.arena_gen += 1

    def workspace(self, nbytes: int, key: str = "attention"):
        """A scratch buffer of at least nbytes per use (`key`: the split attention's partials, the
        int8 prefill's quantized x), grown as asked (every program's dispatches then rebind)."""
        b = self._workspaces.get(key)
        if b is None or b.size < nbytes:
            b = self._workspaces[key] = self.dev.buffer(nbytes)
            self.arena_gen += 1  # rebinds every program's dispatches
        return b

    def rope_tables(self, a: dict, n_rot: int, freqs: str | None, ctx: int):
        """cos and sin of every position's angles [ctx, n_rot / 2], in float64 then float32 (the
        cpu reference's rounding); one pair per distinct rope configuration."""
        key = (a.get("theta"), n_rot, a.get("pos_scale", 1.0), freqs, ctx)
        t = self._tables.get(key)
        if t is None:
            if n_rot == 0:
                z = self.dev.buffer(16)
                t = (z, z)
            else:
                inv = a["theta"] ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
                if freqs is not None:
                    inv = inv / self.weights.vector_host(freqs)
                ang = (np.arange(ctx, dtype=np.float64) * a.get("pos_scale", 1.0))[:, None] * inv[None, :]
                t = (self.dev.upload(np.cos(ang).astype(np.float32)), self.dev.upload(np.sin(ang).astype(np.float32)))
            self._tables[key] = t
        return t

    def gemv_config(self, w: DeviceWeight, n_out: int, glu: bool, fold: dict | None = None, tune: bool = True) -> dict:
        """The decode GEMV's kernel and launch configuration (kernels.decode_gemv): the adapter's
        default, or (tuning.tuning_on: on a GPU unless EDGELLM_TUNE=0) the fastest candidate timed here,
        with the folds it carries (tuning.gemv_config's fold), and cached."""
        from .tuning import gemv_config

        return gemv_config(self.dev, w, n_out, glu, fold, tune)

    def prefill_config(self, w: DeviceWeight, n_out: int, glu: bool, rows: int, planes: int) -> dict:
        """The prefill product of a weight that can take int8 activations: int8 and its tiles, or
        (tuned) the float product's tiles where those time faster (tuning.prefill_config)."""
        from .tuning import prefill_config

        return prefill_config(self.dev, w, n_out, glu, rows, planes)

    def gemm_config(self, w: DeviceWeight, n_out: int, glu: bool, rows: int) -> dict:
        """Tile sizes of the prefill GEMM: the default, or (tuning.tuning_on) the fastest candidate at
        this program's token count, timed here and cached."""
        from .tuning import gemm_config

        return gemm_config(self.dev, w, n_out, glu, rows)

    def cpu_weights(self):
        if self._cpu_weights is None:
            from ..cpu import CpuWeights

            self._cpu_weights = CpuWeights(self.file)
        return self._cpu_weights

    # -- the backend interface ---------------------------------------------------------------------
    def allocate_states(self, graph: Graph, ctx: int) -> dict[str, WebgpuTensor]:
        out = {}
        for t in graph.states():
            shape = t.concrete_shape(ctx=ctx)
            nbytes = (2 if self.kv_dtype == "f16" else 4) * math.prod(shape)
            if nbytes > self.dev.max_binding:
                raise DeviceMemoryError(f"webgpu: KV cache '{t.name}' needs {nbytes} bytes at context {ctx}, more than "
                                        f"the adapter's {self.dev.max_binding}-byte binding; lower --ctx")
            out[t.name] = WebgpuTensor(self.dev, self.dev.buffer(nbytes), 0, shape, self.kv_dtype)
        return out

    # -- the program cache (Model calls these around compiling its programs) ---------------------
    def load_weight_cache(self, cache, fingerprint: str) -> bool:
        """Adopt the converted weights a previous load of this file left in the program cache
        (WebgpuWeights.restore); True when an intact entry was found. The conversions depend on the
        file and the engine only, not on the adapter."""
        from ...cache import program_key

        key = program_key(model=fingerprint, artifact="webgpu-weights")
        self._weight_cache = (cache, key)
        self.weights.keep_converted = True
        found = cache.get_arrays(key, "weights.bin")
        if found is None:
            return False
        try:
            return self.weights.restore(*found) > 0
        except (ValueError, KeyError, TypeError, AttributeError):  # another layout: converted anew, rewritten
            self.weights._cached.clear()
            return False

    def save_weight_cache(self) -> None:
        """Write the converted weights when this load converted any, then drop the host copies."""
        wc = getattr(self, "_weight_cache", None)
        if wc is not None and self.weights._built:
            cache, key = wc
            meta, arrays = self.weights.save()
            cache.put_arrays(key, "weights.bin", arrays, meta)
        self.weights.release_host()

    def _weight_sets(self, graph: Graph) -> list[tuple[str, ...]]:
        """The weight sets (file tensor names, stacked) a program of this graph will upload, in the
        order WebgpuProgram takes them: embeddings and the projections it runs itself."""
        sets = []
        for op in graph.ops:
            if op.kind not in self.SUPPORTED_OPS:
                continue
            ins = op.inputs
            sel = (ins[:1] if op.kind == "embedding" else ins[1:4] if op.kind == "linear_qkv" else
                   ins[1:3] if op.kind == "linear_swiglu" else ins[1:2] if op.kind == "linear" else ())
            if sel:
                sets.append(tuple(graph.tensors[t].source or t for t in sel))
        return sets

    def compile(self, graph: Graph, states: dict, plan=None, max_seq: int | None = None) -> WebgpuProgram:
        self.weights.prefetch(self._weight_sets(graph))
        with _device_errors(f"uploading {self.file.path.name}'s weights and compiling '{graph.name}'"):
            return WebgpuProgram(self, graph, states, plan, max_seq or 512)

    @staticmethod
    def to_numpy(t) -> np.ndarray:
        return t.numpy() if isinstance(t, WebgpuTensor) else np.asarray(t, dtype=np.float32)

    def describe(self) -> str:
        return f"webgpu ({self.dev.describe()}; WGSL kernels, {self.act_dtype} activations, {self.kv_dtype} KV cache)"
