"""The tree build's acceptance model, fitted offline (research code: run by `benchmarks/tree.py --fit-calibration`
and the tests, never by a driver): `calibration_samples` collects training rows from the tree loop's rounds on
training-split prompts, `fit_calibration` fits the logistic model (`dflash_jax.spec.tree.TreeCalibration`). The
result is written beside a pair's checkpoint by `dflash_jax.spec.calibration_file.save_calibration`."""

from __future__ import annotations

import functools

import jax
import numpy as np

from dflash_jax.spec.loop import begin_tree, generate, prepare_tree
from dflash_jax.spec.round import round_jit
from dflash_jax.spec.session import SpecConfig, SpecState
from dflash_jax.spec.tree import TreeCalibration, TreeShape, calibration_features, tree_draft


@functools.partial(jax.jit, static_argnames=("spec", "k"))
def draft_top_k(target_w, draft_w, state: SpecState, spec: SpecConfig, k: int):
    """(log-probabilities, tokens) of the draft's top `k` candidates at every block position of the state's next
    tree draft."""
    return jax.lax.top_k(tree_draft(target_w, draft_w, state, spec).logprobs, k)


def calibration_samples(pair, prompts, *, max_new_tokens: int = 64, branch: int = 8,
                        shape: TreeShape | None = None) -> np.ndarray:
    """Training rows for `fit_calibration`: the tree loop (`shape`, default N = 32 with `branch` candidates)
    runs greedy on `prompts`; at every round and live sequence, for each depth d whose parent on the target's
    greedy path is still among the draft's candidates, one row per candidate: (depth, rank, log q, parent off
    the argmax chain, is the target's token). The target's path is its plain greedy continuation."""
    shape = shape or TreeShape(32, branch)
    prep = prepare_tree(pair, prompts, widest=shape.budget, max_new_tokens=max_new_tokens)
    spec = prep.spec
    gamma = spec.block_size - 1
    # the target's greedy continuation: the chain loop's greedy output is the plain greedy output (lossless)
    plain = generate(pair, prompts, max_new_tokens=max_new_tokens + gamma + 1).tokens
    state = begin_tree(pair, prep, shape.budget)
    rows = []
    while not np.asarray(state.done).all():
        top_lp, top_tok = jax.device_get(draft_top_k(pair.target, pair.draft, state, spec, branch))
        made, done = np.asarray(state.num_generated), np.asarray(state.done)
        state, _ = round_jit(pair.target, pair.draft, state, spec, shape)
        for i in np.flatnonzero(~done):
            truth = plain[i][made[i]: made[i] + gamma]
            off = False
            for d, tok in enumerate(truth):
                hit = np.flatnonzero(top_tok[i, d] == tok)
                for r in range(branch):
                    rows.append((d + 1, r, top_lp[i, d, r], off, len(hit) > 0 and hit[0] == r))
                if not len(hit):
                    break
                off = off or hit[0] > 0
    return np.asarray(rows, np.float64).reshape(-1, 5)


def fit_calibration(samples: np.ndarray, *, l2: float = 1e-2, iters: int = 50) -> TreeCalibration:
    """The logistic acceptance model (`TreeCalibration`) fitted to `calibration_samples` rows by Newton's
    method (L2 `l2`). Deterministic given the rows."""
    samples = np.asarray(samples, np.float64)
    if samples.ndim != 2 or samples.shape[1] != 5 or not len(samples):
        raise ValueError("fit_calibration needs calibration_samples rows [n, 5] (depth, rank, log q, off, hit)")
    x = np.asarray(calibration_features(samples[:, 0], samples[:, 1], samples[:, 2], samples[:, 3]), np.float64)
    y = samples[:, 4]
    w = np.zeros(x.shape[1])
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        grad = x.T @ (p - y) + l2 * w
        hess = x.T @ (x * (p * (1.0 - p))[:, None]) + l2 * np.eye(len(w))
        w = w - np.linalg.solve(hess, grad)
    return TreeCalibration(tuple(round(float(v), 6) for v in w))
