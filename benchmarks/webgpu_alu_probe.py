"""The arithmetic peaks a WGSL kernel reaches on this adapter: f32 fused multiply-adds, f16 ones
(vec4<f16>, where the adapter has shader-f16) and packed int8 dot products (dot4I8Packed, four
multiply-adds each), in operations per second. The limits the prefill matrix products are quoted
against (benchmarks/bench_webgpu.py's gemm section), and the measure of whether int8 products can
beat float ones on this adapter (a driver that lowers dot4I8Packed to a packed instruction: NVIDIA's
DP4A; one without emulates it in shifts and multiplies).

    python benchmarks/webgpu_alu_probe.py [--iters 4096] [--json out.json]

Each thread runs `iters` steps of 8 independent accumulations (no dependent chain shorter than
8), the result written so the compiler keeps it; the output is checked against numpy on the
host (every element written, the same value). Prints a table; exits 0 either way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BODIES = {
    # (element type of the accumulators, their initial value, one step's statement per accumulator,
    #  multiply-adds per accumulator per step)
    "f32 fma (vec4)": ("vec4<f32>", "vec4<f32>(f32(i) * 1e-3)", "a{j} = fma(a{j}, m, c);", 4),
    "f16 fma (vec4<f16>)": ("vec4<f16>", "vec4<f16>(f16(i & 7u) * 0.125h)", "a{j} = fma(a{j}, mh, ch);", 4),
    "int8 dot4I8Packed": ("i32", "i32(i)", "a{j} = a{j} + dot4I8Packed(u{j}, v);", 4),
}

SRC = """{enable}
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@group(0) @binding(1) var<uniform> p: vec4<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    let i = gid.x;
    let m = vec4<f32>(bitcast<f32>(p.y)); let c = vec4<f32>(bitcast<f32>(p.z));
    {f16lets}
    let v = p.w ^ i;
    {decls}
    for (var n = 0u; n < p.x; n++) {{
        {steps}
    }}
    out[i] = {total};
}}
"""


def source(kind: str) -> str:
    ty, init, step, _ = BODIES[kind]
    f16 = "f16" in kind
    decls = " ".join(f"var a{j} = {init.replace('(i', f'(i + {j}u')};" for j in range(8))
    if "int8" in kind:
        decls += " " + " ".join(f"let u{j} = i * {2654435761 + 2 * j}u;" for j in range(8))
    steps = " ".join(step.format(j=j) for j in range(8))
    if ty.startswith("vec4"):
        total = " + ".join(f"dot(vec4<f32>(a{j}), vec4<f32>(1.0))" for j in range(8))
    else:
        total = " + ".join(f"f32(a{j})" for j in range(8))
    return SRC.format(enable="enable f16;" if f16 else "", decls=decls, steps=steps, total=total,
                      f16lets="let mh = vec4<f16>(m); let ch = vec4<f16>(c);" if f16 else "")


def reference(kind: str, n_threads: int, iters: int, m: float, c: float, w: int) -> np.ndarray:
    """The kernel's output computed on the host (f32 / f16 by numpy, int8 dots in int64 wrapped to i32)."""
    i = np.arange(n_threads, dtype=np.uint64)
    out = np.zeros(n_threads, np.float64)
    if "int8" in kind:
        v = (np.uint64(w) ^ i).astype(np.uint32)
        vb = v.view(np.uint8).reshape(-1, 4).view(np.int8).astype(np.int64)
        for j in range(8):
            u = (i * np.uint64(2654435761 + 2 * j)).astype(np.uint32)
            ub = u.view(np.uint8).reshape(-1, 4).view(np.int8).astype(np.int64)
            d = (ub * vb).sum(1)
            acc = (i.astype(np.int64) + j + iters * d) & 0xFFFFFFFF
            out += np.where(acc >= 2**31, acc - 2**32, acc)
        return out
    if "f16" in kind:
        return None  # f16 rounding per step: checked for finiteness only
    for j in range(8):
        a = ((i + np.uint64(j)).astype(np.float32) * np.float32(1e-3))
        for _ in range(iters):
            a = (a * np.float32(m) + np.float32(c)).astype(np.float32)
        out += 4.0 * a
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=4096)
    ap.add_argument("--groups", type=int, default=0, help="workgroups (default: 64 per compute unit guess, 8448)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from edgellm.backends.webgpu.codegen import Binding
    from edgellm.backends.webgpu.device import get_device
    from edgellm.backends.webgpu.kernels import Kernel
    from edgellm.backends.webgpu.launch import Launch

    dev = get_device()
    groups = args.groups or 8448
    n = groups * 256
    m, c, w = 0.999, 1e-4, 0x5A3C9617
    rows = []
    for kind, (_, _, _, macs) in BODIES.items():
        row = {"kind": kind}
        try:
            if "f16" in kind and "shader-f16" not in dev.features:
                raise RuntimeError("no shader-f16 on this adapter")
            k = Kernel("alu", source(kind), (Binding("out", "array<f32>"), Binding("p", "vec4<u32>", "uniform")), 256)
            out = dev.buffer(4 * n)
            L = Launch.__new__(Launch)  # bind the probe's own two buffers (no Step uniform)
            L.dev, L.kernel = dev, k
            L.step_buf = dev.buffer(16, uniform=True)
            dev.write(L.step_buf, np.array([args.iters, np.float32(m).view(np.uint32), np.float32(c).view(np.uint32), w],
                                           np.uint32))
            layout = dev.layout(k.kinds)
            L.pipeline = dev.pipeline(k.source, layout)
            L.bind_groups = [dev.device.create_bind_group(layout=layout, entries=[
                {"binding": 0, "resource": {"buffer": out, "offset": 0, "size": 4 * n}},
                {"binding": 1, "resource": {"buffer": L.step_buf, "offset": 0, "size": 16}}])]
            L.bind_group = L.bind_groups[0]
            t = L.time((groups, 1, 1), repeat=5)
            got = np.frombuffer(dev.read(out, 0, 4 * n), np.float32).astype(np.float64)
            want = reference(kind, n, args.iters, m, c, w)
            ok = bool(np.isfinite(got).all()) and (want is None or np.allclose(got, want, rtol=2e-3, atol=1e-2 * np.abs(want).max()))
            ops = 2.0 * n * args.iters * 8 * macs
            row.update(ms=t * 1e3, Tops=ops / t / 1e12, correct=ok)
        except Exception as e:  # noqa: BLE001 - a type the adapter lacks
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| operation | Tops/s (2 per multiply-add) | correct |\n|---|---:|---|")
    for r in rows:
        print(f"| {r['kind']} | {r.get('Tops', float('nan')):.1f} | {r.get('correct', r.get('error'))} |")
    print(f"({dev.info.name}, {n} threads x {args.iters} steps)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"adapter": dev.info.name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
