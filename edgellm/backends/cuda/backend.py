"""The cuda backend: executes a compiled Graph with the Triton kernel templates in ./kernels.

- Weights are repacked once at load into the layout each kernel reads (kernels/packing.py);
  formats without a kernel layout (K-quants, Q5_*) are dequantized and stored as Q8_0.
  Projections that a fused op reads together (q|k|v, gate|up) are concatenated at load.
- Activations are fp16 views into one arena laid out by the compile step's memory plan; the
  KV cache is fp16, one preallocated tensor per layer and K/V, written in place.
- Stage-aware: prefill programs take any number of tokens (tensor-core kernels, causal flash
  attention); the single-token decode program (matrix-vector kernels, split-context attention)
  is captured once in a CUDA graph whose position and length live in device tensors, so a
  token costs one graph replay and no allocation.

EDGELLM_CUDA_DEVICE=cpu with TRITON_INTERPRET=1 runs the same kernels in Triton's interpreter
on CPU tensors (slow; for tests on machines without a GPU).
"""

from __future__ import annotations

import math
import os
from typing import Callable, Iterator

import numpy as np
import torch

from ...errors import BackendUnavailableError, EdgeLLMError, GraphError
from ...gguf_file import GGUFFile
from ...graph.ir import CTX, SEQ, Graph, Op
from ..cpu import _rope, plan_offsets
from ..info import CudaInfo


class DeviceMemoryError(EdgeLLMError):
    """The model does not fit in the GPU's memory."""


def _device() -> torch.device:
    want = os.environ.get("EDGELLM_CUDA_DEVICE")
    if want:
        return torch.device(want)
    if not torch.cuda.is_available():
        raise BackendUnavailableError("the cuda backend needs an NVIDIA GPU with CUDA; none is visible to torch "
                                      f"(torch {torch.__version__}); use --backend cpu")
    return torch.device("cuda")


def _kernels():
    try:
        from . import kernels
    except ImportError as e:  # triton missing
        raise BackendUnavailableError(f"the cuda backend needs triton: {e}") from None
    return kernels


class CudaWeights:
    """Weights on the device in kernel layouts, converted on first use and shared by all programs."""

    def __init__(self, f: GGUFFile, device: torch.device):
        self.file, self.device = f, device
        self.K = _kernels()
        self._packed: dict[tuple[str, ...], object] = {}
        self._vectors: dict[tuple[str, ...], torch.Tensor] = {}

    def packed(self, *names: str):
        """One PackedWeight for these tensors stacked along the output axis."""
        w = self._packed.get(names)
        if w is None:
            # parts of a stacked weight are not kept: the device holds each weight once
            parts = [self._packed.get((n,)) or self._pack_one(n) for n in names]
            if len({p.fmt for p in parts}) > 1:  # mixed formats: stack as F16
                parts = [self.K.pack_float(self.K.dequantize(p, torch.float32), "F16") for p in parts]
            w = parts[0] if len(parts) == 1 else self.K.concat_packed(parts)
            self._packed[names] = w
        return w

    def _pack_one(self, name: str):
        t = self.file.tensors[name]
        if self.K.can_repack(t.type_name):
            w = self.K.repack(np.ascontiguousarray(t.data), t.type_name, t.shape, device=self.device)
        else:
            from ...quant import dequantize

            dense = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.type_name, t.shape), dtype=np.float32))
            w = self.K.pack_float(dense.to(self.device), "Q8_0")
        return w

    def vector(self, *names: str) -> torch.Tensor:
        """1-D tensors (norm weights, biases, rope factors) as fp32 on the device, concatenated."""
        v = self._vectors.get(names)
        if v is None:
            from ...quant import dequantize

            parts = [np.asarray(dequantize(self.file.tensors[n].data, self.file.tensors[n].type_name,
                                           self.file.tensors[n].shape), dtype=np.float32).reshape(-1) for n in names]
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
        self._shape_fn = {n: _shape_fn(graph, n) for n in graph.tensors if graph.tensors[n].kind == "activation"}
        # static device inputs: tokens, start position, tokens in the cache after this step
        self.tokens = torch.zeros(max_seq, dtype=torch.int32, device=self.dev)
        self.start = torch.zeros(1, dtype=torch.int32, device=self.dev)
        self.seq_len = torch.zeros(1, dtype=torch.int32, device=self.dev)
        self._host_positions = False
        self.delegated: list[str] = []
        self._launches: list[Callable[[dict, int, int], None]] = [self._lower(op) for op in graph.ops]
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_env: dict | None = None
        self.use_cuda_graph = (max_seq == 1 and self.dev.type == "cuda" and not self._host_positions
                               and os.environ.get("EDGELLM_CUDA_GRAPHS", "1") != "0")
        self._warm = False

    # -- buffers ------------------------------------------------------------------------------
    def _buffer(self, name: str, seq: int, ctx: int) -> torch.Tensor:
        t = self.graph.tensors[name]
        shape = [int(d) for d in self._shape_fn[name](seq, ctx)]
        dtype = torch.float32 if name in self.graph.outputs else torch.float16
        if name in self.offsets:
            off = self.offsets[name]
            n = math.prod(shape) * (4 if dtype == torch.float32 else 2)
            return self.arena[off:off + n].view(dtype).view(shape)
        if name in self.graph.outputs:
            return torch.empty(shape, dtype=dtype, device=self.dev)
        raise GraphError(f"cuda: no buffer planned for '{t.name}'")

    # -- lowering: one closure per op ---------------------------------------------------------
    def _lower(self, op: Op) -> Callable:
        K, W, a = self.K, self.backend.weights, op.attrs
        kind = op.kind
        ins, outs = op.inputs, op.outputs
        if kind not in self.backend.SUPPORTED_OPS:
            return self._delegate_to_cpu(op)

        def wname(t):
            return self.graph.tensors[t].source or t

        if kind == "embedding":
            table = W.packed(wname(ins[0]))
            return lambda env, s, c: K.embedding(self.tokens[:s], table, out=env[outs[0]])
        if kind == "rms_norm":
            w = W.vector(wname(ins[1]))
            return lambda env, s, c: K.rms_norm(env[ins[0]], w, a["eps"], out=env[outs[0]])
        if kind == "add_rms_norm":
            w = W.vector(wname(ins[2]))
            return lambda env, s, c: K.rms_norm(env[ins[0]], w, a["eps"], residual=env[ins[1]],
                                                out=env[outs[1]], residual_out=env[outs[0]])
        if kind == "linear":
            w = W.packed(wname(ins[1]))
            bias = W.vector(wname(ins[2])) if a.get("has_bias") else None
            res = ins[-1] if a.get("has_residual") else None

            # the output projection stays on the float path: int8 activations cost up to ~0.3 logits
            # there (measured on SmolLM2), enough to flip a close argmax; inside the blocks the
            # error averages out
            i8 = _use_act_int8(w) and outs[0] not in self.graph.outputs

            def run_linear(env, s, c):
                y = K.linear(env[ins[0]], w, bias=bias, out=env[outs[0]], act_int8=i8)
                if res is not None:
                    y.add_(env[res])
            return run_linear
        if kind == "linear_qkv":
            w = W.packed(*(wname(t) for t in ins[1:4]))
            bias = W.vector(*(wname(t) for t in ins[4:7])) if a.get("has_bias") else None
            i8 = _use_act_int8(w)
            return lambda env, s, c: K.linear(env[ins[0]], w, bias=bias, out=env[outs[0]], act_int8=i8)
        if kind == "linear_swiglu":
            w = W.packed(wname(ins[1]), wname(ins[2]))
            i8 = _use_act_int8(w)
            return lambda env, s, c: K.linear_silu_mul(env[ins[0]], w, out=env[outs[0]], act_int8=i8)
        if kind == "swiglu":
            return lambda env, s, c: K.silu_mul(env[ins[0]], env[ins[1]], out=env[outs[0]])
        if kind == "rope_qkv_store":
            if a.get("pos_scale", 1.0) != 1.0:
                raise GraphError(f"cuda: op '{op.name}' uses linear rope scaling, which the rope kernel lacks")
            freqs = W.vector(wname(ins[4])) if len(ins) > 4 else None
            return lambda env, s, c: K.rope_qkv_cache(
                env[ins[0]], None, None, env[ins[2]], env[ins[3]], self.start, a["n_heads"], a["n_kv_heads"],
                a["head_dim"], theta=a["theta"], style=a["style"], freq_factors=freqs,
                n_rot=a.get("rope_dim", a["head_dim"]), q_out=env[outs[0]])
        if kind == "attention":
            ws = {}

            def run_attention(env, s, c):
                q, kc, vc, out = env[ins[0]], env[ins[1]], env[ins[2]], env[outs[0]]
                if s <= 4:
                    if s not in ws:
                        n = K.default_decode_splits(q, a["n_kv_heads"], kc.shape[0], s, a["n_heads"])
                        ws[s] = K.decode_workspace(s, a["n_heads"], a["head_dim"], n, self.dev)
                    K.attention_decode(q, kc, vc, self.seq_len, a["n_heads"], a["n_kv_heads"], a["scale"], out=out,
                                       head_dim=a["head_dim"], workspace=ws[s])
                else:
                    K.attention_prefill(q, kc, vc, self.start, a["n_heads"], a["n_kv_heads"], a["scale"], out=out,
                                        head_dim=a["head_dim"])
            return run_attention
        if kind == "last_row":
            return lambda env, s, c: env[outs[0]].copy_(env[ins[0]][s - 1:s])
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

            def run_unfused(env, s, c):
                start = int(self._host_start)
                if kind == "kv_store":
                    env[ins[0]][start:start + s].copy_(env[ins[1]])
                    return
                r = _rope(env[ins[0]].float(), start, freqs, a).to(torch.float16)
                if kind == "rope":
                    env[outs[0]].copy_(r)
                else:
                    env[ins[2]][start:start + s].copy_(r)
            self._host_positions = True
            return run_unfused
        raise GraphError(f"cuda: no kernel for op '{op.name}' ({kind})")

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
        for op in self.graph.ops:
            for o in op.outputs:
                t = self.graph.tensors[o]
                if t.alias_of is not None:
                    env[o] = self.states[t.alias_of]
                else:
                    env[o] = self._buffer(o, seq, ctx)
        return env

    def _launch_all(self, env: dict, seq: int, ctx: int) -> None:
        for launch in self._launches:
            launch(env, seq, ctx)

    def greedy_tokens(self, first_token: int, start: int, n: int) -> "Iterator[int]":
        """Decode greedily on the device: each step's argmax feeds the next step inside one CUDA
        graph replay (argmax, token, position and length updated on the device), so a token
        costs one replay and one 4-byte read. Yields n tokens after first_token at position start."""
        if self.max_seq != 1:
            raise GraphError("greedy_tokens runs on the single-token decode program")
        ctx = next(iter(self.states.values())).shape[0]
        if start + n > ctx:
            raise GraphError(f"{start + n} tokens exceed the context of {ctx}")
        self.run({"tokens": [first_token], "start_pos": start})  # warm-up / compile outside the capture
        self._host_start = start
        self.tokens[:1].fill_(first_token)
        self.start.fill_(start)
        self.seq_len.fill_(start + 1)
        if self.dev.type != "cuda" or self._host_positions:
            for _ in range(n):
                env = self._env(1, ctx)
                self._launch_all(env, 1, ctx)
                tok = int(self.K.argmax(env["logits"])[0])
                yield tok
                self._host_start += 1
                self.tokens[:1].fill_(tok)
                self.start.add_(1)
                self.seq_len.add_(1)
            return
        if getattr(self, "_greedy_graph", None) is None:
            env = self._env(1, ctx)
            self._next = torch.zeros(1, dtype=torch.int64, device=self.dev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._launch_all(env, 1, ctx)
                self.K.argmax(env["logits"], out=self._next)
                self.tokens[:1].copy_(self._next)
                self.start.add_(1)
                self.seq_len.add_(1)
            self._greedy_graph = g
        for _ in range(n):
            self._greedy_graph.replay()
            yield int(self._next.item())

    def run(self, inputs: dict[str, object]) -> dict[str, torch.Tensor]:
        ids = np.asarray(inputs["tokens"], dtype=np.int32).reshape(-1)
        seq, start = int(ids.size), int(inputs["start_pos"])
        if seq > self.max_seq:
            raise GraphError(f"cuda program '{self.graph.name}' was compiled for {self.max_seq} tokens, got {seq}")
        ctx = next(iter(self.states.values())).shape[0]
        self._host_start = start
        self.tokens[:seq].copy_(torch.from_numpy(ids), non_blocking=True)
        self.start.fill_(start)
        self.seq_len.fill_(start + seq)
        if self.use_cuda_graph and self._warm:
            if self._graph is None:
                self._graph_env = self._env(seq, ctx)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    self._launch_all(self._graph_env, seq, ctx)
                self._graph = g
            self._graph.replay()
            env = self._graph_env
        else:
            env = self._env(seq, ctx)
            self._launch_all(env, seq, ctx)
            self._warm = True  # the first run compiles and autotunes the kernels outside a capture
        return {name: env[name] for name in self.graph.outputs}


def _shape_fn(graph: Graph, name: str):
    import sympy

    return sympy.lambdify([SEQ, CTX], list(graph.tensors[name].shape), "math")


class CudaBackend(CudaInfo):
    def __init__(self, f: GGUFFile):
        self.device = _device()
        self.K = _kernels()
        # programmatic dependent launch (Hopper): each kernel starts while its predecessor drains
        self.K.set_pdl(self.device.type == "cuda" and os.environ.get("EDGELLM_PDL", "1") != "0"
                       and torch.cuda.get_device_capability(self.device)[0] >= 9)
        self.file = f
        self.weights = CudaWeights(f, self.device)
        self._arena: torch.Tensor | None = None

    @staticmethod
    def available() -> bool:
        try:
            _device()
            _kernels()
            return True
        except BackendUnavailableError:
            return False

    def cpu_weights(self):
        """Float32 host copies of weights, for ops delegated to the cpu backend's kernels."""
        if getattr(self, "_cpu_weights", None) is None:
            from ..cpu import CpuWeights

            self._cpu_weights = CpuWeights(self.file)
        return self._cpu_weights

    def arena(self, nbytes: int) -> torch.Tensor:
        """One byte arena shared by every program (programs never run at the same time)."""
        nbytes = max(nbytes, 256)
        if self._arena is None or self._arena.numel() < nbytes:
            self._arena = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._arena

    def allocate_states(self, graph: Graph, ctx: int) -> dict[str, torch.Tensor]:
        from ...models import config_from_gguf

        cfg = config_from_gguf(self.file)
        need = self.resident_weight_bytes(self.file) + self.kv_cache_bytes(cfg, ctx)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            if need > free:
                raise DeviceMemoryError(
                    f"{self.file.path.name} needs about {need / 2**30:.2f} GiB of GPU memory at context {ctx} "
                    f"(weights {self.resident_weight_bytes(self.file) / 2**30:.2f} GiB + KV cache "
                    f"{self.kv_cache_bytes(cfg, ctx) / 2**30:.2f} GiB) but only {free / 2**30:.2f} of "
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

    @staticmethod
    def to_numpy(t: torch.Tensor) -> np.ndarray:
        return t.detach().to(torch.float32).cpu().numpy()

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "Triton interpreter (CPU)"
        return f"cuda ({name}, Triton kernels, fp16 activations)"
