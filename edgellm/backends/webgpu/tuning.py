"""Launch configurations of the decode GEMV and the prefill GEMM: defaults per adapter, and (on a
GPU unless EDGELLM_TUNE=0; tuning_on) the fastest of a few candidates timed on the adapter at the
first load, cached on disk per adapter with the cuda backend's Tuner
(edgellm/backends/cuda/tuning.py: one JSON file per device string)."""

from __future__ import annotations

import os

from ...errors import EdgeLLMError
from .device import Device
from .kernels import INT8_FORMATS, INT8_GEMM_FORMATS, PREFILL_ATTENTIONS, quantize_x_grid


def quantize_lanes(dev: Device) -> int:
    """kernels.quantize_x's lanes a block on this adapter: 8 (a vec4 a thread, the block's maximum
    and sums shared by shuffles) with subgroups of 8 lanes or more, else 1 (a thread a block)."""
    return 8 if dev.subgroup_size >= 8 else 1


def can_stage(dev: Device, cols: int | None, int8: bool = False, planes: int = 1) -> bool:
    """Whether a GEMV over rows of `cols` can stage x in workgroup memory (gemv_warp's stage;
    int8: as int8 blocks with a scale and two sums each, 11 bytes per 8 elements instead of 32,
    8 more per 8 for a second plane)."""
    if cols is None or cols % 32:
        return False
    return ((3 + 8 * planes) * cols // 8 if int8 else 4 * cols) + 4096 <= dev.max_workgroup_memory


def int8_planes(dev: Device, cols: int | None, fmt: str | None) -> int:
    """How many int8 planes of activations the default decode GEMV of a weight takes (gemv_warp's
    int8 and planes; 0: float x) for the formats of kernels.INT8_FORMATS whose x fits staged so:
    2 by default (about 16-bit activations, twice the dot products of one plane: the float path's
    accuracy, 99.8% teacher-forced top-1 on the default model on lavapipe; on the H200 through
    Vulkan, 2026-11-30, tg128 1B Q4_0 910.8 tok/s against 681.9 with float x and 947.7 with one
    plane, 8B Q8_0 214.6 against 202.9 and 258.4), EDGELLM_WEBGPU_INT8=1 for one plane (faster,
    95.7%: the default model's capital answer tips), 0 for float x."""
    v = os.environ.get("EDGELLM_WEBGPU_INT8", "2")
    if v not in ("0", "1", "2"):
        raise EdgeLLMError(f"EDGELLM_WEBGPU_INT8={v!r}: expected 0 (float activations), 1 or 2 (int8 planes)")
    n = int(v)
    return n if n and fmt in INT8_FORMATS and can_stage(dev, cols, int8=True, planes=n) else 0


def warp_config(dev: Device, rows_per_warp: int = 1, wg: int = 256, unroll: int = 2, stage: bool = False,
                pipeline: bool = False, split: int = 1, int8: bool = False, planes: int = 1, xq: bool = False) -> dict:
    """kernels.gemv_warp's configuration: one subgroup per `rows_per_warp` features (32 lanes
    reducing in workgroup memory where the adapter's subgroup size is unknown)."""
    sub = dev.subgroup_size
    sg = min(32, sub) if sub else 32
    cfg = {"kind": "warp", "wg": wg, "sg": sg, "rows_per_warp": rows_per_warp, "subgroup": bool(sub),
           "rows_per_wg": wg // (sg * split) * rows_per_warp, "unroll": unroll, "stage": stage}
    if pipeline:  # absent otherwise: tuning entries cached before these options keep their meaning
        cfg["pipeline"] = True
    if split > 1:
        cfg["split"] = split
    if int8:
        cfg["int8"] = True
        if planes > 1:
            cfg["planes"] = planes
        if xq:  # x quantized by its own dispatch first, with any prologue a fold would do (gemv_warp's xq)
            cfg["xq"] = True
    return cfg


def default_gemv_config(dev: Device, cols: int | None = None, fmt: str | None = None) -> dict:
    """On a GPU: kernels.gemv_warp (a subgroup strides each row in 16-byte units; x read once
    for its rows), 4 rows per subgroup for the 4-bit formats (their x traffic per weight byte is
    the largest), 2 for the others (the tuner's picks on the H100, 2026-11-24:
    benchmarks/bench_webgpu.py gemv section), x staged in workgroup memory where it fits
    (EDGELLM_WEBGPU_STAGE=0: read from the storage buffer). EDGELLM_WEBGPU_GEMV=block or
    warp:ROWS:WG:UNROLL[:stage][:pipe][:splitS][:int8|:int8x2][:xq] overrides (benchmarks compare them;
    int8: the formats of kernels.INT8_FORMATS take int8 activations, gemv_warp's int8, x staged, in
    two planes with int8x2; F16 ignores it; xq: x quantized by kernels.quantize_x first, with the
    norm or split merge a fold would put in the GEMV's prologue, then read by the GEMV unstaged).
    On a software adapter, kernels.gemv with 2 threads per feature: lavapipe runs a workgroup
    barrier as a switch between all its SIMD batches, and fewer threads per feature mean fewer
    reduction steps (1536x576 Q8_0 GEMV, 2 cores: 32 threads per feature with barriers 14.8 ms,
    2 per feature 0.9 ms). Rows of a length not a multiple of 4 take kernels.gemv (x read one
    element at a time)."""
    want = os.environ.get("EDGELLM_WEBGPU_GEMV", "")
    if dev.info.software and not want:
        return {"wg": 64, "rows_per_wg": 32, "subgroup": bool(dev.subgroup_size)}
    if want.startswith("warp:") and (cols is None or cols % 4 == 0):
        _, r, wg, u, *flags = want.split(":")
        split = next((int(f[5:]) for f in flags if f.startswith("split")), 1)
        planes = 2 if "int8x2" in flags else 1
        int8 = bool({"int8", "int8x2"} & set(flags)) and fmt in INT8_FORMATS and can_stage(dev, cols, True, planes)
        stage = int8 or ("stage" in flags and can_stage(dev, cols))
        return warp_config(dev, int(r), int(wg), int(u), stage, "pipe" in flags, split, int8, planes,
                           xq=int8 and "xq" in flags)
    if want != "block" and (cols is None or cols % 4 == 0):
        four_bit = fmt in ("Q4_0", "Q4_1")
        planes = int8_planes(dev, cols, fmt)
        stage = bool(planes) or (os.environ.get("EDGELLM_WEBGPU_STAGE", "1") == "1" and can_stage(dev, cols))
        return warp_config(dev, 4 if four_bit else 2, 256, 2 if four_bit else 1, stage, int8=bool(planes),
                           planes=max(planes, 1))
    wg = 128
    if dev.subgroup_size:
        tpr = min(32, dev.subgroup_size)
        return {"wg": wg, "rows_per_wg": wg // tpr, "subgroup": True}
    return {"wg": wg, "rows_per_wg": 4, "subgroup": False}


# gemv_warp's (rows per subgroup, units ahead, subgroups per row group) tuned: on the H200 through
# Vulkan (2026-11-30; `benchmarks/webgpu_probe.py`, the 8B projections in Q8_0, Q4_0 and F16, weights
# cycled past the L2 cache, the clock up) every shape's best four came from these; 1 row a subgroup
# with 1 or 2 units ahead, and 2 subgroups a row group with more than 1 unit ahead, never did
WARP_TUNED = [(1, 4, 1), (2, 1, 1), (2, 2, 1), (2, 4, 1), (4, 1, 1), (4, 2, 1), (4, 4, 1), (2, 1, 2), (4, 1, 2)]
# gemv_warp's xq (x quantized by its own dispatch, with a fold's norm or split merge, read
# unstaged): (rows per subgroup, units ahead), timed chained with the quantizing dispatch
XQ_TUNED = [(1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (4, 4)]
# kernels.gemv's (workgroup, threads per feature group, features per thread) tuned for float x
BLOCK_TUNED = [(128, 32, 1), (256, 32, 1), (256, 32, 2), (128, 16, 2)]


def gemv_candidates(dev: Device, int8: bool = False, planes: int = 1, xq: bool = False) -> list[dict]:
    """kernels.gemv_warp at WARP_TUNED, x staged or not (2 and 4 rows a subgroup; 2 subgroups a
    row group and 1 row with 4 units ahead staged only), then kernels.gemv at BLOCK_TUNED: 17
    configurations (66 until 2026-11-30: compiling and timing them took most of a first load's
    tuning). int8: gemv_warp with int8 activations alone in `planes` planes (the same numerics
    whichever wins), x staged, at WARP_TUNED: 9; with xq also x quantized ahead (with the
    prologue a fold would do) at XQ_TUNED: 15."""
    if int8:
        out = [warp_config(dev, r, 256, u, True, split=sp, int8=True, planes=planes) for r, u, sp in WARP_TUNED]
        return out + [warp_config(dev, r, 256, u, False, int8=True, planes=planes, xq=True) for r, u in XQ_TUNED if xq]
    out = [warp_config(dev, r, 256, u, st, split=sp) for r, u, sp in WARP_TUNED for st in (False, True)
           if st or (sp == 1 and r > 1 and u != 2)]
    for wg, tpr, nr in BLOCK_TUNED:
        out.append({"wg": wg, "rows_per_wg": wg * nr // tpr, "subgroup": tpr <= dev.subgroup_size, "rows_per_thread": nr})
    return out


_TUNERS: dict[str, object] = {}


def tuning_on(dev: Device) -> bool:
    """Whether the launch configurations are timed on this adapter: EDGELLM_TUNE=0 never, 1
    always; unset, on a GPU (as the cuda backend) and not on a software adapter, whose timings
    say nothing of a GPU's and take minutes. On the H200 through Vulkan (2026-11-30, two int8
    planes) tuning gave tg128 1B Q4_0 933-941 tok/s against 901 with the defaults and 8B Q8_0
    243-244 against 214, prefill 4-6% more, for 11 and 16 s once at the first load (cached)."""
    v = os.environ.get("EDGELLM_TUNE", "").strip()
    if v in ("0", "1"):
        return v == "1"
    return not dev.info.software


# the tuning table of decode GEMV picks; v5 (2026-11-30): rms_norm, the dispatch a norm made ahead
# runs, 2.4 times faster, so picks timed against the old one are not kept; v6 (2026-11-30): a norm
# folded into gemv_warp sums its squares as x is staged (no pass and barriers of its own ahead)
GEMV_TUNING = "webgpu_gemv_v6"


def gemv_forced() -> bool:
    """Whether EDGELLM_WEBGPU_GEMV names the decode GEMVs' configuration: then it is used as
    given, not timed against candidates (with the tuner on, a GPU's picks replaced a forced
    configuration and its folds: the backend tests that force one failed on the H200 only)."""
    return bool(os.environ.get("EDGELLM_WEBGPU_GEMV", "").strip())


def fold_tag(fold: dict | None) -> str:
    """The tuning key's part for what a decode GEMV does besides its product (the backend's folds,
    gemv_config's `fold`): "" for none."""
    fold = fold or {}
    parts = [fold["norm"]] if fold.get("norm") else []
    if fold.get("combine"):
        parts.append("combine{}x{}".format(*fold["combine"]))
    if fold.get("rope"):
        parts.append("rope")
    return "+".join(parts)


def gemv_config(dev: Device, w, n_out: int, glu: bool = False, fold: dict | None = None, tune: bool = True) -> dict:
    """The launch configuration for one weight: the default, or with tuning on (tuning_on) the
    fastest of the default and gemv_candidates, timed on this adapter at first load (timestamp
    queries where the adapter has them, see launch.py) and cached per adapter and driver in
    <cache dir>/tune/webgpu_<adapter>.json by the cuda backend's Tuner.

    fold: what the backend folds into this GEMV (kernels.gemv_warp's options), timed with it:
    "norm" ("rms" or "add_rms": x normalized in the prologue, each workgroup reducing its row),
    "combine" ((heads, head_dim): the attention's splits merged in the prologue, x staged),
    "rope" (the rotation in the epilogue: rows per subgroup even). A prologue's cost grows with
    the workgroups, so a GEMV timed without it ranks configurations of many workgroups too high.
    With a fold, gemv_warp candidates, and where the fold is a prologue (norm, combine) the same
    work made ahead by a dispatch of its own (prologue_ahead), timed with it: for int8
    activations x quantized with the prologue (kernels.quantize_x, then gemv_warp's xq), for
    float x the op's own kernel (rms_norm, attention_combine) then any GEMV candidate; without a
    fold an int8 GEMV's candidates include x quantized ahead too (xq).

    tune False (a prefill program's GEMV, for its steps of a few tokens only): the pick already
    cached for this weight and fold, else the default, nothing timed (on the H200, 2026-11-30, a
    1B Q4_0 file's first load spent 12 s timing and 21 s compiling candidates, every projection
    tuned twice: folded for decode, plain for the prefill program). EDGELLM_WEBGPU_GEMV set
    (gemv_forced): its configuration, nothing timed."""
    default = default_gemv_config(dev, w.cols, w.fmt)
    if not tuning_on(dev) or gemv_forced():
        return default
    key, cands = _gemv_tuning(dev, w, n_out, glu, fold, default)
    if not tune:
        return _tuner(dev).cached(GEMV_TUNING, key) or default
    return _pick_gemv(dev, w, n_out, glu, fold or {}, key, cands, default)


def _gemv_tuning(dev: Device, w, n_out: int, glu: bool, fold: dict | None, default: dict) -> tuple[tuple, list[dict]]:
    """gemv_config's tuning key and candidates for a weight and fold."""
    fold = fold or {}
    prologue = bool(fold.get("norm") or fold.get("combine"))
    key = (w.fmt, n_out, w.cols, "glu" if glu else "plain")
    if default.get("int8"):  # int8 activations: their variants alone
        planes = default.get("planes", 1)
        key += ("int8",) if planes == 1 else (f"int8x{planes}",)
        cands = gemv_candidates(dev, int8=True, planes=planes, xq=True)
    else:
        cands = [c for c in gemv_candidates(dev) if c.get("kind") != "warp" or (w.cols % 4 == 0 and (not c["stage"] or can_stage(dev, w.cols)))]
        if prologue:
            cands += [{**c, "ahead": True} for c in cands]
    if fold:
        key += (fold_tag(fold),)
        cands = [c for c in cands if (c.get("kind") == "warp" or (prologue_ahead(c) and not fold.get("rope")))
                 and not (fold.get("rope") and c["rows_per_warp"] % 2)]
    # entries cached before the candidates made ahead keep their keys (and meaning)
    if default.get("int8"):
        key += ("xq",)
    elif prologue:
        key += ("ahead",)
    return key, cands


def _pick_gemv(dev: Device, w, n_out: int, glu: bool, fold: dict, key: tuple, cands: list[dict], default: dict,
               qout: tuple[int, bool] | None = None) -> dict:
    state: dict = {}
    try:
        return _pick(dev, GEMV_TUNING, key, cands, default,
                     lambda cfg: _gemv_kernels(w, n_out, glu, cfg, fold, quantize_lanes(dev), qout, dev.subgroup_size),
                     lambda cfg: _time_gemv(dev, w, n_out, glu, cfg, fold, state, qout))
    finally:
        for c in state.get("copies", [])[1:]:
            for b in c.values():
                b.destroy()


def gemv_qout_config(dev: Device, w, n_out: int, glu: bool, fold: dict | None, qout: tuple[int, bool]) -> dict | None:
    """The configuration of a GEMV that also quantizes its output for the next GEMV's xq
    (kernels.gemv_warp's qout: 32-row blocks a workgroup), where that times no slower than this
    GEMV's own pick plus the quantize_x dispatch it saves; else None. With tuning off: the
    default where it holds 32-row blocks (as the backend decides without timings)."""
    default = default_gemv_config(dev, w.cols, w.fmt)
    if not tuning_on(dev) or gemv_forced():
        return default if default.get("kind") == "warp" and default.get("rows_per_wg", 1) % 32 == 0 else None
    key, cands = _gemv_tuning(dev, w, n_out, glu, fold, default)
    tuner = _tuner(dev)
    _pick_gemv(dev, w, n_out, glu, fold or {}, key, cands, default)  # the pick without qout (cached)
    own = tuner.entry(GEMV_TUNING, key)
    blocks = [c for c in [default, *cands] if c.get("kind") == "warp" and c.get("rows_per_wg", 1) % 32 == 0]
    if own is None or not blocks:
        return None
    qkey = key + ("qout{}{}".format(*(int(v) for v in qout)),)
    cfg = _pick_gemv(dev, w, n_out, glu, fold or {}, qkey, blocks[1:], blocks[0], qout)
    with_q = tuner.entry(GEMV_TUNING, qkey)
    quant = quantize_us(dev, n_out, *qout)
    if with_q is None or quant is None or with_q["us"] > own["us"] + quant:
        return None
    return cfg


def quantize_us(dev: Device, cols: int, planes: int, sums: bool) -> float | None:
    """Microseconds of kernels.quantize_x over one row of `cols` (a decode GEMV's x quantized
    ahead), timed once per adapter and cached."""
    from . import kernels

    lanes = quantize_lanes(dev)
    key = (cols, planes, int(sums), lanes)
    state: dict = {}
    make = lambda cfg: (kernels.quantize_x(cols, "1u", planes=planes, sums=sums, lanes=lanes),)  # noqa: E731
    _pick(dev, "webgpu_quantize_v1", key, [], {"lanes": lanes}, make,
          lambda cfg: _time_quantize(dev, cols, planes, sums, lanes, state))
    entry = _tuner(dev).entry("webgpu_quantize_v1", key)
    return entry["us"] if entry else None


def _time_quantize(dev: Device, cols: int, planes: int, sums: bool, lanes: int, state: dict) -> float:
    import numpy as np

    from . import kernels
    from .launch import Chain, Launch, upload_f32

    if "io" not in state:
        rng = np.random.default_rng(0)
        state["io"] = {"X": upload_f32(dev, rng.standard_normal(cols).astype(np.float32)),
                       **int8_x_buffers(dev, 1, cols, planes, sums)}
    L = Launch(dev, kernels.quantize_x(cols, "1u", planes=planes, sums=sums, lanes=lanes), state["io"])
    L.set_step(seq=1)
    return 1e6 * Chain(dev, [(L, quantize_x_grid(cols, 1, lanes=lanes))]).time(repeat=20)


def prologue_ahead(cfg: dict) -> bool:
    """Whether a GEMV configuration has its fold's prologue (a norm, a split merge) made by a
    dispatch of its own before the GEMV: with int8 activations x quantized there too (xq, also
    the plain quantizing of a GEMV without a prologue), with float x the op's own kernel
    ("ahead")."""
    return bool(cfg.get("xq") or cfg.get("ahead"))


def _pick(dev: Device, kernel: str, key: tuple, cands: list[dict], default: dict, make, time, rounds: int = 1) -> dict:
    """The tuner's pick for one weight: the candidates' pipelines compiled ahead where none is
    cached yet (Device.precompile; make(cfg): the kernels a configuration runs), each timed by
    time(cfg) (microseconds) `rounds` times in turn (the Tuner keeps each one's least) with the
    time counted as tuning (timing_s)."""
    tuner = _tuner(dev)
    if tuner.cached(kernel, key) is None:
        dev.precompile([k for cfg in [default, *cands] for k in _quiet_kernels(make, cfg)], now=True)
    return tuner.pick(kernel, key, cands, default, lambda cfg: _timed(time, cfg), rounds=rounds)


_TIMING_S = [0.0]  # seconds spent timing candidates in this process (cached picks time nothing)


def timing_s() -> float:
    """Seconds this process has spent timing launch configurations (the one-time part of a load)."""
    return _TIMING_S[0]


def _timed(fn, *args):
    import time

    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        _TIMING_S[0] += time.perf_counter() - t0


TIMING_BYTES = 160 << 20  # weight bytes a GEMV timing cycles through: past the L2 cache (H100, H200: 50 MB)
MAX_COPIES = 64


def weight_copies(dev: Device, w) -> list[dict]:
    """A weight's buffers by binding name, and on a GPU copies of them (device_copies): a decode
    GEMV reads its weight from memory once per token, and a timing that dispatched one copy
    again and again would read a weight smaller than the L2 cache from there (a 17.8 MB 4096 x
    4096 Q8_0 weight on an H200: 7.4 TB/s from one copy, 1.7-1.9 TB/s from copies cycled,
    2026-11-30) and rank configurations by that."""
    return device_copies(dev, {k: b for k, (b, _, _) in w.resources().items()})


def device_copies(dev: Device, bufs: dict) -> list[dict]:
    """bufs (binding name -> buffer), and on a GPU copies of them made on the device, up to
    TIMING_BYTES in all (at most MAX_COPIES): operands a timing cycles through, as a model's
    layers each read their own."""
    nbytes = sum(b.size for b in bufs.values())
    n = 1 if dev.info.software else max(1, min(MAX_COPIES, -(-TIMING_BYTES // max(nbytes, 1))))
    out = [bufs]
    if n > 1:
        enc = dev.device.create_command_encoder()
        for _ in range(n - 1):
            c = {k: dev.buffer(b.size) for k, b in bufs.items()}
            for k, b in bufs.items():
                enc.copy_buffer_to_buffer(b, 0, c[k], 0, b.size)
            out.append(c)
        dev.queue.submit([enc.finish()])
    return out


COMBINE_TIMING_SPLITS = 8  # a folded split merge is timed at this many splits (512 keys at 64 a split)


def _time_gemv(dev: Device, w, n_out: int, glu: bool, cfg: dict, fold: dict | None = None,
               state: dict | None = None, qout: tuple[int, bool] | None = None) -> float:
    """Microseconds per launch of the GEMV with this configuration on this weight, its copies
    cycled (weight_copies, made once per weight in `state`) as a model's layers are, with the
    prologue a fold adds (gemv_config's fold) on inputs of its shape; a prologue made ahead
    (prologue_ahead) timed with the GEMV as one chain of dispatches (launch.Chain), each copy
    with its own norm weight G: a layer's G is read from memory once per token, after the
    previous layer's weights went through the cache (timed apart, the quantizing dispatch of
    an RMSNorm read one G from the cache again and again, and x quantized ahead of the 8B Q8_0
    gate|up GEMV tied with the folded norm in the timings while decode ran 2-3% slower with
    it: 257.1-259.0 against 264.6-265.0 tok/s, H200 through Vulkan, 2026-11-30)."""
    import numpy as np

    from .backend import MAX_SPLITS, _grid2
    from .launch import Chain, Launch, upload_f32

    state = {} if state is None else state
    fold = fold or {}
    if "copies" not in state:
        rng = np.random.default_rng(0)
        vec = lambda n: upload_f32(dev, rng.standard_normal(n).astype(np.float32))  # noqa: E731
        io = {"Y": dev.buffer(4 * n_out)}
        copies = weight_copies(dev, w)
        if fold.get("norm"):
            io["A"] = vec(w.cols)
            if fold["norm"] == "add_rms":
                io.update(B=vec(w.cols), S=dev.buffer(4 * w.cols))
            copies = [{**c, "G": vec(w.cols)} for c in copies]
        elif fold.get("combine"):
            h, d = fold["combine"]  # per (head, split): d partial outputs, a maximum and a positive sum
            io["WS"] = upload_f32(dev, rng.random(h * MAX_SPLITS * (d + 2)).astype(np.float32) + 0.5)
        io["X"] = io["O"] = vec(w.cols)  # the GEMV's x; a prologue made ahead writes it (O)
        state["io"], state["copies"] = io, copies
    io = state["io"]
    if cfg.get("xq") and "XQ" not in io:
        from .kernels import int8_x_sums

        io.update(int8_x_buffers(dev, 1, w.cols, cfg.get("planes", 1), int8_x_sums(w.fmt)))
    if qout is not None and "YQ" not in io:  # the output quantized too (gemv_warp's qout)
        io.update({"Y" + k[1:]: b for k, b in int8_x_buffers(dev, 1, n_out, *qout).items()})
    lanes = quantize_lanes(dev)
    grids = {"quantize_x": quantize_x_grid(w.cols, 1, norm=bool(fold.get("norm")), lanes=lanes), "rms_norm": (1, 1, 1),
             "add_rms_norm": (1, 1, 1), "attention_combine": (fold.get("combine") or (1,))[:1] + (1, 1)}
    chain = []
    for k in _gemv_kernels(w, n_out, glu, cfg, fold, lanes, qout, dev.subgroup_size):  # a prologue's dispatch made ahead, then the GEMV
        L = Launch(dev, k, [{**c, **io} for c in state["copies"]])
        L.set_step(seq=1, n_splits=COMBINE_TIMING_SPLITS if fold.get("combine") else 1)
        chain.append((L, grids.get(k.name) or (*_grid2(-(-n_out // cfg["rows_per_wg"]), dev.max_groups), 1)))
    return 1e6 * Chain(dev, chain).time(repeat=max(10, len(state["copies"])))


# kernels.attention_warp's (subgroups a workgroup, keys each lane group takes at once): a split's keys
# are walked one step after another, each step a round trip to memory for its keys' K and V rows, so
# more groups or more keys a step mean fewer steps (the default first)
ATTENTION_CANDIDATES = [(4, 2), (8, 2), (4, 4), (8, 4), (2, 4)]
ATTENTION_TIMING_KEYS = 512  # decode attention timed over this many cached keys, in COMBINE_TIMING_SPLITS splits


def attention_config(dev: Device, n_heads: int, n_kv: int, head_dim: int, sg: int, cache_dtype: str,
                     tune: bool = True) -> dict:
    """kernels.attention_warp's {"warps", "keys_ahead"} for decode on this adapter: 4 subgroups and
    2 keys ahead by default, or with tuning on (tuning_on) the fastest of ATTENTION_CANDIDATES
    within 256 threads a workgroup, timed as decode splits its context (ATTENTION_TIMING_KEYS
    keys in COMBINE_TIMING_SPLITS splits, the partial results written), the KV cache's copies
    cycled past the L2 cache as the layers' caches are; cached per adapter. tune False: the
    cached pick or the default."""
    default = {"warps": 4, "keys_ahead": 2}
    if not tuning_on(dev):
        return default
    key = (n_heads, n_kv, head_dim, sg, cache_dtype)
    if not tune:
        return _tuner(dev).cached("webgpu_attention_v1", key) or default
    cands = [{"warps": w, "keys_ahead": k} for w, k in ATTENTION_CANDIDATES if sg * w <= 256]
    make = lambda cfg: (_attention_kernel(n_heads, n_kv, head_dim, sg, cache_dtype, cfg),)  # noqa: E731
    state: dict = {}
    try:
        return _pick(dev, "webgpu_attention_v1", key, cands, default, make,
                     lambda cfg: _time_attention(dev, n_heads, n_kv, head_dim, sg, cache_dtype, cfg, state))
    finally:
        for c in state.get("copies", []):
            for b in c.values():
                b.destroy()


def _attention_kernel(n_heads: int, n_kv: int, head_dim: int, sg: int, cache_dtype: str, cfg: dict):
    from . import kernels

    return kernels.attention_warp(n_heads, n_kv, head_dim, head_dim ** -0.5, "1u", partial=True,
                                  dtypes={"KC": cache_dtype, "VC": cache_dtype}, sg=sg, **cfg)


def _time_attention(dev: Device, n_heads: int, n_kv: int, head_dim: int, sg: int, cache_dtype: str, cfg: dict,
                    state: dict) -> float:
    """Microseconds of one decode attention step (the partial kernel) over ATTENTION_TIMING_KEYS
    keys in COMBINE_TIMING_SPLITS splits, each repetition on another copy of the cache (made
    once per pick in `state`: device_copies)."""
    import numpy as np

    from .launch import Chain, Launch, upload_f32

    n, splits = ATTENTION_TIMING_KEYS, COMBINE_TIMING_SPLITS
    if "copies" not in state:
        rng = np.random.default_rng(0)
        ftype = np.float16 if cache_dtype == "f16" else np.float32
        kv = {k: dev.upload(rng.standard_normal(n * n_kv * head_dim).astype(ftype)) for k in ("KC", "VC")}
        state["copies"] = device_copies(dev, kv)
        state["io"] = {"Q": upload_f32(dev, rng.standard_normal(n_heads * head_dim).astype(np.float32)),
                       "WS": dev.buffer(4 * n_heads * splits * (head_dim + 2))}
    copies, io = state["copies"], state["io"]
    L = Launch(dev, _attention_kernel(n_heads, n_kv, head_dim, sg, cache_dtype, cfg), [{**c, **io} for c in copies])
    L.set_step(seq=1, start=n - 1, kv_len=n, split_len=-(-n // splits), n_splits=splits)
    return 1e6 * Chain(dev, [(L, (n_heads, 1, splits))]).time(repeat=max(10, len(copies)))


PREFILL_ATTENTION_ROWS = 512  # prefill attention timed over a chunk of this many tokens from position 0
PREFILL_ATTENTION_KINDS = tuple(PREFILL_ATTENTIONS)  # "tiled" (kernels.attention_tiled, the default), "blocked"


def prefill_attention_kind(dev: Device, n_heads: int, n_kv: int, head_dim: int, cache_dtype: str,
                           workgroup_bytes: int, tune: bool = True) -> str:
    """The prefill's causal attention kernel: "tiled" (kernels.attention_tiled, a thread per
    score; the default) or, with tuning on (tuning_on) and where it applies (head size a multiple
    of 64), "blocked" (kernels.attention_blocked, register blocks) if it times faster over a
    PREFILL_ATTENTION_ROWS-token chunk; cached per adapter. EDGELLM_WEBGPU_PREFILL_ATTN=tiled|blocked
    forces one (A/B measurement, tests). tune False: the cached pick or the default."""
    from ...errors import GraphError
    from .kernels import attention_blocked_keys

    fits = attention_blocked_keys(head_dim, workgroup_bytes) > 0
    v = os.environ.get("EDGELLM_WEBGPU_PREFILL_ATTN", "").strip()
    if v:
        if v not in PREFILL_ATTENTION_KINDS:
            raise GraphError(f"EDGELLM_WEBGPU_PREFILL_ATTN={v!r}: expected one of {', '.join(PREFILL_ATTENTION_KINDS)}")
        return v if fits or v == "tiled" else "tiled"
    default = {"kind": "tiled"}
    if not fits or not tuning_on(dev):
        return default["kind"]
    key = (n_heads, n_kv, head_dim, cache_dtype, PREFILL_ATTENTION_ROWS)
    if not tune:
        return (_tuner(dev).cached("webgpu_prefill_attention_v1", key) or default)["kind"]
    make = lambda cfg: (_prefill_attention(n_heads, n_kv, head_dim, cache_dtype, workgroup_bytes, cfg["kind"]),)  # noqa: E731
    state: dict = {}
    return _pick(dev, "webgpu_prefill_attention_v1", key, [{"kind": "blocked"}], default, make,
                 lambda cfg: _time_prefill_attention(dev, n_heads, n_kv, head_dim, cache_dtype, workgroup_bytes,
                                                     cfg["kind"], state), rounds=PREFILL_ROUNDS)["kind"]


def _prefill_attention(n_heads: int, n_kv: int, head_dim: int, cache_dtype: str, workgroup_bytes: int, kind: str):
    return PREFILL_ATTENTIONS[kind](n_heads, n_kv, head_dim, head_dim ** -0.5, "step.seq", cache_dtype=cache_dtype,
                workgroup_bytes=workgroup_bytes, dtypes={"KC": cache_dtype, "VC": cache_dtype})


def prefill_attention_grid(kind: str, n_heads: int, head_dim: int, rows: int, workgroup_bytes: int) -> tuple[int, int, int]:
    """The dispatch grid of prefill_attention_kind's kernel over `rows` query rows."""
    from . import kernels

    bm = kernels.BLOCKED_ROWS if kind == "blocked" else kernels.attention_tile_rows(head_dim, workgroup_bytes)
    return n_heads, -(-rows // bm), 1


def _time_prefill_attention(dev: Device, n_heads: int, n_kv: int, head_dim: int, cache_dtype: str,
                            workgroup_bytes: int, kind: str, state: dict) -> float:
    """Microseconds of one PREFILL_ATTENTION_ROWS-token chunk's causal attention from position 0
    (the chunk's K and V rows are in the L2 cache after the q|k|v product wrote them, as here)."""
    import numpy as np

    from .launch import Chain, Launch, upload_f32

    n = PREFILL_ATTENTION_ROWS
    if "io" not in state:
        rng = np.random.default_rng(0)
        ftype = np.float16 if cache_dtype == "f16" else np.float32
        state["io"] = {"Q": upload_f32(dev, rng.standard_normal(n * n_heads * head_dim).astype(np.float32)),
                       "O": dev.buffer(4 * n * n_heads * head_dim),
                       **{k: dev.upload(rng.standard_normal(n * n_kv * head_dim).astype(ftype)) for k in ("KC", "VC")}}
    L = Launch(dev, _prefill_attention(n_heads, n_kv, head_dim, cache_dtype, workgroup_bytes, kind), state["io"])
    L.set_step(seq=n, start=0)
    return 1e6 * Chain(dev, [(L, prefill_attention_grid(kind, n_heads, head_dim, n, workgroup_bytes))]).time(repeat=3)


def _tuner(dev: Device):
    t = _TUNERS.get(dev.info.key())
    if t is None:
        from ..cuda.tuning import Tuner

        t = _TUNERS[dev.info.key()] = Tuner("webgpu|" + dev.info.key(), enabled=True, timer=lambda fn: fn())
    return t


# (tokens x features x k) tiles of 256 threads; workgroup memory (tm + (2 if glu) tn) * tk * 4 bytes.
# The first that fits is the default: 128x64x32 was the tuner's pick for 4 of 6 Llama projections
# on the H100 (2026-11-24; 3.4-4.9 TFLOP/s against 2.7-4.2 for 64x64x16)
DEFAULT_GEMMS = [{"tm": 128, "tn": 64, "tk": 32}, {"tm": 64, "tn": 64, "tk": 16}]
DEFAULT_GEMM = DEFAULT_GEMMS[-1]  # fits WebGPU's default 16 KiB of workgroup memory
GEMM_CANDIDATES = [{"tm": 64, "tn": 64, "tk": 32}, {"tm": 128, "tn": 64, "tk": 16}, {"tm": 64, "tn": 128, "tk": 16},
                   {"tm": 128, "tn": 128, "tk": 16}, {"tm": 128, "tn": 128, "tk": 8}, {"tm": 128, "tn": 64, "tk": 32},
                   {"tm": 64, "tn": 64, "tk": 16}]
# kernels.gemm's register prefetch: on the H200 through Vulkan (2026-11-30, 512 tokens) the best of
# the float tiles for 14336x4096 Q4_0 (21.2 against 18.8 TFLOP/s) and 4096x14336 Q8_0, slower elsewhere
GEMM_CANDIDATES += [{"tm": 128, "tn": 128, "tk": 16, "pre": True}, {"tm": 128, "tn": 64, "tk": 32, "pre": True},
                    {"tm": 128, "tn": 64, "tk": 16, "pre": True}]


def gemm_fits(dev: Device, cfg: dict, glu: bool) -> bool:
    return (cfg["tm"] + (2 if glu else 1) * cfg["tn"]) * cfg["tk"] * 4 <= dev.max_workgroup_memory


def default_gemm_config(dev: Device, glu: bool) -> dict:
    """The first of DEFAULT_GEMMS that fits the adapter's workgroup memory."""
    return dict(next((c for c in DEFAULT_GEMMS if gemm_fits(dev, c, glu)), DEFAULT_GEMM))


def gemm_config(dev: Device, w, n_out: int, glu: bool, rows: int) -> dict:
    """The prefill GEMM's tiles for one weight at `rows` tokens: the first of DEFAULT_GEMMS that
    fits the adapter's workgroup memory, or with tuning on (tuning_on; never on a software
    adapter) the fastest of it and the GEMM_CANDIDATES that fit, timed on this adapter and cached
    like the GEMV's."""
    default = default_gemm_config(dev, glu)
    if not tuning_on(dev) or dev.info.software:
        return default
    key = (w.fmt, n_out, w.cols, rows, "glu" if glu else "plain")
    cands = [c for c in GEMM_CANDIDATES if gemm_fits(dev, c, glu)]
    return _pick(dev, "webgpu_gemm_v3", key, cands, default, lambda cfg: _prefill_kernels(w, n_out, glu, cfg),
                 lambda cfg: _time_prefill(dev, w, n_out, glu, rows, cfg))


def staged(cfg: dict) -> dict:
    """A GEMV configuration for a GEMV whose prologue makes x itself (an embedding; a fold timed
    so): x quantized there, staged, not by a dispatch ahead (prologue_ahead)."""
    c = {k: v for k, v in cfg.items() if k not in ("xq", "ahead")}
    return {**c, "stage": True} if cfg.get("xq") else c


def _gemv_kernels(w, n_out: int, glu: bool, cfg: dict, fold: dict | None = None, lanes: int = 1,
                  qout: tuple[int, bool] | None = None, sg: int = 0) -> tuple:
    """The kernels a decode GEMV configuration runs, with the prologue of `fold` (gemv_config):
    in the GEMV, or made ahead (prologue_ahead) by a dispatch of its own first (quantize_x with
    `lanes` lanes a block, or rms_norm reducing across subgroups of `sg` lanes); qout: the GEMV
    also quantizes its output (gemv_warp's qout)."""
    from . import kernels
    from .backend import MAX_SPLITS, combine_unroll

    fold, opts = fold or {}, ({"qout": qout} if qout is not None else {})
    norm = {"norm": fold["norm"], "eps": 1e-5} if fold.get("norm") else {}
    if cfg.get("xq"):  # x quantized by its own dispatch first (with the prologue)
        planes, sums = cfg.get("planes", 1), kernels.int8_x_sums(w.fmt)
        merge = {"combine": fold["combine"]} if fold.get("combine") else {}
        return (kernels.quantize_x(w.cols, "1u", planes=planes, sums=sums, lanes=lanes, **norm, **merge),
                kernels.decode_gemv(w.desc(), n_out, "1u", cfg, glu=glu, **opts))
    if cfg.get("ahead"):  # the op's own kernel first, the GEMV reading its output
        gemv = kernels.decode_gemv(w.desc(), n_out, "1u", staged(cfg), glu=glu, **opts)
        if fold.get("combine"):
            return (kernels.attention_combine(*fold["combine"], "1u"), gemv)
        if norm:
            return (kernels.rms_norm(w.cols, 1e-5, "1u", add=norm["norm"] == "add_rms", sg=sg), gemv)
        return (gemv,)
    if fold:
        cfg = staged(cfg)
    if norm:
        opts.update(norm)
    elif fold.get("combine"):
        cfg = {**cfg, "stage": True}
        opts["combine"] = (*fold["combine"], MAX_SPLITS, combine_unroll())
    return (kernels.decode_gemv(w.desc(), n_out, "1u", cfg, glu=glu, **opts),)


def _prefill_kernels(w, n_out: int, glu: bool, cfg: dict, lanes: int = 1) -> tuple:
    """The kernels a prefill configuration runs: the float product, or x's quantization (`lanes`
    lanes a block) and the int8 product."""
    from . import kernels

    if "int8" not in cfg:
        return (kernels.gemm(w.desc(), n_out, "step.seq", glu=glu, **cfg),)
    planes, tiles = cfg["int8"], {k: v for k, v in cfg.items() if k != "int8"}
    return (kernels.quantize_x(w.cols, "step.seq", planes=planes, sums=kernels.int8_x_sums(w.fmt), lanes=lanes),
            kernels.gemm_int8(w.desc(), n_out, "step.seq", glu=glu, planes=planes, **tiles))


def _quiet_kernels(make, cfg: dict) -> tuple:
    """make(cfg), or none where a configuration cannot be generated (its timing skips it too)."""
    try:
        return make(cfg)
    except Exception:  # noqa: BLE001
        return ()


# the prefill products' candidates are timed this many times in turn, each keeping its least (the
# Tuner's rounds): a pipeline's first pass after its compile timed up to 5 times slower than its
# second, and two picks of the 8B Q4_0 file's products made minutes apart on one H200 through
# Vulkan (2026-11-30), each the faster of two passes in a row, ranked the tiles differently
# enough that pp512 ran 1,156 tok/s on one set and 1,481 on the other
PREFILL_ROUNDS = 3


# the int8 prefill product (kernels.gemm_int8): tiles (tokens x features) of 256 threads, per
# plane count; the first is the default. On the H200 through Vulkan (2026-11-30, 512 tokens, the
# 8B projections in Q4_0 and Q8_0; benchmarks/bench_webgpu.py gemm section) one plane ran 50-63
# TFLOP/s at 128 x 64 (x's quantization included), two 22-31 at 128 x 128 (64 x 64 the best on
# 6144 and 14336 features), the float product 14-21 (its best tiles 19-21)
GEMM_INT8_CANDIDATES = {1: [{"tm": 128, "tn": 64}, {"tm": 64, "tn": 64}, {"tm": 64, "tn": 128}, {"tm": 128, "tn": 128}],
                        2: [{"tm": 128, "tn": 128}, {"tm": 64, "tn": 64}, {"tm": 128, "tn": 64}]}


def prefill_int8_planes(dev: Device, fmt: str | None, cols: int | None) -> int:
    """How many int8 planes of activations the prefill product of a weight takes (kernels.gemm_int8
    after kernels.quantize_x; 0: the float product, kernels.gemm): EDGELLM_WEBGPU_PREFILL_INT8=0, 1
    or 2; unset, 2 on a GPU for the formats of kernels.INT8_GEMM_FORMATS, 0 on a software adapter
    (whose prefill runs as GEMVs). Two planes keep the float product's accuracy (the default model
    on lavapipe, 512-token chunks: greedy text identical to the cpu backend's on five prompts,
    teacher-forced top-1 100% over 256 positions; one plane: 2 of 5, 97.3%, and the capital
    question answered wrong)."""
    v = os.environ.get("EDGELLM_WEBGPU_PREFILL_INT8", "").strip()
    if v not in ("", "0", "1", "2"):
        raise EdgeLLMError(f"EDGELLM_WEBGPU_PREFILL_INT8={v!r}: expected 0 (float products), 1 or 2 (int8 planes)")
    n = int(v) if v else (0 if dev.info.software else 2)
    return n if n and fmt in INT8_GEMM_FORMATS and cols is not None and cols % 32 == 0 else 0


def prefill_config(dev: Device, w, n_out: int, glu: bool, rows: int, planes: int) -> dict:
    """The prefill product of a weight that can take int8 activations (prefill_int8_planes > 0):
    {"int8": planes, "tm", "tn"} (kernels.quantize_x then kernels.gemm_int8) by default, or with
    tuning on (tuning_on) the fastest of the int8 tiles (x's quantization timed with them) and the
    float product's default and largest tiles ({"tm", "tn", "tk"}, kernels.gemm; with two planes
    the results agree to float rounding, so either may win), timed at `rows` tokens and cached."""
    default = {"int8": planes, **GEMM_INT8_CANDIDATES[planes][0]}
    if not tuning_on(dev) or dev.info.software:
        return default
    key = (w.fmt, n_out, w.cols, rows, "glu" if glu else "plain", planes)
    cands = [{"int8": planes, **c} for c in GEMM_INT8_CANDIDATES[planes]]
    if planes == 2:
        cands += [c for c in (default_gemm_config(dev, glu), {"tm": 128, "tn": 128, "tk": 16, "pre": True})
                  if gemm_fits(dev, c, glu)]
    return _pick(dev, "webgpu_prefill_v2", key, cands, default,
                 lambda cfg: _prefill_kernels(w, n_out, glu, cfg, quantize_lanes(dev)),
                 lambda cfg: _time_prefill(dev, w, n_out, glu, rows, cfg), rounds=PREFILL_ROUNDS)


def int8_x_buffers(dev: Device, rows: int, cols: int, planes: int, sums: bool) -> dict:
    """Buffers for x quantized by kernels.quantize_x (rows x cols), by binding name."""
    from .kernels import int8_x_sizes

    return {k: dev.buffer(n) for k, n in int8_x_sizes(rows, cols, planes, sums).items()}


_PREFILL_IO: dict = {}  # _time_prefill's operands for the product being tuned (one at a time)


def _prefill_io(dev: Device, w, n_out: int, rows: int, planes: int) -> dict:
    """The x (random, the same values each time), y and int8-x buffers of a prefill product's
    timing, made once for all its candidates and rounds (an 8B product's x is 29 MB at 512 rows,
    uploaded for each of ~25 timings before), dropped when the next product's are made."""
    import numpy as np

    from .kernels import int8_x_sums
    from .launch import upload_f32

    key = (id(dev), w.fmt, w.cols, n_out, rows)  # what the buffers' sizes depend on
    if _PREFILL_IO.get("key") != key:
        _PREFILL_IO.clear()
        _PREFILL_IO.update(key=key, io={"X": upload_f32(dev, np.random.default_rng(0).standard_normal(rows * w.cols)
                                                        .astype(np.float32)),
                                        "Y": dev.buffer(4 * n_out * rows)})
    io = _PREFILL_IO["io"]
    if planes and ("int8", planes) not in io:
        io["int8", planes] = int8_x_buffers(dev, rows, w.cols, planes, int8_x_sums(w.fmt))
    return {"X": io["X"], "Y": io["Y"], **(io["int8", planes] if planes else {})}


def _time_prefill(dev: Device, w, n_out: int, glu: bool, rows: int, cfg: dict) -> float:
    """Microseconds of one prefill product so configured at `rows` tokens (an int8 one with x's
    quantization, the two timed as one chain of dispatches)."""
    from .launch import Chain, Launch

    bufs = {k: b for k, (b, _, _) in w.resources().items()}
    bufs.update(_prefill_io(dev, w, n_out, rows, cfg.get("int8", 0)))
    chain, lanes = [], quantize_lanes(dev)
    for k in _prefill_kernels(w, n_out, glu, cfg, lanes):
        L = Launch(dev, k, bufs)
        L.set_step(seq=rows)
        chain.append((L, quantize_x_grid(w.cols, rows, lanes=lanes) if k.name == "quantize_x" else
                      (-(-n_out // cfg["tn"]), -(-rows // cfg["tm"]), 1)))
    return 1e6 * Chain(dev, chain).time(repeat=3)
