"""Compile the kernels for a GPU architecture without a GPU, and summarise the machine code.

    python -m edgellm.backends.cuda.kernels.compile_check [--arch 90] [--only gemv,attn] [--sass DIR]

Triton compiles to a cubin with the ptxas it ships, so this runs on a CPU-only machine: it catches
what the interpreter cannot (type errors that only code generation sees, layouts, register
spills), and shows per kernel the registers, spills, shared memory, barriers and the instruction
mix (16-byte loads, dp4a, tensor-core instructions), which is how the decode kernels were shaped.

It works by swapping Triton's active driver for one that only names the target, and by making
every launch a compile-only warm-up; the public wrappers are then called on CPU tensors at
Llama-3.1-8B shapes. Nothing here is used at run time.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch


def _install_fake_driver(arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class CompileOnlyDriver:
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(CompileOnlyDriver())


def _bin(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


_SASS_OPS = ["STG", "LDS", "STS", "LDL", "STL",
             "BAR.SYNC", "SHFL", "IDP.4A", "HGMMA", "HMMA", "FFMA", "FMUL", "FADD", "HFMA2", "I2F", "PRMT", "LOP3",
             "SHF", "IMAD", "MUFU", "LDGSTS", "UTMALDG", "SYNCS"]


def summarise(kernel, sass_dir: str | None = None, tag: str = "") -> dict:
    cubin = kernel.asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        usage = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([_bin("cuobjdump"), "--dump-sass", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    regs, stack, shared, local = (int(v) for v in m.groups()) if m else (-1, -1, -1, -1)
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+(?:\.[A-Z0-9_]+)*)", sass, re.M)
    counts = collections.Counter()
    for op in ops:
        if op.startswith("LDG"):  # by width: 16-byte loads are what streaming kernels want
            counts["LDG" + next((w for w in (".128", ".64") if w in op), "") + (".EF" if ".EF" in op else "")] += 1
            continue
        for key in _SASS_OPS:
            if op == key or op.startswith(key + "."):
                counts[key] += 1
                break
    if sass_dir:
        os.makedirs(sass_dir, exist_ok=True)
        safe = re.sub(r"[^\w.-]+", "_", tag)[:120]
        with open(os.path.join(sass_dir, safe + ".sass"), "w") as fh:
            fh.write(sass)
        with open(os.path.join(sass_dir, safe + ".ttgir"), "w") as fh:
            fh.write(kernel.asm["ttgir"])
    return dict(regs=regs, stack=stack, shared=shared, local=local, n_sass=len(ops), ops=dict(counts))


def _cases():
    from . import NormTail, PackedWeight, QuantizedActivations, quantize_activations
    from . import attention_decode, attention_prefill, embedding, linear, linear_silu_mul, rms_norm
    from . import rope_qkv_cache, silu_mul, argmax, head_rms_norm, unary, add_into, take_rows

    def pw(fmt, n, k):
        if fmt == "F16":
            return PackedWeight("F16", (n, k), qs=torch.empty(n, k, dtype=torch.float16))
        if fmt in ("Q6", "Q6M"):
            d = torch.empty(n, k // 16, dtype=torch.float16)
            return PackedWeight(fmt, (n, k), qs=torch.empty(n, k // 32 * 24, dtype=torch.uint8), d=d,
                                m=d if fmt == "Q6M" else None)
        if fmt == "Q6K":
            return PackedWeight("Q6K", (n, k), qs=torch.empty(n, k // 32 * 24, dtype=torch.uint8),
                                d=torch.empty(n, k // 16, dtype=torch.int8), m=torch.empty(n, k // 256, dtype=torch.float32))
        if fmt in ("Q4K", "Q5K"):
            return PackedWeight(fmt, (n, k), qs=torch.empty(n, k // 32 * (16 if fmt == "Q4K" else 20), dtype=torch.uint8),
                                d=torch.empty(n, k // 32, dtype=torch.int16), m=torch.empty(n, k // 128, dtype=torch.float16))
        d = torch.empty(n, k // 32, dtype=torch.float16)
        if fmt == "Q8_0":
            return PackedWeight("Q8_0", (n, k), qs=torch.empty(n, k, dtype=torch.int8), d=d)
        m = d if fmt == "Q4_1" else None
        return PackedWeight(fmt, (n, k), qs=torch.empty(n, k // 2, dtype=torch.uint8), d=d, m=m)

    h16 = torch.float16
    x1, x512 = torch.empty(1, 4096, dtype=h16), torch.empty(512, 4096, dtype=h16)
    for fmt in ("Q4_0", "Q4_1", "Q8_0", "F16", "Q6", "Q6M", "Q4K", "Q5K", "Q6K"):
        w = pw(fmt, 4096, 4096)
        yield f"gemv {fmt}", lambda w=w: linear(x1, w)
        if fmt != "F16":
            yield f"gemv-int8 {fmt}", lambda w=w: linear(x1, w, act_int8=True)
        yield f"glu {fmt}", lambda fmt=fmt: linear_silu_mul(x1, pw(fmt, 2 * 14336, 4096))
        yield f"gemm {fmt}", lambda w=w: linear(x512, w)
        yield f"gemm-m32 {fmt}", lambda w=w: linear(torch.empty(32, 4096, dtype=h16), w)
        # a prefill tile whose scale loads are wide enough (4 bytes a thread) to be copied ahead
        yield f"gemm-k128 {fmt}", lambda w=w: linear(x512, w, config=dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128,
                                                                         num_warps=4, num_stages=3))
        # the serving rows step's skinny product at 16 rows, as the H100's tuner picks it for 8B gate|up
        yield f"gemm-m16-skinny {fmt}", lambda w=w: linear(torch.empty(16, 4096, dtype=h16), w, decode_max_tokens=0,
                                                           config=dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128,
                                                                       num_warps=4, num_stages=3, SPLIT_K=4))
    # the rows step's gate|up product with SiLU(gate) * up in its epilogue, at a tile the tuner picks
    skinny = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, SPLIT_K=4)
    x16 = torch.empty(16, 4096, dtype=h16)
    for fmt in ("Q4_0", "Q4K", "Q6K"):
        yield f"gemm-m16-glu {fmt}", lambda fmt=fmt: linear_silu_mul(x16, pw(fmt, 2 * 14336, 4096), config=skinny,
                                                                   decode_max_tokens=0)
        yield f"gemm-m16-plain {fmt}", lambda fmt=fmt: linear(x16, pw(fmt, 2 * 14336, 4096), config=skinny,
                                                            decode_max_tokens=0)
    yield "quantize_act", lambda: quantize_activations(x1)

    def norm_tail(fmt, int8):  # the o projection with the residual add + RMSNorm after it
        xq = QuantizedActivations(torch.empty(1, 4096, dtype=torch.int8), torch.empty(1, 128), torch.empty(1, 128))
        nt = NormTail(x1, x1, x1.clone(), torch.empty(4096), 1e-5, torch.empty(1, dtype=torch.int32),
                      xq if int8 else None)
        return linear(x1, pw(fmt, 4096, 4096), act_int8=int8, norm=nt)
    for fmt in ("Q4_0", "Q8_0", "F16"):
        yield f"gemv-norm {fmt}", lambda fmt=fmt: norm_tail(fmt, False)
    yield "gemv-norm-int8 Q4_0", lambda: norm_tail("Q4_0", True)
    # Llama-3.1-8B Q4_K_M's output projection (Q6_K, float path, the large tile)
    yield "gemv-output Q6", lambda: linear(x1, pw("Q6", 128256, 4096))
    kc = torch.empty(8192, 1024, dtype=h16)
    q = torch.empty(1, 4096, dtype=h16)
    seq = torch.empty(1, dtype=torch.int32)
    yield "attn-decode", lambda: attention_decode(q, kc, kc, seq, 32, 8)
    yield "attn-prefill", lambda: attention_prefill(torch.empty(512, 4096, dtype=h16), kc, kc, 0, 32, 8)
    yield "rms_norm", lambda: rms_norm(x1, torch.empty(4096), 1e-5, residual=x1, out=x1.clone(), residual_out=x1)
    yield "rope", lambda: rope_qkv_cache(torch.empty(1, 6144, dtype=h16), None, None, kc, kc, seq, 32, 8, 128,
                                         theta=5e5)
    yield "silu_mul", lambda: silu_mul(torch.empty(1, 28672, dtype=h16))
    yield "add_into", lambda: add_into(torch.empty(512, 4096, dtype=h16), torch.empty(512, 4096, dtype=h16))
    yield "take_rows", lambda: take_rows(torch.empty(512, 4096, dtype=h16), torch.empty(1, dtype=torch.int64),
                                         out=torch.empty(1, 4096, dtype=torch.float32))
    # the model families' kernels (gemma3: GeGLU, sliding window, per-head q/k norm, softcap)
    yield "gelu_mul", lambda: silu_mul(torch.empty(1, 4096, dtype=h16), act="gelu_tanh")
    yield "glu-gelu Q8_0", lambda: linear_silu_mul(x1, pw("Q8_0", 2 * 2048, 4096), act="gelu_tanh")
    yield "attn-decode-window", lambda: attention_decode(q, kc, kc, seq, 32, 8, window=512)
    # sliding-window layers' ring caches (window 512 + chunk 512 - 1 rows), long-RoPE's factor
    ring = torch.empty(1023, 1024, dtype=h16)
    yield "attn-prefill-window-ring", lambda: attention_prefill(torch.empty(512, 4096, dtype=h16), ring, ring, seq,
                                                                32, 8, window=512)
    yield "rope-ring-scaled", lambda: rope_qkv_cache(torch.empty(1, 6144, dtype=h16), None, None, ring, ring, seq,
                                                     32, 8, 128, theta=1e4, ring=True, pos_scale=0.125, mscale=1.19)
    yield "head_rms_norm", lambda: head_rms_norm(torch.empty(1, 6144, dtype=h16)[:, :4096], torch.empty(128), 1e-6)
    yield "softcap", lambda: unary(torch.empty(1, 128256, dtype=h16), "softcap", 30.0)
    yield "embedding", lambda: embedding(torch.empty(1, dtype=torch.int32), pw("Q8_0", 128256, 4096))
    yield "embedding Q6", lambda: embedding(torch.empty(1, dtype=torch.int32), pw("Q6", 128256, 2048))
    yield "argmax", lambda: argmax(torch.empty(1, 128256, dtype=h16))
    from . import sample

    f16 = [torch.empty(16, dtype=torch.float32) for _ in range(2)]
    yield "sample", lambda: sample(torch.empty(16, 128256, dtype=torch.float32), *f16,
                                   torch.empty(16, dtype=torch.int64), torch.empty(16, dtype=torch.int32))
    from . import cuts

    yield "sample cuts", lambda: cuts(torch.empty(16, 128256, dtype=torch.float32), torch.empty(16, dtype=torch.int64),
                                      *f16, 128256)
    # the batched decode step of 32 sequences (rows program): per-row positions and KV slots
    from . import attention_rows, decode_workspace, kv_store_rows, rope_rows

    rows = torch.empty(32, dtype=torch.int32)
    q32, k32 = torch.empty(32, 4096, dtype=h16), torch.empty(32, 1024, dtype=h16)
    yield "rope-rows", lambda: rope_rows(q32, rows, 32, 128, theta=5e5)
    yield "rope-store-rows", lambda: rope_qkv_cache(q32, k32, k32, kc, kc, 0, 32, 8, 128, theta=5e5, positions=rows,
                                                    bases=rows)
    yield "kv-store-rows", lambda: kv_store_rows(kc, k32, rows, rows)
    yield "attn-rows", lambda: attention_rows(q32, kc, kc, rows, rows, 32, 8)
    yield "attn-rows-split", lambda: attention_rows(q32, kc, kc, rows, rows, 32, 8, n_splits=4,
                                                    workspace=decode_workspace(32, 32, 128, 4, "cpu"))
    yield "attn-rows-window", lambda: attention_rows(q32, kc, kc, rows, rows, 32, 8, window=512)
    # RoPE and the K/V store in the attention kernel, from a q|k|v buffer's views (the backend's form)
    qkv32 = torch.empty(32, 6144, dtype=h16)
    yield "attn-rows-rope", lambda: attention_rows(qkv32[:, :4096], kc, kc, rows, rows, 32, 8, new_k=qkv32[:, 4096:5120],
                                                   new_v=qkv32[:, 5120:], theta=5e5)
    yield "attn-rows-rope-split", lambda: attention_rows(qkv32[:, :4096], kc, kc, rows, rows, 32, 8, n_splits=4,
                                                         workspace=decode_workspace(32, 32, 128, 4, "cpu"),
                                                         new_k=qkv32[:, 4096:5120], new_v=qkv32[:, 5120:], theta=5e5,
                                                         freq_factors=torch.empty(64), style="neox")
    yield "attn-rows-rope-neox", lambda: attention_rows(qkv32[:, :4096], kc, kc, rows, rows, 32, 8, new_k=qkv32[:, 4096:5120],
                                                        new_v=qkv32[:, 5120:], theta=5e5, style="neox")
    yield "attn-rows-rope-norm-split", lambda: attention_rows(qkv32[:, :4096], kc, kc, rows, rows, 32, 8, n_splits=4,
                                                              workspace=decode_workspace(32, 32, 128, 4, "cpu"),
                                                              new_k=qkv32[:, 4096:5120], new_v=qkv32[:, 5120:], theta=5e5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--only", default="", help="comma-separated name prefixes")
    ap.add_argument("--sass", default=None, help="write each kernel's SASS and TTGIR here")
    ap.add_argument("--parallel", type=int, default=0, metavar="N",
                    help="first compile every case's kernels on N threads, as a first load does "
                         "(precompile.py), then check that the cases' launches find them compiled")
    ap.add_argument("--ahead", default="", metavar="PREFIXES",
                    help="with --parallel: the cases named (comma-separated prefixes) are first sent to the "
                         "compile workers without waiting (precompile.ahead, as a load does for its token "
                         "choice), and the parallel compile must not send them again")
    ap.add_argument("--pdl", action="store_true",
                    help="the kernels as a Hopper load launches them: programmatic dependent launch on, and "
                         "the decode GEMVs' L2 weight prefetch (4 MB a launch)")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: compile_check compiles, it does not interpret")
    _install_fake_driver(a.arch)
    from triton.runtime.jit import JITFunction

    import importlib

    from . import _common
    emb_mod = importlib.import_module(__package__ + ".embedding")

    _common.require_device = lambda t, name: None  # CPU tensors stand in for GPU ones
    if a.pdl:
        _common.set_pdl(True)
        _common.set_l2_prefetch(4 << 20)
    emb_mod.require_device = lambda t, name: None
    _common.sm_count.cache_clear()
    _common.sm_count = lambda index: 132
    only = [s for s in a.only.split(",") if s]
    cases = [(name, call) for name, call in _cases() if not only or any(name.startswith(o) for o in only)]
    ahead = [c for c in cases if any(c[0].startswith(o) for o in a.ahead.split(",") if o)]
    at_launch = _precompile_cases(cases, a.parallel, ahead) if a.parallel > 1 else None
    compiled: list = []
    original_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        k = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, k))
        return k

    JITFunction.run = compile_only
    failures = 0
    print(f"{'case':22s} {'kernel':30s} {'regs':>4s} {'spill':>5s} {'smem':>6s}  instruction mix")
    for name, call in cases:
        start = len(compiled)
        try:
            call()
        except Exception as e:  # report and go on: one broken kernel must not hide the others
            failures += 1
            print(f"{name:22s} FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if os.environ.get("EDGELLM_COMPILE_CHECK_TRACE"):
                import traceback
                traceback.print_exception(e)
            continue
        for kname, k in compiled[start:]:
            s = summarise(k, a.sass, f"{name}-{kname}")
            mix = " ".join(f"{op}:{n}" for op, n in sorted(s["ops"].items(), key=lambda kv: -kv[1]))
            print(f"{name:22s} {kname:30s} {s['regs']:4d} {s['local']:5d} {s['shared']:6d}  {mix}")
    JITFunction.run = original_run
    if at_launch is not None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = None
        print(f"compiled at launch after the parallel compile: {len(at_launch)}"
              + "".join(f"\n  {k}" for k in at_launch))
    return 1 if failures else 0


def _precompile_cases(cases, workers: int, ahead=()) -> list[str]:
    """Compile the cases' kernels on `workers` threads (precompile.collect + compile_all, without
    loading them: there is no GPU), those of `ahead` first sent to the workers without waiting
    (precompile.ahead); print what it did, and return a list that collects every kernel compiled
    at launch afterwards (Triton's jit_cache_hook sees each compile)."""
    from triton import knobs

    from .. import precompile

    def launcher(some):
        def launch():
            for _, call in some:
                try:
                    call()
                except Exception:  # noqa: BLE001 - reported by the case's own run below
                    pass
        return launch
    precompile.start_pool()  # as a first load does (EDGELLM_COMPILE_POOL=thread: a no-op)
    if ahead:
        print(f"sent ahead: {precompile.ahead(launcher(ahead))}")
    specs, collect_s = precompile.collect(launcher(cases))
    report = precompile.compile_all(specs, workers=workers, load=False)
    print(f"parallel compile: {report.kernels} kernels on {workers} threads in {report.compile_s:.2f} s "
          f"(collected in {collect_s:.2f} s; {len(report.failed)} failed; {report.in_workers} compiled by "
          f"worker processes)")
    print(f"sent to the compile workers: {precompile._sent}")
    for err in report.failed:
        print(f"  failed: {err}")
    if precompile.pool_error() is not None:
        print(f"  no worker processes: {precompile.pool_error()}")
    at_launch: list[str] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's names
        at_launch.append(repr)
        return None  # compile as usual
    knobs.runtime.jit_cache_hook = hook
    return at_launch


if __name__ == "__main__":
    sys.exit(main())
