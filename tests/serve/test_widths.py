"""The verify width chosen per round: the pure choice rule, and lossless output at every width of one engine
(greedy: the same tokens as alone whatever widths its rounds used; sampled: the same draws as `spec.generate` at any
block size, whatever widths its rounds used: the draws are keyed by output position), with no compiles after warm-up. The engine tests compile 4 widths' programs: slow."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash_jax.compile_cache import CompileCounter
from dflash_jax.serve.engine import Engine, generate as serve_generate
from dflash_jax.spec.policy import choose_width, default_widths, expected_tokens, worth_sums
from dflash_jax.spec import SamplingParams
from dflash_jax.spec import generate as spec_generate

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(40, 56)), [1, 2, 3, 4]]
SAMPLING = [SamplingParams(), SamplingParams(temperature=0.9), SamplingParams(temperature=1.2, top_k=20),
            SamplingParams()]
BUDGET = 28


def test_choice_rule():
    assert default_widths(8) == (1, 2, 4, 8) and default_widths(6) == (1, 2, 4, 6) and default_widths(1) == (1,)
    np.testing.assert_allclose(expected_tokens([0.0, 0.5], 4), [1.0, 1.875])
    flat = {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04}  # latency-bound: wider is almost free
    steep = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}  # compute-bound: cost proportional to width
    assert choose_width([0.8] * 4, flat) == 8
    assert choose_width([0.005] * 4, flat) == 1  # nothing gets accepted: the extra 1-4% is not worth it
    assert choose_width([0.8] * 4, steep) == 1  # 1 token per unit of time beats 1.8 / 2
    mid = {1: 1.0, 2: 1.3, 4: 1.9, 8: 3.2}
    assert choose_width([0.75] * 8, mid) == 4  # 2.73 / 1.9 beats 1.75 / 1.3 and 3.6 / 3.2
    assert choose_width([0.5], {1: 1.0, 2: 1.5}) == 1  # a tie goes to the narrower
    # a width's measured scale on the model's expected tokens: 4 x 2.73 tokens over 2.5 s misses the 10% margin
    # against width 1 (3.97 < 4 a second); committing 5% more than the model expects, it clears it (4.17)
    assert worth_sums([0.75] * 4, [1, 4], {4: 1.05}) == pytest.approx([4.0, 4 * 2.734375 * 1.05])
    assert choose_width([0.75] * 4, {1: 1.0, 4: 2.5}, margin=0.1) == 1
    assert choose_width([0.75] * 4, {1: 1.0, 4: 2.5}, margin=0.1, scale={4: 1.05}) == 4
    assert choose_width([0.75] * 4, {1: 1.0, 4: 2.5}, margin=0.1, scale={2: 1.2}) == 1  # another width's: none
    # the width running now pays no margin: 4.37 a second against width 1's 4 / 1.1 keeps width 4; width 1 running,
    # 3.97 against 4 keeps width 1 (a change needs the clear gain both ways)
    assert choose_width([0.75] * 4, {1: 1.0, 4: 2.5}, margin=0.1, incumbent=4) == 4
    assert choose_width([0.75] * 4, {1: 1.0, 4: 2.5}, margin=0.1, incumbent=1) == 1
    assert choose_width([0.5] * 4, {1: 1.0, 4: 2.5}, margin=0.1, incumbent=4) == 1  # 7.5 / 2.5 < 4 / 1.1


@pytest.fixture(scope="module")
def engine(pair):
    eng = Engine(pair, slots=3, block_size=8, widths="auto", max_prompt_len=16, max_new_tokens=32,
                 round_seconds={1: 1.0, 2: 1.3, 4: 1.9, 8: 3.2})
    eng.warmup([16])
    return eng


def _run(engine, width_of_round, **kw):
    """Serves PROMPTS with each round's width from `width_of_round`, one round per call (calls of several rounds are
    sized by measured time: how many widths a run meets would follow the machine's speed)."""
    saved = engine.choose_width
    engine.choose_width, engine.rounds_per_call = width_of_round, 1
    rounds = []
    engine.observers.append(rounds.append)
    try:
        with CompileCounter() as counter:
            reqs = serve_generate(engine, PROMPTS, max_new_tokens=BUDGET, stop_ids=[], **kw)
    finally:
        engine.choose_width, engine.rounds_per_call = saved, "auto"
        engine.observers.remove(rounds.append)
    assert counter.compiles == 0
    return reqs, rounds


@pytest.mark.slow
def test_greedy_lossless_when_every_round_changes_width(engine, pair):
    cycle = itertools.cycle([8, 1, 4, 2, 8, 8, 1])
    reqs, rounds = _run(engine, lambda live: next(cycle))
    assert {r.width for r in rounds if r.width} == {1, 2, 4, 8}
    for p, r in zip(PROMPTS, reqs):
        assert r.tokens == spec_generate(pair, [p], max_new_tokens=BUDGET, stop_ids=[]).tokens[0]
    assert max(max(r.acceptance) for r in reqs) >= 3  # wide rounds really accepted proposals


@pytest.mark.slow
@pytest.mark.parametrize("width", [1, 4])
def test_sampled_at_a_width_draws_as_alone(engine, pair, width):
    """A narrower verify on the engine's widest layout (the draft context padded, width 1 feeding the draft's
    context cache) is the library's verify of that block size: the same draws from the same seeds."""
    reqs, _ = _run(engine, lambda live: width, sampling=SAMPLING, seed=[0, 1, 2, 3])
    for i, r in enumerate(reqs):
        alone = spec_generate(pair, [PROMPTS[i]], max_new_tokens=BUDGET, sampling=SAMPLING[i], stop_ids=[], seed=i,
                              block_size=width)
        assert r.tokens == alone.tokens[0], i


@pytest.mark.slow
def test_sampled_when_every_round_changes_width_equals_alone_at_any_block(engine, pair):
    """Seeds are reproducible under `--widths auto`: the target's draws are keyed by output position, not by round
    (`spec.session.position_draws`), so a seeded sample whose rounds changed width every time is the sample the
    library draws alone at block 1 (no speculation) and at block 8, and proposals were accepted on the way."""
    cycle = itertools.cycle([8, 1, 4, 2, 8, 8, 1])
    reqs, rounds = _run(engine, lambda live: next(cycle), sampling=SAMPLING, seed=[0, 1, 2, 3])
    assert {r.width for r in rounds if r.width} == {1, 2, 4, 8}
    for i, r in enumerate(reqs):
        for block in (1, 8):
            alone = spec_generate(pair, [PROMPTS[i]], max_new_tokens=BUDGET, sampling=SAMPLING[i], stop_ids=[],
                                  seed=i, block_size=block)
            assert r.tokens == alone.tokens[0], (i, block)
    assert max(max(r.acceptance) for i, r in enumerate(reqs) if SAMPLING[i].temperature) >= 2


@pytest.mark.slow
def test_the_engine_chooses_by_its_table(engine):
    rounds = []
    engine.observers.append(rounds.append)
    try:
        serve_generate(engine, PROMPTS, max_new_tokens=BUDGET, stop_ids=[])
        chosen = {r.width for r in rounds if r.width}
        saved = engine.round_seconds
        engine.round_seconds = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}
        # a new table: the width the moderate one left running would keep its place within the margin (at an
        # acceptance near 1, width 2 makes 1.98 tokens a round for 2.0 against width 1's 1 for 1.0), and the rates
        # its widths served in real time would overrule a model of made-up costs (`served_choice`: width 4 serving
        # 10% more than width 1 did on this CPU, when both had served enough steps, which depends on the load)
        engine._incumbent.clear()
        engine._served.clear()
        rounds.clear()
        serve_generate(engine, PROMPTS, max_new_tokens=BUDGET, stop_ids=[])
        assert {r.width for r in rounds if r.width} == {1}  # cost proportional to width: never speculate
    finally:
        engine.round_seconds = saved
        engine.observers.remove(rounds.append)
    assert chosen - {1}  # the moderate table speculates
    assert engine.width_rounds[1] > 0 and sum(engine.width_rounds.values()) > 0


def test_width_arguments_are_checked(pair):
    with pytest.raises(ValueError, match="widths must be verify widths between 1 and block_size 4"):
        Engine(pair, slots=1, block_size=4, widths=[1, 8])
    with pytest.raises(ValueError, match="round_seconds must give a positive time for each width"):
        Engine(pair, slots=1, block_size=4, widths="auto", round_seconds={1: 1.0})


def test_width_one_rounds_fade_a_requests_evidence(pair):
    """A request moved to width 1 after poor rounds is tried wider again: width-1 rounds propose nothing, so its
    own evidence fades and its estimate returns to the engine-wide one. The margin keeps near-ties narrow."""
    from dflash_jax.serve.engine import Request

    eng = Engine(pair, slots=1, block_size=4, widths="auto", round_seconds={1: 1.0, 2: 1.3, 4: 1.9})
    req = Request(id=0, prompt=[1], max_new_tokens=8, sampling=SamplingParams(), stop_ids=[], seed=0)
    for _ in range(6):
        eng._observe_acceptance(req, 4, 1, False)  # nothing accepted
    low = eng.row_acceptance(req)
    assert low < 0.2
    for _ in range(20):
        eng._observe_acceptance(req, 1, 1, False)
    assert eng.row_acceptance(req) > 2 * low
    assert choose_width([0.5], {1: 1.0, 2: 1.4}) == 2  # 1.5 / 1.4: a 7% gain
    assert choose_width([0.5], {1: 1.0, 2: 1.4}, margin=0.1) == 1  # within the margin: no speculation


def test_a_widths_outcome_scales_what_the_model_expects_of_it(pair):
    """`Engine.worth_scale`: per chain width, the tokens its verifies committed over the tokens the chain model
    expected of each (at the request's estimate just before it), decayed per verify, with `WORTH_PRIOR` tokens of
    "as expected", within `WORTH_SCALE_RANGE`. Width-1 rounds and tree verifies are not counted; a verify its
    request's end cut short neither. The chooser prices the width with it."""
    from dflash_jax.serve.engine import LONG_RUN_DECAY, WORTH_PRIOR, WORTH_SCALE_RANGE, Request
    from dflash_jax.spec.tree import TreeShape

    eng = Engine(pair, slots=1, block_size=4, widths=(1, 4), round_seconds={1: 1.0, 4: 2.5})
    req = Request(id=0, prompt=[1], max_new_tokens=64, sampling=SamplingParams(), stop_ids=[], seed=0)
    assert eng.worth_scale == {}
    got = want = 0.0
    for committed in [4, 4, 2, 4, 3, 4, 4, 1, 4, 4] * 3:
        a = eng.row_acceptance(req)
        got, want = LONG_RUN_DECAY * got + committed, LONG_RUN_DECAY * want + float(expected_tokens(a, 4))
        eng._observe_acceptance(req, 4, committed, False)
    eng._observe_acceptance(req, 1, 1, False)
    eng._observe_acceptance(req, TreeShape(8, 2), 4, False)
    eng._observe_acceptance(req, 4, 1, True)  # the request's last verify: its end may have cut it
    assert set(eng.worth_scale) == {4}
    assert eng.worth_scale[4] == pytest.approx((got + WORTH_PRIOR) / (want + WORTH_PRIOR))
    assert eng.worth_scale[4] != pytest.approx(1.0, abs=1e-3)

    # far more than the model expects (its estimate held low before each verify): the scale stops at the range's top
    for _ in range(100):
        req.accept_hits, req.accept_misses = 0.0, 50.0
        eng._observe_acceptance(req, 4, 4, False)
    assert eng.worth_scale[4] == WORTH_SCALE_RANGE[1]

    # the chooser: width 4 misses the margin at the request's estimate, and clears it with the measured scale
    eng.requests[0] = req
    req.accept_hits, req.accept_misses = 15.0, 5.0
    eng.learn_costs, eng._host_samples, eng.host_seconds = False, 1, 0.0
    alpha = eng.row_acceptance(req)
    # width 4 at 1.12x what would tie it with width 1 before the margin: short of the 10% margin by itself
    eng.round_seconds = table = {1: 1.0, 4: 1.12 * float(expected_tokens(alpha, 4)) / (1.0 + eng.width_margin)}
    assert choose_width([alpha], table, eng.width_margin) == 1
    assert choose_width([alpha], table, eng.width_margin, eng.worth_scale) == 4
    assert eng.choose_width([0]) == 4
    eng._worth.clear()
    assert eng.choose_width([0]) == 4  # the bucket runs width 4 now: width 1 must win by the margin to replace it
    eng._incumbent.clear()
    assert eng.choose_width([0]) == 1
