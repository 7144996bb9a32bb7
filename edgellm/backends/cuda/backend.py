"""The cuda backend: executes a compiled Graph with the Triton kernel templates in ./kernels.

- Weights are repacked once at load into the layout each kernel reads (kernels/packing.py):
  F16/BF16/F32 as F16, Q4_0, Q4_1, Q8_0 as themselves, Q5_0 as Q8_0 (exact), Q4_K, Q5_K and Q6_K
  as Q4K, Q5K and Q6K (their codes, scale codes and super-block scales as stored;
  EDGELLM_KQUANTS=converted makes them Q4_1, Q6M and Q6 with fp16 sub-block scales instead), Q5_1
  as Q6M (6-bit codes, fp16 scales per 16); the types without a layout of their own (Q2_K, Q3_K,
  IQ*) are dequantized and stored as Q8_0.
  Projections that a fused op reads together (q|k|v, gate|up) are concatenated at load, parts in
  different formats first converted to a common layout (packing.unify_formats: exact, Q6M for a
  Q4_K_M file's Q4_K q, k with its Q6_K v).
- Activations are fp16 views into one arena laid out by the compile step's memory plan; the
  KV cache is fp16, one preallocated tensor per layer and K/V, written in place.
- Stage-aware: prefill programs take any number of tokens (tensor-core kernels, causal flash
  attention); the single-token decode program (matrix-vector kernels, split-context attention)
  is captured in a CUDA graph per context bucket, whose position and length live in device
  tensors, so a token costs one graph replay and no allocation. Prefill steps run padded to a
  multiple of PREFILL_PAD tokens and are captured per padded size too (launch-bound otherwise).

EDGELLM_CUDA_DEVICE=cpu with TRITON_INTERPRET=1 runs the same kernels in Triton's interpreter
on CPU tensors (slow; for tests on machines without a GPU).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterator

import numpy as np
import torch

from ...errors import BackendUnavailableError, EdgeLLMError, GraphError, ModelFileError
from ...gguf_file import GGUFFile
from ...sampling import DEVICE_DRAW_FIELDS, device_draw_rows, device_sampling_enabled
from ...graph.ir import Graph, Op
from ...graph.shapes import shape_function
from ..cpu import _rope, plan_offsets
from ..info import CudaInfo
from . import precompile as _precompile
from .graphs import captured


class DeviceMemoryError(EdgeLLMError):
    """The model does not fit in the GPU's memory."""


# Prefill steps run padded to a multiple of PREFILL_PAD tokens so that prompts of nearby lengths
# share one CUDA graph: without graphs, a prefill of a small model is bound by the host's kernel
# launches (H100, 2026-11-22: 135M F16 took 29 ms for 512 tokens and 22 ms for 1024).
PREFILL_PAD = 64
MAX_GRAPHS = 24  # per program; beyond it the least recently used graph is dropped


def _device() -> torch.device:
    want = os.environ.get("EDGELLM_CUDA_DEVICE")
    if want:
        return torch.device(want)
    if not torch.cuda.is_available():
        raise BackendUnavailableError("the cuda backend needs an NVIDIA GPU with CUDA; none is visible to torch "
                                      f"(torch {torch.__version__}); use --backend cpu")
    return torch.device("cuda")


def _kernels():
    # compiled kernels live in the engine's cache (`edgellm cache info|clear` covers them)
    from ...cache import triton_cache_dir

    os.environ["TRITON_CACHE_DIR"] = triton_cache_dir()
    try:
        from . import kernels
    except ImportError as e:  # triton missing
        raise BackendUnavailableError(f"the cuda backend needs triton: {e}") from None
    from .replay_record import watch_kernel_loads

    watch_kernel_loads()  # which cubin each loaded kernel came from, for start-up images
    return kernels


_prefetch_thread: threading.Thread | None = None


def prefetch() -> None:
    """Start Triton's cache key on a background thread: a SHA-256 of its ~450 MB library that
    Triton computes once per process before it loads any cached kernel (0.35 s on the H100 host),
    remembered between processes by triton_key.py (then a few milliseconds of file stats), and
    otherwise file reads and hashing that run outside the GIL while the loading thread reads the
    model file and builds the tokenizer. `edgellm.load` calls it first; CudaBackend waits for it.
    Errors are left to the loading thread, which meets them again. EDGELLM_PREFETCH=0 turns it off.
    Where Triton's cache is empty, the compile workers start too (precompile.start_pool_if_cold)."""
    global _prefetch_thread
    if _prefetch_thread is not None or os.environ.get("EDGELLM_PREFETCH", "1") == "0":
        return

    def work():
        try:
            from triton.runtime.cache import triton_key

            from .triton_key import memoize_triton_key

            if memoize_triton_key() is None:  # not remembered: Triton's own (functools.lru_cache)
                triton_key()
        except Exception:  # noqa: BLE001 - the loading thread meets and reports the same error
            pass

    # not torch.cuda.is_available(): that initialises the CUDA driver on this thread, which then
    # waits for the early context's cuInit (early.py) instead of reading the file meanwhile (the
    # "start" phase of a load took 0.19 s on the H100 host that way, 2026-11-28)
    interpreted = (os.environ.get("TRITON_INTERPRET") == "1"
                   or os.environ.get("EDGELLM_CUDA_DEVICE", "").startswith("cpu"))
    if not interpreted:  # the interpreter compiles nothing and needs no key
        _prefetch_thread = threading.Thread(target=work, name="edgellm-triton-key", daemon=True)
        _prefetch_thread.start()
        # a first load on this machine (Triton's cache empty): the compile workers start now, not
        # where the program cache misses (their start, ~2-2.5 s, outlasted the graph compile there)
        _precompile.start_pool_if_cold()


def _wait_prefetch() -> None:
    if _prefetch_thread is not None:
        _prefetch_thread.join()


# numpy dtype string -> torch dtype, for float weights read as bytes
_TORCH_DTYPES = {"<f2": torch.float16, "<f4": torch.float32, "<i1": torch.int8}

# weights decoded on the device a slab of this many elements at a time (float32: 256 MiB)
_DECODE_SLAB_ELEMENTS = 64 << 20


class CudaWeights:
    """Weights on the device in kernel layouts, converted on first use and shared by all programs."""

    def __init__(self, f: GGUFFile, device: torch.device):
        self.file, self.device = f, device
        self.K = _kernels()
        self._packed: dict[tuple[str, ...], object] = {}
        self._vectors: dict[tuple[str, ...], torch.Tensor] = {}
        self._uploader = None  # upload.Uploader, made at the first weight it carries
        self.uploaded_bytes = 0  # weight bytes that went through it

    def _raw(self, t):
        """A weight's stored bytes as a uint8 tensor of rows (out, row bytes): on the device, read
        through page-locked slots (upload.py) where the tensor is one run of the file's bytes;
        else the host array, which repack copies to the device itself."""
        from . import upload

        data = t.data
        whole = (self.device.type == "cuda" and upload.enabled() and data.nbytes >= upload.MIN_BYTES
                 and data.ndim == 2 and (data.dtype == np.uint8 or data.dtype.str in _TORCH_DTYPES)
                 and self.file.stored_whole(t))
        if not whole:
            return np.ascontiguousarray(data)
        try:
            if self._uploader is None:
                self._uploader = upload.Uploader(self.file.path, self.device)
            rows = self._uploader.upload(t.offset, data.nbytes).view(data.shape[0], -1)
        except OSError as e:  # the file went away or shrank under the load
            raise ModelFileError(f"cannot read tensor '{t.name}' of {self.file.path.name}: {e}") from None
        self.uploaded_bytes += data.nbytes
        return rows if data.dtype == np.uint8 else rows.view(_TORCH_DTYPES[data.dtype.str])

    def done_loading(self) -> None:
        """The uploader's threads and page-locked slots are let go (the weights are all on the device)."""
        if self._uploader is not None:
            self._uploader.close()
            self._uploader = None

    def packed(self, *names: str):
        """One PackedWeight for these tensors stacked along the output axis."""
        w = self._packed.get(names)
        if w is None:
            # parts of a stacked weight are not kept: the device holds each weight once
            parts = [self._packed.get((n,)) or self._pack_one(n) for n in names]
            # mixed formats (Q4_K_M files: q, k Q4_K with v Q6_K, as Q4_1 and Q6): one layout that holds
            # every part exactly (Q6M there, 8 bits per weight; F16 only where none does, e.g. a
            # Q8_0 part with codes beyond 6 bits). Requantizing to Q8_0 put the tiny Q4_K_M-like
            # test model's decode logits 0.8% off, against 0.5% allowed.
            parts = self.K.unify_formats(parts)
            w = parts[0] if len(parts) == 1 else self.K.concat_packed(parts)
            self._packed[names] = w
        return w

    def _pack_one(self, name: str):
        t = self.file.tensor(name)
        if self.K.can_repack(t.type_name):
            return self.K.repack(self._raw(t), t.type_name, t.shape, device=self.device)
        # no layout of its own (Q2_K, Q3_K, IQ*; Q6_K, Q5_K, Q5_1 have Q6/Q6M and are repacked above,
        # on the device): the raw blocks go to the device and are decoded there (bitwise the
        # reference decode) and packed as Q8_0, a slab of rows at a time, which keeps them within
        # 8.5 bits per weight (lossy, but under the error of these 2- to 4-bit formats). Decoding on
        # the host with numpy took most of an 8B Q4_K_M file's 10.7 s load.
        from ...quant import dequantize_torch

        raw = torch.from_numpy(np.ascontiguousarray(t.data))
        rows = max(1, _DECODE_SLAB_ELEMENTS // t.shape[-1])
        parts = []
        for i in range(0, t.shape[0], rows):
            slab = raw[i:i + rows].to(self.device, non_blocking=False)
            dense = dequantize_torch(slab, t.type_name, (slab.shape[0], t.shape[-1]))
            parts.append(self.K.pack_float(dense, "Q8_0"))
        return parts[0] if len(parts) == 1 else self.K.concat_packed(parts)

    def vector(self, *names: str) -> torch.Tensor:
        """1-D tensors (norm weights, biases, rope factors) as fp32 on the device, concatenated."""
        v = self._vectors.get(names)
        if v is None:
            from ...quant import dequantize

            ts = [self.file.tensor(n) for n in names]
            parts = [np.asarray(dequantize(t.data, t.type_name, t.shape), dtype=np.float32).reshape(-1) for t in ts]
            v = torch.from_numpy(np.concatenate(parts)).to(self.device)
            self._vectors[names] = v
        return v

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._packed.values()) + sum(v.numel() * 4 for v in self._vectors.values())


# Decode matrix-vector products on quantized weights quantize the activation to int8 per 32-block
# and use integer dot products (llama.cpp's way) when the weight is large enough that bandwidth,
# not the extra quantize launch, decides: measured on an H200, 4096x4096 Q4_0 went from 12.3 to
# 6.7 us, 14336x4096 from 21.8 to 10.6 us. Not for the output projection (see _lower).
# EDGELLM_ACT_INT8=0/1 forces it off/on.
ACT_INT8_MIN_ELEMENTS = 4 << 20


def _use_act_int8(w) -> bool:
    mode = os.environ.get("EDGELLM_ACT_INT8", "auto")
    if w.fmt == "F16" or mode == "0":
        return False
    return mode == "1" or w.shape[0] * w.shape[1] >= ACT_INT8_MIN_ELEMENTS


def residual_stream(graph: Graph) -> set[str]:
    """The tensors of the residual stream: the sums of residual adds (add_rms_norm's first output,
    both its inputs, a projection's output with its residual added, and what add or last_row make of
    them). They live in float32, other activations in float16: the stream accumulates every layer's
    output and outgrows float16's range in some models (Gemma 3 270M reaches 1.04e5 by layer 14,
    past float16's 65,504: its logits were NaN), where llama.cpp also keeps float32. They are a few
    rows of width d per layer, so the bytes do not matter; the memory plan sizes every activation at
    float32 already (the IR's dtype)."""
    wide: set[str] = set()
    for op in graph.ops:
        if op.kind == "add_rms_norm":
            wide.update((op.outputs[0], op.inputs[0], op.inputs[1]))
        elif op.kind in ("all_reduce", "all_gather"):  # a tensor-parallel rank's partial (of the stream's
            wide.update((op.inputs[0], op.outputs[0]))  # next term; of the logits) and the whole
    changed = True
    while changed:  # forward through the ops that carry the stream on
        changed = False
        for op in graph.ops:
            carries = (op.kind in ("add", "last_row") or (op.kind == "linear" and op.attrs.get("has_residual")))
            src = op.inputs[-1] if op.kind == "linear" else op.inputs[0]
            if carries and (src in wide or (op.kind == "add" and op.inputs[1] in wide)) and op.outputs[0] not in wide:
                wide.add(op.outputs[0])
                changed = True
    return wide


# A shape's first step is captured into its CUDA graph directly: the kernels it meets for the first
# time in this process are read from Triton's cache (or compiled) and loaded during the capture,
# which only records their launches. An eager run of the step before the capture used to do that
# loading outside it; on the H100 it cost about a quarter of a warm load's warm-up (0.48 -> 0.35-0.38 s
# for the 135M shape, benchmarks/profile_warmup.py) and gave the same tokens. EDGELLM_EAGER_BEFORE_CAPTURE=1
# runs it again; a program with collectives (tensor parallelism) always does, so that a communicator's
# first use (which may set it up) is not inside a capture.
_EAGER_BEFORE_CAPTURE = os.environ.get("EDGELLM_EAGER_BEFORE_CAPTURE", "0") == "1"

# The rows programs' skinny-GEMM tuning entries (tuning.py: the kernel name carries a version, so
# that timings of an older kernel are not reused): 2 since the dequantization went through packed
# PTX (2026-11-29), which changed which tiles are fastest.
SKINNY_TUNE_KERNEL = "gemm_skinny.2"



def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t in page-locked memory when it goes to a GPU (a non-blocking copy from it is queued on the
    stream, not waited for)."""
    return t.pin_memory() if device.type == "cuda" else t


class DeviceChooser:
    """Token choice on the device for rows whose sampling is fixed (draws: an
    edgellm.sampling.DeviceDraw or None for the argmax, per row): the parameters are copied to the
    device once, here, into `into`'s tensors where given (a CUDA graph replayed with other
    parameters reads them there); each call picks one token per row of logits. `plan` names the
    work a call does, which depends on host numbers only (so a CUDA graph holding it is keyed by it)."""

    FIELDS = tuple((name, getattr(torch, dtype)) for name, dtype in DEVICE_DRAW_FIELDS)

    @classmethod
    def buffers(cls, rows: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(rows, dtype=dtype, device=device) for name, dtype in cls.FIELDS}

    def __init__(self, K, draws: list, device: torch.device, vocab: int, into: dict | None = None):
        self.K = K
        self.plan, values = device_draw_rows(draws, vocab)
        if self.plan is None:
            return
        self.need, self.cut_rows, self.any_top_k = self.plan
        t = into if into is not None else self.buffers(len(draws), device)
        for name, dtype in self.FIELDS:  # queued on the stream: a blocking copy would wait for the GPU
            t[name].copy_(_pinned(torch.tensor(values[name], dtype=dtype), device), non_blocking=True)
        self.t = t

    def __call__(self, logits: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None = None,
                 step: tuple | None = None) -> torch.Tensor:
        if self.plan is None:
            return self.K.argmax(logits, out=out, step=step)
        t = self.t
        if self.cut_rows:
            self.K.cuts(logits, t["top_k"], t["top_p"], t["min_p"], self.need, out=t["cut"], any_top_k=self.any_top_k)
        return self.K.sample(logits, t["temperature"], t["cut"], t["seed"], pos, out=out, step=step)


class CudaProgram:
    """A compiled graph bound to device weights, caches and an arena; one launch per op."""

    def __init__(self, backend: "CudaBackend", graph: Graph, states: dict[str, torch.Tensor], plan, max_seq: int):
        self.backend, self.graph, self.states = backend, graph, states
        self.dev = backend.device
        self.K = backend.K
        self.max_seq = max_seq
        self.offsets = plan_offsets(plan) if plan is not None else {}
        need = plan.total_bytes if plan is not None else 0
        self.arena = backend.arena(need)
        self._shape_fn = {n: shape_function(graph.tensors[n].shape) for n in graph.tensors
                          if graph.tensors[n].kind == "activation"}
        # static device inputs: tokens, start position, tokens in the cache after this step
        self.tokens = torch.zeros(max_seq, dtype=torch.int32, device=self.dev)
        self.wide = residual_stream(graph)  # kept in float32, see residual_stream
        # float inputs: activations a split model's earlier segment made on another processor
        # (edgellm/hetero/executor.py), copied into static buffers before each step
        self._float_inputs = {n: torch.zeros((max_seq, int(graph.tensors[n].concrete_shape(seq=1, ctx=1)[-1])),
                                             dtype=torch.float32 if n in self.wide else torch.float16,
                                             device=self.dev)
                              for n in graph.inputs if graph.tensors[n].dtype == "f32"}
        self.start = torch.zeros(1, dtype=torch.int32, device=self.dev)
        self.seq_len = torch.zeros(1, dtype=torch.int32, device=self.dev)
        # a rows program (the model's 'rows' graph: one decode token of each of several sequences,
        # row i at its own position pos[i] in its own KV slot at cache rows base[i]..) reads them here
        self.rows_mode = "pos" in graph.inputs and "base" in graph.inputs
        self.row_pos = torch.full((max_seq,), -1, dtype=torch.int32, device=self.dev)
        self.row_base = torch.zeros(max_seq, dtype=torch.int32, device=self.dev)
        self._rows_fused: dict[str, tuple[Op, Op, Op]] = {}  # rope_rows(q) -> (rope_rows(k), store k, store v)
        self._rows_qkv: dict[str, tuple[Op, Op, Op]] = {}  # linear q -> its (q, k, v) linears, one product
        self._rows_qkv_of: dict[str, str] = {}  # rope_rows(q) -> the linear q whose q|k|v buffer it reads
        self._attn_rope: dict[str, str] = {}  # attention_rows -> the fused rope_rows(q) whose work it does
        self._host_positions = False
        self.delegated: list[str] = []
        # decode-stage fusions across ops (see _plan_decode_fusions); a rows program is a decode
        # step whatever its size (its steps of up to ROWS_GEMV_MAX_TOKENS rows take the GEMV kernels)
        self.decode_stage = max_seq <= self.K.configs.DECODE_MAX_TOKENS or self.rows_mode
        # the largest row count whose linear layers take the decode GEMV (above: the GEMM kernel)
        self.gemv_max = self.K.configs.ROWS_GEMV_MAX_TOKENS if self.rows_mode else self.K.configs.DECODE_MAX_TOKENS
        self._rope_into_gemv: dict[str, Op] = {}  # linear_qkv op name -> the rope_qkv_store it absorbs
        self._absorbed: set[str] = set()  # ops whose work another op's kernel does
        self._xq_for: dict[str, object] = {}  # norm output -> int8 copy written by the norm kernel
        self._own_buffers: dict[str, torch.Tensor] = {}  # tensors kept out of the arena (see below)
        self._norm_tail: dict[str, tuple[Op, str, torch.Tensor]] = {}  # linear -> (norm, residual, counter)
        self._aliases: dict[str, str] = {}  # tensor -> the tensor whose buffer it is (no op writes it)
        # add_rms_norm -> (the all_reduce's partial it sums itself, the residual, Peers): see _plan_collectives
        self._sum_into_norm: dict[str, tuple[str, str, object]] = {}
        if self.rows_mode:  # first: the decode fusions below see which projections it stacks
            self._plan_rows_fusions()
        self._plan_decode_fusions()
        self._shots = self._plan_collectives()
        # attention splits of the current step (from the host's sequence length, see _set_context)
        self._splits = 1
        self._split_cap: int | None = None
        self._skinny_jobs: dict[tuple, tuple] = {}  # (fmt, N, K, rows) -> its skinny-GEMM tuning job
        self._prepare_tuning()
        self._after_gemv = self._gemvs_after_gemvs()  # products that skip the L2 prefetch (see there)
        self._launches: list[Callable[[dict, int, int], None]] = [self._lower(op) for op in graph.ops]
        # an eager run of a shape's first step before its capture (see _EAGER_BEFORE_CAPTURE)
        self._eager_first = _EAGER_BEFORE_CAPTURE or any(op.kind in ("all_reduce", "all_gather") for op in graph.ops)
        # CUDA graphs: decode, one per context bucket; prefill, one per padded token count (see run)
        self._graphs: OrderedDict[tuple[int, int], torch.cuda.CUDAGraph] = OrderedDict()
        self._graph_envs: dict[int, dict] = {}
        self.use_cuda_graph = (self.dev.type == "cuda" and not self._host_positions and not self.delegated
                               and os.environ.get("EDGELLM_CUDA_GRAPHS", "1") != "0")
        # seconds this program spent on one-time work (kernel compiles, graph captures), which the
        # generation stats report apart from prefill and decode speed
        self.one_time_s = 0.0
        # prefill token counts round up to a multiple of this, so prompts of nearby lengths share a
        # graph (the padding rows are computed and dropped; 0: no padding)
        self.prefill_pad = PREFILL_PAD if self.use_cuda_graph and max_seq > 1 else 0
        self.last_index = torch.zeros(1, dtype=torch.int64, device=self.dev)  # the last real row

    # -- buffers ------------------------------------------------------------------------------
    def _buffer(self, name: str, seq: int, ctx: int) -> torch.Tensor:
        t = self.graph.tensors[name]
        shape = self._shape_fn[name]({"seq": seq, "ctx": ctx})
        dtype = torch.float32 if name in self.graph.outputs or name in self.wide else torch.float16
        if name in self._own_buffers:
            return self._own_buffers[name][:shape[0]].view(shape)
        if name in self.offsets:
            off = self.offsets[name]
            n = math.prod(shape) * (4 if dtype == torch.float32 else 2)
            return self.arena[off:off + n].view(dtype).view(shape)
        if name in self.graph.outputs:
            return torch.empty(shape, dtype=dtype, device=self.dev)
        raise GraphError(f"cuda: no buffer planned for '{t.name}'")

    # -- decode-stage fusions ----------------------------------------------------------------
    def _plan_decode_fusions(self) -> None:
        """Kernel-level fusions of the decode stage, where a token's time is mostly launches:
        - a fused q|k|v projection whose only reader is rope_qkv_store (adjacent-pair RoPE) rotates
          and writes the KV cache in its GEMV epilogue: one launch instead of two;
        - an RMSNorm whose output feeds int8-activation GEMVs also writes the int8 copy they read,
          so they skip quantize_activations: one launch less per such GEMV; so does the attention
          whose output feeds the output projection's int8 GEMV (its programs own whole heads);
        - a residual add + RMSNorm (add_rms_norm) whose branch input comes from a projection is done
          by that projection's GEMV (NormTail: each program adds its rows into the residual stream,
          the last one to finish normalises): one launch less, twice per layer.
        Prefill stages keep separate kernels (their matrix-matrix products have no such epilogue)."""
        if not self.decode_stage or os.environ.get("EDGELLM_DECODE_FUSION", "1") == "0":
            return
        if self.max_seq == 1:  # one token: its last row is its only row, no copy needed
            for op in self.graph.ops:
                if op.kind == "last_row":
                    self._aliases[op.outputs[0]] = op.inputs[0]
                    self._absorbed.add(op.name)
        readers: dict[str, list[Op]] = {}
        producer: dict[str, Op] = {}
        for op in self.graph.ops:
            for t in op.inputs:
                readers.setdefault(t, []).append(op)
            for t in op.outputs:
                producer[t] = op
        # off by default: on the H100 it saved 24 us per token on Llama-3.2-1B Q4_0 in one run and
        # cost up to 25% of SmolLM2's decode speed in two later ones (docs/benchmarks.md section 1d)
        if os.environ.get("EDGELLM_NORM_TAIL", "0") == "1":
            self._plan_norm_tails(readers, producer)
        for op in self.graph.ops:
            if op.kind == "linear_qkv":
                rd = readers.get(op.outputs[0], [])
                if (len(rd) == 1 and rd[0].kind == "rope_qkv_store" and rd[0].attrs.get("style") == "norm"
                        and rd[0].attrs.get("pos_scale", 1.0) == 1.0 and rd[0].attrs.get("mscale", 1.0) == 1.0
                        and "qk_norm_eps" not in rd[0].attrs and not rd[0].attrs.get("ring")
                        and rd[0].inputs[0] == op.outputs[0]):
                    self._rope_into_gemv[op.name] = rd[0]
                    self._absorbed.add(rd[0].name)
                    # the rotated q is now written while the GEMV still reads its input, earlier than
                    # the memory plan assumed (it may share the input's slot): it gets a buffer of its
                    # own, one for all layers (each is read by its attention before the next is written)
                    q = self.graph.tensors[rd[0].outputs[0]]
                    self._own_buffers[q.name] = self._private_buffer(int(q.shape[-1]))
        W = self.backend.weights
        for op in self.graph.ops:
            if op.kind not in ("linear", "linear_qkv", "linear_swiglu") or op.name in self._absorbed:
                continue
            src = producer.get(op.inputs[0])
            if src is None or src.kind not in ("rms_norm", "add_rms_norm", "attention") \
                    or src.kind not in self.backend.SUPPORTED_OPS:
                continue
            if not self._linear_uses_int8(op, W):
                continue
            width = int(self.graph.tensors[op.inputs[0]].shape[-1])
            if width % 32 or (src.kind == "attention" and src.attrs["head_dim"] % 32):
                continue  # (an attention program writes whole heads: they must be whole 32-blocks)
            self._xq_for[op.inputs[0]] = self._xq_buffer(width)

    def _gemvs_after_gemvs(self) -> set[str]:
        """The products launched right after another product (the down projection after gate|up).
        They do not prefetch their weights into L2 before their PDL wait (set_l2_prefetch): their
        programs become resident as the product before them starts, which then streams its own
        weights through L2 and evicts those lines before they are read (measured on the H100: 8B
        Q4_0 decode 1-2% slower with them prefetching, 1B Q4_0 5% slower). Letting such a product
        launch its successor only after its main loop instead cost up to 10% (docs/benchmarks.md).
        EDGELLM_L2_PREFETCH_AFTER_GEMV=1 prefetches there too."""
        if os.environ.get("EDGELLM_L2_PREFETCH_AFTER_GEMV", "0") == "1":
            return set()
        kinds = ("linear", "linear_qkv", "linear_swiglu")
        after: set[str] = set()
        prev: Op | None = None
        for op in self.graph.ops:
            if op.name in self._absorbed:
                continue
            if op.kind in kinds and prev is not None and prev.kind in kinds:
                after.add(op.name)
            prev = op
        return after

    def _plan_norm_tails(self, readers: dict[str, list[Op]], producer: dict[str, Op]) -> None:
        """Which add_rms_norm ops the GEMV before them absorbs (see _plan_decode_fusions). The sums
        they write (the residual stream) go to one buffer outside the arena, updated in place: the
        GEMV writes them while its other programs still read x, which the memory plan may have put
        in the sum's slot. So a sum must be read before the next absorbing GEMV writes that buffer,
        or by that GEMV itself as its residual (each program reads its rows, then writes them)."""
        ops = self.graph.ops
        order = {op.name: i for i, op in enumerate(ops)}
        if "add_rms_norm" not in self.backend.SUPPORTED_OPS:  # delegated to the cpu: it runs as it is
            return
        cand: dict[str, tuple[Op, Op, str]] = {}  # norm name -> (norm, the linear it follows, residual)
        for op in ops:
            if op.kind != "add_rms_norm" or op.outputs[0] in self.graph.outputs:
                continue
            for i in (0, 1):
                lin = producer.get(op.inputs[i])
                if (lin is not None and lin.kind == "linear" and not lin.attrs.get("has_residual")
                        and readers.get(op.inputs[i], []) == [op] and op.inputs[i] not in self.graph.outputs
                        and op.inputs[1 - i] != op.inputs[i]):
                    cand[op.name] = (op, lin, op.inputs[1 - i])
                    break
        changed = True
        while changed:  # a dropped norm changes the writers of the buffer: check again
            changed = False
            writers = sorted(order[lin.name] for _, lin, _ in cand.values())
            for name, (norm, lin, _) in list(cand.items()):
                nxt = next((w for w in writers if w > order[lin.name]), len(ops))
                for r in readers.get(norm.outputs[0], []):
                    in_place = (r.name in cand and cand[r.name][2] == norm.outputs[0]
                                and order[cand[r.name][1].name] == nxt)
                    if not in_place and (r.name in cand or order[r.name] >= nxt):
                        del cand[name]
                        changed = True
                        break
        if not cand:
            return
        self._norm_counters = torch.zeros(len(cand), dtype=torch.int32, device=self.dev)
        for i, (name, (norm, lin, residual)) in enumerate(cand.items()):
            width = int(self.graph.tensors[norm.outputs[0]].shape[-1])
            self._own_buffers[norm.outputs[0]] = self.backend.shared_buffer(
                ("resid", self.max_seq, width),
                lambda: torch.empty((self.max_seq, width), dtype=torch.float32, device=self.dev))
            self._norm_tail[lin.name] = (norm, residual, self._norm_counters[i:i + 1])
            self._absorbed.add(name)

    def _plan_rows_fusions(self) -> None:
        """A layer of the rows graph rotates q and k (rope_rows) and stores k and v (kv_store_rows)
        in four ops; where they have the usual shape (q read only by its attention, rotated k only
        by its store, one RoPE for both) one launch of the fused rope + KV-store kernel in rows mode
        does all four, at the place of the q rotation (q, k and v are all computed by then)."""
        if os.environ.get("EDGELLM_DECODE_FUSION", "1") == "0":
            return
        ops = self.graph.ops
        order = {op.name: i for i, op in enumerate(ops)}
        producer: dict[str, Op] = {}
        readers: dict[str, list[Op]] = {}
        for op in ops:
            for t in op.outputs:
                producer[t] = op
            for t in op.inputs:
                readers.setdefault(t, []).append(op)
        supported = self.backend.SUPPORTED_OPS
        for att in ops:
            if att.kind != "attention_rows":
                continue
            rq, sk, sv = (producer.get(t) for t in att.inputs[:3])
            if not (rq and sk and sv and rq.kind == "rope_rows" and sk.kind == "kv_store_rows"
                    and sv.kind == "kv_store_rows"):
                continue
            rk = producer.get(sk.inputs[1])
            if rk is None or rk.kind != "rope_rows" or readers.get(rk.outputs[0]) != [sk]:
                continue
            if readers.get(rq.outputs[0]) != [att] or {rq.kind, sk.kind} - set(supported):
                continue
            same = ("head_dim", "rope_dim", "theta", "style", "pos_scale", "mscale")
            if any(rq.attrs.get(k) != rk.attrs.get(k) for k in same) or rq.inputs[2:] != rk.inputs[2:]:
                continue
            first = order[rq.name]
            if min(order[rk.name], order[sk.name], order[sv.name]) < first:
                continue
            srcs = (rq.inputs[0], rk.inputs[0], sv.inputs[1])
            if any(t in producer and order[producer[t].name] >= first for t in srcs):
                continue
            self._rows_fused[rq.name] = (rk, sk, sv)
            self._absorbed.update({rk.name, sk.name, sv.name})
            # the q, k and v projections of one input (read only by this group): one product over
            # the stacked weights into a q|k|v buffer of its own, which the fused kernel reads
            lins = [producer.get(t) for t in srcs]
            if (all(l is not None and l.kind == "linear" and not l.attrs.get("has_residual") for l in lins)
                    and len({l.inputs[0] for l in lins}) == 1
                    and len({bool(l.attrs.get("has_bias")) for l in lins}) == 1
                    and [readers.get(l.outputs[0]) for l in lins] == [[rq], [rk], [sv]]):
                first_lin = min(lins, key=lambda l: order[l.name])
                if first_lin is lins[0]:  # launched where the q projection was
                    self._rows_qkv[lins[0].name] = tuple(lins)
                    self._rows_qkv_of[rq.name] = lins[0].name
                    self._absorbed.update({lins[1].name, lins[2].name})
                    # and the rotation + store done by the attention kernel itself, which reads the
                    # q|k|v buffer (outside the arena, so it outlives the rope op's place)
                    if (os.environ.get("EDGELLM_ROWS_ROPE_IN_ATTENTION", "1") != "0"
                            and rq.attrs.get("mscale", 1.0) == 1.0):
                        self._attn_rope[att.name] = rq.name
                        self._absorbed.add(rq.name)

    def _private_buffer(self, width: int) -> torch.Tensor:
        return self.backend.shared_buffer(("q", self.max_seq, width), lambda: torch.empty(
            (self.max_seq, width), dtype=torch.float16, device=self.dev))

    def _xq_buffer(self, width: int):
        """One int8 activation buffer per width, shared: each is read right after it is written."""
        n = self.max_seq
        return self.backend.shared_buffer(("xq", n, width), lambda: self.K.QuantizedActivations(
            torch.empty((n, width), dtype=torch.int8, device=self.dev),
            torch.empty((n, width // 32), dtype=torch.float32, device=self.dev),
            torch.empty((n, width // 32), dtype=torch.float32, device=self.dev)))

    @staticmethod
    def _xq_rows(xq, s: int):
        return type(xq)(xq.xq[:s], xq.xd[:s], xq.xs[:s])

    def _wname(self, t: str) -> str:
        """The file tensor behind a graph weight tensor."""
        return self.graph.tensors[t].source or t

    def _linear_weight(self, op: Op, W):
        wname = self._wname
        if op.name in self._rows_qkv:  # a rows layer's q projection, stacked with its k and v
            return W.packed(*(wname(l.inputs[1]) for l in self._rows_qkv[op.name]))
        if op.kind == "linear_qkv":
            return W.packed(*(wname(t) for t in op.inputs[1:4]))
        if op.kind == "linear_swiglu":
            return W.packed(wname(op.inputs[1]), wname(op.inputs[2]))
        return W.packed(wname(op.inputs[1]))

    def _linear_uses_int8(self, op: Op, W) -> bool:
        # the output projection stays on the float path: int8 activations cost up to ~0.3 logits
        # there (measured on SmolLM2), enough to flip a close argmax; inside the blocks the error
        # averages out
        if op.kind == "linear" and (op.outputs[0] in self.graph.outputs or op.name == "output"):
            return False
        return _use_act_int8(self._linear_weight(op, W))

    def _set_context(self, seq_len: int) -> int:
        """The context bucket of a step (_context_splits), set for its launches."""
        self._splits = self._context_splits(seq_len)
        return self._splits

    def _context_splits(self, seq_len: int) -> int:
        """The context bucket of a step: its attention split count, from the number of cached
        tokens. Short contexts take one split (one kernel, no combine step); each further
        ATTN_DECODE_KEYS_PER_SPLIT keys add a split, up to about two programs per SM. Decode CUDA
        graphs are captured per bucket."""
        per = self.K.configs.ATTN_DECODE_KEYS_PER_SPLIT
        n = max(1, -(-int(seq_len) // per))
        if self._split_cap is not None:
            n = min(n, self._split_cap)
        return n

    def step_shapes(self, rows: int, ctx: int) -> dict[int, int]:
        """{attention split count: the first position (of the longest row) at which a decode step
        takes it} for a step of `rows` sequences (a rows program) or of one (a decode program), at
        positions 0 .. ctx - 1. Each split count is a variant of the attention kernels (N_SPLITS is
        a compile-time constant) and a CUDA graph of its own: SlotPool.warmup runs a step at each,
        so that none is compiled inside a served round (on an H200, 2026-11-29, rounds of 16 and 32
        streams stalled 0.5-2 s in one iteration of the model thread)."""
        if self.rows_mode:
            bucket = self.row_bucket(rows)
            splits = lambda keys: self._row_splits(bucket, keys)  # noqa: E731
        else:
            splits = self._context_splits
        out: dict[int, int] = {}
        pos = 0
        while pos < ctx:
            s = splits(pos + 1)
            out.setdefault(s, pos)
            lo, hi = pos + 1, ctx  # the next position with another count (counts never fall as keys grow)
            while lo < hi:
                mid = (lo + hi) // 2
                if splits(mid + 1) != s:
                    hi = mid
                else:
                    lo = mid + 1
            pos = lo
        return out

    # -- lowering: one closure per op ---------------------------------------------------------
    def _lower(self, op: Op) -> Callable:
        K, W, a = self.K, self.backend.weights, op.attrs
        kind = op.kind
        ins, outs = op.inputs, op.outputs
        if kind not in self.backend.SUPPORTED_OPS:
            return self._delegate_to_cpu(op)
        wname = self._wname

        if kind == "embedding":
            table = W.packed(wname(ins[0]))
            return lambda env, s, c: K.embedding(self.tokens[:s], table, out=env[outs[0]])
        if op.name in self._absorbed:
            return lambda env, s, c: None
        if kind in ("rms_norm", "add_rms_norm"):
            normed = outs[0] if kind == "rms_norm" else outs[1]
            xq = self._xq_for.get(normed)
            if kind == "rms_norm":
                w = W.vector(wname(ins[1]))
                if int(self.graph.tensors[ins[1]].shape[-1]) != int(self.graph.tensors[ins[0]].shape[-1]):
                    return lambda env, s, c: K.head_rms_norm(env[ins[0]], w, a["eps"], out=env[outs[0]])
                return lambda env, s, c: K.rms_norm(env[ins[0]], w, a["eps"], out=env[outs[0]],
                                                    xq=None if xq is None else self._xq_rows(xq, s))
            w = W.vector(wname(ins[2]))
            if op.name in self._sum_into_norm:  # the all_reduce before it, done here (_plan_collectives)
                partial, other, peers = self._sum_into_norm[op.name]
                return lambda env, s, c: K.rms_norm(env[partial], w, a["eps"], residual=env[other],
                                                    out=env[outs[1]], residual_out=env[outs[0]], peers=peers,
                                                    xq=None if xq is None else self._xq_rows(xq, s))
            return lambda env, s, c: K.rms_norm(env[ins[0]], w, a["eps"], residual=env[ins[1]],
                                                out=env[outs[1]], residual_out=env[outs[0]],
                                                xq=None if xq is None else self._xq_rows(xq, s))
        if op.name in self._rows_qkv:
            return self._lower_rows_qkv(op)
        if kind in ("linear", "linear_qkv", "linear_swiglu"):
            return self._lower_linear(op)
        if kind in ("all_reduce", "all_gather"):
            return self._lower_collective(op)
        if kind == "swiglu":
            return lambda env, s, c: K.silu_mul(env[ins[0]], env[ins[1]], out=env[outs[0]], act=a.get("act", "silu"))
        if kind in ("gelu", "scale", "softcap"):
            if kind == "gelu" and a.get("approximate", "none") != "tanh":  # the kernel is the tanh form
                return lambda env, s, c: env[outs[0]].copy_(
                    torch.nn.functional.gelu(env[ins[0]].float(), approximate="none"))
            param = a.get("factor", a.get("cap", 0.0))
            return lambda env, s, c: K.unary(env[ins[0]], kind, param, out=env[outs[0]])
        if kind == "rope_qkv_store":
            from ..cpu import rope_qkv_extras

            # ring caches (sliding-window layers), linear position scaling, long-RoPE's attention factor
            extra = dict(ring=bool(a.get("ring")), pos_scale=a.get("pos_scale", 1.0), mscale=a.get("mscale", 1.0))

            f_name, n_names = rope_qkv_extras(op, list(ins))
            freqs = W.vector(wname(f_name)) if f_name else None
            if n_names:  # per-head q/k RMSNorm, in place in the q|k|v tensor (read by nothing else)
                qn, kn = (W.vector(wname(n)) for n in n_names)
                nq, nkv = a["n_heads"] * a["head_dim"], a["n_kv_heads"] * a["head_dim"]

                def run_norm_rope(env, s, c):
                    qkv = env[ins[0]]
                    K.head_rms_norm(qkv[:, :nq], qn, a["qk_norm_eps"], out=qkv[:, :nq])
                    K.head_rms_norm(qkv[:, nq:nq + nkv], kn, a["qk_norm_eps"], out=qkv[:, nq:nq + nkv])
                    K.rope_qkv_cache(qkv, None, None, env[ins[2]], env[ins[3]], self.start, a["n_heads"],
                                     a["n_kv_heads"], a["head_dim"], theta=a["theta"], style=a["style"],
                                     freq_factors=freqs, n_rot=a.get("rope_dim", a["head_dim"]), q_out=env[outs[0]],
                                     **extra)
                return run_norm_rope
            return lambda env, s, c: K.rope_qkv_cache(
                env[ins[0]], None, None, env[ins[2]], env[ins[3]], self.start, a["n_heads"], a["n_kv_heads"],
                a["head_dim"], theta=a["theta"], style=a["style"], freq_factors=freqs,
                n_rot=a.get("rope_dim", a["head_dim"]), q_out=env[outs[0]], **extra)
        if kind == "attention":
            ws, caps = {}, {}
            G = a["n_heads"] // a["n_kv_heads"]
            window = int(a.get("window", 0))  # sliding window: the kernels read only the last `window` keys

            xq_all = self._xq_for.get(outs[0])  # the output projection's int8 copy, written here

            def run_attention(env, s, c):
                q, kc, vc, out = env[ins[0]], env[ins[1]], env[ins[2]], env[outs[0]]
                xq = None if xq_all is None else self._xq_rows(xq_all, s)
                if s <= 4:
                    if s not in caps:
                        caps[s] = K.default_decode_splits(q, a["n_kv_heads"], kc.shape[0], s, a["n_heads"])
                        self._split_cap = max(self._split_cap or 1, caps[s])
                    n = min(self._splits, caps[s])
                    if n == 1:  # the whole context in one program per KV head: no combine kernel
                        bm = min(64, max(16, 1 << (s * G - 1).bit_length()))
                        K.attention_prefill(q, kc, vc, self.start, a["n_heads"], a["n_kv_heads"], a["scale"],
                                            out=out, head_dim=a["head_dim"], window=window, xq=xq,
                                            config=dict(BLOCK_M=bm, BLOCK_N=K.configs.attn_decode_single_block_n(
                                                a["n_kv_heads"])))
                        return
                    if (s, n) not in ws:
                        ws[s, n] = K.decode_workspace(s, a["n_heads"], a["head_dim"], n, self.dev)
                    K.attention_decode(q, kc, vc, self.seq_len, a["n_heads"], a["n_kv_heads"], a["scale"], out=out,
                                       head_dim=a["head_dim"], window=window, workspace=ws[s, n],
                                       config=dict(n_splits=n), xq=xq)
                else:  # (a cache of the whole context c is no ring: no row is reused within it)
                    K.attention_prefill(q, kc, vc, self.start, a["n_heads"], a["n_kv_heads"], a["scale"], out=out,
                                        head_dim=a["head_dim"], window=window, xq=xq, ring=kc.shape[0] < c)
            return run_attention
        if kind in ("rope_rows", "kv_store_rows", "attention_rows"):
            return self._lower_rows(op)
        if kind == "last_row":  # the last real token's row (prefill may run padded, see run)
            return lambda env, s, c: K.take_rows(env[ins[0]], self.last_index, out=env[outs[0]])
        if kind in ("add", "mul"):
            fn = torch.add if kind == "add" else torch.mul
            return lambda env, s, c: fn(env[ins[0]], env[ins[1]], out=env[outs[0]])
        if kind == "silu":
            return lambda env, s, c: env[outs[0]].copy_(torch.nn.functional.silu(env[ins[0]]))
        if kind in ("rope", "rope_store", "kv_store"):
            # unfused forms (graphs compiled without fusion): torch ops on the device, position from the
            # host, so these programs are not captured in CUDA graphs (only fused decode programs are)
            n_fixed = {"rope": 2, "rope_store": 3, "kv_store": 3}[kind]
            freqs = W.vector(wname(ins[n_fixed])) if len(ins) > n_fixed else None

            def store(cache, start, s, x):
                if a.get("ring"):  # a sliding-window layer's ring: position p in row p mod rows
                    rows = torch.arange(start, start + s, device=cache.device) % cache.shape[0]
                    cache.index_copy_(0, rows, x)
                else:
                    cache[start:start + s].copy_(x)

            def run_unfused(env, s, c):
                start = int(self._host_start)
                if kind == "kv_store":
                    store(env[ins[0]], start, s, env[ins[1]])
                    return
                r = _rope(env[ins[0]].float(), start, freqs, a).to(torch.float16)
                if kind == "rope":
                    env[outs[0]].copy_(r)
                else:
                    store(env[ins[2]], start, s, r)
            self._host_positions = True
            return run_unfused
        raise GraphError(f"cuda: no kernel for op '{op.name}' ({kind})")

    def _lower_rows(self, op: Op) -> Callable:
        """The row-wise ops of a rows program: positions and slot bases come from the program's
        device tensors row_pos / row_base (set by run), so a captured graph replays any of them."""
        K, a = self.K, op.attrs
        ins, outs = op.inputs, op.outputs
        if op.kind == "rope_rows":
            if a.get("mscale", 1.0) != 1.0:
                raise GraphError(f"cuda: op '{op.name}' uses a long-RoPE attention factor, which the rope kernel lacks")
            rope = self._rows_rope_args(op)
            fused = self._rows_fused.get(op.name)
            if fused is None:
                return lambda env, s, c: K.rope_rows(env[ins[0]], self.row_pos, a["n_heads"], a["head_dim"],
                                                     out=env[outs[0]], **rope)
            rk, sk, sv = fused
            lin_q = self._rows_qkv_of.get(op.name)
            if lin_q is not None:  # q | k | v side by side in the stacked product's buffer
                buf = self._qkv_buffer(lin_q)
                return lambda env, s, c: K.rope_qkv_cache(
                    buf[:s], None, None, env[sk.inputs[0]], env[sv.inputs[0]], 0, a["n_heads"], rk.attrs["n_heads"],
                    a["head_dim"], q_out=env[outs[0]], positions=self.row_pos, bases=self.row_base, **rope)
            return lambda env, s, c: K.rope_qkv_cache(
                env[ins[0]], env[rk.inputs[0]], env[sv.inputs[1]], env[sk.inputs[0]], env[sv.inputs[0]], 0,
                a["n_heads"], rk.attrs["n_heads"], a["head_dim"], q_out=env[outs[0]], positions=self.row_pos,
                bases=self.row_base, **rope)
        if op.kind == "kv_store_rows":
            return lambda env, s, c: K.kv_store_rows(env[ins[0]], env[ins[1]], self.row_base, self.row_pos)
        ws: dict[tuple[int, int], tuple] = {}
        window = int(a.get("window", 0))
        rq_name = self._attn_rope.get(op.name)
        if rq_name is None:
            def operands(env, s):
                return env[ins[0]], env[ins[1]], env[ins[2]], {}
        else:  # RoPE and the K/V store in this kernel, from the q|k|v buffer (_plan_rows_fusions)
            rope = self._rows_rope_args(next(o for o in self.graph.ops if o.name == rq_name))
            _, sk, sv = self._rows_fused[rq_name]
            buf = self._qkv_buffer(self._rows_qkv_of[rq_name])
            nq, nkv = a["n_heads"] * a["head_dim"], a["n_kv_heads"] * a["head_dim"]

            def operands(env, s):
                qkv = buf[:s]
                return (qkv[:, :nq], env[sk.inputs[0]], env[sv.inputs[0]],
                        dict(rope, new_k=qkv[:, nq:nq + nkv], new_v=qkv[:, nq + nkv:]))

        K.prepare_attention_rows(self.dev, rope["n_rot"] if rq_name is not None else 0)

        def run_attention_rows(env, s, c):
            n = self._splits
            if n > 1 and (s, n) not in ws:
                ws[s, n] = K.decode_workspace(s, a["n_heads"], a["head_dim"], n, self.dev)
            q, kc, vc, extra = operands(env, s)
            K.attention_rows(q, kc, vc, self.row_pos, self.row_base, a["n_heads"], a["n_kv_heads"], a["scale"],
                             out=env[outs[0]], head_dim=a["head_dim"], window=window, n_splits=n,
                             workspace=ws.get((s, n)), **extra)
        return run_attention_rows

    def _rows_rope_args(self, rope_op: Op) -> dict:
        """A rope_rows op's rotation as the rope and attention kernels take it (keyword arguments)."""
        a, ins = rope_op.attrs, rope_op.inputs
        freqs = self.backend.weights.vector(self._wname(ins[2])) if len(ins) > 2 else None
        return dict(theta=a["theta"], style=a["style"], freq_factors=freqs, n_rot=a.get("rope_dim", a["head_dim"]),
                    pos_scale=a.get("pos_scale", 1.0))

    def _qkv_buffer(self, lin_q: str) -> torch.Tensor:
        """The q|k|v product of a rows layer: outside the arena (the memory plan knows three
        tensors, not this one), one buffer for all layers (each is read before the next is written)."""
        width = sum(int(self.graph.tensors[l.outputs[0]].shape[-1]) for l in self._rows_qkv[lin_q])
        return self.backend.shared_buffer(("qkv", self.max_seq, width), lambda: torch.empty(
            (self.max_seq, width), dtype=torch.float16, device=self.dev))

    def _lower_rows_qkv(self, op: Op) -> Callable:
        """The q, k and v projections of a rows layer as one product over their stacked weights."""
        K, W = self.K, self.backend.weights
        lins = self._rows_qkv[op.name]
        w = self._linear_weight(op, W)
        bias = W.vector(*(self._wname(l.inputs[2]) for l in lins)) if op.attrs.get("has_bias") else None
        i8 = self._linear_uses_int8(op, W)
        xq = self._xq_for.get(op.inputs[0]) if i8 else None
        buf = self._qkv_buffer(op.name)
        dmt = self.gemv_max
        skinny = self._tuned_skinny(w)
        return lambda env, s, c: K.linear(env[op.inputs[0]], w, bias=bias, out=buf[:s], act_int8=i8,
                                          decode_max_tokens=dmt, xq=None if xq is None else self._xq_rows(xq, s),
                                          config=skinny.get(s))

    def _lower_linear(self, op: Op) -> Callable:
        K, W, a = self.K, self.backend.weights, op.attrs
        ins, outs, kind = op.inputs, op.outputs, op.kind
        wname = self._wname
        w = self._linear_weight(op, W)
        i8 = self._linear_uses_int8(op, W)
        xq = self._xq_for.get(ins[0]) if i8 else None
        # tuned GEMV tiles are for the single-token program; a rows program's steps of more than
        # gemv_max rows take the skinny GEMM, tuned per row count (cfg_at: the config of a step of s rows)
        cfg = self._tuned_gemv(op, w, i8) if self.decode_stage and not self.rows_mode else None
        skinny = self._tuned_skinny(w, kind == "linear_swiglu")

        def cfg_at(s: int) -> dict | None:
            return skinny.get(s, cfg)
        dmt = self.gemv_max
        pf = op.name not in self._after_gemv
        if kind == "linear_swiglu":
            act = a.get("act", "silu")
            return lambda env, s, c: K.linear_silu_mul(env[ins[0]], w, out=env[outs[0]], act_int8=i8,
                                                       config=cfg_at(s), act=act,
                                                       xq=None if xq is None else self._xq_rows(xq, s),
                                                       decode_max_tokens=dmt, l2_prefetch=pf)
        if kind == "linear_qkv":
            bias = W.vector(*(wname(t) for t in ins[4:7])) if a.get("has_bias") else None
            rope_op = self._rope_into_gemv.get(op.name)
            if rope_op is None:
                return lambda env, s, c: K.linear(env[ins[0]], w, bias=bias, out=env[outs[0]], act_int8=i8,
                                                  config=cfg_at(s), xq=None if xq is None else self._xq_rows(xq, s),
                                                  decode_max_tokens=dmt, l2_prefetch=pf)
            ra = rope_op.attrs
            freqs = W.vector(wname(rope_op.inputs[4])) if len(rope_op.inputs) > 4 else None

            def run_qkv_rope(env, s, c):
                rope = K.RopeStore(env[rope_op.inputs[2]], env[rope_op.inputs[3]], self.start, ra["n_heads"],
                                   ra["n_kv_heads"], ra["head_dim"], theta=ra["theta"], style=ra["style"],
                                   freq_factors=freqs, n_rot=ra.get("rope_dim", ra["head_dim"]),
                                   q_out=env[rope_op.outputs[0]])
                K.linear(env[ins[0]], w, bias=bias, act_int8=i8, decode_max_tokens=dmt, config=cfg_at(s),
                         rope=rope, xq=None if xq is None else self._xq_rows(xq, s), l2_prefetch=pf)
            return run_qkv_rope
        bias = W.vector(wname(ins[2])) if a.get("has_bias") else None
        res = ins[-1] if a.get("has_residual") else None
        if op.name in self._norm_tail:
            norm, residual, counter = self._norm_tail[op.name]
            nw, eps = W.vector(wname(norm.inputs[2])), norm.attrs["eps"]
            s_name, n_name = norm.outputs
            nxq = self._xq_for.get(n_name)

            def run_linear_norm(env, s, c):
                tail = K.NormTail(env[residual], env[s_name], env[n_name], nw, eps, counter,
                                  None if nxq is None else self._xq_rows(nxq, s))
                K.linear(env[ins[0]], w, bias=bias, act_int8=i8, decode_max_tokens=dmt, config=cfg_at(s),
                         norm=tail, xq=None if xq is None else self._xq_rows(xq, s), l2_prefetch=pf)
            return run_linear_norm

        def run_linear(env, s, c):
            y = K.linear(env[ins[0]], w, bias=bias, out=env[outs[0]], act_int8=i8, decode_max_tokens=dmt,
                         config=cfg_at(s), xq=None if xq is None else self._xq_rows(xq, s), l2_prefetch=pf)
            if res is not None:
                K.add_into(y, env[res])
        return run_linear

    def _tuned_gemv(self, op: Op, w, i8: bool) -> dict | None:
        """The decode GEMV launch configuration for this weight's (format, shape, path), timed at
        first load and cached on disk (tuning.py); None = the default of configs.py."""
        job = self._gemv_tuning(op, w, i8)
        return None if job is None else self.backend.tuner.pick("gemv", *job)

    def _prepare_tuning(self) -> None:
        """Before lowering a decode stage: the candidates of every GEMV (a rows program: every
        skinny GEMM) the tuner has not seen yet compiled in one parallel batch (Tuner.prepare),
        rather than a batch per pick."""
        tuner = self.backend.tuner
        if tuner is None or not tuner.enabled or not self.decode_stage:
            return
        W = self.backend.weights
        jobs = []
        for op in self.graph.ops:
            if op.kind in ("linear", "linear_qkv", "linear_swiglu") and op.name not in self._absorbed \
                    and op.kind in self.backend.SUPPORTED_OPS:
                w = self._linear_weight(op, W)
                if self.rows_mode:
                    jobs.extend(self._skinny_tuning(w, op.kind == "linear_swiglu"))
                else:
                    job = self._gemv_tuning(op, w, self._linear_uses_int8(op, W))
                    if job is not None:
                        jobs.append(job)
        tuner.prepare(SKINNY_TUNE_KERNEL if self.rows_mode else "gemv", jobs)

    def _tuned_skinny(self, w, swiglu: bool = False) -> dict[int, dict]:
        """A rows program's product with this weight: per row bucket that runs the GEMM kernel, the
        skinny tile and split-K count timed at first load and cached on disk (tuning.py); {} with
        tuning off (configs.gemm_default then). swiglu: w is a fused gate|up weight."""
        return {job[0][3]: self.backend.tuner.pick(SKINNY_TUNE_KERNEL, *job)
                for job in self._skinny_tuning(w, swiglu)}

    def _skinny_tuning(self, w, swiglu: bool = False) -> list[tuple]:
        """(key, candidates, default, run) for Tuner.pick of each row bucket of this rows program
        that takes the skinny GEMM (more rows than gemv_max, at most SKINNY_M); [] with tuning off.
        One job per (format, shape, rows): the layers sharing a shape share it and its buffers.
        A gate|up weight whose product takes the activation in its epilogue (linear.skinny_glu) is
        timed in that form, the kernel that runs (key marked "glu")."""
        tuner = self.backend.tuner
        if not self.rows_mode or tuner is None or not tuner.enabled:
            return []
        from .kernels._common import device_sm_count

        K = self.K
        cf = K.configs
        N, Kd = w.out_features, w.in_features
        jobs = []
        for rows in sorted({self.row_bucket(n) for n in range(1, self.max_seq + 1)}):
            if rows <= self.gemv_max or rows > cf.SKINNY_M:
                continue
            glu = swiglu and K.linear_module.skinny_glu(rows)
            key = (w.fmt, N, Kd, rows) + (("glu",) if glu else ())
            if key not in self._skinny_jobs:
                x = torch.randn((rows, Kd), device=self.dev).to(torch.float16)
                out = torch.empty((rows, N // 2 if glu else N), dtype=torch.float16, device=self.dev)

                def run(cfg, w=w, x=x, out=out, glu=glu):
                    if glu:
                        K.linear_silu_mul(x, w, out=out, config=cfg, decode_max_tokens=0)
                    else:
                        K.linear(x, w, out=out, config=cfg, decode_max_tokens=0)
                sms = device_sm_count(x)
                self._skinny_jobs[key] = (key, cf.skinny_candidates(rows, N, Kd, sms),
                                          cf.gemm_default(rows, N, sms, Kd), run)
            jobs.append(self._skinny_jobs[key])
        return jobs

    def _gemv_tuning(self, op: Op, w, i8: bool) -> tuple | None:
        """(key, candidates, default, run) of this GEMV for Tuner.pick; None with tuning off, or for
        a weight under configs.GEMV_TUNE_MIN_BYTES (a launch-bound GEMV: the default tile)."""
        tuner = self.backend.tuner
        if tuner is None or not tuner.enabled or w.nbytes < self.K.configs.GEMV_TUNE_MIN_BYTES:
            return None
        K = self.K
        glu = op.kind == "linear_swiglu"
        n_out = w.out_features // 2 if glu else w.out_features
        key = (w.fmt, n_out, w.in_features, "i8" if i8 and w.fmt != "F16" else "float", "glu" if glu else "plain")
        cands = K.configs.gemv_tune_candidates(w.fmt, i8 and w.fmt != "F16", glu)
        default = K.configs.gemv_config(w.fmt, i8, glu, n_out * w.in_features, w.in_features)
        x = torch.randn((1, w.in_features), device=self.dev).to(torch.float16)
        out = torch.empty((1, n_out), dtype=torch.float16, device=self.dev)
        quantized: list = []  # x's int8 copy, made at the first timed run (a collection's is not kept)

        def xq():
            if not i8 or w.fmt == "F16":
                return None
            if _precompile.collecting():
                return K.quantize_activations(x)
            if not quantized:
                quantized.append(K.quantize_activations(x))
            return quantized[0]

        def run(cfg):
            if glu:
                K.linear_silu_mul(x, w, out=out, act_int8=i8, xq=xq(), config=cfg)
            else:
                K.linear(x, w, out=out, act_int8=i8, xq=xq(), config=cfg)
        return key, cands, default, run

    def _plan_collectives(self) -> dict:
        """A tensor-parallel rank's collectives (edgellm/backends/cuda/collective.py), op name ->
        the one-shot form where it runs, its input written by its producer straight into the
        symmetric buffer (kept out of the arena):
        - the all_reduces of the layers (two a layer), sharing two alternating buffers; where the
          sum's only reader is a residual add + RMSNorm, the norm kernel reads every rank's partial
          and sums them itself, after its own barrier (kernels/norm.py, Peers): the all_reduce
          costs no launch (EDGELLM_ALL_REDUCE_FUSE=0 keeps it apart);
        - the gather of a one-row step's logits: each rank's head writes its share of the vocabulary
          into its block of a zeroed buffer as wide as the vocabulary, and the one-shot sum of the
          ranks' buffers is every block in place (x + 0 is exact).
        Ops without one fall back to torch.distributed (see _lower_collective)."""
        import torch.distributed as dist

        ars = [op for op in self.graph.ops if op.kind == "all_reduce"]
        gathers = [op for op in self.graph.ops if op.kind == "all_gather"]
        if not ars and not gathers:
            return {}
        if not (dist.is_available() and dist.is_initialized()):
            op = (ars or gathers)[0]
            raise GraphError(f"cuda: op '{op.name}' ({op.kind}) needs torch.distributed initialised "
                             "(a tensor-parallel rank: edgellm.hetero.distributed.load_rank)")
        from .collective import one_shot

        readers: dict[str, list[Op]] = {}
        for op in self.graph.ops:
            for t in op.inputs:
                readers.setdefault(t, []).append(op)

        def alone(op):  # the input is read by this op only, and is no output of the program
            return len(readers.get(op.inputs[0], ())) == 1 and op.inputs[0] not in self.graph.outputs

        def width(op):
            return int(self.graph.tensors[op.inputs[0]].concrete_shape(seq=1, ctx=1)[-1])

        shots = {}
        # a buffer is written again two all_reduces later: each input must be read by its op alone
        if ars and len({width(op) for op in ars}) == 1 and all(alone(op) for op in ars):
            shot = one_shot(self.dev, self.max_seq, width(ars[0]), len(ars))
            if shot is not None:
                for k, op in enumerate(ars):
                    self._own_buffers[op.inputs[0]] = shot.buffer(k)
                    shots[op.name] = shot
                self._plan_sums_into_norms(ars, shot, readers)
        for op in gathers:
            rows = self.graph.tensors[op.inputs[0]].concrete_shape(seq=self.max_seq, ctx=1)[0]
            if rows != 1 or not alone(op):  # several rows: the share is no contiguous block
                continue
            n, world = width(op), int(op.attrs["world"])
            shot = one_shot(self.dev, 1, n * world, 1)
            if shot is not None:
                whole = shot.buffer(0)
                whole.zero_()
                rank = dist.get_rank()
                self._own_buffers[op.inputs[0]] = whole[:, rank * n:(rank + 1) * n]
                shots[op.name] = shot
        return shots

    def _plan_sums_into_norms(self, ars: list[Op], shot, readers: dict[str, list[Op]]) -> None:
        """Which all_reduces the residual add + RMSNorm after them does (see _plan_collectives):
        those whose sum that norm alone reads, where every program the norm may launch has a
        barrier slot in the buffer's signal pad. readers: tensor -> the ops that read it."""
        if os.environ.get("EDGELLM_ALL_REDUCE_FUSE", "1") == "0" or "add_rms_norm" not in self.backend.SUPPORTED_OPS:
            return
        from .kernels.norm import norm_programs

        for k, op in enumerate(ars):
            rd = readers.get(op.outputs[0], [])
            if len(rd) != 1 or rd[0].kind != "add_rms_norm" or rd[0].name in self._absorbed \
                    or op.outputs[0] in self.graph.outputs or rd[0].inputs[0] == rd[0].inputs[1]:
                continue
            norm, peers = rd[0], shot.peers(k)
            if peers is None or norm_programs(self.max_seq, int(self.graph.tensors[op.inputs[0]].shape[-1])) > peers.slots:
                continue
            other = norm.inputs[1] if norm.inputs[0] == op.outputs[0] else norm.inputs[0]
            self._sum_into_norm[norm.name] = (op.inputs[0], other, peers)
            self._absorbed.add(op.name)

    def _lower_collective(self, op: Op) -> Callable:
        """A tensor-parallel rank's collective (float32: the residual stream's precision, and the
        logits'), inside the step's CUDA graph like any kernel: the one-shot form reading every
        rank's symmetric buffer (see _plan_collectives), or torch.distributed's (NCCL; gloo on the
        interpreter's CPU tensors; the first, uncaptured run of each shape creates the
        communicator): all_reduce on a copy in the output's buffer; all_gather as the all_reduce
        of the output with this rank's block in place and zeros elsewhere (exact; NCCL's own
        all_gather captured in the graphs left the ranks hanging in destroy_process_group on the
        H200 pair, 2026-11-26, where its all_reduce did not)."""
        import torch.distributed as dist

        src, dst = op.inputs[0], op.outputs[0]
        shot = self._shots.get(op.name)
        if shot is not None:
            if op.kind == "all_gather":
                whole = shot.buffer(0)
                return lambda env, s, c: shot(whole, env[dst])
            return lambda env, s, c: shot(env[src], env[dst])
        if op.kind == "all_gather":
            rank = dist.get_rank()

            def run_all_gather(env, s, c):
                x, out = env[src], env[dst]
                n = x.shape[1]
                out.zero_()
                out[:, rank * n:(rank + 1) * n].copy_(x)
                dist.all_reduce(out)
            return run_all_gather

        def run_all_reduce(env, s, c):
            out = env[dst]
            out.copy_(env[src])
            dist.all_reduce(out)
        return run_all_reduce

    def _delegate_to_cpu(self, op: Op) -> Callable:
        """An op this backend does not support runs on the cpu backend's reference kernel: its
        activations are copied to the host (float32) and the results back (the transfers the
        partitioner counts). Only ops without state: a KV-cache write must stay on the device.
        Such a program is not captured in a CUDA graph."""
        from ..cpu import CPU_KERNELS

        if any(self.graph.tensors[o].alias_of for o in op.outputs):
            raise GraphError(f"cuda: op '{op.name}' ({op.kind}) writes state and cannot be delegated to the cpu")
        fn = CPU_KERNELS[op.kind]
        self._host_positions = True
        self.delegated.append(op.name)

        def run_on_cpu(env, s, c):
            args = []
            for t in op.inputs:
                kind = self.graph.tensors[t].kind
                if t == "start_pos":
                    args.append(self._host_start)
                elif t == "tokens":
                    args.append(self.tokens[:s].cpu())
                elif kind == "weight":
                    args.append(self.backend.cpu_weights().get(self.graph.tensors[t].source or t))
                else:
                    args.append(env[t].float().cpu())
            result = fn(op, args)
            for name, value in zip(op.outputs, (result,) if len(op.outputs) == 1 else result):
                env[name].copy_(value.to(env[name].dtype))
        return run_on_cpu

    # -- execution ----------------------------------------------------------------------------
    def _env(self, seq: int, ctx: int) -> dict:
        env: dict[str, torch.Tensor] = dict(self.states)
        for n, buf in self._float_inputs.items():
            env[n] = buf[:seq]
        for op in self.graph.ops:
            for o in op.outputs:
                t = self.graph.tensors[o]
                if t.alias_of is not None:
                    env[o] = self.states[t.alias_of]
                elif o not in self._aliases:
                    env[o] = self._buffer(o, seq, ctx)
        for o, src in self._aliases.items():
            env[o] = env[src]
        return env

    def _launch_all(self, env: dict, seq: int, ctx: int) -> None:
        for launch in self._launches:
            launch(env, seq, ctx)

    def draws_on_device(self, params) -> bool:  # loop_tokens draws any sampled generation
        return device_sampling_enabled()

    def loop_tokens(self, first_token: int, start: int, n: int, draw=None, stop=()) -> "Iterator[int]":
        """Decode on the device: each step's token (the argmax, or drawn as `draw`, an
        edgellm.sampling.DeviceDraw, says) feeds the next step inside one CUDA graph replay (token,
        position and length updated on the device), so a token costs one replay and one 8-byte
        read. Yields n tokens after first_token at position start (stop: the caller's end tokens,
        which a loop that runs no step ahead of the caller does not need)."""
        if self.max_seq != 1:
            raise GraphError("loop_tokens runs on the single-token decode program")
        ctx = max(t.shape[0] for t in self.states.values())  # the context (ring caches are shorter)
        if start + n > ctx:
            raise GraphError(f"{start + n} tokens exceed the context of {ctx}")
        self.run({"tokens": [first_token], "start_pos": start})  # the first token's own step (the decode program)
        self._host_start = start
        self.tokens[:1].fill_(first_token)
        self.start.fill_(start)
        self.seq_len.fill_(start + 1)
        chooser = self._loop_chooser(draw, ctx)

        def choose(env):  # the token into _next and the loop's inputs for the next step
            chooser(env["logits"], self.start, out=self._next, step=(self.tokens[:1], self.start, self.seq_len))
        if self.dev.type != "cuda" or self._host_positions or _precompile.collecting():  # (no capture while collecting)
            for i in range(n):
                self._set_context(start + 1 + i)
                env = self._env(1, ctx)
                self._launch_all(env, 1, ctx)
                choose(env)
                yield int(self._next[0])
                self._host_start += 1
            return
        for i in range(n):
            bucket = self._set_context(start + 1 + i)
            key = (bucket, chooser.plan)
            g = self._loop_graphs.get(key)
            if g is None:
                # this bucket's step captured (see _EAGER_BEFORE_CAPTURE), then replayed below:
                # the replay is the step (same token, same cache row as any eager run before it)
                t0 = time.perf_counter()
                if _precompile.has_compiled() and self.dev.type == "cuda":
                    # a first run on this device: the step's kernels (a new token choice's) compiled
                    # side by side first, rather than one by one inside the capture
                    _precompile.precompile(lambda: (self._launch_all(self._loop_env, 1, ctx), choose(self._loop_env)),
                                           device=self.dev)
                if self._eager_first:
                    self._launch_all(self._loop_env, 1, ctx)
                g = torch.cuda.CUDAGraph()
                with captured(g):
                    self._launch_all(self._loop_env, 1, ctx)
                    choose(self._loop_env)
                torch.cuda.synchronize(self.dev)
                self.one_time_s += time.perf_counter() - t0
                self._loop_graphs[key] = g
            g.replay()
            yield int(self._next.item())

    def _loop_chooser(self, draw, ctx: int) -> DeviceChooser:
        """The decode loop's buffers (made once) and a chooser for `draw` writing its parameters there."""
        if not hasattr(self, "_loop_graphs"):
            self._loop_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
            self._loop_env = self._env(1, ctx)
            self._next = torch.zeros(1, dtype=torch.int64, device=self.dev)
            self._loop_draw = DeviceChooser.buffers(1, self.dev)  # the parameters the captured graphs read
        return DeviceChooser(self.K, [draw], self.dev, self._loop_env["logits"].shape[-1], into=self._loop_draw)

    # -- start-up images (replay_record.py records, replay.py replays without torch) -----------
    def replay_meta(self) -> dict:
        """The host-side rules of this program's steps that a replay recomputes: prefill padding
        (_padded) and context buckets (_context_splits)."""
        ctx = max(t.shape[0] for t in self.states.values())
        return {"max_seq": self.max_seq, "pad": self.prefill_pad, "ctx": ctx, "cap": self._split_cap,
                "per": self.K.configs.ATTN_DECODE_KEYS_PER_SPLIT, "vocab": int(self._buffer("logits", 1, ctx).shape[-1])}

    def capture_for_replay(self, padded: int, bucket: int, loop_draw=False):
        """(graph, io) for a start-up image: one step captured into a CUDA graph that is kept for
        reading back (torch's keep_graph) and never run, so the caches are not touched. A step of
        `padded` tokens in context bucket `bucket` (run's graph for that key); with loop_draw
        (None for the argmax, or a DeviceDraw), the decode loop's step with its token choice
        instead (loop_tokens' graph). io: the device tensors the host writes or reads."""
        ctx = max(t.shape[0] for t in self.states.values())
        saved = self._splits
        self._splits = bucket
        try:
            io = {"tokens": self.tokens, "start": self.start, "seq_len": self.seq_len}
            g = torch.cuda.CUDAGraph(keep_graph=True)
            if loop_draw is False:
                env = self._graph_envs.get(padded)
                if env is None:
                    env = self._graph_envs[padded] = self._env(padded, ctx)
                io.update(last_index=self.last_index, logits=env["logits"])
                with captured(g):
                    self._launch_all(env, padded, ctx)
            else:
                chooser = self._loop_chooser(loop_draw, ctx)
                torch.cuda.synchronize(self.dev)  # its parameters' copies are done before the capture
                io.update(next=self._next, **{f"draw.{k}": v for k, v in self._loop_draw.items()})
                with captured(g):
                    self._launch_all(self._loop_env, 1, ctx)
                    chooser(self._loop_env["logits"], self.start, out=self._next,
                            step=(self.tokens[:1], self.start, self.seq_len))
        finally:
            self._splits = saved
        return g, io

    def _padded(self, seq: int, start: int, ctx: int) -> int:
        """The token count a prefill step runs with: seq rounded up to prefill_pad (within the
        program's size and the context). Padding rows hold token 0; their K/V rows land past the
        real tokens, where causal attention never reads them before they are overwritten."""
        if not self.prefill_pad or seq <= 1:
            return seq
        padded = min(-(-seq // self.prefill_pad) * self.prefill_pad, self.max_seq)
        return padded if start + padded <= ctx else seq

    def _execute(self, key: tuple, padded: int, ctx: int) -> dict:
        """Run every op for `padded` rows; on a GPU a key's (rows or tokens, context bucket) first
        step is captured into a CUDA graph, and every step replays it. Returns the environment of
        buffers."""
        if self.use_cuda_graph and not _precompile.collecting():
            env = self._graph_envs.get(padded)
            if env is None:
                env = self._graph_envs[padded] = self._env(padded, ctx)
            g = self._graphs.get(key)
            if g is None:
                # a shape's first step: captured (its kernels compiled or read from Triton's cache
                # and loaded during the capture, see _EAGER_BEFORE_CAPTURE); the replay below is the
                # step itself. An eager run before it is harmless: the same KV rows get the same values.
                t0 = time.perf_counter()
                if self._eager_first:
                    self._launch_all(env, padded, ctx)
                g = torch.cuda.CUDAGraph()
                with captured(g):
                    self._launch_all(env, padded, ctx)
                torch.cuda.synchronize(self.dev)
                self.one_time_s += time.perf_counter() - t0
                self._graphs[key] = g
                if len(self._graphs) > MAX_GRAPHS:  # the least recently used one goes, with its memory
                    del self._graphs[next(iter(self._graphs))]
            self._graphs.move_to_end(key)
            g.replay()
        else:
            env = self._env(padded, ctx)
            self._launch_all(env, padded, ctx)
        return env

    def run(self, inputs: dict[str, object]) -> dict[str, torch.Tensor]:
        """One step over the given tokens at start_pos. On a GPU each shape (decode: context bucket;
        prefill: padded token count) is captured into a CUDA graph at its first step, and that step
        and later ones replay it.
        The returned tensors are the program's own buffers, valid until its next run."""
        if self.rows_mode:
            return self._run_rows(inputs)
        ids = self._token_ids(inputs["tokens"])
        seq, start = len(ids), int(inputs["start_pos"])
        if seq > self.max_seq:
            raise GraphError(f"cuda program '{self.graph.name}' was compiled for {self.max_seq} tokens, got {seq}")
        ctx = max(t.shape[0] for t in self.states.values())  # the context (ring caches are shorter)
        padded = self._padded(seq, start, ctx)
        self._host_start = start
        self.tokens[:seq].copy_(ids if isinstance(ids, torch.Tensor) else torch.from_numpy(ids), non_blocking=True)
        if padded > seq:
            self.tokens[seq:padded].zero_()
        for n, buf in self._float_inputs.items():
            buf[:seq].copy_(inputs[n].to(self.dev, non_blocking=True))
            if padded > seq:
                buf[seq:padded].zero_()
        self.last_index.fill_(seq - 1)
        self.start.fill_(start)
        self.seq_len.fill_(start + padded)
        env = self._execute((padded, self._set_context(start + padded)), padded, ctx)
        return self._outputs(env, seq, ctx)

    def _token_ids(self, tokens) -> "np.ndarray | torch.Tensor":
        """A step's token ids: host values as an int32 array, or a 1-D integer tensor already on this
        program's device (a chained decode step fed the previous step's argmax, which the host
        never reads: copied on the device, unchecked)."""
        if not isinstance(tokens, torch.Tensor):
            return np.asarray(tokens, dtype=np.int32).reshape(-1)
        if tokens.device.type != self.dev.type or tokens.dim() != 1 or tokens.is_floating_point():
            raise GraphError(f"cuda program '{self.graph.name}': device tokens must be a 1-D integer tensor on "
                             f"{self.dev}, got {tuple(tokens.shape)} {tokens.dtype} on {tokens.device}")
        return tokens

    def _outputs(self, env: dict, seq: int, ctx: int) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.graph.outputs:
            t = env[name]
            rows = self._shape_fn[name]({"seq": seq, "ctx": ctx})[0] if name in self._shape_fn else t.shape[0]
            out[name] = t[:rows] if t.shape[0] != rows else t
        return out

    def row_bucket(self, n: int) -> int:
        """The row count a rows step of n sequences runs with: the next power of two (within the
        program's size), so that a CUDA graph per bucket serves every count."""
        return min(1 << max(0, n - 1).bit_length(), self.max_seq)

    def _run_rows(self, inputs: dict[str, object]) -> dict[str, torch.Tensor]:
        """One decode step of several sequences (rows program): tokens, pos and base per row. The
        step runs padded to row_bucket(rows); padding rows have position -1, which the row-wise
        kernels treat as 'no sequence' (no KV write, attention output 0), and their logits are
        dropped. Attention splits follow the longest row (a graph per (bucket, splits))."""
        ids = self._token_ids(inputs["tokens"])
        pos = np.asarray(inputs["pos"], dtype=np.int32).reshape(-1)
        base = np.asarray(inputs["base"], dtype=np.int32).reshape(-1)
        seq = len(ids)
        if not seq or pos.size != seq or base.size != seq:
            raise GraphError(f"cuda program '{self.graph.name}': a rows step needs one token, position and base "
                             f"per row, got {seq}, {pos.size}, {base.size}")
        if seq > self.max_seq:
            raise GraphError(f"cuda program '{self.graph.name}' was compiled for {self.max_seq} rows, got {seq}")
        ctx = next(iter(self.states.values())).shape[0]
        if (pos < 0).any() or (base < 0).any() or (base + pos >= ctx).any():
            raise GraphError(f"cuda program '{self.graph.name}': rows base+pos {(base + pos).tolist()} outside "
                             f"the cache's {ctx} rows")
        padded = self.row_bucket(seq)
        pad = padded - seq
        fed = isinstance(ids, torch.Tensor)  # tokens on the device: copied there after the host's zeros
        host = np.concatenate([np.zeros(seq, np.int32) if fed else ids, np.zeros(pad, np.int32),
                               pos, np.full(pad, -1, np.int32), base, np.zeros(pad, np.int32)])
        dev = torch.from_numpy(host).to(self.dev, non_blocking=True)
        self.tokens[:padded].copy_(dev[:padded])
        if fed:
            self.tokens[:seq].copy_(ids)
        self.row_pos[:padded].copy_(dev[padded:2 * padded])
        self.row_base[:padded].copy_(dev[2 * padded:])
        self._splits = self._row_splits(padded, int(pos.max()) + 1)
        env = self._execute((padded, self._splits), padded, ctx)
        return self._outputs(env, seq, ctx)

    def _row_splits(self, rows: int, max_keys: int) -> int:
        hkv = next((int(op.attrs["n_kv_heads"]) for op in self.graph.ops if op.kind == "attention_rows"), 1)
        return self.K.rows_splits(self.tokens, rows, hkv, max_keys)


class CudaBackend(CudaInfo):
    prefetch = staticmethod(prefetch)

    def __init__(self, f: GGUFFile):
        _wait_prefetch()
        self.device = _device()
        self.K = _kernels()
        self._choosers: OrderedDict[tuple, DeviceChooser] = OrderedDict()  # choose's, per set of draws
        self.K.linear_module._shift_table(self.device)  # made before any capture needs it
        # programmatic dependent launch (Hopper): each kernel starts while its predecessor drains
        self.K.set_pdl(self.device.type == "cuda" and os.environ.get("EDGELLM_PDL", "1") != "0"
                       and torch.cuda.get_device_capability(self.device)[0] >= 9)
        # and under PDL, the decode GEMVs ask L2 for their first weights before they wait (MB a launch)
        mb = os.environ.get("EDGELLM_L2_PREFETCH_MB", "4")
        try:
            self.K.set_l2_prefetch(float(mb) * (1 << 20))
        except ValueError:
            raise ValueError(f"EDGELLM_L2_PREFETCH_MB={mb!r}: expected a number of megabytes (0 turns it off)") from None
        self.file = f
        self.weights = CudaWeights(f, self.device)
        self._arena: torch.Tensor | None = None
        self._shared: dict[tuple, object] = {}
        self.tuner = self._make_tuner()

    def _make_tuner(self):
        """Decode GEMV launch configurations are timed on this device at the first load of each
        (format, shape) and cached on disk per device, Triton and edgellm version (tuning.py);
        EDGELLM_TUNE=0 keeps the defaults of configs.py. The timer replays CUDA graphs of launches
        with the L2 flushed between them, as a decode step meets its weights."""
        if self.device.type != "cuda":
            return None
        from ... import __version__
        from .tuning import Tuner
        import triton

        major, minor = torch.cuda.get_device_capability(self.device)
        name = (f"{torch.cuda.get_device_name(self.device)}|sm{major}{minor}|triton-{triton.__version__}"
                f"|edgellm-{__version__}")
        tuner = Tuner(name)
        tuner.precompile = self.precompile
        return tuner

    def precompile(self, launch: Callable[[], object]) -> "_precompile.Report | None":
        """Compile every Triton kernel that launch() would launch, in parallel, before it runs for
        real (precompile.py; EDGELLM_COMPILE_THREADS); None where nothing compiles ahead (the
        interpreter, a pool of one). A kernel that does not compile is left to its launch, which
        raises as before."""
        if self.device.type != "cuda":
            return None
        report = _precompile.precompile(launch, device=self.device)
        if report is not None and report.failed and not report.kernels:  # something systematic: say so
            import warnings

            warnings.warn(f"cuda: no kernel compiled ahead ({len(report.failed)} failed; they compile at their "
                          f"first launch): {report.failed[0][:300]}", RuntimeWarning, stacklevel=2)
        return report

    def expect_compiles(self, vocab: int | None = None, draw=None) -> None:
        """The load compiles its programs (the program cache missed), so kernels compile too: the
        compile workers start now, beside the graph compile (precompile.start_pool). Given the
        vocabulary, the decode loop's token choice (the argmax, or `draw`, an
        edgellm.sampling.DeviceDraw) is sent to them at once (precompile.ahead): its kernels
        depend on the vocabulary alone, and sampling's are a load's slowest to compile (the
        ranked prefix's top-k, ~2.5 s on the H200's host), so they compile beside the graph
        compile and the tuner rather than in the warm-up's batch."""
        if self.device.type != "cuda":
            return
        _precompile.start_pool()
        if vocab:
            if draw is not None and not device_sampling_enabled():  # the loop takes the argmax only
                draw = None
            chooser = DeviceChooser(self.K, [draw], self.device, int(vocab))
            logits = torch.empty((1, int(vocab)), dtype=torch.float32, device=self.device)
            # the loop's own buffers' kinds (CudaProgram: tokens, start, seq_len int32; the token int64)
            tokens, start, seq_len = (torch.zeros(1, dtype=torch.int32, device=self.device) for _ in range(3))
            nxt = torch.zeros(1, dtype=torch.int64, device=self.device)
            _precompile.ahead(lambda: chooser(logits, start, out=nxt, step=(tokens, start, seq_len)))

    def compiles_done(self) -> None:
        """The load's warm-up is over: the compile workers go once idle for a while (the first
        request's new steps may still compile; a later compile starts them again)."""
        if self.device.type == "cuda":
            _precompile.stop_pool_when_idle()

    @staticmethod
    def available() -> bool:
        try:
            _device()
            _kernels()
            return True
        except BackendUnavailableError:
            return False

    def warmup_sizes(self, programs: dict, ctx: int, full: bool) -> list[tuple[str, int, int]]:
        """(program, tokens, start position) steps that meet every first-run shape of a short
        prompt (one padded prefill size, the first decode bucket), or with full of every prompt
        (each padded prefill size of both prefill programs, each decode context bucket)."""
        if self.device.type != "cuda":
            return []  # the interpreter compiles nothing
        chunk = programs["last"].max_seq
        pad = PREFILL_PAD
        steps = [("last", min(pad, chunk, ctx - 1), 0), ("decode", 1, 0)]
        if full:
            steps += [(stage, n, 0) for stage in ("last", "all") for n in range(pad, min(chunk, ctx - 1) + 1, pad)]
            per = self.K.configs.ATTN_DECODE_KEYS_PER_SPLIT
            steps += [("decode", 1, start) for start in range(per, ctx, per)]
        return steps

    def cpu_weights(self):
        """Float32 host copies of weights, for ops delegated to the cpu backend's kernels."""
        if getattr(self, "_cpu_weights", None) is None:
            from ..cpu import CpuWeights

            self._cpu_weights = CpuWeights(self.file)
        return self._cpu_weights

    def shared_buffer(self, key: tuple, make: Callable[[], object]):
        """A buffer outside the arena, made once per key and shared by every program (programs
        never run at the same time)."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def arena(self, nbytes: int) -> torch.Tensor:
        """One byte arena shared by every program (programs never run at the same time)."""
        nbytes = max(nbytes, 256)
        if self._arena is None or self._arena.numel() < nbytes:
            self._arena = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._arena

    def allocate_states(self, graph: Graph, ctx: int) -> dict[str, torch.Tensor]:
        kv = 2 * sum(t.numel(ctx=ctx) for t in graph.states())  # fp16, the graph's own caches (rings included)
        need = self.resident_weight_bytes(self.file) + kv
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            if need > free:
                raise DeviceMemoryError(
                    f"{self.file.path.name} needs about {need / 2**30:.2f} GiB of GPU memory at context {ctx} "
                    f"(weights {self.resident_weight_bytes(self.file) / 2**30:.2f} GiB + KV cache "
                    f"{kv / 2**30:.2f} GiB) but only {free / 2**30:.2f} of "
                    f"{total / 2**30:.2f} GiB are free; lower --ctx or use a smaller quantization")
        return {t.name: torch.zeros(t.concrete_shape(ctx=ctx), dtype=torch.float16, device=self.device)
                for t in graph.states()}

    def compile(self, graph: Graph, states: dict[str, torch.Tensor], plan=None, max_seq: int | None = None):
        try:
            return CudaProgram(self, graph, states, plan, max_seq or 512)
        except torch.cuda.OutOfMemoryError as e:
            free, total = torch.cuda.mem_get_info(self.device)
            raise DeviceMemoryError(f"out of GPU memory converting {self.file.path.name}'s weights "
                                    f"({free / 2**30:.2f} of {total / 2**30:.2f} GiB free): {e}") from None
        finally:
            self.weights.done_loading()  # the weights this program needs are on the device by now

    @staticmethod
    def to_numpy(t: torch.Tensor) -> np.ndarray:
        return t.detach().to(torch.float32).cpu().numpy()

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """First index of each row's maximum, on the device: the two-stage Triton reduction that the
        greedy decode loop runs (torch's argmax took 27-34 us over a 128k vocabulary on the H100,
        docs/results/h100-2026-11-26b/rows_1b_Q4_0_before.txt), so a served greedy step picks exactly
        `edgellm run`'s token."""
        return self.K.argmax(logits)

    @property
    def samples_on_device(self) -> bool:  # choose draws sampled rows
        return device_sampling_enabled()

    def choose(self, logits: torch.Tensor, draws: list, positions: list[int]) -> torch.Tensor:
        """Each row's next token on the device (int64 [rows]): the argmax where draws[i] is None,
        else drawn as the edgellm.sampling.DeviceDraw says, keyed by positions[i] (the position of
        the token the row fed). Only token ids then leave the device."""
        if all(d is None or d.params.greedy for d in draws):
            return self.K.argmax(logits)
        # the rows' parameters stay on the device while the same sequences run (a chooser per set of
        # draws, the last few kept): a step then uploads its positions only, without waiting for the GPU
        key = tuple(draws)
        chooser = self._choosers.pop(key, None) or DeviceChooser(self.K, draws, self.device, logits.shape[-1])
        self._choosers[key] = chooser
        while len(self._choosers) > 16:
            self._choosers.pop(next(iter(self._choosers)))
        pos = _pinned(torch.tensor(positions, dtype=torch.int64), self.device).to(self.device, non_blocking=True)
        return chooser(logits, pos)

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "Triton interpreter (CPU)"
        return f"cuda ({name}, Triton kernels, fp16 activations)"
