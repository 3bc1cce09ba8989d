"""Lanes (`spec.lanes`): the jitted drivers split a batch's rows into groups run side by side on their own threads.
Every sequence's tokens are the whole batch's (greedy: plain greedy decoding's, with proposals accepted; sampled:
each row keeps its key), for chains and adaptive policies; the lanes share one compiled program; an error in any
lane is raised, with no lane left waiting; the caller's JAX contexts reach every lane."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

import dflash_jax
from dflash_jax.decode import greedy_generate
from dflash_jax.spec import SamplingParams, generate
from dflash_jax.spec import lanes as ln
from dflash_jax.spec.loop import LOOP_BUCKETS
from dflash_jax.spec.policy import AdaptivePolicy, VerifyCost
from dflash_jax.spec.session import prepare
from dflash_jax.spec.tree import TreeShape

BUDGETS = [12, 30, 5, 21, 17]


@pytest.fixture(scope="module")
def plain(pair, prompts):
    return greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=BUDGETS, stop_ids=[], lanes=1)


def test_plain_lanes_equal_one_loop(pair, prompts, plain):
    for lanes in (2, 3):
        assert greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=BUDGETS, stop_ids=[],
                               lanes=lanes) == plain
    assert [len(t) for t in plain] == BUDGETS


def test_dflash_lanes_equal_plain_and_accept(pair, prompts, plain):
    one = generate(pair, prompts, max_new_tokens=BUDGETS, block_size=8, lanes=1)
    two = generate(pair, prompts, max_new_tokens=BUDGETS, block_size=8, lanes=2)
    assert one.tokens == plain and two.tokens == plain
    assert two.stats["lanes"] == 2 and one.stats["lanes"] == 1
    assert two.stats["shapes"]["batch"] < one.stats["shapes"]["batch"]  # each lane runs its share of the rows
    assert two.acceptance_lengths == one.acceptance_lengths
    assert two.stats["mean_acceptance"] > 1.5  # proposals were accepted
    s = two.stats
    assert 0 < s["prefill_s"] <= s["seconds"] and 0 < s["prefill_cpu_s"] <= s["cpu_s"]


def test_sampled_lanes_keep_each_rows_key(pair, prompts):
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    runs = [generate(pair, prompts, max_new_tokens=BUDGETS, block_size=8, sampling=sampling, seed=11, lanes=k)
            for k in (1, 2)]
    assert runs[0].tokens == runs[1].tokens
    other = generate(pair, prompts, max_new_tokens=BUDGETS, block_size=8, sampling=sampling, seed=12, lanes=2)
    assert other.tokens != runs[0].tokens  # the seed reaches every lane


def test_adaptive_lanes_count_every_lanes_rounds(pair, prompts, plain):
    policy = AdaptivePolicy((TreeShape(4, 1), TreeShape(8, 1)), VerifyCost((1.0, 1.3)), taus=(2.5, 3.5))
    one = generate(pair, prompts, max_new_tokens=BUDGETS, proposer=policy, block_size=8, lanes=1)
    two = generate(pair, prompts, max_new_tokens=BUDGETS, proposer=policy, block_size=8, lanes=2)
    assert one.tokens == plain and two.tokens == plain
    rounds = [len(a) for a in two.acceptance_lengths]
    assert sum(one.stats["adaptive_rounds"].values()) == max(rounds)  # one loop: a choice per round
    groups = ln.lane_slices(len(prompts), 2)
    assert sum(two.stats["adaptive_rounds"].values()) == sum(max(rounds[i] for i in g) for g in groups)


def test_split_prepared_keeps_rows_and_pads_inert(pair, prompts):
    prep = prepare(pair, prompts, max_new_tokens=BUDGETS, block_size=8, seed=5, buckets=LOOP_BUCKETS,
                   sampling=[SamplingParams(temperature=0.1 * i) for i in range(5)])
    parts = ln.split_prepared(prep, 2, LOOP_BUCKETS)
    assert [p.num_prompts for p in parts] == [2, 3] or [p.num_prompts for p in parts] == [3, 2]
    assert len({p.tokens.shape for p in parts}) == 1  # one compiled program
    rows = np.concatenate([np.arange(p.num_prompts) for p in parts])
    assert rows.size == 5
    joined = lambda f: np.concatenate([f(p)[:p.num_prompts] for p in parts])  # noqa: E731
    np.testing.assert_array_equal(joined(lambda p: p.key_fold), prep.key_fold[:5])
    np.testing.assert_array_equal(joined(lambda p: p.key_data), prep.key_data[:5])
    np.testing.assert_array_equal(joined(lambda p: p.params.budget), prep.params.budget[:5])
    np.testing.assert_array_equal(joined(lambda p: p.params.sampling.temperature), prep.params.sampling.temperature[:5])
    np.testing.assert_array_equal(joined(lambda p: p.tokens), prep.tokens[:5])
    for p in parts:
        pad = slice(p.num_prompts, None)
        assert (p.lengths[pad] == 1).all() and (p.params.budget[pad] == 1).all() and (p.tokens[pad] == 0).all()


def test_choose_lanes(monkeypatch, pair):
    monkeypatch.delenv(ln.LANES_ENV, raising=False)
    cores = ln.usable_cores()
    assert ln.choose_lanes(64, "auto", pair.target) == min(64, cores)
    assert ln.choose_lanes(1, "auto", pair.target) == 1
    assert ln.choose_lanes(3, 8, pair.target) == 3  # at most one per row
    monkeypatch.setenv(ln.LANES_ENV, "1")
    assert ln.choose_lanes(64, "auto", pair.target) == 1
    monkeypatch.setenv(ln.LANES_ENV, "3")
    assert ln.choose_lanes(64, "auto", pair.target) == 3
    monkeypatch.setenv(ln.LANES_ENV, "two")
    with pytest.raises(ValueError, match=ln.LANES_ENV):
        ln.choose_lanes(64, "auto", pair.target)
    for bad in (0, -1, 1.5, "many", True):
        with pytest.raises(ValueError, match="positive integer"):
            ln.choose_lanes(4, bad, pair.target)
    monkeypatch.setenv(ln.LANES_ENV, "3")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
    with jax.set_mesh(mesh):  # a mesh lays the batch out itself, whatever the environment asks
        assert ln.choose_lanes(64, "auto", pair.target) == 1
        with pytest.raises(ValueError, match="one program"):
            ln.choose_lanes(64, 2, pair.target)


def test_bad_lanes_argument_named(pair, prompts):
    with pytest.raises(ValueError, match="lanes must be"):
        generate(pair, prompts, max_new_tokens=4, lanes=0)
    with pytest.raises(ValueError, match="lanes must be"):
        greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=4, lanes="x")
    with pytest.raises(ValueError, match="stepping driver runs one batch"):
        dflash_jax.generate(pair, prompts, max_new_tokens=4, driver="stepping", lanes=2)


def test_run_lanes_raises_a_lanes_error_and_carries_contexts():
    barrier = threading.Barrier(3)

    def fn(i):  # lane 1 fails before the barrier; the others must not wait for it forever
        try:
            if i == 1:
                raise KeyError("lane one")
            barrier.wait(timeout=60)
        except BaseException:
            barrier.abort()
            raise
        return i

    with pytest.raises(KeyError, match="lane one"):
        ln.run_lanes(fn, [0, 1, 2])
    with jax.default_matmul_precision("highest"):
        seen = ln.run_lanes(lambda i: (jax.config.jax_default_matmul_precision, threading.current_thread().name),
                            [0, 1, 2])
    assert {p for p, _ in seen} == {"highest"}
    assert seen[0][1] == threading.current_thread().name and seen[1][1] != seen[0][1]
