"""Small, deterministic tokenizer vocabularies written into synthetic GGUF files.

    w = GGUFWriter(path, "llama"); ...hyperparameters...
    n_vocab = add_bpe_vocab(w, pre="llama3")   # or add_spm_vocab(w)

Both vocabularies are learned here, in-process, from the built-in text below with a plain BPE
trainer (most frequent adjacent pair first, ties by the pair's spelling), so the same file comes
out on every run. Hugging Face transformers loads them (AutoTokenizer.from_pretrained(dir,
gguf_file=name)) when the file also has general.architecture and the model's hyperparameters.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran into the forest.
It's a truth universally acknowledged that a single man in possession of a good fortune must be in want of a wife.
We're testing the tokenizer: they'll see that it doesn't break words it shouldn't, and I'm sure you've noticed.
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
In 1969, 600000000 people watched the landing; 3.14159 and 2.71828 are constants, and 42 is the answer.
Prices rose from $1,250.00 to $13,999.99 between 2019 and 2024 (an increase of 1019.99%).
Café, naïve, résumé, façade, über, señor, déjà vu: accents appear in English text too.
Hello world! Hello again, world. Hello, hello, hello... is there anybody in there?
Numbers like 123456789 and 0987654321 and 31415926535 test how digits are grouped.
She sells sea shells by the sea shore; the shells she sells are surely sea shells.

def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


class Greeter:
    def __init__(self, name):
        self.name = name

    def greet(self):
        print(f"Hello, {self.name}!")
        return {"greeting": "hello", "name": self.name, "count": 1}


for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

int main(void) {
\tint total = 0;
\tfor (int k = 0; k < 100; k++) {
\t\ttotal += k * k;
\t}
\treturn total;
}

The model reads the prompt, and then the model writes the answer one token at a time.
Large language models run on graphics processors; the kernels are generated for each device.
What is the capital of France? The capital of France is Paris, a city on the river Seine.
"""

# Chunks learned whole, beyond GPT-2's split of the text, so that the vocabulary tells apart
# pre-tokenizers that split CamelCase or keep contractions with their word (gpt-4o, tekken)
EXTRA_BPE_WORDS = ("HelloWorld", " JavaScript", " they'll", "They'll")

BPE_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")
BPE_USER_TOKENS = ("<think>",)
BPE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPM_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% else %}{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}{% endif %}{% endfor %}"
)

# gguf TokenType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

# GPT-2's pattern for splitting text into words before merging
_GPT2_WORDS = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+""")


def _train(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training over {tuple of symbols: count}: merge the most frequent adjacent pair
    (ties: the smallest pair by spelling) until n_merges or every word is one symbol."""
    words = {tuple(w): c for w, c in words.items()}
    merges = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        best_count = max(pairs.values())
        a, b = min(p for p, c in pairs.items() if c == best_count)
        merges.append((a, b))
        merged = {}
        for w, c in words.items():
            if len(w) > 1 and a in w:
                out, i = [], 0
                while i < len(w):
                    if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                        out.append(a + b)
                        i += 2
                    else:
                        out.append(w[i])
                        i += 1
                w = tuple(out)
            merged[w] = merged.get(w, 0) + c
        words = merged
    return merges


def _byte_alphabet() -> dict[int, str]:
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@functools.lru_cache(maxsize=None)
def bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the byte-level BPE vocabulary."""
    alphabet = _byte_alphabet()
    chunks = _GPT2_WORDS.findall(CORPUS) + list(EXTRA_BPE_WORDS)
    words = Counter("".join(alphabet[b] for b in w.encode("utf-8")) for w in chunks)
    merges = _train(words, 1200)
    tokens = [alphabet[b] for b in range(256)] + [a + b for a, b in merges]
    types = [NORMAL] * len(tokens)
    tokens += list(BPE_SPECIAL_TOKENS) + list(BPE_USER_TOKENS)
    types += [CONTROL] * len(BPE_SPECIAL_TOKENS) + [USER_DEFINED] * len(BPE_USER_TOKENS)
    assert len(set(tokens)) == len(tokens) <= 2000
    return tokens, types, [f"{a} {b}" for a, b in merges]


@functools.lru_cache(maxsize=None)
def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the SentencePiece-style vocabulary: <unk>, <s>, </s>, the
    256 byte tokens, then the learned pieces best first (score -rank), then the single characters.
    Newlines and tabs have no piece of their own: they are written as byte tokens."""
    words: Counter = Counter()
    for line in CORPUS.splitlines():
        text = "\u2581" + line.replace(" ", "\u2581").replace("\t", "")
        # a run of spaces is its own piece, except the last space, which starts the next word
        words.update(tuple(w) for w in re.findall("\u2581+(?=\u2581)|\u2581[^\u2581]*|[^\u2581]+", text))
    merges = _train(words, 1000)
    pieces = [a + b for a, b in merges]
    chars = sorted({c for w in words for c in w})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + chars
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (len(pieces) + len(chars))
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces) + len(chars))]
    assert len(set(tokens)) == len(tokens) <= 2000
    return tokens, scores, types


def add_bpe_vocab(writer, *, pre: str = "llama3") -> int:
    """Write a byte-level BPE vocabulary (tokenizer.ggml.model 'gpt2') with tokenizer.ggml.pre =
    pre: 256 byte tokens, the learned merges, control tokens <|begin_of_text|> (BOS),
    <|end_of_text|> (EOS), <|im_start|>, <|im_end|> and a user-defined <think>; add_bos_token true;
    a ChatML template. Returns the vocabulary size."""
    tokens, types, merges = bpe_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    writer.add_eos_token_id(tokens.index("<|end_of_text|>"))
    writer.add_pad_token_id(tokens.index("<|end_of_text|>"))
    writer.add_add_bos_token(True)
    writer.add_chat_template(BPE_CHAT_TEMPLATE)
    return len(tokens)


def add_spm_vocab(writer) -> int:
    """Write a SentencePiece-style vocabulary (tokenizer.ggml.model 'llama'): <unk> 0, <s> 1 (BOS),
    </s> 2 (EOS), <0x00>..<0xFF>, scored pieces, token types; add_bos_token true; a Llama-2 style
    [INST] template. Returns the vocabulary size."""
    tokens, scores, types = spm_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(SPM_CHAT_TEMPLATE)
    return len(tokens)
