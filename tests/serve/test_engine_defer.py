"""Width-1 rounds that defer the draft's context append (`Engine(defer_context=True)`, the default): the committed
rows wait in the state's context rows and the next drafting round appends them at once. Outputs are unchanged
(greedy: the tokens of each request alone, whatever mix of widths), the draft sees the same context (the same
proposals, so the same tokens per verify as an engine that appends every round), a run of width-1 rounds longer
than the pending rows' room appends in the round that fills them, and nothing compiles after warm-up. Compiles
two engines: slow."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash_jax.compile_cache import CompileCounter
from dflash_jax.serve.engine import Engine, generate as serve_generate
from dflash_jax.spec import generate as spec_generate

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(40, 56))]
BUDGET = 40
# long runs of width 1 (past the 4 pending rows: the round that fills them appends), drafting rounds between
CYCLE = [4, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1, 4, 1, 4, 4, 1, 1, 1, 2, 2, 1, 1, 1, 1, 1, 1]


def _engine(pair, defer, **offload):
    eng = Engine(pair, slots=3, block_size=4, widths=[1, 2, 4], max_prompt_len=16, max_new_tokens=BUDGET,
                 round_seconds={1: 1.0, 2: 1.2, 4: 1.5}, row_buckets=None, defer_context=defer, **offload)
    eng.warmup([16])
    return eng


def _run(engine):
    cycle = itertools.cycle(CYCLE)
    engine.choose_width = lambda live: next(cycle)
    rounds = []
    engine.observers.append(rounds.append)
    with CompileCounter() as counter:
        reqs = serve_generate(engine, PROMPTS, max_new_tokens=BUDGET, stop_ids=[])
    assert counter.compiles == 0
    return reqs, rounds


@pytest.mark.slow
def test_deferred_context_append_is_exact(pair):
    # a round per step and one runner: each forced width is one round, and the state is read below
    deferred = _engine(pair, True, rounds_per_call=1, lanes=1)
    assert deferred.defer_context
    reqs, rounds = _run(deferred)
    assert {r.width for r in rounds if r.width} == {1, 2, 4}
    assert deferred.deferred_rounds > 0
    assert deferred.width_rounds[1] > deferred.deferred_rounds  # some width-1 rounds found the pending rows full
    for p, r in zip(PROMPTS, reqs):
        assert r.tokens == spec_generate(pair, [p], max_new_tokens=BUDGET, stop_ids=[]).tokens[0]
    plain = _engine(pair, False, rounds_per_call=1, lanes=1)
    assert plain.deferred_rounds == 0
    ref, _ = _run(plain)
    assert plain.deferred_rounds == 0
    for a, b in zip(reqs, ref):
        assert a.tokens == b.tokens
        assert a.acceptance == b.acceptance  # the drafts saw the same context: the same proposals accepted
    assert max(max(r.acceptance) for r in reqs) >= 3  # wide rounds really accepted proposals
    assert np.asarray(deferred.runner.state.num_context).max() <= deferred.block_size


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
    reqs, rounds = _run(eng)
    assert eng.deferred_rounds > 0 and {r.width for r in rounds if r.width} == {1, 2, 4}
    for p, r in zip(PROMPTS, reqs):
        assert r.tokens == spec_generate(pair, [p], max_new_tokens=BUDGET, stop_ids=[]).tokens[0]
    assert max(max(r.acceptance) for r in reqs) >= 3


@pytest.mark.slow
def test_deferred_context_append_in_calls_of_several_rounds(pair):
    """Calls of several width-1 rounds defer the append every round (the call's context rows hold a row per round,
    past the block's room) and append once at the call's end: each request's tokens equal it alone, its accepted
    tokens per verify equal an engine's that appends every round (the draft saw the same context), with calls of
    several rounds at width 1 and 4, and nothing compiled."""
    eng = _engine(pair, True, rounds_per_call=6)
    reqs, rounds = _run(eng)
    assert {1, 4} <= {r.width for r in rounds if r.burst}
    assert max(r.rounds for r in rounds if r.width == 1) > eng.block_size  # past the pending rows' room
    calls = sum(r.rounds for r in rounds if r.burst and r.width == 1)
    assert eng.deferred_rounds >= calls > 0  # every width-1 round of a call deferred
    for p, r in zip(PROMPTS, reqs):
        assert r.tokens == spec_generate(pair, [p], max_new_tokens=BUDGET, stop_ids=[]).tokens[0]
    appending = _engine(pair, False, rounds_per_call=6)
    ref, _ = _run(appending)
    assert appending.deferred_rounds == 0
    for a, b in zip(reqs, ref):
        assert a.tokens == b.tokens
        assert a.acceptance == b.acceptance
    assert max(max(r.acceptance) for r in reqs) >= 3
