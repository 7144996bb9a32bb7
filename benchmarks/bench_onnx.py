"""Vision networks on the GPU: edgellm cuda (fp16) vs PyTorch eager (channels-last fp16, cuDNN),
PyTorch with CUDA graphs, and onnxruntime on the same ONNX file; output agreement vs fp32.

    python benchmarks/bench_onnx.py [--models resnet18,mobilenet_v2,...] [--size 224] [--batches 1,8]
                                    [--reps 50] [--variant NAME:VAR=VAL[,VAR=VAL]] [--no-ort] [--webgpu] [--no-cuda]
                                    [--out results.json]

Each architecture is built with random weights (nothing is downloaded), exported once to ONNX
(opset 17, dynamic batch) in a temporary folder, and run by every engine in this one process on
the same inputs. Latency: CUDA-event timing around one call, after warm-up; the table shows the
median and the min-max spread; throughput is batch / median. Agreement: max |y - y_fp32| /
max |y_fp32| against PyTorch fp32 eager on the same weights. --variant adds an edgellm row per
variant: the same file loaded again and run (compiled, CUDA graph captured) with those environment
variables set, for A/B rows measured in the same run (e.g. split:EDGELLM_CONV_SPLITK=1).
--webgpu adds "edgellm webgpu fp32" and (with shader-f16) "edgellm webgpu fp16" rows (float16
storage, float32 maths): the same file on the webgpu backend (WGSL kernels, through the NVIDIA
Vulkan driver on an NVIDIA machine; needs wgpu), timed on the host clock
around one call with host arrays in and out (the input upload and the output read-back included:
the backend has no device-tensor interface to time without them).
Needs: torch with CUDA, triton (3.6), onnx, onnxruntime-gpu (else onnxruntime's CPU provider is
timed and marked so), torchvision (or its wheel unpacked as tests/onnx_models.py describes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_vs_llamacpp import environment, variant_arg  # noqa: E402

DEFAULT_MODELS = "resnet18,mobilenet_v2,mobilenet_v3_small,efficientnet_b0,vit_b_16,convnext_tiny"


def tv_models():
    try:
        import torchvision.models as m  # the GPU machine's own torchvision, when it imports

        return m
    except Exception:
        from onnx_models import torchvision_models

        return torchvision_models()


def timed(fn, reps: int, warmup: int = 10) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def host_timed(fn, reps: int, warmup: int = 10) -> list[float]:
    """Milliseconds per call on the host clock (fn returns after its results are on the host)."""
    import time

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def rel(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def cuda_graphed(model, x):
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.inference_mode():
        static_y = model(static_x)
    return g, static_x, static_y


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--variant", action="append", default=[], type=variant_arg,
                    help="NAME:VAR=VAL[,VAR=VAL]: another edgellm row with these environment variables set")
    ap.add_argument("--no-ort", action="store_true", help="leave onnxruntime out")
    ap.add_argument("--webgpu", action="store_true", help="add an edgellm webgpu (float32, WGSL) row")
    ap.add_argument("--no-cuda", action="store_true", help="leave the edgellm cuda rows out (the webgpu rows alone)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_onnx: needs a CUDA GPU", file=sys.stderr)
        return 1
    import edgellm
    from onnx_models import export, randomize

    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
    if args.no_ort:
        ort = None
    torch.backends.cudnn.benchmark = True
    tvm = tv_models()
    rows = []
    dev = torch.cuda.get_device_name()
    tmp = Path(tempfile.mkdtemp(prefix="bench_onnx_"))
    print(f"device {dev}; torch {torch.__version__}; image {args.size}x{args.size}; fp16 unless marked")
    hdr = f"{'model':<20} {'batch':>5} {'engine':<26} {'median ms':>10} {'min-max ms':>16} {'img/s':>9} {'rel err vs fp32':>16}"
    print(hdr)
    for name in args.models.split(","):
        kwargs = {"image_size": args.size} if name.startswith("vit") else {}
        model = randomize(getattr(tvm, name)(**kwargs)).eval()
        path = export(model, tmp / f"{name}.onnx", args.size, dynamic_hw=not name.startswith("vit"))
        fp32 = model.cuda()
        half = __import__("copy").deepcopy(model).half().to(memory_format=torch.channels_last).cuda()
        variants = {}  # engine name suffix -> (model, environment)
        for vname, env in ([] if args.no_cuda else [("", {})] + args.variant):
            try:
                with environment(env):
                    variants[vname] = (edgellm.load(path, backend="cuda"), env)
            except Exception as e:  # recorded, not fatal (ELIB's rule)
                print(f"{name:<20} edgellm{' ' + vname if vname else ''} load failed: {type(e).__name__}: {e}")
        em = variants.get("", (None, {}))[0]
        wms = {}  # webgpu storage type -> model
        for wdt in (("f32", "f16") if args.webgpu else ()):
            try:
                from edgellm.onnx import load_onnx

                wms[wdt] = load_onnx(path, backend="webgpu", dtype=wdt)
                print(f"{name:<20} edgellm webgpu on {wms[wdt].describe()}")
            except Exception as e:  # recorded, not fatal (no shader-f16: no f16 row)
                print(f"{name:<20} edgellm webgpu {wdt} load failed: {type(e).__name__}: {e}")
        sess = None
        if ort is not None:
            prov = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
            sess = ort.InferenceSession(str(path), providers=prov)
            ort_name = "onnxruntime " + ("CUDA fp32" if prov[0].startswith("CUDA") else "CPU fp32")
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(batch))
            xn = x.numpy()
            with torch.inference_mode():
                ref = fp32(x.cuda()).float().cpu().numpy()
            xh = x.cuda().half().to(memory_format=torch.channels_last)
            engines = []
            for vname, (vm, env) in variants.items():
                xe = {vm.input_names[0]: x.cuda().half()}

                def run_e(vm=vm, xe=xe):  # device tensors in and out, as the torch engines are timed
                    return vm.run_device(xe)
                ename = f"edgellm cuda {'fp16' if vm.dtype == torch.float16 else 'fp32'}" + (f" {vname}" if vname else "")
                engines.append((ename, run_e, lambda run_e=run_e: list(run_e().values())[0].float().cpu().numpy(), env))

            def run_eager():
                with torch.inference_mode():
                    return half(xh)
            engines.append(("torch eager cl fp16", run_eager, lambda: run_eager().float().cpu().numpy(), {}))
            try:
                g, sx, sy = cuda_graphed(half, xh)
                engines.append(("torch cuda-graph cl fp16", g.replay, lambda: (g.replay(), sy.float().cpu().numpy())[1],
                                {}))
            except Exception as e:
                print(f"{name:<20} {batch:>5} torch CUDA graph capture failed: {e}")
            for wdt, wm in wms.items():
                xw = {wm.input_names[0]: xn}
                engines.append((f"edgellm webgpu {'fp16' if wdt == 'f16' else 'fp32'}", lambda wm=wm, xw=xw: wm(xw),
                                lambda wm=wm, xw=xw: list(wm(xw).values())[0], {"host_clock": True}))
            if sess is not None:
                inp = sess.get_inputs()[0].name
                engines.append((ort_name, lambda: sess.run(None, {inp: xn}), lambda: sess.run(None, {inp: xn})[0], {}))
            for ename, fn, outfn, env in engines:
                try:
                    host_clock = env.get("host_clock")
                    env = {k: v for k, v in env.items() if k != "host_clock"}
                    with environment(env):  # a variant's first calls compile and capture under its settings
                        t = host_timed(fn, args.reps) if host_clock else timed(fn, args.reps)
                        err = rel(np.asarray(outfn()), ref)
                except Exception as e:
                    print(f"{name:<20} {batch:>5} {ename:<26} failed: {type(e).__name__}: {str(e)[:120]}")
                    rows.append({"model": name, "batch": batch, "engine": ename, "error": str(e)[:300]})
                    continue
                med = statistics.median(t)
                rows.append({"model": name, "batch": batch, "engine": ename, "median_ms": med, "min_ms": min(t),
                             "max_ms": max(t), "img_per_s": batch / med * 1e3, "rel_err_vs_fp32": err,
                             "device": dev, "size": args.size})
                print(f"{name:<20} {batch:>5} {ename:<26} {med:>10.3f} {min(t):>7.3f}-{max(t):<8.3f} "
                      f"{batch / med * 1e3:>9.1f} {err:>16.2e}")
            for vname, (vm, _) in variants.items():
                if vm.runner.graph_errors:
                    print(f"{name:<20} {batch:>5} (edgellm {vname} ran without a CUDA graph: {vm.runner.graph_errors})")
        del fp32, half, em, sess, variants, wms
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"rows in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
