"""`edgellm chat`: a multi-turn chat in the terminal.

The conversation lives in the model's chat template; each answer streams as it is sampled and is
followed by a dim line with its speed. The KV cache keeps the conversation (Model.chat reuses the
common prefix), so a turn prefills only its new message. Commands: /reset, /system TEXT, /exit;
Ctrl-C stops the current answer (what was said so far stays in the history), Ctrl-D leaves.
"""

from __future__ import annotations

import argparse
import signal
import sys

from .errors import EdgeLLMError

HELP = "/reset  forget the conversation | /system TEXT  set the system message (empty: none) | /exit  leave"


def add_chat_parser(sub, help: str | None = None) -> None:
    c = sub.add_parser("chat", help=help,
                       description="An interactive multi-turn chat through the model's chat template. " + HELP +
                                   ". Ctrl-C stops the current answer; Ctrl-D or /exit leaves.")
    c.add_argument("-m", "--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    c.add_argument("--backend", default="auto", help="cpu, cuda, or auto (default)")
    c.add_argument("-c", "--ctx", type=int, default=None, help="context size in tokens (default: min(model, 4096))")
    c.add_argument("-n", "--max-tokens", type=int, default=1024, help="tokens per answer at most (default 1024)")
    c.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 = greedy (default 0.8)")
    c.add_argument("--top-k", type=int, default=40, help="0 disables (default 40)")
    c.add_argument("--top-p", type=float, default=0.95, help="1.0 disables (default 0.95)")
    c.add_argument("--min-p", type=float, default=0.05, help="0 disables (default 0.05)")
    c.add_argument("--repeat-penalty", type=float, default=1.0, help="1.0 disables (default 1.0)")
    c.add_argument("--frequency-penalty", type=float, default=0.0, help="per repeat in the last 64 (default 0)")
    c.add_argument("--presence-penalty", type=float, default=0.0, help="once per token in the last 64 (default 0)")
    c.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    c.add_argument("--system", default=None, help="the system message to start with")
    c.set_defaults(func=_cmd_chat)


def _cmd_chat(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.text import Text

    from .backends.cuda.early import start_for

    start_for(args.backend)  # the GPU's context made while torch imports
    from .model import load
    from .sampling import SamplingParams

    # every argument checked before the model loads
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    repetition_penalty=args.repeat_penalty, seed=args.seed,
                    frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty)
    SamplingParams(**sampling)
    if args.max_tokens < 1:
        raise EdgeLLMError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.ctx is not None and args.ctx <= 0:
        raise EdgeLLMError(f"--ctx must be a positive number of tokens, got {args.ctx}")
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    # Ctrl-C stops an answer even where the chat was started with SIGINT ignored (a process
    # launched in the background by a non-interactive shell inherits that, and Python then keeps it)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    console = Console(highlight=False)
    m = load(args.model, backend=args.backend, ctx=args.ctx)
    if m.tokenizer is None or m.tokenizer.chat_template is None:
        raise EdgeLLMError(f"{m.path} has no chat template; use edgellm run --raw")
    console.print(Text(f"{m.backend.describe()}; load {m.load_s:.2f} s. {HELP}", style="dim"))
    system = args.system
    history: list[dict] = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit to leave)")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = []
            console.print(Text("(conversation forgotten)", style="dim"))
            continue
        if text == "/system" or text.startswith("/system "):
            system = text[len("/system"):].strip() or None
            history = []
            console.print(Text(f"(system message {'set' if system else 'cleared'}; conversation restarted)", style="dim"))
            continue
        if text.startswith("/"):
            console.print(Text(f"unknown command {text.split()[0]}; {HELP}", style="dim"))
            continue
        messages = ([{"role": "system", "content": system}] if system else []) + history + \
                   [{"role": "user", "content": line}]
        pieces: list[str] = []
        stopped = False
        try:
            for piece in m.chat(messages, max_tokens=args.max_tokens, **sampling):
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            stopped = True
        except EdgeLLMError as e:  # e.g. the conversation no longer fits in the context
            console.print(Text(f"\nedgellm: error: {e}", style="bold red"))
            continue
        print()
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": "".join(pieces)}]
        st = m.last_stats
        if stopped:
            st.stop_reason = "Ctrl-C"
        console.print(Text(f"[{st.summary()}]", style="dim"))
