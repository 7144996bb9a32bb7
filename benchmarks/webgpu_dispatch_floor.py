"""The GPU's cost of a dispatch through WebGPU, apart from its work: N tiny dispatches in one
compute pass between two timestamps.

    python benchmarks/webgpu_dispatch_floor.py [-n 160] [--groups 1,132,1024]

Each dispatch runs `groups` workgroups of 64 threads that add 1 to a word each; "chain": every
dispatch writes the same buffer (wgpu puts a barrier between them, as between a decode token's
kernels, each reading what the last wrote); "independent": each its own buffer (no barrier
needed: what the pass costs without the ordering). A decode token of a small model is ~80-150
such dispatches, so the floor times the count is a bound its kernels cannot beat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SRC = """@group(0) @binding(0) var<storage, read_write> b: array<u32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) { b[g.x] = b[g.x] + 1u; }"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=160)
    ap.add_argument("--groups", default="1,132,1024")
    args = ap.parse_args()
    from edgellm.backends.webgpu.device import get_device
    from edgellm.backends.webgpu.launch import encode_dispatch, raw_pass_functions

    dev = get_device()
    if not dev.has_timestamps:
        sys.exit("the adapter has no timestamp queries")
    d, W = dev.device, dev.wgpu
    lay = dev.layout(("storage",))
    pipe = dev.pipeline(SRC, lay)
    raw = raw_pass_functions()
    qs = d.create_query_set(type=W.QueryType.timestamp, count=2)
    res = d.create_buffer(size=16, usage=W.BufferUsage.QUERY_RESOLVE | W.BufferUsage.COPY_SRC)
    print(f"device: {dev.describe()}")
    print("| dispatches | workgroups each | pattern | us per pass | us per dispatch |")
    print("|---:|---:|---|---:|---:|")
    for groups in (int(g) for g in args.groups.split(",")):
        size = 64 * 4 * groups
        bufs = [d.create_buffer(size=size, usage=W.BufferUsage.STORAGE) for _ in range(args.n)]
        for pattern in ("chain", "independent"):
            bgs = [d.create_bind_group(layout=lay, entries=[{"binding": 0, "resource": {
                "buffer": bufs[0 if pattern == "chain" else i], "offset": 0, "size": size}}]) for i in range(args.n)]
            times = []
            for rep in range(30):  # the first ones bring the clock up
                enc = d.create_command_encoder()
                cp = enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": 0,
                                                              "end_of_pass_write_index": 1})
                for bg in bgs:
                    encode_dispatch(cp, pipe, bg, (groups, 1, 1), raw)
                cp.end()
                enc.resolve_query_set(qs, 0, 2, res, 0)
                dev.queue.submit([enc.finish()])
                ts = np.frombuffer(dev.read(res, 0, 16), np.uint64)
                times.append(float(ts[1] - ts[0]) * 1e-3)
            us = statistics.median(times[10:])
            print(f"| {args.n} | {groups} | {pattern} | {us:.1f} | {us / args.n:.2f} |", flush=True)


if __name__ == "__main__":
    main()
