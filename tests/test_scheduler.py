"""The continuous-batching scheduler in process (cpu backend, default model): queue bound,
cancellation, per-request parameters, interleaved prefill and batched decode."""

import threading
import time

import numpy as np
import pytest

from edgellm.sampling import SamplingParams
from edgellm.serve.scheduler import Done, Piece, QueueFullError, Request, Scheduler, ShuttingDownError


class Collect:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if not isinstance(ev, Piece):
            self.done.set()

    def text(self):
        return "".join(e.text for e in self.events if isinstance(e, Piece))

    def tokens(self):
        return [t for e in self.events if isinstance(e, Piece) for t in e.tokens]


def _greedy_alone(m, ids, n):
    """n greedy tokens after ids, one sequence on the model's own slot (end-of-turn not special)."""
    out = [int(np.argmax(m.forward(ids, 0, all_logits=False)[-1]))]
    for i in range(n - 1):
        out.append(int(np.argmax(m.forward(out[-1:], len(ids) + i, all_logits=False)[-1])))
    return out


def test_requests_joining_a_running_batch_get_their_own_greedy_tokens(default_model):
    m = default_model
    s = Scheduler(m, 3, chunk=4).start()  # chunk 4: prompts prefill in parts between decode steps
    try:
        prompts = [m.tokenizer.encode(t) for t in ("The capital of France is", "Once upon a time, in a land",
                                                    "1, 2, 3,")]
        outs = [Collect() for _ in prompts]
        for i, (ids, out) in enumerate(zip(prompts, outs)):
            s.submit(Request(ids, 5, SamplingParams(temperature=0), ignore_eos=True, on_event=out))
            time.sleep(0.3 * i)  # later requests join while earlier ones decode
        for out in outs:
            assert out.done.wait(120)
        for ids, out in zip(prompts, outs):
            assert out.tokens() == _greedy_alone(m, ids, 5)
            done = out.events[-1]
            assert isinstance(done, Done) and done.finish_reason == "length" and done.completion_tokens == 5
        assert s.counts()["busy"] == 0
    finally:
        s.stop()


def test_seeded_sampling_is_per_request(default_model):
    m = default_model
    s = Scheduler(m, 2).start()
    try:
        ids = m.tokenizer.encode("Once upon a time")
        outs = [Collect() for _ in range(3)]
        for seed, out in zip((7, 7, 8), outs):
            s.submit(Request(ids, 8, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed),
                             ignore_eos=True, on_event=out))
        for out in outs:
            assert out.done.wait(120)
        assert outs[0].tokens() == outs[1].tokens()  # same seed, same draws, whatever ran beside them
        assert outs[0].tokens() != outs[2].tokens()
    finally:
        s.stop()


def test_bounded_queue_cancellation_and_shutdown(default_model):
    m = default_model
    s = Scheduler(m, 1, max_queue=2)  # not started: nothing leaves the queue
    ids = m.tokenizer.encode("Hello")
    outs = [Collect() for _ in range(3)]
    reqs = [s.submit(Request(ids, 50, on_event=o)) for o in outs]  # one for the free slot, two waiting
    with pytest.raises(QueueFullError, match="busy"):
        s.submit(Request(ids, 50))
    reqs[1].cancel()
    s.start()
    assert outs[1].done.wait(60) and outs[1].events[-1].finish_reason == "cancelled"
    s.stop()
    for out in outs:
        assert out.done.wait(60)
        assert isinstance(out.events[-1], Done)
    assert s.counts()["busy"] == 0
    with pytest.raises(ShuttingDownError):
        s.submit(Request(ids, 1))


def _serve_all(m, requests, overlap: bool):
    """Run requests (Request kwargs each) together through a 3-slot scheduler; their events."""
    from edgellm.session import SlotPool

    pool = SlotPool(m, 3)
    pool.overlaps = overlap  # the cpu backend's steps are done when queued; the step order is what is tested
    s = Scheduler(m, 3, pool=pool).start()
    assert s.overlap is overlap
    try:
        outs = [Collect() for _ in requests]
        for kw, out in zip(requests, outs):
            s.submit(Request(on_event=out, **kw))
        for out in outs:
            assert out.done.wait(120)
        assert s.counts()["busy"] == 0
        return outs
    finally:
        s.stop()


def test_overlapped_steps_deliver_the_same_answers(default_model):
    """With overlap the next decode step is queued before the previous step's tokens are delivered:
    a stop string found in them ends a request that already ran one step more; that token is
    dropped, so text, tokens, finish reasons and usage are those of the step-by-step scheduler."""
    m = default_model
    ids = m.tokenizer.encode("Once upon a time, in a land far away,")
    ref = _greedy_alone(m, ids, 12)
    text = m.tokenizer.decode(ref)
    stop = text.strip().split()[3]  # a word in the middle of the greedy answer
    greedy = SamplingParams(temperature=0)
    requests = [dict(prompt=ids, max_tokens=12, params=greedy, ignore_eos=True),
                dict(prompt=ids, max_tokens=12, params=greedy, stops=(stop,), ignore_eos=True),
                dict(prompt=m.tokenizer.encode("1, 2, 3,"), max_tokens=5, params=greedy, logprobs=2)]
    plain = _serve_all(m, requests, overlap=False)
    overlapped = _serve_all(m, requests, overlap=True)
    assert plain[0].tokens() == ref
    assert stop in text and plain[1].text() == text[:text.index(stop)]
    assert plain[1].events[-1].finish_reason == "stop" and plain[1].events[-1].completion_tokens < 12
    for a, b in zip(plain, overlapped):
        assert b.text() == a.text() and b.tokens() == a.tokens()
        da, db = a.events[-1], b.events[-1]
        assert (db.finish_reason, db.completion_tokens) == (da.finish_reason, da.completion_tokens)
        lps = lambda out: [lp for e in out.events if isinstance(e, Piece) for lp in (e.logprobs or [])]
        assert [(t, k) for t, _, k in lps(b)] == [(t, k) for t, _, k in lps(a)]
        assert np.allclose([v for _, v, _ in lps(b)], [v for _, v, _ in lps(a)])
