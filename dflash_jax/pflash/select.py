"""Which prompt tokens a compressed prefill keeps, from the scorer's per-token importance.

  keep     = min(n, budget) tokens, or ceil(keep_ratio * n); never fewer than the sink + the last window
  always   = the first `sink` tokens (attention sinks) and the last `window` tokens (the query itself)
  the rest = whole chunks of `chunk` consecutive tokens (aligned to multiples of `chunk` from the prompt's start),
             best mean importance first, each taken if it still fits the budget (so a chunk keeps its local
             context: no isolated tokens), until nothing more fits

The kept indices come back sorted: the target prefills them in order at their original positions.
"""

from __future__ import annotations

import math

import numpy as np

from dflash_jax.spec import requests as rq

DEFAULT_SINK = 4
DEFAULT_CHUNK = 16
DEFAULT_SELECT_WINDOW = 32


def keep_count(n: int, *, keep_ratio: float | None = None, budget: int | None = None,
               window: int = DEFAULT_SELECT_WINDOW, sink: int = DEFAULT_SINK) -> int:
    """How many of n tokens a selection keeps (see module doc); exactly one of keep_ratio / budget."""
    if (keep_ratio is None) == (budget is None):
        raise ValueError("give exactly one of keep_ratio (0 < R <= 1) or budget (tokens to keep)")
    floor = min(n, window + sink)
    if keep_ratio is not None:
        if isinstance(keep_ratio, bool) or not isinstance(keep_ratio, (int, float)) or not 0 < keep_ratio <= 1:
            raise ValueError(f"keep_ratio must be a number in (0, 1], got {keep_ratio!r}")
        return max(floor, min(n, math.ceil(keep_ratio * n)))
    budget = rq.check_int(budget, "budget", low=1, what="a positive token count")
    if budget < floor:
        raise ValueError(f"budget {budget} is below the {floor} tokens always kept (the first {sink} sink tokens and "
                         f"the last window of {window}): raise the budget or lower window / sink")
    return min(n, budget)


def select_tokens(scores, *, keep_ratio: float | None = None, budget: int | None = None,
                  window: int = DEFAULT_SELECT_WINDOW, sink: int = DEFAULT_SINK,
                  chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """Sorted int32 indices of the kept tokens of a prompt with per-token importance `scores` [n]."""
    scores = np.asarray(scores, np.float64).reshape(-1)
    n = scores.shape[0]
    if n == 0:
        raise ValueError("scores is empty: nothing to select from")
    window = rq.check_int(window, "window", low=1, what="a positive integer")
    sink = rq.check_int(sink, "sink", low=0, what="a non-negative integer")
    chunk = rq.check_int(chunk, "chunk", low=1, what="a positive integer")
    k = keep_count(n, keep_ratio=keep_ratio, budget=budget, window=window, sink=sink)
    keep = np.zeros(n, bool)
    keep[:min(sink, n)] = True
    keep[max(0, n - window):] = True
    starts = np.arange(0, n, chunk)
    means = np.array([scores[s:s + chunk].mean() for s in starts])
    for i in np.argsort(-means, kind="stable"):
        if keep.sum() >= k:
            break
        span = slice(starts[i], min(n, starts[i] + chunk))
        if keep.sum() + (~keep[span]).sum() <= k:
            keep[span] = True
    return np.flatnonzero(keep).astype(np.int32)
