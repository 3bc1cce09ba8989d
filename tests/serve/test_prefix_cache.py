"""Prefix caching (`serve.prefix_cache`): a prompt that joins by chunks starts from the longest cached snapshot of
its first k chunks and prefills only the rest. On `FakeRunner` (the host engine's logic, seconds): hits, the tokens
counted, outputs equal to alone, LRU eviction within the budget, keys that see positions. On the shipped pair and
the hybrid (Gated DeltaNet) pair: a request after a shared prefix equals its cold prefill token for token."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.cache import SLOT_AXIS
from dflash_jax.serve.engine import Engine, generate
from dflash_jax.serve.prefix_cache import PrefixCache, prefix_keys
from dflash_jax.serve.runner import FakeRunner, fake_pair, kv_buffers

VOCAB = 256
RNG = np.random.default_rng(11)
SYSTEM = [int(t) for t in RNG.integers(3, VOCAB, 40)]  # a shared "system prompt": two 16-token chunks and a bit


def make(**kw) -> Engine:
    args = dict(slots=2, max_prompt_len=64, max_new_tokens=20, prefill_chunk=16, widths=[1, 2, 4],
                round_seconds={1: 1.0, 2: 1.2, 4: 1.5})
    args.update(kw)
    eng = Engine(fake_pair(vocab_size=VOCAB), runner=FakeRunner, **args)
    eng.warmup([16])
    return eng


def test_a_shared_prefix_is_prefilled_once():
    eng = make()
    first = SYSTEM + [7, 8, 9]
    second = SYSTEM + [100, 101]
    a = generate(eng, [first], max_new_tokens=10, stop_ids=[])[0]
    chunks = eng.runner.calls["chunk"]
    assert eng.prefix_hit_tokens == 0 and eng.prefix_query_tokens == len(first)
    assert len(eng.prefix_cache) == 2  # the snapshots at 16 and 32 tokens
    b = generate(eng, [second], max_new_tokens=10, stop_ids=[])[0]
    assert eng.prefix_hit_tokens == 32  # the two cached chunks; only the last 10 tokens were prefilled
    assert eng.runner.calls["chunk"] == chunks + 1
    assert a.tokens == FakeRunner.alone(first, 10, VOCAB) and b.tokens == FakeRunner.alone(second, 10, VOCAB)
    assert eng.prefix_query_tokens == len(first) + len(second)


def test_no_prefix_cache_and_short_prompts():
    eng = make(prefix_cache_bytes=0)
    assert eng.prefix_cache is None
    reqs = generate(eng, [SYSTEM + [1], SYSTEM + [2]], max_new_tokens=6, stop_ids=[])
    assert [r.tokens for r in reqs] == [FakeRunner.alone(SYSTEM + [i], 6, VOCAB) for i in (1, 2)]
    assert eng.prefix_hit_tokens == 0
    eng = make()
    generate(eng, [[1, 2, 3], [1, 2, 3]], max_new_tokens=6, stop_ids=[])  # whole prompts: no lookup
    assert eng.prefix_query_tokens == 0 and len(eng.prefix_cache) == 0
    assert make(prefill_chunk=None).prefix_cache is None  # snapshots exist only at chunk boundaries
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        make(prefix_cache_bytes=-1)


def test_lru_eviction_within_the_budget():
    cache = PrefixCache(100)
    for i in range(3):
        assert cache.store(bytes([i]), 16 * (i + 1), f"snap{i}", 40)
    assert len(cache) == 2 and bytes([0]) not in cache and cache.evictions == 1 and cache.bytes == 80
    assert cache.lookup([(16, bytes([1]))]).payload == "snap1"  # now the most recent
    cache.store(bytes([3]), 16, "snap3", 40)
    assert bytes([1]) in cache and bytes([2]) not in cache  # the least recently used left
    assert not cache.store(bytes([4]), 16, "huge", 101)  # larger than the whole budget: not kept
    assert not cache.store(bytes([3]), 16, "again", 40)  # already there
    # the longest cached prefix wins
    assert cache.lookup([(16, bytes([1])), (32, bytes([3]))]).payload == "snap3"
    with pytest.raises(ValueError, match="positive number of bytes"):
        PrefixCache(0)


def test_keys_chain_over_chunks_and_see_positions():
    ids = list(range(50))
    keys = prefix_keys(ids, 16)
    assert [n for n, _ in keys] == [16, 32, 48]
    assert prefix_keys(ids[:40] + [0] * 10, 16)[:2] == keys[:2]  # same prefix, same keys
    assert prefix_keys(ids[:40] + [0] * 10, 16)[2] != keys[2]
    assert prefix_keys(list(range(32)), 16) == keys[:1]  # a prefix that is the whole prompt is never a key
    moved = prefix_keys(ids, 16, positions=np.arange(50) + 5)
    assert moved[0][1] != keys[0][1]  # the same tokens at other positions are another prefix


def test_served_prefix_hits_on_a_small_budget_evict():
    eng = make(prefix_cache_bytes=16)  # FakeRunner snapshots are 8 bytes: two fit
    prompts = [SYSTEM[:33] + [i] for i in range(3)] + [[200 + i for i in range(33)] + [1]]
    reqs = generate(eng, prompts, max_new_tokens=4, stop_ids=[])
    assert [r.tokens for r in reqs] == [FakeRunner.alone(p, 4, VOCAB) for p in prompts]
    assert len(eng.prefix_cache) == 2 and eng.prefix_cache.evictions >= 2
    assert eng.prefix_hit_tokens == 2 * 32  # the second and third prompts


def _cold_and_warm(pair, prompts, **kw):
    from dflash_jax.compile_cache import CompileCounter

    eng = Engine(pair, slots=2, max_prompt_len=320, max_new_tokens=24, prefill_chunk=64, **kw)
    eng.warmup([8, 64])
    cold = Engine(pair, slots=2, max_prompt_len=320, max_new_tokens=24, prefill_chunk=64, prefix_cache_bytes=0, **kw)
    cold.warmup([8, 64])
    with CompileCounter() as counter:
        warm_reqs = [generate(eng, [p], max_new_tokens=24, stop_ids=[])[0] for p in prompts]
    assert counter.compiles == 0
    cold_reqs = generate(cold, prompts, max_new_tokens=24, stop_ids=[])
    return eng, warm_reqs, cold_reqs


@pytest.mark.slow
@pytest.mark.parametrize("which", ["qwen3_moe", "qwen3_5", "qwen3_moe_offloaded"])
def test_outputs_after_a_cached_prefix_equal_the_cold_prefill(which):
    """A 200-token shared prefix, then three different endings: the second and third requests start from the
    snapshot at 192 tokens (the target's KV rows, the hybrid family's Gated DeltaNet state and conv tail, the draft's
    context rows: the live rows only) and their greedy outputs equal a cold prefill's, token for token, with
    proposals accepted; also with the experts offloaded (host memory behind a device cache of 12 experts)."""
    import dflash_jax

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIRS["tiny_pair_qwen3_5" if which == "qwen3_5" else "tiny_pair"])
    kw = {}
    if which.endswith("offloaded"):
        from dflash_jax.offload import HostExpertStore

        store = HostExpertStore(pair.target)
        kw = dict(experts="offload", budget_bytes=12 * store.expert_bytes(store.layer_ids[0]), store=store,
                  bandwidth=1e9)
    system = [int(t) for t in np.random.default_rng(4).integers(0, 1000, 200)]
    prompts = [system + [int(t) for t in np.random.default_rng(i).integers(0, 1000, 5 + i)] for i in range(3)]
    eng, warm, cold = _cold_and_warm(pair, prompts, **kw)
    assert [r.tokens for r in warm] == [r.tokens for r in cold]
    assert eng.prefix_hit_tokens == 2 * 192
    assert max(max(r.acceptance) for r in warm) > 1


def test_prefix_cache_flags():
    from dflash_jax.cli.serve import build_parser, check_args
    from dflash_jax.errors import UsageError

    args = build_parser().parse_args([])
    assert args.prefix_cache_mb == 1024 and not args.no_prefix_cache
    with pytest.raises(UsageError, match="--prefix-cache-mb must be >= 0"):
        check_args(build_parser().parse_args(["--prefix-cache-mb", "-1"]))


def test_a_snapshot_keeps_the_live_rows_and_restores_bit_for_bit(pair):
    """The resident runner's snapshot of a 64-token partial prefill keeps 64 of the cache's rows (not its capacity),
    and the prefill restored from it equals the original leaf for leaf."""
    import jax

    eng = Engine(pair, slots=1, max_prompt_len=200, max_new_tokens=8, prefill_chunk=64, widths=[4])
    runner = eng.runner
    tokens = np.asarray(np.random.default_rng(3).integers(0, 1000, (1, 64)), np.int32)
    pre = runner.prefill_start(tokens, np.array([64], np.int32))
    snap = runner.prefill_snapshot(pre, 64)
    (keys, _), draft = jax.tree.map(lambda x: x.shape, kv_buffers(snap), is_leaf=lambda x: hasattr(x, "shape"))
    assert runner.snapshot_rows(64) == 64 < eng.spec.max_len and all(k[SLOT_AXIS] == 64 for k in keys)
    assert all(k[SLOT_AXIS] == 64 for k in draft[0])
    assert runner.prefill_nbytes(snap) < runner.prefill_nbytes(pre) / 2
    back = runner.prefill_restore(snap)
    assert jax.tree.structure(back) == jax.tree.structure(pre)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(pre)):
        assert a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))
    assert runner.snapshot_rows(65) == 128 and runner.snapshot_rows(10**6) == eng.spec.max_len
