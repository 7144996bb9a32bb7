"""Load test of `edgellm serve`: N concurrent streaming clients, loopback only, bounded in requests and time.

For each N (default 1, 4, 16, 32) N clients each stream `--requests` chat completions of exactly
`--tokens` tokens (ignore_eos) at once; reported per N: aggregate generated tokens/s (all tokens /
wall time of the round), time to first token p50/p95, per-stream decode tokens/s (tokens after the
first / time after the first), and whether every request finished with all its tokens.

  # starts its own server (default model, cpu), 127.0.0.1 on a free port:
  python benchmarks/bench_serve.py --backend cpu --tokens 16 --clients 1 4
  # on a GPU machine (no network needed):
  python benchmarks/bench_serve.py --backend cuda -m model.gguf --tokens 128 --ctx 1024
  # against a server already running on this machine:
  python benchmarks/bench_serve.py --url http://127.0.0.1:8080 --clients 1 4 16 32
  # a GPU machine without network: a synthetic model file of a preset's shape (written once),
  # the single-stream speed of the same file (edgellm's own decode loop, as `edgellm run`), and
  # llama.cpp's batched decoding of that file (llama-batched-bench) in the same table:
  python benchmarks/bench_serve.py --backend cuda --synthetic llama-3.2-1b:Q4_0 --model-out /tmp/m.gguf \
      --tokens 128 --ctx 1024 --single --llama-batched-bench /path/to/llama-batched-bench

With --synthetic the requests go to /v1/completions (a synthetic file has no chat template) with a
prompt of about --prompt-tokens tokens; llama-batched-bench gets the prompt length the server
reported (-npp), --tokens (-ntg) and the client counts (-npl). "decode tok/s" is the sum of the
streams' decode rates (each over its own first to last token, so it includes the steps that other
streams' prefill took); "steady tok/s" the tokens received while every stream decoded at once over
that window's length (see steady_decode): llama.cpp's S_TG t/s (N sequences decoding after all
prompts are in) is its counterpart. Long answers (--tokens 512) give the steady window room.
">0.1s model/loop": from the server's GET /metrics before and after the round, how many times an
iteration of the model thread took more than 0.1 s and how many times the event loop ran a timer
more than 0.1 s late (edgellm.serve.metrics). On a GPU, where a step takes milliseconds, either
is a stall; on a CPU, an iteration with a prefill chunk takes that long by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

try:  # the HTTP client the openai package is built on (httpx, or its successor httpx2)
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from edgellm.serve.metrics import STALL_S, parse, past  # noqa: E402
TOPICS = ["the sea", "a robot", "a mountain", "the moon", "a city", "a forest", "a train", "a library"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, who: str, poll: float = 0.5) -> None:
    """Wait until the server at url answers /health (exit with a message if it dies or times out)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            sys.exit(f"{who}: the server exited" + (f": {proc.stderr.read()}" if proc.stderr else ""))
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"{who}: the server did not come up in {timeout} s")
        time.sleep(poll)


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "edgellm", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--backend", args.backend, "--parallel", str(max(args.clients)), "--ctx", str(args.ctx),
           "--max-queue", str(max(args.clients) * args.requests), "--chunk", str(args.chunk)]
    if args.model:
        cmd += ["-m", args.model]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, args.startup_timeout, "bench_serve")
    print(proc.stderr.readline().strip(), file=sys.stderr)
    return proc, url


def prompt_text(i: int, words: int) -> str:
    text = f"Write a long story about {TOPICS[i % len(TOPICS)]} (#{i})."
    filler = " Once upon a time there was a little town by the sea, and its people told stories."
    while len(text.split()) < words:
        text += filler
    return text


SAMPLING = {"temperature": 0}  # every request's sampling fields (--temperature, --top-k, --top-p)


async def one_request(client, url: str, i: int, tokens: int, raw: bool = False, words: int = 0) -> dict:
    body = {"max_tokens": tokens, **SAMPLING, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if SAMPLING["temperature"] > 0:
        body["seed"] = i
    if raw:  # a file without a chat template (synthetic): a plain completion
        body["prompt"] = prompt_text(i, words)
        endpoint = "/v1/completions"
    else:
        body["messages"] = [{"role": "user", "content": prompt_text(i, words)}]
        endpoint = "/v1/chat/completions"
    t0 = time.perf_counter()
    first = end = None
    usage = None
    arrivals = []  # the time of each chunk that carried text
    async with client.stream("POST", url + endpoint, json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"ok": False, "error": chunk["error"]["message"]}
            choice = chunk["choices"][0] if chunk["choices"] else {}
            if choice.get("delta", {}).get("content") or choice.get("text"):
                arrivals.append(time.perf_counter())
                if first is None:
                    first = arrivals[-1]
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    first = first or end
    return {"ok": n == tokens, "tokens": n, "ttft": first - t0, "total": end - t0, "arrivals": arrivals,
            "prompt_tokens": usage["prompt_tokens"] if usage else 0,
            "stream_tps": (n - 1) / (end - first) if n > 1 and end > first else 0.0,
            "error": None if n == tokens else f"{n} of {tokens} tokens"}


async def round_(url: str, n: int, requests: int, tokens: int, timeout: float, raw: bool = False,
                 words: int = 0) -> dict:
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def worker(c):
            return [await one_request(client, url, c * requests + k, tokens, raw, words) for k in range(requests)]

        t0 = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(worker(c) for c in range(n))), timeout)
        wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    ok = [r for r in flat if r["ok"]]
    ttft = sorted(r["ttft"] for r in ok) or [float("nan")]
    steady = steady_decode([rs[0] for rs in results if rs and rs[0]["ok"]] if len(ok) == len(flat) else [])
    return {"clients": n, "requests": len(flat), "ok": len(ok), "wall_s": wall, **steady,
            "aggregate_tps": sum(r.get("tokens", 0) for r in flat) / wall,
            "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p95_ms": 1e3 * ttft[min(len(ttft) - 1, int(round(0.95 * (len(ttft) - 1))))],
            "stream_tps": statistics.mean([r["stream_tps"] for r in ok]) if ok else 0.0,
            # the streams' decode rates summed: the aggregate while all of them run (per round of requests)
            "decode_tps": sum(r["stream_tps"] for r in ok) / max(1, requests),
            "prompt_tokens": int(statistics.median([r["prompt_tokens"] for r in ok])) if ok else 0,
            "errors": sorted({r["error"] for r in flat if r.get("error")})[:3]}


def steady_decode(streams: list[dict], min_window: float = 0.02) -> dict:
    """The aggregate decode rate while every stream of a level decodes at once: from the last
    stream's first token to the first stream's last token, the tokens the streams received in that
    window over its length; what llama-batched-bench's S_TG measures (all prompts in, then N
    sequences decoding together), without the other streams' prefill that the per-stream rates
    include. Tokens are counted as text chunks scaled by each stream's tokens per chunk (a chunk
    carries one token unless its text waited for the next token's bytes). None when the streams
    never all decoded together for min_window seconds (short answers, staggered prompts)."""
    if not streams or any(len(r["arrivals"]) < 2 for r in streams):
        return {"steady_tps": None, "steady_window_s": 0.0}
    lo = max(r["arrivals"][0] for r in streams)
    hi = min(r["arrivals"][-1] for r in streams)
    if hi - lo < min_window:
        return {"steady_tps": None, "steady_window_s": max(0.0, hi - lo)}
    tokens = 0.0
    for r in streams:
        inside = sum(1 for t in r["arrivals"] if lo < t <= hi)
        tokens += inside * r["tokens"] / len(r["arrivals"])
    return {"steady_tps": tokens / (hi - lo), "steady_window_s": hi - lo}


def scrape(url: str) -> dict | None:
    """The server's /metrics (edgellm.serve.metrics.parse), or None where it has none."""
    try:
        r = httpx.get(url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    return parse(r.text) if r.status_code == 200 else None


def stalls(before: dict | None, after: dict | None) -> dict:
    """From two scrapes: the round's iterations of the model thread that took more than STALL_S and
    event-loop timers run more than STALL_S late, each with the range the longest fell in."""
    if before is None or after is None:
        return {}
    model, model_max = past(before, after, "edgellm_scheduler_interval_seconds")
    loop, loop_max = past(before, after, "edgellm_event_loop_lag_seconds")
    one_time = after.get("edgellm_one_time_seconds_total", 0.0) - before.get("edgellm_one_time_seconds_total", 0.0)
    return {"model_stalls": model, "model_stall_max": model_max, "loop_stalls": loop, "loop_stall_max": loop_max,
            "one_time_s": one_time}


def _stall_text(r: dict) -> str:
    return f"{r['model_stalls']}/{r['loop_stalls']}" if "model_stalls" in r else "-"


def synthetic_model(spec: str, out: str) -> str:
    """PRESET:FMT (edgellm.synthetic presets) written to out unless it is there: random weights, a
    byte-level vocabulary whose reserved tokens are text (a random model's output streams)."""
    from edgellm.synthetic import PRESETS, byte_bpe_vocab, preset, write_synthetic_gguf

    name, _, fmt = spec.partition(":")
    if name not in PRESETS or not fmt:
        sys.exit(f"bench_serve: --synthetic wants PRESET:FMT with PRESET one of {', '.join(PRESETS)}, got {spec!r}")
    path = Path(out)
    if not path.exists():
        s = preset(name, weight_type=fmt)
        print(f"writing {path} ({name}, {fmt})", file=sys.stderr)
        write_synthetic_gguf(path, s, byte_bpe_vocab(s.vocab_size, reserved_type=1), fast=True)
    return str(path)


SINGLE = """
import json, sys, time
import edgellm
from edgellm.sampling import SamplingParams
from edgellm.model import GenerationStats
m = edgellm.load(sys.argv[1], backend=sys.argv[2], ctx=int(sys.argv[3]))
ids = m.tokenizer.encode(sys.argv[5])
params = SamplingParams(**json.loads(sys.argv[6]))
list(m.generate_tokens(ids, 8, params))  # first-run compiles and captures
st = GenerationStats(prompt_tokens=len(ids))
n = len(list(m.generate_tokens(ids, int(sys.argv[4]), params, st)))
print(json.dumps({"tokens": n, "decode_tps": st.decode_tps}))
"""


def single_stream(args, model: str, words: int) -> dict | None:
    """edgellm's own single-sequence decode of the same file (what `edgellm run` runs), in a
    process of its own after the server has gone."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # the server's sampling (OpenAI's defaults for what a request leaves out: no top-k, no min-p)
    params = {"temperature": SAMPLING["temperature"], "top_k": SAMPLING.get("top_k", 0),
              "top_p": SAMPLING.get("top_p", 1.0), "min_p": 0.0, "seed": 0}
    r = subprocess.run([sys.executable, "-c", SINGLE, model, args.backend, str(args.ctx), str(args.tokens),
                        prompt_text(0, words), json.dumps(params)], env=env, capture_output=True, text=True,
                       timeout=args.timeout)
    if r.returncode:
        print(f"bench_serve: single-stream run failed: {r.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_batched(args, model: str, prompt_tokens: int) -> dict[int, dict]:
    """llama-batched-bench on the same file: one row per parallel sequence count (pl), with its
    decode (S_TG) and overall speeds; {} when it fails (its error printed)."""
    pls = sorted(set(args.clients))
    ctx = max(pls) * (prompt_tokens + args.tokens) + 64
    cmd = [args.llama_batched_bench, "-m", model, "-c", str(ctx), "-b", "2048", "-ub", "512", "-ngl", "99",
           "-npp", str(prompt_tokens), "-ntg", str(args.tokens), "-npl", ",".join(map(str, pls)),
           "--output-format", "jsonl"]
    print("running " + " ".join(cmd), file=sys.stderr)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"bench_serve: llama-batched-bench failed: {e}", file=sys.stderr)
        return {}
    rows = {}
    for line in r.stdout.splitlines():
        if line.startswith("{") and '"pl"' in line:
            d = json.loads(line)
            rows[int(d["pl"])] = d
    if not rows:
        print(f"bench_serve: llama-batched-bench gave no results (exit {r.returncode}): {r.stderr.strip()[-800:]}",
              file=sys.stderr)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server on this machine (default: start one)")
    p.add_argument("-m", "--model", default=None, help="model for the started server (default: the embedded one)")
    p.add_argument("--synthetic", default=None, metavar="PRESET:FMT",
                   help="serve a synthetic model of this shape and weight format (e.g. llama-3.2-1b:Q4_0)")
    p.add_argument("--model-out", default=None, help="where --synthetic writes its file (reused when present)")
    p.add_argument("--backend", default="auto", help="backend of the started server (default auto)")
    p.add_argument("--ctx", type=int, default=512, help="context per slot of the started server (default 512)")
    p.add_argument("--chunk", type=int, default=256, help="prefill tokens per scheduler step (default 256)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 32], help="concurrency levels")
    p.add_argument("--requests", type=int, default=1, help="requests per client per level (default 1)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--completions", action="store_true",
                   help="plain /v1/completions requests (a file without a chat template; implied by --synthetic)")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="pad each prompt to about this many words (default: a one-line prompt)")
    p.add_argument("--single", action="store_true",
                   help="also time edgellm's single-stream decode of the same file (as `edgellm run`)")
    p.add_argument("--llama-batched-bench", default=None, metavar="PATH",
                   help="also run llama.cpp's llama-batched-bench on the same file (same -npl, -ntg)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per level at most (default 600)")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds for the server to load (default 600)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="requests' temperature (default 0: greedy; above 0 each request seeded by its number)")
    p.add_argument("--top-k", type=int, default=None, help="requests' top_k (llama.cpp's field; default none)")
    p.add_argument("--top-p", type=float, default=None, help="requests' top_p (default none: 1)")
    args = p.parse_args(argv)
    SAMPLING.clear()
    SAMPLING["temperature"] = args.temperature
    if args.top_k is not None:
        SAMPLING["top_k"] = args.top_k
    if args.top_p is not None:
        SAMPLING["top_p"] = args.top_p
    if args.url:
        host = urlparse(args.url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            sys.exit("bench_serve: loopback only (127.0.0.1, localhost, ::1)")
    raw = args.completions
    if args.synthetic:
        sys.path.insert(0, str(ROOT))
        out = args.model_out or f"/tmp/edgellm-bench-serve/{args.synthetic.replace(':', '-')}.gguf"
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        args.model = synthetic_model(args.synthetic, out)
        raw = True
    words = args.prompt_tokens
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    rows = []
    try:
        asyncio.run(round_(url, 1, 1, 4, args.timeout, raw, words))  # warm-up: first-call compilation, caches
        for n in args.clients:
            # a short untimed round first: the batch sizes this level reaches compile their kernels
            # and capture their CUDA graphs (once per row bucket) outside the timed round
            asyncio.run(round_(url, n, 1, 8, args.timeout, raw, words))
            before = scrape(url)
            rows.append(asyncio.run(round_(url, n, args.requests, args.tokens, args.timeout, raw, words)))
            r = rows[-1]
            r.update(stalls(before, scrape(url)))
            print(f"  N={n}: {r['aggregate_tps']:.1f} tok/s", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    single = single_stream(args, args.model, words) if args.single and args.model else None
    prompt_tokens = max((r["prompt_tokens"] for r in rows), default=0) or 16
    llama = llama_batched(args, args.model, prompt_tokens) if args.llama_batched_bench and args.model else {}
    head = (f"{'clients':>7} {'ok/req':>7} {'agg tok/s':>10} {'decode tok/s':>13} {'steady tok/s':>13} "
            f"{'window s':>9} {'TTFT p50 ms':>12} {'TTFT p95 ms':>12} {'stream tok/s':>13} {'wall s':>7} "
            f"{'>0.1s model/loop':>17}")
    if llama:
        head += f" {'llama.cpp S_TG':>15} {'llama.cpp S':>12} {'decode vs llama':>16} {'steady vs llama':>16}"
    print(f"edgellm serve load test: {args.tokens} tokens per request, {args.requests} request(s) per client, "
          f"prompt {prompt_tokens} tokens, sampling {SAMPLING}, {args.model or url}")
    print(head)
    for r in rows:
        steady = f"{r['steady_tps']:>13.1f}" if r["steady_tps"] else f"{'-':>13}"
        line = (f"{r['clients']:>7} {str(r['ok']) + '/' + str(r['requests']):>7} {r['aggregate_tps']:>10.1f} "
                f"{r['decode_tps']:>13.1f} {steady} {r['steady_window_s']:>9.2f} {r['ttft_p50_ms']:>12.0f} "
                f"{r['ttft_p95_ms']:>12.0f} {r['stream_tps']:>13.1f} {r['wall_s']:>7.1f} "
                f"{_stall_text(r):>17}")
        lr = llama.get(r["clients"])
        if lr:
            vs = f"{r['steady_tps'] / lr['speed_tg']:>15.2f}x" if r["steady_tps"] else f"{'-':>16}"
            line += f" {lr['speed_tg']:>15.1f} {lr['speed']:>12.1f} {r['decode_tps'] / lr['speed_tg']:>15.2f}x {vs}"
        elif llama:
            line += f" {'-':>15} {'-':>12} {'-':>16} {'-':>16}"
        print(line + (f"  errors: {r['errors']}" if r["errors"] else ""))
    for r in rows:
        if r.get("model_stalls") or r.get("loop_stalls") or r.get("one_time_s"):
            print(f"  N={r['clients']}: model-thread iterations over {STALL_S:g} s: {r['model_stalls']} (longest "
                  f"{r['model_stall_max'] or '-'}); event-loop lags over {STALL_S:g} s: {r['loop_stalls']} (longest "
                  f"{r['loop_stall_max'] or '-'}); compiles and graph captures: {r['one_time_s']:.2f} s (GET /metrics)")
    if rows and rows[0]["clients"] == 1:
        base = rows[0]["aggregate_tps"]
        print("aggregate vs 1 client: " + ", ".join(f"N={r['clients']} {r['aggregate_tps'] / base:.2f}x" for r in rows))
    if single:
        line = f"single stream, edgellm's own decode loop (as `edgellm run`): {single['decode_tps']:.1f} tok/s"
        if rows and rows[0]["clients"] == 1 and single["decode_tps"]:
            line += f"; through the server (N=1 stream tok/s): {rows[0]['stream_tps'] / single['decode_tps']:.2f}x of it"
        print(line)
        for r in rows:
            if single["decode_tps"]:
                steady = (f", steady {r['steady_tps'] / single['decode_tps']:.2f}x" if r["steady_tps"] else "")
                print(f"  N={r['clients']}: decode tok/s {r['decode_tps'] / single['decode_tps']:.2f}x single stream"
                      + steady)
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "requests": args.requests, "sampling": SAMPLING,
                                               "rows": rows,
                                               "single": single, "llama_batched_bench": llama}, indent=2))
    return 0 if all(r["ok"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
