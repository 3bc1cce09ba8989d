"""The device expert cache shared by every MoE layer (`offload.cache.ExpertCache`): accounting (bytes never
above the budget), rows equal to the host store's, eviction across layers (pinned / held / prefetched-for-a-
later-layer entries stay), passes when a layer's routed union does not fit (the layer-wise forward in passes
equals one pass; host passes equal device passes exactly), hybrid placement's per-expert decision, shared
placement, and lossless generation at the minimum budget with copies issued as `device_put`s."""

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
    ExpertCache, HostCompute, HostExpertStore, OffloadedGenerator, PoolTooSmall, min_budget_bytes,
)
from dflash_jax.offload.forward import ExpertOperands, NonResidentExpert, forward_layerwise
from dflash_jax.offload.placement import plan_shared, warm_shared
from dflash_jax.offload.store import strip_experts
from dflash_jax.offload.cache import min_budget_from_manifest, slab_groups
from dflash_jax.offload.forward import host_device
from dflash_jax.spec import generate

E = 16
CFG = testing.tiny_qwen3_moe_config(
    num_layers=3, moe=MoEConfig(num_experts=E, top_k=2, intermediate_size=32, norm_topk_prob=True))
POISONED = functools.partial(ExpertCache, poison=True)


@pytest.fixture(scope="module")
def weights():
    return testing.random_qwen3_weights(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def store(weights):
    return HostExpertStore(weights)


def _rows(cache, layer, expert):
    slab = cache._slab(layer)
    cache.returned()
    return [np.asarray(leaf)[cache.layers[layer].slot_of[expert]] for leaf in slab.leaves]


def _host_rows(store, layer, expert):
    le = store.layers[layer]
    return [np.asarray(t)[expert] for t, i in zip(le.leaves, le.per_expert) if i]


def test_one_slab_budget_accounting_and_rows(store):
    eb = store.expert_bytes(0)
    assert len(slab_groups(store)) == 1 and min_budget_bytes(store) == eb  # alike layers: one slab
    with pytest.raises(PoolTooSmall, match=f"minimum of {eb / 1e6:.3f} MB"):
        ExpertCache(store, eb - 1)
    cache = ExpertCache(store, 5 * eb + eb // 2, poison=True)
    assert cache.slots == 5 and cache.bytes == 5 * eb <= 5 * eb + eb // 2
    cache.fetch(0, [3, 4])
    cache.fetch(2, [3, 9])
    assert cache.resident(0)[[3, 4]].all() and cache.resident(2)[[3, 9]].all() and not cache.resident(1).any()
    assert cache.resident_bytes() == 4 * eb <= cache.bytes
    for layer, e in ((0, 3), (0, 4), (2, 3), (2, 9)):  # layer 0's expert 3 and layer 2's expert 3 differ
        for got, want in zip(_rows(cache, layer, e), _host_rows(store, layer, e)):
            np.testing.assert_array_equal(got, want)
    # the slot tables point into one slab; the sentinel is the trap row
    assert int(cache.slot_table(1)[0]) == 5 and len(set(cache.layers[0].slot_of[[3, 4]]) |
                                                     set(cache.layers[2].slot_of[[3, 9]])) == 4


def test_eviction_across_layers(store):
    eb = store.expert_bytes(0)
    cache = ExpertCache(store, 4 * eb, pinned={1: [7]})
    cache.fetch(0, [1, 2])
    cache.touch(0, [1, 2])
    cache.advance()
    cache.touch(0, [1])  # layer 0's expert 1 used twice, expert 2 once
    cache.fetch(2, [5])
    cache.touch(2, [5])
    # the cache is full; layer 1 needs one more: the lowest CRF score across layers goes (layer 0's expert 2)
    cache.fetch(1, [3])
    assert not cache.resident(0)[2] and cache.resident(0)[1] and cache.resident(2)[5] and cache.resident(1)[7]
    # held entries (the running layer's) are never evicted, pinned ones neither: the capacity says so
    cache.hold(1, [3])
    assert cache.capacity(0) == 2  # its own expert 1 + layer 2's expert 5
    with pytest.raises(PoolTooSmall, match="passes"):
        cache.fetch(0, [8, 9, 10])
    assert [p.tolist() for p in cache.plan_passes(0, [1, 8, 9, 10])] == [[1, 8], [9, 10]]  # resident one first
    # a prefetch evicts by score (never the pinned 7), and marks what it moved as prefetched for layer 2
    cache.release()
    assert cache.prefetch(2, [11, 12]).experts.tolist() == [11, 12]
    assert not cache.resident(1)[3] and not cache.resident(2)[5] and cache.resident(0)[1]
    assert np.flatnonzero(cache.layers[2].soft).tolist() == [11, 12]
    # with layer 0's and 1's experts held, a prefetch for layer 0 may not take layer 2's prefetched slots ...
    cache.hold(0, [1])
    cache.hold(1, [7])
    assert cache.prefetch(0, [13]).experts.size == 0
    # ... an on-demand fetch may (correctness first); the layer's own run clears the mark
    assert cache.fetch(0, [13]).experts.tolist() == [13]
    assert cache.resident(1)[7] and cache.resident(0)[1] and cache.bytes == 4 * eb
    cache.touch(2, [12])
    assert not cache.layers[2].soft.any()


def _provider(cache, group: int | None = None, host: bool = False, tables=None):
    """Each layer's routed experts from the cache, or with `tables` from those whole tables; with `group`, in
    passes of `group` experts (host: on the host CPU device)."""
    def provide(layer, experts):
        wanted = np.unique(experts)
        if group is None:
            if tables is not None:
                return ExpertOperands(tables[layer], None, np.ones(E, bool))
            cache.fetch(layer, wanted)
            return ExpertOperands(cache.operands(layer), cache.slot_table(layer), cache.resident(layer))

        def passes():
            for i in range(0, len(wanted), group):
                mask = np.zeros(E, bool)
                mask[wanted[i:i + group]] = True
                if tables is not None:
                    yield ExpertOperands(tables[layer], None, np.ones(E, bool), mask=mask, host=host)
                    continue
                cache.returned()
                cache.fetch(layer, wanted[i:i + group])
                yield ExpertOperands(cache.operands(layer), cache.slot_table(layer), cache.resident(layer), mask=mask)
        return passes()
    return provide


def test_passes_equal_one_pass_and_host_passes_equal_device_passes(weights, store):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 24)), jnp.int32)
    cache_in = qwen3.forward_jit(weights, tokens, qwen3.init_cache(CFG, 2, 40), CFG).cache
    block = jnp.asarray([[5, 6, 7, 8], [9, 10, 11, 12]], jnp.int32)
    stripped = strip_experts(weights)
    eb = store.expert_bytes(0)
    whole = {l: store.device_tables(l) for l in store.layer_ids}
    one = forward_layerwise(stripped, block, cache_in, CFG, provider=_provider(None, tables=whole))
    tiny = POISONED(store, eb)  # one slot: every expert of every layer in its own pass
    passes = forward_layerwise(stripped, block, cache_in, CFG, provider=_provider(tiny, group=1),
                               dispatched=lambda i, x: tiny.returned(x))
    assert tiny.bytes == eb
    for layer in range(CFG.num_layers):
        np.testing.assert_array_equal(passes.routed[layer], one.routed[layer])
    # passes add the rows' contributions in another order than one grouped MoE: equal up to fp32 rounding
    np.testing.assert_allclose(np.asarray(passes.out.logits), np.asarray(one.out.logits), rtol=1e-5, atol=2e-5)
    assert (np.asarray(passes.out.logits).argmax(-1) == np.asarray(one.out.logits).argmax(-1)).all()
    # passes of two experts over the whole tables on the device, and the same computed on the host CPU device
    # (hybrid placement): the same numbers, exactly
    cpu = host_device()
    tables = {l: jax.device_put(store.layers[l].tables(store.layers[l].leaves),
                                jax.sharding.SingleDeviceSharding(cpu, memory_kind=cpu.default_memory().kind))
              for l in store.layer_ids}
    dev2 = forward_layerwise(stripped, block, cache_in, CFG, provider=_provider(None, group=2, tables=whole))
    host2 = forward_layerwise(stripped, block, cache_in, CFG, provider=_provider(None, group=2, host=True,
                                                                                  tables=tables))
    np.testing.assert_array_equal(np.asarray(host2.out.logits), np.asarray(dev2.out.logits))
    np.testing.assert_allclose(np.asarray(dev2.out.logits), np.asarray(one.out.logits), rtol=1e-5, atol=2e-5)
    # a provider whose passes miss a routed expert is caught
    def short(layer, experts):
        mask = np.zeros(E, bool)
        mask[np.unique(experts)[:1]] = True
        return iter([ExpertOperands(tables[layer], None, np.ones(E, bool), mask=mask, host=True)])

    with pytest.raises(NonResidentExpert, match="each routed expert exactly once"):
        forward_layerwise(stripped, block, cache_in, CFG, provider=short)


def test_hybrid_decision_follows_the_cost_model():
    model = HostCompute(link_bytes_per_s=1e9, host_flops=1e11, host_bytes_per_s=1e10, host_pass_s=0.0)
    rows = np.zeros(E, int)
    rows[[1, 2, 3]] = [1, 50, 1000]
    # copy 1 MB = 1 ms; host: rows x 1 MFLOP / 1e11 + 1 MB / 1e10 = 0.1 ms + rows x 10 us
    chosen = model.choose(np.array([1, 2, 3]), rows, flops_per_row=1e6, expert_bytes=1_000_000)
    assert chosen.tolist() == [1, 2]  # 0.11 ms and 0.6 ms beat the copy; 10.1 ms does not
    costly = dataclasses_replace(model, host_pass_s=1.0)  # the pass overhead eats the saving
    assert costly.choose(np.array([1, 2, 3]), rows, flops_per_row=1e6, expert_bytes=1_000_000).size == 0
    assert HostCompute.always().choose(np.array([4]), rows, flops_per_row=1e6, expert_bytes=10).tolist() == [4]


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_shared_placement_pins_the_hottest_pairs_across_layers():
    profile = {0: np.array([9, 8, 0, 0]), 1: np.array([1, 1, 1, 1]), 2: np.array([7, 0, 0, 6])}
    pinned = plan_shared(profile, [((0, 1, 2), 6)], reserve=2)
    assert {l: p.tolist() for l, p in pinned.items()} == {0: [0, 1], 1: [], 2: [0, 3]}  # non-uniform hot sets
    warm = warm_shared(profile, [((0, 1, 2), 6)], pinned)
    assert sum(len(v) for v in warm.values()) == 2 and warm[1].tolist() == [0, 1]
    everything = plan_shared(profile, [((0, 1, 2), 12)], reserve=2)
    assert all(len(v) == 4 for v in everything.values())
    assert all(len(v) == 0 for v in plan_shared(profile, [((0, 1, 2), 2)], reserve=2).values())


@pytest.fixture(scope="module")
def pair():
    return testing.random_pair(CFG)


PROMPTS = [np.random.default_rng(i).integers(0, 500, n).tolist() for i, n in enumerate((40, 23))]


class _Accounting:
    """Checks the cache after every round: its slots' bytes within the budget, resident bytes within its slots."""

    def __init__(self, budget):
        self.budget, self.session, self.rounds = budget, None, 0

    def on_round(self, stats):
        cache = self.session.pool
        assert cache.resident_bytes() <= cache.bytes <= self.budget
        self.rounds += 1


@pytest.mark.parametrize("transfer, hybrid", [("device_put", False), ("device_put", True),
                                              pytest.param("pull_rows", False, marks=pytest.mark.slow)])
def test_minimum_budget_is_lossless_and_within_budget(pair, transfer, hybrid):
    """The minimum budget (one expert) with prefetch (in-verify and previous round): the resident tokens, every
    layer in passes, bytes within the budget every round; with copies as device_puts issued ahead and the
    missing experts computed on the host (hybrid) too."""
    want = generate(pair, PROMPTS, max_new_tokens=12, block_size=4)
    store = HostExpertStore(pair.target)
    budget = min_budget_bytes(store)
    check = _Accounting(budget)
    gen = OffloadedGenerator(pair, budget_bytes=budget, prefetcher="previous+residual", block_size=4, store=store,
                             pool_factory=functools.partial(ExpertCache, poison=True, transfer=transfer),
                             bandwidth=1e9, hybrid=HostCompute.always() if hybrid else None)
    session = gen.prefill(PROMPTS, max_new_tokens=12)
    check.session = session
    session.observers = session.observers + (check,)
    while not session.done:
        gen.round(session)
    got = gen.result(session)
    assert got.tokens == want.tokens and got.acceptance_lengths == want.acceptance_lengths
    summary = got.stats["route_ahead"]["summary"]
    assert check.rounds == summary["rounds"] > 0
    if hybrid:  # every miss computed on the host: nothing fetched on demand
        assert summary["host"] > 0 and summary["on_demand"] == 0
    else:
        assert summary["passes"] > summary["rounds"] * CFG.num_layers and summary["on_demand"] > 0


def test_min_budget_from_the_manifest_equals_the_store(tmp_path):
    from dflash_jax import SHIPPED_PAIR, load
    from dflash_jax.checkpoint import read_manifest

    minimum, total = min_budget_from_manifest(read_manifest(SHIPPED_PAIR))
    shipped = HostExpertStore(load(SHIPPED_PAIR, expert_memory="pinned_host").target)
    assert (minimum, total) == (min_budget_bytes(shipped), shipped.total_bytes)
