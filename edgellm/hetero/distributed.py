"""Several processes, one processor each, through torch.distributed (NCCL on GPUs, gloo on CPUs).

Pipeline placement: every process holds the units placed on its rank (weights and KV caches), runs
the same generation loop, and executes only its own segments of each stage program; activations
that cross to another rank go by isend/recv (tagged per tensor, so production and consumption
order never deadlock), and the logits are broadcast from the rank of the head, so every rank
samples the same token. Written for any number of ranks.

    python -m edgellm.hetero.distributed --devices cuda:0,cuda:1 -m model.gguf "prompt"   # a launcher
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
from .executor import split_segments, subgraph
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
        crossing = sorted({t for s in self.segments for t in s.inputs if graph.tensors[t].kind == "activation"})
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
            self.parts.append((s, backend.local.compile(sub, {t.name: states[t.name] for t in sub.states()},
                                                        None, max_seq=max_seq)))

    def run(self, inputs: dict) -> dict:
        me, dev = self.b.rank, self.b.device
        seq = len(inputs["tokens"]) if "tokens" in inputs else 1
        env = dict(inputs)
        pending = []
        for seg, prog in self.parts:
            if prog is None:
                continue
            feed = {}
            for t in seg.inputs:
                if t not in env:  # from another rank
                    shape = self.graph.tensors[t].concrete_shape(seq=seq, ctx=self.b.ctx)
                    buf = torch.empty(shape, dtype=torch.float32, device=dev)
                    dist.recv(buf, src=self.owner[t], tag=self.tag[t])
                    env[t] = buf
                feed[t] = env[t]
            out = prog.run(feed)
            env.update(out)
            for t in seg.outputs:
                for c in self.consumers.get(t, ()):
                    if c != me:
                        pending.append(dist.isend(out[t].float().contiguous(), dst=c, tag=self.tag[t]))
        name = self.graph.outputs[0]
        if me == self.head_rank:
            logits = env[name].float().contiguous()
        else:
            shape = self.graph.tensors[name].concrete_shape(seq=seq, ctx=self.b.ctx)
            logits = torch.empty(shape, dtype=torch.float32, device=dev)
        dist.broadcast(logits, src=self.head_rank)
        for w in pending:
            w.wait()
        return {name: logits}


class DistBackend:
    """The backend protocol for one rank of a pipeline: a local backend for its own units."""

    name = "distributed"
    SUPPORTED_OPS = None

    def __init__(self, f, placement: dict[str, str], rank: int, device: str):
        self.file, self.placement, self.rank = f, dict(placement), rank
        if device.startswith("cuda"):
            from ..backends.cuda.backend import CudaBackend

            torch.cuda.set_device(torch.device(device))
            os.environ["EDGELLM_CUDA_DEVICE"] = device
            self.local = CudaBackend(f)
            self.device = torch.device(device)
        else:
            from ..backends.cpu_fast import CpuFastBackend

            self.local = CpuFastBackend(f, threads=max(torch.get_num_threads(), 1))
            self.device = torch.device("cpu")
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


# -- tensor parallel: every rank runs the whole graph, multiplying only its share of each matrix's rows
def row_share(n: int, rank: int, world: int) -> tuple[int, int]:
    size = -(-n // world)
    if size * (world - 1) >= n:
        raise EdgeLLMError(f"tensor parallel: a matrix of {n} rows cannot give each of {world} ranks a share")
    return rank * size, min(n, (rank + 1) * size)


def _tp_program_cls():
    from ..backends.cpu_fast import CpuFastProgram

    class TensorParallelProgram(CpuFastProgram):
        """Each product: this rank's rows of the (stacked) weights, then an all-gather of the
        shares, so activations, norms, attention and the KV cache are whole on every rank and
        each rank holds 1/world of every matrix."""

        def _rows(self, names):
            n = sum(self.weights.file.tensors[t].shape[0] for t in names)
            return n, row_share(n, self.tp_rank, self.tp_world)

        def prepare_product(self, names):
            self.weights.pack(names, rows=self._rows(names)[1])

        def product(self, names, x):
            n, rows = self._rows(names)
            y = self.weights.pack(names, rows=rows)(x)
            size = -(-n // self.tp_world)
            if y.shape[1] < size:
                y = torch.nn.functional.pad(y, (0, size - y.shape[1]))
            parts = [torch.empty_like(y) for _ in range(self.tp_world)]
            dist.all_gather(parts, y.contiguous())
            return torch.cat(parts, dim=1)[:, :n]

    return TensorParallelProgram


def tensor_parallel_backend(rank: int, world: int):
    """A factory f(file) -> a cpu-fast backend whose programs are this rank's tensor-parallel share."""
    from ..backends.cpu_fast import CpuFastBackend

    base = _tp_program_cls()
    prog_cls = type("TensorParallelProgramR", (base,), {"tp_rank": rank, "tp_world": world})
    backend_cls = type("TensorParallelBackend", (CpuFastBackend,), {"program_cls": prog_cls, "name": "cpu-fast-tp"})
    return lambda f: backend_cls(f, threads=max(torch.get_num_threads(), 1))


def load_rank(path, rank: int, world: int, devices: list[str], placement: dict[str, str] | None = None,
              ctx: int | None = None, mode: str = "pipeline", **kw):
    """This rank's Model in an initialised process group: mode 'pipeline' (placement: unit ->
    'rank:N', default even) or 'tensor' (every matrix's rows shared out; CPU processes)."""
    from ..compiler.compile import compile_graph
    from ..gguf_file import open_gguf
    from ..model import load
    from ..models import build_graph, config_from_gguf

    if mode == "tensor":
        if devices[rank].startswith("cuda"):
            raise EdgeLLMError("tensor parallel runs on CPU processes (gloo); for GPUs use the pipeline mode")
        return load(path, backend=tensor_parallel_backend(rank, world), ctx=ctx, **kw)
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
            print(f"[{m.backend.describe()}; {m.last_stats.summary()}]", file=sys.stderr)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    import tempfile

    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(prog="python -m edgellm.hetero.distributed",
                                 description="Greedy generation with the model's layers pipelined over several processes.")
    ap.add_argument("prompt")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--devices", default="cuda:0,cuda:1", help="one processor per rank, e.g. cuda:0,cuda:1 or cpu,cpu")
    ap.add_argument("--backend", default=None, help="torch.distributed backend (default: nccl for cuda, gloo for cpu)")
    ap.add_argument("--mode", choices=("pipeline", "tensor"), default="pipeline",
                    help="pipeline: layers over ranks; tensor: each matrix's rows over ranks (CPU processes)")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("-c", "--ctx", type=int, default=None)
    args = ap.parse_args(argv)
    if args.model is None:
        from ..default_model import default_model_path

        args.model = str(default_model_path())
    world = len(args.devices.split(","))
    with tempfile.TemporaryDirectory() as d:
        args.rendezvous = os.path.join(d, "rendezvous")
        mp.spawn(_worker, args=(world, args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
