"""Several processes, one processor each, through torch.distributed (NCCL on GPUs, gloo on CPUs).

Pipeline placement: every process holds the units placed on its rank (weights and KV caches), runs
the same generation loop, and executes only its own segments of each stage program; activations
that cross to another rank go by isend/recv (tagged per tensor, so production and consumption
order never deadlock), and the logits are broadcast from the rank of the head, so every rank
samples the same token. Written for any number of ranks.

Tensor placement (--mode tensor): every process runs the whole graph on its share of each layer
(ModelConfig.shard: its attention heads, KV heads and cache, its MLP columns, its vocabulary rows
of the head; edgellm.models.blocks); the output and down projections' partial sums meet in an
all_reduce, two a layer, and the logits in an all_gather, so every rank computes the same logits
and token. On GPUs the collectives run inside each step's CUDA graph
(edgellm/backends/cuda/collective.py).

    python -m edgellm.hetero.distributed --devices cuda:0,cuda:1 -m model.gguf "prompt"   # a launcher
    python -m edgellm.hetero.distributed --devices cuda:0,cuda:1 --mode tensor -m model.gguf "prompt"
    python -m edgellm.hetero.distributed --devices cpu,cpu --backend gloo ...              # CPU processes

In code: `load_rank(path, rank, world, devices)` inside an initialised process group.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from ..errors import EdgeLLMError
from ..graph.ir import Graph
from .executor import compile_segment, split_segments, subgraph
from .units import graph_units, unit_of_state


def even_placement(units: list[str], world: int) -> dict[str, str]:
    """Layers in `world` contiguous runs of near-equal size; the embedding with the first, the head
    with the last."""
    layers = [u for u in units if u.startswith("blk.")]
    out = {"embed": "rank:0", "head": f"rank:{world - 1}"}
    for i, u in enumerate(layers):
        out[u] = f"rank:{min(i * world // max(len(layers), 1), world - 1)}"
    return out


def _rank(proc: str) -> int:
    if not proc.startswith("rank:"):
        raise EdgeLLMError(f"distributed placement: processors are rank:N, got '{proc}'")
    return int(proc.split(":")[1])


class DistProgram:
    def __init__(self, backend: "DistBackend", graph: Graph, states: dict, max_seq: int | None):
        self.graph, self.b = graph, backend
        self.segments = split_segments(graph, backend.placement)
        producer = {o: k for k, s in enumerate(self.segments) for i in s.ops for o in graph.ops[i].outputs}
        # crossing activations in the order the graph makes them (by name among one op's outputs):
        # every rank derives the same tags, and each pair of ranks sends and receives in tag order,
        # as NCCL needs (it pairs point-to-point calls by order; gloo by tag)
        made = {o: i for i, op in enumerate(graph.ops) for o in op.outputs}
        crossing = sorted({t for s in self.segments for t in s.inputs if graph.tensors[t].kind == "activation"},
                          key=lambda t: (made[t], t))
        self.tag = {t: n for n, t in enumerate(crossing)}
        self.owner = {t: _rank(self.segments[producer[t]].processor) for t in crossing}
        self.consumers = {t: sorted({_rank(s.processor) for s in self.segments if t in s.inputs}) for t in crossing}
        self.head_rank = _rank(self.segments[producer[graph.outputs[0]]].processor)
        self.parts = []
        for k, s in enumerate(self.segments):
            if _rank(s.processor) != backend.rank:
                self.parts.append((s, None))
                continue
            sub = subgraph(graph, s, f"{graph.name}.{k}.rank{backend.rank}")
            self.parts.append((s, compile_segment(backend.local, sub, states, max_seq)))

    def run(self, inputs: dict) -> dict:
        me, dev = self.b.rank, self.b.device
        seq = len(inputs["tokens"]) if "tokens" in inputs else 1
        env = dict(inputs)
        pending = []
        for seg, prog in self.parts:
            if prog is None:
                continue
            feed = {k: inputs[k] for k in ("tokens", "start_pos") if k in inputs}  # the cuda backend steps by them
            for t in sorted(seg.inputs, key=lambda t: self.tag.get(t, -1)):
                if t not in env:  # from another rank
                    shape = self.graph.tensors[t].concrete_shape(seq=seq, ctx=self.b.ctx)
                    buf = torch.empty(shape, dtype=torch.float32, device=dev)
                    dist.recv(buf, src=self.owner[t], tag=self.tag[t])
                    env[t] = buf
                feed[t] = env[t]
            out = prog.run(feed)
            env.update(out)
            for t in sorted(seg.outputs, key=lambda t: self.tag.get(t, -1)):
                for c in self.consumers.get(t, ()):
                    if c != me:
                        # a copy (the program's buffer is the arena's, which later segments reuse while
                        # the send may still read it), kept alive here until the send is done
                        sent = out[t].to(torch.float32, copy=True).contiguous()
                        pending.append((dist.isend(sent, dst=c, tag=self.tag[t]), sent))
        name = self.graph.outputs[0]
        if me == self.head_rank:
            logits = env[name].float().contiguous()
        else:
            shape = self.graph.tensors[name].concrete_shape(seq=seq, ctx=self.b.ctx)
            logits = torch.empty(shape, dtype=torch.float32, device=dev)
        dist.broadcast(logits, src=self.head_rank)
        for work, _sent in pending:
            work.wait()
        return {name: logits}


class DistBackend:
    """The backend protocol for one rank of a pipeline: a local backend for its own units."""

    name = "distributed"
    SUPPORTED_OPS = None

    def __init__(self, f, placement: dict[str, str], rank: int, device: str):
        self.file, self.placement, self.rank = f, dict(placement), rank
        self.local = local_backend(device)(f)
        self.device = getattr(self.local, "device", None) or torch.device(device)  # (cuda's interpreter: the CPU)
        self.ctx = 1

    def allocate_states(self, graph: Graph, ctx: int) -> dict:
        self.ctx = ctx
        mine = Graph("states", graph.meta)
        for t in graph.states():
            if _rank(self.placement[unit_of_state(t.name)]) == self.rank:
                mine.tensors[t.name] = t
        return self.local.allocate_states(mine, ctx)

    def compile(self, graph: Graph, states: dict, plan=None, max_seq: int | None = None) -> DistProgram:
        return DistProgram(self, graph, states, max_seq)

    @staticmethod
    def to_numpy(t: torch.Tensor):
        return t.detach().to(torch.float32).cpu().numpy()

    def describe(self) -> str:
        mine = [u for u, p in self.placement.items() if _rank(p) == self.rank]
        return f"rank {self.rank} of a pipeline ({self.local.describe()}): {len(mine)} units"


def local_backend(device: str):
    """A factory f(file) -> this rank's backend on its own processor: cuda on 'cuda:N' (that
    device made current; without GPUs, the cuda backend as EDGELLM_CUDA_DEVICE runs it: Triton's
    interpreter on the CPU), cpu-fast on 'cpu'."""
    if device.startswith("cuda"):
        from ..backends.cuda.backend import CudaBackend

        if torch.cuda.is_available():
            torch.cuda.set_device(torch.device(device))
            os.environ["EDGELLM_CUDA_DEVICE"] = device
        return CudaBackend
    from ..backends import get_backend

    return get_backend("cpu-fast")


def end_process_group() -> None:
    """Leave the process group once this rank's models are dropped (the caller lets go of them
    first): their GPU work finished and every rank at the same point before the group goes (a
    rank's CUDA graphs may hold NCCL work, and a peer may still read its symmetric buffers; on an
    H100 pair, 2026-11-26, destroy_process_group hung without this in 1 of 3 tensor-parallel tests
    and after a benchmark's run on an H200 pair). Called while an exception propagates (from a
    `finally`), it only destroys the group: the other ranks may never reach the barrier."""
    import gc
    import sys

    if sys.exc_info()[0] is not None:
        dist.destroy_process_group()
        return
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def load_rank(path, rank: int, world: int, devices: list[str], placement: dict[str, str] | None = None,
              ctx: int | None = None, mode: str = "pipeline", **kw):
    """This rank's Model in an initialised process group: mode 'pipeline' (placement: unit ->
    'rank:N', default even) or 'tensor' (Megatron's split: each rank holds its share of every
    layer's heads and MLP columns, two all_reduces a layer; edgellm.models.blocks)."""
    from ..compiler.compile import compile_graph
    from ..gguf_file import open_gguf
    from ..model import load
    from ..models import build_graph, config_from_gguf

    if mode == "tensor":
        return load(path, backend=local_backend(devices[rank]), ctx=ctx, shard=(rank, world), **kw)
    if placement is None:
        f = open_gguf(path)
        g = compile_graph(build_graph(config_from_gguf(f), f, "last"), seq=1, ctx=16).graph
        placement = even_placement([u.name for u in graph_units(g)], world)
    return load(path, backend=lambda f: DistBackend(f, placement, rank, devices[rank]), ctx=ctx, **kw)


def _worker(rank: int, world: int, args) -> None:
    devices = args.devices.split(",")
    backend = args.backend or ("nccl" if devices[0].startswith("cuda") else "gloo")
    dist.init_process_group(backend, init_method=f"file://{args.rendezvous}", rank=rank, world_size=world)
    try:
        m = load_rank(args.model, rank, world, devices, ctx=args.ctx, mode=args.mode)
        out = m.generate(args.prompt, max_tokens=args.max_tokens, temperature=0)
        text = "".join(out)
        if rank == 0:
            print(text, flush=True)
            split = f"tensor parallel over {world} ranks, rank 0: " if args.mode == "tensor" else ""
            print(f"[{split}{m.backend.describe()}; {m.last_stats.summary()}]", file=sys.stderr)
    finally:
        m = None  # noqa: F841 - dropped before the group ends
        end_process_group()


def main(argv=None) -> int:
    import tempfile

    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(prog="python -m edgellm.hetero.distributed",
                                 description="Greedy generation with the model split over several processes.")
    ap.add_argument("prompt")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--devices", default="cuda:0,cuda:1", help="one processor per rank, e.g. cuda:0,cuda:1 or cpu,cpu")
    ap.add_argument("--backend", default=None, help="torch.distributed backend (default: nccl for cuda, gloo for cpu)")
    ap.add_argument("--mode", choices=("auto", "pipeline", "tensor"), default="auto",
                    help="pipeline: layers over ranks; tensor: each layer's heads and MLP columns over ranks; "
                         "auto: the solver's pick over GPUs (edgellm.hetero.plan.plan_gpus), pipeline over CPUs")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("-c", "--ctx", type=int, default=None)
    args = ap.parse_args(argv)
    if args.model is None:
        from ..default_model import default_model_path

        args.model = str(default_model_path())
    devices = [d.strip() for d in args.devices.split(",")]
    world = len(devices)
    if args.mode == "auto":
        args.mode = "pipeline"
        if world > 1 and all(d.startswith("cuda") for d in devices):
            from .plan import plan_gpus, render_gpus

            plan = plan_gpus(args.model, devices, ctx=args.ctx, prefill=512)
            print(render_gpus(plan), end="", file=sys.stderr)
            args.mode = plan["mode"]
    with tempfile.TemporaryDirectory() as d:
        args.rendezvous = os.path.join(d, "rendezvous")
        mp.spawn(_worker, args=(world, args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
