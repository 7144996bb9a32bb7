"""The cpu-fast backend: the cpu reference's graph execution with weights kept compact and
matrix products on torch's quantized CPU kernels.

Weights are repacked once, at load, into what the fastest torch CPU kernel for their format takes
(measured on a 2-core AMD EPYC Zen 4 with AVX-512 BF16, torch 2.13; docs/benchmarks.md):
  Q4_0, Q4_1, Q4_G{g}, Q4_G{g}_SYM  -> int4 packs for `_weight_int4pack_mm_for_cpu`, the codes as
                                       stored, group scales and offsets in bf16 (0.625 B/weight)
  Q8_PC                             -> int8 rows for `_weight_int8pack_mm`, row scales in bf16
  every other 2-D format            -> bf16 rows for torch's bf16 linear (2 B/weight)
  vectors (norms, biases)           -> float32
Only the bf16-activation variants of those kernels are fast on this CPU (the float32 ones are
10-100x slower), so a matrix product rounds its input to bf16 once and returns float32; everything
else (norms, RoPE, attention, the KV cache, residual sums) stays float32 as in the reference.
Token embeddings are read from the file's own rows (memory-mapped) and dequantized per lookup, so
the table is not held twice when it is also the output projection.
Projections a fused op reads together (q|k|v, gate|up) are concatenated at load: their stored
rows are concatenated before packing (rows of any block format are independent).

This is the default cpu path of `edgellm run` (`--backend auto` without a GPU). The float32
reference (`cpu`) stays the ground truth that tests compare against.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import GraphError
from ..gguf_file import GGUFFile
from ..graph.ir import Op
from ..quant import dequantize
from .cpu import CPU_KERNELS, GATE_ACTS, CpuBackend, CpuProgram, _kv_store, _rms_norm, rope_qkv_extras, rotate
from .info import CpuFastInfo, int4_group

def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads share a core's vector units): the
    distinct (package, core) pairs of the allowed CPUs in Linux's topology, else the CPU count."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for c in allowed:
        base = f"/sys/devices/system/cpu/cpu{c}/topology/"
        try:
            with open(base + "physical_package_id") as f1, open(base + "core_id") as f2:
                cores.add((f1.read().strip(), f2.read().strip()))
        except OSError:
            return len(allowed)
    return max(len(cores), 1)


class PackedLinear:
    """One weight matrix [n, k] in the layout of the torch CPU kernel that multiplies it."""

    def __init__(self, raw: np.ndarray, type_name: str, shape: tuple[int, int]):
        n, k = shape
        self.n, self.k, self.type_name = n, k, type_name
        g = int4_group(type_name)
        if g is not None and k % g[0] == 0:
            self.kind, self.group = "int4", g[0]
            self._pack_int4(raw, g[0], g[1])
        elif type_name == "Q8_PC":
            self.kind = "int8"
            rows = np.ascontiguousarray(raw).reshape(n, 4 + k)
            self.scales = torch.from_numpy(rows[:, :4].copy().view(np.float32).reshape(n)).to(torch.bfloat16)
            self.q = torch.from_numpy(rows[:, 4:].copy().view(np.int8))
        else:
            self.kind = "bf16"
            # dequantized a slice of rows at a time: no float32 copy of a large matrix is ever held
            self.w = torch.empty((n, k), dtype=torch.bfloat16)
            step = max(1, (16 << 20) // (4 * k))
            for a in range(0, n, step):
                b = min(n, a + step)
                self.w[a:b] = torch.from_numpy(dequantize(raw[a:b], type_name, (b - a, k)))

    def _pack_int4(self, raw: np.ndarray, g: int, sym: bool) -> None:
        n, k = self.n, self.k
        head = 2 if sym else 4  # fp16 d (and fp16 m) before the g/2 code bytes of each block
        blocks = np.ascontiguousarray(raw).reshape(n, k // g, head + g // 2)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = blocks[..., head:]
        q = np.concatenate([codes & 0x0F, codes >> 4], axis=-1).reshape(n, k)  # byte i: codes i, i + g/2
        # the kernel computes (q - 8) * scale + zero: Q4_0-like x = d (q - 8); Q4_1-like x = d q + m
        zero = np.zeros_like(d) if sym else blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d
        # the packing takes a multiple of 16 rows: padded rows have scale 0 and are cut from the output
        pad = -n % 16
        if pad:
            q = np.concatenate([q, np.full((pad, k), 8, np.uint8)])
            d = np.concatenate([d, np.zeros((pad, k // g), np.float32)])
            zero = np.concatenate([zero, np.zeros((pad, k // g), np.float32)])
        self.n_out = n + pad
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
        self.scales_zeros = torch.from_numpy(np.stack([d.T, zero.T], axis=-1)).to(torch.bfloat16).contiguous()
        # bf16 keeps 8 bits of the offset m + 8d, whose rounding error is one constant per group
        # (correlated over the group's g products): it is added back exactly by a small float32
        # product of the input's group sums with the per-group residue
        if not sym:
            resid = torch.from_numpy(zero) - self.scales_zeros[..., 1].float().T  # [n, k/g]
            self.zero_resid = resid.contiguous()
        else:
            self.zero_resid = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 [m, k] -> float32 [m, n]."""
        xb = x.to(torch.bfloat16)
        if self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group, self.scales_zeros)
            if self.zero_resid is not None:
                sums = xb.float().view(x.shape[0], -1, self.group).sum(-1)
                y = torch.addmm(y.float(), sums, self.zero_resid.T)
            y = y.float()
            return y[:, :self.n] if self.n_out != self.n else y
        elif self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(xb, self.q, self.scales)
        else:
            y = torch.nn.functional.linear(xb, self.w)
        return y.float()

    @property
    def nbytes(self) -> int:
        ts = {"int4": ("packed", "scales_zeros"), "int8": ("q", "scales"), "bf16": ("w",)}[self.kind]
        ts = [getattr(self, a) for a in ts]
        return sum(t.numel() * t.element_size() for t in ts)


class WeightRef:
    """A 2-D weight as a kernel input: its name in the file; the packed matrix lives in CpuFastWeights."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class CpuFastWeights:
    """Vectors as float32 tensors; matrices as references whose packs are built once per set of
    rows (one weight, or the concatenation a fused op reads) and kept."""

    def __init__(self, f: GGUFFile):
        self.file = f
        self._vectors: dict[str, torch.Tensor] = {}
        self._refs: dict[str, WeightRef] = {}
        self._packs: dict[tuple, PackedLinear] = {}
        self._biases: dict[tuple, torch.Tensor] = {}

    def get(self, name: str):
        src = self.file.tensors[name]
        if len(src.shape) >= 2:
            ref = self._refs.get(name)
            if ref is None:
                ref = self._refs[name] = WeightRef(name)
            return ref
        t = self._vectors.get(name)
        if t is None:
            t = torch.from_numpy(np.ascontiguousarray(dequantize(src.data, src.type_name, src.shape), dtype=np.float32))
            self._vectors[name] = t
        return t

    def pack(self, names: tuple[str, ...], rows: tuple[int, int] | None = None) -> PackedLinear:
        """The matrix of the named weights stacked by rows (optionally only rows [a, b) of it)."""
        key = (names, rows)
        p = self._packs.get(key)
        if p is None:
            srcs = [self.file.tensors[n] for n in names]
            types = {s.type_name for s in srcs}
            ks = {s.shape[1] for s in srcs}
            if len(ks) != 1:
                raise GraphError(f"cpu-fast: weights {list(names)} have different row lengths {sorted(ks)}")
            if len(types) == 1:
                raw = srcs[0].data if len(srcs) == 1 else np.concatenate([np.asarray(s.data) for s in srcs])
                type_name = srcs[0].type_name
            else:  # mixed formats in one fused product: one float matrix, stored as bf16
                raw = np.concatenate([dequantize(s.data, s.type_name, s.shape) for s in srcs]).astype(np.float32)
                type_name = "F32"
            n = sum(s.shape[0] for s in srcs)
            if rows is not None:
                raw, n = raw[rows[0]:rows[1]], rows[1] - rows[0]
            p = self._packs[key] = PackedLinear(raw, type_name, (n, next(iter(ks))))
            self.file.release_pages()  # the pages just read are not needed again: keep the peak low
        return p

    def bias(self, names: tuple[str, ...]) -> torch.Tensor:
        b = self._biases.get(names)
        if b is None:
            b = self._biases[names] = torch.cat([self.get(n) for n in names])
        return b

    def embedding_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of an embedding table, dequantized from the file's stored rows."""
        src = self.file.tensors[name]
        idx = ids.long().numpy()
        return torch.from_numpy(np.ascontiguousarray(
            dequantize(np.asarray(src.data[idx]), src.type_name, (len(idx), src.shape[1])), dtype=np.float32))

    @property
    def nbytes(self) -> int:
        return (sum(p.nbytes for p in self._packs.values())
                + sum(t.numel() * t.element_size() for t in (*self._vectors.values(), *self._biases.values())))


class CpuFastProgram(CpuProgram):
    """A CpuProgram whose matrix products and embeddings read packed weights."""

    def __init__(self, graph, weights: CpuFastWeights, states, plan=None, arena=None, rope_tables=None):
        super().__init__(graph, weights, states, plan, arena)
        ctx = max(t.shape[0] for t in states.values()) if states else 1  # rings are shorter
        self._rope_tables = rope_tables or RopeTables(ctx)
        self._kernels = {**CPU_KERNELS, **self._fast_kernels(weights)}
        for op in graph.ops:  # pack every product's weights now, not at the first token
            if op.kind in _WEIGHT_SLOTS:
                self.prepare_product(self._weight_names(op))

    # the matrix products, overridable (a tensor-parallel rank multiplies its share of the rows)
    def prepare_product(self, names: tuple[str, ...]) -> None:
        self.weights.pack(names)

    def product(self, names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor:
        """x [m, k] times the named weights stacked by rows, transposed: [m, rows]."""
        return self.weights.pack(names)(x)

    def _weight_names(self, op: Op) -> tuple[str, ...]:
        return tuple(self.graph.tensors[t].source or t for t in (op.inputs[i] for i in _WEIGHT_SLOTS[op.kind]))

    def _fast_kernels(self, w: CpuFastWeights) -> dict:
        graph = self.graph

        def sources(op, slots):
            return tuple(graph.tensors[op.inputs[s]].source or op.inputs[s] for s in slots)

        def linear(op, i):
            y = self.product((i[1].name,), i[0])
            if op.attrs.get("has_bias"):
                y = y + i[2]
            return y + i[-1] if op.attrs.get("has_residual") else y

        def linear_qkv(op, i):
            y = self.product((i[1].name, i[2].name, i[3].name), i[0])
            return y + w.bias(sources(op, (4, 5, 6))) if op.attrs.get("has_bias") else y

        def linear_swiglu(op, i):
            gu = self.product((i[1].name, i[2].name), i[0])
            h = gu.shape[1] // 2
            return GATE_ACTS[op.attrs.get("act", "silu")](gu[:, :h]) * gu[:, h:]  # SwiGLU, or Gemma's GeGLU

        def embedding(op, i):
            return w.embedding_rows(i[0].name, i[1])

        rope = self._rope_tables.rope

        def rope_qkv_store(op, i):
            qkv, start, kc, vc = i[0], int(i[1]), i[2], i[3]
            freqs, norms = rope_qkv_extras(op, i)
            a = op.attrs
            nq, nkv = a["n_heads"] * a["head_dim"], a["n_kv_heads"] * a["head_dim"]
            q_in, k_in = qkv[:, :nq], qkv[:, nq:nq + nkv]
            if norms:  # per-head q/k RMSNorm (qwen3, gemma3), as the reference
                q_in, k_in = _rms_norm(q_in, norms[0], a["qk_norm_eps"]), _rms_norm(k_in, norms[1], a["qk_norm_eps"])
            q = rope(q_in, start, freqs, a, a["n_heads"])
            k = rope(k_in, start, freqs, a, a["n_kv_heads"])
            return q, _kv_store(op, [kc, k, start]), _kv_store(op, [vc, qkv[:, nq + nkv:], start])

        return {"linear": linear, "linear_qkv": linear_qkv, "linear_swiglu": linear_swiglu, "embedding": embedding,
                "rope_qkv_store": rope_qkv_store,
                "rope": lambda op, i: rope(i[0], int(i[1]), i[2] if len(i) > 2 else None, op.attrs, op.attrs["n_heads"]),
                "rope_store": lambda op, i: _kv_store(
                    op, [i[2], rope(i[0], int(i[1]), i[3] if len(i) > 3 else None, op.attrs, op.attrs["n_heads"]), i[1]])}


class RopeTables:
    """cos/sin of every position up to the context, computed once per rope configuration the way
    the reference computes them per call (angles in float64, rounded once to float32), so the
    rotation is bitwise the reference's."""

    def __init__(self, ctx: int):
        self.ctx = ctx
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, freqs, a: dict):
        r = a.get("rope_dim", a["head_dim"])
        m = a.get("mscale", 1.0)  # long-RoPE attention factor on cos and sin, as the reference
        key = (a["theta"], r, a.get("pos_scale", 1.0), m, id(freqs))
        t = self._tables.get(key)
        if t is None:
            inv = a["theta"] ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
            if freqs is not None:
                inv = inv / freqs.to(torch.float64)
            pos = torch.arange(0, self.ctx, dtype=torch.float64) * a.get("pos_scale", 1.0)
            ang = pos[:, None] * inv[None, :]
            t = self._tables[key] = ((ang.cos() * m).float(), (ang.sin() * m).float())
        return t

    def rope(self, x: torch.Tensor, start: int, freqs, a: dict, heads: int) -> torch.Tensor:
        s = x.shape[0]
        d, r = a["head_dim"], a.get("rope_dim", a["head_dim"])
        cos, sin = self._table(freqs, a)
        cos, sin = cos[start:start + s, None, :], sin[start:start + s, None, :]
        return rotate(x.reshape(s, heads, d), cos, sin, r, a["style"]).view(s, heads * d)


# which inputs of a product are its weight matrices (concatenated by rows into one pack)
_WEIGHT_SLOTS = {"linear": (1,), "linear_qkv": (1, 2, 3), "linear_swiglu": (1, 2)}


class CpuFastBackend(CpuFastInfo, CpuBackend):
    program_cls = CpuFastProgram

    def __init__(self, f: GGUFFile, threads: int | None = None):
        # an explicit count wins; otherwise the physical cores, unless the caller already chose
        # fewer (torch's own default is the physical cores)
        if threads:
            torch.set_num_threads(threads)
        elif torch.get_num_threads() > physical_cores():
            torch.set_num_threads(physical_cores())
        self.weights = CpuFastWeights(f)
        self._arena = None
        self._rope = None

    def compile(self, graph, states, plan=None, max_seq=None) -> CpuFastProgram:
        if max_seq == 1:
            # a decode step's intermediates are a few KiB: copying each op's result into its arena
            # slot would cost more than the memory it shares
            plan = None
        arena = None
        if plan is not None and plan.total_bytes:
            if self._arena is None or self._arena.numel() < plan.total_bytes:
                self._arena = torch.empty(plan.total_bytes, dtype=torch.uint8)
            arena = self._arena
        ctx = max(t.shape[0] for t in states.values()) if states else 1  # rings are shorter
        if self._rope is None or self._rope.ctx < ctx:
            self._rope = RopeTables(ctx)
        return self.program_cls(graph, self.weights, states, plan, arena, self._rope)

    def allocate_states(self, graph, ctx: int) -> dict[str, torch.Tensor]:
        # torch.empty: pages of a large fresh allocation become resident only when a position is
        # written; attention reads only the rows already written
        return {t.name: torch.empty(t.concrete_shape(ctx=ctx), dtype=torch.float32) for t in graph.states()}

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for p in self.weights._packs.values():
            kinds[p.kind] = kinds.get(p.kind, 0) + 1
        held = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        return (f"cpu-fast (torch {torch.__version__}, {torch.get_num_threads()} threads; "
                f"weights {self.weights.nbytes / 2**20:.0f} MiB: {held})")
