"""The ONNX side of `edgellm run`, `edgellm plan` and `edgellm bench` (chosen by the .onnx suffix).

  edgellm run model.onnx --input image.jpg [--labels labels.txt]     top-5, or output shapes + values
  edgellm plan model.onnx [--size batch=1,height=224,width=224]       passes, kernels, memory plans
  edgellm bench model.onnx [--backend cuda|webgpu] [-r 20]            latency/throughput at batch 1 and 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from ..errors import EdgeLLMError

IMAGENET_MEAN = "0.485,0.456,0.406"
IMAGENET_STD = "0.229,0.224,0.225"


def is_onnx(path) -> bool:
    return path is not None and str(path).lower().endswith(".onnx")


def add_onnx_run_args(r: argparse.ArgumentParser) -> None:
    g = r.add_argument_group("ONNX models (edgellm run model.onnx --input image.jpg)")
    g.add_argument("--input", action="append", metavar="FILE",
                   help="an image (resized and normalized as below) or a .npy array; repeat for several inputs")
    g.add_argument("--labels", default=None, metavar="FILE", help="class names, one per line: print the top-5")
    g.add_argument("--image-size", type=int, default=224, help="center crop side in pixels (default 224)")
    g.add_argument("--resize", type=int, default=256, help="shorter side before the crop (default 256)")
    g.add_argument("--mean", default=IMAGENET_MEAN, help=f"per-channel mean, RGB in 0..1 (default ImageNet {IMAGENET_MEAN})")
    g.add_argument("--std", default=IMAGENET_STD, help=f"per-channel std (default ImageNet {IMAGENET_STD})")
    g.add_argument("--layout", choices=("nchw", "nhwc"), default="nchw", help="image tensor layout (default nchw)")


def _floats(s: str, what: str) -> np.ndarray:
    try:
        v = np.array([float(x) for x in s.split(",")], dtype=np.float32)
    except ValueError:
        raise EdgeLLMError(f"{what} must be comma-separated numbers, got {s!r}") from None
    if v.size not in (1, 3):
        raise EdgeLLMError(f"{what} needs 1 or 3 values, got {v.size}")
    return v


def load_image(path: str, *, size: int = 224, resize: int = 256, mean: str = IMAGENET_MEAN,
               std: str = IMAGENET_STD, layout: str = "nchw") -> np.ndarray:
    """Standard ImageNet preprocessing: RGB, shorter side to `resize` (bilinear), center crop
    `size`, scale to 0..1, (x - mean) / std; returns [1, 3, size, size] (or NHWC)."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(path).convert("RGB")
    except FileNotFoundError:
        raise EdgeLLMError(f"{path}: no such image file") from None
    except (UnidentifiedImageError, OSError) as e:
        raise EdgeLLMError(f"{path}: not a readable image ({e})") from None
    if size <= 0 or resize < size:
        raise EdgeLLMError(f"--image-size must be positive and at most --resize, got {size} and {resize}")
    w, h = img.size
    s = resize / min(w, h)
    img = img.resize((max(size, round(w * s)), max(size, round(h * s))), Image.BILINEAR)
    w, h = img.size
    left, top = (w - size) // 2, (h - size) // 2
    img = img.crop((left, top, left + size, top + size))
    x = (np.asarray(img, dtype=np.float32) / 255.0 - _floats(mean, "--mean")) / _floats(std, "--std")
    x = x[None]  # [1, H, W, 3]
    return np.ascontiguousarray(x if layout == "nhwc" else x.transpose(0, 3, 1, 2), dtype=np.float32)


def _read_input(path: str, args) -> np.ndarray:
    if path.lower().endswith(".npy"):
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise EdgeLLMError(f"{path}: not a readable .npy array ({e})") from None
    return load_image(path, size=args.image_size, resize=args.resize, mean=args.mean, std=args.std, layout=args.layout)


def _summary(a: np.ndarray) -> str:
    a64 = a.astype(np.float64)
    return (f"shape {tuple(a.shape)}  min {a64.min():.5g}  max {a64.max():.5g}  mean {a64.mean():.5g}  "
            f"std {a64.std():.5g}")


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def run_onnx(args: argparse.Namespace, path: str) -> int:
    from .model import load_onnx

    if not args.input:
        raise EdgeLLMError("edgellm run MODEL.onnx needs --input IMAGE (or --input ARRAY.npy)")
    backend = "cpu" if args.backend in (None, "auto") else args.backend
    m = load_onnx(path, backend=backend)
    if len(args.input) != len(m.input_names):
        raise EdgeLLMError(f"{path}: the model takes {len(m.input_names)} input(s) ({', '.join(m.input_names)}), "
                           f"{len(args.input)} --input given")
    arrays = [_read_input(p, args) for p in args.input]
    t0 = time.perf_counter()
    outs = m(*arrays)
    dt = time.perf_counter() - t0
    labels = None
    if args.labels:
        try:
            with open(args.labels, encoding="utf-8") as f:
                labels = [line.strip() for line in f if line.strip()]
        except OSError as e:
            raise EdgeLLMError(f"{args.labels}: cannot read the label file ({e.strerror})") from None
    for name, a in outs.items():
        if labels is not None and a.ndim == 2 and a.shape[0] == 1 and a.shape[1] in (len(labels), len(labels) + 1):
            off = a.shape[1] - len(labels)  # some classifiers put a background class first
            p = softmax(a[0].astype(np.float64))
            print(f"{name}: top-5")
            for k in np.argsort(-a[0])[:5]:
                label = labels[k - off] if k >= off else "(background)"
                print(f"  {p[k]:7.2%}  {k:5d}  {label}")
        else:
            if labels is not None:
                print(f"({name}: shape {a.shape} does not match {len(labels)} labels)")
            print(f"{name}: {_summary(a)}")
    if not getattr(args, "quiet", False):
        print(f"[{m.describe()}; first call {dt * 1e3:.1f} ms including compile]", file=__import__("sys").stderr)
    return 0


def parse_sizes(spec: str | None) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        k, sep, v = part.partition("=")
        if not sep or not v.strip().isdigit() or int(v) <= 0:
            raise EdgeLLMError(f"--size takes name=positive integer pairs, e.g. batch=1,height=224; got {part!r}")
        sizes[k.strip()] = int(v)
    return sizes


def default_sizes(imported, given: dict[str, int]) -> dict[str, int]:
    sizes = dict(given)
    for s in imported.symbols:
        if s not in sizes:
            sizes[s] = 1 if "batch" in s.lower() or s.lower() in ("n", "b") else 224
    unknown = set(given) - set(imported.symbols)
    if unknown:
        raise EdgeLLMError(f"--size names {sorted(unknown)}; the model's dynamic dimensions are {imported.symbols or 'none'}")
    return sizes


def plan_onnx(args: argparse.Namespace, path: str) -> int:
    import json

    from ..backends import get_backend_info
    from ..compiler.compile import compile_graph
    from ..compiler.report import _fmt
    from .importer import import_onnx

    imp = import_onnx(path)
    sizes = default_sizes(imp, parse_sizes(getattr(args, "size", None)))
    supported, in_place = None, frozenset()
    if args.backend == "cuda":
        from ..backends.cuda.vision import CUDA_ND_KERNELS

        supported = set(CUDA_ND_KERNELS)
    elif args.backend == "webgpu":  # the N-D kinds with WGSL kernels (the rest run on the cpu)
        from ..backends.webgpu.vision import WEBGPU_KINDS, WebgpuNd

        supported, in_place = set(WEBGPU_KINDS), WebgpuNd.in_place  # reshapes planned to read in place
    elif args.backend != "cpu":
        supported = getattr(get_backend_info(args.backend), "SUPPORTED_OPS", None)
    c = compile_graph(imp.graph, supported_ops=supported, backend=args.backend, fuse=not args.no_fuse, sizes=sizes,
                      in_place=in_place)
    from ..graph.ir import SYMBOLS
    from ..graph.ops import flops as op_flops

    weight_bytes = sum(4 * int(np.prod([int(x) for x in t.shape])) for t in c.graph.weights())
    subs = {SYMBOLS[k]: v for k, v in sizes.items()}
    flops = int(sum(op_flops(op.kind, [c.graph.tensors[i] for i in op.inputs], c.graph.tensors[op.outputs[0]],
                             op.attrs).subs(subs) for op in c.graph.ops))
    d = {
        "model": path, "opset": imp.opset, "sizes": sizes, "dynamic_dims": imp.symbols,
        "inputs": {n: [str(x) for x in s] for n, s in imp.inputs.items()},
        "ops_imported": c.original_ops, "ops_compiled": len(c.graph.ops),
        "passes": [{"pass": r.name, "ops_before": r.ops_before, "ops_after": r.ops_after} for r in c.pass_reports],
        "kernels": c.kernel_counts(),
        "segments": [{"backend": s.backend, "ops": len(s.ops), "transfers_in": len(s.inputs_in)} for s in c.segments],
        "intermediates": len(c.records),
        "intermediate_bytes": {k: p.total_bytes for k, p in c.plans.items()},
        "chosen_plan": c.plan.strategy, "lower_bound_bytes": c.lower_bound,
        "weight_bytes_f32": weight_bytes, "flops": flops,
    }
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"model         {path} (ONNX opset {imp.opset})")
    print(f"sizes         {', '.join(f'{k}={v}' for k, v in sizes.items()) or 'static'}"
          + (f"  (dynamic: {', '.join(imp.symbols)})" if imp.symbols else ""))
    for n, s in d["inputs"].items():
        print(f"input         {n} [{', '.join(s)}]")
    print(f"ops           {c.original_ops} imported -> {len(c.graph.ops)} compiled;  {flops / 1e9:.3f} GFLOP per run")
    for r in c.pass_reports:
        if r.ops_before != r.ops_after:
            print(f"  {r.name:<22} {r.ops_before} -> {r.ops_after}")
    print("kernels       " + ", ".join(f"{k} {v}" for k, v in sorted(c.kernel_counts().items(), key=lambda kv: -kv[1])))
    print("segments      " + ", ".join(f"{s['backend']}:{s['ops']}" for s in d["segments"])
          + f"  ({c.transfers} transfers)")
    print(f"weights       {_fmt(weight_bytes)} (float32)")
    print(f"intermediates {len(c.records)} tensors; memory per planner:")
    for k, v in sorted(d["intermediate_bytes"].items(), key=lambda kv: kv[1]):
        mark = "  <- chosen" if k == c.plan.strategy else ""
        print(f"  {k:<16} {_fmt(v):>10}{mark}")
    print(f"  {'lower bound':<16} {_fmt(c.lower_bound):>10}")
    return 0


def _timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_onnx(args: argparse.Namespace, paths: list[str]) -> int:
    """Latency and throughput at batch 1 and 8 (ELIB's method: warm-up runs first, then the median
    of repeated runs with their spread)."""
    from .model import load_onnx

    backends = [b for v in (args.backend or ["cpu"]) for b in v.split(",")]
    reps = int(args.repetitions)
    if reps <= 0:
        raise EdgeLLMError(f"--repetitions must be positive, got {reps}")
    print(f"{'model':<24} {'backend':<8} {'batch':>5} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'img/s':>9}")
    for path in paths:
        for backend in backends:
            m = load_onnx(path, backend=backend)
            sizes = default_sizes(m.imported, {})
            shape0 = m.imported.inputs[m.input_names[0]]
            for batch in (1, 8):
                arrays = []
                rng = np.random.default_rng(0)
                for n in m.input_names:
                    dims = []
                    for d in m.imported.inputs[n]:
                        dims.append(batch if (not d.is_Integer and d.name in sizes and "batch" in d.name.lower())
                                    else int(d) if d.is_Integer else sizes[d.name])
                    arrays.append(rng.standard_normal(dims).astype(np.float32))
                if shape0 and shape0[0].is_Integer and int(shape0[0]) != batch:
                    print(f"{os.path.basename(path):<24} {backend:<8} {batch:>5}  (the file fixes batch {int(shape0[0])})")
                    continue
                sync = _sync(m)
                _timed(lambda: (m(*arrays), sync()), 2 if args.no_warmup else 3)  # warm-up: compile, caches
                t = _timed(lambda: (m(*arrays), sync()), reps)
                med = statistics.median(t)
                print(f"{os.path.basename(path):<24} {backend:<8} {batch:>5} {med * 1e3:>10.2f} {min(t) * 1e3:>8.2f} "
                      f"{max(t) * 1e3:>8.2f} {batch / med:>9.1f}")
    return 0


def _sync(m):
    import torch

    if m.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None
