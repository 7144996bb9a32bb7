"""Where the webgpu decode GEMV loses its bandwidth: a probe on one adapter.

    python benchmarks/webgpu_probe.py [--shapes 4096x4096,14336x4096] [--formats Q8_0,Q4_0,F16]

1. read: the adapter's read bandwidth from one storage buffer (256 MB, vec4<u32> loads), the
   buffer bound read-only and read-write.
2. gemv: per format and shape, weights cycled through copies larger than the L2 cache, timed with
   timestamp queries: the backend's GEMV as it is (`cur`, weights bound read-only), the same
   source with the weights bound read-write (`cur_rw`), and the generated warp-per-rows GEMV
   (`kernels.gemv_warp`: 16-byte loads striding a row, x held in registers for R rows, subgroup
   reduction) for R = 1, 2, 4. Each checked against numpy on the same packed arrays. --stages,
   --pipes, --splits add x staged in workgroup memory, software-pipelined loads and several
   subgroups per row group (gemv_warp's stage, pipeline, split).
3. --pattern: the access pattern alone (pattern_probe: rows of 16-byte loads by one warp, with
   and without the F16 arithmetic, row-major or chunked, one row per warp or striding), the read
   kernel over buffers in turn and over ranges of one buffer.
4. --alloc: read bandwidth by the order buffers were made, then under sustained load
   (alloc_probe; 1 GiB bindings). This is where the GPU's idle clock showed (H200 through
   Vulkan, 2026-11-29: reads at 1.8 TB/s after a pause on the host, 4.4 after 0.3-0.4 s of
   load): run `nvidia-smi --query-gpu=clocks.sm --format=csv -lms 100` beside it.
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


def read_kernel(kind: str = "read"):
    """The read kernel: a fixed grid of threads strides a buffer A in vec4<u32> loads (bound
    read-only, or read-write with kind "storage"), XOR-ing them; O is written only on a value
    no buffer holds."""
    from edgellm.backends.webgpu import kernels
    from edgellm.backends.webgpu.codegen import Binding

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
    return kernels.Kernel("read", src, (kernels.STEP, Binding("A", "array<vec4<u32>>", kind), Binding("O", "array<u32>")), 256)


def read_bandwidth(dev, nbytes: int = 256 << 20, buffers: int = 1) -> dict:
    from edgellm.backends.webgpu.launch import Launch

    out = {}
    a = [dev.upload(np.random.default_rng(i).integers(0, 2**32, nbytes // 4, dtype=np.uint32)) for i in range(buffers)]
    o = dev.buffer(4 * 1024 * 1024)
    groups = 132 * 16
    for kind in ("read", "storage"):
        k = read_kernel(kind)
        L = Launch(dev, k, [{"A": b, "O": o} for b in a])
        t = L.time((groups, 1, 1), repeat=10 * buffers)
        out[kind] = nbytes / t / 1e9
    return out


def read_ranges(dev, nbytes: int, parts: int) -> float:
    """GB/s of the read kernel over `parts` ranges of one buffer of `nbytes`, bound in turn (a
    bind group per range, offsets into the one buffer), as weights sub-allocated from one arena."""
    import wgpu

    from edgellm.backends.webgpu import kernels
    from edgellm.backends.webgpu.launch import dynamic_offsets

    a = dev.upload(np.random.default_rng(0).integers(0, 2**32, nbytes // 4, dtype=np.uint32))
    o = dev.buffer(4 * 1024 * 1024)
    st = dev.buffer(kernels.STEP_BYTES, uniform=True)
    k = read_kernel()
    layout = dev.layout(k.kinds)
    pipe = dev.pipeline(k.source, layout)
    size = nbytes // parts
    bgs = [dev.device.create_bind_group(layout=layout, entries=[
        {"binding": 0, "resource": {"buffer": st, "offset": 0, "size": kernels.STEP_BYTES}},
        {"binding": 1, "resource": {"buffer": a, "offset": i * size, "size": size}},
        {"binding": 2, "resource": {"buffer": o, "offset": 0, "size": o.size}}]) for i in range(parts)]
    qs = dev.device.create_query_set(type=wgpu.QueryType.timestamp, count=2)
    qb = dev.device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    best = None
    for _ in range(2):
        enc = dev.device.create_command_encoder()
        cp = enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": 0,
                                                      "end_of_pass_write_index": 1})
        cp.set_pipeline(pipe)
        reps = 10 * parts
        for i in range(reps):
            cp.set_bind_group(0, bgs[i % parts], dynamic_offsets(k.kinds))
            cp.dispatch_workgroups(132 * 16, 1, 1)
        cp.end()
        enc.resolve_query_set(qs, 0, 2, qb, 0)
        dev.queue.submit([enc.finish()])
        t = np.frombuffer(dev.device.queue.read_buffer(qb), np.uint64)
        gbps = reps * size / (float(t[1] - t[0]) * 1e-9) / 1e9
        best = gbps if best is None else max(best, gbps)
    return best


def alloc_probe(dev, sustain: float = 8.0) -> None:
    """Read bandwidth of buffers by the order and the way they were made: a first 1 GB buffer,
    four 256 MB ones read alone and in turn, the first again, a second 1 GB one, one made empty
    then written (queue.write_buffer instead of create_buffer_with_data); then the first read
    again and again for `sustain` seconds. Timed without Launch.time's clock warm-up (as on
    2026-11-29, when the readings fell from 4.4 to 1.8 TB/s after pauses on the host, then rose
    back under the sustained reads: the GPU's idle clock, not the buffers)."""
    from edgellm.backends.webgpu import launch
    from edgellm.backends.webgpu.launch import Launch

    launch.CLOCK_WARMUP_S = 0.0
    k = read_kernel()
    o = dev.buffer(4 * 1024 * 1024)
    rng = np.random.default_rng(0)

    def gbps(bufs, label):
        L = Launch(dev, k, [{"A": b, "O": o} for b in bufs])
        t = L.time((132 * 16, 1, 1), repeat=40 * len(bufs))
        print(f"alloc {label}: {bufs[0].size / t / 1e9:.0f} GB/s", flush=True)

    a = dev.upload(rng.integers(0, 2**32, 1 << 28, dtype=np.uint32))
    gbps([a], "first 1 GB buffer")
    b = [dev.upload(rng.integers(0, 2**32, 1 << 26, dtype=np.uint32)) for _ in range(4)]
    gbps([b[0]], "a 256 MB buffer alone")
    gbps([b[1]], "another 256 MB buffer alone")
    gbps(b, "four 256 MB buffers in turn")
    gbps([a], "the first 1 GB buffer again")
    c = dev.upload(rng.integers(0, 2**32, 1 << 28, dtype=np.uint32))
    gbps([c], "a second 1 GB buffer")
    d = dev.buffer(1 << 30)
    dev.write(d, rng.integers(0, 2**32, 1 << 28, dtype=np.uint32))
    gbps([d], "a 1 GB buffer made empty, then written")
    gbps([a, c], "the two uploaded 1 GB buffers in turn")
    gbps([a], "the first 1 GB buffer, last")
    for x in [c, d, *b]:
        x.destroy()
    del c, d, b
    gbps([a], "the first 1 GB buffer, the others destroyed")
    import time

    t0 = time.perf_counter()  # the read kept going: does the GPU's clock come back up under load?
    while time.perf_counter() - t0 < sustain:
        gbps([a], f"sustained reads, {time.perf_counter() - t0:.1f} s")


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


_PATTERN = """
@group(0) @binding(1) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
const N: u32 = ${N}u; const RV: u32 = ${RV}u;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let lane = lid % 32u;
    var acc = 0.0;
    var bits = vec4<u32>(0u);
    for (var row = (wid.x + wid.y * nwg.x) * 8u + lid / 32u; row < N; row += ${ROWSTEP}) {
        for (var v = lane; v < RV; v += ${VSTEP}u) {
${BODY}
        }
    }
    acc += f32(bits.x ^ bits.y ^ bits.z ^ bits.w) * 1e-30;
    for (var s = 16u; s > 0u; s = s >> 1u) { acc += subgroupShuffleXor(acc, s); }
    if (lane == 0u && acc == 1.2345e-20) { Y[lid] = acc; }
}
"""


def pattern_probe(dev, shape: str, mb: int) -> None:
    """Access patterns of a warp-per-row GEMV over an F16 weight (rows x cols), against the flat
    read: rows of 16-byte loads by one warp (u loads in flight per lane), xor of the raw words
    (no x, no arithmetic) or an F16 dot with x; one row per warp or warps striding over rows
    (a fixed grid of 132 x 16 workgroups, as the read kernel has)."""
    from string import Template

    from edgellm.backends.webgpu import kernels
    from edgellm.backends.webgpu.codegen import Binding
    from edgellm.backends.webgpu.launch import Launch

    n, k = (int(v) for v in shape.split("x"))
    rv = k // 8  # vec4<u32> of halves per row (a multiple of 32 in the shapes probed)
    nbytes = n * k * 2
    copies = max(1, min(32, -(-(mb << 20) // nbytes)))
    rng = np.random.default_rng(1)
    ws = [dev.upload(rng.integers(0, 2**32, n * rv * 4, dtype=np.uint32) & np.uint32(0x3BFF3BFF)) for _ in range(copies)]
    x = dev.upload(rng.standard_normal(k).astype(np.float32))
    y = dev.buffer(4 * 1024)
    for mode, u, persist, chunk in [(m, u, p, c) for m in ("xor", "f16") for u in (1, 2, 4) for p in (False, True)
                                    for c in (False, True) if not (p and c)]:
            if True:
                lines = []
                for i in range(u):
                    vi = f"min(v + {32 * i}u, RV - 1u)"
                    # chunked: the weight stored as [RV / 32][N][32] vec4s (a warp's 512 bytes of each row
                    # beside the same 512 bytes of the next rows), read at the same logical place
                    idx = f"(({vi}) / 32u) * (N * 32u) + row * 32u + ({vi}) % 32u" if chunk else f"row * RV + {vi}"
                    lines.append(f"            let q{i} = W[{idx}];")
                for i in range(u):
                    if mode == "xor":
                        lines.append(f"            bits = bits ^ q{i};")
                    else:
                        c = f"min(v + {32 * i}u, RV - 1u)"
                        lo = f"vec4<f32>(unpack2x16float(q{i}.x), unpack2x16float(q{i}.y))"
                        hi = f"vec4<f32>(unpack2x16float(q{i}.z), unpack2x16float(q{i}.w))"
                        lines.append(f"            acc += dot({lo}, X[2u * {c}]) + dot({hi}, X[2u * {c} + 1u]);")
                groups = 132 * 16 if persist else -(-n // 8)
                src = Template(_PATTERN).substitute(N=n, RV=rv, VSTEP=32 * u, BODY="\n".join(lines),
                                                    ROWSTEP=f"{groups * 8}u" if persist else "N")
                src = kernels.STEP_STRUCT + "\n@group(0) @binding(0) var<uniform> step: Step;\n" + src
                k_ = kernels.Kernel("pattern", src, (kernels.STEP, Binding("W", "array<vec4<u32>>", "read"),
                                                      Binding("X", "array<vec4<f32>>", "read"),
                                                      Binding("Y", "array<f32>")), 256)
                name = f"{mode}_u{u}" + ("_persist" if persist else "") + ("_chunked" if chunk else "")
                try:
                    L = Launch(dev, k_, [{"W": w, "X": x, "Y": y} for w in ws])
                    t = L.time((*_grid2(groups, dev.max_groups), 1), repeat=4 * copies)
                    row = {"shape": shape, "kernel": name, "us": round(t * 1e6, 2), "GBps": round(nbytes / t / 1e9)}
                except Exception as e:  # noqa: BLE001
                    row = {"shape": shape, "kernel": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print("pattern", json.dumps(row), flush=True)


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
    ap.add_argument("--stages", default="0", help="gemv_warp x staged in workgroup memory: 0, 1 or 0,1")
    ap.add_argument("--pipes", default="0", help="gemv_warp software-pipelined loads: 0, 1 or 0,1")
    ap.add_argument("--splits", default="1", help="gemv_warp subgroups per row group")
    ap.add_argument("--int8", action="store_true", help="the int8 formats (kernels.INT8_FORMATS): each staged variant "
                    "also with int8 activations")
    ap.add_argument("--only-int8", action="store_true", help="with --int8: the int8 formats' float-x variants left out")
    ap.add_argument("--planes", default="1", help="int8 activation planes with --int8: 1, 2 or 1,2")
    ap.add_argument("--single", action="store_true", help="also time each variant on one weight copy, 10 dispatches "
                    "(as the tuner timed until 2026-11-30: a weight smaller than the L2 cache then stays in it)")
    ap.add_argument("--no-block", action="store_true", help="leave out kernels.gemv (cur, cur_rw)")
    ap.add_argument("--alloc", action="store_true", help="only read bandwidth by buffer order and making (alloc_probe)")
    ap.add_argument("--pattern", action="store_true", help="only the access-pattern kernels (pattern_probe), per shape")
    ap.add_argument("--clock-idle", type=float, default=0.0, help="Launch.time's CLOCK_IDLE_S: 0 warms the GPU's "
                    "clock before every timing (the host's compiles between timings let it fall)")
    ap.add_argument("--diag-rows", default="", help="rows per warp of the diagnostic variants (xro, nox, now)")
    ap.add_argument("--diags", default="xro,nox,now,u8", help="diagnostic variants")
    args = ap.parse_args()
    args.diags = args.diags.split(",")
    args.rows, args.wgs, args.unrolls, args.diag_rows, args.stages, args.pipes, args.splits, args.planes = (
        [int(v) for v in a.split(",") if v] for a in (
            args.rows, args.wgs, args.unrolls, args.diag_rows, args.stages, args.pipes, args.splits, args.planes))

    from edgellm.backends.webgpu import codegen, kernels, tuning
    from edgellm.backends.webgpu.backend import DeviceWeight
    from edgellm.backends.webgpu.device import get_device
    from edgellm.backends.webgpu.launch import Launch, read_f32, upload_f32

    from edgellm.backends.webgpu import launch
    launch.CLOCK_IDLE_S = args.clock_idle
    dev = get_device()
    print(dev.describe(), "subgroup", dev.info.subgroup_min, dev.info.subgroup_max, flush=True)
    print("read GB/s", json.dumps({k: round(v) for k, v in read_bandwidth(dev, args.mb << 20).items()}), flush=True)
    if args.alloc:
        alloc_probe(dev)
        return
    if args.pattern:
        for n in [n for n in (4, 16) if args.mb >= 64 * n]:  # the same bytes per dispatch from n buffers in turn
            print(f"read GB/s, {n} buffers of {args.mb // n} MB in turn",
                  json.dumps({k: round(v) for k, v in read_bandwidth(dev, (args.mb // n) << 20, n).items()}), flush=True)
        for n in [n for n in (1, 4, 16) if args.mb >= 64 * n]:
            gb = read_ranges(dev, args.mb << 20, n)
            print(f"read GB/s, {n} ranges of one {args.mb} MB buffer in turn", round(gb), flush=True)
        for shape in args.shapes.split(","):
            pattern_probe(dev, shape, args.mb)
        return
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
            if not args.no_block:
                variants += [("cur", cur, grid), ("cur_rw", _read_write(cur), grid)]
            if hasattr(kernels, "gemv_warp"):
                for r, wg, u, st, pp, sp in ((r, wg, u, st, pp, sp) for r in args.rows for wg in args.wgs
                                             for u in args.unrolls for st in args.stages for pp in args.pipes
                                             for sp in args.splits):
                        if wg % (args.sg * sp):
                            continue
                        if st and not tuning.can_stage(dev, n_in):  # float x does not fit staged: int8 may
                            kw, g, name = None, None, ""
                            for pl in (args.planes if args.int8 and fmt in kernels.INT8_FORMATS else ()):
                                if tuning.can_stage(dev, n_in, int8=True, planes=pl):
                                    ki = kernels.gemv_warp(ws[0].desc(), n_out, "step.seq", rows_per_warp=r, wg=wg,
                                                           unroll=u, subgroup=dev.has_subgroups, sg=args.sg, stage=True,
                                                           pipeline=bool(pp), split=sp, int8=True, planes=pl)
                                    variants.append((f"warp_r{r}_wg{wg}_u{u}_stage" + ("_pipe" if pp else "")
                                                     + (f"_split{sp}" if sp > 1 else "")
                                                     + ("_int8" if pl == 1 else f"_int8x{pl}"), ki,
                                                     (*_grid2(-(-n_out // ki.rows_per_group), dev.max_groups), 1)))
                            continue
                        kw = kernels.gemv_warp(ws[0].desc(), n_out, "step.seq", rows_per_warp=r, wg=wg, unroll=u,
                                               subgroup=dev.has_subgroups, sg=args.sg, stage=bool(st), pipeline=bool(pp),
                                               split=sp)
                        g = (*_grid2(-(-n_out // kw.rows_per_group), dev.max_groups), 1)
                        name = (f"warp_r{r}_wg{wg}_u{u}" + ("_stage" if st else "") + ("_pipe" if pp else "")
                                + (f"_split{sp}" if sp > 1 else ""))
                        if not (args.only_int8 and fmt in kernels.INT8_FORMATS):
                            variants.append((name, kw, g))
                        for pl in (args.planes if args.int8 and st and fmt in kernels.INT8_FORMATS else ()):
                            if not tuning.can_stage(dev, n_in, int8=True, planes=pl):
                                continue
                            ki = kernels.gemv_warp(ws[0].desc(), n_out, "step.seq", rows_per_warp=r, wg=wg, unroll=u,
                                                   subgroup=dev.has_subgroups, sg=args.sg, stage=True, pipeline=bool(pp),
                                                   split=sp, int8=True, planes=pl)
                            variants.append((name + ("_int8" if pl == 1 else f"_int8x{pl}"), ki, g))
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
                    if args.single:  # one copy, 10 dispatches: in the L2 cache where it fits
                        L1 = Launch(dev, k, bufs[0])
                        L1.set_step(seq=1)
                        t1 = L1.time(grid, repeat=10)
                        row.update(us_single=round(t1 * 1e6, 2), GBps_single=round(p.nbytes / t1 / 1e9))
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print("gemv", json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
