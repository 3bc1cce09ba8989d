"""The host engine on `serve.runner.FakeRunner` (numpy rows, deterministic tokens, no model): admission into free
slots, the queue and QueueFull, cancellation, compaction, the scheduler's budgets, chunked prefill, finish reasons,
the background thread and a failed round. Every request's output must equal `FakeRunner.alone` (its tokens are a
function of its prompt and position), so a row that was dropped, moved wrongly, verified while it sat out or fed
the wrong chunk shows as a wrong output. No compile: seconds."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dflash_jax.serve import scheduler as sched
from dflash_jax.serve.engine import Engine, QueueFull, RequestError, generate
from dflash_jax.serve.runner import FakeRunner, fake_pair

VOCAB = 256


def make(**kw) -> Engine:
    args = dict(slots=3, max_prompt_len=64, max_new_tokens=40, max_queue=8, prefill_chunk=None,
                widths=[1, 2, 4], round_seconds={1: 1.0, 2: 1.2, 4: 1.5})
    args.update(kw)
    eng = Engine(fake_pair(vocab_size=VOCAB), runner=FakeRunner, **args)
    eng.warmup([16])
    return eng


def alone(prompt, budget, stops=()):
    return FakeRunner.alone(prompt, budget, VOCAB, stops)


def check_compact(eng: Engine) -> None:
    """The live requests lie within the smallest row bucket of as many rows (`Engine._compact`), each knows its
    slot."""
    if eng.requests:
        n = len(eng.requests)
        assert max(eng.requests) < min(b for b in eng.row_buckets if b >= n)
    assert all(r.slot == s for s, r in eng.requests.items())


def test_admission_fills_free_slots_in_one_group_and_queues_the_rest():
    eng = make(slots=4)
    prefills = eng.runner.calls["prefill"]
    reqs = [eng.submit([i + 1, i + 2, i + 3], max_new_tokens=30, stop_ids=[]) for i in range(6)]
    assert eng.queue_depth == 6 and eng.slots_in_use == 0
    info = eng.step()
    assert info.admitted == 4 and eng.slots_in_use == 4 and eng.queue_depth == 2
    assert eng.runner.calls["prefill"] == prefills + 1  # the four joined in one prefill (a group of 4)
    assert [r.slot for r in reqs] == [0, 1, 2, 3, None, None]
    assert all(len(r.tokens) >= 1 for r in reqs[:4]) and not any(r.tokens for r in reqs[4:])
    assert info.live == 4 and info.verified == 4 and info.rows == 4
    eng.run_until_idle()
    for i, r in enumerate(reqs):
        assert r.finish_reason == "length" and r.tokens == alone([i + 1, i + 2, i + 3], 30), i
    assert not eng.requests and not eng.queue
    three = make(slots=3)  # no group of 4 on 3 slots: one prefill per request
    prefills = three.runner.calls["prefill"]
    for i in range(3):
        three.submit([i + 1], max_new_tokens=5)
    assert three.step().admitted == 3 and three.runner.calls["prefill"] == prefills + 3


def test_queue_full_and_shutdown_refuse_new_requests():
    eng = make(max_queue=2)
    first = [eng.submit([1], max_new_tokens=4) for _ in range(2)]
    with pytest.raises(QueueFull, match="retry later"):
        eng.submit([1], max_new_tokens=4)
    eng.step()  # both take slots: the queue has room again
    third = eng.submit([2], max_new_tokens=4)
    eng.run_until_idle()
    assert all(r.finish_reason == "length" for r in first + [third])
    with pytest.raises(RequestError, match="max_tokens 41 is beyond"):
        eng.submit([1], max_new_tokens=41)
    with pytest.raises(RequestError, match="at most 64"):
        eng.submit(list(range(65)), max_new_tokens=4)
    with pytest.raises(RequestError, match="vocabulary"):
        eng.submit([VOCAB + 3], max_new_tokens=4)


def test_cancel_frees_the_slot_and_a_queued_cancel_never_takes_one():
    eng = make(slots=2)
    keep = eng.submit([5, 6, 7], max_new_tokens=30, stop_ids=[])
    drop = eng.submit([8, 9], max_new_tokens=30, stop_ids=[])
    waiting = eng.submit([3, 3, 3], max_new_tokens=12, stop_ids=[])
    queued_drop = eng.submit([4], max_new_tokens=12, stop_ids=[])
    eng.step()
    assert (keep.slot, drop.slot, waiting.slot) == (0, 1, None)
    releases = eng.runner.calls["release"]
    eng.cancel(drop)
    eng.cancel(queued_drop, reason="stop")
    info = eng.step()
    assert drop.finish_reason == "cancelled" and drop.slot is None and drop.done_event.is_set()
    assert queued_drop.finish_reason == "stop" and queued_drop.tokens == [] and queued_drop.slot is None
    assert sorted(info.finished) == ["cancelled", "stop"]
    assert eng.runner.calls["release"] > releases  # the cancelled row was marked done on the device
    assert waiting.slot == 1  # the freed slot went to the next in line, this same round
    eng.run_until_idle()
    assert keep.tokens == alone([5, 6, 7], 30) and waiting.tokens == alone([3, 3, 3], 12)
    assert len(drop.tokens) < 30 and drop.tokens == alone([8, 9], 30)[: len(drop.tokens)]


def test_compaction_keeps_live_rows_lowest_and_rows_move_with_their_state():
    eng = make(slots=4, row_buckets="auto", rounds_per_call=1)  # a step per round: every bucket it passes through
    assert eng.row_buckets == (1, 2, 4)
    jobs = [([1, 2], 6), ([3, 4, 5], 40), ([6], 9), ([7, 8, 9, 10], 25), ([11, 12], 3), ([13], 30)]
    reqs, moves, rows = [], eng.moves, set()
    for i, (p, m) in enumerate(jobs):
        reqs.append(eng.submit(p, max_new_tokens=m, stop_ids=[]))
        if i % 2:
            info = eng.step()
            check_compact(eng)
            rows.add(info.rows)
    while eng.queue or eng.requests:
        info = eng.step()
        check_compact(eng)
        if info.width:
            assert info.rows == min(b for b in eng.row_buckets if b >= info.live)
            rows.add(info.rows)
    assert eng.moves > moves and eng.runner.calls["move_row"] > 0
    assert {1, 4} <= rows
    for (p, m), r in zip(jobs, reqs):
        assert r.finish_reason == "length" and r.tokens == alone(p, m)


def test_finish_reasons_stop_length_and_stop_at_the_first_token():
    eng = make()
    prompt = [9, 8, 7]
    want = alone(prompt, 40)
    stop = want[5]
    first_stop = alone([4, 4], 1)[0]
    reqs = generate(eng, [prompt, [1, 2, 3], [4, 4]], max_new_tokens=[40, 17, 20],
                    stop_ids=[[stop], [], [first_stop]])
    cut = want.index(stop) + 1
    assert reqs[0].finish_reason == "stop" and reqs[0].tokens == want[:cut]
    assert reqs[1].finish_reason == "length" and reqs[1].tokens == alone([1, 2, 3], 17)
    assert reqs[2].finish_reason == "stop" and reqs[2].tokens == [first_stop]  # ended at its admission
    assert all(r.finished_at is not None and r.first_token_at is not None for r in reqs)
    assert sum(reqs[0].acceptance) + 1 == len(reqs[0].tokens)


def test_a_token_budget_keeps_rows_out_and_they_resume_as_they_were():
    eng = make(slots=4, widths=[4], round_seconds={4: 1.0}, token_budget=4)
    prompts = [[1, 2], [3], [4, 5, 6], [7, 7]]
    infos = []
    eng.observers.append(infos.append)
    reqs = generate(eng, prompts, max_new_tokens=[20, 25, 15, 30], stop_ids=[])
    assert all(i.verified <= 1 for i in infos)  # one verify of 4 tokens a round
    assert sum(r.rounds_waited for r in reqs) > 0
    assert {h for i in infos for h in i.how.values()} <= {"deficit", "work"}
    for p, m, r in zip(prompts, [20, 25, 15, 30], reqs):
        assert r.tokens == alone(p, m)
    # only the admitted row committed in each verify
    assert all(int(c.sum()) <= 1 for c in eng.runner.verified_rows[-len(infos):])


def test_any_mix_of_widths_gives_the_same_tokens():
    eng = make()
    cycle = iter([4, 1, 2, 4, 4, 1, 1, 2] * 50)
    eng.choose_width = lambda live: next(cycle)
    infos = []
    eng.observers.append(infos.append)
    reqs = generate(eng, [[1, 2, 3], [5]], max_new_tokens=30, stop_ids=[])
    assert {i.width for i in infos if i.width} == {1, 2, 4}
    assert [r.tokens for r in reqs] == [alone([1, 2, 3], 30), alone([5], 30)]


def test_chunked_prefill_one_chunk_a_round_while_others_decode():
    eng = make(prefill_chunk=16, prefix_cache_bytes=0)  # every chunk runs (a prompt seen before would hit)
    long_prompt = [int(t) for t in np.random.default_rng(0).integers(3, VOCAB, 50)]
    short = eng.submit([1, 2, 3], max_new_tokens=30, stop_ids=[])
    eng.step()
    long = eng.submit(long_prompt, max_new_tokens=12, stop_ids=[])
    behind = eng.submit([6, 6], max_new_tokens=10, stop_ids=[])
    infos = []
    eng.observers.append(infos.append)
    eng.run_until_idle()
    chunks = [i for i in infos if i.prefill_chunks]
    assert len(chunks) == 4 and all(i.prefill_chunks == 1 for i in chunks)  # 16 + 16 + 16 + 2, one a round
    # the request behind the long one joined whole in the round of the first chunk
    assert sum(i.prefill_tokens for i in chunks) == len(long_prompt) + len(behind.prompt)
    assert all(i.verified >= 1 for i in chunks)  # the live rows kept decoding meanwhile
    assert behind.first_token_at < long.first_token_at  # the short request behind it did not wait for it
    assert long.tokens == alone(long_prompt, 12) and short.tokens == alone([1, 2, 3], 30)
    assert behind.tokens == alone([6, 6], 10)
    # cancelled mid-prefill: its partial state is dropped, its reserved slot freed
    req = eng.submit(long_prompt, max_new_tokens=8, stop_ids=[])
    eng.step()
    assert eng._prefilling is not None and eng.queue_depth == 0
    eng.cancel(req)
    eng.step()
    assert req.finish_reason == "cancelled" and not req.tokens and eng._prefilling is None and not eng.queue


def test_background_thread_serves_and_stops():
    eng = make()
    eng.start()
    try:
        reqs = [eng.submit([3, 4, 5 + i], max_new_tokens=30, stop_ids=[]) for i in range(5)]
        assert all(r.wait(30) for r in reqs)
    finally:
        eng.stop(timeout=30)  # graceful: in-flight requests finish
    assert eng._thread is None
    assert all(r.finish_reason == "length" and r.tokens == alone([3, 4, 5 + i], 30) for i, r in enumerate(reqs))
    slow = lambda info: time.sleep(0.01)  # noqa: E731
    eng.observers.append(slow)
    eng.start()
    try:
        req = eng.submit([3, 4, 5], max_new_tokens=40, stop_ids=[])
        while not req.tokens:
            time.sleep(0.005)
    finally:
        eng.stop(cancel=True, timeout=30)
        eng.observers.remove(slow)
    assert req.finish_reason == "cancelled" and not eng.requests and not eng.queue


def test_a_failed_round_fails_its_requests_and_the_engine_recovers():
    eng = make()
    verify = eng.runner.verify
    broken = threading.Event()

    def failing(*args, **kwargs):
        if not broken.is_set():
            broken.set()
            raise RuntimeError("device lost")
        return verify(*args, **kwargs)

    eng.runner.verify = failing
    eng.start()
    try:
        failed = [eng.submit([1, 2], max_new_tokens=20, stop_ids=[]) for _ in range(2)]
        assert all(r.wait(30) for r in failed)
        assert all(r.finish_reason == "error" and "device lost" in r.error for r in failed)
        later = eng.submit([1, 2], max_new_tokens=20, stop_ids=[])
        assert later.wait(30)
    finally:
        eng.stop(timeout=30)
    assert later.finish_reason == "length" and later.tokens == alone([1, 2], 20)


def test_a_failed_prefill_fails_the_requests_it_was_admitting():
    """Requests taken from the queue for a prefill that raises are neither queued nor in a slot: they must still
    end (with the error), not hang their clients."""
    eng = make()
    prefill = eng.runner.prefill
    calls = []

    def failing(batch):
        calls.append(batch.real)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return prefill(batch)

    eng.runner.prefill = failing
    eng.start()
    try:
        joining = [eng.submit([7, 8], max_new_tokens=10, stop_ids=[]) for _ in range(2)]
        assert all(r.wait(30) for r in joining)
        later = eng.submit([7, 8], max_new_tokens=10, stop_ids=[])
        assert later.wait(30)
    finally:
        eng.stop(timeout=30)
    assert all(r.finish_reason == "error" and "out of memory" in r.error for r in joining)
    assert later.finish_reason == "length" and later.tokens == alone([7, 8], 10)


def test_scheduler_and_runner_wiring_without_a_model():
    """The byte budget comes from the runner ("auto": none for a runner without an expert cache; "cache" needs
    one), and RoundInfo's expert bytes are the verified rows' projected union."""
    eng = make(expert_byte_budget=2500.0, widths=[2], round_seconds={2: 1.0})
    assert eng.budgets.expert_bytes == 2500.0 and eng.expert_bytes.shape == (2, 8)
    infos = []
    eng.observers.append(infos.append)
    generate(eng, [[1], [2], [3]], max_new_tokens=10, stop_ids=[])
    assert all(i.expert_bytes <= 2500.0 + 2000.0 for i in infos if i.verified)  # one row may exceed it alone
    assert any(i.verified < i.live for i in infos)
    assert make().budgets.expert_bytes is None
    with pytest.raises(ValueError, match="needs an expert cache"):
        Engine(fake_pair(), runner=FakeRunner, slots=1, expert_byte_budget="cache")
    assert sched.Budgets().tokens is None
