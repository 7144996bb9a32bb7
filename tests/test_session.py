"""m.chat and KV-cache prefix reuse (edgellm.session), on the cpu backend with the default model."""

import numpy as np
import pytest

from edgellm.errors import EdgeLLMError
from edgellm.session import TextStream, common_prefix

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def pool(default_model):
    """Three further KV slots (binding programs to a cache costs seconds: made once here)."""
    from edgellm.session import SlotPool

    return SlotPool(default_model, 3)


@pytest.fixture
def slot(pool):
    s = pool.slots[0]
    s.reset()  # the record starts empty: nothing in the cache is trusted
    return s


def test_second_turn_prefills_only_new_tokens_and_matches_a_fresh_run(default_model):
    m = default_model
    first = "".join(m.chat(QUESTION, max_tokens=16, temperature=0))
    s1 = m.last_stats
    assert "Paris" in first
    ids1 = m.chat_tokens(QUESTION)
    assert s1.prompt_tokens == len(ids1)
    history = QUESTION + [{"role": "assistant", "content": first},
                          {"role": "user", "content": "And what is the capital of Germany?"}]
    second = "".join(m.chat(history, max_tokens=16, temperature=0))
    s2 = m.last_stats
    ids2 = m.chat_tokens(history)
    assert s2.prompt_tokens == len(ids2)
    # the whole first prompt (and the answer's tokens that were fed back) came from the cache:
    # what was prefilled is at most the new turn's tokens
    assert s2.cached_tokens >= len(ids1)
    assert s2.prompt_tokens - s2.cached_tokens <= len(ids2) - len(ids1)
    assert s2.prompt_tokens - s2.cached_tokens > 0
    # the same greedy answer as the whole history run from an empty cache
    fresh = "".join(m.generate(ids2, max_tokens=16, temperature=0))
    assert m.last_stats.cached_tokens == 0
    assert second == fresh
    assert "Berlin" in second


def test_reused_prefix_gives_the_logits_of_a_fresh_run(default_model, slot):
    m = default_model
    ids = m.chat_tokens(QUESTION + [{"role": "assistant", "content": "Paris."},
                                    {"role": "user", "content": "Why?"}])
    m.forward(ids[:20], 0, all_logits=False, slot=slot)
    assert slot.tokens == ids[:20]
    p = slot.reusable_prefix(ids)
    assert p == 20
    reused = m.forward(ids[p:], p, all_logits=False, slot=slot)[-1]
    assert slot.tokens == ids
    fresh = m.forward(ids, 0, all_logits=False)[-1]  # the whole history from position 0, default slot
    np.testing.assert_allclose(reused, fresh, rtol=0, atol=2e-4)
    assert int(np.argmax(reused)) == int(np.argmax(fresh))


def test_slot_record_follows_what_the_cache_holds(default_model, slot):
    m = default_model
    a = m.tokenizer.encode("The capital of France is")
    b = m.tokenizer.encode("The capital of Spain is")
    m.forward(a, 0, all_logits=False, slot=slot)
    assert slot.tokens == a
    # overwriting from position 2 on: only the first two rows stay known
    m.forward(b[2:], 2, all_logits=False, slot=slot)
    assert slot.tokens == a[:2] + b[2:]
    assert slot.reusable_prefix(b) == len(b) - 1  # one token always runs, for its logits
    assert slot.reusable_prefix(a) == common_prefix(a, b)


@pytest.mark.parametrize("bad, what", [
    ([], "non-empty list"),
    ([{"role": "wizard", "content": "hi"}], "role"),
    ([{"role": "user", "content": 3}], "content"),
    (["hi"], r"messages\[0\] is a str"),
])
def test_bad_messages_are_one_line_errors(default_model, bad, what):
    with pytest.raises(EdgeLLMError, match=what):
        list(default_model.chat(bad, max_tokens=1))


def test_text_stream_cuts_at_stop_strings_across_tokens(default_model):
    tok = default_model.tokenizer
    ids = tok.encode(" Paris is the capital.\n\nBerlin is next.", add_bos=False)
    whole = tok.decode(ids)
    ts = TextStream(tok, stops=["\n\n"])
    out = ""
    for t in ids:
        out += ts.push(t)
        if ts.stopped:
            break
    assert ts.stopped and out == whole[: whole.index("\n\n")]
    # no stop string found: every piece comes out, the same as decode
    ts = TextStream(tok, stops=["zzz"])
    assert "".join(ts.push(t) for t in ids) + ts.flush() == whole


def test_batched_decode_step_equals_each_sequence_alone(default_model, pool):
    """SlotPool.decode: one step over several slots (one matrix product per linear layer, each row
    attending to its own slot up to its own position) gives every sequence the logits a fresh run
    of that sequence alone gives."""
    m = default_model
    assert pool.batch is not None
    seqs = [m.tokenizer.encode(t) for t in ("The capital of France is", "Once upon a time, in a land far away",
                                            "1, 2, 3,")]
    last = []
    # slot 2 holds the first sequence, slot 0 the second, slot 1 the third: rows are not slot order
    order = [pool.slots[2], pool.slots[0], pool.slots[1]]
    for slot, ids in zip(order, seqs):
        last.append(m.forward(ids, 0, all_logits=False, slot=slot)[-1])
    for step in range(2):
        nxt = [int(np.argmax(lg)) for lg in last]
        for ids, t in zip(seqs, nxt):
            ids.append(t)
        out = pool.decode([(slot, ids[-1], len(ids) - 1) for slot, ids in zip(order, seqs)])
        assert out.shape == (3, m.config.vocab_size)
        last = list(out)
    for slot, ids, lg in zip(order, seqs, last):
        assert slot.tokens == ids
        np.testing.assert_allclose(lg, m.forward(ids, 0, all_logits=False)[-1], rtol=0, atol=2e-4)
    with pytest.raises(EdgeLLMError, match="at most once"):
        pool.decode([(order[0], 1, 5), (order[0], 1, 6)])
    with pytest.raises(EdgeLLMError, match="outside slot"):
        pool.decode([(order[0], 1, m.ctx)])


def test_warmup_runs_every_row_count_and_leaves_no_trusted_rows(default_model, pool):
    """SlotPool.warmup (edgellm serve on a GPU): a step at each row count, then every slot's record
    is empty, so the garbage it wrote is never reused as a prompt prefix, and a sequence run
    afterwards gets a fresh run's logits."""
    m = default_model
    counts = []
    orig = pool.decode_tokens
    pool.decode_tokens = lambda steps, need: (counts.append(len(steps)), orig(steps, need))[1]
    try:
        n = pool.warmup()
    finally:
        del pool.decode_tokens
    assert sorted(set(counts)) == [1, 2, 3] and n == len(counts)
    assert all(s.tokens == [] for s in pool.slots)
    ids = m.tokenizer.encode("The capital of France is")
    assert pool.slots[1].reusable_prefix(ids) == 0
    got = m.forward(ids, 0, all_logits=False, slot=pool.slots[1])[-1]
    np.testing.assert_allclose(got, m.forward(ids, 0, all_logits=False)[-1], rtol=0, atol=2e-4)
