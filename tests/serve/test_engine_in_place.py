"""Rounds on whole KV buffers (`ResidentRunner.in_place`): where attention reads each row's keys where they lie (the
CPU kernel, `nn.attention.reads_in_place`), a round of the first `rows` rows computes over the whole cache buffers,
writing its new keys into them in place, instead of copying those rows (and a length bucket of their slots) out
and back. The program holds no cut copy of a KV buffer, one length bucket serves every round, and the tokens equal
the cutting runner's."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dflash_jax.cache import holds_slots
from dflash_jax.nn.attention import attention_tuning, reads_in_place
from dflash_jax.serve.engine import Engine, generate
from dflash_jax.spec import SamplingParams
from dflash_jax.spec.round import Chain
from pallas_kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels could not be built here")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(40, 52))]
BUDGETS = [48, 30, 40]


def _kv_buffers(state):
    caches = [n for n in jax.tree.leaves(state, is_leaf=holds_slots) if holds_slots(n)]
    return [b for c in caches for b in (*c.keys, *c.values)]


def _burst_text(runner, proposer, rows: int, in_place: bool) -> str:
    return runner.burst_program(proposer, rows, in_place=in_place).as_text()


def test_in_place_rounds_copy_no_kv_rows(engine):
    """The session engine's runner (4 slots; on 2 cores, 2 lanes of 2) reads in place; a call of one row's
    rounds holds no array of a KV buffer's cut shape, where the cutting program does (so the check can fail)."""
    assert engine.runner.in_place
    runner = getattr(engine.runner, "lanes", [engine.runner])[0]  # a lane's runner (laned: `serve.lanes`)
    assert reads_in_place(runner.pair.target.embed.dtype)
    assert runner.in_place and runner.length_buckets == (runner.spec.max_len,)
    buffers = _kv_buffers(runner.state)
    assert len(buffers) > 4 and all(b.shape[0] == runner.slots for b in buffers)
    cut_shapes = {"tensor<1x" + "x".join(map(str, b.shape[1:])) + "xf32>" for b in buffers}
    drafting = engine.proposers[max(engine.proposers)]
    for proposer in (drafting, Chain(1, defer_context=True)):  # a drafting round, a width-1 round holding the taps
        whole = _burst_text(runner, proposer, 1, True)
        assert cpu_kernels.ATTENTION_TARGET in whole
        assert not any(s in whole for s in cut_shapes), proposer
    assert any(s in _burst_text(runner, drafting, 1, False) for s in cut_shapes)


@pytest.mark.slow  # a second engine's compiles (60 s)
def test_in_place_rounds_give_the_cutting_runners_tokens(pair, engine):
    """The session engine (in place) and an engine whose rounds cut their rows (`AttentionTuning(in_place=False)`:
    the same kernel over cut copies) commit the same tokens, greedy and sampled, with proposals accepted; the rows
    finish at different rounds, so calls run on row buckets smaller than the slots."""
    sampling = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams()]
    whole = generate(engine, PROMPTS, max_new_tokens=BUDGETS, sampling=sampling, seed=5)
    with attention_tuning(in_place=False):
        eng = Engine(pair, slots=4, max_prompt_len=16, max_new_tokens=64, max_queue=16)
        assert not eng.runner.in_place
        eng.warmup([16])
        cut = generate(eng, PROMPTS, max_new_tokens=BUDGETS, sampling=sampling, seed=5)
    assert [r.tokens for r in cut] == [r.tokens for r in whole]
    assert np.mean([np.mean(r.acceptance) for r in whole]) > 1.5
