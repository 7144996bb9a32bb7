"""The llama family graph builder (Llama 2/3, SmolLM2, Mistral, and Qwen2 with attention biases).

  x = embedding(tokens)
  per layer: h = x + Wo·attention(rope(Wq·n), kv_store(rope(Wk·n)), kv_store(Wv·n)),  n = rms_norm(x)
             x = h + Wdown·(silu(Wgate·m) * Wup·m),                                      m = rms_norm(h)
  logits = Woutput·rms_norm(x)      (Woutput = token_embd when the output is tied)
"""

from __future__ import annotations

import math

from ..gguf_file import GGUFFile
from ..graph.ir import CTX, SEQ, Graph
from .config import ModelConfig

# which logits the graph returns: every position, only the last one, or one per row where each row
# is a different sequence's decode token (its own KV slot at rows base.. of the cache, its own position)
STAGES = ("all", "last", "rows")


def build_llama(cfg: ModelConfig, f: GGUFFile, logits: str = "all") -> Graph:
    if logits not in STAGES:
        raise ValueError(f"logits must be one of {STAGES}, got {logits!r}")
    g = Graph(f"{cfg.arch}-{logits}", meta={"arch": cfg.arch, "logits": logits})

    def w(name: str) -> str:
        t = f.tensors[name]
        return g.weight(name, t.shape, storage=t.type_name)

    tokens = g.input("tokens", (SEQ,), "i32")
    rows = logits == "rows"
    if rows:
        pos, base = g.input("pos", (SEQ,), "i32"), g.input("base", (SEQ,), "i32")
    else:
        start = g.input("start_pos", (), "i32")
    freqs = w("rope_freqs.weight") if cfg.has_rope_freqs else None
    rope = dict(head_dim=cfg.head_dim, rope_dim=cfg.rope_dim, theta=cfg.rope_theta,
                style=cfg.rope_style, pos_scale=cfg.rope_pos_scale)
    embd = w("token_embd.weight")
    x = g.op("embedding", embd, tokens, name="embed")
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        n = g.op("rms_norm", x, w(b + "attn_norm.weight"), name=b + "attn_norm", eps=cfg.norm_eps)
        proj = {}
        for p in "qkv":
            proj[p] = g.op("linear", n, w(b + f"attn_{p}.weight"), name=b + f"attn_{p}")
            if cfg.attn_bias:
                proj[p] = g.op("add", proj[p], w(b + f"attn_{p}.bias"), name=b + f"attn_{p}_bias")
        rope_op, at = ("rope_rows", (pos,)) if rows else ("rope", (start,))
        rope_in = lambda t: (t, *at) + ((freqs,) if freqs else ())  # noqa: E731
        q = g.op(rope_op, *rope_in(proj["q"]), name=b + "rope_q", n_heads=cfg.n_heads, **rope)
        k = g.op(rope_op, *rope_in(proj["k"]), name=b + "rope_k", n_heads=cfg.n_kv_heads, **rope)
        kc = g.state(f"cache.k.{i}", (CTX, cfg.kv_dim))
        vc = g.state(f"cache.v.{i}", (CTX, cfg.kv_dim))
        where = (base, pos) if rows else (start,)
        kc = g.op("kv_store_rows" if rows else "kv_store", kc, k, *where, name=b + "store_k")
        vc = g.op("kv_store_rows" if rows else "kv_store", vc, proj["v"], *where, name=b + "store_v")
        a = g.op("attention_rows" if rows else "attention", q, kc, vc, *where, name=b + "attn", n_heads=cfg.n_heads,
                 n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, scale=1.0 / math.sqrt(cfg.head_dim))
        o = g.op("linear", a, w(b + "attn_output.weight"), name=b + "attn_output")
        h = g.op("add", x, o, name=b + "attn_residual")
        m = g.op("rms_norm", h, w(b + "ffn_norm.weight"), name=b + "ffn_norm", eps=cfg.norm_eps)
        gate = g.op("linear", m, w(b + "ffn_gate.weight"), name=b + "ffn_gate")
        up = g.op("linear", m, w(b + "ffn_up.weight"), name=b + "ffn_up")
        act = g.op("mul", g.op("silu", gate, name=b + "ffn_silu"), up, name=b + "ffn_mul")
        down = g.op("linear", act, w(b + "ffn_down.weight"), name=b + "ffn_down")
        x = g.op("add", h, down, name=b + "ffn_residual")
    if logits == "last":
        x = g.op("last_row", x, name="last_row")
    x = g.op("rms_norm", x, w("output_norm.weight"), name="output_norm", eps=cfg.norm_eps)
    head = embd if cfg.tied_output else w("output.weight")
    out = g.op("linear", x, head, name="output", out="logits")
    g.output(out)
    g.validate()
    return g
