"""Acceptance rules for a verified block.

Shapes: proposals [b, B-1] (the draft tokens d_1..d_{B-1}); target rows [b, B, V] where row j is the
target's distribution for the token after block slot j (slot 0 = the anchor). Each rule returns
(accepted [b] in [0, B-1], bonus [b]): the committed continuation is d_1..d_a followed by the bonus.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.spec.sampling import sample_probs_rows


def _prefix_length(matches: jax.Array) -> jax.Array:
    return jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def match_accept(proposals: jax.Array, target_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Longest prefix where d_{j+1} equals the target's token at row j; bonus = the target's token at row a.

    With target_tokens = argmax rows this is greedy verification; with target_tokens sampled per row it is
    the lossless exact-match rule for sampling (every emitted token is the target's own draw given the
    committed prefix)."""
    accepted = _prefix_length(proposals == target_tokens[:, :-1])
    bonus = jnp.take_along_axis(target_tokens, accepted[:, None], axis=1)[:, 0]
    return accepted, bonus


def rejection_accept(
    keys: jax.Array, proposals: jax.Array, target_probs: jax.Array, draft_probs: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling. target_probs [b, B, V] (p), draft_probs [b, B-1, V] (q, the distributions the
    proposals were drawn from); keys [b], one per sequence (its draws do not depend on the batch). Row j
    accepts d_{j+1} with probability min(1, p_j(d) / q_j(d)); the first rejected row a draws the bonus from
    normalize(max(p_a - q_a, 0)) (p_a if that is all zero); when all B-1 are accepted the bonus is drawn
    from p_{B-1}. The emitted tokens are distributed exactly as p."""
    b, gamma = proposals.shape
    split = jax.vmap(jax.random.split)(keys)
    k_u, k_bonus = split[:, 0], split[:, 1]
    p = jnp.take_along_axis(target_probs[:, :gamma], proposals[..., None], axis=-1)[..., 0]
    q = jnp.take_along_axis(draft_probs, proposals[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(k_u)
    accepted = _prefix_length(u * q < p)
    rows = jnp.arange(b)
    p_a = target_probs[rows, accepted]
    q_a = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)[rows, accepted]
    residual = jnp.maximum(p_a - q_a, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(total > 0, residual / jnp.maximum(total, 1e-38), p_a)
    return accepted, sample_probs_rows(k_bonus, residual)
