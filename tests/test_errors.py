"""Bad input: a specific exception in the API, one line naming the problem and a non-zero exit in the CLI."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest

import edgellm
from edgellm.errors import (
    ContextOverflowError,
    MissingTensorError,
    ModelFileError,
    TensorShapeError,
    UnknownTensorTypeError,
    UnsupportedArchitectureError,
)
from edgellm.gguf_file import open_gguf
from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf

SPEC = SyntheticSpec(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=96)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("err") / "good.gguf", SPEC)


def _patched(src, dst, find: bytes, skip: int, fmt: str, value):
    """Copy src to dst with the value `skip` bytes after `find` (in the header) replaced."""
    data = bytearray(src.read_bytes())
    i = data.index(find) + len(find) + skip
    struct.pack_into(fmt, data, i, value)
    dst.write_bytes(bytes(data))
    return dst


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "edgellm", *args], capture_output=True, text=True, timeout=300)


def _make_cases(good, tmp):
    cases = {}
    cases["missing"] = (tmp / "nope.gguf", ModelFileError, "not found")
    (tmp / "text.gguf").write_text("this is not a model\n")
    cases["not-gguf"] = (tmp / "text.gguf", ModelFileError, "not a GGUF")
    raw = good.read_bytes()
    (tmp / "trunc-data.gguf").write_bytes(raw[: len(raw) // 2])
    cases["truncated-data"] = (tmp / "trunc-data.gguf", ModelFileError, "truncated")
    (tmp / "trunc-head.gguf").write_bytes(raw[:200])
    cases["truncated-header"] = (tmp / "trunc-head.gguf", ModelFileError, "truncated")
    # tensor info: name, u32 n_dims, n_dims x u64, u32 type -> type 250
    name = b"output_norm.weight"
    cases["unknown-type"] = (_patched(good, tmp / "badtype.gguf", name, 4 + 8, "<I", 250),
                             UnknownTensorTypeError, "output_norm.weight")
    # metadata: key, u32 value type, u32 value
    cases["shape-mismatch"] = (_patched(good, tmp / "badshape.gguf", b"llama.feed_forward_length", 4, "<I", 100),
                               TensorShapeError, "ffn_gate.weight")
    arch = write_synthetic_gguf(tmp / "arch.gguf", SyntheticSpec(arch="qwen2", n_layers=1, d_model=64, n_heads=4,
                                                                  n_kv_heads=2, ffn_dim=96))
    data = arch.read_bytes().replace(b"qwen2", b"qwenX")
    (tmp / "arch.gguf").write_bytes(data)
    cases["unsupported-arch"] = (tmp / "arch.gguf", UnsupportedArchitectureError, "qwenX")
    return cases


def test_bad_model_files_raise_specific_errors(good, tmp_path):
    for case, (path, exc, words) in _make_cases(good, tmp_path).items():
        with pytest.raises(exc) as info:
            edgellm.load(path)
        msg = str(info.value)
        assert words in msg, f"{case}: {msg}"
        assert "\n" not in msg, f"{case}: multi-line message"


def test_bad_model_files_give_one_line_cli_errors(good, tmp_path):
    for case, (path, _, words) in _make_cases(good, tmp_path).items():
        r = _cli("info", str(path))
        assert r.returncode != 0, case
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("edgellm: error:") and words in lines[0], (case, r.stderr)
        assert "Traceback" not in r.stderr


def test_missing_tensor(tmp_path, good):
    data = good.read_bytes().replace(b"blk.0.ffn_up.weight", b"blk.0.ffn_XX.weight")
    (tmp_path / "m.gguf").write_bytes(data)
    with pytest.raises(MissingTensorError, match="blk.0.ffn_up.weight"):
        edgellm.load(tmp_path / "m.gguf")


def test_prompt_longer_than_context(default_model):
    long_prompt = "word " * 600
    with pytest.raises(ContextOverflowError, match="context of 512"):
        list(default_model.generate(long_prompt, max_tokens=4, chat=False))
    with pytest.raises(ContextOverflowError):
        default_model.logits(list(range(513)))


def test_prompt_longer_than_context_cli():
    r = _cli("run", "--ctx", "16", "-n", "4", "--raw", "a b c d e f g h i j k l m n o p q r s t u v w x y z")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "context of 16" in r.stderr


def test_input_file_is_not_modified(good):
    before = good.read_bytes()
    m = edgellm.load(good, ctx=32)
    m.logits([1, 2, 3])
    assert good.read_bytes() == before


def test_reader_agrees_with_gguf_py(default_model_path, good):
    """Our header parser against gguf-py's own reader: every key and every tensor byte."""
    from gguf import GGUFReader

    for path in (default_model_path, good):
        ours = open_gguf(path)
        ref = GGUFReader(str(path))
        keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert list(ours.metadata) == keys
        for k in keys:
            expected = ref.fields[k].contents()
            got = ours.metadata[k]
            if isinstance(expected, float):
                assert got == pytest.approx(expected, rel=1e-7), k
            else:
                assert got == expected, k
        assert [t.name for t in ref.tensors] == list(ours.tensors)
        for t in ref.tensors:
            mine = ours.tensors[t.name]
            assert mine.ggml_type == t.tensor_type
            assert mine.shape == tuple(int(x) for x in reversed(t.shape.tolist()))
            assert np.array_equal(mine.data.view(np.uint8).ravel(), t.data.view(np.uint8).ravel()), t.name


def test_long_string_arrays_are_parsed_when_read_and_never_seen_unparsed(default_model_path, tmp_path):
    """The vocabulary's tokens and merges (49k strings each in the default model) are parsed on
    first use; every way of reading the metadata gives gguf-py's values, and length() counts them
    without parsing. A file cut inside such an array is still refused at open, naming the key."""
    import json

    from gguf import GGUFReader

    from edgellm.gguf_file import LAZY_STRINGS

    ref = GGUFReader(str(default_model_path))
    want = {k: ref.fields[k].contents() for k in ref.fields if not k.startswith("GGUF.")}
    big = [k for k, v in want.items() if isinstance(v, list) and len(v) >= LAZY_STRINGS and isinstance(v[0], str)]
    assert set(big) == {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"}

    def fresh():
        m = open_gguf(default_model_path).metadata
        assert all(not isinstance(dict.__getitem__(m, k), list) for k in big)  # not parsed yet
        return m

    m = fresh()
    assert [m.length(k) for k in big] == [len(want[k]) for k in big] and m.length("no.such.key") == 0
    assert all(not isinstance(dict.__getitem__(m, k), list) for k in big)  # length() parsed nothing
    for read in (lambda m: dict(m), lambda m: {**m}, lambda m: dict(m.items()), lambda m: m.copy(),
                 lambda m: dict(zip(m, m.values())), lambda m: json.loads(json.dumps(m)),
                 lambda m: {k: m.get(k) for k in m}):
        got = read(fresh())
        assert got.keys() == want.keys()
        for k in big:
            assert got[k] == want[k], k
    assert fresh() == {k: (m[k]) for k in m} and not (fresh() != dict(fresh()))
    m = fresh()
    assert m.pop("tokenizer.ggml.merges") == want["tokenizer.ggml.merges"] and "tokenizer.ggml.merges" not in m

    raw = default_model_path.read_bytes()
    at = raw.find(b"tokenizer.ggml.merges") + 100_000  # inside the merges' strings
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:at])
    with pytest.raises(ModelFileError, match=r"cut\.gguf.*tokenizer\.ggml\.merges"):
        open_gguf(cut)
