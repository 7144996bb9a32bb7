"""The serving stack's own ceiling: `edgellm serve` with the model replaced by a stand-in.

The stand-in decode step costs a fixed time (--step-ms; of it --host-ms holds the GIL, as the
backend's Python launch work does, the rest sleeps with the GIL released, as torch's wait for the
GPU does) and returns deterministic tokens: words of an English text in the default model's
vocabulary. It plugs in where the model's slot pool does (Scheduler(..., pool=)), so everything
else is the real thing: Scheduler, TextStream with the default model's tokenizer, app.py, uvicorn
over loopback, and streaming httpx clients in another process.

Per N concurrent clients (each streams --requests completions of --tokens tokens, ignore_eos):
aggregate and per-stream tokens/s (the median of --repeat rounds), each also as a fraction of the
ceiling, the stand-in's own step rate (per stream: steps/s; aggregate: N x steps/s): its device
rate, one step every --step-ms, where steps are queued on a device, else a tight loop of its
steps. Also where the time per step goes, read from the server: the stand-in step as the
scheduler saw it, the scheduler thread's time between steps, the CPU time per token of the
scheduler and event-loop threads, the event loop's busy fraction, the spread of the rounds and
the longest time between two steps queued one after the other (a stall). The stand-in's step runs
while the scheduler goes on, as a step queued on a GPU does, on a device queue (a step queued
while another runs starts when it ends), and has decode_next, so the scheduler chains steps as
on cuda (--no-overlap: as on a CPU backend).
--profile writes cProfile tables of the scheduler thread and the event-loop thread.

  python benchmarks/bench_serve_stack.py                        # N = 1, 4, 16, 32; 0.7 ms steps
  python benchmarks/bench_serve_stack.py --clients 1 16 --step-ms 0.5 --profile /tmp/prof
  python benchmarks/bench_serve_stack.py --requests 1 --prompt-words 270 --prefill-ms 0.015  # bench_serve's H100 shape
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

try:  # the HTTP client the openai package is built on (httpx, or its successor httpx2)
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import _free_port, wait_healthy  # noqa: E402  (one way to start and wait, both benchmarks)

TEXT = ("The old lighthouse keeper climbed the stairs every evening, counting the steps as his father had "
        "done before him. Out on the water the fishing boats turned for home, their lamps small against "
        "the dark, and the wind carried the smell of salt and rain across the harbour. He lit the lamp, "
        "wrote the weather in the book, and sat by the window to watch the sea until morning came.")


# -- the stand-in model (server side) ---------------------------------------------------------------
class StandInModel:
    """What the scheduler and app.py use of a Model: ctx, tokenizer, config.vocab_size, chat_tokens,
    forward (prefill). Tokens come from TEXT, shifted per slot."""

    def __init__(self, ctx: int, prefill_ms_per_token: float):
        from edgellm.default_model import default_model_path
        from edgellm.gguf_file import open_gguf
        from edgellm.tokenizer import Tokenizer

        self.path = str(default_model_path())
        self.tokenizer = Tokenizer.from_metadata(open_gguf(self.path).metadata)
        self.config = SimpleNamespace(vocab_size=self.tokenizer.vocab_size)
        self.ctx = ctx
        self.prefill_s = prefill_ms_per_token / 1e3
        self.text_ids = [t for t in self.tokenizer.encode(TEXT) if t not in self.tokenizer.stop_ids]

    def chat_tokens(self, messages, add_generation_prompt: bool = True):
        from edgellm.model import Model

        return Model.chat_tokens(self, messages, add_generation_prompt)

    def token(self, slot, pos: int) -> int:
        return self.text_ids[(pos + 13 * slot.index) % len(self.text_ids)]

    def forward(self, ids, pos, all_logits=False, slot=None):
        time.sleep(self.prefill_s * len(ids))
        del slot.tokens[pos:]
        slot.tokens.extend(int(t) for t in ids)
        logits = np.zeros((1, self.config.vocab_size), np.float32)
        logits[0, self.token(slot, pos + len(ids))] = 1.0
        return logits


class StandInPool:
    """The slot pool's decode step (SlotPool.decode_tokens) at a fixed cost: host_s holding the GIL
    (a Python busy loop) in `releases` parts, each ended by a release of the GIL (time.sleep(0)) as
    each torch call in the backend's launch work releases it, then the rest of step_s asleep (the
    GIL released, as in the wait for the GPU). A thread waiting for the GIL takes it at each
    release; taking it back can then wait for that thread (up to the switch interval).
    Records, per step, the step's own time and the scheduler thread's time since the last step."""

    def __init__(self, model: StandInModel, n: int, step_ms: float, host_ms: float, releases: int,
                 overlaps: bool = True):
        from edgellm.session import KVSlot

        self.model, self.n = model, n
        self.slots = [KVSlot({}, {}, index=s) for s in range(n)]
        self.batch = self  # not None: the scheduler runs batched steps
        self.step_s, self.host_s = step_ms / 1e3, min(host_ms, step_ms) / 1e3
        self.releases = max(1, releases)
        self.overlaps = overlaps  # as SlotPool on a CUDA device: the step runs while the host goes on
        self.reset()

    def reset(self):
        self.steps = self.rows = 0
        self.in_step = self.between = self.between_cpu = 0.0
        self._last = None  # (wall, thread cpu) at the end of the previous step
        self.own_cpu = 0.0  # the stand-in's own CPU time (its host part)
        self.cpu_first = self.cpu_last = None  # the scheduler thread's CPU clock at the first and last step
        self._device_free = 0.0  # when the last queued step's device part ends
        self._queued = None  # when the last step was queued
        self.max_gap = 0.0  # the longest time between two steps queued one after the other (a stall)

    draws_on_device = False  # sampled rows are drawn on the host from their logits, as on the cpu backend

    def launch(self) -> float:
        """The host part; returns when the device part ends: after the steps queued before it, as
        a GPU runs its queue in order."""
        t0, c0 = time.perf_counter(), time.thread_time()
        for k in range(1, self.releases + 1):  # each torch call releases the GIL and takes it again
            end = t0 + self.host_s * k / self.releases
            while time.perf_counter() < end:
                pass
            time.sleep(0)
        self.own_cpu += time.thread_time() - c0
        self._device_free = max(time.perf_counter(), self._device_free) + self.step_s
        return self._device_free

    @staticmethod
    def wait_until(end: float) -> None:
        rest = end - time.perf_counter()
        if rest > 0:
            time.sleep(rest)

    def step(self):
        self.wait_until(self.launch())

    def decode_tokens(self, steps, need_logits, draws=None):
        return self.decode_start(steps, need_logits, draws)()

    def decode_start(self, steps, need_logits, draws=None):
        return self._queue([(slot, pos) for slot, _, pos in steps], [token for _, token, _ in steps], need_logits)

    def decode_next(self, prev: "StandInStep") -> "StandInStep":
        """The step after prev for the same slots, fed prev's tokens, queued before prev is read
        (SlotPool.decode_next: the scheduler's chain of steps where the device chooses the tokens)."""
        return self._queue([(slot, pos + 1) for slot, pos in prev.rows], list(prev.chosen),
                           [False] * len(prev.rows))

    def _queue(self, rows, fed, need_logits) -> "StandInStep":
        t0, c0 = time.perf_counter(), time.thread_time()
        if self.cpu_first is None:
            self.cpu_first, self.own_cpu = c0, 0.0
        self.cpu_last = c0
        if self._last is not None and t0 - self._last[0] < 0.05:  # not across an idle gap
            self.between += t0 - self._last[0]
            self.between_cpu += c0 - self._last[1]
        if self._queued is not None:
            self.max_gap = max(self.max_gap, t0 - self._queued)
        self._queued = t0
        device_end = self.launch()
        tokens = np.empty(len(rows), np.int64)
        for i, ((slot, pos), token) in enumerate(zip(rows, fed)):
            del slot.tokens[pos:]
            slot.tokens.append(int(token))
            tokens[i] = self.model.token(slot, pos + 1)
        logits = {}
        for i, need in enumerate(need_logits):
            if need:
                row = np.zeros(self.model.config.vocab_size, np.float32)
                row[tokens[i]] = 1.0
                logits[i] = row
        t1 = time.perf_counter()
        self.steps += 1
        self.rows += len(rows)
        self.in_step += t1 - t0
        return StandInStep(self, rows, tokens, logits, device_end)


class StandInStep:
    """A queued stand-in step (SlotPool's DecodeStep): rows (slot, position), the chosen tokens, and
    called, waits for the device part to end and returns (tokens, logits rows asked for)."""

    def __init__(self, pool: StandInPool, rows, chosen, logits, device_end: float):
        self.pool, self.rows, self.chosen, self.logits, self.device_end = pool, rows, chosen, logits, device_end

    def __call__(self):
        pool = self.pool
        t2 = time.perf_counter()
        pool.wait_until(self.device_end)
        t3 = time.perf_counter()
        pool.in_step += t3 - t2
        pool._last = (t3, time.thread_time())
        return self.chosen, self.logits


class LoopClock:
    """The event loop's busy time: wall time minus the time it waits in select()."""

    def __init__(self):
        self.blind = False
        self.reset()

    def reset(self):  # on the loop's thread
        self.t0, self.idle, self.iterations = time.perf_counter(), 0.0, 0
        self.cpu0 = time.thread_time()

    def hook(self, loop):
        sel = getattr(loop, "_selector", None)
        if sel is None:  # not asyncio's own loop (uvloop): its busy time is not known
            self.blind = True
            return
        select = sel.select

        def timed(timeout=None):
            t = time.perf_counter()
            try:
                return select(timeout)
            finally:
                self.idle += time.perf_counter() - t
                self.iterations += 1

        sel.select = timed

    def read(self) -> dict:
        wall = time.perf_counter() - self.t0
        return {"wall_s": wall, "busy_s": None if self.blind else wall - self.idle, "iterations": self.iterations,
                "cpu_s": time.thread_time() - self.cpu0}


def serve_main(args) -> None:
    from edgellm.serve.app import ServeConfig, create_app
    from edgellm.serve.cli import run_server
    from edgellm.serve.scheduler import Scheduler

    model = StandInModel(args.ctx, args.prefill_ms)
    pool = StandInPool(model, args.parallel, args.step_ms, args.host_ms, args.gil_releases, not args.no_overlap)
    sched = Scheduler(model, args.parallel, max_queue=args.parallel * 4, pool=pool)
    profs = {}
    if args.profile:
        loop_fn = sched._loop

        def profiled_loop():
            profs["scheduler"] = p = cProfile.Profile()
            p.runcall(loop_fn)

        sched._thread = threading.Thread(target=profiled_loop, name="edgellm-scheduler", daemon=True)
    sched.start()
    app = create_app(model, sched, ServeConfig(model_id="stand-in", stream_interval=args.stream_interval / 1e3))
    clock = LoopClock()

    @app.post("/bench/reset")
    async def _reset():
        pool.reset()
        clock.reset()
        return {}

    @app.get("/bench/stats")
    async def _stats():
        sched_cpu = (pool.cpu_last - pool.cpu_first - pool.own_cpu) if pool.cpu_first is not None else 0.0
        return {"steps": pool.steps, "rows": pool.rows, "in_step_s": pool.in_step, "between_s": pool.between,
                "max_gap_s": pool.max_gap,
                "sched_cpu_s": sched_cpu,
                "between_cpu_s": pool.between_cpu, "loop": clock.read(),
                "switch_interval_s": sys.getswitchinterval()}

    def hook(loop):
        clock.hook(loop)
        if args.profile:
            profs["loop"] = p = cProfile.Profile()
            p.enable()

    try:
        kw = {} if args.switch_interval is None else {"switch_interval": args.switch_interval / 1e3}
        run_server(app, sched, host="127.0.0.1", port=args.port, loop_hook=hook, **kw)
    finally:
        if "loop" in profs:
            profs["loop"].disable()
        for name, p in profs.items():
            p.dump_stats(f"{args.profile}.{name}.prof")


# -- the clients (driver side) ------------------------------------------------------------------------
async def one_request(client, url: str, i: int, tokens: int, words: int, stop) -> dict:
    text = TEXT.split() * (1 + words // len(TEXT.split()))
    prompt = f"Request {i}: " + " ".join(text[:max(1, words)])
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if stop:
        body["stop"] = stop
    t0 = time.perf_counter()
    first = None
    usage = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if first is None:
                first = time.perf_counter()
            if '"usage"' in line:  # only the chunks with usage are parsed: the client stays cheap
                u = json.loads(line[6:]).get("usage")
                usage = u or usage
            elif '"error"' in line and "error" in json.loads(line[6:]):
                return {"ok": False, "error": line[:200]}
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    first = first or end
    return {"ok": n == tokens, "tokens": n, "ttft": first - t0,
            "stream_tps": (n - 1) / (end - first) if n > 1 and end > first else 0.0,
            "error": None if n == tokens else f"{n} of {tokens} tokens"}


async def round_(url: str, n: int, requests: int, tokens: int, words: int, stop, timeout: float) -> dict:
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def worker(c):
            return [await one_request(client, url, c * requests + k, tokens, words, stop) for k in range(requests)]

        t0 = time.perf_counter()
        c0 = time.process_time()
        results = await asyncio.wait_for(asyncio.gather(*(worker(c) for c in range(n))), timeout)
        wall = time.perf_counter() - t0
        client_cpu = time.process_time() - c0
    flat = [r for rs in results for r in rs]
    ok = [r for r in flat if r["ok"]]
    return {"clients": n, "requests": len(flat), "ok": len(ok), "wall_s": wall, "client_cpu_s": client_cpu,
            "aggregate_tps": sum(r.get("tokens", 0) for r in flat) / wall,
            "stream_tps": statistics.mean([r["stream_tps"] for r in ok]) if ok else 0.0,
            "ttft_p50_ms": 1e3 * statistics.median([r["ttft"] for r in ok]) if ok else float("nan"),
            "errors": sorted({r["error"] for r in flat if r.get("error")})[:3]}


def ceiling(args) -> float:
    """Steps per second of the stand-in alone: its device rate where steps queue on a device (the
    scheduler then chains them back to back), else a tight loop of its decode step."""
    if not args.no_overlap:
        return 1e3 / args.step_ms
    pool = StandInPool(SimpleNamespace(), 1, args.step_ms, args.host_ms, args.gil_releases)
    n = max(200, int(0.5 / max(args.step_ms / 1e3, 1e-5)))
    pool.step()
    t0 = time.perf_counter()
    for _ in range(n):
        pool.step()
    return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 32], help="concurrency levels")
    p.add_argument("--requests", type=int, default=2, help="requests per client per level (default 2)")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds per level; the median is shown (default 3)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--prompt-words", type=int, default=60, help="words of prompt per request (default 60)")
    p.add_argument("--stop", nargs="*", default=None, help="stop strings sent with every request (never met)")
    p.add_argument("--step-ms", type=float, default=0.7, help="the stand-in decode step, ms (default 0.7)")
    p.add_argument("--host-ms", type=float, default=0.1,
                   help="of it, ms holding the GIL (the backend's launch work; default 0.1)")
    p.add_argument("--gil-releases", type=int, default=8,
                   help="GIL releases in the host part (torch calls per step: input copies, graph replay, "
                        "argmax, readback; default 8)")
    p.add_argument("--no-overlap", action="store_true",
                   help="the stand-in's step does not run while the scheduler goes on (as on a CPU backend)")
    p.add_argument("--prefill-ms", type=float, default=0.01, help="stand-in prefill, ms per prompt token")
    p.add_argument("--switch-interval", type=float, default=None, metavar="MS",
                   help="sys.setswitchinterval while serving (default: edgellm serve's own)")
    p.add_argument("--stream-interval", type=float, default=0.0, metavar="MS",
                   help="edgellm serve --stream-interval: ms between hand-overs of events to the streams (default 0)")
    p.add_argument("--ctx", type=int, default=1024, help="context per slot (default 1024)")
    p.add_argument("--profile", default=None, metavar="PREFIX",
                   help="cProfile the scheduler thread and the event loop thread: PREFIX.scheduler.prof, "
                        "PREFIX.loop.prof, and their top functions printed (slows the server)")
    p.add_argument("--top", type=int, default=25, help="functions per profile table (default 25)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per level at most")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--parallel", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve_main(args)
        return 0

    rate = ceiling(args)
    port = _free_port()
    cmd = [sys.executable, __file__, "--serve", "--port", str(port), "--parallel", str(max(args.clients)),
           "--step-ms", str(args.step_ms), "--host-ms", str(args.host_ms),
           "--gil-releases", str(args.gil_releases),
           "--stream-interval", str(args.stream_interval),
           *(["--no-overlap"] if args.no_overlap else []), "--prefill-ms", str(args.prefill_ms),
           "--ctx", str(args.ctx)] + (["--switch-interval", str(args.switch_interval)]
                                      if args.switch_interval is not None else []) + (["--profile", args.profile] if args.profile else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 120, "bench_serve_stack", poll=0.2)
    rows = []
    try:
        asyncio.run(round_(url, 1, 1, 8, args.prompt_words, args.stop, args.timeout))  # warm-up
        for n in args.clients:
            asyncio.run(round_(url, n, 1, 8, args.prompt_words, args.stop, args.timeout))
            runs = []
            for _ in range(args.repeat):
                httpx.post(url + "/bench/reset")
                r = asyncio.run(round_(url, n, args.requests, args.tokens, args.prompt_words, args.stop,
                                       args.timeout))
                r["server"] = httpx.get(url + "/bench/stats").json()
                runs.append(r)
            runs.sort(key=lambda r: r["aggregate_tps"])
            r = runs[len(runs) // 2]  # the median round
            r["all_aggregate_tps"] = [x["aggregate_tps"] for x in runs]
            r["max_gap_ms"] = max(1e3 * x["server"]["max_gap_s"] for x in runs)
            rows.append(r)
            print(f"  N={n}: {r['aggregate_tps']:.0f} tok/s", file=sys.stderr)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    interval = rows[0]["server"]["switch_interval_s"] if rows else float("nan")
    print(f"serving stack ceiling: stand-in decode step {args.step_ms} ms ({args.host_ms} ms holding the GIL, "
          f"released {args.gil_releases} times; {'no overlap' if args.no_overlap else 'overlapping'}), "
          f"{rate:.0f} steps/s alone; {args.tokens} tokens x {args.requests} request(s) per client, "
          f"median of {args.repeat} rounds; "
          f"switch interval {interval * 1e3:g} ms; stream interval {args.stream_interval:g} ms; {os.cpu_count()} CPUs")
    print(f"{'clients':>7} {'ok/req':>7} {'agg tok/s':>10} {'of ceiling':>10} {'stream tok/s':>12} {'of ceiling':>10} "
          f"{'TTFT p50 ms':>11} {'rows/step':>9} {'step ms':>8} {'between ms':>10} {'sched us/tok':>12} "
          f"{'loop us/tok':>11} {'loop busy':>9} {'client cpu':>10} {'agg min-max':>13} {'max gap ms':>10}")
    for r in rows:
        s = r["server"]
        steps, tokens = max(1, s["steps"]), max(1, s["rows"])
        busy = "-" if s["loop"]["busy_s"] is None else f"{s['loop']['busy_s'] / max(1e-9, s['loop']['wall_s']):.2f}"
        line = (f"{r['clients']:>7} {str(r['ok']) + '/' + str(r['requests']):>7} {r['aggregate_tps']:>10.0f} "
                f"{r['aggregate_tps'] / (rate * r['clients']):>10.2f} {r['stream_tps']:>12.0f} "
                f"{r['stream_tps'] / rate:>10.2f} {r['ttft_p50_ms']:>11.1f} {s['rows'] / steps:>9.1f} "
                f"{1e3 * s['in_step_s'] / steps:>8.3f} {1e3 * s['between_s'] / steps:>10.3f} "
                f"{1e6 * s['sched_cpu_s'] / tokens:>12.1f} {1e6 * s['loop']['cpu_s'] / tokens:>11.1f} "
                f"{busy:>9} {r['client_cpu_s'] / r['wall_s']:>10.2f} "
                f"{min(r['all_aggregate_tps']):>6.0f}-{max(r['all_aggregate_tps']):<6.0f} {r['max_gap_ms']:>10.1f}")
        print(line + (f"  errors: {r['errors']}" if r["errors"] else ""))
    print("step ms: the stand-in step as the scheduler saw it (launch to result); between ms: the scheduler "
          "thread's wall time from one step's result to the next launch; sched / loop us/tok: CPU time of the "
          "scheduler thread (less the stand-in's own) and of the event-loop thread per generated token; loop "
          "busy: the event loop's busy fraction; client cpu: the client process's CPU / wall; "
          "agg min-max: the rounds' aggregate tok/s; max gap ms: the longest time between two steps queued "
          "one after the other, over the rounds")
    if args.profile:
        for name in ("scheduler", "loop"):
            path = f"{args.profile}.{name}.prof"
            if os.path.exists(path):
                out = io.StringIO()
                pstats.Stats(path, stream=out).sort_stats("tottime").print_stats(args.top)
                print(f"\n== {name} thread, by own time ({path}) ==")
                print("\n".join(out.getvalue().splitlines()[:args.top + 12]))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "ceiling_steps_s": rate, "rows": rows}, indent=2))
    return 0 if all(r["ok"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
