"""Capacity mode (`Buckets(capacity=N)`, the loops' default): one compiled prefill and one compiled loop for every
prompt length and budget that fit the capacity, the prefill in chunks inside the program; the output is the
bucketed path's (greedy tokens, sampled draws with the same seeds); a request that does not fit is refused with
one message naming the capacity and how to raise it."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax import testing
from dflash_jax.compile_cache import CompileCounter
from dflash_jax.spec import Buckets, SamplingParams, generate, generate_stepping
from dflash_jax.spec.loop import LOOP_BUCKETS, prepare_tree
from dflash_jax.spec.prefill import CapacityPrepared
from dflash_jax.spec.requests import DEFAULT_CAPACITY
from dflash_jax.spec.session import prepare

CAPACITY = Buckets(capacity=256, chunk=64, pad_batch=True)
BUCKETED = Buckets(pad_batch=True)


@pytest.fixture(scope="module")
def pair():
    return testing.random_pair()


def _prompt(n, seed, vocab=512):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def test_capacity_shapes_and_the_default():
    """Every shape but the batch follows the capacity (capped at the target's positions), whatever the request;
    the loops default to capacity mode."""
    assert LOOP_BUCKETS.fixed and LOOP_BUCKETS.capacity == DEFAULT_CAPACITY == 2048
    assert not Buckets().fixed
    b = Buckets(capacity=300, chunk=64)
    assert b.capacity_rows(4096) == 300 and b.capacity_rows(256) == 256
    assert b.chunk_len(300) == 64 and b.prompt_buffer(300) == 320  # whole chunks
    assert Buckets(capacity=40, chunk=64).prompt_buffer(40) == 40
    with pytest.raises(ValueError, match="Buckets.capacity must be a positive integer"):
        Buckets(capacity=0)
    with pytest.raises(ValueError, match="Buckets.chunk must be a positive integer"):
        Buckets(capacity=64, chunk=True)


def test_every_request_has_the_same_shapes(pair):
    preps = [prepare(pair, [_prompt(n, n)], max_new_tokens=budget, buckets=CAPACITY)
             for n, budget in ((1, 1), (9, 17), (150, 90), (230, 10))]
    assert all(isinstance(p, CapacityPrepared) for p in preps)
    assert {(p.spec, p.prompt_buffer().shape, p.chunk) for p in preps} == {(preps[0].spec, (1, 256), 64)}
    assert preps[0].spec.max_len == preps[0].spec.output_len == 256
    big = prepare(pair, [_prompt(9, 0)], max_new_tokens=17, buckets=Buckets(capacity=10**6))
    assert big.spec.max_len == pair.target_cfg.max_position_embeddings  # capped at the target's positions


def test_greedy_equals_the_bucketed_path(pair):
    """Prompts of one chunk and of three (a ragged last one), with their own budgets: the same tokens and
    acceptance as the bucketed programs, in the jitted and the stepping loop; proposals were accepted."""
    prompts, budgets = [_prompt(9, 1), _prompt(150, 2)], [40, 25]
    cap = generate(pair, prompts, max_new_tokens=budgets, buckets=CAPACITY)
    ref = generate(pair, prompts, max_new_tokens=budgets, buckets=BUCKETED)
    assert cap.tokens == ref.tokens
    assert cap.acceptance_lengths == ref.acceptance_lengths
    assert [len(t) for t in cap.tokens] == budgets
    assert cap.stats["mean_acceptance"] > 1.5  # the speculative path ran, not a 1-token-per-round loop
    assert cap.stats["shapes"]["cache"] == cap.stats["shapes"]["output"] == 256
    assert generate_stepping(pair, prompts, max_new_tokens=budgets, buckets=CAPACITY).tokens == ref.tokens


def test_sampled_draws_equal_the_bucketed_path(pair):
    """The same seeds draw the same tokens in capacity mode (the same compiled programs as greedy: traced
    settings), one sequence sampled (near uniformly over its top 40) and one greedy in the batch."""
    prompts = [_prompt(20, 4), _prompt(160, 5)]
    kwargs = dict(max_new_tokens=[30, 21], seed=[3, 11], stop_ids=[],
                  sampling=[SamplingParams(temperature=100.0, top_k=40), SamplingParams()])
    cap = generate(pair, prompts, buckets=CAPACITY, **kwargs)
    ref = generate(pair, prompts, buckets=BUCKETED, **kwargs)
    assert cap.tokens == ref.tokens
    greedy = generate(pair, prompts, max_new_tokens=[30, 21], stop_ids=[], buckets=CAPACITY)
    assert cap.tokens[0] != greedy.tokens[0] and cap.tokens[1] == greedy.tokens[1]  # row 0 sampled, row 1 did not


def test_no_compile_for_other_prompt_lengths_and_budgets(pair):
    """After one request, prompts of other lengths (one chunk or several) and other budgets compile nothing."""
    generate(pair, [_prompt(20, 6), _prompt(30, 6)], max_new_tokens=40, buckets=CAPACITY)
    with CompileCounter() as counter:
        short = generate(pair, [_prompt(5, 7), _prompt(9, 7)], max_new_tokens=17, buckets=CAPACITY)
        long = generate(pair, [_prompt(180, 8), _prompt(60, 8)], max_new_tokens=[60, 3], buckets=CAPACITY)
    assert counter.compiles == 0 and counter.traces == 0, (counter.compiles, counter.traces)
    assert [len(t) for t in short.tokens + long.tokens] == [17, 17, 60, 3]


def test_a_request_past_the_capacity_is_refused(pair):
    b = pair.draft_cfg.block_size
    prepare(pair, [_prompt(200, 9)], max_new_tokens=256 - 200 - b, buckets=CAPACITY)  # exactly fits
    with pytest.raises(ValueError, match=r"needs 257 cache rows, more than the capacity 256: raise it with "
                                         r"buckets=Buckets\(capacity=512\) \(dflash-generate --capacity 512"):
        prepare(pair, [_prompt(200, 9)], max_new_tokens=257 - 200 - b, buckets=CAPACITY)
    with pytest.raises(ValueError, match="capacity 256"):
        generate(pair, [_prompt(10, 9)], max_new_tokens=250, buckets=CAPACITY)
    with pytest.raises(ValueError, match="tree budget 24 needs 260 cache rows, more than the capacity 256"):
        prepare_tree(pair, [_prompt(200, 9)], widest=24, max_new_tokens=36, buckets=CAPACITY)
    tree = prepare_tree(pair, [_prompt(200, 9)], widest=24, max_new_tokens=32, buckets=CAPACITY)
    assert tree.spec.max_len == 256 and isinstance(tree, CapacityPrepared)


def test_cli_capacity_flags(capsys):
    """`--capacity N` / `--bucketed` pick the shapes; a request past the capacity ends in one line naming the
    flag that raises it (before anything compiles)."""
    from dflash_jax.cli.generate import build_parser, main, shape_buckets

    def parsed(*flags):
        return shape_buckets(build_parser().parse_args(["--prompt-ids", "1,2", *flags]))

    assert parsed() is None  # the loops' default: LOOP_BUCKETS
    assert parsed("--capacity", "512") == Buckets(capacity=512, pad_batch=True)
    assert parsed("--bucketed") == BUCKETED
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prompt-ids", "1", "--capacity", "512", "--bucketed"])
    capsys.readouterr()
    assert main(["--prompt-ids", "1,2,3", "--max-new-tokens", "100", "--capacity", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than the capacity 64" in err[0] and "--capacity 128" in err[0], err


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_5"])
def test_families_equal_the_bucketed_path(family):
    """gpt-oss (sliding window 16 shorter than the prompt, sinks) and the Qwen3.5 hybrid (DeltaNet state carried
    from chunk to chunk of the prefill loop): capacity-mode greedy output is the bucketed one's."""
    cfg = {"gpt_oss": testing.tiny_gpt_oss_config, "qwen3_5": testing.tiny_qwen3_5_config}[family]()
    fam_pair = testing.random_pair(cfg, seed=3, block_size=8, mask_token_id=cfg.vocab_size - 1)
    prompts, budgets = [_prompt(9, 1, 100), _prompt(150, 2, 100)], [24, 17]
    cap = generate(fam_pair, prompts, max_new_tokens=budgets, stop_ids=[], buckets=CAPACITY)
    ref = generate(fam_pair, prompts, max_new_tokens=budgets, stop_ids=[], buckets=BUCKETED)
    assert cap.tokens == ref.tokens and cap.acceptance_lengths == ref.acceptance_lengths


def test_a_growing_capacity_takes_a_longer_request(pair):
    """The loops' default grows: a request past the capacity runs at the next power of two of rows (one more
    program) with the bucketed path's tokens, instead of being refused."""
    import dataclasses

    grow = dataclasses.replace(CAPACITY, grow=True)
    assert LOOP_BUCKETS.grow
    prompts = [_prompt(200, 9)]
    res = generate(pair, prompts, max_new_tokens=80, buckets=grow)
    assert res.stats["shapes"]["cache"] == res.stats["shapes"]["output"] == 512
    assert res.tokens == generate(pair, prompts, max_new_tokens=80, buckets=BUCKETED).tokens
    tree = prepare_tree(pair, prompts, widest=24, max_new_tokens=36, buckets=grow)
    assert tree.spec.max_len == 512 and tree.spec.output_len == 512
