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

Threads alone scale a compile about 3x on 16 cores: Triton's code generation (Python walking the
kernel's AST) and parts of its passes hold the GIL. So the compiles that Triton's on-disk cache
does not already hold run in **worker processes** (`EDGELLM_COMPILE_POOL=process`, the default;
`thread` keeps everything in this process): a fork server that has imported Triton and the kernel
modules once forks the workers, each compiles a specialization for the same target with the same
options (Triton writes the result to its cache under the same key as this process computes) and
builds its launcher, and this process's threads then read each kernel back from the cache and load
it onto the device. A worker that cannot compile a kernel (or a pool that cannot start) leaves it
to the in-process compile, which raises the error as before. `start_pool()` starts the workers in
the background when a load already knows it will compile (Model's program cache missed).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
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
    in_workers: int = 0  # of kernels: compiled by the worker processes (the rest were cache reads or in-process)
    worker_s: list[float] = field(default_factory=list)  # each worker compile's seconds (in its process)
    launcher_s: list[float] = field(default_factory=list)  # of which building (or waiting for) its launcher


reports: list[Report] = []  # this process's compile_all reports, latest last (at most 64; profiling reads them)


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
    """Compile the specializations: those Triton's cache lacks in the compile server's workers
    (pool_mode() "process"), read back on a pool of `workers` threads (default threads()), which
    compile whatever the workers did not; with load (a CUDA device), also load each onto `device`
    and build its launcher."""
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

    remote = _submit_to_workers(specs)

    def one(spec: Spec) -> str | None:
        try:
            if set_device is not None:
                set_device()
            future = remote.get(spec.key)
            if future is not None:
                try:  # compiled into Triton's cache by a worker: the preload below reads it back
                    future.result(timeout=WORKER_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - compiled here instead, which reports a real error
                    pass
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
    answers = [a for f in remote.values() if f.done() and not f.cancelled() and f.exception() is None
               for a in [f.result()] if isinstance(a, dict)]
    report.worker_s = [a["seconds"] for a in answers]
    report.launcher_s = [a["launcher_s"] for a in answers]
    report.in_workers = len(answers)
    report.compile_s = time.perf_counter() - t0
    reports.append(report)
    del reports[:-64]
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



# -- compiling in worker processes -------------------------------------------------------------------

_pool_lock = threading.Lock()
_pool: "_Server | None" = None  # the compile server, once its workers are up
_pool_thread: threading.Thread | None = None  # starting it
_pool_error: str | None = None  # why it could not start or broke: threads only, for the rest of the process
START_TIMEOUT_S = 60.0
WORKER_TIMEOUT_S = 300.0  # a worker's compile not answered by then is done here instead
LAZY_START_MIN = 8  # compiles that start a server not started ahead (start_pool): ~2 s of imports


def pool_mode() -> str:
    """Where the compiles run: "process" (worker processes; the default) or "thread" (this process's
    threads only), from EDGELLM_COMPILE_POOL."""
    raw = os.environ.get("EDGELLM_COMPILE_POOL", "").strip().lower() or "process"
    if raw not in ("process", "thread"):
        raise ValueError(f"EDGELLM_COMPILE_POOL must be 'process' or 'thread', got {raw!r}")
    return raw


class _Server:
    """The client of a compile server (compile_server.py: a process of its own, started with this
    Python, whose forked workers compile): requests and answers as JSON lines over its stdin and
    stdout. Not multiprocessing's spawn or fork server, which import the user's main module again
    in every worker."""

    def __init__(self, workers: int):
        import subprocess
        import sys

        from ...cache import triton_cache_dir

        # the Triton cache this process reads from (a server started before the cuda backend's
        # import, which sets the variable, would otherwise compile into Triton's default folder)
        env = dict(os.environ, TRITON_CACHE_DIR=triton_cache_dir())
        self.proc = subprocess.Popen([sys.executable, "-m", f"{__package__}.compile_server", str(workers)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, bufsize=1, env=env)
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._next = 0
        self._ready = threading.Event()
        self._dead: str | None = None
        t0 = time.perf_counter()
        self._reader = threading.Thread(target=self._read, name="edgellm-compile-server", daemon=True)
        self._reader.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._dead is not None:
            self.close()
            raise RuntimeError(self._dead or f"the compile server did not start within {START_TIMEOUT_S:.0f} s")
        self.start_s = time.perf_counter() - t0  # its imports and the workers' forks

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("ready"):
                self._ready.set()
                continue
            with self._lock:
                future = self._pending.pop(msg.get("id"), None)
            if future is None:
                continue
            if msg.get("ok"):
                future.set_result({"seconds": float(msg.get("seconds", 0.0)),
                                   "launcher_s": float(msg.get("launcher_s", 0.0))})
            else:
                future.set_exception(RuntimeError(msg.get("error", "compile failed")))
        try:
            code = self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - its pipe closed, the process lingers
            code = None
        with self._lock:  # the server is gone: whatever waits compiles in this process
            self._dead = self._dead or f"the compile server exited (code {code})"
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(RuntimeError(self._dead))
        self._ready.set()

    def submit(self, *request) -> Future:
        future: Future = Future()
        with self._lock:
            if self._dead is not None:
                raise RuntimeError(self._dead)
            self._next += 1
            ident = self._next
            self._pending[ident] = future
        try:
            self.proc.stdin.write(json.dumps({"id": ident, "args": request}) + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:
            with self._lock:
                self._pending.pop(ident, None)
            raise RuntimeError(f"the compile server is gone: {e}") from None
        return future

    @property
    def dead(self) -> str | None:
        return self._dead

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # end of requests: the server lets its workers go and exits
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a server that does not leave is stopped
            self.proc.kill()


_last_start_s: float | None = None  # how long the last server took to start (profiling reads it)


def _start() -> None:
    global _pool, _pool_error, _last_start_s
    try:
        server = _Server(threads())
    except Exception as e:  # noqa: BLE001 - no workers here (a sandbox, no fork): threads then
        _pool_error = f"{type(e).__name__}: {e}"
        return
    _last_start_s = server.start_s
    with _pool_lock:
        wanted = _pool_thread is threading.current_thread()  # else stop_pool() came first
        if wanted:
            _pool = server
    if not wanted:
        server.close()


def pool_error() -> str | None:
    """Why compiles stay in this process's threads although pool_mode() is "process" (the server
    could not start, or died), or None."""
    return _pool_error


def start_pool(*, interpreter_checked: bool = False) -> None:
    """Start the compile workers in the background (a no-op when they run, or where compiles stay in
    this process: pool_mode() "thread", a pool of one, the interpreter, a start that failed).
    interpreter_checked: the caller knows Triton compiles here (start_pool_if_cold's thread, which
    must not import Triton while the main thread imports torch)."""
    global _pool_thread
    if pool_mode() != "process" or threads() < 2 or not (interpreter_checked or enabled()):
        return
    with _pool_lock:
        if _pool is not None or _pool_error is not None or (_pool_thread is not None and _pool_thread.is_alive()):
            return
        _pool_thread = threading.Thread(target=_start, name="edgellm-compile-pool", daemon=True)
        _pool_thread.start()


def start_pool_if_cold() -> bool:
    """At a process's start (`edgellm run` before it imports torch): when Triton's kernel cache is
    empty (the first run on this machine), start the compile workers as soon as the early context
    (early.py) says there is a GPU, on a thread of their own; True when that thread started.
    Otherwise the load starts them where it finds its programs uncached (start_pool)."""
    from ...cache import triton_cache_dir

    folder = triton_cache_dir()
    try:
        with os.scandir(folder) as entries:
            if any(entries):
                return False
    except OSError:  # no folder yet: empty
        pass

    def when_there_is_a_gpu():  # without holding up the caller's imports while the driver starts
        from .early import outcome

        if outcome(timeout=10.0).get("context") and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            start_pool(interpreter_checked=True)
    threading.Thread(target=when_there_is_a_gpu, name="edgellm-compile-pool-early", daemon=True).start()
    return True


def stop_pool() -> None:
    """Let the workers go (a server still starting closes itself when up, without this call
    waiting for it); a later compile starts a server again."""
    global _pool, _pool_thread
    with _pool_lock:
        pool, _pool, _pool_thread = _pool, None, None
    if pool is not None:
        pool.close()


IDLE_STOP_S = 30.0
_idle_timer: threading.Timer | None = None


def stop_pool_when_idle(seconds: float = IDLE_STOP_S) -> None:
    """A load's compiles are done: the workers go after `seconds` without a compile (the first
    request's new steps, e.g. a sampled decode loop, compile right after the load)."""
    global _idle_timer
    with _pool_lock:
        if _idle_timer is not None:
            _idle_timer.cancel()
        used = _uses

        def stop_if_unused():
            if _uses == used:
                stop_pool()
            else:
                stop_pool_when_idle(seconds)
        _idle_timer = threading.Timer(seconds, stop_if_unused)
        _idle_timer.daemon = True
        _idle_timer.start()


def _get_pool() -> "_Server | None":
    global _pool_error
    start_pool()
    thread = _pool_thread
    if thread is not None:
        thread.join(START_TIMEOUT_S + 15)
    pool = _pool
    if pool is not None and pool.dead is not None:  # it died (killed, out of memory): threads from now on
        _pool_error = pool.dead
        stop_pool()
        return None
    return pool


def _resolve(module: str, qualname: str):
    """The JIT function named module + qualname (a module-level kernel), or None."""
    from triton.runtime.jit import JITFunction

    if "<locals>" in qualname:
        return None
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, JITFunction) else None


def _source(fn, data: str, target: tuple):
    """(source, target, backend, options) of a specialization, read from Triton's serialized form
    (JITFunction.preload's reading, without asking the driver for a device: the target is given)."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    d = json.loads(data)
    constexprs = {
        tuple(k): (tl.dtype(v) if tl.dtype.is_dtype(v) else
                   tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v)
        for k, v in zip(d["constant_keys"], d["constant_vals"])
    }
    attrs = dict(zip(map(tuple, d["attrs_keys"]), d["attrs_vals"]))
    signature = {k: convert_to_tuple_if_list(v) for k, v in d["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items()}
    gpu = GPUTarget(*target)
    backend = make_backend(gpu)
    return ASTSource(fn, signature, constexprs, attrs), gpu, backend, backend.parse_options(options)


def _cache_entry(src, backend, options) -> tuple[str, bool]:
    """(the digest of the key triton.compile files a specialization (_source's src, backend and
    options) under, whether Triton's on-disk cache holds it)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import get_cache_key, get_cache_manager

    options = backend.parse_options(dict(options.__dict__, **src.parse_options()))
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
    return digest, get_cache_manager(digest).get_group(f"{src.name[:150]}.json") is not None


def compile_in_worker(module: str, qualname: str, fn_key: str, data: str, target: list,
                      digest: str | None = None, cache_dir: str | None = None) -> float:
    """In a worker: compile one specialization into Triton's cache and build its launcher; the seconds
    it took. `digest` and `cache_dir`: the cache key's digest and the cache folder of the loading
    process, which must be this process's too (else the loading process would not find the result:
    an error, and it compiles the kernel itself)."""
    t0 = time.perf_counter()
    fn = _resolve(module, qualname)
    if fn is None or fn.cache_key != fn_key:
        raise LookupError(f"{module}.{qualname}: not the kernel the loading process launches")
    if cache_dir is not None:
        from triton import knobs

        if os.path.realpath(knobs.cache.dir) != os.path.realpath(cache_dir):
            raise LookupError(f"the compile server's Triton cache is {knobs.cache.dir}, not {cache_dir}")
    src, gpu, backend, options = _source(fn, data, tuple(target))
    if digest is not None and _cache_entry(src, backend, options)[0] != digest:
        raise LookupError(f"{module}.{qualname}: another Triton cache key in the compile server")
    from triton.compiler import compile as triton_compile

    kernel = triton_compile(src, target=gpu, options=options.__dict__)
    t1 = time.perf_counter()
    if gpu.backend == "cuda":
        try:  # the launcher's C stub (gcc), cached by its source: the loading process then imports it
            from triton.backends.nvidia.driver import CudaLauncher

            # one build per kernel at a time: a kernel's tiles share one stub, which workers
            # compiling several of its tiles at once would otherwise each build with gcc
            with _launcher_lock(module, qualname):
                CudaLauncher(kernel.src, kernel.metadata)
        except Exception:  # noqa: BLE001 - no CUDA library here: the loading process builds it
            pass
    t2 = time.perf_counter()
    return {"seconds": t2 - t0, "launcher_s": t2 - t1}


@contextmanager
def _launcher_lock(module: str, qualname: str):
    """An exclusive lock, across the compile workers, on building a kernel's launcher (a file lock
    in Triton's cache folder; none where that cannot be made)."""
    from triton import knobs

    try:
        import fcntl

        name = hashlib.sha256(f"{module}.{qualname}".encode()).hexdigest()[:24]
        os.makedirs(knobs.cache.dir, exist_ok=True)
        fd = os.open(os.path.join(knobs.cache.dir, f".edgellm-launcher-{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


_misses = 0  # specializations this process found missing from Triton's cache (compiled, not read)
_uses = 0  # batches sent to the compile server (stop_pool_when_idle looks for new ones)
_sent = 0  # specializations sent to the compile server


def has_compiled() -> bool:
    """Whether this process has compiled kernels (not only read them from Triton's cache): then a
    shape met for the first time likely compiles too, and is worth collecting first (precompile)."""
    return _misses > 0


_inflight_lock = threading.Lock()
_inflight: dict[str, Future] = {}  # spec key -> its compile sent ahead (ahead()), until answered


def ahead(launch: Callable[[], object]) -> int:
    """Send the kernels launch() would compile to the compile workers and return without waiting
    (the server started if need be, on a thread): for kernels a load knows it will launch long
    before it does (the decode loop's token choice depends on the vocabulary alone). Their
    launches' compile_all later waits for these compiles rather than sending them again. Returns
    how many specializations were sent; 0 where compiles stay in this process or launch() raised."""
    if not enabled() or collecting() or pool_mode() != "process":
        return 0
    try:
        specs, _ = collect(launch)
    except Exception:  # noqa: BLE001 - the real launch meets the same error and reports it
        return 0
    with _inflight_lock:
        mine = {s.key: Future() for s in specs if s.key not in _inflight}
        _inflight.update(mine)
    if not mine:
        return 0

    def settle(key: str, placeholder: Future, answer: Future | None) -> None:
        with _inflight_lock:
            if _inflight.get(key) is placeholder:
                del _inflight[key]
        ok = answer is not None and not answer.cancelled() and answer.exception() is None
        placeholder.set_result(answer.result() if ok else None)  # None: compiled where it launches

    def send() -> None:
        try:
            remote = _submit_to_workers([s for s in specs if s.key in mine], least=1, reuse=False)
        except Exception:  # noqa: BLE001 - compiled where they launch
            remote = {}
        for key, placeholder in mine.items():
            answer = remote.get(key)
            if answer is None:
                settle(key, placeholder, None)
            else:
                answer.add_done_callback(lambda f, key=key, ph=placeholder: settle(key, ph, f))
    threading.Thread(target=send, name="edgellm-compile-ahead", daemon=True).start()
    return len(mine)


def _submit_to_workers(specs: list[Spec], *, least: int | None = None, reuse: bool = True) -> dict[str, Future]:
    """Send the specializations Triton's cache does not hold to the workers; {spec key: future}
    (with reuse, those sent ahead and not yet answered are waited for, not sent again). Empty
    where compiles stay in this process, or fewer than `least` need a compiler (default: two,
    or LAZY_START_MIN where the server has not been started)."""
    global _misses, _uses, _sent
    try:
        from triton.runtime.driver import driver

        t = driver.active.get_current_target()
        target = (t.backend, t.arch, t.warp_size)
        todo = []
        for s in specs:
            src, _, backend, options = _source(s.fn, s.data, target)
            digest, cached = _cache_entry(src, backend, options)
            if not cached:
                todo.append((s, s.fn.__module__, s.fn.__qualname__, digest))
    except Exception:  # noqa: BLE001 - the in-process compile handles whatever this could not read
        return {}
    sent: dict[str, Future] = {}
    if reuse:
        with _inflight_lock:
            sent = {job[0].key: _inflight[job[0].key] for job in todo if job[0].key in _inflight}
        todo = [job for job in todo if job[0].key not in sent]
    _misses += len(todo)  # (those sent ahead were counted there)
    todo = [job for job in todo if _resolve(job[1], job[2]) is job[0].fn]
    if pool_mode() != "process":
        return sent
    starting = _pool is not None or (_pool_thread is not None and _pool_thread.is_alive())
    if least is None:
        least = 2 if starting else LAZY_START_MIN
    if len(todo) < least:  # a few compiles: threads, rather than wait for a server
        return sent
    pool = _get_pool()
    if pool is None:
        return sent
    _uses += 1
    out: dict[str, Future] = dict(sent)
    try:
        from triton import knobs

        here = knobs.cache.dir
        for s, module, qualname, digest in todo:
            out[s.key] = pool.submit(module, qualname, s.fn.cache_key, s.data, list(target), digest, here)
            _sent += 1
    except Exception:  # noqa: BLE001 - a broken pool: what was not submitted compiles here
        pass
    return out
