"""The host engine's `n` samples of one prompt, log-probs and prompt scores, on `serve.runner.FakeRunner` (no model,
no compile: seconds). A sample's output must equal `FakeRunner.alone(.., fold=index)` whatever joined around it, its
prompt must be prefilled once, and each token's log-prob must be the fake runner's score of that very token at that
position (so a log-prob attached to the wrong token, row or round shows)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.serve.engine import Engine, RequestError
from dflash_jax.serve.runner import TOP_LOGPROBS, FakeRunner, fake_pair

VOCAB = 256


def make(**kw) -> Engine:
    args = dict(slots=4, max_prompt_len=64, max_new_tokens=40, max_queue=8, prefill_chunk=None,
                widths=[1, 2, 4], round_seconds={1: 1.0, 2: 1.2, 4: 1.5})
    args.update(kw)
    eng = Engine(fake_pair(vocab_size=VOCAB), runner=FakeRunner, **args)
    eng.warmup([16])
    return eng


def check_logprobs(req) -> None:
    assert len(req.token_logprobs) == len(req.tokens) == len(req.top_logprobs)
    for pos, (tok, lp, top) in enumerate(zip(req.tokens, req.token_logprobs, req.top_logprobs)):
        assert lp == pytest.approx(FakeRunner.logprob(tok, pos)), pos
        assert len(top) == req.logprobs
        assert [t for t, _ in top] == [(tok + i) % VOCAB for i in range(req.logprobs)]


@pytest.mark.parametrize("chunk", [None, 8])
def test_n_samples_share_one_prefill_and_equal_their_folds(chunk):
    eng = make(prefill_chunk=chunk)
    prefills, chunks = eng.runner.calls["prefill"], eng.runner.calls["chunk"]
    prompt = list(range(3, 3 + (20 if chunk else 5)))
    other = eng.submit([9, 9], max_new_tokens=12)
    head = eng.submit(prompt, max_new_tokens=30, n=3)
    assert [r.index for r in head.samples] == [0, 1, 2]
    eng.run_until_idle()
    assert other.tokens == FakeRunner.alone([9, 9], 12, VOCAB)
    outs = [r.tokens for r in head.samples]
    assert outs == [FakeRunner.alone(prompt, 30, VOCAB, fold=i) for i in range(3)]
    assert len({tuple(o) for o in outs}) == 3  # independent samples
    assert eng.runner.calls["fork"] >= 1
    if chunk is None:  # the other request and the prompt: two prefills (not 1 + 3)
        assert eng.runner.calls["prefill"] - prefills <= 2
    else:  # the long prompt's chunks ran once
        assert eng.runner.calls["chunk"] - chunks == -(-len(prompt) // eng.prefill_chunk)
    assert all(r.finish_reason == "length" for r in head.samples)


def test_n_waits_for_enough_free_slots_and_holds_the_line():
    eng = make()
    first = [eng.submit([i + 1], max_new_tokens=20) for i in range(3)]
    eng.step()
    head = eng.submit([7, 7, 7], max_new_tokens=6, n=2)
    late = eng.submit([5], max_new_tokens=4)
    eng.step()
    assert head.slot is None and late.slot is None  # one free slot: the pair waits, and the one behind it too
    eng.run_until_idle()
    assert [r.tokens for r in head.samples] == [FakeRunner.alone([7, 7, 7], 6, VOCAB, fold=i) for i in range(2)]
    assert late.tokens == FakeRunner.alone([5], 4, VOCAB)
    assert all(r.tokens == FakeRunner.alone([i + 1], 20, VOCAB) for i, r in enumerate(first))


def test_logprobs_follow_each_token():
    eng = make()
    plain = eng.submit([1, 2], max_new_tokens=25)
    scored = eng.submit([3, 4], max_new_tokens=25, logprobs=3)
    many = eng.submit([5, 6], max_new_tokens=17, logprobs=0, n=2)
    eng.run_until_idle()
    assert plain.token_logprobs == [] and plain.top_logprobs == []
    check_logprobs(scored)
    for r in many.samples:
        check_logprobs(r)
        assert r.top_logprobs[0] == []


def test_prompt_scores_and_bad_requests():
    eng = make()
    req = eng.submit([3, 4, 5, 6], max_new_tokens=4, logprobs=1, prompt_logprobs=True)
    eng.run_until_idle()
    assert eng.runner.calls["prompt_logprobs"] == 1
    s = req.prompt_scores
    assert s.logprob.shape == (3,) and s.top_id.shape == (3, min(TOP_LOGPROBS, VOCAB))
    assert s.logprob.tolist() == pytest.approx([FakeRunner.logprob(t, -1 - i) for i, t in enumerate([4, 5, 6])])
    head = eng.submit([3, 4, 5, 6], max_new_tokens=4, logprobs=1, prompt_logprobs=True, n=3)
    eng.run_until_idle()
    assert eng.runner.calls["prompt_logprobs"] == 2  # scored once for its three samples
    assert all(r.prompt_scores is head.prompt_scores for r in head.samples)
    for bad in (dict(n=0), dict(n=5), dict(n=1.5), dict(logprobs=TOP_LOGPROBS + 1), dict(logprobs=-1)):
        with pytest.raises(RequestError):
            eng.submit([1], max_new_tokens=2, **bad)


def test_cancelling_a_queued_request_ends_its_samples():
    eng = make(slots=2)
    busy = [eng.submit([i + 1], max_new_tokens=30) for i in range(2)]
    eng.step()
    head = eng.submit([4], max_new_tokens=5, n=2)
    eng.cancel(head)
    eng.step()
    assert [r.finish_reason for r in head.samples] == ["cancelled", "cancelled"]
    assert all(r.done_event.is_set() for r in head.samples)
    eng.run_until_idle()
    assert all(r.finish_reason == "length" for r in busy)
    assert np.all([len(r.tokens) == 30 for r in busy])
