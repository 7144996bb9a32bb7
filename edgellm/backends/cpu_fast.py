"""The cpu-fast backend: the cpu reference's graph execution with weights kept compact and
matrix products on torch's quantized CPU kernels.

Weights are repacked once, at load, into what the fastest torch CPU kernel for their format takes
(measured on a 2-core AMD EPYC Zen 4 with AVX-512 BF16, torch 2.13; docs/benchmarks.md):
  Q4_0, Q4_1, Q4_G{g}, Q4_G{g}_SYM  -> int4 packs for `_weight_int4pack_mm_for_cpu`, the codes as
                                       stored, group scales and offsets in bf16 (0.625 B/weight)
  Q8_0                              -> its codes' high and low nibbles as two int4 packs, block
                                       scales in bf16 (1.25 B/weight; codes exact)
  Q8_PC                             -> int8 rows for `_weight_int8pack_mm`, row scales in bf16
  Q4_K                              -> as Q4_1 (fp16 sub-block scales and minimums; quant/block_forms.py)
  Q5_0                              -> as Q8_0 (exactly)
  Q6_K, Q5_K, Q5_1                  -> as Q8_0, requantized from their values (|error| about amax/254 a block)
  every other 2-D format            -> bf16 rows for torch's bf16 linear (2 B/weight)
A fused product's parts in different formats (a Q4_K_M file's q|k|v) are requantized to Q8_0 when
each has such a form, so that the stack stays one quantized matrix the native kernels read.
  vectors (norms, biases)           -> float32
Only the bf16-activation variants of those kernels are fast on this CPU (the float32 ones are
10-100x slower), so a matrix product rounds its input to bf16 once and returns float32; everything
else (norms, RoPE, attention, the KV cache, residual sums) stays float32 as in the reference.
Token embeddings are read from the file's own rows (memory-mapped) and dequantized per lookup, so
the table is not held twice when it is also the output projection.
Projections a fused op reads together (q|k|v, gate|up) are concatenated at load: their stored
rows are concatenated before packing (rows of any block format are independent).

The packs of a model are built at its first load and kept in the program cache (edgellm.cache,
`weights.bin` of the model's cpu-fast entry); later loads map them back from the file instead of
repacking (0.5 s of the default model's load on the 2-core machine).

A program for one token (the decode step) whose ops all have native forms runs as one call into
the native library (cpu_step.py: norms, products, RoPE with the cache write and attention between
barriers of one parallel region); other programs, and steps with an op it lacks, run op by op.

This is the default cpu path of `edgellm run` (`--backend auto` without a GPU). The float32
reference (`cpu`) stays the ground truth that tests compare against.
"""

from __future__ import annotations

import os
import platform
import weakref

import numpy as np
import torch

from ..errors import GraphError
from ..gguf_file import GGUFFile
from ..graph.ir import Op
from ..quant import dequantize
from .cpu import CPU_KERNELS, GATE_ACTS, CpuBackend, CpuProgram, _attention, _kv_store, _rms_norm, rope_qkv_extras, rotate
from .info import CpuFastInfo, int4_group

# products with at most this many input rows (decode steps) run on the native kernels where they
# are built (cpu_native.c: Q8_0, Q4_0, Q4_1 from the file's own blocks, int8 dot products); more
# rows on torch's packs
NATIVE_MAX_ROWS = int(os.environ.get("EDGELLM_NATIVE_MAX_ROWS", "8"))

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
        elif type_name == "Q8_0" and k % 32 == 0:
            self.kind, self.group = "int4x2", 32
            self._pack_q8_0(raw)
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
        self.packed, self.scales_zeros = _int4_pack(q, d, zero)
        self.n_out = n + (-n % 16)
        # bf16 keeps 8 bits of the offset m + 8d, whose rounding error is one constant per group
        # (correlated over the group's g products): it is added back exactly by a small float32
        # product of the input's group sums with the per-group residue
        if not sym:
            resid = torch.from_numpy(zero) - self.scales_zeros[..., 1].float().T[:n]  # [n, k/g] (padding cut)
            self.zero_resid = resid.T.contiguous()  # [k/g, n]: addmm streams it row by row
        else:
            self.zero_resid = None

    def _pack_q8_0(self, raw: np.ndarray) -> None:
        """Q8_0 (fp16 d, 32 int8 codes per block) as two int4 products of the same codes' nibbles:
        with u = q + 128 = 16 h + l,  d q = 16 d (h - 8) + [d (l - 8) + 8 d]. The codes stay exact;
        only d is rounded to bf16 (16 d and 8 d are exact multiples of it, so no offset residue).
        1.25 B/weight, and two int4 products took half the time of one bf16 product (49152 x 576
        on the 2-core EPYC: 3.0 vs 5.9 ms on one thread)."""
        n, k = self.n, self.k
        blocks = np.ascontiguousarray(raw).reshape(n, k // 32, 34)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        u = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(n, k)
        self.packed, self.scales_zeros = _int4_pack(u >> 4, 16 * d, np.zeros_like(d))
        self.packed_lo, self.scales_zeros_lo = _int4_pack(u & 0x0F, d, 8 * d)
        self.n_out, self.zero_resid = n + (-n % 16), None

    native = None  # the native kernel's reading of the same rows (cpu_native.NativeRows), for few inputs
    blocks = None  # the rows' GGML blocks where converted from the file's (the native kernels read them)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 [m, k] -> float32 [m, n]."""
        if self.native is not None and x.shape[0] <= NATIVE_MAX_ROWS:
            return self.native(x)
        xb = x.to(torch.bfloat16)
        if self.kind == "int4x2":
            mm = torch.ops.aten._weight_int4pack_mm_for_cpu
            y = mm(xb, self.packed, 32, self.scales_zeros).float() + mm(xb, self.packed_lo, 32, self.scales_zeros_lo)
            return y[:, :self.n] if self.n_out != self.n else y
        if self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group, self.scales_zeros)
            if self.n_out != self.n:
                y = y[:, :self.n]
            if self.zero_resid is not None:
                # the input's group sums in float32 (not the bf16-rounded input: the difference is
                # 2^-9 of a correction that is itself 2^-9 of the offset)
                sums = x.reshape(x.shape[0], -1, self.group).sum(-1)
                return torch.addmm(y.float(), sums, self.zero_resid)
            return y.float()
        elif self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(xb, self.q, self.scales)
        else:
            y = torch.nn.functional.linear(xb, self.w)
        return y.float()

    _TENSORS = {"int4": ("packed", "scales_zeros", "zero_resid"),
                "int4x2": ("packed", "scales_zeros", "packed_lo", "scales_zeros_lo"),
                "int8": ("q", "scales"), "bf16": ("w",)}

    @property
    def nbytes(self) -> int:
        ts = [getattr(self, a) for a in self._TENSORS[self.kind]]
        held = self.blocks.nbytes if self.blocks is not None else 0
        return held + sum(t.numel() * t.element_size() for t in ts if t is not None)

    # -- the program cache's form: a few numbers and the tensors as numpy arrays ------------------
    def to_arrays(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta = {"kind": self.kind, "n": self.n, "k": self.k, "type": self.type_name,
                "group": getattr(self, "group", None), "n_out": getattr(self, "n_out", None), "dtypes": {}}
        arrays = {}
        for a in self._TENSORS[self.kind]:
            t = getattr(self, a)
            if t is not None:
                meta["dtypes"][a] = str(t.dtype).removeprefix("torch.")
                arrays[a] = _as_numpy(t)
        if self.blocks is not None:
            meta["dtypes"]["blocks"] = "uint8"
            arrays["blocks"] = self.blocks
        return meta, arrays

    @classmethod
    def from_arrays(cls, meta: dict, arrays: dict[str, np.ndarray]) -> "PackedLinear":
        p = cls.__new__(cls)
        p.kind, p.n, p.k, p.type_name = meta["kind"], meta["n"], meta["k"], meta["type"]
        if meta["kind"] not in cls._TENSORS or set(arrays) != set(meta["dtypes"]):
            raise ValueError("not a packed matrix")
        if p.kind.startswith("int4"):
            p.group, p.n_out, p.zero_resid = meta["group"], meta["n_out"], None
        for a, dt in meta["dtypes"].items():
            if a == "blocks":
                p.blocks = np.asarray(arrays[a])
            else:
                setattr(p, a, _as_tensor(arrays[a], dt))
        return p


def _int4_pack(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q [n, k] in 0..15 with per-group scale and zero [n, k/g] (x = (q - 8) scale + zero) in
    the layout of `_weight_int4pack_mm_for_cpu`. The packing takes a multiple of 16 rows: padded
    rows have scale 0 and are cut from the output."""
    n, k = q.shape
    pad = -n % 16
    if pad:
        q = np.concatenate([q, np.full((pad, k), 8, np.uint8)])
        scale = np.concatenate([scale, np.zeros((pad, scale.shape[1]), np.float32)])
        zero = np.concatenate([zero, np.zeros((pad, zero.shape[1]), np.float32)])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
    return packed, torch.from_numpy(np.stack([scale.T, zero.T], axis=-1)).to(torch.bfloat16).contiguous()


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a numpy array (bf16, which numpy lacks, as int16)."""
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _as_tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(a)
    want = getattr(torch, dtype, None)
    if not isinstance(want, torch.dtype) or want.itemsize != t.element_size():
        raise ValueError(f"dtype {dtype} does not match the stored {a.dtype}")
    return t.view(want) if t.dtype != want else t


class WeightRef:
    """A 2-D weight as a kernel input: its name in the file; the packed matrix lives in CpuFastWeights."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


_NATIVE_FORMS = ("Q4_0", "Q4_1", "Q8_0")  # what the native kernels read (cpu_native.FORMATS)


def _block_form_of(src) -> str | None:
    """The plain block type a GGUF tensor of another type is converted to here, or None."""
    k = src.shape[1] if len(src.shape) == 2 else 0
    if k % 32:
        return None
    if src.type_name == "Q4_K" and k % 256 == 0:
        return "Q4_1"
    if src.type_name in ("Q5_0", "Q5_1") or (src.type_name in ("Q6_K", "Q5_K") and k % 256 == 0):
        return "Q8_0"
    return None


def _block_form(src) -> tuple[str, np.ndarray]:
    """(type, rows of blocks) of a GGUF tensor as the packs and native kernels take it: its own, or
    its plain block form (_block_form_of; a Q4_K sub-block scale beyond fp16 keeps its own)."""
    from ..quant.block_forms import as_q8_0, q4_k_as_q4_1

    form = _block_form_of(src)
    n, k = src.shape[0], (src.shape[1] if len(src.shape) == 2 else 0)
    if form == "Q4_1":
        try:
            return "Q4_1", q4_k_as_q4_1(src.data, n, k)
        except ValueError:
            return src.type_name, src.data
    if form == "Q8_0":
        return "Q8_0", as_q8_0(src.data, src.type_name, n, k)
    return src.type_name, src.data


class CpuFastWeights:
    """Vectors as float32 tensors; matrices as references whose packs are built once per set of
    rows (one weight, or the concatenation a fused op reads) and kept."""

    def __init__(self, f: GGUFFile):
        self.file = f
        self._vectors: dict[str, torch.Tensor] = {}
        self._refs: dict[str, WeightRef] = {}
        self._packs: dict[tuple, PackedLinear] = {}
        self._biases: dict[tuple, torch.Tensor] = {}
        self._tables: dict[str, tuple[str, np.ndarray]] = {}
        self.built = 0  # packs built (not restored from the cache) since the last restore or save

    def get(self, name: str):
        src = self.file.tensor(name)
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
            srcs = [self.file.tensor(n) for n in names]
            ks = {s.shape[1] for s in srcs}
            if len(ks) != 1:
                raise GraphError(f"cpu-fast: weights {list(names)} have different row lengths {sorted(ks)}")
            forms = [_block_form(s) for s in srcs]
            types = {t for t, _ in forms}
            converted = any(t != s.type_name for (t, _), s in zip(forms, srcs))
            if len(types) > 1 and all(t in _NATIVE_FORMS for t, _ in forms):
                # mixed quantized formats in one fused product (a Q4_K_M file's q|k|v): one Q8_0 stack
                from ..quant.block_forms import as_q8_0

                forms = [("Q8_0", as_q8_0(r, t, s.shape[0], s.shape[1])) for (t, r), s in zip(forms, srcs)]
                types, converted = {"Q8_0"}, True
            if len(types) == 1:
                raw = forms[0][1] if len(forms) == 1 else np.concatenate([np.asarray(r) for _, r in forms])
                type_name = forms[0][0]
            else:  # mixed formats in one fused product: one float matrix, stored as bf16
                raw = np.concatenate([dequantize(s.data, s.type_name, s.shape) for s in srcs]).astype(np.float32)
                type_name, converted = "F32", False
            n = sum(s.shape[0] for s in srcs)
            if rows is not None:
                raw, n = raw[rows[0]:rows[1]], rows[1] - rows[0]
            p = self._packs[key] = PackedLinear(raw, type_name, (n, next(iter(ks))))
            if converted:
                p.blocks = np.ascontiguousarray(raw)
            self._attach_native(p, names, rows)
            self.built += 1
            self.file.release_pages()  # the pages just read are not needed again: keep the peak low
        return p

    # -- the program cache: packs built at one load are mapped back at the next ------------------
    def restore(self, meta: dict, arrays: dict[str, np.ndarray]) -> int:
        """Adopt packs from a cache artifact (save's form); returns how many were adopted."""
        packs = {}
        for i, entry in enumerate(meta["packs"]):
            names, rows = tuple(entry["names"]), entry["rows"]
            prefix = f"{i}."
            mine = {a[len(prefix):]: v for a, v in arrays.items() if a.startswith(prefix)}
            rows = tuple(rows) if rows is not None else None
            packs[(names, rows)] = p = PackedLinear.from_arrays(entry, mine)
            self._attach_native(p, names, rows)
        self._packs.update(packs)
        self.built = 0
        return len(packs)

    def save(self) -> tuple[dict, dict[str, np.ndarray]]:
        entries, arrays = [], {}
        for i, ((names, rows), p) in enumerate(self._packs.items()):
            meta, arrs = p.to_arrays()
            entries.append({**meta, "names": list(names), "rows": list(rows) if rows is not None else None})
            arrays.update({f"{i}.{a}": v for a, v in arrs.items()})
        return {"packs": entries}, arrays

    def _attach_native(self, p: PackedLinear, names: tuple[str, ...], rows: tuple[int, int] | None) -> None:
        """Give a matrix of a format the native kernels read (Q8_0, Q4_0, Q4_1) their reading: the
        file's own blocks, memory-mapped, each stacked part (and the rows [a, b) of the stack) where
        it lies; nothing is copied."""
        from .cpu_native import FORMATS

        if p.type_name not in FORMATS or p.k % 32 or NATIVE_MAX_ROWS < 1:
            return
        from . import cpu_native

        if cpu_native.library() is None:
            return
        if p.blocks is not None:  # converted from the file's format: the converted rows
            p.native = cpu_native.NativeRows([p.blocks], p.k, p.type_name)
            return
        parts, base = [], 0
        a, b = rows if rows is not None else (0, p.n)
        for name in names:
            data = self.file.tensor(name).data
            lo, hi = max(a - base, 0), min(b - base, data.shape[0])
            if lo < hi:
                parts.append(data[lo:hi])
            base += data.shape[0]
        p.native = cpu_native.NativeRows(parts, p.k, p.type_name)

    def table(self, name: str) -> tuple[str, np.ndarray]:
        """An embedding table as the native step reads it: (type, rows of blocks): the file's own
        rows where the native kernels read its type, else its plain block form (_block_form),
        the LM head's converted rows where the table is tied to it, converted once."""
        src = self.file.tensor(name)
        got = self._tables.get(name)
        if got is None:
            tied = self._packs.get(((name,), None))
            if tied is not None and tied.blocks is not None:
                got = (tied.type_name, tied.blocks)
            else:
                got = _block_form(src) if src.type_name not in _NATIVE_FORMS else (src.type_name, src.data)
            self._tables[name] = got
        return got

    def bias(self, names: tuple[str, ...]) -> torch.Tensor:
        b = self._biases.get(names)
        if b is None:
            b = self._biases[names] = torch.cat([self.get(n) for n in names])
        return b

    def embedding_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of an embedding table, dequantized from the file's stored rows."""
        src = self.file.tensor(name)
        idx = ids.long().numpy()
        return torch.from_numpy(np.ascontiguousarray(
            dequantize(np.asarray(src.data[idx]), src.type_name, (len(idx), src.shape[1])), dtype=np.float32))

    @property
    def nbytes(self) -> int:
        return (sum(p.nbytes for p in self._packs.values())
                + sum(t.numel() * t.element_size() for t in (*self._vectors.values(), *self._biases.values())))


class CpuFastProgram(CpuProgram):
    """A CpuProgram whose matrix products and embeddings read packed weights."""

    def __init__(self, graph, weights: CpuFastWeights, states, plan=None, arena=None, rope_tables=None,
                 max_seq=None):
        super().__init__(graph, weights, states, plan, arena)
        self.max_seq = max_seq
        self._step, self.step_unavailable = None, None  # the native decode step (cpu_step), built at the first step
        ctx = max(t.shape[0] for t in states.values()) if states else 1  # rings are shorter
        self._rope_tables = rope_tables or RopeTables(ctx)
        self._kernels = {**CPU_KERNELS, **self._fast_kernels(weights)}
        for op in graph.ops:  # pack every product's weights now, not at the first token
            if op.kind in _WEIGHT_SLOTS:
                self.prepare_product(self._weight_names(op))

    def run(self, inputs: dict) -> dict:
        step = self._native_step() if self.max_seq == 1 else None
        return step.run(inputs) if step is not None else super().run(inputs)

    def _native_step(self):
        """A program for one token runs as one native call where every op has a native form
        (cpu_step) and every product's rows are read here (`decode_rows`)."""
        if self._step is None and self.step_unavailable is None:
            if "product" in vars(self) and "decode_rows" not in vars(self):
                self.step_unavailable = "its products are replaced without their one-token rows"
            else:
                from .cpu_step import lower

                self._step, self.step_unavailable = lower(self)
        return self._step

    # the matrix products, overridable: the executor's row splits (edgellm/hetero/executor.py)
    # replace `product` with one that multiplies a share of the rows here and the rest elsewhere
    def prepare_product(self, names: tuple[str, ...]) -> None:
        self.weights.pack(names)

    def product(self, names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor:
        """x [m, k] times the named weights stacked by rows, transposed: [m, rows]."""
        return self.weights.pack(names)(x)

    def decode_rows(self, names: tuple[str, ...]):
        """The rows a one-token product of the named weights multiplies here, as the native kernels
        read them (cpu_native.NativeRows), or None where it is not read natively here (the native
        step then keeps the interpreter). Replaced with `product` by the executor's row splits."""
        return self.weights.pack(names).native

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
            return y.add_(i[-1]) if op.attrs.get("has_residual") else y  # y is the product's own new tensor

        def linear_qkv(op, i):
            y = self.product((i[1].name, i[2].name, i[3].name), i[0])
            return y + w.bias(sources(op, (4, 5, 6))) if op.attrs.get("has_bias") else y

        def linear_swiglu(op, i):
            gu = self.product((i[1].name, i[2].name), i[0])
            h = gu.shape[1] // 2
            return GATE_ACTS[op.attrs.get("act", "silu")](gu[:, :h]).mul_(gu[:, h:])  # SwiGLU, or Gemma's GeGLU

        def embedding(op, i):
            return w.embedding_rows(i[0].name, i[1])

        rope = self._rope_tables.rope

        def rope_qkv_store(op, i):
            qkv, start, kc, vc = i[0], int(i[1]), i[2], i[3]
            freqs, norms = rope_qkv_extras(op, i)
            a = op.attrs
            nq, nkv = a["n_heads"] * a["head_dim"], a["n_kv_heads"] * a["head_dim"]
            qk = qkv[:, :nq + nkv]
            if norms:  # per-head q/k RMSNorm (qwen3, gemma3), as the reference
                qk = torch.cat([_rms_norm(qk[:, :nq], norms[0], a["qk_norm_eps"]),
                                _rms_norm(qk[:, nq:], norms[1], a["qk_norm_eps"])], 1)
            # q and k heads rotate by the same angles: one rotation over both (elementwise, so each
            # value is computed as in two calls)
            qk = rope(qk, start, freqs, a, a["n_heads"] + a["n_kv_heads"])
            q = qk[:, :nq] if qk.shape[0] == 1 else qk[:, :nq].contiguous()
            return q, _kv_store(op, [kc, qk[:, nq:], start]), _kv_store(op, [vc, qkv[:, nq + nkv:], start])

        def attention_rows(op, i):
            q, kc, vc, base, pos = i[0], i[1], i[2], i[3], i[4]
            out = torch.empty_like(q)
            for r, (b, p) in enumerate(zip(base.tolist(), pos.tolist())):
                out[r:r + 1] = decode_attention(q[r:r + 1], kc[b:b + p + 1], vc[b:b + p + 1], p, op.attrs)
            return out

        return {"linear": linear, "linear_qkv": linear_qkv, "linear_swiglu": linear_swiglu, "embedding": embedding,
                "rope_qkv_store": rope_qkv_store,
                "attention": lambda op, i: decode_attention(i[0], i[1], i[2], int(i[3]), op.attrs),
                "attention_rows": attention_rows,
                "rope": lambda op, i: rope(i[0], int(i[1]), i[2] if len(i) > 2 else None, op.attrs, op.attrs["n_heads"]),
                "rope_store": lambda op, i: _kv_store(
                    op, [i[2], rope(i[0], int(i[1]), i[3] if len(i) > 3 else None, op.attrs, op.attrs["n_heads"]), i[1]])}


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, start: int, a: dict) -> torch.Tensor:
    """The reference's attention, with a short path for one query row (a decode step): it sees
    every cached key, so there is no mask to build (the products and softmax are the reference's,
    bitwise; half the time of the masked form at a short context)."""
    if q.shape[0] != 1 or a.get("window"):
        return _attention(q, kc, vc, start, a)
    h, g, d = a["n_heads"], a["n_kv_heads"], a["head_dim"]
    n = start + 1
    k = kc[:n].view(n, g, d).transpose(0, 1)  # [G, n, d]
    v = vc[:n].view(n, g, d).transpose(0, 1)
    p = torch.softmax(torch.bmm(q.view(g, h // g, d), k.transpose(1, 2)).mul_(a["scale"]), dim=-1)
    return torch.bmm(p, v).view(1, h * d)


class RopeTables:
    """cos/sin of every position up to the context, computed once per rope configuration as the
    reference computes them per call (angles in float64, rounded once to float32), with numpy's
    cos and sin (the reference's torch ones agree to within a float32 rounding), on one thread."""

    def __init__(self, ctx: int):
        self.ctx = ctx
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, freqs, a: dict):
        r = a.get("rope_dim", a["head_dim"])
        m = a.get("mscale", 1.0)  # long-RoPE attention factor on cos and sin, as the reference
        key = (a["theta"], r, a.get("pos_scale", 1.0), m, id(freqs))
        t = self._tables.get(key)
        if t is None:
            inv = a["theta"] ** (-np.arange(0, r, 2, dtype=np.float64) / r)
            if freqs is not None:
                inv = inv / freqs.to(torch.float64).numpy()
            pos = np.arange(0, self.ctx, dtype=np.float64) * a.get("pos_scale", 1.0)
            ang = pos[:, None] * inv[None, :]
            # numpy, not torch: built with torch's cos/sin, the table differed between processes in
            # ~6% of its first half's values (2 threads, 2026-11-29), and the default question's
            # greedy answer, a near tie (0.08 logits in float32), changed from run to run
            t = self._tables[key] = (torch.from_numpy((np.cos(ang) * m).astype(np.float32)),
                                     torch.from_numpy((np.sin(ang) * m).astype(np.float32)))
        return t

    def _full_table(self, freqs, a: dict):
        """For a rotation of the whole head: cos and signed sin per feature ([ctx, d]), laid out so
        that x C + swap(x) S is the rotation (swap exchanges each pair's two features)."""
        key = ("full", a["theta"], a["head_dim"], a.get("pos_scale", 1.0), id(freqs), a["style"])
        t = self._tables.get(key)
        if t is None:
            cos, sin = self._table(freqs, a)
            if a["style"] == "norm":  # pairs (2i, 2i+1)
                c, sn = cos.repeat_interleave(2, -1), torch.stack([-sin, sin], -1).flatten(-2)
            else:  # pairs (i, i + d/2)
                c, sn = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
            t = self._tables[key] = (c.contiguous(), sn.contiguous())
        return t

    def rope(self, x: torch.Tensor, start: int, freqs, a: dict, heads: int) -> torch.Tensor:
        s = x.shape[0]
        d, r = a["head_dim"], a.get("rope_dim", a["head_dim"])
        if r == d:
            # x0 cos + x1 (-sin) and x1 cos + x0 sin: each value the reference's x0 cos - x1 sin and
            # x0 sin + x1 cos bitwise (one rounding per product and per sum), in 4 ops instead of 9
            c, sn = self._full_table(freqs, a)
            c, sn = c[start:start + s, None, :], sn[start:start + s, None, :]
            xh = x.reshape(s, heads, d)
            pairs = xh.view(s, heads, d // 2, 2) if a["style"] == "norm" else xh.view(s, heads, 2, d // 2)
            swapped = pairs.flip(-1 if a["style"] == "norm" else -2).reshape(s, heads, d)
            return (xh * c).add_(swapped * sn).view(s, heads * d)
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
        self._steps = weakref.WeakSet()  # the one-token programs compiled here (describe() says how they ran)

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
        prog = self.program_cls(graph, self.weights, states, plan, arena, self._rope, max_seq=max_seq)
        if max_seq == 1:
            self._steps.add(prog)
        return prog

    # -- the program cache (Model calls these around compiling its programs) ---------------------
    def _weights_key(self, fingerprint: str) -> str:
        from ..cache import program_key

        # the int4 pack layout is torch's own, per version and machine architecture
        return program_key(model=fingerprint, artifact="cpu-fast-weights", torch=torch.__version__,
                           machine=platform.machine())

    def load_weight_cache(self, cache, fingerprint: str) -> bool:
        """Map the packs a previous load of this file built; True when they were found intact.
        Backends whose programs pack other rows (a tensor-parallel rank's share, whose ranks would
        overwrite one another's entry) build their packs at every load."""
        if self.program_cls is not CpuFastProgram:
            return False
        key = self._weights_key(fingerprint)
        self._weight_cache = (cache, key)
        found = cache.get_arrays(key, "weights.bin")
        if found is None:
            return False
        try:
            return self.weights.restore(*found) > 0
        except (ValueError, KeyError, TypeError):  # written by another layout: rebuilt and rewritten
            self.weights._packs.clear()
            return False

    def save_weight_cache(self) -> None:
        """Write the packs when this load built any (a miss, or products the entry lacked)."""
        wc = getattr(self, "_weight_cache", None)
        if wc is not None and self.weights.built:
            cache, key = wc
            meta, arrays = self.weights.save()
            cache.put_arrays(key, "weights.bin", arrays, meta)
            self.weights.built = 0

    def allocate_states(self, graph, ctx: int) -> dict[str, torch.Tensor]:
        # torch.empty: pages of a large fresh allocation become resident only when a position is
        # written; attention reads only the rows already written
        return {t.name: torch.empty(t.concrete_shape(ctx=ctx), dtype=torch.float32) for t in graph.states()}

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for p in self.weights._packs.values():
            kinds[p.kind] = kinds.get(p.kind, 0) + 1
        held = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        native = sum(p.native is not None for p in self.weights._packs.values())
        if native:
            held += f"; {native} native for <= {NATIVE_MAX_ROWS} rows"
        ran = {"one native call" if p._step is not None else f"interpreted: {p.step_unavailable}"
               for p in self._steps if p._step is not None or p.step_unavailable is not None}
        if ran:
            held += f"; decode step {', '.join(sorted(ran))}"
        return (f"cpu-fast (torch {torch.__version__}, {torch.get_num_threads()} threads; "
                f"weights {self.weights.nbytes / 2**20:.0f} MiB: {held})")
