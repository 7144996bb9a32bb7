"""KV-cache slots, prefix reuse, chat prompts and the text stream with stop strings.

A KVSlot is one sequence's KV cache (the backend's state tensors) with the programs bound to it,
plus the token ids whose keys and values its rows 0..len-1 hold. Model.forward keeps that record
truthful on every run, so the next request on the slot can skip the longest common prefix and
prefill only the tokens after it: a chat's second turn reads only the new message, not the whole
history again. `edgellm chat` and `edgellm serve` (one slot per parallel sequence) share this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import EdgeLLMError

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(eq=False)
class KVSlot:
    """One sequence's KV cache: `states` (the backend's cache tensors), `programs` (the model's
    stage programs bound to them) and `tokens`, the ids whose K/V rows 0..len(tokens)-1 hold."""

    states: dict = field(repr=False)
    programs: dict = field(repr=False)
    tokens: list[int] = field(default_factory=list)
    index: int = 0
    # (window, rows) of the sliding-window layers whose cache is a ring (ModelConfig.kv_rings), and
    # per ring the oldest position whose row still holds it: later writes overwrite earlier rows
    rings: tuple[tuple[int, int], ...] = ()
    ring_from: dict = field(default_factory=dict, repr=False)

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading ids can be skipped: their K/V rows are already in the cache. At least
        one id is always left to run, since its logits are what comes next. With ring caches the
        prefix is reused only when every ring still holds the window before its end (a rewind to
        a point whose window has been overwritten runs from the start)."""
        n = common_prefix(self.tokens, ids)
        n = min(n, len(ids) - 1) if ids else 0
        return n if self.holds_window_before(n) else 0

    def holds_window_before(self, pos: int) -> bool:
        """Whether every ring still holds the positions a query at pos reads before it (its window)."""
        return pos == 0 or all(max(0, pos - window + 1) >= self.ring_from.get(rows, 0)
                               for window, rows in self.rings)

    def wrote(self, start: int, end: int) -> None:
        """Positions start..end-1 were written (runs write in order, at most a ring's worth at once):
        in a ring of `rows` rows they overwrote the rows of positions before end - rows, and what
        was kept before start stays only from where it was still held."""
        for _, rows in self.rings:
            self.ring_from[rows] = max(min(self.ring_from.get(rows, 0), start), end - rows)

    def reset(self) -> None:
        self.tokens = []


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_messages(messages) -> list[dict]:
    """A conversation as [{'role': ..., 'content': str}, ...], or an EdgeLLMError saying what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise EdgeLLMError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise EdgeLLMError(f"messages[{i}] is a {type(msg).__name__}, expected a dict with 'role' and 'content'")
        role, content = msg.get("role"), msg.get("content")
        if role not in CHAT_ROLES:
            raise EdgeLLMError(f"messages[{i}]['role'] is {role!r}, expected one of {', '.join(CHAT_ROLES)}")
        if not isinstance(content, str):
            raise EdgeLLMError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


class TextStream:
    """Turns sampled token ids into text pieces and cuts at stop strings: text that could be the
    start of a stop string is held back until it is known not to be one; a stop string found ends
    the stream (`stopped` true) and is not part of the output."""

    def __init__(self, tokenizer, stops=()):
        self._decoder = tokenizer.stream_decoder(strip_leading_space=False)  # a continuation keeps its space
        self._stops = tuple(s for s in stops if s)
        self._longest = max(map(len, self._stops), default=0)
        self._pending = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """The text that is now certain after one more token ('' when held back or stopped)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.push(token)
        return self._release()

    def flush(self) -> str:
        """End of generation: whatever is held back (unless a stop string ended the stream)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.flush()
        out = self._release()
        out, self._pending = out + self._pending, ""
        return out

    def _release(self) -> str:
        pending = self._pending
        if not self._stops:
            self._pending = ""
            return pending
        cut = min((i for i in (pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return pending[:cut]
        # hold back the longest suffix that is a prefix of some stop string
        keep = next((k for k in range(min(self._longest - 1, len(pending)), 0, -1)
                     if any(s.startswith(pending[-k:]) for s in self._stops)), 0)
        self._pending = pending[len(pending) - keep:]
        return pending[: len(pending) - keep]


ROW_OPS = frozenset({"rope_rows", "kv_store_rows", "attention_rows"})


class SlotPool:
    """`n` KV slots in one cache tensor per layer with the slots along its rows (slot s owns rows
    s*ctx .. (s+1)*ctx-1). Each slot is a view bound to the model's single-sequence programs (for
    prefill, and decode of one sequence); where the backend runs the row-wise ops, `decode` runs
    one token of each of several slots in one step: the model's 'rows' graph, whose linear layers
    are one matrix product over the rows (the weights read once per step, not once per sequence)
    and whose attention reads each row's own slot up to its own position."""

    def __init__(self, model, n: int):
        from .compiler.compile import compile_graph
        from .models import build_graph
        from .models.blocks import rows_stage_unsupported

        if n < 1:
            raise EdgeLLMError(f"a slot pool needs at least one slot, got {n}")
        self.model, self.n, self.ctx = model, n, model.ctx
        backend = model.backend
        self.batch = None
        self.overlaps = False
        rings = model.config.kv_rings(self.ctx, model.kv_chunk)
        if rows_stage_unsupported(model.config):
            # no row-wise graph for this model: each slot gets caches of its own (ring layers their
            # rings) and sequences decode one at a time (edgellm.serve.scheduler's round robin)
            self.states = None
            self.slots = [KVSlot(*model.bind_programs(backend.allocate_states(model.compiled["decode"].graph,
                                                                              self.ctx)), index=s, rings=rings)
                          for s in range(n)]
            return
        graph = build_graph(model.config, model.file, "rows")
        self.states = backend.allocate_states(graph, n * self.ctx)
        self.slots = []
        for s in range(n):
            view = {k: t[s * self.ctx:(s + 1) * self.ctx] for k, t in self.states.items()}
            self.slots.append(KVSlot(*model.bind_programs(view), index=s))
        supported = getattr(backend, "SUPPORTED_OPS", None)
        if supported is None or ROW_OPS <= set(supported):
            c = compile_graph(graph, supported_ops=supported, backend=backend.name, seq=n, ctx=n * self.ctx,
                              fuse=model.fuse)
            self.batch = backend.compile(c.graph, self.states, c.plan, max_seq=n)
            # a step queued on a CUDA device runs while the host goes on (decode_start)
            self.overlaps = getattr(getattr(self.batch, "dev", None), "type", None) == "cuda"

    def warmup(self) -> int:
        """One batched step at every padded row count the backend runs (and one single-sequence
        step), at the first and the last position of a slot and at the first position of each
        attention split count (see below), so that kernel compiles and CUDA graph captures happen
        now rather than inside the first requests that reach each count (H100, 1B: a 16-client
        level otherwise waited 1.7 s for its first steps). The slots are reset afterwards. Returns
        the number of steps run."""
        if self.batch is None:
            return 0
        bucket = getattr(self.batch, "row_bucket", None)
        counts = sorted({min(self.n, bucket(k)) if bucket else k for k in range(1, self.n + 1)})
        # and a step at the first position of each attention split count that a program has a
        # kernel variant for (step_shapes, cuda), once per count: the compile of a variant met
        # first inside a served round would stall it
        warmed: set = set()
        shapes = []
        for count in counts:
            positions = {0, self.ctx - 1}
            program = self.batch if count > 1 else self.slots[0].programs["decode"]
            step_shapes = getattr(program, "step_shapes", None)
            if step_shapes is not None:
                for splits, pos in sorted(step_shapes(count, self.ctx).items()):
                    if (count > 1, splits) not in warmed:
                        warmed.add((count > 1, splits))
                        positions.add(pos)
            shapes += [(count, pos) for pos in sorted(positions)]

        def run_steps():
            for count, pos in shapes:
                self.decode_tokens([(self.slots[i], 0, pos) for i in range(count)], [False] * count)
        precompile = getattr(self.model.backend, "precompile", None)
        if precompile is not None:  # their kernels compiled side by side first (cuda: precompile.py)
            precompile(run_steps)
        run_steps()
        steps = len(shapes)
        for slot in self.slots:
            slot.reset()
        return steps

    def decode(self, steps: list[tuple[KVSlot, int, int]]):
        """One decode step of several sequences: (slot, token, position) each, distinct slots.
        Returns float32 logits [len(steps), vocab], row i for steps[i]. (A step of one sequence
        runs that slot's single-token program: the same logits, with that program's fusions.)"""
        return self.model.backend.to_numpy(self._run(steps))

    @property
    def draws_on_device(self) -> bool:
        """Whether the backend draws sampled tokens where the logits are (DecodeStep's draws)."""
        return bool(getattr(self.model.backend, "samples_on_device", False))

    def decode_tokens(self, steps: list[tuple[KVSlot, int, int]], need_logits: list[bool], draws: list | None = None):
        """decode, reading back less: (the token of every row, chosen where the logits are (on the
        GPU for cuda): the argmax, or drawn as draws[i] (an edgellm.sampling.DeviceDraw) says where
        the backend draws on the device; {i: float32 logits of row i} for the rows with
        need_logits[i]). A sequence whose token the device chooses needs only that token: a step
        then copies len(steps) ids, not len(steps) x vocab floats."""
        return self.decode_start(steps, need_logits, draws)()

    def decode_start(self, steps: list[tuple[KVSlot, int, int]], need_logits: list[bool],
                     draws: list | None = None) -> "DecodeStep":
        """decode_tokens in two halves: this call does the step's host work and queues its device
        work; the DecodeStep it returns, called, waits for the step and returns what decode_tokens
        does. On a GPU (`overlaps`) the step runs while the caller does other host work in between
        (the scheduler: the previous step's text and events)."""
        return DecodeStep(self.model.backend, steps, self._run(steps), need_logits, draws)

    def decode_next(self, prev: "DecodeStep") -> "DecodeStep":
        """The step after prev for the same slots in the same order, each at the next position, fed
        prev's tokens where they are (a copy on the device) and choosing its tokens as prev did:
        queued before prev's tokens are read back, so that a GPU runs the two steps back to back
        while the host reads and delivers prev's tokens (the scheduler's chain of steps). No logits
        are read back. The slots' token records get the fed tokens when prev is read (called);
        read it before the slots run anything else."""
        steps = [(slot, None, pos + 1) for slot, pos in prev.rows]
        prev.copy_now()
        step = DecodeStep(self.model.backend, steps, self._run(steps, feed=prev.chosen), [False] * len(steps),
                          prev.draws)
        prev.feeds(steps)
        return step

    def _run(self, steps: list[tuple[KVSlot, int | None, int]], feed=None):
        """The rows program over the steps; its logits as the backend's tensor [len(steps), vocab].
        feed: the tokens as a tensor on the backend's device (decode_next), the steps' own tokens
        then None and recorded in the slots by the step that made them."""
        import numpy as np

        from .models.blocks import rows_stage_unsupported

        if self.batch is None:
            why = rows_stage_unsupported(self.model.config)
            raise EdgeLLMError(f"no batched decode step for {why}: decode each slot alone" if why else
                               f"the {self.model.backend.name} backend has no row-wise decode ops")
        if len({id(s) for s, _, _ in steps}) != len(steps):
            raise EdgeLLMError("a decode step takes each slot at most once")
        vocab = self.model.config.vocab_size
        for slot, token, pos in steps:
            if not 0 <= pos < self.ctx:
                raise EdgeLLMError(f"position {pos} is outside slot {slot.index}'s context of {self.ctx}")
            if feed is None and not 0 <= token < vocab:
                raise EdgeLLMError(f"token id {token} is outside the vocabulary [0, {vocab})")
        for slot, _, pos in steps:  # as Model.forward: rows from pos on are about to change
            del slot.tokens[pos:]
        tokens = np.array([t for _, t, _ in steps], dtype=np.int32) if feed is None else feed
        if len(steps) == 1:  # one sequence: its own single-token program (the decode fusions of one row)
            slot, _, pos = steps[0]
            out = slot.programs["decode"].run({"tokens": tokens, "start_pos": int(pos)})
        else:
            out = self.batch.run({"tokens": tokens, "pos": np.array([p for _, _, p in steps], dtype=np.int32),
                                  "base": np.array([s.index * self.ctx for s, _, _ in steps], dtype=np.int32)})
        if feed is None:
            for slot, token, pos in steps:
                if len(slot.tokens) == pos:  # the record reached pos: it now holds the token there
                    slot.tokens.append(int(token))
        return out["logits"]


class DecodeStep:
    """A queued decode step of a SlotPool (decode_start, decode_next). Calling it waits for the
    step and returns (the chosen token of every row, {i: float32 logits of row i} for the rows
    asked); the result is kept, so a second call returns it again. `chosen` (the argmax, or a
    device draw where draws[i] asks for one) stays on the device, where decode_next feeds it to the
    following step. The logits rows asked for are gathered when the step is queued: a following
    step rewrites the program's logits buffer."""

    def __init__(self, backend, steps: list[tuple[KVSlot, int | None, int]], logits, need_logits: list[bool],
                 draws: list | None = None):
        self.rows = [(slot, pos) for slot, _, pos in steps]
        self.draws = draws if draws is not None and any(d is not None for d in draws) else None
        if self.draws is not None:  # sampled rows drawn where the logits are (cuda)
            if len(self.draws) != len(steps) or not hasattr(backend, "choose"):
                raise EdgeLLMError(f"draws on the device need the backend's choose and one draw per row "
                                   f"({len(self.draws)} for {len(steps)} rows)")
            self.chosen = backend.choose(logits, self.draws, [pos for _, pos in self.rows])
        else:  # first maximum, as np.argmax: the backend's own reduction where it has one (cuda)
            self.chosen = backend.argmax(logits) if hasattr(backend, "argmax") else logits.argmax(dim=-1)
        self._backend = backend
        self._want = [i for i, need in enumerate(need_logits) if need]
        self._logits = logits[self._want] if self._want else None
        self._copy = None  # (tokens, logits rows) on their way to the host, and the event after them (copy_now)
        self._fed: list[tuple[KVSlot, int]] = []  # (slot, position) a following step wrote with row i's token
        self._result = None

    def copy_now(self) -> None:
        """Queue the copies to the host behind this step now, before a following step is queued:
        on a GPU, reading this step then waits for it alone, not for the following one too (which
        would leave the GPU idle while the host delivers this step's tokens). The copies land in
        pinned memory; an event marks when they are there."""
        if self._copy is None and self._result is None and self.chosen.is_cuda:
            import torch

            logits = self._logits.to("cpu", non_blocking=True) if self._want else None
            self._copy = (self.chosen.to("cpu", non_blocking=True), logits,
                          torch.cuda.current_stream(self.chosen.device).record_event())

    def __call__(self):
        import numpy as np

        if self._result is None:
            if self._copy is not None:
                tokens, logits, copied = self._copy
                copied.synchronize()
            else:
                tokens, logits = self.chosen.cpu(), self._logits
            rows = self._backend.to_numpy(logits) if self._want else None
            self._result = tokens.numpy().astype(np.int64), {i: rows[k] for k, i in enumerate(self._want)}
            self._record()
        return self._result

    def feeds(self, steps: list[tuple[KVSlot, int | None, int]]) -> None:
        """A following step ran these (slot, _, position) rows on this step's tokens: each slot's
        record gets its token once it is known (now, if this step was read already)."""
        self._fed = [(slot, pos) for slot, _, pos in steps]
        if self._result is not None:
            self._record()

    def _record(self) -> None:
        # a row whose record ended just before its position (as _run found it) now holds the token there
        for (slot, pos), token in zip(self._fed, self._result[0]):
            if len(slot.tokens) == pos:
                slot.tokens.append(int(token))
        self._fed = []

