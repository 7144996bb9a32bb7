"""Op counts of imported vision networks before and after the fusion passes, and (on a GPU, with
--kernels) the CUDA kernels one inference launches: edgellm cuda unfused / fused vs PyTorch eager.

    python benchmarks/onnx_ops.py [--models vit_b_16,convnext_tiny,...] [--size 224] [--kernels [--profile 12]]
                                  [--out ops.json]

Each architecture is built with random weights (nothing is downloaded), exported to ONNX (opset 17,
as benchmarks/bench_onnx.py does) and compiled for batch 1 at size x size. Columns:
  ops        the compiled graph's op count (fuse=False: cleanup passes only; fused: every pass)
  compute    the same without layout-only ops (reshape, transpose, gather, slice), which are views
             on the device and launch nothing
  kernels    (--kernels) CUDA kernels in one inference, counted by torch.profiler, CUDA graphs off
             (inside a graph the same kernels run, with less launch overhead between them);
             --profile N adds each engine's N most expensive kernels (time summed per name)
Without a GPU the op counts are printed and --kernels is skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

DEFAULT_MODELS = "resnet18,mobilenet_v2,efficientnet_b0,vit_b_16,convnext_tiny"
LAYOUT = {"reshape", "transpose", "gather", "slice"}


def _tv_models():
    try:
        import torchvision.models as m

        return m
    except Exception:
        from onnx_models import torchvision_models

        return torchvision_models()


def kernel_profile(fn, reps: int = 3) -> tuple[int, dict[str, tuple[int, float]]]:
    """(CUDA kernels launched by one call of fn, {kernel name: (launches, total us) per call}),
    after warm-up, from torch.profiler's trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name != "CUDA" or "memcpy" in e.name.lower() or "memset" in e.name.lower():
            continue
        row = per.setdefault(e.name, [0, 0.0])
        row[0] += 1
        row[1] += e.time_range.elapsed_us()  # a device event: its kernel's own duration
    n = sum(r[0] for r in per.values())
    return round(n / reps), {k: (round(v[0] / reps), v[1] / reps) for k, v in per.items()}


def _print_top(title: str, per: dict, top: int) -> None:
    total = sum(t for _, t in per.values())
    print(f"  {title}: {total:.1f} us of kernels per inference")
    for name, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {t:>9.1f} us {n:>4}x  {name[:110]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--kernels", action="store_true", help="count CUDA kernels per inference (needs a GPU)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="with --kernels: print the N kernels taking the most time, per engine")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    import torch

    from edgellm.compiler.compile import compile_graph
    from edgellm.onnx import import_onnx, load_onnx
    from onnx_models import export, randomize

    gpu = torch.cuda.is_available()
    if args.kernels and not gpu:
        print("onnx_ops: --kernels needs a CUDA GPU; printing op counts only", file=sys.stderr)
    tvm = _tv_models()
    tmp = Path(tempfile.mkdtemp(prefix="onnx_ops_"))
    sizes = {"batch": 1, "height": args.size, "width": args.size}
    rows = []
    print(f"{'model':<18} {'ops':>5} {'fused':>6} {'compute':>8} {'fused':>6}"
          + (f" {'kernels':>8} {'fused':>6} {'torch':>6}" if args.kernels and gpu else "") + "  fused kinds")
    for name in args.models.split(","):
        kwargs = {"image_size": args.size} if name.startswith("vit") else {}
        model = randomize(getattr(tvm, name)(**kwargs)).eval()
        path = export(model, tmp / f"{name}.onnx", args.size, dynamic_hw=not name.startswith("vit"))
        graph = import_onnx(path).graph
        syms = {s.name for t in graph.inputs for d in graph.tensors[t].shape for s in d.free_symbols}
        sz = {k: v for k, v in sizes.items() if k in syms}
        before = compile_graph(graph, fuse=False, sizes=sz, planner="greedy_by_size").graph
        after = compile_graph(graph, fuse=True, sizes=sz, planner="greedy_by_size").graph
        row = {"model": name, "size": args.size, "ops_unfused": len(before.ops), "ops_fused": len(after.ops),
               "compute_unfused": sum(1 for o in before.ops if o.kind not in LAYOUT),
               "compute_fused": sum(1 for o in after.ops if o.kind not in LAYOUT),
               "kinds_unfused": before.op_counts(), "kinds_fused": after.op_counts()}
        if args.kernels and gpu:
            x = torch.randn(1, 3, args.size, args.size, device="cuda")
            profiles = {}
            for key, fuse in (("kernels_unfused", False), ("kernels_fused", True)):
                m = load_onnx(path, backend="cuda", fuse=fuse)
                m.runner.graphs = False
                xe = {m.input_names[0]: x.half()}
                row[key], profiles[key] = kernel_profile(lambda: m.run_device(xe))
            half = model.half().to(memory_format=torch.channels_last).cuda()
            xh = x.half().to(memory_format=torch.channels_last)

            def eager():
                with torch.inference_mode():
                    return half(xh)
            row["kernels_torch"], profiles["kernels_torch"] = kernel_profile(eager)
            row["kernel_us"] = {k: sum(t for _, t in p.values()) for k, p in profiles.items()}
        rows.append(row)
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(row["kinds_fused"].items(), key=lambda kv: -kv[1]))
        print(f"{name:<18} {row['ops_unfused']:>5} {row['ops_fused']:>6} {row['compute_unfused']:>8} "
              f"{row['compute_fused']:>6}"
              + (f" {row['kernels_unfused']:>8} {row['kernels_fused']:>6} {row['kernels_torch']:>6}"
                 if "kernels_fused" in row else "") + f"  {kinds}")
        if args.profile and "kernels_fused" in row:
            _print_top("edgellm fused", profiles["kernels_fused"], args.profile)
            _print_top("edgellm unfused", profiles["kernels_unfused"], args.profile)
            _print_top("torch eager", profiles["kernels_torch"], args.profile)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"rows in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
