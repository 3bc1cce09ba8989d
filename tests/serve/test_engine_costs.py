"""The width chooser's cost table kept current while serving: the pure rule (`observe_cost`, `explore_width`,
`decide_width`) on simulated rounds, and the engine's wiring of it (no compile: fast)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.serve.engine import Engine, RoundInfo
from dflash_jax.spec.policy import (
    BucketCosts, CostRule, acceptance_upper, choose_width, decide_width, explore_acceptance, exploration_loss,
    explore_width, observe_cost, with_drafting, with_host,
)

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


def test_acceptance_upper_is_wide_with_little_evidence_and_narrow_with_much():
    assert acceptance_upper(0.7, 2.0) == pytest.approx(0.7 + (0.21 / 3) ** 0.5)
    assert acceptance_upper(0.7, 100.0) == pytest.approx(0.7 + (0.21 / 101) ** 0.5)
    assert acceptance_upper(0.99, 0.0) == pytest.approx(0.98)  # capped below 1
    np.testing.assert_allclose(acceptance_upper([0.5, 0.5], [2.0, 8.0]),
                               [0.5 + (0.25 / 3) ** 0.5, 0.5 + (0.25 / 9) ** 0.5])


def test_a_narrow_choice_on_a_pessimistic_acceptance_tries_the_wider_width_now_and_then():
    """Width 1 held on the prior (0.7: width 4 does not win by the margin) while the draft really accepts 0.9:
    the optimistic estimate of a row with little evidence says width 4 could win, so a fresh (stale) width 4 runs
    at once; once it ran, not again for `accept_after` rounds; a width that cannot win even at the optimistic
    acceptance (a wide bucket of a compute-bound CPU) is never tried."""
    rule = CostRule(accept_after=16)
    c = BucketCosts.fresh({1: 1.0, 4: 2.6}, rule)
    assert choose_width([0.7], c.seconds, 0.1) == 1  # 2.53 tokens for 2.6x the time
    assert choose_width([0.9], c.seconds, 0.1) == 4  # 3.44 tokens
    upper = acceptance_upper([0.7], [2.0])
    assert explore_acceptance(upper, c, 1, 0.0, 0.1, rule) == 4  # fresh: stale at once
    assert explore_acceptance(acceptance_upper([0.7], [200.0]), c, 1, 0.0, 0.1, rule) is None  # sure it loses
    c = observe_cost(c, 4, 2.6, rule, explored=True)
    for r in range(rule.accept_after):
        assert explore_acceptance(upper, c, 1, 0.0, 0.1, rule) is None, r  # it ran: not before accept_after rounds
        c = observe_cost(c, 1, 1.0, rule)
    assert explore_acceptance(upper, c, 1, 0.0, 0.1, rule) == 4
    assert explore_acceptance(upper, c, 4, 0.0, 0.1, rule) is None  # nothing wider than the choice
    hopeless = BucketCosts.fresh({1: 1.0, 4: 4.5}, rule)  # 4 rows' worth of compute: 4 tokens cannot pay
    assert explore_acceptance(acceptance_upper([0.7] * 8, [2.0] * 8), hopeless, 1, 0.0, 0.1, rule) is None
    assert explore_acceptance(upper, c, 1, 0.0, 0.1, CostRule(explore_every=0)) is None  # exploration off
    assert explore_acceptance(upper, BucketCosts.fresh({4: 1.0}), 4) is None  # one width


def test_one_slow_try_does_not_price_a_width_out_of_later_tries():
    """A try whose round read slow (2x its warm-up price) leaves width 4 unconfirmed: the acceptance exploration
    prices it at its warm-up figure until `confirm` served times confirm the learned one (`optimistic_seconds`), so
    it is tried again after `accept_after` rounds; confirmed slow, it is not. The chooser itself prices the learned
    cost throughout."""
    from dflash_jax.spec.policy import optimistic_seconds

    rule = CostRule(accept_after=4, confirm=3)
    upper = acceptance_upper([0.7], [2.0])  # optimistic: about 0.96
    c = BucketCosts.fresh({1: 1.0, 4: 2.6}, rule)
    c = observe_cost(c, 4, 5.2, rule, explored=True)  # one slow try
    assert c.seconds[4] > 3.4 and optimistic_seconds(c, rule)[4] == pytest.approx(2.6)
    for _ in range(rule.accept_after):
        c = observe_cost(c, 1, 1.0, rule)
    assert choose_width(upper, c.seconds, 0.1) == 1  # at the learned price even the optimistic acceptance loses
    assert explore_acceptance(upper, c, 1, 0.0, 0.1, rule) == 4  # at the warm-up price it may win: tried again
    for _ in range(2):  # confirmed slow
        c = observe_cost(c, 4, 5.2, rule, explored=True)
        for _ in range(rule.accept_after):
            c = observe_cost(c, 1, 1.0, rule)
    assert optimistic_seconds(c, rule) == c.seconds
    assert explore_acceptance(upper, c, 1, 0.0, 0.1, rule) is None


def test_an_exploration_costs_what_its_rounds_give_up_at_the_current_estimate():
    """`exploration_loss`: each round's time beyond what the chosen width takes for the same expected tokens, plus
    what it pays up front; nothing when the wider width wins at the estimate. A wide bucket gives up far more
    per try than one row, so the same budget affords it far less often."""
    seconds = {1: 1.0, 4: 2.6}
    tokens = 1 + 0.7 + 0.7 ** 2 + 0.7 ** 3  # width 4 at 0.7
    assert exploration_loss([0.7], seconds, 1, 4, 8) == pytest.approx(8 * (2.6 - tokens))
    assert exploration_loss([0.7], seconds, 1, 4, 8, first=0.5) == pytest.approx(8 * (2.6 - tokens) + 0.5)
    assert exploration_loss([0.95], seconds, 1, 4, 8) == 0.0  # it wins at the estimate: nothing given up
    wide = {1: 16.0, 4: 60.0}  # 16 rows of a compute-bound CPU
    assert exploration_loss([0.7] * 16, wide, 1, 4, 1) > 5 * exploration_loss([0.7], seconds, 1, 4, 8)


def test_drafting_pays_the_held_context_per_token_it_commits():
    """`with_drafting`: a drafting shape pays `per_token` for each token it is expected to commit over the rows;
    width 1 pays nothing. Enough of it turns a marginal drafting choice into width 1."""
    seconds = {1: 1.0, 4: 2.0}
    assert with_drafting(seconds, [0.9], 0.0) == seconds
    tokens = 1 + 0.9 + 0.81 + 0.729
    assert with_drafting(seconds, [0.9, 0.9], 0.1) == pytest.approx({1: 1.0, 4: 2.0 + 0.1 * 2 * tokens})
    c = BucketCosts.fresh(seconds)
    assert decide_width([0.9], c, 0.0, 0.1, None) == (4, False)
    assert decide_width([0.9], c, 0.0, 0.1, None, drafting_per_token=0.4) == (1, False)


def test_each_width_is_priced_with_its_own_host_work():
    """`with_host`: one host figure for every width, or one per width; a drafting round's own host work (more
    tokens emitted per round) can turn a choice that one shared figure gets wrong. The engine keeps the host work of
    its chosen rounds per (row bucket, width) (`Engine.host_by`) and prices with it."""
    from dflash_jax.serve.engine import generate
    from dflash_jax.serve.runner import MAX_BURST, FakeRunner, fake_pair

    seconds = {1: 1.0, 4: 2.0}
    assert with_host(seconds, 0.5) == {1: 1.5, 4: 2.5}
    assert with_host(seconds, {1: 0.5}) == {1: 1.5, 4: 2.0}
    c = BucketCosts.fresh(seconds)
    assert decide_width([0.8], c, 0.4, 0.1, None) == (4, False)  # 2.95 tokens for 2.4 s against 1 for 1.4 s
    assert decide_width([0.8], c, {1: 0.1, 4: 1.5}, 0.1, None) == (1, False)  # 2.95 for 3.5 s against 1 for 1.1 s

    budget = 4 * MAX_BURST + 60  # longer than one call of width-4 rounds: some calls end uncut (priced)
    eng = Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=2, max_prompt_len=64, max_new_tokens=budget,
                 max_queue=8, prefill_chunk=None, widths=[1, 4], block_size=4)
    eng.warmup([16])
    infos = []
    eng.observers.append(infos.append)
    generate(eng, [[1, 2, 3]], max_new_tokens=budget, stop_ids=[])
    chosen = {(i.rows, i.width) for i in infos if i.width and not i.explored and not i.compiles}
    assert chosen and set(eng.host_by) == chosen and all(v >= 0.0 for v in eng.host_by.values())


def test_a_call_its_rows_finishing_cut_short_prices_nothing():
    """A call of several rounds that ended early because its rows finished (the last call of a request) carries the
    whole call's fixed work over its few rounds: it updates neither the width's table entry, nor its host work, nor
    the round time that sizes its calls; the served rates still count it. Calls that ran their rounds do update."""
    from dflash_jax.serve.engine import generate
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    eng = Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=2, max_prompt_len=64, max_new_tokens=70,
                 max_queue=8, prefill_chunk=None, widths=[1, 4], block_size=4, rounds_per_call=16)
    eng.warmup([16])
    eng.choose_width = lambda live: 1
    seen = []

    def observe(info):  # the figures the step left, and whether its call was cut short
        seen.append((info.rounds, eng._cut_short, dict(eng.host_by), eng.bucket_costs(info.rows).seconds[1],
                     dict(eng._round_time), sum(v[0] for v in eng._served.values())))

    eng.observers.append(observe)
    generate(eng, [[1, 2, 3]], max_new_tokens=70, stop_ids=[])  # 69 rounds after the prefill's token: 4 x 16 + 5
    rounds = [r for r, *_ in seen]
    assert rounds[-1] < 16 and seen[-1][1] and not any(cut for _, cut, *_ in seen[:-1])
    before, last = seen[-2], seen[-1]
    assert last[2:5] == before[2:5]  # host work, table entry, round time: unchanged by the cut-short call
    assert last[5] > before[5] * 0.99  # its step counted in the served rates (the older ones faded by 0.99)
    assert before[2] != seen[-3][2] or before[3] != seen[-3][3]  # full calls did update them


def test_the_engine_prices_the_held_contexts_flush_per_token(pair):
    """`Engine.drafting_per_token`: a timed flush of the bucket per step that admitted, over the tokens committed
    per such step; 0 before a flush of the bucket was timed, and for an engine that does not hold the context."""
    eng = Engine(pair, slots=2, block_size=4, widths=(1, 4))
    assert eng.defer_context and eng.drafting_per_token(1) == 0.0 and eng.flush_seconds(1) is None
    eng._flush_times[1] = [0.002, 0.009, 0.001]  # a median: one slow flush moves nothing
    eng._admit_rate = [1.0, 100.0]  # one admitting step per 100 tokens
    assert eng.drafting_per_token(1) == pytest.approx(2e-5)
    assert eng.drafting_per_token(2) == 0.0  # not timed in that bucket
    fixed = Engine(pair, slots=2, block_size=4)
    fixed._flush_times[1], fixed._admit_rate = [0.002], [1.0, 100.0]
    assert not fixed.defer_context and fixed.drafting_per_token(1) == 0.0


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
    assert main(["--acceptance-budget", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-serve: error:") and "--acceptance-budget must be a share" in err and "\n" not in err
    args = build_parser().parse_args([])
    assert not args.no_learn_costs and args.explore_every == 8  # learning on by default
    assert args.acceptance_budget == CostRule().accept_budget
    assert build_parser().parse_args(["--no-learn-costs"]).no_learn_costs


def _undersold(explore: bool):
    """An engine of widths 1 and 4 whose table makes width 4 win only if the draft accepts more than the prior says,
    after one request of 60 tokens (equal to the request run alone whatever the widths). Returns (engine, infos)."""
    from dflash_jax.serve.engine import generate
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    kw = {} if explore else dict(acceptance_exploration=False)  # on by default
    eng = Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=2, max_prompt_len=64, max_new_tokens=60,
                 max_queue=8, prefill_chunk=None, widths=[1, 4], block_size=4, **kw)
    eng.warmup([16])
    assert eng.acceptance_exploration == explore
    eng.cost_table = {rows: {1: 1.0, 4: 2.6} for rows in eng.row_buckets}
    eng.call_overhead = {}
    infos = []
    eng.observers.append(infos.append)
    [req] = generate(eng, [[1, 2, 3]], max_new_tokens=60, stop_ids=[])
    assert req.tokens == FakeRunner.alone([1, 2, 3], 60, 256, ())
    return eng, infos


def test_the_engine_tries_a_drafting_width_its_prior_undersells():
    """Widths 1 and 4, a table where width 4 wins only if the draft accepts more than the prior says: the engine
    runs a short call of width 4 at once (the acceptance evidence, counted in `acceptance_explores`), then goes by
    what it measured; the tokens are the request's own whatever the widths."""
    from dflash_jax.serve.engine import ACCEPTANCE_CALL_ROUNDS

    eng, infos = _undersold(True)
    assert eng.acceptance_explores == 1  # the fresh width 4, once: it is not stale again within the request
    explored = [i for i in infos if i.explored]
    assert len(explored) == 1 and explored[0].width == 4 and 1 <= explored[0].rounds <= ACCEPTANCE_CALL_ROUNDS
    assert infos[0].explored  # at the first round: no evidence yet, an optimistic estimate says it may win


def test_the_acceptance_exploration_turns_off():
    """`acceptance_exploration=False`: the same table and request as above start at width 1 (the prior rules width
    4 out, and nothing tries it; what the rounds then measure is the cost table's to learn); the flag takes only
    True or False, checked before the runner is built."""
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    eng, infos = _undersold(False)
    # no acceptance try; a later switch to width 4 (the fake's host work, large against its rounds, favours it once
    # learned) runs its one short trial call first
    assert eng.acceptance_explores == 0 and sum(i.explored for i in infos) == eng.switch_trials <= 1
    assert infos[0].width == 1
    for bad in (None, 1, "yes"):
        with pytest.raises(TypeError, match="acceptance_exploration"):
            Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=2, widths=[1, 4], block_size=4,
                   acceptance_exploration=bad)


def test_held_rows_fade_toward_what_the_draft_accepted_not_the_prior(pair):
    """Width-1 rounds propose nothing: the engine-wide estimate fades toward the long-run acceptance of the drafting
    verifies (`long_run_acceptance`), so an engine that saw its draft accept 0.9 does not forget it while held; with
    no drafting verify yet, toward `acceptance_prior`."""
    from dflash_jax.serve.engine import Request, SamplingParams

    eng = Engine(pair, slots=2, block_size=4, widths=(1, 4), acceptance_prior=0.6)
    assert eng.long_run_acceptance == pytest.approx(0.6)
    req = Request(id=0, prompt=[1], max_new_tokens=8, sampling=SamplingParams(), stop_ids=[], seed=0)
    for _ in range(40):  # 4 tokens a verify: 3 of 3 proposals accepted
        eng._observe_acceptance(req, 4, 4, False)
    for _ in range(10):  # one in ten rejected
        eng._observe_acceptance(req, 4, 3, False)
    assert 0.85 < eng.long_run_acceptance < 0.97
    for _ in range(200):
        eng._fade_prior()
    g = eng._hits / (eng._hits + eng._misses)
    assert g == pytest.approx(eng.long_run_acceptance, abs=1e-6)


def test_the_acceptance_exploration_spends_a_budget_of_the_served_time():
    """After the first try (free: nothing measured yet), a try runs only when the credit (`CostRule.accept_budget` of
    the served time, less what the tries before it were expected to lose) covers what it is expected to lose at the
    current estimate (`exploration_loss`), which it then spends."""
    from dflash_jax.serve.engine import ACCEPT_FREE_EVIDENCE, ACCEPTANCE_CALL_ROUNDS, Request, SamplingParams, generate
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    def engine(**kw):
        eng = Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=2, max_prompt_len=64, max_new_tokens=400,
                     max_queue=8, prefill_chunk=None, widths=[1, 4], block_size=4, **kw)
        eng.warmup([16])
        eng.cost_table = {rows: {1: 1e-3, 4: 2.9e-3} for rows in eng.row_buckets}  # 4 wins only above 0.85
        eng.call_overhead = {}
        return eng

    eng = engine()
    eng.requests[0] = Request(id=0, prompt=[1], max_new_tokens=8, sampling=SamplingParams(), stop_ids=[], seed=0)
    eng.host_seconds, eng._host_samples = 0.0, 1
    assert eng.choose_width([0]) == 4 and eng.acceptance_explores == 1  # nothing measured: free
    eng._accept_explore = False
    eng._long_hits = ACCEPT_FREE_EVIDENCE + 10.0  # the acceptance known (past the learning)
    eng._costs[1] = observe_cost(eng.bucket_costs(1), 1, 1e-3, eng.cost_rule)
    for _ in range(eng.cost_rule.accept_after):
        eng._costs[1] = observe_cost(eng._costs[1], 1, 1e-3, eng.cost_rule)
    eng._explore_credit = 0.0
    assert eng.choose_width([0]) == 1 and eng.acceptance_explores == 1  # no credit
    alpha = eng.row_acceptance(eng.requests[0])
    loss = exploration_loss([alpha], eng.bucket_costs(1).seconds, 1, 4, ACCEPTANCE_CALL_ROUNDS)
    assert loss > 0
    eng._explore_credit = 1.5 * loss
    assert eng.choose_width([0]) == 4 and eng.acceptance_explores == 2
    assert eng._explore_credit == pytest.approx(0.5 * loss)  # spent

    served = engine(cost_rule=CostRule(accept_budget=0.05))  # the credit: a share of the steps' time
    infos = []
    served.observers.append(infos.append)
    [req] = generate(served, [[5, 6, 7]], max_new_tokens=400, stop_ids=[])
    assert req.tokens == FakeRunner.alone([5, 6, 7], 400, 256, ())
    assert 0.0 < served._explore_credit <= 0.05 * sum(i.seconds for i in infos)


def test_a_width_found_wanting_waits_longer_before_the_next_try():
    """A try whose bucket then chooses a narrower width doubles the rounds before the next try there (up to
    `ACCEPT_BACKOFF` times `accept_after`); a try after which the tried width is chosen resets the wait. Where
    width 4 keeps losing (4 rows on a CPU, where each try also appends the held context first), tries thin out."""
    from dflash_jax.serve.engine import ACCEPT_BACKOFF, ACCEPT_FREE_EVIDENCE

    eng = _trying_engine()
    eng._long_hits, eng._explore_credit = ACCEPT_FREE_EVIDENCE + 10.0, 1.0  # the acceptance known; credit to spare
    base = eng.cost_rule.accept_after
    waits = []
    eng._costs[1] = observe_cost(eng.bucket_costs(1), 4, 2.9e-3, eng.cost_rule, explored=True)  # just ran
    for _ in range(6):
        for _ in range(eng._accept_wait.get(1, base) - 1):  # one round short of the wait: no try
            eng._costs[1] = observe_cost(eng._costs[1], 1, 1e-3, eng.cost_rule)
        assert eng.choose_width([0]) == 1
        eng._costs[1] = observe_cost(eng._costs[1], 1, 1e-3, eng.cost_rule)
        assert eng.choose_width([0]) == 4 and eng._explored == 4  # a try
        eng._costs[1] = observe_cost(eng._costs[1], 4, 2.9e-3, eng.cost_rule, explored=True)
        eng._accept_tried[1] = 4  # as `step` records a try that ran
        assert eng.choose_width([0]) == 1  # found wanting: the verdict
        waits.append(eng._accept_wait[1])
    assert waits == [min(base * 2 ** k, ACCEPT_BACKOFF * base) for k in range(1, 7)]
    eng._accept_tried[1] = 4
    eng.requests[0].accept_hits = 1000.0  # this row accepts everything: width 4 chosen after the try
    assert eng.choose_width([0]) == 4 and eng._explored is None and eng._accept_wait[1] == base


def _trying_engine():
    """A fake engine of widths 1 and 4 whose table makes width 4 win only above an acceptance of 0.85, one live
    request, no host work and no stale-neighbour exploration in the way of the acceptance tries."""
    from dflash_jax.serve.engine import Request, SamplingParams
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    eng = Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=2, max_prompt_len=64, max_new_tokens=400,
                 max_queue=8, prefill_chunk=None, widths=[1, 4], block_size=4,
                 cost_rule=CostRule(explore_every=10**6))
    eng.warmup([16])
    eng.cost_table = {rows: {1: 1e-3, 4: 2.9e-3} for rows in eng.row_buckets}
    eng.call_overhead = {}
    eng.requests[0] = Request(id=0, prompt=[1], max_new_tokens=8, sampling=SamplingParams(), stop_ids=[], seed=0)
    eng.host_seconds, eng._host_samples = 0.0, 1
    return eng


def test_while_the_acceptance_is_learned_a_try_comes_at_the_next_call_and_costs_no_credit():
    """Up to `ACCEPT_FREE_EVIDENCE` of drafting evidence the engine is still learning what its draft accepts: a try
    runs at the next call after the last drafting one wherever the optimistic estimate hopes, whatever the backoff
    and the credit, and spends none. Past it, the backoff and the budget apply again."""
    from dflash_jax.serve.engine import ACCEPT_BACKOFF, ACCEPT_FREE_EVIDENCE

    eng = _trying_engine()
    base = eng.cost_rule.accept_after
    eng._long_hits, eng._explore_credit = 10.0, 0.0  # one try's worth of evidence, no credit
    eng._accept_wait[1] = ACCEPT_BACKOFF * base  # backed off as far as it goes
    eng._costs[1] = observe_cost(eng.bucket_costs(1), 4, 2.9e-3, eng.cost_rule, explored=True)  # just ran
    assert eng.choose_width([0]) == 1  # not at the very call after it
    eng._costs[1] = observe_cost(eng._costs[1], 1, 1e-3, eng.cost_rule)
    assert eng.choose_width([0]) == 4 and eng._explored == 4 and eng._explore_credit == 0.0
    eng._long_hits, eng._explore_credit = ACCEPT_FREE_EVIDENCE + 1.0, 1.0  # learned: the backoff holds it off
    eng._costs[1] = observe_cost(eng._costs[1], 4, 2.9e-3, eng.cost_rule, explored=True)
    for _ in range(3):
        eng._costs[1] = observe_cost(eng._costs[1], 1, 1e-3, eng.cost_rule)
        assert eng.choose_width([0]) == 1


@pytest.mark.parametrize("alone, together, prefills", [(0.001, 0.01, 3), (0.004, 0.01, 1)])
def test_waiting_requests_prefill_one_by_one_where_that_measured_cheaper(alone, together, prefills):
    """Each served prefill is timed per (group, prompt bucket) (`prefill_cost`); three requests waiting together
    prefill one by one when three single prefills measured cheaper than one group padded to 4 rows (a CPU computes
    padding rows as real ones), together otherwise; the tokens are the requests' own either way."""
    from dflash_jax.serve.engine import PREFILL_WINDOW, generate
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    eng = Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=4, max_prompt_len=64, max_new_tokens=8,
                 max_queue=8, prefill_chunk=None, block_size=4)
    eng.warmup([16])
    [req] = generate(eng, [[1, 2, 3]], max_new_tokens=4, stop_ids=[])  # a served prefill is timed
    width = eng.prompt_bucket(3)
    assert eng.prefill_cost(1, width) > 0.0 and eng.prefill_cost(4, width) is None
    eng._prefill_times = {(1, width): [alone] * PREFILL_WINDOW, (4, width): [together] * PREFILL_WINDOW}
    before = eng.runner.calls["prefill"]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    reqs = generate(eng, prompts, max_new_tokens=8, stop_ids=[])
    assert [r.tokens for r in reqs] == [FakeRunner.alone(p, 8, 256, ()) for p in prompts]
    assert eng.runner.calls["prefill"] - before == prefills
    assert (eng.split_admissions > 0) == (prefills > 1)


def test_what_the_widths_served_overrules_the_round_model():
    """`Engine.served_rate`: every chosen step adds its committed tokens over its row-seconds (admissions left out)
    to its (bucket, width), the bucket's older steps faded. Over enough steps of both: a drafting width that served
    fewer tokens per row-second than width 1 gives way to it where the round model expects it to win, and one that
    served more than (1 + margin) times width 1's runs where the model picks width 1; with too few steps, or within
    the margin, the model's choice stands. A width that stops running fades out."""
    from dflash_jax.serve.engine import SERVED_DECAY, SERVED_STEPS, Request, SamplingParams, generate
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    eng = Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=2, max_prompt_len=64, max_new_tokens=60,
                 max_queue=8, prefill_chunk=None, widths=[1, 4], block_size=4)
    eng.warmup([16])
    infos = []
    eng.observers.append(infos.append)
    [req] = generate(eng, [[1, 2, 3]], max_new_tokens=60, stop_ids=[])
    assert req.tokens == FakeRunner.alone([1, 2, 3], 60, 256, ())
    chosen = [i for i in infos if i.width and not i.compiles and not i.prefill_chunks]
    keys = {(i.rows, i.width) for i in chosen}
    assert keys and set(eng._served) == keys
    for key in keys:
        rate, steps = eng.served_rate(*key)
        assert rate > 0.0 and 0.0 < steps <= sum((i.rows, i.width) == key for i in chosen)
    assert eng.served_rate(2, 4) is None

    eng.call_overhead, eng.host_seconds, eng._host_samples, eng.host_by = {}, 0.0, 1, {}
    eng._flush_times, eng._costs = {}, {}
    eng.requests[0] = Request(id=0, prompt=[1], max_new_tokens=8, sampling=SamplingParams(), stop_ids=[], seed=0)
    eng.requests[0].accept_hits, eng.requests[0].accept_misses = 50.0, 5.0
    eng.cost_table = {rows: {1: 1e-3, 4: 1.5e-3} for rows in eng.row_buckets}  # 4 wins at this acceptance
    eng._served = {}
    assert eng.choose_width([0]) == 4  # the round model's pick

    overrules = eng.served_overrules
    eng._served = {(1, 1): [20.0, 20.0, 0.02], (1, 4): [20.0, 30.0, 0.04]}  # 1000 against 750 tokens / row-second
    assert eng.served_choice(1, 4) == 1 and eng.served_choice(1, 1) is None
    assert eng.choose_width([0]) == 1 and eng.served_overrules == overrules + 1
    eng._served[(1, 4)] = [SERVED_STEPS - 1.0, 30.0, 0.04]  # too few steps of width 4: the model stands
    assert eng.served_choice(1, 4) is None and eng.choose_width([0]) == 4

    eng.cost_table = {rows: {1: 1e-3, 4: 5e-3} for rows in eng.row_buckets}  # 4 loses at any acceptance
    eng._costs = {}
    eng._served = {}
    assert eng.choose_width([0]) == 1
    eng._served = {(1, 1): [20.0, 20.0, 0.02], (1, 4): [20.0, 60.0, 0.04]}  # 1000 against 1500
    assert eng.choose_width([0]) == 4 and eng.served_overrules == overrules + 2
    eng._served[(1, 4)] = [20.0, 20.0 * (1.0 + eng.width_margin) * 0.99, 0.02]  # within the margin: the model
    assert eng.served_choice(1, 1) is None and eng.choose_width([0]) == 1

    # a few calls of each are evidence enough. At 4 clients on the shipped pair, width 1 had served 6.4 (decayed) steps
    # of its bucket when the model switched to width 4, which then served 0.73x its rate; with 8 steps needed the
    # overrule never came (width 1 no longer ran to add any), and width 4 ran 67% of the rounds at 0.75x plain
    eng.cost_table = {rows: {1: 1e-3, 4: 1.5e-3} for rows in eng.row_buckets}
    eng._costs = {}
    eng._served = {(1, 1): [6.4, 6.4 * 6.0, 6.4e-3], (1, 4): [6.7, 6.7 * 4.35, 6.7e-3]}  # 6000 against 4350
    assert eng.choose_width([0]) == 1

    # a width turned down fades out: after enough steps of width 1 in the bucket, the model decides again
    eng._served = {(1, 1): [20.0, 20.0, 0.02], (1, 4): [20.0, 30.0, 0.04]}
    step = RoundInfo(width=1, rows=1, live=1, tokens=1)
    n = 0
    while eng.served_choice(1, 4) is not None:
        eng._note_served(step, 1e-3)
        n += 1
    assert n == pytest.approx(np.log(SERVED_STEPS / 20.0) / np.log(SERVED_DECAY), abs=1.0)
    assert eng._served[(1, 4)][1] / eng._served[(1, 4)][2] == pytest.approx(750.0)  # faded, not changed


def test_a_switch_to_a_drafting_width_not_served_lately_runs_a_short_call_first():
    """A bucket serving width 1 whose round model now prefers width 4 on a price the bucket has not served (the
    warm-up's, from idle rows): the switch runs as an exploration (a short call priced from its own rounds, the
    incumbent kept), and the model decides again on that. Where width 4 then still wins, its calls run whole; where
    its live rounds cost far more, the bucket stays at width 1. A wrong switch costs one short call, not calls of
    50 ms until the served rates overrule it; with a fixed table (nothing re-priced) the model's pick runs as it is."""
    from dflash_jax.serve.engine import EXPLORE_CALL_ROUNDS, Request, SamplingParams
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    def switching(**kw):
        eng = _trying_engine() if not kw else Engine(
            fake_pair(vocab_size=256), runner=FakeRunner, slots=2, max_prompt_len=64, max_new_tokens=400,
            prefill_chunk=None, widths=[1, 4], block_size=4, **kw)
        if kw:
            eng.warmup([16])
            eng.requests[0] = Request(id=0, prompt=[1], max_new_tokens=8, sampling=SamplingParams(), stop_ids=[],
                                      seed=0)
        eng.acceptance_exploration = False
        eng.cost_table = {rows: {1: 1e-3, 4: 1.5e-3} for rows in eng.row_buckets}  # 4 wins at the prior's 0.7
        eng._incumbent[1] = 1
        if eng.learn_costs:
            for _ in range(4):  # the bucket has served width 1
                eng._costs[1] = observe_cost(eng.bucket_costs(1), 1, 1e-3, eng.cost_rule)
        return eng

    eng = switching()
    rule = eng.cost_rule
    assert eng.choose_width([0]) == 4 and eng._explored == 4 and eng.switch_trials == 1
    assert eng._incumbent[1] == 1  # a trial: the bucket still runs width 1
    assert eng._burst_count(1, 4, None) == EXPLORE_CALL_ROUNDS
    eng._costs[1] = observe_cost(eng._costs[1], 4, 1.5e-3, rule, explored=True)  # priced as the warm-up did
    assert eng.choose_width([0]) == 4 and eng._explored is None and eng._incumbent[1] == 4  # now whole calls
    assert eng.switch_trials == 1 and eng._burst_count(1, 4, None) > EXPLORE_CALL_ROUNDS
    for _ in range(rule.stale_after):  # width 1 again for a while: width 4 unserved there, a switch tries again
        eng._costs[1] = observe_cost(eng._costs[1], 1, 1e-3, rule)
    eng._incumbent[1] = 1
    assert eng.choose_width([0]) == 4 and eng._explored == 4 and eng.switch_trials == 2

    wrong = switching()  # its live rounds cost 6x width 1's: one trial, and the bucket stays at width 1
    assert wrong.choose_width([0]) == 4 and wrong._explored == 4
    wrong._costs[1] = observe_cost(wrong._costs[1], 4, 6e-3, rule, explored=True)
    assert wrong.choose_width([0]) == 1 and wrong._explored is None and wrong.switch_trials == 1

    fixed = switching(round_seconds={1: 1e-3, 4: 1.5e-3})
    assert not fixed.learn_costs and fixed.choose_width([0]) == 4 and fixed._explored is None
    assert fixed.switch_trials == 0


def test_the_cost_metrics_show_the_table_the_explored_rounds_and_the_switch_trials():
    """`attach_cost_metrics`: a server's registry (any observer whose object holds `metrics.registry`) gets the
    learned table by row bucket and width, the explored rounds by width and their time, and the switch trials."""
    from dflash_jax.serve.engine import attach_cost_metrics
    from dflash_jax.serve.metrics import Metrics

    class Server:
        def __init__(self):
            self.metrics = Metrics()

        def on_round(self, info):
            pass

    eng = _trying_engine()
    server = Server()
    eng.observers.append(server.on_round)
    assert attach_cost_metrics(eng) == 1 and attach_cost_metrics(eng) == 0  # once per registry
    eng.switch_trials, eng.explore_rounds[4], eng.explore_seconds = 2, 5, 0.25
    text = server.metrics.render()[0].decode()

    def metric(name):
        return float(next(x for x in text.splitlines() if x.startswith(name)).rsplit(" ", 1)[1])

    assert metric("dflash_width_switch_trials_total") == 2.0
    assert metric('dflash_width_explore_rounds_total{width="4"}') == 5.0
    assert metric('dflash_width_explore_rounds_total{width="1"}') == 0.0
    assert metric("dflash_width_explore_seconds_total") == 0.25
    assert metric('dflash_cost_table_seconds{rows="1",width="4"}') == pytest.approx(2.9e-3)


def test_explored_calls_leave_the_host_work_figures_alone():
    """An explored call (a stale neighbour, an acceptance try, a switch's trial) is short, its share of the call's
    host work per round several times a whole call's: neither the engine-wide host figure nor any width's learns from
    it. Chosen calls do."""
    from dflash_jax.serve.engine import generate
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    def engine(explore: bool):
        eng = Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=2, max_prompt_len=64, max_new_tokens=60,
                     max_queue=8, prefill_chunk=None, widths=[1, 4], block_size=4, rounds_per_call=4)
        eng.warmup([16])

        def choose(live):
            eng._explored = 4 if explore else None
            return 4

        eng.choose_width = choose
        [req] = generate(eng, [[1, 2, 3]], max_new_tokens=60, stop_ids=[])
        assert req.tokens == FakeRunner.alone([1, 2, 3], 60, 256, ())
        return eng

    explored = engine(True)
    assert explored.explore_rounds[4] > 0
    assert explored._host_samples == 0 and explored.host_seconds == 0.0 and explored.host_by == {}
    chosen = engine(False)
    assert chosen._host_samples > 0 and chosen.host_by


def _served_call(rng, alphas, budgets, width, rounds):
    """One simulated device call: each round every unfinished row commits 1 + its accepted run of `width - 1`
    proposals (each accepted at its alpha given the ones before), up to its budget; the call ends after `rounds`
    rounds or when every row is done. Returns (tokens committed, rounds run)."""
    left = np.array(budgets, np.int64)
    tokens = ran = 0
    while ran < rounds and left.any():
        run = np.ones(len(left), np.int64)
        for k in range(1, width):
            grow = (run == k) & (rng.random(len(left)) < alphas)
            run += grow
        got = np.minimum(run, left)
        tokens, left, ran = tokens + int(got.sum()), left - got, ran + 1
    return tokens, ran


def test_a_call_prices_the_rows_its_rounds_outrun():
    """`call_occupancy`: the share of a call's rows x rounds that commit, against a simulation of the calls it
    models. A row that finishes inside a call sits out its other rounds; a width whose rounds commit more fills its
    rows' budgets in fewer rounds, so at 4 rows of 64 - 192 tokens width-4 calls of 55 rounds idle much of their
    rows x rounds where width-1 calls of 64 do little. One row, or rows that outlast the call, idle nothing."""
    from dflash_jax.spec.policy import call_occupancy

    alphas, budgets = np.array([0.92, 0.9, 0.94, 0.91]), [40, 90, 150, 190]
    rounds = {1: 64, 4: 55}
    occ = call_occupancy(alphas, budgets, rounds)
    assert occ[1] == pytest.approx((40 + 3 * 64) / (4 * 64)) and occ[4] < 0.7
    rng = np.random.default_rng(0)
    for w, n in rounds.items():  # what the calls serve per row-round, modelled and simulated
        worth = sum((1.0 - a ** w) / (1.0 - a) for a in alphas)
        served = [_served_call(rng, alphas, budgets, w, n) for _ in range(200)]
        simulated = sum(t for t, _ in served) / sum(r for _, r in served)
        assert occ[w] * worth == pytest.approx(simulated, rel=0.08), w
    assert call_occupancy([0.9], [30], rounds) == {1: 1.0, 4: 1.0}  # one row: its call ends when it finishes
    assert call_occupancy(alphas, [400] * 4, rounds) == {1: 1.0, 4: 1.0}  # every row outlasts the call

    # the choice: width 4's rounds at 2.8x width 1's would serve 1.2x its tokens with every row busy, but its calls'
    # idle rows take that back
    seconds = {1: 1e-3, 4: 2.8e-3}
    assert choose_width(alphas, seconds, MARGIN) == 4
    assert choose_width(alphas, seconds, MARGIN, occ) == 1


def test_the_engine_prices_a_calls_idle_rows_only_where_the_call_outlives_them():
    """`Engine.choose_width` scales each width's expected tokens by its calls' occupancy of the live rows' budgets
    left: short budgets turn a round model's width 4 to width 1; long ones (every row outlasts the call), a request
    waiting (the call ends at the first finish), one row, or rounds of a call each keep width 4."""
    from dflash_jax.serve.engine import Request, SamplingParams
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    def engine(budgets, **kw):
        eng = Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=4, max_prompt_len=64, max_new_tokens=400,
                     prefill_chunk=None, widths=[1, 4], block_size=4, round_seconds={1: 1e-3, 4: 2.8e-3},
                     call_seconds=0.15, **kw)
        eng.warmup([16])
        eng.acceptance_exploration = False
        for s, b in enumerate(budgets):
            eng.requests[s] = Request(id=s, prompt=[1], max_new_tokens=b, sampling=SamplingParams(), stop_ids=[],
                                      seed=0, accept_hits=60.0, accept_misses=5.0)
        eng._round_time = {(4, 1): 1e-3, (4, 4): 2.8e-3, (1, 1): 1e-3, (1, 4): 2.8e-3}  # calls of 64 and 54 rounds
        return eng

    short, live = [40, 90, 150, 190], [0, 1, 2, 3]
    occ = engine(short)._occupancy(live, 4, [0.92] * 4, [1, 4], None)
    assert occ[4] < 0.75 * occ[1]
    assert engine(short).choose_width(live) == 1
    assert engine([400] * 4).choose_width(live) == 4
    waiting = engine(short)
    waiting.queue.append(Request(id=9, prompt=[1], max_new_tokens=8, sampling=SamplingParams(), stop_ids=[], seed=0))
    assert waiting._occupancy(live, 4, [0.92] * 4, [1, 4], None) is None and waiting.choose_width(live) == 4
    assert engine(short[:1]).choose_width([0]) == 4
    assert engine(short, rounds_per_call=1).choose_width(live) == 4
