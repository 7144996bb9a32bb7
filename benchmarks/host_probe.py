"""What the host side of a GPU + CPU split can move: memory bandwidth, cpu-fast's products, and
the PCIe link, alone and at the same time (issue 18's split runs on these three).

    python benchmarks/host_probe.py [--threads N] [--format Q8_0] [--json FILE]

Rows (GB/s of the bytes each moves; best of --reps):
- host copy / host read: a 1 GiB torch copy (read + write counted) and an int8 sum (read) with the
  threads given (default: the physical cores, as cpu-fast uses);
- cpu-fast product: cpu-fast's PackedLinear (torch's kernels) and, for Q8_0, the native kernel
  (edgellm/backends/cpu_native.c) for the Llama-3.1-8B layer shapes, one token (M = 1), in the
  format's file bytes per second (what a CPU-held layer streams per token), cycling through copies
  of the layer larger together than the last-level cache (--cycle-gb);
- pinned H2D / D2H: 256 MiB copies between pinned host memory and the GPU on a side stream;
- H2D while the CPU multiplies: the same copies with the products (native where built) running
  on the CPU threads, both rates (the two share the host's memory).
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
    ap.add_argument("--cycle-gb", type=float, default=1.2,
                    help="the products cycle through copies of the layer this large together (DRAM, not L3)")
    a = ap.parse_args()

    import numpy as np
    import torch

    from edgellm.backends import cpu_native as native
    from edgellm.backends.cpu_fast import PackedLinear, physical_cores
    from edgellm.bench.device import cpu_name
    from edgellm.quant import quantize

    threads = a.threads or physical_cores()
    torch.set_num_threads(threads)
    out: dict = {"threads": threads, "cpu": cpu_name(), "format": a.format}

    src = torch.empty(1 << 30, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    out["host_copy_GBs"] = 2 * src.numel() / best(lambda: dst.copy_(src), a.reps) / 1e9
    f32 = src.view(torch.float32)
    out["host_read_GBs"] = src.numel() / best(lambda: f32.sum(), a.reps) / 1e9
    del dst

    rng = np.random.default_rng(0)
    raws, file_bytes = {}, {}
    for name, (n, k) in SHAPES.items():
        raws[name] = quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.02, a.format)
        file_bytes[name] = raws[name].nbytes
    layer = sum(file_bytes.values())
    # a decode step streams its CPU-held layers from DRAM: the products cycle through copies of
    # the layer larger together than the last-level cache (one copy could stay in a large L3)
    copies = max(1, -(-a.cycle_gb * 1e9 // layer))
    out["layer_copies"] = int(copies)
    native_ok = native.library() is not None
    out["native"] = "built" if native_ok else native.unavailable()
    layers = []
    for c in range(int(copies)):
        ps = {}
        for name, raw in raws.items():
            r = raw if c == 0 else raw.copy()
            n, k = SHAPES[name]
            ps[name] = (PackedLinear(r, a.format, (n, k)),
                        native.NativeRows([r], k) if native_ok and a.format == "Q8_0" else None)
        layers.append(ps)
    x = torch.randn(1, 4096)
    x14 = torch.randn(1, 14336)

    def run_layers(which: int, only: str | None = None):
        for ps in layers:
            for name, pair in ps.items():
                if only is None or name == only:
                    pair[which](x14 if pair[0].k == 14336 else x)

    kinds = [(0, "cpu_products", "packed")] + ([(1, "native_products", "native")] if layers[0]["o"][1] is not None else [])
    for which, key, _ in kinds:
        prod = {}
        for name in SHAPES:
            t = best(lambda: run_layers(which, name), a.reps) / len(layers)
            prod[name] = {"us": t * 1e6, "file_GBs": file_bytes[name] / t / 1e9}
            if which == 0:
                prod[name]["packed_GBs"] = layers[0][name][0].nbytes / t / 1e9
        out[key] = prod
        out[key.replace("products", "layer_GBs")] = layer * len(layers) / best(lambda: run_layers(which), a.reps) / 1e9
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
                run_layers(kinds[-1][0])
                done[1] += len(layers)
            done[0] = time.perf_counter() - t
        th = threading.Thread(target=cpu_loop)
        th.start()
        time.sleep(0.2)
        t_up = best(lambda: up(8), a.reps)
        stop.set()
        th.join()
        out["h2d_with_cpu_GBs"] = 8 * h.numel() / t_up / 1e9
        out[kinds[-1][1].replace("products", "layer_with_h2d_GBs")] = done[1] * layer / done[0] / 1e9
        out["gpu"] = torch.cuda.get_device_name(dev)

    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
