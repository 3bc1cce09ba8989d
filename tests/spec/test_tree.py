"""Token-tree verification (`spec.tree`): the best-first tree, the tree attention mask (every node's logits
equal its path run as a chain), the acceptance walk, lossless greedy output on the shipped pair and on
random gpt-oss / Qwen3 / Qwen3.5 pairs (with proposals really accepted, off the draft's argmax chain too),
and the adaptive policy."""

from __future__ import annotations

import heapq
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax import testing
from dflash_jax.decode import greedy_generate
from dflash_jax.models.decoder import TreeBlock
from dflash_jax.models.family import family_of
from dflash_jax.spec import generate
from dflash_jax.spec.loop import generate_tree
from dflash_jax.spec.policy import AdaptivePolicy, VerifyCost
from dflash_jax.spec.tree import TreeShape, accept_tree, build_tree, tree_supported
from tests.spec.tree_checks import lossless_tree_rounds


# ----------------------------------------------------------------------------------------------------------
# the tree
# ----------------------------------------------------------------------------------------------------------

def _best_paths(logprobs: np.ndarray, branch: int, budget: int):
    """Reference: the budget-1 most probable non-empty paths by exhaustive enumeration (ranks per depth)."""
    depth, _ = logprobs.shape
    order = np.argsort(-logprobs, axis=1, kind="stable")[:, :branch]
    paths = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(branch), repeat=d):
            score = sum(logprobs[j, order[j, r]] for j, r in enumerate(ranks))
            paths.append((score, tuple(int(order[j, r]) for j, r in enumerate(ranks))))
    return heapq.nlargest(budget - 1, paths, key=lambda p: p[0])


def test_build_tree_takes_the_most_probable_paths():
    rng = np.random.default_rng(0)
    depth, vocab, budget, branch = 4, 12, 13, 3
    logits = rng.normal(size=(2, depth, vocab)) * 2.0
    logprobs = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    anchor = jnp.array([5, 6], jnp.int32)
    tree = jax.tree.map(np.asarray, build_tree(anchor, jnp.asarray(logprobs), TreeShape(budget, branch, 1.0)))
    for b in range(2):
        assert tree.tokens[b, 0] == anchor[b] and tree.depth[b, 0] == 0 and tree.valid[b].all()
        got = {}
        for t in range(1, budget):
            p = tree.parent[b, t]
            assert p < t and tree.depth[b, t] == tree.depth[b, p] + 1  # topological, one level down
            path = got.get(p, ()) + (int(tree.tokens[b, t]),)
            got[t] = path
            # the mask row is exactly the node's ancestors and itself
            anc, u = {t}, t
            while u:
                u = int(tree.parent[b, u])
                anc.add(u)
            assert set(np.flatnonzero(tree.mask[b, t])) == anc
            np.testing.assert_allclose(tree.score[b, t], sum(logprobs[b, d, x] for d, x in enumerate(path)),
                                       rtol=1e-5)
        want = _best_paths(logprobs[b], branch, budget)
        assert sorted(got.values()) == sorted(p for _, p in want)
        # best-first: scores never increase along the node order
        assert np.all(np.diff(tree.score[b, 1:]) <= 1e-6)
    # a smaller budget is a prefix of the larger tree
    small = jax.tree.map(np.asarray, build_tree(anchor, jnp.asarray(logprobs), TreeShape(6, branch, 1.0)))
    np.testing.assert_array_equal(small.tokens, tree.tokens[:, :6])
    np.testing.assert_array_equal(small.mask, tree.mask[:, :6, :6])
    # a sharpened build is the plain build on the sharpened distributions
    sharp = build_tree(anchor, jnp.asarray(logprobs), TreeShape(budget, branch, 0.5))
    plain = build_tree(anchor, jax.nn.log_softmax(jnp.asarray(logprobs) / 0.5, axis=-1), TreeShape(budget, branch, 1.0))
    np.testing.assert_array_equal(np.asarray(sharp.tokens), np.asarray(plain.tokens))
    # branch 1 is the argmax chain
    chain = jax.tree.map(np.asarray, build_tree(anchor, jnp.asarray(logprobs), TreeShape(depth + 1, 1)))
    np.testing.assert_array_equal(chain.tokens[:, 1:], np.argmax(logprobs, axis=-1))
    np.testing.assert_array_equal(chain.parent[:, 1:], np.broadcast_to(np.arange(depth), (2, depth)))


def test_accept_tree_walks_the_matching_path():
    # root 0 -> {1: tok 10, 2: tok 11}; 1 -> {3: tok 12}; 2 -> {4: tok 13, 5: tok 14}
    parent = np.array([[0, 0, 0, 1, 2, 2]])
    tokens = np.array([[99, 10, 11, 12, 13, 14]])
    depth = np.array([[0, 1, 1, 2, 2, 2]])
    mask = np.eye(6, dtype=bool)
    for t in range(1, 6):
        mask[t] |= mask[parent[0, t]]
    from dflash_jax.spec.tree import Tree

    tree = Tree(tokens=jnp.asarray(tokens), parent=jnp.asarray(parent), depth=jnp.asarray(depth),
                mask=jnp.asarray(mask[None]), score=jnp.zeros((1, 6)), valid=jnp.ones((1, 6), bool),
                rank=jnp.zeros((1, 6), jnp.int32))
    # target: after the root 11 (second branch), after node 2 14, after node 5 the bonus 7
    target = np.array([[11, 0, 14, 0, 0, 7]])
    accepted, bonus, path = accept_tree(tree, jnp.asarray(target))
    assert int(accepted[0]) == 2 and int(bonus[0]) == 7
    assert list(np.asarray(path[0, :3])) == [0, 2, 5]
    # nothing matches: the bonus is the target's token at the root
    accepted, bonus, _ = accept_tree(tree, jnp.asarray(np.array([[50, 0, 0, 0, 0, 0]])))
    assert int(accepted[0]) == 0 and int(bonus[0]) == 50
    # an invalid node is never accepted
    accepted, _, _ = accept_tree(tree.replace(valid=tree.valid.at[0, 2].set(False)), jnp.asarray(target))
    assert int(accepted[0]) == 0


# ----------------------------------------------------------------------------------------------------------
# the tree attention mask: every node's logits equal its root-to-node path run as a chain
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", [pytest.param("qwen3", marks=pytest.mark.slow), "gpt_oss", "qwen3_5"])
def test_tree_forward_equals_each_path_as_a_chain(family):
    # gpt-oss with a window of 3 < the tree depth: the window must apply among the tree's own rows too;
    # Qwen3.5: the DeltaNet layers' conv (kernel 4 < the depth 4 + 1) and state along each node's path
    cfg = {"qwen3": lambda: testing.tiny_qwen3_moe_config(num_layers=2),
           "gpt_oss": lambda: testing.tiny_gpt_oss_config(num_layers=2, layer_windows=(3, None)),
           "qwen3_5": lambda: testing.tiny_qwen3_5_config()}[family]()
    fam = family_of(cfg)
    w = fam.random_weights(cfg, jax.random.key(3))
    rng = np.random.default_rng(1)
    prompt_len, n = 9, 7
    parent = [0, 0, 0, 1, 3, 2, 4]  # depths 0 1 1 2 3 2 4
    depth = [0, 1, 1, 2, 3, 2, 4]
    mask = np.eye(n, dtype=bool)
    for t in range(1, n):
        mask[t] |= mask[parent[t]]
    tokens = rng.integers(0, cfg.vocab_size, n)
    # one row per node: the prompt, then the node's root-to-node path as a plain chain (right-padded)
    prompt = np.broadcast_to(rng.integers(0, cfg.vocab_size, prompt_len), (n, prompt_len))
    paths = np.zeros((n, max(depth) + 1), np.int32)
    lengths = mask.sum(axis=1).astype(np.int32)
    for t in range(n):
        paths[t, : lengths[t]] = tokens[mask[t]]  # ancestors in topological order = by depth

    @jax.jit
    def run(w, prompt, paths, lengths, tokens, depths, tree_mask):
        cache = fam.forward(w, prompt, fam.init_cache(cfg, n, 32, jnp.float32, verify_width=n), cfg,
                            logits="none").cache
        chains = fam.forward(w, paths, cache, cfg, num_valid=lengths, logits="last").logits
        one = jax.tree.map(lambda x: x[:1], cache)
        tree = fam.forward(w, tokens, one, cfg, logits="all", tree=TreeBlock(depths=depths, mask=tree_mask)).logits
        chain_tree = fam.forward(w, tokens, one, cfg, logits="all", tree=TreeBlock(
            depths=jnp.arange(n, dtype=jnp.int32)[None], mask=jnp.tril(jnp.ones((1, n, n), bool)))).logits
        plain = fam.forward(w, tokens, one, cfg, logits="all").logits
        return chains, tree[0], chain_tree, plain

    chains, tree, chain_tree, plain = run(w, jnp.asarray(prompt, jnp.int32), jnp.asarray(paths), jnp.asarray(lengths),
                                          jnp.asarray(tokens[None], jnp.int32), jnp.asarray([depth], jnp.int32),
                                          jnp.asarray(mask[None]))
    np.testing.assert_allclose(np.asarray(tree), np.asarray(chains), rtol=2e-5, atol=2e-5)
    # a tree that is a chain gives the plain block's logits
    np.testing.assert_allclose(np.asarray(chain_tree), np.asarray(plain), rtol=2e-5, atol=2e-5)
    # power: the same forward with every node seeing the whole block (no tree mask) differs
    assert float(jnp.abs(plain[0] - tree).max()) > 1e-3


# ----------------------------------------------------------------------------------------------------------
# lossless greedy generation
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shipped():
    return dflash_jax.load()


SHIPPED_PROMPTS = [[5, 17, 300, 41, 99, 12, 7, 8, 9, 100], list(range(40, 71))]


def test_greedy_tree_equals_plain_greedy_on_the_shipped_pair(shipped):
    pair = shipped
    n = 48
    plain = greedy_generate(pair.target, pair.target_cfg, SHIPPED_PROMPTS, max_new_tokens=n)
    chain = generate(pair, SHIPPED_PROMPTS, max_new_tokens=n)
    assert chain.tokens == plain
    result, accepted, off_chain = lossless_tree_rounds(pair, SHIPPED_PROMPTS, n, TreeShape(16, 4))
    # proposals are accepted, some of them on a branch other than the draft's argmax chain, and the tree
    # commits more tokens per round than the chain of the same draft
    assert accepted.mean() >= 3.0, accepted.mean()
    assert off_chain.sum() >= 2, off_chain.sum()
    tau_chain = np.mean([a for seq in chain.acceptance_lengths for a in seq])
    tau_tree = np.mean([a for seq in result.acceptance_lengths for a in seq])
    assert tau_tree > 1.1 * tau_chain, (tau_tree, tau_chain)
    # the chain proposed from the pair's branch head (opt-in): the same output, more tokens per round
    head_chain = generate(pair, SHIPPED_PROMPTS, max_new_tokens=n, branch_head=True)
    assert head_chain.tokens == plain
    tau_head_chain = np.mean([a for seq in head_chain.acceptance_lengths for a in seq])
    assert tau_head_chain > 1.1 * tau_chain, (tau_head_chain, tau_chain)
    # the jitted loop gives the same rounds (the head build; the calibration only scores the marginal build)
    looped = generate_tree(pair, SHIPPED_PROMPTS, max_new_tokens=n, tree_budget=16, branch=4, calibration=None)
    assert looped.tokens == plain and looped.acceptance_lengths == result.acceptance_lengths
    # the pair's branch head builds the trees: from the marginals alone the same budget commits fewer tokens
    assert pair.draft.branch_head is not None
    marginal = generate_tree(pair, SHIPPED_PROMPTS, max_new_tokens=n, tree_budget=16, branch=4, calibration=None,
                             branch_head=False)
    assert marginal.tokens == plain
    tau_marginal = np.mean([a for seq in marginal.acceptance_lengths for a in seq])
    assert tau_tree > 1.1 * tau_marginal, (tau_tree, tau_marginal)


@pytest.mark.slow
def test_adaptive_policy_is_lossless_and_follows_its_costs(shipped):
    pair = shipped
    n = 32
    prompts = SHIPPED_PROMPTS[:1]
    plain = greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=n)
    shapes = (TreeShape(4, 1), TreeShape(16, 4))
    # a free wide tree is always chosen; a prohibitively expensive one never
    cheap = generate_tree(pair, prompts, max_new_tokens=n, adaptive=AdaptivePolicy(shapes, VerifyCost((1.0, 1.0))))
    dear = generate_tree(pair, prompts, max_new_tokens=n, adaptive=AdaptivePolicy(shapes, VerifyCost((1.0, 100.0))))
    assert cheap.tokens == plain and dear.tokens == plain
    assert list(cheap.stats["adaptive_rounds"].values()) == [0, len(cheap.acceptance_lengths[0])]
    assert list(dear.stats["adaptive_rounds"].values()) == [len(dear.acceptance_lengths[0]), 0]
    assert max(dear.acceptance_lengths[0]) <= 4 < max(cheap.acceptance_lengths[0])
    # deterministic: the same request, the same rounds
    again = generate_tree(pair, prompts, max_new_tokens=n, adaptive=AdaptivePolicy(shapes, VerifyCost((1.0, 1.0))))
    assert again.acceptance_lengths == cheap.acceptance_lengths


def test_verify_cost_model():
    shapes = (TreeShape(4, 1), TreeShape(32))
    cost = VerifyCost.model(shapes, round_s=1e-3, row_s=1e-4, expert_bytes=(1e6, 4e6), link_bytes_per_s=1e9)
    np.testing.assert_allclose(cost.seconds, (1e-3 + 4e-4 + 1e-3, 1e-3 + 32e-4 + 4e-3))
    with pytest.raises(ValueError, match="2 entries for 1 shapes"):
        AdaptivePolicy(shapes[:1], cost).seconds()
    # a fit to noisy timings is monotone in the budget and exact on timings that follow the model
    four = (TreeShape(4, 1), TreeShape(8, 1), TreeShape(16, 1), TreeShape(32))
    fitted = VerifyCost.fit(four, (0.036, 0.021, 0.039, 0.086)).seconds
    assert all(a <= b for a, b in zip(fitted, fitted[1:])), fitted
    np.testing.assert_allclose(VerifyCost.fit(four, (0.014, 0.018, 0.026, 0.042)).seconds, (0.014, 0.018, 0.026, 0.042))


@pytest.mark.parametrize("family", ["gpt_oss", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_greedy_tree_equals_plain_greedy_on_random_pairs(family):
    cfg = (testing.tiny_gpt_oss_config(num_layers=2, layer_windows=(5, None)) if family == "gpt_oss"
           else testing.tiny_qwen3_moe_config(num_layers=2))
    # seeds whose chain accepts proposals (tokens per round measured 1.90 gpt-oss, 2.52 Qwen3 at B = 8)
    pair = testing.random_pair(cfg, seed=1 if family == "gpt_oss" else 0, target_layer_ids=(0, 1), block_size=8)
    rng = np.random.default_rng(2)
    prompts = [[3, 17, 42, 5, 9, 11, 7, 2], rng.integers(0, 500, 23).tolist()]
    _, accepted, _ = lossless_tree_rounds(pair, prompts, 40, TreeShape(8, 3))
    # proposals accepted (the planted agreement puts the draft's second choice far below its first, so
    # off-chain acceptance is asserted on the shipped pair and in the sampling test instead)
    assert accepted.mean() >= 0.3 and accepted.max() >= 2, accepted


def _second_choice_pair(seed: int):
    """A random Qwen3.5 pair whose draft often ranks the target's token second: the draft's final norm
    amplifies a hidden dim that the (shared) lm_head maps to tokens 7 and 9 alike (both on top when it is
    positive), and only weakly the dim that tells 7 from 9 (the target's amplifies that one strongly)."""
    import dataclasses

    pair = testing.random_pair(testing.tiny_qwen3_5_config(), seed=seed, target_layer_ids=(0, 3), block_size=8)
    head = pair.target.lm_head.at[2, :].set(0.0).at[2, 7].set(2.0).at[2, 9].set(2.0)
    norm = pair.draft.final_norm.at[2].set(30.0).at[0].set(3.0)
    return dataclasses.replace(pair, target=pair.target.replace(lm_head=head), draft=pair.draft.replace(final_norm=norm))


def test_greedy_tree_equals_plain_greedy_on_qwen3_5():
    # the hybrid DeltaNet family: per-path conv windows and delta-rule states in the verify, the accepted
    # path's rows committed and replayed; off-chain paths accepted (measured: 5 of 31 rounds, 1.13 per round)
    pair = _second_choice_pair(0)
    assert tree_supported(pair.target_cfg)
    prompts = [[3, 17, 42, 5, 9, 11, 7, 2], list(range(40, 63))]
    _, accepted, off_chain = lossless_tree_rounds(pair, prompts, 32, TreeShape(8, 3))
    assert accepted.mean() >= 0.5 and accepted.max() >= 2, accepted
    assert off_chain.sum() >= 2, off_chain


@pytest.mark.slow
def test_greedy_trees_from_a_branch_head_on_qwen3_5():
    # the head changes which paths the DeltaNet layers run; the output stays the target's
    from dflash_jax.models.draft import init_branch_head
    from dflash_jax.pair import with_branch_head

    pair = _second_choice_pair(0)
    fresh = init_branch_head(pair.draft_cfg.hidden_size, jax.random.key(1))
    pair = with_branch_head(pair, fresh.replace(w_out=jax.random.normal(jax.random.key(2), fresh.w_out.shape) * 0.05))
    prompts = [[3, 17, 42, 5, 9, 11, 7, 2], list(range(40, 63))]
    _, accepted, _ = lossless_tree_rounds(pair, prompts, 32, TreeShape(8, 3))
    assert accepted.mean() >= 0.5 and accepted.max() >= 2, accepted


@pytest.mark.slow
def test_qwen3_5_tree_loop_and_tree_wider_than_the_block():
    # the jitted loop, and a tree of 24 nodes > the block of 8 (the DeltaNet rollback width is widened)
    pair = _second_choice_pair(2)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6]]
    plain = greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=24)
    for budget, branch in ((8, 3), (24, 4)):
        result = generate_tree(pair, prompts, max_new_tokens=24, tree_budget=budget, branch=branch)
        assert result.tokens == plain, (budget, branch)
    fam = family_of(pair.target_cfg)
    cache = fam.init_cache(pair.target_cfg, 1, 16, jnp.float32, verify_width=1)
    tree = TreeBlock(depths=jnp.array([[0, 1]], jnp.int32), mask=jnp.tril(jnp.ones((1, 2, 2), bool)))
    with pytest.raises(ValueError, match="rollback width >= 2"):
        fam.forward(pair.target, jnp.zeros((1, 2), jnp.int32), cache, pair.target_cfg, tree=tree)


def test_bad_arguments(shipped):
    with pytest.raises(ValueError, match="tree_budget"):
        generate_tree(shipped, [[1, 2]], max_new_tokens=4, tree_budget=0)
    with pytest.raises(ValueError, match="branch"):
        generate_tree(shipped, [[1, 2]], max_new_tokens=4, branch=0)
    with pytest.raises(ValueError, match="'pair'"):
        generate_tree(shipped, [[1, 2]], max_new_tokens=4, calibration="shipped")


# ----------------------------------------------------------------------------------------------------------
# dflash-generate --tree-budget / --adaptive
# ----------------------------------------------------------------------------------------------------------

def _cli(capsys, *argv):
    from dflash_jax.cli.generate import main

    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("argv, message", [
    (["--tree-budget", "0"], "--tree-budget must be >= 1"),
    (["--tree-budget", "8", "--tree-branch", "0"], "--tree-branch must be >= 1"),
    (["--adaptive", "--proposer", "tree"], "contradict: pass one --proposer"),
    (["--tree-budget", "8", "--offload", "--expert-budget-mb", "1", "--loop", "jit"], "use the stepping driver"),
    (["--no-branch-head"], "--no-branch-head only applies to trees"),
    (["--head-chain", "--tree-budget", "8"], "--tree-budget applies to --proposer tree, not head-chain"),
    (["--proposer", "chain", "--tree-budget", "8"], "--tree-budget applies to --proposer tree, not chain"),
])
def test_cli_tree_flags_errors(capsys, argv, message):
    code, _, err = _cli(capsys, "--prompt-ids", "1,2,3", *argv)
    assert code == 2 and message in err, err


@pytest.mark.slow
def test_cli_tree_budget_and_adaptive_match_the_chain(capsys):
    import json

    args = ["--prompt-ids", ",".join(map(str, SHIPPED_PROMPTS[0])), "--max-new-tokens", 24, "--json"]
    code, chain, _ = _cli(capsys, *args)
    assert code == 0
    chain = json.loads(chain)
    for extra in (["--tree-budget", 16], ["--adaptive"]):
        code, out, _ = _cli(capsys, *args, *extra)
        assert code == 0
        out = json.loads(out)
        assert out["tokens"] == chain["tokens"]
        assert np.mean(out["acceptance_lengths"]) >= np.mean(chain["acceptance_lengths"])
    assert sum(out["stats"]["adaptive_rounds"].values()) == len(out["acceptance_lengths"])


def test_choose_shape_follows_acceptance_and_cost():
    from dflash_jax.spec.policy import choose_shape, prior_tokens_per_round, update_calibration

    shapes = (TreeShape(4, 1), TreeShape(16, 1), TreeShape(16, 4))
    # the model-draft prior: longer chains and trees commit more, a tree more than the chain of its width
    taus = [prior_tokens_per_round(s) for s in shapes]
    assert 1.0 < taus[0] < taus[1] < taus[2]
    policy = AdaptivePolicy(shapes, VerifyCost((1.0, 1.8, 2.0)), taus=(2.0, 4.0, 6.0))
    live = jnp.array([True, True])
    pick = lambda acc, exp: int(choose_shape(policy, jnp.asarray(acc), jnp.asarray(exp), live))  # noqa: E731
    assert pick([0.0, 0.0], [0.0, 0.0]) == 2  # calibrated as the prior: 6 / 2 > 4 / 1.8 > 2 / 1 tokens per second
    assert pick([1.0, 1.0], [20.0, 20.0]) == 0  # far below the prior: the cheap chain
    # only live sequences vote
    assert int(choose_shape(policy, jnp.array([1.0, 50.0]), jnp.array([20.0, 20.0]), jnp.array([True, False]))) == 0
    acc, exp = update_calibration(policy, jnp.zeros(2), jnp.zeros(2), 2, jnp.array([3, 7]), jnp.array([False, True]))
    np.testing.assert_allclose(np.asarray(acc), [3.0, 0.0])
    np.testing.assert_allclose(np.asarray(exp), [5.0, 0.0])
