"""Offline measurement and fitting for the tree proposer and the adaptive policy (research code: run by
benchmarks and tests, never by a driver).

  measure_round_seconds / calibrate_policy   an `AdaptivePolicy`'s cost table and tokens per round, measured
  calibration_samples / fit_calibration      the tree build's acceptance model (`spec.tree.TreeCalibration`)
"""

from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import numpy as np

from dflash_jax.spec.loop import begin_tree, generate, generate_tree, prepare_tree
from dflash_jax.spec.policy import AdaptivePolicy, VerifyCost
from dflash_jax.spec.round import as_proposer, round_jit, round_step
from dflash_jax.spec.session import SpecConfig, SpecState
from dflash_jax.spec.tree import TreeCalibration, TreeShape, calibration_features, tree_draft


def measure_round_seconds(pair, prompts, shapes: Sequence[TreeShape], *, max_new_tokens: int = 64,
                          repeats: int = 3, block_size: int | None = None) -> VerifyCost:
    """Each shape's seconds per round on this machine, measured at warm-up: the shape's round (`spec.round.round`,
    jitted) on the state after the prefill of `prompts` (calibration prompts of the batch and length the run
    will use; the outputs are dropped), the shapes interleaved, the fastest of `repeats`. Hand the result (or
    `VerifyCost.fit(shapes, result.seconds)` on a noisy machine) to `AdaptivePolicy(cost=)`: the policy's
    choices are then deterministic given these figures."""
    widest = max(s.budget for s in shapes)
    prep = prepare_tree(pair, prompts, widest=widest, max_new_tokens=max_new_tokens, block_size=block_size)
    state = begin_tree(pair, prep, widest)
    def shape_round(tw, dw, st, p):
        return round_step(tw, dw, st, prep.spec, p)[0]

    rounds = [jax.jit(functools.partial(shape_round, p=as_proposer(s))) for s in shapes]
    for fn in rounds:
        jax.block_until_ready(fn(pair.target, pair.draft, state).output)
    best = [float("inf")] * len(rounds)
    for _ in range(repeats):
        for i, fn in enumerate(rounds):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(pair.target, pair.draft, state).output)
            best[i] = min(best[i], time.perf_counter() - t0)
    return VerifyCost(tuple(best))


def calibrate_policy(pair, prompts, shapes: Sequence[TreeShape], *, max_new_tokens: int = 64, repeats: int = 3,
                     calibration_range: tuple[float, float] | None = (0.5, 2.0), decay: float = 0.9,
                     clock: str = "wall", statistic: str = "min", margin: float = 0.0, log=None) -> AdaptivePolicy:
    """An `AdaptivePolicy` whose figures are measured on calibration prompts in the mode it will run in (the
    resident jitted loops): each shape's fixed loop (a chain: `spec.loop.generate` at block B; a tree:
    `generate_tree`) runs `prompts`, compiled first, then `repeats` times interleaved; its seconds per round
    are the fastest run's seconds over its rounds, its tokens per round the run's mean. With the prompts' own
    figures and c = 1 the policy picks the fastest fixed shape there; `calibration_range` bounds how far a
    sequence's acceptance may move it (and so which shapes it provisions). clock: "wall" (seconds of the run)
    or "cpu" (this process's CPU seconds over the call, prefill included: the work, which other jobs on a
    shared machine do not inflate). statistic: "min" (the fastest repeat) or "median" (of the repeats: robust to
    one lucky or loaded run). margin: the policy's prior toward the cheapest shape (`AdaptivePolicy.margin`)."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic must be 'min' or 'median', got {statistic!r}")

    def timed(s):
        c0 = time.process_time()
        seconds = run(s).stats["seconds"]
        return seconds if clock == "wall" else time.process_time() - c0

    def run(s):
        if s.is_chain:
            return generate(pair, prompts, max_new_tokens=max_new_tokens, block_size=s.budget)
        return generate_tree(pair, prompts, max_new_tokens=max_new_tokens, tree_budget=s.budget, branch=s.branch,
                             temperature=s.temperature, calibration=s.calibration)

    taus, rounds, times = [], [], [[] for _ in shapes]
    for s in shapes:
        res = run(s)
        taus.append(float(np.mean([a for seq in res.acceptance_lengths for a in seq])))
        rounds.append(max(1, int(res.stats["rounds"])))
    stat = np.min if statistic == "min" else np.median
    for r in range(repeats):
        for i, s in enumerate(shapes):
            times[i].append(timed(s))
        if log:
            log(f"calibration repeat {r + 1}/{repeats}: " + ", ".join(
                f"{s.label()} {stat(t) / n * 1e3:.1f} ms/round" for s, t, n in zip(shapes, times, rounds)))
    return AdaptivePolicy(tuple(shapes), VerifyCost(tuple(float(stat(t)) / n for t, n in zip(times, rounds))),
                          taus=tuple(round(t, 4) for t in taus), decay=decay, calibration_range=calibration_range,
                          margin=margin)


@functools.partial(jax.jit, static_argnames=("spec", "k"))
def _draft_top_k(target_w, draft_w, state: SpecState, spec: SpecConfig, k: int):
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
        top_lp, top_tok = jax.device_get(_draft_top_k(pair.target, pair.draft, state, spec, branch))
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
