"""The engine on every target family (slow): a hybrid Gated-DeltaNet target (Qwen3.5-MoE, whose rows carry
linear-attention state and the verify block's rollback inputs) and gpt-oss, random tiny pairs with planted
agreement. Rows sit rounds out under a one-verify-per-round token budget and requests queue for 3 slots; every
request's greedy output equals it run alone by `spec.generate`."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax import testing
from dflash_jax.serve import scheduler as sched
from dflash_jax.serve.engine import Engine, generate as serve_generate
from dflash_jax.spec import generate as spec_generate


@pytest.mark.slow
@pytest.mark.parametrize("make_cfg", [testing.tiny_qwen3_5_config, testing.tiny_gpt_oss_config],
                         ids=["qwen3_5", "gpt_oss"])
def test_engine_lossless_on_family(make_cfg):
    cfg = make_cfg()
    pair = testing.random_pair(cfg, seed=3, block_size=8, mask_token_id=cfg.vocab_size - 1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 100, n).tolist() for n in (9, 16, 3, 12, 7)]
    budgets = [30, 24, 40, 17, 33]
    engine = Engine(pair, slots=3, max_prompt_len=16, max_new_tokens=64,
                    token_budget=pair.draft_cfg.block_size)
    engine.warmup([16])
    reqs = serve_generate(engine, prompts, max_new_tokens=budgets, stop_ids=[])
    assert sum(r.rounds_waited for r in reqs) > 0
    for p, m, r in zip(prompts, budgets, reqs):
        alone = spec_generate(pair, [p], max_new_tokens=m, stop_ids=[])
        assert r.tokens == alone.tokens[0]
    assert max(max(r.acceptance) for r in reqs) >= 3  # proposals were really accepted (rollbacks of many lengths)


@pytest.mark.slow
def test_every_width_on_the_hybrid_family():
    """Qwen3.5's linear-attention rows keep the widest verify's rollback inputs; rounds of every narrower width
    (1, 2, 4, 8 in turn) roll back exactly too: greedy output equals each request alone."""
    import itertools

    cfg = testing.tiny_qwen3_5_config()
    pair = testing.random_pair(cfg, seed=3, block_size=8, mask_token_id=cfg.vocab_size - 1)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 100, n).tolist() for n in (9, 16, 5)]
    engine = Engine(pair, slots=2, max_prompt_len=16, max_new_tokens=32, widths="auto",
                    round_seconds={1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    engine.warmup([16])
    cycle = itertools.cycle([8, 1, 4, 2, 8])
    engine.choose_width = lambda live: next(cycle)
    reqs = serve_generate(engine, prompts, max_new_tokens=24, stop_ids=[])
    for p, r in zip(prompts, reqs):
        assert r.tokens == spec_generate(pair, [p], max_new_tokens=24, stop_ids=[]).tokens[0]
    assert max(max(r.acceptance) for r in reqs) >= 2
