"""Shapes that do not follow the request: one compiled program per bucket, per-sequence settings in one
batch, stable sampling at any temperature, and clear errors at the Python boundary."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dflash_jax import testing
from dflash_jax.compile_cache import CompileCounter
from dflash_jax.decode import greedy_generate
from dflash_jax.spec import (
    Buckets, Draft, SamplingParams, begin, draft_round_jit, generate, generate_stepping, verify_round,
)
from dflash_jax.spec import session
from dflash_jax.spec.requests import bucket
from dflash_jax.spec.sampling import RowSampling, greedy_tokens, processed_scores, sampling_probs


@pytest.fixture(scope="module")
def pair():
    return testing.random_pair()


def _prompt(n, seed, vocab=512):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def test_bucket_sizes():
    assert [bucket(n, 16) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, 128]
    assert [bucket(n, 16, fine=True) for n in (17, 24, 25, 33, 48, 49)] == [24, 24, 32, 48, 48, 64]
    assert [bucket(n, 1, fine=True) for n in range(1, 10)] == [1, 2, 3, 4, 6, 6, 8, 8, 12]
    b = Buckets()
    assert b.cache_len(24 + 64 + 8) == 96 and b.output_len(1) == b.output_len(64) == 64
    with pytest.raises(ValueError, match="Buckets.prompt must be a positive integer"):
        Buckets(prompt=0)


def test_capacity_tiers():
    """A capacity with a floor runs each request at the smallest power-of-two tier >= the floor that holds it; past
    the capacity, `grow` takes the next power of two; without a floor, always the capacity."""
    tiers = Buckets(capacity=2048, floor=256, grow=True)
    assert [tiers.capacity_rows(4096, n) for n in (1, 200, 256, 257, 600, 2048, 2049)] == [
        256, 256, 256, 512, 1024, 2048, 4096]
    assert tiers.capacity_rows(1024, 600) == 1024 and tiers.capacity_rows(300, 200) == 256
    assert Buckets(capacity=2048).capacity_rows(4096, 200) == 2048
    with pytest.raises(ValueError, match="Buckets.floor must be a positive integer"):
        Buckets(capacity=2048, floor=0)


def test_no_recompile_across_requests_of_one_bucket(pair):
    """After one request, others with other prompt lengths (same bucket), budgets, temperatures, top-p /
    top-k, stop ids and seeds compile nothing, in the jitted loop, the stepping loop and plain decoding."""
    v = pair.target_cfg.vocab_size
    first = generate(pair, [_prompt(20, 0)], max_new_tokens=40)
    generate_stepping(pair, [_prompt(20, 0)], max_new_tokens=40)
    # a batch of greedy rows runs a program of its own where the platform runs conditionals from the host (a GPU,
    # `SpecConfig.greedy_only`): one sampled request first there (on a CPU the same program)
    warm = dict(max_new_tokens=40, sampling=SamplingParams(temperature=0.5))
    if session.specialize_greedy():
        generate(pair, [_prompt(20, 0)], **warm)
        generate_stepping(pair, [_prompt(20, 0)], **warm)
    greedy_generate(pair.target, pair.target_cfg, [_prompt(20, 0)], max_new_tokens=40)
    # capacity mode, at the capacity's smallest tier that holds the request (`Buckets.floor`)
    assert first.stats["shapes"] == {"batch": 1, "prompt": 24, "output": 256, "cache": 256}
    requests = [
        dict(prompts=[_prompt(17, 1)], max_new_tokens=64),
        dict(prompts=[_prompt(23, 2)], max_new_tokens=np.int64(9), sampling=SamplingParams(temperature=0.7)),
        dict(prompts=[np.asarray(_prompt(21, 3), np.int64)], max_new_tokens=33, seed=12,
             sampling=SamplingParams(temperature=1.3, top_k=40, top_p=0.9)),
        dict(prompts=[_prompt(24, 4)], max_new_tokens=50, stop_ids=[first.tokens[0][5], 3, 4, v - 1]),
        dict(prompts=[_prompt(18, 5)], max_new_tokens=2, sampling=SamplingParams(temperature=1e-45)),
    ]
    with CompileCounter() as counter:
        results = [generate(pair, **r) for r in requests]
        stepped = generate_stepping(pair, **requests[2])
        plain = greedy_generate(pair.target, pair.target_cfg, [_prompt(17, 1)], max_new_tokens=np.int32(64),
                                stop_ids=[3])
    assert counter.compiles == 0 and counter.traces == 0, (counter.compiles, counter.traces)
    assert [len(r.tokens[0]) for r in results][:3] == [64, 9, 33]
    assert len(results[3].tokens[0]) <= 50 and len(results[4].tokens[0]) == 2
    assert stepped.tokens == results[2].tokens  # same seed, same draws, either loop
    greedy = results[0].tokens[0]  # lossless: the plain greedy run, cut at its stop id
    assert plain[0] == greedy[: greedy.index(3) + 1 if 3 in greedy else len(greedy)]
    assert results[0].stats["mean_acceptance"] > 1.5  # the speculative path ran, not a 1-token-per-round loop


@pytest.mark.parametrize("mode", ["exact_match", pytest.param("rejection", marks=pytest.mark.slow)])
def test_sequences_of_one_batch_equal_their_runs_alone(pair, mode):
    """Per-sequence budgets, sampling settings, stop ids and seeds in one batch: every sequence's output is
    the one it gets alone (greedy sequences and sampled ones with a fixed seed), in either method."""
    prompts = [_prompt(17, 10), _prompt(22, 11), _prompt(19, 12), _prompt(24, 13)]
    alone_greedy = generate(pair, [prompts[0]], max_new_tokens=40).tokens[0]
    stop = alone_greedy[7]
    sampling = [SamplingParams(mode=mode), SamplingParams(temperature=0.9, top_k=30, mode=mode),
                SamplingParams(mode=mode), SamplingParams(temperature=1.1, top_p=0.8, mode=mode)]
    budgets, stops, seeds = [40, 30, 11, 25], [[stop], [], [], [5]], [1, 5, 2, 9]
    batch = generate(pair, prompts, max_new_tokens=budgets, sampling=sampling, stop_ids=stops, seed=seeds)
    for i in range(len(prompts)):
        alone = generate(pair, [prompts[i]], max_new_tokens=budgets[i], sampling=sampling[i],
                         stop_ids=stops[i], seed=[seeds[i]])
        assert batch.tokens[i] == alone.tokens[0], (mode, i)
        assert batch.acceptance_lengths[i] == alone.acceptance_lengths[0], (mode, i)
    assert batch.tokens[0] == alone_greedy[: alone_greedy.index(stop) + 1]
    assert len(batch.tokens[2]) == 11
    assert batch.tokens[1] != generate(pair, [prompts[1]], max_new_tokens=30).tokens[0]  # it did sample


def test_greedy_tokens_is_argmax_with_its_ties_infinities_and_nans():
    """`greedy_tokens` (two vectorizing reductions) picks exactly what `jnp.argmax` picks: the first of tied maxima,
    -0.0 tied with 0.0, rows of -inf, the first NaN of a row that holds one; any leading shape, a vocabulary-sized
    last axis."""
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 3, (400, 2, 9)).astype(np.float32)  # small integers: many ties
    x[::3, 0, rng.integers(0, 9)] = np.nan
    x[1::5, 1, :] = -np.inf
    x[2::7, 0, 4] = -0.0
    x[3::11, 1, 2] = np.inf
    x[4::13, 0, 5:] = np.nan
    got, want = jax.jit(greedy_tokens)(x), jnp.argmax(x, axis=-1)
    assert got.dtype == jnp.int32 and got.shape == (400, 2)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    wide = rng.standard_normal((3, 5, 1024)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy_tokens)(wide)), np.argmax(wide, axis=-1))


def test_tiny_and_huge_temperatures_are_stable():
    logits = jnp.asarray([[0.5, 3.0, -2.0, 3.0 - 1e-6, 1e4], [1.0, 2.0, 3.0, -1e9, 0.0]], jnp.float32)
    for t in (1e-45, 1e-38, 1e-20):
        p = np.asarray(sampling_probs(logits, SamplingParams(temperature=t)))
        assert np.isfinite(p).all()
        np.testing.assert_array_equal(p, np.eye(5)[[4, 2]])
    p = np.asarray(sampling_probs(logits, SamplingParams(temperature=1e30)))
    np.testing.assert_allclose(p, 0.2, rtol=1e-5)
    ties = np.asarray(sampling_probs(jnp.asarray([[2.0, 2.0, 1.0]]), SamplingParams(temperature=1e-45)))
    np.testing.assert_array_equal(ties, [[0.5, 0.5, 0.0]])


def _reference_probs(logits, t, top_p, top_k):
    """The module doc's definition, in float64 numpy."""
    z = (logits - logits.max()) / t
    order = np.argsort(-z, kind="stable")
    keep = np.ones_like(z, bool)
    if 0 < top_k < len(z):
        keep &= z >= z[order[top_k - 1]]
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        sp = p[order]
        before = np.cumsum(sp) - sp
        kept = int(np.sum((before < top_p) & (sp > 0)))
        keep &= z >= z[order[kept - 1]]
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def test_per_row_top_k_top_p_temperature_match_the_definition():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 3, 50)).astype(np.float32) * 3
    temps, top_ps, top_ks = [0.7, 1.0, 1.9, 0.3], [1.0, 0.6, 0.95, 0.3], [0, 7, 0, 49]
    rows = RowSampling(temperature=jnp.asarray(temps, jnp.float32), top_p=jnp.asarray(top_ps, jnp.float32),
                       top_k=jnp.asarray(top_ks, jnp.int32))
    got = np.asarray(jax.jit(lambda x, r: jax.nn.softmax(processed_scores(x, r), axis=-1))(logits, rows))
    for i in range(4):
        for j in range(3):
            want = _reference_probs(logits[i, j].astype(np.float64), temps[i], top_ps[i], top_ks[i])
            np.testing.assert_allclose(got[i, j], want, atol=2e-6)
            assert (got[i, j] > 0).sum() == (want > 0).sum()
        single = np.asarray(sampling_probs(logits[i], SamplingParams(temperature=temps[i], top_p=top_ps[i],
                                                                      top_k=top_ks[i])))
        np.testing.assert_allclose(single, got[i], atol=1e-7)
    assert ((got[1] > 0).sum(-1) <= 7).all() and ((got[3] > 0).sum(-1) < 50).all()


# ----------------------------------------------------------------------------------------------------------
# the Python boundary
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(prompts=[[1, 2.0, 3]]), TypeError, "prompt 0: token 1 must be an integer id, got float 2.0"),
        (dict(prompts=[[1, True]]), TypeError, "prompt 0: token 1 must be an integer id, got bool"),
        (dict(prompts=[np.array([1.0, 2.0])]), TypeError, "prompt 0 must hold integer token ids"),
        (dict(prompts=[1, 2, 3]), TypeError, "got one flat list of integers: pass [prompt]"),
        (dict(prompts="hello"), TypeError, "tokenize it first"),
        (dict(prompts=["hello"]), TypeError, "prompt 0 is a str"),
        (dict(prompts=[[1], []]), ValueError, "prompt 1 is empty"),
        (dict(prompts=[[1, 2**70]]), ValueError, f"token id {2**70} outside the vocabulary [0, 512)"),
        (dict(prompts=[[-1]]), ValueError, "token id -1 outside the vocabulary"),
        (dict(max_new_tokens=4.0), TypeError, "max_new_tokens must be a positive integer, got float 4.0"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens must be a positive integer, got 0"),
        (dict(max_new_tokens=[4, 5]), ValueError, "max_new_tokens has 2 entries for 1 prompts"),
        (dict(max_new_tokens=10**6), ValueError, "exceeds the target's"),
        (dict(stop_ids=[2.0]), TypeError, "stop_ids entry must be a token id in [0, 512), got float"),
        (dict(stop_ids=[512]), ValueError, "stop_ids entry must be a token id in [0, 512), got 512"),
        (dict(stop_ids=5), TypeError, "stop_ids must be a list of token ids"),
        (dict(seed=1.5), TypeError, "seed must be an integer"),
        (dict(seed=2**64), ValueError, "seed must be an integer in [-2**63, 2**63)"),
        (dict(sampling="greedy"), TypeError, "sampling must be a SamplingParams"),
        (dict(prompts=[[1], [2]], sampling=[SamplingParams(temperature=1.0),
                                            SamplingParams(temperature=1.0, mode="rejection")]),
         ValueError, "must share one acceptance mode"),
        (dict(block_size=9), ValueError, "block size must be between 1 and the draft's trained block size 8"),
        (dict(block_size=4.0), ValueError, "block size must be between 1"),
    ],
)
def test_bad_requests_fail_at_the_boundary(pair, kwargs, error, message):
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
    args.update(kwargs)
    prompts = args.pop("prompts")
    with pytest.raises(error) as e:
        begin(pair, prompts, **args)
    assert message in str(e.value)


def test_numpy_integers_are_accepted(pair):
    a = generate(pair, [np.array([5, 6, 7], np.int32)], max_new_tokens=np.int64(6), stop_ids=np.array([3]),
                 seed=np.uint8(1))
    b = generate(pair, [[5, 6, 7]], max_new_tokens=6, stop_ids=[3], seed=1)
    assert a.tokens == b.tokens


@pytest.mark.parametrize(
    "params, error, message",
    [
        (dict(temperature=float("inf")), ValueError, "temperature must be >= 0 and finite"),
        (dict(temperature=float("nan")), ValueError, "temperature must be >= 0"),
        (dict(temperature=-1.0), ValueError, "temperature must be >= 0"),
        (dict(temperature="1"), TypeError, "temperature must be a real number"),
        (dict(top_p=0.0), ValueError, "top_p must be in (0, 1]"),
        (dict(top_p=1.5), ValueError, "top_p must be in (0, 1]"),
        (dict(top_k=2.5), TypeError, "top_k must be an integer"),
        (dict(top_k=-1), ValueError, "top_k must be >= 0"),
        (dict(mode="beam"), ValueError, "mode must be 'exact_match' or 'rejection'"),
    ],
)
def test_sampling_params_validate(params, error, message):
    with pytest.raises(error) as e:
        SamplingParams(**params)
    assert message in str(e.value)
    assert SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3)).top_k == 3


def test_eager_verify_round_rejects_out_of_vocabulary_proposals(pair):
    spec, state = begin(pair, [[1, 2, 3]], max_new_tokens=8)
    draft = draft_round_jit(pair.target, pair.draft, state, spec)
    vocab = pair.target_cfg.vocab_size
    bad = Draft(tokens=draft.tokens.at[0, 2].set(vocab), probs=None, draft_cache=draft.draft_cache)
    with pytest.raises(ValueError, match=rf"draft.tokens\[0, 2\] = {vocab} is outside the vocabulary"):
        verify_round(pair.target, state, bad, spec)
    short = Draft(tokens=draft.tokens[:, :3], probs=None, draft_cache=draft.draft_cache)
    with pytest.raises(ValueError, match=r"draft.tokens must have shape \[batch, block_size - 1\]"):
        verify_round(pair.target, state, short, spec)
    with pytest.raises(TypeError, match="draft must be a Draft"):
        verify_round(pair.target, state, draft.tokens, spec)


def test_seeds_that_differ_only_above_32_bits_draw_differently():
    """JAX's key keeps a seed's low 32 bits; a request's seed (any int64, as OpenAI clients send) folds its high
    word in, while every seed in [0, 2^32) keeps exactly `jax.random.key(seed)`."""
    import jax

    from dflash_jax.spec.sampling import seed_key_data

    for s in (0, 7, 2**31, 2**32 - 1):
        np.testing.assert_array_equal(seed_key_data(s), np.asarray(jax.random.key_data(jax.random.key(s))))
    seeds = [0, 2**32, 2**33, 2**32 + 7, 7, -1, 2**32 - 1, 2**63 - 1, -(2**63)]
    assert len({tuple(seed_key_data(s)) for s in seeds}) == len(seeds)


def test_a_seed_key_compiles_nothing():
    """Serving compiles nothing after warm-up: a request's key (any seed) is built on the host."""
    from dflash_jax.compile_cache import CompileCounter
    from dflash_jax.spec.sampling import seed_key_data

    with CompileCounter() as counter:
        for s in (3, 2**31 + 5, 2**40 + 1, -(2**62) - 9):
            seed_key_data(s)
    assert counter.compiles == 0
