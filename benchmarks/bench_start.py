"""What a user meets first: time to load (TTLM) and time to first token (TTFT), cold and warm,
edgellm and llama.cpp (llama-cpp-python) side by side on the same files, each sample in a fresh
process.

    python benchmarks/bench_start.py --backend cpu                       # the default model
    python benchmarks/bench_start.py --backend cuda -m a.gguf --synthetic llama-3.1-8b:Q4_0 -r 3

Per model and engine:
  edgellm cold   an empty engine cache (EDGELLM_CACHE_DIR: no compiled programs, no compiled
                 kernels, no tuning), the model file in the page cache;
  edgellm warm   the same cache, filled by the cold run (median of -r runs);
  edgellm-image  (cuda) the same through the start-up image, as `edgellm run` loads a model whose
                 steps an earlier run recorded (backends/cuda/replay.py; no torch imported): the
                 cold sample loads in full and records the image, the warm ones replay it (load
                 includes capturing the request's CUDA graphs through the driver);
  llama.cpp      llama-cpp-python's Llama() load and its first token (median of -r runs; it has no
                 cache of its own: its first run is reported as cold);
  run cold/warm  `edgellm run -n 8 --temperature 0` wall time for the default question, as a user
                 types it (process start to exit); on cuda the warm runs replay the start-up image
                 the cold run recorded (--cli-variant full:EDGELLM_REPLAY=0 measures the full load).
--variant LABEL:K=V,K=V (repeatable) does the same for the edgellm load rows: one cold load (the first
variant's), then each variant's warm loads from that cache, interleaved round by round.
--cli-variant LABEL:K=V,K=V (repeatable) measures the `edgellm run` rows once per variant instead,
the warm runs of the variants interleaved round by round; the key TREE runs the CLI from another
source tree (e.g. one made by `git archive`), other keys are environment variables:
    --cli-variant new: --cli-variant base:TREE=/tmp/base --cli-variant late-ctx:EDGELLM_EARLY_CONTEXT=0
--cold-repeat N gives every variant N cold samples, each from an empty cache of its own, in
interleaved rounds (an A/B of first-run work, e.g. EDGELLM_COMPILE_POOL=process against thread).
A sample's numbers: import (the engine's Python modules), load (edgellm.load / Llama()), TTFT
(a 37-token chat prompt's prefill and its first token, after load), 8 tokens (TTFT + 7 decode
steps), process (the child's wall time from exec to exit). Prints a Markdown table; -o writes JSON.

Python bytecode: a pip install leaves compiled bytecode beside every module, so a user's imports
do not compile source. A machine that runs with PYTHONDONTWRITEBYTECODE=1 and without that
bytecode (the GPU machine's torch environment: `import torch` 3.8 s there against 2.2-2.5 s with
bytecode, 2026-11-26) would charge every sample for compiling the libraries' source. So the
children run with bytecode kept under a folder of this run (PYTHONPYCACHEPREFIX), filled by one
untimed import first; --no-bytecode-cache measures the machine as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"

CHILD = r"""
import sys, time
t0 = time.perf_counter()
if sys.argv[1] == "llama.cpp":
    import llama_cpp  # noqa: F401  before numpy and torch: its CUDA build crashed otherwise (LlamaCppEngine.preload)
import json
engine, backend, path, ids, ctx = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
out, recorded = {}, False
if engine == "edgellm-image":  # the start-up image as `edgellm run` loads it (backends/cuda/replay.py)
    import numpy as np
    from edgellm.backends.cuda.replay import load_replay
    from edgellm.sampling import SamplingParams
    t1 = time.perf_counter()
    m = load_replay(path, ctx)
    if m is not None and not m.backend.prepare(len(ids), 8, SamplingParams(temperature=0), m.kv_chunk):
        m.backend.close()
        m = None
    if m is None:  # no image yet (the first sample): the full load, which then records one
        import edgellm
        m = edgellm.load(path, backend=backend, ctx=ctx)
        recorded = True
    class E:
        model = m
    e = E()
    t2 = time.perf_counter()
    first = int(np.argmax(m.forward(ids, 0, all_logits=False)[-1]))
    t3 = time.perf_counter()
elif engine == "llama.cpp":
    from edgellm.bench.engines import LlamaCppEngine as E
else:
    from edgellm.bench.engines import EdgeLLMEngine as E
    import edgellm  # noqa: F401
if engine != "edgellm-image":
    e = E()
    e.prepare(backend)
    t1 = time.perf_counter()
    e.load(path, backend, ctx)
    t2 = time.perf_counter()
    e.prefill(ids)
    first = e.next_token()
    t3 = time.perf_counter()
if engine == "llama.cpp":
    import llama_cpp
    tok = first
    for i in range(7):
        e._one[0] = tok
        e._decode(e._one, 1)
        tok = e.next_token()
else:
    m = e.model
    pos, tok = len(ids), first
    greedy = getattr(m.programs["decode"], "loop_tokens", None)
    if greedy is not None:
        for tok in greedy(tok, pos, 7):
            pass
    else:
        import numpy as np
        for i in range(7):
            tok = int(np.argmax(m.forward([tok], pos + i, all_logits=False)[-1]))
t4 = time.perf_counter()
out = {"import_s": t1 - t0, "load_s": t2 - t1, "ttft_s": t3 - t2, "eight_s": t4 - t2}
if engine != "llama.cpp":
    out["phases"] = e.model.load_phases
    out["cache_hits"] = e.model.cache_hits
if recorded:
    from edgellm.backends.cuda.replay_record import Unrecordable, record
    e.model.default_slot.reset()
    list(e.model.generate_tokens(ids, 8, SamplingParams(temperature=0)))  # the steps a run records
    try:
        out["image"] = record(e.model, len(ids), 8, SamplingParams(temperature=0))
    except Unrecordable as err:
        out["image"] = f"none: {err}"
print("RESULT " + json.dumps(out))
"""


def _child(engine: str, backend: str, path: str, ids: list[int], ctx: int, env: dict) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, engine, backend, path, json.dumps(ids), str(ctx)],
                       capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - t0
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit {p.returncode}"]}
    d = json.loads(line[7:])
    d["process_s"] = wall
    return d


def _priming_imports(engine: str, backend: str) -> str:
    """The imports whose bytecode one untimed process leaves in a run's bytecode cache (see above)."""
    if engine == "llama.cpp":
        return "import llama_cpp, edgellm.bench.engines"
    imports = "import edgellm.cli, edgellm.model, edgellm.compiler.compile, edgellm.tokenizer, rich"
    if backend == "cuda":
        imports += "; import edgellm.backends.cuda.backend, triton, sympy"
    if engine == "edgellm-image":
        return imports + "; import edgellm.backends.cuda.replay"
    return imports if engine in ("edgellm", "cli") else "import edgellm"


def _variant(spec: str) -> tuple[str, dict]:
    """'LABEL:K=V,K=V' -> (label, settings)."""
    label, _, rest = spec.partition(":")
    settings = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return label, settings


def _cli(path: str | None, backend: str, env: dict, cwd: str | None = None) -> dict:
    """`python -m edgellm run` in cwd: `-m` puts the working directory first on sys.path, so a
    variant's source tree must be the working directory too, not only on PYTHONPATH."""
    cmd = [sys.executable, "-m", "edgellm", "run", "--backend", backend, "--temperature", "0", "-n", "8", QUESTION]
    if path:
        cmd[4:4] = ["-m", path]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=cwd or str(ROOT))
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": p.stderr.strip().splitlines()[-1:]}
    return {"process_s": wall, "answer": p.stdout.strip(), "stats": p.stderr.strip().splitlines()[-1]}


def _median(samples: list[dict], key: str) -> float | None:
    vals = [s[key] for s in samples if key in s]
    return statistics.median(vals) if vals else None


def _prompt_ids(path: str) -> list[int]:
    import edgellm

    m = edgellm.load(path, backend="cpu", ctx=64, warmup=False, cache=False)
    if m.tokenizer is not None and m.tokenizer.chat_template:
        return m.prompt_tokens(QUESTION)
    return [1 + (i * 7919) % (m.config.vocab_size - 2) for i in range(37)]  # 37 tokens, as the chat prompt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", default=[], help="GGUF file (repeatable; default: the embedded model)")
    ap.add_argument("--synthetic", action="append", default=[],
                    help="PRESET:FORMAT written with edgellm.synthetic (with a vocabulary), e.g. llama-3.1-8b:Q4_0")
    ap.add_argument("--model-dir", default=None, help="where synthetic files go (default: a temporary folder)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--engines", default="edgellm,llama.cpp",
                    help="edgellm, llama.cpp (comma-separated); 'cli' alone: only the `edgellm run` rows")
    ap.add_argument("-r", "--repeat", type=int, default=3)
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("--no-cli", action="store_true", help="skip the `edgellm run` wall-time rows")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:K=V,...",
                    help="edgellm load rows per variant (environment settings), interleaved (see above)")
    ap.add_argument("--cli-variant", action="append", default=[], metavar="LABEL:K=V,...",
                    help="measure the `edgellm run` rows per variant, interleaved (see above)")
    ap.add_argument("--cold-repeat", type=int, default=1, metavar="N",
                    help="with --variant or --cli-variant: N cold samples of every variant, each from an "
                         "empty cache of its own, interleaved round by round (default 1; --variant's "
                         "later variants get cold samples only when N > 1)")
    ap.add_argument("-o", "--output", default=None, help="write the results as JSON here")
    ap.add_argument("--no-bytecode-cache", action="store_true",
                    help="run the children without a bytecode cache of their own (see above)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("-r must be at least 1")
    if args.cold_repeat < 1:
        ap.error("--cold-repeat must be at least 1")

    from edgellm.default_model import default_model_path

    models = list(args.model) or ([] if args.synthetic else [str(default_model_path())])
    if args.synthetic:
        from edgellm.synthetic import byte_bpe_vocab, preset, write_synthetic_gguf

        d = Path(args.model_dir or tempfile.mkdtemp(prefix="edgellm-start-"))
        d.mkdir(parents=True, exist_ok=True)
        for item in args.synthetic:
            name, fmt = item.split(":")
            path = d / f"{name}-{fmt}-vocab.gguf"
            if not path.exists():
                print(f"writing {path} ...", file=sys.stderr, flush=True)
                spec = preset(name, weight_type=fmt)  # Q4_K_M: llama-quantize's mix (quant_mix)
                write_synthetic_gguf(path, spec, byte_bpe_vocab(spec.vocab_size), fast=True)
            models.append(str(path))

    engines = [e for e in args.engines.split(",") if e]
    results = {"date": time.strftime("%Y-%m-%d"), "backend": args.backend, "argv": sys.argv[1:], "rows": []}
    base_env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if not args.no_bytecode_cache:  # as after a pip install: the libraries' bytecode exists (see above)
        base_env.pop("PYTHONDONTWRITEBYTECODE", None)
        base_env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="edgellm-pyc-")
        for engine in engines:
            subprocess.run([sys.executable, "-c", _priming_imports(engine, args.backend)], env=base_env,
                           capture_output=True, timeout=600)
    results["bytecode_cache"] = not args.no_bytecode_cache
    for path in models:
        for f in (path,):  # page cache: read the file once before any timed run
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
        ids = _prompt_ids(path)
        for engine in engines:
            if engine == "cli":  # (--engines cli: only the `edgellm run` rows)
                continue
            cache = tempfile.mkdtemp(prefix="edgellm-cache-")
            env = {**base_env, "EDGELLM_CACHE_DIR": cache}
            env.pop("TRITON_CACHE_DIR", None)
            samples = []
            if engine == "edgellm" and args.variant:
                variants = [_variant(v) for v in args.variant]
                cold = _child(engine, args.backend, path, ids, args.ctx, {**env, **variants[0][1]})
                print(f"{Path(path).name} {engine} cold [{variants[0][0]}]: {cold}", file=sys.stderr, flush=True)
                colds = {label: [] for label, _ in variants}
                colds[variants[0][0]].append(cold)
                for i in range(args.cold_repeat if args.cold_repeat > 1 else 0):  # more cold samples
                    for v, (label, settings) in enumerate(variants):
                        if i == 0 and v == 0:
                            continue  # the one above, whose cache the warm runs below use
                        fresh = {**env, "EDGELLM_CACHE_DIR": tempfile.mkdtemp(prefix="edgellm-cache-"), **settings}
                        s = _child(engine, args.backend, path, ids, args.ctx, fresh)
                        print(f"{Path(path).name} {engine} cold [{label}] #{i}: {s}", file=sys.stderr, flush=True)
                        colds[label].append(s)
                warm = {label: [] for label, _ in variants}
                for i in range(args.repeat):
                    for label, settings in variants:
                        s = _child(engine, args.backend, path, ids, args.ctx, {**env, **settings})
                        print(f"{Path(path).name} {engine} warm [{label}] #{i}: {s}", file=sys.stderr, flush=True)
                        warm[label].append(s)
                rows = ([(f"edgellm cold [{k}]", v) for k, v in colds.items() if v]
                        + [(f"edgellm warm [{k}]", v) for k, v in warm.items()])
            elif engine in ("edgellm", "edgellm-image"):
                for i in range(args.repeat + 1):
                    s = _child(engine, args.backend, path, ids, args.ctx, env)
                    print(f"{Path(path).name} {engine} #{i}: {s}", file=sys.stderr, flush=True)
                    samples.append(s)
                rows = [(f"{engine} cold", samples[:1]), (f"{engine} warm", samples[1:])]
            else:
                for i in range(args.repeat):
                    s = _child(engine, args.backend, path, ids, args.ctx, env)
                    print(f"{Path(path).name} {engine} #{i}: {s}", file=sys.stderr, flush=True)
                    samples.append(s)
                rows = [(f"{engine} first", samples[:1]), (f"{engine} median", samples)]
            for label, ss in rows:
                results["rows"].append({"model": Path(path).name, "what": label, "samples": ss,
                                        **{k: _median(ss, k) for k in ("import_s", "load_s", "ttft_s", "eight_s",
                                                                          "process_s")}})
        if not args.no_cli and ("edgellm" in engines or "cli" in engines):
            cli_path = None if not args.model and not args.synthetic else path  # None: as a user types it
            variants = [_variant(v) for v in args.cli_variant] or [("", {})]
            envs, cwds = [], []
            for label, settings in variants:
                env = {**base_env, "EDGELLM_CACHE_DIR": tempfile.mkdtemp(prefix="edgellm-cache-")}
                env.pop("TRITON_CACHE_DIR", None)
                tree = settings.get("TREE")
                if tree:
                    env["PYTHONPATH"] = f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
                    if not args.no_bytecode_cache:  # its own modules' bytecode, primed as the main tree's
                        env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="edgellm-pyc-")
                        subprocess.run([sys.executable, "-c", _priming_imports("edgellm", args.backend)], env=env,
                                       capture_output=True, timeout=600)
                env.update({k: v for k, v in settings.items() if k != "TREE"})
                envs.append(env)
                cwds.append(tree or str(ROOT))
            runs = [[_cli(cli_path, args.backend, env, cwd)] for env, cwd in zip(envs, cwds)]  # cold runs
            for _ in range(args.cold_repeat - 1):  # more cold runs, each from an empty cache of its own
                for v, env in enumerate(envs):
                    fresh = {**env, "EDGELLM_CACHE_DIR": tempfile.mkdtemp(prefix="edgellm-cache-")}
                    runs[v].append(_cli(cli_path, args.backend, fresh, cwds[v]))
            n_cold = max(1, args.cold_repeat)
            for _ in range(args.repeat):  # then the warm ones, a round of every variant at a time
                for v, env in enumerate(envs):
                    runs[v].append(_cli(cli_path, args.backend, env, cwds[v]))
            for (name, _), rs in zip(variants, runs):
                tag = f" [{name}]" if name else ""
                for s in rs:
                    print(f"{Path(path).name} edgellm run{tag}: {s}", file=sys.stderr, flush=True)
                for label, ss in ((f"`edgellm run` cold{tag}", rs[:n_cold]), (f"`edgellm run` warm{tag}", rs[n_cold:])):
                    results["rows"].append({"model": Path(path).name, "what": label, "samples": ss,
                                            "process_s": _median(ss, "process_s")})

    def ms(v):
        return "—" if v is None else f"{v * 1e3:,.0f}"

    print(f"\n{results['date']}, backend {args.backend}, medians (ms)\n")
    print("| model | what | import | load (TTLM) | TTFT after load | 8 tokens after load | process wall |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results["rows"]:
        err = next((s["error"] for s in r["samples"] if "error" in s), None)
        print(f"| {r['model']} | {r['what']} | {ms(r.get('import_s'))} | {ms(r.get('load_s'))} | "
              f"{ms(r.get('ttft_s'))} | {ms(r.get('eight_s'))} | {ms(r.get('process_s'))} |"
              + (f" error: {err}" if err else ""))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
