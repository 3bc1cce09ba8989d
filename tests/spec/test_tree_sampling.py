"""Tree verification with sampling is lossless: the emitted tokens have exactly the target's distribution
(chi-square against the exact joint of three tokens, and the power check: the same draws are rejected
against a slightly different distribution), while proposals are accepted, off the argmax chain too."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax import testing
from dflash_jax.decode import greedy_generate
from dflash_jax.spec import Buckets, SamplingParams
from dflash_jax.spec.loop import generate_tree_stepping
from dflash_jax.spec.tree import TreeShape
from tests.spec.sampling_checks import chi_square_pvalue, exact_joint3  # noqa: E402

V = 8
N_TOKENS = 3


@pytest.fixture(scope="module")
def small_vocab_pair():
    cfg = testing.tiny_qwen3_moe_config(vocab_size=V, num_layers=2)
    return testing.random_pair(cfg, seed=5, agreeable=False, target_layer_ids=(0, 1), mask_token_id=V - 1,
                               vocab_size=V, block_size=4)


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
    exact = exact_joint3(pair, prompt, sampling).reshape(-1)
    assert chi_square_pvalue(counts, exact * n) > 1e-3
    wrong = exact_joint3(pair, prompt, SamplingParams(**dict(params, temperature=params["temperature"] * 1.25)))
    assert chi_square_pvalue(counts, wrong.reshape(-1) * n) < 1e-3
