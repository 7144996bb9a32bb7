"""edgellm's cpu backends against llama.cpp on the CPU: decode and prefill speed, resident memory.

    python benchmarks/bench_cpu_vs_llamacpp.py [--model PATH] [-p 64] [-n 64] [-r 5] [--threads N]

Every measurement runs in its own child process, and the engines take turns round by round (a
busy machine slows every engine alike, not the one that happened to run last):
- speed: llama-bench's tests through edgellm's benchmark engines (edgellm.bench.engines), pp = one
  forward pass over p prompt tokens, tg = n greedy single-token steps from the start token; the
  median of r rounds;
- memory: the peak resident set (ru_maxrss from wait4) of a whole `edgellm run --temperature 0`
  answering the default question, and of a Python process that answers it through
  llama-cpp-python's chat completion (the same file, CPU, the same context and threads).
Threads: the physical cores for every engine (llama.cpp: n_threads and n_threads_batch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

QUESTION = "What is the capital of France?"


def _speed_child(engine: str, backend: str, model: str, p: int, n: int, threads: int) -> dict:
    if engine == "llama.cpp":
        import llama_cpp  # noqa: F401  (first, as the benchmark runner does)
    import numpy as np

    from edgellm.bench.engines import EdgeLLMEngine, LlamaCppEngine

    eng = (LlamaCppEngine if engine == "llama.cpp" else EdgeLLMEngine)(threads=threads)
    eng.prepare(backend)
    eng.load(model, backend, p + n + 8)
    ids = np.random.default_rng(0).integers(3, eng.vocab_size(), p).tolist()
    eng.prefill(ids[:8]), eng.decode(4)  # warm-up
    t = time.perf_counter()
    eng.prefill(ids)
    pp = p / (time.perf_counter() - t)
    t = time.perf_counter()
    eng.decode(n)
    tg = n / (time.perf_counter() - t)
    return {"pp": pp, "tg": tg}


def _answer_child(model: str, ctx: int, threads: int, n: int) -> dict:
    """llama.cpp answering the question as a user of llama-cpp-python would."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
                          n_gpu_layers=0, verbose=False)
    out = llm.create_chat_completion([{"role": "user", "content": QUESTION}], temperature=0, max_tokens=n)
    return {"text": out["choices"][0]["message"]["content"]}


def _run_child(args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"child {' '.join(args[-2:])} failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    return r.stdout


def _peak_rss(args: list[str]) -> tuple[int, str, str]:
    """Run a child alone and return its peak resident set (bytes, from wait4), stdout and stderr."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r, w = os.pipe()
    er, ew = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(w, 1), os.dup2(ew, 2)
        os.close(r), os.close(er)
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, *args], env)
    os.close(w), os.close(ew)
    with os.fdopen(r) as fo, os.fdopen(er) as fe:
        out, err = fo.read(), fe.read()
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child {' '.join(args[:4])} failed: {err.strip().splitlines()[-1:]}")
    return usage.ru_maxrss * 1024, out, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("-p", type=int, default=64, help="prompt tokens of the pp test")
    ap.add_argument("-n", type=int, default=64, help="generated tokens of the tg test")
    ap.add_argument("-r", type=int, default=5, help="rounds")
    ap.add_argument("--threads", type=int, default=None, help="threads (default: physical cores)")
    ap.add_argument("--ctx", type=int, default=512, help="context of the memory runs")
    ap.add_argument("--backends", default="cpu,cpu-fast", help="edgellm backends to measure (default cpu,cpu-fast)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()

    from edgellm.backends.cpu_fast import physical_cores
    from edgellm.default_model import default_model_path

    model = a.model or str(default_model_path())
    threads = a.threads or physical_cores()
    if a.child:
        kind, engine, backend = a.child.split(":")
        res = (_speed_child(engine, backend, model, a.p, a.n, threads) if kind == "speed"
               else _answer_child(model, a.ctx, threads, a.n))
        print(json.dumps(res))
        return

    import importlib.util

    configs = [("edgellm", b) for b in a.backends.split(",") if b] + [("llama.cpp", "cpu")]
    if not importlib.util.find_spec("llama_cpp"):
        configs = configs[:-1]
        print("llama-cpp-python is not installed: llama.cpp is left out", file=sys.stderr)
    me = os.path.abspath(__file__)
    base = [me, "--model", model, "-p", str(a.p), "-n", str(a.n), "--threads", str(threads), "--ctx", str(a.ctx)]
    speed: dict[tuple, list[dict]] = {c: [] for c in configs}
    for rnd in range(a.r):
        for c in configs:
            out = _run_child([*base, "--child", f"speed:{c[0]}:{c[1]}"])
            speed[c].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {rnd + 1} {c[0]} {c[1]}: pp {speed[c][-1]['pp']:.1f} tg {speed[c][-1]['tg']:.1f} tok/s",
                  file=sys.stderr, flush=True)
        print(f"round {rnd + 1}/{a.r} done", file=sys.stderr)

    memory: dict[tuple, tuple[int, str]] = {}
    for c in configs:
        try:
            if c[0] == "edgellm":
                rss, out, _ = _peak_rss(["-m", "edgellm", "run", "-m", model, "--backend", c[1], "--temperature", "0",
                                         "-n", str(a.n), "-c", str(a.ctx), "-q", QUESTION])
                memory[c] = (rss, out.strip())
            else:
                rss, out, _ = _peak_rss([*base, "--child", "answer:llama.cpp:cpu"])
                memory[c] = (rss, json.loads(out.strip().splitlines()[-1])["text"].strip())
        except SystemExit as e:  # e.g. a file without a vocabulary: no text answer, the speeds stand
            print(f"{c[0]} {c[1]}: no answer run: {e}", file=sys.stderr)
            memory[c] = (0, "-")

    from edgellm.bench.device import cpu_name

    print(f"\n{time.strftime('%Y-%m-%d', time.gmtime())}, {cpu_name()}, {threads} threads, "
          f"model {os.path.basename(model)}, pp{a.p} / tg{a.n}, median of {a.r} interleaved rounds\n")
    has_ref = configs[-1][0] == "llama.cpp"
    ref_tg = statistics.median(r["tg"] for r in speed[configs[-1]]) if has_ref else None
    # other work on the machine only ever slows a round: each engine's best round is its least
    # disturbed one, so the ratio of best rounds is quoted beside the ratio of medians
    ref_best = max(r["tg"] for r in speed[configs[-1]]) if has_ref else None
    print("| engine | backend | pp tok/s | tg tok/s | tg vs llama.cpp (medians / best rounds) | peak RSS of a run | greedy answer |")
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        pp = statistics.median(r["pp"] for r in speed[c])
        tg = statistics.median(r["tg"] for r in speed[c])
        best = max(r["tg"] for r in speed[c])
        spread = f" ({min(r['tg'] for r in speed[c]):.1f}-{best:.1f})"
        ratio = f"{tg / ref_tg:.2f}x / {best / ref_best:.2f}x" if has_ref else "-"
        rss, text = memory[c]
        mem = f"{rss / 2**20:.0f} MiB" if rss else "-"
        print(f"| {c[0]} | {c[1]} | {pp:.1f} | {tg:.1f}{spread} | {ratio} | {mem} | {text!r} |")


if __name__ == "__main__":
    main()
