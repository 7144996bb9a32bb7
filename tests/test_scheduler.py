"""The continuous-batching scheduler in process (cpu backend, default model): queue bound,
cancellation, per-request parameters, interleaved prefill, batched decode and chained greedy steps."""

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


# -- chained greedy steps (Scheduler chain=True; on a GPU by default) ---------------------------------
def _run_through(m, requests, parallel: int, chain: bool, overlap: bool = False):
    """Run requests (Request kwargs each) through a scheduler of `parallel` slots, all queued before
    it starts (beyond the slots they wait); their events, the pool and the row count of each
    chained step (SlotPool.decode_next)."""
    from edgellm.session import SlotPool

    pool = SlotPool(m, parallel)
    pool.overlaps = overlap  # the cpu backend's steps are done when queued; the step order is what is tested
    chained = []
    decode_next = pool.decode_next
    pool.decode_next = lambda prev: chained.append(len(prev.rows)) or decode_next(prev)
    s = Scheduler(m, parallel, pool=pool, chain=chain)
    assert s.chain is chain
    outs = [Collect() for _ in requests]
    for kw, out in zip(requests, outs):
        s.submit(Request(on_event=out, **kw))
    s.start()
    try:
        for out in outs:
            assert out.done.wait(300)
        assert s.counts()["busy"] == 0
        return outs, pool, chained
    finally:
        s.stop()


def _usage(out):
    done = out.events[-1]
    assert isinstance(done, Done)
    return done.finish_reason, done.prompt_tokens, done.completion_tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_chained_steps_give_the_answers_of_requests_run_one_at_a_time(default_model, overlap):
    """Greedy requests that end at different steps, by max_tokens, a stop string, an end-of-turn
    token or the end of the context, decoded with each step queued before the previous step's
    tokens are read (fed its argmax on the device), get the text, finish reason and usage of each
    request run alone and unchained; six requests on three slots, so that three are admitted into
    slots freed by chained requests."""
    m = default_model
    greedy = SamplingParams(temperature=0)
    story = m.tokenizer.encode("Once upon a time, in a land far away,")
    text = m.tokenizer.decode(_greedy_alone(m, story, 12))
    stop = text.strip().split()[3]  # a word in the middle of the greedy answer
    requests = [dict(prompt=m.prompt_tokens("What is 2+2? Answer with one number."), max_tokens=20, params=greedy),
                dict(prompt=story, max_tokens=12, params=greedy, stops=(stop,), ignore_eos=True),
                dict(prompt=m.tokenizer.encode("The capital of France is"), max_tokens=9, params=greedy,
                     ignore_eos=True),
                dict(prompt=m.tokenizer.encode("1, 2, 3,"), max_tokens=4, params=greedy, ignore_eos=True),
                dict(prompt=m.prompt_tokens("Hello"), max_tokens=15, params=greedy),
                dict(prompt=m.tokenizer.encode("1, 2, 3, " * m.ctx)[:m.ctx - 6], max_tokens=20, params=greedy,
                     ignore_eos=True)]  # ends at the end of the context
    alone = [_run_through(m, [kw], 1, chain=False)[0][0] for kw in requests]
    together, _, chained = _run_through(m, requests, 3, chain=True, overlap=overlap)
    assert chained and max(chained) == 3, "no chained step of three sequences"
    assert [_usage(a)[0] for a in alone] == ["stop", "stop", "length", "length", "stop", "length"]
    assert _usage(alone[-1])[2] < 20
    assert alone[1].text() == text[:text.index(stop)]
    for a, b in zip(alone, together):
        assert b.text() == a.text() and b.tokens() == a.tokens()
        assert _usage(b) == _usage(a)


def test_a_slot_freed_by_a_chained_request_holds_a_truthful_prefix(default_model):
    """A chained sequence that ends by an end-of-turn token or a stop string has run one step more
    than its answer: that step's input token is in the slot's record with its K/V row, and the
    record holds nothing else. The next request on the slot skips that prefix and gets the
    tokens and log-probabilities of a fresh run."""
    m = default_model
    greedy = SamplingParams(temperature=0)
    eot = m.prompt_tokens("What is 2+2? Answer with one number.")
    story = m.tokenizer.encode("Once upon a time, in a land far away,")
    ref = _greedy_alone(m, story, 12)
    text = m.tokenizer.decode(ref)
    stop = text.strip().split()[3]
    for kw in (dict(prompt=eot, max_tokens=20, params=greedy),
               dict(prompt=story, max_tokens=12, params=greedy, stops=(stop,), ignore_eos=True)):
        (out,), pool, chained = _run_through(m, [kw], 1, chain=True, overlap=True)
        assert chained
        record, prompt = list(pool.slots[0].tokens), kw["prompt"]
        answer = out.tokens()
        if _usage(out)[0] == "stop" and not kw.get("stops"):  # ended by an end-of-turn token: fed once more
            assert record == prompt + answer + [_greedy_alone(m, prompt, len(answer) + 1)[-1]]
        else:  # the stop string's token and the one after it were fed
            assert len(answer) < 12 and record == prompt + ref[:len(answer) + 1]
        # the next request on the slot: the record is its prompt's prefix, then a question
        follow = record + m.tokenizer.encode(" Then what?")
        s = Scheduler(m, 1, pool=pool, chain=True).start()
        try:
            got = Collect()
            s.submit(Request(follow, 6, greedy, ignore_eos=True, logprobs=0, on_event=got))
            assert got.done.wait(120)
        finally:
            s.stop()
        assert got.events[-1].cached_tokens == len(record)
        want = _greedy_alone(m, follow, 6)
        assert got.tokens() == want
        x = m.forward(follow + want[:-1], 0, all_logits=True)[len(follow) - 1:]
        fresh = [float(r[t] - r.max() - np.log(np.exp(r - r.max()).sum())) for r, t in zip(x, want)]
        lps = [lp for e in got.events if isinstance(e, Piece) for _, lp, _ in (e.logprobs or [])]
        np.testing.assert_allclose(lps, fresh, rtol=0, atol=1e-3)


def test_a_request_cancelled_in_a_chained_batch_frees_its_slot_within_a_step(default_model):
    """A greedy request cancelled while its next step is in flight is done (Done 'cancelled') at
    the next step; its slot goes to the waiting request, which gets a fresh run's tokens, and the
    others' answers do not change. The cancellation comes as the step that produces a stop
    string's token is read: the step in flight is settled after that token's text is delivered,
    so the request it ends counts the tokens of the step-by-step order."""
    from edgellm.session import SlotPool

    m = default_model
    greedy = SamplingParams(temperature=0)
    prompts = [m.tokenizer.encode(t) for t in ("Once upon a time, in a land far away,", "The capital of France is",
                                                "1, 2, 3,")]
    text = m.tokenizer.decode(_greedy_alone(m, prompts[0], 12))
    stopped = dict(prompt=prompts[0], max_tokens=12, params=greedy, stops=(text.strip().split()[3],),
                   ignore_eos=True)
    alone = _run_through(m, [stopped], 1, chain=False)[0][0]
    j = _usage(alone)[2]  # the token that completes the stop string
    assert 2 <= j < 12
    pool = SlotPool(m, 3)
    pool.overlaps = True  # the GPU's order: the next step queued before the previous tokens are delivered
    s = Scheduler(m, 3, pool=pool, chain=True)
    outs = [Collect() for _ in range(4)]
    steps_at = []  # the scheduler's step count at the cancellation and at its Done

    def cancel(ev):  # on the model thread, with the next step in flight
        outs[1](ev)
        if isinstance(ev, Done):
            steps_at.append(s.steps)
        elif len(outs[1].tokens()) == j - 1 and not steps_at:
            steps_at.append(s.steps)
            reqs[1].cancel()
    reqs = [Request(on_event=outs[0], **stopped), Request(prompts[1], 10, greedy, ignore_eos=True, on_event=cancel),
            Request(prompts[2], 10, greedy, ignore_eos=True, on_event=outs[2]),
            Request(prompts[1], 8, greedy, ignore_eos=True, on_event=outs[3])]  # waits for a slot
    for r in reqs:  # queued before the loop starts: the first three decode in step
        s.submit(r)
    s.start()
    try:
        for out in outs:
            assert out.done.wait(120)
        assert s.counts()["busy"] == 0
    finally:
        s.stop()
    assert _usage(outs[1])[0] == "cancelled" and steps_at[1] - steps_at[0] <= 1
    got = outs[1].tokens()  # and the token read with its cancellation, if delivered before it was seen
    assert j - 1 <= len(got) <= j and got == _greedy_alone(m, prompts[1], len(got))
    assert outs[0].text() == alone.text() and _usage(outs[0]) == _usage(alone)
    assert outs[3].events[-1].cached_tokens > 0  # the cancelled request's slot, its prompt kept
    for i, n in ((2, 10), (3, 8)):
        ids = prompts[i if i < 3 else 1]
        assert outs[i].tokens() == _greedy_alone(m, ids, n) and _usage(outs[i]) == ("length", len(ids), n)


def test_chained_steps_on_the_cuda_backend_feed_the_argmax_on_the_device(tmp_path, monkeypatch):
    """SlotPool.decode_next on the cuda backend's programs (without a GPU: on the cpu, the kernels
    in Triton's interpreter): the rows program (three slots) and the single-sequence program (one
    slot) take the previous step's argmax as a tensor on the device. Three steps queued before
    any is read give the tokens and slot records of steps fed the same tokens from the host."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("EDGELLM_CUDA_DEVICE", "cpu")
    import edgellm
    from edgellm.session import SlotPool
    from edgellm.synthetic import SyntheticSpec, write_synthetic_gguf

    spec = SyntheticSpec(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                         weight_type="F16", std=0.1, seed=31)
    m = edgellm.load(write_synthetic_gguf(tmp_path / "m.gguf", spec), backend="cuda", ctx=24, prefill_chunk=8)
    chained, fed = SlotPool(m, 3), SlotPool(m, 3)
    assert chained.batch.rows_mode
    for pool in (chained, fed):
        for slot, ids in zip(pool.slots, ([3, 5, 7, 9], [11, 2], [4, 4, 4, 8, 1])):
            m.forward(ids, 0, all_logits=False, slot=slot)
    for rows in ([2, 0, 1], [1]):
        steps = [chained.decode_start([(chained.slots[i], 1, len(chained.slots[i].tokens)) for i in rows],
                                      [False] * len(rows))]
        for _ in range(2):
            steps.append(chained.decode_next(steps[-1]))
        got = [step()[0].tolist() for step in steps]
        assert steps[1]()[0].tolist() == got[1]  # read again: the same result, nothing recorded twice
        want, tokens = [], [1] * len(rows)
        for _ in range(3):
            tokens = fed.decode_tokens([(fed.slots[i], t, len(fed.slots[i].tokens)) for i, t in zip(rows, tokens)],
                                       [False] * len(rows))[0].tolist()
            want.append(tokens)
        assert got == want
        assert [s.tokens for s in chained.slots] == [s.tokens for s in fed.slots]
