"""Token trees in the offloaded loop (`offload.loop.OffloadedGenerator(tree=)`): with the target's experts in
host memory and a poisoned device cache (reading a non-resident expert wrecks the output), tree-verified
generation equals the resident tree loop round for round and plain greedy token for token, at a budget below
one verify's routed union (layers run in passes, experts fetched on demand and by route-ahead from each
node's draft hidden state) and at a budget that holds every expert (one program)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import dflash_jax
from dflash_jax.decode import greedy_generate
from dflash_jax.offload import ExpertCache, HostExpertStore, OffloadedGenerator
from dflash_jax.spec.loop import generate_tree_stepping
from dflash_jax.spec.tree import TreeShape

POISONED = functools.partial(ExpertCache, poison=True)
PROMPTS = [[5, 17, 300, 41, 99, 12, 7, 8, 9, 100]]
NEW = 24
SHAPE = TreeShape(16, 4)


@pytest.fixture(scope="module")
def shipped():
    pair = dflash_jax.load()
    store = HostExpertStore(pair.target)
    resident, rounds = generate_tree_stepping(pair, PROMPTS, max_new_tokens=NEW, shape=SHAPE)
    assert resident.tokens == greedy_generate(pair.target, pair.target_cfg, PROMPTS, max_new_tokens=NEW)
    return pair, store, resident, rounds


def _offloaded(pair, store, budget, **kw):
    kw.setdefault("tree", SHAPE)
    gen = OffloadedGenerator(pair, budget_bytes=budget, store=store, pool_factory=POISONED, bandwidth=1e9, **kw)
    return gen.generate(PROMPTS, max_new_tokens=NEW)


def test_offloaded_tree_is_lossless_below_one_verifys_union(shipped):
    pair, store, resident, rounds = shipped
    # off-chain paths accepted in the resident rounds this run reproduces
    assert sum(int(r["off_chain"][0]) for r in rounds) >= 1
    budget = 3 * store.expert_bytes(store.layer_ids[0])  # 3 of 8 experts: a 16-node verify routes to more
    got = _offloaded(pair, store, budget, prefetcher="draft_router", pin=False)
    assert got.tokens == resident.tokens and got.acceptance_lengths == resident.acceptance_lengths
    summary = got.stats["route_ahead"]["summary"]
    assert got.stats["tree"] == {"budget": 16, "branch": 4}
    assert summary["bytes_moved"] > 0
    assert max(s.passes for r in got.route_ahead.rounds for s in r.layers) >= 2  # unions wider than the cache


@pytest.mark.slow
def test_offloaded_tree_with_every_expert_resident_runs_one_program(shipped):
    pair, store, resident, _ = shipped
    got = _offloaded(pair, store, store.total_bytes)
    assert got.stats["offload"]["verify"] == "single"
    assert got.tokens == resident.tokens and got.acceptance_lengths == resident.acceptance_lengths


@pytest.mark.slow
def test_offloaded_adaptive_policy_is_lossless(shipped):
    # the shape chosen per round on the host (chains at their own width, trees), below all experts
    from dflash_jax.spec.policy import AdaptivePolicy, VerifyCost

    pair, store, resident, _ = shipped
    shapes = (TreeShape(4, 1), SHAPE)
    # a prior that starts on the tree and a cost that makes the chain win once the tree's acceptance falls
    # below its prior (the chain's acceptance above its own brings the tree back): both shapes run
    policy = AdaptivePolicy(shapes, VerifyCost((1.0, 3.0)), taus=(2.5, 8.0), decay=0.5)
    budget = 3 * store.expert_bytes(store.layer_ids[0])
    got = _offloaded(pair, store, budget, tree=policy, pin=False)
    assert got.tokens == resident.tokens
    chosen = got.stats["adaptive_rounds"]
    assert sum(chosen.values()) == len(got.acceptance_lengths[0]) and min(chosen.values()) >= 1, chosen
