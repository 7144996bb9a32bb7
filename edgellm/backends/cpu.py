"""The cpu backend: the reference executor of a Graph (torch on the CPU, float32 throughout).

Plain and numerically careful: it is the ground truth for every kernel test and the fallback for
ops another backend does not support. Weights are converted once, at load, into the layout its
kernels want: float32 rows (dequantized from their GGML blocks). The KV cache is one preallocated
float32 tensor per layer and per K/V at the context capacity, written in place at the position
offset (no concatenation, no copy).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from ..errors import GraphError
from ..gguf_file import GGUFFile
from ..compiler.memory import MemoryPlan, plan_offsets  # noqa: F401 - plan_offsets: the backends' import
from ..compiler.passes import rope_qkv_extras  # noqa: F401 - also the fused backends' import
from .cpu_nd import ND_KERNELS
from .info import CpuInfo
from ..graph.ir import Graph, Op
from ..graph.shapes import shape_function
from ..quant import dequantize


class CpuWeights:
    """Weights converted to float32 torch tensors, shared by every program compiled for one model."""

    def __init__(self, f: GGUFFile):
        self.file = f
        self._cache: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        t = self._cache.get(name)
        if t is None:
            src = self.file.tensor(name)
            # numpy, single-threaded: steadier than torch's thread pool on a busy machine (1.2 s for SmolLM2)
            t = torch.from_numpy(np.ascontiguousarray(dequantize(src.data, src.type_name, src.shape), dtype=np.float32))
            self._cache[name] = t
        return t

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._cache.values())


def _rope(x: torch.Tensor, start: int, freqs: torch.Tensor | None, a: dict,
          positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary embedding at positions start.. (or at the given per-row positions)."""
    s = x.shape[0]
    h, d, r = a["n_heads"], a["head_dim"], a.get("rope_dim", a["head_dim"])
    # angles in float64, then rounded once to float32
    dev = x.device  # also called by the cuda backend's unfused rope ops, on device tensors
    inv = a["theta"] ** (-torch.arange(0, r, 2, dtype=torch.float64, device=dev) / r)
    if freqs is not None:
        inv = inv / freqs.to(device=dev, dtype=torch.float64)
    pos = (torch.arange(start, start + s, dtype=torch.float64, device=dev) if positions is None
           else positions.to(device=dev, dtype=torch.float64)) * a.get("pos_scale", 1.0)
    ang = pos[:, None] * inv[None, :]  # [S, r/2]
    m = a.get("mscale", 1.0)  # long-RoPE attention factor: scales cos and sin
    cos, sin = (ang.cos() * m).to(x.dtype)[:, None, :], (ang.sin() * m).to(x.dtype)[:, None, :]
    return rotate(x.view(s, h, d), cos, sin, r, a["style"]).view(s, h * d)


def rotate(xh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int, style: str) -> torch.Tensor:
    """xh [S, H, d] with its first r features rotated by the angles' cos/sin ([S, 1, r/2]): pairs
    (2i, 2i+1) for style 'norm', (i, i + r/2) for 'neox'; the rest copied."""
    out = xh.clone()
    if style == "norm":
        x0, x1 = xh[..., 0:r:2], xh[..., 1:r:2]
        out[..., 0:r:2] = x0 * cos - x1 * sin
        out[..., 1:r:2] = x0 * sin + x1 * cos
    else:
        x0, x1 = xh[..., : r // 2], xh[..., r // 2 : r]
        out[..., : r // 2] = x0 * cos - x1 * sin
        out[..., r // 2 : r] = x0 * sin + x1 * cos
    return out


def _attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, start: int, a: dict) -> torch.Tensor:
    s = q.shape[0]
    h, g, d = a["n_heads"], a["n_kv_heads"], a["head_dim"]
    r = h // g
    n = start + s
    w = a.get("window", 0)
    # keys at positions lo..n-1; a sliding window starts at the first query's window, and reads
    # position p from row p mod rows (a ring cache holds the last `rows` positions written)
    lo = max(0, start - w + 1) if w else 0
    if n - lo > kc.shape[0]:
        raise GraphError(f"attention: queries at {start}..{n - 1} read keys {lo}..{n - 1}, more than the "
                         f"cache's {kc.shape[0]} rows hold (a ring cache sized for a smaller chunk?)")
    rows = torch.arange(lo, n) % kc.shape[0] if w else slice(0, n)
    m = n - lo
    qh = q.view(s, g, r, d).permute(1, 2, 0, 3).reshape(g, r * s, d)
    k = kc[rows].view(m, g, d).transpose(0, 1)  # [G, m, d]
    v = vc[rows].view(m, g, d).transpose(0, 1)
    scores = torch.bmm(qh, k.transpose(1, 2)).view(g, r, s, m) * a["scale"]
    qpos = torch.arange(start, n)[:, None]
    kpos = torch.arange(lo, n)[None, :]
    hidden = kpos > qpos
    if w:  # sliding window: only the last `window` positions (the query's own included)
        hidden |= kpos <= qpos - w
    scores = scores.masked_fill(hidden, float("-inf"))
    p = torch.softmax(scores, dim=-1).view(g, r * s, m)
    o = torch.bmm(p, v).view(g, r, s, d)
    return o.permute(2, 0, 1, 3).reshape(s, h * d)


def _attention_rows(q, kc, vc, base, pos, a: dict) -> torch.Tensor:
    # each row is one sequence's decode query over its own slot of the cache: the single-sequence
    # attention on that row, so a batched step computes what separate steps would
    out = torch.empty_like(q)
    for i, (b, p) in enumerate(zip(base.tolist(), pos.tolist())):
        out[i:i + 1] = _attention(q[i:i + 1], kc[b:b + p + 1], vc[b:b + p + 1], p, a)
    return out


def _kv_store_rows(op: Op, i: list) -> torch.Tensor:
    cache, x, rows = i[0], i[1], (i[2] + i[3]).long()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= cache.shape[0]):
        raise GraphError(f"op '{op.name}': rows {rows.tolist()} outside the cache's {cache.shape[0]}")
    cache.index_copy_(0, rows, x)
    return cache


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if w.shape[-1] != x.shape[-1]:  # one norm per group of w's width (per-head q/k norm)
        return _rms_norm(x.unflatten(-1, (-1, w.shape[-1])), w, eps).flatten(-2)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


GATE_ACTS = {"silu": torch.nn.functional.silu, "gelu_tanh": gelu_tanh}  # the gated MLP's activation


# -- the reference kernels: op kind -> f(op, inputs) -> output (or a tuple for multi-output ops) --
def _linear(op: Op, i: list) -> torch.Tensor:
    y = torch.nn.functional.linear(i[0], i[1], i[2] if op.attrs.get("has_bias") else None)
    return y + i[-1] if op.attrs.get("has_residual") else y

def _add_rms_norm(op: Op, i: list) -> tuple[torch.Tensor, torch.Tensor]:
    s = i[0] + i[1]
    return s, _rms_norm(s, i[2], op.attrs["eps"])

def _rope_qkv_store(op: Op, i: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv, start, kc, vc = i[0], int(i[1]), i[2], i[3]
    freqs, norms = rope_qkv_extras(op, i)
    a = op.attrs
    nq, nkv = a["n_heads"] * a["head_dim"], a["n_kv_heads"] * a["head_dim"]
    q_in, k_in = qkv[:, :nq].contiguous(), qkv[:, nq:nq + nkv].contiguous()
    if norms:
        q_in, k_in = _rms_norm(q_in, norms[0], a["qk_norm_eps"]), _rms_norm(k_in, norms[1], a["qk_norm_eps"])
    q = _rope(q_in, start, freqs, a)
    k = _rope(k_in, start, freqs, {**a, "n_heads": a["n_kv_heads"]})
    return (q, _kv_store(op, [kc, k, start]), _kv_store(op, [vc, qkv[:, nq + nkv:], start]))

def _kv_store(op: Op, i: list) -> torch.Tensor:
    cache, x, start = i[0], i[1], int(i[2])
    if op.attrs.get("ring"):  # a sliding-window layer's ring: position p in row p mod rows
        if x.shape[0] > cache.shape[0]:
            raise GraphError(f"op '{op.name}': {x.shape[0]} rows do not fit the ring cache's {cache.shape[0]}")
        cache.index_copy_(0, torch.arange(start, start + x.shape[0]) % cache.shape[0], x)
        return cache
    if start + x.shape[0] > cache.shape[0]:
        raise GraphError(f"op '{op.name}': rows {start}..{start + x.shape[0]} exceed the cache's {cache.shape[0]}")
    cache[start : start + x.shape[0]] = x
    return cache


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """x summed over the tensor-parallel ranks (torch.distributed's default process group; gloo
    on CPUs), into a new tensor."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise GraphError("all_reduce: this graph is one rank's share of a tensor-parallel model and needs "
                         "torch.distributed initialised (edgellm.hetero.distributed.load_rank)")
    y = x.clone()
    dist.all_reduce(y)
    return y


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every tensor-parallel rank's x side by side along the columns, in rank order."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)


CPU_KERNELS: dict[str, Callable] = {
    "embedding": lambda op, i: i[0].index_select(0, i[1].long()),
    "rms_norm": lambda op, i: _rms_norm(i[0], i[1], op.attrs["eps"]),
    "linear": _linear,
    "add": lambda op, i: i[0] + i[1],
    "mul": lambda op, i: i[0] * i[1],
    "silu": lambda op, i: torch.nn.functional.silu(i[0]),
    # one gelu op for both worlds: ONNX's exact (erf) form by default, the tanh form of Gemma's
    # builder with approximate='tanh'
    "gelu": lambda op, i: torch.nn.functional.gelu(i[0], approximate=op.attrs.get("approximate", "none")),
    "scale": lambda op, i: i[0] * op.attrs["factor"],
    "softcap": lambda op, i: torch.tanh(i[0] / op.attrs["cap"]) * op.attrs["cap"],
    "rope": lambda op, i: _rope(i[0], int(i[1]), i[2] if len(i) > 2 else None, op.attrs),
    "kv_store": _kv_store,
    "attention": lambda op, i: _attention(i[0], i[1], i[2], int(i[3]), op.attrs),
    "last_row": lambda op, i: i[0][-1:],
    "rope_rows": lambda op, i: _rope(i[0], 0, i[2] if len(i) > 2 else None, op.attrs, positions=i[1]),
    "kv_store_rows": _kv_store_rows,
    "attention_rows": lambda op, i: _attention_rows(i[0], i[1], i[2], i[3], i[4], op.attrs),
    "all_reduce": lambda op, i: all_reduce(i[0]),
    "all_gather": lambda op, i: all_gather(i[0]),
    # fused ops (edgellm.compiler.passes): each the composition it replaces
    "add_rms_norm": _add_rms_norm,
    "swiglu": lambda op, i: GATE_ACTS[op.attrs.get("act", "silu")](i[0]) * i[1],
    "linear_swiglu": lambda op, i: (GATE_ACTS[op.attrs.get("act", "silu")](torch.nn.functional.linear(i[0], i[1]))
                                    * torch.nn.functional.linear(i[0], i[2])),
    "linear_qkv": lambda op, i: torch.cat(
        [torch.nn.functional.linear(i[0], w, i[4 + k] if op.attrs.get("has_bias") else None)
         for k, w in enumerate(i[1:4])], dim=1),
    "rope_qkv_store": _rope_qkv_store,
    "rope_store": lambda op, i: _kv_store(
        op, [i[2], _rope(i[0], int(i[1]), i[3] if len(i) > 3 else None, op.attrs), i[1]]),
}
CPU_KERNELS.update({k: v for k, v in ND_KERNELS.items() if k not in CPU_KERNELS})  # N-D kinds (imported networks)


class CpuProgram:
    """A graph bound to weights and state tensors, executed op by op."""

    def __init__(self, graph: Graph, weights: CpuWeights, states: dict[str, torch.Tensor],
                 plan: MemoryPlan | None = None, arena: torch.Tensor | None = None):
        graph.validate()
        self.graph = graph
        self.weights = weights
        self.states = states
        self._free_after = self._liveness(graph)
        # the memory plan: each planned intermediate is a view into the arena at its offset
        self.offsets = plan_offsets(plan) if plan is not None else {}
        self.arena = arena
        if self.offsets and (arena is None or arena.numel() < plan.total_bytes):
            raise GraphError(f"graph '{graph.name}': the arena is smaller than the plan's {plan.total_bytes} bytes")
        self._shape_fn = {n: shape_function(graph.tensors[n].shape) for n in self.offsets}
        missing = [t.name for t in graph.states() if t.name not in states]
        if missing:
            raise GraphError(f"graph '{graph.name}': no storage for state tensors {missing[:3]}")
        for t in graph.weights():
            weights.get(t.source or t.name)
        self._kernels = CPU_KERNELS
        unsupported = {op.kind for op in graph.ops} - set(self._kernels)
        if unsupported:
            raise GraphError(f"cpu backend: no kernel for op kinds {sorted(unsupported)}")

    @staticmethod
    def _liveness(graph: Graph) -> list[list[str]]:
        last = graph.last_uses()
        free: list[list[str]] = [[] for _ in graph.ops]
        for name, i in last.items():
            t = graph.tensors[name]
            if t.kind == "activation" and i < len(graph.ops) and t.alias_of is None:
                free[i].append(name)
        return free

    def _view(self, name: str, seq: int, ctx: int) -> torch.Tensor:
        shape = self._shape_fn[name]({"seq": seq, "ctx": ctx})
        n = 4 * math.prod(shape)
        off = self.offsets[name]
        return self.arena[off : off + n].view(torch.float32).view(shape)

    def run(self, inputs: dict[str, object]) -> dict[str, torch.Tensor]:
        env: dict[str, object] = {}
        for name in self.graph.inputs:
            if name not in inputs:
                raise GraphError(f"graph '{self.graph.name}': input '{name}' not given")
            v = inputs[name]
            env[name] = torch.as_tensor(np.asarray(v)) if not isinstance(v, (int, torch.Tensor)) else v
        for t in self.graph.weights():
            env[t.name] = self.weights.get(t.source or t.name)
        env.update(self.states)
        seq = int(np.asarray(inputs["tokens"]).shape[0]) if "tokens" in inputs else 1
        ctx = max(t.shape[0] for t in self.states.values()) if self.states else 1  # rings are shorter
        with torch.inference_mode():
            for op, free in zip(self.graph.ops, self._free_after):
                result = self._kernels[op.kind](op, [env[i] for i in op.inputs])
                results = (result,) if len(op.outputs) == 1 else result
                for name, value in zip(op.outputs, results):
                    if name in self.offsets:
                        view = self._view(name, seq, ctx)
                        view.copy_(value)
                        value = view
                    env[name] = value
                for name in free:
                    env.pop(name, None)
        return {name: env[name] for name in self.graph.outputs}


class CpuBackend(CpuInfo):

    def __init__(self, f: GGUFFile, threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.weights = CpuWeights(f)
        self._arena: torch.Tensor | None = None

    @staticmethod
    def available() -> bool:
        return True

    def allocate_states(self, graph: Graph, ctx: int) -> dict[str, torch.Tensor]:
        return {t.name: torch.zeros(t.concrete_shape(ctx=ctx), dtype=torch.float32) for t in graph.states()}

    def compile(self, graph: Graph, states: dict[str, torch.Tensor], plan: MemoryPlan | None = None,
                max_seq: int | None = None) -> CpuProgram:
        """Bind a graph to weights and states; with a memory plan, intermediates live in one arena
        shared by every program of this backend (programs never run concurrently)."""
        arena = None
        if plan is not None and plan.total_bytes:
            if self._arena is None or self._arena.numel() < plan.total_bytes:
                self._arena = torch.empty(plan.total_bytes, dtype=torch.uint8)
            arena = self._arena
        return CpuProgram(graph, self.weights, states, plan, arena)

    @staticmethod
    def to_numpy(t: torch.Tensor) -> np.ndarray:
        return t.detach().to(torch.float32).cpu().numpy()

    def describe(self) -> str:
        return f"cpu (torch {torch.__version__}, {torch.get_num_threads()} threads, float32)"


def state_bytes(graph: Graph, ctx: int) -> int:
    return sum(math.prod(t.concrete_shape(ctx=ctx)) * 4 for t in graph.states())
