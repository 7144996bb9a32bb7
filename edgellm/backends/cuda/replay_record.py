"""Writing a start-up image (replay.py) after a cuda run: each step the run needed (and each step
of the image it replaces) captured once more into a CUDA graph that is read back through the
driver instead of run, its kernels traced to the cubins Triton loaded them from, its device
addresses to the allocations they fall in, and those allocations' contents saved.

A step whose graph holds anything replay cannot reproduce (a kernel not loaded through Triton,
an argument larger than a pointer, a copy node) makes the whole image unrecordable: then no image
is written, and later runs load in full as before.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from ...errors import EdgeLLMError
from ...sampling import DeviceDraw, SamplingParams
from . import driver
from . import replay as R

# function handle -> (kernel name, path of its cubin in Triton's cache), for every kernel loaded
_loaded: dict[int, tuple[str, str | None]] = {}
_watching = False


class Unrecordable(EdgeLLMError):
    """A step of this model cannot go into a start-up image."""


def watch_kernel_loads() -> None:
    """Note which cubin each kernel Triton loads comes from (Triton's kernel_load_end_hook)."""
    global _watching
    if _watching:
        return
    _watching = True
    try:
        from triton import knobs

        chain = knobs.runtime.kernel_load_end_hook
        chain.add  # noqa: B018 - a Triton without hook chains records no images
    except (ImportError, AttributeError):
        return

    def loaded(module, function, name, metadata_group, hash_):
        cubin = next((p for k, p in (metadata_group or {}).items() if str(k).endswith(".cubin")), None)
        _loaded[int(function)] = (name, cubin)
    chain.add(loaded)


class _Segments:
    """The device allocations a recording's addresses fall in, numbered in order of first use."""

    def __init__(self):
        self.index: dict[int, int] = {}  # base -> number
        self.spans: list[tuple[int, int]] = []  # (base, size)

    def ref(self, ptr: int, what: str = "an argument") -> list[int]:
        r = self.resolve(ptr)
        if r is None:
            raise Unrecordable(f"{what} at {ptr:#x} is not device memory")
        return r

    def resolve(self, ptr: int) -> list[int] | None:
        for base, size in self.spans:  # most addresses fall in an allocation seen already
            if base <= ptr < base + size:
                return [self.index[base], ptr - base]
        span = driver.address_range(ptr)
        if span is None:
            return None
        base, size = span
        if size > (64 << 30):
            raise Unrecordable(f"an allocation of {size >> 30} GiB (expandable segments?) cannot be saved")
        self.index[base] = len(self.spans)
        self.spans.append((base, size))
        return [self.index[base], ptr - base]

    def snapshot(self, scratch: list[tuple[int, int]]) -> tuple[list, np.ndarray]:
        """(segments meta, image): every allocation's size and its bytes outside the scratch
        ranges (caches and arenas, written before they are read), copied from the device."""
        runs_of, total = [], 0
        for base, size in self.spans:
            cuts = sorted((max(p, base) - base, min(p + n, base + size) - base) for p, n in scratch
                          if p < base + size and p + n > base)
            runs, at = [], 0
            for lo, hi in cuts:
                if lo > at:
                    runs.append([at, lo - at])
                at = max(at, hi)
            if at < size:
                runs.append([at, size - at])
            runs_of.append(runs)
            total += sum(n for _, n in runs)
        if total > R.max_bytes():
            raise Unrecordable(f"the image would hold {total / 2**30:.1f} GiB of device memory "
                               f"(over EDGELLM_REPLAY_MAX_BYTES={R.max_bytes()})")
        image = np.empty(total, dtype=np.uint8)
        segments, at = [], 0
        for (base, size), runs in zip(self.spans, runs_of):
            out = []
            for off, n in runs:
                driver.copy_dtoh(image.ctypes.data + at, base + off, n)
                out.append([off, at, n])
                at += n
            segments.append([size, out])
        return segments, image


class _Modules:
    def __init__(self):
        self.index: dict[int, int] = {}
        self.entries: list[list] = []  # [kernel name, shared bytes]
        self.cubins: list[bytes] = []

    def ref(self, fn: int, shared: int) -> int:
        i = self.index.get(fn)
        if i is None:
            name, path = _loaded.get(fn, (None, None))
            if path is None:
                raise Unrecordable(f"kernel '{driver.func_name(fn)}' was not loaded from a Triton cubin")
            with open(path, "rb") as f:
                self.cubins.append(f.read())
            i = self.index[fn] = len(self.entries)
            self.entries.append([name, shared])
        self.entries[i][1] = max(self.entries[i][1], shared)
        return i


def _order(nodes: list[int], edges: list[tuple[int, int, int]]) -> list[int]:
    """The nodes in an order their dependencies allow (ties in the driver's listing order)."""
    pos = {n: i for i, n in enumerate(nodes)}
    deps = {n: 0 for n in nodes}
    after: dict[int, list[int]] = {n: [] for n in nodes}
    for a, b, _ in edges:
        deps[b] += 1
        after[a].append(b)
    ready = sorted((n for n in nodes if deps[n] == 0), key=pos.__getitem__)
    out = []
    while ready:
        n = ready.pop(0)
        out.append(n)
        for b in after[n]:
            deps[b] -= 1
            if deps[b] == 0:
                ready.append(b)
        ready.sort(key=pos.__getitem__)
    if len(out) != len(nodes):
        raise Unrecordable("the captured graph has a cycle")
    return out


def extract(graph: int, segs: _Segments, mods: _Modules) -> list:
    """A captured graph's work as replay.ReplayImage._capture replays it."""
    nodes = driver.graph_nodes(graph)
    edges = driver.graph_edges(graph)
    programmatic = {b for _, b, t in edges if t == driver._DEP_PROGRAMMATIC}
    out = []
    for node in _order(nodes, edges):
        kind = driver.node_type(node)
        if kind == driver.NODE_EMPTY:
            continue
        if kind == driver.NODE_MEMSET:
            m = driver.memset_node(node)
            if m["height"] != 1 or m["element"] not in (1, 4):
                raise Unrecordable(f"a {m['height']}-row memset of {m['element']}-byte elements")
            out.append(["memset", segs.ref(m["dst"], "a memset"), m["value"], m["element"], m["width"]])
            continue
        if kind != driver.NODE_KERNEL:
            raise Unrecordable(f"a graph node of type {kind} (only kernels and memsets are replayed)")
        k = driver.kernel_node(node)
        fn = mods.ref(k["func"], k["shared"])
        args, relocs = [], []
        for i, a in enumerate(k["args"]):
            if len(a) > 8:
                raise Unrecordable(f"kernel '{mods.entries[fn][0]}' takes a {len(a)}-byte argument")
            if len(a) == 8:
                v = int.from_bytes(a, "little")
                r = segs.resolve(v) if v else None
                if r is not None:
                    relocs.append([i, r[0], r[1]])
            args.append(a.hex())
        out.append([fn, list(k["grid"]), list(k["block"]), k["shared"], int(node in programmatic), args, relocs])
    return out


def _draw_for(plan_json: str, vocab: int) -> DeviceDraw | None:
    """A draw whose choice plan is plan_json (the values are the device buffers', set per run)."""
    plan = json.loads(plan_json)
    if plan is None:
        return None
    need, cut_rows, any_top_k = plan
    if any_top_k:
        p = SamplingParams(temperature=1.0, top_k=need, top_p=1.0, min_p=0.05 if cut_rows else 0.0)
    elif need:
        p = SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0)
    else:
        p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05 if cut_rows else 0.0)
    if R.draw_plan(p, vocab) != plan_json:
        raise Unrecordable(f"no sampling parameters give the choice plan {plan_json}")
    return DeviceDraw(p, 1)


def record(model, n_prompt: int, max_tokens: int, params: SamplingParams) -> str:
    """Write the start-up image of `model` (loaded on the cuda backend) covering a generation of
    max_tokens after n_prompt prompt tokens with params, and the steps of the image it replaces.
    Returns what was written; raises Unrecordable with the reason where no image can be."""
    pc = model.program_cache
    progs = model.programs
    if model.backend_name != "cuda" or not hasattr(model.backend, "device"):
        raise Unrecordable(f"images are made of cuda models (this one runs on {model.backend_name})")
    if pc is None or model.fingerprint is None:
        raise Unrecordable("the program cache is off")
    if model.config.shard != (0, 1) or model.backend.device.type != "cuda" or (model.backend.device.index or 0) != 0:
        raise Unrecordable("images are made for the first GPU's whole model only")
    if not all(n in progs and getattr(progs[n], "use_cuda_graph", False) for n in ("last", "decode")):
        raise Unrecordable("the programs do not run as CUDA graphs")
    device = driver.init_device(0)  # the primary context, the one torch runs in
    metas = {n: progs[n].replay_meta() for n in ("last", "decode")}
    vocab = metas["decode"]["vocab"]
    key = R.image_key(model.fingerprint, device, model.ctx, model.prefill_chunk, model.fuse)
    keys = R.needed_keys(metas, model.kv_chunk, n_prompt, max_tokens, params, vocab)
    old = pc.get_json(key, R.KEYS_ARTIFACT)
    if isinstance(old, list):
        keys |= {tuple(k) for k in old if isinstance(k, list) and len(k) == 3 and k[0] in metas
                 and k[1] in ("step", "loop")}
    segs, mods = _Segments(), _Modules()
    out = {n: {"meta": metas[n], "io": {}, "steps": {}, "loops": {}} for n in metas}
    keep = []  # the graphs stay alive (with any memory of theirs) until the contents are saved
    for prog, kind, k in sorted(keys):
        p = progs[prog]
        if kind == "step":
            padded, bucket = (int(x) for x in k.split(":"))
            g, io = p.capture_for_replay(padded, bucket)
        else:
            bucket, plan_json = k.split(":", 1)
            g, io = p.capture_for_replay(1, int(bucket), loop_draw=_draw_for(plan_json, vocab))
        keep.append(g)
        launches = extract(g.raw_cuda_graph(), segs, mods)
        out[prog]["io"].update({n: segs.ref(t.data_ptr(), f"input '{n}'") for n, t in io.items() if n != "logits"})
        entry = {"launches": launches}
        if kind == "step":
            entry["logits"] = segs.ref(io["logits"].data_ptr(), "the logits")
        out[prog][kind + "s"][k] = entry
    torch.cuda.synchronize(model.backend.device)
    scratch = {(t.data_ptr(), t.numel() * t.element_size()) for t in model.states.values()}
    scratch |= {(p.arena.data_ptr(), p.arena.numel()) for p in progs.values() if getattr(p, "arena", None) is not None}
    segments, image = segs.snapshot(sorted(scratch))
    del keep
    meta = {"format": R.FORMAT, "vocab": vocab, "segments": segments, "modules": mods.entries, "programs": out}
    arrays = {"image": image, **{f"cubin.{i}": np.frombuffer(c, dtype=np.uint8) for i, c in enumerate(mods.cubins)}}
    pc.put_arrays(key, R.ARTIFACT, arrays, meta=meta)
    pc.put_json(key, R.KEYS_ARTIFACT, sorted(list(k) for k in keys))
    n_launch = sum(len(e["launches"]) for p in out.values() for d in (p["steps"], p["loops"]) for e in d.values())
    return (f"start-up image saved: {len(keys)} steps, {n_launch} launches, {len(mods.entries)} kernels, "
            f"{image.nbytes / 2**20:.0f} MiB of device memory")
