"""The decoder every supported family shares, built from metadata (no per-model forward code).
A family (llama.py, qwen3.py, gemma3.py, phi3.py) only sets ModelConfig fields; each block below
reads the fields that change it.

  x = embedding(tokens) (* embed_scale)
  per layer: h = x + post_norm(Wo·attention(rope(qnorm(Wq·n)), kv_store(rope(knorm(Wk·n))), kv_store(Wv·n)))
             x = h + post_norm(Wdown·(act(Wgate·m) * Wup·m))             n = rms_norm(x), m = rms_norm(h)
  logits = softcap(Woutput·rms_norm(x))      (Woutput = token_embd when the output is tied)

qnorm/knorm (per-head RMSNorm), post_norm, the sliding window, the per-layer RoPE base and the
softcap are present only where the family has them.

Tensor parallelism (ModelConfig.shard = (rank, world), Megatron's split): a rank's graph holds
its share of the heads (rows of Wq, Wk, Wv: its KV heads, their caches and the query heads that
read them) and of the MLP's hidden columns (rows of Wgate, Wup; columns of Wdown), and the
matching columns of Wo; the output and down projections' partial sums meet in an all_reduce, so
norms, residual stream, embedding and head are whole on every rank. Two all_reduces a layer.
KV heads that do not divide among the ranks are shared as evenly as they go (SmolLM2-135M's 3
over 2 ranks: 2 and 1, with 6 and 3 query heads); the MLP width must divide.
"""

from __future__ import annotations

import sympy

from ..errors import GraphError
from ..gguf_file import GGUFFile
from ..graph.ir import CTX, SEQ, Graph, col_slice, row_slice
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
        self.rank, self.world = shard_of(cfg)
        # this rank's heads (the whole model's when world is 1) and its rows of each projection
        lo, hi = share(cfg.n_kv_heads, self.rank, self.world)
        group, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
        self.heads, self.kv_heads = group * (hi - lo), hi - lo
        self.kv_dim = self.kv_heads * cfg.head_dim
        f = share(cfg.ffn_dim, self.rank, self.world)
        self.spans = {"attn_q": (group * lo * hd, group * hi * hd), "attn_k": (lo * hd, hi * hd),
                      "attn_v": (lo * hd, hi * hd), "attn_output": (group * lo * hd, group * hi * hd),
                      "ffn_gate": f, "ffn_up": f, "ffn_down": f}
        self.g = Graph(f"{cfg.arch}-{logits}", meta={"arch": cfg.arch, "logits": logits})
        if self.world > 1:
            self.g.meta["shard"] = [self.rank, self.world]
        self.tokens = self.g.input("tokens", (SEQ,), "i32")
        self.by_rows = logits == "rows"
        if self.by_rows:
            self.pos, self.base = self.g.input("pos", (SEQ,), "i32"), self.g.input("base", (SEQ,), "i32")
        else:
            self.start = self.g.input("start_pos", (), "i32")

    def w(self, name: str, part: str = "") -> str:
        """A graph weight for a stored tensor: whole, or (tensor parallelism) this rank's share of
        the projection `part` (a key of self.spans): rows of Wq/Wk/Wv/Wgate/Wup and of their biases,
        columns of Wo and Wdown."""
        t = self.f.tensors[name]
        if self.world == 1 or not part:
            return self.g.weight(name, t.shape, storage=t.type_name)
        a, b = self.spans[part]
        if part in ("attn_output", "ffn_down"):
            return self.g.weight(name, (t.shape[0], b - a), storage=t.type_name, source=col_slice(name, a, b))
        return self.g.weight(name, (b - a,) + tuple(t.shape[1:]), storage=t.type_name, source=row_slice(name, a, b))

    def rows(self, name: str, prefix: str, parts: dict[str, int]) -> dict[str, str]:
        """Graph weights prefix+part+'.weight' for consecutive row blocks of one stored tensor
        (fused q|k|v, gate|up): each reads its rows of the file's tensor (GGUFFile.tensor), so the
        graph is the one an unfused file gives and the fusion passes apply unchanged. parts: each
        part's rows in the file; a tensor-parallel rank reads its share of each (self.spans)."""
        t = self.f.tensors[name]
        out, at = {}, 0
        for part, n in parts.items():
            a, b = self.spans[part]  # (0, n) when alone
            out[part] = self.g.weight(f"{prefix}{part}.weight", (b - a,) + tuple(t.shape[1:]), storage=t.type_name,
                                      source=row_slice(name, at + a, at + b))
            at += n
        if at != t.shape[0]:
            raise ValueError(f"tensor '{name}' has {t.shape[0]} rows, the parts {parts} {at}")
        return out

    def all_reduce(self, x: str, name: str) -> str:
        """The sum over the tensor-parallel ranks of each one's partial product (none when alone)."""
        return self.g.op("all_reduce", x, name=name) if self.world > 1 else x

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
            ws = {f"attn_{p}": self.w(b + f"attn_{p}.weight", f"attn_{p}") for p in "qkv"}
        proj = {}
        for p in "qkv":
            proj[p] = g.op("linear", n, ws[f"attn_{p}"], name=b + f"attn_{p}")
            if cfg.attn_bias:
                proj[p] = g.op("add", proj[p], self.w(b + f"attn_{p}.bias", f"attn_{p}"), name=b + f"attn_{p}_bias")
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
        q = g.op(rope_kind, proj["q"], *at, *extra, name=b + "rope_q", n_heads=self.heads, **rope)
        k = g.op(rope_kind, proj["k"], *at, *extra, name=b + "rope_k", n_heads=self.kv_heads, **rope)
        # a sliding-window layer's cache is a ring of ModelConfig.kv_rows rows (when the programs'
        # largest chunk is known): position p in row p mod rows, the attention reading it the same way
        ring = bool(window and self.kv_chunk)
        rows = sympy.Min(CTX, window + self.kv_chunk - 1) if ring else CTX
        kc = g.state(f"cache.k.{i}", (rows, self.kv_dim))
        vc = g.state(f"cache.v.{i}", (rows, self.kv_dim))
        store = {"ring": True} if ring else {}
        kc = g.op("kv_store" + suffix, kc, k, *where, name=b + "store_k", **store)
        vc = g.op("kv_store" + suffix, vc, proj["v"], *where, name=b + "store_v", **store)
        attrs = dict(n_heads=self.heads, n_kv_heads=self.kv_heads, head_dim=cfg.head_dim, scale=cfg.softmax_scale)
        if window:
            attrs["window"] = window
        a = g.op("attention" + suffix, q, kc, vc, *where, name=b + "attn", **attrs)
        o = g.op("linear", a, self.w(b + "attn_output.weight", "attn_output"), name=b + "attn_output")
        return self.all_reduce(o, b + "attn_output_sum")

    def mlp(self, i: int, m: str) -> str:
        cfg, g, b = self.cfg, self.g, f"blk.{i}."
        if cfg.fused_gate_up:
            ws = self.rows(b + "ffn_up.weight", b, {"ffn_gate": cfg.ffn_dim, "ffn_up": cfg.ffn_dim})
            wg, wu = ws["ffn_gate"], ws["ffn_up"]
        else:
            wg, wu = self.w(b + "ffn_gate.weight", "ffn_gate"), self.w(b + "ffn_up.weight", "ffn_up")
        gate = g.op("linear", m, wg, name=b + "ffn_gate")
        up = g.op("linear", m, wu, name=b + "ffn_up")
        act_kind = {"silu": "silu", "gelu_tanh": "gelu"}[cfg.mlp_act]
        act_attrs = {"approximate": "tanh"} if act_kind == "gelu" else {}
        act = g.op("mul", g.op(act_kind, gate, name=b + f"ffn_{act_kind}", **act_attrs), up, name=b + "ffn_mul")
        down = g.op("linear", act, self.w(b + "ffn_down.weight", "ffn_down"), name=b + "ffn_down")
        return self.all_reduce(down, b + "ffn_down_sum")

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

    def head(self, embd: str) -> tuple[str, bool]:
        """The output projection's weight, and whether it is this rank's share of the vocabulary
        (tensor parallelism: rows of the head, the logits gathered after it; where the vocabulary
        divides among the ranks), which halves the largest matrix a decode step reads."""
        src = "token_embd.weight" if self.cfg.tied_output else "output.weight"
        t = self.f.tensors[src]
        if self.world == 1 or t.shape[0] % self.world:
            return (embd if self.cfg.tied_output else self.w(src)), False
        n = t.shape[0] // self.world
        a = self.rank * n
        return self.g.weight("output.weight", (n, t.shape[1]), storage=t.type_name, source=row_slice(src, a, a + n)), True

    def build(self) -> Graph:
        cfg, g = self.cfg, self.g
        rope_freqs = self.w(cfg.rope_factor_tensor) if cfg.rope_factor_tensor else None
        embd, x = self.embed()
        for i in range(cfg.n_layers):
            x = self.layer(i, x, rope_freqs)
        if g.meta["logits"] == "last":
            x = g.op("last_row", x, name="last_row")
        x = self.norm(x, "output_norm.weight", "output_norm")
        head, gather = self.head(embd)
        steps = [("linear", (x, head), "output", {})]
        if cfg.logit_softcap:
            steps.append(("softcap", (), "logit_softcap", {"cap": cfg.logit_softcap}))
        if gather:
            steps.append(("all_gather", (), "output_gather", {"world": self.world}))
        y = None
        for k, (kind, ins, name, attrs) in enumerate(steps):
            last = {"out": "logits"} if k == len(steps) - 1 else {}
            y = g.op(kind, *(ins or (y,)), name=name, **attrs, **last)
        g.output(y)
        g.validate()
        return g


def shard_of(cfg: ModelConfig) -> tuple[int, int]:
    """(rank, world) of the config's tensor parallelism, checked: every rank gets a KV head (the
    KV heads are shared as evenly as they go, each with its query heads) and the MLP width divides
    among the ranks (column blocks of the stored formats are checked where the file's tensor is
    cut, GGUFFile.tensor)."""
    rank, world = cfg.shard
    if world < 1 or not 0 <= rank < world:
        raise GraphError(f"tensor parallel shard {cfg.shard}: expected (rank, world) with 0 <= rank < world")
    name = cfg.name or cfg.arch
    if world > 1 and cfg.n_heads % cfg.n_kv_heads:
        raise GraphError(f"{name}: tensor parallelism needs the attention heads ({cfg.n_heads}) to be a multiple "
                         f"of the KV heads ({cfg.n_kv_heads})")
    if cfg.n_kv_heads < world:
        raise GraphError(f"{name}: tensor parallelism over {world} ranks needs a KV head for each rank "
                         f"(the model has {cfg.n_kv_heads})")
    if cfg.ffn_dim % world:
        raise GraphError(f"{name}: tensor parallelism over {world} ranks needs the MLP width ({cfg.ffn_dim}) "
                         "to divide among them")
    return rank, world


def share(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's share [lo, hi) of n units split as evenly as they go (the first n % world ranks one
    more)."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


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
