"""The gemma3, qwen3, phi3 and sliding-window (Mistral-style) families against transformers reading
the same synthetic GGUF file (float32, CPU): odd head dimensions, GQA and MQA, tied and untied
outputs, F16 and quantized weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import edgellm
from edgellm.errors import UnsupportedArchitectureError
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-4  # max |dlogit| relative to the largest reference logit

FAMILY_SPECS = {
    # gemma3: 6 layers so that the pattern has 5 sliding-window layers (window 5 < 19 tokens) and a global one
    "gemma3-f16-gqa2-hd24": SyntheticSpec(arch="gemma3", n_layers=6, d_model=64, n_heads=4, n_kv_heads=2, head_dim=24,
                                          ffn_dim=96, sliding_window=5, rope_theta=1e6, norm_eps=1e-6,
                                          weight_type="F16", std=0.1, seed=31),
    "gemma3-q8_0-mqa-untied-softcap": SyntheticSpec(arch="gemma3", n_layers=2, d_model=64, n_heads=2, n_kv_heads=1,
                                                    head_dim=48, ffn_dim=64, sliding_window=4, tied=False,
                                                    logit_softcap=3.0, weight_type="Q8_0", std=0.1, seed=32),
    "qwen3-f32-gqa2-hd24": SyntheticSpec(arch="qwen3", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=24,
                                         rope_theta=1e6, norm_eps=1e-6, std=0.1, seed=33),
    "qwen3-q8_0-mqa-untied": SyntheticSpec(arch="qwen3", n_layers=2, d_model=64, n_heads=4, n_kv_heads=1, tied=False,
                                           weight_type="Q8_0", std=0.1, seed=34),
    "phi3-f32-mha-untied": SyntheticSpec(arch="phi3", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, tied=False,
                                         std=0.1, seed=35),
    "phi3-f16-gqa2-hd24": SyntheticSpec(arch="phi3", n_layers=2, d_model=96, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                        weight_type="F16", std=0.1, seed=36),
    "phi3-q8_0-mqa": SyntheticSpec(arch="phi3", n_layers=2, d_model=64, n_heads=2, n_kv_heads=1, ffn_dim=64,
                                   weight_type="Q8_0", std=0.1, seed=37),
    # Phi-3 long-RoPE (rope_factors_short/long, attention factor): the short factors within the training context
    "phi3-longrope-gqa2": SyntheticSpec(arch="phi3", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, tied=False,
                                        rope_factors=True, std=0.1, seed=39),
    # Mistral-style: a llama file with attention.sliding_window (see hf_logits)
    "mistral-sliding-window": SyntheticSpec(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, sliding_window=6,
                                            std=0.1, seed=38),
}


def hf_overrides(spec: SyntheticSpec, path=None) -> dict:
    """Config values transformers' GGUF loader does not read from these files (each is in the file,
    or is llama.cpp's fixed reading of it)."""
    hd = spec.head_dim or spec.d_model // spec.n_heads
    if spec.arch == "gemma3":
        # llama.cpp's softmax scale for Gemma 3 is 1/sqrt(key_length); transformers uses query_pre_attn_scalar
        return {"query_pre_attn_scalar": hd, "final_logit_softcapping": spec.logit_softcap or None}
    if spec.arch == "qwen3":
        return {"head_dim": hd}  # attention.key_length is not mapped for qwen3
    if spec.arch == "phi3":
        out = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}  # its defaults lie outside a tiny vocab
        if spec.rope_factors:  # transformers' GGUF loader ignores the factor tensors: give them as its config
            from edgellm.gguf_file import open_gguf

            f = open_gguf(path)
            short, long = (np.asarray(f.tensors[f"rope_factors_{k}.weight"].data, dtype=np.float64).tolist()
                           for k in ("short", "long"))
            orig = spec.context_length // 4
            out.update(max_position_embeddings=spec.context_length, original_max_position_embeddings=orig,
                       rope_parameters={"rope_type": "longrope", "short_factor": short, "long_factor": long,
                                        "rope_theta": spec.rope_theta, "original_max_position_embeddings": orig})
        return out
    return {}


def hf_logits(directory, name, spec, ids) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=name, dtype=torch.float32,
                                                              **hf_overrides(spec, directory / name))
    if spec.arch == "llama" and spec.sliding_window:
        # transformers' GGUF loader has no mistral path here: its Mistral model (sliding-window
        # attention) takes the weights of the llama model it read, whose parameter names it shares
        cfg = transformers.MistralConfig(**{k: v for k, v in model.config.to_dict().items()
                                            if k not in ("architectures", "model_type")},
                                         sliding_window=spec.sliding_window)
        mistral = transformers.MistralForCausalLM(cfg).to(torch.float32)
        missing, unexpected = mistral.load_state_dict(model.state_dict(), strict=False)
        assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
        model = mistral.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.mark.parametrize("name", list(FAMILY_SPECS))
def test_family_logits_match_transformers(name, family_dir):
    spec = FAMILY_SPECS[name]
    path = write_synthetic_gguf(family_dir / f"{name}.gguf", spec)
    ids = np.random.default_rng(spec.seed).integers(0, spec.vocab_size, 19).tolist()
    m = edgellm.load(path, ctx=64)
    assert m.config.arch == spec.arch
    ours = m.logits(ids)
    ref = hf_logits(family_dir, path.name, spec, ids)
    scale = np.abs(ref).max()
    assert scale > 0.5, "reference logits too small for a meaningful comparison"
    err = np.abs(ours - ref).max() / scale
    assert err <= REL_TOL, f"{name}: max |dlogit| {err:.2e} of the logit scale"
    # decode through the cache (the sliding window over cached keys) gives the same last rows
    steps = [m.forward(ids[:9], 0, all_logits=False)[-1]]
    steps += [m.forward([ids[i]], i, all_logits=False)[-1] for i in range(9, len(ids))]
    assert np.abs(np.stack(steps) - ref[8:]).max() / scale <= REL_TOL


def test_family_graphs_state_only_their_differences(family_dir):
    """What each family adds shows in its graph: the sliding window on gemma3's local layers only,
    per-head q/k norms, GELU gating, the embedding scale; phi3's fused tensors read as row slices
    and still fuse into one q|k|v projection and one gate|up projection."""
    from edgellm.compiler.compile import compile_graph
    from edgellm.gguf_file import open_gguf
    from edgellm.models import build_graph, config_from_gguf

    spec = FAMILY_SPECS["gemma3-f16-gqa2-hd24"]
    f = open_gguf(write_synthetic_gguf(family_dir / "g.gguf", spec))
    cfg = config_from_gguf(f)
    g = build_graph(cfg, f)
    windows = [op.attrs.get("window", 0) for op in g.ops if op.kind == "attention"]
    assert windows == [5, 5, 5, 5, 5, 0]
    thetas = [op.attrs["theta"] for op in g.ops if op.name.endswith("rope_q")]
    assert thetas == [10000.0] * 5 + [1e6]
    assert cfg.embed_scale == pytest.approx(8.0) and cfg.softmax_scale == pytest.approx(1 / math.sqrt(24))
    counts = g.op_counts()
    assert counts["gelu"] == 6 and "silu" not in counts and counts["scale"] == 1
    assert counts["rms_norm"] == 6 * 6 + 1  # attn, q, k, post-attn, ffn, post-ffw per layer + output
    fused = compile_graph(g, seq=8, ctx=64).graph.op_counts()
    assert fused.get("linear_swiglu") == 6 and "gelu" not in fused
    # the q/k norms move into the fused RoPE + cache write: one q|k|v projection per layer
    # (rms_norm left: the first attn_norm and the two post-norms per layer; the others fuse with their adds)
    assert fused["linear_qkv"] == 6 and fused["rope_qkv_store"] == 6 and fused["rms_norm"] == 1 + 2 * 6

    spec = FAMILY_SPECS["phi3-f16-gqa2-hd24"]
    f = open_gguf(write_synthetic_gguf(family_dir / "p.gguf", spec))
    g = build_graph(config_from_gguf(f), f)
    sources = {t.source for t in g.weights()}
    assert "blk.0.attn_qkv.weight[0:96]" in sources and "blk.0.ffn_up.weight[96:192]" in sources
    fused = compile_graph(g, seq=8, ctx=64).graph.op_counts()
    assert fused["linear_qkv"] == 2 and fused["linear_swiglu"] == 2


def test_unsupported_architecture_names_the_supported_ones(family_dir):
    import gguf

    path = family_dir / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match=r"'falcon' is not supported \(supported: gemma3, llama, "
                                                           r"mistral, phi3, qwen2, qwen3\)"):
        edgellm.load(path)
