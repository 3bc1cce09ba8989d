"""Length buckets: a resident round computes over the smallest of a few cache lengths holding its rows' live
lengths (`serve.runner.length_buckets`), not the whole cache. Under a small attention chunk (so that a short cache
has several buckets) requests whose caches grow across bucket boundaries produce the tokens of the same engine with
the whole cache every round, and of each request run alone; warm-up compiles every bucket (no compile while
serving)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dflash_jax.cache import SLOT_AXIS, KVCache
from dflash_jax.compile_cache import CompileCounter
from dflash_jax.nn.attention import attention_tuning
from dflash_jax.serve.engine import Engine, generate as serve_generate
from dflash_jax.serve.runner import cut_slots, length_buckets
from dflash_jax.spec import SamplingParams
from dflash_jax.spec.round import Chain
from dflash_jax.spec import generate as spec_generate

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(40, 56))]
BUDGETS = [60, 40, 64]


def test_length_buckets_shape():
    with attention_tuning(chunk=16, dense_max_rows=32, kernel=False):
        assert length_buckets(256, 8) == (48, 256)
        assert length_buckets(1024, 8) == (48, 192, 1024)
        assert length_buckets(32, 8) == (32,)  # a dense cache is never cut
    assert length_buckets(4096, 5) == (768, 4096)
    assert length_buckets(16384, 5) == (768, 3072, 16384)
    assert length_buckets(256, 5) == (256,)


def test_cut_slots():
    import jax.numpy as jnp

    from dflash_jax.cache import kv_shape

    x = jnp.zeros(kv_shape(2, 64, 1, 4))
    assert cut_slots((x, x), 16)[0].shape == kv_shape(2, 16, 1, 4)
    assert cut_slots(x, 64) is x and cut_slots(x, None) is x


@pytest.mark.parametrize("block_size, widths", [
    (1, None),
    pytest.param(4, None, marks=pytest.mark.slow),  # the draft side too (50 s)
    pytest.param(4, (1,), marks=pytest.mark.slow),  # width-1 rounds of a block-4 state: deferring, cut for one row
])
def test_length_buckets_lossless_and_warm(pair, block_size, widths):
    with attention_tuning(chunk=16, dense_max_rows=32, kernel=False):
        eng = Engine(pair, slots=2, block_size=block_size, widths=widths, max_prompt_len=16, max_new_tokens=64,
                     prefix_cache_bytes=0, lanes=1)  # one runner: its length buckets are watched
        buckets = eng.runner.length_buckets
        assert len(buckets) > 1 and buckets[-1] == eng.spec.max_len
        eng.warmup([16])
        used, prefilled = [], []
        choose, prefill = eng.runner.length_bucket, eng.runner.prefill
        eng.runner.length_bucket = lambda rows, rounds=1, proposer=None: (
            used.append(choose(rows, rounds, proposer)) or used[-1])
        eng.runner.prefill = lambda batch: (  # the slots of the prefilled rows' caches (`runner.prefill_slots`)
            lambda rows: prefilled.append(rows.target_cache.keys[0].shape[SLOT_AXIS]) or rows)(prefill(batch))
        with CompileCounter() as counter:
            reqs = serve_generate(eng, PROMPTS, max_new_tokens=BUDGETS, sampling=SamplingParams(), seed=0)
        assert counter.compiles == 0
        # prefilled into the short bucket's slots, inserted into the whole cache up to their lengths, grown past it
        assert set(prefilled) == {buckets[0]} and max(len(r.tokens) + 16 for r in reqs) > buckets[0]
        assert set(used) >= set(buckets[:2])  # the caches grew across a bucket boundary
        assert used == sorted(used) or len(set(used)) > 1
        eng.runner.length_bucket = lambda rows, rounds=1, proposer=None: buckets[-1]  # the whole cache every round
        whole = serve_generate(eng, PROMPTS, max_new_tokens=BUDGETS, sampling=SamplingParams(), seed=0)
        for i, (r, w) in enumerate(zip(reqs, whole)):
            assert r.tokens == w.tokens, i
            alone = spec_generate(pair, [PROMPTS[i]], max_new_tokens=BUDGETS[i], sampling=SamplingParams(), seed=0)
            assert r.tokens == alone.tokens[0], i


def test_a_round_cuts_for_what_its_proposer_can_add(pair):
    """A deferring width-1 round adds one row to a cache and writes no draft block, so a call of 16 of them needs
    16 slots past the live lengths, not 16 widest verifies and a block: it keeps the short bucket, and runs whole."""
    with attention_tuning(chunk=16, dense_max_rows=32, kernel=False):
        eng = Engine(pair, slots=2, block_size=4, widths=[1, 4], max_prompt_len=16, max_new_tokens=64,
                     prefix_cache_bytes=0, lanes=1, round_seconds={1: 1.0, 4: 2.0})
        eng._reset()
        runner = eng.runner
        lengths = [leaf for leaf in jax.tree.leaves(runner.state, is_leaf=lambda x: isinstance(x, KVCache))
                   if isinstance(leaf, KVCache)]
        top = int(max(int(np.max(np.asarray(c.lengths))) for c in lengths))
        short = runner.length_buckets[0]
        assert top + 16 <= short < top + 16 * 4 + 4
        defer, wide = Chain(1, defer_context=True), Chain(4)
        assert runner.growth(defer) == (1, 0) and runner.growth(wide) == (4, 4)
        assert runner.growth(None) == (runner.layout.widest, 4)
        assert runner.length_bucket(1, 16, defer) == short
        assert runner.length_bucket(1, 16, wide) > short
        assert runner.burst_rounds(1, 16, defer) == 16
        assert runner.burst_rounds(1, 16, wide) == (short - top - 4) // 4
