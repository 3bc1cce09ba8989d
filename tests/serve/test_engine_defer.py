"""Width-1 rounds that hold the draft's context (`Engine(defer_context=True)`, the default): the committed rows wait
in the state's held context rows, and a drafting round (or a full hold) appends them at once first
(`flush_context`). Outputs are unchanged (greedy: the tokens of each request alone, whatever mix of widths), the
draft sees the same context (the same proposals, so the same tokens per verify as an engine that appends every
round), a run of width-1 rounds longer than the hold appends when it fills, the chooser re-prices no drafting width
while a row holds more than a block, and nothing compiles after warm-up. Each alike where width-1 rounds skip the
draft's context instead (`skip_context`, where the runner can: caught up before the next drafting round), with no
hold to fill. Compiles several engines: slow."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash_jax.compile_cache import CompileCounter
from dflash_jax.serve.engine import Engine, generate as serve_generate
from dflash_jax.serve.runner import MAX_BURST
from dflash_jax.spec import generate as spec_generate

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(40, 56))]
BUDGET = 40
# runs of width 1 (past a block of pending rows: the drafting round after them flushes first), drafting rounds between
CYCLE = [4, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1, 4, 1, 4, 4, 1, 1, 1, 2, 2, 1, 1, 1, 1, 1, 1]
# the least hold: a block and a call's rounds
LEAST = 4 + MAX_BURST
# a run of width 1 longer than the least hold, so the hold fills, and a budget that holds it
RUN = LEAST + 6
LONG = [4] + [1] * RUN + [2, 4]
LONG_BUDGET = RUN + 24
# calls of several rounds (one call per forced width): drafting calls after calls of width-1 rounds
CALLS = [4, 1, 1, 4, 1, 2, 1, 4]


def _engine(pair, defer, skip=False, budget=BUDGET, max_prompt_len=16, **offload):
    eng = Engine(pair, slots=3, block_size=4, widths=[1, 2, 4], max_prompt_len=max_prompt_len, max_new_tokens=budget,
                 round_seconds={1: 1.0, 2: 1.2, 4: 1.5}, row_buckets=None, defer_context=defer, skip_context=skip,
                 **offload)
    eng.warmup(sorted({16, max_prompt_len}))
    assert eng.skip_context == (skip and bool(defer) and eng.runner.catches_up)
    return eng


def _skipped(engine):
    """Width-1 rounds skipped the draft's context and drafting rounds caught it up (`skip_context`), or none did."""
    if engine.skip_context:
        assert engine.catch_ups > 0 and engine.caught_up_rows > 0
    else:
        assert engine.catch_ups == 0 and engine.caught_up_rows == 0


def _run(engine, pattern=CYCLE, budget=BUDGET):
    cycle = itertools.cycle(pattern)
    engine.choose_width = lambda live: next(cycle)
    rounds = []
    engine.observers.append(rounds.append)
    flush = engine.runner.flush_context
    engine.flushed = []  # (rows, the slots over the limit) of every flush

    def spy(rows, slots=None):
        engine.flushed.append((rows, None if slots is None else list(slots)))
        return flush(rows, slots)

    engine.runner.flush_context = spy
    with CompileCounter() as counter:
        reqs = serve_generate(engine, PROMPTS, max_new_tokens=budget, stop_ids=[])
    assert counter.compiles == 0
    return reqs, rounds


def _gathered(engine) -> None:
    """Some flush appended fewer rows than its bucket's (`flush_context`'s `slots`: a gathered flush), and none
    named a row twice."""
    assert any(slots is not None and len(slots) < rows for rows, slots in engine.flushed), engine.flushed
    assert all(slots is None or len(set(slots)) == len(slots) for _, slots in engine.flushed)


@pytest.mark.slow
@pytest.mark.parametrize("skip", [False, True], ids=["held", "skipped"])
def test_deferred_context_append_is_exact(pair, skip):
    # a round per step and one runner: each forced width is one round, and the state is read below
    deferred = _engine(pair, True, skip, rounds_per_call=1, lanes=1)
    assert deferred.defer_context and deferred.context_rows >= deferred.output_len
    assert deferred.runner.state.context.shape[1] == deferred.context_rows
    reqs, rounds = _run(deferred)
    assert {r.width for r in rounds if r.width} == {1, 2, 4}
    assert deferred.deferred_rounds == deferred.width_rounds[1] > 0  # every width-1 round held the context
    assert deferred.context_flushes > 0  # drafting rounds after runs of more than a block appended them first
    if not skip:  # the rows over the limit alone (a skipping engine catches up instead)
        _gathered(deferred)
    _skipped(deferred)
    for p, r in zip(PROMPTS, reqs):
        assert r.tokens == spec_generate(pair, [p], max_new_tokens=BUDGET, stop_ids=[]).tokens[0]
    plain = _engine(pair, False, rounds_per_call=1, lanes=1)
    assert not plain.defer_context and plain.context_rows == plain.block_size
    ref, _ = _run(plain)
    assert plain.deferred_rounds == 0 and plain.context_flushes == 0
    for a, b in zip(reqs, ref):
        assert a.tokens == b.tokens
        assert a.acceptance == b.acceptance  # the drafts saw the same context: the same proposals accepted
    assert max(max(r.acceptance) for r in reqs) >= 3  # wide rounds really accepted proposals


@pytest.mark.slow
def test_a_full_hold_appends_and_the_draft_sees_the_same_context(pair):
    """The least hold (`LEAST` rows) under a longer run of width-1 rounds: it fills, is appended, holds again; a
    round per step and calls of several alike. The drafts after it accept as an appending engine's do."""
    for per_call in (1, 6):
        ref, _ = _run(_engine(pair, False, rounds_per_call=per_call, budget=LONG_BUDGET), LONG, LONG_BUDGET)
        held = _engine(pair, LEAST, False, rounds_per_call=per_call, budget=LONG_BUDGET)
        assert held.context_rows == LEAST
        reqs, rounds = _run(held, LONG, LONG_BUDGET)
        widths = [r.width for r in rounds if r.width]
        assert held.context_flushes >= 2  # one when the hold filled, one before the drafting round after the run
        assert held.deferred_rounds == held.width_rounds[1] >= RUN and 4 in widths
        for a, b in zip(reqs, ref):
            assert a.tokens == b.tokens
            assert a.acceptance == b.acceptance
        assert np.asarray(held.runner.pending_context()).max() <= held.context_rows


@pytest.mark.slow
def test_skipped_context_is_caught_up_in_chunks_and_never_fills_the_hold(pair, monkeypatch):
    """Width-1 rounds that skip the draft's context add no held rows: a run of `RUN` of them under the least hold
    (`LEAST` rows) appends nothing until the drafting round after it, which catches those positions up (8 a call)
    with the prompt's held rows; a round per step and calls of several alike. Tokens and tokens per verify equal an
    appending engine's, and nothing compiles after warm-up."""
    from dflash_jax.serve import engine as engine_module

    monkeypatch.setattr(engine_module, "CATCH_UP_CHUNK", 8)
    for per_call in (1, 6):
        # a call per forced width: calls of 6 width-1 rounds (at least `RUN`), then drafting calls
        pattern = LONG if per_call == 1 else [1] * -(-RUN // 6) + [4] * 4
        ref, _ = _run(_engine(pair, False, rounds_per_call=per_call, budget=LONG_BUDGET), pattern, LONG_BUDGET)
        skipping = _engine(pair, LEAST, True, rounds_per_call=per_call, budget=LONG_BUDGET)
        assert skipping.skip_context and skipping.context_rows == LEAST
        reqs, rounds = _run(skipping, pattern, LONG_BUDGET)
        assert skipping.deferred_rounds == skipping.width_rounds[1] >= RUN
        # none while the run would have filled the hold: the first drafting round's (the prompts' held rows; a call
        # of one round) and the catch-up before the drafting round after the run
        assert skipping.context_flushes == (2 if per_call == 1 else 1)
        assert skipping.catch_ups >= RUN // 8 and skipping.caught_up_rows >= RUN * len(PROMPTS)
        assert np.asarray(skipping.runner.pending_context()).max() <= max(len(p) for p in PROMPTS) + 4
        for a, b in zip(reqs, ref):
            assert a.tokens == b.tokens
            assert a.acceptance == b.acceptance
        assert max(max(r.acceptance) for r in reqs) >= 3


@pytest.mark.slow
def test_no_drafting_width_is_explored_while_a_row_holds_more_than_a_block(pair):
    """Width 1 priced far below width 4, exploration every 8th round: by then the engine that holds the draft's
    context holds more than a block in every row, and re-prices no drafting width; the appending engine does."""
    from dflash_jax.spec.policy import CostRule

    rule = CostRule(explore_every=8, stale_after=1, confirm=1)
    counts = {}
    for defer in (True, False):
        eng = Engine(pair, slots=3, block_size=4, widths=[1, 4], max_prompt_len=16, max_new_tokens=BUDGET,
                     round_seconds={1: 1.0, 4: 50.0}, learn_costs=True, cost_rule=rule, row_buckets=None,
                     defer_context=defer, rounds_per_call=1, lanes=1)
        eng.warmup([16])
        reqs = serve_generate(eng, PROMPTS, max_new_tokens=BUDGET, stop_ids=[])
        for p, r in zip(PROMPTS, reqs):
            assert r.tokens == spec_generate(pair, [p], max_new_tokens=BUDGET, stop_ids=[]).tokens[0]
        counts[defer] = (eng.explore_rounds[4], eng.width_rounds[4])
    # the appending engine re-prices width 4 (once its measured price is in, the model may choose it outright, so
    # its later rounds at width 4 need not be explorations); the holding one never explores it
    assert counts[False][0] >= 1 and counts[False][1] >= 2
    assert counts[True][0] == 0


@pytest.mark.slow
def test_offloaded_deferred_context_append_is_exact(pair):
    """The offloaded runner defers too (its layer-wise verify commits through the same `spec.round.commit`): each
    request's tokens equal it alone, with width-1 rounds that deferred."""
    import dflash_jax
    from dflash_jax.offload import HostExpertStore, min_budget_bytes

    offloaded = dflash_jax.load(expert_memory="pinned_host")
    store = HostExpertStore(offloaded.target)
    eng = _engine(offloaded, True, experts="offload", budget_bytes=min_budget_bytes(store), store=store,
                  bandwidth=1e9)
    assert not eng.skip_context  # a catch-up would stream every table: its width-1 rounds hold their taps
    reqs, rounds = _run(eng)
    assert eng.deferred_rounds > 0 and eng.context_flushes > 0 and {r.width for r in rounds if r.width} == {1, 2, 4}
    for p, r in zip(PROMPTS, reqs):
        assert r.tokens == spec_generate(pair, [p], max_new_tokens=BUDGET, stop_ids=[]).tokens[0]
    assert max(max(r.acceptance) for r in reqs) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("skip", [False, True], ids=["held", "skipped"])
def test_deferred_context_append_in_calls_of_several_rounds(pair, skip):
    """Calls of several width-1 rounds hold the draft's context every round (past a block of rows): each request's
    tokens equal it alone, its accepted tokens per verify equal an engine's that appends every round (the draft saw
    the same context), with calls of several rounds at width 1 and 4, and nothing compiled."""
    eng = _engine(pair, True, skip, rounds_per_call=6)
    reqs, rounds = _run(eng, CALLS)
    _skipped(eng)
    if not skip:
        _gathered(eng)
    assert {1, 4} <= {r.width for r in rounds if r.burst}
    assert max(r.rounds for r in rounds if r.width == 1) > eng.block_size  # past the pending rows' room
    calls = sum(r.rounds for r in rounds if r.burst and r.width == 1)
    assert eng.deferred_rounds >= calls > 0  # every width-1 round of a call deferred
    for p, r in zip(PROMPTS, reqs):
        assert r.tokens == spec_generate(pair, [p], max_new_tokens=BUDGET, stop_ids=[]).tokens[0]
    appending = _engine(pair, False, rounds_per_call=6)
    ref, _ = _run(appending, CALLS)
    assert appending.deferred_rounds == 0
    for a, b in zip(reqs, ref):
        assert a.tokens == b.tokens
        assert a.acceptance == b.acceptance
    assert max(max(r.acceptance) for r in reqs) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("skip", [False, True], ids=["held", "skipped"])
def test_a_prefill_holds_the_prompt_until_the_first_drafting_round(pair, skip):
    """A whole prompt's draft context is held too: after its prefill and width-1 rounds the row's draft cache is
    empty and its prompt rows and rounds' rows pending (skipping: the prompt's alone); the first drafting round
    appends them (one flush; skipping: with the rounds' positions caught up) and proposes what an appending engine
    proposes."""
    widths = iter([1, 1, 1] + [4] * 40)
    eng = _engine(pair, True, skip, rounds_per_call=1, lanes=1)
    eng.choose_width = lambda live: next(widths)
    prompt = PROMPTS[2]
    req = eng.submit(prompt, max_new_tokens=BUDGET, stop_ids=[])
    for _ in range(3):
        eng.step()
    slot = req.slot
    assert eng.runner.pending_context()[slot] == len(prompt) + (0 if skip else 3) and eng.context_flushes == 0
    assert req.skipped_from == (0 if skip else None)
    assert int(np.asarray(eng.runner.state.draft_cache.lengths)[slot]) == 0  # the draft has seen nothing yet
    eng.run_until_idle()
    assert eng.context_flushes == 1 and eng.caught_up_rows == (3 if skip else 0)
    assert req.tokens == spec_generate(pair, [prompt], max_new_tokens=BUDGET, stop_ids=[]).tokens[0]
    ref = _engine(pair, False, rounds_per_call=1, lanes=1)
    widths = iter([1, 1, 1] + [4] * 40)
    ref.choose_width = lambda live: next(widths)
    (want,) = serve_generate(ref, [prompt], max_new_tokens=BUDGET, stop_ids=[])
    assert req.acceptance == want.acceptance and max(req.acceptance) >= 3


@pytest.mark.slow
def test_a_reused_slot_reads_only_its_own_held_context(pair):
    """A prefill holds its prompt's draft context only as wide as the prompt (a block at least), and the insert
    writes those columns alone: the rest of the slot's hold keeps its last request's rows, past the pending count,
    never read. A short prompt after a long request in the same slot (its hold filled by the prompt and every
    width-1 round) proposes what an appending engine proposes, and outputs the tokens of the target alone."""
    long, short = PROMPTS[2] + list(range(60, 80)), PROMPTS[1]

    def run(engine):
        engine.choose_width = lambda live: 1  # the long request holds its prompt and all its rounds' rows
        (first,) = serve_generate(engine, [long], max_new_tokens=BUDGET, stop_ids=[])
        widths = itertools.cycle([1, 1, 4, 4, 2, 4, 1, 4])
        engine.choose_width = lambda live: next(widths)
        (second,) = serve_generate(engine, [short], max_new_tokens=BUDGET, stop_ids=[])
        return first, second

    held = _engine(pair, True, rounds_per_call=1, lanes=1, max_prompt_len=48)
    rows = held.runner.prefill(held._batch([held.submit(short, max_new_tokens=1, stop_ids=[])], 1))
    assert held.block_size <= rows.context.shape[1] < held.context_rows  # the prompt's columns, not the hold's
    held.run_until_idle()
    first, second = run(held)
    assert first.slot == second.slot
    ref_first, ref_second = run(_engine(pair, False, rounds_per_call=1, lanes=1, max_prompt_len=48))
    assert second.tokens == ref_second.tokens == spec_generate(pair, [short], max_new_tokens=BUDGET,
                                                                stop_ids=[]).tokens[0]
    assert second.acceptance == ref_second.acceptance and max(second.acceptance) >= 3
    assert first.tokens == ref_first.tokens
