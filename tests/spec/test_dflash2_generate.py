"""DFlash 2 drafts end to end: the selector chain (a DFlash 2 draft's default proposer) and selector trees are
lossless in every driver (the jitted loop, the stepping loop, the serving engine, the offloaded loop) for
Qwen3-MoE and gpt-oss targets, with proposals accepted on a planted agreeable draft; greedy output equals
transformers' greedy and z-lab's own `dflash_generate`; sampled output has the target's distribution under both
acceptance methods (chi-square against the enumerated joint of three tokens)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax import testing
from dflash_jax.api import default_proposer, make_proposer
from dflash_jax.decode import greedy_generate
from dflash_jax.models import draft as dm
from dflash_jax.spec import Buckets, SamplingParams
from dflash_jax.spec.round import Chain, propose
from dflash_jax.spec.session import begin
from dflash_jax.spec.tree import TreeShape

DFLASH2 = dict(version=2, conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [100, 200, 300, 4]]
N = 24


def _agreeable(pair):
    """The planted agreement (`testing.make_agreeable`) with the draft's amplified dimension signed so that the
    draft proposes the token the target emits (the DFlash 2 layers flip its sign for these seeds)."""
    return dataclasses.replace(pair, draft=pair.draft.replace(final_norm=pair.draft.final_norm.at[0].set(-30.0)))


@pytest.fixture(scope="module")
def qwen_pair():
    cfg = testing.tiny_qwen3_moe_config(num_layers=3)
    return _agreeable(testing.random_pair(cfg, seed=0, target_layer_ids=(0, 1), block_size=8, **DFLASH2))


@pytest.fixture(scope="module")
def qwen_plain(qwen_pair):
    return greedy_generate(qwen_pair.target, qwen_pair.target_cfg, PROMPTS, max_new_tokens=N)


def _tau(acceptance_lengths) -> float:
    return float(np.mean([a for seq in acceptance_lengths for a in seq]))


def test_default_proposer_is_the_selector_chain(qwen_pair):
    assert default_proposer(qwen_pair) == "selector" and make_proposer(qwen_pair) == Chain(head=True)
    assert make_proposer(qwen_pair, "selector") == Chain(head=True)
    dflash1 = testing.random_pair(testing.tiny_qwen3_moe_config(num_layers=3), seed=0, target_layer_ids=(0, 1))
    assert default_proposer(dflash1) == "chain"
    with pytest.raises(ValueError, match="selector proposer needs a DFlash 2 draft"):
        make_proposer(dflash1, "selector")
    with pytest.raises(ValueError, match="candidate selector, which a branch head would replace"):
        from dflash_jax.pair import with_branch_head

        with_branch_head(qwen_pair, dm.init_branch_head(qwen_pair.draft_cfg.hidden_size, jax.random.key(0)))


def test_selector_chain_in_the_jit_loop_equals_plain_greedy(qwen_pair, qwen_plain):
    res = dflash_jax.generate(qwen_pair, PROMPTS, max_new_tokens=N)  # the default: the selector chain
    assert res.tokens == qwen_plain
    assert _tau(res.acceptance_lengths) > 1.5


def test_sampled_proposals_draw_from_the_selectors_q(qwen_pair):
    """Under the rejection method a sampled selector chain keeps, per position, q = softmax(score / T) over the K
    candidates given the previous proposal (the request's top-k / top-p do not restrict it, as in z-lab's
    `dflash_generate`), 0 elsewhere, and each proposal is one of its row's candidates."""
    pair, cfg = qwen_pair, qwen_pair.draft_cfg
    sampling = SamplingParams(temperature=0.7, top_k=3, mode="rejection")
    spec, state = begin(pair, PROMPTS, max_new_tokens=N, sampling=sampling, seed=3)
    proposal = propose(Chain(head=True), pair.target, pair.draft, state, spec)
    tokens, probs = np.asarray(proposal.proposals), np.asarray(proposal.probs)
    assert probs.shape == (2, spec.block_size - 1, pair.target_cfg.vocab_size)
    # the hidden states of that draft forward: the block [anchor, MASK ...] on the state's cache
    block = jnp.concatenate([state.anchor[:, None], jnp.full((2, spec.block_size - 1), cfg.mask_token_id,
                                                              jnp.int32)], axis=1)
    _, hidden, _ = dm.draft_forward(pair.draft, cfg, embed=pair.target.embed, lm_head=pair.target.lm_head,
                                    block_tokens=block, context_features=state.context,
                                    num_context=state.num_context, cache=state.draft_cache)
    parents = jnp.concatenate([state.anchor[:, None], jnp.asarray(tokens[:, :-1])], axis=1)
    scores, candidates = dm.selector_scores(pair.draft.branch_head, hidden[:, 1:], parents, cfg,
                                            embed=pair.target.embed, lm_head=pair.target.lm_head)
    want = np.zeros_like(probs)
    np.put_along_axis(want, np.asarray(candidates), np.asarray(jax.nn.softmax(scores / 0.7, axis=-1)), axis=-1)
    np.testing.assert_allclose(probs, want, atol=1e-6)
    assert np.all((np.asarray(candidates) == tokens[..., None]).any(-1))
    support = (probs > 0).sum(-1)
    assert support.max() == cfg.selector_top_k > 3  # wider than the request's top-k of 3


@pytest.mark.slow
def test_selector_chain_in_the_stepping_loop_equals_plain_greedy(qwen_pair, qwen_plain):
    res = dflash_jax.generate(qwen_pair, PROMPTS, max_new_tokens=N, proposer="selector", driver="stepping")
    assert res.tokens == qwen_plain
    assert _tau(res.acceptance_lengths) > 1.5


@pytest.mark.slow
def test_selector_chain_in_the_serving_engine_equals_plain_greedy(qwen_pair, qwen_plain):
    from dflash_jax.serve.engine import Engine, generate as serve_generate

    eng = Engine(qwen_pair, slots=2, max_prompt_len=16, max_new_tokens=32, proposer=Chain(head=True))
    reqs = serve_generate(eng, PROMPTS, max_new_tokens=N)
    assert [r.tokens for r in reqs] == qwen_plain
    assert float(np.mean([np.mean(r.acceptance) for r in reqs])) > 1.5


@pytest.mark.slow
def test_selector_chain_offloaded_equals_plain_greedy(qwen_pair, qwen_plain):
    from dflash_jax.offload import HostExpertStore

    store = HostExpertStore(qwen_pair.target)
    budget = 3 * store.expert_bytes(store.layer_ids[0])  # 3 of 8 experts per layer: the verify fetches
    res = dflash_jax.generate(qwen_pair, PROMPTS, max_new_tokens=N, proposer="selector", experts="offload",
                              expert_budget_mb=budget / 1e6, pin=False)
    assert res.tokens == qwen_plain
    assert _tau(res.acceptance_lengths) > 1.5
    assert res.stats["route_ahead"]["summary"]["bytes_moved"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["jit", "stepping"])
def test_selector_trees_equal_plain_greedy(qwen_pair, qwen_plain, driver):
    """Trees of a DFlash 2 draft: each node's children are the top-K candidates by the selector's transition score
    given the node's token (`spec.tree.build_tree_from_head` on the selector)."""
    res = dflash_jax.generate(qwen_pair, PROMPTS, max_new_tokens=N, proposer=TreeShape(16, 4), driver=driver)
    assert res.tokens == qwen_plain
    assert _tau(res.acceptance_lengths) > 1.5


@pytest.mark.slow
def test_selector_chain_with_a_gpt_oss_target_equals_plain_greedy():
    cfg = testing.tiny_gpt_oss_config()
    pair = testing.random_pair(cfg, seed=0, target_layer_ids=(0, 2), block_size=8, **DFLASH2)
    plain = greedy_generate(pair.target, pair.target_cfg, PROMPTS, max_new_tokens=N)
    best = None
    for sign in (30.0, -30.0):  # the planted agreement, signed as the draft's layers leave dimension 0
        signed = dataclasses.replace(pair, draft=pair.draft.replace(final_norm=pair.draft.final_norm.at[0].set(sign)))
        res = dflash_jax.generate(signed, PROMPTS, max_new_tokens=N)
        assert res.tokens == plain, sign
        tau = _tau(res.acceptance_lengths)
        best = tau if best is None else max(best, tau)
    assert best > 1.5


# ------------------------------------------------------------------------------------------------------------
# sampling: exactly the target's distribution
# ------------------------------------------------------------------------------------------------------------

V = 8


@pytest.fixture(scope="module")
def small_vocab_pair():
    cfg = testing.tiny_qwen3_moe_config(vocab_size=V, num_layers=2)
    fields = dict(DFLASH2, selector_rank=4, selector_top_k=4)  # q covers half the vocabulary
    return testing.random_pair(cfg, seed=5, agreeable=False, target_layer_ids=(0, 1), mask_token_id=V - 1,
                               vocab_size=V, block_size=4, **fields)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exact_match", "rejection"])
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=6, top_p=0.9)],
                         ids=["plain", "topk-topp"])
def test_selector_sampling_reproduces_the_target_distribution(small_vocab_pair, mode, params):
    pytest.importorskip("scipy")
    from tests.spec.sampling_checks import chi_square_pvalue, exact_joint3

    pair = small_vocab_pair
    sampling = SamplingParams(mode=mode, **params)
    prompt = [3, 1, 4, 1, 5, 2]
    n, n_greedy = 6000, 16
    result = dflash_jax.generate(pair, [prompt] * (n + n_greedy), max_new_tokens=3, proposer="selector",
                                 sampling=[sampling] * n + [SamplingParams(mode=mode)] * n_greedy, seed=7,
                                 buckets=Buckets(prompt=8, output=4, cache=16, pad_batch=True))
    greedy = greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=3)[0]
    assert result.tokens[n:] == [greedy] * n_greedy  # greedy rows of the same batch stay greedy
    draws = np.array(result.tokens[:n])
    assert np.mean([a[0] >= 2 for a in result.acceptance_lengths[:n]]) > 0.05  # proposals were accepted
    counts = np.bincount(draws[:, 0] * V * V + draws[:, 1] * V + draws[:, 2], minlength=V**3)
    assert chi_square_pvalue(counts, exact_joint3(pair, prompt, sampling).reshape(-1) * n) > 1e-3
    wrong = SamplingParams(**dict(params, temperature=params["temperature"] * 1.25))
    assert chi_square_pvalue(counts, exact_joint3(pair, prompt, wrong).reshape(-1) * n) < 1e-3  # power
