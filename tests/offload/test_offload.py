"""Host-offloaded experts: stats arithmetic, placement, cache eviction, the layer-wise forward's exactness
and residency invariant, predictors, and lossless offloaded generation (B1/B2/B3) on a tiny random pair."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import testing
from dflash_jax.config import MoEConfig
from dflash_jax.models import qwen3
from dflash_jax.offload import (
    ExpertCache, HostExpertStore, OffloadedGenerator, PoolTooSmall, RoundStats, RouteAheadStats, TraceObserver,
    generate_offloaded, make_predictor,
)
from dflash_jax.offload.forward import ExpertOperands, NonResidentExpert, forward_layerwise
from dflash_jax.offload.placement import plan_placement, warm_set
from dflash_jax.offload.predictors import (
    DraftRouter, NextLayerResidual, PreviousRound, RoundInputs, Union, in_verify_part, ranked_union,
)
from dflash_jax.offload.stats import layer_round_stats
from dflash_jax.offload.store import strip_experts
from dflash_jax.spec import SamplingParams, generate, generate_stepping

E = 16
# the offloaded runs' caches: free slots and a trap slot hold blow-up values, so reading a non-resident expert
# wrecks the output (`ExpertCache(poison=True)`)
POISONED = functools.partial(ExpertCache, poison=True)
CFG = testing.tiny_qwen3_moe_config(
    num_layers=3, moe=MoEConfig(num_experts=E, top_k=2, intermediate_size=32, norm_topk_prob=True))


# ---- stats -----------------------------------------------------------------------------------------------
def test_layer_stats_arithmetic():
    s = layer_round_stats(0, predicted=[1, 2, 3, 4], routed=[3, 4, 5, 3], resident=[4, 5, 9], prefetched=[1, 3],
                          expert_bytes=10)
    assert (s.predicted, s.routed, s.covered, s.wasted, s.hits, s.on_demand, s.prefetched) == (4, 3, 2, 2, 2, 1, 2)
    assert s.coverage == 2 / 3 and s.waste == 0.5 and s.hit_rate == 2 / 3 and s.bytes_moved == 30
    empty = layer_round_stats(1, predicted=[], routed=[], resident=[])
    assert (empty.coverage, empty.waste, empty.hit_rate, empty.bytes_moved) == (1.0, 0.0, 1.0, 0)


def test_round_and_run_stats_are_expert_weighted():
    a = layer_round_stats(0, predicted=[1, 2], routed=[1], resident=[1], expert_bytes=100)  # cov 1, waste 1/2
    b = layer_round_stats(1, predicted=[7], routed=[5, 6, 7], resident=[7], prefetched=[7], expert_bytes=10)
    r = RoundStats(round=0, layers=[a, b], draft_s=0.1, verify_s=0.2, hide_window_s=0.25, bandwidth=100.0)
    t = r.totals()
    assert t["covered"] == 2 and t["routed"] == 4 and t["coverage"] == 0.5
    assert t["wasted"] == 1 and t["predicted"] == 3 and t["waste"] == 1 / 3
    assert t["covered_bytes"] == 110 and t["routed_bytes"] == 130 and t["coverage_bytes"] == 110 / 130
    assert t["wasted_bytes"] == 100 and t["waste_bytes"] == 100 / 210
    assert t["hits"] == 2 and t["hit_rate"] == 0.5 and t["on_demand"] == 2
    assert t["prefetched_bytes"] == 10 and t["on_demand_bytes"] == 20 and t["bytes_moved"] == 30
    assert t["prefetch_transfer_s"] == 0.1 and t["on_demand_transfer_s"] == 0.2
    assert t["exposed_transfer_s"] == pytest.approx(0.2)  # the prefetch (0.1 s) hides in the 0.25 s window
    slow = RoundStats(round=1, layers=[b], hide_window_s=0.04, bandwidth=100.0).totals()
    assert slow["exposed_transfer_s"] == pytest.approx(0.06 + 0.2)
    run = RouteAheadStats([r, RoundStats(round=1, layers=[b], bandwidth=100.0)])
    summary = run.summary()
    assert summary["routed"] == 7 and summary["covered"] == 3 and summary["coverage"] == 3 / 7
    assert summary["rounds"] == 2 and summary["bytes_moved"] == 60
    assert run.per_layer()[1]["coverage"] == 1 / 3


def test_in_verify_prefetch_hides_behind_its_layer_window_only():
    """In-verify prefetches count as predicted / prefetched for the layer they target; their transfer hides only
    behind that layer's one-layer window, the before-verify part behind the round's window."""
    a = layer_round_stats(0, predicted=[1, 2], routed=[1, 3], resident=[1, 2], prefetched=[2], expert_bytes=10)
    b = layer_round_stats(1, predicted=[4, 5, 6], routed=[4, 5], resident=[4, 5, 6], prefetched=[4],
                          prefetched_in_verify=[5, 6], in_verify_window_s=0.1, expert_bytes=10)
    assert (b.predicted, b.covered, b.wasted, b.hits, b.on_demand) == (3, 2, 1, 2, 0)
    assert b.prefetched == 3 and b.prefetched_in_verify == 2 and b.bytes_moved == 30  # in-verify is part of it
    t = RoundStats(round=0, layers=[a, b], hide_window_s=0.5, bandwidth=100.0).totals()
    assert t["prefetched"] == 4 and t["prefetched_in_verify"] == 2 and t["prefetched_in_verify_bytes"] == 20
    assert t["prefetch_transfer_s"] == pytest.approx(0.4) and t["in_verify_prefetch_transfer_s"] == pytest.approx(0.2)
    assert t["in_verify_window_s"] == pytest.approx(0.1)
    # early 0.2 s hides in the 0.5 s round window; late 0.2 s against a 0.1 s layer window: 0.1 exposed;
    # on demand: expert 3 of layer 0 (0.1 s)
    assert t["exposed_transfer_s"] == pytest.approx(0.1 + 0.1)
    assert t["coverage"] == 3 / 4 and t["waste"] == 2 / 5
    summary = RouteAheadStats([RoundStats(round=0, layers=[a, b], hide_window_s=0.5, bandwidth=100.0)]).summary()
    assert summary["prefetched_in_verify"] == 2 and summary["in_verify_window_s"] == pytest.approx(0.1)
    assert summary["exposed_transfer_s"] == pytest.approx(0.2)


# ---- placement and predictors ------------------------------------------------------------------------------
def test_placement_pins_the_hottest_under_the_budget():
    profile = {0: np.array([5, 0, 5, 1]), 3: np.array([0, 2, 1, 9])}
    pinned = plan_placement(profile, slots=3, reserve=1)
    assert pinned[0].tolist() == [0, 2] and pinned[3].tolist() == [1, 3]
    assert plan_placement(profile, slots=4, reserve=4)[0].tolist() == [0, 1, 2, 3]  # S >= E: everything
    assert plan_placement(profile, slots=2, reserve=2)[0].tolist() == []
    assert warm_set(profile, 2)[3].tolist() == [1, 3]


def test_predictor_rankings():
    assert ranked_union(np.array([[3, 1], [1, 2], [3, 1]])).tolist() == [1, 3, 2]
    assert ranked_union(np.array([[3, 1]]), np.array([[0.2, 0.8]])).tolist() == [1, 3]
    inputs = RoundInputs(round=1, layers=(0,), top_k=2, previous_routed={0: np.array([[4, 2], [4, 6]])},
                         previous_logits={0: np.log(np.array([[0.1, 0.2, 0.3, 0.05, 0.35]]))})
    assert PreviousRound().predict(inputs)[0].tolist() == [4, 2, 6]
    assert PreviousRound(width=3).predict(inputs)[0].tolist() == [4, 2, 1]
    assert PreviousRound().predict(RoundInputs(round=0, layers=(0,), top_k=2)) == {}

    class Fixed:
        needs_draft, name = False, "fixed"

        def __init__(self, ids):
            self.ids = ids

        def predict(self, inputs):
            return {0: np.array(self.ids)}

    assert Union(Fixed([1, 2, 3]), Fixed([2, 5])).predict(inputs)[0].tolist() == [1, 2, 5, 3]
    # the in-verify predictor predicts nothing before the verify; unions expose it to the loop
    residual = NextLayerResidual(width=3)
    assert residual.predict(inputs) == {} and not residual.needs_draft and in_verify_part(residual) is residual
    both = make_predictor("previous+residual", None, CFG)
    assert isinstance(both, Union) and both.in_verify and not both.needs_draft
    assert both.predict(inputs)[0].tolist() == [4, 2, 6] and isinstance(in_verify_part(both), NextLayerResidual)
    assert in_verify_part(make_predictor("previous", None, CFG)) is None
    assert residual.rank(np.array([[3, 1], [1, 2]]), np.array([[0.6, 0.3], [0.5, 0.4]])).tolist() == [1, 3, 2]
    assert residual.from_logits(np.log(np.array([[0.1, 0.2, 0.3, 0.05, 0.35]])), 2).tolist() == [4, 2, 1]
    with pytest.raises(ValueError, match="unknown predictor"):
        make_predictor("residual+residual", None, CFG)


def test_draft_router_applies_each_layers_router():
    weights = testing.random_qwen3_weights(CFG, jax.random.key(3))
    hidden = jax.random.normal(jax.random.key(4), (2, 4, CFG.hidden_size))
    pred = DraftRouter(weights, CFG, width=3).predict(
        RoundInputs(round=0, layers=(0, 1, 2), top_k=2, draft_hidden=hidden))
    for layer in range(CFG.num_layers):
        h = qwen3.rms_norm(hidden.reshape(-1, CFG.hidden_size), weights.layers[layer].post_norm, CFG.rms_norm_eps)
        probs = jax.nn.softmax(h @ weights.layers[layer].mlp.router, axis=-1)
        top = np.asarray(jax.lax.top_k(probs, 3)[1])
        assert set(pred[layer].tolist()) == set(top.reshape(-1).tolist())


# ---- the expert cache -----------------------------------------------------------------------------------------
def _rows(cache, layer, expert):
    """The cache's copy of `layer`'s expert `expert`: its row of every per-expert leaf of the layer's slab."""
    slot = cache.layers[layer].slot_of[expert]
    return [np.asarray(leaf)[slot] for leaf in cache.slabs[cache.layers[layer].slab].leaves]


def _host_rows(store, layer, expert):
    le = store.layers[layer]
    return [np.asarray(t)[expert] for t, i in zip(le.leaves, le.per_expert) if i]


@pytest.mark.parametrize("expert_format", ["dense", "mxfp4", "nvfp4"])
def test_cache_holds_the_stores_rows_and_evicts_by_rule(expert_format):
    weights = testing.random_qwen3_weights(CFG, jax.random.key(0))
    if expert_format != "dense":
        weights = testing.quantize_experts(weights, expert_format)
    store = HostExpertStore(weights)
    assert all(store.layers[0].leaves[j].sharding.memory_kind == "pinned_host"
               for j, i in enumerate(store.layers[0].per_expert) if i)
    cache = ExpertCache(store, 3 * store.expert_bytes(0), pinned={0: [0]}, poison=True)  # 3 slots, one pinned
    assert cache.slots == 3
    cache.fetch(0, [1, 2])
    assert np.flatnonzero(cache.resident(0)).tolist() == [0, 1, 2]
    for e in (0, 1, 2):
        for got, want in zip(_rows(cache, 0, e), _host_rows(store, 0, e)):
            np.testing.assert_array_equal(got, want)
    cache.touch(0, [1])
    cache.advance()
    cache.touch(0, [1, 2])  # expert 1 used twice, expert 2 once: 2 has the lower CRF score
    cache.fetch(0, [3])
    assert np.flatnonzero(cache.resident(0)).tolist() == [0, 1, 3]  # pinned 0 stays, 2 leaves
    np.testing.assert_array_equal(_rows(cache, 0, 3)[0], _host_rows(store, 0, 3)[0])
    cache.fetch(0, [4], protect=[1])
    assert np.flatnonzero(cache.resident(0)).tolist() == [0, 1, 4]
    with pytest.raises(PoolTooSmall, match="raise the expert budget"):
        cache.fetch(0, [5, 6, 7])  # three unpinned experts at once, two unpinned slots
    moved = cache.prefetch(0, [9, 8, 7], protect=[1])  # room for one: the most likely
    assert moved.experts.tolist() == [9] and cache.resident(0)[[0, 1, 9]].all()
    assert cache.slot_table(0).shape == (E,) and int(cache.slot_table(0)[5]) == 3  # sentinel = N (the trap row)


# ---- the layer-wise forward --------------------------------------------------------------------------------
def _cache_provider(cache, record=None):
    def provide(layer, experts):
        cache.fetch(layer, experts)
        if record is not None:
            record[layer] = np.unique(experts)
        return ExpertOperands(cache.operands(layer), cache.slot_table(layer), cache.resident(layer))
    return provide


@pytest.mark.parametrize("expert_format", ["dense", "mxfp4"])
def test_layerwise_forward_equals_resident_and_reads_only_resident_experts(expert_format):
    weights = testing.random_qwen3_weights(CFG, jax.random.key(0))
    if expert_format != "dense":
        weights = testing.quantize_experts(weights, expert_format)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 24)), jnp.int32)
    prompt_out = qwen3.forward_jit(weights, tokens, qwen3.init_cache(CFG, 2, 40), CFG)
    block = jnp.asarray([[5, 6, 7, 8], [9, 10, 11, 12]], jnp.int32)
    want = qwen3.forward_jit(weights, block, prompt_out.cache, CFG, tap_layers=(0, 2))
    store = HostExpertStore(weights)
    # every expert of every layer fits; filled in routing order, layer after layer: slot != expert id
    expert_cache = POISONED(store, store.total_bytes)
    got = forward_layerwise(strip_experts(weights), block, prompt_out.cache, CFG,
                            provider=_cache_provider(expert_cache), tap_layers=(0, 2))
    # Same math; fp32 sums may associate differently: XLA's CPU ragged_dot is one dense dot over all slots'
    # [N * K] contraction, so an expert's position in the slab changes the blocking of its sum (~1e-6).
    tol = dict(rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got.out.logits), np.asarray(want.logits), **tol)
    for a, b in zip(got.out.taps, want.taps):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)
    np.testing.assert_allclose(np.asarray(got.out.cache.keys[2]), np.asarray(want.cache.keys[2]), **tol)
    for layer in range(CFG.num_layers):
        np.testing.assert_array_equal(got.routed[layer], np.asarray(want.router_experts[layer]).reshape(-1, 2))

    # A provider that does not fetch is caught before the expert GEMM runs ...
    empty = POISONED(store, store.total_bytes)

    def lazy(layer, experts):
        return ExpertOperands(empty.operands(layer), empty.slot_table(layer), empty.resident(layer))

    with pytest.raises(NonResidentExpert):
        forward_layerwise(strip_experts(weights), block, prompt_out.cache, CFG, provider=lazy)

    # ... and a provider that lies about residency computes on poison: the trap makes the output blow up,
    # so the equality above really means no non-resident expert was read.
    def lying(layer, experts):
        return ExpertOperands(empty.operands(layer), empty.slot_table(layer), np.ones(E, bool))

    bad = forward_layerwise(strip_experts(weights), block, prompt_out.cache, CFG, provider=lying)
    logits = np.asarray(bad.out.logits)
    assert not np.isfinite(logits).all() or np.abs(logits - np.asarray(want.logits)).max() > 1e3


def test_in_verify_prediction_is_the_next_router_on_the_residual():
    """Layer i+1's in-verify prediction = layer i+1's post-attention norm and router applied to layer i's
    post-attention residual (checked by hand with the model's own pieces), each row's top-`width`; read with
    layer i's routing and handed to the hook before layer i's experts ran; none for the first MoE layer."""
    weights = testing.random_qwen3_weights(CFG, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 24)), jnp.int32)
    cache = qwen3.forward_jit(weights, tokens, qwen3.init_cache(CFG, 2, 40), CFG).cache
    block = jnp.asarray([[5, 6, 7, 8], [9, 10, 11, 12]], jnp.int32)
    store = HostExpertStore(weights)
    expert_cache = ExpertCache(store, store.total_bytes)
    calls = []
    seen = {}

    def provide(layer, experts):
        calls.append(("provider", layer))
        return _cache_provider(expert_cache)(layer, experts)

    def hook(layer, experts, probs):
        calls.append(("ahead", layer))
        seen[layer] = (experts, probs)

    got = forward_layerwise(strip_experts(weights), block, cache, CFG, provider=provide, ahead=hook, ahead_width=3)
    assert calls == [("provider", 0), ("ahead", 1), ("provider", 1), ("ahead", 2), ("provider", 2)]
    assert sorted(got.ahead) == [1, 2] and all(seen[j][0].shape == (8, 3) for j in (1, 2))
    # by hand: the resident model's pieces, layer by layer
    x, ctx = qwen3.block_context(weights, block, cache, CFG)
    for i, lw in enumerate(weights.layers):
        x, _, _ = qwen3.attention_sublayer(lw, x, cache.keys[i], cache.values[i], ctx, CFG.layer_windows[i], CFG)
        if i + 1 < CFG.num_layers:
            nxt = weights.layers[i + 1]
            logits = qwen3.mlp_input(nxt, x, CFG) @ nxt.mlp.router  # the residual x, layer i+1's norm
            probs, top = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), 3)
            np.testing.assert_array_equal(seen[i + 1][0], np.asarray(top))
            np.testing.assert_allclose(seen[i + 1][1], np.asarray(probs), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.asarray(got.ahead_logits[i + 1]), np.asarray(logits), rtol=1e-5, atol=1e-5)
        x = qwen3.mlp_sublayer(lw, x, qwen3.mlp_input(lw, x, CFG), CFG)
    # and without the hook the forward is unchanged (no prediction computed)
    plain = forward_layerwise(strip_experts(weights), block, cache, CFG, provider=_cache_provider(expert_cache))
    assert plain.ahead == {} and plain.ahead_logits == {}
    np.testing.assert_array_equal(np.asarray(plain.out.logits), np.asarray(got.out.logits))


# ---- offloaded generation: lossless for every budget and predictor ---------------------------------------------
@pytest.fixture(scope="module")
def pair():
    return testing.random_pair(CFG)


PROMPTS = [np.random.default_rng(i).integers(0, 500, n).tolist() for i, n in enumerate((40, 23))]
PREDICTORS = ["none", "previous", "draft_router", "previous+draft_router", "residual", "previous+residual"]


def _per_slot(pair):
    """(bytes of one expert of every MoE layer, the store): `k * per_slot` buys k experts per layer on average."""
    store = HostExpertStore(pair.target)
    return sum(store.expert_bytes(layer) for layer in store.layer_ids), store


def _budgets(store, smallest):
    """Expert-cache budgets in bytes, by name: one expert (every layer in passes of one expert), one expert less
    than one layer's routed union (the largest layer runs in two passes), one union, a mid one."""
    eb = store.expert_bytes(store.layer_ids[0])
    layers = len(store.layer_ids)
    return {"min": eb, "below_union": (smallest - 1) * eb, "union": smallest * eb,
            "mid": (smallest + E) // 2 * layers * eb}


# (budget, predictors) of the fast set: each predictor at least once, the passes budgets with prefetch
FAST = {1: {"min": ["none"], "mid": ["previous"]},
        4: {"min": ["none", "previous+residual"], "below_union": ["previous"], "union": ["draft_router", "residual"],
            "mid": ["previous+draft_router"]}}


@pytest.mark.parametrize("block, everything", [(1, False), (4, False), pytest.param(1, True, marks=pytest.mark.slow),
                                                pytest.param(4, True, marks=pytest.mark.slow)])
def test_offloaded_generation_is_lossless_for_every_budget_and_predictor(pair, block, everything):
    """Budgets: one expert (every layer in passes), one layer's routed union less one (passes), one union, a mid
    one, all experts; poisoned cache. The fast set runs each predictor somewhere, the slow one everywhere."""
    want = generate(pair, PROMPTS, max_new_tokens=20, block_size=block)
    if block > 1:
        assert want.stats["mean_acceptance"] > 1.5  # proposals get accepted: rollback paths run
    per_slot, store = _per_slot(pair)
    full = generate_offloaded(pair, PROMPTS, budget_bytes=E * per_slot, block_size=block, max_new_tokens=20,
                              store=store, pool_factory=POISONED, bandwidth=1e9)
    assert full.tokens == want.tokens
    assert full.stats["route_ahead"]["summary"]["bytes_moved"] == 0  # everything pinned: B0 residency
    # one layer's largest routed union in one block: below it that layer must run in passes
    smallest = max(s.routed for r in full.route_ahead.rounds for s in r.layers)
    with pytest.raises(PoolTooSmall, match="minimum"):
        generate_offloaded(pair, PROMPTS, budget_bytes=store.expert_bytes(0) - 1, block_size=block,
                           max_new_tokens=20, store=store, bandwidth=1e9)
    for label, budget in _budgets(store, smallest).items():
        names = (PREDICTORS if block > 1 else ["none", "previous"]) if everything else FAST[block].get(label, [])
        for name in names:
            got = generate_offloaded(pair, PROMPTS, budget_bytes=budget, predictor=name, block_size=block,
                                     max_new_tokens=20, store=store, pool_factory=POISONED, bandwidth=1e9)
            assert got.tokens == want.tokens, (label, name)
            assert got.acceptance_lengths == want.acceptance_lengths
            summary = got.stats["route_ahead"]["summary"]
            assert got.stats["offload"]["pool_bytes"] <= budget
            assert summary["on_demand"] + summary["prefetched"] > 0  # the cache really was too small to hold all
            if label in ("min", "below_union"):  # some layer ran in passes
                assert summary["passes"] > summary["rounds"] * CFG.num_layers, (label, name)
            if name == "none":
                assert summary["predicted"] == 0 and summary["prefetched"] == 0
            if name == "residual":  # predicts only inside the verify, for every MoE layer but the first
                assert summary["predicted"] > 0 and summary["prefetched"] == summary["prefetched_in_verify"]
                assert got.route_ahead.per_layer()[0]["predicted"] == 0
    for name in (("previous", "draft_router+residual") if block > 1 else ("previous",)) if everything else ():
        wide = generate_offloaded(pair, PROMPTS, budget_bytes=smallest * store.expert_bytes(0), predictor=name, width=4,
                                  block_size=block, max_new_tokens=20, store=store, pool_factory=POISONED,
                                  bandwidth=1e9)
        assert wide.tokens == want.tokens, name


class _Recorder:
    def __init__(self):
        self.rounds = []

    def on_round(self, stats):
        self.rounds.append(stats)


def test_generator_rounds_observers_and_trace(pair):
    """The object API: `prefill` + `round` until done = `generate` = the resident run; every round's `RoundStats`
    reaches the generator's and the request's observers; the trace equals the resident stepping loop's (the
    offloaded rounds propose, accept and emit the same tokens) and counts each round's bytes moved."""
    per_slot, store = _per_slot(pair)
    everywhere = _Recorder()
    gen = OffloadedGenerator(pair, budget_bytes=(3 * E // 4) * per_slot, prefetcher="previous+residual",
                             block_size=4, store=store, pool_factory=POISONED, bandwidth=1e9, observers=[everywhere])
    want = generate_stepping(pair, PROMPTS, max_new_tokens=20, block_size=4, trace=True)
    mine = _Recorder()
    got = gen.generate(PROMPTS, max_new_tokens=20, trace=True, observers=[mine])
    assert got.tokens == want.tokens and got.acceptance_lengths == want.acceptance_lengths
    offload_keys = ("bytes_moved", "hits", "misses", "on_demand", "host", "prefetched", "coverage", "passes")
    assert [[None if r is None else {k: v for k, v in r.items() if k not in offload_keys} for r in rnd]
            for rnd in got.trace] == want.trace
    for rnd, stats in zip(got.trace, mine.rounds):  # the round's offload counts, in every live row
        t = stats.totals()
        assert all(r is None or (r["hits"], r["misses"], r["passes"]) == (t["hits"], t["routed"] - t["hits"],
                                                                         t["passes"]) for r in rnd)
    assert len(mine.rounds) == got.stats["rounds"] == len(got.route_ahead.rounds)
    assert all(a is b for a, b in zip(mine.rounds, got.route_ahead.rounds))
    moved = [r.bytes_moved for r in mine.rounds]
    assert [rnd[0]["bytes_moved"] for rnd in got.trace] == moved and sum(moved) > 0
    assert sum(moved) == got.stats["route_ahead"]["summary"]["bytes_moved"]
    for i, tokens in enumerate(got.tokens):  # the rounds' emitted tokens make up the output after the first
        emitted = [t for r in mine.rounds if r.tokens.live[i] for t in r.tokens.emitted[i]]
        assert [tokens[0]] + emitted == tokens

    session = gen.prefill(PROMPTS, max_new_tokens=20)
    assert session.rounds == 0 and not session.done
    while not session.done:
        stats = gen.round(session)
        assert stats.round == session.rounds - 1 and len(stats.layers) == CFG.num_layers
    stepped = gen.result(session)
    assert stepped.tokens == want.tokens and stepped.acceptance_lengths == want.acceptance_lengths
    assert stepped.trace is None and len(session.route_ahead.rounds) == stepped.stats["rounds"]
    assert len(everywhere.rounds) == 2 * stepped.stats["rounds"]  # the generator's observer saw both requests
    with pytest.raises(ValueError, match="finished"):
        gen.round(session)


def test_generator_policy_errors(pair):
    per_slot, store = _per_slot(pair)
    with pytest.raises(ValueError, match="verify='single' needs every expert pinned"):
        OffloadedGenerator(pair, budget_bytes=(E - 1) * per_slot, verify="single", store=store, bandwidth=1e9)
    with pytest.raises(ValueError, match="verify must be one of"):
        OffloadedGenerator(pair, budget_bytes=E * per_slot, verify="fast", store=store, bandwidth=1e9)
    with pytest.raises(PoolTooSmall, match=r"minimum of 0\.\d+ MB"):
        OffloadedGenerator(pair, budget_bytes=store.expert_bytes(0) - 1, store=store, bandwidth=1e9)
    for moved, hint in (("poison", "pool_factory"), ("warmup", "twice"), ("single_program_when_full", "verify")):
        with pytest.raises(TypeError, match=hint):
            generate_offloaded(pair, PROMPTS, budget_bytes=E * per_slot, max_new_tokens=4, **{moved: True})


def test_one_generator_serves_requests_without_recompiling(pair):
    """Requests with other prompt lengths (same bucket), token budgets, sampling settings, stop ids and seeds
    through one `OffloadedGenerator` run the programs the first request compiled: the only compiles of a later
    request are pool row copies of a chunk size not copied before (`store.pull_rows`, at most log2(S) + 1 sizes).
    Each request equals its resident run (a sampled sequence included: same keys, same draws)."""
    from dflash_jax.compile_cache import CompileCounter
    from dflash_jax.offload.store import pull_rows

    with CompileCounter() as probe:  # the counter sees a compile
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(5))
    assert probe.compiles >= 1
    per_slot, store = _per_slot(pair)
    rng = np.random.default_rng(9)
    later = [rng.integers(0, 500, n).tolist() for n in (33, 45)]  # the prompt bucket of PROMPTS (40, 23)
    sampled = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20)]
    free = generate(pair, later, max_new_tokens=[30, 12], block_size=4, sampling=sampled, seed=[3, 4])
    stop = free.tokens[0][6]  # a stop id the first sequence meets
    request = dict(max_new_tokens=[30, 12], sampling=sampled, stop_ids=[[stop], []], seed=[3, 4])
    want = generate(pair, later, block_size=4, **request)
    assert len(want.tokens[0]) < 30 and want.tokens[0][-1] == stop and len(want.tokens[1]) == 12
    first_want = generate(pair, PROMPTS, max_new_tokens=20, block_size=4)
    runs = ((3 * E // 4, "previous+draft_router+residual", "layerwise"), (E, "none", "single"))
    for budget, predictor, verify in runs:
        gen = OffloadedGenerator(pair, budget_bytes=budget * per_slot, prefetcher=predictor, block_size=4,
                                 store=store, pool_factory=POISONED, bandwidth=1e9, verify=verify)
        first = gen.generate(PROMPTS, max_new_tokens=20)
        assert first.tokens == first_want.tokens and first.stats["offload"]["verify"] == verify
        copies = pull_rows._cache_size()
        with CompileCounter() as counter:
            got = gen.generate(later, **request)
        assert got.tokens == want.tokens and got.acceptance_lengths == want.acceptance_lengths, verify
        assert got.stats["shapes"] == first.stats["shapes"]
        assert counter.compiles == pull_rows._cache_size() - copies, (verify, counter.compiles)
        if verify == "single":  # every expert pinned at once: one copy size, already compiled
            assert counter.compiles == 0


def test_learned_router_starts_as_the_draft_router_and_learns(pair):
    from dflash_jax.offload.predictors import LearnedRouter
    from dflash_jax.offload.route_model import init_from_target
    from dflash_jax.train.route_predictor import train_route_predictor
    from study.rounds import collect_route_data

    hidden, targets, layers = collect_route_data(pair, PROMPTS, block_size=4, max_new_tokens=12)
    assert targets.shape == (CFG.num_layers, hidden.shape[0], E) and (targets.sum(-1) == 2).all()
    start = init_from_target(pair.target, layers)
    inputs = RoundInputs(round=0, layers=layers, top_k=2, draft_hidden=jnp.asarray(hidden[:8]).reshape(2, 4, -1))
    learned = LearnedRouter(start, layers, eps=CFG.rms_norm_eps).predict(inputs)
    draft = DraftRouter(pair.target, CFG).predict(inputs)
    assert all(set(learned[l].tolist()) == set(draft[l].tolist()) for l in layers)  # same top-k per row
    _, losses = train_route_predictor(start, hidden, targets, eps=CFG.rms_norm_eps, steps=40, batch=64)
    assert np.mean(losses[-5:]) < 0.8 * losses[0]


@pytest.mark.slow  # (fast-set time: the mechanism is covered by a faster test)
def test_learned_router_with_token_features_and_threshold(pair):
    """Token features read the verify block's tokens; the threshold knob selects exactly the experts whose
    block-level probability 1 - prod_rows(1 - p) reaches it, most probable first; generation with it stays
    lossless at a pool too small to hold every expert."""
    from dflash_jax.offload.predictors import LearnedRouter
    from dflash_jax.offload.route_model import init_from_target, route_logits
    from dflash_jax.train.route_predictor import train_route_predictor
    from study.rounds import record_rounds, rounds_to_arrays

    rounds = record_rounds(pair, PROMPTS[:1], block_size=4, max_new_tokens=12)
    layers = tuple(sorted(rounds[0]["routed"]))
    hidden, tokens, targets = rounds_to_arrays(rounds, layers, E)
    assert tokens.shape == (hidden.shape[0],) and (targets.sum(-1) == 2).all()
    embeds = np.asarray(pair.target.embed)[tokens]
    start = init_from_target(pair.target, layers, token_features=True)
    with pytest.raises(ValueError, match="embed"):
        LearnedRouter(start, layers, eps=CFG.rms_norm_eps, threshold=0.5)
    params, losses = train_route_predictor(start, hidden, targets, eps=CFG.rms_norm_eps, steps=30, batch=32,
                                           token_embeds=embeds)
    assert np.mean(losses[-5:]) < losses[0]
    r = rounds[1]
    inputs = RoundInputs(round=1, layers=layers, top_k=2, draft_hidden=jnp.asarray(r["hidden"]).reshape(1, 4, -1),
                         block_tokens=jnp.asarray(r["tokens"]).reshape(1, 4))
    # large token weights: a predictor reading the wrong tokens (or none) would pick other sets
    strong = params.replace(u=params.u + 3.0 * jax.random.normal(jax.random.key(5), params.u.shape))
    t = 0.3
    got = LearnedRouter(strong, layers, eps=CFG.rms_norm_eps, threshold=t, embed=pair.target.embed).predict(inputs)
    logits = route_logits(strong, jnp.asarray(r["hidden"]), CFG.rms_norm_eps,
                          jnp.asarray(np.asarray(pair.target.embed)[r["tokens"]]))
    p = np.asarray(jax.nn.sigmoid(logits), np.float64)  # fp32 like the predictor: saturated ties go by id
    for j, layer in enumerate(layers):
        block_p = 1 - np.prod(1 - p[j], axis=0)
        want = [e for e in np.argsort(-block_p, kind="stable") if block_p[e] >= t]
        assert got[layer].tolist() == want
    want_tokens = generate(pair, PROMPTS[:1], max_new_tokens=16, block_size=4).tokens
    per_slot, store = _per_slot(pair)
    for predictor in (LearnedRouter(params, layers, eps=CFG.rms_norm_eps, threshold=0.2, embed=pair.target.embed),
                      LearnedRouter(params, layers, eps=CFG.rms_norm_eps, width=3, embed=pair.target.embed)):
        got = generate_offloaded(pair, PROMPTS[:1], budget_bytes=(E // 2) * per_slot, predictor=predictor, block_size=4,
                                 max_new_tokens=16, store=store, pool_factory=POISONED, bandwidth=1e9)
        assert got.tokens == want_tokens
        assert got.stats["route_ahead"]["summary"]["predicted"] > 0


def test_residual_predictor_scores_offline_as_in_the_loop(pair):
    """`record_rounds(ahead=True)` keeps the in-verify prediction inputs (the next layer's router logits on the
    residual) and the same rounds; `score_predictor` then scores "residual" (alone or in a union) exactly as the
    loop's stats count it."""
    from study.evaluate import score_predictor
    from study.rounds import record_rounds

    plain = record_rounds(pair, PROMPTS, block_size=4, max_new_tokens=12)
    rounds = record_rounds(pair, PROMPTS, block_size=4, max_new_tokens=12, ahead=True)
    assert len(rounds) == len(plain) and all(sorted(r["ahead_logits"]) == [1, 2] for r in rounds)
    for a, b in zip(rounds, plain):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        assert all((a["routed"][l] == b["routed"][l]).all() for l in range(CFG.num_layers))
        assert a["ahead_logits"][1].shape == (a["hidden"].shape[0], E)
    layers = tuple(range(CFG.num_layers))
    with pytest.raises(ValueError, match="ahead=True"):
        score_predictor(NextLayerResidual(), [plain], layers, num_experts=E, top_k=2)
    _, store = _per_slot(pair)
    for name in ("residual", "previous+residual"):
        offline = score_predictor(make_predictor(name, pair.target, CFG), [rounds], layers, num_experts=E, top_k=2)
        online = generate_offloaded(pair, PROMPTS, budget_bytes=store.total_bytes, predictor=name, block_size=4,
                                    max_new_tokens=12, store=store, bandwidth=1e9, verify="layerwise")
        summary = online.stats["route_ahead"]["summary"]
        assert offline["cases"] == summary["rounds"] * len(layers)
        assert offline["coverage"] == pytest.approx(summary["coverage"])
        assert offline["waste"] == pytest.approx(summary["waste"])
