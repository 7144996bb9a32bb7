"""Where the webgpu decode GEMV loses its bandwidth: a probe on one adapter.

    python benchmarks/webgpu_probe.py [--shapes 4096x4096,14336x4096] [--formats Q8_0,Q4_0,F16]

1. read: the adapter's read bandwidth from one storage buffer (256 MB, vec4<u32> loads), the
   buffer bound read-only and read-write.
2. gemv: per format and shape, weights cycled through copies larger than the L2 cache, timed with
   timestamp queries: the backend's GEMV as it is (`cur`, weights bound read-only), the same
   source with the weights bound read-write (`cur_rw`), and the generated warp-per-rows GEMV
   (`kernels.gemv_warp`: 16-byte loads striding a row, x held in registers for R rows, subgroup
   reduction) for R = 1, 2, 4. Each checked against numpy on the same packed arrays.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_webgpu import _grid2, _random_packed  # noqa: E402


def read_bandwidth(dev, nbytes: int = 256 << 20) -> dict:
    from edgellm.backends.webgpu import kernels
    from edgellm.backends.webgpu.codegen import Binding
    from edgellm.backends.webgpu.launch import Launch

    out = {}
    a = dev.upload(np.random.default_rng(0).integers(0, 2**32, nbytes // 4, dtype=np.uint32))
    o = dev.buffer(4 * 1024 * 1024)
    groups = 132 * 16
    for kind in ("read", "storage"):
        src = (f"{kernels.STEP_STRUCT}\n"
               "@group(0) @binding(0) var<uniform> step: Step;\n"
               f"@group(0) @binding(1) var<storage, {'read' if kind == 'read' else 'read_write'}> A: array<vec4<u32>>;\n"
               "@group(0) @binding(2) var<storage, read_write> O: array<u32>;\n"
               "@compute @workgroup_size(256)\n"
               "fn main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {\n"
               "    let n = arrayLength(&A); let stride = nwg.x * 256u;\n"
               "    var acc = vec4<u32>(0u);\n"
               "    for (var i = g.x; i < n; i += stride) { acc = acc ^ A[i]; }\n"
               "    if (acc.x == 0x12345678u) { O[g.x] = acc.y; }\n}\n")
        k = kernels.Kernel("read", src, (kernels.STEP, Binding("A", "array<vec4<u32>>", kind), Binding("O", "array<u32>")), 256)
        L = Launch(dev, k, {"A": a, "O": o})
        t = L.time((groups, 1, 1), repeat=10)
        out[kind] = nbytes / t / 1e9
    return out


def _read_write(k):
    """The same kernel with its read-only weight bindings declared read-write (as before 2026-11-24)."""
    from dataclasses import replace

    from edgellm.backends.webgpu import kernels

    src, binds = k.source, []
    for i, b in enumerate(k.bindings):
        if b.kind == "read":
            src = src.replace(f"@binding({i}) var<storage, read>", f"@binding({i}) var<storage, read_write>")
            b = replace(b, kind="storage")
        binds.append(b)
    return kernels.Kernel(k.name, src, tuple(binds), k.workgroup)


def _variant(k, what: str):
    """Diagnostic variants of a gemv_warp kernel: 'xro' x bound read-only, 'nox' x replaced by
    constants (weight loads only), 'now' weight loads replaced by values made from indices."""
    import re
    from dataclasses import replace

    from edgellm.backends.webgpu import kernels

    src, binds = k.source, list(k.bindings)
    if what == "xro":
        src = re.sub(r"fn X_st\(.*\n", "", src)
        for i, b in enumerate(binds):
            if b.name in ("X", "X_v4"):
                src = src.replace(f"@binding({i}) var<storage, read_write>", f"@binding({i}) var<storage, read>")
                binds[i] = replace(b, kind="read")
    elif what == "nox":
        src = re.sub(r"let x(\d+)_(\d+) = X_ld4\([^;]*\);", r"let x\1_\2 = vec4<f32>(f32(v) * 1e-3, 1.0, 0.5, 0.25);", src)
    elif what == "u8":  # nibbles through unpack4xU8 and a float conversion instead of the mantissa trick
        src = re.sub(r"fn lo4\(.*?\n}\n", "fn lo4(w: u32, off: f32) -> vec4<f32> { return vec4<f32>(unpack4xU8(w & 0x0F0F0F0Fu)) - vec4<f32>(off - 8388608.0); }\n", src, flags=re.S)
        src = re.sub(r"fn hi4\(.*?\n}\n", "fn hi4(w: u32, off: f32) -> vec4<f32> { return vec4<f32>(unpack4xU8((w >> 4u) & 0x0F0F0F0Fu)) - vec4<f32>(off - 8388608.0); }\n", src, flags=re.S)
        src = re.sub(r"fn i8x4\(.*?\n}\n", "fn i8x4(w: u32) -> vec4<f32> { return vec4<f32>(unpack4xI8(w)); }\n", src, flags=re.S)
    elif what == "now":
        src = re.sub(r"let q(\d+)_(\d+) = W_qs\(rw\d+, (v\d+)\);", r"let q\1_\2 = vec4<u32>(\3 * 2654435761u, \3, \3 ^ 5u, \3 + 7u);", src)
    return kernels.WarpKernel(k.name, src, tuple(binds), k.workgroup, rows_per_group=k.rows_per_group)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--formats", default="Q8_0,Q4_0,F16")
    ap.add_argument("--bandwidth", type=float, default=3.0e12)
    ap.add_argument("--mb", type=int, default=256, help="weight copies cycled through, MB in all")
    ap.add_argument("--rows", default="1,2,4", help="gemv_warp rows per warp")
    ap.add_argument("--wgs", default="128,256", help="gemv_warp workgroup sizes")
    ap.add_argument("--sg", type=int, default=32, help="gemv_warp lanes per row (the adapter's subgroup size or less)")
    ap.add_argument("--unrolls", default="4", help="gemv_warp units loaded ahead per lane")
    ap.add_argument("--diag-rows", default="", help="rows per warp of the diagnostic variants (xro, nox, now)")
    ap.add_argument("--diags", default="xro,nox,now,u8", help="diagnostic variants")
    args = ap.parse_args()
    args.diags = args.diags.split(",")
    args.rows, args.wgs, args.unrolls, args.diag_rows = ([int(v) for v in a.split(",") if v] for a in (
        args.rows, args.wgs, args.unrolls, args.diag_rows))

    from edgellm.backends.webgpu import codegen, kernels, tuning
    from edgellm.backends.webgpu.backend import DeviceWeight
    from edgellm.backends.webgpu.device import get_device
    from edgellm.backends.webgpu.launch import Launch, read_f32, upload_f32

    dev = get_device()
    print(dev.describe(), "subgroup", dev.info.subgroup_min, dev.info.subgroup_max, flush=True)
    print("read GB/s", json.dumps({k: round(v) for k, v in read_bandwidth(dev, args.mb << 20).items()}), flush=True)
    rng = np.random.default_rng(0)
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            n_out, n_in = (int(s) for s in shape.split("x"))
            p = _random_packed(fmt, n_out, n_in, rng)
            ref_w = codegen.dequantize_packed(p).astype(np.float64)
            copies = max(1, min(32, -(-(args.mb << 20) // p.nbytes)))
            ws = [DeviceWeight(p, dev) for _ in range(copies)]
            xh = rng.standard_normal(n_in, dtype=np.float32)
            ref = ref_w @ xh.astype(np.float64)
            x = upload_f32(dev, xh)
            y = dev.buffer(4 * n_out)
            bufs = [{**{k: b for k, (b, _, _) in w.resources().items()}, "X": x, "Y": y} for w in ws]
            variants = []
            os.environ["EDGELLM_WEBGPU_GEMV"] = "block"
            cfg = tuning.default_gemv_config(dev, n_in)
            del os.environ["EDGELLM_WEBGPU_GEMV"]
            cur = kernels.gemv(ws[0].desc(), n_out, "step.seq", **cfg)
            grid = (*_grid2(-(-n_out // cfg["rows_per_wg"]), dev.max_groups), 1)
            variants += [("cur", cur, grid), ("cur_rw", _read_write(cur), grid)]
            if hasattr(kernels, "gemv_warp"):
                for r, wg, u in ((r, wg, u) for r in args.rows for wg in args.wgs for u in args.unrolls):
                        kw = kernels.gemv_warp(ws[0].desc(), n_out, "step.seq", rows_per_warp=r, wg=wg, unroll=u,
                                               subgroup=dev.has_subgroups, sg=args.sg)
                        g = (*_grid2(-(-n_out // kw.rows_per_group), dev.max_groups), 1)
                        variants.append((f"warp_r{r}_wg{wg}_u{u}", kw, g))
                        if wg == args.wgs[0] and u == args.unrolls[0] and r in args.diag_rows:
                            variants += [(f"warp_r{r}_{v}", _variant(kw, v), g) for v in args.diags]
            for name, k, grid in variants:
                row = {"fmt": fmt, "shape": shape, "kernel": name}
                try:
                    L = Launch(dev, k, bufs)
                    L.set_step(seq=1)
                    dev.write(y, np.full(n_out, np.nan, np.float32))
                    L.run(grid)
                    got = read_f32(dev, y, n_out)
                    row["max_rel_err"] = float(np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-30))
                    t = L.time(grid, repeat=4 * copies)
                    row.update(us=round(t * 1e6, 2), GBps=round(p.nbytes / t / 1e9), pct=round(100 * p.nbytes / t / args.bandwidth, 1))
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print("gemv", json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
