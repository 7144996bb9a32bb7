"""A decode step of the cpu-fast backend run by the native library in one call.

A program compiled for one token (the decode stage) whose every op has a native form is lowered
once into a list of op records (cpu_native.c: `edgellm_op`, run by `edgellm_step`): each
intermediate tensor gets a float32 buffer of its one-token shape, the KV caches and norm weights
are the program's own tensors, the matrices are the file's blocks the native products read. A
step is then one call into the library: one parallel region whose threads meet at a barrier after
each op, instead of the interpreter calling torch and the library ~250 times (on the 2-core
machine the per-op costs were a third of the default model's step: docs/benchmarks.md).

What is lowered: embedding, rms_norm, add_rms_norm, linear (bias, residual), linear_qkv (bias),
linear_swiglu (SiLU or tanh-GELU gate), rope_qkv_store (either pair layout, partial rotation,
scaled positions and frequency factors through the program's own RoPE tables, per-head q/k norms),
decode attention (grouped-query heads) and last_row, with matrices of the native formats (Q8_0,
Q4_0, Q4_1). A graph with anything else (a sliding window, a soft cap, a scaled embedding, another
weight format) keeps the interpreter; `lower` says why (the program's `step_unavailable`).
EDGELLM_NATIVE_STEP=0 turns the lowering off.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from ..errors import GraphError
from ..graph.shapes import shape_function
from . import cpu_native
from .cpu import rope_qkv_extras

EOP = {"embedding": 1, "rms_norm": 2, "add_rms_norm": 3, "linear": 4, "linear_qkv": 4, "linear_swiglu": 5,
       "rope_qkv_store": 6, "attention": 7}
FMT = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
ACTS = {"silu": 0, "gelu_tanh": 1}
STYLES = {"norm": 0, "neox": 1}
# the attributes each op kind may carry and still be lowered (anything else: the interpreter)
ATTRS = {"embedding": set(), "rms_norm": {"eps"}, "add_rms_norm": {"eps"}, "linear": {"has_bias", "has_residual"},
         "linear_qkv": {"has_bias"}, "linear_swiglu": {"act"}, "last_row": set(),
         "rope_qkv_store": {"n_heads", "head_dim", "rope_dim", "theta", "style", "pos_scale", "n_kv_heads", "mscale",
                            "qk_norm_eps"},
         "attention": {"n_heads", "n_kv_heads", "head_dim", "scale"}}

_p, _f = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)


class EdgellmOp(ctypes.Structure):
    """cpu_native.c's edgellm_op, field for field."""

    _fields_ = [("kind", ctypes.c_int32), ("fmt", ctypes.c_int32), ("act", ctypes.c_int32), ("style", ctypes.c_int32),
                ("n_heads", ctypes.c_int32), ("n_kv", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("rope_dim", ctypes.c_int32),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("parts", ctypes.c_int64),
                ("w", _p), ("rows", _p),
                ("a", _p), ("b", _p), ("wv", _p), ("bias", _p), ("res", _p),
                ("y", _p), ("y2", _p), ("cos", _p), ("sin", _p), ("kc", _p), ("vc", _p), ("qn", _p), ("kn", _p),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class Unsupported(Exception):
    """The graph has something the native step does not run (the message says what)."""


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class NativeStep:
    """The lowered program (see the module's docstring); `run` has CpuProgram.run's contract for
    one token."""

    def __init__(self, program, lib: ctypes.CDLL):
        self.lib = lib
        g = self.graph = program.graph
        w = program.weights
        ctx = max(t.shape[0] for t in program.states.values()) if program.states else 1
        self.ctx = ctx
        self.buf: dict[str, torch.Tensor] = {}  # every tensor an op reads or writes, by name
        self.keep: list = []  # what the records point into
        self.inputs: list[str] = []  # fed per call (besides tokens and start_pos)
        for name in g.inputs:
            if name in ("tokens", "start_pos"):
                continue
            self.inputs.append(name)
            self.buf[name] = self._activation(name)
        self.states = {t.name for t in g.states()}
        for t in g.states():
            s = program.states[t.name]
            if s.dtype != torch.float32 or not s.is_contiguous():
                raise Unsupported(f"state '{t.name}' is not contiguous float32")
            self.buf[t.name] = s
        self.vocab = None
        self.caches: list[torch.Tensor] = []
        self.rope_rows: list[int] = []
        records, kmax, nmax, heads = [], 32, 2, 1
        self.op_index: list[int] = []  # the graph op of each record
        for index, op in enumerate(g.ops):
            extra = set(op.attrs) - ATTRS.get(op.kind, set())
            if op.kind not in ATTRS or extra:
                raise Unsupported(f"op '{op.name}' ({op.kind}{', attributes ' + str(sorted(extra)) if extra else ''})")
            if op.kind == "last_row":  # one token: the row itself
                self.buf[op.outputs[0]] = self._in(op.inputs[0])
                continue
            r = EdgellmOp(kind=EOP[op.kind])
            if op.kind == "embedding":
                self._embedding(r, op, w)
            elif op.kind in ("rms_norm", "add_rms_norm"):
                wv = w.get(self.graph.tensors[op.inputs[-1]].source or op.inputs[-1])
                r.k, r.eps = wv.numel(), float(op.attrs["eps"])
                r.wv = _ptr(self._vector(wv, r.k, op))
                r.a = _ptr(self._in(op.inputs[0], r.k, op))
                if op.kind == "add_rms_norm":
                    r.b = _ptr(self._in(op.inputs[1], r.k, op))
                    r.y, r.y2 = _ptr(self._out(op.outputs[0], r.k, op)), _ptr(self._out(op.outputs[1], r.k, op))
                else:
                    r.y = _ptr(self._out(op.outputs[0], r.k, op))
            elif op.kind in ("linear", "linear_qkv", "linear_swiglu"):
                names = program._weight_names(op)
                nat = program.decode_rows(names)
                if nat is None:
                    raise Unsupported(f"op '{op.name}': weights {names[0]}{'...' if len(names) > 1 else ''} "
                                      "are not multiplied natively here")
                r.fmt, r.n, r.k, r.parts, r.w, r.rows = FMT[nat.fmt], nat.n, nat.k, len(nat.parts), \
                    ctypes.addressof(nat._ptrs), ctypes.addressof(nat._rows)
                self.keep.append(nat)
                r.a = _ptr(self._in(op.inputs[0], r.k, op))
                kmax = max(kmax, r.k)
                if op.kind == "linear_swiglu":
                    act = op.attrs.get("act", "silu")
                    if act not in ACTS:
                        raise Unsupported(f"op '{op.name}': gate activation {act}")
                    r.act, nmax = ACTS[act], max(nmax, r.n)
                    r.y = _ptr(self._out(op.outputs[0], r.n // 2, op))
                else:
                    r.y = _ptr(self._out(op.outputs[0], r.n, op))
                    if op.attrs.get("has_bias"):
                        b = w.bias(tuple(g.tensors[op.inputs[s]].source or op.inputs[s] for s in (4, 5, 6))) \
                            if op.kind == "linear_qkv" else w.get(g.tensors[op.inputs[2]].source or op.inputs[2])
                        r.bias = _ptr(self._vector(b, r.n, op))
                    if op.attrs.get("has_residual"):
                        r.res = _ptr(self._in(op.inputs[-1], r.n, op))
            elif op.kind == "rope_qkv_store":
                self._rope(r, op, program)
            elif op.kind == "attention":
                a = op.attrs
                r.n_heads, r.n_kv, r.head_dim, r.scale = a["n_heads"], a["n_kv_heads"], a["head_dim"], float(a["scale"])
                if a["n_heads"] % a["n_kv_heads"]:
                    raise Unsupported(f"op '{op.name}': {a['n_heads']} heads over {a['n_kv_heads']} KV heads")
                nq, nkv = a["n_heads"] * a["head_dim"], a["n_kv_heads"] * a["head_dim"]
                r.a = _ptr(self._in(op.inputs[0], nq, op))
                r.kc, r.vc = _ptr(self._cache(op.inputs[1], nkv, op)), _ptr(self._cache(op.inputs[2], nkv, op))
                r.y = _ptr(self._out(op.outputs[0], nq, op))
                heads = max(heads, a["n_heads"])
            records.append(r)
            self.op_index.append(index)
        self.ops = (EdgellmOp * len(records))(*records)
        self.xq = torch.empty(kmax, dtype=torch.int8)
        self.xd = torch.empty(kmax // 32, dtype=torch.float32)
        self.xs = torch.empty(kmax // 32, dtype=torch.float32)
        self.tmp = torch.empty(nmax, dtype=torch.float32)
        self.scores = torch.empty(heads * ctx, dtype=torch.float32)
        self.kinds = [g.ops[i].kind for i in self.op_index]  # the records' op kinds
        self.op_ns: torch.Tensor | None = None  # per-record wall time, summed over steps, when profiling
        # the positions every cache and RoPE table holds (a segment without attention has no bound)
        self.rows = min([c.shape[0] for c in self.caches] + self.rope_rows, default=None)
        for name in g.outputs:
            self._in(name)
        cache_ids = {id(program.states[n]) for n in self.states}
        self.no_copy = {n for n in g.outputs if id(self.buf[n]) in cache_ids}  # a cache or its alias

    def profile(self, on: bool = True) -> None:
        """Start (zeroed) or stop adding each op's wall time to `op_ns` (benchmarks/profile_cpu_step.py)."""
        self.op_ns = torch.zeros(len(self.ops), dtype=torch.int64) if on else None

    # -- buffers ---------------------------------------------------------------------------------
    def _activation(self, name: str) -> torch.Tensor:
        shape = shape_function(self.graph.tensors[name].shape)({"seq": 1, "ctx": self.ctx})
        return torch.empty(shape, dtype=torch.float32)

    def _in(self, name: str, numel: int | None = None, op=None) -> torch.Tensor:
        t = self.buf.get(name)
        if t is None:
            raise Unsupported(f"'{name}' is read before it is written")
        if numel is not None and t.numel() != numel:
            raise Unsupported(f"op '{op.name}': '{name}' has {t.numel()} values, expected {numel}")
        return t

    def _out(self, name: str, numel: int, op) -> torch.Tensor:
        t = self.buf[name] = self._activation(name)
        if t.numel() != numel:
            raise Unsupported(f"op '{op.name}': output '{name}' of {t.numel()} values, expected {numel}")
        return t

    def _vector(self, v, numel: int, op) -> torch.Tensor:
        if not isinstance(v, torch.Tensor) or v.numel() != numel:
            raise Unsupported(f"op '{op.name}': a vector of {numel} values expected")
        v = v.contiguous().float()
        self.keep.append(v)
        return v

    def _cache(self, name: str, width: int, op) -> torch.Tensor:
        c = self._in(name)
        if c.dim() != 2 or c.shape[1] != width:
            raise Unsupported(f"op '{op.name}': cache '{name}' of shape {tuple(c.shape)}, expected [positions, {width}]")
        self.caches.append(c)
        return c

    # -- ops with more to check ------------------------------------------------------------------
    def _embedding(self, r: EdgellmOp, op, w) -> None:
        name = self.graph.tensors[op.inputs[0]].source or op.inputs[0]
        src = w.file.tensor(name)
        fmt, rows = w.table(name) if len(src.shape) == 2 else (src.type_name, src.data)
        if fmt not in FMT or len(src.shape) != 2 or src.shape[1] % 32:
            raise Unsupported(f"op '{op.name}': embedding table of {src.type_name}")
        table = np.ascontiguousarray(rows).view(np.uint8).reshape(src.shape[0], -1)
        ptrs = (ctypes.c_void_p * 1)(table.ctypes.data)
        self.keep += [table, ptrs]
        self.vocab = src.shape[0]
        r.fmt, r.k, r.w = FMT[fmt], src.shape[1], ctypes.addressof(ptrs)
        r.y = _ptr(self._out(op.outputs[0], r.k, op))

    def _rope(self, r: EdgellmOp, op, program) -> None:
        a = op.attrs
        i = [program.weights.get(self.graph.tensors[n].source or n) if self.graph.tensors[n].kind == "weight" else None
             for n in op.inputs]
        freqs, norms = rope_qkv_extras(op, i)
        if a["style"] not in STYLES:
            raise Unsupported(f"op '{op.name}': rope style {a['style']}")
        d, rd = a["head_dim"], a.get("rope_dim", a["head_dim"])
        if d > 1024 or rd % 2 or rd > d:
            raise Unsupported(f"op '{op.name}': heads of {d} features rotating {rd}")
        if norms:  # per-head q/k RMSNorm before the rotation (qwen3)
            r.qn, r.kn = _ptr(self._vector(norms[0], d, op)), _ptr(self._vector(norms[1], d, op))
            r.eps = float(a["qk_norm_eps"])
        cos, sin = program._rope_tables._table(freqs, a)  # [positions, rope_dim / 2], the reference's angles
        self.keep += [cos, sin]
        r.n_heads, r.n_kv, r.head_dim, r.rope_dim, r.style = a["n_heads"], a["n_kv_heads"], d, rd, STYLES[a["style"]]
        r.cos, r.sin = _ptr(cos), _ptr(sin)
        self.rope_rows.append(cos.shape[0])
        nq, nkv = a["n_heads"] * d, a["n_kv_heads"] * d
        r.a = _ptr(self._in(op.inputs[0], nq + 2 * nkv, op))
        r.kc, r.vc = _ptr(self._cache(op.inputs[2], nkv, op)), _ptr(self._cache(op.inputs[3], nkv, op))
        r.y = _ptr(self._out(op.outputs[0], nq, op))
        self.buf[op.outputs[1]], self.buf[op.outputs[2]] = self.buf[op.inputs[2]], self.buf[op.inputs[3]]

    # -- a step ----------------------------------------------------------------------------------
    def run(self, inputs: dict) -> dict[str, torch.Tensor]:
        pos = int(inputs["start_pos"]) if "start_pos" in inputs else 0
        token = 0
        if "tokens" in inputs:
            toks = np.asarray(inputs["tokens"]).reshape(-1)
            if toks.shape[0] != 1:
                raise GraphError(f"graph '{self.graph.name}': the native step takes one token, got {toks.shape[0]}")
            token = int(toks[0])
            if self.vocab is not None and not 0 <= token < self.vocab:
                raise GraphError(f"graph '{self.graph.name}': token id {token} outside the vocabulary of {self.vocab}")
        if pos < 0 or (self.rows is not None and pos >= self.rows):
            raise GraphError(f"graph '{self.graph.name}': position {pos} outside the cache's {self.rows} rows")
        for name in self.inputs:
            self.buf[name].copy_(torch.as_tensor(inputs[name]).reshape(self.buf[name].shape))
        self.lib.edgellm_step(ctypes.addressof(self.ops), len(self.ops), pos, token, _ptr(self.xq), _ptr(self.xd), _ptr(self.xs),
                              _ptr(self.tmp), _ptr(self.scores), torch.get_num_threads(),
                              _ptr(self.op_ns) if self.op_ns is not None else None)
        # the caches are returned as they are (as the interpreter returns them); activations as
        # copies, since the next step overwrites their buffers
        return {name: self.buf[name] if name in self.no_copy else self.buf[name].clone() for name in self.graph.outputs}


def lower(program) -> tuple[NativeStep | None, str | None]:
    """The program's native step, or None and why not."""
    if os.environ.get("EDGELLM_NATIVE_STEP", "1") == "0":
        return None, "turned off (EDGELLM_NATIVE_STEP=0)"
    lib = cpu_native.library()
    if lib is None:
        return None, cpu_native.unavailable()
    try:
        return NativeStep(program, lib), None
    except Unsupported as e:
        return None, str(e)
