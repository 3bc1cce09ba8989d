"""The width chooser's cost table kept current while serving: the pure rule (`observe_cost`, `explore_width`,
`decide_width`) on simulated rounds, and the engine's wiring of it (no compile: fast)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.serve.engine import Engine, RoundInfo
from dflash_jax.spec.policy import BucketCosts, CostRule, choose_width, decide_width, explore_width, observe_cost

# a 32-row bucket as the serving benchmark met it: the warm-up table, measured while the machine was busy,
# prices wide rounds far above what served rounds cost
WARMUP = {1: 0.0547, 2: 0.0918, 4: 0.1347, 8: 0.2032}
TRUE = {1: 0.030, 2: 0.033, 4: 0.039, 8: 0.060}
ALPHAS = [0.6] * 32
HOST = 0.010
MARGIN = 0.1


def simulate(costs, true, rounds, rule=CostRule(), noise=0.05, seed=0, load=lambda r: 1.0):
    """Serves `rounds` rounds: each round's width by `decide_width`, its time the true cost times the machine's
    load factor of the round and a deterministic noise factor (a shared machine: up to 1 + noise, and a 3x
    spike every 17th round)."""
    rng = np.random.default_rng(seed)
    picks = []
    for r in range(rounds):
        width, explored = decide_width(ALPHAS, costs, HOST, MARGIN, rule)
        t = true[width] * load(r) * (1.0 + noise * rng.random()) * (3.0 if r % 17 == 16 else 1.0)
        costs = observe_cost(costs, width, t, rule, explored)
        picks.append((width, explored))
    return costs, picks


def test_a_stale_table_converges_within_tens_of_rounds():
    best = choose_width(ALPHAS, {w: t + HOST for w, t in TRUE.items()}, MARGIN)
    assert best > 1 and choose_width(ALPHAS, {w: t + HOST for w, t in WARMUP.items()}, MARGIN) == 1
    costs, picks = simulate(BucketCosts.fresh(WARMUP), TRUE, 200)
    chosen = [w for w, explored in picks if not explored]
    first = next(i for i, (w, explored) in enumerate(picks) if w == best and not explored)
    assert first < 40, picks[:first + 1]
    late = [w for w, explored in picks[60:] if not explored]
    assert late.count(best) >= 0.9 * len(late), late  # the spikes do not knock it off
    for w in (best, 1):  # entries in use track the served cost (within the noise), the warm-up figures are gone
        assert TRUE[w] * 0.95 < costs.seconds[w] < TRUE[w] * 1.3, (w, costs.seconds)
    explored = sum(e for _, e in picks)
    assert 0 < explored <= len(picks) / CostRule().explore_every
    assert len(chosen) == len(picks) - explored


def test_a_table_that_underprices_wide_rounds_recovers_too():
    cheap = {1: 0.030, 2: 0.031, 4: 0.032, 8: 0.033}  # warm-up on an idle machine, served under load
    steep = {1: 0.030, 2: 0.060, 4: 0.120, 8: 0.240}
    _, picks = simulate(BucketCosts.fresh(cheap), steep, 150)
    late = [w for w, explored in picks[60:] if not explored]
    assert set(late) == {1}, late


def test_the_table_follows_the_load_and_keeps_its_ratios():
    """The machine's load doubles, then halves, in slow waves: every width's time moves with it. The chosen
    width's rounds carry the load to the whole table, so the widths' ratios (measured against rounds of the same
    minute) stay right and the choice does not flip with the load."""
    best = choose_width(ALPHAS, {w: t + HOST for w, t in TRUE.items()}, MARGIN)
    wave = lambda r: 1.5 + 0.5 * np.sin(r / 40.0)  # noqa: E731
    costs, picks = simulate(BucketCosts.fresh(WARMUP), TRUE, 300, load=wave)
    late = [w for w, explored in picks[60:] if not explored]
    assert late.count(best) >= 0.9 * len(late), late
    ratios = {w: costs.seconds[w] / costs.seconds[best] for w in TRUE}
    for w in (2, 4, 8):  # the widths explored near the end: their ratio to the chosen one
        assert ratios[w] == pytest.approx(TRUE[w] / TRUE[best], rel=0.15), ratios  # 5% noise, 3x spikes, the wave


def test_exploration_is_bounded_deterministic_and_adjacent_or_the_narrowest():
    rule = CostRule(explore_every=4, stale_after=8, confirm=2)
    costs = BucketCosts.fresh(WARMUP, rule)
    a, picks_a = simulate(costs, TRUE, 100, rule)
    b, picks_b = simulate(costs, TRUE, 100, rule)
    assert picks_a == picks_b and a == b  # deterministic
    for r, (w, explored) in enumerate(picks_a):
        if explored:
            assert r % rule.explore_every == rule.explore_every - 1  # only in its slots
    # a round explores only a neighbour of the width the table would have chosen, or the narrowest width
    widths = sorted(WARMUP)
    c = BucketCosts.fresh(WARMUP, rule)
    for r in range(60):
        chosen = choose_width(ALPHAS, {w: t + HOST for w, t in c.seconds.items()}, MARGIN)
        other = explore_width(c, chosen, rule)
        if other is not None:
            assert abs(widths.index(other) - widths.index(chosen)) == 1 or other == widths[0]
            assert c.stale(other, rule)
        c = observe_cost(c, other or chosen, TRUE[other or chosen], rule)


def test_a_wide_choice_re_measures_a_stale_narrowest_width():
    """Width 1 priced too high (as short calls can price it) keeps width 4 chosen when only the chosen width's
    neighbours are explored; exploring the narrowest too re-measures it, and the choice comes back to width 1."""
    true = {1: 1.0, 2: 2.6, 4: 3.0}  # a compute-bound CPU: width 1 pays best at this acceptance
    rule = CostRule(explore_every=4, stale_after=16, confirm=2)
    c = BucketCosts.fresh({1: 6.0, 2: 2.6, 4: 3.0}, rule)
    alphas = [0.6] * 4
    assert choose_width(alphas, c.seconds, 0.1) == 4
    assert explore_width(c, 4, rule) is None  # not an exploration slot yet
    picks = []
    for _ in range(60):
        w, explored = decide_width(alphas, c, 0.0, 0.1, rule)
        picks.append((w, explored))
        c = observe_cost(c, w, true[w], rule, explored)
    assert (1, True) in picks[:8]  # width 1 re-measured in the first exploration slots
    assert [w for w, explored in picks[-20:] if not explored] == [1] * len([x for x in picks[-20:] if not x[1]])
    assert c.seconds[1] == pytest.approx(1.0, rel=0.01)


def test_no_exploration_with_one_width_or_when_off():
    one = BucketCosts.fresh({4: 1.0})
    for _ in range(50):
        assert decide_width(ALPHAS, one, HOST, MARGIN) == (4, False)
        one = observe_cost(one, 4, 2.0)
    never = CostRule(explore_every=0)
    c = BucketCosts.fresh(WARMUP, never)
    for _ in range(50):
        w, explored = decide_width(ALPHAS, c, HOST, MARGIN, never)
        assert not explored
        c = observe_cost(c, w, TRUE[w], never)
    c = BucketCosts.fresh(WARMUP)
    assert all(not decide_width(ALPHAS, c, HOST, MARGIN, None)[1] for _ in range(20))


def test_observe_cost_follows_the_load_and_each_widths_cost():
    c = BucketCosts.fresh({1: 1.0, 2: 4.0})
    c = observe_cost(c, 1, 2.0)  # a chosen round twice its warm-up figure: the machine is twice as loaded
    assert c.load == pytest.approx(2.0) and c.seconds == pytest.approx({1: 2.0, 2: 8.0})  # ratios kept
    assert c.age == {1: 0, 2: CostRule().stale_after + 1} and c.rounds == 1
    c = observe_cost(c, 2, 4.0, explored=True)  # the explored width against the rounds just before it:
    assert c.load == pytest.approx(2.0) and c.recent[2] == pytest.approx((2.0,))  # 2 at load 1, the warm-up said 4
    assert c.seconds == pytest.approx({1: 2.0, 2: 2.0 * 8 ** 0.5})  # one round moves it halfway (geometric)
    c = observe_cost(c, 2, 4.0, explored=True)  # a second one confirms it: the median of (2, 2, 4)
    assert c.seconds == pytest.approx({1: 2.0, 2: 4.0})
    for _ in range(10):
        c = observe_cost(c, 1, 2.0)
    assert len(c.load_recent) == CostRule().window
    assert observe_cost(c, 1, 6.0).seconds == pytest.approx({1: 2.0, 2: 4.0})  # one slow round moves nothing
    slow = c
    for _ in range(3):  # a lasting slowdown shows within window // 2 + 1 rounds, in every entry
        slow = observe_cost(slow, 1, 4.0)
    assert slow.seconds == pytest.approx({1: 4.0, 2: 8.0})
    rule = CostRule(stale_after=5)
    for _ in range(5):
        c = observe_cost(c, 1, 2.0, rule)
    assert c.stale(2, rule) and not c.stale(1, CostRule(confirm=1))
    assert observe_cost(c, 2, 8.0, rule, explored=True).recent[2] == pytest.approx((2.0, 4.0))  # stale: newest only
    with pytest.raises(ValueError, match="window >= 1"):
        CostRule(window=0)


def test_the_engine_learns_by_default_and_counts_exploration(pair):
    """The wiring, without compiling anything: learning is on unless a fixed table is given; a served round
    updates its bucket's entry and the cost table; an explored round is counted."""
    assert not Engine(pair, slots=2, block_size=4, widths="auto", round_seconds={1: 1.0, 2: 1.3, 4: 1.9}).learn_costs
    assert not Engine(pair, slots=2, block_size=4, widths="auto", learn_costs=False).learn_costs
    eng = Engine(pair, slots=2, block_size=4, widths="auto")
    assert eng.learn_costs
    eng.cost_table = {1: {1: 0.01, 2: 0.05, 4: 0.09}, 2: {1: 0.02, 2: 0.06, 4: 0.1}}
    eng._device_seconds = 0.02
    eng.learn_cost(RoundInfo(width=2, rows=1, seconds=0.03))  # a chosen round: the load is 0.4 of the warm-up's
    assert eng.seconds_table(1) == pytest.approx({1: 0.004, 2: 0.02, 4: 0.036})
    assert eng.cost_table[1] == pytest.approx(eng.seconds_table(1))
    assert eng.seconds_table(2) == {1: 0.02, 2: 0.06, 4: 0.1}  # other buckets untouched
    eng.learn_cost(RoundInfo(width=4, rows=1, seconds=0.05, explored=True))  # measured: 0.02 s
    assert eng.explore_rounds[4] == 1 and eng.explore_seconds == pytest.approx(0.05)
    assert eng.bucket_costs(1).load == pytest.approx(0.4)  # halfway from the warm-up's 0.036 s at this load
    assert eng.seconds_table(1)[4] == pytest.approx((0.02 * 0.036) ** 0.5)
    eng.learn_cost(RoundInfo(width=2, rows=1, seconds=0.03, compiles=1))  # a compiling round teaches nothing
    assert eng.bucket_costs(1).rounds == 2
    fixed = Engine(pair, slots=2, block_size=4, widths=[4])
    fixed._device_seconds = 0.5
    fixed.learn_cost(RoundInfo(width=4, rows=1, seconds=0.5))
    assert fixed.bucket_costs(1).rounds == 0  # one width: nothing to choose, nothing learned


def test_serve_flags(capsys):
    from dflash_jax.cli.serve import build_parser, main

    assert main(["--explore-every", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-serve: error:") and "--explore-every must be >= 0" in err and "\n" not in err
    args = build_parser().parse_args([])
    assert not args.no_learn_costs and args.explore_every == 8  # learning on by default
    assert build_parser().parse_args(["--no-learn-costs"]).no_learn_costs
