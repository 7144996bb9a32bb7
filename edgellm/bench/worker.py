"""One benchmark job in its own process: `python -m edgellm.bench.worker CONFIG.json`.

The parent (edgellm.bench.runner) writes the job as JSON and reads the result file the worker
rewrites after every phase, so a job that times out or crashes still leaves what it measured and
the phase it was in. Jobs:
  run       load an engine on a model, warm up, time each prefill (pp) and decode (tg) test once,
            optionally measure perplexity; one repetition of one configuration
  peak_bw   the device's copy bandwidth (cached on disk per device name)
  quantize  produce a quantized file (edgellm.bench.quantize.produce_quantized)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024


class _Result:
    def __init__(self, path: str, job: str):
        self.path = path
        self.data: dict = {"job": job, "status": "running", "phase": "start", "pid": os.getpid()}
        self.save()

    def phase(self, name: str) -> None:
        self.data["phase"] = name
        self.save()

    def save(self) -> None:
        self.data["peak_rss_bytes"] = _peak_rss_bytes()
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    name = type(e).__name__
    return name in ("OutOfMemoryError",) or "out of memory" in str(e).lower()


def _run(cfg: dict, res: _Result) -> None:
    import numpy as np

    from .engines import engine_class

    engine = engine_class(cfg["engine"])(threads=cfg.get("threads"))
    backend = cfg["backend"]
    t0 = time.perf_counter()
    engine.prepare(backend)
    res.data["import_s"] = time.perf_counter() - t0
    if backend == "cuda" and "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
    res.phase("load")
    t0 = time.perf_counter()
    engine.load(cfg["model"], backend, int(cfg["ctx"]))
    res.data["load_s"] = time.perf_counter() - t0
    engine.decode(1)  # ready for the first token: lazy initialisation on the first call counts
    res.data["ttlm_s"] = time.perf_counter() - t0
    res.data["kv_bytes_per_element"] = engine.kv_bytes_per_element()
    res.data["info"] = engine.info()
    vocab = engine.vocab_size()
    rng = np.random.default_rng(int(cfg.get("seed", 0)))
    prompts = {p: rng.integers(0, vocab, int(p)).tolist() for p in cfg.get("pp", [])}

    if cfg.get("warmup", True):
        res.phase("warmup")
        warm: dict = {}
        for p, ids in prompts.items():  # twice: a first run may compile, a second capture a CUDA graph
            for _ in range(2):
                t0 = time.perf_counter()
                engine.prefill(ids)
                engine.next_token()
            warm[f"pp{p}"] = time.perf_counter() - t0
        if cfg.get("tg"):
            t0 = time.perf_counter()
            engine.decode(min(2, max(cfg["tg"])))
            warm["tg"] = time.perf_counter() - t0
        res.data["warmup_s"] = warm

    samples: dict = res.data.setdefault("samples", {})
    for p, ids in prompts.items():
        res.phase(f"pp{p}")
        t0 = time.perf_counter()
        engine.prefill(ids)
        t1 = time.perf_counter()
        engine.next_token()
        t2 = time.perf_counter()
        samples[f"pp{p}"] = {"kind": "pp", "tokens": int(p), "prefill_s": t1 - t0, "ttft_s": t2 - t0}
    for n in cfg.get("tg", []):
        res.phase(f"tg{n}")
        t0 = time.perf_counter()
        engine.decode(int(n))
        samples[f"tg{n}"] = {"kind": "tg", "tokens": int(n), "decode_s": time.perf_counter() - t0}
    res.data["device_peak_bytes"] = engine.device_peak_bytes()

    ppl = cfg.get("ppl")
    if ppl:
        res.phase("perplexity")
        t0 = time.perf_counter()
        r = engine.perplexity(ppl["tokens"], int(ppl["n_ctx"]), bos_id=ppl.get("bos_id"),
                              max_chunks=ppl.get("max_chunks"))
        res.data["perplexity"] = dict(r.to_dict(), seconds=time.perf_counter() - t0)
        res.data["device_peak_bytes"] = engine.device_peak_bytes()
    engine.close()


def _peak_bw(cfg: dict, res: _Result) -> None:
    from pathlib import Path

    from .device import nvidia_driver, peak_bandwidth

    out = peak_bandwidth(cfg["backend"], Path(cfg["cache_file"]) if cfg.get("cache_file") else None)
    if cfg["backend"] == "cuda":
        import torch

        out["driver"] = nvidia_driver()
        out["cuda"] = torch.version.cuda
    res.data.update(out)


def _quantize(cfg: dict, res: _Result) -> None:
    from .quantize import produce_quantized

    res.data["path"] = str(produce_quantized(cfg["src"], cfg["qtype"], cfg["cache_dir"], cfg.get("policy")))


JOBS = {"run": _run, "peak_bw": _peak_bw, "quantize": _quantize}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m edgellm.bench.worker CONFIG.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        cfg = json.load(f)
    res = _Result(cfg["result"], cfg["job"])
    try:
        JOBS[cfg["job"]](cfg, res)
    except BaseException as e:  # recorded for the parent, whatever it was
        res.data["status"] = "oom" if _is_oom(e) else "error"
        res.data["error_type"] = type(e).__name__
        res.data["error"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        res.data["traceback"] = traceback.format_exc(limit=20)[-4000:]
        res.save()
        return 1
    res.data["status"] = "ok"
    res.data["phase"] = "done"
    res.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
