"""`edgellm serve`: the OpenAI-compatible server (uvicorn), loopback unless told otherwise."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import sys
import threading
import time

from ..errors import EdgeLLMError


def add_serve_parser(sub, help: str | None = None) -> None:
    s = sub.add_parser(
        "serve", help=help,
        description="Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, "
                    "/health) with continuous batching over --parallel KV-cache slots. Binds 127.0.0.1 "
                    "unless --host says otherwise.")
    s.add_argument("-m", "--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    s.add_argument("--backend", default="auto", help="cpu, cuda, or auto (default)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8080, help="TCP port (default 8080)")
    s.add_argument("-np", "--parallel", type=int, default=4, help="sequences served at once, one KV-cache slot each (default 4)")
    s.add_argument("-c", "--ctx", type=int, default=None,
                   help="context of each slot in tokens (default: min(model, 4096))")
    s.add_argument("--api-key", default=os.environ.get("EDGELLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/ (default: $EDGELLM_API_KEY, else none)")
    s.add_argument("--alias", default=None, help="the model's id in the API (default: the file name without .gguf)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503 (default 64)")
    s.add_argument("--chunk", type=int, default=256, help="prefill tokens per step, between decode steps (default 256)")
    s.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    s.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for (default: the context)")
    s.add_argument("--stream-interval", type=float, default=0.0, metavar="MS",
                   help="least milliseconds between two hand-overs of tokens to the streams; the tokens of "
                        "several steps then go out as one chunk per stream, fewer writes for the event loop "
                        "(default 0: each step's tokens as soon as the loop runs)")
    s.add_argument("--shutdown-grace", type=float, default=5.0,
                   help="seconds Ctrl-C/SIGTERM lets running requests finish before cancelling them (default 5)")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=_cmd_serve)


def _check_args(args: argparse.Namespace) -> None:
    checks = [
        ("--port", 0 <= args.port <= 65535, "in 0..65535"),
        ("--parallel", args.parallel >= 1, ">= 1"),
        ("--ctx", args.ctx is None or args.ctx > 0, "> 0"),
        ("--max-queue", args.max_queue >= 0, ">= 0"),
        ("--chunk", args.chunk >= 1, ">= 1"),
        ("--max-body", args.max_body >= 1024, ">= 1024"),
        ("--max-tokens-limit", args.max_tokens_limit is None or args.max_tokens_limit >= 1, ">= 1"),
        ("--shutdown-grace", args.shutdown_grace >= 0, ">= 0"),
        ("--stream-interval", args.stream_interval >= 0, ">= 0"),
    ]
    for name, ok, want in checks:
        if not ok:
            raise EdgeLLMError(f"{name} must be {want}, got {getattr(args, name[2:].replace('-', '_'))}")
    if args.model is not None and not os.path.isfile(args.model):
        raise EdgeLLMError(f"model file {args.model} does not exist")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cmd_serve(args: argparse.Namespace) -> int:
    _check_args(args)  # before the model loads: a typo costs no waiting
    # The server's kernels launch without programmatic dependent launch (cuda, Hopper) unless
    # EDGELLM_PDL says otherwise. Measured on the H200 (2026-11-28, docs/benchmarks.md), 8B Q4_0
    # through this server, 16 streams: 3,459 tok/s steady with it off against 2,950 with it on
    # (llama.cpp 2,120-2,200 on the same file); one stream 493.5 tok/s against `edgellm run`'s
    # 462.7-487.9 (it keeps PDL). Off for the batched steps alone, one stream through the server
    # fell to 0.73-0.95x of `edgellm run`.
    os.environ.setdefault("EDGELLM_PDL", "0")
    from ..backends.cuda.early import start_for

    start_for(args.backend)  # the GPU's context made while torch and the server's stack import
    try:
        import uvicorn

        from .app import ServeConfig, create_app
    except ImportError as e:
        raise EdgeLLMError(f"edgellm serve needs {e.name}: pip install fastapi uvicorn") from None
    from ..model import load
    from .scheduler import Scheduler

    m = load(args.model, backend=args.backend, ctx=args.ctx)
    if m.tokenizer is None:
        raise EdgeLLMError(f"{os.path.basename(m.path)} has no vocabulary; the server needs text")
    model_id = args.alias or os.path.basename(m.path).removesuffix(".gguf")
    sched = Scheduler(m, args.parallel, max_queue=args.max_queue, chunk=args.chunk)
    if sched.pool.overlaps:  # a GPU: compile and capture every batched step now, not in the first requests
        t0 = time.perf_counter()
        print("edgellm serve: preparing the batched decode steps...", file=sys.stderr, flush=True)
        n = sched.pool.warmup()
        print(f"edgellm serve: {n} decode steps prepared in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    sched.start()
    app = create_app(m, sched, ServeConfig(model_id=model_id, api_key=args.api_key, max_body=args.max_body,
                                          max_tokens_limit=args.max_tokens_limit,
                                          stream_interval=args.stream_interval / 1e3))
    if not _is_loopback(args.host) and not args.api_key:
        print(f"edgellm serve: warning: listening on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    print(f"edgellm serve: {model_id} on http://{args.host}:{args.port}/v1 ({args.parallel} slots x {m.ctx} tokens; "
          f"{m.backend.describe()}; load {m.load_s:.1f} s)", file=sys.stderr, flush=True)
    run_server(app, sched, host=args.host, port=args.port, log_level=args.log_level,
               shutdown_grace=args.shutdown_grace)
    print("edgellm serve: stopped", file=sys.stderr)
    return 0


# While serving, two threads share the GIL: the model thread (which releases it at every torch
# call and in the wait for the GPU) and the event loop's. A thread that wants the GIL back waits
# until the holder releases it or the switch interval (Python's default 5 ms) forces it to: with
# the loop busy, each release in a decode step could cost the model thread up to 5 ms.
SWITCH_INTERVAL_S = 0.0005


def run_server(app, sched, *, host: str, port: int, log_level: str = "warning", shutdown_grace: float = 5.0,
               switch_interval: float | None = SWITCH_INTERVAL_S, loop_hook=None) -> None:
    """Serve app with uvicorn until Ctrl-C / SIGTERM (running requests get shutdown_grace seconds
    to finish), then stop the scheduler. switch_interval: sys.setswitchinterval while serving
    (None: Python's as it is). loop_hook(loop), when given, sees the event loop before the server
    starts (benchmarks/bench_serve_stack.py counts its busy time)."""
    import asyncio

    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_grace, access_log=log_level in ("info", "debug"))
    server = _server_class()(config)

    async def serve():
        loop_hook(asyncio.get_running_loop())
        await server.serve()

    old_interval = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    try:
        if loop_hook is None:
            server.run()
        else:  # as server.run() (Python 3.11+), plus the hook
            with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
                runner.run(serve())
    finally:
        sched.stop()
        sys.setswitchinterval(old_interval)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own re-raises the signal after shutting down, so the process would die of
            # SIGTERM before the rest of the command ran; a clean shutdown here exits with status 0
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return Server
