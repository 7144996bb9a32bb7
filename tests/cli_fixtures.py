"""Small model files for command-line tests (fast to write, fast to load) and a runner for
`python -m edgellm ...` in a child process with this checkout's edgellm first on the path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

# A llama model of 2 layers with a byte-level vocabulary: loads in well under a second.
TINY = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, context_length=1024)


# ChatML, as the default model's template (without its default system prompt)
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_gguf(path: Path, weight_type: str = "F32", chat_template: str | None = None, **kw) -> Path:
    from edgellm.synthetic import SyntheticSpec, byte_bpe_vocab, write_synthetic_gguf

    spec = SyntheticSpec(**{**TINY, "weight_type": weight_type, "embed_type": "F32", **kw})
    vocab = byte_bpe_vocab(512)

    def tokenizer(writer) -> int:
        n = vocab(writer)
        if chat_template:
            writer.add_chat_template(chat_template)
        return n

    return write_synthetic_gguf(path, spec, tokenizer=tokenizer)


def hf_folder(path: Path, vocab: int = 320, seed: int = 0) -> Path:
    """A Hugging Face llama folder (config.json + model.safetensors) written with safetensors itself."""
    from safetensors.numpy import save_file

    d, ffn, heads, kv, layers = 64, 128, 4, 2, 2
    hd = d // heads
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (0.05 * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, d), "model.norm.weight": 1 + w(d), "lm_head.weight": w(vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * hd, d), p + "self_attn.k_proj.weight": w(kv * hd, d),
            p + "self_attn.v_proj.weight": w(kv * hd, d), p + "self_attn.o_proj.weight": w(d, heads * hd),
            p + "mlp.gate_proj.weight": w(ffn, d), p + "mlp.up_proj.weight": w(ffn, d),
            p + "mlp.down_proj.weight": w(d, ffn), p + "input_layernorm.weight": 1 + w(d),
            p + "post_attention_layernorm.weight": 1 + w(d)})
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d, "intermediate_size": ffn,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "float32"}))
    return path


def child_env(*front: str | os.PathLike, **extra: str) -> dict:
    """The environment of a child edgellm: `front` folders, then this checkout, then PYTHONPATH."""
    env = dict(os.environ)
    parts = [str(p) for p in front] + [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(extra)
    return env


def edgellm(*args: str, cwd=None, input: str | None = None, env: dict | None = None, timeout: float = 120):
    """`python -m edgellm ARGS` in a child process; returns the CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-m", "edgellm", *args], capture_output=True, text=True, cwd=cwd,
                          input=input, env=env or child_env(), timeout=timeout,
                          stdin=None if input is not None else subprocess.DEVNULL)


def hide_modules(folder: Path, *names: str) -> Path:
    """A folder whose sitecustomize makes `import NAME` fail (and find_spec(NAME) return None) in a
    child process that has it on PYTHONPATH: a machine without those packages."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{n!r}] = None\n" for n in names))
    return folder
