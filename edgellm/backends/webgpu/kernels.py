"""WGSL kernel templates. Each function renders one kernel's source for given shapes and storage
descriptors (codegen.py) and returns a `Kernel`: its source, its bindings in order, its workgroup
size. Shapes, epsilons and scales are baked in as constants (a kernel is specialised per shape;
every layer of a model shares the same sources, so pipelines are made once per model).

Per-step values (tokens in this step, start position, context length, attention splits) come
from the `Step` uniform bound first in every kernel, so that a program's bind groups and
pipelines are made once and only the uniform changes per step.

Row counts: a template takes `rows`, a WGSL expression ("step.seq" for [seq, n] tensors, "1u"
for a tensor of one row), and the host dispatches as many rows as the step has.
Where a reduction across threads is needed, `subgroup=True` uses subgroupShuffleXor (adapters
with the `subgroup` feature; the lanes reduced together must lie in one subgroup), else
workgroup memory and barriers.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, replace
from string import Template

from .codegen import HELPERS, ActDesc, Binding, WeightDesc

STEP_STRUCT = ("struct Step { seq: u32, start: u32, kv_len: u32, split_len: u32, n_splits: u32, "
               "p0: u32, p1: u32, p2: u32 }")
STEP_BYTES = 32
STEP = Binding("step", "Step", "uniform")
NEG = "-1.0e30"  # a finite -inf: exp(NEG - m) is 0 and NEG - NEG is 0, never NaN


@dataclass(frozen=True)
class Kernel:
    name: str
    source: str
    bindings: tuple[Binding, ...]
    workgroup: int

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(b.kind for b in self.bindings)


def _render(name: str, parts: list, body: str, wg: int, dtypes: dict | None = None, step: bool = True,
            **consts) -> Kernel:
    """Assemble a kernel: Step + the parts' bindings, helpers, accessors, then the body template
    with ${...} constants substituted. dtypes: binding name -> element type of the tensor bound
    there ("f32", "f16"), overriding the template's default: the caller's storage decides, the
    template's maths stays the same. step=False leaves the Step uniform out (kernels whose every
    size is a constant: the imported networks' kernels, nd_kernels.py)."""
    bindings: list[Binding] = [STEP] if step else []
    acc = []
    f16 = False
    for p, x in parts:  # (descriptor, accessor argument) pairs
        if isinstance(p, ActDesc) and dtypes and p.name in dtypes:
            p = replace(p, dtype=dtypes[p.name])
        bindings += p.bindings()
        acc.append(p.accessors(x) if isinstance(p, WeightDesc) else p.accessors())
        f16 |= getattr(p, "dtype", "f32") == "f16"
    decls = "\n".join(b.decl(i) for i, b in enumerate(bindings))
    src = "\n".join([("enable f16;" if f16 else ""), STEP_STRUCT if step else "", decls, HELPERS, *acc,
                     Template(body).substitute(WG=wg, **consts)])
    return Kernel(name, src, tuple(bindings), wg)


def _tree(var: str, lane: str, width: str, op: str = "+") -> str:
    """A reduction of red[] over `width` consecutive lanes in workgroup memory (all threads call it)."""
    comb = f"red[lid] = red[lid] + red[lid + s];" if op == "+" else "red[lid] = max(red[lid], red[lid + s]);"
    return (f"red[lid] = {var}; workgroupBarrier();\n"
            f"    for (var s = {width} / 2u; s > 0u; s = s >> 1u) {{ if ({lane} < s) {{ {comb} }} workgroupBarrier(); }}\n")


def _lane_sums(var: str, width: int, arr: str) -> str:
    """`var` summed across each `width` lanes by subgroup shuffles, each group's sum stored in
    arr[lid / width] (a workgroup barrier before arr is read: _sum_of)."""
    return (f"for (var s = {width // 2}u; s > 0u; s = s >> 1u) {{ {var} += subgroupShuffleXor({var}, s); }}\n"
            f"    if (lid % {width}u == 0u) {{ {arr}[lid / {width}u] = {var}; }}")


def _sum_of(arr: str, n: str, out: str) -> str:
    """`var out` = the sum of arr[0 .. n) (every thread reads them all: n a few dozen at most)."""
    return f"var {out} = 0.0;\n    for (var i = 0u; i < {n}; i++) {{ {out} += {arr}[i]; }}"


# -- matrix products ------------------------------------------------------------------------------
def gemv(w: WeightDesc, n_out: int, rows: str, *, bias: bool = False, residual: bool = False, glu: bool = False,
         rows_per_wg: int = 4, wg: int = 128, subgroup: bool = False, x_vec: int = 4, rows_per_thread: int = 1, dtypes: dict | None = None) -> Kernel:
    """y[t, c] = sum_k x[t, k] W[c, k] (+ bias[c]) (+ res[t, c]); glu: silu(W[c] x) * (W[c + n_out] x).
    Decode-stage (few rows): rows_per_wg output features per workgroup; TPR = wg * rows_per_thread /
    rows_per_wg threads per feature group stride over its blocks (16-byte loads); each thread reads
    a block of x once for rows_per_thread features; then a reduction over the TPR threads.
    Grid (features / rows_per_wg, 1, rows)."""
    nr = rows_per_thread
    tpr = wg * nr // rows_per_wg
    assert tpr * rows_per_wg == wg * nr and tpr & (tpr - 1) == 0 and tpr <= wg, (wg, rows_per_wg, nr)
    parts = [(w, "X"), (ActDesc("X", vec=x_vec), None), (ActDesc("Y"), None)]
    if bias:
        parts.append((ActDesc("B"), None))
    if residual:
        parts.append((ActDesc("R"), None))
    na = nr * (2 if glu else 1)  # accumulators per thread
    if subgroup:
        red = f"for (var s = TPR / 2u; s > 0u; s = s >> 1u) {{ for (var a = 0u; a < {na}u; a++) {{ acc[a] += subgroupShuffleXor(acc[a], s); }} }}"
        decl = ""
    else:
        red = (f"for (var a = 0u; a < {na}u; a++) {{ red[a * WG + lid] = acc[a]; }}\n    workgroupBarrier();\n"
               "    for (var s = TPR / 2u; s > 0u; s = s >> 1u) {\n"
               f"        if (lane < s) {{ for (var a = 0u; a < {na}u; a++) {{ red[a * WG + lid] += red[a * WG + lid + s]; }} }}\n"
               "        workgroupBarrier();\n    }\n"
               f"    for (var a = 0u; a < {na}u; a++) {{ acc[a] = red[a * WG + lid]; }}")
        decl = f"var<workgroup> red: array<f32, {wg * na}>;"
    epi = ""
    if glu:
        epi += "y = y / (1.0 + exp(-y)) * acc[NR + r];\n"
    if bias:
        epi += "            y += B_ld(col);\n"
    if residual:
        epi += "            y += R_ld(t * N + col);\n"
    body = """
const N: u32 = ${N}u; const K: u32 = ${K}u; const NB: u32 = ${NB}u; const BLK: u32 = ${BLK}u;
const ROWS: u32 = ${ROWS}u; const TPR: u32 = ${TPR}u; const WG: u32 = ${WG}u; const NR: u32 = ${NR}u;
${DECL}
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = wid.z;
    let lane = lid % TPR;
    let c0 = (wid.x + wid.y * nwg.x) * ROWS + (lid / TPR) * NR;
    var acc: array<f32, ${NA}>;
    if (c0 < N && t < ${ROWS_EXPR}) {
        for (var b = lane; b < NB; b += TPR) {
            let xv = W_xblock(t * K + b * BLK);
            for (var r = 0u; r < NR; r++) {
                let col = min(c0 + r, N - 1u);  // a thread's last features may lie past N: computed, not stored
                acc[r] += W_dotv(col, b, xv);
                ${GLU_DOT}
            }
        }
    }
    ${RED}
    if (lane == 0u && t < ${ROWS_EXPR}) {
        for (var r = 0u; r < NR; r++) {
            let col = c0 + r;
            if (col < N) {
                var y = acc[r];
                ${EPI}
                Y_st(t * N + col, y);
            }
        }
    }
}
"""
    return _render("gemv", parts, body, wg, N=n_out, K=w.cols, NB=w.nblocks, BLK=w.block, ROWS=rows_per_wg,
                   TPR=tpr, NR=nr, NA=na, DECL=decl, RED=red, EPI=epi, ROWS_EXPR=rows,
                   GLU_DOT="acc[NR + r] += W_dotv(col + N, b, xv);" if glu else "", dtypes=dtypes)


@dataclass(frozen=True)
class WarpKernel(Kernel):
    rows_per_group: int = 1  # output features per workgroup (warps x rows per warp)


# weights in one unit of quants (16 bytes; the six-bit layouts: a block's nibbles and its top bits)
_UNIT_ELEMS = {"F16": 8, "Q8_0": 16, "Q4_0": 32, "Q4_1": 32, "Q6": 32, "Q6M": 32}


def _unit_dot(fmt: str, q: str, x: str, d: str, m: str) -> str:
    """WGSL expression: one 16-byte unit `q` (vec4<u32>) of quants dotted with the x vec4s named
    x + "0".. (its scale `d`, Q4_1's minimum `m` times the x sum `x + "s"`). Six-bit units: the
    block's top-bit words q + "a", q + "b", its two scales `d` (a vec2) and Q6M's two minimums `m`
    times the half sums of x, x + "sl" and x + "sh"."""
    if fmt in ("Q6", "Q6M"):
        lo = " + ".join(f"dot(b6(q6lo({q}.{c}, {q}a, {i}u)), {x}{i})" for i, c in enumerate("xyzw"))
        hi = " + ".join(f"dot(b6(q6hi({q}.{c}, {q}b, {i}u)), {x}{i + 4})" for i, c in enumerate("xyzw"))
        e = f"({lo}) * {d}.x + ({hi}) * {d}.y"
        return e + (f" + {x}sl * {m}.x + {x}sh * {m}.y" if fmt == "Q6M" else "")
    if fmt == "F16":
        return f"dot(vec4<f32>(h2({q}.x), h2({q}.y)), {x}0) + dot(vec4<f32>(h2({q}.z), h2({q}.w)), {x}1)"
    if fmt == "Q8_0":
        s = " + ".join(f"dot(i8x4({q}.{c}), {x}{i})" for i, c in enumerate("xyzw"))
        return f"({s}) * {d}"
    off = "8388616.0" if fmt == "Q4_0" else "8388608.0"
    s = " + ".join(f"dot(lo4({q}.{c}, {off}), {x}{i}) + dot(hi4({q}.{c}, {off}), {x}{i + 4})" for i, c in enumerate("xyzw"))
    return f"({s}) * {d}" if fmt == "Q4_0" else f"({s}) * {d} + {x}s * {m}"


INT8_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q6", "Q6M")  # gemv_warp's int8 activations


def _unit_dot_int8(fmt: str, q: str, x: str, d: str, m: str, planes: int = 1) -> str:
    """WGSL expression: one 16-byte unit `q` of quants dotted with int8 x by packed dot products
    (x + "q" the unit's 16 codes for Q8_0, whose unit is half a block; else x + "l", x + "h" the
    block's first and second 16, x + "s" their integer sums), times x's block scale x + "d". A
    4-bit or 6-bit code (0..15, 0..63) is a non-negative int8 as it stands; its offset (8, 32)
    and a minimum (Q4_1, Q6M) multiply the codes' sums, so the only float work is per block.
    planes 2: x is 254 * (its first plane's codes) + (the second's, x + "q2" etc.), each dot
    product taken over both planes and combined in 32-bit integers."""
    def dots(words: list[str], xs: str) -> str:
        one = " + ".join(f"dot4I8Packed({wd}, {xs}.{c})" for wd, c in zip(words, "xyzw"))
        if planes == 1:
            return one
        return f"254 * ({one}) + " + " + ".join(f"dot4I8Packed({wd}, {xs}2.{c})" for wd, c in zip(words, "xyzw"))
    if fmt == "Q8_0":
        return f"f32({dots([f'{q}.{c}' for c in 'xyzw'], x + 'q')}) * ({d} * {x}d)"
    if fmt in ("Q4_0", "Q4_1"):
        lo = dots([f"({q}.{c} & 0x0F0F0F0Fu)" for c in "xyzw"], x + "l")
        hi = dots([f"(({q}.{c} >> 4u) & 0x0F0F0F0Fu)" for c in "xyzw"], x + "h")
        if fmt == "Q4_0":
            return f"f32({lo} + {hi} - 8 * ({x}s.x + {x}s.y)) * ({d} * {x}d)"
        return f"f32({lo} + {hi}) * ({d} * {x}d) + {m} * ({x}d * f32({x}s.x + {x}s.y))"
    lo = dots([f"q6lo({q}.{c}, {q}a, {i}u)" for i, c in enumerate("xyzw")], x + "l")
    hi = dots([f"q6hi({q}.{c}, {q}b, {i}u)" for i, c in enumerate("xyzw")], x + "h")
    e = f"(f32({lo} - 32 * {x}s.x) * {d}.x + f32({hi} - 32 * {x}s.y) * {d}.y) * {x}d"
    return e + (f" + ({m}.x * f32({x}s.x) + {m}.y * f32({x}s.y)) * {x}d" if fmt == "Q6M" else "")


def gemv_warp(w: WeightDesc, n_out: int, rows: str, *, rows_per_warp: int = 1, wg: int = 256, sg: int = 32,
              unroll: int = 4, subgroup: bool = True, bias: bool = False, residual: bool = False, glu: bool = False,
              norm: str | None = None, eps: float = 1e-6, stage: bool = False, rows_per_wg: int | None = None,
              rope: "RopeFold | None" = None, combine: tuple[int, ...] | None = None,
              embed: WeightDesc | None = None, pipeline: bool = False, split: int = 1, int8: bool = False,
              planes: int = 1, xq: bool = False, qout: tuple[int, bool] | None = None,
              dtypes: dict | None = None) -> WarpKernel:
    """The decode GEMV as one subgroup (sg lanes, a GPU's warp) per `rows_per_warp` output features:
    the lanes stride along the rows in 16-byte units of quants (a warp reads 16 * sg contiguous
    bytes per row per unit: coalesced), each lane issuing the loads of `unroll` units (and their
    scales) for all its rows before any arithmetic, so that that many loads per lane are in flight
    (the loop's trip count is not known to the driver's compiler, which does not pipeline it:
    H100 through Vulkan, 4096x14336 F16, one unit per step 6.6% of copy bandwidth); x is read per
    unit once for all the lane's rows; the partial sums are reduced across the subgroup by
    shuffles (or, without subgroups, in workgroup memory). Code generated unrolled: no arrays in
    function scope. glu: silu(W[c] x) * (W[c + n_out] x). Grid (features / rows_per_group, 1, rows).

    norm "rms": x = rms_norm(A) * G computed here (the RMSNorm before a projection, folded in: one
    dispatch and one barrier fewer per norm). Since W (A * G / rms) = (W (A * G)) / rms, the
    workgroup stages (or reads) A * G as it is and sums A^2 in the same pass; the sum is reduced
    across the workgroup after the product's loop and 1 / rms multiplies the product's sums before
    the epilogue (int8 codes of A * G are those of A * G / rms: the same blocks, scales 1 / rms
    apart). Until 2026-11-30 each workgroup first reduced sum(A^2) of its row (a pass over A and
    a tree of barriers) before staging x: on the H200 the 8B q|k|v projection with its norm and
    RoPE folded took 17.2 us for 14 MB, the output projection 10.6 us for 9.4 MB. norm "add_rms": x =
    rms_norm(A + B) * G, and the sum A + B (the residual stream) is also written to S by the
    first workgroup of each row. Bindings A, G (and B, S) instead of X; a bias is then bound
    as BIAS. embed (with norm "rms"): A is the embedding (weight `embed`, a WeightDesc named E)
    of the step's tokens (binding TOK, the last), read here from the weight, and written to S by
    the first workgroup of each row (the embedding op's dispatch folded in too).

    rope: W is a fused q|k|v projection whose result goes through RoPE and into the KV cache
    (rope_qkv_store's work done here, without a dispatch of its own; RopeFold): each lane 0 holds
    adjacent features (2i, 2i+1) (rows_per_warp even, rows start even), a rotation pair, rotates
    the q and k pairs with COS/SIN[pos, i] (the rope kernel's tables) and writes q to Y ([rows,
    q_dim]), k and v to row `pos` of KC and VC. Neox pairs (i, i + n_rot / 2) lie half a head
    apart: there the lanes' features 2i, 2i+1 of a head are its weight rows i and i + n_rot / 2
    (RopeFold.neox; rope_row maps them), stored back to those columns.

    combine (n_heads, head_dim, max_splits[, unroll]): x is the attention output still split over the
    context (attention(partial=True)'s WS: per row, head and split the unnormalised output, its
    maximum and sum), merged here as attention_combine does, once per workgroup into the staged x
    (stage required): one dispatch fewer per layer where decode attention is split. Binding WS
    instead of X; the weights of each (head, split) in workgroup memory (8 * heads * max_splits
    bytes).

    stage: the workgroup first copies its row of x (normalized where a norm is folded) into
    workgroup memory (4 * K bytes; K a multiple of 32), and the lanes read x from there instead
    of from the storage buffer: a 4-bit weight's x traffic is 8 times its own bytes. Positions are
    XOR-swizzled (vec4 index c at c ^ ((c >> 3) & 7)) so that the 8 lanes of a 128-byte
    shared-memory phase, each reading the same element of consecutive units, hit distinct banks.

    pipeline: the loop runs a constant number of steps (the driver's compiler sees its trip count)
    and each step issues the next step's weight loads before its own arithmetic, the first
    step's before the prologue (x staging, a folded norm's reduction): the weights stream while
    the workgroup stages x and while it multiplies, instead of the loads of a step waiting for
    the previous step's arithmetic.

    split: `split` subgroups share each group of rows_per_warp rows, striding it together (sg *
    split lanes per row; their sums meet in workgroup memory after the subgroup reductions): as
    many warps as a GPU holds in flight, where one warp per few rows would leave most of it idle
    (4,096 rows at 2 per warp are 2,048 warps; an H200 holds 8,448).

    int8 (INT8_FORMATS, x staged): x is staged as int8 per 32-element block with one float scale
    (amax / 127, pack4x8snorm) and, for the formats with offsets or minimums, the integer sums of
    each half block's codes, as llama.cpp's Q8_1 activations; a unit's products are packed dot
    products (four dot4I8Packed for Q8_0's 16 bytes, eight for a 4-bit or 6-bit block's 32 codes,
    taken from the quants by masks and shifts): a quarter of the f32 staging's workgroup-memory
    traffic and of its bytes, and no per-element float conversion (4 instructions per weight
    byte for Q8_0's float path, 8 for Q4_0's; the integer path's about 0.5 and 0.6). Activations
    are rounded to 8 bits: results differ from the float path by that rounding. planes 2: a
    second int8 plane holds each block's rounding residual (x = d / 254 * (254 q1 + q2), the
    residual's step 1/254 of the first's), twice the dot products for about 16-bit activations.
    With subgroups of 8 lanes or more, x is staged a vec4 a thread, a block's maximum and code
    sums shuffled between its 8 lanes (every thread busy, where a block a thread keeps K / 32 of
    them: the folded split merge's and norm's loads then run on a quarter of the threads).

    xq (with int8): x arrives quantized (kernels.quantize_x's XQ, XD, XS, XQ2, a dispatch before
    this one) and the lanes read its codes from there (the cache) beside the weights: no staging,
    no workgroup memory and no barrier, where the staging quantizes all of x in every workgroup
    before its first weight load (the 14,336-input down projection of an 8B model at 34-43% of
    the read rate on the H200, 2026-11-30). Not with a norm, merge or embedding prologue.

    qout (planes, sums): y is also quantized for the next GEMV's xq as quantize_x would (the same
    rounding; int8_x_parts named YQ, YD, YS, YQ2): the workgroup's outputs (a multiple of 32
    rows, 32-aligned) meet in workgroup memory and a thread per 32-block stores its codes,
    scale and sums, so that the next GEMV needs no quantize_x dispatch (a gate|up GEMV feeding
    the down projection). Not with a RoPE epilogue."""
    R, U, LN = rows_per_warp, unroll, sg * split  # LN lanes per group of R rows
    if qout is not None and (rope is not None or n_out % 32 or (wg // LN * R) % 32 or qout[0] not in (1, 2)):
        raise ValueError(f"gemv_warp: y quantized in the epilogue (qout {qout}) needs 32-row blocks per workgroup "
                         f"(got {wg // LN * R} rows), {n_out} features a multiple of 32, planes 1 or 2, and no RoPE")
    if split < 1 or wg % LN or (rows_per_wg is not None and rows_per_wg != wg // LN * R):
        raise ValueError(f"gemv_warp: workgroup {wg}, subgroup {sg}, {split} subgroups per {R} rows, "
                         f"rows_per_wg {rows_per_wg}")
    if norm not in (None, "rms", "add_rms"):
        raise ValueError(f"gemv_warp: norm {norm!r}")
    if embed is not None and (norm != "rms" or embed.cols != w.cols or embed.name != "E"):
        raise ValueError(f"gemv_warp: an embedding prologue needs norm 'rms' and a weight named E of {w.cols} "
                         f"columns (got norm {norm!r}, {embed})")
    bname = "BIAS" if norm else "B"  # with a folded norm, B is the add + RMSNorm's second addend
    if combine is not None and (norm or not stage or combine[0] * combine[1] != w.cols or combine[1] % 4):
        raise ValueError(f"gemv_warp: combining attention splits (heads, head_dim, max splits) {combine} needs x staged, "
                         f"no norm, and heads x head_dim = the {w.cols} inputs, head_dim a multiple of 4")
    if rope is not None and (glu or R % 2 or n_out != rope.q_dim + 2 * rope.kv_dim or rope.head_dim % 2 or rope.n_rot % 2):
        raise ValueError(f"gemv_warp: a RoPE epilogue needs no glu, an even rows_per_warp (got {R}) and n_out = q + 2 kv "
                         f"features (got {n_out} for {rope})")
    if stage and w.cols % 32:
        raise ValueError(f"gemv_warp: staging x needs rows of a multiple of 32 elements, not {w.cols}")
    if planes not in (1, 2) or (planes == 2 and not int8):
        raise ValueError(f"gemv_warp: int8 activations in 1 or 2 planes, not {planes} (int8 {int8})")
    if int8 and (w.fmt not in INT8_FORMATS or not (stage or xq)):
        raise ValueError(f"gemv_warp: int8 activations need a weight in {', '.join(INT8_FORMATS)} and x staged "
                         f"(got {w.fmt}, stage {stage})")
    if xq and (not int8 or norm or combine is not None or embed is not None):
        raise ValueError("gemv_warp: x quantized ahead (xq) needs int8 activations and no norm, split merge or "
                         "embedding prologue")
    if combine is not None:
        parts = [(w, "WS"), (ActDesc("WS"), None), (ActDesc("Y"), None)]
    elif embed is not None:  # the weights' x-dot helpers are never called: G stands in for x
        parts = [(w, "G"), (embed, "G"), (ActDesc("G", vec=4), None), (ActDesc("Y"), None), (ActDesc("S"), None)]
    elif norm:
        parts = [(w, "A"), (ActDesc("A", vec=4), None), (ActDesc("G", vec=4), None), (ActDesc("Y"), None)]
        if norm == "add_rms":
            parts += [(ActDesc("B", vec=4), None), (ActDesc("S"), None)]
    elif xq:  # the weights' x-dot helpers are never called: XN_ld4 (the body's) stands in for x
        parts = [(w, "XN"), *int8_x_parts(planes, w.fmt != "Q8_0"), (ActDesc("Y"), None)]
    else:
        parts = [(w, "X"), (ActDesc("X", vec=4), None), (ActDesc("Y"), None)]
    if bias:
        parts.append((ActDesc(bname), None))
    if residual:
        parts.append((ActDesc("R"), None))
    if rope is not None:
        parts += [(ActDesc(n), None) for n in ("KC", "VC", "COS", "SIN")]
    if qout is not None:
        parts += int8_x_parts(qout[0], qout[1], "storage", prefix="Y")
    fmt = w.fmt
    per = _UNIT_ELEMS[fmt] // 4  # x vec4s per unit
    staged_x = bool(int8 or stage) and not xq
    if norm:  # x = a * g staged or read as is; 1 / rms(a) multiplies the sums (norm_scale, below)
        a4 = "(A_ld4(xb + c) + B_ld4(xb + c))" if norm == "add_rms" else "A_ld4(xb + c)"
        if embed is not None:
            a4 = "E_get4(TOK[t], 4u * c)"
        a_at = lambda c: a4.replace("c)", f"({c}))")  # noqa: E731
        xfn = "let x{n} = " + a_at("{c}") + " * G_ld4({c});"
        write_s = norm == "add_rms" or embed is not None

        def norm_val(name: str, c: str, ok: str = "", value: bool = True) -> str:
            """x's value at vec4 c as `name` (a * g; value False: not made), its a's squares
            added to ss and, for the first workgroup of a row, a written to S; ok: where c may
            lie past the row."""
            guard = f"{ok} && " if ok else ""
            acc = f"ss += dot({name}a, {name}a);"
            st = (f" if ({guard}wid.x + wid.y == 0u) {{ let k = t * K + 4u * ({c}); S_st(k, {name}a.x); "
                  f"S_st(k + 1u, {name}a.y); S_st(k + 2u, {name}a.z); S_st(k + 3u, {name}a.w); }}") if write_s else ""
            if ok:
                acc = f"if ({ok}) {{ {acc} }}"
            x = f" let {name} = {name}a * G_ld4({c});" if value else ""
            return f"let {name}a = {a_at(c)};{x} {acc}{st}"

        prologue = "\n    var ss = 0.0;"
        if not staged_x:  # x read in the loop: its squares summed first
            prologue += f"""
    if (t < ${{ROWS_EXPR}}) {{
        let xb = t * (K / 4u);
        for (var c = lid; c < K / 4u; c += WG) {{ {norm_val("n_", "c", value=False)} }}
    }}"""
    elif combine is not None:
        xfn = "let x{n} = combined4(t, {c});"
        # every (head, split)'s maximum and sum read at once, one per thread, then per head in
        # workgroup memory: the weight of each split (no chain of S dependent loads per head)
        prologue = """
    let S = step.n_splits;
    if (t < ${ROWS_EXPR}) {
        for (var e = lid; e < CH * S; e += WG) {
            let b = (t * CH * S + e) * (CD + 2u) + CD;
            cw[(e / S) * CMAX + e % S] = WS_ld(b); cl[(e / S) * CMAX + e % S] = WS_ld(b + 1u);
        }
    }
    workgroupBarrier();
    if (t < ${ROWS_EXPR}) {
        for (var h = lid; h < CH; h += WG) {
            var mx = ${NEG};
            for (var s = 0u; s < S; s++) { mx = max(mx, cw[h * CMAX + s]); }
            var l = 0.0;
            for (var s = 0u; s < S; s++) { l += exp(cw[h * CMAX + s] - mx) * cl[h * CMAX + s]; }
            for (var s = 0u; s < S; s++) { cw[h * CMAX + s] = exp(cw[h * CMAX + s] - mx) / l; }
        }
    }
    workgroupBarrier();"""
    else:
        xfn = "let x{n} = X_ld4(xb + {c});"
        prologue = ""
    if xq:
        pass  # x's codes read in the loop (below)
    elif int8 and subgroup and sg >= 8:  # int8 blocks staged a vec4 a thread, 8 lanes a block
        value = xfn.format(n="v_", c="cc").replace("let x", "let ", 1)  # "let v_ = <x at cc>;"
        if norm:
            value = norm_val("v_", "cc", "c < K / 4u")
        resid = sum2 = store2 = ""
        if planes == 2:
            resid = "\n            let r_ = pack4x8snorm((v_ - (m_ / 127.0) * vec4<f32>(unpack4xI8(p_))) * (254.0 * inv_d));"
            sum2 = " * 254 + dot4I8Packed(r_, 0x01010101u)"
            store2 = " xq2[2u * b + j / 4u][j % 4u] = r_;"
        sums = ""
        if fmt != "Q8_0":  # each half block's code sum: its 4 lanes' sums added by shuffles
            sums = f"""
            var s_ = dot4I8Packed(p_, 0x01010101u){sum2};
            s_ += subgroupShuffleXor(s_, 1u); s_ += subgroupShuffleXor(s_, 2u);"""
        prologue += f"""
    if (t < ${{ROWS_EXPR}}) {{
        let xb = t * (K / 4u);
        for (var i = 0u; i < {-(-(w.cols // 4) // wg)}u; i++) {{  // a constant count: the shuffles in uniform control flow
            let c = lid + i * WG;
            let cc = min(c, K / 4u - 1u);  // lanes past K / 4 (whole groups of 8: K is a multiple of 32) compute, not store
            {value}
            var m_ = amax4(v_);
            m_ = max(m_, subgroupShuffleXor(m_, 1u)); m_ = max(m_, subgroupShuffleXor(m_, 2u));
            m_ = max(m_, subgroupShuffleXor(m_, 4u));
            let inv_d = select(0.0, 1.0 / m_, m_ > 0.0);
            let p_ = pack4x8snorm(v_ * inv_d);{resid}{sums}
            let b = cc / 8u; let j = cc % 8u;
            if (c < K / 4u) {{
                xq[2u * b + j / 4u][j % 4u] = p_;{store2}
                if (j == 0u) {{ xd[b] = m_ / {"127.0" if planes == 1 else "32258.0"}; }}
                {"if (j % 4u == 0u) { xsum[b][j / 4u] = s_; }" if fmt != "Q8_0" else ""}
            }}
        }}
    }}
    workgroupBarrier();"""
    elif int8:  # x into workgroup memory as int8 blocks of 32 with a scale each, a block a thread
        vals = " ".join(norm_val(f"v_{i}", f"8u * b + {i}u") if norm else
                        xfn.format(n=f"v_{i}", c=f"8u * b + {i}u").replace("let x", "let ", 1) for i in range(8))
        amax = "max(" * 7 + "amax4(v_0)" + "".join(f", amax4(v_{i}))" for i in range(1, 8))
        packs = ", ".join(f"pack4x8snorm(v_{i} * inv_d)" for i in range(8))
        sums = second = ""
        if planes == 2:  # the residual of each element's rounding, in steps of 1/254 of the first's
            res = ", ".join(f"pack4x8snorm((v_{i} - d1_ * vec4<f32>(unpack4xI8(p_[{i}]))) * (254.0 * inv_d))" for i in range(8))
            second = (f"\n            let r_ = array<u32, 8>({res});\n"
                      "            xq2[2u * b] = vec4<u32>(r_[0], r_[1], r_[2], r_[3]); "
                      "xq2[2u * b + 1u] = vec4<u32>(r_[4], r_[5], r_[6], r_[7]);")
        if fmt != "Q8_0":  # the integer sums of each half block's codes (the formats' offsets and minimums)
            half = ["dot4I8Packed(p_[{}], 0x01010101u)".format(i) for i in range(8)]
            if planes == 2:
                half = [f"254 * {h} + dot4I8Packed(r_[{i}], 0x01010101u)" for i, h in enumerate(half)]
            sums = (f"\n            xsum[b] = vec2<i32>({' + '.join(half[:4])},\n"
                    f"                                {' + '.join(half[4:])});")
        prologue += f"""
    if (t < ${{ROWS_EXPR}}) {{
        let xb = t * (K / 4u);
        for (var b = lid; b < K / 32u; b += WG) {{
            {vals}
            let m_ = {amax};
            let inv_d = select(0.0, 1.0 / m_, m_ > 0.0);
            let d1_ = m_ / 127.0;
            xd[b] = d1_{"" if planes == 1 else " / 254.0"};
            let p_ = array<u32, 8>({packs});
            xq[2u * b] = vec4<u32>(p_[0], p_[1], p_[2], p_[3]); xq[2u * b + 1u] = vec4<u32>(p_[4], p_[5], p_[6], p_[7]);{second}{sums}
        }}
    }}
    workgroupBarrier();"""
    elif stage:  # x into workgroup memory once; the lanes read it from there
        value = norm_val("v_", "c") if norm else xfn.format(n="v_", c="c").replace("let x", "let ", 1)
        prologue += f"""
    if (t < ${{ROWS_EXPR}}) {{
        let xb = t * (K / 4u);
        for (var c = lid; c < K / 4u; c += WG) {{ {value} xs[c ^ ((c >> 3u) & 7u)] = v_; }}
    }}
    workgroupBarrier();"""
        xfn = "let x{n} = xs[({c}) ^ ((({c}) >> 3u) & 7u)];"
    # (accumulator, row expression) pairs: the features, then the up halves of glu
    rws = [(f"a{r}", f"min(row0 + {r}u, N - 1u)") for r in range(R)]
    if rope is not None and rope.neox:  # lane 0's adjacent features are a neox pair's rows
        rws = [(a, f"rope_row({e})") for a, e in rws]
    if glu:
        rws += [(f"g{r}", f"min(row0 + {r}u, N - 1u) + N") for r in range(R)]
    accs = [a for a, _ in rws]
    rw_l = [f"    let rw{j} = {e};" for j, (_, e) in enumerate(rws)]

    def loads(base: str) -> list[tuple[str, str]]:
        """(name, expression) of the weight values a step starting at unit `base` reads."""
        out = []
        for u in range(U):
            vu = f"min({base} + {u * LN}u, UNITS - 1u)"
            for j in range(len(rws)):
                out.append((f"q{j}_{u}", f"W_qs(rw{j}, {vu})"))
                if fmt == "Q8_0":
                    out.append((f"d{j}_{u}", f"W_d(rw{j}, {vu} >> 1u)"))
                elif fmt in ("Q6", "Q6M"):
                    out += [(f"q{j}_{u}a", f"W_top(rw{j}, {vu}, 0u)"), (f"q{j}_{u}b", f"W_top(rw{j}, {vu}, 1u)"),
                            (f"d{j}_{u}", f"W_dpair(rw{j}, {vu})")]
                    if fmt == "Q6M":
                        out.append((f"m{j}_{u}", f"W_mpair(rw{j}, {vu})"))
                elif fmt in ("Q4_0", "Q4_1"):
                    out.append((f"d{j}_{u}", f"W_d(rw{j}, {vu})"))
                if fmt == "Q4_1":
                    out.append((f"m{j}_{u}", f"W_m(rw{j}, {vu})"))
        return out

    body_l = [f"            let v{u} = min(v + {u * LN}u, UNITS - 1u);" for u in range(U)]
    if pipeline:  # this step's values from the registers, the next step's loads issued now
        first = loads("sl")
        pre = rw_l + [f"    var n_{n} = {e};" for n, e in first]
        body_l += [f"            let {n} = n_{n};" for n, _ in first]
        body_l += [f"            n_{n} = {e};" for n, e in loads(f"v + {LN * U}u")]
    else:
        pre = []
        body_l = [r.replace("    let", "            let", 1) for r in rw_l] + body_l
        body_l += [f"            let {n} = {e};" for n, e in loads("v")]
    for u in range(U):  # then the arithmetic, unit by unit
        body_l.append(f"            if (v + {u * LN}u < UNITS) {{")
        if int8:
            if fmt == "Q8_0":  # a unit is half a block
                body_l.append(f"                let x{u}_q = xq[v{u}]; let x{u}_d = xd[v{u} >> 1u];"
                              + (f" let x{u}_q2 = xq2[v{u}];" if planes == 2 else ""))
            else:  # a unit is a block: its first and second 16 x codes, their scale and sums
                body_l.append(f"                let x{u}_l = xq[2u * v{u}]; let x{u}_h = xq[2u * v{u} + 1u]; "
                              f"let x{u}_d = xd[v{u}]; let x{u}_s = xsum[v{u}];"
                              + (f" let x{u}_l2 = xq2[2u * v{u}]; let x{u}_h2 = xq2[2u * v{u} + 1u];" if planes == 2 else ""))
            for j, (acc, _) in enumerate(rws):
                body_l.append(f"                {acc} += {_unit_dot_int8(fmt, f'q{j}_{u}', f'x{u}_', f'd{j}_{u}', f'm{j}_{u}', planes)};")
            body_l.append("            }")
            continue
        body_l += ["                " + xfn.format(n=f"{u}_{i}", c=f"v{u} * {per}u + {i}u") for i in range(per)]
        if fmt == "Q4_1":
            body_l.append(f"                let x{u}_v = " + " + ".join(f"x{u}_{i}" for i in range(per)) + ";")
            body_l.append(f"                let x{u}_s = x{u}_v.x + x{u}_v.y + x{u}_v.z + x{u}_v.w;")
        if fmt == "Q6M":  # the sums of x over each half of the block
            for half, rng_ in (("sl", range(0, 4)), ("sh", range(4, 8))):
                body_l.append(f"                let x{u}_{half}v = " + " + ".join(f"x{u}_{i}" for i in rng_) + ";")
                body_l.append(f"                let x{u}_{half} = x{u}_{half}v.x + x{u}_{half}v.y + x{u}_{half}v.z + x{u}_{half}v.w;")
        for j, (acc, _) in enumerate(rws):
            body_l.append(f"                {acc} += {_unit_dot(fmt, f'q{j}_{u}', f'x{u}_', f'd{j}_{u}', f'm{j}_{u}')};")
        body_l.append("            }")
    if xq:  # x's codes, scales and sums from quantize_x's arrays (row t) instead of workgroup memory
        arrays = {"xq": ("XQ", "xo"), "xq2": ("XQ2", "xo"), "xd": ("XD", "bo"), "xsum": ("XS", "bo")}
        body_l = [re.sub(r"\b(xq2|xq|xd|xsum)\[([^\[\]]*)\]",
                         lambda m: f"{arrays[m[1]][0]}[{arrays[m[1]][1]} + ({m[2]})]", ln) for ln in body_l]
        pre = pre + ["    let xo = t * (K / 16u); let bo = t * (K / 32u);"]
    if subgroup:
        red = "\n".join(f"    for (var s = {sg // 2}u; s > 0u; s = s >> 1u) {{ {a} += subgroupShuffleXor({a}, s); }}" for a in accs)
        decl = ""
    else:
        red = []
        for j, a in enumerate(accs):
            red.append(f"    red[{j}u * WG + lid] = {a};")
        red.append("    workgroupBarrier();")
        red.append(f"    for (var s = {sg // 2}u; s > 0u; s = s >> 1u) {{")
        red.append("        if (lane < s) {")
        red += [f"            red[{j}u * WG + lid] += red[{j}u * WG + lid + s];" for j in range(len(accs))]
        red.append("        }\n        workgroupBarrier();\n    }")
        red += [f"    {a} = red[{j}u * WG + lid];" for j, a in enumerate(accs)]
        red = "\n".join(red)
        decl = f"var<workgroup> red: array<f32, {wg * len(accs)}>;"
    if split > 1:  # each subgroup's sums into workgroup memory; the group's first lane adds them
        na = len(accs)
        red += "\n    if (lane == 0u) { " + " ".join(f"sred[(lid / SG) * {na}u + {j}u] = {a};"
                                                for j, a in enumerate(accs)) + " }"
        red += "\n    workgroupBarrier();\n    if (sl == 0u) { " + " ".join(
            f"{a} = " + " + ".join(f"sred[(lid / SG + {i}u) * {na}u + {j}u]" for i in range(split)) + ";"
            for j, a in enumerate(accs)) + " }"
        decl += f"\nvar<workgroup> sred: array<f32, {wg // sg * na}>;"
    norm_pub = norm_scale = ""
    if norm:  # rms(x) from the row's squares summed in the prologue, applied to the sums (W (a g) / rms)
        if subgroup:
            norm_pub = "    " + _lane_sums("ss", sg, "nred")
            total = _sum_of("nred", "WARPS", "tot")
        else:
            norm_pub = "    nred[lid] = ss;"
            total = ("for (var s = WG / 2u; s > 0u; s = s >> 1u) { if (lid < s) { nred[lid] += nred[lid + s]; } "
                     "workgroupBarrier(); }\n    let tot = nred[0];")
        norm_scale = (f"    workgroupBarrier();\n    {total}\n    let inv = inverseSqrt(tot / f32(K) + ${{EPS}});\n    "
                      + " ".join(f"{a} = {a} * inv;" for a in accs))
    stores = []
    if rope is None:
        keep = " qy[col % QB] = y;" if qout is not None else ""
        for r in range(R):
            e = _epilogue(f"a{r}", f"g{r}" if glu else None, bias, residual, "col", "t * N + col", bname)
            stores.append(f"        {{ let col = row0 + {r}u; if (col < N) {{ {e} Y_st(t * N + col, y);{keep} }} }}")
    else:  # pairs (2i, 2i+1): N is even, so a pair lies wholly below N or above it
        for r in range(0, R, 2):
            e0 = _epilogue(f"a{r}", None, bias, residual, "rope_row(col)", "t * N + col", bname)
            e1 = _epilogue(f"a{r + 1}", None, bias, residual, "rope_row(col + 1u)", "t * N + col + 1u", bname)
            stores.append(f"        {{ let col = row0 + {r}u; if (col < N) {{ var y0 = 0.0; var y1 = 0.0; "
                          f"{{ {e0} y0 = y; }} {{ {e1} y1 = y; }} rope_put(t, col, y0, y1); }} }}")
    body = """
const N: u32 = ${N}u; const K: u32 = ${K}u; const UNITS: u32 = ${UNITS}u; const SG: u32 = ${SG}u;
const WG: u32 = ${WG}u; const WARPS: u32 = WG / SG;
${DECL}
${NDECL}
${ROPE}
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = wid.z;
    let lane = lid % SG;
    let sl = lid % ${LN}u;
    let row0 = ((wid.x + wid.y * nwg.x) * (WG / ${LN}u) + lid / ${LN}u) * ${R}u;
${PRE}
${PROLOGUE}
${NORMPUB}
    ${ACCS}
    if (row0 < N && t < ${ROWS_EXPR}) {
        let xb = t * (K / 4u);
        ${LOOP} {
${BODY}
        }
    }
${RED}
${NORMSCALE}
    if (sl == 0u && t < ${ROWS_EXPR}) {
${STORES}
    }
${QOUT}
}
"""
    steps = -(-w.units // (LN * U))
    loop = (f"for (var i = 0u; i < {steps}u; i++) {{ let v = sl + i * {LN * U}u;" if pipeline
            else f"for (var v = sl; v < UNITS; v += {LN * U}u) {{")
    qout_l = ""
    if qout is not None:  # the workgroup's y (QB rows from row QB * group) into int8 blocks, a thread per block
        rpw = wg // LN * R
        vals = " ".join(f"let v{i} = vec4<f32>(qy[qb + {4 * i}u], qy[qb + {4 * i + 1}u], qy[qb + {4 * i + 2}u], "
                        f"qy[qb + {4 * i + 3}u]);" for i in range(8))
        qout_l = f"""    workgroupBarrier();
    let qblk = (wid.x + wid.y * nwg.x) * {rpw // 32}u + lid;
    if (lid < {rpw // 32}u && qblk < N / 32u && t < ${{ROWS_EXPR}}) {{
        let o = t * (N / 32u) + qblk; let qb = lid * 32u;
        {vals}
{_quantize_block(qout[0], qout[1], "Y")}    }}"""
        decl += f"\nconst QB: u32 = {rpw}u;\nvar<workgroup> qy: array<f32, {rpw}>;\n{QUANT_AMAX}"
    body = body.replace("${PROLOGUE}", prologue).replace("${PRE}", "\n".join(pre)).replace("${LOOP} {", loop)
    body = body.replace("${QOUT}", qout_l).replace("${NORMPUB}", norm_pub).replace("${NORMSCALE}", norm_scale)
    tok = ""
    if embed is not None:  # TOK after the parts' bindings (and the Step uniform)
        tok = f"@group(0) @binding({1 + sum(len(p.bindings()) for p, _ in parts)}) var<storage, read_write> TOK: array<u32>;"
    k = _render("gemv_warp", parts, body, wg, N=n_out, K=w.cols, UNITS=w.units, SG=sg, LN=LN, R=R, ROWS_EXPR=rows,
                ACCS=" ".join(f"var {a} = 0.0;" for a in accs), BODY="\n".join(body_l), RED=red,
                DECL=decl, STORES="\n".join(stores), EPS=_f(eps),
                NDECL=(f"var<workgroup> nred: array<f32, {wg}>;" if norm else "")
                + (f"\nvar<workgroup> xq: array<vec4<u32>, {w.cols // 16}>;\nvar<workgroup> xd: array<f32, {w.cols // 32}>;\n"
                   + (f"var<workgroup> xsum: array<vec2<i32>, {w.cols // 32}>;\n" if fmt != "Q8_0" else "")
                   + (f"var<workgroup> xq2: array<vec4<u32>, {w.cols // 16}>;\n" if planes == 2 else "")
                   + "fn amax4(v: vec4<f32>) -> f32 { let a = abs(v); return max(max(a.x, a.y), max(a.z, a.w)); }"
                   if int8 and not xq else "\nfn XN_ld4(i4: u32) -> vec4<f32> { return vec4<f32>(0.0); }" if xq
                   else f"\nvar<workgroup> xs: array<vec4<f32>, {w.cols // 4}>;" if stage else ""),
                ROPE=(rope.wgsl() if rope is not None else "") + (_combine_wgsl(*combine) if combine else "") + tok,
                NEG=NEG, dtypes=dtypes)
    extra = (Binding("TOK", "array<u32>"),) if embed is not None else ()
    return WarpKernel(k.name, k.source, k.bindings + extra, wg, rows_per_group=wg // LN * R)


def _combine_wgsl(n_heads: int, head_dim: int, max_splits: int, unroll: int = 1) -> str:
    """gemv_warp's combine: the per-(head, split) weights and x's vec4 c of row t merged from them.
    unroll > 1: that many splits' loads issued together per step of the loop (the last step's
    extra splits clamped to the last and weighted 0), a round trip to the cache per `unroll`
    splits instead of per split (the loop's count is the step's, unknown to the compiler)."""
    if unroll > 1:
        loads = "\n".join(f"        let s{i} = min(s + {i}u, S - 1u); let b{i} = hb + s{i} * (CD + 2u);\n"
                          f"        let a{i} = vec4<f32>(WS_ld(b{i}), WS_ld(b{i} + 1u), WS_ld(b{i} + 2u), WS_ld(b{i} + 3u));"
                          for i in range(unroll))
        adds = " + ".join(f"select(0.0, cw[h * CMAX + s{i}], s + {i}u < S) * a{i}" for i in range(unroll))
        loop = f"""    for (var s = 0u; s < S; s += {unroll}u) {{
{loads}
        v += {adds};
    }}"""
    else:
        loop = """    for (var s = 0u; s < S; s++) {
        let b = hb + s * (CD + 2u);
        v += cw[h * CMAX + s] * vec4<f32>(WS_ld(b), WS_ld(b + 1u), WS_ld(b + 2u), WS_ld(b + 3u));
    }"""
    return f"""
const CH: u32 = {n_heads}u; const CD: u32 = {head_dim}u; const CMAX: u32 = {max_splits}u;
var<workgroup> cw: array<f32, {n_heads * max_splits}>;  // per (head, split): the maximum, then the weight
var<workgroup> cl: array<f32, {n_heads * max_splits}>;  // the sum
fn combined4(t: u32, c: u32) -> vec4<f32> {{
    let k = 4u * c; let h = k / CD;
    let S = step.n_splits;
    let hb = (t * CH + h) * S * (CD + 2u) + k % CD;
    var v = vec4<f32>(0.0);
{loop}
    return v;
}}"""


def decode_gemv(w: WeightDesc, n_out: int, rows: str, cfg: dict, **opts) -> Kernel:
    """The decode GEMV a launch configuration names: cfg["kind"] "warp" (gemv_warp) or "block"
    (gemv, the default); either way cfg["rows_per_wg"] output features per workgroup."""
    c = dict(cfg)
    if c.pop("kind", "block") == "warp":
        return gemv_warp(w, n_out, rows, **c, **opts)
    return gemv(w, n_out, rows, **c, **opts)


def _epilogue(acc: str, up: str | None, bias: bool, residual: bool, col: str, flat: str, bias_name: str = "B") -> str:
    """WGSL statements making y of one output: the accumulator, silu-gated by `up` (glu), plus
    the bias (binding `bias_name`) at column `col`, plus the residual at flat index `flat`."""
    y = f"var y = {acc};"
    if up is not None:
        y += f" y = y / (1.0 + exp(-y)) * {up};"
    if bias:
        y += f" y += {bias_name}_ld({col});"
    if residual:
        y += f" y += R_ld({flat});"
    return y


def _stage_4x4(count: str, index: str, row_ok: str, load: str, store: str) -> list[str]:
    """WGSL lines staging `count` 4x4 blocks into workgroup memory, k-major: four rows' vec4 loads
    (`load`, rows past `row_ok` and k past K read as 0) transposed in registers into four vec4
    stores (`store`). index: the statements that set the block's coordinates from i, ending with
    the row variable used in row_ok/load, and kq (the k block); {r} is the row, {e} the k offset."""
    lines = [f"        for (var i = lid; i < {count}; i += 256u) {{",
             f"            {index} let k = k0 + 4u * kq;"]
    lines += [f"            var r{r} = vec4<f32>(0.0); if ({row_ok.format(r=r)} && k < K) {{ r{r} = {load.format(r=r)}; }}"
              for r in range(4)]
    lines += [f"            {store.format(e=e)} = vec4<f32>(r0.{c}, r1.{c}, r2.{c}, r3.{c});" for e, c in enumerate("xyzw")]
    return lines + ["        }"]


def _prefetch_4x4(tag: str, count: int, index: str, row_ok: str, load: str, store: str) -> tuple[list[str], list[str], list[str]]:
    """_stage_4x4 split in two for a register prefetch: (declarations, loads, stores). The loads
    read the 4x4 blocks of the k-tile at `kt` (a WGSL expression set by the caller) into registers
    p<tag><slot>_<r>, each thread its ceil(count / 256) slots (unrolled: count is a constant);
    the stores write them to workgroup memory later, so that a tile's global loads are in flight
    while the workgroup multiplies the previous one."""
    decl, loads, stores = [], [], []
    for s in range(-(-count // 256)):
        v = [f"p{tag}{s}_{r}" for r in range(4)]
        decl.append("    " + " ".join(f"var {x} = vec4<f32>(0.0);" for x in v))
        head = f"{{ let i = lid + {256 * s}u; if (i < {count}u) {{ {index}"
        loads.append(f"        {head} let k = kt + 4u * kq;")
        loads += [f"            {v[r]} = vec4<f32>(0.0); if ({row_ok.format(r=r)} && k < K) {{ {v[r]} = {load.format(r=r)}; }}"
                  for r in range(4)]
        loads.append("        } }")
        stores.append(f"        {head}")
        stores += [f"            {store.format(e=e)} = vec4<f32>({', '.join(f'{x}.{c}' for x in v)});"
                   for e, c in enumerate("xyzw")]
        stores.append("        } }")
    return decl, loads, stores


def _tile_accumulators(pm: int, pn: int, glu: bool, bias: bool, residual: bool) -> tuple[str, list[str]]:
    """A GEMM tile's per-thread float accumulators (c<i>_<q>: vec4s of pm rows x pn features;
    u<i>_<q> the up half's with glu) and the WGSL lines storing them through the epilogue, the
    thread's rows ty * pm.. and features tx * pn.. (rows past `rows` and features past N skipped)."""
    accs = " ".join(f"var c{i}_{q} = vec4<f32>(0.0);" + (f" var u{i}_{q} = vec4<f32>(0.0);" if glu else "")
                    for i in range(pm) for q in range(pn // 4))
    stores = []
    for i in range(pm):
        stores.append(f"    {{ let m = m0 + ty * {pm}u + {i}u; if (m < rows) {{")
        for q in range(pn // 4):
            for e, c in enumerate("xyzw"):
                y = _epilogue(f"c{i}_{q}.{c}", f"u{i}_{q}.{c}" if glu else None, bias, residual, "n", "m * N + n")
                stores.append(f"        {{ let n = n0 + tx * {pn}u + {4 * q + e}u; if (n < N) {{ {y} Y_st(m * N + n, y); }} }}")
        stores.append("    } }")
    return accs, stores


def gemm(w: WeightDesc, n_out: int, rows: str, *, bias: bool = False, residual: bool = False, glu: bool = False,
         tm: int = 64, tn: int = 64, tk: int = 32, pre: bool = False, dtypes: dict | None = None) -> Kernel:
    """The prefill matrix product: a TM x TN tile of y per workgroup of 256 threads (16 x 16), each
    thread a contiguous (TM/16) x (TN/16) block of it held in vec4 registers; x and dequantized W
    tiles staged in workgroup memory TK at a time, k-major, as vec4s, so that each step of k is
    TM/64 + TN/64 16-byte workgroup-memory reads per thread for (TM/16) x (TN/16) FMAs (glu: twice
    the W reads and FMAs). Staging moves 4 x 4 blocks (four rows' W_get4 / X_ld4, transposed in
    registers). Generated unrolled: no arrays in function scope, which the driver's compiler may
    put in local memory. tm, tn in (64, 128); tk a multiple of 4.
    W is read four elements at a time through W_get4, so every format is this one template.
    pre: the next k-tile's global loads (and W's dequantization) go to registers before the
    workgroup multiplies the current one, and to workgroup memory after it (one barrier pair per
    tile as without it): the loads' latency hidden behind the products, where otherwise every
    tile waits for its loads with the multipliers idle."""
    if tm not in (64, 128) or tn not in (64, 128) or tk % 4 or tk <= 0:
        raise ValueError(f"gemm tiles {tm}x{tn}x{tk}: tm and tn must be 64 or 128, tk a multiple of 4")
    parts = [(w, "X"), (ActDesc("X", vec=4), None), (ActDesc("Y"), None)]
    if bias:
        parts.append((ActDesc("B"), None))
    if residual:
        parts.append((ActDesc("R"), None))
    nw = 2 if glu else 1
    pm, pn = tm // 16, tn // 16
    # staging: 4x4 blocks of x (rows x k) and of each W half (features x k)
    specs = [("x", tm * tk // 16, "(TM / 4u) * (TK / 4u)",
              "let mq = i / (TK / 4u); let kq = i % (TK / 4u); let m = m0 + 4u * mq;",
              "m + {r}u < rows", "X_ld4(((m + {r}u) * K + k) >> 2u)", "xs[(4u * kq + {e}u) * (TM / 4u) + mq]"),
             ("w", nw * tn * tk // 16, "NW * (TN / 4u) * (TK / 4u)",
              "let half = i / ((TN / 4u) * (TK / 4u)); let j = i % ((TN / 4u) * (TK / 4u)); "
              "let nq = j / (TK / 4u); let kq = j % (TK / 4u); let n = n0 + 4u * nq;",
              "n + {r}u < N", "W_get4(n + {r}u + half * N, k)",
              "ws[half * TK * (TN / 4u) + (4u * kq + {e}u) * (TN / 4u) + nq]")]
    if pre:
        decl, loads, stores = [], [], []
        for tag, count, _, index, ok, ld, st in specs:
            d_, l_, s_ = _prefetch_4x4(tag, count, index, ok, ld, st)
            decl += d_; loads += l_; stores += s_
        first = ["    { let kt = 0u;"] + loads + ["    }"]
        stage = stores + ["        workgroupBarrier();", "        let kt = k0 + TK;", "        if (kt < K) {"] + loads + ["        }"]
        prologue = "\n".join(decl + first)
        sync = ""
    else:
        stage = [ln for _, _, count, index, ok, ld, st in specs for ln in _stage_4x4(count, index, ok, ld, st)]
        prologue, sync = "", "        workgroupBarrier();"
    # the k loop: this thread's rows ty*PM.., columns tx*PN..
    inner = []
    for q in range(pm // 4):
        inner.append(f"            let a{q} = xs[k * (TM / 4u) + ty * {pm // 4}u + {q}u];")
    for q in range(pn // 4):
        inner.append(f"            let b{q} = ws[k * (TN / 4u) + tx * {pn // 4}u + {q}u];")
        if glu:
            inner.append(f"            let g{q} = ws[TK * (TN / 4u) + k * (TN / 4u) + tx * {pn // 4}u + {q}u];")
    for i in range(pm):
        xi = f"a{i // 4}.{'xyzw'[i % 4]}"
        for q in range(pn // 4):
            inner.append(f"            c{i}_{q} += {xi} * b{q};")
            if glu:
                inner.append(f"            u{i}_{q} += {xi} * g{q};")
    accs, stores = _tile_accumulators(pm, pn, glu, bias, residual)
    body = """
const N: u32 = ${N}u; const K: u32 = ${K}u; const TM: u32 = ${TM}u; const TN: u32 = ${TN}u; const TK: u32 = ${TK}u;
const NW: u32 = ${NW}u;
var<workgroup> xs: array<vec4<f32>, ${XS}>;  // [TK][TM / 4]
var<workgroup> ws: array<vec4<f32>, ${WS}>;  // [NW][TK][TN / 4]
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let rows = ${ROWS_EXPR};
    let m0 = wid.y * TM; let n0 = wid.x * TN;
    let ty = lid / 16u; let tx = lid % 16u;
    ${ACCS}
${PROLOGUE}
    for (var k0 = 0u; k0 < K; k0 += TK) {
${STAGE}
${SYNC}
        for (var k = 0u; k < TK; k++) {
${INNER}
        }
        workgroupBarrier();
    }
${STORES}
}
"""
    return _render("gemm", parts, body, 256, N=n_out, K=w.cols, TM=tm, TN=tn, TK=tk, NW=nw, XS=tm * tk // 4,
                   WS=nw * tn * tk // 4, ROWS_EXPR=rows, ACCS=accs, PROLOGUE=prologue, STAGE="\n".join(stage), SYNC=sync, INNER="\n".join(inner),
                   STORES="\n".join(stores), dtypes=dtypes)


# -- int8 prefill: x quantized once per product, packed dot products -----------------------------
@dataclass(frozen=True)
class RawDesc:
    """A binding of a type of its own (the int8 activations' arrays), with no accessors."""

    name: str
    wgsl_type: str
    kind: str = "storage"

    def bindings(self) -> list[Binding]:
        return [Binding(self.name, self.wgsl_type, self.kind)]

    def accessors(self) -> str:
        return ""


def int8_x_parts(planes: int, sums: bool, kind: str = "read", prefix: str = "X") -> list:
    """The quantized x's bindings: XQ (a row's blocks, two vec4<u32> of codes each), XD (a float
    scale per block), XS (per block the integer sums of its two halves' codes) and, planes 2, XQ2
    (the residual plane); named with `prefix` for X."""
    parts = [(RawDesc(prefix + "Q", "array<vec4<u32>>", kind), None), (RawDesc(prefix + "D", "array<f32>", kind), None)]
    if sums:
        parts.append((RawDesc(prefix + "S", "array<vec2<i32>>", kind), None))
    if planes == 2:
        parts.append((RawDesc(prefix + "Q2", "array<vec4<u32>>", kind), None))
    return parts


def int8_x_sizes(rows: int, cols: int, planes: int, sums: bool) -> dict[str, int]:
    """Bytes of each of int8_x_parts' arrays for `rows` rows of `cols` elements."""
    nb = cols // 32
    out = {"XQ": rows * cols, "XD": 4 * rows * nb}
    if sums:
        out["XS"] = 8 * rows * nb
    if planes == 2:
        out["XQ2"] = rows * cols
    return out


QUANT_AMAX = "fn am(v: vec4<f32>) -> f32 { let a = abs(v); return max(max(a.x, a.y), max(a.z, a.w)); }"


def _quantize_block(planes: int, sums: bool, prefix: str = "X") -> str:
    """WGSL storing block o of int8_x_parts' arrays (named prefix + Q, D, S, Q2) from its 32 values
    v0..v7 (vec4s): codes round(127 * v / amax), the scale, the half blocks' code sums, the residual
    plane (quantize_x's rounding; am is QUANT_AMAX)."""
    q, d, sm, q2 = (prefix + n for n in ("Q", "D", "S", "Q2"))
    amax = "max(" * 7 + "am(v0)" + "".join(f", am(v{i}))" for i in range(1, 8))
    packs = ", ".join(f"pack4x8snorm(v{i} * inv)" for i in range(8))
    half = ["dot4I8Packed(p[{}], 0x01010101u)".format(i) for i in range(8)]
    plane2 = ""
    if planes == 2:
        res = ", ".join(f"pack4x8snorm((v{i} - d1 * vec4<f32>(unpack4xI8(p[{i}]))) * (254.0 * inv))" for i in range(8))
        plane2 = (f"    let r = array<u32, 8>({res});\n"
                  f"    {q2}[2u * o] = vec4<u32>(r[0], r[1], r[2], r[3]); {q2}[2u * o + 1u] = vec4<u32>(r[4], r[5], r[6], r[7]);\n")
        half = [f"254 * {h} + dot4I8Packed(r[{i}], 0x01010101u)" for i, h in enumerate(half)]
    store_sums = f"    {sm}[o] = vec2<i32>({' + '.join(half[:4])}, {' + '.join(half[4:])});\n" if sums else ""
    return f"""    let m = {amax};
    let inv = select(0.0, 1.0 / m, m > 0.0);
    let d1 = m / 127.0;
    let p = array<u32, 8>({packs});
    {q}[2u * o] = vec4<u32>(p[0], p[1], p[2], p[3]); {q}[2u * o + 1u] = vec4<u32>(p[4], p[5], p[6], p[7]);
{plane2}    {d}[o] = {"d1" if planes == 1 else "d1 / 254.0"};
{store_sums}"""


def quantize_x(cols: int, rows: str, *, planes: int = 1, sums: bool = True, norm: str | None = None,
               eps: float = 1e-6, combine: tuple[int, int] | None = None, wg: int = 256, lanes: int = 1,
               dtypes: dict | None = None) -> Kernel:
    """x [rows, cols] (X, f32 or f16) as int8 blocks of 32 with a float scale each, for
    gemm_int8 and gemv_warp's xq: codes round(127 * x / amax) (pack4x8snorm), scale amax / 127,
    the integer sums of each half block's codes (the weight formats' offsets and minimums
    multiply them). planes 2: a second plane holds each element's rounding residual in steps 254
    times finer (x = scale / 254 * (254 q1 + q2), the scale stored so), as gemv_warp's int8
    staging. A thread per block; grid quantize_x_grid.

    The prologue a decode GEMV would otherwise fold (gemv_warp's norm and combine), done here once
    for all of the GEMV's workgroups instead of in each of them:
    norm "rms" / "add_rms": x = rms_norm(A [+ B]) * G (bindings A, G [, B, S] instead of X; the sum
    A + B written to S), a workgroup of `wg` threads per row (the row's sum of squares reduced
    in workgroup memory), grid (1, rows); with lanes 8, workgroups of QUANTIZE_NORM_WG threads
    each summing the whole row's squares (a few KiB from the cache, all loads at once) and
    quantizing their own QUANTIZE_NORM_WG vec4s (a 4096-element row: 4 workgroups, where one
    walked the row four times after its reduction).
    combine (heads, head_dim): x is the attention output still split over the context
    (attention(partial=True)'s WS; step.n_splits splits), the heads of each block merged by its
    thread as attention_combine does (head_dim a multiple of 4; of 32: a block lies in one head,
    its split weights computed once).

    lanes 8 (adapters with subgroups of 8 lanes or more): a vec4 a thread, the 8 lanes of a block
    sharing its maximum and code sums by shuffles: 8 times the threads (a 4096-element row is 16
    workgroups of 64 instead of 2), each with one vec4 of the merge, whose splits it reads 4 at a
    time into an online softmax (one round trip to the cache per 4 splits, where a thread per
    block waited on one per split, three times over). Grid quantize_x_grid(..., lanes)."""
    if cols % 32:
        raise ValueError(f"quantize_x: rows of a multiple of 32 elements, not {cols}")
    if norm not in (None, "rms", "add_rms") or (norm and combine):
        raise ValueError(f"quantize_x: norm {norm!r} (None, 'rms' or 'add_rms'), not with a split merge")
    if combine is not None and (combine[0] * combine[1] != cols or combine[1] % 4):
        raise ValueError(f"quantize_x: merging attention splits (heads, head_dim) {combine} needs heads x head_dim = "
                         f"the {cols} inputs and head_dim a multiple of 4")
    if lanes == 8:
        return _quantize_x_lanes(cols, rows, planes=planes, sums=sums, norm=norm, eps=eps, combine=combine,
                                 dtypes=dtypes)
    if lanes != 1:
        raise ValueError(f"quantize_x: 1 or 8 lanes a block, not {lanes}")
    parts = _quantize_x_inputs(norm, combine)
    if norm:
        a4 = "(A_ld4(xb + {c}) + B_ld4(xb + {c}))" if norm == "add_rms" else "A_ld4(xb + {c})"
        vals = " ".join(f"let v{i} = " + a4.format(c=f"8u * b + {i}u") + f" * (G_ld4(8u * b + {i}u) * rinv);"
                        for i in range(8))
    elif combine:
        vals = ""  # merged into v0..v7 before the block (below)
    else:
        vals = " ".join(f"let v{i} = X_ld4(xb + 8u * b + {i}u);" for i in range(8))
    parts += int8_x_parts(planes, sums, "storage")
    block = f"""    let o = t * NB + b;
    {vals}
{_quantize_block(planes, sums)}"""
    head = f"""
const NB: u32 = {cols // 32}u; const K4: u32 = {cols // 4}u;
{QUANT_AMAX}"""
    if norm:  # a workgroup per row: its sum of squares (S written), then a thread per block
        store_s = ("let k = 4u * (xb + c); S_st(k, a.x); S_st(k + 1u, a.y); S_st(k + 2u, a.z); S_st(k + 3u, a.w);"
                   if norm == "add_rms" else "")
        a = "A_ld4(xb + c) + B_ld4(xb + c)" if norm == "add_rms" else "A_ld4(xb + c)"
        body = head + f"""
var<workgroup> red: array<f32, ${{WG}}>;
@compute @workgroup_size(${{WG}})
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {{
    let t = wid.y; let xb = t * K4;
    let live = t < ${{ROWS_EXPR}};
    var ss = 0.0;
    if (live) {{ for (var c = lid; c < K4; c += ${{WG}}u) {{ let a = {a}; ss += dot(a, a); {store_s} }} }}
    red[lid] = ss;
    workgroupBarrier();
    for (var s = ${{WG}}u / 2u; s > 0u; s = s >> 1u) {{ if (lid < s) {{ red[lid] += red[lid + s]; }} workgroupBarrier(); }}
    let rinv = inverseSqrt(red[0] / f32({cols}) + {_f(eps)});
    if (!live) {{ return; }}
    for (var b = lid; b < NB; b += ${{WG}}u) {{
{block}    }}
}}
"""
        return _render("quantize_x", parts, body, wg, ROWS_EXPR=rows, dtypes=dtypes)
    weights = ""
    if combine:  # per head the block covers: its splits' weights, then its elements merged from them
        h, d = combine
        groups = [range(8)] if d % 32 == 0 else [range(i, i + 1) for i in range(8)]  # vec4s sharing a head
        weights = f"""
    let S = step.n_splits;
    {" ".join(f"var v{i} = vec4<f32>(0.0);" for i in range(8))}"""
        for g in groups:
            e = f"32u * b + {4 * g[0]}u"
            adds = " ".join(f"v{i} += w * vec4<f32>(WS_ld(j + {4 * (i - g[0])}u), WS_ld(j + {4 * (i - g[0]) + 1}u), "
                            f"WS_ld(j + {4 * (i - g[0]) + 2}u), WS_ld(j + {4 * (i - g[0]) + 3}u));" for i in g)
            weights += f"""
    {{
        let e0 = {e};
        let hb = (t * {h}u + e0 / {d}u) * S * {d + 2}u;
        var mx = ${{NEG}};
        for (var s = 0u; s < S; s++) {{ mx = max(mx, WS_ld(hb + s * {d + 2}u + {d}u)); }}
        var l = 0.0;
        for (var s = 0u; s < S; s++) {{ let i = hb + s * {d + 2}u + {d}u; l += exp(WS_ld(i) - mx) * WS_ld(i + 1u); }}
        for (var s = 0u; s < S; s++) {{
            let i = hb + s * {d + 2}u;
            let w = exp(WS_ld(i + {d}u) - mx) / l;
            let j = i + e0 % {d}u;
            {adds}
        }}
    }}"""
        weights += "\n"
    body = head + f"""
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {{
    let t = wid.y; let b = wid.x * 64u + lid;
    if (t >= ${{ROWS_EXPR}} || b >= NB) {{ return; }}
    let xb = t * K4;{weights}
{block}}}
"""
    return _render("quantize_x", parts, body, 64, ROWS_EXPR=rows, NEG=NEG, dtypes=dtypes)


QUANTIZE_NORM_WG = 256  # quantize_x's workgroup with a norm


def quantize_x_grid(cols: int, rows: int, norm: bool = False, lanes: int = 1) -> tuple[int, int, int]:
    """quantize_x's dispatch grid: a thread per 32-block (lanes 8: per vec4), 64 a workgroup
    (QUANTIZE_NORM_WG with a norm), a row per grid row; with a norm and lanes 1, a workgroup per
    row."""
    if norm and lanes == 1:
        return (1, rows, 1)
    return (-(-(cols // 32 * lanes) // (QUANTIZE_NORM_WG if norm else 64)), rows, 1)


def _merge_wgsl(n_heads: int, head_dim: int, unroll: int = 4) -> str:
    """WGSL fn merged4(t, c): vec4 c of row t of the attention output (its head's D elements at
    c * 4 % D) merged from attention(partial=True)'s splits in WS (step.n_splits of them, each
    the unnormalised output, its maximum and its sum) as an online softmax, `unroll` splits' loads
    issued at once (one round trip to the cache per `unroll` splits; the last step's extra splits
    clamped to the last and weighted 0)."""
    h, d, u = n_heads, head_dim, unroll
    loads = "\n".join(
        f"        let s{i} = min(s0 + {i}u, S - 1u); let b{i} = hb + s{i} * {d + 2}u;\n"
        f"        let m{i} = select({NEG}, WS_ld(b{i} + {d}u), s0 + {i}u < S); let l{i} = WS_ld(b{i} + {d + 1}u);\n"
        f"        let a{i} = vec4<f32>(WS_ld(b{i} + e), WS_ld(b{i} + e + 1u), WS_ld(b{i} + e + 2u), WS_ld(b{i} + e + 3u));"
        for i in range(u))
    mn = "m0"
    for i in range(1, u):
        mn = f"max({mn}, m{i})"
    return f"""
fn merged4(t: u32, c: u32) -> vec4<f32> {{
    let k = 4u * c; let e = k % {d}u;
    let S = step.n_splits;
    let hb = (t * {h}u + k / {d}u) * S * {d + 2}u;
    var mx = {NEG}; var l = 0.0; var acc = vec4<f32>(0.0);
    for (var s0 = 0u; s0 < S; s0 += {u}u) {{
{loads}
        let mn = max(mx, {mn});
        let f = exp(mx - mn);
        {" ".join(f"let e{i} = exp(m{i} - mn);" for i in range(u))}
        l = l * f + {" + ".join(f"e{i} * l{i}" for i in range(u))};
        acc = acc * f + {" + ".join(f"e{i} * a{i}" for i in range(u))};
        mx = mn;
    }}
    return acc / l;
}}"""


def _quantize_x_inputs(norm: str | None, combine) -> list:
    """quantize_x's input bindings: the norm's A, G (B, S), the attention partials WS, or X."""
    if norm:
        return [(ActDesc("A", vec=4), None), (ActDesc("G", vec=4), None)] + (
            [(ActDesc("B", vec=4), None), (ActDesc("S"), None)] if norm == "add_rms" else [])
    return [(ActDesc("WS"), None)] if combine else [(ActDesc("X", vec=4), None)]


def _quantize_x_lanes(cols: int, rows: str, *, planes: int, sums: bool, norm: str | None, eps: float,
                      combine: tuple[int, int] | None, dtypes: dict | None) -> Kernel:
    """quantize_x with a vec4 a thread and 8 lanes a block (its lanes=8; arguments checked there):
    workgroups of QUANTIZE_NORM_WG threads with a norm, else 64."""
    k4 = cols // 4
    wg = QUANTIZE_NORM_WG if norm else 64
    merge = ""
    parts = _quantize_x_inputs(norm, combine)
    if norm:
        a = "A_ld4(xb + cc) + B_ld4(xb + cc)" if norm == "add_rms" else "A_ld4(xb + cc)"
        value = f"let v = ({a}) * (G_ld4(cc) * rinv);"
    elif combine:
        value = "let v = merged4(t, cc);"
        merge = _merge_wgsl(*combine)
    else:
        value = "let v = X_ld4(xb + cc);"
    parts += int8_x_parts(planes, sums, "storage")
    resid = store2 = ""
    code_sum = "dot4I8Packed(p, 0x01010101u)"
    if planes == 2:
        resid = "\n        let r = pack4x8snorm((v - (m / 127.0) * vec4<f32>(unpack4xI8(p))) * (254.0 * inv));"
        store2 = " XQ2[2u * o + j / 4u][j % 4u] = r;"
        code_sum = "dot4I8Packed(p, 0x01010101u) * 254 + dot4I8Packed(r, 0x01010101u)"
    sum_l = store_s = ""
    if sums:  # each half block's code sum: its 4 lanes' added by shuffles, the second half's taken from lane 4
        sum_l = (f"\n        var cs = {code_sum};\n        cs += subgroupShuffleXor(cs, 1u); cs += subgroupShuffleXor(cs, 2u);"
                 "\n        let cs_hi = subgroupShuffleXor(cs, 4u);")
        store_s = " XS[o] = vec2<i32>(cs, cs_hi);"
    pre = ""
    if norm:  # every workgroup sums the whole row's squares (S: its own vec4s), then quantizes its vec4s
        store = ("if (c / ${WG}u == wid.x) { let k = 4u * (xb + c); S_st(k, a.x); S_st(k + 1u, a.y); "
                 "S_st(k + 2u, a.z); S_st(k + 3u, a.w); }" if norm == "add_rms" else "")
        aa = "A_ld4(xb + c) + B_ld4(xb + c)" if norm == "add_rms" else "A_ld4(xb + c)"
        pre = f"""
    var ss = 0.0;
    for (var c = lid; c < K4; c += ${{WG}}u) {{ let a = {aa}; ss += dot(a, a); {store} }}
    {_lane_sums("ss", 8, "red")}
    workgroupBarrier();
    {_sum_of("red", "${WG}u / 8u", "tot")}
    let rinv = inverseSqrt(tot / f32({cols}) + {_f(eps)});"""
    body = f"""
const NB: u32 = {cols // 32}u; const K4: u32 = {k4}u;
{QUANT_AMAX}
{"var<workgroup> red: array<f32, ${WG} / 8>;" if norm else ""}{merge}
@compute @workgroup_size(${{WG}})
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {{
    let t = wid.y;
    if (t >= ${{ROWS_EXPR}}) {{ return; }}
    let xb = t * K4;{pre}
    {{
        let c = wid.x * ${{WG}}u + lid;
        let cc = min(c, K4 - 1u);  // lanes past K4 (whole blocks of 8) compute, not store
        {value}
        var m = am(v);
        m = max(m, subgroupShuffleXor(m, 1u)); m = max(m, subgroupShuffleXor(m, 2u)); m = max(m, subgroupShuffleXor(m, 4u));
        let inv = select(0.0, 1.0 / m, m > 0.0);
        let p = pack4x8snorm(v * inv);{resid}{sum_l}
        let o = t * NB + cc / 8u; let j = cc % 8u;
        if (c < K4) {{
            XQ[2u * o + j / 4u][j % 4u] = p;{store2}
            if (j == 0u) {{ XD[o] = m / {"127.0" if planes == 1 else "32258.0"};{store_s} }}
        }}
    }}
}}
"""
    return _render("quantize_x", parts, body, wg, ROWS_EXPR=rows, NEG=NEG, dtypes=dtypes)


INT8_GEMM_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q6", "Q6M")


def int8_x_sums(fmt: str) -> bool:
    """Whether a format's int8 products need x's half-block code sums (offsets and minimums)."""
    return fmt != "Q8_0"


def gemm_int8(w: WeightDesc, n_out: int, rows: str, *, bias: bool = False, residual: bool = False, glu: bool = False,
              tm: int = 64, tn: int = 64, planes: int = 1, dtypes: dict | None = None) -> Kernel:
    """The prefill matrix product on int8: x quantized per 32-block (quantize_x's XQ, XD, XS), W's
    codes as they are stored (Q8_0's bytes; the 4-bit and 6-bit layouts' codes unpacked by masks
    and shifts, their offsets and minimums applied to x's code sums), each 32-element block of
    a product one sum of eight packed dot products (dot4I8Packed; NVIDIA's DP4A, four
    multiply-adds, at 2.2 times the f32 FMA rate on the H200 through Vulkan:
    benchmarks/webgpu_alu_probe.py), exact in 32-bit integers, then scaled into a float
    accumulator once per block. A TM x TN tile of y per workgroup of 256 threads (16 x 16), each
    thread (TM/16) x (TN/16) outputs; a k-step is one block: its x codes (TM rows x 8 words) and
    W codes (TN rows x 8 words) staged in workgroup memory word-major, read as vec4s, a quarter
    of the float product's workgroup-memory bytes per multiply-add; the next block's global loads
    in registers while the workgroup multiplies (gemm's pre). planes 2: x's residual plane
    too (about 16-bit activations; twice the dot products)."""
    if w.fmt not in INT8_GEMM_FORMATS:
        raise ValueError(f"gemm_int8: int8 products need a weight in {', '.join(INT8_GEMM_FORMATS)}, not {w.fmt}")
    if tm not in (64, 128) or tn not in (64, 128) or planes not in (1, 2):
        raise ValueError(f"gemm_int8 tiles {tm}x{tn}, planes {planes}: tm and tn must be 64 or 128, planes 1 or 2")
    fmt, nw = w.fmt, 2 if glu else 1
    six = fmt in ("Q6", "Q6M")
    sums = int8_x_sums(fmt)
    parts = [(w, "Y")] + int8_x_parts(planes, sums) + [(ActDesc("Y"), None)]  # (W_xblock, never called, reads Y)
    if bias:
        parts.append((ActDesc("B"), None))
    if residual:
        parts.append((ActDesc("R"), None))
    pm, pn = tm // 16, tn // 16
    WR = nw * tn  # W rows staged per step
    # -- staging: loads into registers (block kb), stores into workgroup memory -----------------
    decl, loads, stores = [], [], []
    xslots = -(-(2 * tm * planes) // 256)  # a thread loads one vec4 (4 words) of a row's block per slot
    for sl in range(xslots):
        decl.append(f"    var px{sl} = vec4<u32>(0u); var pxd{sl} = 0.0;" + (f" var pxs{sl} = vec2<i32>(0);" if sums else ""))
        head = (f"{{ let e = lid + {256 * sl}u; let pl = e / {2 * tm}u; let r = e % {2 * tm}u; "
                f"let m = r >> 1u; let h = r & 1u; if (e < {2 * tm * planes}u) {{")
        src = "select(XQ2[i], XQ[i], pl == 0u)" if planes == 2 else "XQ[i]"
        loads.append(f"        {head} if (m0 + m < rows) {{ let o = (m0 + m) * NB + kb; let i = 2u * o + h; "
                     f"px{sl} = {src}; pxd{sl} = XD[o];" + (f" pxs{sl} = XS[o];" if sums else "") +
                     f" }} else {{ px{sl} = vec4<u32>(0u); pxd{sl} = 0.0;" + (f" pxs{sl} = vec2<i32>(0);" if sums else "")
                     + " } } }")
        st = " ".join(f"xq[(pl * 8u + 4u * h + {j}u) * (TM / 4u) + (m >> 2u)][m & 3u] = px{sl}.{c};" for j, c in enumerate("xyzw"))
        st += f" if (pl == 0u && h == 0u) {{ xdv[m] = pxd{sl};" + (f" xsv[m] = pxs{sl};" if sums else "") + " }"
        stores.append(f"        {head} {st} }} }}")
    wslots = -(-WR // 256)
    for sl in range(wslots):
        words = [f"pw{sl}_{j}" for j in range(8)]
        decl.append("    " + " ".join(f"var {v} = 0u;" for v in words) + f" var pwd{sl} = {'vec2<f32>(0.0)' if six else '0.0'};"
                    + (f" var pwm{sl} = {'vec2<f32>(0.0)' if six else '0.0'};" if fmt in ("Q4_1", "Q6M") else ""))
        head = f"{{ let e = lid + {256 * sl}u; if (e < {WR}u) {{ let n = n0 + e % TN; let row = min(n, N - 1u) + (e / TN) * N;"
        if fmt == "Q8_0":
            ld = (f"let q0 = W_qs(row, 2u * kb); let q1 = W_qs(row, 2u * kb + 1u); "
                  + " ".join(f"{words[j]} = q0.{c}; {words[4 + j]} = q1.{c};" for j, c in enumerate("xyzw"))
                  + f" pwd{sl} = W_d(row, kb);")
        elif fmt in ("Q4_0", "Q4_1"):
            ld = ("let q = W_qs(row, kb); "
                  + " ".join(f"{words[j]} = q.{c} & 0x0F0F0F0Fu; {words[4 + j]} = (q.{c} >> 4u) & 0x0F0F0F0Fu;"
                             for j, c in enumerate("xyzw"))
                  + f" pwd{sl} = W_d(row, kb);" + (f" pwm{sl} = W_m(row, kb);" if fmt == "Q4_1" else ""))
        else:
            ld = ("let q = W_qs(row, kb); let ta = W_top(row, kb, 0u); let tb = W_top(row, kb, 1u); "
                  + " ".join(f"{words[j]} = q6lo(q.{c}, ta, {j}u); {words[4 + j]} = q6hi(q.{c}, tb, {j}u);"
                             for j, c in enumerate("xyzw"))
                  + f" pwd{sl} = W_dpair(row, kb);" + (f" pwm{sl} = W_mpair(row, kb);" if fmt == "Q6M" else ""))
        # rows past N load row N - 1 (min above): finite values, their outputs never stored
        loads.append(f"        {head} {ld} }} }}")
        st = " ".join(f"wq[({j}u * NW + e / TN) * (TN / 4u) + ((e % TN) >> 2u)][e & 3u] = {words[j]};" for j in range(8))
        st += f" wdv[e] = pwd{sl};" + (f" wmv[e] = pwm{sl};" if fmt in ("Q4_1", "Q6M") else "")
        stores.append(f"        {{ let e = lid + {256 * sl}u; if (e < {WR}u) {{ {st} }} }}")
    # -- a k-step: integer sums per output, then scaled into the float accumulators --------------
    inner = [f"        let xd{i} = xdv[ty * {pm}u + {i}u];" for i in range(pm)]
    if sums:
        inner += [f"        let xs{i} = xsv[ty * {pm}u + {i}u];" for i in range(pm)]
    halves = ("l", "h") if six else ("",)
    outs = [(i, q, e, g) for g in range(nw) for i in range(pm) for q in range(pn // 4) for e in range(4)]
    for i, q, e, g in outs:
        inner.append("        " + " ".join(f"var s{h}{g}_{i}_{q}_{e} = 0;" for h in halves))
    for wd in range(8):
        h = halves[wd // 4] if six else ""
        for pl in range(planes):
            inner += [f"        let a{pl}_{wd}_{q} = xq[({pl * 8 + wd}u) * (TM / 4u) + ty * {pm // 4}u + {q}u];" for q in range(pm // 4)]
        for g in range(nw):
            inner += [f"        let b{g}_{wd}_{q} = wq[({wd}u * NW + {g}u) * (TN / 4u) + tx * {pn // 4}u + {q}u];" for q in range(pn // 4)]
        for i, q, e, g in outs:
            a = lambda pl: f"a{pl}_{wd}_{i // 4}.{'xyzw'[i % 4]}"
            b = f"b{g}_{wd}_{q}.{'xyzw'[e]}"
            dp = f"dot4I8Packed({a(0)}, {b})"
            if planes == 2:
                dp = f"254 * {dp} + dot4I8Packed({a(1)}, {b})"
            inner.append(f"        s{h}{g}_{i}_{q}_{e} += {dp};")
    for i, q, e, g in outs:
        col = f"{g} * TN + tx * {pn}u + {4 * q + e}u"
        acc, sfx = ("c" if g == 0 else "u") + f"{i}_{q}.{'xyzw'[e]}", f"{g}_{i}_{q}_{e}"
        if fmt == "Q8_0":
            upd = f"f32(s{sfx}) * (xd{i} * wdv[{col}])"
        elif fmt == "Q4_0":
            upd = f"f32(s{sfx} - 8 * (xs{i}.x + xs{i}.y)) * (xd{i} * wdv[{col}])"
        elif fmt == "Q4_1":
            upd = f"(f32(s{sfx}) * wdv[{col}] + wmv[{col}] * f32(xs{i}.x + xs{i}.y)) * xd{i}"
        else:
            upd = f"(f32(sl{sfx} - 32 * xs{i}.x) * wdv[{col}].x + f32(sh{sfx} - 32 * xs{i}.y) * wdv[{col}].y"
            upd += (f" + wmv[{col}].x * f32(xs{i}.x) + wmv[{col}].y * f32(xs{i}.y)) * xd{i}" if fmt == "Q6M" else ") * xd" + str(i))
        inner.append(f"        {acc} += {upd};")
    accs, st_lines = _tile_accumulators(pm, pn, glu, bias, residual)
    sc = "vec2<f32>" if six else "f32"
    body = f"""
const N: u32 = ${{N}}u; const NB: u32 = ${{NB}}u; const TM: u32 = ${{TM}}u; const TN: u32 = ${{TN}}u; const NW: u32 = ${{NW}}u;
var<workgroup> xq: array<vec4<u32>, {planes * 8 * tm // 4}>;  // [plane][word][TM / 4]
var<workgroup> wq: array<vec4<u32>, {8 * WR // 4}>;  // [word][NW][TN / 4]
var<workgroup> xdv: array<f32, {tm}>;
var<workgroup> wdv: array<{sc}, {WR}>;
{f"var<workgroup> xsv: array<vec2<i32>, {tm}>;" if sums else ""}
{f"var<workgroup> wmv: array<{sc}, {WR}>;" if fmt in ("Q4_1", "Q6M") else ""}
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {{
    let rows = ${{ROWS_EXPR}};
    let m0 = wid.y * TM; let n0 = wid.x * TN;
    let ty = lid / 16u; let tx = lid % 16u;
    ${{ACCS}}
${{DECL}}
    {{ let kb = 0u;
${{LOADS}}
    }}
    for (var k0 = 0u; k0 < NB; k0++) {{
${{STORES}}
        workgroupBarrier();
        let kb = k0 + 1u;
        if (kb < NB) {{
${{LOADS}}
        }}
${{INNER}}
        workgroupBarrier();
    }}
${{ST}}
}}
"""
    return _render("gemm_int8", parts, body, 256, N=n_out, NB=w.cols // 32, TM=tm, TN=tn, NW=nw, ROWS_EXPR=rows,
                   ACCS=accs, DECL="\n".join(decl), LOADS="\n".join(loads), STORES="\n".join(stores),
                   INNER="\n".join(inner), ST="\n".join(st_lines), dtypes=dtypes)


# -- row-wise kernels -----------------------------------------------------------------------------
def embedding(w: WeightDesc, rows: str, *, dtypes: dict | None = None) -> Kernel:
    """out[t, k] = W[tokens[t], k]; grid (ceil(cols / 256), rows)."""
    body = """
@group(0) @binding(${TOKB}) var<storage, read_write> TOK: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let k = gid.x; let t = gid.y;
    if (k < ${K}u && t < ${ROWS_EXPR}) { Y_st(t * ${K}u + k, W_get(TOK[t], k)); }
}
"""
    parts = [(w, "Y"), (ActDesc("Y"), None)]
    n_bind = 1 + len(w.bindings()) + 1
    k = _render("embedding", parts, body, 256, K=w.cols, ROWS_EXPR=rows, TOKB=n_bind, dtypes=dtypes)
    return Kernel(k.name, k.source, k.bindings + (Binding("TOK", "array<u32>"),), 256)


def rms_norm(cols: int, eps: float, rows: str, *, add: bool = False, wg: int = 256, sg: int = 0, vec: int | None = None,
             dtypes: dict | None = None) -> Kernel:
    """O = x * rsqrt(mean(x^2) + eps) * G per row; add: x = A + B is also written to S (the
    residual stream). One workgroup per row. Each thread issues all its loads of x (and G) at
    once, `vec` elements each (4 where the row is a multiple of 4; 1 otherwise or where asked),
    keeps them in registers for the scaling, and the sum of squares is reduced across subgroups
    of `sg` lanes (0: in workgroup memory alone). A row of 4,096 read one element per thread and
    iteration, with a barrier per level of the reduction tree and the row read again for the
    scaling, took 16.4 us on the H200 through Vulkan (2026-11-30, 8B F16 decode, 31 of them a
    token: benchmarks/webgpu_decode_profile.py --steps), a chain of 16 loads each way; this way
    6.9 us."""
    V = vec if vec is not None else (4 if cols % 4 == 0 else 1)
    if V not in (1, 4) or cols % V:
        raise ValueError(f"rms_norm: {cols} columns read {vec} at a time")
    if sg and (sg & (sg - 1) or wg % sg):
        raise ValueError(f"rms_norm: subgroups of {sg} lanes in a workgroup of {wg}")
    per = -(-cols // (V * wg))  # elements (of V) per thread
    parts = [(ActDesc("A", vec=V), None), (ActDesc("G", vec=V), None), (ActDesc("O", vec=V), None)]
    if add:
        parts += [(ActDesc("B", vec=V), None), (ActDesc("S", vec=V), None)]
    ty, ld, st = ("vec4<f32>", "_ld4", "_st4") if V == 4 else ("f32", "_ld", "_st")
    loads, sq, stores = [], [], []
    for i in range(per):
        x = f"A{ld}(t * CV + k{i})" + (f" + B{ld}(t * CV + k{i})" if add else "")
        keep = f" S{st}(t * CV + k{i}, v{i});" if add else ""
        loads.append(f"    let k{i} = lid + {i}u * WG; var v{i} = {ty}(0.0); var g{i} = {ty}(0.0);\n"
                     f"    if (live && k{i} < CV) {{ v{i} = {x}; g{i} = G{ld}(k{i});{keep} }}")
        sq.append(f"dot(v{i}, v{i})" if V == 4 else f"v{i} * v{i}")
        stores.append(f"    if (live && k{i} < CV) {{ O{st}(t * CV + k{i}, v{i} * inv * g{i}); }}")
    if sg:  # across each subgroup by shuffles, then the subgroups' sums in workgroup memory
        red = f"    {_lane_sums('ss', sg, 'red')}\n    workgroupBarrier();\n    {_sum_of('red', f'{wg // sg}u', 'tot')}"
        nred = wg // sg
    else:
        red = "    " + _tree("ss", "lid", f"{wg}u") + "    let tot = red[0];"
        nred = wg
    body = f"""
const CV: u32 = ${{CV}}u; const WG: u32 = ${{WG}}u;
var<workgroup> red: array<f32, {nred}>;
@compute @workgroup_size(${{WG}})
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {{
    let t = wid.x + wid.y * nwg.x;  // rows past the per-dimension limit continue in y
    let live = t < ${{ROWS_EXPR}};
{chr(10).join(loads)}
    var ss = {" + ".join(sq)};
{red}
    let inv = inverseSqrt(tot / f32(${{C}}u) + ${{EPS}});
{chr(10).join(stores)}
}}
"""
    return _render("add_rms_norm" if add else "rms_norm", parts, body, wg, C=cols, CV=cols // V, EPS=_f(eps),
                   ROWS_EXPR=rows, dtypes=dtypes)


def elementwise(kind: str, cols: int, rows: str, *, b_rows: bool = True, dtypes: dict | None = None) -> Kernel:
    """add, mul (b broadcast over rows when b_rows is False), silu, swiglu = silu(a) * b."""
    expr = {"add": "a + b", "mul": "a * b", "silu": "a / (1.0 + exp(-a))", "swiglu": "a / (1.0 + exp(-a)) * b"}[kind]
    parts = [(ActDesc("A"), None), (ActDesc("Y"), None)]
    unary = kind == "silu"
    if not unary:
        parts.insert(1, (ActDesc("B"), None))
    body = """
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i < ${C}u * ${ROWS_EXPR}) {
        let a = A_ld(i);
        ${LOADB}
        Y_st(i, ${EXPR});
    }
}
"""
    loadb = "" if unary else f"let b = B_ld({'i' if b_rows else f'i % {cols}u'});"
    return _render(kind, parts, body, 256, C=cols, ROWS_EXPR=rows, EXPR=expr, LOADB=loadb, dtypes=dtypes)


def last_row(cols: int, *, dtypes: dict | None = None) -> Kernel:
    """out[0, :] = x[seq - 1, :]."""
    body = """
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < ${C}u) { Y_st(gid.x, X_ld((step.seq - 1u) * ${C}u + gid.x)); }
}
"""
    return _render("last_row", [(ActDesc("X"), None), (ActDesc("Y"), None)], body, 256, C=cols, dtypes=dtypes)


# the token choice's output: TOK[0] and HIST[step.p0] get the first index of the workgroup's best
# score, each thread bringing its own best (m at index mi)
_BEST_OF = """
var<workgroup> best: array<f32, ${WG}>;
var<workgroup> bidx: array<u32, ${WG}>;
fn best_of(m: f32, mi: u32, lid: u32) -> vec2<u32> {  // the workgroup's largest value (bits), first index
    best[lid] = m; bidx[lid] = mi;
    workgroupBarrier();
    for (var s = ${WG}u / 2u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            let v = best[lid + s]; let j = bidx[lid + s];
            if (v > best[lid] || (v == best[lid] && j < bidx[lid])) { best[lid] = v; bidx[lid] = j; }
        }
        workgroupBarrier();
    }
    return vec2<u32>(bitcast<u32>(best[0]), bidx[0]);
}
"""
_TOKEN_PICK = """
@group(0) @binding(${TOKB}) var<storage, read_write> TOK: array<u32>;
@group(0) @binding(${HISTB}) var<storage, read_write> HIST: array<u32>;""" + _BEST_OF + """
fn pick(m: f32, mi: u32, lid: u32) {
    let r = best_of(m, mi, lid);
    if (lid == 0u) { TOK[0] = r.y; HIST[step.p0] = r.y; }
}
"""


def argmax_parallelism(n: int) -> int:
    """The workgroups of argmax's first pass over n logits (about 4 a thread)."""
    return max(1, min(256, -(-n // (4 * 256))))


def argmax(n: int, wg: int = 256, *, dtypes: dict | None = None) -> tuple[Kernel, Kernel]:
    """TOK[0] = the first index of the largest of x[0..n) (numpy's argmax); the same index also
    goes to HIST[step.p0] (the tokens of a greedy run, read back in batches). Two dispatches:
    argmax_part, argmax_parallelism(n) workgroups each reducing a chunk of x to its largest
    value and first index (PART[2 wg], PART[2 wg + 1]), then argmax_pick, one workgroup over
    those. One workgroup over a whole vocabulary issued each thread's ~500 loads one after
    another (the greedy step's ~0.25 ms a token on the H200 beside a 0.75 ms 1B decode pass,
    2026-11-30)."""
    nwg = argmax_parallelism(n)
    chunk = -(-n // nwg)
    part_body = _BEST_OF + """
@group(0) @binding(${PARTB}) var<storage, read_write> PART: array<u32>;
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    var m = ${NEG}; var mi = 0xffffffffu;
    let end = min(${N}u, (wid.x + 1u) * ${CHUNK}u);
    for (var i = wid.x * ${CHUNK}u + lid; i < end; i += ${WG}u) { let v = X_ld(i); if (v > m) { m = v; mi = i; } }
    let r = best_of(m, mi, lid);
    if (lid == 0u) { PART[2u * wid.x] = r.x; PART[2u * wid.x + 1u] = r.y; }
}
"""
    part = _render("argmax_part", [(ActDesc("X"), None)], part_body, wg, N=n, NEG=NEG, CHUNK=chunk, PARTB=2,
                   dtypes=dtypes)
    pick_body = _TOKEN_PICK + """
@group(0) @binding(${PARTB}) var<storage, read_write> PART: array<u32>;
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) lid: u32) {
    var m = ${NEG}; var mi = 0xffffffffu;
    for (var w = lid; w < ${NWG}u; w += ${WG}u) {
        let v = bitcast<f32>(PART[2u * w]); let j = PART[2u * w + 1u];
        if (v > m || (v == m && j < mi)) { m = v; mi = j; }
    }
    pick(m, mi, lid);
}
"""
    pick = _render("argmax_pick", [], pick_body, wg, NEG=NEG, NWG=nwg, PARTB=1, TOKB=2, HISTB=3, dtypes=dtypes)
    return (Kernel(part.name, part.source, part.bindings + (Binding("PART", "array<u32>"),), wg),
            Kernel(pick.name, pick.source, pick.bindings + (Binding("PART", "array<u32>"), Binding("TOK", "array<u32>"),
                                                            Binding("HIST", "array<u32>")), wg))


SAMPLE_WORDS = 8  # SAMP: temperature, min-p, top-p (f32 bits), top-k, the seed's low and high words
STATE_WORDS = 8  # SAMPLE_STATE: best key, least key, lo, hi, mass (f32 bits), cut (f32 bits), top-k cut key
SAMPLE_WG = 256
SAMPLE_TOPK_MAX = 64  # a top-k up to this many takes the ranked path (sample_topk, then sample_topk_draw)
_SAMPLE_COMMON = """
@group(0) @binding(${SAMPB}) var<storage, read> SAMP: array<u32>;
@group(0) @binding(${STATEB}) var<storage, read_write> STATE: array<u32>;
@group(0) @binding(${PARTB}) var<storage, read_write> PART: array<u32>;
var<workgroup> redf: array<f32, ${WG}>;
var<workgroup> redu: array<u32, ${WG}>;
fn key_of(x: f32) -> u32 {  // float order as unsigned order; a NaN (by its bits: WGSL may assume none) lowest
    let u = bitcast<u32>(x + 0.0);
    if ((bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u) { return 0u; }
    return select(u | 0x80000000u, ~u, (u >> 31u) == 1u);
}
fn value_of(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k & 0x7fffffffu, (k >> 31u) == 1u));
}
fn sum_f(v: f32, lid: u32) -> f32 {
    redf[lid] = v; workgroupBarrier();
    for (var s = ${WG}u / 2u; s > 0u; s = s >> 1u) { if (lid < s) { redf[lid] = redf[lid] + redf[lid + s]; } workgroupBarrier(); }
    let r = redf[0]; workgroupBarrier();
    return r;
}
fn sum_u(v: u32, lid: u32) -> u32 {
    redu[lid] = v; workgroupBarrier();
    for (var s = ${WG}u / 2u; s > 0u; s = s >> 1u) { if (lid < s) { redu[lid] = redu[lid] + redu[lid + s]; } workgroupBarrier(); }
    let r = redu[0]; workgroupBarrier();
    return r;
}
fn max_f(v: f32, lid: u32) -> f32 {
    redf[lid] = v; workgroupBarrier();
    for (var s = ${WG}u / 2u; s > 0u; s = s >> 1u) { if (lid < s) { redf[lid] = max(redf[lid], redf[lid + s]); } workgroupBarrier(); }
    let r = redf[0]; workgroupBarrier();
    return r;
}
// the 17 thresholds of a 16-way split of [lo, hi): t(0) = lo, t(16) = hi
fn split(lo: u32, hi: u32, j: u32) -> u32 {
    let w = hi - lo;
    return lo + (w >> 4u) * j + (((w & 15u) * j) >> 4u);
}
const CHUNK: u32 = ${CHUNK}u;  // the logits one workgroup of a parallel pass reads
"""
# each kernel's body: a parallel pass (NWG workgroups, partial results to PART[wg * 16 + j]) or a
# one-workgroup step that combines them into STATE
_SAMPLE_BODIES = {
    # the row's largest and smallest logits
    "stats": """
    var hi_v = -3.0e38; var lo_v = 3.0e38;
    for (var i = wg * CHUNK + lid; i < min(${N}u, (wg + 1u) * CHUNK); i += ${WG}u) {
        let v = X_ld(i); hi_v = max(hi_v, v); lo_v = min(lo_v, v);
    }
    let mx = max_f(hi_v, lid);
    let mn = -max_f(-lo_v, lid);
    if (lid == 0u) { PART[wg * 16u] = bitcast<u32>(mx); PART[wg * 16u + 1u] = bitcast<u32>(mn); }""",
    "stats_done": """
    var hi_v = -3.0e38; var lo_v = 3.0e38;
    for (var w = lid; w < ${NWG}u; w += ${WG}u) {
        hi_v = max(hi_v, bitcast<f32>(PART[w * 16u])); lo_v = min(lo_v, bitcast<f32>(PART[w * 16u + 1u]));
    }
    let mx = max_f(hi_v, lid);
    let mn = -max_f(-lo_v, lid);
    if (lid == 0u) {
        STATE[0] = key_of(mx); STATE[1] = key_of(mn);
        STATE[2] = key_of(mn); STATE[3] = key_of(mx) + 1u;  // top-k: count(>= lo) >= k > count(>= hi)
        STATE[6] = key_of(mn);  // no top-k: every logit
    }""",
    # top-k: how many logits lie at or above each threshold
    "count": """
    let lo = STATE[2]; let hi = STATE[3];
    var c: array<u32, 16>;
    for (var i = wg * CHUNK + lid; i < min(${N}u, (wg + 1u) * CHUNK); i += ${WG}u) {
        let k = key_of(X_ld(i));
        for (var j = 1u; j < 16u; j++) { c[j] += select(0u, 1u, k >= split(lo, hi, j)); }
    }
    for (var j = 1u; j < 16u; j++) { let t = sum_u(c[j], lid); if (lid == 0u) { PART[wg * 16u + j] = t; } }""",
    "count_done": """
    let lo = STATE[2]; let hi = STATE[3]; let k = SAMP[3];
    var pick = 0u;
    for (var j = 1u; j < 16u; j++) {
        var c = 0u;
        for (var w = lid; w < ${NWG}u; w += ${WG}u) { c += PART[w * 16u + j]; }
        if (sum_u(c, lid) >= k) { pick = j; }
    }
    if (lid == 0u) { STATE[2] = split(lo, hi, pick); STATE[3] = split(lo, hi, pick + 1u); STATE[6] = STATE[2]; }""",
    # the mass (relative to the best logit's) of the logits the top-k keeps
    "mass": """
    let best = value_of(STATE[0]); let ck = value_of(STATE[6]);
    var m = 0.0;
    for (var i = wg * CHUNK + lid; i < min(${N}u, (wg + 1u) * CHUNK); i += ${WG}u) {
        let v = X_ld(i); m += select(0.0, exp(v - best), v >= ck);
    }
    let t = sum_f(m, lid);
    if (lid == 0u) { PART[wg * 16u] = bitcast<u32>(t); }""",
    "mass_done": """
    var m = 0.0;
    for (var w = lid; w < ${NWG}u; w += ${WG}u) { m += bitcast<f32>(PART[w * 16u]); }
    let t = sum_f(m, lid);
    if (lid == 0u) { STATE[4] = bitcast<u32>(t); STATE[2] = STATE[6]; STATE[3] = STATE[0] + 1u; }""",
    # top-p: the mass at or above each threshold, within the top-k
    "mcount": """
    let lo = STATE[2]; let hi = STATE[3]; let best = value_of(STATE[0]); let ck = STATE[6];
    var a: array<f32, 16>;
    for (var i = wg * CHUNK + lid; i < min(${N}u, (wg + 1u) * CHUNK); i += ${WG}u) {
        let v = X_ld(i); let k = key_of(v);
        if (k >= ck) {
            let e = exp(v - best);
            for (var j = 1u; j < 16u; j++) { a[j] += select(0.0, e, k >= split(lo, hi, j)); }
        }
    }
    for (var j = 1u; j < 16u; j++) { let t = sum_f(a[j], lid); if (lid == 0u) { PART[wg * 16u + j] = bitcast<u32>(t); } }""",
    "mcount_done": """
    let lo = STATE[2]; let hi = STATE[3]; let goal = bitcast<f32>(SAMP[2]) * bitcast<f32>(STATE[4]);
    var pick = 0u;
    for (var j = 1u; j < 16u; j++) {
        var a = 0.0;
        for (var w = lid; w < ${NWG}u; w += ${WG}u) { a += bitcast<f32>(PART[w * 16u + j]); }
        if (sum_f(a, lid) >= goal) { pick = j; }
    }
    if (lid == 0u) { STATE[2] = split(lo, hi, pick); STATE[3] = split(lo, hi, pick + 1u); }""",
}


_PCG = """
fn pcg(v: u32) -> u32 {
    let s = v * 747796405u + 2891336453u;
    let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
    return (w >> 22u) ^ w;
}
// the step's draw: a hash of the seed and the position; token i's Gumbel-perturbed score x / T - log(-log u)
fn draw_key() -> u32 { return pcg(step.start ^ pcg(SAMP[4] ^ pcg(SAMP[5]))); }
fn gumbel(v: f32, temp: f32, i: u32, rkey: u32) -> f32 {
    let u = (f32(pcg(i ^ rkey) >> 8u) + 0.5) / 16777216.0;
    return v / temp - log(-log(u));
}"""


def _select_top(per_thread: int) -> str:
    """WGSL: each thread's candidates (up to `per_thread` logits' keys ck and ids ci, private) and
    select_top(want, m, lid): the threshold t such that exactly `want` of the workgroup's candidates
    (all of them, if fewer) rank at or above it (ranks(key, id, t)) in the order key descending,
    id ascending: numpy's stable ranking np.argsort(-x, kind="stable"), ties by the lower id.
    A radix select on (key, ~id), 8 bits a round from the top, stopping once a round's chosen
    digit is taken whole; each round a histogram (workgroup atomics) and a scan of its 256 bins."""
    return f"""
var<private> ck: array<u32, {max(1, per_thread)}>;
var<private> ci: array<u32, {max(1, per_thread)}>;
var<workgroup> hist: array<atomic<u32>, 256>;
var<workgroup> cum: array<u32, 256>;
var<workgroup> sel: array<u32, 3>;  // the round's digit, what remains to take within it, its count
var<workgroup> done: u32;
var<workgroup> taken: atomic<u32>;
fn ranks(k: u32, i: u32, t: vec2<u32>) -> bool {{ return k > t.x || (k == t.x && ~i >= t.y); }}
fn select_top(want: u32, m: u32, lid: u32) -> vec2<u32> {{
    var pk = 0u; var mk = 0u; var pi = 0u; var mi = 0u;  // the digits chosen so far (of the key, of ~id) and their masks
    var rem = want;
    for (var r = 0u; r < 8u; r++) {{
        atomicStore(&hist[lid], 0u);
        workgroupBarrier();
        let sh = 24u - 8u * (r & 3u);
        for (var s = 0u; s < m; s++) {{
            let k = ck[s]; let inv = ~ci[s];
            if ((k & mk) == pk && (inv & mi) == pi) {{ atomicAdd(&hist[select((inv >> sh) & 255u, (k >> sh) & 255u, r < 4u)], 1u); }}
        }}
        workgroupBarrier();
        cum[lid] = atomicLoad(&hist[255u - lid]);  // then the inclusive sum from digit 255 down to 255 - lid
        workgroupBarrier();
        for (var o = 1u; o < 256u; o = o << 1u) {{
            var v = cum[lid];
            if (lid >= o) {{ v += cum[lid - o]; }}
            workgroupBarrier();
            cum[lid] = v;
            workgroupBarrier();
        }}
        let h = atomicLoad(&hist[255u - lid]);
        let c = cum[lid];
        if (c >= rem && c - h < rem) {{ sel[0] = 255u - lid; sel[1] = rem - (c - h); sel[2] = h; }}
        if (lid == 255u && c < rem) {{ sel[0] = 256u; }}  // fewer candidates than wanted: all of them
        workgroupBarrier();
        let d = sel[0];
        if (lid == 0u) {{ done = select(0u, 1u, d == 256u || sel[1] == sel[2] || r == 7u); }}
        if (d == 256u) {{ pk = 0u; pi = 0u; mk = 0xffffffffu; mi = 0xffffffffu; }}
        else if (r < 4u) {{ pk |= d << sh; mk |= 255u << sh; }}
        else {{ pi |= d << sh; mi |= 255u << sh; }}
        rem = sel[1];
        if (workgroupUniformLoad(&done) == 1u) {{ break; }}
    }}
    return vec2<u32>(pk, pi);
}}
"""


# the kept candidates of a ranked top-k, sorted in place in workgroup memory (bitonic, key
# descending, id ascending)
_TOPK_SORT = """
var<workgroup> gk: array<u32, ${KMAX}>;
var<workgroup> gi: array<u32, ${KMAX}>;
var<workgroup> kept: u32;
fn before(a: u32, b: u32) -> bool { return gk[a] > gk[b] || (gk[a] == gk[b] && gi[a] < gi[b]); }
fn sort_kept(lid: u32) {
    workgroupBarrier();
    for (var k = 2u; k <= ${KMAX}u; k = k << 1u) {
        for (var j = k >> 1u; j > 0u; j = j >> 1u) {
            if (lid < ${KMAX}u / 2u) {
                let a = 2u * lid - (lid & (j - 1u));  // the pair (a, a + j) this thread orders
                let b = a + j;
                let up = (a & k) == 0u;  // this block sorts descending (else ascending)
                if (before(b, a) == up) {
                    let tk = gk[a]; gk[a] = gk[b]; gk[b] = tk;
                    let ti = gi[a]; gi[a] = gi[b]; gi[b] = ti;
                }
            }
            workgroupBarrier();
        }
    }
}
"""


def _sample_kernel(name: str, n: int, nwg: int, head: str, body: str, extra: tuple = (), dtypes=None, **consts) -> Kernel:
    wg = SAMPLE_WG
    src = _SAMPLE_COMMON + head + """
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wgid: vec3<u32>) {
    let wg = wgid.x;""" + body + "\n}\n"
    k = _render(name, [(ActDesc("X"), None)], src, wg, N=n, NWG=nwg, CHUNK=-(-n // nwg), SAMPB=2, STATEB=3, PARTB=4,
                dtypes=dtypes, **consts)
    return Kernel(k.name, k.source, k.bindings + (Binding("SAMP", "array<u32>", "read"),
                                                  Binding("STATE", "array<u32>"), Binding("PART", "array<u32>")) + extra, wg)


def sample_parallelism(n: int) -> int:
    """The workgroups of the sampler's parallel passes over a row of n logits."""
    return max(1, min(128, -(-n // (4 * SAMPLE_WG))))


def sample_kernels(n: int, *, dtypes: dict | None = None) -> dict[str, Kernel]:
    """The token choice of a sampled step over logits x[0..n), as edgellm.sampling's chain draws
    it: top-k, then top-p (over the top-k's probabilities, or the whole row's), then min-p, then
    temperature. The kept logits are those at or above one cut value. Top-k's cut (the k-th largest
    logit) and top-p's (the smallest logit whose better-ranked mass is below top_p) are found on
    the logits' order-preserving 32-bit keys, 16 ways a round, 8 rounds: each round a pass of
    sample_parallelism(n) workgroups over the row ("count", "mcount") and a one-workgroup step
    that picks the sixteenth holding the cut ("count_done", "mcount_done"); "stats" and "mass"
    give the row's extremes and the kept mass. "cut" combines the three cuts into STATE; "draw" is
    a Gumbel-max pass, argmax of x / T - log(-log u) over the kept logits, u from a hash (PCG) of
    the seed, the position (step.start) and the token id, so a seed gives the same tokens on every
    run (and the argmax at temperature 0), each workgroup's best to PART, then "draw_pick" (one
    workgroup) writes the best into TOK[0] and HIST[step.p0] as `argmax` does (one workgroup
    walking a 128k row took ~0.25 ms on the H200, as the argmax did).

    A top-k of at most SAMPLE_TOPK_MAX ranks instead: "topk", each workgroup's k best of its
    chunk (a radix select, _select_top) to PART, then "topk_draw", one workgroup: the k best of
    those, sorted, top-p and min-p as a prefix of that ranking, and the draw over what is kept,
    into TOK and HIST. Exactly k are kept, ties by the lower id, as the chain's stable ranking
    (the thresholds above keep every logit equal to the k-th). Which passes a step runs follows
    the parameters (sample_plan)."""
    nwg = sample_parallelism(n)
    ks = {name: _sample_kernel("sample_" + name, n, nwg, "", body, dtypes=dtypes) for name, body in _SAMPLE_BODIES.items()}
    ks["cut"] = _sample_kernel("sample_cut", n, nwg, "", """
    if (lid == 0u) {
        let best = value_of(STATE[0]);
        var cut = -3.0e38;
        if (SAMP[3] > 0u && SAMP[3] < ${N}u) { cut = value_of(STATE[6]); }
        if (bitcast<f32>(SAMP[2]) < 1.0) { cut = max(cut, value_of(STATE[2])); }
        let min_p = bitcast<f32>(SAMP[1]);
        if (min_p > 0.0) { cut = max(cut, best + log(min_p)); }
        STATE[5] = bitcast<u32>(cut);
    }""", dtypes=dtypes)
    ks["draw"] = _sample_kernel("sample_draw", n, nwg, _BEST_OF + _PCG, """
    let temp = bitcast<f32>(SAMP[0]); let cut = bitcast<f32>(STATE[5]);
    let rkey = draw_key();
    var m = ${NEG}; var mi = 0xffffffffu;
    for (var i = wg * CHUNK + lid; i < min(${N}u, (wg + 1u) * CHUNK); i += ${WG}u) {
        let v = X_ld(i);
        var score = v;
        if (temp > 0.0) { score = select(${NEG}, gumbel(v, temp, i, rkey), v >= cut); }
        if (score > m) { m = score; mi = i; }
    }
    let r = best_of(m, mi, lid);
    if (lid == 0u) { PART[2u * wg] = r.x; PART[2u * wg + 1u] = r.y; }""", dtypes=dtypes, NEG=NEG)
    pick = Template(_TOKEN_PICK).safe_substitute(TOKB=5, HISTB=6)
    tok = (Binding("TOK", "array<u32>"), Binding("HIST", "array<u32>"))
    ks["draw_pick"] = _sample_kernel("sample_draw_pick", n, nwg, pick, """
    var m = ${NEG}; var mi = 0xffffffffu;
    for (var w = lid; w < ${NWG}u; w += ${WG}u) {
        let v = bitcast<f32>(PART[2u * w]); let j = PART[2u * w + 1u];
        if (v > m || (v == m && j < mi)) { m = v; mi = j; }
    }
    pick(m, mi, lid);""", extra=tok, dtypes=dtypes, NEG=NEG)
    chunk = -(-n // nwg)
    ks["topk"] = _sample_kernel("sample_topk", n, nwg, _select_top(-(-chunk // SAMPLE_WG)), """
    let K = min(SAMP[3], ${KMAX}u);
    if (lid == 0u) { atomicStore(&taken, 0u); }
    var m = 0u;
    for (var i = wg * CHUNK + lid; i < min(${N}u, (wg + 1u) * CHUNK); i += ${WG}u) { ck[m] = key_of(X_ld(i)); ci[m] = i; m += 1u; }
    let t = select_top(K, m, lid);
    for (var s = 0u; s < m; s++) {
        if (ranks(ck[s], ci[s], t)) {
            let slot = atomicAdd(&taken, 1u);
            if (slot < K) { PART[wg * ${KSTRIDE}u + 2u * slot] = ck[s]; PART[wg * ${KSTRIDE}u + 2u * slot + 1u] = ci[s]; }
        }
    }
    workgroupBarrier();
    for (var j = atomicLoad(&taken) + lid; j < K; j += ${WG}u) {  // a chunk of fewer than K: the rest rank last
        PART[wg * ${KSTRIDE}u + 2u * j] = 0u; PART[wg * ${KSTRIDE}u + 2u * j + 1u] = 0xffffffffu;
    }""", dtypes=dtypes, KMAX=SAMPLE_TOPK_MAX, KSTRIDE=2 * SAMPLE_TOPK_MAX)
    ks["topk_draw"] = _sample_kernel("sample_topk_draw", n, nwg, pick + _PCG + _select_top(
        -(-nwg * SAMPLE_TOPK_MAX // SAMPLE_WG)) + _TOPK_SORT, """
    let K = min(SAMP[3], ${KMAX}u);
    if (lid == 0u) { atomicStore(&taken, 0u); }
    var m = 0u;
    for (var c = lid; c < ${NWG}u * K; c += ${WG}u) {
        let at = (c / K) * ${KSTRIDE}u + 2u * (c % K);
        ck[m] = PART[at]; ci[m] = PART[at + 1u]; m += 1u;
    }
    let t = select_top(K, m, lid);
    for (var s = 0u; s < m; s++) {
        if (ranks(ck[s], ci[s], t)) {
            let slot = atomicAdd(&taken, 1u);
            if (slot < K) { gk[slot] = ck[s]; gi[slot] = ci[s]; }
        }
    }
    workgroupBarrier();
    for (var j = atomicLoad(&taken) + lid; j < ${KMAX}u; j += ${WG}u) { gk[j] = 0u; gi[j] = 0xffffffffu; }
    sort_kept(lid);
    if (lid == 0u) {  // top-p over the top-k's probabilities, then min-p: a prefix of the ranking
        let top = value_of(gk[0]);
        var total = 0.0;
        for (var j = 0u; j < K; j++) { total += exp(value_of(gk[j]) - top); }
        let top_p = bitcast<f32>(SAMP[2]); let min_p = bitcast<f32>(SAMP[1]);
        var keep = K;
        if (top_p < 1.0) {
            var above = 0.0;  // the mass ranked before token j
            keep = 0u;
            for (var j = 0u; j < K && above < top_p * total; j++) { keep = j + 1u; above += exp(value_of(gk[j]) - top); }
        }
        if (min_p > 0.0) {
            var j = 1u;
            while (j < keep && exp(value_of(gk[j]) - top) >= min_p) { j += 1u; }
            keep = j;
        }
        kept = keep;
    }
    workgroupBarrier();
    let temp = bitcast<f32>(SAMP[0]);
    var sc = ${NEG}; var si = 0xffffffffu;
    if (lid < kept) {
        let v = value_of(gk[lid]);
        si = gi[lid];
        sc = select(v, gumbel(v, temp, si, draw_key()), temp > 0.0);
    }
    pick(sc, si, lid);""", extra=tok, dtypes=dtypes, KMAX=SAMPLE_TOPK_MAX, KSTRIDE=2 * SAMPLE_TOPK_MAX, NEG=NEG)
    return ks


def sample_plan(top_k: int, top_p: float, min_p: float, vocab: int) -> list[tuple[str, bool]]:
    """The kernels (sample_kernels) a sampled step runs, in order, each with whether it is a
    parallel pass (sample_parallelism(vocab) workgroups) or one workgroup. A top-k of at most
    SAMPLE_TOPK_MAX takes the ranked path: two dispatches, where the cuts by thresholds take 38
    with the CLI's defaults (top-k 40, top-p 0.95, min-p 0.05)."""
    plan = []
    by_rank = 0 < top_k < vocab
    if by_rank and top_k <= SAMPLE_TOPK_MAX:
        return [("topk", True), ("topk_draw", False)]
    if by_rank or top_p < 1.0 or min_p > 0:
        plan += [("stats", True), ("stats_done", False)]
        if by_rank:
            plan += [("count", True), ("count_done", False)] * 8
        if top_p < 1.0:
            plan += [("mass", True), ("mass_done", False)] + [("mcount", True), ("mcount_done", False)] * 8
        plan.append(("cut", False))
    return plan + [("draw", True), ("draw_pick", False)]


def sample_part_words(n: int) -> int:
    """The words of the sampler's PART buffer over a row of n logits: 16 a workgroup of a
    parallel pass, or a ranked top-k's candidates (key and id each, SAMPLE_TOPK_MAX a workgroup)."""
    return sample_parallelism(n) * max(16, 2 * SAMPLE_TOPK_MAX)


def sample_words(temperature: float, top_k: int, top_p: float, min_p: float, seed: int) -> "np.ndarray":
    """The SAMP buffer's words for sample_kernels."""
    import numpy as np

    f = np.array([temperature, min_p, top_p], np.float32).view(np.uint32)
    return np.array([f[0], f[1], f[2], top_k, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, 0, 0], np.uint32)


def sample_state(cut: float = float("-inf")) -> "np.ndarray":
    """SAMPLE_STATE as a step without cuts reads it: only the cut (-inf: every logit kept)."""
    import numpy as np

    st = np.zeros(STATE_WORDS, np.uint32)
    st[5] = np.array([max(cut, -3.0e38)], np.float32).view(np.uint32)[0]
    return st


# -- RoPE and the KV cache ----------------------------------------------------------------------
@dataclass(frozen=True)
class RopeFold:
    """RoPE (adjacent pairs, the 'norm' style) and the KV-cache write as a GEMV epilogue
    (gemv_warp's `rope`): the projection's features are q (q_dim), k, v (kv_dim each), heads of
    head_dim features whose first n_rot are rotated; q goes to Y, k and v to the caches KC and VC
    at row step.start + t. Bindings COS/SIN: the rope kernel's tables [position, n_rot / 2]."""

    q_dim: int
    kv_dim: int
    head_dim: int
    n_rot: int
    neox: bool = False  # pairs (i, i + n_rot / 2) of a head, not (2i, 2i+1)

    def wgsl(self) -> str:
        row = ("""    let i = c % RHD;
    if (c >= RQD + RKVD || i >= RROT) { return c; }
    return c - i + (i >> 1u) + (i & 1u) * (RROT / 2u);""" if self.neox else "    return c;")
        return f"""
const RQD: u32 = {self.q_dim}u; const RKVD: u32 = {self.kv_dim}u; const RHD: u32 = {self.head_dim}u;
const RROT: u32 = {self.n_rot}u;
// the weight row (and output column) of the GEMV's feature c: a neox pair's two rows side by side
fn rope_row(c: u32) -> u32 {{
{row}
}}
// features col, col + 1 (col even) of row t: rotated where they are a q or k pair within the
// rotated dimensions, then stored to q or to the caches at the row's position
fn rope_put(t: u32, col: u32, y0: f32, y1: f32) {{
    let pos = step.start + t;
    let i = col % RHD;
    var o0 = y0; var o1 = y1;
    if (col < RQD + RKVD && i < RROT) {{
        let c = COS_ld(pos * (RROT / 2u) + i / 2u); let s = SIN_ld(pos * (RROT / 2u) + i / 2u);
        o0 = y0 * c - y1 * s; o1 = y0 * s + y1 * c;
    }}
    let d0 = rope_row(col); let d1 = rope_row(col + 1u);
    if (col < RQD) {{
        Y_st(t * RQD + d0, o0); Y_st(t * RQD + d1, o1);
    }} else if (col < RQD + RKVD) {{
        KC_st(pos * RKVD + d0 - RQD, o0); KC_st(pos * RKVD + d1 - RQD, o1);
    }} else {{
        VC_st(pos * RKVD + d0 - RQD - RKVD, o0); VC_st(pos * RKVD + d1 - RQD - RKVD, o1);
    }}
}}"""


@dataclass(frozen=True)
class RopeSegment:
    """heads [h0, h0 + n) of the grid read n heads from X at column c0 and write them to `dst`
    (Q: the output rows; KC/VC: the cache rows at the token's position), rotated or copied."""

    n: int
    c0: int
    dst: str  # "Q", "KC" or "VC"
    rotate: bool


def rope(segments: list[RopeSegment], x_cols: int, head_dim: int, n_rot: int, neox: bool, rows: str,
         cache_dtype: str = "f32", *, dtypes: dict | None = None) -> Kernel:
    """RoPE on some heads and the KV-cache write, in one kernel: grid (heads, rows). cos/sin come
    from tables COS/SIN[pos, i] computed on the host in float64 (as the cpu reference does)."""
    dsts = sorted({s.dst for s in segments})
    parts = [(ActDesc("X"), None), (ActDesc("COS"), None), (ActDesc("SIN"), None)]
    parts += [(ActDesc(d, dtype=cache_dtype if d != "Q" else "f32"), None) for d in dsts]
    width = {d: sum(s.n for s in segments if s.dst == d) * head_dim for d in dsts}
    branches, h0 = [], 0
    for k, s in enumerate(segments):
        row = "t" if s.dst == "Q" else "pos"
        prior = sum(x.n for x in segments[:k] if x.dst == s.dst)  # earlier heads written to the same tensor
        rot = "true" if s.rotate else "false"
        branches.append(f"if (h >= {h0}u && h < {h0 + s.n}u) {{ head(t * XW + {s.c0}u + (h - {h0}u) * D, "
                        f"{row} * {width[s.dst]}u + (h - {h0}u + {prior}u) * D, pos, {rot}, {dsts.index(s.dst)}u); }}")
        h0 += s.n
    stores = "\n".join(f"        case {i}u: {{ {d}_st(o, v); }}" for i, d in enumerate(dsts))
    body = """
const D: u32 = ${D}u; const R: u32 = ${R}u; const HALF: u32 = ${R}u / 2u; const XW: u32 = ${XW}u;
var<private> lane: u32;
fn put(which: u32, o: u32, v: f32) {
    switch which {
${STORES}
        default: {}
    }
}
// one head of D values from X at src to tensor `which` at dst, rotated or copied; the 64 threads
// of the workgroup share it
fn head(src: u32, dst: u32, pos: u32, rotate: bool, which: u32) {
    if (rotate) {
        for (var i = lane; i < HALF; i += 64u) {
            let c = COS_ld(pos * HALF + i); let s = SIN_ld(pos * HALF + i);
            let i1 = ${I1}; let i2 = ${I2};
            let x1 = X_ld(src + i1); let x2 = X_ld(src + i2);
            put(which, dst + i1, x1 * c - x2 * s);
            put(which, dst + i2, x1 * s + x2 * c);
        }
        for (var d = R + lane; d < D; d += 64u) { put(which, dst + d, X_ld(src + d)); }
    } else {
        for (var d = lane; d < D; d += 64u) { put(which, dst + d, X_ld(src + d)); }
    }
}
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x; let t = wid.y;
    lane = lid;
    if (t >= ${ROWS_EXPR}) { return; }
    let pos = step.start + t;
    ${BRANCHES}
}
"""
    return _render("rope", parts, body, 64, D=head_dim, R=n_rot, XW=x_cols, ROWS_EXPR=rows,
                   BRANCHES="\n    ".join(branches), STORES=stores,
                   I1="i" if neox else "2u * i", I2="i + HALF" if neox else "2u * i + 1u", dtypes=dtypes)


# -- attention -------------------------------------------------------------------------------------
def attention(n_heads: int, n_kv: int, head_dim: int, scale: float, rows: str, *, partial: bool,
              cache_dtype: str = "f32", wg: int = 64, dtypes: dict | None = None) -> Kernel:
    """Causal attention of query rows t (position start + t) over the cache rows 0..position, one
    workgroup per (head, row, split): keys [split * split_len, ...) in chunks of WG with an online
    softmax. GQA: head h reads KV head h / (n_heads / n_kv). partial: write (acc, max, sum) per
    split to WS for attention_combine (decode split over the context), else the output."""
    dpt = -(-head_dim // wg)
    parts = [(ActDesc("Q"), None), (ActDesc("KC", dtype=cache_dtype), None), (ActDesc("VC", dtype=cache_dtype), None),
             (ActDesc("WS" if partial else "O"), None)]
    if partial:
        out = """for (var i = 0u; i < DPT; i++) { let d = lid + i * WG; if (d < D) { WS_st(base + d, acc[i]); } }
    if (lid == 0u) { WS_st(base + D, m); WS_st(base + D + 1u, l); }"""
    else:
        out = "for (var i = 0u; i < DPT; i++) { let d = lid + i * WG; if (d < D) { O_st(t * H * D + h * D + d, acc[i] / l); } }"
    body = """
const H: u32 = ${H}u; const G: u32 = ${G}u; const D: u32 = ${D}u; const REP: u32 = ${H}u / ${G}u;
const WG: u32 = ${WG}u; const DPT: u32 = ${DPT}u;
var<workgroup> qs: array<f32, ${D}>;
var<workgroup> p: array<f32, ${WG}>;
var<workgroup> red: array<f32, ${WG}>;
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x; let t = wid.y; let sp = wid.z;
    let kvh = h / REP;
    let last = step.start + t;  // the last key this row sees
    let k_begin = sp * step.split_len;
    let k_end = min(last + 1u, k_begin + step.split_len);
    let base = ((t * H + h) * step.n_splits + sp) * (D + 2u);
    for (var d = lid; d < D; d += WG) { qs[d] = Q_ld(t * H * D + h * D + d); }
    workgroupBarrier();
    var m = ${NEG}; var l = 0.0;
    var acc: array<f32, ${DPT}>;
    for (var j0 = k_begin; j0 < k_end; j0 += WG) {
        let j = j0 + lid;
        var s = ${NEG};
        if (j < k_end) {
            var dot = 0.0;
            let kb = j * G * D + kvh * D;
            for (var d = 0u; d < D; d++) { dot += qs[d] * KC_ld(kb + d); }
            s = dot * ${SCALE};
        }
        ${TREE_MAX}
        let mn = max(m, red[0]);
        workgroupBarrier();
        let e = select(0.0, exp(s - mn), j < k_end);
        p[lid] = e;
        ${TREE_SUM}
        let alpha = exp(m - mn);
        l = l * alpha + red[0];
        let n = min(WG, k_end - j0);
        for (var i = 0u; i < DPT; i++) {
            let d = lid + i * WG;
            var a = acc[i] * alpha;
            if (d < D) {
                for (var jj = 0u; jj < n; jj++) { a += p[jj] * VC_ld((j0 + jj) * G * D + kvh * D + d); }
            }
            acc[i] = a;
        }
        m = mn;
        workgroupBarrier();
    }
    ${OUT}
}
"""
    return _render("attention_partial" if partial else "attention", parts, body, wg, H=n_heads, G=n_kv, D=head_dim,
                   DPT=dpt, SCALE=_f(scale), NEG=NEG, OUT=out,
                   TREE_MAX=_tree("s", "lid", "WG", "max"), TREE_SUM=_tree("e", "lid", "WG"), dtypes=dtypes)


def attention_warp_fits(head_dim: int, sg: int) -> bool:
    """Whether attention_warp takes this head size on subgroups of sg lanes: D / 4 lanes (or a
    whole subgroup) per key, a power of two that divides the subgroup and D / 4."""
    if head_dim % 4 or sg < 1:
        return False
    lk = min(sg, head_dim // 4)
    return lk & (lk - 1) == 0 and sg % lk == 0 and (head_dim // 4) % lk == 0


def attention_warp(n_heads: int, n_kv: int, head_dim: int, scale: float, rows: str, *, partial: bool,
                   cache_dtype: str = "f32", sg: int = 32, warps: int = 4, keys_ahead: int = 2,
                   finish: str | None = None, max_splits: int = 32, planes: int = 1, sums: bool = True,
                   dtypes: dict | None = None) -> Kernel:
    """Decode attention with the keys spread over lane groups (attention's drop-in: the same
    grid (heads, rows, splits), Step fields and outputs, partial included). A group of LK =
    min(sg, D / 4) lanes takes one key at a time: each lane reads 16 bytes of the key's K and V
    rows (a group reads a row whole, coalesced, where attention's threads read one key each, a
    row's length apart), the score is reduced across the group by subgroup shuffles, and each
    group keeps its own online softmax (running max, sum and its lanes' share of the output) over
    the keys it takes, `keys_ahead` at a time with their loads issued first: no workgroup
    barrier inside the loop. The groups' states meet in workgroup memory at the end. Needs
    subgroups (sg lanes) and attention_warp_fits(head_dim, sg).

    finish (with partial): the splits merged by the head's last workgroup to finish, so no merge
    dispatch follows (_attention_finish): "o" writes O as the whole attention does; "q" writes O
    quantized into int8 blocks for the output projection's xq (int8_x_parts' XQ, XD [, XS, XQ2];
    head_dim a multiple of 32, a block inside one head). CNT: a u32 per (row, head), zero between
    dispatches (the last workgroup resets its own); max_splits bounds step.n_splits."""
    D = head_dim
    if not attention_warp_fits(D, sg):
        raise ValueError(f"attention_warp: head_dim {D} on subgroups of {sg} lanes (needs D / 4 lanes, or a whole "
                         f"subgroup, per key: a power of two dividing both)")
    if finish not in (None, "o", "q") or (finish and not partial) or (finish == "q" and D % 32):
        raise ValueError(f"attention_warp: finish {finish!r} (None, 'o' or 'q' with partial=True; 'q' needs "
                         f"head_dim a multiple of 32, not {D})")
    D4 = D // 4
    LK = min(sg, D4)
    VPL, NG, KU = D4 // LK, warps * (sg // LK), keys_ahead
    wg = sg * warps
    if finish and NG < max(1, wg // D) + 1:
        raise ValueError(f"attention_warp: finish needs 2 lane groups or more a workgroup (head_dim {D}, {warps} "
                         f"subgroups of {sg})")
    parts = [(ActDesc("Q", vec=4), None), (ActDesc("KC", dtype=cache_dtype, vec=4), None),
             (ActDesc("VC", dtype=cache_dtype, vec=4), None), (ActDesc("WS" if partial else "O"), None)]
    if finish:
        parts.append((RawDesc("CNT", "array<atomic<u32>>"), None))
        parts += [(ActDesc("O"), None)] if finish == "o" else int8_x_parts(planes, sums, "storage")
    qs = "\n".join(f"    let q{c} = Q_ld4((t * H + h) * D4 + gl + {LK * c}u) * ${{SCALE}};" for c in range(VPL))
    accs = " ".join(f"var a{c} = vec4<f32>(0.0);" for c in range(VPL))
    loop = []
    for u in range(KU):
        loop.append(f"        let j{u} = kb + {u}u * NG; let ok{u} = j{u} < k_end;")
        loop.append(f"        let r{u} = (min(j{u}, k_end - 1u) * G + kvh) * D4 + gl;")
        for c in range(VPL):
            loop.append(f"        let k{u}_{c} = KC_ld4(r{u} + {LK * c}u); let v{u}_{c} = VC_ld4(r{u} + {LK * c}u);")
    for u in range(KU):
        loop.append(f"        var s{u} = " + " + ".join(f"dot(q{c}, k{u}_{c})" for c in range(VPL)) + ";")
        if LK > 1:
            loop.append(f"        for (var o = {LK // 2}u; o > 0u; o = o >> 1u) "
                        f"{{ s{u} += subgroupShuffleXor(s{u}, o); }}")
        loop.append(f"        s{u} = select(${{NEG}}, s{u}, ok{u});")
    mx = f"max(m, {'max(' * (KU - 1)}s0{''.join(f', s{u})' for u in range(1, KU))})"
    loop.append(f"        let mn = {mx};")
    loop.append("        let al = exp(m - mn);")
    for u in range(KU):
        loop.append(f"        let p{u} = select(0.0, exp(s{u} - mn), ok{u});")
    loop.append("        l = l * al + " + " + ".join(f"p{u}" for u in range(KU)) + ";")
    for c in range(VPL):
        loop.append(f"        a{c} = a{c} * al + " + " + ".join(f"v{u}_{c} * p{u}" for u in range(KU)) + ";")
    loop.append("        m = mn;")
    store = "\n".join(f"    {{ let o4 = grp * D + 4u * (gl + {LK * c}u); ga[o4] = a{c}.x; ga[o4 + 1u] = a{c}.y; "
                      f"ga[o4 + 2u] = a{c}.z; ga[o4 + 3u] = a{c}.w; }}" for c in range(VPL))
    if partial:
        out = """WS_st(base + d, o);
        if (d == 0u) { WS_st(base + D, M); WS_st(base + D + 1u, L); }"""
    else:
        out = "O_st(t * H * D + h * D + d, o / L);"
    body = """
const H: u32 = ${H}u; const G: u32 = ${G}u; const D: u32 = ${D}u; const D4: u32 = ${D4}u; const REP: u32 = ${H}u / ${G}u;
const NG: u32 = ${NG}u; const KU: u32 = ${KU}u;
var<workgroup> gm: array<f32, ${NG}>;
var<workgroup> gl_: array<f32, ${NG}>;
var<workgroup> ga: array<f32, ${NGD}>;
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x; let t = wid.y; let sp = wid.z;
    let kvh = h / REP;
    let grp = lid / ${LK}u; let gl = lid % ${LK}u;
    let rows_ok = t < ${ROWS_EXPR};
    let last = step.start + t;
    let k_begin = sp * step.split_len;
    let k_end = select(k_begin, min(last + 1u, k_begin + step.split_len), rows_ok);
    let base = ((t * H + h) * step.n_splits + sp) * (D + 2u);
${QS}
    var m = ${NEG}; var l = 0.0;
    ${ACCS}
    let span = select(0u, k_end - k_begin, k_end > k_begin);
    let iters = (span + NG * KU - 1u) / (NG * KU);
    for (var i = 0u; i < iters; i++) {
        let kb = k_begin + grp + i * NG * KU;
${LOOP}
    }
    if (gl == 0u) { gm[grp] = m; gl_[grp] = l; }
${STORE}
    workgroupBarrier();
    if (!rows_ok) { return; }
    var M = ${NEG};
    for (var g = 0u; g < NG; g++) { M = max(M, gm[g]); }
    var L = 0.0;
    for (var g = 0u; g < NG; g++) { L += gl_[g] * exp(gm[g] - M); }
    for (var d = lid; d < D; d += ${WG}u) {
        var o = 0.0;
        for (var g = 0u; g < NG; g++) { o += ga[g * D + d] * exp(gm[g] - M); }
        ${OUT}
    }${FINISH}
}
"""
    fin, decl = _attention_finish(finish, n_heads, D, wg, max_splits, planes, sums) if finish else ("", "")
    body = (decl + body).replace("${QS}", qs).replace("${LOOP}", "\n".join(loop)).replace("${STORE}", store)
    body = body.replace("${FINISH}", fin)
    name = "attention_warp_partial" if partial else "attention_warp"
    return _render(name + (f"_finish_{finish}" if finish else ""), parts, body, wg, H=n_heads, G=n_kv,
                   D=D, D4=D4, NG=NG, NGD=NG * D, KU=KU, LK=LK, SCALE=_f(scale), NEG=NEG, OUT=out, ACCS=accs,
                   ROWS_EXPR=rows, dtypes=dtypes)


def _attention_finish(finish: str, n_heads: int, d: int, wg: int, max_splits: int, planes: int,
                      sums: bool) -> tuple[str, str]:
    """attention_warp's finish: WGSL run after a workgroup wrote its split's partial (its head's D
    values, maximum and sum), and the workgroup-memory declarations it needs. The partial is made
    visible device-wide (storageBarrier: naga's is a device-scope acquire-release barrier on
    storage memory) before the workgroup counts itself in CNT; the workgroup that counts
    step.n_splits returns the count to zero and merges the head's splits: their maxima and sums
    read by one thread each, the weights exp(m - M) / L made once in workgroup memory, then the
    D values a thread each (splits spread over WG / D lanes, 4 loads at once), added across the
    lanes and written to O, or quantized a 32-block a thread (_quantize_block's rounding).
    Workgroup memory: the splits' maxima, sums and weights (3 x max_splits), and attention_warp's
    ga (at least 4 x WG floats, reused: (WG / D + 1) x D <= 2 x WG of it)."""
    nsg = max(1, wg // d)
    decl = (f"{QUANT_AMAX if finish == 'q' else ''}\nvar<workgroup> fin_last: u32;\nvar<workgroup> fin_m: array<f32, {max_splits}>;\n"
            f"var<workgroup> fin_l: array<f32, {max_splits}>;\nvar<workgroup> fin_w: array<f32, {max_splits}>;\n")
    u = 4
    terms = []
    for i in range(u):
        terms.append(f"            let s{i} = s0 + {i * nsg}u; let c{i} = min(s{i}, S - 1u);\n"
                     f"            let v{i} = WS_ld(hb + c{i} * (D + 2u) + e);")
    adds = " + ".join(f"select(0.0, v{i} * fin_w[c{i}], s{i} < S)" for i in range(u))
    if finish == "o":
        out = "O_st(t * H * D + h * D + e, o);"
    else:
        out = f"ga[{nsg}u * D + e] = o;"
    fin = f"""
    storageBarrier();  // the partial written (device scope) before this workgroup is counted
    if (lid == 0u) {{ fin_last = select(0u, 1u, atomicAdd(&CNT[t * H + h], 1u) + 1u == step.n_splits); }}
    if (workgroupUniformLoad(&fin_last) == 0u) {{ return; }}
    storageBarrier();  // every split's partial visible to this, the last workgroup
    if (lid == 0u) {{ atomicStore(&CNT[t * H + h], 0u); }}
    let S = min(step.n_splits, {max_splits}u);
    let hb = (t * H + h) * step.n_splits * (D + 2u);
    for (var s = lid; s < S; s += ${{WG}}u) {{
        fin_m[s] = WS_ld(hb + s * (D + 2u) + D); fin_l[s] = WS_ld(hb + s * (D + 2u) + D + 1u);
    }}
    workgroupBarrier();
    var fm = ${{NEG}};
    for (var s = 0u; s < S; s++) {{ fm = max(fm, fin_m[s]); }}
    var fl = 0.0;
    for (var s = 0u; s < S; s++) {{ fl += fin_l[s] * exp(fin_m[s] - fm); }}
    for (var s = lid; s < S; s += ${{WG}}u) {{ fin_w[s] = exp(fin_m[s] - fm) / fl; }}
    workgroupBarrier();
    for (var i = lid; i < {nsg}u * D; i += ${{WG}}u) {{
        let e = i % D; let g = i / D;
        var o = 0.0;
        for (var s0 = g; s0 < S; s0 += {u * nsg}u) {{
{chr(10).join(terms)}
            o += {adds};
        }}
        ga[g * D + e] = o;
    }}
    workgroupBarrier();
    for (var e = lid; e < D; e += ${{WG}}u) {{
        var o = 0.0;
        for (var g = 0u; g < {nsg}u; g++) {{ o += ga[g * D + e]; }}
        {out}
    }}"""
    if finish == "q":
        vals = " ".join(f"let v{i} = vec4<f32>(ga[q + {4 * i}u], ga[q + {4 * i + 1}u], ga[q + {4 * i + 2}u], "
                        f"ga[q + {4 * i + 3}u]);" for i in range(8))
        fin += f"""
    workgroupBarrier();
    if (lid < D / 32u) {{
        let q = {nsg}u * D + 32u * lid;
        {vals}
        let o = t * (H * D / 32u) + h * (D / 32u) + lid;
{_quantize_block(planes, sums)}    }}"""
    return fin, decl


# the tiled prefill attentions' online softmax: thread `lid` < BM updates row lid's maximum, sum
# and rescale factor (row_m, row_l, row_a) from the tile's BN scores in p, which become exp(s - max)
_ROW_SOFTMAX = """        if (lid < BM) {
            var mx = row_m[lid];
            for (var j = 0u; j < BN; j++) { mx = max(mx, p[lid * BN + j]); }
            var sum = 0.0;
            for (var j = 0u; j < BN; j++) {
                let sv = p[lid * BN + j];
                let e = select(0.0, exp(sv - mx), sv > ${NEG});
                p[lid * BN + j] = e; sum += e;
            }
            let alpha = exp(row_m[lid] - mx);
            row_a[lid] = alpha; row_l[lid] = row_l[lid] * alpha + sum; row_m[lid] = mx;
        }"""


def attention_tiled(n_heads: int, n_kv: int, head_dim: int, scale: float, rows: str, *, cache_dtype: str = "f32",
                    workgroup_bytes: int = 28 * 1024, dtypes: dict | None = None) -> Kernel:
    """Causal prefill attention in tiles (flash attention without matrix units): a workgroup takes
    BM query rows of one head and walks the keys BN at a time; each K/V tile is staged once in
    workgroup memory for all BM rows (the per-row kernel reads it BM times). Thread (i, j) of the
    BM x BN workgroup scores query i against key j; row i's online-softmax state lives in workgroup
    memory; each thread then accumulates D / BN output dimensions of one row. Grid (heads,
    ceil(rows / BM)). The staged q and K rows are D + 1 floats apart: thread (i, j) reads element
    dd of K row j while its neighbours read the same element of the next rows, which at a stride
    of D (a multiple of 32 words) all sit in one of workgroup memory's 32 banks (a 16-way
    conflict on every load of the score loop)."""
    d = head_dim
    bm, bn = _attention_tiles(d, workgroup_bytes)
    wg = bm * bn
    dpt = -(-d // bn)
    parts = [(ActDesc("Q"), None), (ActDesc("KC", dtype=cache_dtype), None), (ActDesc("VC", dtype=cache_dtype), None),
             (ActDesc("O"), None)]
    body = """
const H: u32 = ${H}u; const G: u32 = ${G}u; const D: u32 = ${D}u; const REP: u32 = ${H}u / ${G}u;
const BM: u32 = ${BM}u; const BN: u32 = ${BN}u; const DPT: u32 = ${DPT}u; const DS: u32 = D + 1u;
var<workgroup> qs: array<f32, ${QS}>;
var<workgroup> ks: array<f32, ${KS}>;
var<workgroup> vs: array<f32, ${VS}>;
var<workgroup> p: array<f32, ${BMBN}>;
var<workgroup> row_m: array<f32, ${BM}>;
var<workgroup> row_l: array<f32, ${BM}>;
var<workgroup> row_a: array<f32, ${BM}>;
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x; let m0 = wid.y * BM;
    let kvh = h / REP;
    let n_rows = ${ROWS_EXPR};
    let qi = lid / BN; let kj = lid % BN;
    for (var e = lid; e < BM * D; e += ${WG}u) {
        let r = e / D; let dd = e % D;
        var v = 0.0;
        if (m0 + r < n_rows) { v = Q_ld((m0 + r) * H * D + h * D + dd); }
        qs[r * DS + dd] = v;
    }
    if (lid < BM) { row_m[lid] = ${NEG}; row_l[lid] = 0.0; }
    var acc: array<f32, ${DPT}>;
    let last_row = min(m0 + BM, n_rows) - 1u;
    let k_end = step.start + last_row + 1u;  // keys the tile's last row sees
    for (var j0 = 0u; j0 < k_end; j0 += BN) {
        workgroupBarrier();
        for (var e = lid; e < BN * D; e += ${WG}u) {
            let j = j0 + e / D; let dd = e % D;
            var kv = 0.0; var vv = 0.0;
            if (j < k_end) { kv = KC_ld(j * G * D + kvh * D + dd); vv = VC_ld(j * G * D + kvh * D + dd); }
            ks[(e / D) * DS + dd] = kv; vs[e] = vv;
        }
        workgroupBarrier();
        var sc = ${NEG};
        let qpos = step.start + m0 + qi;
        if (j0 + kj <= qpos && m0 + qi < n_rows) {
            var dot = 0.0;
            for (var dd = 0u; dd < D; dd++) { dot += qs[qi * DS + dd] * ks[kj * DS + dd]; }
            sc = dot * ${SCALE};
        }
        p[lid] = sc;
        workgroupBarrier();
ROW_SOFTMAX
        workgroupBarrier();
        let alpha = row_a[qi];
        for (var c = 0u; c < DPT; c++) {
            let dd = kj + c * BN;
            if (dd < D) {
                var a = acc[c] * alpha;
                for (var j = 0u; j < BN; j++) { a += p[qi * BN + j] * vs[j * D + dd]; }
                acc[c] = a;
            }
        }
    }
    workgroupBarrier();
    if (m0 + qi < n_rows) {
        let l = row_l[qi];
        for (var c = 0u; c < DPT; c++) {
            let dd = kj + c * BN;
            if (dd < D) { O_st((m0 + qi) * H * D + h * D + dd, acc[c] / l); }
        }
    }
}
"""
    body = body.replace("ROW_SOFTMAX", _ROW_SOFTMAX)
    return _render("attention_tiled", parts, body, wg, H=n_heads, G=n_kv, D=d, BM=bm, BN=bn, DPT=dpt, QS=bm * (d + 1),
                   KS=bn * (d + 1), VS=bn * d, BMBN=bm * bn, SCALE=_f(scale), NEG=NEG, ROWS_EXPR=rows, dtypes=dtypes)


BLOCKED_ROWS = 32  # attention_blocked's query rows per workgroup (8 groups of 4, 16 threads each)


def attention_blocked_keys(head_dim: int, workgroup_bytes: int) -> int:
    """attention_blocked's keys per tile (32 or 16) within workgroup_bytes, 0 where it does not
    apply (head_dim not a multiple of 64, or no tile fits)."""
    if head_dim % 64:
        return 0
    for bn in (32, 16):
        if ((BLOCKED_ROWS + bn) * (head_dim // 4 + 1) * 16 + BLOCKED_ROWS * bn * 4 + 3 * BLOCKED_ROWS * 4
                <= workgroup_bytes):
            return bn
    return 0


def attention_blocked(n_heads: int, n_kv: int, head_dim: int, scale: float, rows: str, *, cache_dtype: str = "f32",
                      workgroup_bytes: int = 28 * 1024, dtypes: dict | None = None) -> Kernel:
    """Causal prefill attention in register blocks (flash attention without matrix units): a
    workgroup of 128 threads takes BLOCKED_ROWS query rows of one head (q scaled, staged once)
    and walks the keys BN at a time (attention_blocked_keys), K then V of a tile staged in one
    workgroup buffer. Thread (rg, cg) of 8 x 16 holds 4 query rows: their scores against keys cg,
    cg + 16 (vec4 dot products over q and K rows read from workgroup memory: 4 + BN / 16 loads
    for 4 BN / 16 vec4 products, where attention_tiled's thread per score read two floats per
    product), then, after a thread per row has updated its online softmax, the rows' outputs in
    D / 16 dimensions (4 x D / 64 vec4 accumulators in registers) from the tile's probabilities
    and V. q and K rows D / 4 + 1 vec4s apart (the 16 threads reading 16 K rows at once hit
    different banks). head_dim a multiple of 64; grid (heads, ceil(rows / BLOCKED_ROWS))."""
    d = head_dim
    bn = attention_blocked_keys(d, workgroup_bytes)
    if not bn:
        raise ValueError(f"attention_blocked: head_dim {d} (a multiple of 64) within {workgroup_bytes} bytes of "
                         "workgroup memory")
    kpt, dv, d4 = bn // 16, d // 64, d // 4  # keys per thread, output vec4s per row per thread
    parts = [(ActDesc("Q"), None), (ActDesc("KC", dtype=cache_dtype), None), (ActDesc("VC", dtype=cache_dtype), None),
             (ActDesc("O"), None)]
    rows4, keys = range(4), range(kpt)
    acc_decl = " ".join(f"var a{i}_{e} = vec4<f32>(0.0);" for i in rows4 for e in range(dv))
    s_decl = " ".join(f"var s{i}_{j} = 0.0;" for i in rows4 for j in keys)
    s_loads = " ".join(f"let q{i} = qs[(r0 + {i}u) * ST + c];" for i in rows4) + " " + \
        " ".join(f"let k{j} = kv[(cg + {16 * j}u) * ST + c];" for j in keys)
    s_dots = " ".join(f"s{i}_{j} += dot(q{i}, k{j});" for i in rows4 for j in keys)
    s_store = "\n".join(f"        {{ let key = j0 + cg + {16 * j}u; p[(r0 + {i}u) * BN + cg + {16 * j}u] = "
                         f"select(${{NEG}}, s{i}_{j}, key <= qpos0 + {i}u && key < k_end); }}" for i in rows4 for j in keys)
    rescale = " ".join(f"a{i}_{e} *= al{i};" for i in rows4 for e in range(dv))
    alphas = " ".join(f"let al{i} = row_a[r0 + {i}u];" for i in rows4)
    pv = (" ".join(f"let v{e} = kv[j * ST + cg * {dv}u + {e}u];" for e in range(dv)) + " "
          + " ".join(f"let p{i} = p[(r0 + {i}u) * BN + j];" for i in rows4) + " "
          + " ".join(f"a{i}_{e} += p{i} * v{e};" for i in rows4 for e in range(dv)))
    stores = "\n".join(f"""    if (m0 + r0 + {i}u < n_rows) {{
        let l = row_l[r0 + {i}u]; let ob = (m0 + r0 + {i}u) * H * D + h * D;
{"".join(f"        {{ let o = a{i}_{e} / l; let c = 4u * (cg * {dv}u + {e}u); O_st(ob + c, o.x); O_st(ob + c + 1u, o.y); O_st(ob + c + 2u, o.z); O_st(ob + c + 3u, o.w); }}{chr(10)}" for e in range(dv))}    }}""" for i in rows4)
    body = """
const H: u32 = ${H}u; const G: u32 = ${G}u; const D: u32 = ${D}u; const REP: u32 = ${H}u / ${G}u;
const BM: u32 = ${BM}u; const BN: u32 = ${BN}u; const D4: u32 = ${D4}u; const ST: u32 = ${D4}u + 1u;
var<workgroup> qs: array<vec4<f32>, ${QS}>;
var<workgroup> kv: array<vec4<f32>, ${KS}>;
var<workgroup> p: array<f32, ${BMBN}>;
var<workgroup> row_m: array<f32, ${BM}>;
var<workgroup> row_l: array<f32, ${BM}>;
var<workgroup> row_a: array<f32, ${BM}>;
fn kv_row(j: u32, c: u32, kvh: u32, k: bool) -> vec4<f32> {
    let b = j * G * D + kvh * D + 4u * c;
    if (k) { return vec4<f32>(KC_ld(b), KC_ld(b + 1u), KC_ld(b + 2u), KC_ld(b + 3u)); }
    return vec4<f32>(VC_ld(b), VC_ld(b + 1u), VC_ld(b + 2u), VC_ld(b + 3u));
}
@compute @workgroup_size(128)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x; let m0 = wid.y * BM;
    let kvh = h / REP;
    let n_rows = ${ROWS_EXPR};
    let rg = lid / 16u; let cg = lid % 16u; let r0 = 4u * rg;
    for (var e = lid; e < BM * D4; e += 128u) {
        let r = e / D4; let c = e % D4;
        var v = vec4<f32>(0.0);
        if (m0 + r < n_rows) { let b = (m0 + r) * H * D + h * D + 4u * c; v = vec4<f32>(Q_ld(b), Q_ld(b + 1u), Q_ld(b + 2u), Q_ld(b + 3u)) * ${SCALE}; }
        qs[r * ST + c] = v;
    }
    if (lid < BM) { row_m[lid] = ${NEG}; row_l[lid] = 0.0; }
    ACC_DECL
    let last_row = min(m0 + BM, n_rows) - 1u;
    let k_end = step.start + last_row + 1u;  // keys the tile's last row sees
    let qpos0 = step.start + m0 + r0;
    for (var j0 = 0u; j0 < k_end; j0 += BN) {
        workgroupBarrier();
        for (var e = lid; e < BN * D4; e += 128u) {
            let j = e / D4; let c = e % D4;
            var v = vec4<f32>(0.0);
            if (j0 + j < k_end) { v = kv_row(j0 + j, c, kvh, true); }
            kv[j * ST + c] = v;
        }
        workgroupBarrier();
        S_DECL
        for (var c = 0u; c < D4; c++) { S_LOADS S_DOTS }
S_STORE
        workgroupBarrier();
ROW_SOFTMAX
        for (var e = lid; e < BN * D4; e += 128u) {  // V over K: every score is in p
            let j = e / D4; let c = e % D4;
            var v = vec4<f32>(0.0);
            if (j0 + j < k_end) { v = kv_row(j0 + j, c, kvh, false); }
            kv[j * ST + c] = v;
        }
        workgroupBarrier();
        ALPHAS RESCALE
        for (var j = 0u; j < BN; j++) { PV }
    }
STORES
}
"""
    for k, v in {"ROW_SOFTMAX": _ROW_SOFTMAX, "ACC_DECL": acc_decl, "S_DECL": s_decl, "S_LOADS": s_loads, "S_DOTS": s_dots, "S_STORE": s_store,
                 "ALPHAS": alphas, "RESCALE": rescale, "PV": pv, "STORES": stores}.items():
        body = body.replace(k, v)
    return _render("attention_blocked", parts, body, 128, H=n_heads, G=n_kv, D=d, BM=BLOCKED_ROWS, BN=bn, D4=d4,
                   QS=BLOCKED_ROWS * (d4 + 1), KS=bn * (d4 + 1), BMBN=BLOCKED_ROWS * bn, SCALE=_f(scale), NEG=NEG,
                   ROWS_EXPR=rows, dtypes=dtypes)


# the prefill's causal attention kernels by the name the tuner keeps (tuning.prefill_attention_kind)
PREFILL_ATTENTIONS = {"tiled": attention_tiled, "blocked": attention_blocked}


def _attention_tiles(head_dim: int, workgroup_bytes: int) -> tuple[int, int]:
    """attention_tiled's (BM query rows, BN keys) per workgroup: 16 x 16, halved until q, K (rows
    D + 1 floats apart), V, the scores and the rows' softmax state fit in workgroup_bytes."""
    bm = bn = 16
    while (bm * (head_dim + 1) + bn * (2 * head_dim + 1) + bm * bn + 3 * bm) * 4 > workgroup_bytes and bn > 4:
        bm, bn = bm // 2, bn // 2
    return bm, bn


def attention_tile_rows(head_dim: int, workgroup_bytes: int = 28 * 1024) -> int:
    """BM of attention_tiled for this head size (the grid's second dimension is rows / BM)."""
    return _attention_tiles(head_dim, workgroup_bytes)[0]


def attention_combine(n_heads: int, head_dim: int, rows: str, wg: int = 64, *, dtypes: dict | None = None) -> Kernel:
    """Merge the splits of attention(partial=True): grid (heads, rows). A thread per vec4 of the
    head (_merge_wgsl: an online softmax over the splits, 4 read at once); head sizes not a
    multiple of 4, a thread per element, the splits' maxima and sums read first."""
    if head_dim % 4 == 0:
        body = _merge_wgsl(n_heads, head_dim) + """
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x; let t = wid.y;
    for (var c = lid; c < ${D}u / 4u; c += ${WG}u) {
        let v = merged4(t, h * (${D}u / 4u) + c);
        let o = t * ${H}u * ${D}u + h * ${D}u + 4u * c;
        O_st(o, v.x); O_st(o + 1u, v.y); O_st(o + 2u, v.z); O_st(o + 3u, v.w);
    }
}
"""
        return _render("attention_combine", [(ActDesc("WS"), None), (ActDesc("O"), None)], body, wg, H=n_heads,
                       D=head_dim, dtypes=dtypes)
    body = """
const H: u32 = ${H}u; const D: u32 = ${D}u;
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x; let t = wid.y;
    let S = step.n_splits;
    let base = (t * H + h) * S * (D + 2u);
    var mx = ${NEG};
    for (var s = 0u; s < S; s++) { mx = max(mx, WS_ld(base + s * (D + 2u) + D)); }
    var l = 0.0;
    for (var s = 0u; s < S; s++) { let b = base + s * (D + 2u); l += exp(WS_ld(b + D) - mx) * WS_ld(b + D + 1u); }
    for (var d = lid; d < D; d += ${WG}u) {
        var o = 0.0;
        for (var s = 0u; s < S; s++) { let b = base + s * (D + 2u); o += exp(WS_ld(b + D) - mx) * WS_ld(b + d); }
        O_st(t * H * D + h * D + d, o / l);
    }
}
"""
    return _render("attention_combine", [(ActDesc("WS"), None), (ActDesc("O"), None)], body, wg, H=n_heads,
                   D=head_dim, NEG=NEG, dtypes=dtypes)


def _f(v: float) -> str:
    """A WGSL f32 literal."""
    r = repr(float(v))
    return r if ("e" in r or "." in r) else r + ".0"
