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
TOPICS = ["the sea", "a robot", "a mountain", "the moon", "a city", "a forest", "a train", "a library"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "edgellm", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--backend", args.backend, "--parallel", str(max(args.clients)), "--ctx", str(args.ctx),
           "--max-queue", str(max(args.clients) * args.requests)]
    if args.model:
        cmd += ["-m", args.model]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while True:
        if proc.poll() is not None:
            sys.exit(f"bench_serve: the server exited: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"bench_serve: the server did not come up in {args.startup_timeout} s")
        time.sleep(0.5)
    print(proc.stderr.readline().strip(), file=sys.stderr)
    return proc, url


async def one_request(client, url: str, i: int, tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]} (#{i})."}],
            "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = end = None
    usage = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"ok": False, "error": chunk["error"]["message"]}
            choice = chunk["choices"][0] if chunk["choices"] else {}
            if first is None and choice.get("delta", {}).get("content"):
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    first = first or end
    return {"ok": n == tokens, "tokens": n, "ttft": first - t0, "total": end - t0,
            "stream_tps": (n - 1) / (end - first) if n > 1 and end > first else 0.0,
            "error": None if n == tokens else f"{n} of {tokens} tokens"}


async def round_(url: str, n: int, requests: int, tokens: int, timeout: float) -> dict:
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def worker(c):
            return [await one_request(client, url, c * requests + k, tokens) for k in range(requests)]

        t0 = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(worker(c) for c in range(n))), timeout)
        wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    ok = [r for r in flat if r["ok"]]
    ttft = sorted(r["ttft"] for r in ok) or [float("nan")]
    return {"clients": n, "requests": len(flat), "ok": len(ok), "wall_s": wall,
            "aggregate_tps": sum(r.get("tokens", 0) for r in flat) / wall,
            "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p95_ms": 1e3 * ttft[min(len(ttft) - 1, int(round(0.95 * (len(ttft) - 1))))],
            "stream_tps": statistics.mean([r["stream_tps"] for r in ok]) if ok else 0.0,
            "errors": sorted({r["error"] for r in flat if r.get("error")})[:3]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server on this machine (default: start one)")
    p.add_argument("-m", "--model", default=None, help="model for the started server (default: the embedded one)")
    p.add_argument("--backend", default="auto", help="backend of the started server (default auto)")
    p.add_argument("--ctx", type=int, default=512, help="context per slot of the started server (default 512)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 32], help="concurrency levels")
    p.add_argument("--requests", type=int, default=1, help="requests per client per level (default 1)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per level at most (default 600)")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds for the server to load (default 600)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.url:
        host = urlparse(args.url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            sys.exit("bench_serve: loopback only (127.0.0.1, localhost, ::1)")
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    rows = []
    try:
        asyncio.run(round_(url, 1, 1, 4, args.timeout))  # warm-up: first-call compilation, caches
        for n in args.clients:
            rows.append(asyncio.run(round_(url, n, args.requests, args.tokens, args.timeout)))
            r = rows[-1]
            print(f"  N={n}: {r['aggregate_tps']:.1f} tok/s", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    head = f"{'clients':>7} {'ok/req':>7} {'agg tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p95 ms':>12} {'stream tok/s':>13} {'wall s':>7}"
    print(f"edgellm serve load test: {args.tokens} tokens per request, {args.requests} request(s) per client, {url}")
    print(head)
    for r in rows:
        print(f"{r['clients']:>7} {str(r['ok']) + '/' + str(r['requests']):>7} {r['aggregate_tps']:>10.1f} "
              f"{r['ttft_p50_ms']:>12.0f} {r['ttft_p95_ms']:>12.0f} {r['stream_tps']:>13.1f} {r['wall_s']:>7.1f}"
              + (f"  errors: {r['errors']}" if r["errors"] else ""))
    if rows and rows[0]["clients"] == 1:
        base = rows[0]["aggregate_tps"]
        print("aggregate vs 1 client: " + ", ".join(f"N={r['clients']} {r['aggregate_tps'] / base:.2f}x" for r in rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "requests": args.requests, "rows": rows}, indent=2))
    return 0 if all(r["ok"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
