"""What the host side of a GPU + CPU split can move: memory bandwidth, cpu-fast's products, and
the PCIe link, alone and at the same time (issue 18's split runs on these three).

    python benchmarks/host_probe.py [--threads N] [--format Q8_0] [--json FILE]

Rows (GB/s of the bytes each moves; best of --reps):
- host copy / host read: a 1 GiB torch copy (read + write counted) and an int8 sum (read) with the
  threads given (default: the physical cores, as cpu-fast uses);
- cpu-fast product: cpu-fast's PackedLinear for the Llama-3.1-8B layer shapes, one token (M = 1),
  in the format's file bytes per second (what a CPU-held layer streams per token);
- pinned H2D / D2H: 256 MiB copies between pinned host memory and the GPU on a side stream;
- H2D while the CPU multiplies: the same copies with the products running on the CPU threads,
  both rates (the two share the host's memory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {"q|k|v": (6144, 4096), "o": (4096, 4096), "gate|up": (28672, 4096), "down": (4096, 14336)}


def best(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--format", default="Q8_0")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import numpy as np
    import torch

    from edgellm.backends.cpu_fast import PackedLinear, physical_cores
    from edgellm.quant import quantize

    threads = a.threads or physical_cores()
    torch.set_num_threads(threads)
    out: dict = {"threads": threads, "cpu": _cpu_name(), "format": a.format}

    src = torch.empty(1 << 30, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    out["host_copy_GBs"] = 2 * src.numel() / best(lambda: dst.copy_(src), a.reps) / 1e9
    f32 = src.view(torch.float32)
    out["host_read_GBs"] = src.numel() / best(lambda: f32.sum(), a.reps) / 1e9
    del dst

    rng = np.random.default_rng(0)
    packs, file_bytes = {}, {}
    for name, (n, k) in SHAPES.items():
        w = rng.standard_normal((n, k), dtype=np.float32) * 0.02
        raw = quantize(w, a.format)
        packs[name] = PackedLinear(raw, a.format, (n, k))
        file_bytes[name] = raw.nbytes
    x = torch.randn(1, 4096)
    x14 = torch.randn(1, 14336)
    prod = {}
    for name, p in packs.items():
        xx = x14 if p.k == 14336 else x
        t = best(lambda: p(xx), a.reps)
        prod[name] = {"us": t * 1e6, "file_GBs": file_bytes[name] / t / 1e9, "packed_GBs": p.nbytes / t / 1e9}
    out["cpu_products"] = prod
    # what torch's other CPU kernels take for the largest shape (per-channel int8, bf16)
    n, k = SHAPES["gate|up"]
    xb = x.to(torch.bfloat16)
    q8 = torch.randint(-127, 127, (n, k), dtype=torch.int8)
    sc = torch.rand(n, dtype=torch.bfloat16)
    t = best(lambda: torch.ops.aten._weight_int8pack_mm(xb, q8, sc), a.reps)
    out["int8pack_gate_up_GBs"] = n * k / t / 1e9
    wb = torch.randn(n, k, dtype=torch.bfloat16)
    t = best(lambda: torch.nn.functional.linear(xb, wb), a.reps)
    out["bf16_gate_up_GBs"] = 2 * n * k / t / 1e9
    del q8, wb
    layer = sum(file_bytes.values())
    layer_t = sum(v["us"] for v in prod.values()) * 1e-6
    out["cpu_layer_GBs"] = layer / layer_t / 1e9

    if torch.cuda.is_available():
        dev = torch.device("cuda:0")
        h = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
        d = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        s = torch.cuda.Stream(dev)

        def up(n=4):
            with torch.cuda.stream(s):
                for _ in range(n):
                    d.copy_(h, non_blocking=True)
            s.synchronize()

        def down(n=4):
            with torch.cuda.stream(s):
                for _ in range(n):
                    h.copy_(d, non_blocking=True)
            s.synchronize()
        out["h2d_GBs"] = 4 * h.numel() / best(up, a.reps) / 1e9
        out["d2h_GBs"] = 4 * h.numel() / best(down, a.reps) / 1e9
        # both at once: the CPU multiplies its layer shapes in a loop while the link copies
        stop = threading.Event()
        done = [0.0, 0]

        def cpu_loop():
            t = time.perf_counter()
            while not stop.is_set():
                for name, p in packs.items():
                    p(x14 if p.k == 14336 else x)
                done[1] += 1
            done[0] = time.perf_counter() - t
        th = threading.Thread(target=cpu_loop)
        th.start()
        time.sleep(0.2)
        t_up = best(lambda: up(8), a.reps)
        stop.set()
        th.join()
        out["h2d_with_cpu_GBs"] = 8 * h.numel() / t_up / 1e9
        out["cpu_layer_with_h2d_GBs"] = done[1] * layer / done[0] / 1e9
        out["gpu"] = torch.cuda.get_device_name(dev)

    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
