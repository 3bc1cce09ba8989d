"""The PFlash needle-retrieval set: prompts of the asked length whose right continuation is the planted passage,
a control with another passage at the same span, the passage right before the query, and the scoring helpers."""

from __future__ import annotations

import numpy as np
import pytest

import dflash_jax
from dflash_jax.pflash import needle as nd
from study.needle import needle_set


def _synthetic(n_hays=3, hay_len=200, n_passages=4, passage_len=60):
    rng = np.random.default_rng(0)
    hays = [rng.integers(0, 500, hay_len).tolist() for _ in range(n_hays)]
    passages = [rng.integers(500, 1000, passage_len).tolist() for _ in range(n_passages)]
    return hays, passages


def test_cases_plant_the_passage_and_ask_for_its_continuation():
    hays, passages = _synthetic()
    length, p, q, a = 160, 48, 16, 8
    cases = nd.build_needles(hays, passages, length=length, passage=p, query=q, answer=a, depths=(0.1, 0.5))
    assert len(cases) == 3
    for i, c in enumerate(cases):
        lo, hi = c.span
        assert len(c.prompt) == len(c.control) == len(c.adjacent) == length
        planted = c.prompt[lo:hi]
        assert hi - lo == p and any(planted == passages[i][o:o + p] for o in range(len(passages[i]) - p + 1))
        assert c.prompt[-q:] == planted[:q] and c.answer == planted[q:q + a]  # the query asks for the passage again
        assert lo == round(c.depth * (length - p - q)) and c.depth == (0.1, 0.5)[i % 2]
        # the control differs only inside the span (another passage), the query is the same
        assert c.control[:lo] == c.prompt[:lo] and c.control[hi:] == c.prompt[hi:]
        assert c.control[lo:hi] == passages[i + 1][:p] != planted
        assert c.adjacent[-(p + q):] == planted + planted[:q]
        assert not set(planted) & set(hays[i])  # the passage is not haystack text
    again = nd.build_needles(hays, passages, length=length, passage=p, query=q, answer=a, depths=(0.1, 0.5))
    assert [c.prompt for c in again] == [c.prompt for c in cases]  # seeded


@pytest.mark.parametrize("kw,match", [
    (dict(length=60), "no haystack"), (dict(query=40, answer=10), "must fit in the passage"),
    (dict(depths=(1.0,)), "depths"), (dict(passage=0), "positive integer"), (dict(length=400), "fewer than"),
])
def test_bad_needle_arguments_are_refused(kw, match):
    hays, passages = _synthetic()
    args = dict(length=160, passage=48, query=16, answer=8)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        nd.build_needles(hays, passages, **args)
    with pytest.raises(ValueError, match="passages"):
        nd.build_needles(hays, passages[:3], length=160)


def test_scoring_helpers():
    assert nd.score_answer([1, 2, 3, 9], [1, 2, 3]) == (True, 1.0)
    assert nd.score_answer([1, 5, 3], [1, 2, 3]) == (False, 2 / 3)
    assert nd.kept_fraction(np.array([0, 1, 10, 11, 12, 30]), (10, 14)) == 0.75


def test_needle_set_from_the_shipped_pairs_held_out_files():
    pair = dflash_jax.load(dequantize_experts="auto")
    cases = needle_set(pair, 2, 300)
    assert len(cases) == 2
    for c in cases:
        assert len(c.prompt) == 300 and max(c.prompt) < pair.target_cfg.vocab_size
        lo, hi = c.span
        assert c.prompt[-16:] == c.prompt[lo:lo + 16] and c.answer == c.prompt[lo + 16:lo + 24]
