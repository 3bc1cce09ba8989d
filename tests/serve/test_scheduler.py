"""The 2-D deficit round robin (`serve.scheduler.schedule`), a pure function: work conservation, union
pricing, fairness under adversarial mixes (no starvation, a bound on the wait), decisions visible."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dflash_jax.serve.scheduler import Budgets, Demand, SchedulerState, schedule, union_bytes, wait_bound

L, E = 4, 8
BYTES = np.full((L, E), 100.0)  # every expert 100 bytes: all experts = 3200


def experts(*ids, layers=range(L)):
    m = np.zeros((L, E), bool)
    for layer in layers:
        m[layer, list(ids)] = True
    return m


def run(rounds, demands_of, budgets, state=None):
    """Runs `rounds` rounds; demands_of(r) -> the live demands of round r. Returns (decisions, waits) where
    waits[key] is the longest run of consecutive rounds the key was live and not admitted."""
    state = state or SchedulerState()
    decisions, current, longest = [], {}, {}
    for r in range(rounds):
        demands = demands_of(r)
        d = schedule(demands, state, budgets, BYTES)
        state = d.state
        decisions.append(d)
        for dem in demands:
            k = dem.key
            current[k] = 0 if k in d.admitted else current.get(k, 0) + 1
            longest[k] = max(longest.get(k, 0), current[k])
    return decisions, longest


def test_unlimited_budgets_admit_everyone():
    demands = [Demand(k, 16, experts(k % E)) for k in range(6)]
    d = schedule(demands, SchedulerState(), Budgets(), BYTES)
    assert sorted(d.admitted) == list(range(6)) and d.waiting == ()
    assert d.tokens == 96 and d.expert_bytes == union_bytes([x.experts for x in demands], BYTES)


def test_round_cost_is_the_union():
    """Two sequences routed to the same experts cost those bytes once: both fit a budget of one's bytes."""
    same = experts(0, 1)
    one = float(BYTES[same].sum())
    d = schedule([Demand(0, 8, same), Demand(1, 8, same.copy()), Demand(2, 8, experts(5, 6))], SchedulerState(),
                 Budgets(expert_bytes=one), BYTES)
    assert set(d.admitted) == {0, 1} and d.waiting == (2,)
    assert d.expert_bytes == one


def test_token_budget_is_round_robin():
    """Budget = one verify per round: N sequences take turns, each exactly once per N rounds."""
    demands = [Demand(k, 16, experts(0)) for k in range(5)]
    decisions, waits = run(25, lambda r: demands, Budgets(tokens=16))
    assert all(len(d.admitted) == 1 for d in decisions)
    order = [d.admitted[0] for d in decisions]
    for start in range(0, 25, 5):
        assert sorted(order[start:start + 5]) == list(range(5))
    assert max(waits.values()) <= len(demands)


def test_work_conserving_and_progress():
    """Nobody fits the byte budget: one sequence still verifies each round; leftover capacity is used."""
    big = [Demand(k, 16, experts(*range(E))) for k in range(3)]  # each alone exceeds the budget
    decisions, waits = run(12, lambda r: big, Budgets(expert_bytes=500.0))
    assert all(len(d.admitted) >= 1 for d in decisions)
    assert max(waits.values()) <= wait_bound(3, Budgets(expert_bytes=500.0), 16, BYTES)
    assert all(sum(k in d.admitted for d in decisions) >= 3 for k in range(3))
    small = [Demand(k, 16, experts(k)) for k in range(4)]
    d = schedule(small, SchedulerState(), Budgets(tokens=64, expert_bytes=400.0 * 4), BYTES)
    assert len(d.admitted) == 4  # everything fits: everything runs


@pytest.mark.parametrize("seed", range(4))
def test_no_starvation_adversarial(seed):
    """Adversarial mixes: a heavy sequence (every expert) among many light ones that share few experts, under
    tight budgets, with arrivals and departures. Every live sequence verifies within the documented bound
    n + ceil(cap_t / q_t) + ceil(cap_b / q_b) of rounds."""
    rng = np.random.default_rng(seed)
    heavy = Demand(0, 16, experts(*range(E)))
    light_keys = list(range(1, 9))
    budgets = Budgets(tokens=32, expert_bytes=600.0)
    live = {0: heavy}
    next_key = 100

    def demands_of(r):
        nonlocal next_key
        for k in light_keys:
            if k not in live:
                live[k] = Demand(k, 16, experts(int(rng.integers(0, 2)), layers=[int(rng.integers(0, L))]))
        if r % 7 == 3:  # a departure and an arrival
            victim = int(rng.choice([k for k in live if k != 0]))
            del live[victim]
            live[next_key] = Demand(next_key, 16, experts(int(rng.integers(0, E))))
            next_key += 1
        return list(live.values())

    decisions, waits = run(200, demands_of, budgets)
    n = max(len(d.admitted) + len(d.waiting) for d in decisions)
    bound = wait_bound(n, budgets, 16, BYTES)
    q_t, q_b = budgets.tokens / n, budgets.expert_bytes / n
    assert bound == n + math.ceil(16 / q_t) + math.ceil(BYTES.sum() / q_b)
    assert waits[0] <= bound, (waits[0], bound)
    assert max(waits.values()) <= bound
    heavy_turns = sum(0 in d.admitted for d in decisions)
    assert heavy_turns >= 200 // bound
    assert all(d.tokens <= budgets.tokens or len(d.admitted) == 1 for d in decisions)
    kinds = {k for d in decisions for k in d.how.values()}
    assert kinds <= {"deficit", "work", "forced"} and "deficit" in kinds


def test_fair_share_between_heavy_and_light():
    """Over many rounds a heavy (all experts) and a light sequence under a byte budget that holds only one heavy
    verify per round: both keep verifying (the light one also fits beside it when budget remains)."""
    demands = [Demand(0, 16, experts(*range(E))), Demand(1, 16, experts(0))]
    decisions, waits = run(40, lambda r: demands, Budgets(expert_bytes=float(BYTES.sum())))
    assert sum(0 in d.admitted for d in decisions) >= 15 and sum(1 in d.admitted for d in decisions) >= 15


def test_pure_and_validated():
    demands = [Demand(0, 16, experts(0)), Demand(1, 16, experts(1))]
    state = SchedulerState()
    a = schedule(demands, state, Budgets(tokens=16), BYTES)
    b = schedule(demands, state, Budgets(tokens=16), BYTES)
    assert a == b or (a.admitted == b.admitted and a.state.pointer == b.state.pointer)
    assert state == SchedulerState()  # not mutated
    with pytest.raises(ValueError, match="duplicate"):
        schedule([Demand(0, 16, experts(0)), Demand(0, 16, experts(1))], state, Budgets(), BYTES)
    empty = schedule([], state, Budgets(), BYTES)
    assert empty.admitted == () and empty.tokens == 0
