"""Log-probs, prompt scores and `n` samples on the shipped pair (the session's engine, `conftest.engine`): every
reported log-prob equals log_softmax of one plain target forward over the final sequence, the top alternatives are
that forward's top-k, and the samples of a prompt prefilled once equal the requests a seed and a fold make alone."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.spec.sampling import SamplingParams
from tests.serve.logprob_checks import plain_log_softmax, tolerance

PROMPT = [15, 27, 3, 99, 4, 8, 61]


def test_logprobs_equal_a_plain_forward(engine, pair):
    engine.runner.sync()
    req = engine.submit(PROMPT, max_new_tokens=40, logprobs=3, prompt_logprobs=True)
    other = engine.submit([5, 6, 7], max_new_tokens=30)  # a neighbour that does not ask: rows are not mixed up
    engine.run_until_idle()
    assert other.token_logprobs == []
    seq = PROMPT + req.tokens
    ref = plain_log_softmax(pair, seq)
    n, tol = len(PROMPT), tolerance(pair)
    got = np.asarray(req.token_logprobs)
    want = ref[np.arange(n - 1, len(seq) - 1), seq[n:]]
    np.testing.assert_allclose(got, want, atol=tol)
    for i, top in enumerate(req.top_logprobs):
        row = ref[n - 1 + i]
        assert [t for t, _ in top][0] == int(np.argmax(row))  # greedy: the token itself is the top one
        np.testing.assert_allclose([lp for _, lp in top], np.sort(row)[::-1][:3], atol=tol)
    # echo's prompt scores: the same forward's rows over the prompt
    s = req.prompt_scores
    np.testing.assert_allclose(s.logprob, ref[np.arange(n - 1), PROMPT[1:]], atol=tol)
    np.testing.assert_allclose(s.top_logprob[:, :3], -np.sort(-ref[: n - 1], axis=1)[:, :3], atol=tol)


def test_n_samples_equal_their_solo_runs(engine):
    from dflash_jax import compile_cache

    hot = SamplingParams(temperature=1.0)
    # warmed again: another test of the session may have cleared JAX's caches since (a change of the attention
    # tuning does, `tests/serve/test_engine_lengths.py`), and then every program compiles again, warm-up or not
    engine.warmup([engine.max_prompt_len])
    with compile_cache.CompileCounter() as counter:  # forks and log-probs were compiled at warm-up
        head = engine.submit(PROMPT, max_new_tokens=24, sampling=hot, seed=11, n=3, logprobs=2)
        engine.run_until_idle()
    assert counter.compiles == 0
    outs = [r.tokens for r in head.samples]
    assert len({tuple(o) for o in outs}) > 1  # independent samples
    solo = engine.submit(PROMPT, max_new_tokens=24, sampling=hot, seed=11)
    engine.run_until_idle()
    assert solo.tokens == outs[0]  # sample 0 is the request a lone submit makes
    again = engine.submit(PROMPT, max_new_tokens=24, sampling=hot, seed=11, n=3)
    engine.run_until_idle()
    assert [r.tokens for r in again.samples] == outs  # reproducible for the seed
    greedy = engine.submit(PROMPT, max_new_tokens=24, n=2, logprobs=0)
    engine.run_until_idle()
    a, b = greedy.samples
    assert a.tokens == b.tokens and a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-6)


def test_a_seed_reproduces_a_sample_whatever_else_is_in_the_batch(engine):
    """The engine's verify width is fixed (the conftest engine): a seeded sampled request's key is its own, so its
    output does not depend on the requests decoding beside it, nor on its slot."""
    hot = SamplingParams(temperature=0.9, top_p=0.95)
    alone = engine.submit(PROMPT, max_new_tokens=30, sampling=hot, seed=123)
    engine.run_until_idle()
    others = [engine.submit([i + 2, 40 + i], max_new_tokens=10 + 7 * i, sampling=hot, seed=i) for i in range(3)]
    busy = engine.submit(PROMPT, max_new_tokens=30, sampling=hot, seed=123)  # joins last: another slot
    engine.run_until_idle()
    assert busy.tokens == alone.tokens
    assert all(r.finish_reason in ("length", "stop") for r in others)
    different = engine.submit(PROMPT, max_new_tokens=30, sampling=hot, seed=124)
    engine.run_until_idle()
    assert different.tokens != alone.tokens
