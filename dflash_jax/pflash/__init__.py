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

A server compresses the prompts it takes with a `Compressor` (`serve.Engine(compress=...)`, `dflash-serve
--pflash-keep R`): each prompt of at least `min_tokens` tokens is scored and compressed as it is submitted, and its
prefill (whole or by chunks) runs on the kept tokens at their original positions; decoding is the usual round.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dflash_jax.spec import requests as rq
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


@dataclasses.dataclass(frozen=True)
class Compressor:
    """Prompt compression as a policy: `compressor(prompt)` returns the kept indices of a prompt of at least
    `min_tokens` tokens (`compress` with these settings), or None to prefill it whole (shorter prompts, and a
    selection that keeps every token). Thread-safe (a server calls it on its request threads); `warm(lengths)`
    compiles the scorer for those prompt lengths' buckets, so that serving compiles nothing."""

    scorer: Scorer
    keep_ratio: float | None = None
    budget: int | None = None
    min_tokens: int = 1
    window: int = DEFAULT_WINDOW
    sink: int = DEFAULT_SINK
    chunk: int = DEFAULT_CHUNK

    def __post_init__(self):
        if not isinstance(self.scorer, Scorer):
            raise TypeError(f"scorer must be a pflash.Scorer (Scorer.from_pair(pair) or load_scorer()), got "
                            f"{type(self.scorer).__name__}")
        keep_count(max(self.min_tokens, self.window + self.sink), keep_ratio=self.keep_ratio, budget=self.budget,
                   window=self.window, sink=self.sink)  # bad settings fail here, not on the first long request
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            raise ValueError(f"min_tokens must be a positive integer, got {self.min_tokens!r}")

    def __call__(self, prompt_ids: Sequence[int]) -> np.ndarray | None:
        n = len(prompt_ids)
        if n < self.min_tokens:
            return None
        if self.budget is not None and n <= self.budget:
            return None
        kept = compress(self.scorer, prompt_ids, keep_ratio=self.keep_ratio, budget=self.budget, window=self.window,
                        sink=self.sink, chunk=self.chunk)
        return None if len(kept) == n else kept

    def warm(self, max_tokens: int) -> None:
        """Compiles the scorer for every prompt of up to `max_tokens` tokens this compressor would score: a dummy
        prompt per prompt bucket (`score_tokens` compiles one program per bucket)."""
        if self.keep_ratio == 1:
            return
        n = max(self.min_tokens, 1 if self.budget is None else self.budget + 1)
        while n <= max_tokens:
            bucket = rq.DEFAULT_BUCKETS.prompt_len(n)
            score_tokens(self.scorer, [0] * min(bucket, max_tokens), window=self.window)
            n = bucket + 1


__all__ = ["CompressedBatch", "Compressor", "Scorer", "begin_compressed", "check_kept", "compress", "generate", "keep_count",
           "load_scorer", "prepare_compressed", "score_tokens", "select_tokens"]
