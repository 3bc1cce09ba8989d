"""The PFlash needle set drawn from a trained pair's held-out files (`dflash_jax.pflash.needle` builds the cases
from any token lists; this research-side helper reads the training corpus's held-out split)."""

from __future__ import annotations

from typing import Sequence

from dflash_jax.pflash.needle import NeedleCase, build_needles
from dflash_jax.train.data import file_windows


def needle_set(pair, n: int, length: int, *, passage: int = 48, query: int = 16, answer: int = 8,
               depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7), seed: int = 1) -> list[NeedleCase]:
    """`n` cases of `length` tokens from a trained pair's held-out files (`train.data.file_windows`): haystacks
    and passages are windows of different files (two seeded draws; a passage drawn from a haystack's own file is
    skipped)."""
    hay_len = length - passage - query
    hays = file_windows(pair, "held_out", n, hay_len, seed=seed)
    pool = file_windows(pair, "held_out", 4 * n + 8, passage, seed=seed + 1000)
    hay_sets = [set(zip(h, h[1:], h[2:])) for h in hays]
    passages = [p for p in pool if not any(len(set(zip(p, p[1:], p[2:])) & s) > passage // 2 for s in hay_sets)]
    if len(passages) < len(hays) + 1:
        raise ValueError(f"only {len(passages)} held-out passages not overlapping the haystacks: lower n ({n})")
    return build_needles(hays, passages, length=length, passage=passage, query=query, answer=answer, depths=depths,
                         seed=seed)
