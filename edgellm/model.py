"""The public API: load a model, get logits, generate text.

    m = edgellm.load()                       # the embedded default model, cpu backend
    for piece in m.generate("Hello", max_tokens=32, temperature=0):
        print(piece, end="")
    m.logits(m.tokenizer.encode("Hello"))    # float32 [n_tokens, vocab]
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np

from .backends import get_backend
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
    # one-time work met on the way (kernel compiles, CUDA graph captures of a new shape): timed
    # apart, so that prefill_s and decode_s are the speeds a warm engine runs at
    compile_s: float = 0.0
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
        once = f" | first-run compile {self.compile_s:.2f} s" if self.compile_s >= 0.0005 else ""
        return (f"prompt {self.prompt_tokens} tok{cached}, {self.prefill_tps:.1f} tok/s | "
                f"generated {self.generated_tokens} tok, {self.decode_tps:.1f} tok/s{once} | stop: {self.stop_reason}")


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
    program_cache: object = field(default=None, repr=False)  # edgellm.cache.ProgramCache, or None
    fingerprint: str | None = None  # the model file's content fingerprint (the cache key's part)
    load_phases: dict = field(default_factory=dict)  # seconds per phase of load()
    cache_hits: list = field(default_factory=list)  # artifacts load() read from the program cache
    first_sampling: SamplingParams | None = field(default=None, repr=False)  # the first requests' (load's sampling)

    def __post_init__(self):
        t0 = time.perf_counter()
        # a backend name, or a factory f(file) -> backend (edgellm.hetero.executor's split backend)
        backend_cls = self.backend_name if callable(self.backend_name) else get_backend(self.backend_name)
        self.backend = backend_cls(self.file)
        self.backend_name = getattr(self.backend, "name", str(self.backend_name))
        t1 = time.perf_counter()
        chunk = min(self.prefill_chunk, self.ctx)
        # stage-aware programs: prefill chunks (all / last logits) and single-token decode; the
        # all-logits program takes fewer rows where the backend bounds an output's size (webgpu: a
        # chunk's logits in one storage binding, 128 MiB on many adapters: 261 rows of a 128k vocabulary)
        cap = getattr(self.backend, "max_logit_rows", None)
        self.all_chunk = max(1, min(chunk, cap(self.config.vocab_size))) if cap is not None else chunk
        stages = {"all": ("all", self.all_chunk), "last": ("last", chunk), "decode": ("last", 1)}
        self.compiled = self._compile_stages(stages)
        t2 = time.perf_counter()
        # backends that repack weights at load keep the packs in the program cache
        # (not for a tensor-parallel rank: its packs are its share, and every rank would write one entry)
        weight_cache = (self.program_cache is not None and hasattr(self.backend, "load_weight_cache")
                        and self.config.shard[1] == 1)
        if weight_cache and self.backend.load_weight_cache(self.program_cache, self.fingerprint):
            self.cache_hits.append("weights")
        self.states = self.backend.allocate_states(self.compiled["decode"].graph, self.ctx)
        # the decode program first: a backend that tunes its kernels at load (webgpu) times them
        # for decode, and the prefill programs' steps of a few tokens then take those picks
        order = sorted(self.compiled, key=lambda name: name != "decode")
        self.programs = {name: self.backend.compile(self.compiled[name].graph, self.states, self.compiled[name].plan,
                                                    max_seq=self.compiled[name].sizes["seq"]) for name in order}
        if weight_cache:
            self.backend.save_weight_cache()
        t3 = time.perf_counter()
        self.load_phases.update({"backend": t1 - t0, "compile": t2 - t1, "weights": t3 - t2})
        tune_s = getattr(self.backend, "tune_s", 0.0)
        if tune_s:  # configurations timed on the device inside the weights phase (once: cached)
            self.load_phases["tuning"] = tune_s

    @property
    def graphs(self) -> dict:
        """The builder's graphs per logits stage ("all", "last"), before any pass."""
        return {stage: build_graph(self.config, self.file, stage, kv_chunk=self.kv_chunk) for stage in ("all", "last")}

    @property
    def kv_chunk(self) -> int:
        """The most tokens one program writes into the KV cache: the prefill chunk. Sliding-window
        layers keep rings of window + kv_chunk - 1 rows (ModelConfig.kv_rows)."""
        return min(self.prefill_chunk, self.ctx)

    def _compile_stages(self, stages: dict) -> dict:
        """The compiled graph of each stage: from the program cache when this model, engine,
        backend and context were compiled before, else compiled now (and cached)."""
        from .cache import program_key
        from .compiler.serialize import compiled_from_data, compiled_to_data

        supported = getattr(self.backend, "SUPPORTED_OPS", None)
        skip = frozenset(getattr(self.backend, "SKIP_PASSES", ()))
        cache = self.program_cache
        key = None
        if cache is not None:
            shard = {"shard": list(self.config.shard)} if self.config.shard[1] > 1 else {}
            key = program_key(model=self.fingerprint, backend=self.backend.name,
                              ops=sorted(supported) if supported is not None else None,
                              ctx=self.ctx, stages=stages, fuse=self.fuse, skip=sorted(skip), **shard)
            data = cache.get_json(key, "compiled.json")
            if isinstance(data, dict) and set(data) == set(stages):
                try:
                    out = {name: compiled_from_data(d) for name, d in data.items()}
                    self.cache_hits.append("compiled")
                    return out
                except EdgeLLMError:  # unreadable entry: compiled anew and rewritten below
                    pass
        from .compiler.compile import compile_graph

        if cache is not None:  # a first load of these programs: it will compile kernels too (cuda: in workers)
            expect = getattr(self.backend, "expect_compiles", None)
            if expect is not None:
                expect(vocab=self.config.vocab_size, draw=self._first_draw())
        graphs = self.graphs
        out = {name: compile_graph(graphs[g], supported_ops=supported, backend=self.backend.name, seq=seq,
                                   ctx=self.ctx, fuse=self.fuse, planner="greedy_by_size", skip_passes=skip)
               for name, (g, seq) in stages.items()}
        if cache is not None:
            try:
                cache.put_json(key, "compiled.json", {name: compiled_to_data(c) for name, c in out.items()})
            except (TypeError, ValueError):  # an attribute JSON cannot hold: run uncached
                pass
        return out

    # -- forward --------------------------------------------------------------------------------
    # -- KV slots (edgellm.session) ---------------------------------------------------------------
    @property
    def default_slot(self) -> KVSlot:
        """The KV cache allocated at load, as a slot: forward, generate and chat run on it."""
        if getattr(self, "_default_slot", None) is None:
            self._default_slot = KVSlot(self.states, self.programs, rings=self.config.kv_rings(self.ctx, self.kv_chunk))
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
        if not slot.holds_window_before(start_pos):
            raise EdgeLLMError(f"position {start_pos}: the sliding-window layers' ring caches no longer hold the "
                               f"window before it (later positions overwrote it); run the tokens from an earlier "
                               f"position (KVSlot.reusable_prefix says which are reusable)")
        programs = slot.programs
        # rows from start_pos on are about to change: until the run completes, trust only those before
        del slot.tokens[start_pos:]
        known = len(slot.tokens) == start_pos
        try:
            out = self._run_programs(programs, ids, start_pos, all_logits)
        finally:  # ring caches: which rows the run overwrote (a backend may pad a chunk past its tokens)
            slot.wrote(start_pos, start_pos + ids.size + self.backend_pad(ids.size))
        if known:
            slot.tokens.extend(int(t) for t in ids)
        return out

    def backend_pad(self, n: int) -> int:
        """At most how many rows past n tokens a run may write (the cuda backend pads prefill chunks
        to a multiple of its prefill_pad for CUDA-graph reuse; the padding rows hold junk)."""
        pad = max((getattr(p, "prefill_pad", 0) for p in self.programs.values()), default=0)
        return min(pad - 1, self.kv_chunk - 1) if pad and n > 1 else 0  # a chunk pads up to the chunk size

    def _run_programs(self, programs: dict, ids: np.ndarray, start_pos: int, all_logits: bool) -> np.ndarray:
        if ids.size == 1 and not all_logits:
            out = programs["decode"].run({"tokens": ids, "start_pos": int(start_pos)})
            return self.backend.to_numpy(out["logits"])
        if all_logits:  # the all-logits program's chunks (its size may be below the prefill chunk)
            step = self.all_chunk
            parts = [self.backend.to_numpy(programs["all"].run({"tokens": ids[i:i + step],
                                                                "start_pos": int(start_pos + i)})["logits"])
                     for i in range(0, ids.size, step)]
            return parts[0] if len(parts) == 1 else np.concatenate(parts)
        chunk = self.kv_chunk  # the prefill programs' size (the stages compiled in __post_init__)
        for i in range(0, ids.size - chunk, chunk):
            # earlier chunks only fill the KV cache; the last-logits program keeps that cheap
            programs["last"].run({"tokens": ids[i:i + chunk], "start_pos": int(start_pos + i)})
        i = (ids.size - 1) // chunk * chunk  # the last chunk gives the logits
        out = programs["last"].run({"tokens": ids[i:], "start_pos": int(start_pos + i)})
        return self.backend.to_numpy(out["logits"])

    def warmup(self, *, full: bool = False, sampling: SamplingParams | None = None) -> float:
        """Run the programs once on placeholder tokens, so that what a backend does on a shape's
        first run (compile kernels or load them from the kernel cache, capture CUDA graphs) is done
        before the first request: a short prompt's prefill and the first decode buckets; with
        full, every prefill size and every decode bucket up to the context (`edgellm warmup`, which
        fills the persistent kernel cache). sampling: the token choice the first requests make
        (default the argmax): a device decode loop's step is warmed drawing as they will (its
        kernels compiled with the rest). Backends without first-run work skip it. Returns the
        seconds spent. The placeholder rows written into the KV cache are overwritten by the
        next sequence before anything reads them."""
        sizes = getattr(self.backend, "warmup_sizes", None)
        if sizes is None:
            return 0.0
        steps = sizes(self.programs, self.ctx, full)
        if not steps:  # nothing compiles or captures on this device (the Triton interpreter)
            return 0.0
        t0 = time.perf_counter()

        loop = getattr(self.programs["decode"], "loop_tokens", None)
        on_device = getattr(self.programs["decode"], "draws_on_device", None)
        # the argmax, or the first requests' draw where the loop makes it on the device
        draw = self._first_draw(sampling) if on_device is not None and on_device(sampling) else None

        def run_steps():
            for stage, seq, start in steps:
                self.programs[stage].run({"tokens": np.zeros(seq, dtype=np.int32), "start_pos": start})
            if loop is not None and self.ctx > 2:  # the decode loop's step with its token choice
                for _ in loop(0, 1, 1, draw):
                    pass
        precompile = getattr(self.backend, "precompile", None)
        # their kernels compiled side by side first (cuda: precompile.py), unless the programs came
        # from the cache: the load that stored them compiled these kernels into the kernel cache
        # too, and loading them from there one by one is quicker than a collection pass (H100)
        if precompile is not None and (full or "compiled" not in self.cache_hits):
            precompile(run_steps)
        run_steps()
        done = getattr(self.backend, "compiles_done", None)
        if done is not None:
            done()
        dt = time.perf_counter() - t0
        self.load_phases["warmup"] = self.load_phases.get("warmup", 0.0) + dt
        return dt

    def _first_draw(self, sampling: SamplingParams | None = None):
        """The first requests' token choice as a device loop draws it (an edgellm.sampling
        DeviceDraw; None for the argmax, or a draw that needs the host): of `sampling`, default
        the one load() was given."""
        sampling = sampling if sampling is not None else self.first_sampling
        if sampling is None or sampling.greedy:
            return None
        return Sampler(sampling).device_draw()

    def _one_time_s(self) -> float:
        """Seconds the programs have spent on one-time work so far (backends that compile or
        capture on a shape's first run count it in `one_time_s`)."""
        return sum(getattr(p, "one_time_s", 0.0) for p in self.programs.values())

    def logits(self, token_ids) -> np.ndarray:
        """Next-token logits for every position of token_ids (from an empty cache): float32 [n, vocab]."""
        return self.forward(token_ids, 0, all_logits=True)

    # -- generation -----------------------------------------------------------------------------
    def prompt_tokens(self, prompt: str, *, chat: bool | None = None, system: str | None = None) -> list[int]:
        """Token ids for a prompt; with chat (default: when the model has a chat template) the prompt
        is the user's message, rendered through the model's own template."""
        tok = self.tokenizer
        if tok is None:
            raise _no_vocabulary(self.path)
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
            t0, once0 = time.perf_counter(), self._one_time_s()
            logits = self.forward(step_in, pos, all_logits=False, slot=slot)[-1]
            once = self._one_time_s() - once0
            dt = time.perf_counter() - t0 - once
            stats.compile_s += once
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
            program = slot.programs["decode"]
            loop = getattr(program, "loop_tokens", None)
            # the device draw's seed only where a device loop can take it (it comes from the sampler's
            # random numbers, which a host loop then goes on drawing from)
            draw = sampler.device_draw() if step == 0 and loop is not None else None
            on_device = getattr(program, "draws_on_device", None)
            if draw is not None and (draw.params.greedy or (on_device is not None and on_device(draw.params))):
                # a backend that loops on the device (argmax or draw there): no logits leave it
                n = min(max_tokens - 1, self.ctx - pos)
                slot.wrote(pos, pos + n)  # rows it may write (ring caches lose what they overwrite)
                t0, once0 = time.perf_counter(), self._one_time_s()
                for token in loop(step_in[0], pos, n, None if draw.params.greedy else draw, stop=stop_ids):
                    stats.generated_tokens += 1
                    if token in stop_ids:
                        stats.stop_reason = "eos"
                        break
                    yield token
                once = self._one_time_s() - once0
                stats.compile_s += once
                stats.decode_s += time.perf_counter() - t0 - once
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
         fuse: bool = True, prefill_chunk: int = 512, cache: bool | None = None, warmup: bool = True,
         shard: tuple[int, int] = (0, 1), sampling: SamplingParams | None = None) -> Model:
    """Load a GGUF model (default: the embedded SmolLM2-135M-Instruct Q4_1) on a backend.
    ctx: the KV-cache capacity in tokens (default: min(model's context, 4096)).
    fuse: run the fusion passes (off: the builder's graph as is, for checking the passes).
    prefill_chunk: prompts are processed in chunks of at most this many tokens; intermediate
    memory is planned for one chunk.
    cache: read and write the program cache (edgellm.cache: compiled graphs, memory plans, the
    tokenizer); default on unless EDGELLM_CACHE=0.
    warmup: do the backend's first-run work (kernel loads, graph captures) for a short prompt now,
    counted in load time, rather than in the first request (Model.warmup); sampling: the token
    choice the first requests will make, warmed with the rest (default: the argmax).
    shard: (rank, world) of tensor parallelism, inside an initialised torch.distributed process
    group (edgellm.hetero.distributed.load_rank): this process holds its share of every layer."""
    if path is not None and str(path).lower().endswith(".onnx"):  # a network, not a language model
        from .onnx import load_onnx

        return load_onnx(path, backend=backend, fuse=fuse)
    from . import cache as cache_mod

    t0 = time.perf_counter()
    if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, int) or ctx <= 0):
        raise EdgeLLMError(f"ctx must be a positive number of tokens, got {ctx!r}")
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk <= 0:
        raise EdgeLLMError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk!r}")
    if isinstance(backend, str):
        from .backends.cuda.early import start_for

        start_for(backend)  # the GPU's context made on a thread while the file and tokenizer load
    prefetch = getattr(get_backend(backend), "prefetch", None) if isinstance(backend, str) else None
    if prefetch is not None:
        prefetch()  # the backend's start-up work that needs no file, on a thread (cuda: Triton's cache key)
    t_start = time.perf_counter()
    path = str(path) if path is not None else str(default_model_path())
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    if tuple(shard) != (0, 1):
        cfg = replace(cfg, shard=(int(shard[0]), int(shard[1])))
    use_cache = cache_mod.enabled() if cache is None else cache
    pc = cache_mod.ProgramCache() if use_cache else None
    fingerprint = cache_mod.file_fingerprint(path) if pc is not None else None
    t1 = time.perf_counter()
    tok, tok_cached = _load_tokenizer(f, path, pc, fingerprint)
    t2 = time.perf_counter()
    if ctx is None:
        ctx = min(cfg.context_length, 4096)
    m = Model(path=path, backend_name=backend, ctx=ctx, file=f, config=cfg, tokenizer=tok, fuse=fuse,
              prefill_chunk=prefill_chunk, program_cache=pc, fingerprint=fingerprint,
              load_phases={"start": t_start - t0, "open": t1 - t_start, "tokenizer": t2 - t1},
              cache_hits=["tokenizer"] if tok_cached else [], first_sampling=sampling)
    if warmup:
        m.warmup(sampling=sampling)
    m.load_s = time.perf_counter() - t0
    return m


def require_vocabulary(path: str | os.PathLike | None) -> None:
    """Refuse a text prompt for a file without a vocabulary before anything loads (its header
    only): the CLI's check, which would otherwise come after the whole load, kernels compiled."""
    path = str(path) if path is not None else str(default_model_path())
    if path.lower().endswith(".onnx"):
        return
    if open_gguf(path).get("tokenizer.ggml.model", "none") == "none":
        raise _no_vocabulary(path)


def _no_vocabulary(path: str) -> MetadataError:
    return MetadataError(f"{os.path.basename(path)} has no vocabulary (tokenizer.ggml.model = 'none'); "
                         "pass token ids instead of text")


def _load_tokenizer(f, path: str, pc, fingerprint: str | None) -> tuple[Tokenizer | None, bool]:
    """The file's tokenizer (None for vocabulary-less files, which run from token ids, as
    llama.cpp's benchmark models), its built BPE model read from and written to the cache."""
    if f.get("tokenizer.ggml.model", "none") == "none":
        return None, False
    from .cache import program_key

    key = program_key(model=fingerprint, artifact="tokenizer") if pc is not None else None
    cached = pc.get(key, "tokenizer.json") if pc is not None else None
    got = pc.get_arrays(key, "derived") if pc is not None and cached is not None else None
    derived = Tokenizer.derived_from(*got) if got is not None else None
    tok = Tokenizer.from_metadata(f.metadata, source=os.path.basename(path),
                                  backend_json=cached.decode() if cached is not None else None, derived=derived)
    if pc is not None and cached is None:
        pc.put(key, "tokenizer.json", tok.backend_json().encode())
    if pc is not None and derived is None:
        d = tok.derived()
        pc.put_arrays(key, "derived", d["arrays"], meta=d["meta"])
    return tok, cached is not None
