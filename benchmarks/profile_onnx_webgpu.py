"""Where an imported network's time goes on the webgpu backend: each recorded dispatch timed alone
(repeated in one compute pass, one submit, waited for on the host; the per-submit cost is timed
with an empty pass and subtracted), summed per kernel and per op.

    python benchmarks/profile_onnx_webgpu.py MODEL.onnx [--batch 1] [--size 224] [--top 15] [--reps 20]
    python benchmarks/profile_onnx_webgpu.py --torchvision vit_b_16   # random weights, exported here
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--torchvision", default=None, help="a torchvision architecture name (random weights)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="f32")
    a = ap.parse_args()
    from edgellm.backends.webgpu.launch import encode_dispatch, raw_pass_functions
    from edgellm.onnx import load_onnx

    path = a.model
    if a.torchvision:
        from onnx_models import export, randomize, torchvision_models

        name = a.torchvision
        kw = {"image_size": a.size} if name.startswith("vit") else {}
        m = randomize(getattr(torchvision_models(), name)(**kw)).eval()
        path = str(export(m, Path(tempfile.mkdtemp()) / f"{name}.onnx", a.size, dynamic_hw=not name.startswith("vit")))
    if not path:
        ap.error("give an ONNX file or --torchvision NAME")
    om = load_onnx(path, backend="webgpu", dtype=a.dtype)
    x = {om.input_names[0]: np.random.default_rng(0).standard_normal((a.batch, 3, a.size, a.size)).astype(np.float32)}
    for _ in range(3):
        om(x)
    t = time.perf_counter()
    for _ in range(a.reps):
        om(x)
    call_ms = (time.perf_counter() - t) / a.reps * 1e3
    b = list(om.runner._bound.values())[-1]
    rec, dev = b.recording, om.runner.tensor_ops.dev
    raw = raw_pass_functions()

    def timed(steps, n):
        enc = dev.device.create_command_encoder()
        cp = enc.begin_compute_pass()
        for _ in range(n):
            for st in steps:
                encode_dispatch(cp, st[1], st[2], st[3], raw, st[5])
        cp.end()
        t0 = time.perf_counter()
        dev.queue.submit([enc.finish()])
        dev.read(rec.arena, 0, 16)  # waits for the submitted work
        return time.perf_counter() - t0

    base = min(timed([], 1) for _ in range(5))
    per_kernel, per_op = collections.Counter(), collections.Counter()
    gpu = [st for st in rec.steps if st[0] == "gpu"]
    for st in gpu:
        ms = max(0.0, (min(timed([st], a.reps) for _ in range(2)) - base) / a.reps * 1e3)
        op, kern = st[4].split(":", 1)
        per_kernel[f"{kern} {st[3]}"] += ms
        per_op[f"{op} ({kern})"] += ms
    total = sum(per_op.values())
    print(f"{om.describe()}\n{len(gpu)} dispatches; a call {call_ms:.3f} ms on the host clock; "
          f"dispatches timed alone sum to {total:.3f} ms")
    for title, c in (("by kernel and grid", per_kernel), ("by op", per_op)):
        print(f"-- {title}")
        for k, v in c.most_common(a.top):
            print(f"{v:9.3f} ms {100 * v / max(total, 1e-9):5.1f}%  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
