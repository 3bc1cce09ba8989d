"""The engine's slots in lanes (`serve.lanes.LanedRunner`: slot s in lane s % n, one resident runner per lane, calls
of several rounds side by side on their own threads): requests that queue, join, leave and move across lanes equal
each request run alone (greedy and sampled), with proposals accepted, calls of several rounds run in every lane and
nothing compiled while serving; the lane choice and its errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dflash_jax.compile_cache import CompileCounter
from dflash_jax.serve.engine import Engine, generate
from dflash_jax.serve.lanes import LanedRunner, interleave, lane_rows
from dflash_jax.spec import SamplingParams
from dflash_jax.spec import generate as spec_generate

from .conftest import PROMPT_BUCKET

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [7] * 12, list(range(40, 56)), [1, 2, 3, 4], [900, 17]]
BUDGETS = [40, 12, 64, 20, 50, 33]
SAMPLING = [SamplingParams(), SamplingParams(temperature=0.9), SamplingParams(),
            SamplingParams(temperature=1.2, top_k=20), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams()]


def test_lane_rows_and_interleave():
    assert [lane_rows(r, 0, 2) for r in (1, 2, 3, 4, 32)] == [1, 1, 2, 2, 16]
    assert [lane_rows(r, 1, 2) for r in (1, 2, 3, 4, 32)] == [0, 1, 1, 2, 16]
    assert [lane_rows(5, lane, 3) for lane in range(3)] == [2, 2, 1]
    a, b = np.array([0, 2, 4]), np.array([1, 3, 5])
    assert interleave([a, b], 6, 2).tolist() == [0, 1, 2, 3, 4, 5]
    assert interleave([a, b], 3, 2).tolist() == [0, 1, 2]
    assert interleave([np.array([7]), None], 1, 2).tolist() == [7]


@pytest.fixture(scope="module")
def laned(pair):
    """Two lanes of two slots: the session engine's shapes (`conftest.engine`), so the programs are shared."""
    eng = Engine(pair, slots=4, max_prompt_len=PROMPT_BUCKET, max_new_tokens=64, max_queue=16, lanes=2)
    eng.warmup([PROMPT_BUCKET])
    return eng


def test_lanes_equal_alone_with_moves_across_lanes(pair, laned, monkeypatch):
    assert isinstance(laned.runner, LanedRunner) and laned.lanes == 2
    started = []  # the lanes run on the runner's own threads: no call starts one (the warm-up did)
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name) or start(self))
    moves = []
    move = laned.runner.move_row
    laned.runner.move_row = lambda src, dst: moves.append((src, dst)) or move(src, dst)
    laned.rounds_per_call = 4  # a fixed schedule ("auto" sizes calls from measured times), with a move across lanes
    try:
        calls = laned.burst_calls
        with CompileCounter() as counter:
            reqs = generate(laned, PROMPTS, max_new_tokens=BUDGETS, sampling=SAMPLING, seed=[0, 11, 2, 33, 4, 5])
    finally:
        laned.runner.move_row, laned.rounds_per_call = move, "auto"
    assert counter.compiles == 0 and started == []
    assert any(s % 2 != d % 2 for s, d in moves)  # rows moved from one lane to the other
    assert laned.burst_calls > calls
    for i, r in enumerate(reqs):
        alone = spec_generate(pair, [PROMPTS[i]], max_new_tokens=BUDGETS[i], sampling=SAMPLING[i],
                              seed=[0, 11, 2, 33, 4, 5][i])
        assert r.tokens == alone.tokens[0], i
    assert np.mean([np.mean(r.acceptance) for r, s in zip(reqs, SAMPLING) if not s.temperature]) > 1.5


def test_lanes_logprobs_round_by_round(pair, laned):
    """A request asking for log-probs runs a round per call (draft and verify in each lane): the same tokens as
    alone, a log-prob for each."""
    other = laned.submit(PROMPTS[0], max_new_tokens=30, stop_ids=[])
    req = laned.submit(PROMPTS[1], max_new_tokens=20, stop_ids=[], logprobs=2)
    laned.run_until_idle()
    assert req.tokens == spec_generate(pair, [PROMPTS[1]], max_new_tokens=20).tokens[0]
    assert other.tokens == spec_generate(pair, [PROMPTS[0]], max_new_tokens=30).tokens[0]
    assert len(req.token_logprobs) == len(req.tokens) and all(lp <= 0 for lp in req.token_logprobs)


def test_lane_choice(pair, monkeypatch):
    monkeypatch.delenv("DFLASH_LANES", raising=False)
    with pytest.raises(ValueError, match="does not divide slots"):
        Engine(pair, slots=4, max_prompt_len=PROMPT_BUCKET, max_new_tokens=64, lanes=3)
    with pytest.raises(ValueError, match="lanes must be"):
        Engine(pair, slots=4, max_prompt_len=PROMPT_BUCKET, max_new_tokens=64, lanes=0)
    with pytest.raises(ValueError, match="lanes=2"):
        Engine(pair, slots=4, max_prompt_len=PROMPT_BUCKET, max_new_tokens=64, lanes=2, experts="offload",
               budget_bytes=10**9)
    assert Engine(pair, slots=1, max_prompt_len=PROMPT_BUCKET, max_new_tokens=64).lanes == 1
    assert Engine(pair, slots=3, max_prompt_len=PROMPT_BUCKET, max_new_tokens=64, lanes="auto").lanes in (1, 3)
    monkeypatch.setenv("DFLASH_LANES", "1")
    eng = Engine(pair, slots=4, max_prompt_len=PROMPT_BUCKET, max_new_tokens=64)
    assert eng.lanes == 1 and not isinstance(eng.runner, LanedRunner)


def test_serve_cli_lanes_flag():
    from dflash_jax.cli.serve import build_parser, check_args
    from dflash_jax.errors import UsageError

    for bad in ("0", "two", "-1"):
        with pytest.raises(UsageError, match="--lanes must be"):
            check_args(build_parser().parse_args(["--lanes", bad]))
    args = build_parser().parse_args(["--lanes", "2"])
    check_args(args)
    assert args.lanes == 2
