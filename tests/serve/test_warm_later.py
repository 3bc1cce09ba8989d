"""Widths warmed after start (`Engine.warmup(later_widths=True)`, what `dflash-serve` does): the warm-up compiles,
runs and times the widest width only; the others join a row bucket's choice once the engine has warmed and timed them
there, a bucket at a time while it serves, and all of them while it waits. A learned table gains the new widths at
the load it shows (`join_widths`, pure: fast). The engine test compiles two widths' programs: slow."""

from __future__ import annotations

import itertools
import time

import pytest

from dflash_jax.compile_cache import CompileCounter
from dflash_jax.serve import engine as engine_mod
from dflash_jax.serve.engine import Engine, generate as serve_generate
from dflash_jax.spec import generate as spec_generate
from dflash_jax.spec.policy import BucketCosts, CostRule, join_widths, observe_cost

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(40, 56))]
BUDGET = 40


def test_join_widths_prices_a_new_width_at_the_load_it_was_timed_under():
    rule = CostRule(confirm=2, stale_after=10)
    costs = BucketCosts.fresh({4: 2.0}, rule)
    for t in (4.0, 4.0, 4.0):  # served at twice the warm-up's time: the load is 2
        costs = observe_cost(costs, 4, t, rule)
    assert costs.load == pytest.approx(2.0)
    joined = join_widths(costs, {1: 1.5, 4: 6.0}, rule)  # timed now at a load of 3 (6.0 for a cost of 2.0)
    assert joined.cost[4] == costs.cost[4] and joined.recent[4] == costs.recent[4]  # the learned width kept
    assert joined.cost[1] == pytest.approx(0.5)  # 1.5 s at a load of 3
    assert joined.seconds[1] == pytest.approx(1.0)  # priced at the load the table follows (2)
    assert joined.stale(1, rule) and joined.prior[1] == pytest.approx(0.5) and joined.recent[1] == ()
    assert joined.age[1] == rule.stale_after and joined.load == costs.load and joined.rounds == costs.rounds
    assert join_widths(joined, {1: 9.0, 4: 9.0}, rule) is joined  # nothing new: unchanged
    with pytest.raises(ValueError, match="shares no width"):
        join_widths(costs, {1: 1.0, 2: 2.0}, rule)


def _serve(engine, choose=None):
    rounds = []
    engine.observers.append(rounds.append)
    saved = engine.choose_width
    if choose is not None:
        engine.choose_width = choose
    try:
        with CompileCounter() as counter:
            reqs = serve_generate(engine, PROMPTS, max_new_tokens=BUDGET, stop_ids=[])
    finally:
        engine.choose_width = saved
        engine.observers.remove(rounds.append)
    return reqs, rounds, counter.compiles


@pytest.mark.slow
def test_later_widths_join_while_busy_and_while_idle(pair, monkeypatch):
    # calls of 4 rounds: enough steps within the requests for a bucket to be warmed, timed and chosen from
    eng = Engine(pair, slots=3, block_size=4, widths=[1, 4], max_prompt_len=16, max_new_tokens=BUDGET,
                 rounds_per_call=4)
    eng.warmup([16], later_widths="always")  # whatever the cache holds (True: after one whole warm-up here)
    buckets, lengths = eng.row_buckets, eng.runner.length_buckets
    assert eng.widths_warming == (1,) and eng.warming == len(buckets) * (len(lengths) + 1)
    assert all(eng.ready_widths(r) == (4,) and set(eng.seconds_table(r)) == {4} for r in buckets)
    reference = [spec_generate(pair, [p], max_new_tokens=BUDGET, stop_ids=[]).tokens[0] for p in PROMPTS]

    # busy: the round's bucket is warmed after a step, timed after the next, and then chosen from (as after a warm-up
    # that loaded its programs from the cache: one that compiled them afresh leaves them to idle time)
    monkeypatch.setattr(engine_mod, "BUSY_WARM_ROUNDS", 1)
    eng.busy_warm = True
    reqs, rounds, _ = _serve(eng)
    assert [r.tokens for r in reqs] == reference
    assert max(max(r.acceptance) for r in reqs) >= 2  # width-4 rounds accepted proposals
    joined = [r for r in buckets if eng.ready_widths(r) == (1, 4)]
    assert joined and set(eng.seconds_table(joined[0])) == {1, 4}
    first = next(i for i, r in enumerate(rounds) if r.rows in joined)  # no width 1 before its bucket joined
    assert all(r.width == 4 for r in rounds[: first + 2] if r.width)
    assert set(joined) <= {r.rows for r in rounds}  # only buckets the rounds computed
    assert eng.warming > 0  # their other lengths' programs (and any bucket not served) wait for an idle engine

    # idle: the serving loop warms the rest by itself
    eng.start()
    try:
        deadline = time.monotonic() + 300
        while eng.warming and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        eng.stop()
    assert eng.warming == 0 and eng.widths_warming == ()
    assert all(set(eng.seconds_table(r)) == {1, 4} and eng.seconds_table(r)[1] > 0 for r in buckets)

    # every width's programs at every length are warm: rounds of either width, alone and in calls, compile nothing
    cycle = itertools.cycle([1, 1, 4, 1, 4, 4, 1, 1, 1])
    reqs, rounds, compiles = _serve(eng, lambda live: next(cycle))
    assert compiles == 0 and {r.width for r in rounds if r.width} == {1, 4}
    assert [r.tokens for r in reqs] == reference


def test_no_busy_warming_after_a_cold_warm_up_or_while_stopping():
    """A warm-up that compiled afresh (a cold cache) leaves the later widths to idle time; a stopping engine warms
    nothing while its last requests finish."""
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    eng = Engine(fake_pair(), runner=FakeRunner, slots=2, block_size=4, widths=[1, 4], max_prompt_len=16,
                 max_new_tokens=64, rounds_per_call=1)
    eng.warmup([16], later_widths="always")
    assert eng.warming and eng.ready_widths(1) == (4,)
    eng.submit([1, 2, 3], max_new_tokens=64)
    eng.step()
    left = eng.warming
    eng.busy_warm = False
    assert not eng.warm_later(busy=True) and eng.warming == left
    eng.busy_warm, eng._stopping = True, True
    engine_mod.BUSY_WARM_ROUNDS, saved = 1, engine_mod.BUSY_WARM_ROUNDS
    try:
        eng.step()
    finally:
        engine_mod.BUSY_WARM_ROUNDS = saved
        eng._stopping = False
    assert eng.requests and eng.warming == left  # a busy step ran, no warming after it
    assert eng.warm_later(busy=True)  # and a busy engine does warm otherwise
    assert eng._later_loads is None  # stepped by its caller: no prefetching context left open (only the loop's)
    eng.run_until_idle()
    assert eng.finish_warmup() > 0 and eng.warming == 0 and eng.widths_warming == ()


def test_later_only_after_a_whole_warm_up_of_the_configuration(tmp_path):
    """`later_widths=True` warms every width at the first start of a configuration (the later widths' programs would
    compile afresh while requests wait) and leaves a marker in the compilation cache; the next start of the same
    configuration leaves them for later; another configuration warms whole again. No cache: whole."""
    from dflash_jax import compile_cache
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    def engine(slots=2):
        return Engine(fake_pair(), runner=FakeRunner, slots=slots, block_size=4, widths=[1, 4], max_prompt_len=16,
                      max_new_tokens=8)

    saved = compile_cache.active_dir()
    compile_cache.enable(str(tmp_path / "cache"))
    try:
        first = engine()
        first.warmup([16], later_widths=True)
        assert first.warming == 0 and first.ready_widths(1) == (1, 4)
        assert any(p.name.startswith("dflash-warmed-") for p in (tmp_path / "cache").iterdir())
        second = engine()
        second.warmup([16], later_widths=True)
        assert second.warming > 0 and second.ready_widths(1) == (4,)
        other = engine(slots=3)
        other.warmup([16], later_widths=True)
        assert other.warming == 0
        compile_cache.disable()
        bare = engine()
        bare.warmup([16], later_widths=True)
        assert compile_cache.active_dir() is None and bare.warming == 0
    finally:
        compile_cache.enable(saved) if saved else compile_cache.disable()
    assert compile_cache.active_dir() == saved


def test_finish_warmup_needs_an_idle_engine():
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    eng = Engine(fake_pair(), runner=FakeRunner, slots=2, block_size=4, widths=[1, 4], max_prompt_len=16,
                 max_new_tokens=8)
    eng.submit([1, 2, 3], max_new_tokens=4)
    with pytest.raises(RuntimeError, match="idle engine"):
        eng.finish_warmup()


def test_a_width_joins_while_every_request_ends_within_its_call(monkeypatch):
    """Calls long enough to hold a whole request (one client, calls of up to `MAX_BURST` rounds): no step leaves a
    row live, and the busy warm-up still runs, counted in rounds (`BUSY_WARM_ROUNDS`), for the step's row bucket:
    width 1 joins after two warms' worth of rounds, and later requests run at it."""
    from dflash_jax.serve.runner import MAX_BURST, FakeRunner, fake_pair

    monkeypatch.setattr(engine_mod, "BUSY_WARM_ROUNDS", 16)
    eng = Engine(fake_pair(), runner=FakeRunner, slots=2, block_size=4, widths=[1, 4], max_prompt_len=16,
                 max_new_tokens=32, rounds_per_call=MAX_BURST, round_seconds={1: 1.0, 4: 50.0})
    eng.warmup([16], later_widths="always")
    assert eng.busy_warm and eng.ready_widths(1) == (4,)
    infos = []
    eng.observers.append(infos.append)
    for i in range(12):
        (req,) = serve_generate(eng, [[1, 2, 3 + i]], max_new_tokens=32, stop_ids=[])
        assert req.finish_reason == "length" and not eng.requests
    calls = [i for i in infos if i.width]
    assert all(i.finished for i in calls if i.rounds > 1)  # every call of several rounds ended its request
    assert eng.ready_widths(1) == (1, 4)  # joined: warmed, then timed, while busy
    assert calls[0].width == 4 and calls[-1].width == 1  # and chosen once it had (width 4 priced far above it)


def test_the_idle_warm_up_waits_for_a_quiet_engine(monkeypatch):
    """The background loop starts a later warm-up step only once nothing was queued or live for `IDLE_WARM_AFTER`:
    a closed-loop client (its next request sent as the last ends) is never held by one, and the steps run once it
    stops. Their prefetching context closes with the last step."""
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    monkeypatch.setattr(engine_mod, "BUSY_WARM_ROUNDS", 10**9)  # no busy warming: the idle steps alone
    monkeypatch.setattr(engine_mod, "IDLE_WARM_AFTER", 2.0)
    eng = Engine(fake_pair(), runner=FakeRunner, slots=2, block_size=4, widths=[1, 4], max_prompt_len=16,
                 max_new_tokens=16, rounds_per_call=1)
    eng.warmup([16], later_widths="always")
    left = eng.warming
    assert left and eng.ready_widths(1) == (4,)
    req = eng.submit([1, 2, 3], max_new_tokens=8)  # queued before the loop starts: it serves first
    eng.start()
    try:
        for i in range(6):  # a closed loop: each request submitted the moment the last one ended
            assert req.wait(30) and req.finish_reason == "length"
            req = eng.submit([1, 2, 4 + i], max_new_tokens=8)
        assert req.wait(30)
        time.sleep(0.2)
        assert eng.warming == left  # never quiet for IDLE_WARM_AFTER: no step ran
        deadline = time.monotonic() + 60  # quiet now: the steps run by themselves
        while eng.warming and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        eng.stop()
    assert eng.warming == 0 and eng.widths_warming == () and eng._later_loads is None
