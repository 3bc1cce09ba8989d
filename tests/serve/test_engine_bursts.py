"""Several rounds per device call (`Engine(rounds_per_call=...)`, `RoundRunner.burst`): the same tokens as a round
per call, fewer host steps, and the host conditions that keep a call to one round (log-probs asked, a long prompt
prefilled by chunks, scheduler budgets; an explored width runs a short call), on `FakeRunner` (seconds); the resident
runner's program (`serve.runner._burst`) on the shipped pair: equal to a round per call and to each request run alone,
proposals accepted, nothing compiled while serving."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.compile_cache import CompileCounter
from dflash_jax.serve.engine import EXPLORE_CALL_ROUNDS, Engine, RoundInfo, generate
from dflash_jax.serve.runner import MAX_BURST, FakeRunner, fake_pair
from dflash_jax.spec import SamplingParams
from dflash_jax.spec import generate as spec_generate

VOCAB = 256
PROMPTS = [[1, 2, 3], [5], [7, 8], [9, 10, 11, 12]]
BUDGETS = [30, 25, 40, 12]


def make(**kw) -> Engine:
    args = dict(slots=4, max_prompt_len=64, max_new_tokens=40, max_queue=8, prefill_chunk=None, widths=[4],
                round_seconds={4: 1.0})
    args.update(kw)
    eng = Engine(fake_pair(vocab_size=VOCAB), runner=FakeRunner, **args)
    eng.warmup([16])
    return eng


def alone(prompt, budget):
    return FakeRunner.alone(prompt, budget, VOCAB)


def run(eng, prompts=PROMPTS, budgets=BUDGETS):
    infos = []
    eng.observers.append(infos.append)
    reqs = generate(eng, prompts, max_new_tokens=budgets, stop_ids=[])
    eng.observers.remove(infos.append)
    return reqs, infos


def test_bursts_give_the_tokens_of_a_round_per_call_in_fewer_steps():
    one, _ = run(make(rounds_per_call=1))
    eng = make(rounds_per_call=4)
    calls = dict(eng.runner.calls)  # the warm-up's
    reqs, infos = run(eng)
    assert [r.tokens for r in reqs] == [r.tokens for r in one] == [alone(p, m) for p, m in zip(PROMPTS, BUDGETS)]
    assert eng.burst_calls > 0 and eng.runner.calls["burst"] - calls["burst"] == eng.burst_calls
    assert max(i.rounds for i in infos) == 4 and all(1 <= i.rounds <= 4 for i in infos)
    verify_steps = [i for i in infos if i.width]
    verifies = eng.runner.calls["verify"] - calls["verify"]
    assert sum(i.rounds for i in verify_steps) == verifies > len(verify_steps)  # several verifies per step
    # each verify's commits recorded, in order, per request
    for r in reqs:
        assert sum(r.acceptance) == len(r.tokens) - 1 and all(c >= 1 for c in r.acceptance)
    assert sum(len(i.committed) for i in infos) == sum(len(r.acceptance) for r in reqs)


def test_auto_sizes_calls_by_the_measured_round_time():
    eng = make()  # rounds_per_call="auto", call_seconds 0.05
    reqs, infos = run(eng)
    assert [r.tokens for r in reqs] == [alone(p, m) for p, m in zip(PROMPTS, BUDGETS)]
    first = next(i for i in infos if i.width)
    assert first.rounds == 1  # nothing timed yet at this row bucket and width
    assert max(i.rounds for i in infos) > 1  # a fake round takes microseconds: many fit in 50 ms
    assert max(i.rounds for i in infos) <= MAX_BURST
    slow = make(call_seconds=1e-9)  # no room for a second round
    run(slow)
    assert slow.burst_calls == 0


def test_a_full_engine_ends_the_call_when_a_row_finishes():
    eng = make(slots=2, rounds_per_call=MAX_BURST)
    prompts, budgets = [[1], [2, 2], [3, 3, 3]], [6, 40, 20]
    reqs, infos = run(eng, prompts, budgets)
    assert [r.tokens for r in reqs] == [alone(p, m) for p, m in zip(prompts, budgets)]
    # the third request waited for a slot: the call in which the first finished ended there, and it joined next
    finished = next(k for k, i in enumerate(infos) if i.finished)
    assert infos[finished + 1].admitted == 1
    assert reqs[2].first_token_at is not None and reqs[2].first_token_at < reqs[1].finished_at


def test_conditions_that_keep_a_round_per_call():
    # log-probs asked: a round per call (the verify's logits are read after each)
    eng = make(rounds_per_call=4)
    req = eng.submit([1, 2, 3], max_new_tokens=20, stop_ids=[], logprobs=2)
    eng.run_until_idle()
    assert eng.burst_calls == 0 and req.tokens == alone([1, 2, 3], 20)
    # a scheduler budget: every round decides who verifies
    eng = make(rounds_per_call=4, token_budget=4)
    reqs, _ = run(eng)
    assert eng.burst_calls == 0 and [r.tokens for r in reqs] == [alone(p, m) for p, m in zip(PROMPTS, BUDGETS)]
    # a long prompt prefilled by chunks: one chunk per round, so a round per call until it joined
    eng = make(rounds_per_call=4, prefill_chunk=16, prefix_cache_bytes=0)
    long_prompt = list(np.random.default_rng(0).integers(3, VOCAB, 50))
    short = eng.submit([1, 2, 3], max_new_tokens=30, stop_ids=[])
    eng.step()
    long_req = eng.submit([int(t) for t in long_prompt], max_new_tokens=10, stop_ids=[])
    chunked = 0
    while not long_req.tokens:
        info = eng.step()
        chunked += info.prefill_chunks
        assert info.rounds == 1 or eng._prefilling is None  # the step its last chunk joined in may run several
    assert chunked == 4
    eng.run_until_idle()
    assert eng.burst_calls > 0  # once it joined
    assert short.tokens == alone([1, 2, 3], 30) and long_req.tokens == alone([int(t) for t in long_prompt], 10)


def test_bursts_of_mixed_widths_and_cancel_between_calls():
    eng = make(widths=[1, 2, 4], round_seconds={1: 1.0, 2: 1.2, 4: 1.5}, rounds_per_call=3)
    cycle = iter([4, 1, 2] * 100)
    eng.choose_width = lambda live: next(cycle)
    keep = eng.submit([5, 6, 7], max_new_tokens=40, stop_ids=[])
    drop = eng.submit([8, 9], max_new_tokens=40, stop_ids=[])
    eng.step()
    eng.step()
    eng.cancel(drop)
    eng.run_until_idle()
    assert keep.tokens == alone([5, 6, 7], 40)
    assert drop.finish_reason == "cancelled" and drop.tokens == alone([8, 9], 40)[: len(drop.tokens)]
    assert len(drop.tokens) < 40 and eng.burst_calls > 0


def test_an_explored_width_runs_a_call_of_several_rounds():
    """An explored width runs a call of several rounds too (here the fixed 3 per call), so its learned cost per
    round is what a chosen round of it costs: a round alone would also pay the whole call's host work."""
    eng = make(widths=[1, 2, 4], round_seconds={1: 1.0, 2: 1.2, 4: 1.5}, rounds_per_call=3)

    def explore(live):
        eng._explored = 2
        return 2

    eng.choose_width = explore
    reqs, infos = run(eng)
    assert [r.tokens for r in reqs] == [alone(p, m) for p, m in zip(PROMPTS, BUDGETS)]
    explored = [i for i in infos if i.explored]
    assert explored and all(i.width == 2 for i in explored) and max(i.rounds for i in explored) == 3
    assert eng.explore_rounds[2] > 0


def test_an_explored_width_runs_a_short_call_priced_net_of_the_call():
    """With calls sized by time, a chosen width's calls run up to `MAX_BURST` rounds, an explored width's only
    `EXPLORE_CALL_ROUNDS` (a width that does not pay costs a few rounds), and a round of a call is priced at its share
    of the call's time less the call's host work timed at warm-up, so short and long calls price rounds alike."""
    scale = MAX_BURST // 16 + 1  # budgets longer than a chosen call's whole run (up to 4 tokens a round)
    eng = make(widths=[1, 2, 4], round_seconds={1: 1.0, 2: 1.2, 4: 1.5}, rounds_per_call="auto",
               max_new_tokens=200 * scale)
    steps = iter(range(10**6))

    def choose(live):  # every other step explores width 2
        eng._explored = 2 if next(steps) % 2 else None
        return eng._explored or 4

    eng.choose_width = choose
    budgets = [200 * scale, 150 * scale, 180 * scale, 120 * scale]
    reqs, infos = run(eng, budgets=budgets)
    assert [r.tokens for r in reqs] == [alone(p, m) for p, m in zip(PROMPTS, budgets)]
    explored = [i for i in infos if i.explored]
    chosen = [i for i in infos if i.width and not i.explored]
    assert explored and all(i.burst and i.width == 2 for i in explored if i.rounds > 1)
    assert max(i.rounds for i in explored) == EXPLORE_CALL_ROUNDS < max(i.rounds for i in chosen)

    eng.call_overhead[4] = 0.2
    eng._device_seconds = 1.1
    assert eng._round_seconds(RoundInfo(rows=4, rounds=3, burst=True)) == pytest.approx(0.3)
    assert eng._round_seconds(RoundInfo(rows=4, rounds=1)) == pytest.approx(1.1)  # a round alone: its time
    eng.call_overhead[4] = 0.9  # at most half the call's time is the call's own
    assert eng._round_seconds(RoundInfo(rows=4, rounds=3, burst=True)) == pytest.approx(0.55 / 3)


def test_an_explored_call_is_long_enough_that_its_own_work_prices_little():
    """Where a call's own work (`call_overhead`: on a CPU the cut and write-back of its rows' caches, 1 - 3 ms) is
    large against the explored width's rounds, the explored call runs enough rounds that it is at most
    1 / `EXPLORE_CALL_SHARE` of the call (an error in it then prices the rounds little wrong), never more than the
    call would run anyway; with little of it, `EXPLORE_CALL_ROUNDS`."""
    eng = make(widths=[1, 4], round_seconds={1: 1e-3, 4: 2e-3}, rounds_per_call="auto", max_new_tokens=200)
    eng.call_overhead = {rows: 1e-4 for rows in eng.row_buckets}
    assert eng._explore_count(4, 1) == EXPLORE_CALL_ROUNDS  # 3 rounds of 1 ms: 0.1 ms is little
    eng.call_overhead[4] = 2.5e-3  # 3 rounds of width 1 would be mostly the call's own work
    assert eng._explore_count(4, 1) == 5 and eng._explore_count(4, 4) == EXPLORE_CALL_ROUNDS
    eng._explored = 1  # the call as sized: no more rounds than the width's calls run
    assert eng._burst_count(4, 1, None) == 5
    eng.call_overhead[4] = 0.03
    eng._explored = None
    whole = eng._burst_count(4, 1, None)
    eng._explored = 1
    assert eng._explore_count(4, 1) > whole > EXPLORE_CALL_ROUNDS and eng._burst_count(4, 1, None) == whole


def test_bad_rounds_per_call_named():
    for bad in (0, MAX_BURST + 1, "many", 2.5):
        with pytest.raises((TypeError, ValueError), match="rounds_per_call"):
            Engine(fake_pair(vocab_size=VOCAB), runner=FakeRunner, slots=2, rounds_per_call=bad)
    for bad in (0, -1.0, "1"):
        with pytest.raises(ValueError, match="call_seconds"):
            Engine(fake_pair(vocab_size=VOCAB), runner=FakeRunner, slots=2, call_seconds=bad)
    # the held context rows: at least a block (4) and a call's rounds
    for bad in (MAX_BURST + 3, 0, -5, "auto", 30.5):
        with pytest.raises((TypeError, ValueError), match="defer_context"):
            Engine(fake_pair(vocab_size=VOCAB), runner=FakeRunner, slots=2, block_size=4, defer_context=bad)
    for fine in (True, False, MAX_BURST + 4, 500):
        Engine(fake_pair(vocab_size=VOCAB), runner=FakeRunner, slots=2, block_size=4, defer_context=fine)
    for bad in ("yes", 1, None):  # width-1 rounds that skip the taps: a flag
        with pytest.raises(TypeError, match="skip_context"):
            Engine(fake_pair(vocab_size=VOCAB), runner=FakeRunner, slots=2, block_size=4, skip_context=bad)
    # a runner that cannot catch up (no model here) holds the taps
    assert not Engine(fake_pair(vocab_size=VOCAB), runner=FakeRunner, slots=2, block_size=4,
                      skip_context=True).skip_context


# -- the resident runner on the shipped pair -------------------------------------------------------------------


def test_resident_bursts_equal_rounds_and_alone(pair, engine):
    """The session engine (4 slots, block 4, rounds_per_call "auto") runs its calls of several rounds once a round
    of the row bucket is timed; greedy and seeded sampled requests equal the library run alone, and the engine
    with a round per call, with proposals accepted and nothing compiled."""
    assert engine.rounds_per_call == "auto"
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(40, 52)), [17, 3]]
    budgets = [48, 30, 40, 24]
    sampling = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(), SamplingParams()]
    calls = engine.burst_calls
    with CompileCounter() as counter:
        reqs = generate(engine, prompts, max_new_tokens=budgets, sampling=sampling, seed=3)
    assert counter.compiles == 0
    assert engine.burst_calls > calls
    for i, r in enumerate(reqs):
        lib = spec_generate(pair, [prompts[i]], max_new_tokens=budgets[i], sampling=sampling[i], seed=3)
        assert r.tokens == lib.tokens[0], i
    assert np.mean([np.mean(r.acceptance) for r in reqs]) > 1.5  # proposals accepted
    engine.rounds_per_call = 1
    try:
        calls = engine.burst_calls
        again = generate(engine, prompts, max_new_tokens=budgets, sampling=sampling, seed=3)
        assert engine.burst_calls == calls
    finally:
        engine.rounds_per_call = "auto"
    assert [r.tokens for r in again] == [r.tokens for r in reqs]


def test_serve_cli_flags_checked():
    from dflash_jax.errors import UsageError
    from dflash_jax.cli.serve import MAX_ROUNDS_PER_CALL, build_parser, check_args

    assert MAX_ROUNDS_PER_CALL == MAX_BURST  # the parser's bound, written out, is the runner's
    for flags, message in ((["--rounds-per-call", "0"], "--rounds-per-call must be"),
                           (["--rounds-per-call", str(MAX_BURST + 1)], "--rounds-per-call must be"),
                           (["--rounds-per-call", "some"], "--rounds-per-call must be"),
                           (["--call-ms", "0"], "--call-ms must be")):
        with pytest.raises(UsageError, match=message):
            check_args(build_parser().parse_args(flags))
    args = build_parser().parse_args(["--rounds-per-call", "3"])
    check_args(args)
    assert args.rounds_per_call == 3
    args = build_parser().parse_args(["--rounds-per-call", str(MAX_BURST)])
    check_args(args)
    assert args.rounds_per_call == MAX_BURST
