"""Whole models on the webgpu backend against the cpu backend (the float32 reference): tiny
synthetic models of every weight format and both architectures, fused and unfused graphs, the
tiled-GEMM prefill, delegation of ops to the cpu, greedy decoding on the device, and the default
model's answer to the capital question. Skips where there is no WebGPU adapter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("wgpu", reason="the webgpu backend needs the wgpu package (pip install 'edgellm[webgpu]')")

import edgellm  # noqa: E402
from edgellm.errors import BackendUnavailableError, EdgeLLMError  # noqa: E402
from edgellm.sampling import SamplingParams  # noqa: E402
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def adapter():
    from edgellm.backends.webgpu.device import get_device

    try:
        return get_device()
    except BackendUnavailableError as e:
        pytest.skip(f"no WebGPU adapter: {e}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("webgpu_models")
    specs = {
        "F32": SyntheticSpec(weight_type="F32", seed=1),
        "F16": SyntheticSpec(weight_type="F16", seed=2),
        "Q8_0": SyntheticSpec(weight_type="Q8_0", seed=3),
        "Q4_0": SyntheticSpec(weight_type="Q4_0", seed=4, rope_freqs=True),
        "Q4_1": SyntheticSpec(weight_type="Q4_1", seed=5, tied=False, output_type="Q8_0"),
        # Q4_K (as Q4_1) with q|k|v in different formats (Q4_K, Q5_0, Q6_K): stacked as F16 at load
        "mixed": SyntheticSpec(weight_type="Q4_K", seed=6, d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=256,
                               type_overrides={"blk.0.attn_v.weight": "Q6_K", "blk.1.attn_k.weight": "Q5_0"}),
        "qwen2": SyntheticSpec(arch="qwen2", weight_type="Q8_0", seed=7),
        # GQA 8:2 with linear RoPE scaling (positions scaled) and frequency factors
        "rope_scaled": SyntheticSpec(weight_type="Q8_0", seed=8, d_model=128, n_heads=8, n_kv_heads=2, ffn_dim=256,
                                     rope_linear_factor=2.0, rope_freqs=True),
    }
    return {k: str(write_synthetic_gguf(root / f"{k}.gguf", s)) for k, s in specs.items()}


PROMPT = [int(x) for x in np.random.default_rng(11).integers(0, 256, 13)]


@pytest.fixture
def gpu_tuning(monkeypatch, tmp_path, adapter):
    """Tuning on as on a GPU (the software adapter taken for one), the tuning cache in tmp_path,
    no tuner kept from an earlier test."""
    from edgellm.backends.webgpu import tuning

    monkeypatch.setattr(type(adapter.info), "software", property(lambda self: False))
    monkeypatch.setenv("EDGELLM_TUNE", "1")
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_TUNERS", {})
    return tuning


def _compare(path: str, *, fuse: bool = True, chunk: int = 8, steps: int = 3, tol: float = 3e-3):
    """Logits of every prompt position (prefill in chunks, so later chunks start past 0), then
    decode steps, on both backends."""
    cpu = edgellm.load(path, backend="cpu", ctx=64, fuse=fuse, prefill_chunk=chunk)
    gpu = edgellm.load(path, backend="webgpu", ctx=64, fuse=fuse, prefill_chunk=chunk)
    want, got = cpu.logits(PROMPT), gpu.logits(PROMPT)
    scale = float(np.abs(want).max())
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= tol * scale
    tok = int(np.argmax(want[-1]))
    for i in range(steps):
        w = cpu.forward([tok], len(PROMPT) + i, all_logits=False)
        g = gpu.forward([tok], len(PROMPT) + i, all_logits=False)
        assert float(np.abs(g - w).max()) <= tol * scale
        tok = int(np.argmax(w[-1]))
    return gpu


@pytest.mark.parametrize("name", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "mixed", "qwen2"])
def test_synthetic_models_match_cpu(models, name):
    gpu = _compare(models[name])
    if name == "mixed":  # q|k|v of Q4_K, Q6_K (and Q5_0) parts: one six-bit layout, not F16
        fmts = {names: w.fmt for names, w in gpu.backend.weights._mats.items()}
        stacks = [f for names, f in fmts.items() if len(names) == 3]
        assert stacks == ["Q6M", "Q6M"], fmts


@pytest.mark.parametrize("name,gemv", [("Q8_0", "warp:2:64:2"), ("Q4_1", "warp:2:64:2:stage"), ("qwen2", "warp:1:64:1:stage")])
def test_norm_folded_into_decode_gemv(models, monkeypatch, name, gemv):
    """The warp GEMV (forced on the software adapter; x staged in workgroup memory or not) with
    every RMSNorm before a projection folded into it: decode logits still match the cpu backend's, and the norms' dispatches are
    gone (qwen2's biased q|k|v projection too: its bias bound apart from the norm's inputs)."""
    monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", gemv)
    g = _compare(models[name])
    dec = g.programs["decode"]
    kinds = [op.kind for op in dec.graph.ops]
    folds = dec._folds
    assert folds and all(n.kind in ("rms_norm", "add_rms_norm") for n in folds.values())
    n_norms = kinds.count("rms_norm") + kinds.count("add_rms_norm")
    names = [getattr(getattr(st, "kernel", None), "name", "") for st in dec._steps]
    assert names.count("rms_norm") + names.count("add_rms_norm") == n_norms - len(folds)
    assert n_norms == len(folds)
    if name == "qwen2":
        biased = [op.name for op in dec.graph.ops if op.kind == "linear_qkv" and op.attrs.get("has_bias")]
        assert biased and set(biased) <= set(folds)


def _recorded(prog, monkeypatch) -> list[str]:
    """The kernels one decode step of `prog` dispatches, as the backend records them (through the
    steps' objects: the replayed list of handles, _flat, is made from the same steps)."""
    from edgellm.backends.webgpu import backend

    monkeypatch.setattr(backend, "_RAW", None)
    names: list[str] = []
    orig = backend._Dispatch.encode

    def encode(self, cpass, seq, splits):
        if all(int(v) for v in self.grid(seq, splits)):
            names.append(self.kernel.name)
        return orig(self, cpass, seq, splits)

    monkeypatch.setattr(backend._Dispatch, "encode", encode)
    prog.run({"tokens": [3], "start_pos": 5})
    monkeypatch.setattr(backend._Dispatch, "encode", orig)
    return names


@pytest.mark.parametrize("name,gemv", [("Q8_0", "warp:2:64:2"), ("Q4_0", "warp:4:64:1:stage"),
                                       ("rope_scaled", "warp:2:64:1"), ("qwen2", "warp:2:64:1")])
def test_rope_folded_into_decode_gemv(models, monkeypatch, name, gemv):
    """RoPE and the KV-cache write done in the q|k|v projection's warp GEMV (forced on the
    software adapter): prefill and decode logits match the cpu backend's, greedy tokens on the
    device are the cpu's, and the decode step dispatches no rope kernel (qwen2: neox pairs and
    biases)."""
    monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", gemv)
    g = _compare(models[name], steps=4)
    dec = g.programs["decode"]
    names = _recorded(dec, monkeypatch)
    n_qkv = sum(op.kind == "linear_qkv" for op in dec.graph.ops)
    assert n_qkv and len(dec._ropes) == n_qkv and "rope" not in names
    cpu = edgellm.load(models[name], backend="cpu", ctx=64)
    p = SamplingParams(temperature=0)
    assert list(g.generate_tokens(PROMPT, 8, p)) == list(cpu.generate_tokens(PROMPT, 8, p))


@pytest.mark.parametrize("name,gemv", [("Q8_0", "warp:2:64:1"), ("rope_scaled", "warp:1:64:2:stage")])
def test_attention_splits_merged_in_output_gemv(models, monkeypatch, name, gemv):
    """Decode attention split over the context (one split per 4 keys here, 4 to 5 splits) with
    the splits merged in the output projection's GEMV: logits match the cpu backend's, and no
    attention_combine is dispatched; past COMBINE_IN_GEMV_SPLITS, or with the fold off, the
    combine is its own dispatch again. (The "finish" fold, which takes the combine's place where
    the lane-group attention runs, off.)"""
    from edgellm.backends.webgpu import backend

    monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", gemv)
    monkeypatch.setenv("EDGELLM_WEBGPU_FOLD", folds_without("finish"))
    monkeypatch.setattr(backend, "SPLIT_KEYS", 4)
    g = _compare(models[name], steps=4)
    dec = g.programs["decode"]
    n_attn = sum(op.kind == "attention" for op in dec.graph.ops)
    assert len(dec._combines) == n_attn
    names = _recorded(dec, monkeypatch)  # 6 keys: 2 splits
    partial = ("attention_partial", "attention_warp_partial")  # the thread-per-key or the lane-group kernel
    assert sum(n in partial for n in names) == n_attn and "attention_combine" not in names
    monkeypatch.setattr(backend, "COMBINE_IN_GEMV_SPLITS", 1)
    names = _recorded(dec, monkeypatch)
    assert sum(n in partial for n in names) == names.count("attention_combine") == n_attn
    monkeypatch.setattr(backend, "COMBINE_IN_GEMV_SPLITS", backend.MAX_SPLITS)
    monkeypatch.setenv("EDGELLM_WEBGPU_FOLD", "last_row,norm,rope")
    g = _compare(models[name], steps=2)
    assert not g.programs["decode"]._combines
    assert _recorded(g.programs["decode"], monkeypatch).count("attention_combine") == n_attn


@pytest.mark.parametrize("name,gemv", [("Q8_0", "warp:2:64:1:stage:int8"), ("qwen2", "warp:2:64:1:stage:int8"),
                                       ("Q4_0", "warp:4:64:2:stage:int8"), ("mixed", "warp:2:64:1:stage:int8"),
                                       ("Q4_0", "warp:4:64:2:stage:int8x2"), ("mixed", "warp:2:64:1:stage:int8x2")])
def test_int8_activations(models, monkeypatch, name, gemv):
    """EDGELLM_WEBGPU_GEMV=...:int8: the decode GEMVs of Q8_0, Q4_0 and the K-quants' layouts
    (mixed: Q4_1, Q6, Q6M) stage x as int8 blocks (their kernels use dot4I8Packed) and the logits
    stay within 1% of the cpu backend's (2% for mixed: 4-bit weights throughout, d_model 256),
    with the folds on; in two planes (int8x2) within the float path's 0.3%. Each kernel's own
    rounding is checked exactly in test_webgpu_kernels."""
    monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", gemv)
    tol = 3e-3 if gemv.endswith("int8x2") else 2e-2 if name == "mixed" else 1e-2
    dec = _compare(models[name], steps=3, tol=tol).programs["decode"]
    kinds = [getattr(st, "kernel", None) or st.pick(1, 1)[0].kernel for st in dec._steps]
    assert sum("dot4I8Packed" in k.source for k in kinds) >= 4


@pytest.mark.parametrize("name,gemv", [("Q8_0", "warp:2:64:1:int8x2:xq"), ("Q4_0", "warp:4:64:2:int8:xq"),
                                       ("mixed", "warp:2:64:1:int8x2:xq")])
def test_int8_x_quantized_ahead(models, monkeypatch, name, gemv):
    """EDGELLM_WEBGPU_GEMV=...:xq: every decode GEMV but the one reading the embedding weight in
    its prologue quantizes x in a dispatch of its own (quantize_x) and reads the codes from there
    unstaged; where the GEMV would fold an RMSNorm (with the residual add) or the attention
    splits' merge, quantize_x does that work (its source reads A and G, or WS, and a step with
    splits picks that variant); the logits stay within the int8 path's tolerance of the cpu
    backend's with decode attention split (one split per 4 keys: 4 to 5 splits). (The "finish"
    fold off: test_attention_finishes_its_merge.)"""
    from edgellm.backends.webgpu import backend

    monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", gemv)
    monkeypatch.setenv("EDGELLM_WEBGPU_FOLD", folds_without("finish"))
    monkeypatch.setattr(backend, "SPLIT_KEYS", 4)
    tol = 3e-3 if "int8x2" in gemv else 2e-2 if name == "mixed" else 1e-2
    dec = _compare(models[name], steps=3, tol=tol).programs["decode"]
    for splits in (1, 2):
        ds = [d for st in dec._steps for d in (st.pick(1, splits) if hasattr(st, "pick") else (st,))]
        names = [d.kernel.name for d in ds]
        quant = [i for i, n in enumerate(names) if n == "quantize_x"]
        assert quant and all(names[i + 1] == "gemv_warp" and "XQ[xo + " in ds[i + 1].kernel.source for i in quant)
        linears = [o for o in dec.graph.ops if o.kind in ("linear", "linear_qkv", "linear_swiglu")]
        # the down projections' x quantized by their gate|up GEMVs where those hold 32-row blocks
        assert len(quant) == len(linears) - len(dec._embeds) - len(dec._qouts) >= 1
        srcs = [ds[i].kernel.source for i in quant]
        assert sum("inverseSqrt" in q for q in srcs) == len(dec._folds) - len(dec._embeds) >= 1
        merged = sum("WS_ld" in q for q in srcs)
        assert merged == (len(dec._combines) if splits > 1 else 0)
        staged = [d for d in ds if d.kernel.name == "gemv_warp" and "XQ[xo + " not in d.kernel.source]
        assert len(staged) == len(dec._embeds) and all("dot4I8Packed" in d.kernel.source for d in staged)
    assert dec._combines


@pytest.mark.parametrize("name,gemv", [("Q8_0", "warp:2:64:1"), ("qwen2", "warp:2:64:1:stage:int8"),
                                       ("Q4_0", "warp:4:64:2:int8:xq"), ("mixed", "warp:2:64:1:int8x2:xq"),
                                       ("mixed", "warp:4:64:2:int8:xq")])
def test_attention_finishes_its_merge(models, monkeypatch, adapter, name, gemv):
    """The "finish" fold: decode attention split over the context (one split per 4 keys: 2 to 5
    splits) merges its splits in each head's last workgroup: logits match the cpu backend's
    (int8 tolerances where x is int8), a step dispatches one finishing attention per layer and no
    attention_combine; where the output projection reads x quantized ahead (xq) and heads are
    whole 32-blocks (mixed: 64), the attention writes x's int8 blocks ("q") and no quantize_x
    runs before that GEMV (head size 16: "o", then quantize_x); greedy tokens on the device are
    the cpu's (float x) or those with the fold off (int8 x, the same rounding); with the fold off
    the merge is in the output projection again."""
    from edgellm.backends.webgpu import backend

    if not adapter.subgroup_size:
        pytest.skip("the lane-group attention needs the adapter's subgroup size")
    monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", gemv)
    monkeypatch.setattr(backend, "SPLIT_KEYS", 4)
    int8 = "int8" in gemv
    tol = 3e-3 if "int8x2" in gemv or not int8 else 2e-2 if name == "mixed" else 1e-2
    gpu = _compare(models[name], steps=4, tol=tol)
    dec = gpu.programs["decode"]
    n_attn = sum(op.kind == "attention" for op in dec.graph.ops)
    mode = "q" if gemv.endswith(":xq") and name == "mixed" else "o"
    assert len(dec._finished) == n_attn and not dec._combines and len(dec._attn_quant) == (n_attn if mode == "q" else 0)
    names = _recorded(dec, monkeypatch)  # 6 keys: 2 splits
    assert names.count(f"attention_warp_partial_finish_{mode}") == n_attn and "attention_combine" not in names
    if gemv.endswith(":xq"):
        linears = [o for o in dec.graph.ops if o.kind in ("linear", "linear_qkv", "linear_swiglu")]
        assert names.count("quantize_x") == len(linears) - len(dec._embeds) - len(dec._qouts) - len(dec._attn_quant)
    p = SamplingParams(temperature=0)
    monkeypatch.setenv("EDGELLM_WEBGPU_FOLD", folds_without("finish"))
    other = edgellm.load(models[name], backend="webgpu" if int8 else "cpu", ctx=64)
    if int8:
        assert not other.programs["decode"]._finished and other.programs["decode"]._combines
    assert list(gpu.generate_tokens(PROMPT, 8, p)) == list(other.generate_tokens(PROMPT, 8, p))


def test_attention_finish_not_on_metal(models, monkeypatch, adapter):
    """Metal's storage barrier (naga: threadgroup_barrier(mem_device)) orders memory for its
    threadgroup only, so on a Metal adapter the split merge stays in the output projection
    ("combine") and the logits match the cpu backend's."""
    from edgellm.backends.webgpu import backend

    if not adapter.subgroup_size:
        pytest.skip("the lane-group attention needs the adapter's subgroup size")
    monkeypatch.setattr(adapter.info, "backend", "Metal")
    monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", "warp:2:64:1")
    monkeypatch.setattr(backend, "SPLIT_KEYS", 4)
    dec = _compare(models["Q8_0"], steps=2).programs["decode"]
    assert not dec._finished and dec._combines


@pytest.mark.parametrize("name,gemv", [("Q8_0", "warp:4:256:1:int8x2:xq"), ("Q4_0", "warp:4:256:2:int8:xq"),
                                       ("Q4_1", "warp:8:256:2:int8x2:xq")])
def test_gate_up_quantizes_the_down_projections_x(models, monkeypatch, name, gemv):
    """With gate|up GEMVs of 32-row blocks per workgroup and the down projections reading x
    quantized ahead (xq), the gate|up GEMV quantizes its output in its epilogue (gemv_warp's
    qout, into the "int8_y" workspace) and the down projection reads it there: no quantize_x
    dispatch before it, one dispatch fewer a layer than with the fold off, the same logits as the
    cpu backend's within the int8 tolerance, and the same as with a quantize_x dispatch."""
    monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", gemv)
    tol = 3e-3 if "int8x2" in gemv else 1e-2
    gpu = _compare(models[name], steps=3, tol=tol)
    dec = gpu.programs["decode"]
    glus = [o for o in dec.graph.ops if o.kind == "linear_swiglu"]
    assert glus and set(dec._qouts) == {r.name for g in glus for r in dec.graph.ops if g.outputs[0] in r.inputs}
    ds = [d for st in dec._steps for d in (st.pick(1, 1) if hasattr(st, "pick") else (st,))]
    qsrc = [d.kernel.source for d in ds if d.kernel.name == "gemv_warp" and "YQ[" in d.kernel.source]
    assert len(qsrc) == len(glus)
    monkeypatch.setenv("EDGELLM_WEBGPU_FOLD", ",".join(f for f in backend_folds() if f != "qout"))
    off = edgellm.load(models[name], backend="webgpu", ctx=64)
    dec_off = off.programs["decode"]
    n_off = sum(len(st.pick(1, 1)) if hasattr(st, "pick") else 1 for st in dec_off._steps)
    assert not dec_off._qouts and n_off == len(ds) + len(glus)
    a, b = gpu.logits(PROMPT), off.logits(PROMPT)
    tok = int(np.argmax(a[-1]))
    ga = gpu.forward([tok], len(PROMPT), all_logits=False)
    gb = off.forward([tok], len(PROMPT), all_logits=False)
    assert float(np.abs(ga - gb).max()) <= 1e-5 * float(np.abs(gb).max())


@pytest.mark.parametrize("qout_us,used", [(12.0, True), (16.0, False)])
def test_gate_up_qout_tuned(models, monkeypatch, adapter, gpu_tuning, qout_us, used):
    """With tuning on, a gate|up GEMV whose pick holds 16 rows a workgroup is timed again among
    the 32-row candidates with its output quantized (qout) and takes that where it is no slower
    than its pick plus the down projection's quantize_x (10 + 5 us here): at 12 us it does (the
    32-row configuration lowered, the down projection's quantize_x gone), at 16 it does not;
    the logits match the cpu backend's either way."""
    tuning = gpu_tuning
    sg = adapter.subgroup_size
    if not sg:
        pytest.skip("the adapter's subgroup size is unknown")
    c16 = tuning.warp_config(adapter, 2, 8 * sg, 1, True, int8=True, planes=2)
    c32 = tuning.warp_config(adapter, 4, 8 * sg, 1, True, int8=True, planes=2)
    c16xq = tuning.warp_config(adapter, 2, 8 * sg, 1, True, int8=True, planes=2, xq=True)
    assert (c16["rows_per_wg"], c32["rows_per_wg"]) == (16, 32)
    monkeypatch.setattr(tuning, "default_gemv_config", lambda dev, cols=None, fmt=None: c16)
    monkeypatch.setattr(tuning, "gemv_candidates", lambda dev, **kw: [c32, c16xq])
    qtimed = []

    def fake(dev, w, n, glu, cfg, fold=None, state=None, qout=None):
        if qout is not None:
            qtimed.append(cfg["rows_per_wg"])
            return qout_us
        if glu:  # the 16-row staged configuration is gate|up's pick
            return 10.0 if cfg["rows_per_wg"] == 16 and not cfg.get("xq") else 20.0
        return 1.0 if cfg.get("xq") else 2.0  # the others read x quantized ahead
    monkeypatch.setattr(tuning, "_time_gemv", fake)
    monkeypatch.setattr(tuning, "_time_quantize", lambda *a: 5.0)
    dec = _compare(models["Q8_0"], steps=2, tol=3e-3).programs["decode"]
    assert qtimed and set(qtimed) == {32}
    glus = [o for o in dec.graph.ops if o.kind == "linear_swiglu"]
    ds = [d for st in dec._steps for d in (st.pick(1, 1) if hasattr(st, "pick") else (st,))]
    qgemv = [d.kernel for d in ds if d.kernel.name == "gemv_warp" and "YQ[" in d.kernel.source]
    if used:
        assert len(dec._qouts) == len(glus) and len(qgemv) == len(glus)
        assert all(k.rows_per_group == 32 for k in qgemv)
    else:
        assert not dec._qouts and not qgemv


def backend_folds():
    from edgellm.backends.webgpu.backend import FOLDS

    return FOLDS


def folds_without(*kinds: str) -> str:
    """EDGELLM_WEBGPU_FOLD's value for every fold but these."""
    return ",".join(f for f in backend_folds() if f not in kinds)


def test_rope_fold_without_norm_fold(models, monkeypatch):
    """Only the rope fold (EDGELLM_WEBGPU_FOLD=rope): the GEMV reads the normed x from the arena,
    where the memory plan also put the rotated q (it was written after the projection): q gets a
    buffer of its own, and the logits still match the cpu backend's."""
    monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", "warp:2:64:1")
    monkeypatch.setenv("EDGELLM_WEBGPU_FOLD", "rope")
    dec = _compare(models["Q8_0"], steps=3).programs["decode"]
    assert dec._ropes and not dec._folds and not dec._alias
    assert set(dec._private) == {r.outputs[0] for r in dec._ropes.values()}


def test_decode_dispatches_per_layer(tmp_path, monkeypatch, adapter):
    """Dispatches of one decode token, read from the recorded step of models of 1 and 3 layers:
    5 per layer with the folds (q|k|v GEMV with the norm and RoPE + cache write, attention,
    output projection + residual, gate|up GEMV with the norm, down projection + residual) and
    1 besides (the LM head; the embedding read by the first GEMV); the rope fold off
    (EDGELLM_WEBGPU_FOLD=last_row,norm) adds the rope dispatch back and the embedding's, all
    folds off (0) the norms and last_row's copy too."""
    monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", "warp:2:64:1")
    paths = {n: str(write_synthetic_gguf(tmp_path / f"l{n}.gguf", SyntheticSpec(weight_type="Q8_0", seed=9, n_layers=n)))
             for n in (1, 3)}
    counts = {}
    for fold in ("1", "last_row,norm", "0"):
        monkeypatch.setenv("EDGELLM_WEBGPU_FOLD", fold)
        rec = {n: _recorded(edgellm.load(p, backend="webgpu", ctx=64).programs["decode"], monkeypatch)
               for n, p in paths.items()}
        per_layer = (len(rec[3]) - len(rec[1])) / 2
        counts[fold] = (per_layer, len(rec[1]) - per_layer, rec[1])
    assert counts["1"][0] == 5 and counts["last_row,norm"][0] == 6 and counts["0"][0] == 8
    from edgellm.backends.webgpu import kernels

    head_dim = SyntheticSpec().d_model // SyntheticSpec().n_heads
    sg = min(32, adapter.subgroup_size or 0)
    attn = "attention_warp" if sg and kernels.attention_warp_fits(head_dim, sg) else "attention"
    assert counts["1"][2] == ["gemv_warp", attn, "gemv_warp", "gemv_warp", "gemv_warp", "gemv_warp"]
    assert "last_row" in counts["0"][2] and "last_row" not in counts["last_row,norm"][2]
    assert (counts["1"][1], counts["last_row,norm"][1], counts["0"][1]) == (1, 2, 4)


def test_bad_fold_switch(models, monkeypatch):
    monkeypatch.setenv("EDGELLM_WEBGPU_FOLD", "norm,ropes")
    with pytest.raises(edgellm.errors.GraphError, match="EDGELLM_WEBGPU_FOLD.*ropes"):
        edgellm.load(models["Q8_0"], backend="webgpu", ctx=64)


def test_unfused_graph(models):
    """Without fusion: separate rope, kv_store, add, mul and silu kernels."""
    g = _compare(models["qwen2"], fuse=False)
    kinds = {op.kind for op in g.programs["all"].graph.ops}
    assert {"rope", "kv_store", "silu", "mul", "add"} <= kinds


def test_all_logits_chunk_fits_the_binding(models, monkeypatch, adapter):
    """Where a prefill chunk's logits exceed one storage binding (a 128k vocabulary at 512 rows on
    adapters with WebGPU's 128 MiB default: Llama 3's 1B and 8B), the all-logits program takes
    fewer rows (a power of two that fits) and logits of a longer prompt still equal the cpu
    backend's at every position; the last-logits and decode programs keep the prefill chunk.
    Without the cap that load fails."""
    from edgellm.backends.webgpu.backend import DeviceMemoryError, WebgpuBackend

    vocab = 256  # SyntheticSpec's; 24 rows of float32 logits, 16 of them fit
    monkeypatch.setattr(adapter, "max_binding", 64 + 4 * vocab * 24)
    prompt = [int(x) for x in np.random.default_rng(12).integers(0, vocab, 45)]
    cpu = edgellm.load(models["Q8_0"], backend="cpu", ctx=64, prefill_chunk=32)
    gpu = edgellm.load(models["Q8_0"], backend="webgpu", ctx=64, prefill_chunk=32)
    assert gpu.all_chunk == 16 and gpu.compiled["all"].sizes["seq"] == 16
    assert gpu.compiled["last"].sizes["seq"] == 32 and gpu.kv_chunk == 32
    want, got = cpu.logits(prompt), gpu.logits(prompt)
    assert got.shape == want.shape == (45, vocab)
    assert float(np.abs(got - want).max()) <= 3e-3 * float(np.abs(want).max())
    last = gpu.forward(prompt, 0, all_logits=False)  # 32 + 13 rows through the last-logits program
    np.testing.assert_allclose(last[-1], got[-1], rtol=0, atol=1e-4 * float(np.abs(want).max()))
    monkeypatch.setattr(WebgpuBackend, "max_logit_rows", None)
    with pytest.raises(DeviceMemoryError, match="logits"):
        edgellm.load(models["Q8_0"], backend="webgpu", ctx=64, prefill_chunk=32, cache=False)


def test_tiled_prefill(models, monkeypatch):
    """The prefill path GPUs take, tiled GEMM and tiled causal attention (a software adapter runs
    prefill as GEMVs and per-row attention by default): the float tiles and attention_tiled, which a
    GPU's defaults (int8 products, the tuner's pick of attention) would replace."""
    monkeypatch.setenv("EDGELLM_WEBGPU_TILED", "1")
    monkeypatch.setenv("EDGELLM_WEBGPU_PREFILL_INT8", "0")
    monkeypatch.setenv("EDGELLM_WEBGPU_PREFILL_ATTN", "tiled")
    g = _compare(models["Q4_1"], chunk=40, steps=1)
    assert g.backend.prefill_tiled
    assert {"gemm", "attention_tiled"} <= {v.kernel.name for st in g.programs["all"]._steps
                                           for v in getattr(st, "variants", ())}


def test_prefill_attention_blocked(models, monkeypatch):
    """EDGELLM_WEBGPU_PREFILL_ATTN=blocked: the tiled prefill's causal attention in register
    blocks (head size 64): logits of every prompt position (40-token chunks, later chunks past
    position 0) within the cpu backend's tolerance; a bad value is refused by name."""
    monkeypatch.setenv("EDGELLM_WEBGPU_TILED", "1")
    monkeypatch.setenv("EDGELLM_WEBGPU_PREFILL_ATTN", "blocked")
    g = _compare(models["mixed"], chunk=40, steps=1, tol=2e-2)
    names = {v.kernel.name for st in g.programs["all"]._steps for v in getattr(st, "variants", ())}
    assert "attention_blocked" in names and "attention_tiled" not in names
    monkeypatch.setenv("EDGELLM_WEBGPU_PREFILL_ATTN", "flash")
    with pytest.raises(edgellm.errors.GraphError, match="EDGELLM_WEBGPU_PREFILL_ATTN='flash'"):
        edgellm.load(models["mixed"], backend="webgpu", ctx=64, prefill_chunk=40)


def test_prefill_attention_tuned(models, monkeypatch, gpu_tuning):
    """With tuning on (as on a GPU), a prefill program's causal attention is timed both ways
    (attention_tiled, attention_blocked) over a chunk (512 tokens; 64 here) and the pick lowered; a second
    load takes it from the cache, timing nothing."""
    monkeypatch.setenv("EDGELLM_WEBGPU_TILED", "1")
    monkeypatch.setattr(gpu_tuning, "PREFILL_ATTENTION_ROWS", 64)  # a software adapter's timing
    pick = gpu_tuning._pick  # the other kernels keep their defaults (their tuning is tested apart)
    monkeypatch.setattr(gpu_tuning, "_pick", lambda dev, kernel, key, cands, default, *a, **kw: pick(
        dev, kernel, key, cands, default, *a, **kw) if kernel == "webgpu_prefill_attention_v1" else default)
    timed = []
    real = gpu_tuning._time_prefill_attention
    monkeypatch.setattr(gpu_tuning, "_time_prefill_attention", lambda *a: (timed.append(a[6]), real(*a))[1])
    m = edgellm.load(models["mixed"], backend="webgpu", ctx=64, prefill_chunk=40)
    assert sorted(set(timed)) == ["blocked", "tiled"]
    kinds = {v.kernel.name for st in m.programs["all"]._steps for v in getattr(st, "variants", ())}
    assert len(kinds & {"attention_blocked", "attention_tiled"}) == 1
    timed.clear()
    edgellm.load(models["mixed"], backend="webgpu", ctx=64, prefill_chunk=40)
    assert not timed


@pytest.mark.parametrize("name,planes", [("Q8_0", "2"), ("Q4_0", "1"), ("mixed", "2"), ("qwen2", "1"), ("Q4_1", "2")])
def test_int8_prefill(models, monkeypatch, name, planes):
    """EDGELLM_WEBGPU_PREFILL_INT8 (the default on a GPU: 2) with the tiled prefill: each
    product of an int8-capable format quantizes its x (quantize_x) and multiplies on packed dot
    products (gemm_int8); the logits of every prompt position stay within the float path's 0.3%
    of the cpu backend's with two planes, 1% with one (2% for mixed's 4-bit weights throughout).
    Each kernel's own rounding is checked exactly in test_webgpu_kernels."""
    monkeypatch.setenv("EDGELLM_WEBGPU_TILED", "1")
    monkeypatch.setenv("EDGELLM_WEBGPU_PREFILL_INT8", planes)
    tol = 3e-3 if planes == "2" else 2e-2 if name == "mixed" else 1e-2
    g = _compare(models[name], chunk=40, steps=1, tol=tol)
    names = [v.kernel.name for st in g.programs["all"]._steps for v in getattr(st, "variants", ())]
    assert names.count("gemm_int8") >= 4 and names.count("quantize_x") == names.count("gemm_int8")


def test_weights_packed_ahead_in_a_bounded_window(models, monkeypatch):
    """WebgpuWeights.prefetch packs the file's own layouts too (Q8_0 here) in threads, never more
    than PREFETCH_AHEAD per worker ahead of the program build, each taken set refilling the
    window; the packed weights are the ones matrix() packs itself (same arrays), and the pool
    ends with the queue."""
    from edgellm.backends.webgpu import backend as B, codegen
    from edgellm.gguf_file import GGUFFile

    monkeypatch.setattr(B, "PREFETCH_AHEAD", 1)
    monkeypatch.setattr(B.os, "cpu_count", lambda: 2)
    f = GGUFFile(models["Q8_0"])
    sets = [(n,) for n, t in f.tensors.items() if len(t.shape) == 2 and n.startswith("blk.")]
    assert len(sets) > 4
    w = B.WebgpuWeights(f, B.get_device())
    seen = []
    real = w._pack
    monkeypatch.setattr(w, "_pack", lambda n: (seen.append(n), real(n))[1])
    w.prefetch(sets)
    assert len(w._pending) == 2 and len(w._queue) == len(sets) - 2
    for n in sets:
        got = w.matrix(*n)
        assert len(w._pending) <= 2
        want, _ = real(n)
        for have, part in zip(got.buffers, codegen.part_arrays(want, got.part_rows)):
            for k, a in part.items():
                raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
                assert np.array_equal(np.frombuffer(B.get_device().read(have[k], 0, raw.size), np.uint8), raw)
    assert w._pool is None and not w._queue and not w._pending
    assert sorted(seen) == sorted(sets)


def test_bad_prefill_int8_switch(models, monkeypatch):
    monkeypatch.setenv("EDGELLM_WEBGPU_TILED", "1")
    monkeypatch.setenv("EDGELLM_WEBGPU_PREFILL_INT8", "3")
    with pytest.raises(EdgeLLMError, match="EDGELLM_WEBGPU_PREFILL_INT8='3'"):
        edgellm.load(models["Q8_0"], backend="webgpu", ctx=64, prefill_chunk=40).logits(PROMPT)


def test_delegation_to_cpu(models, monkeypatch):
    """Ops the backend lacks run on the cpu reference kernels between device passes (recorded
    through wgpu-py's public API here, the fast path's fallback)."""
    from edgellm.backends.webgpu import backend
    from edgellm.backends.webgpu.backend import WebgpuBackend

    monkeypatch.setattr(backend, "_RAW", None)
    monkeypatch.setattr(WebgpuBackend, "SKIP_PASSES", frozenset())  # add_rms_norm made, then delegated
    monkeypatch.setattr(WebgpuBackend, "SUPPORTED_OPS", WebgpuBackend.SUPPORTED_OPS - {"add_rms_norm", "swiglu",
                                                                                      "linear_swiglu"})
    g = _compare(models["Q8_0"])
    assert any("+norm" in n for n in g.programs["decode"].delegated)


def test_replayed_dispatches_follow_a_new_arena(models, monkeypatch):
    """Decode steps replay a list of wgpu-native handles made at the first step (_flat): it is
    used, and remade when the arena (and so every bind group) is replaced; the logits stay the
    cpu backend's before and after, and equal to those of the public path."""
    from edgellm.backends.webgpu import backend

    monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", "warp:2:64:1")
    cpu = edgellm.load(models["Q8_0"], backend="cpu", ctx=64)
    gpu = edgellm.load(models["Q8_0"], backend="webgpu", ctx=64)
    dec = gpu.programs["decode"]
    cpu.logits(PROMPT)
    gpu.logits(PROMPT)
    pos = len(PROMPT)
    want = [cpu.forward([t], pos + i, all_logits=False) for i, t in enumerate((5, 9, 17))]
    got = [gpu.forward([5], pos, all_logits=False)]
    flat = dec._flat_cache[(1, 1, False)]
    assert len(flat) >= len(dec._steps) and dec._flat_key[0] == gpu.backend.arena_gen
    gen = gpu.backend.arena_gen
    gpu.backend.reserve_arena(gpu.backend.arena_buffer.size + 4096)  # a new arena buffer: new bind groups
    assert gpu.backend.arena_gen == gen + 1
    got.append(gpu.forward([9], pos + 1, all_logits=False))
    assert dec._flat_key[0] == gen + 1 and dec._flat_cache[(1, 1, False)] is not flat
    monkeypatch.setattr(backend, "_RAW", None)  # the public path, same values
    got.append(gpu.forward([17], pos + 2, all_logits=False))
    scale = float(np.abs(want[0]).max())
    for w, g in zip(want, got):
        assert float(np.abs(g - w).max()) <= 3e-3 * scale


def test_split_merge_unrolled(models, monkeypatch):
    """EDGELLM_WEBGPU_COMBINE_UNROLL=4: the output projection merges four splits per step of its
    loop (4 to 5 splits here, one per 4 keys): logits match the cpu backend's; a value that is not
    a split count is refused by name."""
    from edgellm.backends.webgpu import backend

    monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", "warp:2:64:1")
    monkeypatch.setattr(backend, "SPLIT_KEYS", 4)
    monkeypatch.setenv("EDGELLM_WEBGPU_COMBINE_UNROLL", "4")
    monkeypatch.setenv("EDGELLM_WEBGPU_FOLD", folds_without("finish"))
    dec = _compare(models["Q8_0"], steps=4).programs["decode"]
    assert dec._combines
    monkeypatch.setenv("EDGELLM_WEBGPU_COMBINE_UNROLL", "four")
    with pytest.raises(edgellm.errors.GraphError, match="EDGELLM_WEBGPU_COMBINE_UNROLL='four'"):
        edgellm.load(models["Q8_0"], backend="webgpu", ctx=64)


def test_greedy_on_device_matches_cpu(models):
    cpu = edgellm.load(models["Q8_0"], backend="cpu", ctx=64)
    gpu = edgellm.load(models["Q8_0"], backend="webgpu", ctx=64)
    calls = []
    prog = gpu.programs["decode"]
    orig = prog.loop_tokens
    prog.loop_tokens = lambda *a, **kw: (calls.append(a), orig(*a, **kw))[1]
    p = SamplingParams(temperature=0)
    assert list(gpu.generate_tokens(PROMPT, 12, p)) == list(cpu.generate_tokens(PROMPT, 12, p))
    assert calls, "greedy decoding did not run on the device"


def test_device_loop_batches_and_stop(models, monkeypatch):
    """loop_tokens' batches (1, 2, 4, ... LOOP_BATCH steps a command buffer and one compute pass,
    each step reading its values at its own slot of the step buffer, one batch queued ahead of
    the one being read): greedy tokens as the cpu backend's, and sampled tokens (varied, where the
    synthetic model's argmax repeats) as those of one submission a step; with a stop token
    nothing is submitted past the batch queued after the one that holds it (history slots after
    it stay unwritten), and a caller that reads on past it gets every token. With LOOP_BATCH_S,
    batches of about that much decoding once one was timed; the same tokens through wgpu-py's
    own map (Device.submission_reader's fallback)."""
    from edgellm.backends.webgpu import backend, device
    from edgellm.backends.webgpu.backend import LOOP_BATCH
    from edgellm.sampling import DeviceDraw

    monkeypatch.setattr(backend, "LOOP_BATCH_S", 1e9)  # batch sizes by growth alone
    n = 2 * LOOP_BATCH + 8  # batches 1, 2, 4, 8, 16, 32, 9
    cpu = edgellm.load(models["Q8_0"], backend="cpu", ctx=n + 24)
    gpu = edgellm.load(models["Q8_0"], backend="webgpu", ctx=n + 24)
    prog = gpu.programs["decode"]
    encoded = []
    orig = prog._encode_tokens
    prog._encode_tokens = lambda *a, **kw: (encoded.append(a[2]), orig(*a, **kw))[1]
    first, *want = cpu.generate_tokens(PROMPT, n + 1, SamplingParams(temperature=0))
    gpu.forward(list(PROMPT), 0, all_logits=False)  # the prompt's cache rows
    assert list(prog.loop_tokens(first, len(PROMPT), n)) == want
    assert encoded == [1, 2, 4, 8, 16, LOOP_BATCH, n - 63], encoded

    draw = DeviceDraw(SamplingParams(temperature=2.0, top_k=40, top_p=1.0, min_p=0.0), 12345)
    gpu.forward(list(PROMPT), 0, all_logits=False)
    ref = list(prog.loop_tokens(first, len(PROMPT), n, draw))
    assert len(set(ref)) > 8, ref
    prog._encode_tokens = lambda *a, **kw: None  # one submission a step (the path of steps with host work)
    gpu.forward(list(PROMPT), 0, all_logits=False)
    assert list(prog.loop_tokens(first, len(PROMPT), n, draw)) == ref
    prog._encode_tokens = orig

    # a stop token first met after the first batch: nothing past the batch queued after the one
    # that holds it runs
    stop_at = next(i for i in range(3, 31) if ref[i] not in ref[:i])
    ends = (1, 3, 7, 15, 31, 63, n)  # the batches end before these steps
    end = ends[next(j for j, e in enumerate(ends) if e > stop_at) + 1]
    gpu.forward(list(PROMPT), 0, all_logits=False)
    prog.dev.write(prog.hist_buf, np.full(n, 0xFFFFFFFF, np.uint32))
    seen = []
    for t in prog.loop_tokens(first, len(PROMPT), n, draw, stop={ref[stop_at]}):
        seen.append(t)
        if t == ref[stop_at]:
            break
    assert seen == ref[:stop_at + 1]
    hist = np.frombuffer(prog.dev.read(prog.hist_buf, 0, 4 * n), np.uint32)
    assert list(hist[:end]) == ref[:end]  # the batch that holds the stop token and the next ran whole
    assert end < n and (hist[end:] == 0xFFFFFFFF).all(), (stop_at, end, hist[end:end + 8])
    gpu.forward(list(PROMPT), 0, all_logits=False)
    assert list(prog.loop_tokens(first, len(PROMPT), n, draw, stop={ref[stop_at]})) == ref

    # batches of about LOOP_BATCH_S once timed: a bound of a few steps' time keeps them small
    monkeypatch.setattr(backend, "LOOP_BATCH_S", 1e-9)
    encoded.clear()
    prog._encode_tokens = lambda *a, **kw: (encoded.append(a[2]), orig(*a, **kw))[1]
    gpu.forward(list(PROMPT), 0, all_logits=False)
    assert list(prog.loop_tokens(first, len(PROMPT), n)) == want
    assert encoded[:3] == [1, 2, 4] and set(encoded[3:]) == {1}, encoded
    prog._encode_tokens = orig

    # the reads through wgpu-py's map (where its private calls differ): the same tokens
    assert isinstance(prog.dev.submission_reader(), device.SubmissionReader)
    monkeypatch.setattr(prog.dev, "_reader", device.QueueReader(prog.dev))
    gpu.forward(list(PROMPT), 0, all_logits=False)
    assert list(prog.loop_tokens(first, len(PROMPT), n)) == want


def test_sampled_generation_draws_on_the_device(models):
    """A sampled generation loops on the device too (kernels.sample_kernels in the step, only token
    ids read back): each token within the top-k of the logits the model gives for the sequence so
    far, a seed repeats its tokens, and top-k 1 is the greedy answer."""
    gpu = edgellm.load(models["Q8_0"], backend="webgpu", ctx=64)
    draws = []
    prog = gpu.programs["decode"]
    orig = prog.loop_tokens
    prog.loop_tokens = lambda *a, **kw: (draws.append(a[3]), orig(*a, **kw))[1]
    p = SamplingParams(temperature=1.5, top_k=3, top_p=0.95, min_p=0.0, seed=5)
    got = list(gpu.generate_tokens(PROMPT, 8, p))
    assert len(got) == 8 and draws and draws[-1] is not None and draws[-1].params == p
    logits = gpu.forward(list(PROMPT) + got[:-1], 0, all_logits=True)[len(PROMPT) - 1:]
    for tok, row in zip(got, logits):
        assert tok in np.argsort(-row)[:3], (tok, np.sort(row)[-4:])
    assert list(gpu.generate_tokens(PROMPT, 8, p)) == got
    greedy = list(gpu.generate_tokens(PROMPT, 8, SamplingParams(temperature=0)))
    assert list(gpu.generate_tokens(PROMPT, 8, SamplingParams(temperature=0.7, top_k=1, seed=2))) == greedy


@pytest.mark.parametrize("kernels", ["adapter's", "a GPU's"])
def test_default_model_answers_capital(monkeypatch, kernels):
    """The embedded SmolLM2-135M-Instruct, greedy: the same text as the cpu backend, with this
    adapter's default kernels and with a GPU's (the prompt through the tiled prefill's int8
    products in two planes, decode through the subgroup GEMVs on int8 activations in two planes)."""
    if kernels == "a GPU's":
        monkeypatch.setenv("EDGELLM_WEBGPU_TILED", "1")
        monkeypatch.setenv("EDGELLM_WEBGPU_PREFILL_INT8", "2")
        monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", "warp:2:256:1:int8x2")
    gpu = edgellm.load(backend="webgpu", ctx=256)
    text = "".join(gpu.generate("What is the capital of France?", max_tokens=12, temperature=0))
    assert text == "The capital of France is Paris."  # the cpu backend's answer (shared/NOTES.md)


def test_struct_types_resolved_without_cffi_parser():
    """device.fast_struct_types: the C types wgpu-py asks cffi for by name ("T", "T *", "T[]" of
    a wgpu.h typedef or a C primitive) are, for a sample of the header's typedefs (structs,
    enums, flags, callback pointers) and primitives, the very cffi type objects cffi's own parser
    gives for the same strings, and they are made without it; other strings still go to the
    parser."""
    import random

    from wgpu.backends.wgpu_native._ffi import ffi

    from edgellm.backends.webgpu.device import fast_struct_types

    assert fast_struct_types(ffi) and ffi._typeof_locked._edgellm_fast
    names = sorted(k[8:] for k in ffi._parser._declarations if k.startswith("typedef "))
    kinds = {type(ffi._parser._declarations["typedef " + n][0]).__name__ for n in names}
    assert {"StructType", "EnumType", "FunctionPtrType"} <= kinds, kinds
    sample = random.Random(7).sample(names, 24) + ["WGPUBufferDescriptor", "WGPUBindGroupEntry", "WGPUBufferUsage",
                                                    "uint8_t", "char", "uint32_t", "intptr_t", "float"]
    calls = []
    parse = ffi._parser.parse_type
    try:
        ffi._parser.parse_type = lambda cdecl: calls.append(cdecl) or parse(cdecl)
        for n in sample:
            for cdecl in (f"{n} *", f"{n}[]", f"{n} []", n):
                ffi._parsed_types.pop(cdecl, None)
                fast = ffi.typeof(cdecl)
                with ffi._lock:
                    tp = parse(cdecl)
                    slow = ffi._get_cached_btype(tp.as_function_pointer() if tp.is_raw_function else tp)
                assert fast is slow, cdecl
        assert calls == []
        ffi._parsed_types.pop("uint32_t [3]", None)
        assert ffi.sizeof(ffi.typeof("uint32_t [3]")) == 12 and calls == ["uint32_t [3]"]
        assert ffi.sizeof("WGPUBufferDescriptor") == ffi.sizeof(ffi.new("WGPUBufferDescriptor *")[0])
    finally:
        ffi._parser.parse_type = parse


def test_auto_prefers_a_hardware_adapter(monkeypatch):
    from edgellm.backends import _auto
    from edgellm.backends.cuda.backend import CudaBackend
    from edgellm.backends.webgpu import device

    monkeypatch.setattr(CudaBackend, "available", staticmethod(lambda: False))
    monkeypatch.setattr(device, "_gpu_device_nodes_absent", lambda: False)
    soft = device.AdapterInfo("llvmpipe (LLVM 15)", "llvmpipe", "Vulkan", "CPU", "Mesa", ())
    gpu = device.AdapterInfo("NVIDIA H100 80GB HBM3", "nvidia", "Vulkan", "DiscreteGPU", "NVIDIA", ())
    monkeypatch.setattr(device, "list_adapters", lambda: [soft])
    assert _auto() == "cpu-fast"  # the CPU choice of auto (the float32 cpu is the reference)
    monkeypatch.setattr(device, "list_adapters", lambda: [soft, gpu])
    assert _auto() == "webgpu"


def test_auto_skips_adapter_enumeration_without_gpu_device_nodes(monkeypatch, tmp_path):
    """On Linux without /dev/dri/renderD*, /dev/nvidia* or /dev/dxg only software adapters can
    exist: auto picks cpu-fast without loading wgpu (0.9 s of a 3 s run on the 2-core machine)."""
    from edgellm.backends import _auto
    from edgellm.backends.cuda.backend import CudaBackend
    from edgellm.backends.webgpu import device

    monkeypatch.setattr(CudaBackend, "available", staticmethod(lambda: False))
    monkeypatch.setattr(device.sys, "platform", "linux")
    calls = []
    monkeypatch.setattr(device, "list_adapters", lambda: calls.append(1) or [])
    monkeypatch.setattr(device, "Path", lambda p: tmp_path if p == "/dev" else Path(p))
    assert _auto() == "cpu-fast" and calls == []  # an empty /dev: no enumeration
    (tmp_path / "dri").mkdir()
    (tmp_path / "dri" / "renderD128").touch()
    assert _auto() == "cpu-fast" and calls == [1]  # a render node: wgpu is asked


def test_device_feature_probes(adapter):
    """The device's probe kernels ran: an adapter with subgroups reports the width its kernels run
    with (a power of two, 4 or more: lavapipe's 8 with AVX2), and unpack2x16float is found where
    WebGPU's core has it (every Vulkan adapter here); the description names what was found."""
    if adapter.has_subgroups:
        n = adapter.subgroup_size
        assert n >= 4 and n & (n - 1) == 0, n
        assert f"subgroups of {n}" in adapter.describe()
    assert adapter.has_f16_unpack and "unpack2x16float" not in adapter.describe()


def test_bad_adapter_index(monkeypatch):
    from edgellm.backends.webgpu.device import Device

    monkeypatch.setenv("EDGELLM_WEBGPU_ADAPTER", "99")
    with pytest.raises(BackendUnavailableError, match="EDGELLM_WEBGPU_ADAPTER=99"):
        Device()


def test_cli_lists_adapters():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "edgellm", "info", "--adapters"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "webgpu adapter 0:" in r.stdout and "features used:" in r.stdout


def test_tuning_cached_per_adapter(models, monkeypatch, tmp_path):
    """EDGELLM_TUNE=1: GEMV and decode attention candidates timed at load, the picks cached per
    adapter and reused: a second load times nothing."""
    from edgellm.backends.webgpu import tuning

    monkeypatch.setenv("EDGELLM_TUNE", "1")
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_TUNERS", {})
    # one candidate, whatever the adapter asks for (a GPU's int8 GEMVs ask with int8, planes, xq)
    monkeypatch.setattr(tuning, "gemv_candidates", lambda dev, **kw: [{"wg": 64, "rows_per_wg": 16, "subgroup": False}])
    first = _compare(models["Q8_0"], steps=1)
    files = list((tmp_path / "tune").glob("webgpu_*.json"))
    text = files[0].read_text() if len(files) == 1 else ""
    assert f"{tuning.GEMV_TUNING}|Q8_0" in text
    assert "webgpu_attention_v1" in text or not first.programs["decode"].dev.subgroup_size
    # the picks' time is reported apart (a one-time part of the load), within the weights phase
    assert 0 < first.load_phases["tuning"] <= first.load_phases["weights"]
    timed = []
    monkeypatch.setattr(tuning, "_TUNERS", {})
    for fn in ("_time_gemv", "_time_attention", "_time_prefill", "_time_quantize", "_time_prefill_attention"):
        monkeypatch.setattr(tuning, fn, lambda *a: timed.append(a) or 1.0)
    # the same program shapes as _compare's load (its prefill chunk sets the rows prefill is tuned at)
    again = edgellm.load(models["Q8_0"], backend="webgpu", ctx=64, prefill_chunk=8)
    assert not timed  # every pick came from the cache
    assert "tuning" not in again.load_phases


def test_gemv_tuned_with_its_folds(models, monkeypatch, tmp_path, adapter):
    """With tuning on, a projection whose warp GEMV carries a fold (the RMSNorm before it, the
    RoPE after it, the attention's split merge) is timed with that fold, keyed by it, among
    gemv_warp's candidates only (rows per subgroup even where RoPE is folded); a GEMV without
    folds among all candidates; the tuned model's logits still match the cpu backend's."""
    from edgellm.backends.webgpu import tuning

    monkeypatch.setenv("EDGELLM_TUNE", "1")
    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("EDGELLM_WEBGPU_FOLD", folds_without("finish"))  # the split merge in the output projection
    monkeypatch.setattr(tuning, "_TUNERS", {})
    warp = lambda r: tuning.warp_config(adapter, r, 64, 1, True)  # noqa: E731
    block = {"wg": 64, "rows_per_wg": 16, "subgroup": False}
    monkeypatch.setattr(tuning, "default_gemv_config", lambda dev, cols=None, fmt=None: warp(2))
    monkeypatch.setattr(tuning, "gemv_candidates", lambda dev, **kw: [warp(1), warp(2), block])
    timed, kernels_timed = [], []
    real_time, real_kernels = tuning._time_gemv, tuning._gemv_kernels

    def time_gemv(dev, w, n, glu, cfg, fold=None, state=None, qout=None):
        timed.append((tuning.fold_tag(fold), cfg))
        return real_time(dev, w, n, glu, cfg, fold, state, qout)

    def gemv_kernels(w, n, glu, cfg, fold=None, lanes=1, qout=None, sg=0):
        ks = real_kernels(w, n, glu, cfg, fold, lanes, qout, sg)
        kernels_timed.append((tuning.fold_tag(fold), cfg, [k.name for k in ks], ks[0].source))
        return ks
    calls = []
    real_config = tuning.gemv_config

    def gemv_config(dev, w, n, glu=False, fold=None, tune=True):
        before = len(timed)
        cfg = real_config(dev, w, n, glu, fold, tune)
        calls.append((tune, len(timed) - before))
        return cfg
    monkeypatch.setattr(tuning, "_time_gemv", time_gemv)
    monkeypatch.setattr(tuning, "_gemv_kernels", gemv_kernels)
    monkeypatch.setattr(tuning, "gemv_config", gemv_config)
    _compare(models["Q8_0"], steps=2)
    # the prefill programs' GEMVs (steps of a few tokens) take cached picks or defaults, untimed
    assert any(not t for t, _ in calls) and all(n == 0 for t, n in calls if not t)
    tags = {t for t, _ in timed}
    assert "" in tags and any("rope" in t for t in tags) and any("rms" in t for t in tags), tags
    assert any("combine" in t for t in tags), tags
    for tag, cfg in timed:  # folded: warp GEMVs, or any GEMV after the prologue made ahead
        if tag:
            assert cfg.get("kind") == "warp" or cfg.get("ahead"), (tag, cfg)
        if "rope" in tag:
            assert cfg.get("kind") == "warp" and cfg["rows_per_warp"] % 2 == 0, (tag, cfg)
    assert any(cfg.get("kind") != "warp" for t, cfg in timed if not t)  # unfolded: every candidate
    for pro in ("rms", "combine"):  # a prologue is timed folded and made ahead
        assert {bool(c.get("ahead")) for t, c in timed if pro in t} == {False, True}, pro
    for tag, cfg, names, src in kernels_timed:  # the timed kernels do the fold's prologue
        if cfg.get("ahead") and ("rms" in tag or "combine" in tag):
            assert names[0] == ("rms_norm" if "rms" in tag else "attention_combine") and len(names) == 2, (tag, names)
        elif "rms" in tag:
            assert "inverseSqrt" in src and names == ["gemv_warp"], tag
        elif "combine" in tag:
            assert "combined4" in src and names == ["gemv_warp"], tag
    text = next((tmp_path / "tune").glob("webgpu_*.json")).read_text()
    assert "rms+rope" in text and "combine" in text


@pytest.mark.parametrize("winner", ["xq", "staged", "timed"])
def test_decode_gemv_tuned_between_x_quantized_ahead_and_staged(models, monkeypatch, tmp_path, adapter, winner,
                                                                gpu_tuning):
    """On a GPU with tuning on, each int8 decode GEMV is timed with x quantized ahead (quantize_x,
    with the prologue a fold would do: the norm, the split merge; then gemv_warp's xq: the two
    dispatches timed together) and with x staged (quantized in the GEMV's prologue). The pick is
    lowered as timed (two dispatches, or one; the GEMV reading the embedding weight always
    staged) and the logits match the cpu backend's, attention split over the context. ("timed":
    this adapter's own timings, whichever wins.)"""
    from edgellm.backends.webgpu import backend
    from edgellm.backends.webgpu import tuning

    monkeypatch.setenv("EDGELLM_WEBGPU_PREFILL_INT8", "0")
    monkeypatch.setattr(tuning, "WARP_TUNED", [(2, 1, 1)])
    monkeypatch.setattr(tuning, "XQ_TUNED", [(2, 2)])
    monkeypatch.setattr(tuning, "default_gemv_config", lambda dev, cols=None, fmt=None: tuning.warp_config(
        adapter, 2, 64, 1, True, int8=True, planes=2))
    timed = []
    real = tuning._time_gemv

    def time_gemv(dev, w, n, glu, cfg, fold=None, state=None, qout=None):
        timed.append((bool(fold), cfg))
        t = real(dev, w, n, glu, cfg, fold, state, qout)
        return t if winner == "timed" else 1.0 if bool(cfg.get("xq")) == (winner == "xq") else 2.0
    monkeypatch.setattr(tuning, "_time_gemv", time_gemv)
    monkeypatch.setattr(backend, "SPLIT_KEYS", 4)
    dec = _compare(models["Q8_0"], steps=2, tol=3e-3).programs["decode"]
    for folded in (False, True):
        assert {bool(c.get("xq")) for f, c in timed if f == folded} == {False, True}
    names = [d.kernel.name for st in dec._steps for d in (st.pick(1, 2) if hasattr(st, "pick") else (st,))]
    gemvs = names.count("gemv_warp")
    if winner == "xq":
        # all but the embedding's, and those of the down projections their gate|up GEMVs quantized
        assert names.count("quantize_x") == gemvs - len(dec._embeds) - len(dec._qouts) >= 4
    elif winner == "staged":
        assert "quantize_x" not in names


@pytest.mark.parametrize("winner", ["ahead", "folded"])
def test_float_decode_gemv_tuned_with_its_prologue_ahead(models, monkeypatch, tmp_path, adapter, winner, gpu_tuning):
    """On a GPU with tuning on, a float decode GEMV that folds an RMSNorm or the attention
    splits' merge is also timed with that op as a dispatch of its own first (rms_norm,
    attention_combine: "ahead"), the GEMV then reading its output; the pick is lowered as timed
    and the logits match the cpu backend's with decode attention split over the context."""
    from edgellm.backends.webgpu import backend, tuning

    warp = tuning.warp_config(adapter, 2, 64, 1, True)
    monkeypatch.setattr(tuning, "default_gemv_config", lambda dev, cols=None, fmt=None: warp)
    monkeypatch.setattr(tuning, "gemv_candidates", lambda dev, **kw: [warp])
    monkeypatch.setattr(tuning, "_time_gemv", lambda dev, w, n, glu, cfg, fold=None, state=None, qout=None:
                        1.0 if bool(cfg.get("ahead")) == (winner == "ahead") else 2.0)
    monkeypatch.setattr(backend, "SPLIT_KEYS", 4)
    monkeypatch.setenv("EDGELLM_WEBGPU_FOLD", folds_without("finish"))
    dec = _compare(models["F16"], steps=2).programs["decode"]
    assert dec._combines and len(dec._folds) > len(dec._embeds)
    names = [d.kernel.name for st in dec._steps for d in (st.pick(1, 2) if hasattr(st, "pick") else (st,))]
    ahead = len(dec._folds) - len(dec._embeds) + len(dec._combines)  # every prologue but the embedding's
    if winner == "ahead":
        assert names.count("rms_norm") + names.count("attention_combine") == ahead
        assert all(names[i + 1] == "gemv_warp" for i, n in enumerate(names) if n in ("rms_norm", "attention_combine"))
    else:
        assert "rms_norm" not in names and "attention_combine" not in names


@pytest.mark.parametrize("winner", [(8, 4), (2, 2), None])
def test_decode_attention_tuned(models, monkeypatch, tmp_path, adapter, winner, gpu_tuning):
    """On a GPU with tuning on, the decode attention's subgroups a workgroup and keys at once
    (kernels.attention_warp's warps, keys_ahead) are timed per attention shape and the pick
    lowered in the decode program (its workgroup size) and, from the cache, in the prefill
    program's steps of a few tokens; logits match the cpu backend's with attention split over
    the context. (None: this adapter's own timings, whichever wins.)"""
    from edgellm.backends.webgpu import backend, tuning

    if not adapter.subgroup_size:
        pytest.skip("the adapter's subgroup size is unknown")
    one_gemv = {"wg": 64, "rows_per_wg": 16, "subgroup": False}
    monkeypatch.setattr(tuning, "gemv_candidates", lambda dev, **kw: [one_gemv])
    monkeypatch.setattr(tuning, "default_gemv_config", lambda dev, cols=None, fmt=None: one_gemv)
    monkeypatch.setattr(tuning, "ATTENTION_CANDIDATES", [(4, 2), (8, 4), (2, 2)])
    timed = []
    real = tuning._time_attention

    def time_attention(dev, h, g, d, sg, dtype, cfg, state):
        timed.append((cfg["warps"], cfg["keys_ahead"]))
        t = real(dev, h, g, d, sg, dtype, cfg, state)
        return t if winner is None else 1.0 if (cfg["warps"], cfg["keys_ahead"]) == winner else 2.0
    monkeypatch.setattr(tuning, "_time_attention", time_attention)
    monkeypatch.setattr(backend, "SPLIT_KEYS", 4)
    g = _compare(models["Q8_0"], steps=3)
    assert set(timed) == {(4, 2), (8, 4), (2, 2)}
    sg = min(32, adapter.subgroup_size)
    for prog in ("decode", "all"):
        ks = [v.kernel for st in g.programs[prog]._steps for v in getattr(st, "variants", (st,))
              if getattr(v, "kernel", None) is not None and v.kernel.name.startswith("attention_warp")]
        assert ks, prog
        if winner is not None:
            assert all(k.workgroup == sg * winner[0] for k in ks), (prog, [k.workgroup for k in ks])


@pytest.mark.parametrize("winner", ["int8", "float", "timed"])
def test_prefill_product_tuned_between_int8_and_float(models, monkeypatch, tmp_path, adapter, winner, gpu_tuning):
    """On a GPU with tuning on, each int8-capable prefill product is timed as int8 tiles (with x's
    quantization) and as the float product's tiles, the fastest cached per adapter and lowered:
    gemm_int8 after quantize_x, or gemm; either way the logits match the cpu backend's within the
    float path's tolerance. ("timed": the real timings on this adapter, whichever wins.)"""
    from edgellm.backends.webgpu import tuning

    one_gemv = {"wg": 64, "rows_per_wg": 16, "subgroup": False}
    monkeypatch.setattr(tuning, "gemv_candidates", lambda dev, **kw: [one_gemv])
    monkeypatch.setattr(tuning, "default_gemv_config", lambda dev, cols=None, fmt=None: one_gemv)
    monkeypatch.setattr(tuning, "GEMM_INT8_CANDIDATES", {2: [{"tm": 64, "tn": 64}]})
    if winner != "timed":
        monkeypatch.setattr(tuning, "_time_prefill", lambda dev, w, n, glu, rows, cfg: 1.0 if ("int8" in cfg) == (winner == "int8") else 2.0)
    g = _compare(models["Q8_0"], chunk=40, steps=1)
    assert "webgpu_prefill_v2|Q8_0" in next((tmp_path / "tune").glob("webgpu_*.json")).read_text()
    names = [v.kernel.name for st in g.programs["all"]._steps for v in getattr(st, "variants", ())]
    if winner == "int8":
        assert names.count("gemm_int8") >= 4 and "gemm" not in names
    elif winner == "float":
        assert names.count("gemm") >= 4 and "gemm_int8" not in names and "quantize_x" not in names


def test_tuning_is_on_by_default_on_a_gpu_only(monkeypatch):
    """Unset EDGELLM_TUNE tunes on a GPU adapter and not on a software one; 0 and 1 decide for both;
    with tuning off a weight's configuration is the default and nothing is timed."""
    from types import SimpleNamespace

    from edgellm.backends.webgpu import tuning

    gpu = SimpleNamespace(info=SimpleNamespace(software=False), subgroup_size=32, max_workgroup_memory=48 * 1024)
    cpu = SimpleNamespace(info=SimpleNamespace(software=True), subgroup_size=8, max_workgroup_memory=32 * 1024)
    monkeypatch.delenv("EDGELLM_TUNE", raising=False)
    assert tuning.tuning_on(gpu) and not tuning.tuning_on(cpu)
    monkeypatch.setenv("EDGELLM_TUNE", "0")
    assert not tuning.tuning_on(gpu) and not tuning.tuning_on(cpu)
    w = SimpleNamespace(cols=4096, fmt="Q8_0")
    monkeypatch.setattr(tuning, "_time_gemv", lambda *a: pytest.fail("timed with tuning off"))
    assert tuning.gemv_config(gpu, w, 4096) == tuning.default_gemv_config(gpu, 4096, "Q8_0")
    assert tuning.gemm_config(gpu, w, 4096, False, 512) == tuning.default_gemm_config(gpu, False)
    monkeypatch.setenv("EDGELLM_TUNE", "1")
    assert tuning.tuning_on(gpu) and tuning.tuning_on(cpu)


def test_forced_gemv_configuration_is_not_tuned(monkeypatch):
    """EDGELLM_WEBGPU_GEMV names the decode GEMVs' configuration: with tuning on (a GPU) it is
    the one used, folds and all, and nothing is timed; the output-quantizing variant (qout) is
    decided by the forced configuration's blocks alone."""
    from types import SimpleNamespace

    from edgellm.backends.webgpu import tuning

    gpu = SimpleNamespace(info=SimpleNamespace(software=False), subgroup_size=32, max_workgroup_memory=48 * 1024)
    monkeypatch.setenv("EDGELLM_TUNE", "1")
    monkeypatch.setattr(tuning, "_time_gemv", lambda *a, **k: pytest.fail("a forced configuration was timed"))
    monkeypatch.setattr(tuning, "_pick", lambda *a, **k: pytest.fail("a forced configuration was tuned"))
    w = SimpleNamespace(cols=4096, fmt="Q8_0")
    for forced, blocks in (("warp:2:64:1", False), ("warp:4:256:1:int8x2:xq", True)):
        monkeypatch.setenv("EDGELLM_WEBGPU_GEMV", forced)
        want = tuning.default_gemv_config(gpu, 4096, "Q8_0")
        assert want["rows_per_warp"] == int(forced.split(":")[1])
        for fold in (None, {"norm": "rms"}, {"combine": (32, 128)}):
            assert tuning.gemv_config(gpu, w, 4096, fold=fold) == want
        got = tuning.gemv_qout_config(gpu, w, 4096, True, {"norm": "rms"}, (2, True))
        assert (got == want) if blocks else got is None


def test_float32_kv_cache(models, monkeypatch):
    """EDGELLM_WEBGPU_KV=f32: the cache in float32 (the default is fp16 where the adapter has shader-f16)."""
    monkeypatch.setenv("EDGELLM_WEBGPU_KV", "f32")
    g = _compare(models["Q4_0"], tol=2e-4)
    assert g.backend.kv_dtype == "f32" and "f32 KV cache" in g.backend.describe()


@pytest.mark.parametrize("env,tol", [({"EDGELLM_WEBGPU_ACT": "f16"}, 2e-2), ({"EDGELLM_WEBGPU_KV": "f32"}, 2e-4)])
def test_folds_with_other_storage(models, adapter, monkeypatch, env, tol):
    """Every decode fold (forced warp GEMV, attention split every 4 keys) with fp16 activations or
    a float32 KV cache: the folded kernels store q, the cache rows and the residual through the
    tensors' own descriptors."""
    from edgellm.backends.webgpu import backend

    if env.get("EDGELLM_WEBGPU_ACT") == "f16" and not adapter.has_f16:
        pytest.skip("the adapter has no shader-f16")
    for k, v in {**env, "EDGELLM_WEBGPU_GEMV": "warp:2:64:1:stage"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(backend, "SPLIT_KEYS", 4)
    dec = _compare(models["Q4_0"], tol=tol, steps=3).programs["decode"]
    assert dec._folds and dec._ropes and dec._alias and dec._embeds
    assert (dec._finished and not dec._combines) if adapter.subgroup_size else dec._combines


def test_device_errors_are_one_line(models, monkeypatch):
    """A failure inside wgpu (here a refused bind group) is an edgellm error naming the program and
    step, on one line, not wgpu's multi-line report."""
    import wgpu

    from edgellm.backends.webgpu.backend import WebgpuError
    from edgellm.backends.webgpu.device import get_device

    m = edgellm.load(models["Q8_0"], backend="webgpu", ctx=64)

    def refuse(*a, **k):
        raise wgpu.GPUValidationError("Validation Error\n\nCaused by:\n  In wgpuDeviceCreateBindGroup\n  too big")
    monkeypatch.setattr(get_device().device, "create_bind_group", refuse)
    with pytest.raises(WebgpuError, match="running 'llama-last' on 1 tokens failed: Validation Error .* too big") as e:
        m.forward([1], 0, all_logits=False)
    assert "\n" not in str(e.value)


def test_fp16_activations(models, adapter, monkeypatch):
    """EDGELLM_WEBGPU_ACT=f16: every arena tensor stored as fp16 through its storage descriptor
    (the kernels unchanged); logits within fp16 rounding of the cpu's."""
    if not adapter.has_f16:
        pytest.skip("the adapter has no shader-f16")
    monkeypatch.setenv("EDGELLM_WEBGPU_ACT", "f16")
    g = _compare(models["Q8_0"], tol=2e-2)
    assert "f16 activations" in g.backend.describe()
    sources = [v.kernel.source for st in g.programs["decode"]._steps for v in getattr(st, "variants", (st,))]
    # x bound as an arena tensor (a float GEMV's, or quantize_x's where a GPU's GEMVs take int8 x)
    readers = [src for src in sources if re.search(r"var<storage, read_write> X: array<", src)]
    assert readers and all("var<storage, read_write> X: array<f16>" in src for src in readers)


def test_fp16_activations_into_int8_prefill(models, adapter, monkeypatch):
    """fp16 activations read by the int8 prefill's quantizer (through X's storage descriptor) and
    written by its products: logits within fp16 rounding of the cpu's."""
    if not adapter.has_f16:
        pytest.skip("the adapter has no shader-f16")
    monkeypatch.setenv("EDGELLM_WEBGPU_ACT", "f16")
    monkeypatch.setenv("EDGELLM_WEBGPU_TILED", "1")
    monkeypatch.setenv("EDGELLM_WEBGPU_PREFILL_INT8", "2")
    g = _compare(models["Q4_0"], chunk=40, steps=1, tol=2e-2)
    quant = [v.kernel.source for st in g.programs["all"]._steps for v in getattr(st, "variants", ())
             if v.kernel.name == "quantize_x"]
    assert quant and all("X: array<f16>" in src for src in quant)


def test_int8_default_configuration(monkeypatch):
    """A GPU adapter's default GEMV takes int8 activations in two planes for the formats that have
    them and whose x fits staged so (not F16, not rows too long for the workgroup memory), with x
    staged; EDGELLM_WEBGPU_INT8=1 one plane, 0 float x; the tuner's int8 candidates are int8 alone."""
    from types import SimpleNamespace

    from edgellm.backends.webgpu import tuning

    gpu = SimpleNamespace(info=SimpleNamespace(software=False), subgroup_size=32, max_workgroup_memory=48 * 1024)
    monkeypatch.delenv("EDGELLM_WEBGPU_GEMV", raising=False)
    monkeypatch.delenv("EDGELLM_WEBGPU_INT8", raising=False)
    assert tuning.default_gemv_config(gpu, 4096, "Q8_0")["planes"] == 2
    assert not tuning.default_gemv_config(gpu, 4096, "F16").get("int8")
    monkeypatch.setenv("EDGELLM_WEBGPU_INT8", "0")
    assert not tuning.default_gemv_config(gpu, 4096, "Q8_0").get("int8")
    monkeypatch.setenv("EDGELLM_WEBGPU_INT8", "1")
    for fmt in ("Q8_0", "Q4_0", "Q4_1", "Q6", "Q6M"):
        cfg = tuning.default_gemv_config(gpu, 14336, fmt)
        assert cfg["int8"] and cfg["stage"] and cfg["kind"] == "warp", fmt
    assert not tuning.default_gemv_config(gpu, 4096, "F16").get("int8")
    assert not tuning.default_gemv_config(gpu, 40000, "Q8_0").get("int8")  # 55 KB of int8 x: does not fit
    cands = tuning.gemv_candidates(gpu, int8=True)
    assert len(cands) == len(tuning.WARP_TUNED) and all(c["int8"] and c["stage"] and "planes" not in c for c in cands)
    monkeypatch.setenv("EDGELLM_WEBGPU_INT8", "2")  # two planes: 19 bytes per 8 elements staged
    assert tuning.default_gemv_config(gpu, 14336, "Q4_0")["planes"] == 2
    assert not tuning.default_gemv_config(gpu, 20000, "Q4_0").get("int8")
    assert all(c["planes"] == 2 for c in tuning.gemv_candidates(gpu, int8=True, planes=2))
    monkeypatch.setenv("EDGELLM_WEBGPU_INT8", "yes")
    with pytest.raises(edgellm.errors.EdgeLLMError, match="EDGELLM_WEBGPU_INT8='yes'"):
        tuning.default_gemv_config(gpu, 4096, "Q8_0")


@pytest.mark.parametrize("damage", [None, "flip", "truncate"])
def test_converted_weights_are_cached_and_rebuilt_when_damaged(adapter, models, tmp_path, monkeypatch, damage):
    """A K-quant file's converted weights (Q4_K as Q4_1, the mixed q|k|v stack in a six-bit layout)
    go into the program cache at the first load; the next load uploads them without converting any
    (codegen.repack is not called for a converted format) and gives the same logits as a load without
    the cache; a damaged entry is detected, converted anew with the same logits, and rewritten. A file
    whose weights are only sliced from its blocks (Q8_0) writes no entry."""
    from edgellm.backends.webgpu import codegen

    monkeypatch.setenv("EDGELLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EDGELLM_CACHE", raising=False)
    path = models["mixed"]
    ref = edgellm.load(path, backend="webgpu", ctx=64, cache=False).logits(PROMPT)
    first = edgellm.load(path, backend="webgpu", ctx=64)
    assert "weights" not in first.cache_hits
    (entry,) = list((tmp_path / "cache" / "programs").rglob("weights.bin"))
    if damage == "flip":
        data = bytearray(entry.read_bytes())
        data[len(data) - 100] ^= 0x01
        entry.write_bytes(bytes(data))
    elif damage == "truncate":
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    converted = []
    real = codegen.repack

    def counting(raw, fmt, shape):
        if fmt.upper() not in ("F16", "Q8_0", "Q4_0", "Q4_1"):
            converted.append(fmt)
        return real(raw, fmt, shape)

    monkeypatch.setattr(codegen, "repack", counting)
    second = edgellm.load(path, backend="webgpu", ctx=64)
    np.testing.assert_array_equal(second.logits(PROMPT), ref)
    if damage is None:
        assert "weights" in second.cache_hits and converted == []
    else:
        assert "weights" not in second.cache_hits and "Q4_K" in converted
        converted.clear()
        third = edgellm.load(path, backend="webgpu", ctx=64)  # the entry the second load rewrote
        assert "weights" in third.cache_hits and converted == []
        np.testing.assert_array_equal(third.logits(PROMPT), ref)
    q8 = edgellm.load(models["Q8_0"], backend="webgpu", ctx=64)
    assert "weights" not in q8.cache_hits
    assert len(list((tmp_path / "cache" / "programs").rglob("weights.bin"))) == 1


def test_a_cached_webgpu_load_imports_neither_torch_nor_sympy(adapter, models, tmp_path):
    """The webgpu backend runs a file in the layouts it reads as they are (here Q4_0) without torch,
    and a load that finds its program in the cache without sympy (shape functions from
    graph.shapes, not sympy.lambdify): 1.4 s of a 1B-shape load's 2.3 s on the 2-core CPU machine."""
    code = ("import sys, edgellm; m = edgellm.load(sys.argv[1], backend='webgpu', ctx=64); m.logits([3, 17]); "
            "print(sorted(m.cache_hits), [k for k in ('torch', 'sympy') if k in sys.modules])")
    env = {**os.environ, "EDGELLM_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code, models["Q4_0"]], capture_output=True, text=True, env=env,
                           timeout=300) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-500:]
    assert runs[0].stdout.strip().endswith("['sympy']")  # the first load compiled its graphs
    assert runs[1].stdout.strip() == "['compiled'] []"  # (the synthetic file has no tokenizer)
