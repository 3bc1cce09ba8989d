"""The continuous-batching engine: lossless against each request run alone (greedy and sampled), with rows
sitting rounds out, requests queueing, joining and leaving mid-decode; no compiles after warm-up;
cancellation; graceful stop; request validation."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dflash_jax.compile_cache import CompileCounter
from dflash_jax.serve import scheduler as sched
from dflash_jax.serve.engine import QueueFull, RequestError, generate as serve_generate
from dflash_jax.spec import SamplingParams
from dflash_jax.spec import generate as spec_generate

EOS = 1022
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [7] * 12, list(range(40, 56)), [1, 2, 3, 4], [900, 17]]
BUDGETS = [40, 30, 64, 20, 50, 33]
SAMPLING = [SamplingParams(), SamplingParams(temperature=0.9), SamplingParams(),
            SamplingParams(temperature=1.2, top_k=20), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams()]
STOPS = [[EOS], [], [EOS], [EOS, 17], [], [EOS]]
SEEDS = [0, 11, 2, 33, 4, 5]


def test_lossless_with_scheduling_queueing_and_no_compiles(engine, pair):
    """Six requests on four slots under a token budget of two verifies per round: rows sit rounds out (the
    scheduler), requests queue and join as others leave. Each request's output equals the same request run
    alone by `spec.generate` (greedy: the same tokens; sampled: the same draws from the same seed), and the
    engine compiles nothing."""
    saved = engine.budgets
    engine.budgets = sched.Budgets(tokens=2 * engine.block_size)
    rounds = []
    engine.observers.append(rounds.append)
    try:
        with CompileCounter() as counter:
            reqs = serve_generate(engine, PROMPTS, max_new_tokens=BUDGETS, sampling=SAMPLING, stop_ids=STOPS,
                                  seed=SEEDS)
    finally:
        engine.budgets = saved
        engine.observers.remove(rounds.append)
    assert counter.compiles == 0
    assert all(r.compiles == 0 for r in rounds)
    # the budget held (two verifies a round), the scheduler was work conserving (two whenever two were live)
    assert all(r.verified == min(2, r.live) and r.verify_tokens == r.verified * engine.block_size for r in rounds)
    assert {h for r in rounds for h in r.how.values()} <= {"deficit", "work"}
    assert sum(r.rounds_waited for r in reqs) > 0  # the scheduler really kept rows out of some verifies
    assert all(r.finish_reason in ("stop", "length") for r in reqs)
    assert not engine.requests and not engine.queue
    for i, r in enumerate(reqs):
        alone = spec_generate(pair, [PROMPTS[i]], max_new_tokens=BUDGETS[i], sampling=SAMPLING[i], stop_ids=STOPS[i],
                              seed=SEEDS[i])
        assert r.tokens == alone.tokens[0], i
        assert sum(r.acceptance) + 1 == len(r.tokens)
    assert np.mean([np.mean(r.acceptance) for r in reqs if not SAMPLING[reqs.index(r)].temperature]) > 1.3


@pytest.fixture
def round_per_call(engine):
    """The engine stepping one round per call (these tests cancel between rounds)."""
    engine.rounds_per_call = 1
    yield engine
    engine.rounds_per_call = "auto"


def test_cancel_frees_the_slot(round_per_call):
    engine = round_per_call
    keep = engine.submit([5, 6, 7], max_new_tokens=40, stop_ids=[])
    drop = engine.submit([8, 9, 10], max_new_tokens=40, stop_ids=[])
    engine.step()
    assert drop.slot is not None and len(engine.requests) == 2
    engine.cancel(drop)
    info = engine.step()
    assert drop.finish_reason == "cancelled" and drop.slot is None and drop.done_event.is_set()
    assert "cancelled" in info.finished and len(engine.requests) == 1
    engine.run_until_idle()
    assert keep.finish_reason == "length" and len(keep.tokens) == 40
    queued = engine.submit([1, 2], max_new_tokens=4)
    engine.cancel(queued)  # still in the queue: it never takes a slot
    engine.step()
    assert queued.finish_reason == "cancelled" and queued.tokens == []


def test_background_thread_and_graceful_stop(round_per_call):
    engine = round_per_call
    engine.start()
    try:
        reqs = [engine.submit([3, 4, 5 + i], max_new_tokens=30, stop_ids=[]) for i in range(3)]
    finally:
        engine.stop(timeout=60)  # graceful: in-flight requests finish
    assert all(r.finish_reason == "length" and len(r.tokens) == 30 for r in reqs)
    engine.start()
    slow = lambda info: time.sleep(0.05)  # noqa: E731
    engine.observers.append(slow)
    try:
        req = engine.submit([3, 4, 5], max_new_tokens=64, stop_ids=[])
        while not req.tokens:
            time.sleep(0.01)
    finally:
        engine.stop(cancel=True, timeout=60)  # shutdown that cancels in-flight work
        engine.observers.remove(slow)
    assert req.finish_reason == "cancelled" and len(req.tokens) < 64
    assert not engine.requests


def test_validation(engine):
    with pytest.raises(RequestError, match="max_tokens 65 is beyond"):
        engine.submit([1, 2], max_new_tokens=65)
    with pytest.raises(RequestError, match="vocabulary"):
        engine.submit([1, 5000], max_new_tokens=4)
    with pytest.raises(RequestError, match="at most 16"):
        engine.submit(list(range(17)), max_new_tokens=4)
    with pytest.raises(RequestError, match="rejection"):
        engine.submit([1], max_new_tokens=4, sampling=SamplingParams(temperature=1.0, mode="rejection"))
    saved, engine.max_queue = engine.max_queue, 1
    try:
        first = engine.submit([1], max_new_tokens=2)
        with pytest.raises(QueueFull, match="retry later"):
            engine.submit([1], max_new_tokens=2)
    finally:
        engine.max_queue = saved
    engine.run_until_idle()
    assert first.finish_reason in ("stop", "length")


def test_prefill_buckets_are_powers_of_two_capped():
    """The engine pads a prefill to `buckets.prompt` times a power of two (no fine 1.5x steps: half the prefill
    programs to compile at start), capped at the longest prompt prefilled whole; the chunk widths likewise, the
    chunk the widest."""
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    eng = Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=2, max_prompt_len=384, max_new_tokens=16,
                 prefill_chunk=None, widths=[4], round_seconds={4: 1.0})
    assert [eng.prompt_bucket(n) for n in (1, 16, 17, 33, 65, 200, 300, 384)] == [16, 16, 32, 64, 128, 256, 384, 384]
    eng = Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=2, max_prompt_len=384, max_new_tokens=16,
                 prefill_chunk=96, prefix_cache_bytes=0, widths=[4], round_seconds={4: 1.0})
    assert eng.chunk_widths() == [16, 32, 64, 96] and eng.prompt_bucket(90) == 96
    assert eng._batch([None]).tokens.shape[1] == 16
