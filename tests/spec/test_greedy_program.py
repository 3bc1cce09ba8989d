"""A batch whose every row is greedy may run a program without the sampling work (`SpecConfig.greedy_only`): the
same tokens, no conditional left to skip it (a GPU runs a conditional from the host), and no way to run a sampled
row through it."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from dflash_jax.spec import loop, session
from dflash_jax.spec.round import Chain, round_step
from dflash_jax.spec.sampling import SamplingParams, greedy_programs, specialize_greedy
from dflash_jax.spec.tree import TreeShape
from pallas_kernels import target

BUDGETS = (40, 40)
SAMPLED = SamplingParams(temperature=0.8, top_k=20)


def _conditionals(spec, pair, prep) -> int:
    """`stablehlo.case` ops in the lowered program of one block-4 round (chain) of `prep`'s batch under `spec`."""
    state = jax.eval_shape(functools.partial(session.begin_arrays, spec=prep.spec), pair.target, pair.draft,
                           prep.tokens, prep.lengths, prep.params, prep.key_data, prep.key_fold)
    one = jax.jit(lambda t, d, s: round_step(t, d, s, spec, Chain(4))[0])
    return one.lower(pair.target, pair.draft, state).as_text().count("stablehlo.case")


def test_prepare_specializes_greedy_batches_where_conditionals_run_from_the_host(pair, prompts):
    """On a CPU one program serves greedy and sampled requests (no compile between them); traced for a GPU, a
    batch of greedy rows gets the greedy program, and one sampled row takes the batch back to the general one."""
    assert not specialize_greedy()
    assert not session.prepare(pair, prompts, block_size=4, max_new_tokens=8).spec.greedy_only
    with target.compiling_for("gpu"):
        assert specialize_greedy()
        assert session.prepare(pair, prompts, block_size=4, max_new_tokens=8).spec.greedy_only
        mixed = session.prepare(pair, prompts, block_size=4, max_new_tokens=8,
                                sampling=[SamplingParams(), SAMPLED])
        assert not mixed.spec.greedy_only
        with greedy_programs(False):  # the platform's choice overridden, in this block only
            assert not session.prepare(pair, prompts, block_size=4, max_new_tokens=8).spec.greedy_only
        assert specialize_greedy()
    with pytest.raises(TypeError, match="greedy_programs takes True, False or None"):
        with greedy_programs("on"):
            pass


def test_the_greedy_program_has_no_conditional_and_the_same_tokens(pair, prompts):
    """The round's conditionals that skip the sampling work (the draft's and the acceptance's) are gone from the
    greedy program, and the loops decode exactly what the general program decodes, proposals accepted, for a
    chain and for a tree."""
    prep = session.prepare(pair, prompts, block_size=4, max_new_tokens=8)
    greedy = dataclasses.replace(prep.spec, greedy_only=True)
    assert _conditionals(prep.spec, pair, prep) >= 2
    assert _conditionals(greedy, pair, prep) == 0
    general = [loop.generate(pair, prompts, max_new_tokens=40, proposer=p) for p in (Chain(4), TreeShape(6, 2))]
    with greedy_programs(True):
        assert session.prepare(pair, prompts, block_size=4, max_new_tokens=8).spec.greedy_only
        special = [loop.generate(pair, prompts, max_new_tokens=40, proposer=p) for p in (Chain(4), TreeShape(6, 2))]
        # sampled rows keep the general program, and their draws
        drawn = loop.generate(pair, prompts, max_new_tokens=12, sampling=SAMPLED, seed=3)
    for a, b in zip(general, special):
        assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
        assert max(max(acc) for acc in b.acceptance_lengths) > 1  # proposals were accepted
    assert drawn.tokens == loop.generate(pair, prompts, max_new_tokens=12, sampling=SAMPLED, seed=3).tokens


def test_a_sampled_row_is_refused_by_the_greedy_program(pair, prompts):
    """A greedy-only spec would decode a sampled row greedily without a word: the batch's settings are checked
    where they are concrete (the prefill's entry, an eager round), done rows aside."""
    prep = session.prepare(pair, prompts, block_size=4, max_new_tokens=8, sampling=[SamplingParams(), SAMPLED])
    forced = dataclasses.replace(prep, spec=dataclasses.replace(prep.spec, greedy_only=True))
    with pytest.raises(ValueError, match=r"row 1 samples \(temperature 0.8\).*greedy_only=True"):
        session.begin_prepared(pair, forced)
    state = session.begin_prepared(pair, prep)
    with pytest.raises(ValueError, match="row 1 samples"):
        session.draft_round(pair.target, pair.draft, state, forced.spec)
    finished = state.replace(done=np.array([False, True]))  # a done row's settings are never read
    session.draft_round(pair.target, pair.draft, finished, forced.spec)
