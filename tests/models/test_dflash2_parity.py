"""DFlash 2 draft parity against z-lab's reference `dflash.model.DFlash2DraftModel` (fp32, tiny random models).

The draft is a tiny random `DFlash2DraftModel` (a sliding-window layer and a full one; convolution kernels of 3
taps far from the identity; random codebooks) saved in the release layout and read back with
`convert.draft.load_hf_draft`. The target is a tiny random Qwen3-MoE whose HF hidden states give the context
features, as the reference's `extract_context_feature` builds them; prompts of 300 tokens exercise RoPE.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
reference = pytest.importorskip("dflash.model")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from convert.draft import load_hf_draft  # noqa: E402
from convert.errors import CheckpointError  # noqa: E402
from dflash_jax import testing  # noqa: E402
from dflash_jax.config import ConfigError, from_hf_config  # noqa: E402
from dflash_jax.models import draft, qwen3  # noqa: E402
from dflash_jax.train.objectives import draft_blocks  # noqa: E402
from tests.hf_reference import (  # noqa: E402
    build_and_save, build_and_save_dflash2_draft, tiny_dflash2_config, tiny_qwen3_moe_config,
)

FP32_TOL = 1e-4
B = 8
MASK = 159
TAPS = (0, 2)
TARGET_LAYERS = 4
PROMPT = 300
CACHE_LEN = 512
VARIANTS = {
    "sliding": {},
    # the reference's optional logit multiplier and soft cap feed the selector's unary scores
    "scaled": dict(layer_types=["full_attention", "sliding_attention"],
                   dflash_config={"input_embedding_scale": 1.3, "output_multiplier": 0.7,
                                  "final_logit_softcapping": 3.0},
                   dflash2={"conv_kernel_size": 2, "conv_group_size": 8, "selector_top_k": 9}),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    hf = build_and_save(tiny_qwen3_moe_config(num_hidden_layers=TARGET_LAYERS), d, seed=11)
    return dict(hf=hf, dir=d, embed=hf.get_input_embeddings().weight.detach().numpy(),
                lm_head=hf.lm_head.weight.detach().numpy().T)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            d = tmp_path_factory.mktemp(f"dflash2_{name}")
            hf = build_and_save_dflash2_draft(
                tiny_dflash2_config(target_layers=TARGET_LAYERS, taps=TAPS, mask_token_id=MASK, block_size=B,
                                    **VARIANTS[name]), d, seed=21 + len(built))
            cfg, weights = load_hf_draft(d, "fp32")
            built[name] = (hf, cfg, weights, d)
        return built[name]

    return get


def _max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def _record_generate(hf_draft, target, prompt, temperature=0.0, seed=0):
    """Runs the reference's own `dflash_generate`, recording every draft call (inputs and hidden) and every
    `propose` (its hidden input, anchor and outputs)."""
    calls, proposals = [], []
    forward, propose = hf_draft.forward, hf_draft.propose

    def recording_forward(**kwargs):
        out = forward(**kwargs)
        calls.append({k: kwargs[k].clone() for k in ("target_hidden", "noise_embedding", "position_ids")}
                     | {"hidden": out.clone()})
        return out

    def recording_propose(hidden, anchor_ids, output_head, temperature):
        tokens, indices, probs = propose(hidden, anchor_ids, output_head, temperature)
        proposals.append(dict(hidden=hidden.clone(), anchor=anchor_ids.clone(), tokens=tokens.clone(),
                              indices=indices.clone(), probs=None if probs is None else probs.clone()))
        return tokens, indices, probs

    hf_draft.forward, hf_draft.propose = recording_forward, recording_propose
    try:
        torch.manual_seed(seed)
        out = reference.dflash_generate(hf_draft, target["hf"], torch.as_tensor(prompt[None]), max_new_tokens=30,
                                        stop_token_ids=None, temperature=temperature, return_stats=False)
    finally:
        del hf_draft.forward, hf_draft.propose
    return out[0].numpy(), calls, proposals


def _our_hidden(cfg, weights, target, call, cache):
    """Our draft forward on one recorded reference call: its context rows appended to `cache`, its block."""
    ctx = call["target_hidden"][0].numpy()
    width = call["noise_embedding"].shape[1]
    embed = target["embed"]
    # the block's tokens: the embedding rows the reference used (its anchor, then MASK)
    noise = call["noise_embedding"][0].numpy() / cfg.input_embedding_scale
    anchor = int(np.argmin(np.abs(embed - noise[0]).sum(-1)))
    block = np.array([[anchor] + [cfg.mask_token_id] * (width - 1)], np.int32)
    np.testing.assert_allclose(embed[block[0]], noise, atol=1e-5)
    features = np.zeros((1, max(len(ctx), 1), ctx.shape[1]), np.float32)
    features[0, :len(ctx)] = ctx
    logits, hidden, cache = draft.draft_forward_jit(
        weights, cfg, embed=jnp.asarray(embed), lm_head=jnp.asarray(target["lm_head"]),
        block_tokens=jnp.asarray(block), context_features=jnp.asarray(features),
        num_context=jnp.asarray([len(ctx)], jnp.int32), cache=cache)
    return logits, hidden, cache, anchor


@jax.jit(static_argnames=("cfg",))
def _greedy_path(selector, hidden, anchor, cfg, embed, head):
    """The selector's greedy path over hidden [D, H], one position after another from the anchor."""

    def step(prev, h):
        token = jnp.argmax(draft.selector_logits(selector, h, prev, cfg, embed=embed, lm_head=head)).astype(jnp.int32)
        return token, token

    return jax.lax.scan(step, anchor, hidden)[1]


_VARIANT_PARAMS = [pytest.param(name, marks=[pytest.mark.slow] if name != "sliding" else []) for name in VARIANTS]


@pytest.mark.parametrize("name", _VARIANT_PARAMS)
def test_hidden_states_and_greedy_path_equal_reference_generate(name, target, drafts):
    """Every draft call of the reference's greedy `dflash_generate`: our hidden states equal its, and the
    selector's greedy path from the anchor (ours, on our hidden states) equals what its `propose` returned."""
    hf_draft, cfg, weights, _ = drafts(name)
    assert cfg.dflash2 and weights.convs is not None and draft.is_selector(weights.branch_head)
    prompt = np.random.default_rng(0).integers(0, MASK, PROMPT)
    _, calls, proposals = _record_generate(hf_draft, target, prompt)
    assert len(calls) == len(proposals) >= 3
    cache = draft.init_draft_cache(cfg, 1, CACHE_LEN)
    embed, head = jnp.asarray(target["embed"]), jnp.asarray(target["lm_head"])
    off_unary = 0
    for n, (call, prop) in enumerate(zip(calls, proposals)):
        _, hidden, cache, anchor = _our_hidden(cfg, weights, target, call, cache)
        assert _max_err(hidden[0], call["hidden"][0].numpy()) < FP32_TOL, n
        assert int(prop["anchor"][0]) == anchor
        path = np.asarray(_greedy_path(weights.branch_head, hidden[0, 1:], jnp.int32(anchor), cfg, embed, head))
        assert path.tolist() == prop["tokens"][0].tolist(), n
        unary = np.asarray(draft.draft_logits(hidden[0, 1:], cfg, embed=embed, lm_head=head)).argmax(-1)
        off_unary += int(np.sum(unary != np.asarray(path)))
    assert off_unary > 0  # the pairwise term changes choices: the test sees the selector, not the argmax


@pytest.mark.slow
@pytest.mark.parametrize("name", _VARIANT_PARAMS)
def test_candidates_and_sampled_q_rows_equal_reference(name, target, drafts):
    """A sampled `dflash_generate` (temperature 0.8): per round, our candidates and q rows, computed on the
    reference's hidden states and given its drawn predecessors, equal its `select`'s q rows (scattered into
    the vocabulary by its indices)."""
    hf_draft, cfg, weights, _ = drafts(name)
    prompt = np.random.default_rng(1).integers(0, MASK, PROMPT)
    temperature = 0.8
    _, _, proposals = _record_generate(hf_draft, target, prompt, temperature=temperature, seed=3)
    assert len(proposals) >= 3
    embed, head = jnp.asarray(target["embed"]), jnp.asarray(target["lm_head"])
    for n, prop in enumerate(proposals):
        hidden = jnp.asarray(prop["hidden"][0].numpy())  # [D, H]
        drawn = prop["tokens"][0].numpy()
        parents = jnp.asarray(np.concatenate([prop["anchor"].numpy(), drawn[:-1]]), jnp.int32)
        scores, candidates = draft.selector_scores(weights.branch_head, hidden, parents, cfg, embed=embed,
                                                   lm_head=head)
        ref_indices, ref_q = prop["indices"][0].numpy(), prop["probs"][0].numpy()
        np.testing.assert_array_equal(np.sort(np.asarray(candidates), -1), np.sort(ref_indices, -1))
        ours = np.asarray(jax.nn.softmax(draft.selector_logits(weights.branch_head, hidden, parents, cfg, embed=embed,
                                                               lm_head=head) / temperature, axis=-1))
        theirs = np.zeros_like(ours)
        np.put_along_axis(theirs, ref_indices, ref_q, axis=-1)
        assert _max_err(ours, theirs) < 1e-5, n
        assert np.all(theirs[np.arange(len(drawn)), drawn] > 0)  # each draw is one of its row's candidates


def test_release_and_save_pretrained_layouts_convert_alike(drafts, tmp_path):
    """Codebooks stored without `.weight` (the release) or with it (`save_pretrained`) convert to the same
    weights; a missing or misshapen DFlash 2 tensor is refused naming it."""
    from safetensors.torch import load_file, save_file

    hf, cfg, weights, d = drafts("sliding")
    tensors = load_file(os.path.join(d, "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in tensors  # the release layout
    with_weight = tmp_path / "with_weight"
    with_weight.mkdir()
    for f in os.listdir(d):
        if f != "model.safetensors":
            (with_weight / f).write_bytes((d / f).read_bytes())
    renamed = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in tensors.items()}
    save_file(renamed, str(with_weight / "model.safetensors"), metadata={"format": "pt"})
    cfg2, weights2 = load_hf_draft(with_weight, "fp32")
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(weights2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for broken, match in ((lambda t: t.pop("layers.1.mlp_conv.base_kernel"), "mlp_conv.base"),
                          (lambda t: t.update({"candidate_selector.hidden_projection.weight": torch.zeros(3, 64)}),
                           "hidden_projection")):
        bad = dict(tensors)
        broken(bad)
        save_file(bad, str(with_weight / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=match):
            load_hf_draft(with_weight, "fp32")


def test_dflash2_fields_validated():
    """The DFlash 2 fields: positive integers, the group size divides the hidden size, top-k <= the vocabulary;
    DFlash 2 fields on a DFlash 1 config (or none on a DFlash 2 config) are one error naming the field."""
    tcfg = testing.tiny_qwen3_moe_config()
    fields = dict(version=2, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    cfg = testing.tiny_draft_config(tcfg, **fields)
    assert cfg.dflash2 and not testing.tiny_draft_config(tcfg).dflash2
    for patch, match in (({"conv_group_size": 24}, "must divide hidden_size"),
                         ({"selector_top_k": 513}, "exceeds vocab_size"),
                         ({"selector_rank": 0}, "selector_rank must be a positive integer"),
                         ({"conv_kernel_size": None}, "needs conv_kernel_size"),
                         ({"version": 1}, "conv_kernel_size is a DFlash 2 field"),
                         ({"version": 3}, "version is 1")):
        with pytest.raises(ConfigError, match=match):
            dataclasses.replace(cfg, **patch)
    raw = tiny_dflash2_config(target_layers=TARGET_LAYERS).to_dict()
    parsed = from_hf_config(raw)
    assert (parsed.version, parsed.conv_kernel_size, parsed.conv_group_size, parsed.selector_rank,
            parsed.selector_top_k) == (2, 3, 16, 8, 6)
    raw["dflash_config"]["selector_top_k"] = "6"
    with pytest.raises(ConfigError, match="selector_top_k"):
        from_hf_config(raw)


@pytest.mark.slow
def test_packed_blocks_keep_the_convolution_inside_each_block():
    """`draft_forward_blocks` (the training form) on a DFlash 2 draft: every block equals the inference forward
    of that block alone, so no convolution tap crosses into the previous block."""
    tcfg = testing.tiny_qwen3_moe_config(vocab_size=64, num_layers=2, max_position_embeddings=512)
    dcfg = testing.tiny_draft_config(tcfg, target_layer_ids=(0,), block_size=4, mask_token_id=63,
                                     layer_windows=(None, 6), version=2, conv_kernel_size=3, conv_group_size=16,
                                     selector_rank=8, selector_top_k=5)
    target_w = testing.random_qwen3_weights(tcfg, jax.random.key(0))
    draft_w = testing.random_draft_weights(dcfg, jax.random.key(1))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 60, (1, 40)), jnp.int32)
    out = qwen3.forward(target_w, tokens, qwen3.init_cache(tcfg, *tokens.shape), tcfg,
                        tap_layers=dcfg.target_layer_ids, logits="none")
    feats = draft.context_features(out.taps)
    anchors = jnp.array([[3, 7, 11, 20]], jnp.int32)  # adjacent blocks: a leaking tap would read its neighbour
    blocks, _ = draft_blocks(tokens, anchors, 4, 63)
    blocks = blocks.at[:, :, 1:].set(jnp.asarray(np.random.default_rng(2).integers(0, 60, (1, 4, 3)), jnp.int32))
    blocks_jit = jax.jit(draft.draft_forward_blocks, static_argnames=("cfg",))
    logits, hidden = blocks_jit(draft_w, dcfg, embed=target_w.embed, lm_head=target_w.lm_head,
                                block_tokens=blocks, context_features=feats, anchors=anchors)
    for a in range(4):
        ref, ref_hidden, _ = draft.draft_forward_jit(
            draft_w, dcfg, embed=target_w.embed, lm_head=target_w.lm_head, block_tokens=blocks[:, a],
            context_features=feats, num_context=anchors[:, a], cache=draft.init_draft_cache(dcfg, 1, 48))
        np.testing.assert_allclose(np.asarray(hidden[0, a]), np.asarray(ref_hidden[0]), atol=2e-5, rtol=1e-5)
