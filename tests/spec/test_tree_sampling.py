"""Tree verification with sampling is lossless: the emitted tokens have exactly the target's distribution
(chi-square against the exact joint of three tokens, and the power check: the same draws are rejected
against a slightly different distribution), while proposals are accepted, off the argmax chain too."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import testing
from dflash_jax.decode import greedy_generate
from dflash_jax.models.family import family_of
from dflash_jax.spec import Buckets, SamplingParams
from dflash_jax.spec.sampling import sampling_probs
from dflash_jax.spec.loop import generate_tree_stepping
from dflash_jax.spec.tree import TreeShape

V = 8
N_TOKENS = 3


@pytest.fixture(scope="module")
def small_vocab_pair():
    cfg = testing.tiny_qwen3_moe_config(vocab_size=V, num_layers=2)
    return testing.random_pair(cfg, seed=5, agreeable=False, target_layer_ids=(0, 1), mask_token_id=V - 1,
                               vocab_size=V, block_size=4)


def _exact_joint(pair, prompt, params):
    """p(x1, x2, x3 | prompt) under the processed target distribution, by enumeration."""
    cfg = pair.target_cfg
    fam = family_of(cfg)
    prefixes = np.array([[a, b] for a in range(V) for b in range(V)])
    seqs = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1).astype(np.int32)
    out = fam.forward_jit(pair.target, jnp.asarray(seqs), fam.init_cache(cfg, len(seqs), seqs.shape[1]), cfg)
    probs = np.asarray(sampling_probs(out.logits, params), np.float64)
    p1 = probs[0, len(prompt) - 1]
    p2 = probs[::V, len(prompt)]  # row a*V: prefix (a, 0) -> p(x2 | a)
    p3 = probs[:, len(prompt) + 1].reshape(V, V, V)  # p(x3 | a, b)
    return p1[:, None, None] * p2[:, :, None] * p3


def _chi_square_pvalue(counts, expected):
    from scipy.stats import chi2

    order = np.argsort(expected)
    bins_e, bins_c, acc_e, acc_c = [], [], 0.0, 0
    for e, c in zip(expected[order], counts[order]):  # merge the smallest cells until each expects >= 5
        acc_e += e
        acc_c += c
        if acc_e >= 5:
            bins_e.append(acc_e)
            bins_c.append(acc_c)
            acc_e, acc_c = 0.0, 0
    if acc_e > 0:
        bins_e[-1] += acc_e
        bins_c[-1] += acc_c
    bins_e, bins_c = np.array(bins_e), np.array(bins_c)
    return chi2.sf(np.sum((bins_c - bins_e) ** 2 / bins_e), len(bins_e) - 1)


@pytest.mark.slow
@pytest.mark.parametrize("params, head", [(dict(temperature=1.0), False),
                                          (dict(temperature=0.8, top_k=6, top_p=0.9), False),
                                          (dict(temperature=1.0), True)],
                         ids=["plain", "topk-topp", "branch-head"])
def test_tree_sampling_reproduces_the_target_distribution(small_vocab_pair, params, head):
    pytest.importorskip("scipy")
    pair = small_vocab_pair
    if head:  # trees built from a branch head (other nodes than the marginals'): the rule does not depend on them
        import jax

        from dflash_jax.models.draft import init_branch_head
        from dflash_jax.pair import with_branch_head

        fresh = init_branch_head(pair.draft_cfg.hidden_size, jax.random.key(1))
        pair = with_branch_head(pair, fresh.replace(w_out=jax.random.normal(jax.random.key(2), fresh.w_out.shape) * 0.2))
    sampling = SamplingParams(**params)
    prompt = [3, 1, 4, 1, 5, 2]
    n, n_greedy = 6000, 16
    result, rounds = generate_tree_stepping(
        pair, [prompt] * (n + n_greedy), max_new_tokens=N_TOKENS, shape=TreeShape(8, 3),
        sampling=[sampling] * n + [SamplingParams()] * n_greedy, seed=7,
        buckets=Buckets(prompt=8, output=4, cache=16, pad_batch=True))
    greedy = greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=N_TOKENS)[0]
    assert result.tokens[n:] == [greedy] * n_greedy  # greedy rows of the same batch stay greedy
    draws = np.array(result.tokens[:n])
    assert draws.shape == (n, N_TOKENS)
    # the tree is exercised: first rounds accept proposals, often on a branch other than the draft's argmax
    first = rounds[0]
    assert np.mean(first["accepted"][:n] >= 1) > 0.2
    assert np.mean(first["off_chain"][:n]) > 0.05
    counts = np.bincount(draws[:, 0] * V * V + draws[:, 1] * V + draws[:, 2], minlength=V**3)
    exact = _exact_joint(pair, prompt, sampling).reshape(-1)
    assert _chi_square_pvalue(counts, exact * n) > 1e-3
    wrong = _exact_joint(pair, prompt, SamplingParams(**dict(params, temperature=params["temperature"] * 1.25)))
    assert _chi_square_pvalue(counts, wrong.reshape(-1) * n) < 1e-3
