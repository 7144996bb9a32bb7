"""Model logits against independent references: transformers reading the same GGUF (float32, CPU),
and a float64 numpy forward pass (tests/reference.py) for features transformers ignores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edgellm
from edgellm.sampling import SamplingParams
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf
from reference import ReferenceLlama

TOL = 1e-3  # max |delta logit| allowed (the acceptance bound)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "# Print the first 10 numbers\nfor i in range(10):\n    print(fibonacci(i))",
]


def _chat_ids(tok, text):
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(rendered, add_special_tokens=False).input_ids


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.fixture(scope="module")
def default_prompts(hf_default):
    _, tok = hf_default
    ids = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    ids.append(_chat_ids(tok, "What is the capital of France? Answer in one sentence, then explain why "
                              "Paris became the capital, with a few historical facts."))
    return ids


def test_default_model_logits_match_transformers(default_model, hf_default, default_prompts):
    model, _ = hf_default
    for ids in default_prompts:
        ours = default_model.logits(ids)
        ref = _hf_logits(model, ids)
        assert ours.shape == ref.shape == (len(ids), 49152)
        assert ours.dtype == np.float32
        err = np.abs(ours - ref).max()
        assert err <= TOL, f"max |dlogit| {err} on a {len(ids)}-token prompt"
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_default_model_greedy_continuation_matches_transformers(default_model, hf_default, default_prompts):
    model, _ = hf_default
    for ids in default_prompts:
        ours = list(default_model.generate_tokens(ids, 32, SamplingParams(temperature=0)))
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        ref = out[0, len(ids):].tolist()
        eos = default_model.tokenizer.stop_ids
        ref = ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]
        assert ours == ref


def test_incremental_decode_equals_full_prefill(default_model, default_prompts):
    """Prefill a prefix, then decode one token at a time through the in-place KV cache: each step's
    logits equal the full-sequence logits at that position."""
    ids = default_prompts[1][:24]
    full = default_model.logits(ids)
    caches = {n: t.data_ptr() for n, t in default_model.states.items()}
    step = [default_model.forward(ids[:10], 0, all_logits=False)[-1]]
    for i in range(10, len(ids)):
        step.append(default_model.forward(ids[i:i + 1], i, all_logits=False)[-1])
    np.testing.assert_allclose(np.stack(step), full[9:], atol=1e-4, rtol=0)
    # written in place: the cache tensors are the same storage after every step
    assert caches == {n: t.data_ptr() for n, t in default_model.states.items()}


# -- synthetic models: many shapes and formats ---------------------------------------------------

SYNTHETIC = {
    # name: spec (std 0.1 makes logits O(1), so the absolute tolerance is a sharp test)
    "llama-f32-gqa2": SyntheticSpec(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, std=0.1),
    "llama-f16-gqa3-untied": SyntheticSpec(n_layers=3, d_model=96, n_heads=3, n_kv_heads=1, ffn_dim=160,
                                           tied=False, weight_type="F16", std=0.1, seed=1),
    "llama-q8_0-mha": SyntheticSpec(n_layers=2, d_model=64, n_heads=2, n_kv_heads=2, weight_type="Q8_0", std=0.1, seed=2),
    "llama-q4_0-untied": SyntheticSpec(n_layers=2, d_model=128, n_heads=4, n_kv_heads=1, ffn_dim=96, tied=False,
                                       weight_type="Q4_0", output_type="Q8_0", std=0.1, seed=3),
    "llama-q4_1": SyntheticSpec(n_layers=1, d_model=64, n_heads=4, n_kv_heads=4, weight_type="Q4_1",
                                embed_type="Q8_0", std=0.1, seed=4),
    "qwen2-f32-bias": SyntheticSpec(arch="qwen2", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, std=0.1, seed=5),
    "qwen2-q8_0-untied": SyntheticSpec(arch="qwen2", n_layers=2, d_model=64, n_heads=8, n_kv_heads=2, tied=False,
                                       weight_type="Q8_0", std=0.1, seed=6),
}


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("synthetic")


@pytest.mark.parametrize("name", list(SYNTHETIC))
def test_synthetic_logits_match_transformers(name, synthetic_dir):
    transformers = pytest.importorskip("transformers")
    spec = SYNTHETIC[name]
    path = write_synthetic_gguf(synthetic_dir / f"{name}.gguf", spec)
    ids = np.random.default_rng(spec.seed).integers(0, spec.vocab_size, 19).tolist()
    ours = edgellm.load(path, ctx=64).logits(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(synthetic_dir), gguf_file=path.name, dtype=torch.float32)
    ref = _hf_logits(hf, ids)
    assert np.abs(ref).max() > 0.5, "reference logits too small for a meaningful comparison"
    err = np.abs(ours - ref).max()
    assert err <= TOL, f"{name}: max |dlogit| {err}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


FLOAT64_ONLY = {
    # features transformers' GGUF loader ignores: checked against the float64 reference instead
    "llama3-rope-freqs": SyntheticSpec(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, rope_freqs=True, std=0.1),
    "linear-rope-scaling": SyntheticSpec(n_layers=2, d_model=64, n_heads=4, n_kv_heads=1, rope_linear_factor=4.0,
                                         std=0.1, seed=7),
    "head-dim-key-length": SyntheticSpec(n_layers=2, d_model=80, n_heads=4, n_kv_heads=2, head_dim=48, std=0.1, seed=8),
    "qwen2-q4_1": SyntheticSpec(arch="qwen2", n_layers=2, d_model=64, n_heads=4, n_kv_heads=1, weight_type="Q4_1",
                                std=0.1, seed=9),
}


@pytest.mark.parametrize("name", list(FLOAT64_ONLY))
def test_synthetic_logits_match_float64_reference(name, synthetic_dir):
    spec = FLOAT64_ONLY[name]
    path = write_synthetic_gguf(synthetic_dir / f"{name}.gguf", spec)
    ids = np.random.default_rng(spec.seed).integers(0, spec.vocab_size, 23).tolist()
    ours = edgellm.load(path, ctx=64).logits(ids)
    ref = ReferenceLlama(path).logits(ids)
    assert np.abs(ref).max() > 0.5
    err = np.abs(ours - ref).max()
    assert err <= 1e-4, f"{name}: max |dlogit| {err} vs float64"


def test_synthetic_vocab_models_match_transformers(synthetic_dir):
    """Models carrying a real vocabulary (byte-level BPE and SentencePiece-style) load and match."""
    transformers = pytest.importorskip("transformers")
    vf = pytest.importorskip("vocab_fixtures")
    for kind, add in (("bpe", vf.add_bpe_vocab), ("spm", vf.add_spm_vocab)):
        spec = SyntheticSpec(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, std=0.1, seed=11)
        path = write_synthetic_gguf(synthetic_dir / f"vocab-{kind}.gguf", spec, tokenizer=add)
        m = edgellm.load(path, ctx=64)
        ids = m.tokenizer.encode("Hello world, 123 tokens here!")
        ours = m.logits(ids)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(synthetic_dir), gguf_file=path.name,
                                                               dtype=torch.float32)
        err = np.abs(ours - _hf_logits(hf, ids)).max()
        assert err <= TOL, f"{kind}: max |dlogit| {err}"
