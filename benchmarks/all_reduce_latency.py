"""The all_reduce of one decode row ([1, 4096]) between the GPUs of one host, as a tensor-parallel
step runs it: 200 calls captured in one CUDA graph, microseconds per call. NCCL's all_reduce
(float32, float16; also outside a graph) against the one-shot form over symmetric memory that
edgellm/backends/cuda/collective.py uses (PyTorch's symm_mem.one_shot_all_reduce_out).

    python benchmarks/all_reduce_latency.py [--gpus 2] [--width 4096]

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 as the
environment sets them); the one-shot form does not use it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def _timed(fn, n: int = 200, graph: bool = True) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
        g.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        g.replay()
    else:
        t = time.perf_counter()
        for _ in range(n):
            fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def _rank(rank: int, world: int, width: int, rv: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{rv}", rank=rank, world_size=world)
    rows = []
    for dt in (torch.float32, torch.float16):
        x = torch.ones(1, width, device="cuda", dtype=dt)
        rows.append((f"NCCL all_reduce {dt}, in a CUDA graph", _timed(lambda: dist.all_reduce(x))))
        rows.append((f"NCCL all_reduce {dt}, launched one by one", _timed(lambda: dist.all_reduce(x), graph=False)))
    from edgellm.backends.cuda.collective import one_shot

    shot = one_shot(torch.device("cuda", rank), 1, width, 2)
    if shot is None:
        rows.append(("one-shot (symmetric memory)", float("nan")))
    else:
        src, out = shot.buffer(0), torch.empty(1, width, device="cuda")
        src.fill_(rank + 1.0)
        rows.append(("one-shot float32 (symmetric memory), in a CUDA graph", _timed(lambda: shot(src, out))))
        torch.cuda.synchronize()
        want = world * (world + 1) / 2
        assert bool((out == want).all()), f"one-shot sum {out[0, :4].tolist()} != {want}"
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}, one row of {width}: microseconds per all_reduce")
        for name, us in rows:
            print(f"  {name:<58} {us:7.1f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--width", type=int, default=4096)
    a = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(a.gpus, a.width, os.path.join(d, "rv")), nprocs=a.gpus, join=True)


if __name__ == "__main__":
    main()
