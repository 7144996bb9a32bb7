"""Pick kernel launch configurations by timing them once, and remember the choice on disk.

The cuda backend calls :meth:`Tuner.pick` while it loads a model, once per (kernel, key), where
the key names what the best launch configuration depends on: the weight format and the shape.
The first time a (device, kernel, key) is seen, the default configuration and each candidate
are timed on the device and the fastest is kept; later loads read it back from the cache
without timing anything.

Cache file
    ``<cache dir>/tune/<device>.json``, one file per device string (the device string should name
    the GPU, its compute capability and the Triton version, e.g. ``"NVIDIA H200|sm90|triton-3.6.0"``;
    characters other than letters, digits, ``.``, ``-`` and ``_`` become ``_`` in the file name).
    It holds one JSON object::

        {"<kernel>|<key items joined by ','>": {"config": {...}, "us": 12.3,
                                                "default_us": 15.0, "candidates": 6}, ...}

    ``config`` is the chosen configuration, ``us`` its median time in microseconds, ``default_us``
    the default's (null if the default failed to run) and ``candidates`` how many distinct
    configurations were tried, the default included. Files are replaced atomically (a temporary
    file in the same folder, then ``os.replace``). A cached choice that is no longer among the
    configurations offered (the kernel's candidates changed) is timed again. Put a version into
    the kernel name when a kernel's code changes in a way that invalidates old timings.

    An unreadable or corrupt file gives a warning and an empty cache (it is rewritten at the next
    save); a cache folder that cannot be written gives a warning and the results stay in memory.
    A missing file is the normal first run, and is silent.

Environment
    ``EDGELLM_TUNE``       ``0`` turns tuning off: every pick is the default configuration, nothing
                           is timed and the cache is neither read nor written, so a run is
                           deterministic. Unset or any other value: tuning on.
    ``EDGELLM_CACHE_DIR``  the cache folder; else ``$XDG_CACHE_HOME/edgellm``, else
                           ``~/.cache/edgellm``.
    ``EDGELLM_PROGRESS``   ``1`` shows the progress bar even when stderr is not a terminal, ``0``
                           hides it even when it is.

Typical use::

    tuner = Tuner(device_name)
    with tuner.tuning_session(total=len(layers)):        # one progress bar, one save at the end
        for layer in layers:
            cfg = tuner.pick("matmul_q4_1", (layer.n, layer.k), CANDIDATES, DEFAULT,
                             run=lambda cfg: launch(layer, **cfg))
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["Tuner", "cuda_event_timer", "default_cache_dir", "tuning_enabled"]

Config = dict
Timer = Callable[[Callable[[], None]], float]


def default_cache_dir() -> Path:
    """The engine's cache root (edgellm.cache.cache_root): ``$EDGELLM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/edgellm``, else ``~/.cache/edgellm``."""
    from ...cache import cache_root

    return cache_root()


def tuning_enabled() -> bool:
    """Whether ``EDGELLM_TUNE`` allows tuning (anything but ``"0"``)."""
    return os.environ.get("EDGELLM_TUNE", "").strip() != "0"


def cuda_event_timer(fn: Callable[[], None], *, launches: int = 20, replays: int = 5,
                     flush_bytes: int = 128 << 20) -> float:
    """Median device time of one ``fn`` in microseconds.

    A decode kernel runs for a few microseconds, less than the host needs to launch it, so timing
    single calls with events measures the host (a first H100 run this way timed every GEMV at
    60-290 us and picked noise). Here ``fn`` runs once to compile, is captured ``launches`` times
    into one CUDA graph, and the graph is replayed ``replays`` times between events.

    In a decode step every weight comes from DRAM (the model is larger than L2), but the same
    launch repeated keeps a matrix of a few MB in L2 and would time L2. So each launch in the
    graph follows a write of ``flush_bytes`` (more than the L2) to a scratch buffer, and the time
    of a graph of those writes alone is subtracted (``flush_bytes=0``: no flushing).
    """
    import torch

    from .graphs import captured

    fn()
    torch.cuda.synchronize()
    scratch = torch.empty(max(flush_bytes, 1), dtype=torch.uint8, device="cuda")

    def capture(with_fn: bool):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if with_fn:
                fn()  # a warm launch on the capture stream
            scratch.fill_(1)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with captured(graph):
            for _ in range(launches):
                if flush_bytes:
                    scratch.fill_(1)
                if with_fn:
                    fn()
        graph.replay()
        torch.cuda.synchronize()
        return graph

    def per_launch(graph) -> float:
        times: list[float] = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / launches)  # ms -> us per launch
        return statistics.median(times)

    total = per_launch(capture(True))
    if not flush_bytes:
        return total
    return max(total - per_launch(capture(False)), 0.01)


def _sanitize(device: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", device).strip("._") or "device"


def _entry_key(kernel: str, key: tuple) -> str:
    return f"{kernel}|{','.join(map(str, key))}"


def _canonical(config: Config) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def _progress_wanted(progress: bool) -> bool:
    if not progress:
        return False
    env = os.environ.get("EDGELLM_PROGRESS")
    if env in ("0", "1"):
        return env == "1"
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def _distinct(default: Config, candidates: list[Config]) -> dict[str, Config]:
    """The default and the candidates without repeats, the default first, by canonical form."""
    configs: dict[str, Config] = {}
    for cfg in [default, *candidates]:
        configs.setdefault(_canonical(cfg), dict(cfg))
    return configs


def _quietly(run: Callable[[Config], None], cfg: Config) -> None:
    """run(cfg), a failure ignored (its timing run meets it again and skips the configuration)."""
    try:
        run(cfg)
    except Exception:  # noqa: BLE001
        pass


class Tuner:
    """Per-device choice of kernel launch configurations, timed at first use and cached on disk.

    ``device`` names the device (it names the cache file). ``cache_dir`` defaults to
    :func:`default_cache_dir`; ``enabled`` to :func:`tuning_enabled` (``EDGELLM_TUNE``); ``timer``
    to :func:`cuda_event_timer` (it takes a no-argument function and returns microseconds).
    ``progress`` allows a progress bar on stderr, shown only on a terminal or with
    ``EDGELLM_PROGRESS=1``.
    """

    def __init__(self, device: str, *, cache_dir: str | os.PathLike | None = None, enabled: bool | None = None,
                 timer: Timer | None = None, progress: bool = True):
        self.device = device
        self.enabled = tuning_enabled() if enabled is None else bool(enabled)
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.path = root / "tune" / f"{_sanitize(device)}.json"
        self.timer: Timer = timer or cuda_event_timer
        self._show_progress = _progress_wanted(progress)
        self._entries: dict[str, dict] | None = None  # read lazily, at the first pick
        self._dirty = False
        self._writable = True
        self._warned: set[str] = set()
        self._picks: list[dict] = []
        self._session_depth = 0
        self._bar = None  # (rich Progress, task id) while a bar is shown
        self._session_total = 0
        self._session_done = 0
        # the backend's precompile(launch): compiles what launch() would launch, in parallel, first
        self.precompile: Callable[[Callable[[], object]], object] | None = None

    # -- the cache file ------------------------------------------------------------------------

    def _warn(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _read(self, *, quiet: bool = False) -> dict[str, dict]:
        """The file's valid entries; {} when it is missing, unreadable or corrupt."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (FileNotFoundError, NotADirectoryError):  # the first run: nothing cached yet
            return {}
        except (OSError, ValueError) as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            if not quiet:
                self._warn("read", f"edgellm tuning cache {self.path} cannot be read ({e}); starting empty")
            return {}
        return {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("config"), dict)}

    def _cache(self) -> dict[str, dict]:
        if self._entries is None:
            self._entries = self._read()
        return self._entries

    def save(self) -> None:
        """Write new results to the cache file (merged over what other processes wrote meanwhile).

        Does nothing when tuning is off, nothing is new, or the folder proved unwritable.
        """
        if not self.enabled or not self._dirty or not self._writable or self._entries is None:
            return
        merged = {**self._read(quiet=True), **self._entries}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(merged, f, indent=1, sort_keys=True, default=str)
                f.write("\n")
            os.replace(tmp, self.path)
            tmp = None
        except OSError as e:
            self._writable = False
            self._warn("write", f"edgellm tuning cache {self.path} cannot be written ({e}); "
                                "keeping tuning results in memory only")
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        self._entries = merged
        self._dirty = False

    # -- picking ---------------------------------------------------------------------------------

    def cached(self, kernel: str, key: tuple) -> Config | None:
        """The cached configuration for (kernel, key), or None (always None when tuning is off)."""
        entry = self.entry(kernel, key)
        return dict(entry["config"]) if entry else None

    def entry(self, kernel: str, key: tuple) -> dict | None:
        """The cached pick for (kernel, key) with its times: {"config", "us", "default_us", ...}, or
        None (always None when tuning is off)."""
        if not self.enabled:
            return None
        entry = self._cache().get(_entry_key(kernel, key))
        return dict(entry) if entry else None

    def pick(self, kernel: str, key: tuple, candidates: list[Config], default: Config,
             run: Callable[[Config], None], rounds: int = 1) -> Config:
        """The fastest of ``default`` and ``candidates`` for ``kernel`` at ``key``.

        ``run(config)`` launches the kernel once with a configuration. A cached choice is returned
        without running anything. Otherwise each distinct configuration (the default first) is
        timed with ``timer(lambda: run(config))``, ``rounds`` times in turn (every configuration
        once, then again: a drift of the device's clock over the picks falls on all of them) and
        the least of its times kept; one that raises (compile error, out of resources...) is
        skipped. The fastest is cached and returned; ties go to the default, and
        if every configuration fails the default is returned (and nothing is cached). With tuning
        off the default is returned and nothing runs. Configurations must be JSON-serializable
        (keep values to numbers, strings and booleans).
        """
        default = dict(default)
        if not self.enabled:
            self._note(kernel, key, default, None, None, "default")
            return default
        configs = _distinct(default, candidates)
        name = _entry_key(kernel, key)
        entry = self._cached(name, configs)
        if entry is not None:
            self._advance()
            self._note(kernel, key, dict(entry["config"]), entry.get("us"), entry.get("default_us"), "cached")
            return dict(entry["config"])

        with self._maybe_session():  # outside a session: a session of one, saved at its end
            self._start_bar(f"{kernel} {key}")
            if self.precompile is not None:  # the candidates' kernels compiled side by side
                self.precompile(lambda: [_quietly(run, cfg) for cfg in configs.values()])
            times: dict[str, float] = {}
            failed: set[str] = set()
            for _ in range(max(1, rounds)):
                for canon, cfg in configs.items():
                    if canon in failed:
                        continue
                    try:
                        t = float(self.timer(lambda cfg=cfg: run(cfg)))
                    except Exception:  # noqa: BLE001 - a failing configuration is simply not a choice
                        failed.add(canon)
                        times.pop(canon, None)
                        continue
                    times[canon] = min(t, times.get(canon, t))
            self._advance()
            default_us = times.get(_canonical(default))
            if not times:
                self._note(kernel, key, default, None, None, "failed")
                return default
            best = min(times, key=times.__getitem__)  # min keeps the first of equals: the default wins ties
            choice = configs[best]
            self._cache()[name] = {"config": choice, "us": times[best], "default_us": default_us,
                                   "candidates": len(configs)}
            self._dirty = True
            self._note(kernel, key, choice, times[best], default_us, "tuned")
        return dict(choice)

    def prepare(self, kernel: str, jobs: list[tuple[tuple, list[Config], Config, Callable[[Config], None]]]) -> None:
        """Ahead of the picks of ``jobs`` ((key, candidates, default, run) each, as pick takes
        them): with a ``precompile`` hook and tuning on, every configuration of the keys not cached
        yet is launched once inside one precompile call, so that all their kernels compile side by
        side (the cuda backend: on a thread pool) rather than one pick's at a time. Nothing is
        timed or cached here."""
        if self.precompile is None or not self.enabled:
            return
        todo: dict[str, tuple[Callable[[Config], None], list[Config]]] = {}
        for key, candidates, default, run in jobs:
            name = _entry_key(kernel, key)
            if name in todo:
                continue
            configs = _distinct(default, candidates)
            if self._cached(name, configs) is None:
                todo[name] = (run, list(configs.values()))
        if todo:
            self.precompile(lambda: [_quietly(run, cfg) for run, cfgs in todo.values() for cfg in cfgs])

    def _cached(self, name: str, configs: dict[str, Config]) -> dict | None:
        """The cache's entry for name if its choice is still one of configs (else it is stale)."""
        entry = self._cache().get(name)
        return entry if entry is not None and _canonical(entry["config"]) in configs else None

    def _note(self, kernel, key, config, us, default_us, source) -> None:
        self._picks.append({"kernel": kernel, "key": tuple(key), "config": dict(config), "us": us,
                            "default_us": default_us, "source": source})

    def report(self) -> list[dict]:
        """The picks of this Tuner so far: kernel, key, config, us, default_us, and source
        (``"tuned"``, ``"cached"``, ``"default"`` when tuning is off, ``"failed"`` when nothing ran)."""
        return [dict(p, config=dict(p["config"])) for p in self._picks]

    # -- progress --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def tuning_session(self, total: int) -> Iterator[Tuner]:
        """Group about ``total`` picks under one progress bar and one save at the end.

        The bar ("tuning kernels for <device>") appears only once something has to be timed, and
        advances on every pick in the session. Sessions nest; the outermost one owns the bar.
        """
        self._session_depth += 1
        self._session_total += max(0, int(total))
        try:
            yield self
        finally:
            self._session_depth -= 1
            if self._session_depth == 0:
                self._stop_bar()
                self._session_total = self._session_done = 0
                self.save()

    def _maybe_session(self):
        return contextlib.nullcontext() if self._session_depth else self.tuning_session(1)

    def _start_bar(self, what: str) -> None:
        if not self._show_progress:
            return
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            bar = Progress(TextColumn(f"tuning kernels for {self.device}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), TextColumn("{task.description}"),
                           console=Console(stderr=True), transient=True)
            bar.start()
            task = bar.add_task("", total=max(self._session_total, self._session_done + 1),
                                completed=self._session_done)
            self._bar = (bar, task)
        bar, task = self._bar
        bar.update(task, description=what)

    def _advance(self) -> None:
        if self._session_depth == 0:
            return
        self._session_done += 1
        if self._bar is not None:
            bar, task = self._bar
            bar.update(task, completed=self._session_done, total=max(self._session_total, self._session_done))

    def _stop_bar(self) -> None:
        if self._bar is not None:
            self._bar[0].stop()
            self._bar = None
