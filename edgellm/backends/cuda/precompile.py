"""Compile the Triton kernels a batch of launches needs, in parallel, before they first launch.

A first load compiles every kernel a short prompt's prefill and the first decode step launch
(and the tuner's candidates), each at its first launch, one after the other: on the H100 host about
16 kernels and 14 s, of which each kernel's ptxas run and its launcher's gcc run are subprocesses
and the rest Triton's MLIR and LLVM passes. Done here instead:

1. `collect(launch)` runs `launch()` (the same host code as the real steps) with every Triton
   launch turned into a compile-only warm-up, and Triton's `jit_cache_hook` recording each kernel
   that would compile (its specialization: signature, constants, options) and skipping it, so
   nothing compiles and nothing runs on the device. Host code between launches runs as usual
   (torch ops on the step's buffers included); a program being collected must not capture CUDA
   graphs (`collecting()` tells it).
2. `compile_all(specs)` compiles the distinct specializations on a thread pool
   (`JITFunction.preload`: the same compile, written to Triton's cache and to the kernel's
   in-memory table under the key its launch looks up), then loads each onto the device and builds
   its launcher (`CompiledKernel._init_handles`), so the subprocesses and much of the passes
   overlap. A kernel that fails here is left for its real launch, which raises the error as before.

The real steps then find every kernel compiled. `EDGELLM_COMPILE_THREADS` sets the pool's size
(default: the CPU count, at most 16); 0 or 1 turns this off (kernels compile at first launch).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

_lock = threading.Lock()  # one collection at a time: the patch and the hook are process-wide
_state = threading.local()


def threads() -> int:
    """The compile pool's size (EDGELLM_COMPILE_THREADS; default the CPU count, at most 16)."""
    raw = os.environ.get("EDGELLM_COMPILE_THREADS", "").strip()
    if raw:
        try:
            return max(0, int(raw))
        except ValueError:
            raise ValueError(f"EDGELLM_COMPILE_THREADS must be a whole number, got {raw!r}") from None
    return min(16, os.cpu_count() or 1)


def enabled() -> bool:
    """Whether launches compile ahead in parallel: a pool of 2 or more, and compiled Triton (the
    interpreter compiles nothing)."""
    from triton import knobs

    return threads() > 1 and not knobs.runtime.interpret


def collecting() -> bool:
    """True on the thread running collect(): its launches neither compile nor run, so a program
    must run its steps eagerly (no CUDA graph capture)."""
    return getattr(_state, "on", False)


@dataclass
class Spec:
    """One kernel specialization to compile: the JIT function and Triton's serialized form of it."""

    fn: object  # triton.runtime.jit.JITFunction
    data: str  # its specialization data (JSON), as JITFunction.preload takes
    key: str  # (kernel, specialization) identity, for de-duplication


@dataclass
class Report:
    """What compile_all did: kernels compiled, those that failed (left to their launch) and the wall
    time of the collection and of the compile."""

    kernels: int = 0
    failed: list[str] = field(default_factory=list)
    collect_s: float = 0.0
    compile_s: float = 0.0


def collect(launch: Callable[[], object]) -> tuple[list[Spec], float]:
    """Run launch() with Triton's launches compile-only and uncompiled kernels recorded instead of
    compiled. Returns the distinct specializations (in launch order) and the seconds it took."""
    from triton import knobs
    from triton.runtime.jit import JITFunction

    specs: dict[str, Spec] = {}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's names
        ident = f"{fn.module}.{fn.name}:{key}"
        if ident not in specs:
            specs[ident] = Spec(fn.jit_function, compile["specialization_data"], ident)
        return True  # skip: _do_compile returns None, the launch returns without running

    t0 = time.perf_counter()
    with _lock:
        run, prev = JITFunction.run, knobs.runtime.jit_cache_hook
        caller = threading.get_ident()

        def compile_only(self, *args, grid, warmup, **kwargs):
            # the collecting thread's launches only (any other thread launches as usual)
            return run(self, *args, grid=grid, warmup=warmup or threading.get_ident() == caller, **kwargs)

        JITFunction.run = compile_only
        knobs.runtime.jit_cache_hook = lambda **kw: (hook(**kw) if threading.get_ident() == caller
                                                     else prev(**kw) if prev is not None else None)
        _state.on = True
        try:
            launch()
        finally:
            _state.on = False
            JITFunction.run = run
            knobs.runtime.jit_cache_hook = prev
    return list(specs.values()), time.perf_counter() - t0


def compile_all(specs: list[Spec], *, device=None, workers: int | None = None, load: bool = True) -> Report:
    """Compile the specializations on a pool of `workers` threads (default threads()); with load
    (a CUDA device), also load each onto `device` and build its launcher."""
    report = Report()
    if not specs:
        return report
    n = max(1, min(workers or threads(), len(specs)))
    t0 = time.perf_counter()
    set_device = None
    if load and device is not None:
        import torch

        device = torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()

        def set_device():  # this thread's current device, as the launch's
            torch.cuda.set_device(index)

    def one(spec: Spec) -> str | None:
        try:
            if set_device is not None:
                set_device()
            kernel = spec.fn.preload(spec.data)
            if load and kernel is not None:
                kernel._init_handles()  # the module on the device and the launcher (gcc, cached)
        except Exception as e:  # noqa: BLE001 - the kernel's own launch reports it
            return f"{spec.key}: {type(e).__name__}: {e}"
        return None

    with ThreadPoolExecutor(n, thread_name_prefix="edgellm-compile") as pool:
        for err in pool.map(one, specs):
            if err is None:
                report.kernels += 1
            else:
                report.failed.append(err)
    report.compile_s = time.perf_counter() - t0
    return report


def precompile(launch: Callable[[], object], *, device=None, load: bool = True) -> Report | None:
    """collect(launch), then compile_all of what it found; None where it is off (enabled()) or
    launch() raised (warned: the real run raises it again, where it belongs)."""
    if not enabled() or collecting():
        return None
    try:
        specs, collect_s = collect(launch)
    except Exception as e:  # noqa: BLE001 - the real steps meet the same error and report it
        import warnings

        warnings.warn(f"cuda: kernels not compiled ahead (they compile at their first launch): "
                      f"{type(e).__name__}: {str(e)[:300]}", RuntimeWarning, stacklevel=2)
        return None
    report = compile_all(specs, device=device, load=load)
    report.collect_s = collect_s
    return report

