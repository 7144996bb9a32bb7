"""Speed of the cuda backend's Triton kernels on a GPU, at Llama-3.1-8B decode shapes.

    python benchmarks/bench_kernels.py [--formats Q4_0,Q8_0,F16] [--sections copy,gemv,...] [--tune]
                                       [--model llama8b|smollm2] [--json OUT.json]

Method (see NOTES.md, METHOD.md): every timed region is a CUDA graph replayed many times and timed
with events (median of --reps measurements), as the decode loop will run. Weight-streaming
kernels rotate through enough copies of their weights to exceed 4x the L2 cache, so they read
DRAM, not L2. Each kernel's output is first checked against a torch reference at the benchmark
shape. Bandwidth counts the fewest bytes the op must move (weights + activations read, outputs
written) and is given as GB/s and as % of the measured device-to-device copy bandwidth
(bytes read + written).

Sections:
  copy      the copy bandwidth (the 100% of every % column)
  gemv      decode linear at (out, in) = 4096x4096, 14336x4096, 4096x14336 (float and int8 activations),
            with cuBLAS (torch fp16 matmul on the dequantized weight) beside it
  glu       fused gate/up + SiLU at 14336x4096 (two matrices)
  attn      flash-decoding at 32/8 heads, head_dim 128, context 512..16384
  small     rms_norm, rope+KV write, silu_mul, embedding, argmax, quantize_activations (us per launch)
  prefill   linear at 512 tokens (TFLOP/s, cuBLAS beside it) and prefill attention
  token     one whole decode token (all layers + lm head + argmax) in one graph: ms/token, tok/s, % of copy BW;
            with and without programmatic dependent launch, float and int8 activations. The lm head
            is Q8_0 for Q4 formats (llama.cpp's files have Q6_K there, which the backend would requantize)
--tune times every candidate config of gemv (slow: one compile each) and prints the best per shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from edgellm.backends.cuda import kernels as K  # noqa: E402
from edgellm.backends.cuda.kernels import configs  # noqa: E402

GB = 1e9
DEV = "cuda"
DRY = False  # --dry-run: tiny shapes through the interpreter on the CPU, to check the script itself
MODELS = {
    "tiny": dict(layers=2, d=64, heads=6, kv_heads=2, head_dim=32, ffn=96, vocab=300, theta=1e4),
    "llama8b": dict(layers=32, d=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256, theta=5e5),
    "smollm2": dict(layers=30, d=576, heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=49152, theta=1e5),
}
RESULTS: list[dict] = []


# --------------------------------------------------------------------------------------- timing

def l2_bytes() -> int:
    if DRY:
        return 1 << 16
    try:
        return int(torch.cuda.get_device_properties(0).L2_cache_size)
    except Exception:
        return 50 * 2**20


def rotated_copies(w, max_copies: int = 16) -> list:
    """w (a PackedWeight) and copies of it, enough that launches rotating through them read
    DRAM, not the L2 (at least four L2 sizes of bytes, at most max_copies)."""
    import dataclasses

    n = min(max_copies, max(1, -(-4 * l2_bytes() // max(w.nbytes, 1))))
    return [w] + [dataclasses.replace(w, qs=w.qs.clone(), d=None if w.d is None else w.d.clone(),
                                      m=None if w.m is None else w.m.clone()) for _ in range(n - 1)]


def graph_time(fn, inner: int = 1, reps: int = 7, min_ms: float = 20.0) -> float:
    """Seconds per call of fn (which makes `inner` launches of the op): fn captured in a CUDA
    graph, replayed until min_ms elapse per measurement; median over reps measurements."""
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) / inner
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    n = max(1, int(min_ms / 1e3 / one))
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        start.record()
        for _ in range(n):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / n / inner)
    del g
    return statistics.median(times)


def copy_bandwidth() -> float:
    n = 1 << (20 if DRY else 30)
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    a.random_(0, 255)
    t = graph_time(lambda: b.copy_(a))
    return 2 * n / t


def row(section, name, t, nbytes=None, flops=None, copy_bw=None, **extra):
    r = dict(section=section, name=name, us=t * 1e6, **extra)
    line = f"{section:8s} {name:44s} {t * 1e6:10.2f} us"
    if nbytes is not None:
        r["GBps"] = nbytes / t / GB
        line += f" {r['GBps']:8.0f} GB/s"
        if copy_bw:
            r["pct_copy"] = 100 * nbytes / t / copy_bw
            line += f" {r['pct_copy']:6.1f}%"
    if flops is not None:
        r["TFLOPs"] = flops / t / 1e12
        line += f" {r['TFLOPs']:7.1f} TFLOP/s"
    for k, v in extra.items():
        line += f"  {k}={v}"
    print(line, flush=True)
    RESULTS.append(r)


# -------------------------------------------------------------------------------------- weights

def random_packed(fmt: str, n_out: int, n_in: int) -> K.PackedWeight:
    """Random weights in packed form directly on the GPU (any bytes are valid quants)."""
    dev = DEV
    if fmt == "F16":
        return K.PackedWeight("F16", (n_out, n_in), qs=(torch.randn(n_out, n_in, device=dev) * 0.02).half())
    d = (torch.rand(n_out, n_in // 32, device=dev) * 0.01 + 0.001).half()
    if fmt == "Q8_0":
        qs = torch.randint(-127, 128, (n_out, n_in), dtype=torch.int8, device=dev)
        return K.PackedWeight("Q8_0", (n_out, n_in), qs=qs, d=d)
    qs = torch.randint(0, 256, (n_out, n_in // 2), dtype=torch.uint8, device=dev)
    if fmt == "Q4_0":
        return K.PackedWeight("Q4_0", (n_out, n_in), qs=qs, d=d)
    m = (torch.randn(n_out, n_in // 32, device=dev) * 0.01).half()
    return K.PackedWeight("Q4_1", (n_out, n_in), qs=qs, d=d, m=m)


def copies_for(nbytes: int, cap: int = 64) -> int:
    if DRY:
        return 2
    return max(2, min(cap, math.ceil(4 * l2_bytes() / max(nbytes, 1))))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------- sections

def bench_gemv(formats, copy_bw, tune: bool, shapes):
    for fmt in formats:
        for (n, k) in shapes:
            w0 = random_packed(fmt, n, k)
            nb = w0.nbytes
            ws = [w0] + [random_packed(fmt, n, k) for _ in range(copies_for(nb) - 1)]
            x = torch.randn(1, k, device=DEV).half()
            out = torch.empty(1, n, device=DEV, dtype=torch.float16)
            ref = x.float() @ K.dequantize(w0).T
            modes = [False] + ([True] if fmt != "F16" else [])
            for act_int8 in modes:
                K.linear(x, w0, out=out, act_int8=act_int8)
                err = rel_err(out, ref)
                xq = K.quantize_activations(x) if act_int8 else None

                def run(cfg=None):
                    for w in ws:
                        K.linear(x, w, out=out, act_int8=act_int8, xq=xq, config=cfg)

                t = graph_time(run, inner=len(ws))
                tag = "int8" if act_int8 else "float"
                row("gemv", f"{fmt} {n}x{k} {tag}", t, nb + 2 * (k + n), copy_bw=copy_bw, err=f"{err:.1e}")
                if tune:
                    best = None
                    for cfg in configs.gemv_candidates(fmt):
                        try:
                            tc = graph_time(lambda: run(cfg), inner=len(ws), reps=3, min_ms=5)
                        except Exception as e:  # a config that does not compile or fit
                            print(f"    {cfg}: failed ({type(e).__name__})")
                            continue
                        if best is None or tc < best[0]:
                            best = (tc, cfg)
                    if best:
                        row("tune", f"{fmt} {n}x{k} {tag} best", best[0], nb + 2 * (k + n), copy_bw=copy_bw,
                            cfg=best[1])
            if fmt == "F16":  # cuBLAS beside the F16 kernel
                wts = [w.qs for w in ws]
                t = graph_time(lambda: [torch.matmul(x, w.T, out=out) for w in wts], inner=len(ws))
                row("gemv", f"cuBLAS F16 {n}x{k}", t, nb + 2 * (k + n), copy_bw=copy_bw)
            ws = None
            torch.cuda.empty_cache()


def bench_glu(formats, copy_bw, model):
    d, f = model["d"], model["ffn"]
    for fmt in formats:
        w0 = random_packed(fmt, 2 * f, d)
        ws = [w0] + [random_packed(fmt, 2 * f, d) for _ in range(copies_for(w0.nbytes) - 1)]
        x = torch.randn(1, d, device=DEV).half()
        out = torch.empty(1, f, device=DEV, dtype=torch.float16)
        for act_int8 in ([False, True] if fmt != "F16" else [False]):
            K.linear_silu_mul(x, w0, out=out, act_int8=act_int8)
            gu = x.float() @ K.dequantize(w0).T
            ref = torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]
            err = rel_err(out, ref)
            t = graph_time(lambda: [K.linear_silu_mul(x, w, out=out, act_int8=act_int8) for w in ws], inner=len(ws))
            row("glu", f"{fmt} gate+up {2 * f}x{d} {'int8' if act_int8 else 'float'}", t, w0.nbytes + 2 * (d + f),
                copy_bw=copy_bw, err=f"{err:.1e}")
        ws = None
        torch.cuda.empty_cache()


def bench_attn(copy_bw, model, seqs=(512, 2048, 4096, 8192, 16384)):
    H, HKV, D = model["heads"], model["kv_heads"], model["head_dim"]
    ctx = max(seqs)
    n_copies = 4  # caches of several layers, so a step reads DRAM
    caches = [(torch.randn(ctx, HKV * D, device=DEV).half(), torch.randn(ctx, HKV * D, device=DEV).half())
              for _ in range(n_copies)]
    q = torch.randn(1, H * D, device=DEV).half()
    out = torch.empty_like(q)
    for seq in seqs:
        sl = torch.tensor([seq], dtype=torch.int32, device=DEV)
        n_splits = K.default_decode_splits(q, HKV, ctx, 1, H)
        wsp = K.decode_workspace(1, H, D, n_splits, DEV)
        kc, vc = caches[0]
        K.attention_decode(q, kc, vc, sl, H, HKV, out=out, workspace=wsp)
        G = H // HKV
        qh = q.float().view(H, D)
        kk = kc[:seq].float().view(seq, HKV, D).repeat_interleave(G, 1)
        vv = vc[:seq].float().view(seq, HKV, D).repeat_interleave(G, 1)
        p = torch.softmax(torch.einsum("hd,shd->hs", qh, kk) / math.sqrt(D), dim=1)
        err = rel_err(out.view(H, D), torch.einsum("hs,shd->hd", p, vv))
        t = graph_time(lambda: [K.attention_decode(q, c[0], c[1], sl, H, HKV, out=out, workspace=wsp)
                                for c in caches], inner=n_copies)
        row("attn", f"decode seq={seq} splits={n_splits}", t, 2 * seq * HKV * D * 2, copy_bw=copy_bw,
            err=f"{err:.1e}")


def bench_small(copy_bw, model):
    d, H, HKV, D, V, f = model["d"], model["heads"], model["kv_heads"], model["head_dim"], model["vocab"], model["ffn"]
    x = torch.randn(1, d, device=DEV).half()
    res = torch.randn(1, d, device=DEV).half()
    w = torch.randn(d, device=DEV)
    out = torch.empty_like(x)
    t = graph_time(lambda: K.rms_norm(x, w, 1e-5, residual=res, out=out, residual_out=res))
    row("small", f"rms_norm+residual d={d}", t, 4 * d * 2, copy_bw=copy_bw)
    qkv = torch.randn(1, (H + 2 * HKV) * D, device=DEV).half()
    kc = torch.empty(4096, HKV * D, device=DEV, dtype=torch.float16)
    vc = torch.empty_like(kc)
    qo = torch.empty(1, H * D, device=DEV, dtype=torch.float16)
    pos = torch.tensor([100], dtype=torch.int32, device=DEV)
    t = graph_time(lambda: K.rope_qkv_cache(qkv, None, None, kc, vc, pos, H, HKV, D, theta=model["theta"], q_out=qo))
    row("small", "rope + kv write (1 token)", t, 2 * qkv.numel() * 2, copy_bw=copy_bw)
    gu = torch.randn(1, 2 * f, device=DEV).half()
    act = torch.empty(1, f, device=DEV, dtype=torch.float16)
    t = graph_time(lambda: K.silu_mul(gu, out=act))
    row("small", f"silu_mul f={f}", t, 3 * f * 2, copy_bw=copy_bw)
    table = random_packed("Q8_0", V, d)
    ids = torch.tensor([17], dtype=torch.int32, device=DEV)
    t = graph_time(lambda: K.embedding(ids, table, out=out))
    row("small", "embedding Q8_0 (1 token)", t)
    logits = torch.randn(1, V, device=DEV).half()
    tok = torch.empty(1, dtype=torch.int64, device=DEV)
    K.argmax(logits, out=tok)
    assert int(tok) == int(torch.argmax(logits.float())), "argmax disagrees with torch"
    t = graph_time(lambda: K.argmax(logits, out=tok))
    row("small", f"argmax V={V}", t, V * 2, copy_bw=copy_bw)
    qa = K.quantize_activations(x)
    t = graph_time(lambda: K.quantize_activations(x, out=qa))
    row("small", f"quantize_activations d={d}", t)


def bench_prefill(formats, copy_bw, model, T=512):
    d, f = model["d"], model["ffn"]
    x = torch.randn(T, d, device=DEV).half()
    for fmt in formats:
        for (n, k) in ((d, d), (2 * f, d), (d, f)):
            w = random_packed(fmt, n, k)
            xx = x if k == d else torch.randn(T, k, device=DEV).half()
            out = torch.empty(T, n, device=DEV, dtype=torch.float16)
            K.linear(xx, w, out=out)
            wd = K.dequantize(w, torch.float16)
            ref = xx.float() @ wd.float().T
            err = rel_err(out, ref)
            t = graph_time(lambda: K.linear(xx, w, out=out))
            row("prefill", f"{fmt} T={T} {n}x{k}", t, flops=2 * T * n * k, err=f"{err:.1e}")
            if fmt == formats[0]:
                tc = graph_time(lambda: torch.matmul(xx, wd.T, out=out))
                row("prefill", f"cuBLAS F16 T={T} {n}x{k}", tc, flops=2 * T * n * k)
            w = wd = None
    H, HKV, D = model["heads"], model["kv_heads"], model["head_dim"]
    q = torch.randn(T, H * D, device=DEV).half()
    kc = torch.randn(T, HKV * D, device=DEV).half()
    vc = torch.randn(T, HKV * D, device=DEV).half()
    out = torch.empty_like(q)
    t = graph_time(lambda: K.attention_prefill(q, kc, vc, 0, H, HKV, out=out))
    row("prefill", f"attention T={T} causal", t, flops=2 * 2 * H * D * T * T / 2)


def bench_token(formats, copy_bw, model, seq=512, act_int8=False, pdl_modes=(False,)):
    """One decode step of the whole model as one CUDA graph (random weights, random KV cache)."""
    L, d, H, HKV, D, f, V = (model[k] for k in ("layers", "d", "heads", "kv_heads", "head_dim", "ffn", "vocab"))
    ctx = seq + 64
    for fmt in formats:
        if act_int8 and fmt == "F16":
            continue
        layers = []
        for _ in range(L):
            layers.append(dict(
                attn_norm=torch.rand(d, device=DEV) + 0.5, ffn_norm=torch.rand(d, device=DEV) + 0.5,
                wqkv=random_packed(fmt, (H + 2 * HKV) * D, d), wo=random_packed(fmt, d, H * D),
                wgu=random_packed(fmt, 2 * f, d), wdown=random_packed(fmt, d, f),
                kc=torch.randn(ctx, HKV * D, device=DEV).half(), vc=torch.randn(ctx, HKV * D, device=DEV).half()))
        head = random_packed("Q8_0" if fmt.startswith("Q4") else fmt, V, d)
        out_norm = torch.rand(d, device=DEV) + 0.5
        table = random_packed("Q8_0", V, d)
        ids = torch.tensor([5], dtype=torch.int32, device=DEV)
        pos = torch.tensor([seq - 1], dtype=torch.int32, device=DEV)
        seq_t = torch.tensor([seq], dtype=torch.int32, device=DEV)
        h = torch.empty(1, d, device=DEV, dtype=torch.float16)
        xn, o = torch.empty_like(h), torch.empty_like(h)
        qkv = torch.empty(1, (H + 2 * HKV) * D, device=DEV, dtype=torch.float16)
        q, attn = torch.empty(1, H * D, device=DEV, dtype=torch.float16), torch.empty(1, H * D, device=DEV,
                                                                                        dtype=torch.float16)
        act = torch.empty(1, f, device=DEV, dtype=torch.float16)
        logits = torch.empty(1, V, device=DEV, dtype=torch.float16)
        tok = torch.empty(1, dtype=torch.int64, device=DEV)
        n_splits = K.default_decode_splits(q, HKV, ctx, 1, H)
        wsp = K.decode_workspace(1, H, D, n_splits, DEV)

        def step():
            K.embedding(ids, table, out=h)
            for i, ly in enumerate(layers):
                if i == 0:
                    K.rms_norm(h, ly["attn_norm"], 1e-5, out=xn)
                else:
                    K.rms_norm(o, ly["attn_norm"], 1e-5, residual=h, out=xn, residual_out=h)
                K.linear(xn, ly["wqkv"], out=qkv, act_int8=act_int8)
                K.rope_qkv_cache(qkv, None, None, ly["kc"], ly["vc"], pos, H, HKV, D, theta=model["theta"], q_out=q)
                K.attention_decode(q, ly["kc"], ly["vc"], seq_t, H, HKV, out=attn, workspace=wsp)
                K.linear(attn, ly["wo"], out=o, act_int8=act_int8)
                K.rms_norm(o, ly["ffn_norm"], 1e-5, residual=h, out=xn, residual_out=h)
                K.linear_silu_mul(xn, ly["wgu"], out=act, act_int8=act_int8)
                K.linear(act, ly["wdown"], out=o, act_int8=act_int8)
            K.rms_norm(o, out_norm, 1e-5, residual=h, out=xn, residual_out=h)
            K.linear(xn, head, out=logits, act_int8=act_int8)
            K.argmax(logits, out=tok)

        wbytes = sum(ly[k].nbytes for ly in layers for k in ("wqkv", "wo", "wgu", "wdown")) + head.nbytes
        kvbytes = L * 2 * seq * HKV * D * 2
        for use_pdl in pdl_modes:
            K.set_pdl(use_pdl)
            try:
                step()
                if not DRY:
                    torch.cuda.synchronize()
                assert torch.isfinite(logits.float()).all(), "non-finite logits in the token benchmark"
                ref_tok = int(torch.argmax(logits.float()))
                assert int(tok) == ref_tok, f"argmax kernel {int(tok)} vs torch {ref_tok}"
                t = graph_time(step, reps=5, min_ms=50)
            finally:
                K.set_pdl(False)
            tag = f"{fmt}{' int8-act' if act_int8 else ''}{' pdl' if use_pdl else ''} seq={seq}"
            row("token", tag, t, wbytes + kvbytes, copy_bw=copy_bw, tok_per_s=f"{1 / t:.1f}",
                weights_GB=f"{wbytes / GB:.2f}")
        layers = head = None
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="Q4_0,Q8_0,F16")
    ap.add_argument("--sections", default="copy,gemv,glu,attn,small,prefill,token")
    ap.add_argument("--model", default="llama8b", choices=sorted(MODELS))
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--json", default=None, help="also write all rows to this file")
    ap.add_argument("--dry-run", action="store_true",
                    help="check this script on the CPU: TRITON_INTERPRET=1, tiny shapes, numbers meaningless")
    a = ap.parse_args()
    global DEV, DRY
    if a.dry_run:
        if not K.INTERPRET:
            sys.exit("--dry-run needs TRITON_INTERPRET=1 in the environment")
        DEV, DRY, a.model = "cpu", True, "tiny"
    elif not torch.cuda.is_available() or K.INTERPRET:
        sys.exit("bench_kernels.py needs a CUDA GPU (and TRITON_INTERPRET unset)")
    torch.manual_seed(0)
    formats = [s.strip().upper() for s in a.formats.split(",") if s.strip()]
    sections = set(a.sections.split(","))
    model = MODELS[a.model]
    import triton
    if DRY:
        name = "cpu (interpreter dry run)"
    else:
        props = torch.cuda.get_device_properties(0)
        name = f"{props.name}, {props.multi_processor_count} SMs, L2 {l2_bytes() / 2**20:.0f} MiB"
    print(f"device: {name}; torch {torch.__version__}, triton {triton.__version__}; dp4a asm: {K.USE_DP4A}",
          flush=True)
    copy_bw = copy_bandwidth()
    row("copy", "device-to-device copy 1 GiB", 2 * (1 << 30) / copy_bw, 2 * (1 << 30), copy_bw=copy_bw)
    d, f = model["d"], model["ffn"]
    steps = [
        ("gemv", lambda: bench_gemv(formats, copy_bw, a.tune, [(d, d), (f, d), (d, f)])),
        ("glu", lambda: bench_glu(formats, copy_bw, model)),
        ("attn", lambda: bench_attn(copy_bw, model, (40, 67) if DRY else (512, 2048, 4096, 8192, 16384))),
        ("small", lambda: bench_small(copy_bw, model)),
        ("prefill", lambda: bench_prefill(formats, copy_bw, model, T=37 if DRY else 512)),
        ("token", lambda: (bench_token(formats, copy_bw, model, seq=40 if DRY else 512,
                                       pdl_modes=(False,) if DRY else (False, True)),
                           bench_token([x for x in formats if x != "F16"], copy_bw, model, seq=40 if DRY else 512,
                                       act_int8=True, pdl_modes=(False,) if DRY else (False, True)))),
    ]
    for name, fn in steps:
        if name not in sections:
            continue
        try:
            fn()
        except Exception as e:  # one failing section must not hide the others' numbers
            import traceback
            traceback.print_exc()
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            RESULTS.append(dict(section=name, error=f"{type(e).__name__}: {e}"))
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=name, copy_GBps=copy_bw / GB, rows=RESULTS), fh, indent=1)
    print("\nsummary (% = of copy bandwidth):")
    for r in RESULTS:
        if "pct_copy" in r and r["section"] in ("gemv", "glu", "token", "tune"):
            print(f"  {r['section']:6s} {r['name']:44s} {r['pct_copy']:5.1f}%  {r['us']:9.1f} us")


if __name__ == "__main__":
    main()
