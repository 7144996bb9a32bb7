"""The decoder every supported family shares, built from metadata (no per-model forward code).
A family (llama.py, qwen3.py, gemma3.py, phi3.py) only sets ModelConfig fields; each block below
reads the fields that change it.

  x = embedding(tokens) (* embed_scale)
  per layer: h = x + post_norm(Wo·attention(rope(qnorm(Wq·n)), kv_store(rope(knorm(Wk·n))), kv_store(Wv·n)))
             x = h + post_norm(Wdown·(act(Wgate·m) * Wup·m))             n = rms_norm(x), m = rms_norm(h)
  logits = softcap(Woutput·rms_norm(x))      (Woutput = token_embd when the output is tied)

qnorm/knorm (per-head RMSNorm), post_norm, the sliding window, the per-layer RoPE base and the
softcap are present only where the family has them.
"""

from __future__ import annotations

import sympy

from ..errors import GraphError
from ..gguf_file import GGUFFile
from ..graph.ir import CTX, SEQ, Graph, row_slice
from .config import ModelConfig

# which logits the graph returns: every position, only the last one, or one per row where each row
# is a different sequence's decode token (its own KV slot at rows base.. of the cache, its own
# position: the batched decode step of edgellm.session.SlotPool)
STAGES = ("all", "last", "rows")


class Builder:
    """A Graph under construction for one model file: weights by name, the shared blocks."""

    def __init__(self, cfg: ModelConfig, f: GGUFFile, logits: str, kv_chunk: int | None = None):
        if logits not in STAGES:
            raise ValueError(f"logits must be one of {STAGES}, got {logits!r}")
        if kv_chunk is not None and (isinstance(kv_chunk, bool) or not isinstance(kv_chunk, int) or kv_chunk < 1):
            raise ValueError(f"kv_chunk must be a positive number of tokens, got {kv_chunk!r}")
        self.cfg, self.f, self.kv_chunk = cfg, f, kv_chunk
        self.g = Graph(f"{cfg.arch}-{logits}", meta={"arch": cfg.arch, "logits": logits})
        self.tokens = self.g.input("tokens", (SEQ,), "i32")
        self.by_rows = logits == "rows"
        if self.by_rows:
            self.pos, self.base = self.g.input("pos", (SEQ,), "i32"), self.g.input("base", (SEQ,), "i32")
        else:
            self.start = self.g.input("start_pos", (), "i32")

    def w(self, name: str) -> str:
        t = self.f.tensors[name]
        return self.g.weight(name, t.shape, storage=t.type_name)

    def rows(self, name: str, prefix: str, parts: dict[str, int]) -> dict[str, str]:
        """Graph weights prefix+part+'.weight' for consecutive row blocks of one stored tensor
        (fused q|k|v, gate|up): each reads its rows of the file's tensor (GGUFFile.tensor), so the
        graph is the one an unfused file gives and the fusion passes apply unchanged."""
        t = self.f.tensors[name]
        out, at = {}, 0
        for part, n in parts.items():
            out[part] = self.g.weight(f"{prefix}{part}.weight", (n,) + tuple(t.shape[1:]), storage=t.type_name,
                                      source=row_slice(name, at, at + n))
            at += n
        if at != t.shape[0]:
            raise ValueError(f"tensor '{name}' has {t.shape[0]} rows, the parts {parts} {at}")
        return out

    def norm(self, x: str, weight: str, name: str) -> str:
        return self.g.op("rms_norm", x, self.w(weight), name=name, eps=self.cfg.norm_eps)

    # -- the blocks ----------------------------------------------------------------------------
    def embed(self) -> tuple[str, str]:
        embd = self.w("token_embd.weight")
        x = self.g.op("embedding", embd, self.tokens, name="embed")
        if self.cfg.embed_scale != 1.0:
            x = self.g.op("scale", x, name="embed_scale", factor=self.cfg.embed_scale)
        return embd, x

    def attention(self, i: int, n: str, rope_freqs: str | None) -> str:
        cfg, g, b = self.cfg, self.g, f"blk.{i}."
        if cfg.fused_qkv:
            ws = self.rows(b + "attn_qkv.weight", b, {"attn_q": cfg.q_dim, "attn_k": cfg.kv_dim, "attn_v": cfg.kv_dim})
        else:
            ws = {f"attn_{p}": self.w(b + f"attn_{p}.weight") for p in "qkv"}
        proj = {}
        for p in "qkv":
            proj[p] = g.op("linear", n, ws[f"attn_{p}"], name=b + f"attn_{p}")
            if cfg.attn_bias:
                proj[p] = g.op("add", proj[p], self.w(b + f"attn_{p}.bias"), name=b + f"attn_{p}_bias")
        if cfg.qk_norm:  # per head: the weight has head_dim entries
            for p in "qk":
                proj[p] = self.norm(proj[p], b + f"attn_{p}_norm.weight", b + f"attn_{p}_norm")
        window = cfg.window(i)
        theta = cfg.rope_theta_local if window and cfg.rope_theta_local else cfg.rope_theta
        rope = dict(head_dim=cfg.head_dim, rope_dim=cfg.rope_dim, theta=theta, style=cfg.rope_style,
                    pos_scale=1.0 if window and cfg.rope_theta_local else cfg.rope_pos_scale)
        if cfg.rope_mscale != 1.0:
            rope["mscale"] = cfg.rope_mscale
        extra = (rope_freqs,) if rope_freqs else ()
        if self.by_rows:  # each row its own sequence: its own position, its own KV slot
            why = rows_stage_unsupported(cfg)
            if why:
                raise GraphError(f"{cfg.arch}: batched decode of {why} is not supported yet (serve it with --parallel 1)")
            rope_kind, at, where, suffix = "rope_rows", (self.pos,), (self.base, self.pos), "_rows"
        else:
            rope_kind, at, where, suffix = "rope", (self.start,), (self.start,), ""
        q = g.op(rope_kind, proj["q"], *at, *extra, name=b + "rope_q", n_heads=cfg.n_heads, **rope)
        k = g.op(rope_kind, proj["k"], *at, *extra, name=b + "rope_k", n_heads=cfg.n_kv_heads, **rope)
        # a sliding-window layer's cache is a ring of ModelConfig.kv_rows rows (when the programs'
        # largest chunk is known): position p in row p mod rows, the attention reading it the same way
        ring = bool(window and self.kv_chunk)
        rows = sympy.Min(CTX, window + self.kv_chunk - 1) if ring else CTX
        kc = g.state(f"cache.k.{i}", (rows, cfg.kv_dim))
        vc = g.state(f"cache.v.{i}", (rows, cfg.kv_dim))
        store = {"ring": True} if ring else {}
        kc = g.op("kv_store" + suffix, kc, k, *where, name=b + "store_k", **store)
        vc = g.op("kv_store" + suffix, vc, proj["v"], *where, name=b + "store_v", **store)
        attrs = dict(n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, scale=cfg.softmax_scale)
        if window:
            attrs["window"] = window
        a = g.op("attention" + suffix, q, kc, vc, *where, name=b + "attn", **attrs)
        return g.op("linear", a, self.w(b + "attn_output.weight"), name=b + "attn_output")

    def mlp(self, i: int, m: str) -> str:
        cfg, g, b = self.cfg, self.g, f"blk.{i}."
        if cfg.fused_gate_up:
            ws = self.rows(b + "ffn_up.weight", b, {"ffn_gate": cfg.ffn_dim, "ffn_up": cfg.ffn_dim})
            wg, wu = ws["ffn_gate"], ws["ffn_up"]
        else:
            wg, wu = self.w(b + "ffn_gate.weight"), self.w(b + "ffn_up.weight")
        gate = g.op("linear", m, wg, name=b + "ffn_gate")
        up = g.op("linear", m, wu, name=b + "ffn_up")
        act_kind = {"silu": "silu", "gelu_tanh": "gelu"}[cfg.mlp_act]
        act_attrs = {"approximate": "tanh"} if act_kind == "gelu" else {}
        act = g.op("mul", g.op(act_kind, gate, name=b + f"ffn_{act_kind}", **act_attrs), up, name=b + "ffn_mul")
        return g.op("linear", act, self.w(b + "ffn_down.weight"), name=b + "ffn_down")

    def layer(self, i: int, x: str, rope_freqs: str | None) -> str:
        cfg, g, b = self.cfg, self.g, f"blk.{i}."
        o = self.attention(i, self.norm(x, b + "attn_norm.weight", b + "attn_norm"), rope_freqs)
        if cfg.post_norms:
            o = self.norm(o, b + "post_attention_norm.weight", b + "post_attn_norm")
        h = g.op("add", x, o, name=b + "attn_residual")
        down = self.mlp(i, self.norm(h, b + "ffn_norm.weight", b + "ffn_norm"))
        if cfg.post_norms:
            down = self.norm(down, b + "post_ffw_norm.weight", b + "post_ffw_norm")
        return g.op("add", h, down, name=b + "ffn_residual")

    def build(self) -> Graph:
        cfg, g = self.cfg, self.g
        rope_freqs = self.w(cfg.rope_factor_tensor) if cfg.rope_factor_tensor else None
        embd, x = self.embed()
        for i in range(cfg.n_layers):
            x = self.layer(i, x, rope_freqs)
        if g.meta["logits"] == "last":
            x = g.op("last_row", x, name="last_row")
        x = self.norm(x, "output_norm.weight", "output_norm")
        head = embd if cfg.tied_output else self.w("output.weight")
        if cfg.logit_softcap:
            out = g.op("softcap", g.op("linear", x, head, name="output"), name="logit_softcap", out="logits",
                       cap=cfg.logit_softcap)
        else:
            out = g.op("linear", x, head, name="output", out="logits")
        g.output(out)
        g.validate()
        return g


def rows_stage_unsupported(cfg: ModelConfig) -> str:
    """Why the 'rows' stage (one decode step of several sequences) cannot be built for this model,
    or '' when it can. Sliding-window layers would need the row-wise ops to read each slot's ring
    (slot s's rows of a ring layer: s*rows .. s*rows + rows - 1, position p at row p mod rows);
    scaled RoPE, the attention factor in rope_rows."""
    if any(cfg.window(i) for i in range(cfg.n_layers)):
        return "sliding-window layers"
    if cfg.rope_mscale != 1.0:
        return "scaled-RoPE layers"
    return ""


def build_decoder(cfg: ModelConfig, f: GGUFFile, logits: str = "all", kv_chunk: int | None = None) -> Graph:
    """kv_chunk: the most tokens one program of the model writes into the cache at once (its
    prefill chunk); given, sliding-window layers get ring caches (ModelConfig.kv_rows)."""
    return Builder(cfg, f, logits, kv_chunk).build()
