"""The DFlash training objective on tiny cases (mask, anchor rule, loss weights), a smoke training run
that lowers the loss, HF export round trips, and the shipped pair."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax import testing
from dflash_jax.models import draft as draft_model
from dflash_jax.models import qwen3
from dflash_jax.train.common import TrainConfig, train_loop
from dflash_jax.train.objectives import dflash_loss, draft_blocks, lm_loss, sample_anchors, slot_weights

TCFG = testing.tiny_qwen3_moe_config(vocab_size=64, num_layers=2, max_position_embeddings=512)
DCFG = testing.tiny_draft_config(TCFG, target_layer_ids=(0,), block_size=4, mask_token_id=63)


def test_blocks_labels_and_weights():
    tokens = jnp.arange(20, dtype=jnp.int32)[None] + 100
    blocks, labels = draft_blocks(tokens, jnp.array([[3, 10]]), 4, mask_token_id=7)
    np.testing.assert_array_equal(np.asarray(blocks[0]), [[103, 7, 7, 7], [110, 7, 7, 7]])
    np.testing.assert_array_equal(np.asarray(labels[0]), [[103, 104, 105, 106], [110, 111, 112, 113]])
    w = np.asarray(slot_weights(4, gamma=2.0))
    np.testing.assert_allclose(w, [0.0, 1.0, np.exp(-0.5), np.exp(-1.0)], rtol=1e-6)
    a = sample_anchors(np.random.default_rng(0), 50, 8, 5, 9)
    assert a.min() == 5 and a.max() == 9


def _features(target_w, tokens):
    out = qwen3.forward(target_w, tokens, qwen3.init_cache(TCFG, *tokens.shape), TCFG,
                        tap_layers=DCFG.target_layer_ids, logits="none")
    return draft_model.context_features(out.taps)


def test_context_is_strictly_before_the_anchor_and_loss_matches_inference():
    """The loss of a block equals the weighted CE of the inference draft forward run on the prefix only:
    tokens at or after the anchor never influence it, except through the anchor token itself."""
    target_w = testing.random_qwen3_weights(TCFG, jax.random.key(0))
    draft_w = testing.random_draft_weights(DCFG, jax.random.key(1))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 60, (1, 24)), jnp.int32)
    s = 9
    loss, _ = dflash_loss(draft_w, target_w, tokens, _features(target_w, tokens), jnp.array([[s]]), DCFG,
                          block_size=4, gamma=3.0)
    # changing the text after the labels changes nothing; changing the context before the anchor does
    later = tokens.at[0, s + 4:].set(0)
    loss_later, _ = dflash_loss(draft_w, target_w, later, _features(target_w, later), jnp.array([[s]]), DCFG,
                                block_size=4, gamma=3.0)
    assert float(loss_later) == pytest.approx(float(loss), abs=1e-6)
    earlier = tokens.at[0, 2].set((int(tokens[0, 2]) + 1) % 60)
    loss_earlier, _ = dflash_loss(draft_w, target_w, earlier, _features(target_w, earlier), jnp.array([[s]]),
                                  DCFG, block_size=4, gamma=3.0)
    assert abs(float(loss_earlier) - float(loss)) > 1e-5
    # the same number from the inference path: prefix-only context, block [x_s, MASK...]
    prefix_feats = _features(target_w, tokens[:, :s])
    block = jnp.array([[int(tokens[0, s]), 63, 63, 63]], jnp.int32)
    logits, _, _ = draft_model.draft_forward(
        draft_w, DCFG, embed=target_w.embed, lm_head=target_w.lm_head, block_tokens=block,
        context_features=prefix_feats, num_context=jnp.array([s]), cache=draft_model.init_draft_cache(DCFG, 1, 32))
    logp = jax.nn.log_softmax(logits[0], axis=-1)
    nll = -np.array([float(logp[k, int(tokens[0, s + k])]) for k in range(4)])
    w = np.asarray(slot_weights(4, 3.0))
    assert float(loss) == pytest.approx(float((nll * w).sum() / w.sum()), rel=1e-5)


def test_smoke_training_lowers_both_losses(tmp_path):
    target_w = testing.random_qwen3_weights(TCFG, jax.random.key(2), norm_jitter=0.0)
    rng = np.random.default_rng(1)
    pattern = rng.integers(0, 60, 16)
    data = np.tile(pattern, 8)  # a repeating stream: learnable in a few steps

    def batch(step):
        r = np.random.default_rng(step)
        starts = r.integers(0, len(data) - 33, 4)
        return jnp.asarray(np.stack([data[s: s + 32] for s in starts]), jnp.int32)

    cfg = TrainConfig(steps=30, learning_rate=1e-2, warmup_steps=3, log_every=1, save_every=15)
    target_w, losses = train_loop(target_w, lambda p, b: lm_loss(p, b, TCFG), batch, cfg,
                                  checkpoint_dir=str(tmp_path / "t"), desc="t", progress=False)
    assert losses[-1] < 0.5 * losses[0]
    # resuming from the final checkpoint does no more steps and returns the same weights
    again, more = train_loop(testing.random_qwen3_weights(TCFG, jax.random.key(9), norm_jitter=0.0),
                             lambda p, b: lm_loss(p, b, TCFG), batch, cfg, checkpoint_dir=str(tmp_path / "t"),
                             desc="t", progress=False)
    assert more == []
    np.testing.assert_array_equal(np.asarray(again.embed), np.asarray(target_w.embed))

    draft_w = testing.random_draft_weights(DCFG, jax.random.key(3), norm_jitter=0.0)

    def draft_batch(step):
        tokens = batch(step)
        anchors = sample_anchors(np.random.default_rng(step), 4, 2, 1, 32 - 4)
        return tokens, _features(target_w, tokens), jnp.asarray(anchors)

    def loss(p, b):
        return dflash_loss(p, target_w, *b, DCFG, block_size=4, gamma=3.0)

    _, dlosses = train_loop(draft_w, loss, draft_batch, dataclasses_replace(cfg, steps=40), checkpoint_dir=None,
                            desc="d", progress=False)
    assert dlosses[-1] < 0.5 * dlosses[0]


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def test_hf_export_round_trip(tmp_path):
    """Exported weights load back through the HF loaders bit for bit (and transformers reads the target)."""
    from convert.draft import load_hf_draft
    from convert import load_hf_target
    from dflash_jax.train.export import save_hf_draft, save_hf_target

    target_w = testing.random_qwen3_weights(TCFG, jax.random.key(4))
    draft_w = testing.random_draft_weights(DCFG, jax.random.key(5))
    save_hf_target(target_w, TCFG, str(tmp_path / "t"), eos_token_id=62)
    save_hf_draft(draft_w, DCFG, str(tmp_path / "d"))
    cfg, loaded = load_hf_target(tmp_path / "t")
    assert cfg.moe == TCFG.moe and cfg.eos_token_ids == (62,)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(target_w)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    dcfg, dloaded = load_hf_draft(tmp_path / "d")
    assert dcfg.target_layer_ids == DCFG.target_layer_ids and dcfg.block_size == 4
    for a, b in zip(jax.tree.leaves(dloaded), jax.tree.leaves(draft_w)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # (fast-set time: the mechanism is covered by a faster test)
def test_hf_export_round_trip_qwen3_5(tmp_path):
    """A Qwen3.5-MoE target (DeltaNet + gated attention, shared expert) exports in the layout transformers
    writes: it loads back bit for bit and transformers' own model of the directory gives our logits."""
    import torch

    from convert import load_hf_target
    from dflash_jax.config import RopeConfig, MoEConfig
    from dflash_jax.models.qwen3_5.config import Qwen3_5Config
    from dflash_jax.models.family import family_of
    from dflash_jax.train.export import save_hf_target
    from tests.hf_reference import hf_forward

    cfg = Qwen3_5Config(
        vocab_size=96, hidden_size=64, num_layers=3, layer_types=("linear_attention", "full_attention",
                                                                  "linear_attention"),
        num_heads=4, num_kv_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=16,
                                                                       norm_topk_prob=True),
        shared_expert_intermediate_size=24, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0, rotary_dim=8),
        max_position_embeddings=512, eos_token_ids=(90,))
    fam = family_of(cfg)
    weights = fam.random_weights(cfg, jax.random.key(7))
    save_hf_target(weights, cfg, str(tmp_path / "t"), eos_token_id=90)
    loaded_cfg, loaded = load_hf_target(tmp_path / "t")
    assert loaded_cfg == cfg
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(weights)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, 96, (1, 40))
    want = hf_forward(hf, tokens)[0]
    cache = fam.init_cache(cfg, 1, 64, verify_width=0)
    got = fam.forward(weights, jnp.asarray(tokens, jnp.int32), cache, cfg).logits
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=2e-4)


SHIPPED = dflash_jax.SHIPPED_PAIR


def test_shipped_pair_is_small_and_loads():
    import dflash_jax

    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(SHIPPED) for f in fs)
    assert 0 < size <= 25 * 2**20
    pair = dflash_jax.load(SHIPPED)
    assert pair.expert_format == "mxfp4" and pair.tokenizer_path
    assert pair.target_cfg.moe.num_experts == 8 and pair.target_cfg.moe.top_k == 2
    split = json.load(open(os.path.join(SHIPPED, "split.json")))
    assert split["held_out_files"] and split["train_files"] > 10 * len(split["held_out_files"])
    # nothing in it names the machine it was built on (`train.tiny_pair.make_portable`)
    for d, _, fs in os.walk(SHIPPED):
        assert "commit_success.txt" not in fs
    sources = json.load(open(os.path.join(SHIPPED, "manifest.json")))["sources"]
    assert not os.path.isabs(sources["target"]) and not os.path.isabs(sources["draft"])


def test_dflash_generate_default_pair_prints_code(capsys):
    """With no --checkpoint the CLI runs the shipped pair: its output is the shipped target's own greedy
    continuation of the prompt (up to its eos), decoded by the shipped tokenizer, the trained draft is
    accepted, and what follows `def fib(n):` is an indented function body, as in the code it was trained on."""
    import dflash_jax
    from dflash_jax.cli.generate import load_tokenizer, main
    from dflash_jax.decode import greedy_generate

    assert main(["--prompt", "def fib(n):", "--max-new-tokens", "48", "--json", "--block-size", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    pair = dflash_jax.load(SHIPPED)
    tokenizer = load_tokenizer(pair)
    prompt = tokenizer.encode("def fib(n):", add_special_tokens=False).ids
    assert out["stats"]["prompt_tokens"] == len(prompt)
    want = greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=48,
                           stop_ids=pair.target_cfg.eos_token_ids)[0]
    assert out["tokens"] == want and len(want) >= 8
    assert out["text"] == tokenizer.decode(want)
    assert out["text"].startswith("\n    ")  # the def's body: a new line, indented four spaces
    assert out["stats"]["mean_acceptance"] > 1.5  # the trained draft is accepted


@pytest.mark.parametrize("variant", [
    {},                                                         # full attention, bidirectional block
    {"layer_windows": (None, 6)},                               # a sliding layer whose window hides context
    {"layer_windows": (5, 5), "layer_causal": (True, True)},    # causal, windowed
    {"attention_bias": True, "layer_causal": (False, True)},
])
def test_packed_blocks_equal_the_inference_forward_block_by_block(variant):
    """`draft_forward_blocks` (all anchors of a sequence over one shared context) gives, for every block,
    the logits of `draft_forward` run on that block alone with only the context before its anchor."""
    dcfg = testing.tiny_draft_config(TCFG, target_layer_ids=(0,), block_size=4, mask_token_id=63, **variant)
    target_w = testing.random_qwen3_weights(TCFG, jax.random.key(0))
    draft_w = testing.random_draft_weights(dcfg, jax.random.key(1))
    if dcfg.attention_bias:  # non-zero biases, so a dropped bias term would show
        draft_w = jax.tree.map(lambda a: a + 0.05 if a.ndim == 1 else a, draft_w)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 60, (2, 40)), jnp.int32)
    anchors = jnp.array([[1, 9, 9, 30], [36, 17, 3, 22]], jnp.int32)  # repeats and overlapping blocks too
    feats = _features(target_w, tokens)
    blocks, _ = draft_blocks(tokens, anchors, 4, 63)
    logits, hidden = draft_model.draft_forward_blocks(
        draft_w, dcfg, embed=target_w.embed, lm_head=target_w.lm_head, block_tokens=blocks,
        context_features=feats, anchors=anchors)
    assert logits.shape == (2, 4, 4, 64) and hidden.shape == (2, 4, 4, dcfg.hidden_size)
    for i in range(2):
        for a in range(4):
            s = int(anchors[i, a])
            ref, ref_hidden, _ = draft_model.draft_forward(
                draft_w, dcfg, embed=target_w.embed, lm_head=target_w.lm_head, block_tokens=blocks[i:i + 1, a],
                context_features=feats[i:i + 1], num_context=jnp.array([s]),  # rows >= s: padding
                cache=draft_model.init_draft_cache(dcfg, 1, 48))
            np.testing.assert_allclose(np.asarray(logits[i, a]), np.asarray(ref[0]), atol=2e-5, rtol=1e-5)
            np.testing.assert_allclose(np.asarray(hidden[i, a]), np.asarray(ref_hidden[0]), atol=2e-5, rtol=1e-5)


def test_packed_blocks_of_mixed_widths_equal_inference_at_each_width():
    """A block trained as width w sees only its first w slots: its outputs there equal the inference forward
    of a width-w block; and the loss scores exactly those slots."""
    dcfg = testing.tiny_draft_config(TCFG, target_layer_ids=(0,), block_size=4, mask_token_id=63)
    target_w = testing.random_qwen3_weights(TCFG, jax.random.key(0))
    draft_w = testing.random_draft_weights(dcfg, jax.random.key(1))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 60, (1, 30)), jnp.int32)
    anchors = jnp.array([[5, 5, 12, 20]], jnp.int32)
    widths = jnp.array([[2, 4, 3, 2]], jnp.int32)
    feats = _features(target_w, tokens)
    blocks, labels = draft_blocks(tokens, anchors, 4, 63)
    logits, _ = draft_model.draft_forward_blocks(
        draft_w, dcfg, embed=target_w.embed, lm_head=target_w.lm_head, block_tokens=blocks,
        context_features=feats, anchors=anchors, widths=widths)
    expected_nll, weights = [], np.asarray(slot_weights(4, 3.0))
    for a in range(4):
        s, w = int(anchors[0, a]), int(widths[0, a])
        ref, _, _ = draft_model.draft_forward(
            draft_w, dcfg, embed=target_w.embed, lm_head=target_w.lm_head, block_tokens=blocks[:, a, :w],
            context_features=feats, num_context=jnp.array([s]), cache=draft_model.init_draft_cache(dcfg, 1, 40))
        np.testing.assert_allclose(np.asarray(logits[0, a, :w]), np.asarray(ref[0]), atol=2e-5, rtol=1e-5)
        logp = jax.nn.log_softmax(ref[0], axis=-1)
        expected_nll += [(weights[k], -float(logp[k, int(labels[0, a, k])])) for k in range(1, w)]
    loss, aux = dflash_loss(draft_w, target_w, tokens, feats, anchors, dcfg, block_size=4, gamma=3.0, widths=widths)
    wsum = sum(w for w, _ in expected_nll)
    assert float(loss) == pytest.approx(sum(w * v for w, v in expected_nll) / wsum, rel=1e-5)
    assert float(aux["ce"]) == pytest.approx(np.mean([v for _, v in expected_nll]), rel=1e-5)


def _assert_quick_training_lowered_the_losses(work, recipe):
    """Both exported models score better than their initializations on the same data: the target's LM loss on
    training-text windows (measured 7.42 -> 7.17 nats), the draft's DFlash loss on the target's continuations
    (7.21 -> 6.55)."""
    from convert import load_hf_target
    from convert.draft import load_hf_draft
    from dflash_jax.train.tiny_pair import target_config

    tcfg, target = load_hf_target(work / "hf_target")
    dcfg, draft = load_hf_draft(work / "hf_draft")
    target0 = testing.random_qwen3_weights(target_config(recipe.num_experts, recipe.top_k, recipe.expert_intermediate),
                                           jax.random.key(recipe.seed), norm_jitter=0.0)
    draft0 = testing.random_draft_weights(dcfg, jax.random.key(recipe.seed + 1), norm_jitter=0.0)
    stream = np.load(work / "train_tokens.npy")
    starts = np.random.default_rng(123).integers(0, len(stream) - 65, 8)
    windows = jnp.asarray(np.stack([stream[s: s + 64] for s in starts]), jnp.int32)
    before, after = float(lm_loss(target0, windows, tcfg)[0]), float(lm_loss(target, windows, tcfg)[0])
    assert after < before - 0.1, (before, after)
    tokens = jnp.asarray(np.load(work / "continuations.npy"), jnp.int32)
    taps = qwen3.forward(target, tokens, qwen3.init_cache(tcfg, *tokens.shape), tcfg,
                         tap_layers=dcfg.target_layer_ids, logits="none").taps
    anchors = jnp.asarray(sample_anchors(np.random.default_rng(5), len(tokens), 2, recipe.prompt_len - 1,
                                         tokens.shape[1] - dcfg.block_size))
    before, after = (float(dflash_loss(w, target, tokens, draft_model.context_features(taps), anchors, dcfg,
                                       block_size=dcfg.block_size, gamma=recipe.gamma)[0]) for w in (draft0, draft))
    assert after < before - 0.3, (before, after)


@pytest.mark.slow
def test_quick_recipe_runs_every_stage_and_the_pair_generates(tmp_path):
    """examples/train_tiny_pair.py's pipeline at toy sizes: tokenizer, target, continuations, draft (packed
    blocks at mixed widths), export, convert; the converted pair loads and decodes losslessly."""
    import dataclasses

    import dflash_jax
    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec import generate
    from convert.cli import convert
    from dflash_jax.train.tiny_pair import Recipe, train_tiny_pair

    with pytest.raises(ValueError, match="convert="):  # dflash_jax never imports the converter: it is passed in
        train_tiny_pair(str(tmp_path / "bad"), str(tmp_path / "pair"), recipe=Recipe.quick(), progress=False)
    with pytest.raises(ValueError, match="block_widths"):
        train_tiny_pair(str(tmp_path / "bad"), None, recipe=dataclasses.replace(Recipe.quick(), block_widths=(1, 32)),
                        progress=False)
    summary = train_tiny_pair(str(tmp_path / "work"), str(tmp_path / "pair"), recipe=Recipe.quick(), progress=False,
                              convert=convert)
    for name in ("target_loss", "draft_loss"):  # the last step's loss is logged, a finite number
        assert len(summary[name]["last"]) == 1 and np.isfinite(summary[name]["last"][0]), summary[name]
    _assert_quick_training_lowered_the_losses(tmp_path / "work", Recipe.quick())
    pair = dflash_jax.load(str(tmp_path / "pair"))
    assert json.load(open(tmp_path / "pair" / "manifest.json"))["sources"]["target"] == "hf_target"
    prompt = list(range(5, 25))
    want = greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=12)
    assert generate(pair, [prompt], max_new_tokens=12, block_size=4).tokens == want
