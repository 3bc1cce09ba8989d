"""A needle-retrieval set for PFlash: can the target still reproduce a passage planted early in a long prompt?

Each case is built from held-out text only (token lists; `study.needle.needle_set`, research code, draws them from a
trained pair's held-out files, `build_needles` takes any):

  prompt  = haystack[:at] + passage + haystack[at:] + passage[:query]      (a copy / induction task)
  answer  = passage[query : query + answer]                                 (what the prompt asks for again)
  control = the same prompt with the planted passage swapped for another passage of the same length
  adjacent = haystack + passage + passage[:query]: the passage right before the query (the easiest retrieval)

so the right continuation of the prompt is the planted text, which only the early passage gives away; the
control has every position and the query unchanged but not the passage, and measures how often the answer is
guessable without it (the chance level). A target that retrieves scores exact match well above the control
with the full prefill (keep 1); a compressed prefill keeps the score only if the selection keeps the passage.
A target that fails even the adjacent copy does not copy from its context at all (no induction), and no
retrieval set can rank compression on it.
`needle_kept` (the fraction of the passage's tokens a selection kept) measures the selection alone.

`build_needles` is deterministic (numpy seed); the passage is never taken from the case's own haystack.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class NeedleCase:
    """One needle prompt: `prompt` ids, the `answer` ids, the planted passage's `span` [lo, hi) in the prompt,
    the `control` prompt (same length and query, another passage planted at the same span) and the `adjacent`
    prompt (same length, the passage right before the query)."""

    prompt: list[int]
    answer: list[int]
    span: tuple[int, int]
    control: list[int]
    adjacent: list[int]
    depth: float


def build_needles(haystacks: Sequence[Sequence[int]], passages: Sequence[Sequence[int]], *, length: int,
                  passage: int = 48, query: int = 16, answer: int = 8,
                  depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7), seed: int = 0) -> list[NeedleCase]:
    """One case per haystack (len(passages) >= len(haystacks) + 1: case i plants passages[i] and its control plants
    passages[i + 1]); prompts are exactly `length` tokens; the passage starts at depth depths[i % len(depths)] of the
    haystack part. Each passage needs passage tokens, each haystack length - passage - query."""
    for name, value in (("length", length), ("passage", passage), ("query", query), ("answer", answer)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if query + answer > passage:
        raise ValueError(f"query ({query}) + answer ({answer}) must fit in the passage ({passage} tokens)")
    hay_len = length - passage - query
    if hay_len < 1:
        raise ValueError(f"length {length} leaves no haystack around a {passage}-token passage and a {query}-token "
                         "query: use a longer prompt or a shorter passage")
    if not depths or any(not 0 <= d < 1 for d in depths):
        raise ValueError(f"depths must be fractions in [0, 1), got {depths!r}")
    if len(passages) < len(haystacks) + 1:
        raise ValueError(f"need at least {len(haystacks) + 1} passages for {len(haystacks)} haystacks (one spare "
                         "for the last control)")
    rng = np.random.default_rng(seed)
    cases = []
    for i, hay in enumerate(haystacks):
        hay = list(hay)
        if len(hay) < hay_len:
            raise ValueError(f"haystack {i} has {len(hay)} tokens, fewer than the {hay_len} a {length}-token prompt "
                             "needs")
        hay = hay[:hay_len]
        planted, other = (list(p) for p in (passages[i], passages[i + 1]))
        if min(len(planted), len(other)) < passage:
            raise ValueError(f"passages {i} and {i + 1} need {passage} tokens each")
        off = int(rng.integers(0, len(planted) - passage + 1))
        planted = planted[off:off + passage]
        other = other[:passage]
        depth = float(depths[i % len(depths)])
        at = int(round(depth * hay_len))
        q = planted[:query]
        cases.append(NeedleCase(prompt=hay[:at] + planted + hay[at:] + q, answer=planted[query:query + answer],
                                span=(at, at + passage), control=hay[:at] + other + hay[at:] + q,
                                adjacent=hay + planted + q, depth=depth))
    return cases


def score_answer(tokens: Sequence[int], answer: Sequence[int]) -> tuple[bool, float]:
    """(exact match of the first len(answer) tokens, fraction of the answer's positions matched)."""
    tokens, answer = list(tokens)[:len(answer)], list(answer)
    same = sum(a == b for a, b in zip(tokens, answer))
    return tokens == answer, same / len(answer)


def kept_fraction(kept, span: tuple[int, int]) -> float:
    """The fraction of the planted passage's tokens [lo, hi) among the kept indices."""
    lo, hi = span
    kept = np.asarray(kept)
    return float(((kept >= lo) & (kept < hi)).sum()) / (hi - lo)
