"""Training DFlash 2 drafts: a fresh one computes its DFlash 1 backbone, the selector's training candidates
carry the target's token, a few steps train the convolutions and the selector, and the trained draft goes
export -> convert-weights -> load."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import testing
from dflash_jax.models import draft as draft_model
from dflash_jax.models import qwen3
from dflash_jax.train.common import TrainConfig, train_loop
from dflash_jax.train.dflash2 import (as_dflash2, dflash2_config, fit_selector, init_selector, selector_examples,
                                     selector_refit_loss)
from dflash_jax.train.objectives import (scored_blocks, dflash2_loss, draft_blocks, sample_anchors, selector_candidates,
                                         selector_loss)

TCFG = testing.tiny_qwen3_moe_config(vocab_size=64, num_layers=2, max_position_embeddings=512)
DCFG1 = testing.tiny_draft_config(TCFG, target_layer_ids=(0,), block_size=4, mask_token_id=63)
DCFG2 = dflash2_config(DCFG1, conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4)


@jax.jit
def _features(target_w, tokens):
    out = qwen3.forward(target_w, tokens, qwen3.init_cache(TCFG, *tokens.shape), TCFG,
                        tap_layers=DCFG1.target_layer_ids, logits="none")
    return draft_model.context_features(out.taps)


def _blocks(target_w, seed=0, n=4, length=32, a=2):  # the training test's batch shapes: one compiled _features
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 60, (n, length)), jnp.int32)
    anchors = jnp.asarray(sample_anchors(rng, n, a, 1, length - DCFG1.block_size))
    return tokens, _features(target_w, tokens), anchors


@pytest.fixture(scope="module")
def target_w():
    return testing.random_qwen3_weights(TCFG, jax.random.key(3), norm_jitter=0.0)


def test_a_fresh_dflash2_draft_computes_its_dflash1_backbone(target_w):
    """Identity convolutions and a zero successor codebook: the same logits and hidden states as the DFlash 1
    draft, and selector scores equal to the logits (so the selector chain starts as the argmax chain)."""
    w1 = testing.random_draft_weights(DCFG1, jax.random.key(1))
    w2 = as_dflash2(w1, DCFG2, jax.random.key(2))
    tokens, feats, anchors = _blocks(target_w)
    blocks, _ = draft_blocks(tokens, anchors, DCFG1.block_size, DCFG1.mask_token_id)

    @functools.partial(jax.jit, static_argnums=1)
    def forward(w, c):
        logits, hidden = draft_model.draft_forward_blocks(w, c, embed=target_w.embed, lm_head=target_w.lm_head,
                                                          block_tokens=blocks, context_features=feats, anchors=anchors)
        if not c.dflash2:
            return logits, hidden, None
        scores, cands = draft_model.selector_scores(w.branch_head, hidden, jnp.full(hidden.shape[:-1], 5), c,
                                                    embed=target_w.embed, lm_head=target_w.lm_head)
        return logits, hidden, (scores, jnp.take_along_axis(logits, cands, axis=-1))

    logits1, hidden1, _ = forward(w1, DCFG1)
    logits2, hidden2, (scores, candidate_logits) = forward(w2, DCFG2)
    np.testing.assert_array_equal(np.asarray(logits1), np.asarray(logits2))
    np.testing.assert_array_equal(np.asarray(hidden1), np.asarray(hidden2))
    np.testing.assert_array_equal(np.asarray(scores), np.asarray(candidate_logits))
    with pytest.raises(ValueError, match="DFlash 2 config"):
        as_dflash2(w1, DCFG1, jax.random.key(2))
    with pytest.raises(ValueError, match="dflash_loss"):
        dflash2_loss(w1, target_w, tokens, feats, anchors, DCFG2, block_size=4, gamma=3.0)


def test_selector_candidates_are_the_top_k_with_the_target_injected():
    unary = jnp.array([[0.0, 5.0, 4.0, 3.0, 2.0, 1.0], [0.0, 5.0, 4.0, 3.0, 2.0, 1.0]])
    cands, target, present = selector_candidates(unary, jnp.array([2, 5]), 3)
    np.testing.assert_array_equal(np.asarray(cands), [[1, 2, 3], [1, 2, 5]])  # 5 was missing: it replaces the 3rd
    np.testing.assert_array_equal(np.asarray(target), [1, 2])
    np.testing.assert_array_equal(np.asarray(present), [True, False])


def test_selector_refit_examples_give_the_joint_objectives_selector_loss(target_w):
    """The refit's precomputed examples (the draft frozen) score the selector as `dflash2_loss` does on the same
    forward: equal loss and metrics, the target's token injected with its own logit where it is missing; a short
    `fit_selector` on them lowers that loss."""
    cfg = dataclasses.replace(DCFG2, selector_top_k=24)  # a random draft's top-24 of 64 holds some targets
    w2 = as_dflash2(testing.random_draft_weights(DCFG1, jax.random.key(6)), cfg, jax.random.key(7))
    w2 = w2.replace(branch_head=w2.branch_head.replace(
        successor=jax.random.normal(jax.random.key(8), w2.branch_head.successor.shape)))  # a selector that scores
    tokens, feats, anchors = _blocks(target_w, seed=2)
    widths = jnp.asarray(np.random.default_rng(2).choice([2, 3, 4], anchors.shape), jnp.int32)
    logits, hidden, labels, w = scored_blocks(w2, target_w, tokens, feats, anchors, cfg, block_size=4, gamma=3.0,
                                               widths=widths)
    want, want_metrics = selector_loss(w2.branch_head, logits, hidden, labels, w, cfg.selector_top_k)
    examples = selector_examples(w2, target_w, tokens, feats, anchors, cfg, gamma=3.0, widths=widths)
    got, got_metrics = selector_refit_loss(w2.branch_head, examples)
    assert 0 < float(want_metrics["sel_hit"]) < 1  # both injected and present examples
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for k in want_metrics:
        if k.startswith("sel_"):
            np.testing.assert_allclose(float(got_metrics[k]), float(want_metrics[k]), rtol=1e-5)

    scored = np.asarray(examples[-1]) > 0
    data = {k: np.asarray(x)[scored] for k, x in zip(("hidden", "unary", "candidates", "label_logit", "parent",
                                                      "label", "w"), examples)}
    fresh = init_selector(cfg, jax.random.key(9))
    fitted, losses = fit_selector(fresh, data, steps=30, batch=64, learning_rate=3e-2, progress=False)
    batch = tuple(jnp.asarray(data[k]) for k in data)
    assert float(selector_refit_loss(fitted, batch)[0]) < float(selector_refit_loss(fresh, batch)[0])


@pytest.mark.slow
def test_dflash2_training_export_convert_load_round_trip(tmp_path, target_w):
    """A few steps on a learnable stream lower the selector's loss and move the convolutions off the identity;
    the draft exported in the z-lab layout converts with its target and loads equal, as a DFlash 2 draft whose
    conditional head is its selector (its generation is tested in tests/spec/test_dflash2_generate.py)."""
    from convert.cli import convert
    from convert.draft import load_hf_draft
    import dflash_jax
    from dflash_jax.train.export import save_hf_draft, save_hf_target

    w2 = as_dflash2(testing.random_draft_weights(DCFG1, jax.random.key(4), norm_jitter=0.0), DCFG2, jax.random.key(5))
    data = np.tile(np.random.default_rng(1).integers(0, 60, 16), 8)  # a repeating stream: learnable in a few steps

    def batch(step):
        r = np.random.default_rng(step)
        starts = r.integers(0, len(data) - 33, 4)
        tokens = jnp.asarray(np.stack([data[s: s + 32] for s in starts]), jnp.int32)
        return tokens, _features(target_w, tokens), jnp.asarray(sample_anchors(r, 4, 2, 1, 32 - 4))

    cfg = TrainConfig(steps=25, learning_rate=1e-2, warmup_steps=3, log_every=1)
    metric = {}

    def loss(p, b):
        value, aux = dflash2_loss(p, target_w, *b, DCFG2, block_size=4, gamma=3.0)
        return value, {"sel_ce": aux["sel_ce"]}

    sel = jax.jit(lambda p, b: loss(p, b)[1]["sel_ce"])
    metric["before"] = float(sel(w2, batch(1000)))
    trained, losses = train_loop(w2, loss, batch, cfg, checkpoint_dir=None, desc="d2", progress=False)
    metric["after"] = float(sel(trained, batch(1000)))
    assert losses[-1] < 0.5 * losses[0] and metric["after"] < 0.5 * metric["before"], (losses, metric)
    moved = trained.convs[0].attention
    assert float(jnp.abs(moved.projection).max()) > 0 and float(jnp.abs(moved.base[:, 1:]).max()) > 0
    assert float(jnp.abs(trained.branch_head.successor).max()) > 0

    save_hf_target(target_w, TCFG, str(tmp_path / "t"), eos_token_id=62)
    save_hf_draft(trained, DCFG2, str(tmp_path / "d"))
    dcfg, loaded = load_hf_draft(tmp_path / "d")
    assert dcfg == dataclasses.replace(DCFG2, max_position_embeddings=dcfg.max_position_embeddings)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    convert(str(tmp_path / "t"), str(tmp_path / "d"), str(tmp_path / "pair"), expert_format="bf16", dtype="fp32",
            progress=False)
    pair = dflash_jax.load(str(tmp_path / "pair"))
    assert pair.draft_cfg.dflash2 and draft_model.is_selector(pair.draft.branch_head)
    for a, b in zip(jax.tree.leaves(pair.draft), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
