"""The calibrated tree build (`spec.tree.TreeCalibration`: node scores from a fitted acceptance model), its fit,
and the adaptive policy's reachable shapes (what it compiles and provisions)."""

from __future__ import annotations

import heapq
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.spec.tree import (
    AdaptivePolicy, TreeCalibration, TreeShape, VerifyCost, build_tree, calibration_features, choose_shape,
    fit_calibration,
)

WEIGHTS = (0.1, 1.1, -1.2, -0.5, 0.2, -1.3, 1.3, -0.1, -0.6)


def _calibrated_paths(logprobs: np.ndarray, cal: TreeCalibration, branch: int, budget: int):
    """Reference: every rank path scored by the sum of its nodes' calibrated log acceptance (non-increasing in
    rank per node, the parent's path off the argmax chain as a feature); the budget-1 best, by enumeration."""
    depth = logprobs.shape[0]
    order = np.argsort(-logprobs, axis=1, kind="stable")[:, :branch]
    top = np.take_along_axis(logprobs, order, axis=1)

    scores = {(d, off): np.minimum.accumulate(np.asarray(cal.log_accept(  # children at block position d + 1
        np.full(branch, d + 1), np.arange(branch), top[d], np.full(branch, off)))) for d in range(depth)
        for off in (False, True)}
    node_scores = lambda d, off: scores[(d, off)]  # noqa: E731

    paths = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(branch), repeat=d):
            score, off = 0.0, False
            for j, r in enumerate(ranks):
                score += float(node_scores(j, off)[r])
                off = off or r > 0
            paths.append((score, tuple(int(order[j, r]) for j, r in enumerate(ranks))))
    return heapq.nlargest(budget - 1, paths, key=lambda p: p[0])


def test_calibrated_build_takes_the_best_calibrated_paths():
    rng = np.random.default_rng(3)
    cal = TreeCalibration(WEIGHTS)
    depth, vocab, branch, budget = 4, 12, 3, 14
    logprobs = np.asarray(jax_log_softmax(rng.normal(size=(2, depth, vocab)) * 2.0))
    tree = build_tree(jnp.array([1, 2]), jnp.asarray(logprobs), TreeShape(budget, branch, calibration=cal))
    for b in range(2):
        want = {p for _, p in _calibrated_paths(logprobs[b], cal, branch, budget)}
        toks, parent = np.asarray(tree.tokens[b]), np.asarray(tree.parent[b])
        got = set()
        for t in range(1, budget):
            path, u = [], t
            while u != 0:
                path.append(int(toks[u]))
                u = int(parent[u])
            got.add(tuple(reversed(path)))
        assert got == want
    # the plain build differs (the calibration changes which paths are taken)
    plain = build_tree(jnp.array([1, 2]), jnp.asarray(logprobs), TreeShape(budget, branch))
    assert not np.array_equal(np.asarray(plain.tokens), np.asarray(tree.tokens))


def jax_log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_fit_calibration_recovers_a_logistic_model():
    rng = np.random.default_rng(0)
    n = 40000
    rows = np.stack([rng.integers(1, 16, n), rng.integers(0, 8, n), -rng.exponential(1.5, n),
                     rng.random(n) < 0.4, np.zeros(n)], axis=1).astype(np.float64)
    feats = calibration_features(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3])
    rows[:, 4] = rng.random(n) < 1.0 / (1.0 + np.exp(-(feats @ np.asarray(WEIGHTS))))
    fitted = fit_calibration(rows)
    got = np.asarray(TreeCalibration(fitted.weights).log_accept(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]))
    want = np.asarray(TreeCalibration(WEIGHTS).log_accept(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]))
    np.testing.assert_allclose(np.exp(got), np.exp(want), atol=0.08)
    with pytest.raises(ValueError, match="calibration_samples"):
        fit_calibration(np.zeros((3, 4)))
    with pytest.raises(TypeError, match="TreeCalibration"):
        TreeShape(8, 4, calibration=WEIGHTS)


def test_policy_provisions_only_the_shapes_it_can_choose():
    shapes = (TreeShape(4, 1), TreeShape(8, 1), TreeShape(16, 4))
    # measured figures: at c = 1 the chain of 4 is fastest (2.5 / 1.0 vs 3.2 / 1.5 vs 4.3 / 2.0 tokens per s);
    # the tree wins from c = 3.3 on
    policy = AdaptivePolicy(shapes, VerifyCost((1.0, 1.5, 2.0)), taus=(2.5, 3.2, 4.3), calibration_range=(0.5, 2.0))
    assert policy.reachable() == (0,)
    only = policy.pruned()
    assert only.shapes == shapes[:1] and only.taus == (2.5,) and only.cost.seconds == (1.0,)
    # unclipped, a sequence accepting far more than calibrated makes the tree win: it stays reachable
    wide = AdaptivePolicy(shapes, VerifyCost((1.0, 1.5, 2.0)), taus=(2.5, 3.2, 4.3))
    assert wide.reachable() == (0, 2) and wide.pruned().shapes == (shapes[0], shapes[2])
    live = np.ones(2, bool)
    assert int(choose_shape(wide, np.full(2, 50.0), np.zeros(2, np.float32), live)) == 2
    # the clipped policy never leaves its reachable set, on the host (numpy) and traced (jax) alike
    for acc in (0.0, 50.0, 1e4):
        for xp in (np, jnp):
            assert int(choose_shape(policy, xp.full(2, acc, xp.float32), xp.zeros(2, xp.float32), live)) == 0
    # every shape reachable: the policy is returned as is
    assert AdaptivePolicy(shapes[:1]).pruned().shapes == shapes[:1]


def test_calibration_samples_from_the_shipped_pair_fit_a_model_that_ranks_the_argmax_first():
    """`calibration_samples` on the shipped pair (a small tree loop, greedy): rows (depth, rank, log q, off, hit)
    with at most one hit per (round, depth) group, hits at depth 1 (the target's next token is the draft's
    candidate often), and a fitted model that scores the draft's argmax above its second choice."""
    import dflash_jax
    from dflash_jax.spec.tree import calibration_samples
    from dflash_jax.train.data import file_windows

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR)
    prompts = file_windows(pair, "train", 1, 48, 3)
    rows = calibration_samples(pair, prompts, max_new_tokens=12, branch=2, shape=TreeShape(8, 2))
    assert rows.ndim == 2 and rows.shape[1] == 5 and len(rows) >= 8
    depth, rank, lq, hit = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 4]
    assert set(np.unique(rank)) == {0.0, 1.0} and (lq <= 0).all() and depth.min() == 1
    first = rows[depth == 1]
    assert first[:, 4].sum() >= 1  # the target's token is among the draft's 2 candidates at depth 1 somewhere
    assert hit.sum() <= len(rows) / 2  # one hit at most per group of 2 candidates
    cal = fit_calibration(rows)
    a0, a1 = cal.log_accept(np.array([1, 1]), np.array([0, 1]), np.array([-0.2, -2.0]), np.array([False, False]))
    assert float(a0) > float(a1)
