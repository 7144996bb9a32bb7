"""`edgellm plan`: the compiled program of a model, from its file's header alone.

Nothing here reads weight data: the GGUF header gives shapes and formats, the graph and the
passes give the kernels, the memory planners give intermediate bytes, and the backend says how
it stores weights and the KV cache. A user learns whether a model fits before trying.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..backends import get_backend_info
from ..gguf_file import open_gguf
from ..models import build_graph, config_from_gguf
from .compile import CompiledGraph, compile_graph, graph_flops


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclass
class StagePlan:
    name: str
    seq: int
    compiled: CompiledGraph

    def to_dict(self) -> dict:
        c = self.compiled
        return {
            "stage": self.name,
            "seq": self.seq,
            "ops_builder": c.original_ops,
            "ops_compiled": len(c.graph.ops),
            "passes": [{"pass": r.name, "ops_before": r.ops_before, "ops_after": r.ops_after} for r in c.pass_reports],
            "kernels": c.kernel_counts(),
            "segments": [{"backend": s.backend, "ops": len(s.ops), "transfers_in": len(s.inputs_in)}
                         for s in c.segments],
            "transfers": c.transfers,
            "intermediate_bytes": {k: p.total_bytes for k, p in c.plans.items()},
            "chosen_plan": c.plan.strategy,
            "lower_bound_bytes": c.lower_bound,
        }


def plan_model(path: str, *, backend: str = "cpu", ctx: int | None = None, prefill: int = 512,
               fuse: bool = True) -> dict:
    """Everything `edgellm plan` shows, as a dict (the --json output)."""
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    ctx = ctx or min(cfg.context_length, 4096)
    prefill = min(prefill, ctx)
    backend_cls = get_backend_info(backend)
    supported = getattr(backend_cls, "SUPPORTED_OPS", None)
    skip = frozenset(getattr(backend_cls, "SKIP_PASSES", ()))
    graphs = {s: build_graph(cfg, f, s, kv_chunk=prefill) for s in ("all", "last")}  # as Model builds them
    stages = [
        StagePlan("prefill", prefill, compile_graph(graphs["last"], supported_ops=supported, backend=backend_cls.name,
                                                    seq=prefill, ctx=ctx, fuse=fuse, skip_passes=skip)),
        StagePlan("decode", 1, compile_graph(graphs["last"], supported_ops=supported, backend=backend_cls.name,
                                             seq=1, ctx=ctx, fuse=fuse, skip_passes=skip)),
    ]
    by_format: dict[str, list[int]] = {}
    for t in f.tensors.values():
        row = by_format.setdefault(t.type_name, [0, 0, 0])
        row[0] += 1
        row[1] += t.n_elements
        row[2] += t.nbytes
    file_weight_bytes = sum(r[2] for r in by_format.values())
    resident = backend_cls.resident_weight_bytes(f)
    kv = backend_cls.kv_cache_bytes(cfg, ctx, prefill)  # sliding-window layers: rings (ModelConfig.kv_rows)
    kv_full = backend_cls.kv_cache_bytes(cfg, ctx)  # every layer at the whole context
    arena = max(s.compiled.plan.total_bytes for s in stages)
    outputs = backend_cls.output_bytes(cfg, prefill)
    overhead = backend_cls.runtime_overhead_bytes(f, cfg)
    peak = resident + kv + arena + outputs + overhead
    fl_prefill = graph_flops(graphs["last"], prefill, prefill)
    fl_decode = graph_flops(graphs["last"], 1, ctx // 2)
    return {
        "model": {"path": str(path), "name": cfg.name, "arch": cfg.arch, "file_bytes": os.path.getsize(path),
                  "layers": cfg.n_layers, "d_model": cfg.d_model, "vocab": cfg.vocab_size},
        "backend": backend_cls.name,
        "ctx": ctx,
        "prefill": prefill,
        "stages": [s.to_dict() for s in stages],
        "weights_by_format": {k: {"tensors": v[0], "params": v[1], "bytes": v[2]} for k, v in
                              sorted(by_format.items(), key=lambda kv: -kv[1][2])},
        "weight_bytes_file": file_weight_bytes,
        "weight_bytes_resident": resident,
        "kv_cache_bytes": kv,
        "kv_cache_bytes_full_context": kv_full,
        "kv_rings": [{"window": w, "rows": r, "layers": sum(1 for i in range(cfg.n_layers)
                                                            if cfg.kv_rows(i, ctx, prefill) == r and cfg.window(i) == w)}
                     for w, r in cfg.kv_rings(ctx, prefill)],
        "arena_bytes": arena,
        "output_bytes": outputs,
        "runtime_overhead_bytes": overhead,
        "estimated_peak_bytes": peak,
        "flops_prefill_per_token": fl_prefill / prefill,
        "flops_decode_per_token_at_half_ctx": fl_decode,
    }


def render_plan(p: dict) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    buf = StringIO()
    # soft_wrap: no line is wrapped by rich, table titles included (a title wider than its table
    # was broken over lines); a terminal wraps long lines itself
    con = Console(file=buf, width=110, force_terminal=False, color_system=None, soft_wrap=True)
    m = p["model"]
    con.print(f"[bold]{m['name']}[/bold] ({m['arch']}, {m['layers']} layers, d {m['d_model']}, vocab {m['vocab']}), "
              f"file {_fmt(m['file_bytes'])}")
    con.print(f"backend {p['backend']}, context {p['ctx']} tokens, prefill chunk {p['prefill']} tokens")

    t = Table(title="passes (prefill graph): ops before → after")
    t.add_column("pass")
    t.add_column("before", justify="right")
    t.add_column("after", justify="right")
    for r in p["stages"][0]["passes"]:
        t.add_row(r["pass"], str(r["ops_before"]), str(r["ops_after"]))
    con.print(t)

    t = Table(title="kernels per stage")
    t.add_column("op")
    for s in p["stages"]:
        t.add_column(f"{s['stage']} (seq {s['seq']})", justify="right")
    kinds = sorted({k for s in p["stages"] for k in s["kernels"]})
    for k in kinds:
        t.add_row(k, *[str(s["kernels"].get(k, 0)) for s in p["stages"]])
    t.add_row("total", *[str(s["ops_compiled"]) for s in p["stages"]])
    con.print(t)

    t = Table(title="delegation: subgraphs per stage")
    t.add_column("stage")
    t.add_column("subgraphs")
    t.add_column("transfers at cuts", justify="right")
    for s in p["stages"]:
        segs = ", ".join(f"{g['backend']}:{g['ops']}" for g in s["segments"])
        t.add_row(s["stage"], segs, str(s["transfers"]))
    con.print(t)

    t = Table(title="intermediate memory per planner")
    t.add_column("stage")
    for name in ("naive", "greedy_shared", "greedy_by_size", "min_cost_flow"):
        t.add_column(name, justify="right")
    t.add_column("lower bound", justify="right")
    t.add_column("chosen")
    for s in p["stages"]:
        ib = s["intermediate_bytes"]
        t.add_row(s["stage"], *[_fmt(ib[k]) if k in ib else "-" for k in
                                ("naive", "greedy_shared", "greedy_by_size", "min_cost_flow")],
                  _fmt(s["lower_bound_bytes"]), s["chosen_plan"])
    con.print(t)

    t = Table(title="weights by stored format")
    t.add_column("format")
    t.add_column("tensors", justify="right")
    t.add_column("params", justify="right")
    t.add_column("bytes", justify="right")
    t.add_column("bits/weight", justify="right")
    for k, v in p["weights_by_format"].items():
        t.add_row(k, str(v["tensors"]), f"{v['params'] / 1e6:.2f} M", _fmt(v["bytes"]),
                  f"{8 * v['bytes'] / max(v['params'], 1):.2f}")
    con.print(t)

    t = Table(title=f"estimated peak memory of a {p['backend']} run")
    t.add_column("part")
    t.add_column("bytes", justify="right")
    for label, key in (("weights as the backend holds them", "weight_bytes_resident"),
                       ("KV cache", "kv_cache_bytes"), ("intermediates (one arena)", "arena_bytes"),
                       ("logits outputs", "output_bytes"), ("runtime (file map, tokenizer, graphs)",
                                                            "runtime_overhead_bytes")):
        t.add_row(label, _fmt(p[key]))
    t.add_row("[bold]total[/bold]", f"[bold]{_fmt(p['estimated_peak_bytes'])}[/bold]")
    con.print(t)
    if p.get("kv_rings"):
        rings = ", ".join(f"{r['layers']} layers with window {r['window']}: {r['rows']} rows" for r in p["kv_rings"])
        saved = p["kv_cache_bytes_full_context"] - p["kv_cache_bytes"]
        con.print(f"KV cache: sliding-window layers keep ring caches ({rings}) instead of {p['ctx']} rows: "
                  f"{_fmt(p['kv_cache_bytes'])} instead of {_fmt(p['kv_cache_bytes_full_context'])} "
                  f"({_fmt(saved)} saved)")
    con.print(f"arithmetic: {p['flops_prefill_per_token'] / 1e9:.3f} GFLOP per prefill token, "
              f"{p['flops_decode_per_token_at_half_ctx'] / 1e9:.3f} GFLOP per decode token at half context")
    return buf.getvalue()
