"""The `edgellm` command: run a model, describe a model file."""

from __future__ import annotations

import argparse
import os
import sys

from . import arguments as A
from .errors import EdgeLLMError

DEFAULT_MAX_TOKENS = 256

# import name -> what to pip install, where the two differ (anything else: the import name)
PIP_NAMES = {"llama_cpp": "llama-cpp-python", "yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn",
             "torch": "torch (scripts/install.sh installs the pinned CPU build)"}


def _add_model_arg(p: argparse.ArgumentParser, positional: bool = False) -> None:
    if positional:
        p.add_argument("model", nargs="?", default=None,
                       help="a .gguf file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    else:
        p.add_argument("-m", "--model", default=None,
                       help="a .gguf file (default: the embedded SmolLM2-135M-Instruct Q4_1)")


def _cmd_run(args: argparse.Namespace) -> int:
    if getattr(args, "gpu_memory", None):  # a split model: the CPU's threads kept awake across the GPU's segments
        from .omp import keep_pool_awake

        keep_pool_awake()
    from .backends.cuda.early import start_for

    start_for(args.backend)  # the GPU's context made while torch imports
    from .model import load, require_vocabulary
    from .onnx.cli import is_onnx, run_onnx

    onnx_path = next((p for p in (args.model, args.prompt) if is_onnx(p)), None)
    if onnx_path is not None:  # a network file: `edgellm run model.onnx --input image.jpg`
        return run_onnx(args, onnx_path)

    prompt = args.prompt
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            prompt = "Tell me a short story about a robot who learns to paint."
        else:
            prompt = sys.stdin.read()
    if not prompt.strip() and not args.allow_empty:
        raise EdgeLLMError("the prompt is empty (give the prompt as an argument or on stdin; "
                           "--allow-empty runs an empty prompt deliberately)")
    from .sampling import SamplingParams

    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    repetition_penalty=args.repeat_penalty, seed=args.seed,
                    frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty)
    params = SamplingParams(**sampling)
    chat = False if args.raw else None
    placed = None
    require_vocabulary(args.model)  # a text prompt needs one: said now, not after the load
    # a cuda model whose steps an earlier run recorded: replayed without torch (backends/cuda/replay.py)
    m = _replayed(args, prompt, chat, params) if args.backend in ("cuda", "auto") and not args.gpu_memory else None
    if m is None:
        if args.backend in ("cuda", "auto") and not args.gpu_memory:
            from .backends.cuda.precompile import start_pool_if_cold

            start_pool_if_cold()  # a first run here: the compile workers start while torch imports
        from .progress import slow_notice

        if args.backend != "webgpu":  # (webgpu's kernels run on the adapter: torch only where an op is delegated)
            import torch

            torch.set_num_threads(args.threads or A.physical_cores())  # the cpu backend's matrix code
        with slow_notice("loading the model (the first load on this device compiles kernels; later ones read "
                         "them from ~/.cache/edgellm)", after=1.5):
            if args.gpu_memory:  # placed over the GPU (within the budget) and the CPU by the solver
                from .hetero.plan import load_placed

                def note(text):
                    if not args.quiet:
                        print(text, file=sys.stderr)
                m, placed = load_placed(args.model, args.gpu_memory, ctx=args.ctx, log=note)
            else:
                m = load(args.model, backend=args.backend, ctx=args.ctx, sampling=params)  # its draw warmed too
        if args.backend == "webgpu" and "torch" in sys.modules:  # the load delegated ops to the cpu backend
            sys.modules["torch"].set_num_threads(args.threads or A.physical_cores())
    stream = m.generate(prompt, max_tokens=args.max_tokens, chat=chat, system=args.system, stop=args.stop or (),
                        **sampling)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        cached = f" (cached: {', '.join(m.cache_hits)})" if m.cache_hits else ""
        tuned = m.load_phases.get("tuning")
        if tuned:  # a first load on this device: kernel configurations timed, cached for the next
            cached += f" (of which tuning kernels {tuned:.2f} s, once)"
        print(f"[{m.backend.describe()}; load {m.load_s:.2f} s{cached}; {m.last_stats.summary()}]", file=sys.stderr)
    if placed is None and m.backend_name == "cuda" and "start-up image" not in m.cache_hits:
        _record_image(args, m, params)
    if placed is not None:  # the solver's prediction beside this run's time, kept for `edgellm plan`
        from .hetero.plan import compare_line, record_measured

        st = m.last_stats
        decode_s = 1 / st.decode_tps if st.decode_tps else None
        new_tokens = st.prompt_tokens - st.cached_tokens
        record_measured(placed, decode_s=decode_s, prompt_s=st.prefill_s or None, prompt_tokens=new_tokens)
        if not args.quiet:
            print(compare_line(placed, decode_s), file=sys.stderr)
    return 0


def _replayed(args: argparse.Namespace, prompt: str, chat, params):
    """The model from its start-up image when one holds every step this request runs, else None."""
    from .backends.cuda.replay import load_replay

    m = load_replay(args.model, ctx=args.ctx)
    if m is None:
        return None
    import time

    t0 = time.perf_counter()
    ids = m.prompt_tokens(prompt, chat=chat, system=args.system)
    if m.backend.prepare(len(ids), args.max_tokens, params, m.kv_chunk):  # its steps' graphs made
        m.load_phases["graphs"] = time.perf_counter() - t0
        m.load_s += m.load_phases["graphs"]
        return m
    m.backend.close()  # its device memory back before the full load
    return None


def _record_image(args: argparse.Namespace, m, params) -> None:
    """After a full cuda load: the steps this run needed saved as a start-up image, which the next
    run of the same model and settings replays without torch (EDGELLM_REPLAY=0: not written)."""
    from .backends.cuda import replay

    if not replay.enabled() or m.last_stats is None or m.program_cache is None:  # (EDGELLM_CACHE=0: nothing kept)
        return
    from .backends.cuda.replay_record import Unrecordable, record

    try:
        line = record(m, m.last_stats.prompt_tokens, args.max_tokens, params)
    except Unrecordable as e:
        line = f"no start-up image: {e}"
    except (EdgeLLMError, RuntimeError) as e:  # the driver or torch refused a step: the answer stands
        line = f"no start-up image: {type(e).__name__}: {e}"
    if not args.quiet:
        print(f"[{line}]", file=sys.stderr)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _family_lines(cfg) -> list[str]:
    """What the model's family changes about the llama block (edgellm.models), one line each."""
    lines = []
    slid = [w for w in cfg.layer_window if w]
    if slid:
        local = f", RoPE base {cfg.rope_theta_local:g} there" if cfg.rope_theta_local else ""
        lines.append(f"attention     sliding window {max(slid)} on {len(slid)} of {cfg.n_layers} layers{local}")
    if cfg.attn_scale is not None:
        lines.append(f"attn scale    {cfg.attn_scale:.6g}")
    parts = [name for flag, name in ((cfg.qk_norm, "per-head q/k RMSNorm"), (cfg.post_norms, "post-norms"),
                                     (cfg.fused_qkv, "fused q|k|v tensor"), (cfg.fused_gate_up, "fused gate|up tensor"))
             if flag]
    if parts:
        lines.append(f"block         {', '.join(parts)}")
    if cfg.mlp_act != "silu" or cfg.embed_scale != 1.0:
        lines.append(f"mlp           {cfg.mlp_act}-gated; embedding scale {cfg.embed_scale:g}")
    if cfg.logit_softcap:
        lines.append(f"logits        softcap {cfg.logit_softcap:g}")
    if cfg.rope_factors:
        lines.append(f"rope factors  {cfg.rope_factors}, attention factor {cfg.rope_mscale:g}")
    return lines


def _cmd_info(args: argparse.Namespace) -> int:
    from .default_model import default_model_path
    from .gguf_file import open_gguf
    from .models import config_from_gguf

    if args.adapters:  # the GPUs the webgpu backend can use, with their features; no model read
        from .backends.webgpu.device import describe_adapters

        print("\n".join(describe_adapters(verbose=True)))
        return 0
    path = args.model or str(default_model_path())
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    print(f"file          {path}")
    print(f"size          {_fmt_bytes(os.path.getsize(path))} (GGUF v{f.version}, {len(f.tensors)} tensors)")
    print(f"name          {cfg.name}")
    print(f"architecture  {cfg.arch}")
    print(f"layers        {cfg.n_layers}")
    print(f"d_model       {cfg.d_model}")
    print(f"heads         {cfg.n_heads} query / {cfg.n_kv_heads} kv, head_dim {cfg.head_dim}")
    print(f"ffn           {cfg.ffn_dim}")
    print(f"vocab         {cfg.vocab_size}")
    print(f"context       {cfg.context_length}")
    print(f"rope          theta {cfg.rope_theta:g}, dims {cfg.rope_dim}, style {cfg.rope_style}"
          + (f", linear scale {cfg.rope_pos_scale:g}" if cfg.rope_pos_scale != 1 else "")
          + (", per-frequency factors" if cfg.has_rope_freqs else ""))
    print(f"norm eps      {cfg.norm_eps:g}")
    for line in _family_lines(cfg):
        print(line)
    print(f"output        {'tied to token_embd' if cfg.tied_output else 'output.weight'}")
    by_type: dict[str, list[int]] = {}
    for t in f.tensors.values():
        c = by_type.setdefault(t.type_name, [0, 0, 0])
        c[0] += 1
        c[1] += t.n_elements
        c[2] += t.nbytes
    total_params = sum(c[1] for c in by_type.values())
    total_bytes = sum(c[2] for c in by_type.values())
    print(f"parameters    {total_params / 1e6:.1f} M, {_fmt_bytes(total_bytes)}, "
          f"{8 * total_bytes / max(total_params, 1):.2f} bits per weight")
    print("tensor types")
    for name, (n, params, nbytes) in sorted(by_type.items(), key=lambda kv: -kv[1][2]):
        print(f"  {name:<6} {n:>4} tensors  {params / 1e6:9.2f} M params  {_fmt_bytes(nbytes):>10}")
    kind = f.get("tokenizer.ggml.model", "(none)")
    print(f"tokenizer     {kind}" + (f", pre-tokenizer {f.get('tokenizer.ggml.pre')}" if "tokenizer.ggml.pre" in f.metadata else ""))
    if kind not in ("none", "(none)"):
        from .tokenizer import Tokenizer

        tok = Tokenizer.from_metadata(f.metadata, source=os.path.basename(path))
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else None
        print(f"  vocab {tok.vocab_size}, bos {tok.bos_id} {bos!r}, eos {tok.eos_id} {eos!r}, add_bos {tok.add_bos}")
        print(f"  stop tokens {sorted(tok.stop_ids)}")
    tmpl = f.get("tokenizer.chat_template", None)
    from .chat_builtin import BUILTIN_TEMPLATES

    builtin = f"built-in {f.architecture} format (the file has none)" if f.architecture in BUILTIN_TEMPLATES else "none"
    print(f"chat template {'yes (' + str(len(tmpl)) + ' chars)' if tmpl else builtin}")
    if args.tensors:
        print("tensors")
        for t in f.tensors.values():
            print(f"  {t.name:<32} {t.type_name:<6} {str(t.shape):<16} {_fmt_bytes(t.nbytes):>10}")
    from .backends.webgpu.device import describe_adapters

    print("\n".join(describe_adapters()))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from .compiler.report import plan_model, render_plan
    from .default_model import default_model_path
    from .onnx.cli import is_onnx, plan_onnx

    if is_onnx(args.model):
        return plan_onnx(args, args.model)
    path = args.model or str(default_model_path())
    from .hetero.plan import run_plan_args

    placed = run_plan_args(args, path)
    if placed is not None:
        print(placed, end="")
        return 0
    p = plan_model(path, backend=args.backend, ctx=args.ctx, prefill=args.prefill, fuse=not args.no_fuse)
    print(json.dumps(p, indent=2) if args.json else render_plan(p), end="" if not args.json else "\n")
    return 0


def _add_run_parser(sub, help: str) -> None:
    r = sub.add_parser("run", help=help,
                       description="Generate text from a prompt. With no model, the embedded SmolLM2-135M-Instruct runs; "
                                   "models with a chat template get it applied unless --raw.")
    r.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read stdin, or a demo prompt)")
    _add_model_arg(r)
    r.add_argument("--backend", default="auto", type=A.backend_name,
                   help="cpu-fast (weights packed, bf16 products), cpu (float32 reference), cuda, webgpu, or "
                        "auto (default: cuda when a GPU is usable, else webgpu on a GPU adapter, else cpu-fast)")
    r.add_argument("--gpu-memory", type=A.byte_size, default=None,
                   help="run a model larger than the GPU: at most this much GPU memory (e.g. 6GiB); the layers "
                        "past it run on the CPU, their prefill products streamed to the GPU (edgellm plan "
                        "--gpu-memory shows the placement)")
    r.add_argument("-n", "--max-tokens", type=A.at_least(0), default=DEFAULT_MAX_TOKENS,
                   help="tokens to generate at most")
    r.add_argument("-c", "--ctx", type=A.positive(int), default=None,
                   help="context size in tokens (default: min(model, 4096))")
    r.add_argument("-t", "--threads", type=A.positive(int), default=None,
                   help="CPU threads (default: the physical cores, here %d)" % A.physical_cores())
    r.add_argument("--temperature", "--temp", type=A.at_least(0.0, float), default=0.8, help="0 = greedy (default 0.8)")
    r.add_argument("--top-k", type=A.at_least(0), default=40, help="0 disables (default 40)")
    r.add_argument("--top-p", type=A.between(0.0, 1.0), default=0.95, help="1.0 disables (default 0.95)")
    r.add_argument("--min-p", type=A.between(0.0, 1.0), default=0.05, help="0 disables (default 0.05)")
    r.add_argument("--repeat-penalty", type=A.positive(float), default=1.0, help="1.0 disables (default 1.0)")
    r.add_argument("--frequency-penalty", type=A.between(-2.0, 2.0), default=0.0,
                   help="subtracted per repeat of a token in the last 64 (default 0)")
    r.add_argument("--presence-penalty", type=A.between(-2.0, 2.0), default=0.0,
                   help="subtracted once from a token in the last 64 (default 0)")
    r.add_argument("--seed", type=A.at_least(0), default=None, help="random seed for sampling")
    r.add_argument("--stop", action="append", type=A.unescape,
                   help=r"stop when this text appears (repeatable; escapes as llama-cli: \n \t \\ \xHH \uXXXX ...)")
    r.add_argument("--system", default=None, type=A.unescape, help="system message for chat models (escapes as --stop)")
    r.add_argument("--allow-empty", action="store_true", help="run an empty prompt instead of refusing it")
    r.add_argument("--raw", action="store_true", help="do not apply the chat template")
    r.add_argument("-q", "--quiet", action="store_true", help="do not print timings to stderr")
    from .onnx.cli import add_onnx_run_args

    add_onnx_run_args(r)
    r.set_defaults(func=_cmd_run)


def _add_info_parser(sub, help: str) -> None:
    i = sub.add_parser("info", help=help, description="Print architecture, hyperparameters, "
                       "tensor types and sizes, tokenizer and template facts of a GGUF file.")
    _add_model_arg(i, positional=True)
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.add_argument("--adapters", action="store_true", help="list the webgpu backend's adapters and their features")
    i.set_defaults(func=_cmd_info)


def _add_plan_parser(sub, help: str) -> None:
    pl = sub.add_parser("plan", help=help,
                        description="Compile a model without loading its weights: op counts before/after each "
                                    "pass, kernels per stage, delegated subgraphs, intermediate memory per planner, "
                                    "weight bytes per format, KV-cache bytes and the estimated peak memory.")
    _add_model_arg(pl, positional=True)
    pl.add_argument("--backend", default="auto", type=A.backend_name,
                    help="backend to plan for (default auto: what `run` uses)")
    pl.add_argument("-c", "--ctx", type=A.positive(int), default=None, help="context size (default: min(model, 4096))")
    pl.add_argument("--prefill", type=A.positive(int), default=512, help="prefill chunk in tokens (default 512)")
    pl.add_argument("--no-fuse", action="store_true", help="plan without the fusion passes")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument("--size", default=None, help="ONNX models: sizes of the dynamic dimensions, e.g. "
                    "batch=1,height=224,width=224 (default: batch 1, others 224)")
    from .hetero.plan import add_plan_args

    add_plan_args(pl)
    pl.set_defaults(func=_cmd_plan)


# Every subcommand: (name, module or None for this one, the function adding its parser, one-line help). A
# subcommand's module is imported and its options added only when that subcommand runs (or asks for its help),
# so that `edgellm run` does not pay for the imports of quantize, bench or serve.
COMMANDS = (
    ("run", None, "_add_run_parser", "generate text from a prompt (streams to stdout)"),
    ("info", None, "_add_info_parser", "describe a model file"),
    ("plan", None, "_add_plan_parser", "show the compiled program and the memory a run needs (reads no weights)"),
    ("quantize", ".quantize_model", "add_quantize_parser",
     "write a model's weights in another format (GGUF or HF safetensors -> GGUF)"),
    ("bench", ".bench.cli", "add_bench_parser",
     "benchmark engines, quantizations and backends (tokens/s, MBU, perplexity)"),
    ("cache", ".cache_cli", "add_cache_parser",
     "show or clear the persistent cache (compiled programs, kernels, tuning)"),
    ("warmup", ".cache_cli", "add_warmup_parser", "compile every kernel and program a model needs, ahead of time"),
    ("serve", ".serve.cli", "add_serve_parser", "serve a model over an OpenAI-compatible HTTP API"),
    ("chat", ".chat_cli", "add_chat_parser", "chat with a model in the terminal (multi-turn)"),
)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command's parser. With argv, only the subcommand it names gets its options (and imports its
    module); the others are listed by name and help. Without argv, every subcommand in full."""
    import importlib

    from . import __version__

    p = A.ArgumentParser(prog="edgellm", description="Run large language models fast, from GGUF files.")
    p.add_argument("--version", action="version", version=f"edgellm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    # the subcommand is the first word that is not an option (the top level has no option taking a value)
    chosen = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    for name, module, adder, help in COMMANDS:
        if argv is None or name == chosen:
            owner = importlib.import_module(module, __package__) if module else sys.modules[__name__]
            getattr(owner, adder)(sub, help=help)
        else:
            sub.add_parser(name, help=help, add_help=False)  # parsed only when chosen, then built in full
    return p


def missing_module_message(e: ImportError) -> str:
    """One line for an ImportError: the module that is missing and what to install."""
    name = (e.name or "").split(".")[0]
    if isinstance(e, ModuleNotFoundError) and name and name != "edgellm":
        return f"this needs the Python module '{name}', which is not installed: pip install {PIP_NAMES.get(name, name)}"
    what = f" ({name})" if name else ""
    return f"a module does not import{what}: {e}; reinstall it (pip install --force-reinstall {PIP_NAMES.get(name, name or '...')})"


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed subcommand: user errors become one line on stderr and exit status 1."""
    try:
        return args.func(args)
    except EdgeLLMError as e:
        print(f"edgellm: error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:  # an optional (or broken) dependency: say what to install, not a traceback
        print(f"edgellm: error: {missing_module_message(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nedgellm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        parser = build_parser(argv)  # the chosen subcommand may import its dependencies here
    except ImportError as e:
        print(f"edgellm: error: {missing_module_message(e)}", file=sys.stderr)
        return 1
    return run_command(parser.parse_args(argv))


def exit_now(status: int) -> None:
    """End the process as soon as its work is done: wait for threads that are not daemons (as the
    interpreter does), run the atexit callbacks, flush the output, then leave without the
    interpreter's teardown. Tearing down a process that imported torch took 0.2-0.6 s on the CPU
    machine (its modules and libraries freed one by one); nothing of that is the user's. Only for the
    process's own entry point: main() stays an ordinary function for callers in the same process."""
    import atexit
    import threading

    # what the interpreter does first at exit: the threading module's own exit hooks (idle
    # ThreadPoolExecutor workers are told to stop there; joining them without it waits forever),
    # then every thread that is not a daemon joined
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    else:
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon:
                t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`edgellm run ... | head -1`) or stream
            pass
    os._exit(status)


def entry() -> None:
    """The `edgellm` executable and `python -m edgellm`."""
    exit_now(main())


if __name__ == "__main__":
    entry()
