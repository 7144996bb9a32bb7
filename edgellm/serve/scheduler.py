"""Continuous batching: many requests share one model, each in its own KV-cache slot.

One thread owns the model. Between model steps it admits waiting requests into free slots (the
slot whose cache already holds the longest prefix of the prompt: a multi-turn client or a shared
system prompt skips that part of the prefill), drops cancelled ones (the slot is free for the
next step), runs pending prefills up to `chunk` prompt tokens in all (oldest first; a long prompt
in chunk-sized parts over several steps), then one decode step for every running sequence.
Requests thus join and leave the running set between steps, and prompts delay the running
sequences by at most one chunk of prefill per step.

A decode step is one batched program over every running sequence (SlotPool.decode_tokens: the
linear layers one matrix product over the rows, attention over each row's own slot and length;
rows whose token the device chooses read back only that token: the argmax of greedy rows, and on
a backend that draws on the device (cuda) sampled rows' draws) where the backend has
the row-wise ops (cpu, cuda); elsewhere each sequence's single-token program runs in turn, with
the same step structure.

Where the step runs on a GPU (SlotPool.overlaps), it is queued before the previous step's tokens
are delivered (their text, stop strings and events), so that this host work runs while the GPU
steps; what decides the next step (the token fed next, end-of-turn tokens, max_tokens) is settled
before it is queued. A stop string found in the delivered text ends a request that has already
run one more step: that token is dropped, so the answer and its usage are those of the
step-by-step order.

Chaining (on where the steps overlap; Scheduler(chain=...), EDGELLM_SERVE_CHAIN=0 turns it off to
measure the difference): the overlap alone still leaves the GPU idle between steps, since step
k+1 is queued only once step k's tokens are back on the host and accepted. When every sequence of
a step has its token chosen on the device (no repetition penalty, no logprobs; greedy, or sampled
where the backend draws on the device), step k+1 is queued right after step k, before its tokens
are read back, fed step k's tokens by a copy on the device (SlotPool.decode_next); the host then reads, accepts and delivers step k's tokens
while the GPU runs step k+1, whose tokens the next iteration reads if it decodes the same
sequences. Anything else (a request to admit into a free slot, a cancellation, a prefill, a
sequence that ended) first settles the step in flight: its tokens are read and accepted for the
sequences still running, so that no slot changes hands with a step of its old request in flight
or a token left to record in its cache's token list. A sequence that ends by the token it feeds
(an end-of-turn token, a stop string) has run one step too many, whose token is dropped: the
answers, finish reasons and usage are those of the step-by-step order. Endings known in advance
(max_tokens, the end of the context) stop the chain before that step.

Each request brings its own sampling parameters (and seed), stop strings and max_tokens; its
events (text pieces, then a final Done or Failed) go to a callback, called on this thread.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import EdgeLLMError
from ..sampling import Sampler, SamplingParams
from ..session import KVSlot, SlotPool, TextStream


class QueueFullError(EdgeLLMError):
    """Every slot is busy and the waiting queue is at its bound."""


class ShuttingDownError(EdgeLLMError):
    """The scheduler is stopping and takes no new requests."""


@dataclass
class Piece:
    """Text that is now certain, with the tokens that produced it (and their log-probabilities
    when asked: one (token, logprob, [(token, logprob), ...]) per token)."""
    text: str
    tokens: list[int]
    logprobs: list | None = None


@dataclass
class Done:
    finish_reason: str  # 'stop' (end of turn or a stop string), 'length' (max_tokens or context), 'cancelled'
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    total_s: float


@dataclass
class Failed:
    message: str


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stops: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's and the k most likely
    ignore_eos: bool = False  # end-of-turn tokens do not end the answer (load tests)
    on_event: Callable[[object], None] = lambda ev: None
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: bool = False

    def cancel(self) -> None:
        """Stop this request; its slot is free before the next model step. Safe from any thread."""
        self.cancelled = True


@dataclass(eq=False)
class _Running:
    req: Request
    slot: KVSlot
    pos: int  # the next cache row to write
    todo: list[int]  # prompt tokens still to prefill
    sampler: Sampler
    history: list[int]
    text: TextStream
    t0: float
    last: int | None = None  # the sampled token to feed next
    generated: int = 0
    cached: int = 0
    ttft: float = 0.0
    ending: str | None = None  # its last token is taken ('stop' or 'length'); delivering it ends the request
    done: bool = False  # finished, cancelled or failed: its slot is free


class Scheduler:
    def __init__(self, model, parallel: int = 1, *, max_queue: int = 64, chunk: int = 256,
                 pool: SlotPool | None = None, chain: bool | None = None, metrics=None):
        """pool: the slots and decode step over model (default SlotPool(model, parallel); a stand-in
        with the same slots / batch / decode_start / overlaps measures the serving stack without a
        model: benchmarks/bench_serve_stack.py). chain: queue steps whose tokens the device chooses back to back (see the
        module docstring); None: where the steps overlap and the pool has decode_next, unless
        EDGELLM_SERVE_CHAIN=0. metrics: an edgellm.serve.metrics.ServerMetrics that exports `stats`
        (counts kept here as plain ints) and gets the iteration intervals."""
        if parallel < 1:
            raise EdgeLLMError(f"parallel must be at least 1, got {parallel}")
        if max_queue < 0:
            raise EdgeLLMError(f"max_queue must be >= 0, got {max_queue}")
        self.model = model
        self.ctx = model.ctx
        self.chunk = max(1, int(chunk))
        self.max_queue = max_queue
        self.pool = SlotPool(model, parallel) if pool is None else pool
        self.slots: list[KVSlot] = list(self.pool.slots)
        self.batched = self.pool.batch is not None
        # a decode step's device work runs while this thread delivers the previous step's tokens
        self.overlap = self.batched and bool(getattr(self.pool, "overlaps", False))
        if chain is None:
            chain = (self.overlap and hasattr(self.pool, "decode_next")
                     and os.environ.get("EDGELLM_SERVE_CHAIN", "1") != "0")
        self.chain = self.batched and chain
        self._inflight: tuple[list[_Running], object] | None = None  # (runs, chained step): queued, not yet read
        self._deliveries: list[tuple[_Running, int | None, object]] = []
        self._free: list[KVSlot] = list(self.slots)
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[_Running] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._stop_ids = model.tokenizer.stop_ids if model.tokenizer is not None else frozenset()
        self._thread = threading.Thread(target=self._loop, name="edgellm-scheduler", daemon=True)
        self.steps = 0
        # counts a metrics endpoint reads (edgellm.serve.metrics): tokens, steps, finished requests
        self.stats: collections.Counter = collections.Counter()
        self.metrics = None
        if metrics is not None:
            self.attach_metrics(metrics)

    # -- the caller's side ------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def submit(self, req: Request) -> Request:
        """Queue a request (prompt must leave room for one generated token: the caller checks the
        context). Raises QueueFullError when the bounded queue is full, ShuttingDownError when stopping."""
        if not req.prompt:
            raise EdgeLLMError("the prompt has no tokens")
        if len(req.prompt) >= self.ctx:
            raise EdgeLLMError(f"the prompt has {len(req.prompt)} tokens; the context holds {self.ctx}")
        with self._cv:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            # free slots take the first waiting requests at the next step; beyond them, max_queue wait
            if len(self._waiting) >= len(self._free) + self.max_queue:
                raise QueueFullError(f"all {len(self.slots)} slots are busy and {len(self._waiting)} requests "
                                     "are waiting; try again later")
            self._waiting.append(req)
            self._cv.notify()
        return req

    def attach_metrics(self, metrics) -> None:
        """Export stats and counts through metrics (edgellm.serve.metrics.ServerMetrics) and observe
        the model thread's iteration intervals into it."""
        metrics.watch(self.stats, self.counts, self.one_time_s)
        self.metrics = metrics

    def one_time_s(self) -> float:
        """Seconds the pool's programs spent on one-time work (kernel compiles, graph captures: the
        cuda programs' one_time_s; 0 where a backend has none)."""
        programs = [self.pool.batch] + [p for slot in self.slots for p in getattr(slot, "programs", {}).values()]
        return float(sum(getattr(p, "one_time_s", 0.0) for p in programs if p is not None))

    def counts(self) -> dict:
        with self._cv:
            return {"slots": len(self.slots), "busy": len(self.slots) - len(self._free),
                    "free": len(self._free), "waiting": len(self._waiting), "max_queue": self.max_queue}

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything queued or running (each gets Done('cancelled')) and end the thread."""
        with self._cv:
            self._stopping = True
            for r in list(self._waiting) + [run.req for run in self._running]:
                r.cancel()
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the model thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        last = None  # the start of the previous iteration that had requests to run
        while True:
            with self._cv:
                settle = self._inflight is not None and not self._chain_goes_on()
                if not settle:
                    self._drop_cancelled()
                    self._admit()
                    if not self._running:
                        if self._stopping:
                            return
                        last = None  # idle time is no stall
                        self._cv.wait(0.5)
                        continue
            if self.metrics is not None:
                now = time.perf_counter()
                if last is not None:
                    self.metrics.interval.observe(now - last)
                last = now if self._running else None
            if settle:
                self._settle()
                continue
            self._prefill()
            self._decode()
            self.steps += 1

    def _chain_goes_on(self) -> bool:
        """Whether this iteration only decodes the chained step's sequences once more: none of them
        ended or was cancelled (stop() cancels them all), no other request runs (a prefill), and no
        waiting request takes a free slot. (Checked under the lock that submit takes, so that
        nothing is admitted in between.)"""
        runs = self._inflight[0]
        return (self._running == runs and not any(r.req.cancelled or r.ending is not None for r in runs)
                and not self._prefills_pending())

    def _prefills_pending(self) -> bool:
        """A running request has prompt tokens to prefill, or a waiting one a free slot to take
        (read without the lock: a request submitted meanwhile is seen by the next iteration)."""
        return any(r.todo for r in self._running) or bool(self._waiting and self._free)

    def _settle(self) -> None:
        """Read the chained step in flight and accept its tokens for the sequences still running. The
        tokens accepted before are delivered first: a sequence that they end (an end-of-turn
        token, a stop string) is done and drops this step's token, as in the step-by-step order."""
        runs, step = self._inflight
        self._inflight = None
        self._deliver()
        try:
            tokens, _ = step()
        except Exception as e:
            for run in runs:
                if not run.done:
                    self._fail(run, _message(e))
            return
        for i, run in enumerate(runs):
            if not run.done:
                run.pos += 1
                self._accept(run, int(tokens[i]), None)

    def _drop_cancelled(self) -> None:
        for r in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(r)
            self.stats["requests_cancelled"] += 1
            _send(r, Done("cancelled", len(r.prompt), 0, 0, 0.0, 0.0))
        for run in [run for run in self._running if run.req.cancelled]:
            self._finish(run, "cancelled")

    def _admit(self) -> None:
        while self._free and self._waiting:
            req = self._waiting.popleft()
            # the free slot whose cache holds the longest prefix of this prompt
            slot = max(self._free, key=lambda s: (s.reusable_prefix(req.prompt), -s.index))
            self._free.remove(slot)
            pos = slot.reusable_prefix(req.prompt)
            run = _Running(req, slot, pos, list(req.prompt[pos:]), Sampler(req.params), list(req.prompt),
                           TextStream(self.model.tokenizer, req.stops), time.perf_counter(), cached=pos)
            if req.max_tokens == 0:
                self._release(run)
                self.stats["requests_length"] += 1
                _send(req, Done("length", len(req.prompt), pos, 0, 0.0, 0.0))
                continue
            self._running.append(run)

    def _prefill(self) -> None:
        """Pending prefills, oldest first, up to `chunk` tokens in all this step; a prompt's last
        part yields its first token (delivered at once)."""
        budget = self.chunk
        prefills = [r for r in self._running if r.todo]
        if prefills:
            self._deliver()  # the previous step's tokens do not wait for the prefill
        for run in prefills:
            if budget <= 0:
                break
            if run.req.cancelled:
                continue
            part, run.todo = run.todo[:budget], run.todo[budget:]
            budget -= len(part)
            self.stats["prompt_tokens"] += len(part)
            logits = self._forward(run, part)
            if logits is not None and not run.todo:
                run.ttft = time.perf_counter() - run.t0
                self._sample(run, logits)
                self._deliver()

    def _decode(self) -> None:
        """One decode step of the running sequences. With overlap the step is queued on the device
        first and the previous step's tokens are delivered while it runs: a sequence that a stop
        string in those ends has run one step more, whose token is dropped (it is done). Chained,
        the step is the one queued last iteration (the loop settled it unless these sequences are
        its own), and the next one is queued before its tokens are read (see the module docstring)."""
        if self._inflight is not None:
            (runs, step), self._inflight = self._inflight, None
        else:
            runs = [r for r in self._running if not r.todo and r.last is not None and not r.req.cancelled
                    and r.ending is None]
            step = None
        if not runs:
            self._deliver()
            return
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(runs)
        if not self.batched:  # round-robin single-sequence steps (see the module docstring)
            for run in runs:
                logits = self._forward(run, [run.last])
                if logits is not None:
                    self._sample(run, logits)
                    self._deliver()
            return
        # rows without a repetition penalty or logprobs take the token chosen on the device (the
        # argmax; a draw where the backend samples there); only the others' logits are read back
        on_device = self.pool.draws_on_device
        need = [not (r.req.params.chain_only and r.req.logprobs is None and (r.req.params.greedy or on_device))
                for r in runs]
        draws = [None if n or r.req.params.greedy else r.sampler.device_draw() for r, n in zip(runs, need)]
        try:
            if step is None:
                step = self.pool.decode_start([(r.slot, r.last, r.pos) for r in runs], need, draws)
            # chain the next step unless a row needs its logits or ends for sure by this step's token,
            # or prompts wait for their prefill (the next iteration would settle the chained step
            # before it, and each prefill chunk would then wait for two decode steps instead of one)
            if self.chain and not any(need) and not self._prefills_pending() and all(
                    r.generated + 1 < r.req.max_tokens and r.pos + 1 < self.ctx for r in runs):
                self._inflight = (runs, self.pool.decode_next(step))
            self._deliver()  # the previous step's tokens, while the device runs this step
            tokens, logits = step()
        except Exception as e:
            self._inflight = None
            self._deliver()
            for run in runs:
                if not run.done:
                    self._fail(run, _message(e))
            return
        for i, run in enumerate(runs):
            if run.done:  # a stop string in the tokens delivered above ended it
                continue
            run.pos += 1
            if i in logits:
                self._sample(run, logits[i])
            else:
                self._accept(run, int(tokens[i]), None)
        if not self.overlap:
            self._deliver()

    def _forward(self, run: _Running, ids: list[int]) -> np.ndarray | None:
        try:
            logits = self.model.forward(ids, run.pos, all_logits=False, slot=run.slot)[-1]
        except Exception as e:  # one request's failure must not take the others down
            self._fail(run, _message(e))
            return None
        run.pos += len(ids)
        return logits

    def _sample(self, run: _Running, logits: np.ndarray) -> None:
        self._accept(run, run.sampler(logits, run.history), logits)

    def _accept(self, run: _Running, token: int, logits: np.ndarray | None) -> None:
        """The token chosen for a running request (logits: its distribution, needed only for
        logprobs): what decides the next step (the token fed next, whether the request ends by an
        end-of-turn token or its length) now; its text and events in _deliver."""
        req = run.req
        run.generated += 1
        if token in self._stop_ids and not req.ignore_eos:
            run.ending = "stop"
            self._deliveries.append((run, None, None))
            return
        self.stats["generated_tokens"] += 1  # as usage counts them: an end-of-turn token is not
        run.history.append(token)
        run.last = token
        lp = _logprobs(logits, token, req.logprobs, self.model.tokenizer) if req.logprobs is not None else None
        if run.generated >= req.max_tokens or run.pos >= self.ctx:
            run.ending = "length"
        self._deliveries.append((run, token, lp))

    def _deliver(self) -> None:
        """The accepted tokens' text (stop strings cut it and end the request) and events, in order;
        a request that ended meanwhile (cancelled, failed) gets nothing more."""
        items, self._deliveries = self._deliveries, []
        for run, token, lp in items:
            if run.done:
                continue
            if token is None:  # an end-of-turn token
                self._emit(run, run.text.flush(), [], None)
                self._finish(run, "stop")
                continue
            self._emit(run, run.text.push(token), [token], lp)
            if run.text.stopped:
                self._finish(run, "stop")
            elif run.ending == "length":
                self._emit(run, run.text.flush(), [], None)
                self._finish(run, "length")

    def _emit(self, run: _Running, text: str, tokens: list[int], lp) -> None:
        if text or tokens:
            _send(run.req, Piece(text, tokens, [lp] if lp is not None else None))

    def _finish(self, run: _Running, reason: str) -> None:
        completion = len(run.history) - len(run.req.prompt)  # sampled tokens, an end-of-turn token not counted
        self._release(run)
        self.stats[f"requests_{reason}"] += 1
        _send(run.req, Done(reason, len(run.req.prompt), run.cached, completion,
                            run.ttft, time.perf_counter() - run.t0))

    def _fail(self, run: _Running, message: str) -> None:
        self._release(run)
        self.stats["requests_failed"] += 1
        _send(run.req, Failed(message))

    def _release(self, run: _Running) -> None:
        run.done = True
        with self._cv:
            if run in self._running:
                self._running.remove(run)
            if run.slot not in self._free:
                self._free.append(run.slot)


def _message(e: Exception) -> str:
    return str(e) if isinstance(e, EdgeLLMError) else f"{type(e).__name__}: {e}"


def _send(req: Request, ev) -> None:
    try:
        req.on_event(ev)
    except Exception:  # a listener that went away must not stop the model thread
        req.cancel()


def _logprobs(logits: np.ndarray, token: int, k: int, tok) -> tuple:
    """(token, logprob, [(token, logprob) for the k most likely]) from the model's distribution."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top = np.argpartition(-x, k)[:k] if 0 < k < x.size else np.arange(0)
    top = top[np.argsort(-x[top], kind="stable")]
    return token, float(x[token] - lse), [(int(i), float(x[i] - lse)) for i in top]
