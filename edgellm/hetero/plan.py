"""From a model and memory budgets to a placement with predicted times (`edgellm plan --gpu-memory`).

    problem = build_problem(f, cfg, graphs, ["cuda:0", "cpu"], {"cuda:0": 6 << 30}, profile, ctx=4096)
    best = solve(problem)   # edgellm.hetero.solver

Per unit and processor: decode time per token (the decode graph, attention at half the context)
and prefill time per prompt (the prefill graph at `prefill` tokens), each the measured time of the
op where the profile has it, else the processor's fitted cost model; memory = the unit's weights in
that processor's layout + its KV cache at the full context. Row splits of a layer between a GPU and
the CPU are offered with `splits=True`; the executor runs row splits between cpu-fast processors
(a split with the GPU's share held in its memory is predicted, not yet executed).

Streamed layers (`stream=True`, the default with a GPU and the CPU): a layer the GPU cannot hold
runs on the CPU ('rows cpu SHARE | cuda:N', stream.py) while the GPU multiplies the rest of each
product's rows from weights copied over the link as they are needed, and all of them for a
prefill chunk. Its decode time is the CPU's other ops plus the slower of its two shares (the CPU's
products slowed by the link's use of host memory, `Link.host_slowdown`; the GPU's bound by the
link); its prefill time the CPU's other ops plus, per product, the slower of the GPU's arithmetic
and the link's copy of weights and activations. It costs the GPU no memory per layer, but the
streaming slots (stream.N_SLOTS x SLOT_BYTES) once: the solver runs with and without streaming
(budget less the slots) and keeps the better placement.
"""

from __future__ import annotations

import os

from ..cache import file_fingerprint, write_text_atomic
from ..errors import EdgeLLMError
from .profile import Profile, cache_path, load_profile, op_cost_inputs, op_signature
from .solver import Option, PlacementError, Problem, Solution, check_budgets, parse_bytes, solve
from .units import graph_units

SPLIT_FRACTIONS = (0.25, 0.5, 0.75)


def _info(proc: str):
    from ..backends.info import CpuFastInfo, CudaInfo

    return CudaInfo if proc.startswith("cuda") else CpuFastInfo


PRODUCT_KINDS = ("linear", "linear_qkv", "linear_swiglu")


def unit_tables(f, graph, proc: str, profile: Profile, seq: int, kv_len: int, products: bool | None = None
                ) -> dict[str, float]:
    """Seconds per unit of one run of `graph` (seq tokens, attending to kv_len keys) on proc;
    products=True counts only the matrix products, False everything else."""
    base = proc.split(":")[0]
    model = ((profile.processors.get(f"{proc}@prefill") or profile.processors.get(f"{base}@prefill")) if seq > 1
             else None) or profile.processors.get(proc) or profile.processors.get(base)
    if model is None:
        raise EdgeLLMError(f"no profile for processor '{proc}': run `edgellm plan --profile` on the machine that has it")  # noqa: E501
    info = _info(proc)
    world = graph.meta.get("shard", [0, 1])[1]  # a tensor-parallel rank's graph: its all_reduces
    out = {}
    for u in graph_units(graph):
        t = 0.0
        for i in u.ops:
            if products is not None and (graph.ops[i].kind in PRODUCT_KINDS) != products:
                continue
            if graph.ops[i].kind in ("all_reduce", "all_gather"):  # what the whole tensor takes on the link
                t += profile.collective(world).cost(4 * graph.tensors[graph.ops[i].outputs[0]].numel(seq=seq, ctx=kv_len))
                continue
            sig = op_signature(graph, i, seq, kv_len)
            m = profile.measured.get(f"{proc}|{sig}") or profile.measured.get(f"{proc.split(':')[0]}|{sig}")
            if m is None:
                nbytes, nfl = op_cost_inputs(graph, i, f, info, seq, kv_len)
                m = model.predict(nbytes, nfl, 1)
            t += m
        out[u.name] = t
    return out


def unit_memory(f, graph, proc: str, ctx: int) -> dict[str, int]:
    info = _info(proc)
    kv_elem = 2 if proc.startswith("cuda") else 4
    out = {}
    for u in graph_units(graph):
        w = sum(info.tensor_bytes(f, n) for n in u.weights
                if not (u.name == "embed" and not proc.startswith("cuda")))  # cpu-fast reads embedding rows from the file
        kv = sum(ctx * int(graph.tensors[s].concrete_shape(ctx=1)[-1]) * kv_elem for s in u.states)
        out[u.name] = w + kv
    return out


def unit_products(f, graph) -> dict[str, list[tuple[int, int, int]]]:
    """Per unit, its matrix products as (bytes in the cuda layout, rows, row length)."""
    from ..backends.info import CudaInfo

    out: dict[str, list] = {}
    for u in graph_units(graph):
        for i in u.ops:
            op = graph.ops[i]
            if op.kind not in PRODUCT_KINDS:
                continue
            ws = [graph.tensors[t].source or t for t in op.inputs if graph.tensors[t].kind == "weight"
                  and len(f.shape_of(graph.tensors[t].source or t)[1]) == 2]
            rows = sum(f.shape_of(w)[1][0] for w in ws)
            out.setdefault(u.name, []).append((sum(CudaInfo.tensor_bytes(f, w) for w in ws), rows,
                                               f.shape_of(ws[0])[1][1]))
    return out


def gpu_workspace(f, cfg, prefill_graph, *, ctx: int, prefill: int, stream: bool) -> int:
    """GPU bytes beside weights and caches: the cuda backend's activation arena for a prefill chunk
    and, with streaming, a streamed product's prefill activations (stream_activation_bytes)."""
    arena = activation_arena(f, cfg, ctx=ctx, prefill=prefill)
    return arena + (stream_activation_bytes(f, prefill_graph, prefill) if stream else 0)


def activation_arena(f, cfg, *, ctx: int, prefill: int) -> int:
    """The cuda backend's activation arena for a prefill chunk: the whole model's memory plan, an
    upper bound for any run of its layers."""
    from ..backends.info import CudaInfo
    from ..compiler.compile import compile_graph
    from ..models import build_graph

    return int(compile_graph(build_graph(cfg, f, "last"), supported_ops=CudaInfo.SUPPORTED_OPS, backend="cuda",
                             seq=prefill, ctx=ctx, fuse=False, planner="greedy_by_size").plan.total_bytes)


def stream_activation_bytes(f, prefill_graph, prefill: int) -> int:
    """A streamed product's prefill activations on the GPU: x in fp16 and one piece's fp16 output
    (each piece's output goes to the host as it comes), for the layers' largest products (the head
    multiplies only the last position of a prompt)."""
    from .stream import SLOT_BYTES

    prods = [p for u, ps in unit_products(f, prefill_graph).items() if u.startswith("blk.") for p in ps]
    cols = max((k for _, _, k in prods), default=0)
    piece = max((min(n, max(1, SLOT_BYTES * n // max(b, 1))) for b, n, _ in prods), default=0)
    return int(prefill * (2 * piece + 2 * cols))


def stream_reservation(f, graph) -> int:
    """GPU bytes the streaming slots take: N_SLOTS slots of SLOT_BYTES (less where every product
    is smaller), and the padding of a piece's parts."""
    from .stream import N_SLOTS, SLOT_BYTES

    sizes = [b for ps in unit_products(f, graph).values() for b, _, _ in ps]
    return N_SLOTS * (min(max(sizes, default=0), SLOT_BYTES) + 1024)


def stream_options(f, decode_graph, prefill_graph, g: str, profile: Profile, *, ctx: int, prefill: int,
                   gpu_pre_products: dict, mem_cpu: dict) -> dict[str, list[Option]]:
    """Per layer (and the head), the streamed row splits 'rows cpu SHARE | g' (see the module
    docstring). By default only SHARE 1.00: the CPU multiplies every row in decode and the GPU
    streams every row of a prefill chunk. Decode shares below 1 (the GPU multiplying part of each
    decode product from streamed rows at the same time as the CPU) are offered with
    EDGELLM_STREAM_DECODE=1: on the H100 machine (2026-11-27, 8B Q8_0 under 6 and 4 GiB caps, the
    CPU side on the native kernels) they ran decode at 24.6 / 14.2 tok/s against 45 / 24 predicted
    and 33.9 / 17.4 without them: the CPU's products wait for the GPU's rows, which wait for the
    link (docs/benchmarks.md)."""
    link = profile.link("cpu", g)
    back = profile.link(g, "cpu")
    slow = link.host_slowdown
    kv_half = max(ctx // 2, 1)
    rest_d = unit_tables(f, decode_graph, "cpu", profile, 1, kv_half, products=False)
    prod_d = unit_tables(f, decode_graph, "cpu", profile, 1, kv_half, products=True)
    rest_p = unit_tables(f, prefill_graph, "cpu", profile, prefill, prefill, products=False)
    prods = unit_products(f, decode_graph)
    decode_shares = os.environ.get("EDGELLM_STREAM_DECODE", "0") == "1"
    out: dict[str, list[Option]] = {}
    for u, ps in prods.items():
        if u == "embed":
            continue
        n_prod = len(ps)
        wbytes = sum(b for b, _, _ in ps)
        t_link = wbytes / link.bandwidth
        t_cpu = prod_d[u] * slow
        # the round trip of each product's activations (x up, y down) and the wait for it
        act_d = sum(link.cost(4 * k) + back.cost(4 * n) for _, n, k in ps)
        act_p = sum(link.cost(4 * k * prefill) + back.cost(4 * n * prefill) for _, n, k in ps)
        pre = rest_p[u] + max(gpu_pre_products[u], t_link) + act_p
        shares = [1.0]  # decode on the CPU alone, prefill chunks streamed
        if decode_shares:
            best = t_link / max(t_link + t_cpu, 1e-12)  # the CPU's share that finishes both sides together
            shares += sorted({round(min(max(best + d, 0.0), 0.95), 2) for d in (-0.1, 0.0, 0.1)} | {0.0})
        opts = []
        for share in shares:
            if share >= 1.0:  # nothing crosses the link in decode
                dec = rest_d[u] + prod_d[u]
            else:
                dec = rest_d[u] + max(share * t_cpu, (1 - share) * t_link) + act_d
            host = mem_cpu[u] + int(wbytes)  # at most the CPU's packs and cache, and every row pinned
            opts.append(Option(f"rows cpu {share:.2f} | {g}", dec, pre, {"cpu": host, g: 0}, ("cpu",), "cpu"))
        out[u] = opts
    return out


def build_problem(f, decode_graph, prefill_graph, processors: list[str], budgets: dict, profile: Profile, *,
                  ctx: int, prefill: int = 512, prefill_weight: float = 0.0, splits: bool = False,
                  stream: bool = False) -> Problem:
    kv_half = max(ctx // 2, 1)
    dec = {p: unit_tables(f, decode_graph, p, profile, 1, kv_half) for p in processors}
    pre = {p: unit_tables(f, prefill_graph, p, profile, prefill, prefill) for p in processors}
    mem = {p: unit_memory(f, decode_graph, p, ctx) for p in processors}
    d_model = int(decode_graph.tensors["embed.out"].concrete_shape(seq=1)[-1])
    units = [u.name for u in graph_units(decode_graph)]
    options = []
    gpus = [p for p in processors if p.startswith("cuda")]
    streamed: dict[str, list[Option]] = {}
    if stream and "cpu" in processors:
        for g in gpus:
            for u, opts in stream_options(
                    f, decode_graph, prefill_graph, g, profile, ctx=ctx, prefill=prefill, gpu_pre_products=unit_tables(f, prefill_graph, g, profile, prefill, prefill,
                                                                     products=True),
                    mem_cpu=mem["cpu"]).items():
                streamed.setdefault(u, []).extend(opts)
    for u in units:
        opts = [Option(p, dec[p][u], pre[p][u], {p: mem[p][u]}, (p,), p) for p in processors]
        opts += streamed.get(u, [])
        if splits and u.startswith("blk.") and "cpu" in processors:
            for g in gpus:
                back_d = profile.link("cpu", g).cost(4 * d_model)
                back_p = profile.link("cpu", g).cost(4 * d_model * prefill)
                for fr in SPLIT_FRACTIONS:
                    opts.append(Option(f"rows {g} {fr:.2f} | cpu", max(fr * dec[g][u], (1 - fr) * dec["cpu"][u]) + back_d,
                                       max(fr * pre[g][u], (1 - fr) * pre["cpu"][u]) + back_p,
                                       {g: int(fr * mem[g][u]), "cpu": int((1 - fr) * mem["cpu"][u])}, (g, "cpu"), g))
        options.append(opts)
    td = {(a, b): profile.link(a, b).cost(4 * d_model) for a in processors for b in processors if a != b}
    tp = {(a, b): profile.link(a, b).cost(4 * d_model * prefill) for a in processors for b in processors if a != b}
    return Problem(units, options, dict(budgets), td, tp, prefill_weight)


def default_gpu_budget(device: str) -> int:
    """What is free on the GPU now, less 512 MiB for the runtime's own workspaces."""
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return max(free - (512 << 20), 0)


def summarize(problem: Problem, sol: Solution) -> dict:
    runs = []
    for u, o in zip(problem.units, sol.options):
        if runs and runs[-1]["on"] == o.name:
            runs[-1]["units"].append(u)
        else:
            runs.append({"on": o.name, "units": [u]})
    return {"placement": {u: o.name for u, o in zip(problem.units, sol.options)},
            "runs": [{"on": r["on"], "from": r["units"][0], "to": r["units"][-1], "count": len(r["units"])} for r in runs],
            "predicted_decode_s": sol.decode_s, "predicted_prefill_s": sol.prefill_s,
            "memory_bytes": sol.memory, "budgets": problem.budgets}


def measure_processors(path: str, procs: list[str], profile: Profile, *, ctx: int, prefill: int,
                       force: bool = False) -> Profile:
    """Profile what the stored profile lacks (or everything with force) and store it: the CPU by
    timing this model's ops on cpu-fast, a GPU by microbenchmarks on it."""
    import torch

    from .profile import profile_cpu, profile_cuda, save_profile

    for p in sorted(procs, key=lambda q: not q.startswith("cuda")):  # a missing GPU fails before CPU work
        if not force and (p in profile.processors or p.split(":")[0] in profile.processors):
            continue
        if p.startswith("cpu"):
            from ..model import load

            profile_cpu(load(path, backend="cpu-fast", ctx=ctx, prefill_chunk=prefill), profile,
                        kv_len=max(ctx // 2, 1), prefill=prefill, name=p.split(":")[0])
        elif p.startswith("cuda"):
            if not torch.cuda.is_available():
                raise EdgeLLMError(f"no GPU is visible and the stored profile has no '{p}' "
                                   f"({cache_path()}): plan on the machine that has the GPU")
            profile_cuda(profile, p if ":" in p else "cuda:0")
        else:
            raise EdgeLLMError(f"--devices: unknown processor '{p}' (cpu, cuda:N)")
    save_profile(profile)
    return profile


# the objective: decode time per token + PREFILL_WEIGHT x prefill time per prompt (a prompt's
# prefill amortised over a 256-token answer)
PREFILL_WEIGHT = 1 / 256


def plan_split(path: str, *, gpu_memory: str | None, devices: str | None, ctx: int | None, prefill: int,
               splits: bool = False, profile: Profile | None = None, measure: bool = False,
               stream: bool = True, prefill_weight: float = PREFILL_WEIGHT) -> dict:
    from ..compiler.compile import compile_graph
    from ..gguf_file import open_gguf
    from ..models import build_graph, config_from_gguf

    f = open_gguf(path)
    cfg = config_from_gguf(f)
    ctx = ctx or min(cfg.context_length, 4096)
    procs = [p.strip() for p in (devices or "cuda:0,cpu").split(",") if p.strip()]
    profile = profile or load_profile()
    if measure or any(p not in profile.processors and p.split(":")[0] not in profile.processors for p in procs):
        profile = measure_processors(path, procs, profile, ctx=min(ctx, 1024), prefill=min(prefill, 512), force=measure)
    budgets = {}
    for p in procs:
        if p.startswith("cuda"):
            budgets[p] = parse_bytes(gpu_memory) if gpu_memory else default_gpu_budget(p)
    dec = compile_graph(build_graph(cfg, f, "last"), seq=1, ctx=ctx).graph
    pre = compile_graph(build_graph(cfg, f, "last"), seq=prefill, ctx=ctx).graph
    given = dict(budgets)
    problem = build_problem(f, dec, pre, procs, budgets, profile, ctx=ctx, prefill=prefill, splits=splits,
                            prefill_weight=prefill_weight)
    check_budgets(problem)  # a budget smaller than one layer is an error, with streaming or without
    # GPU memory beside weights and caches: the activations (and with streaming also the slots and
    # the streamed products' activations), taken off each GPU budget before solving
    work = activation_arena(f, cfg, ctx=ctx, prefill=prefill)
    for p, b in given.items():
        if 0 < b <= work:
            raise PlacementError(f"the memory budget for {p} ({b / 2**20:.1f} MiB) leaves no room beside the "
                                 f"activations of a {prefill}-token prefill ({work / 2**20:.1f} MiB): raise it")

    def attempt(reserve: int, streamed: bool):
        room = {p: b - reserve if b > 0 else b for p, b in given.items()}
        if any(b < 0 for b in room.values()):
            return None
        prob = build_problem(f, dec, pre, procs, room, profile, ctx=ctx, prefill=prefill, splits=splits,
                             stream=streamed, prefill_weight=prefill_weight)
        try:
            sol = solve(prob)
        except PlacementError:
            return None
        sol.memory = {p: b + (reserve if p.startswith("cuda") else 0) for p, b in sol.memory.items()}
        return prob, sol, reserve

    best = attempt(work, False)
    if stream and "cpu" in procs and any(p.startswith("cuda") for p in procs):
        reserve = work + stream_activation_bytes(f, pre, prefill) + stream_reservation(f, dec)
        other = attempt(reserve, True)
        if other is not None and any(o.name.startswith("rows cpu") for o in other[1].options) and (
                best is None or other[1].objective < best[1].objective):
            best = other
    if best is None:
        problem.budgets = {p: b - work if b > 0 else b for p, b in given.items()}
        solve(problem)  # raises the clear error
    problem, sol, reserve = best
    problem.budgets = given
    out = summarize(problem, sol)
    out["gpu_workspace_bytes"] = reserve
    out.update({"model": str(path), "ctx": ctx, "prefill": prefill, "processors": procs})
    out["measured"] = measured_for(out)
    return out


# -- measured times of a placement (`edgellm run --gpu-memory` records them, `edgellm plan` shows
# them beside the prediction) ---------------------------------------------------------------------
MAX_MEASURED = 64  # placements remembered, the most recent kept


def _measured_path():
    return cache_path().with_name("measured.json")


def _placement_key(p: dict) -> str:
    """The file's content (its fingerprint, as the program cache keys it), the context and the
    placement itself: a time measured for one placement of one file is shown only for that."""
    import hashlib
    import json

    try:
        ident = file_fingerprint(p["model"])
    except OSError:
        ident = str(p["model"])
    placement = json.dumps(sorted(p["placement"].items()))
    return hashlib.sha256(f"{ident}|{p['ctx']}|{placement}".encode()).hexdigest()[:32]


def _read_measured() -> dict:
    import json

    try:
        data = json.loads(_measured_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: rewritten by the next record


def record_measured(p: dict, *, decode_s: float | None, prompt_s: float | None, prompt_tokens: int) -> None:
    """Store a run's measured decode time per token and prompt time for this placement (p: a
    plan_split result). Written whole (write_text_atomic): of two processes recording at once,
    one's entry may be lost, never the file."""
    import json
    import time

    data = _read_measured()
    data[_placement_key(p)] = {"decode_s": decode_s, "prompt_s": prompt_s, "prompt_tokens": int(prompt_tokens),
                               "predicted_decode_s": p["predicted_decode_s"], "date": time.strftime("%Y-%m-%d %H:%M")}
    data = dict(list(data.items())[-MAX_MEASURED:])
    write_text_atomic(_measured_path(), json.dumps(data, indent=1))  # a read-only cache: the run showed them


def measured_for(p: dict) -> dict | None:
    """The last recorded measurement of this placement (record_measured), or None."""
    got = _read_measured().get(_placement_key(p))
    return got if isinstance(got, dict) and "date" in got else None


def compare_line(p: dict, decode_s: float | None) -> str:
    """`edgellm run --gpu-memory`'s line: the solver's predicted decode time beside the run's."""
    pred = p["predicted_decode_s"]
    if not decode_s:
        return f"split: predicted decode {pred * 1e3:.2f} ms/token (too few tokens generated to measure it)"
    return (f"split: decode {decode_s * 1e3:.2f} ms/token measured, {pred * 1e3:.2f} predicted "
            f"({(pred - decode_s) / decode_s:+.0%})")


def plan_gpus(path: str, gpus: list[str], *, ctx: int | None, prefill: int, profile: Profile | None = None,
              prefill_weight: float = 0.0, gpu_memory: str | None = None) -> dict:
    """How to run one model over several GPUs of one host: tensor parallel (each GPU its share of
    every layer, two all_reduces a layer; edgellm.models.blocks) or pipelined (the solver's
    placement of whole layers over the GPUs' free memory, which for a model that fits one GPU is
    that GPU alone: a single stream's token passes every layer in turn, so layers on several GPUs
    only add transfers). Both predicted from the profile (a GPU's cost model, the all_reduce link);
    'mode' is the one with the smaller decode + prefill_weight x prefill time. Returns both.
    gpu_memory: each GPU's budget for the pipeline's placement (default: what is free)."""
    from dataclasses import replace

    from ..compiler.compile import compile_graph
    from ..errors import GraphError
    from ..gguf_file import open_gguf
    from ..models import build_graph, config_from_gguf
    from ..models.blocks import shard_of

    f = open_gguf(path)
    cfg = config_from_gguf(f)
    ctx = ctx or min(cfg.context_length, 4096)
    profile = profile or load_profile()
    world = len(gpus)
    pipe = plan_split(path, gpu_memory=gpu_memory, devices=",".join(gpus), ctx=ctx, prefill=prefill, profile=profile,
                      prefill_weight=prefill_weight)
    shard = replace(cfg, shard=(0, world))  # rank 0: the largest share where heads divide unevenly
    try:
        shard_of(shard)
    except GraphError as e:  # no tensor-parallel split of this model over these GPUs: the pipeline
        return {"model": str(path), "gpus": gpus, "ctx": ctx, "prefill": prefill, "mode": "pipeline",
                "tensor": {"unavailable": str(e)}, "pipeline": pipe}
    dec = compile_graph(build_graph(shard, f, "last"), seq=1, ctx=ctx).graph
    pre = compile_graph(build_graph(shard, f, "last"), seq=prefill, ctx=ctx).graph
    tp_dec = sum(unit_tables(f, dec, gpus[0], profile, 1, max(ctx // 2, 1)).values())
    tp_pre = sum(unit_tables(f, pre, gpus[0], profile, prefill, prefill).values())
    mem = sum(unit_memory(f, dec, gpus[0], ctx).values())
    tensor = {"predicted_decode_s": tp_dec, "predicted_prefill_s": tp_pre, "memory_per_gpu": mem,
              "collectives_per_token": sum(op.kind in ("all_reduce", "all_gather") for op in dec.ops),
              "all_reduce_link": {"latency_s": profile.collective(world).latency_s,
                                  "bandwidth": profile.collective(world).bandwidth,
                                  "measured": f"all_reduce*{world}" in profile.links}}
    cost = {"tensor": tp_dec + prefill_weight * tp_pre,
            "pipeline": pipe["predicted_decode_s"] + prefill_weight * pipe["predicted_prefill_s"]}
    return {"model": str(path), "gpus": gpus, "ctx": ctx, "prefill": prefill, "mode": min(cost, key=cost.get),
            "tensor": tensor, "pipeline": pipe}


def render(p: dict) -> str:
    lines = [f"placement of {p['model']} (ctx {p['ctx']}) over {', '.join(p['processors'])}:"]
    for r in p["runs"]:
        span = r["from"] if r["count"] == 1 else f"{r['from']} .. {r['to']}"
        lines.append(f"  {span:<22} ({r['count']:>3} units) on {_where(r['on'])}")
    for proc, b in p["memory_bytes"].items():
        cap = p["budgets"].get(proc)
        work = p.get("gpu_workspace_bytes") if proc.startswith("cuda") else None
        lines.append(f"  memory on {proc}: {b / 2**30:.2f} GiB" + (f" of {cap / 2**30:.2f} GiB" if cap else "")
                     + (f" (activations and streaming {work / 2**30:.2f} GiB of it)" if work else ""))
    lines.append(f"  predicted decode: {p['predicted_decode_s'] * 1e3:.2f} ms/token "
                 f"({1 / max(p['predicted_decode_s'], 1e-12):.1f} tok/s); "
                 f"prefill of {p['prefill']} tokens: {p['predicted_prefill_s'] * 1e3:.1f} ms")
    m = p.get("measured")
    if m:
        parts = []
        if m.get("decode_s"):
            parts.append(f"decode {m['decode_s'] * 1e3:.2f} ms/token ({1 / m['decode_s']:.1f} tok/s)")
        if m.get("prompt_s"):
            parts.append(f"a prompt of {m['prompt_tokens']} tokens {m['prompt_s'] * 1e3:.1f} ms")
        if parts:
            lines.append(f"  measured (edgellm run, {m['date']}): " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def _where(choice: str) -> str:
    """A placement value in words: 'rows cpu 1.00 | cuda:0' -> 'cpu, prefill streamed to cuda:0'."""
    if not choice.startswith("rows "):
        return choice
    from .executor import parse_choice

    main, share, other = parse_choice(choice)
    if other.startswith("cuda") and main == "cpu":
        if share >= 1.0:
            return f"{main}, prefill streamed to {other}"
        return f"{main} ({share:.0%} of the rows) + {other} (the rest, streamed; all of them for prefill)"
    return f"{main} ({share:.0%} of the rows) + {other} (the rest)"


def render_gpus(p: dict) -> str:
    t, pipe = p["tensor"], p["pipeline"]
    pick = "tensor parallel" if p["mode"] == "tensor" else "whole layers on " + ", ".join(r["on"] for r in pipe["runs"])
    lines = [f"{p['model']} (ctx {p['ctx']}) over {', '.join(p['gpus'])}: {pick}"]
    if "unavailable" in t:
        lines.append(f"  tensor parallel: not possible ({t['unavailable']})")
    else:
        link = t["all_reduce_link"]
        lines.append(f"  tensor parallel: predicted decode {t['predicted_decode_s'] * 1e3:.2f} ms/token, prefill of "
                     f"{p['prefill']} tokens {t['predicted_prefill_s'] * 1e3:.1f} ms; "
                     f"{t['memory_per_gpu'] / 2**30:.2f} GiB a GPU; {t['collectives_per_token']} collectives a step "
                     f"at {link['latency_s'] * 1e6:.1f} us" + ("" if link["measured"] else " (not measured: a guess)"))
    lines.append("  pipeline: " + render(pipe).strip().replace("\n", "\n  "))
    return "\n".join(lines) + "\n"


def add_plan_args(pl) -> None:
    """`edgellm plan` options for a placement over several processors."""
    pl.add_argument("--gpu-memory", default=None,
                    help="memory budget per GPU, e.g. 6GiB: show the layer placement over GPU and CPU and predicted "
                         "times (default with --devices: what is free)")
    pl.add_argument("--devices", default=None, help="processors to place over (default cuda:0,cpu)")
    pl.add_argument("--splits", action="store_true", help="also consider row splits of a layer between GPU and CPU")
    pl.add_argument("--no-stream", dest="stream", action="store_false",
                    help="layers the GPU cannot hold run on the CPU alone (default: their prefill products are "
                         "streamed to the GPU over the link)")
    pl.add_argument("--prefill-weight", type=float, default=PREFILL_WEIGHT,
                    help="the objective is decode time per token + this x prefill time per prompt "
                         f"(default {PREFILL_WEIGHT:g}: a prompt amortised over a 256-token answer)")
    pl.add_argument("--profile", action="store_true",
                    help="measure this machine's processors again (stored in ~/.cache/edgellm/hetero/)")


def run_plan_args(args, path: str) -> str | None:
    """The placement text (or JSON dict) when --gpu-memory/--devices was given, else None."""
    if not (getattr(args, "gpu_memory", None) or getattr(args, "devices", None) or getattr(args, "profile", False)):
        return None
    if args.gpu_memory:
        parse_bytes(args.gpu_memory)  # a bad size fails before any work
    procs = [d.strip() for d in (args.devices or "").split(",") if d.strip()]
    gpus_only = len(procs) > 1 and all(d.startswith("cuda") for d in procs)
    if gpus_only:  # several GPUs of one host: tensor parallel or pipelined
        if args.profile:
            measure_processors(path, procs, load_profile(), ctx=args.ctx or 1024, prefill=min(args.prefill, 512),
                               force=True)
        p = plan_gpus(path, procs, ctx=args.ctx, prefill=args.prefill, gpu_memory=args.gpu_memory)
    else:
        p = plan_split(path, gpu_memory=args.gpu_memory, devices=args.devices, ctx=args.ctx, prefill=args.prefill,
                       stream=getattr(args, "stream", True), prefill_weight=getattr(args, "prefill_weight", PREFILL_WEIGHT),
                       splits=args.splits, measure=args.profile)
    if args.json:
        import json

        return json.dumps(p, indent=2) + "\n"
    return render_gpus(p) if gpus_only else render(p)


def load_placed(path: str, gpu_memory: str, *, ctx: int | None = None, devices: str | None = None,
                prefill_chunk: int = 512, log=None):
    """`edgellm run --gpu-memory SIZE`: a model placed over the GPU (within SIZE) and the CPU by the
    solver, loaded by the split executor. Processors the stored profile lacks are measured first:
    a GPU by its microbenchmarks (seconds); the CPU, when no model's ops were ever timed on it, by
    a copy and a product on the host (`edgellm plan MODEL --gpu-memory SIZE --profile` times this
    model's own ops for a closer prediction). Returns (model, plan)."""
    import torch

    from .executor import load_split
    from .profile import cpu_model_from_host, profile_cuda, save_profile

    procs = [p.strip() for p in (devices or "cuda:0,cpu").split(",") if p.strip()]
    profile = load_profile()
    for p in procs:
        if p in profile.processors or p.split(":")[0] in profile.processors:
            continue
        if p.startswith("cuda"):
            if not torch.cuda.is_available():
                raise EdgeLLMError(f"--gpu-memory places layers on a GPU, and no GPU is visible to torch "
                                   f"({torch.__version__}); run without it, or with --backend cpu-fast")
            if log:
                log(f"measuring {p} (once per machine, stored in {cache_path()})")
            profile_cuda(profile, p if ":" in p else "cuda:0")
        elif p == "cpu":
            if log:
                log("measuring the CPU (once per machine; `edgellm plan MODEL --gpu-memory SIZE --profile` "
                    "times this model's own ops)")
            profile.processors["cpu"] = cpu_model_from_host()
        else:
            raise EdgeLLMError(f"--devices: unknown processor '{p}' (cpu, cuda:N)")
        save_profile(profile)
    plan = plan_split(path, gpu_memory=gpu_memory, devices=",".join(procs), ctx=ctx, prefill=prefill_chunk,
                      profile=profile)
    if log:
        log(render(plan).rstrip())
    return load_split(path, plan["placement"], ctx=plan["ctx"], prefill_chunk=prefill_chunk), plan
