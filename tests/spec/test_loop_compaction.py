"""The jitted loop's compaction (`spec.loop.run_compacting`): a batch whose rows finish at different rounds
continues on its live rows in a smaller batch bucket. Every sequence's tokens and rounds are those of the
uncompacted run (greedy: plain greedy decoding's too; sampled: each row keeps its key), for chains and adaptive
policies; the compaction targets follow the batch buckets."""

from __future__ import annotations

import pytest

from dflash_jax.decode import greedy_generate
from dflash_jax.spec import Buckets, SamplingParams, generate
from dflash_jax.spec.loop import COMPACT_MIN_BATCH, compaction_target
from dflash_jax.spec.policy import AdaptivePolicy, VerifyCost
from dflash_jax.spec.tree import TreeShape

# budgets far apart, so that rows finish many rounds apart and the loop compacts 4 -> 2 -> 1
BUDGETS = [3, 40, 9, 22]


def test_compaction_targets_follow_the_batch_buckets():
    fine = Buckets(pad_batch=True)
    assert compaction_target(32, fine, "auto") == 16
    assert compaction_target(24, fine, "auto") == 12
    assert compaction_target(8, fine, "auto") == 4
    assert compaction_target(COMPACT_MIN_BATCH - 1, fine, "auto") == 0  # small batches: no more compiles
    assert compaction_target(6, fine, True) == 3
    assert compaction_target(4, fine, True) == 2
    assert compaction_target(2, fine, True) == 1
    assert compaction_target(1, fine, True) == 0
    assert compaction_target(32, fine, False) == 0
    assert compaction_target(32, Buckets(pad_batch=False), True) == 0  # unpadded batches keep their shape
    coarse = Buckets(pad_batch=True, fine=False)
    assert compaction_target(32, coarse, True) == 16
    assert compaction_target(12, coarse, True) == 4  # 6 is no coarse bucket: the next one down


def test_bad_compact_value_is_refused(pair, prompts):
    with pytest.raises(ValueError, match="compact must be True, False or 'auto'"):
        generate(pair, prompts, max_new_tokens=4, compact="yes")


def test_compacted_chain_equals_the_uncompacted_run_and_plain_greedy(pair, prompts):
    plain = greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=BUDGETS, stop_ids=[])
    whole = generate(pair, prompts, max_new_tokens=BUDGETS, block_size=8, compact=False, lanes=1)
    packed = generate(pair, prompts, max_new_tokens=BUDGETS, block_size=8, compact=True, lanes=1)
    assert whole.stats["compactions"] == 0
    assert packed.stats["compactions"] == 2  # 4 rows -> 2 -> 1
    assert packed.tokens == whole.tokens == plain
    assert [len(t) for t in packed.tokens] == BUDGETS
    assert packed.acceptance_lengths == whole.acceptance_lengths
    assert packed.stats["rounds"] == whole.stats["rounds"]
    assert packed.mean_acceptance(1) > 1.5  # proposals were accepted, in the row that ran longest


def test_compacted_sampling_keeps_each_rows_draws(pair, prompts):
    sampling = SamplingParams(temperature=0.8, top_p=0.95)
    runs = [generate(pair, prompts, max_new_tokens=BUDGETS, block_size=8, sampling=sampling, seed=7, compact=c, lanes=1)
            for c in (False, True)]
    assert runs[1].stats["compactions"] >= 1
    assert runs[1].tokens == runs[0].tokens
    assert runs[1].acceptance_lengths == runs[0].acceptance_lengths


@pytest.mark.slow  # its own programs at 4, 2 and 1 rows (about 30 s)
def test_compacted_adaptive_policy_equals_the_uncompacted_run(pair, prompts):
    policy = AdaptivePolicy((TreeShape(4, 1), TreeShape(8, 1)), VerifyCost((1.0, 1.6)))
    runs = [generate(pair, prompts, max_new_tokens=BUDGETS, proposer=policy, block_size=8, compact=c, lanes=1)
            for c in (False, True)]
    assert runs[1].stats["compactions"] >= 1
    assert runs[1].tokens == runs[0].tokens
    assert sum(runs[1].stats["adaptive_rounds"].values()) >= runs[1].stats["rounds"]


def test_compaction_sizes_halve_to_the_smallest_bucket():
    from dflash_jax.spec.loop import compaction_sizes

    fine = Buckets(pad_batch=True)
    assert compaction_sizes(32, fine, "auto") == [16, 8, 4]
    assert compaction_sizes(4, fine, True) == [2, 1]
    assert compaction_sizes(4, fine, "auto") == []


def test_warmup_compiles_every_compacted_bucket(pair, prompts):
    """A warmed-up run whose rows end at once (no compaction), then a run that compacts: it compiles nothing.
    Block 4 at two rows: shapes no other test here compiles."""
    import jax.monitoring

    two = prompts[:2]
    generate(pair, two, max_new_tokens=1, block_size=4, compact=True, warmup=True, lanes=1)
    compiles = []

    def listen(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        res = generate(pair, two, max_new_tokens=BUDGETS[:2], block_size=4, compact=True, lanes=1)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert res.stats["compactions"] == 1  # 2 rows -> 1
    assert compiles == []
