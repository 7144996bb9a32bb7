"""`edgellm cache info|clear` and `edgellm warmup`: the persistent cache from the command line."""

from __future__ import annotations

import argparse

from . import arguments as A


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _cmd_cache(args: argparse.Namespace) -> int:
    from .cache import ProgramCache

    pc = ProgramCache()
    if args.action == "clear":
        freed = pc.clear()
        print(f"cleared {pc.root}: {_fmt(freed)} freed")
        return 0
    info = pc.info()
    print(f"cache     {info['root']}" + ("" if info["enabled"] else "  (off: EDGELLM_CACHE=0)"))
    print(f"bound     {_fmt(info['max_bytes'])} for compiled programs (EDGELLM_CACHE_MAX_BYTES)")
    what = {"programs": "compiled graphs, memory plans, tokenizers (one entry per model and setup)",
            "images": "of which cuda start-up images (edgellm run replays them without torch)",
            "tune": "tuned kernel configurations, per device",
            "triton": "compiled GPU kernels"}
    for part, v in info["parts"].items():
        print(f"{part:<9} {v['items']:>6} {'entries' if part in ('programs', 'images') else 'files':<8} "
              f"{_fmt(v['bytes']):>10}  {what[part]}")
    return 0


def _cmd_warmup(args: argparse.Namespace) -> int:
    from .backends.cuda.early import start_for

    start_for(args.backend)  # the GPU's context made while torch imports
    from .model import load
    from .progress import slow_notice

    with slow_notice("compiling kernels for this device (each is compiled once, then read from the cache)"):
        m = load(args.model, backend=args.backend, ctx=args.ctx, warmup=False)
        dt = m.warmup(full=True)
    print(f"warmed {m.backend.describe()} for {m.path} at context {m.ctx}: load {m.load_s:.2f} s, "
          f"every program shape {dt:.2f} s")
    return 0


def add_cache_parser(sub, help: str | None = None) -> None:
    c = sub.add_parser("cache", help=help,
                       description="The cache under ~/.cache/edgellm (EDGELLM_CACHE_DIR moves it) holds what a load "
                                   "computes, so that a second load of the same model skips it.")
    c.add_argument("action", choices=("info", "clear"), nargs="?", default="info")
    c.set_defaults(func=_cmd_cache)


def add_warmup_parser(sub, help: str | None = None) -> None:
    w = sub.add_parser("warmup", help=help,
                       description="Load a model and run every program shape once (each prefill size, each "
                                   "decode context bucket), so that later runs find all kernels in the cache.")
    w.add_argument("-m", "--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    w.add_argument("--backend", type=A.backend_name, default="auto", help="backend (default: auto)")
    w.add_argument("-c", "--ctx", type=A.positive(int), default=None, help="context size (default: min(model, 4096))")
    w.set_defaults(func=_cmd_warmup)
