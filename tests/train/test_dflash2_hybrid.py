"""A DFlash 2 draft for the shipped hybrid Qwen3.5-MoE pair (Gated DeltaNet + gated attention target): the recipe's
DFlash 2 draft config and `as_dflash2` upgrade the pair's DFlash 1 draft, `dflash2_loss` trains it on the hybrid
target's taps, and its selector chain gives exactly the plain greedy output with proposals accepted."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax.decode import greedy_generate
from dflash_jax.models import draft as draft_model
from dflash_jax.models.family import family_of
from dflash_jax.train.common import TrainConfig, train_loop
from dflash_jax.train.data import file_windows
from dflash_jax.train.dflash2 import as_dflash2
from dflash_jax.train.objectives import dflash2_loss, sample_anchors
from dflash_jax.train.tiny_pair import Recipe

HYBRID = "tiny_pair_qwen3_5"
NEW = 32


@pytest.mark.slow
def test_hybrid_pair_dflash2_draft_trains_and_its_selector_chain_is_lossless():
    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIRS[HYBRID], dequantize_experts=True)
    recipe = dataclasses.replace(Recipe.hybrid(), draft_version=2)
    cfg = recipe.draft_config(pair.draft_cfg)
    assert cfg.dflash2 and pair.target_cfg.model_type == "qwen3_5_moe"
    init = as_dflash2(pair.draft.replace(branch_head=None), cfg, jax.random.key(0))

    # a few training rows: the hybrid target's greedy continuations of training-file windows
    fam = family_of(pair.target_cfg)
    prompts = file_windows(pair, "train", 4, 32, seed=1)
    outs = greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=64, stop_ids=[])
    rows = jnp.asarray(np.asarray([p + o for p, o in zip(prompts, outs)], np.int32))
    out = jax.jit(lambda t: fam.forward(pair.target, t, fam.init_cache(pair.target_cfg, *t.shape), pair.target_cfg,
                                        tap_layers=cfg.target_layer_ids, logits="none").taps)(rows)
    feats = draft_model.context_features(out)
    anchors = jnp.asarray(sample_anchors(np.random.default_rng(0), 4, 4, 31, rows.shape[1] - cfg.block_size))

    def loss(p, _):
        return dflash2_loss(p, pair.target, rows, feats, anchors, cfg, block_size=cfg.block_size, gamma=7.0)

    trained, losses = train_loop(init, loss, lambda step: None, TrainConfig(steps=4, learning_rate=1e-3, warmup_steps=1),
                                 checkpoint_dir=None, desc="hybrid dflash2", progress=False)
    assert np.isfinite(losses).all()
    assert float(jnp.abs(trained.branch_head.successor).max()) > 0  # the selector moved off its start

    d2 = dataclasses.replace(pair, draft=trained, draft_cfg=cfg)
    prompt = file_windows(pair, "held_out", 1, 64, seed=3)[0]
    want = greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=NEW, stop_ids=[])
    res = dflash_jax.generate(d2, [prompt], max_new_tokens=NEW, proposer="selector", block_size=8, stop_ids=[])
    assert res.tokens == want and res.mean_acceptance() > 1.5
