"""PFlash: speculative prefill compression.

A small scorer model reads the whole prompt and scores each token by the attention the prompt's last window pays
it (`score_tokens`); a selection keeps the sink tokens, the last window and the best chunks under a keep ratio or
a token budget (`select_tokens`); the target prefills only the kept tokens at their original positions and then
decodes normally, with DFlash or plainly (`generate`). Lossy by design: what the prefill drops is gone; the
benchmark (`benchmarks/hybrid_sweep.py`, docs/pflash.md) measures the quality it costs, with agreement against the
full prefill and a needle-retrieval set built from held-out text (`pflash.needle`).

  scorer = pflash.Scorer.from_pair(pair)                 # or pflash.load_scorer(DIR): any converted target
  kept = pflash.compress(scorer, prompt, keep_ratio=0.25)
  result = pflash.generate(pair, [prompt], [kept], max_new_tokens=64)
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dflash_jax.pflash.generate import (CompressedBatch, begin_compressed, check_kept, generate,
                                        prepare_compressed)
from dflash_jax.pflash.score import DEFAULT_WINDOW, Scorer, load_scorer, score_tokens
from dflash_jax.pflash.select import DEFAULT_CHUNK, DEFAULT_SINK, keep_count, select_tokens


def compress(scorer: Scorer, prompt_ids: Sequence[int], *, keep_ratio: float | None = None,
             budget: int | None = None, window: int = DEFAULT_WINDOW, sink: int = DEFAULT_SINK,
             chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """Sorted int32 indices of the prompt tokens to keep (exactly one of keep_ratio in (0, 1] or budget tokens):
    the first `sink` tokens, the last `window` tokens (also the scorer's query window) and the chunks of `chunk`
    tokens the window attends to most. keep_ratio 1 keeps every token without running the scorer."""
    keep_count(len(prompt_ids), keep_ratio=keep_ratio, budget=budget, window=window, sink=sink)  # bad args first
    if keep_ratio is not None and keep_ratio == 1:
        return np.arange(len(prompt_ids), dtype=np.int32)
    scores = score_tokens(scorer, prompt_ids, window=window)
    return select_tokens(scores, keep_ratio=keep_ratio, budget=budget, window=window, sink=sink, chunk=chunk)


__all__ = ["CompressedBatch", "Scorer", "begin_compressed", "check_kept", "compress", "generate", "keep_count",
           "load_scorer", "prepare_compressed", "score_tokens", "select_tokens"]
