"""Training objectives: the target's language-model loss and the DFlash draft objective.

DFlash objective (one block per (sequence, anchor)):
  - an anchor position s is drawn per block, 1 <= s <= L - B; the block is [x_s, MASK x (B-1)] at
    positions s .. s+B-1;
  - the context is the frozen target's taps at positions strictly before the anchor (0 .. s-1), exactly
    what the draft sees at inference when the target cache holds s committed tokens;
  - attention inside the block is whatever the draft's layers do at inference (bidirectional for
    full-attention layers): `draft_forward_blocks` runs all A blocks of a sequence over one shared
    context projection with the inference masks (tested equal to `draft_forward` block by block);
  - the loss is cross-entropy on slots k = 1 .. B-1 (slot k predicts x_{s+k}), weighted by
    w_k = exp(-(k - 1) / gamma): early slots matter most, since a block is accepted only up to the first
    miss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.config import DraftConfig, Qwen3Config
from dflash_jax.models import draft as draft_model
from dflash_jax.models.family import family_of


def lm_loss(weights, tokens: jax.Array, cfg: Qwen3Config, *, aux_coef: float = 0.01, implementation: str = "auto"):
    """Next-token cross-entropy plus a Switch-style load-balancing loss over the MoE layers:
    `E * sum_e f_e P_e` (f_e: share of routed slots sent to expert e, P_e: mean router probability)."""
    b, t = tokens.shape
    fam = family_of(cfg)  # any registered target family
    cache = fam.init_cache(cfg, b, t, weights.embed.dtype)
    out = fam.forward(weights, tokens, cache, cfg, return_router_logits=True, implementation=implementation)
    logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    aux = jnp.float32(0.0)
    moe = [(e, r) for e, r in zip(out.router_experts, out.router_logits) if e is not None]
    for experts, r_logits in moe:
        num_e = r_logits.shape[-1]
        frac = jnp.mean(jax.nn.one_hot(experts, num_e).sum(-2), axis=(0, 1)) / experts.shape[-1]
        prob = jnp.mean(jax.nn.softmax(r_logits, axis=-1), axis=(0, 1))
        aux = aux + num_e * jnp.sum(frac * prob)
    aux = aux / max(len(moe), 1)
    return ce + aux_coef * aux, {"ce": ce, "balance": aux}


def slot_weights(block_size: int, gamma: float) -> jax.Array:
    """w_k for slots 0..B-1 (slot 0, the anchor, has weight 0)."""
    k = jnp.arange(block_size, dtype=jnp.float32)
    return jnp.where(k >= 1, jnp.exp(-(k - 1) / gamma), 0.0)


def draft_blocks(tokens: jax.Array, anchors: jax.Array, block_size: int, mask_token_id: int):
    """Blocks [x_s, MASK x (B-1)] and labels x_s .. x_{s+B-1} for anchors [n, A] into tokens [n, L]."""
    offsets = anchors[..., None] + jnp.arange(block_size)
    labels = jnp.take_along_axis(tokens[:, None, :], offsets, axis=-1)  # [n, A, B]
    blocks = jnp.where(jnp.arange(block_size) == 0, labels, mask_token_id)
    return blocks.astype(jnp.int32), labels.astype(jnp.int32)


def dflash_loss(draft_w, target_w, tokens: jax.Array, features: jax.Array, anchors: jax.Array,
                dcfg: DraftConfig, *, block_size: int, gamma: float, widths: jax.Array | None = None):
    """tokens [n, L]; features [n, L, F] (the target's taps over tokens); anchors [n, A] with
    1 <= s <= L - B; widths [n, A] (optional): block a is run and scored as a width-w block (slots 1..w-1),
    so one draft learns every block size it will serve. Returns (weighted mean CE over the scored slots,
    {"ce": unweighted CE, "acc1": slot-1 accuracy})."""
    n, _ = tokens.shape
    a = anchors.shape[1]
    blocks, labels = draft_blocks(tokens, anchors, block_size, dcfg.mask_token_id)
    logits, _ = draft_model.draft_forward_blocks(
        draft_w, dcfg, embed=target_w.embed, lm_head=target_w.lm_head, block_tokens=blocks,
        context_features=features, anchors=anchors.astype(jnp.int32), widths=widths)
    logits = logits.reshape(n * a, block_size, -1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, labels.reshape(n * a, -1, 1), axis=-1)[..., 0]  # [n*A, B]
    w = jnp.broadcast_to(slot_weights(block_size, gamma), (n * a, block_size))
    scored = jnp.ones_like(w, bool) if widths is None else jnp.arange(block_size) < widths.reshape(-1, 1)
    scored = scored & (jnp.arange(block_size) >= 1)
    w = jnp.where(scored, w, 0.0)
    loss = jnp.sum(nll * w) / jnp.sum(w)
    pred = jnp.argmax(logits, axis=-1)
    acc1 = jnp.mean(pred[:, 1] == labels.reshape(n * a, -1)[:, 1])
    return loss, {"ce": jnp.sum(jnp.where(scored, nll, 0.0)) / jnp.sum(scored), "acc1": acc1}


def sample_anchors(rng, n: int, per_seq: int, low: int, high: int):
    """Anchor positions uniform in [low, high] (inclusive), independently per block."""
    return rng.integers(low, high + 1, (n, per_seq)).astype("int32")
