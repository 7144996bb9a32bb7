"""The tokenizer a GGUF file describes, built from its own metadata on Hugging Face `tokenizers`.

A GGUF carries no tokenizer.json: it stores the vocabulary (tokenizer.ggml.tokens), a type per
token (token_type), merges or scores, and special token ids under llama.cpp's key names. Two
vocabulary kinds are supported:

- `gpt2`: byte-level BPE. The merges are in the file; the pre-tokenizer (how text is split
  before BPE) is named by tokenizer.ggml.pre and chosen here the way llama.cpp chooses it.
- `llama`: SentencePiece-style BPE with byte fallback (<0xNN> tokens) and "▁" for spaces. The file
  has scores instead of merges; merges are derived from them (a piece made of two pieces is merged
  with the priority of its score, as llama.cpp's SentencePiece tokenizer does).

Control (3), unknown (2) and user-defined (4) tokens are matched whole in the text; control and
unknown ones only when parse_special is true, as llama.cpp does. Encoding is done by `tokenizers`;
decoding by a per-token byte table built here, so that `decode` and the streaming decoder give the
same text by construction and never split a UTF-8 character.

Where llama.cpp and transformers disagree, this follows transformers' GGUF loader (the reference the
tests compare with): after a special token, a SentencePiece vocabulary gets no extra "▁" prefix.
"""

from __future__ import annotations

import codecs
import json
import operator
import re
import threading
import warnings
from typing import Iterable

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from .errors import MetadataError

# llama.cpp's token types (gguf TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's visible space
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

# Text of end-of-turn tokens that llama.cpp treats as end of generation when the vocabulary has them.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
})

# -- byte-level pre-tokenizers (tokenizer.ggml.pre) ------------------------------------------------
# Split patterns, by the family llama.cpp groups each name into. None means GPT-2's own pattern,
# which `tokenizers`' ByteLevel pre-tokenizer applies itself.
_CONTRACTIONS_CI = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_SPLIT = (_CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (_CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS_CI}?"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS_CI}?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+"
                 rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_GPT2_FAMILY = ("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
_LLAMA3_FAMILY = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                  "dbrx", "smaug-bpe")
_QWEN2_FAMILY = ("qwen2", "deepseek-r1-qwen", "megrez")
_GPT4O_FAMILY = ("gpt-4o", "llama4")
_TEKKEN_FAMILY = ("tekken",)

SUPPORTED_PRE_TOKENIZERS = frozenset(_GPT2_FAMILY + _DIGITS_THEN_GPT2 + _LLAMA3_FAMILY + _QWEN2_FAMILY
                                     + _GPT4O_FAMILY + _TEKKEN_FAMILY)


def _byte_level_pre_tokenizer(pre: str, source: str):
    """(pre-tokenizer, ignore_merges) for a byte-level vocabulary whose tokenizer.ggml.pre is `pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def split_then_bytes(pattern: str):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level])

    if pre in _LLAMA3_FAMILY:
        # llama.cpp looks a whole pre-token up in the vocabulary before merging for these (as
        # Llama 3's tokenizer.json says: ignore_merges)
        return split_then_bytes(_LLAMA3_SPLIT), True
    if pre in _QWEN2_FAMILY:
        return split_then_bytes(_QWEN2_SPLIT), False
    if pre in _GPT4O_FAMILY:
        return split_then_bytes(_GPT4O_SPLIT), False
    if pre in _TEKKEN_FAMILY:
        return split_then_bytes(_TEKKEN_SPLIT), False
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]), False
    if pre not in _GPT2_FAMILY:
        warnings.warn(f"{source or 'GGUF'}: unknown tokenizer.ggml.pre {pre!r}; splitting text with GPT-2's "
                      "pattern, so token ids may differ from the model's own tokenizer", stacklevel=3)
    return gpt2, False


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: every byte as one printable character (printable Latin-1 stand for
    themselves, the rest are shifted past U+0100 in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


BYTE_ALPHABET = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in BYTE_ALPHABET.items()}


# alphabet character -> its byte; a character below 256 outside the alphabet (which encodes to
# other bytes in UTF-8 than in Latin-1) -> U+FFFF, so that the encode fails and the exact path runs
_TO_LATIN1 = {**{b: "\uffff" for b in range(256)}, **{ord(c): b for c, b in _CHAR_TO_BYTE.items()}}


def _byte_level_bytes(token: str) -> bytes:
    try:  # every character in the byte alphabet: one C-level translation (a vocabulary in ~50 ms)
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        # characters outside the alphabet cannot come from BPE; keep them as their own UTF-8
        return b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode("utf-8") for c in token)


class ByteTable:
    """Each token's bytes as one blob and offsets (token i is blob[offsets[i]:offsets[i + 1]]): the
    program cache's form of the table from_metadata builds from the vocabulary's strings."""

    def __init__(self, blob, offsets):
        offsets = np.asarray(offsets)
        if offsets.ndim != 1 or offsets.dtype != np.int64 or len(offsets) < 1 or offsets[0] != 0 \
                or int(offsets[-1]) != len(blob) or (len(offsets) > 1 and np.any(np.diff(offsets) < 0)):
            raise ValueError("not a byte table")
        self.blob = bytes(blob) if not isinstance(blob, bytes) else blob
        self.offsets = offsets
        self._off = offsets.tolist()

    @classmethod
    def of(cls, pieces: list[bytes]) -> "ByteTable":
        offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in pieces], out=offsets[1:])
        return cls(b"".join(pieces), offsets)

    def blob_array(self) -> np.ndarray:
        return np.frombuffer(self.blob, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self._off) - 1

    def __getitem__(self, i: int) -> bytes:
        return self.blob[self._off[i]:self._off[i + 1]]


# -- metadata access -------------------------------------------------------------------------------
class _Meta:
    """Typed reads of tokenizer metadata that fail with the key and the file named."""

    def __init__(self, meta: dict, source: str):
        self.meta, self.source = meta, source or "GGUF"

    def error(self, key: str, problem: str) -> MetadataError:
        return MetadataError(f"{self.source}: metadata key '{key}' {problem}")

    def get(self, key: str, kind, default=None):
        if key not in self.meta:
            return default
        value = self.meta[key]
        if kind is bool and type(value) is int and value in (0, 1):  # a flag some writers store as an integer
            return bool(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            want = getattr(kind, "__name__", kind)
            raise self.error(key, f"is {type(value).__name__} {value!r:.60}, expected {want}")
        return value

    def chat_template(self) -> tuple[str | None, bool]:
        """(template, built in): the file's chat template, else the family's known format, as
        llama.cpp's built-in templates (--raw turns it off)."""
        template = self.get("tokenizer.chat_template", str)
        if template:
            return template, False
        from .chat_builtin import BUILTIN_TEMPLATES

        template = BUILTIN_TEMPLATES.get(str(self.meta.get("general.architecture", "")))
        return template, template is not None

    def token_id(self, key: str, n_vocab: int) -> int | None:
        value = self.get(key, int)
        if value is None:
            return None
        if value < 0:  # llama.cpp writes -1 (as uint32 max sometimes) for "none"
            return None
        if value >= n_vocab:
            if value >= 2**31 - 1:
                return None
            raise self.error(key, f"is {value}, outside the vocabulary of {n_vocab} tokens")
        return value

    def array(self, key: str, n: int, item_kind, required: bool = False) -> list | None:
        value = self.get(key, list)
        if value is None:
            if required:
                raise self.error(key, "is missing")
            return None
        if n >= 0 and len(value) != n:
            raise self.error(key, f"has {len(value)} entries, expected {n} (one per token)")
        kinds = item_kind if isinstance(item_kind, tuple) else (item_kind,)
        if value and not set(map(type, value)) <= set(kinds) and \
                not all(isinstance(v, item_kind) and not isinstance(v, bool) for v in value):
            bad = next(v for v in value if not isinstance(v, item_kind) or isinstance(v, bool))
            raise self.error(key, f"holds {type(bad).__name__} {bad!r:.60}, expected {item_kind}")
        return value


# -- the tokenizer ---------------------------------------------------------------------------------
class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Build with `Tokenizer.from_metadata(meta)`."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    stop_ids: frozenset[int]
    chat_template: str | None
    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None  # tokenizer.ggml.pre (byte-level vocabularies)

    def __init__(self, *, backend: _HFTokenizer, tokens, token_types: list[int],
                 token_bytes, special_ids: frozenset[int], model: str, pre: str | None,
                 bos_id: int | None, eos_id: int | None, unk_id: int | None, pad_id: int | None,
                 add_bos: bool, add_eos: bool, stop_ids: frozenset[int], chat_template: str | None,
                 strip_leading_space: bool, source: str = ""):
        self._backend = backend
        self._plain_backend: _HFTokenizer | None = None  # built on first parse_special=False
        self._plain_lock = threading.Lock()
        self._tokens_src = tokens  # the list, or a function giving it (read from the metadata on first use)
        self._types = token_types
        self._token_bytes = token_bytes  # list of bytes, or a ByteTable
        self._special_ids = special_ids
        self._strip_leading_space = strip_leading_space
        self.model, self.pre, self.source = model, pre, source
        self.vocab_size = len(token_bytes)
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = bos_id, eos_id, unk_id, pad_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.stop_ids = stop_ids
        self.chat_template = chat_template
        self.builtin_template = False  # chat_template is the family's built-in one (the file has none)

    @property
    def _tokens(self) -> list[str]:
        if callable(self._tokens_src):
            self._tokens_src = self._tokens_src()
        return self._tokens_src

    def __repr__(self) -> str:
        pre = f", pre={self.pre!r}" if self.pre else ""
        return (f"Tokenizer({self.model!r}{pre}, vocab={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, "
                f"add_bos={self.add_bos})")

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, meta: dict, source: str = "", backend_json: str | None = None,
                      derived: dict | None = None) -> "Tokenizer":
        """The tokenizer described by a GGUF's metadata (`open_gguf(path).metadata`); source names
        the file in error messages. Raises MetadataError for a missing or malformed key.
        backend_json: `backend_json()` of the same file's tokenizer from an earlier load (the
        program cache), which skips building the BPE model (merges of a SentencePiece vocabulary
        are derived from its scores, seconds for a 262k vocabulary). derived: `derived()` of the
        same file's tokenizer (the program cache too), which skips reading the vocabulary's
        strings (each token's bytes and the stop tokens come from it; 0.1-0.3 s for a 128k
        vocabulary); ignored unless backend_json is given and it counts the file's tokens."""
        m = _Meta(meta, source)
        if backend_json is not None and derived is not None:
            tok = cls._from_derived(m, backend_json, derived)
            if tok is not None:
                return tok
        model = m.get("tokenizer.ggml.model", str)
        if model is None:
            raise m.error("tokenizer.ggml.model", "is missing (no tokenizer in this file)")
        if model not in ("gpt2", "llama"):
            raise m.error("tokenizer.ggml.model", f"is {model!r}: this tokenizer kind is not supported "
                                                  "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
        tokens = m.array("tokenizer.ggml.tokens", -1, str, required=True)
        if not tokens:
            raise m.error("tokenizer.ggml.tokens", "is empty")
        n = len(tokens)
        types = m.array("tokenizer.ggml.token_type", n, int)
        ids = {key: m.token_id(f"tokenizer.ggml.{key}", n)
               for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
                           "eot_token_id", "eom_token_id")}
        bos, eos, unk, pad = (ids["bos_token_id"], ids["eos_token_id"], ids["unknown_token_id"],
                              ids["padding_token_id"])
        if types is None:
            types = _guess_token_types(tokens, model, {i for i in (bos, eos, unk, pad) if i is not None})

        if model == "gpt2":
            token_bytes, strip = _byte_level_token_bytes(tokens, types), False
            pre = m.get("tokenizer.ggml.pre", str, "default")
        else:
            token_bytes, strip = _sentencepiece_token_bytes(tokens, types), \
                m.get("tokenizer.ggml.add_space_prefix", bool, True)
            pre = None

        # added tokens: matched whole in the text before the model sees it
        referenced = {i for i in (bos, eos, unk, pad) if i is not None}
        special = _special_ids(types, referenced)
        backend = None
        if backend_json is not None:
            try:
                backend = _HFTokenizer.from_str(backend_json)
            except Exception:  # not a tokenizer: build it from the metadata
                backend = None
        if backend is None:
            backend = _build_byte_level(m) if model == "gpt2" else _build_sentencepiece(m, tokens, types)
            user = [i for i, t in enumerate(types) if t == USER_DEFINED and i not in referenced]
            backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
            backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])

        add_bos = m.get("tokenizer.ggml.add_bos_token", bool, model == "llama")
        add_eos = m.get("tokenizer.ggml.add_eos_token", bool, False)
        stop = {i for i in (eos, ids["eot_token_id"], ids["eom_token_id"]) if i is not None}
        stop |= {i for i, (t, ty) in enumerate(zip(tokens, types))
                 if t in _EOG_TEXTS and ty in (CONTROL, USER_DEFINED)}
        template, builtin = m.chat_template()
        tok = cls(backend=backend, tokens=tokens, token_types=types, token_bytes=token_bytes,
                   special_ids=frozenset(special), model=model, pre=pre, bos_id=bos, eos_id=eos, unk_id=unk,
                   pad_id=pad, add_bos=add_bos, add_eos=add_eos, stop_ids=frozenset(stop),
                   chat_template=template or None, strip_leading_space=strip, source=source)
        tok.builtin_template = builtin
        return tok

    @classmethod
    def _from_derived(cls, m: "_Meta", backend_json: str, derived: dict) -> "Tokenizer | None":
        """from_metadata's cached path: the metadata's scalars and token types, the built BPE model
        and the derived tables; None (build it all) where they do not fit the file."""
        key = "tokenizer.ggml.tokens"
        n = m.meta.length(key) if hasattr(m.meta, "length") else len(m.meta.get(key) or ())
        table = derived.get("token_bytes")
        model = m.get("tokenizer.ggml.model", str)
        if not n or not isinstance(table, ByteTable) or len(table) != n or derived.get("model") != model:
            return None
        types = m.array("tokenizer.ggml.token_type", n, int)
        if types is None:  # guessed from the strings: nothing to save
            return None
        ids = {k: m.token_id(f"tokenizer.ggml.{k}", n)
               for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")}
        bos, eos, unk, pad = (ids["bos_token_id"], ids["eos_token_id"], ids["unknown_token_id"],
                              ids["padding_token_id"])
        referenced = {i for i in (bos, eos, unk, pad) if i is not None}
        special = _special_ids(types, referenced)
        try:
            backend = _HFTokenizer.from_str(backend_json)
        except Exception:  # noqa: BLE001 - not a tokenizer: build it all
            return None
        template, builtin = m.chat_template()
        meta = m.meta
        tok = cls(backend=backend, tokens=lambda: meta[key], token_types=types, token_bytes=table,
                  special_ids=frozenset(special), model=model,
                  pre=m.get("tokenizer.ggml.pre", str, "default") if model == "gpt2" else None,
                  bos_id=bos, eos_id=eos, unk_id=unk, pad_id=pad,
                  add_bos=m.get("tokenizer.ggml.add_bos_token", bool, model == "llama"),
                  add_eos=m.get("tokenizer.ggml.add_eos_token", bool, False),
                  stop_ids=frozenset(int(i) for i in derived["stop_ids"]), chat_template=template or None,
                  strip_leading_space=bool(derived["strip_leading_space"]), source=m.source)
        tok.builtin_template = builtin
        return tok

    def derived(self) -> dict:
        """What from_metadata computes from the vocabulary's strings, for the program cache:
        {"arrays": {"bytes", "offsets"}, "meta": {...}} (see ByteTable)."""
        table = self._token_bytes if isinstance(self._token_bytes, ByteTable) else ByteTable.of(self._token_bytes)
        return {"arrays": {"bytes": table.blob_array(), "offsets": table.offsets},
                "meta": {"model": self.model, "stop_ids": sorted(self.stop_ids),
                         "strip_leading_space": self._strip_leading_space}}

    @staticmethod
    def derived_from(meta: dict, arrays: dict) -> dict | None:
        """derived() read back from the cache (None where malformed)."""
        try:
            table = ByteTable(arrays["bytes"], arrays["offsets"])
            return {"token_bytes": table, "model": meta["model"], "stop_ids": list(meta["stop_ids"]),
                    "strip_leading_space": bool(meta["strip_leading_space"])}
        except (KeyError, TypeError, ValueError):
            return None

    def backend_json(self) -> str:
        """The built BPE model (vocabulary, merges, added tokens) as tokenizers' JSON: what
        from_metadata(..., backend_json=) takes back. The merges are written as "left right"
        strings, tokenizers' older form, where no merged piece contains a space (byte-level and
        SentencePiece pieces never do): tokenizers reads that form back about a fifth faster than
        pairs of strings (a 128k vocabulary: 0.13 against 0.17 s on the CPU machine), which is a
        cached load's largest tokenizer cost."""
        return merges_as_strings(self._backend.to_str())

    # -- encoding ----------------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids for text. add_bos: prepend BOS (default: the file's add_bos_token); EOS is
        appended when the file says add_eos_token. parse_special: match control tokens such as
        <|im_start|> written in the text (user-defined tokens are matched either way)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes text (str), got {type(text).__name__}")
        backend = self._backend if parse_special else self._plain()
        ids = backend.encode(text, add_special_tokens=False).ids if text else []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _plain(self) -> _HFTokenizer:
        """A copy of the backend that treats special tokens in the text as plain text."""
        with self._plain_lock:
            if self._plain_backend is None:
                plain = _HFTokenizer.from_str(self._backend.to_str())
                plain.encode_special_tokens = True
                self._plain_backend = plain
            return self._plain_backend

    # -- decoding ----------------------------------------------------------------------------------
    def _check_id(self, token_id) -> int:
        try:
            i = operator.index(token_id)
        except TypeError:
            raise TypeError(f"token ids are integers, got {type(token_id).__name__} {token_id!r:.40}") from None
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary (0..{self.vocab_size - 1})")
        return i

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text for token ids. skip_special leaves out control tokens (BOS, EOS, <|im_end|>, ...).
        Bytes that do not form valid UTF-8 come out as U+FFFD."""
        ids = [self._check_id(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i not in self._special_ids]
        text = b"".join(self._token_bytes[i] for i in ids).decode("utf-8", errors="replace")
        if self._strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def token_text(self, token_id: int) -> str:
        """The text one token stands for (a control token's own name, such as '<|im_end|>'; a byte
        token that is only part of a character shows as U+FFFD)."""
        return self._token_bytes[self._check_id(token_id)].decode("utf-8", errors="replace")

    def token_piece(self, token_id: int) -> str:
        """The token as the vocabulary spells it (e.g. 'Ġthe', '▁the', '<0x0A>')."""
        return self._tokens[self._check_id(token_id)]

    def is_special(self, token_id: int) -> bool:
        return self._check_id(token_id) in self._special_ids

    def stream_decoder(self, skip_special: bool = True, *, strip_leading_space: bool | None = None) -> "StreamDecoder":
        """An incremental decoder: push ids one by one and get the new text each time; the pieces
        join to `decode(ids, skip_special=...)`. strip_leading_space: drop one space at the start of
        the text, as decode does for a SentencePiece vocabulary (its "▁" prefix); pass False when
        the ids continue a prompt, so that "▁Paris" after "... is" keeps its space."""
        return StreamDecoder(self, skip_special, strip_leading_space=strip_leading_space)

    # -- chat --------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the model's own chat template (tokenizer.chat_template).
        Raises MetadataError when the file has no template or the template fails to render."""
        from .chat import render_chat_template

        if self.chat_template is None:
            raise MetadataError(f"{self.source or 'this model'} has no chat template (tokenizer.chat_template); "
                                "use the prompt as raw text")
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.unk_id,
                 "pad_token": self.pad_id}
        special = {name: self._tokens[i] for name, i in names.items() if i is not None}
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    source=self.source, **special)


class StreamDecoder:
    """Turns a stream of token ids into text pieces. A UTF-8 character split across tokens is held
    back until its last byte arrives, so the pieces joined equal `decode` of all ids at once."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True, *, strip_leading_space: bool | None = None):
        self._tok = tokenizer
        self._skip = skip_special
        self._strip = tokenizer._strip_leading_space if strip_leading_space is None else strip_leading_space
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._started = False  # whether any text has come out (the leading-space rule applies once)

    def push(self, token_id: int) -> str:
        """Add one token; returns the text that is now complete (possibly '')."""
        i = self._tok._check_id(token_id)
        if self._skip and i in self._tok._special_ids:
            return ""
        return self._emit(self._utf8.decode(self._tok._token_bytes[i]))

    def flush(self) -> str:
        """End of stream: bytes still held back are an incomplete character (generation stopped inside
        it, e.g. an emoji cut by max_tokens): they are dropped, not shown as U+FFFD, as llama.cpp does.
        The decoder is reset, ready for a new stream."""
        self._utf8.reset()  # only a valid-so-far prefix is ever held back; invalid bytes already became U+FFFD
        return ""

    def _emit(self, text: str) -> str:
        if text and not self._started:
            self._started = True
            if self._strip and text[0] == " ":
                text = text[1:]
        return text


# -- builders --------------------------------------------------------------------------------------
def _special_ids(types: list[int], referenced: set[int]) -> list[int]:
    """Ids matched whole in the text before the model sees it: control and unknown tokens, and the
    ones the metadata names (bos, eos, unk, pad)."""
    return sorted({i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)} | referenced)


def _guess_token_types(tokens: list[str], model: str, referenced: set[int]) -> list[int]:
    """Token types for a file without tokenizer.ggml.token_type: byte tokens by their <0xNN>
    spelling (SentencePiece), the BOS/EOS/UNK/PAD tokens as control, the rest normal."""
    types = []
    for i, t in enumerate(tokens):
        if i in referenced:
            types.append(CONTROL)
        elif model == "llama" and _BYTE_TOKEN.match(t):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    return types


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    """token -> id; a token spelled twice keeps its first id (decoding still knows both)."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    return vocab


def _build_byte_level(m: _Meta) -> _HFTokenizer:
    tokens = m.meta["tokenizer.ggml.tokens"]
    merges_raw = m.array("tokenizer.ggml.merges", -1, str, required=True)
    merges = []
    for k, line in enumerate(merges_raw):
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise m.error("tokenizer.ggml.merges",
                          f"entry #{k} is {line!r:.60}, expected two tokens separated by a space")
        merges.append((parts[0], parts[1]))
    vocab = _vocab_dict(tokens)
    pre = m.get("tokenizer.ggml.pre", str, "default")
    pre_tok, ignore_merges = _byte_level_pre_tokenizer(pre, m.source)
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges)
    except Exception as e:  # tokenizers reports a merge naming an unknown token
        raise m.error("tokenizer.ggml.merges", f"does not fit the vocabulary: {e}") from None
    backend = _HFTokenizer(bpe)
    backend.pre_tokenizer = pre_tok
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_token_bytes(tokens: list[str], types: list[int]) -> list[bytes]:
    # control and user-defined tokens are stored as their text; the rest in the byte alphabet
    return [t.encode("utf-8") if ty in (CONTROL, USER_DEFINED, UNKNOWN) else _byte_level_bytes(t)
            for t, ty in zip(tokens, types)]


def _build_sentencepiece(m: _Meta, tokens: list[str], types: list[int]) -> _HFTokenizer:
    n = len(tokens)
    scores = m.array("tokenizer.ggml.scores", n, (int, float))
    merges_raw = m.array("tokenizer.ggml.merges", -1, str)
    vocab = _vocab_dict(tokens)
    if merges_raw is not None:
        merges = [tuple(line.split(" ", 1)) for line in merges_raw]
    else:
        if scores is None:
            raise m.error("tokenizer.ggml.scores", "is missing: a 'llama' vocabulary needs scores (or merges)")
        merges = sentencepiece_merges(tokens, scores, types)
    add_space_prefix = m.get("tokenizer.ggml.add_space_prefix", bool, True)
    unk = m.token_id("tokenizer.ggml.unknown_token_id", n)
    try:
        # a character with neither a piece nor byte tokens becomes <unk> rather than vanishing
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                         unk_token=tokens[unk] if unk is not None else None)
    except Exception as e:
        raise m.error("tokenizer.ggml.merges", f"does not fit the vocabulary: {e}") from None
    backend = _HFTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPIECE_SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False)
    return backend


def _sentencepiece_token_bytes(tokens: list[str], types: list[int]) -> list[bytes]:
    token_bytes = []
    for t, ty in zip(tokens, types):
        byte = _BYTE_TOKEN.match(t) if ty == BYTE else None
        if byte:
            token_bytes.append(bytes([int(byte.group(1), 16)]))
        elif ty in (CONTROL, UNKNOWN):
            token_bytes.append(t.encode("utf-8"))
        else:
            token_bytes.append(t.replace(SPIECE_SPACE, " ").encode("utf-8"))
    return token_bytes


def merges_as_strings(backend_json: str) -> str:
    """tokenizers' JSON with a BPE model's merges as "left right" strings instead of pairs, where
    that form is unambiguous (no piece of any merge contains a space); otherwise unchanged."""
    data = json.loads(backend_json)
    model = data.get("model") or {}
    merges = model.get("merges")
    if not merges or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) and " " not in x for x in p)
                             for p in merges):
        return backend_json
    model["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(data, ensure_ascii=False)


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's scored pieces: every normal piece that is the
    concatenation of two pieces becomes a merge of those two, ranked by the piece's score (highest
    first; equal scores by token id, then by the left part's length)."""
    pieces = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (NORMAL, USER_DEFINED):
            pieces.setdefault(t, i)
    ranked = []
    for t, i in pieces.items():
        if len(t) < 2 or types[i] != NORMAL:
            continue
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in pieces and right in pieces:
                ranked.append((-float(scores[i]), i, cut, left, right))
    ranked.sort(key=lambda r: r[:3])
    return [(left, right) for *_, left, right in ranked]
