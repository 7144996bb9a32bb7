"""Issue 15's serving table from bench_serve.py JSON files, with its targets checked.

    python benchmarks/serve_table.py serve_8b_Q4_0.json serve_8b_Q4_K_M.json ... [--markdown OUT.md]

Each file is one `bench_serve.py --json` run with `--single` (edgellm's own decode loop, as
`edgellm run`) and `--llama-batched-bench` (llama.cpp's batched decoding of the same file in the
same run). Per file: one stream through the server against the own loop, and at 16 and 32
streams the steady rate (every stream decoding, as llama-batched-bench's S_TG) against the own loop
and against llama.cpp's S_TG. The targets: at 16 streams at least 6x the single stream and 1.5x
llama.cpp; one stream through the server within 10% of the own loop.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGET_VS_SINGLE = 6.0
TARGET_VS_LLAMA = 1.5
TARGET_ONE_STREAM = 0.9


def summarise(run: dict) -> dict:
    """The table's numbers of one bench_serve run (None where the run lacks them)."""
    rows = {int(r["clients"]): r for r in run.get("rows", [])}
    own = (run.get("single") or {}).get("decode_tps")
    llama = {int(k): v for k, v in (run.get("llama_batched_bench") or {}).items()}
    out = {"own_loop": own, "one_stream": rows[1]["decode_tps"] if 1 in rows else None}
    out["one_vs_own"] = out["one_stream"] / own if own and out["one_stream"] else None
    for n in (16, 32):
        steady = rows[n].get("steady_tps") if n in rows else None
        s_tg = llama[n]["speed_tg"] if n in llama else None
        out[f"steady_{n}"] = steady
        out[f"llama_{n}"] = s_tg
        out[f"vs_llama_{n}"] = steady / s_tg if steady and s_tg else None
        out[f"vs_own_{n}"] = steady / own if steady and own else None
    out["ok"] = all(r.get("ok") == r.get("requests", r.get("ok")) and not r.get("errors") for r in rows.values())
    return out


def targets_met(s: dict) -> dict[str, bool | None]:
    def at_least(v, t):
        return None if v is None else v >= t
    return {"16 streams >= 6x one": at_least(s["vs_own_16"], TARGET_VS_SINGLE),
            "16 streams >= 1.5x llama.cpp": at_least(s["vs_llama_16"], TARGET_VS_LLAMA),
            "one stream within 10%": at_least(s["one_vs_own"], TARGET_ONE_STREAM)}


def _f(v, fmt: str = ",.1f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{fmt}}{suffix}"


def table(named: list[tuple[str, dict]]) -> str:
    lines = ["| file | one stream: server / own loop | N=16 steady | vs own loop | llama.cpp S_TG | vs llama.cpp "
             "| N=32 steady | llama.cpp S_TG | vs llama.cpp | targets (issue 15) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, s in named:
        met = targets_met(s)
        verdict = "all met" if all(met.values()) else "; ".join(
            f"{k}: {'unmeasured' if v is None else 'no'}" for k, v in met.items() if not v)
        if not s["ok"]:
            verdict += " (requests failed)"
        lines.append(
            f"| {name} | {_f(s['one_stream'])} / {_f(s['own_loop'])} ({_f(s['one_vs_own'], '.2f', '×')}) "
            f"| {_f(s['steady_16'])} | {_f(s['vs_own_16'], '.2f', '×')} | {_f(s['llama_16'])} "
            f"| {_f(s['vs_llama_16'], '.2f', '×')} | {_f(s['steady_32'])} | {_f(s['llama_32'])} "
            f"| {_f(s['vs_llama_32'], '.2f', '×')} | {verdict} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="bench_serve.py --json files")
    p.add_argument("--markdown", default=None, help="also write the table here")
    args = p.parse_args(argv)
    named = []
    for f in args.json:
        try:
            run = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"serve_table: {f}: not a bench_serve JSON file ({e})")
        if not isinstance(run, dict) or "rows" not in run:
            sys.exit(f"serve_table: {f}: not a bench_serve JSON file (no 'rows')")
        named.append((Path(f).stem.removeprefix("serve_"), summarise(run)))
    text = table(named)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
