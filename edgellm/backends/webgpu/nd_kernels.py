"""WGSL templates for the N-D op kinds of imported networks (edgellm.graph.nd_ops), float32.

Each function renders one kernel for concrete shapes (every size, stride and offset a constant:
a kernel is specialised per layer shape, and layers of one shape share the pipeline) through
kernels._render and codegen's storage descriptors, as the language-model kernels are; none
binds the Step uniform. Tensors are contiguous row-major float32 ranges of a buffer; `A_ld(i)`
reads element i of A, `Y_st(i, v)` writes one. Weights bind read-only.

- `gemm`: the matrix product of convolution (as an implicit GEMM: A is gathered from the NCHW
  input through the kernel window, zero outside the padding), linear (x @ W^T) and matmul
  (batched, broadcast batch axes): a 64 x 64 tile of the output per workgroup of 256 threads,
  4 x 4 outputs per thread; `tiled` stages A and B tiles 16 deep in workgroup memory (GPUs),
  else every thread reads its operands from the buffers (no barriers: a software adapter such
  as lavapipe runs those slowly). Epilogue: bias, activation, residual add, activation after it.
  Split-K (`splits`, `splitk_count`): few tiles over a long K sum K ranges into a float32
  workspace that `gemm_splitk_epilogue` adds up before the epilogue.
- `depthwise`: one output element per thread, the window's products summed in registers.
- `pool`: max / average pooling, one output per thread; `global_avgpool`: one row per thread,
  or (`tiled`, long rows) one row per workgroup reduced in workgroup memory.
- `elementwise`: an expression of up to three inputs read through strides (numpy broadcasting:
  stride 0; transposes; slices with steps; offsets), written through strides: element-wise ops,
  the activations, and every layout copy (reshape, transpose, expand, slice, gather, concat).
- `softmax` (any axis), `layer_norm` (trailing axes; with `add`, the residual sum written too),
  `sdpa` (one query row per thread, online softmax; `sdpa_rows`: one per workgroup, for few rows),
  `reduce_mean` (any axes), `resize` (nearest,
  linear; through the cpu reference's own coordinate tables).
"""

from __future__ import annotations

import math

from .codegen import ActDesc
from .kernels import Kernel, _f, _render

# WGSL helpers every N-D kernel may call (erf, a driver-independent tanh, sigmoid, torch's pow)
ND_HELPERS = """
fn nd_erf(x: f32) -> f32 {  // Abramowitz & Stegun 7.1.26: |error| <= 1.5e-7
    let t = 1.0 / (1.0 + 0.3275911 * abs(x));
    let p = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t;
    let y = 1.0 - p * exp(-x * x);
    return select(-y, y, x >= 0.0);
}
fn nd_tanh(x: f32) -> f32 {  // from exp (drivers may map tanh() to a fast approximation of ~2^-11)
    let a = abs(x);
    if (a < 0.0625) { let x2 = x * x; return x * (1.0 + x2 * (-0.3333333333 + x2 * 0.1333333333)); }
    let t = 1.0 - 2.0 / (exp(2.0 * min(a, 15.0)) + 1.0);
    return select(-t, t, x >= 0.0);
}
fn nd_sigmoid(x: f32) -> f32 { return 1.0 / (1.0 + exp(-x)); }
fn nd_pow(a: f32, b: f32) -> f32 {  // torch.pow: integer exponents of negative bases, x^0 = 1
    if (b == 0.0) { return 1.0; }
    if (b == 1.0) { return a; }
    if (b == 2.0) { return a * a; }
    if (floor(b) == b) {
        let r = pow(abs(a), b);
        return select(r, -r, a < 0.0 && abs(b % 2.0) == 1.0);
    }
    return pow(a, b);
}
"""


def act_expr(act: str | None, args: dict | None, v: str) -> str:
    """WGSL for activation `act` of the f32 expression v (None: v itself): the fused epilogues'
    codes and the unary kinds (cpu_nd.ACTIVATIONS' semantics)."""
    a = args or {}
    if act is None:
        return v
    if act == "relu":
        return f"max({v}, 0.0)"
    if act == "sigmoid":
        return f"nd_sigmoid({v})"
    if act == "tanh":
        return f"nd_tanh({v})"
    if act == "silu":
        return f"({v}) * nd_sigmoid({v})"
    if act == "hardswish":
        return f"({v}) * clamp(({v}) / 6.0 + 0.5, 0.0, 1.0)"
    if act == "hardsigmoid":
        return f"clamp({_f(a.get('alpha', 1 / 6))} * ({v}) + {_f(a.get('beta', 0.5))}, 0.0, 1.0)"
    if act == "gelu":
        if a.get("approximate", "none") == "tanh":
            return f"0.5 * ({v}) * (1.0 + nd_tanh(0.7978845608028654 * (({v}) + 0.044715 * ({v}) * ({v}) * ({v}))))"
        return f"0.5 * ({v}) * (1.0 + nd_erf(({v}) * 0.7071067811865476))"
    if act == "clip":
        lo, hi = a.get("min"), a.get("max")
        e = v if lo is None else f"max({v}, {_f(lo)})"
        return e if hi is None else f"min({e}, {_f(hi)})"
    if act == "erf":
        return f"nd_erf({v})"
    if act == "sqrt":
        return f"sqrt({v})"
    if act == "exp":
        return f"exp({v})"
    if act == "neg":
        return f"-({v})"
    raise ValueError(f"no WGSL for activation {act!r}")


ACTS = ("relu", "sigmoid", "tanh", "silu", "hardswish", "hardsigmoid", "gelu", "clip", "erf", "sqrt", "exp", "neg")
BINARY = {"add": "a + b", "mul": "a * b", "sub": "a - b", "div": "a / b", "pow": "nd_pow(a, b)"}


def _act(name: str, kind: str = "storage") -> tuple:
    return (ActDesc(name, kind=kind), None)


def _nd(name: str, parts: list, body: str, wg: int, dtypes: dict | None = None, **consts) -> Kernel:
    """_render without the Step uniform, with the N-D helpers in front of the body. dtypes:
    binding name -> element type of the tensor bound there ('f32', 'f16': storage; the maths
    stays float32)."""
    return _render(name, parts, ND_HELPERS + body, wg, dtypes=dtypes, step=False, **consts)


def _flat_id() -> str:
    return "let i = (wid.x + wid.y * nwg.x) * ${WG}u + lid;"


_MAIN = ("@compute @workgroup_size(${WG})\n"
         "fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,\n"
         "        @builtin(num_workgroups) nwg: vec3<u32>) {\n")


# -- matrix products --------------------------------------------------------------------------------
def gemm(kind: str, geom: dict, *, tiled: bool, bias: bool = False, act: str | None = None, act_args: dict | None = None,
         residual: bool = False, res_act: str | None = None, res_act_args: dict | None = None,
         weight_b: bool = True, splits: int = 1, dtypes: dict | None = None) -> tuple[Kernel, tuple[int, int, int]]:
    """Y = act2(act(A B + bias) + R) as a tiled matrix product: (kernel, grid (ceil(N / 64), ceil(M / 64), Z)).

    splits > 1 (split-K): workgroup z' = s * Z + z sums only the s-th of `splits` equal ranges of K
    (multiples of 16) and writes its raw sums to P[s * |Y| + y_index] (float32); the epilogue is
    then `gemm_splitk_epilogue`'s, which adds the partial sums. For products whose 64 x 64 tiles
    are too few to fill the GPU while each walks a long K (late convolutions at batch 1).

    kind 'conv': geom N, C, H, W (input), O, OH, OW, KH, KW, SH, SW, PT, PL, DH, DW, G (groups);
    M = N*OH*OW output pixels, the product's N = O/G channels of group z, K = C/G*KH*KW; A
    (input X) gathered through the window, B the weight W [O, C/G*KH*KW] (rows contiguous).
    kind 'linear': geom M, N, K: A = X [M, K], B = W^T (W [N, K]).
    kind 'matmul': geom M, N, K and the batch axes: 'zdims' (the output's batch sizes; Z is
    their product), 'zsa', 'zsb' (their strides in A and B in elements, 0 where broadcast);
    A [M, K] and B [K, N] per batch.
    weight_b: B is a weight (bound read-only)."""
    if kind == "conv":
        g = geom
        M, N, K = g["N"] * g["OH"] * g["OW"], g["O"] // g["G"], g["C"] // g["G"] * g["KH"] * g["KW"]
        khw, ohw = g["KH"] * g["KW"], g["OH"] * g["OW"]
        a_fn = f"""
fn a_at(m: u32, k: u32, z: u32) -> f32 {{
    if (m >= {M}u || k >= {K}u) {{ return 0.0; }}
    let n = m / {ohw}u; let p = m % {ohw}u; let oh = p / {g['OW']}u; let ow = p % {g['OW']}u;
    let c = k / {khw}u; let r = k % {khw}u; let kh = r / {g['KW']}u; let kw = r % {g['KW']}u;
    let ih = i32(oh * {g['SH']}u + kh * {g['DH']}u) - {g['PT']}; let iw = i32(ow * {g['SW']}u + kw * {g['DW']}u) - {g['PL']};
    if (ih < 0 || iw < 0 || ih >= {g['H']} || iw >= {g['W']}) {{ return 0.0; }}
    return X_ld(((n * {g['C']}u + z * {g['C'] // g['G']}u + c) * {g['H']}u + u32(ih)) * {g['W']}u + u32(iw));
}}
fn b_at(k: u32, n: u32, z: u32) -> f32 {{
    if (k >= {K}u || n >= {N}u) {{ return 0.0; }}
    return W_ld((z * {N}u + n) * {K}u + k);
}}
fn y_index(m: u32, n: u32, z: u32) -> u32 {{
    return ((m / {ohw}u) * {g['O']}u + z * {N}u + n) * {ohw}u + m % {ohw}u;
}}
fn bias_index(n: u32, z: u32) -> u32 {{ return z * {N}u + n; }}
"""
        m_fast, a_k_fast, b_k_fast, Z = True, False, True, g["G"]
        parts = [_act("X"), _act("W", "read")]
    elif kind == "linear":
        M, N, K = geom["M"], geom["N"], geom["K"]
        a_fn = f"""
fn a_at(m: u32, k: u32, z: u32) -> f32 {{ if (m >= {M}u || k >= {K}u) {{ return 0.0; }} return X_ld(m * {K}u + k); }}
fn b_at(k: u32, n: u32, z: u32) -> f32 {{ if (k >= {K}u || n >= {N}u) {{ return 0.0; }} return W_ld(n * {K}u + k); }}
fn y_index(m: u32, n: u32, z: u32) -> u32 {{ return m * {N}u + n; }}
fn bias_index(n: u32, z: u32) -> u32 {{ return n; }}
"""
        m_fast, a_k_fast, b_k_fast, Z = False, True, True, 1
        parts = [_act("X"), _act("W", "read" if weight_b else "storage")]
    elif kind == "matmul":
        M, N, K = geom["M"], geom["N"], geom["K"]
        zdims, zsa, zsb = geom["zdims"], geom["zsa"], geom["zsb"]
        Z = math.prod(zdims) if zdims else 1
        offs = ["var r = z; var oa = 0u; var ob = 0u;"]
        for d, sa, sb in reversed(list(zip(zdims, zsa, zsb))):
            offs.append(f"{{ let c = r % {d}u; r = r / {d}u; oa += c * {sa}u; ob += c * {sb}u; }}")
        a_fn = f"""
fn z_off(z: u32) -> vec2<u32> {{ {' '.join(offs)} return vec2<u32>(oa, ob); }}
fn a_at(m: u32, k: u32, z: u32) -> f32 {{ if (m >= {M}u || k >= {K}u) {{ return 0.0; }} return X_ld(z_off(z).x + m * {K}u + k); }}
fn b_at(k: u32, n: u32, z: u32) -> f32 {{ if (k >= {K}u || n >= {N}u) {{ return 0.0; }} return W_ld(z_off(z).y + k * {N}u + n); }}
fn y_index(m: u32, n: u32, z: u32) -> u32 {{ return (z * {M}u + m) * {N}u + n; }}
fn bias_index(n: u32, z: u32) -> u32 {{ return n; }}
"""
        m_fast, a_k_fast, b_k_fast = False, True, False
        parts = [_act("X"), _act("W", "read" if weight_b else "storage")]
    else:
        raise ValueError(f"gemm kind {kind!r}")
    if splits > 1:
        ks = -(-K // (16 * splits)) * 16  # each split's share of K, a multiple of the 16-deep tiles
        parts.append(_act("P"))
        ysize = M * N * Z
        bias = residual = False
        act = None
    else:
        ks = K
        parts.append(_act("Y"))
    if bias:
        parts.append(_act("B", "read"))
    if residual:
        parts.append(_act("R"))
    # thread (tm, tn): rows m0 + tm + 16 i, columns n0 + tn + 16 j (the fast index across threads
    # is the one contiguous in Y: pixels for convolutions, features for products)
    tm, tn = ("tx", "ty") if m_fast else ("ty", "tx")
    accs = " ".join(f"var c{i}{j} = 0.0;" for i in range(4) for j in range(4))
    fmas = "\n".join(f"            c{i}{j} = fma(a{i}, b{j}, c{i}{j});" for i in range(4) for j in range(4))
    if tiled:
        ai = "i % 64u" if not a_k_fast else "i / 16u"
        ak = "i / 64u" if not a_k_fast else "i % 16u"
        bn = "i / 16u" if b_k_fast else "i % 64u"
        bk = "i % 16u" if b_k_fast else "i / 64u"
        loop = f"""
    for (var k0 = kb; k0 < ke; k0 += 16u) {{
        for (var i = lid; i < 1024u; i += 256u) {{
            let am = {ai}; let ak = {ak};
            As[ak * 64u + am] = a_at(m0 + am, k0 + ak, z);
            let bn = {bn}; let bk = {bk};
            Bs[bk * 64u + bn] = b_at(k0 + bk, n0 + bn, z);
        }}
        workgroupBarrier();
        for (var k = 0u; k < 16u; k++) {{
{chr(10).join(f"            let a{i} = As[k * 64u + {tm} + {16 * i}u];" for i in range(4))}
{chr(10).join(f"            let b{j} = Bs[k * 64u + {tn} + {16 * j}u];" for j in range(4))}
{fmas}
        }}
        workgroupBarrier();
    }}"""
        decl = "var<workgroup> As: array<f32, 1024>;\nvar<workgroup> Bs: array<f32, 1024>;"
    else:
        loop = f"""
    for (var k = kb; k < ke; k++) {{
{chr(10).join(f"            let a{i} = a_at(min(m0 + {tm} + {16 * i}u, {M - 1}u), k, z);" for i in range(4))}
{chr(10).join(f"            let b{j} = b_at(k, min(n0 + {tn} + {16 * j}u, {N - 1}u), z);" for j in range(4))}
{fmas}
    }}"""
        decl = ""
    stores = []
    for i in range(4):
        for j in range(4):
            v = f"c{i}{j}"
            if splits > 1:
                stores.append(f"    {{ let m = m0 + {tm} + {16 * i}u; let n = n0 + {tn} + {16 * j}u;\n"
                              f"      if (m < {M}u && n < {N}u) {{ P_st(s * {ysize}u + y_index(m, n, z), {v}); }} }}")
                continue
            e = [f"var v = {v};"]
            if bias:
                e.append("v += B_ld(bias_index(n, z));")
            e.append(f"v = {act_expr(act, act_args, 'v')};")
            if residual:
                e.append("v += R_ld(yi);")
                e.append(f"v = {act_expr(res_act, res_act_args, 'v')};")
            stores.append(f"    {{ let m = m0 + {tm} + {16 * i}u; let n = n0 + {tn} + {16 * j}u;\n"
                          f"      if (m < {M}u && n < {N}u) {{ let yi = y_index(m, n, z); {' '.join(e)} Y_st(yi, v); }} }}")
    body = a_fn + decl + """
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let tx = lid % 16u; let ty = lid / 16u;
    let m0 = wid.y * 64u; let n0 = wid.x * 64u; let z = wid.z % ${Z}u; let s = wid.z / ${Z}u;
    let kb = s * ${KS}u; let ke = min(kb + ${KS}u, ${K}u);
    ${ACCS}
${LOOP}
${STORES}
}
"""
    k = _nd(f"{kind}_gemm" + ("_splitk" if splits > 1 else ""), parts, body, 256, dtypes, ACCS=accs, LOOP=loop,
            STORES="\n".join(stores), Z=Z, KS=ks, K=K)
    return k, (-(-N // 64), -(-M // 64), Z * splits)


def gemm_splitk_epilogue(ysize: int, splits: int, channel: str, *, bias: bool = False, act: str | None = None,
                         act_args: dict | None = None, residual: bool = False, res_act: str | None = None,
                         res_act_args: dict | None = None, dtypes: dict | None = None) -> Kernel:
    """The split-K GEMM's epilogue, one output element per thread (flat grid): Y[i] = act2(act(sum
    over s of P[s * ysize + i] + bias[channel(i)]) + R[i]). channel: a WGSL expression of the flat
    index i giving the bias element (conv: (i / OH*OW) % O; linear: i % N)."""
    parts = [_act("P"), _act("Y")]
    e = []
    if bias:
        parts.append(_act("B", "read"))
        e.append(f"v += B_ld({channel});")
    e.append(f"v = {act_expr(act, act_args, 'v')};")
    if residual:
        parts.append(_act("R"))
        e.append("v += R_ld(i);")
        e.append(f"v = {act_expr(res_act, res_act_args, 'v')};")
    body = _MAIN + "    " + _flat_id() + f"""
    if (i >= {ysize}u) {{ return; }}
    var v = 0.0;
    for (var s = 0u; s < {splits}u; s++) {{ v += P_ld(s * {ysize}u + i); }}
    {' '.join(e)}
    Y_st(i, v);
}}
"""
    return _nd("gemm_splitk_epilogue", parts, body, 256, dtypes)


def splitk_count(m: int, n: int, z: int, k: int, target: int = 256, most: int = 16, auto: bool = True) -> int:
    """How many K ranges a product of M x N (x Z) over K is split into: enough workgroups of 64 x 64
    tiles to reach `target` (about two per SM of a large GPU; the adapter does not say how many it
    has), each range at least 256 deep (16 tiles of 16), at most `most`; 1 without `auto`
    (software adapters: the caller's choice). EDGELLM_WEBGPU_SPLITK=N forces N (1: never split)."""
    import os

    want = os.environ.get("EDGELLM_WEBGPU_SPLITK")
    if want:
        return max(1, min(int(want), -(-k // 16)))
    if not auto:
        return 1
    tiles = -(-m // 64) * -(-n // 64) * z
    if tiles * 2 > target:
        return 1
    return max(1, min(most, target // tiles, k // 256))


# -- convolution windows ---------------------------------------------------------------------------
def depthwise(g: dict, *, bias: bool, act=None, act_args=None, residual=False, res_act=None, res_act_args=None,
              dtypes: dict | None = None) -> Kernel:
    """Grouped convolution with one input channel per group (C = G; O = G * mult): one output
    element per thread. Grid: ceil(N*O*OH*OW / 256) workgroups (2-D when many)."""
    mult = g["O"] // g["G"]
    parts = [_act("X"), _act("W", "read"), _act("Y")]
    if bias:
        parts.append(_act("B", "read"))
    if residual:
        parts.append(_act("R"))
    e = ["var v = s;"]
    if bias:
        e.append("v += B_ld(o);")
    e.append(f"v = {act_expr(act, act_args, 'v')};")
    if residual:
        e.append("v += R_ld(i);")
        e.append(f"v = {act_expr(res_act, res_act_args, 'v')};")
    total = g["N"] * g["O"] * g["OH"] * g["OW"]
    body = _MAIN + f"""    {_flat_id()}
    if (i >= {total}u) {{ return; }}
    let ow = i % {g['OW']}u; let oh = (i / {g['OW']}u) % {g['OH']}u;
    let o = (i / {g['OH'] * g['OW']}u) % {g['O']}u; let n = i / {g['O'] * g['OH'] * g['OW']}u;
    let xb = (n * {g['C']}u + o / {mult}u) * {g['H'] * g['W']}u;
    var s = 0.0;
    for (var kh = 0u; kh < {g['KH']}u; kh++) {{
        let ih = i32(oh * {g['SH']}u + kh * {g['DH']}u) - {g['PT']};
        if (ih < 0 || ih >= {g['H']}) {{ continue; }}
        for (var kw = 0u; kw < {g['KW']}u; kw++) {{
            let iw = i32(ow * {g['SW']}u + kw * {g['DW']}u) - {g['PL']};
            if (iw < 0 || iw >= {g['W']}) {{ continue; }}
            s = fma(X_ld(xb + u32(ih) * {g['W']}u + u32(iw)), W_ld((o * {g['KH']}u + kh) * {g['KW']}u + kw), s);
        }}
    }}
    {' '.join(e)}
    Y_st(i, v);
}}
"""
    return _nd("depthwise", parts, body, 256, dtypes)


def pool(g: dict, *, is_max: bool, count_include_pad: bool, dtypes: dict | None = None) -> Kernel:
    """Max / average pooling over NCHW, one output per thread. geom: N, C, H, W, OH, OW, KH, KW,
    SH, SW, PT, PL, PB, PR, DH, DW. Average: the divisor counts the real elements, or
    (count_include_pad) the window's positions inside the padded input (the cpu reference's
    rule, ceil_mode windows clipped to it); average pooling has no dilation (the reference's)."""
    dh, dw = (g["DH"], g["DW"]) if is_max else (1, 1)
    total = g["N"] * g["C"] * g["OH"] * g["OW"]
    if is_max:
        init, upd, fin = "var s = bitcast<f32>(0xff800000u);", "s = max(s, X_ld(xb + u32(ih) * ${W}u + u32(iw)));", "s"
        pad_count = ""
    else:
        init = "var s = 0.0; var cnt = 0.0; var tot = 0.0;"
        upd = "s += X_ld(xb + u32(ih) * ${W}u + u32(iw)); cnt += 1.0;"
        fin = "s / tot" if count_include_pad else "s / cnt"
        pad_count = ("let hp = i32(oh * ${SH}u + kh) - ${PT}; let wp = i32(ow * ${SW}u + kw) - ${PL};\n"
                     "            if (hp >= -${PT} && hp < ${H} + ${PB} && wp >= -${PL} && wp < ${W} + ${PR}) { tot += 1.0; }")
    body = _MAIN + "    " + _flat_id() + """
    if (i >= ${TOTAL}u) { return; }
    let ow = i % ${OW}u; let oh = (i / ${OW}u) % ${OH}u; let nc = i / (${OH}u * ${OW}u);
    let xb = nc * ${H}u * ${W}u;
    ${INIT}
    for (var kh = 0u; kh < ${KH}u; kh++) {
        for (var kw = 0u; kw < ${KW}u; kw++) {
            ${PADCOUNT}
            let ih = i32(oh * ${SH}u + kh * ${DH}u) - ${PT}; let iw = i32(ow * ${SW}u + kw * ${DW}u) - ${PL};
            if (ih < 0 || iw < 0 || ih >= ${H} || iw >= ${W}) { continue; }
            ${UPD}
        }
    }
    Y_st(i, ${FIN});
}
"""
    body = body.replace("${INIT}", init).replace("${UPD}", upd).replace("${PADCOUNT}", pad_count)
    consts = {k: g[k] for k in ("H", "W", "OH", "OW", "KH", "KW", "SH", "SW", "PT", "PL", "PB", "PR")}
    return _nd("maxpool" if is_max else "avgpool", [_act("X"), _act("Y")], body, 256, dtypes, TOTAL=total, DH=dh, DW=dw,
               FIN=fin, **consts)


def global_avgpool(rows: int, cols: int, *, tiled: bool, wg: int = 64, dtypes: dict | None = None) -> tuple[Kernel, bool]:
    """Mean of each row of X [rows, cols]: one row per thread, or (tiled, cols > wg) one row per
    workgroup of wg threads reduced in workgroup memory (grid: rows workgroups, 2-D when many);
    returns (kernel, whether a workgroup takes one row)."""
    if tiled and cols > wg:
        body = f"""
var<workgroup> red: array<f32, {wg}>;
""" + _MAIN + f"""    let row = wid.x + wid.y * nwg.x;
    var s = 0.0;
    if (row < {rows}u) {{ for (var k = lid; k < {cols}u; k += {wg}u) {{ s += X_ld(row * {cols}u + k); }} }}
    red[lid] = s; workgroupBarrier();
    for (var st = {wg // 2}u; st > 0u; st = st >> 1u) {{ if (lid < st) {{ red[lid] += red[lid + st]; }} workgroupBarrier(); }}
    if (lid == 0u && row < {rows}u) {{ Y_st(row, red[0] / {_f(cols)}); }}
}}
"""
        return _nd("global_avgpool_wg", [_act("X"), _act("Y")], body, wg, dtypes), True
    body = _MAIN + f"""    {_flat_id()}
    if (i >= {rows}u) {{ return; }}
    var s = 0.0;
    for (var k = 0u; k < {cols}u; k++) {{ s += X_ld(i * {cols}u + k); }}
    Y_st(i, s / {_f(cols)});
}}
"""
    return _nd("global_avgpool", [_act("X"), _act("Y")], body, 256, dtypes), False


# -- element-wise and layout ----------------------------------------------------------------------
def coalesce(shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Drop size-1 axes and merge neighbouring axes that every operand walks contiguously
    (stride[d] == stride[d + 1] * shape[d + 1]): fewer divisions per element."""
    dims = [(s, [st[d] for st in strides]) for d, s in enumerate(shape) if s != 1]
    out: list = []
    for s, st in dims:
        if out and all(p == q * s for p, q in zip(out[-1][1], st)):
            out[-1] = (out[-1][0] * s, st)
        else:
            out.append((s, st))
    if not out:
        out = [(1, [0] * len(strides))]
    return tuple(s for s, _ in out), [tuple(o[1][k] for o in out) for k in range(len(strides))]


def elementwise(expr: str, shape: tuple[int, ...], strides: list[tuple[int, ...]], offsets: list[int],
                y_strides: tuple[int, ...] | None = None, y_offset: int = 0, weights: tuple[bool, ...] = (),
                dtypes: dict | None = None) -> Kernel:
    """Y[y_offset + sum c_d ys_d] = expr(a, b, c) with a = A[off_A + sum c_d sA_d], ... over the
    coordinates c of `shape`; strides may be 0 (broadcast) or negative (reversed slices).
    Y contiguous unless y_strides. weights[k]: input k binds read-only. Grid: ceil(total / 256)."""
    names = "ABC"[:len(strides)]
    all_strides = list(strides) + [y_strides if y_strides is not None else _contiguous(shape)]
    shape, all_strides = coalesce(tuple(shape), all_strides)
    total = math.prod(shape)
    lines = ["var r = i;"]
    for d in range(len(shape) - 1, -1, -1):
        lines.append(f"let c{d} = i32(r % {shape[d]}u); r = r / {shape[d]}u;")
    idx = []
    for k, (st, off) in enumerate(zip(all_strides, list(offsets) + [y_offset])):
        terms = [str(off)] + [f"c{d} * {s}" for d, s in enumerate(st) if s != 0]
        idx.append(f"u32({' + '.join(terms)})")
    loads = " ".join(f"let {n.lower()} = {n}_ld({idx[k]});" for k, n in enumerate(names))
    parts = [_act(n, "read" if k < len(weights) and weights[k] else "storage") for k, n in enumerate(names)]
    parts.append(_act("Y"))
    body = _MAIN + f"""    {_flat_id()}
    if (i >= {total}u) {{ return; }}
    {' '.join(lines)}
    {loads}
    Y_st({idx[-1]}, {expr});
}}
"""
    return _nd("elementwise", parts, body, 256, dtypes)


def _contiguous(shape) -> tuple[int, ...]:
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return tuple(reversed(st))


# -- reductions over rows ---------------------------------------------------------------------------
def softmax(outer: int, length: int, inner: int, wg: int = 0, dtypes: dict | None = None) -> Kernel:
    """Softmax along an axis of `length` elements at stride `inner`: one (outer, inner) row per
    thread, or with wg > 0 (the last axis: inner 1) one row per workgroup of wg threads."""
    if wg:
        assert inner == 1
        body = f"var<workgroup> red: array<f32, {wg}>;\n" + _MAIN + f"""    let row = wid.x + wid.y * nwg.x;
    let b = min(row, {outer - 1}u) * {length}u;
    var m = bitcast<f32>(0xff800000u);
    for (var j = lid; j < {length}u; j += {wg}u) {{ m = max(m, X_ld(b + j)); }}
    red[lid] = m; workgroupBarrier();
    for (var st = {wg // 2}u; st > 0u; st = st >> 1u) {{ if (lid < st) {{ red[lid] = max(red[lid], red[lid + st]); }} workgroupBarrier(); }}
    let mx = red[0]; workgroupBarrier();
    var e = 0.0;
    for (var j = lid; j < {length}u; j += {wg}u) {{ e += exp(X_ld(b + j) - mx); }}
    {_row_sum("e", wg)}
    let inv = 1.0 / tot_e;
    if (row < {outer}u) {{ for (var j = lid; j < {length}u; j += {wg}u) {{ Y_st(b + j, exp(X_ld(b + j) - mx) * inv); }} }}
}}
"""
        return _nd("softmax_wg", [_act("X"), _act("Y")], body, wg, dtypes)
    body = _MAIN + f"""    {_flat_id()}
    if (i >= {outer * inner}u) {{ return; }}
    let base = (i / {inner}u) * {length * inner}u + i % {inner}u;
    var m = bitcast<f32>(0xff800000u);
    for (var j = 0u; j < {length}u; j++) {{ m = max(m, X_ld(base + j * {inner}u)); }}
    var s = 0.0;
    for (var j = 0u; j < {length}u; j++) {{ s += exp(X_ld(base + j * {inner}u) - m); }}
    let inv = 1.0 / s;
    for (var j = 0u; j < {length}u; j++) {{ Y_st(base + j * {inner}u, exp(X_ld(base + j * {inner}u) - m) * inv); }}
}}
"""
    return _nd("softmax", [_act("X"), _act("Y")], body, 256, dtypes)


def _row_sum(var: str, wg: int) -> str:
    """WGSL: the sum of `var` over the workgroup's threads into `tot` (workgroup memory `red`)."""
    return (f"red[lid] = {var}; workgroupBarrier();\n"
            f"    for (var st = {wg // 2}u; st > 0u; st = st >> 1u) {{ if (lid < st) {{ red[lid] += red[lid + st]; }} "
            f"workgroupBarrier(); }}\n"
            f"    let tot_{var} = red[0]; workgroupBarrier();\n")


def layer_norm(rows: int, cols: int, eps: float, *, bias: bool, add: bool, weights: tuple[bool, bool] = (False, False),
               wg: int = 0, dtypes: dict | None = None) -> Kernel:
    """Y = (x - mean) / sqrt(var + eps) * G + Bi over rows of `cols` (two passes: mean, then the
    centred variance); add: x = A + B2, the sum also written to S. One row per thread, or with
    wg > 0 one row per workgroup of wg threads (coalesced reads, sums reduced in workgroup
    memory; grid: one workgroup per row, 2-D when many)."""
    parts = [_act("X", "read" if weights[0] else "storage")]
    if add:
        parts.append(_act("X2", "read" if weights[1] else "storage"))
    parts += [_act("G", "read"), _act("Y")]
    if bias:
        parts.append(_act("Bi", "read"))
    if add:
        parts.append(_act("S"))
    ld = "(X_ld(b + k) + X2_ld(b + k))" if add else "X_ld(b + k)"
    again = "S_ld(b + k)" if add else "X_ld(b + k)"
    first = "let v = " + ld + ";" + (" S_st(b + k, v);" if add else "")
    out = "(" + again + " - mean) * inv * G_ld(k)" + (" + Bi_ld(k)" if bias else "")
    if wg:
        body = f"var<workgroup> red: array<f32, {wg}>;\n" + _MAIN + f"""    let row = wid.x + wid.y * nwg.x;
    let ok = row < {rows}u;
    let b = min(row, {rows - 1}u) * {cols}u;
    var s = 0.0;
    for (var k = lid; k < {cols}u; k += {wg}u) {{ {first.replace("S_st(", "if (ok) { S_st(").replace("v);", "v); }") if add else first} s += v; }}
    {_row_sum("s", wg)}
    let mean = tot_s / {_f(cols)};
    var q = 0.0;
    for (var k = lid; k < {cols}u; k += {wg}u) {{ let d = {again if not add else "(X_ld(b + k) + X2_ld(b + k))"} - mean; q = fma(d, d, q); }}
    {_row_sum("q", wg)}
    let inv = inverseSqrt(tot_q / {_f(cols)} + {_f(eps)});
    if (ok) {{ for (var k = lid; k < {cols}u; k += {wg}u) {{ Y_st(b + k, {out.replace("S_ld(b + k)", "(X_ld(b + k) + X2_ld(b + k))") if add else out}); }} }}
}}
"""
        return _nd("add_layer_norm_wg" if add else "layer_norm_wg", parts, body, wg, dtypes)
    body = _MAIN + f"""    {_flat_id()}
    if (i >= {rows}u) {{ return; }}
    let b = i * {cols}u;
    var s = 0.0;
    for (var k = 0u; k < {cols}u; k++) {{ {first} s += v; }}
    let mean = s / {_f(cols)};
    var q = 0.0;
    for (var k = 0u; k < {cols}u; k++) {{ let d = {again} - mean; q = fma(d, d, q); }}
    let inv = inverseSqrt(q / {_f(cols)} + {_f(eps)});
    for (var k = 0u; k < {cols}u; k++) {{ Y_st(b + k, {out}); }}
}}
"""
    return _nd("add_layer_norm" if add else "layer_norm", parts, body, 256, dtypes)


def sdpa(batch: int, sq: int, sk: int, d: int, dv: int, scale: float, dtypes: dict | None = None) -> Kernel:
    """softmax(scale q k^T) v with q [batch, sq, d], k [batch, sk, d], v [batch, sk, dv]: one
    query row per thread, the keys in one pass (online softmax: running maximum and sum, the
    accumulated output rescaled when the maximum grows)."""
    body = _MAIN + f"""    {_flat_id()}
    if (i >= {batch * sq}u) {{ return; }}
    let bq = i * {d}u; let bk = (i / {sq}u) * {sk * d}u; let bv = (i / {sq}u) * {sk * dv}u;
    var q: array<f32, {d}>;
    for (var t = 0u; t < {d}u; t++) {{ q[t] = Q_ld(bq + t) * {_f(scale)}; }}
    var acc: array<f32, {dv}>;
    var m = bitcast<f32>(0xff800000u); var l = 0.0;
    for (var j = 0u; j < {sk}u; j++) {{
        var s = 0.0;
        for (var t = 0u; t < {d}u; t++) {{ s = fma(q[t], K_ld(bk + j * {d}u + t), s); }}
        let mn = max(m, s);
        let corr = exp(m - mn); let p = exp(s - mn);
        l = l * corr + p;
        for (var t = 0u; t < {dv}u; t++) {{ acc[t] = fma(p, V_ld(bv + j * {dv}u + t), acc[t] * corr); }}
        m = mn;
    }}
    let inv = 1.0 / l;
    for (var t = 0u; t < {dv}u; t++) {{ Y_st(i * {dv}u + t, acc[t] * inv); }}
}}
"""
    return _nd("sdpa", [_act("Q"), _act("K"), _act("V"), _act("Y")], body, 256, dtypes)


def sdpa_rows(batch: int, sq: int, sk: int, d: int, dv: int, scale: float, wg: int = 64,
              dtypes: dict | None = None) -> Kernel:
    """sdpa with one query row per workgroup (GPUs; flat grid of batch * sq workgroups): thread t
    keeps an online softmax over keys t, t + wg, ...; the partial maxima, sums and weighted values
    are then combined in workgroup memory (each thread finishes output columns t, t + wg, ...).
    The one-row-per-thread kernel left ViT-B/16's 2,364 query rows on 10 workgroups (76% of its
    time on the H100). Needs wg * (dv + 2) floats of workgroup memory (`sdpa_rows_fits`)."""
    body = _MAIN + f"""    let row = wid.x + wid.y * nwg.x;
    if (row >= {batch * sq}u) {{ return; }}
    let bq = row * {d}u; let bk = (row / {sq}u) * {sk * d}u; let bv = (row / {sq}u) * {sk * dv}u;
    var acc: array<f32, {dv}>;
    var m = -1.0e30; var l = 0.0;
    for (var j = lid; j < {sk}u; j += ${{WG}}u) {{
        var s = 0.0;
        for (var t = 0u; t < {d}u; t++) {{ s = fma(Q_ld(bq + t), K_ld(bk + j * {d}u + t), s); }}
        s = s * {_f(scale)};
        let mn = max(m, s);
        let corr = exp(m - mn); let p = exp(s - mn);
        l = l * corr + p;
        for (var t = 0u; t < {dv}u; t++) {{ acc[t] = fma(p, V_ld(bv + j * {dv}u + t), acc[t] * corr); }}
        m = mn;
    }}
    sm_m[lid] = m;
    workgroupBarrier();
    var mx = -1.0e30;
    for (var u = 0u; u < ${{WG}}u; u++) {{ mx = max(mx, sm_m[u]); }}
    let f = exp(m - mx);  // 0 for a thread that saw no key (m = -1e30)
    sm_l[lid] = l * f;
    for (var t = 0u; t < {dv}u; t++) {{ sm_acc[t * ${{WG}}u + lid] = acc[t] * f; }}
    workgroupBarrier();
    var tot = 0.0;
    for (var u = 0u; u < ${{WG}}u; u++) {{ tot += sm_l[u]; }}
    let inv = 1.0 / tot;
    for (var t = lid; t < {dv}u; t += ${{WG}}u) {{
        var y = 0.0;
        for (var u = 0u; u < ${{WG}}u; u++) {{ y += sm_acc[t * ${{WG}}u + u]; }}
        Y_st(row * {dv}u + t, y * inv);
    }}
}}
"""
    decl = (f"var<workgroup> sm_m: array<f32, {wg}>;\nvar<workgroup> sm_l: array<f32, {wg}>;\n"
            f"var<workgroup> sm_acc: array<f32, {wg * dv}>;\n")
    return _nd("sdpa_rows", [_act("Q"), _act("K"), _act("V"), _act("Y")], decl + body, wg, dtypes)


def sdpa_rows_fits(dv: int, wg: int = 64, workgroup_bytes: int = 16384) -> bool:
    """Whether sdpa_rows' workgroup memory (wg * (dv + 2) floats) fits WebGPU's guaranteed 16 KiB."""
    return 4 * wg * (dv + 2) <= workgroup_bytes


def reduce_mean(shape: tuple[int, ...], axes: tuple[int, ...], dtypes: dict | None = None) -> Kernel:
    """The mean over `axes` of X (shape), one output element per thread (the kept axes in order)."""
    st = _contiguous(shape)
    kept = [d for d in range(len(shape)) if d not in axes]
    red = [d for d in axes]
    n_out = math.prod(shape[d] for d in kept)
    n_red = math.prod(shape[d] for d in red)
    lines = ["var r = i; var base = 0u;"]
    for d in reversed(kept):
        lines.append(f"base += (r % {shape[d]}u) * {st[d]}u; r = r / {shape[d]}u;")
    inner = ["var q = j; var off = base;"]
    for d in reversed(red):
        inner.append(f"off += (q % {shape[d]}u) * {st[d]}u; q = q / {shape[d]}u;")
    body = _MAIN + f"""    {_flat_id()}
    if (i >= {n_out}u) {{ return; }}
    {' '.join(lines)}
    var s = 0.0;
    for (var j = 0u; j < {n_red}u; j++) {{ {' '.join(inner)} s += X_ld(off); }}
    Y_st(i, s / {_f(n_red)});
}}
"""
    return _nd("reduce_mean", [_act("X"), _act("Y")], body, 256, dtypes)


def resize(nc: int, h: int, w: int, oh: int, ow: int, *, linear: bool, dtypes: dict | None = None) -> Kernel:
    """NCHW resize through per-axis tables T (resize_tables' values, float32; indices exact):
    nearest: T = [row index (oh), column index (ow)]; linear: T = [y0, y1, fy (oh each), x0, x1,
    fx (ow each)], the cpu reference's blend (top and bottom rows, then between them). One output
    element per thread."""
    if linear:
        val = (f"let y0 = u32(T_ld(oy)); let y1 = u32(T_ld({oh}u + oy)); let fy = T_ld({2 * oh}u + oy);\n"
               f"    let x0 = u32(T_ld({3 * oh}u + ox)); let x1 = u32(T_ld({3 * oh + ow}u + ox)); "
               f"let fx = T_ld({3 * oh + 2 * ow}u + ox);\n"
               f"    let top = X_ld(b + y0 * {w}u + x0) * (1.0 - fx) + X_ld(b + y0 * {w}u + x1) * fx;\n"
               f"    let bot = X_ld(b + y1 * {w}u + x0) * (1.0 - fx) + X_ld(b + y1 * {w}u + x1) * fx;\n"
               f"    let v = top * (1.0 - fy) + bot * fy;")
    else:
        val = f"let v = X_ld(b + u32(T_ld(oy)) * {w}u + u32(T_ld({oh}u + ox)));"
    body = _MAIN + f"""    {_flat_id()}
    if (i >= {nc * oh * ow}u) {{ return; }}
    let ox = i % {ow}u; let oy = (i / {ow}u) % {oh}u; let b = (i / {oh * ow}u) * {h * w}u;
    {val}
    Y_st(i, v);
}}
"""
    return _nd("resize_linear" if linear else "resize_nearest", [_act("X"), _act("T", "read"), _act("Y")], body, 256,
               dtypes)
