"""Every proposer of the round in the serving engine: a token tree and the branch head's chain, verified by the
same `spec.round` the jitted loop runs. Each request's output equals the same request run alone by
`spec.generate` with that proposer (greedy: the same tokens; sampled: the same draws from the same seed), the
tree commits more tokens per verify than the chain, and nothing compiles after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

import dflash_jax

from dflash_jax.compile_cache import CompileCounter
from dflash_jax.serve.engine import Engine, generate as serve_generate
from dflash_jax.spec import SamplingParams, TreeShape
from dflash_jax.spec import generate as spec_generate
from dflash_jax.spec.round import Chain

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [7] * 12, list(range(40, 56)), [1, 2, 3, 4]]
BUDGETS = [40, 30, 48, 20, 33]
SAMPLING = [SamplingParams(), SamplingParams(temperature=0.9), SamplingParams(),
            SamplingParams(temperature=1.2, top_k=20), SamplingParams()]
SEEDS = [0, 11, 2, 33, 4]
TREE = TreeShape(16, 4)


def _served(pair, proposer, **kw):
    eng = Engine(pair, slots=4, max_prompt_len=16, max_new_tokens=64, proposer=proposer, **kw)
    eng.warmup([16])
    rounds = []
    eng.observers.append(rounds.append)
    with CompileCounter() as counter:
        reqs = serve_generate(eng, PROMPTS, max_new_tokens=BUDGETS, sampling=SAMPLING, seed=SEEDS)
    assert counter.compiles == 0
    assert all(r.compiles == 0 for r in rounds)
    _served.engine = eng
    return reqs


def _alone(pair, proposer, i):
    return spec_generate(pair, [PROMPTS[i]], max_new_tokens=BUDGETS[i], sampling=SAMPLING[i], seed=SEEDS[i],
                         proposer=proposer).tokens[0]


def _per_verify(reqs):
    greedy = [r for i, r in enumerate(reqs) if not SAMPLING[i].temperature]
    return float(np.mean([np.mean(r.acceptance) for r in greedy]))


def test_tree_proposer_serves_each_request_as_alone(pair):
    """Five requests (greedy and sampled) on four slots, every round a 16-node tree: each output equals the request
    run alone by the jitted tree loop, and the tree commits more per verify than the engine's chain of the block."""
    reqs = _served(pair, TREE)
    for i, r in enumerate(reqs):
        assert r.tokens == _alone(pair, TREE, i), i
        assert sum(r.acceptance) + 1 == len(r.tokens)
    chain = spec_generate(pair, [PROMPTS[i] for i in (0, 2, 4)], max_new_tokens=[BUDGETS[i] for i in (0, 2, 4)])
    chain_per_verify = float(np.mean([np.mean(a) for a in chain.acceptance_lengths]))
    assert _per_verify(reqs) > chain_per_verify > 1.3
    _tree_logprobs_equal_a_plain_forward(_served.engine, pair)


def _tree_logprobs_equal_a_plain_forward(eng, pair):
    """The tree engine's log-probs: each committed token's is the target's log_softmax at its parent node on the
    committed path, equal to one plain forward over the final sequence (and nothing compiles: warmed up)."""
    from tests.serve.logprob_checks import plain_log_softmax, tolerance

    prompt = PROMPTS[0]
    with CompileCounter() as counter:
        req = eng.submit(prompt, max_new_tokens=40, logprobs=2)
        other = eng.submit(PROMPTS[2], max_new_tokens=30, sampling=SamplingParams(temperature=0.9), logprobs=1,
                           seed=5)
        eng.run_until_idle()
    assert counter.compiles == 0
    assert max(req.acceptance) > 2  # the tree committed several tokens per verify
    for r, p in ((req, prompt), (other, PROMPTS[2])):
        seq = p + r.tokens
        ref = plain_log_softmax(pair, seq)
        n = len(p)
        assert len(r.token_logprobs) == len(r.tokens)
        np.testing.assert_allclose(r.token_logprobs, ref[np.arange(n - 1, len(seq) - 1), seq[n:]],
                                   atol=tolerance(pair))
    for i, top in enumerate(req.top_logprobs):
        row = plain_log_softmax(pair, prompt + req.tokens)[len(prompt) - 1 + i]
        assert top[0][0] == int(np.argmax(row)) == req.tokens[i]


@pytest.mark.slow
def test_head_chain_proposer_serves_each_request_as_alone(pair):
    """The branch head's chain at the engine's chosen widths: outputs equal the head chain run alone at the block
    (greedy) and proposals were accepted."""
    reqs = _served(pair, "head-chain")
    for i, r in enumerate(reqs):
        if SAMPLING[i].temperature:
            continue  # sampled: the engine's widths change the draws; greedy outputs are the target's at any width
        assert r.tokens == _alone(pair, Chain(head=True), i), i
    assert _per_verify(reqs) > 1.3


@pytest.mark.slow
def test_adaptive_engine_mixes_trees_and_chains(pair):
    """`proposer=TREE, widths="auto"`: the tree is one more shape the chooser prices beside the chain widths (the
    same acceptance model, `spec.policy.expected_tokens`). Rounds forced through every shape, and then left to the
    chooser: greedy outputs equal each request alone, every shape ran, nothing compiled after warm-up."""
    import itertools

    # calls of at most 4 rounds: enough steps that the forced cycle reaches every shape before the requests end
    eng = Engine(pair, slots=4, max_prompt_len=16, max_new_tokens=64, proposer=TREE, widths="auto",
                 row_buckets=None, rounds_per_call=4)
    assert eng.widths[-1] == TREE and 1 in eng.widths and len(eng.widths) >= 4
    eng.warmup([16])
    greedy = [i for i in range(len(PROMPTS)) if not SAMPLING[i].temperature]
    cycle = itertools.cycle([TREE] + list(eng.widths) + [TREE])
    chooser = eng.choose_width
    eng.choose_width = lambda live: next(cycle)
    rounds = []
    eng.observers.append(rounds.append)
    with CompileCounter() as counter:
        reqs = serve_generate(eng, [PROMPTS[i] for i in greedy], max_new_tokens=[BUDGETS[i] for i in greedy])
    assert counter.compiles == 0
    assert {r.width for r in rounds if r.width} == set(eng.widths)
    for i, r in zip(greedy, reqs):
        assert r.tokens == _alone(pair, TREE, i), i
    eng.choose_width = chooser  # the chooser's own picks: still the requests' tokens
    reqs = serve_generate(eng, [PROMPTS[i] for i in greedy], max_new_tokens=[BUDGETS[i] for i in greedy])
    for i, r in zip(greedy, reqs):
        assert r.tokens == _alone(pair, TREE, i), i
    assert eng.width_rounds[TREE] > 0


def test_engine_refuses_bad_proposers(pair):
    with pytest.raises(ValueError, match="proposer must be"):
        Engine(pair, proposer="forest")
    with pytest.raises(ValueError, match="widths are chain widths"):
        Engine(pair, widths=[2, TREE])
    with pytest.raises(ValueError, match="chain of width 4"):
        Engine(pair, proposer=TreeShape(4, 1))


@pytest.mark.slow
def test_offloaded_engine_serves_trees(pair):
    """The offloaded engine (experts in host memory, a device cache of the smallest budget that runs) verifies the
    same trees, layer by layer: each greedy output equals the resident tree loop's, more per verify than a chain."""
    from dflash_jax.offload import HostExpertStore, min_budget_bytes
    offloaded = dflash_jax.load(expert_memory="pinned_host")
    store = HostExpertStore(offloaded.target)
    eng = Engine(offloaded, experts="offload", budget_bytes=min_budget_bytes(store), slots=2, max_prompt_len=16,
                 max_new_tokens=64, store=store, bandwidth=1e9, proposer=TREE)
    eng.warmup([16])
    greedy = [i for i in range(len(PROMPTS)) if not SAMPLING[i].temperature]
    reqs = serve_generate(eng, [PROMPTS[i] for i in greedy], max_new_tokens=[BUDGETS[i] for i in greedy])
    for i, r in zip(greedy, reqs):
        assert r.tokens == _alone(pair, TREE, i), i
    assert float(np.mean([np.mean(r.acceptance) for r in reqs])) > 2.0
    assert eng.runner.offload_summary()["moved_bytes"] > 0
