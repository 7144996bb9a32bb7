"""The sweep: quantize, check engines, measure the device, run every configuration (each repetition
in its own process, configurations round-robin), gather the results, write the reports."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EdgeLLMError
from . import metrics
from .device import cache_root, git_commit, git_dirty, host_info, versions
from .engines import engine_class, engine_label
from .plan import BenchPlan, validate
from .quantize import SOURCE, QuantizationUnavailable, cached_path

SCHEMA = "edgellm-bench/1"
FAILED = ("error", "timeout", "crash", "oom")
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


# -- child processes -------------------------------------------------------------------------------
@dataclass
class JobOutcome:
    status: str  # ok | error | oom | timeout | crash
    error: str | None
    result: dict
    wall_s: float
    returncode: int | None
    log: str  # the job's stdout + stderr (tail)


def _package_root() -> str:
    return str(Path(__file__).resolve().parent.parent.parent)


# The child's entry: import the engine's preload modules first (before edgellm, numpy and torch
# load their own native libraries), then run edgellm.bench.worker as __main__ with the job file.
# A preload that fails to import is left to the engine's own import, which reports it.
_BOOT = """import importlib, runpy, sys
for _m in sys.argv[2:]:
    try:
        importlib.import_module(_m)
    except Exception:
        pass
sys.argv = sys.argv[:2]
runpy.run_module("edgellm.bench.worker", run_name="__main__", alter_sys=True)
"""


def _preload(job: dict) -> list[str]:
    if job.get("job") != "run" or not job.get("engine"):
        return []
    try:
        return list(engine_class(job["engine"]).preload)
    except EdgeLLMError:  # the worker reports an engine it cannot import
        return []


def run_job(job: dict, timeout_s: float, workdir: Path, log_path: Path | None = None) -> JobOutcome:
    """Run one job in a child `python` (edgellm.bench.worker) with a wall-clock limit. A timeout
    kills the job's whole process group; a crash, a signal or an exception is returned, never raised.
    The engine's `preload` modules are imported first in the child (Engine.preload)."""
    workdir.mkdir(parents=True, exist_ok=True)
    fd, cfg_path = tempfile.mkstemp(prefix="job-", suffix=".json", dir=workdir)
    result_path = cfg_path[:-5] + ".result.json"
    job = dict(job, result=result_path)
    with os.fdopen(fd, "w") as f:
        json.dump(job, f)
    log_path = log_path or Path(cfg_path[:-5] + ".log")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_package_root()] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a native crash leaves the Python stack in the job's log
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", _BOOT, cfg_path, *_preload(job)], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the job's own process group (start_new_session)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            rc = proc.wait()
        except BaseException:  # Ctrl-C: do not leave the job running
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            raise
    wall = time.perf_counter() - t0
    try:
        result = json.loads(Path(result_path).read_text())
    except (OSError, ValueError):
        result = {}
    try:
        log_text = log_path.read_text(errors="replace")[-4000:]
    except OSError:
        log_text = ""
    phase = result.get("phase", "start")
    last_line = next((ln.strip() for ln in reversed(log_text.splitlines()) if ln.strip()), "")
    if timed_out:
        status, error = "timeout", f"timed out after {timeout_s:g} s (phase: {phase})"
    elif result.get("status") == "ok" and rc == 0:
        status, error = "ok", None
    elif result.get("status") in ("error", "oom"):
        status, error = result["status"], f"{result.get('error')} (phase: {phase})"
    elif rc is not None and rc < 0:
        sig = signal.Signals(-rc).name if -rc in signal.Signals.__members__.values() else str(-rc)
        hint = " (often the out-of-memory killer)" if -rc == signal.SIGKILL else ""
        status, error = "crash", f"killed by signal {sig}{hint} (phase: {phase})"
    else:
        status = "crash"
        error = f"exited with status {rc} (phase: {phase})" + (f": {last_line[-300:]}" if last_line else "")
    return JobOutcome(status, error, result, wall, rc, log_text)


# -- configurations --------------------------------------------------------------------------------
@dataclass
class Variant:
    """One model file in one quantization."""

    model: str  # label: the source file's stem
    source: str
    quant: str  # SOURCE or a format name
    path: str | None = None
    label: str = ""  # the type shown: the format, or the source file's main type
    source_type: str = ""  # the source file's main type (a quantized source: its variants are re-quantized)
    status: str = "pending"  # ok | skipped
    reason: str | None = None
    size_bytes: int | None = None
    bits_per_weight: float | None = None


@dataclass
class Config:
    id: str
    variant: Variant
    engine: str  # label
    engine_spec: str
    backend: str
    status: str = "pending"
    error: str | None = None
    runs: list[dict] = field(default_factory=list)
    ppl_error: str | None = None  # perplexity was attempted and failed
    ppl_skipped: str | None = None  # perplexity cannot be measured for this model (the reason)


def file_facts(path: str) -> dict:
    """Size, bits per weight and main tensor type of a GGUF file (its header only)."""
    from ..gguf_file import open_gguf

    f = open_gguf(path)
    by_type: dict[str, int] = {}
    n_elements = nbytes = 0
    for t in f.tensors.values():
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.nbytes
        n_elements += t.n_elements
        nbytes += t.nbytes
    main = max(by_type, key=by_type.get) if by_type else "?"
    return {"size_bytes": os.path.getsize(path), "bits_per_weight": 8 * nbytes / max(n_elements, 1),
            "main_type": main, "tensor_bytes": nbytes}


class ModelCosts:
    """FLOPs and bytes per token from the edgellm graph of a model file (engine-independent)."""

    def __init__(self, path: str):
        from ..gguf_file import open_gguf
        from ..models import build_graph, config_from_gguf

        f = open_gguf(path)
        self.config = config_from_gguf(f)
        self.graph = build_graph(self.config, f, "last")
        self.flops = metrics.graph_flops(self.graph)
        self.weight_bytes = metrics.weight_bytes_per_token(self.graph, lambda name: f.tensors[name].nbytes, seq=1)

    def kv_bytes(self, kv_len: float, bytes_per_element: float) -> float:
        return metrics.kv_bytes_per_token(self.graph, kv_len, bytes_per_element)


# -- the sweep -------------------------------------------------------------------------------------
class _Progress:
    """A rich progress bar on stderr (or nothing, when rich is not wanted)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._p = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn)

            self._p = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                               MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                               transient=False)
            self._p.__enter__()
            self._task = self._p.add_task("benchmark", total=0)
        return self

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)

    def add(self, n: int) -> None:
        if self._p is not None:
            self._p.update(self._task, total=(self._p.tasks[0].total or 0) + n)

    def start(self, text: str) -> None:
        if self._p is not None:
            self._p.update(self._task, description=text)

    def done(self, note: str | None = None) -> None:
        if self._p is not None:
            self._p.advance(self._task)
            if note:
                self._p.console.print(note)


def _prepare_variants(plan: BenchPlan, quant_cache: Path, workdir: Path, progress: _Progress,
                      log_dir: Path | None) -> list[Variant]:
    variants = []
    for src in plan.models:
        facts = file_facts(src)
        model = Path(src).stem
        for q in plan.quants:
            v = Variant(model=model, source=str(src), quant=q, source_type=facts["main_type"])
            if q == SOURCE:
                v.path, v.label, v.status = str(src), facts["main_type"], "ok"
            else:
                v.label = q
                dst = cached_path(src, q, quant_cache, plan.quant_policy)
                if dst.is_file():
                    v.path, v.status = str(dst), "ok"
                else:
                    progress.add(1)
                    progress.start(f"quantizing {model} to {q}")
                    out = run_job({"job": "quantize", "src": str(src), "qtype": q, "cache_dir": str(quant_cache),
                                   "policy": plan.quant_policy},
                                  plan.timeout_s, workdir,
                                  log_dir / f"quantize-{model}-{q}.log" if log_dir else None)
                    if out.status == "ok" and out.result.get("path") and Path(out.result["path"]).is_file():
                        v.path, v.status = out.result["path"], "ok"
                        progress.done(f"quantized {model} to {q}: {v.path}")
                    else:
                        v.status = "skipped"
                        err = out.error or "no file"
                        if out.result.get("error_type") == QuantizationUnavailable.__name__:
                            err = out.result.get("error", err).split(": ", 1)[-1]
                        v.reason = f"quantization to {q} unavailable: {err}"
                        progress.done(f"[yellow]skipped {model} {q}[/]: {v.reason}")
            if v.path:
                f = file_facts(v.path)
                v.size_bytes, v.bits_per_weight = f["size_bytes"], f["bits_per_weight"]
            variants.append(v)
    return variants


def _ppl_inputs(plan: BenchPlan, variant: Variant, text: str) -> tuple[dict | None, str | None]:
    """Tokens of the perplexity text (the model file's own tokenizer, the same tokens for every
    engine) and the chunk size; or the reason there is no perplexity for this model."""
    from ..gguf_file import open_gguf
    from ..models import config_from_gguf
    from ..tokenizer import Tokenizer

    f = open_gguf(variant.path)
    if f.get("tokenizer.ggml.model", "none") == "none":
        return None, "the model has no vocabulary (tokenizer.ggml.model = 'none')"
    try:
        tok = Tokenizer.from_metadata(f.metadata, source=os.path.basename(variant.path))
        ids = tok.encode(text, parse_special=False)
    except EdgeLLMError as e:
        return None, f"the model's tokenizer cannot be read by edgellm: {e}"
    try:
        model_ctx = config_from_gguf(f).context_length
    except EdgeLLMError:
        model_ctx = None
    n_ctx = metrics.choose_ppl_ctx(len(ids), plan.ppl_ctx, model_ctx)  # a text too short is the user's error
    bos = tok.bos_id if tok.add_bos and tok.bos_id is not None else None
    return {"tokens": ids, "n_ctx": n_ctx, "bos_id": bos, "max_chunks": plan.ppl_chunks}, None


def run_bench(plan: BenchPlan, *, progress: bool = True, argv: list[str] | None = None) -> dict:
    """Run the whole benchmark described by plan; returns the results (the content of results.json)."""
    plan = validate(plan)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    out_dir = Path(plan.out_dir) if plan.out_dir else None
    log_dir = None
    if out_dir:
        log_dir = out_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
    quant_cache = Path(plan.quant_cache) if plan.quant_cache else (
        out_dir / "quant" if out_dir else cache_root() / "quant")
    text = plan.ppl_path.read_text(encoding="utf-8") if plan.ppl else None
    t_start = time.perf_counter()
    interrupted = False

    with tempfile.TemporaryDirectory(prefix="edgellm-bench-") as tmp, _Progress(progress) as prog:
        workdir = Path(tmp)
        variants = _prepare_variants(plan, quant_cache, workdir, prog, log_dir)

        # perplexity inputs and graph costs, once per file (errors here are the user's: raise them)
        ppl_inputs: dict[str, tuple[dict | None, str | None]] = {}
        costs: dict[str, ModelCosts | str] = {}
        for v in variants:
            if v.status != "ok":
                continue
            if plan.ppl:
                ppl_inputs[v.path] = _ppl_inputs(plan, v, text)
            try:
                costs[v.path] = ModelCosts(v.path)
            except EdgeLLMError as e:
                costs[v.path] = f"no edgellm graph for this model: {e}"

        configs: list[Config] = []
        availability: dict[tuple[str, str], tuple[bool, str]] = {}
        for v in variants:
            for e in plan.engines:
                for b in plan.backends:
                    label = engine_label(e)
                    c = Config(id=f"{v.model}/{v.label}/{label}/{b}", variant=v, engine=label, engine_spec=e, backend=b)
                    if v.status != "ok":
                        c.status, c.error = "skipped", v.reason
                    else:
                        key = (e, b)
                        if key not in availability:
                            try:
                                availability[key] = engine_class(e).available(b)
                            except Exception as exc:  # an availability probe must not stop the sweep
                                availability[key] = (False, f"availability check failed: {exc}")
                        ok, reason = availability[key]
                        if not ok:
                            c.status, c.error = "unavailable", reason
                    configs.append(c)
        runnable = [c for c in configs if c.status == "pending"]

        # peak bandwidth per backend in use
        devices: dict[str, dict] = {}
        for b in dict.fromkeys(c.backend for c in runnable):
            if plan.peak_bw_gbps is not None:
                devices[b] = {"bytes_per_s": plan.peak_bw_gbps * 1e9, "source": "--peak-bw"}
                continue
            prog.add(1)
            prog.start(f"measuring {b} memory bandwidth")
            out = run_job({"job": "peak_bw", "backend": b,
                           "cache_file": str(cache_root() / "bench" / "peak_bandwidth.json")},
                          min(plan.timeout_s, 600), workdir, log_dir / f"peak_bw-{b}.log" if log_dir else None)
            if out.status == "ok":
                devices[b] = {k: out.result.get(k) for k in ("device", "bytes_per_s", "source", "measured_at",
                                                             "driver", "cuda")}
            else:
                devices[b] = {"bytes_per_s": None, "error": out.error}
            prog.done()
        for b, d in devices.items():
            if "device" not in d:
                from .device import device_name, nvidia_driver, nvidia_gpu_name

                d["device"] = device_name("cpu") if b == "cpu" else nvidia_gpu_name() if b == "cuda" else None
                if b == "cuda":
                    d["driver"] = nvidia_driver()

        # the sweep: repetitions outermost, so drift during the run hits every configuration alike
        ctx_need = max(max(plan.prompt_lengths), max(plan.gen_lengths) + 2)
        prog.add(plan.repetitions * len(runnable))
        try:
            with _sigterm_as_interrupt():
                _sweep(plan, runnable, ctx_need, ppl_inputs, workdir, log_dir, prog)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep what finished, report the rest as interrupted
            for c in runnable:
                if c.status == "pending" or not c.runs:
                    c.status, c.error = "interrupted", "the sweep was stopped before this configuration finished"
                elif len(c.runs) < plan.repetitions and c.status == "ok":
                    c.error = f"interrupted after {len(c.runs)} of {plan.repetitions} repetitions"
            interrupted = True

    results = assemble(plan, variants, configs, devices, costs, argv=argv, started=started,
                       elapsed_s=time.perf_counter() - t_start)
    if interrupted:
        results["interrupted"] = True
    if out_dir:
        from .report import write_outputs

        results["files"] = write_outputs(results, out_dir)
    return results


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (a `timeout`, a job scheduler) stops the sweep like Ctrl-C: finished results are kept."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _sweep(plan, runnable, ctx_need, ppl_inputs, workdir, log_dir, prog) -> None:
    """Every repetition of every runnable configuration, each in its own process (run_job)."""
    for rep in range(plan.repetitions):
        last = rep == plan.repetitions - 1
        for c in runnable:
            tag = f"[{rep + 1}/{plan.repetitions}] {c.id}"
            if c.status in FAILED:
                c.runs.append({"rep": rep, "status": "skipped", "error": "an earlier repetition failed"})
                prog.done()
                continue
            ppl, ppl_reason = (None, None)
            if plan.ppl and last:
                ppl, ppl_reason = ppl_inputs.get(c.variant.path, (None, "no perplexity input"))
                if ppl_reason:
                    c.ppl_skipped = ppl_reason
            # the same KV capacity in every repetition, perplexity or not (it can change the programs)
            ppl_ctx = (ppl_inputs.get(c.variant.path, (None, None))[0] or {}).get("n_ctx", 0) if plan.ppl else 0
            ctx = max(ctx_need, ppl_ctx)
            job = {"job": "run", "engine": c.engine_spec, "backend": c.backend, "model": c.variant.path,
                   "ctx": ctx, "pp": plan.prompt_lengths, "tg": plan.gen_lengths, "warmup": plan.warmup,
                   "threads": plan.threads, "seed": plan.seed, "ppl": ppl}
            prog.start(tag)
            safe = c.id.replace("/", "_").replace(":", "_")
            out = run_job(job, plan.timeout_s, workdir, log_dir / f"{safe}-rep{rep + 1}.log" if log_dir else None)
            run = {"rep": rep, "status": out.status, "error": out.error, "wall_s": out.wall_s,
                   "returncode": out.returncode, "ctx": ctx, "result": out.result}
            if out.status != "ok":
                run["log_tail"] = out.log[-2000:]
            c.runs.append(run)
            phase = out.result.get("phase")
            if out.status == "ok":
                c.status = "ok"
                prog.done()
            elif phase == "perplexity":  # the timed tests are all in: only perplexity is lost
                c.status = "ok"
                c.ppl_error = out.error
                prog.done(f"[yellow]{tag}: perplexity {out.status}[/]: {out.error}")
            else:
                c.status, c.error = out.status, out.error
                prog.done(f"[red]{tag}: {out.status}[/]: {out.error}")


# -- results ---------------------------------------------------------------------------------------
def _stats(xs) -> dict | None:
    s = metrics.summarize(xs)
    return s.to_dict() if s else None


def _finite(x) -> float | None:
    return float(x) if x is not None and isinstance(x, (int, float)) and math.isfinite(x) else None


def config_metrics(c: Config, devices: dict, costs: dict) -> dict:
    """Aggregate a configuration's runs into medians, spreads and the derived metrics."""
    ok_runs = [r["result"] for r in c.runs if r.get("result") and r["result"].get("samples") is not None]
    load_runs = [r["result"] for r in c.runs if r.get("result", {}).get("ttlm_s") is not None]
    cost = costs.get(c.variant.path)
    cost_reason = cost if isinstance(cost, str) else None
    cost = cost if isinstance(cost, ModelCosts) else None
    peak = (devices.get(c.backend) or {}).get("bytes_per_s")
    kv_elem = next((r.get("kv_bytes_per_element") for r in load_runs if r.get("kv_bytes_per_element")), None)
    tests = []
    names: list[str] = []
    for r in ok_runs:
        for name in r["samples"]:
            if name not in names:
                names.append(name)
    for name in names:
        ss = [r["samples"][name] for r in ok_runs if name in r["samples"]]
        kind, n = ss[0]["kind"], ss[0]["tokens"]
        t: dict = {"name": name, "kind": kind, "tokens": n, "samples": len(ss)}
        if kind == "pp":
            secs = [s["prefill_s"] for s in ss]
            t["seconds"] = _stats(secs)
            t["tokens_per_s"] = _stats([n / s for s in secs])
            t["ttft_s"] = _stats([s["ttft_s"] for s in ss])
            if cost:
                fl = metrics.prefill_flops(cost.flops, n)
                t["flops"] = fl
                t["flop_per_s"] = _stats([metrics.flop_rate(fl, s) for s in secs])
        else:
            secs = [s["decode_s"] for s in ss]
            t["seconds"] = _stats(secs)
            t["tokens_per_s"] = _stats([n / s for s in secs])
            t["tpot_s"] = _stats([s / n for s in secs])
            if cost:
                fpt = metrics.decode_flops_per_token(cost.flops, n)
                t["flops_per_token"] = fpt
                t["flop_per_s"] = _stats([metrics.flop_rate(fpt * n, s) for s in secs])
                t["weight_bytes_per_token"] = cost.weight_bytes
                kv = cost.kv_bytes(metrics.decode_kv_len(n), kv_elem) if kv_elem else None
                t["kv_bytes_per_token"] = kv
                tpot = t["tpot_s"]["median"]
                if peak and kv is not None:
                    t["mbu"] = _finite(metrics.mbu(cost.weight_bytes, kv, tpot, peak))
                    t["mbu_samples"] = [_finite(metrics.mbu(cost.weight_bytes, kv, s / n, peak)) for s in secs]
                else:
                    t["mbu"] = None
                    t["mbu_note"] = ("no peak bandwidth for this device" if not peak
                                     else "the engine did not report its KV-cache element size")
        if cost_reason:
            t["cost_note"] = cost_reason
        tests.append(t)
    ppl = next((r["result"].get("perplexity") for r in reversed(c.runs)
                if r.get("result", {}).get("perplexity")), None)
    rss = [r.get("peak_rss_bytes") for r in load_runs if r.get("peak_rss_bytes")]
    dev = [r.get("device_peak_bytes") for r in load_runs if r.get("device_peak_bytes")]
    info = next((r.get("info") for r in load_runs if r.get("info")), None)
    v = c.variant
    return {
        "id": c.id, "model": v.model, "source": v.source, "quant": v.label, "quantized": v.quant != SOURCE,
        # produced from a file that was quantized already: it carries that file's quantization error too
        "requantized_from": v.source_type if v.quant != SOURCE and v.source_type not in FLOAT_TYPES else None,
        "path": v.path, "size_bytes": v.size_bytes, "bits_per_weight": v.bits_per_weight,
        "engine": c.engine, "engine_spec": c.engine_spec, "backend": c.backend,
        "status": c.status, "error": c.error,
        "ttlm_s": _stats([r["ttlm_s"] for r in load_runs]),
        "load_s": _stats([r["load_s"] for r in load_runs if r.get("load_s") is not None]),
        "tests": tests,
        "perplexity": ppl if ppl else ({"error": c.ppl_error} if c.ppl_error else
                                       {"skipped": c.ppl_skipped} if c.ppl_skipped else None),
        "peak_rss_bytes": max(rss) if rss else None,
        "device_peak_bytes": max(dev) if dev else None,
        "kv_bytes_per_element": kv_elem,
        "engine_info": info,
        "runs": [{k: r.get(k) for k in ("rep", "status", "error", "wall_s", "returncode", "ctx", "log_tail")} |
                 {"phases": {k: r.get("result", {}).get(k) for k in ("import_s", "load_s", "ttlm_s", "warmup_s")}}
                 for r in c.runs],
    }


def assemble(plan: BenchPlan, variants: list[Variant], configs: list[Config], devices: dict, costs: dict, *,
             argv=None, started: str = "", elapsed_s: float = 0.0) -> dict:
    from .report import perplexity_agreement

    rows = [config_metrics(c, devices, costs) for c in configs]
    out = {
        "schema": SCHEMA,
        "started": started,
        "elapsed_s": elapsed_s,
        "command": ["edgellm", "bench"] + list(argv) if argv is not None else None,
        "plan": plan.to_dict(),
        "environment": {"versions": versions(), "git_commit": git_commit(), "git_dirty": git_dirty(),
                        "host": host_info()},
        "devices": devices,
        "variants": [dict(vars(v)) for v in variants],
        "configurations": rows,
        "method": {
            "prefill": "one forward over p random tokens from an empty KV cache; t/s = p / time",
            "ttft": "time from submitting the p tokens to holding the first greedy token id",
            "decode": "n single-token steps from an empty cache, each fed the previous greedy pick; t/s = n / time",
            "ttlm": "engine load + one single-token step (ready for the first token), imports excluded",
            "statistics": f"warm-up per process (each prompt length twice, a short decode), then one sample per "
                          f"repetition; repetitions round-robin "
                          f"over configurations, each in a fresh process; spread = (max-min)/median, flagged "
                          f"above {metrics.SPREAD_FLAG:.0%}",
            "flops": "sum of edgellm.graph.ops.flops over the model graph (prefill: seq=kv_len=p; "
                     "decode: seq=1, kv_len=(n+1)/2)",
            "mbu": "(stored weight bytes read per token + KV bytes read per token) / TPOT / peak copy bandwidth "
                   "(read+write)",
            "perplexity": "llama.cpp's: chunks of n_ctx tokens from an empty cache, second half scored, exp(mean NLL)",
        },
    }
    out["perplexity_agreement"] = perplexity_agreement(out)
    return out
