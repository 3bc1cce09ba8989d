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

DFlash 2 drafts (`dflash2_loss`) add their candidate selector's objective on the same forward: at every scored
slot k the candidates are the top-K tokens of the draft's logits (K = `selector_top_k`), the target's token x_{s+k}
replacing the last candidate when it is not among them (so every example has a right answer among the K), and the
loss is the K-way cross-entropy of the selector's scores `score(c | x_{s+k-1})` (teacher-forced: the predecessor
is the target's token, the anchor for k = 1) at the target's token, weighted by the same w_k. The candidate set
is chosen without gradient; the scores' unary part is the draft's logits, so the selector's loss trains the draft
too (jointly with its own loss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.models.draft.config import DraftConfig
from dflash_jax.models.qwen3.config import Qwen3Config
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
    logits, _, labels, w = scored_blocks(draft_w, target_w, tokens, features, anchors, dcfg, block_size=block_size,
                                          gamma=gamma, widths=widths)
    return _block_ce(logits, labels, w)


def scored_blocks(draft_w, target_w, tokens, features, anchors, dcfg: DraftConfig, *, block_size: int, gamma: float,
                   widths):
    """The training forward: (logits [N, B, V], hidden [N, B, H], labels [N, B], slot weights [N, B] with 0 on
    the slots not scored), N = n * A blocks."""
    n, _ = tokens.shape
    a = anchors.shape[1]
    blocks, labels = draft_blocks(tokens, anchors, block_size, dcfg.mask_token_id)
    logits, hidden = draft_model.draft_forward_blocks(
        draft_w, dcfg, embed=target_w.embed, lm_head=target_w.lm_head, block_tokens=blocks,
        context_features=features, anchors=anchors.astype(jnp.int32), widths=widths)
    w = jnp.broadcast_to(slot_weights(block_size, gamma), (n * a, block_size))
    scored = jnp.ones_like(w, bool) if widths is None else jnp.arange(block_size) < widths.reshape(-1, 1)
    scored = scored & (jnp.arange(block_size) >= 1)
    return (logits.reshape(n * a, block_size, -1), hidden.reshape(n * a, block_size, -1),
            labels.reshape(n * a, block_size), jnp.where(scored, w, 0.0))


def _block_ce(logits, labels, w):
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]  # [N, B]
    loss = jnp.sum(nll * w) / jnp.sum(w)
    scored = w > 0
    acc1 = jnp.mean(jnp.argmax(logits[:, 1], axis=-1) == labels[:, 1])
    return loss, {"ce": jnp.sum(jnp.where(scored, nll, 0.0)) / jnp.sum(scored), "acc1": acc1}


def selector_candidates(unary: jax.Array, label: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """The training candidates at positions with logits `unary` [..., V] and target tokens `label` [...]: the
    top-K of the logits, the last replaced by the target's token when it is not among them. Returns
    (candidates [..., K] int32, the target's index among them [...], whether it was among the top-K [...])."""
    _, candidates = jax.lax.top_k(jax.lax.stop_gradient(unary), top_k)
    candidates = candidates.astype(jnp.int32)
    label = label.astype(jnp.int32)
    present = jnp.any(candidates == label[..., None], axis=-1)
    candidates = candidates.at[..., -1].set(jnp.where(present, candidates[..., -1], label))
    return candidates, jnp.argmax(candidates == label[..., None], axis=-1), present


def selector_loss(selector: draft_model.SelectorWeights, logits: jax.Array, hidden: jax.Array, labels: jax.Array,
                  w: jax.Array, top_k: int):
    """The candidate selector's K-way cross-entropy (module doc) over blocks: logits [N, B, V] (the draft's
    processed logits: the unary scores), hidden [N, B, H] (final-normed), labels [N, B] (the target's tokens,
    slot 0 the anchor), w [N, B] slot weights (0: not scored). Returns (loss, {"sel_ce", "sel_acc": the share of
    scored slots whose best-scoring candidate is the target's token, "sel_hit": the share whose target token is
    among the top-K without injection})."""
    unary, label, parent = logits[:, 1:], labels[:, 1:], labels[:, :-1]
    candidates, target, hit = selector_candidates(unary, label, top_k)
    scores = jnp.take_along_axis(unary, candidates, axis=-1) + draft_model.selector_transition(
        selector, hidden[:, 1:], parent, candidates)
    nll = jax.nn.logsumexp(scores, axis=-1) - jnp.take_along_axis(scores, target[..., None], axis=-1)[..., 0]
    w = w[:, 1:]
    scored = w > 0
    mean = lambda x: jnp.sum(jnp.where(scored, x, 0.0)) / jnp.sum(scored)  # noqa: E731
    return jnp.sum(nll * w) / jnp.sum(w), {"sel_ce": mean(nll), "sel_acc": mean(jnp.argmax(scores, -1) == target),
                                           "sel_hit": mean(hit)}


def dflash2_loss(draft_w, target_w, tokens: jax.Array, features: jax.Array, anchors: jax.Array, dcfg: DraftConfig, *,
                 block_size: int, gamma: float, widths: jax.Array | None = None, selector_weight: float = 1.0):
    """A DFlash 2 draft's objective: `dflash_loss` on its blocks plus `selector_weight` times its selector's
    `selector_loss` on the same forward (arguments as `dflash_loss`). Returns (loss, the metrics of both)."""
    if not dcfg.dflash2 or not draft_model.is_selector(draft_w.branch_head):
        raise ValueError("dflash2_loss trains a DFlash 2 draft (version 2 config, weights with a SelectorWeights "
                         "head); a DFlash 1 draft trains with dflash_loss")
    logits, hidden, labels, w = scored_blocks(draft_w, target_w, tokens, features, anchors, dcfg,
                                               block_size=block_size, gamma=gamma, widths=widths)
    draft_part, metrics = _block_ce(logits, labels, w)
    sel_part, sel_metrics = selector_loss(draft_w.branch_head, logits, hidden, labels, w, dcfg.selector_top_k)
    return draft_part + selector_weight * sel_part, {**metrics, **sel_metrics}


def sample_anchors(rng, n: int, per_seq: int, low: int, high: int):
    """Anchor positions uniform in [low, high] (inclusive), independently per block."""
    return rng.integers(low, high + 1, (n, per_seq)).astype("int32")
