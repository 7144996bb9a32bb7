"""The webgpu backend on a GPU: correctness against the cpu backend, then speed.

    python benchmarks/bench_webgpu.py --quick                    # < 5 minutes on an H100
    python benchmarks/bench_webgpu.py --models llama-3.1-8b --formats Q4_0,Q8_0,F16 [--cuda]
        [--llama-bench PATH/llama-bench [--fa 1]]
    [--model-dir DIR] [-p 512] [-n 128] [-r 3] [--bandwidth 3.0e12] [--timeout 300] [--json OUT.json]

1. device: the adapter, its driver, wgpu's version and the optional features the kernels use.
2. check: a tiny synthetic model's logits on webgpu vs cpu (max error relative to the largest
   logit) and its greedy tokens; the default model's greedy answers to three chat prompts on
   both backends (identical text expected).
3. gemv: the decode matrix-vector kernel alone per format and shape (Llama 1B/8B projections),
   weights cycled through copies larger than the L2 cache, timed with timestamp queries: GB/s
   of weight bytes and the fraction of --bandwidth (the H100's copy bandwidth, 3.0 TB/s); the
   default launch configuration and the best of the tuning candidates. gemm: the prefill matrix
   product alone at -p tokens, TFLOP/s of the default tiles and the best candidate.
4. models: edgellm.synthetic files of the SmolLM2-135M / Llama-3.2-1B / Llama-3.1-8B shapes in
   each format (written once into --model-dir, reused): prefill pp{p} from an empty cache and
   decode tg{n} (greedy on the device) in tokens/s, median of -r runs, and decode bandwidth =
   weight bytes read per token x tokens/s against --bandwidth; with --cuda the cuda backend too.
   Each (file, backend) runs in its own process under --timeout: a failure or hang is recorded
   in the table and the run goes on. With --llama-bench (llama.cpp's, built with GGML_VULKAN:
   benchmarks/gpu_session.sh build_llama_vk) also llama-bench -ngl 99 -fa FA -p P -n N -r R on the
   same file right after (mean of R after its own warm-up), as backend llama.cpp-vulkan; on a
   synthetic file its decode bandwidth counts the webgpu row's weight bytes per token (the same
   matrices, read as stored).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

QUICK_MODELS = "smollm2-135m,llama-3.2-1b"
QUICK_FORMATS = "Q4_0,Q8_0"
ALL_FORMATS = "Q4_0,Q8_0,F16"
ALL_MODELS = "smollm2-135m,llama-3.2-1b,llama-3.1-8b"
GEMV_SHAPES = {  # (out, in): Llama-3.2-1B and Llama-3.1-8B projections and output heads
    "quick": [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)],
    "full": [(2048, 2048), (8192, 2048), (2048, 8192), (128256, 2048),
             (4096, 4096), (6144, 4096), (28672, 4096), (14336, 4096), (4096, 14336), (128256, 4096)],
}
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "List three primary colours."]


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:200]


# -- 1. device -------------------------------------------------------------------------------------
def device_section() -> dict:
    import wgpu

    from edgellm.backends.webgpu.device import get_device

    dev = get_device()
    info = {"adapter": dev.info.name, "backend": dev.info.backend, "driver": dev.info.driver,
            "type": dev.info.adapter_type, "wgpu": wgpu.__version__, "f16": dev.has_f16,
            "subgroups": dev.has_subgroups, "subgroup_sizes": [dev.info.subgroup_min, dev.info.subgroup_max],
            "timestamps": dev.has_timestamps, "max_binding": dev.max_binding, "max_buffer": dev.max_buffer}
    print(f"device: {dev.describe()}; wgpu {wgpu.__version__}", flush=True)
    return info


# -- 2. check --------------------------------------------------------------------------------------
def check_section(tmp: str) -> dict:
    import edgellm
    from edgellm.sampling import SamplingParams
    from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf

    out: dict = {}
    try:
        path = os.path.join(tmp, "tiny-check-Q4_0.gguf")
        write_synthetic_gguf(path, SyntheticSpec(weight_type="Q4_0", d_model=256, n_heads=8, n_kv_heads=2,
                                                 ffn_dim=512, vocab_size=1000, n_layers=3, seed=5))
        ids = np.random.default_rng(0).integers(0, 1000, 45).tolist()
        cpu = edgellm.load(path, backend="cpu", ctx=128, prefill_chunk=32)
        gpu = edgellm.load(path, backend="webgpu", ctx=128, prefill_chunk=32)
        a, b = cpu.logits(ids), gpu.logits(ids)
        out["tiny_logits_rel_err"] = float(np.abs(a - b).max() / np.abs(a).max())
        g = SamplingParams(temperature=0)
        out["tiny_greedy_same"] = list(cpu.generate_tokens(ids, 24, g)) == list(gpu.generate_tokens(ids, 24, g))
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        out["tiny_error"] = _err(e)
    try:
        cpu = edgellm.load(backend="cpu", ctx=512)
        gpu = edgellm.load(backend="webgpu", ctx=512)
        same = []
        for prompt in CHAT_PROMPTS:
            a = "".join(cpu.generate(prompt, max_tokens=48, temperature=0))
            b = "".join(gpu.generate(prompt, max_tokens=48, temperature=0))
            same.append(a == b)
            if a != b:
                out.setdefault("default_model_diffs", []).append({"prompt": prompt, "cpu": a, "webgpu": b})
        out["default_model_same_text"] = f"{sum(same)}/{len(same)}"
    except Exception as e:  # noqa: BLE001
        out["default_model_error"] = _err(e)
    print(f"check: {json.dumps(out)}", flush=True)
    return out


# -- 3. gemv ---------------------------------------------------------------------------------------
def _random_packed(fmt: str, rows: int, cols: int, rng):
    """Packed arrays of random bytes and small scales (quantizing ~0.5 G values would take minutes)."""
    from edgellm.backends.webgpu import codegen

    nb = cols // 32
    if fmt == "F16":
        a = {"qs": (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16).view(np.uint8)}
    else:
        qbytes = cols if fmt == "Q8_0" else cols // 2
        a = {"qs": rng.integers(0, 256, (rows, qbytes), dtype=np.uint8),
             "d": (rng.random((rows, nb), dtype=np.float32) * 1e-3).astype(np.float16)}
        if fmt == "Q4_1":
            a["m"] = (-rng.random((rows, nb), dtype=np.float32) * 1e-3).astype(np.float16)
    return codegen.PackedArrays(fmt, rows, cols, a)


def gemv_section(formats: list[str], shapes: list[tuple[int, int]], bw: float, tune: bool) -> list[dict]:
    from edgellm.backends.webgpu import kernels, tuning
    from edgellm.backends.webgpu.backend import DeviceWeight
    from edgellm.backends.webgpu.device import get_device
    from edgellm.backends.webgpu.launch import Launch, upload_f32

    dev = get_device()
    rng = np.random.default_rng(0)
    rows_out = []
    for fmt in formats:
        d = tuning.default_gemv_config(dev, 4096, fmt)  # int8 with EDGELLM_WEBGPU_INT8=1 or 2
        cands = tuning.gemv_candidates(dev, int8=bool(d.get("int8")), planes=d.get("planes", 1)) if tune else []
        for n_out, n_in in shapes:
            row = {"fmt": fmt, "shape": f"{n_out}x{n_in}"}
            try:
                p = _random_packed(fmt, n_out, n_in, rng)
                copies = max(1, min(32, -(-256_000_000 // p.nbytes)))  # >= 256 MB together: 5x the H100's L2
                ws = [DeviceWeight(p, dev) for _ in range(copies)]
                x = upload_f32(dev, rng.standard_normal(n_in, dtype=np.float32))
                y = dev.buffer(4 * n_out)
                bufs = [{**{k: b for k, (b, _, _) in w.resources().items()}, "X": x, "Y": y} for w in ws]

                def timed(cfg):
                    k = kernels.decode_gemv(ws[0].desc(), n_out, "step.seq", cfg)
                    L = Launch(dev, k, bufs)
                    L.set_step(seq=1)
                    return L.time((*_grid2(-(-n_out // cfg["rows_per_wg"]), dev.max_groups), 1), repeat=4 * copies)

                default = tuning.default_gemv_config(dev, n_in, fmt)
                t = timed(default)
                row.update(bytes=p.nbytes, default=default, us=t * 1e6, GBps=p.nbytes / t / 1e9,
                           pct=100 * p.nbytes / t / bw)
                best = (t, default)
                every = []
                for cfg in cands:
                    try:
                        tc = timed(cfg)
                    except Exception:  # noqa: BLE001 - a candidate the adapter rejects
                        continue
                    every.append([cfg, round(tc * 1e6, 2)])
                    best = min(best, (tc, cfg), key=lambda b: b[0])
                row["candidates_us"] = every
                if cands:
                    row.update(best=best[1], best_us=best[0] * 1e6, best_GBps=p.nbytes / best[0] / 1e9,
                               best_pct=100 * p.nbytes / best[0] / bw)
            except Exception as e:  # noqa: BLE001
                row["error"] = _err(e)
            print(f"gemv {json.dumps(row)}", flush=True)
            rows_out.append(row)
    return rows_out


def gemm_section(formats: list[str], shapes: list[tuple[int, int]], rows: int, tune: bool) -> list[dict]:
    """The prefill matrix product alone at `rows` tokens: TFLOP/s of the default tiles and the best
    candidate (weights stay in the L2 between repeats here: prefill is compute-bound)."""
    from edgellm.backends.webgpu import kernels, tuning
    from edgellm.backends.webgpu.backend import DeviceWeight
    from edgellm.backends.webgpu.device import get_device
    from edgellm.backends.webgpu.launch import Launch, upload_f32

    dev = get_device()
    rng = np.random.default_rng(1)
    out = []
    for fmt in formats:
        for n_out, n_in in shapes:
            row = {"fmt": fmt, "shape": f"{n_out}x{n_in}", "rows": rows}
            try:
                w = DeviceWeight(_random_packed(fmt, n_out, n_in, rng), dev)
                bufs = {**{k: b for k, (b, _, _) in w.resources().items()},
                        "X": upload_f32(dev, rng.standard_normal(rows * n_in, dtype=np.float32)),
                        "Y": dev.buffer(4 * rows * n_out)}
                flop = 2.0 * rows * n_out * n_in
                results = []
                default = tuning.default_gemm_config(dev, False)
                for cfg in [default] + ([c for c in tuning.GEMM_CANDIDATES if c != default] if tune else []):
                    try:
                        L = Launch(dev, kernels.gemm(w.desc(), n_out, "step.seq", **cfg), bufs)
                        L.set_step(seq=rows)
                        t = L.time((-(-n_out // cfg["tn"]), -(-rows // cfg["tm"]), 1), repeat=3)
                        results.append((t, cfg))
                    except Exception:  # noqa: BLE001 - a tiling the adapter rejects
                        continue
                t0 = results[0][0] if results and results[0][1] == default else float("nan")
                best = min(results, key=lambda r: r[0])
                row.update(ms=t0 * 1e3, TFLOPs=flop / t0 / 1e12, best=best[1], best_ms=best[0] * 1e3,
                           best_TFLOPs=flop / best[0] / 1e12,
                           each=[{**cfg, "TFLOPs": round(flop / t / 1e12, 2)} for t, cfg in results])
                if fmt in kernels.INT8_GEMM_FORMATS or w.fmt in kernels.INT8_GEMM_FORMATS:
                    row.update(_int8_gemm_times(dev, w, bufs, n_out, rows, flop, tune))
            except Exception as e:  # noqa: BLE001
                row["error"] = _err(e)
            print(f"gemm {json.dumps(row)}", flush=True)
            out.append(row)
    return out


def _int8_gemm_times(dev, w, bufs: dict, n_out: int, rows: int, flop: float, tune: bool) -> dict:
    """The int8 prefill product (quantize_x, then gemm_int8) in one and two planes: TFLOP/s of
    the default tiles and the best candidate, x's quantization included (ms of it apart)."""
    from edgellm.backends.webgpu import kernels, tuning
    from edgellm.backends.webgpu.launch import Launch

    out = {}
    sums = kernels.int8_x_sums(w.fmt)
    for planes in (1, 2):
        b = {**bufs, **tuning.int8_x_buffers(dev, rows, w.cols, planes, sums)}
        lanes = tuning.quantize_lanes(dev)
        q = Launch(dev, kernels.quantize_x(w.cols, "step.seq", planes=planes, sums=sums, lanes=lanes), b)
        q.set_step(seq=rows)
        tq = q.time(kernels.quantize_x_grid(w.cols, rows, lanes=lanes), repeat=3)
        each = []
        cands = tuning.GEMM_INT8_CANDIDATES[planes][:None if tune else 1]
        launches = []
        for cfg in cands:
            L = Launch(dev, kernels.gemm_int8(w.desc(), n_out, "step.seq", planes=planes, **cfg), b)
            L.set_step(seq=rows)
            launches.append((cfg, L))
        best = {}
        for _ in range(2):  # every candidate timed twice, in turn: the faster of its two
            for cfg, L in launches:
                t = L.time((-(-n_out // cfg["tn"]), -(-rows // cfg["tm"]), 1), repeat=5) + tq
                best[id(L)] = min(best.get(id(L), t), t)
        for cfg, L in launches:
            each.append({**cfg, "TFLOPs": round(flop / best[id(L)] / 1e12, 2)})
        out[f"int8x{planes}"] = {"quantize_ms": tq * 1e3, "TFLOPs": each[0]["TFLOPs"],
                                 "best_TFLOPs": max(e["TFLOPs"] for e in each), "each": each}
    return out


def _grid2(n: int, limit: int):
    from edgellm.backends.webgpu.backend import _grid2 as g

    return g(n, limit)


# -- 4. models (one process per file and backend) ----------------------------------------------------
def one_model(path: str, backend: str, p: int, n: int, reps: int, bw: float) -> dict:
    import edgellm

    t = time.perf_counter()
    m = edgellm.load(path, backend=backend, ctx=p + n + 16, prefill_chunk=p)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, m.config.vocab_size, p).tolist()
    prog, dec = m.programs["last"], m.programs["decode"]

    def sync(out):
        if backend == "cuda":
            import torch

            torch.cuda.synchronize()
        else:
            m.backend.to_numpy(out["logits"])  # a read waits for the queue

    sync(prog.run({"tokens": prompt, "start_pos": 0}))  # compiles the kernels
    load_s = time.perf_counter() - t

    def prefill() -> float:
        t0 = time.perf_counter()
        sync(prog.run({"tokens": prompt, "start_pos": 0}))
        return p / (time.perf_counter() - t0)

    def decode() -> float:
        gen = dec.loop_tokens(1, 0, n)
        next(gen)  # pipelines / graphs made on the first step
        if backend == "cuda":
            import torch

            torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = sum(1 for _ in gen)
        return got / (time.perf_counter() - t0)

    pp = [prefill() for _ in range(reps)]
    tg = [decode() for _ in range(reps)]
    if backend == "webgpu":
        wbytes = dec.matrix_bytes
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_check import weight_bytes_read

        wbytes = weight_bytes_read(m)
    tgm = statistics.median(tg)
    return {"load_s": load_s, f"pp{p}": statistics.median(pp), f"tg{n}": tgm, "weight_bytes_per_token": wbytes,
            "decode_GBps": wbytes * tgm / 1e9, "decode_pct_bw": 100 * wbytes * tgm / bw,
            "load_phases": {k: round(v, 3) for k, v in getattr(m, "load_phases", {}).items()},
            "describe": m.backend.describe()}


def synthetic_file(name: str, fmt: str, folder: str) -> str:
    from edgellm.synthetic import preset, write_synthetic_gguf

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}-{fmt}.gguf")
    if not os.path.exists(path):
        t = time.perf_counter()
        write_synthetic_gguf(path + ".part", preset(name, weight_type=fmt), fast=True)
        os.replace(path + ".part", path)
        print(f"wrote {path} ({os.path.getsize(path) / 1e9:.2f} GB, {time.perf_counter() - t:.0f} s)", flush=True)
    return path


def llama_row(args, path: str, name: str, fmt: str, bw: float, wbytes: float | None) -> dict:
    """llama-bench (Vulkan) on one file, as a models row of backend llama.cpp-vulkan."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_vs_llamacpp import llama_bench

    row = {"model": name, "fmt": fmt, "backend": "llama.cpp-vulkan"}
    res = llama_bench(args.llama_bench, path, [args.p], [args.n], args.r, args.fa, timeout=args.timeout)
    missing = [k for k in (f"pp{args.p}", f"tg{args.n}") if k not in res]
    if "error" in res or missing:
        return {**row, "error": res.get("error") or f"llama-bench reported no {', '.join(missing)}"}
    row.update(res)
    if wbytes:
        tg = row[f"tg{args.n}"]
        row.update(weight_bytes_per_token=wbytes, decode_GBps=wbytes * tg / 1e9, decode_pct_bw=100 * wbytes * tg / bw)
    return row


def models_section(args, bw: float) -> list[dict]:
    rows = []
    backends = ["webgpu"] + (["cuda"] if args.cuda else [])
    jobs = [(name, fmt, None) for name in args.models.split(",") if name for fmt in args.formats.split(",") if fmt]
    jobs += [(os.path.basename(f), "file", f) for f in args.file or ()]
    for name, fmt, path in jobs:
        if path is None:
            try:
                path = synthetic_file(name, fmt, args.model_dir)
            except Exception as e:  # noqa: BLE001
                rows.append({"model": name, "fmt": fmt, "error": "writing the file: " + _err(e)})
                continue
        for be in backends:
            row = {"model": name, "fmt": fmt, "backend": be}
            # each backend as its users get it (both tune at first load on a GPU) unless told otherwise
            env = {**os.environ, **({"EDGELLM_TUNE": "1"} if args.tune else {})}
            env.update(kv.split("=", 1) for kv in args.set or ())
            cmd = [sys.executable, os.path.abspath(__file__), "--one", path, be, "-p", str(args.p), "-n", str(args.n),
                   "-r", str(args.r), "--bandwidth", str(bw)]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
                last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
                if r.returncode == 0 and last.startswith("{"):
                    row.update(json.loads(last))
                else:
                    tail = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
                    row["error"] = tail[:300]
            except subprocess.TimeoutExpired:
                row["error"] = f"timed out after {args.timeout} s"
            print(f"model {json.dumps(row)}", flush=True)
            rows.append(row)
        if args.llama_bench:
            wbytes = None if fmt == "file" else next(  # webgpu converts some formats of other files
                (r.get("weight_bytes_per_token") for r in rows[::-1]
                 if r.get("backend") == "webgpu" and r["model"] == name and r["fmt"] == fmt), None)
            rows.append(llama_row(args, path, name, fmt, bw, wbytes))
            print(f"model {json.dumps(rows[-1])}", flush=True)
    return rows


def print_tables(res: dict, p: int, n: int) -> None:
    print("\n## GEMV alone (decode, one token)")
    print("| format | out x in | MB | default µs | GB/s | % of copy bw | best µs | best GB/s | best % | best config |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res.get("gemv", []):
        if "error" in r:
            print(f"| {r['fmt']} | {r['shape']} | error: {r['error']} |||||||")
            continue
        print(f"| {r['fmt']} | {r['shape']} | {r['bytes'] / 1e6:.1f} | {r['us']:.1f} | {r['GBps']:.0f} | {r['pct']:.0f}% | "
              f"{r.get('best_us', float('nan')):.1f} | {r.get('best_GBps', float('nan')):.0f} | "
              f"{r.get('best_pct', float('nan')):.0f}% | {r.get('best', '')} |")
    print(f"\n## GEMM alone (prefill, {p} tokens)")
    print("| format | out x in | default ms | TFLOP/s | best ms | best TFLOP/s | best tiles | int8 x1 TFLOP/s (best) "
          "| int8 x2 TFLOP/s (best) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res.get("gemm", []):
        if "error" in r:
            print(f"| {r['fmt']} | {r['shape']} | error: {r['error']} ||||||")
            continue
        i8 = [f"{r[k]['TFLOPs']:.2f} ({r[k]['best_TFLOPs']:.2f})" if k in r else "" for k in ("int8x1", "int8x2")]
        print(f"| {r['fmt']} | {r['shape']} | {r['ms']:.2f} | {r['TFLOPs']:.2f} | {r['best_ms']:.2f} | "
              f"{r['best_TFLOPs']:.2f} | {r['best']} | {i8[0]} | {i8[1]} |")
    print(f"\n## Models (synthetic files; prefill pp{p}, decode tg{n} greedy on the device)")
    print(f"| model | format | backend | pp{p} tok/s | tg{n} tok/s | MB/token | decode GB/s | % of copy bw | load s | tuning s |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def cell(r, key, fmt, scale=1.0, unit=""):
        return format(r[key] / scale, fmt) + unit if r.get(key) is not None else "-"

    for r in res.get("models", []):
        if "error" in r:
            print(f"| {r['model']} | {r['fmt']} | {r.get('backend', '')} | error: {r['error']} |||||")
            continue
        print(f"| {r['model']} | {r['fmt']} | {r['backend']} | {r[f'pp{p}']:.0f} | {r[f'tg{n}']:.1f} | "
              f"{cell(r, 'weight_bytes_per_token', '.0f', 1e6)} | {cell(r, 'decode_GBps', '.0f')} | "
              f"{cell(r, 'decode_pct_bw', '.0f', unit='%')} | {cell(r, 'load_s', '.1f')} | "
              f"{cell(r.get('load_phases', {}), 'tuning', '.1f')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"models {QUICK_MODELS}, formats {QUICK_FORMATS}, -n 64, -r 2, 4 GEMV shapes")
    ap.add_argument("--models", default=None, help=f"synthetic presets (default {ALL_MODELS})")
    ap.add_argument("--formats", default=None, help=f"weight formats (default {ALL_FORMATS})")
    ap.add_argument("--file", action="append", metavar="GGUF",
                    help="also this model file (e.g. a Q4_K_M made by llama-quantize; repeatable)")
    ap.add_argument("--tune", action="store_true", help="models: EDGELLM_TUNE=1 (configurations timed at load and "
                    "cached per adapter; the default on a GPU since 2026-11-30, EDGELLM_TUNE=0 in the environment "
                    "or --set EDGELLM_TUNE=0 for the built-in defaults)")
    ap.add_argument("--model-dir", default="/tmp/edgellm-bench-models")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=None)
    ap.add_argument("-r", type=int, default=None)
    ap.add_argument("--bandwidth", type=float, default=3.0e12, help="copy bandwidth in bytes/s (H100: 3.0e12)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per (file, backend) process")
    ap.add_argument("--set", action="append", metavar="VAR=VALUE",
                    help="environment of the model runs, e.g. EDGELLM_WEBGPU_ACT=f16 (repeatable)")
    ap.add_argument("--cuda", action="store_true", help="also the cuda backend (torch with CUDA and triton)")
    ap.add_argument("--llama-bench", default=None, metavar="PATH",
                    help="models: also this llama-bench (a GGML_VULKAN build) on each file, backend llama.cpp-vulkan")
    ap.add_argument("--fa", type=int, default=1, help="llama-bench -fa (flash attention) with --llama-bench")
    ap.add_argument("--skip", default="", help="sections to skip: check,gemv,gemm,models")
    ap.add_argument("--gemv-shapes", default=None, help="OUTxIN,... instead of the Llama shapes")
    ap.add_argument("--no-tune", action="store_true", help="GEMV: time the default configuration only")
    ap.add_argument("--json", default=None, help="write every result here")
    ap.add_argument("--one", nargs=2, metavar=("FILE", "BACKEND"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.n = args.n or (64 if args.quick else 128)
    args.r = args.r or (2 if args.quick else 3)
    if args.one:
        try:
            print(json.dumps(one_model(args.one[0], args.one[1], args.p, args.n, args.r, args.bandwidth)))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            print(_err(e), file=sys.stderr)
            sys.exit(1)
        return
    if args.llama_bench and not os.access(args.llama_bench, os.X_OK):
        ap.error(f"--llama-bench {args.llama_bench}: not an executable file")
    if args.models is None:  # "" (with --file): no synthetic files
        args.models = QUICK_MODELS if args.quick else ALL_MODELS
    args.formats = args.formats or (QUICK_FORMATS if args.quick else ALL_FORMATS)
    skip = set(args.skip.split(","))
    t0 = time.perf_counter()
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args)}
    try:
        res["device"] = device_section()
    except Exception as e:  # noqa: BLE001 - nothing else can run
        print(f"no WebGPU device: {_err(e)}")
        sys.exit(1)
    if "check" not in skip:
        res["check"] = check_section(args.model_dir if os.path.isdir(args.model_dir) else "/tmp")
    if "gemv" not in skip:
        shapes = GEMV_SHAPES["quick" if args.quick else "full"]
        if args.gemv_shapes:
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.gemv_shapes.split(",")]
        res["gemv"] = gemv_section([f for f in args.formats.split(",") if f], shapes, args.bandwidth, not args.no_tune)
    if "gemm" not in skip:
        shapes = GEMV_SHAPES["quick"][:3] if args.quick else GEMV_SHAPES["full"]
        if args.gemv_shapes:
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.gemv_shapes.split(",")]
        res["gemm"] = gemm_section([f for f in args.formats.split(",") if f], shapes, args.p, not args.no_tune)
    if "models" not in skip:
        res["models"] = models_section(args, args.bandwidth)
    res["seconds"] = time.perf_counter() - t0
    print_tables(res, args.p, args.n)
    print(f"\n({res['seconds']:.0f} s; device {res['device']['adapter']}, driver {res['device']['driver']}, "
          f"wgpu {res['device']['wgpu']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
