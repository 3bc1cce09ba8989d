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
    # on a GPU attention takes the dense path wherever its scores fit (`AttentionTuning.gpu_path`): never cut
    from pallas_kernels import target

    with target.compiling_for("gpu"):
        assert length_buckets(4096, 5) == (4096,)
        with attention_tuning(gpu_dense_bytes=None):
            assert length_buckets(4096, 5) == (768, 4096)


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


def test_rows_move_across_lanes_cut_to_their_length(pair):
    """Two lanes under the small chunk: a row taken across lanes carries its caches cut to the smallest length bucket
    holding it (`LanedRunner._take_slots`), and lands with every K/V slot up to its length as it was; every request
    equals its run alone, and nothing compiles while serving (the warm-up took a row with each bucket's cut)."""
    from dflash_jax.cache import holds_slots
    from dflash_jax.serve import lanes as serve_lanes

    def kv(state, row, n):  # every cache buffer's first n slots of row `row`
        nodes = [x for x in jax.tree.leaves(state, is_leaf=holds_slots) if holds_slots(x)]
        return [np.asarray(b)[row, :, :n] for x in nodes for b in x.keys + x.values]

    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [7] * 12, list(range(40, 56))]
    # slots 0 and 1 end first: slot 3 moves to 0 and slot 2 to 1, each across lanes, shorter than the first length
    # bucket (taken cut), then longer (taken whole)
    runs = [[6, 6, 40, 50], [40, 40, 60, 64]]
    with attention_tuning(chunk=16, dense_max_rows=32, kernel=False):
        eng = Engine(pair, slots=4, block_size=1, max_prompt_len=16, max_new_tokens=64, prefix_cache_bytes=0,
                     lanes=2)
        eng.warmup([16])
        runner = eng.runner
        assert runner.take_buckets[0] < eng.spec.max_len
        taken, take, move, moved = [], serve_lanes.take_row, runner.move_row, []

        def checked_move(src, dst):
            a, b = runner.lanes[src % 2], runner.lanes[dst % 2]
            n = serve_lanes.row_length(a.state, src // 2)
            before = kv(a.state, src // 2, n)
            move(src, dst)
            for x, y in zip(before, kv(b.state, dst // 2, n)):
                np.testing.assert_array_equal(x, y)
            moved.append(n)

        serve_lanes.take_row = lambda state, row, length=None: taken.append(length) or take(state, row, length)
        runner.move_row = checked_move
        eng.rounds_per_call = 4  # a fixed schedule
        try:
            with CompileCounter() as counter:
                reqs = [serve_generate(eng, prompts, max_new_tokens=b, sampling=SamplingParams(), seed=0) for b in runs]
        finally:
            serve_lanes.take_row, runner.move_row = take, move
        assert counter.compiles == 0
        assert set(taken) == set(runner.take_buckets) == {48, eng.spec.max_len}  # rows moved across lanes: cut, whole
        assert min(moved) < 48 < max(moved)
        for budgets, got in zip(runs, reqs):
            for p, m, r in zip(prompts, budgets, got):
                alone = spec_generate(pair, [p], max_new_tokens=m, sampling=SamplingParams(), seed=0)
                assert r.tokens == alone.tokens[0]
