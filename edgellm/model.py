"""The public API: load a model, get logits, generate text.

    m = edgellm.load()                       # the embedded default model, cpu backend
    for piece in m.generate("Hello", max_tokens=32, temperature=0):
        print(piece, end="")
    m.logits(m.tokenizer.encode("Hello"))    # float32 [n_tokens, vocab]
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .backends import get_backend
from .compiler.compile import compile_graph
from .default_model import default_model_path
from .errors import ContextOverflowError, EdgeLLMError, MetadataError
from .gguf_file import open_gguf
from .models import build_graph, config_from_gguf
from .sampling import Sampler, SamplingParams
from .session import KVSlot, TextStream, check_messages
from .tokenizer import Tokenizer


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V were already in the cache (a common prefix)
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = ""

    @property
    def prefill_tps(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # the first generated token comes from the prefill; decode steps produce the rest
        n = max(self.generated_tokens - 1, 0)
        return n / self.decode_s if self.decode_s else 0.0

    def summary(self) -> str:
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (f"prompt {self.prompt_tokens} tok{cached}, {self.prefill_tps:.1f} tok/s | "
                f"generated {self.generated_tokens} tok, {self.decode_tps:.1f} tok/s | stop: {self.stop_reason}")


@dataclass
class Model:
    path: str
    backend_name: str
    ctx: int
    file: object = field(repr=False)
    config: object = field(repr=False)
    tokenizer: Tokenizer | None = field(repr=False)
    load_s: float = 0.0
    last_stats: GenerationStats | None = None
    fuse: bool = True
    prefill_chunk: int = 512

    def __post_init__(self):
        backend_cls = get_backend(self.backend_name)
        self.backend = backend_cls(self.file)
        self.graphs = {stage: build_graph(self.config, self.file, stage) for stage in ("all", "last")}
        self.states = self.backend.allocate_states(self.graphs["last"], self.ctx)
        chunk = min(self.prefill_chunk, self.ctx)
        # stage-aware programs: prefill chunks (all / last logits) and single-token decode
        stages = {"all": ("all", chunk), "last": ("last", chunk), "decode": ("last", 1)}
        self.compiled = {
            name: compile_graph(self.graphs[g], supported_ops=getattr(self.backend, "SUPPORTED_OPS", None),
                                backend=self.backend.name, seq=seq, ctx=self.ctx, fuse=self.fuse)
            for name, (g, seq) in stages.items()
        }
        self.programs = {name: self.backend.compile(c.graph, self.states, c.plan, max_seq=c.sizes["seq"])
                         for name, c in self.compiled.items()}

    # -- forward --------------------------------------------------------------------------------
    # -- KV slots (edgellm.session) ---------------------------------------------------------------
    @property
    def default_slot(self) -> KVSlot:
        """The KV cache allocated at load, as a slot: forward, generate and chat run on it."""
        if getattr(self, "_default_slot", None) is None:
            self._default_slot = KVSlot(self.states, self.programs)
        return self._default_slot

    def bind_programs(self, states: dict) -> tuple[dict, dict]:
        """(states, the stage programs bound to them): the compiled graphs run on another KV cache
        (edgellm.session.SlotPool makes slots this way; compiled graphs and memory plans are shared)."""
        return states, {name: self.backend.compile(c.graph, states, c.plan, max_seq=c.sizes["seq"])
                        for name, c in self.compiled.items()}

    def forward(self, token_ids, start_pos: int, *, all_logits: bool, slot: KVSlot | None = None) -> np.ndarray:
        """Run tokens at positions start_pos.. against a KV cache (default: the model's own slot);
        returns float32 logits ([n, vocab] with all_logits, else [1, vocab] for the last token)."""
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        if ids.size == 0:
            raise EdgeLLMError("no tokens to run: the token list is empty")
        if start_pos + ids.size > self.ctx:
            raise ContextOverflowError(
                f"{start_pos + ids.size} tokens do not fit in the context of {self.ctx} (raise --ctx; "
                f"the model was trained with {self.config.context_length})"
            )
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            raise EdgeLLMError(f"token id {int(ids[bad][0])} is outside the vocabulary [0, {self.config.vocab_size})")
        slot = slot if slot is not None else self.default_slot
        programs = slot.programs
        # rows from start_pos on are about to change: until the run completes, trust only those before
        del slot.tokens[start_pos:]
        known = len(slot.tokens) == start_pos
        out = self._run_programs(programs, ids, start_pos, all_logits)
        if known:
            slot.tokens.extend(int(t) for t in ids)
        return out

    def _run_programs(self, programs: dict, ids: np.ndarray, start_pos: int, all_logits: bool) -> np.ndarray:
        if ids.size == 1 and not all_logits:
            out = programs["decode"].run({"tokens": ids, "start_pos": int(start_pos)})
            return self.backend.to_numpy(out["logits"])
        chunk = self.compiled["all"].sizes["seq"]
        parts = []
        for i in range(0, ids.size, chunk):
            last_chunk = i + chunk >= ids.size
            if not all_logits and not last_chunk:
                # earlier chunks only fill the KV cache; the last-logits program keeps that cheap
                programs["last"].run({"tokens": ids[i:i + chunk], "start_pos": int(start_pos + i)})
                continue
            prog = programs["all" if all_logits else "last"]
            out = prog.run({"tokens": ids[i:i + chunk], "start_pos": int(start_pos + i)})
            parts.append(self.backend.to_numpy(out["logits"]))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def logits(self, token_ids) -> np.ndarray:
        """Next-token logits for every position of token_ids (from an empty cache): float32 [n, vocab]."""
        return self.forward(token_ids, 0, all_logits=True)

    # -- generation -----------------------------------------------------------------------------
    def prompt_tokens(self, prompt: str, *, chat: bool | None = None, system: str | None = None) -> list[int]:
        """Token ids for a prompt; with chat (default: when the model has a chat template) the prompt
        is the user's message, rendered through the model's own template."""
        tok = self.tokenizer
        if tok is None:
            raise MetadataError(f"{os.path.basename(self.path)} has no vocabulary (tokenizer.ggml.model = 'none'); "
                                "pass token ids instead of text")
        use_chat = tok.chat_template is not None if chat is None else chat
        if use_chat:
            if tok.chat_template is None:
                raise MetadataError(f"{os.path.basename(self.path)} has no chat template; use raw mode")
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            return self.chat_tokens(messages)
        return tok.encode(prompt)

    def chat_tokens(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation [{'role': ..., 'content': ...}, ...] rendered through the
        model's chat template (with the assistant's turn opened by default)."""
        tok = self.tokenizer
        if tok is None or tok.chat_template is None:
            raise MetadataError(f"{os.path.basename(self.path)} has no chat template; a messages list needs one")
        text = tok.apply_chat_template(check_messages(messages), add_generation_prompt=add_generation_prompt)
        ids = tok.encode(text, add_bos=False)
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids = [tok.bos_id] + ids
        return ids

    def generate(self, prompt: str | list[int], max_tokens: int = 256, *, chat: bool | None = None,
                 system: str | None = None, stop: list[str] | tuple[str, ...] = (), **sampling) -> Iterator[str]:
        """Stream the continuation of prompt as text pieces. Sampling keywords: temperature, top_k,
        top_p, min_p, repetition_penalty, repeat_last_n, seed (see SamplingParams). Stops at an
        end-of-generation token, at any of `stop` (not included in the output), or after max_tokens."""
        params = SamplingParams(**sampling)
        if max_tokens < 0:
            raise EdgeLLMError(f"max_tokens must be >= 0, got {max_tokens}")
        ids = list(prompt) if isinstance(prompt, (list, tuple)) else self.prompt_tokens(prompt, chat=chat, system=system)
        if len(ids) >= self.ctx:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens, which does not fit in the context of {self.ctx} "
                f"(leave room for at least one generated token; raise --ctx up to the model's {self.config.context_length})"
            )
        stats = GenerationStats(prompt_tokens=len(ids))
        self.last_stats = stats
        return self._generate(ids, max_tokens, params, tuple(s for s in stop if s), stats)

    def chat(self, messages: list[dict], max_tokens: int = 256, *, stop: list[str] | tuple[str, ...] = (),
             slot: KVSlot | None = None, **sampling) -> Iterator[str]:
        """Stream the assistant's answer to a conversation [{'role': ..., 'content': ...}, ...],
        rendered through the model's chat template. The KV cache keeps the tokens of earlier calls:
        only the tokens after the longest common prefix with them are prefilled (a second turn reads
        just the new message). Sampling keywords and stop as for generate; stats in last_stats."""
        params = SamplingParams(**sampling)
        if max_tokens < 0:
            raise EdgeLLMError(f"max_tokens must be >= 0, got {max_tokens}")
        ids = self.chat_tokens(messages)
        if len(ids) >= self.ctx:
            raise ContextOverflowError(
                f"the conversation has {len(ids)} tokens, which does not fit in the context of {self.ctx} "
                f"(leave room for at least one generated token; raise --ctx up to the model's {self.config.context_length})"
            )
        stats = GenerationStats(prompt_tokens=len(ids))
        self.last_stats = stats
        return self._generate(ids, max_tokens, params, tuple(s for s in stop if s), stats,
                              slot=slot, reuse_prefix=True)

    def generate_tokens(self, ids: list[int], max_tokens: int, params: SamplingParams | None = None,
                        stats: GenerationStats | None = None, *, slot: KVSlot | None = None,
                        reuse_prefix: bool = False) -> Iterator[int]:
        """Stream sampled token ids after the prompt ids (prefill, then one decode step per token);
        stops at an end-of-generation token (not yielded), a full context, or max_tokens.
        slot: the KV cache to run on (default: the model's own); reuse_prefix: skip the prompt's
        longest common prefix with what that cache already holds (stats.cached_tokens)."""
        sampler = Sampler(params or SamplingParams())
        stats = stats if stats is not None else GenerationStats(prompt_tokens=len(ids))
        stop_ids = self.tokenizer.stop_ids if self.tokenizer is not None else frozenset()
        slot = slot if slot is not None else self.default_slot
        history = list(ids)
        pos = slot.reusable_prefix(history) if reuse_prefix else 0
        step_in = history[pos:]
        stats.cached_tokens = pos
        stats.stop_reason = "max_tokens"
        for step in range(max_tokens):
            if pos + len(step_in) > self.ctx:
                stats.stop_reason = "context full"
                return
            t0 = time.perf_counter()
            logits = self.forward(step_in, pos, all_logits=False, slot=slot)[-1]
            dt = time.perf_counter() - t0
            if step == 0:
                stats.prefill_s += dt
            else:
                stats.decode_s += dt
            pos += len(step_in)
            token = sampler(logits, history)
            stats.generated_tokens += 1
            if token in stop_ids:
                stats.stop_reason = "eos"
                return
            history.append(token)
            step_in = [token]
            yield token
            # the device loop writes rows from pos on without the slot's record: it stays a true prefix
            device_greedy = getattr(slot.programs["decode"], "greedy_tokens", None)
            if step == 0 and device_greedy is not None and sampler.params.greedy and \
                    sampler.params.repetition_penalty == 1.0:
                # greedy on a backend that can loop on the device: no logits leave it
                n = min(max_tokens - 1, self.ctx - pos)
                t0 = time.perf_counter()
                for token in device_greedy(step_in[0], pos, n):
                    stats.generated_tokens += 1
                    if token in stop_ids:
                        stats.stop_reason = "eos"
                        break
                    yield token
                stats.decode_s += time.perf_counter() - t0
                if stats.stop_reason != "eos":
                    stats.stop_reason = "max_tokens" if n == max_tokens - 1 else "context full"
                return

    def _generate(self, ids, max_tokens, params, stops, stats, **where) -> Iterator[str]:
        text = TextStream(self.tokenizer, stops)
        for token in self.generate_tokens(ids, max_tokens, params, stats, **where):
            piece = text.push(token)
            if piece:
                yield piece
            if text.stopped:
                stats.stop_reason = "stop string"
                return
        piece = text.flush()
        if piece:
            yield piece


def load(path: str | os.PathLike | None = None, backend: str = "cpu", ctx: int | None = None, *,
         fuse: bool = True, prefill_chunk: int = 512) -> Model:
    """Load a GGUF model (default: the embedded SmolLM2-135M-Instruct Q4_1) on a backend.
    ctx: the KV-cache capacity in tokens (default: min(model's context, 4096)).
    fuse: run the fusion passes (off: the builder's graph as is, for checking the passes).
    prefill_chunk: prompts are processed in chunks of at most this many tokens; intermediate
    memory is planned for one chunk."""
    t0 = time.perf_counter()
    path = str(path) if path is not None else str(default_model_path())
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    # vocabulary-less files (tokenizer.ggml.model = 'none', as llama.cpp's benchmark models) run from token ids
    has_vocab = f.get("tokenizer.ggml.model", "none") != "none"
    tok = Tokenizer.from_metadata(f.metadata, source=os.path.basename(path)) if has_vocab else None
    if ctx is None:
        ctx = min(cfg.context_length, 4096)
    if not isinstance(ctx, int) or ctx <= 0:
        raise EdgeLLMError(f"ctx must be a positive number of tokens, got {ctx!r}")
    if not isinstance(prefill_chunk, int) or prefill_chunk <= 0:
        raise EdgeLLMError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk!r}")
    m = Model(path=path, backend_name=backend, ctx=ctx, file=f, config=cfg, tokenizer=tok, fuse=fuse,
              prefill_chunk=prefill_chunk)
    m.load_s = time.perf_counter() - t0
    return m
