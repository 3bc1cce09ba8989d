"""The learned route-ahead model: per MoE layer a linear map from the draft's hidden states to the target
layer's routing. What `predictors.LearnedRouter` runs; `train.route_predictor` fits its weights.

Model (`LinearRouteWeights`): `logits_l = RMSNorm_l(h) @ W_l + b_l` with RMSNorm_l the target layer's
post-attention norm as an effective fp32 scale (`ModelFamily.linear_router`: w, or 1 + w for Qwen3.5's
zero-centred norms); `init_from_target` starts W_l at the target's router and b_l at its router bias (gpt-oss; 0
otherwise), so step 0 reproduces each family's router logits, i.e. is `DraftRouter` (gpt-oss: top-k of these
logits). With token features (`u` set): `+ RMSNorm_l(embed[t]) @ U_l`, where t is the verify block's token in
that row (the anchor or the draft's proposal: known before the verify, and what the verify's early layers
route on most), `embed` the target's embedding, U_l starting at 0.
`sigmoid(logits)` estimates P(row routed to e) (the fit minimizes the binary cross-entropy against the
verify's routing), so a block's P(e routed by some row) = 1 - prod_rows(1 - p_row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.nn.norms import rms_norm
from dflash_jax.offload.families import family_of_weights


@struct.dataclass
class LinearRouteWeights:
    norms: jax.Array  # [L, H] the target layers' effective post-attention norm scales (fixed; Qwen3.5: 1 + w)
    w: jax.Array  # [L, H, E]
    b: jax.Array  # [L, E]
    u: jax.Array | None = None  # [L, H_embed, E] token-feature weights (None: hidden states only)


def init_from_target(weights, layers: tuple[int, ...], *, token_features: bool = False) -> LinearRouteWeights:
    """W_l = the target router of MoE layer l, b_l = its router bias (gpt-oss; 0 otherwise), the norm scale as
    the family defines it (Qwen3.5: 1 + w): `route_logits` at step 0 are the family's router logits (on fp32
    inputs), i.e. the `DraftRouter` prediction; U_l = 0."""
    fam = family_of_weights(weights)
    linear = [fam.linear_router(fam.router_of(weights.layers[i])) for i in layers]
    w = jnp.stack([r.router for r in linear])
    norms = jnp.stack([r.norm for r in linear])
    b = jnp.stack([r.router_bias for r in linear])
    u = jnp.zeros((len(layers), weights.embed.shape[1], w.shape[2]), jnp.float32) if token_features else None
    return LinearRouteWeights(norms=norms, w=w, b=b, u=u)


def route_logits(params: LinearRouteWeights, hidden: jax.Array, eps: float,
                 token_embeds: jax.Array | None = None) -> jax.Array:
    """hidden [N, H] (and token_embeds [N, H_embed] when the weights have `u`) -> logits [L, N, E]."""
    h = jax.vmap(lambda n: rms_norm(hidden.astype(jnp.float32), n, eps))(params.norms)
    logits = jnp.einsum("lnh,lhe->lne", h, params.w) + params.b[:, None, :]
    if params.u is not None:
        if token_embeds is None:
            raise ValueError("these route-predictor weights read the verify block's tokens: pass token_embeds")
        t = token_embeds.astype(jnp.float32)
        t = t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + eps)
        logits = logits + jnp.einsum("nh,lhe->lne", t, params.u)
    return logits


@functools.partial(jax.jit, static_argnames=("eps",))
def route_probs(params: LinearRouteWeights, hidden: jax.Array, tokens: jax.Array | None, embed: jax.Array | None,
                eps: float) -> jax.Array:
    """P(row routed to e) [L, N, E] for draft hidden states [N, H] and (weights with `u`) the rows' verify-block
    tokens [N], embedded with the target's `embed`."""
    token_embeds = None if tokens is None else jnp.take(embed, tokens, axis=0)
    return jax.nn.sigmoid(route_logits(params, hidden, eps, token_embeds))
