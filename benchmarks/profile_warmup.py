"""Where a load's first-run work goes on the GPU: a timeline of one load in this process.

    python benchmarks/profile_warmup.py --backend cuda FILE.gguf [--runs 2] [--sampled]

Each run is a fresh process (the engine cache as found: run once to fill it, or pass --runs 2 and
read the second). The child times, around the real calls:
- Triton: each kernel specialization met for the first time (`triton.compiler.compile`: a
  compile, or a read of Triton's cache), and its load onto the device (`CompiledKernel._init_handles`);
- CUDA graphs: `torch.cuda.graph` enter (a device synchronize), the capture, exit;
- the cuda program's launch passes (`_launch_all`: eager first runs and captures);
- the load's phases (`Model.load_phases`) and the wall of `edgellm.load`.
and prints them as a table of totals, then the 15 slowest kernels.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r"""
import collections, json, sys, time
t_import = time.perf_counter()
import edgellm
from edgellm.backends import get_backend
backend, path = sys.argv[1], sys.argv[2]
get_backend(backend)
t_imported = time.perf_counter()
tot = collections.defaultdict(float)
cnt = collections.Counter()
slow = []

def timed(owner, name, label, keep=None):
    orig = getattr(owner, name)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            dt = time.perf_counter() - t
            tot[label] += dt
            cnt[label] += 1
            if keep is not None:
                slow.append((dt, label, keep(a, k)))
    setattr(owner, name, wrapper)

if backend == "cuda":
    import torch
    import triton.compiler as tc
    import triton.compiler.compiler as tcc
    def kname(a, k):
        src = a[0] if a else k.get("src")
        return getattr(getattr(src, "fn", None), "__name__", str(src)[:40])
    timed(tc, "compile", "triton compile or cache read", kname)  # JITFunction imports it from here
    timed(tcc.CompiledKernel, "_init_handles", "kernel load + launcher", lambda a, k: getattr(a[0], "name", "?"))
    timed(torch.cuda.graph, "__enter__", "graph enter (synchronize)")
    timed(torch.cuda.graph, "__exit__", "graph exit (end capture, instantiate)")
    from edgellm.backends.cuda import backend as cb
    import torch as _t
    def pass_name(a, k):
        prog, seq = a[0], a[2]
        return f"max_seq={prog.max_seq} rows={seq} capturing={_t.cuda.is_current_stream_capturing()}"
    timed(cb.CudaProgram, "_launch_all", "launch passes (eager + capture)", pass_name)
    import triton.runtime.jit as tjit
    timed(tjit.JITFunction, "run", "JITFunction.run (every launch)")
    import triton.backends.nvidia.driver as nvd
    timed(nvd.CudaLauncher, "__call__", "launcher call (C launch)")
    timed(cb.CudaProgram, "loop_tokens", "loop_tokens generator made")
    timed(torch.cuda, "synchronize", "torch.cuda.synchronize")
    from edgellm.backends.cuda import precompile as pc, tuning as tu
    timed(pc, "collect", "precompile.collect (the launches compile-only)")
    timed(pc, "compile_all", "precompile.compile_all (compile, read back, load)", lambda a, k: f"{len(a[0])} specs")
    timed(pc, "_get_pool", "waiting for the compile server (or its thread)")
    timed(pc, "ahead", "precompile.ahead (collect; sent, not waited for)")
    timed(tu.Tuner, "prepare", "Tuner.prepare (its compiles)", lambda a, k: a[1])
    timed(tu.Tuner, "pick", "Tuner.pick (timing, or the cache)")
    timed(tu, "cuda_event_timer", "tuning's timer (a candidate's graphs)")
sampling = None
if len(sys.argv) > 3 and sys.argv[3] == "sampled":  # the CLI's default draw (edgellm run passes it to load)
    from edgellm.sampling import SamplingParams
    sampling = SamplingParams(seed=1)
t0 = time.perf_counter()
m = edgellm.load(path, backend=backend, sampling=sampling)
t1 = time.perf_counter()
print(json.dumps({"import_s": round(t_imported - t_import, 3), "load_s": round(t1 - t0, 3),
                  "phases": {k: round(v, 3) for k, v in m.load_phases.items()}, "hits": m.cache_hits}))
if backend == "cuda":
    for r in pc.reports:
        ws = sorted(r.worker_s)
        print(f"  compile_all: {r.kernels} kernels in {r.compile_s:.2f} s (collected in {r.collect_s:.2f} s); "
              f"{r.in_workers} by workers" + (f": sum {sum(ws):.2f} s, longest {ws[-1]:.2f} s, launchers "
                                             f"{sum(r.launcher_s):.2f} s" if ws else ""))
    if pc._pool is not None or getattr(pc, "_last_start_s", None) is not None:
        print(f"  compile server start: {getattr(pc, '_last_start_s', None)}")
for label in sorted(tot, key=lambda l: -tot[l]):
    print(f"  {tot[label] * 1e3:9.1f} ms  x{cnt[label]:4d}  {label}")
for dt, label, what in sorted(slow, reverse=True)[:24]:
    print(f"  {dt * 1e3:9.1f} ms  {label}: {what}")
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--runs", type=int, default=2, help="fresh processes per file (the first may fill the cache)")
    ap.add_argument("--sampled", action="store_true",
                    help="load for the CLI's default sampling (its warm-up draws as `edgellm run` does)")
    a = ap.parse_args()
    for f in a.files:
        for i in range(a.runs):
            r = subprocess.run([sys.executable, "-c", CHILD, a.backend, f] + (["sampled"] if a.sampled else []),
                               capture_output=True, text=True,
                               timeout=900, env=dict(os.environ))
            print(f"== {os.path.basename(f)} run {i + 1} (exit {r.returncode})")
            print(r.stdout.strip() or r.stderr.strip()[-3000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
