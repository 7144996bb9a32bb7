"""`edgellm bench`: the benchmark sweep from the command line.

Wired into the main CLI with add_bench_parser(subparsers); runs standalone as
`python -m edgellm.bench ...` (same options)."""

from __future__ import annotations

import argparse
import sys


DESCRIPTION = """\
Benchmark engines on GGUF models (the ELIB method): for every model x quantization x engine x
backend, time to load (TTLM), prefill tokens/s and TTFT (pp tests), decode tokens/s and TPOT
(tg tests), achieved FLOP/s, memory bandwidth utilisation (MBU), perplexity and peak memory.
Every repetition of every configuration runs in its own process with a timeout; configurations
run round-robin; failures (timeout, out of memory, crash) are recorded and the sweep goes on.
Lists are comma-separated (or repeat the option)."""

EPILOG = """\
examples:
  edgellm bench -p 128 -n 32 -r 3                       the default model, edgellm on the cpu
  edgellm bench model.gguf --quant q4_0,q8_0 --engine edgellm,llama.cpp -o results/
  edgellm bench --backend cpu,cuda --engine edgellm,transformers --ppl wiki.test.raw
"""


def _split(values: list[str] | None, default: list[str]) -> list[str]:
    if not values:
        return list(default)
    return [x.strip() for v in values for x in v.split(",") if x.strip()]


def _number(value: str | None, what: str, kind=float):
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        from .plan import BenchArgumentError

        raise BenchArgumentError(f"{what}: '{value}' is not a number") from None


def add_bench_parser(subparsers, help: str | None = None) -> argparse.ArgumentParser:
    b = subparsers.add_parser("bench", help=help,
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(b)
    b.set_defaults(func=cmd_bench)
    return b


def _add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("models", nargs="*", metavar="MODEL",
                   help="GGUF files (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    b.add_argument("--quant", action="append", metavar="TYPES",
                   help="quantizations to produce from each model and measure, e.g. q4_0,q8_0 "
                        "('source' = the file as given; default: source)")
    b.add_argument("--backend", action="append", metavar="NAMES", help="cpu, cuda, webgpu (default: cpu)")
    b.add_argument("--engine", action="append", metavar="NAMES",
                   help="edgellm, llama.cpp, transformers, or package.module:Class (default: edgellm)")
    b.add_argument("-p", "--n-prompt", action="append", metavar="N", help="prompt lengths of the prefill tests (default: 512)")
    b.add_argument("-n", "--n-gen", action="append", metavar="N", help="tokens of the decode tests (default: 128)")
    b.add_argument("-r", "--repetitions", default="5", metavar="N", help="repetitions of each test (default: 5)")
    b.add_argument("--ppl", metavar="FILE", default=None,
                   help="UTF-8 text for perplexity (default: a text shipped with edgellm)")
    b.add_argument("--no-ppl", action="store_true", help="skip perplexity")
    b.add_argument("--ppl-ctx", metavar="N", default=None,
                   help="perplexity chunk size in tokens (default: 512, or less for a short text)")
    b.add_argument("--ppl-chunks", metavar="N", default=None, help="score at most N chunks (default: all)")
    b.add_argument("-o", "--output", metavar="DIR", default=None,
                   help="write results.json, results.csv, report.md, plots and logs there")
    b.add_argument("--timeout", metavar="S", default="1800",
                   help="wall-clock limit of each process (one repetition of one configuration; default 1800)")
    b.add_argument("--peak-bw", metavar="GB/s", default=None,
                   help="peak memory bandwidth for MBU (default: measured with a copy, cached per device)")
    b.add_argument("--quant-cache", metavar="DIR", default=None,
                   help="where quantized files are kept (default: DIR/quant with -o, else ~/.cache/edgellm/quant)")
    b.add_argument("--quant-policy", metavar="P", default=None,
                   help="which tensors get which type when quantizing: uniform, mixed-8-4-4, llama.cpp "
                        "(default: the quantizer's, uniform)")
    b.add_argument("-t", "--threads", metavar="N", default=None, help="CPU threads for every engine (default: theirs)")
    b.add_argument("--no-warmup", action="store_true", help="skip the warm-up in each process (each prompt length twice, a short decode)")
    b.add_argument("--no-progress", action="store_true", help="no live progress display")


def plan_from_args(args: argparse.Namespace):
    from .plan import BenchPlan

    return BenchPlan(
        models=list(args.models or []),
        quants=_split(args.quant, ["source"]),
        backends=_split(args.backend, ["cpu"]),
        engines=_split(args.engine, ["edgellm"]),
        prompt_lengths=_split(args.n_prompt, ["512"]),
        gen_lengths=_split(args.n_gen, ["128"]),
        repetitions=args.repetitions,
        ppl=not args.no_ppl,
        ppl_file=args.ppl,
        ppl_ctx=args.ppl_ctx,
        ppl_chunks=args.ppl_chunks,
        out_dir=args.output,
        timeout_s=_number(args.timeout, "--timeout"),
        peak_bw_gbps=_number(args.peak_bw, "--peak-bw"),
        quant_cache=args.quant_cache,
        quant_policy=args.quant_policy,
        threads=args.threads,
        warmup=not args.no_warmup,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from .plan import validate
    from .report import terminal_summary
    from .runner import run_bench

    models = list(args.models or [])
    if models and all(m.lower().endswith(".onnx") for m in models):  # networks: latency at batch 1 and 8
        from ..onnx.cli import bench_onnx

        return bench_onnx(args, models)
    plan = validate(plan_from_args(args))  # every error before anything runs
    argv = getattr(args, "_argv", None)
    if argv is None and "bench" in sys.argv:  # called through the main `edgellm` command
        argv = sys.argv[sys.argv.index("bench") + 1:]
    results = run_bench(plan, progress=not args.no_progress, argv=argv)
    print(terminal_summary(results))
    if plan.out_dir:
        print(f"\nresults in {plan.out_dir}: {', '.join(results.get('files', []))}")
    else:
        print("\n(-o DIR writes results.json, results.csv, report.md and plots)")
    if results.get("interrupted"):
        print("the sweep was interrupted: the configurations that had not finished are marked 'interrupted'")
        return 130
    if not any(c["tests"] for c in results["configurations"]):
        from .plan import BenchArgumentError

        raise BenchArgumentError(f"no configuration produced a result: {why_nothing_ran(results)}")
    return 0


def why_nothing_ran(results: dict) -> str:
    """The distinct reasons the configurations failed, each with the configurations it hit, in one line."""
    reasons: dict[str, list[str]] = {}
    for c in results["configurations"]:
        reasons.setdefault(f"{c['status']}: {c.get('error') or 'no measurements'}", []).append(c["id"])
    return "; ".join(f"{ids[0]}{f' (and {len(ids) - 1} more)' if len(ids) > 1 else ''} {why}"
                     for why, ids in reasons.items()) or "no configurations"


def build_parser() -> argparse.ArgumentParser:
    from ..arguments import ArgumentParser

    p = ArgumentParser(prog="edgellm bench", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args._argv = argv
    from ..cli import run_command

    return run_command(args)
