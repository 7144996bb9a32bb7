"""The native Q8_0 decode kernel (edgellm/backends/cpu_native.c) on the host: builds of it with
other compile-time tunables, weights in three kinds of memory, several thread counts.

    python benchmarks/native_probe.py [--variants 'base:;pf512:-DPREFETCH_BYTES=512'] \
        [--memory anon,mmap,huge] [--threads 16,12,8] [--cycle-gb 1.4] [--json FILE]

Each row: one token (M = 1) through the Llama-3.1-8B layer's products (q|k|v, o, gate|up, down),
cycling through copies of the layer larger together than the last-level cache, in GB/s of the
file's bytes (best of --reps passes); beside it the rate at which torch sums the same bytes (a
plain read of that memory). Memory: anon = malloc'd (numpy), mmap = the file's pages mapped
read-only (as cpu-fast reads a model), huge = anonymous memory advised to use huge pages.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_probe import best  # noqa: E402  (this folder's)

SHAPES = {"q|k|v": (6144, 4096), "o": (4096, 4096), "gate|up": (28672, 4096), "down": (4096, 14336)}


def random_q8_0(n: int, k: int, rng):
    """Random codes with one small positive fp16 scale per block (values do not change the time)."""
    import numpy as np

    raw = rng.integers(-127, 128, size=(n, k // 32 * 34), dtype=np.int8).view(np.uint8)
    blocks = raw.reshape(n, k // 32, 34)
    blocks[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="base:;pf256:-DPREFETCH_BYTES=256;pf512:-DPREFETCH_BYTES=512;"
                                          "pf1024:-DPREFETCH_BYTES=1024;rows64:-DROWS_PER_TASK=64")
    ap.add_argument("--memory", default="anon,mmap,huge")
    ap.add_argument("--threads", default=None, help="comma-separated (default: the physical cores)")
    ap.add_argument("--cycle-gb", type=float, default=1.4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import warnings

    import numpy as np
    import torch

    from edgellm.backends import cpu_native

    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    from edgellm.backends.cpu_fast import physical_cores
    from edgellm.bench.device import cpu_name

    threads = [int(t) for t in a.threads.split(",")] if a.threads else [physical_cores()]
    rng = np.random.default_rng(0)
    layer = {name: random_q8_0(n, k, rng) for name, (n, k) in SHAPES.items()}
    layer_bytes = sum(r.nbytes for r in layer.values())
    copies = max(1, int(-(-a.cycle_gb * 1e9 // layer_bytes)))
    tmpdir = tempfile.mkdtemp(prefix="native-probe-")

    def place(kind: str, c: int, name: str, raw):
        if kind == "anon":
            return raw.copy()
        if kind == "huge":
            mm = mmap.mmap(-1, raw.nbytes + (2 << 20))
            if hasattr(mmap, "MADV_HUGEPAGE"):
                mm.madvise(mmap.MADV_HUGEPAGE)
            arr = np.frombuffer(mm, np.uint8, raw.nbytes).reshape(raw.shape)
            arr[...] = raw
            return arr
        path = os.path.join(tmpdir, f"{c}-{name.replace('|', '_')}.bin")
        raw.tofile(path)
        return np.memmap(path, np.uint8, "r", shape=raw.shape)

    mems = {}
    for kind in a.memory.split(","):
        mems[kind] = [{name: place(kind, c, name, raw) for name, raw in layer.items()} for c in range(copies)]
    x = {4096: torch.randn(1, 4096), 14336: torch.randn(1, 14336)}
    out = {"cpu": cpu_name(), "copies": copies, "layer_GB": layer_bytes / 1e9, "rows": []}
    print(f"{out['cpu']}; {copies} copies of the 8B layer ({copies * layer_bytes / 1e9:.2f} GB) per memory kind")
    print(f"{'variant':<10} {'memory':<6} {'threads':>7} {'GB/s':>7} {'torch sum GB/s':>15}")
    for vname, flags in (v.split(":", 1) for v in a.variants.split(";")):
        lib = cpu_native.variant(flags.split())
        for kind, cs in mems.items():
            prods = [{name: cpu_native.NativeRows([arr], SHAPES[name][1], lib=lib) for name, arr in c.items()} for c in cs]
            # int64 sums (torch's int8 and int32 sums are not vectorised): a plain read of the memory
            tensors = [torch.frombuffer(arr, dtype=torch.int64) for c in cs for arr in c.values()]
            for t in threads:
                torch.set_num_threads(t)

                def one_token():
                    for ps in prods:
                        for name, p in ps.items():
                            p(x[SHAPES[name][1]])
                gbs = copies * layer_bytes / best(one_token, a.reps) / 1e9

                def read():
                    for tt in tensors:
                        tt.sum()
                rd = copies * layer_bytes / best(read, a.reps) / 1e9
                print(f"{vname:<10} {kind:<6} {t:>7} {gbs:>7.1f} {rd:>15.1f}", flush=True)
                out["rows"].append({"variant": vname, "flags": flags, "memory": kind, "threads": t,
                                    "GBs": gbs, "torch_sum_GBs": rd})
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
