"""Whether WGSL cooperative matrices (wgpu-native's experimental `wgpu_cooperative_matrix`, naga's
`coop_mat8x8` / `coop_mat16x16`) work on this adapter, with which element types and layouts, and how
fast a plain matrix product through them runs.

    python benchmarks/webgpu_coopmat_probe.py [--size 4096] [--reps 20]

For each tile type (8x8 f32; 16x16 f16 inputs with f32 and f16 accumulators): compile a one-tile
product, run it on random tiles with each of coopLoad/coopLoadT for A and B, and say which layout
each load reads (row- or column-major) by comparing with numpy's product in float64. Then a GEMM
C[M,N] = A[M,K] B[K,N] (A row-major, B read as W[N,K] row-major, as a linear layer's weight is
stored) with one subgroup per 64 x 64 block of C, loads straight from global memory, timed over
--reps dispatches: TFLOPS, against the fp32 non-tensor peak. Prints a table; exits 0 either way.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TILE_SRC = """enable f16;
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read> a: array<{ab}>;
@group(0) @binding(1) var<storage, read> b: array<{ab}>;
@group(0) @binding(2) var<storage, read_write> c: array<{cc}>;
@compute @workgroup_size({sg})
fn main() {{
    let s = {n}u;
    let ma = {la}<coop_mat{n}x{n}<{ab}, A>>(&a[0], s);
    let mb = {lb}<coop_mat{n}x{n}<{ab}, B>>(&b[0], s);
    var mc = coop_mat{n}x{n}<{cc}, C>();
    mc = coopMultiplyAdd(ma, mb, mc);
    coopStoreT(mc, &c[0], s);
}}
"""

# a subgroup's 64 x 64 block of C: 4 x 4 fragments of 16 x 16, K in steps of 16, loads from global
GEMM_SRC = """enable f16;
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read> a: array<f16>;
@group(0) @binding(1) var<storage, read> w: array<f16>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
const K: u32 = {K}u;
const N: u32 = {N}u;
@compute @workgroup_size({sg})
fn main(@builtin(workgroup_id) g: vec3<u32>) {{
    let m0 = g.y * 64u;
    let n0 = g.x * 64u;
{decl}
    for (var k = 0u; k < K; k += 16u) {{
{body}
    }}
{store}
}}
"""


def gemm_source(K: int, N: int, sg: int, la: str, lb: str) -> str:
    decl = "\n".join(f"    var c{i}{j} = coop_mat16x16<f32, C>();" for i in range(4) for j in range(4))
    body = []
    for i in range(4):
        body.append(f"        let a{i} = {la}<coop_mat16x16<f16, A>>(&a[(m0 + {16 * i}u) * K + k], K);")
    for j in range(4):
        body.append(f"        let b{j} = {lb}<coop_mat16x16<f16, B>>(&w[(n0 + {16 * j}u) * K + k], K);")
    for i in range(4):
        for j in range(4):
            body.append(f"        c{i}{j} = coopMultiplyAdd(a{i}, b{j}, c{i}{j});")
    store = "\n".join(f"    coopStoreT(c{i}{j}, &c[(m0 + {16 * i}u) * N + n0 + {16 * j}u], N);"
                      for i in range(4) for j in range(4))
    return GEMM_SRC.format(K=K, N=N, sg=sg, decl=decl, body="\n".join(body), store=store)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from edgellm.backends.webgpu.device import import_wgpu

    wgpu = import_wgpu()
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    info = adapter.info
    print(f"adapter: {info.get('device', '')} ({info.get('backend_type', '')}, {info.get('description', '')})")
    feats = sorted(adapter.features)
    print("features:", ", ".join(feats))
    if "cooperative-matrix" not in feats:
        print("no cooperative-matrix feature on this adapter")
        return
    want = [f for f in ("shader-f16", "subgroup", "cooperative-matrix", "timestamp-query") if f in feats]
    lim = adapter.limits
    dev = adapter.request_device_sync(required_features=want, required_limits={
        k: lim[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size") if k in lim})
    sg = 32
    U = wgpu.BufferUsage
    rng = np.random.default_rng(0)

    def run(src: str, arrays: list[np.ndarray], out_bytes: int, groups=(1, 1, 1), reps: int = 1):
        m = dev.create_shader_module(code=src)
        pipe = dev.create_compute_pipeline(layout="auto", compute={"module": m, "entry_point": "main"})
        bufs = [dev.create_buffer_with_data(data=x.tobytes(), usage=U.STORAGE) for x in arrays]
        out = dev.create_buffer(size=out_bytes, usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)
        dev.queue.write_buffer(out, 0, np.full(out_bytes // 4, np.nan, np.float32).tobytes())
        bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
            {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}} for i, b in enumerate(bufs + [out])])

        def go(n):
            enc = dev.create_command_encoder()
            cp = enc.begin_compute_pass()
            cp.set_pipeline(pipe)
            cp.set_bind_group(0, bg)
            for _ in range(n):
                cp.dispatch_workgroups(*groups)
            cp.end()
            dev.queue.submit([enc.finish()])
            return dev.queue.read_buffer(out, 0, 16)

        go(1)
        t = 0.0
        if reps > 1:
            go(2)
            t0 = time.perf_counter()
            go(reps)
            t = (time.perf_counter() - t0) / reps
        return np.frombuffer(dev.queue.read_buffer(out), np.uint8), t

    print("\n| tile | A, B, C | A load | B load | result | max rel err |")
    print("|---|---|---|---|---|---:|")
    for n, ab, cc in ((8, "f32", "f32"), (16, "f16", "f32"), (16, "f16", "f16"), (8, "f16", "f32")):
        npab = np.float16 if ab == "f16" else np.float32
        npcc = np.float16 if cc == "f16" else np.float32
        A = rng.standard_normal((n, n)).astype(npab)
        B = rng.standard_normal((n, n)).astype(npab)
        for la in ("coopLoad", "coopLoadT"):
            for lb in ("coopLoad", "coopLoadT"):
                src = TILE_SRC.format(ab=ab, cc=cc, sg=sg, n=n, la=la, lb=lb)
                try:
                    raw, _ = run(src, [A, B], n * n * np.dtype(npcc).itemsize)
                except Exception as e:  # noqa: BLE001 - what the driver or naga says is the result
                    msg = " ".join(str(e).split())[:160]
                    print(f"| {n}x{n} | {ab},{ab},{cc} | {la} | {lb} | error: {msg} | |")
                    continue
                C = raw.view(npcc).astype(np.float64).reshape(n, n)
                A64, B64 = A.astype(np.float64), B.astype(np.float64)
                best = None
                for name, ref in (("A B", A64 @ B64), ("A^T B", A64.T @ B64), ("A B^T", A64 @ B64.T),
                                  ("A^T B^T", A64.T @ B64.T), ("(A B)^T", (A64 @ B64).T),
                                  ("(A^T B)^T", (A64.T @ B64).T), ("(A B^T)^T", (A64 @ B64.T).T),
                                  ("(A^T B^T)^T", (A64.T @ B64.T).T)):
                    err = float(np.max(np.abs(C - ref)) / np.max(np.abs(ref)))
                    if best is None or err < best[1]:
                        best = (name, err)
                ok = best[1] < 2e-2 and np.isfinite(C).all()
                print(f"| {n}x{n} | {ab},{ab},{cc} | {la} | {lb} | "
                      f"{'C = ' + best[0] if ok else 'wrong (closest ' + best[0] + ')'} | {best[1]:.2e} |")

    S = args.size
    print(f"\nGEMM {S} x {S} x {S}, f16 inputs, f32 accumulators, a subgroup per 64 x 64 block, loads from global:")
    print("| A load | B load | ms | TFLOPS | max rel err (256 rows) |")
    print("|---|---|---:|---:|---:|")
    X = (rng.standard_normal((S, S)) * 0.5).astype(np.float16)
    W = (rng.standard_normal((S, S)) * 0.5).astype(np.float16)
    ref = X[:256].astype(np.float64) @ W.astype(np.float64).T
    for la in ("coopLoadT", "coopLoad"):
        for lb in ("coopLoad", "coopLoadT"):
            try:
                raw, t = run(gemm_source(S, S, sg, la, lb), [X, W], S * S * 4, groups=(S // 64, S // 64, 1),
                             reps=args.reps)
            except Exception as e:  # noqa: BLE001
                print(f"| {la} | {lb} | error: {' '.join(str(e).split())[:160]} | | |")
                continue
            C = raw.view(np.float32).reshape(S, S)[:256].astype(np.float64)
            err = float(np.max(np.abs(C - ref)) / np.max(np.abs(ref)))
            print(f"| {la} | {lb} | {t * 1e3:.3f} | {2 * S ** 3 / t / 1e12:.1f} | {err:.2e} |")


if __name__ == "__main__":
    main()
