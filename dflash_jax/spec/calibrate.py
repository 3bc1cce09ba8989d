"""The adaptive policy's figures, measured on this machine at warm-up (host side, not traced): each shape's
seconds per round and tokens per round, timed by the library's one paired, interleaved method
(`dflash_jax.timing.paired_runs`: every shape once per repeat, back to back, the order reversed every other
repeat).

  measure_round_seconds   each shape's round (`spec.round`) on one prefilled state: a `VerifyCost`
  calibrate_policy        each shape's fixed loop on calibration prompts: an `AdaptivePolicy`
  (`decode.measured_policy`: plain decoding (`PLAIN`: width 1, no draft forward, the fastest plain loop) against the
                          chain of the block, measured on the request's own prompts; `generate_default` runs the
                          choice: the default that is never slower than plain by more than the measurement's error)

The tree build's acceptance model is fitted offline by research code (`study.tree_calibration`).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np

from dflash_jax.spec.loop import begin_tree, generate, generate_tree, prepare_tree
from dflash_jax.spec.policy import AdaptivePolicy, VerifyCost
from dflash_jax.spec.round import as_proposer, round_step
from dflash_jax.spec.tree import TreeShape
from dflash_jax.timing import CLOCKS, paired_runs


def measure_round_seconds(pair, prompts, shapes: Sequence[TreeShape], *, max_new_tokens: int = 64,
                          repeats: int = 3, block_size: int | None = None) -> VerifyCost:
    """Each shape's seconds per round on this machine, measured at warm-up: the shape's round (`spec.round.round`,
    jitted) on the state after the prefill of `prompts` (calibration prompts of the batch and length the run
    will use; the outputs are dropped), the shapes interleaved (`timing.paired_runs`), the fastest of `repeats`.
    Hand the result (or `VerifyCost.fit(shapes, result.seconds)` on a noisy machine) to `AdaptivePolicy(cost=)`:
    the policy's choices are then deterministic given these figures."""
    widest = max(s.budget for s in shapes)
    prep = prepare_tree(pair, prompts, widest=widest, max_new_tokens=max_new_tokens, block_size=block_size)
    state = begin_tree(pair, prep, widest)

    def shape_round(tw, dw, st, p):
        return round_step(tw, dw, st, prep.spec, p)[0]

    rounds = [jax.jit(functools.partial(shape_round, p=as_proposer(s))) for s in shapes]
    runs = {i: (lambda fn=fn: jax.block_until_ready(fn(pair.target, pair.draft, state).output))
            for i, fn in enumerate(rounds)}
    for run in runs.values():  # compiled before any timing
        run()
    timings = paired_runs(runs, repeats)
    return VerifyCost(tuple(timings.stat(i, "wall", "min") for i in runs))


def calibrate_policy(pair, prompts, shapes: Sequence[TreeShape], *, max_new_tokens: int = 64, repeats: int = 3,
                     calibration_range: tuple[float, float] | None = (0.5, 2.0), decay: float = 0.9,
                     clock: str = "wall", statistic: str = "min", margin: float = 0.0, log=None,
                     buckets=None) -> AdaptivePolicy:
    """An `AdaptivePolicy` whose figures are measured on calibration prompts in the mode it will run in (the
    resident jitted loops): each shape's fixed loop (a chain: `spec.loop.generate` at block B; a tree:
    `generate_tree`) runs `prompts`, compiled first, then `repeats` times interleaved (`timing.paired_runs`); its
    seconds per round are the fastest run's seconds over its rounds, its tokens per round the run's mean. With the prompts' own
    figures and c = 1 the policy picks the fastest fixed shape there; `calibration_range` bounds how far a
    sequence's acceptance may move it (and so which shapes it provisions). clock: "wall" (seconds of the run)
    or "cpu" (this process's CPU seconds: the work, which other jobs on a shared machine do not inflate); both
    over the rounds only (the run's time after its prefill and first token, the same for every shape).
    statistic: "min" (the fastest repeat) or "median" (of the repeats: robust to one lucky or loaded run). margin: the policy's prior toward the cheapest shape (`AdaptivePolicy.margin`).
    A shape of budget 1 (`PLAIN`) runs the loop at block 1: plain greedy decoding, no draft forward. buckets: the
    loops' shape buckets (those of the run to come, so the calibration compiles the programs the run reuses)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic must be 'min' or 'median', got {statistic!r}")

    def run(s):
        if s.is_chain:
            # the chain as the run names it (`Chain(B)`), so a run of the chosen shape reuses this compiled loop
            return generate(pair, prompts, max_new_tokens=max_new_tokens, proposer=as_proposer(s),
                            block_size=s.budget, buckets=buckets)
        return generate_tree(pair, prompts, max_new_tokens=max_new_tokens, tree_budget=s.budget, branch=s.branch,
                             temperature=s.temperature, calibration=s.calibration, buckets=buckets)

    taus, rounds = [], []
    for s in shapes:  # compiled, and each shape's tokens per round (the loops are deterministic)
        res = run(s)
        taus.append(float(np.mean([a for seq in res.acceptance_lengths for a in seq])))
        rounds.append(max(1, int(res.stats["rounds"])))

    def progress(r, timings):
        if log:
            log(f"calibration repeat {r + 1}/{repeats}: " + ", ".join(
                f"{s.label()} {timings.stat(i, clock, statistic) / n * 1e3:.1f} ms/round"
                for i, (s, n) in enumerate(zip(shapes, rounds))))

    def decode_seconds(res):  # the rounds alone (wall, CPU): the prefill, the same for every shape, left out
        st = res.stats
        return st["seconds"] - st["prefill_s"], st["cpu_s"] - st["prefill_cpu_s"]

    timings = paired_runs({i: functools.partial(run, s) for i, s in enumerate(shapes)}, repeats,
                          on_repeat=progress, seconds_of=decode_seconds)
    seconds = [timings.stat(i, clock, statistic) / n for i, n in enumerate(rounds)]
    return AdaptivePolicy(tuple(shapes), VerifyCost(tuple(seconds)),
                          taus=tuple(round(t, 4) for t in taus), decay=decay, calibration_range=calibration_range,
                          margin=margin)


PLAIN = TreeShape(1, 1)  # plain decoding: a width-1 verify, no draft forward (the loop at block 1)
