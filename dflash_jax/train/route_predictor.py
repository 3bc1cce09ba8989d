"""Fitting the learned route-ahead predictor (`offload.route_model`) with optax.

Data: rows of (draft hidden state [+ verify-block token embedding], multi-hot routed experts per MoE layer)
from recorded resident rounds (`study.rounds.collect_route_data` / `rounds_to_arrays`). Start: the target's
routers (`offload.route_model.init_from_target`, i.e. the `DraftRouter` prediction). Loss: mean binary
cross-entropy of sigmoid(`route_logits`) against the routed sets over rows, experts and layers, so
sigmoid(logits) estimates P(row routed to e).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax.offload.route_model import LinearRouteWeights, route_logits


def train_route_predictor(params: LinearRouteWeights, hidden: np.ndarray, targets: np.ndarray, *, eps: float,
                          steps: int = 300, learning_rate: float = 3e-3, batch: int = 256, seed: int = 0,
                          token_embeds: np.ndarray | None = None):
    """Adam on the mean BCE (`token_embeds` [N, H_embed]: the rows' token embeddings, needed when the
    weights have `u`); returns (params, losses per step)."""
    opt = optax.adam(learning_rate)
    trainable = (params.w, params.b, params.u)
    state = opt.init(trainable)

    def loss_fn(tr, h, y, t):
        p = params.replace(w=tr[0], b=tr[1], u=tr[2])
        return optax.sigmoid_binary_cross_entropy(route_logits(p, h, eps, t), y.astype(jnp.float32)).mean()

    @jax.jit
    def step(tr, state, h, y, t):
        loss, grads = jax.value_and_grad(loss_fn)(tr, h, y, t)
        updates, state = opt.update(grads, state, tr)
        return optax.apply_updates(tr, updates), state, loss

    if params.u is not None and token_embeds is None:
        raise ValueError("weights with token features need token_embeds")
    rng = np.random.default_rng(seed)
    losses = []
    n = hidden.shape[0]
    for _ in range(steps):
        idx = rng.integers(0, n, min(batch, n))
        t = None if params.u is None else jnp.asarray(token_embeds[idx])
        trainable, state, loss = step(trainable, state, jnp.asarray(hidden[idx]), jnp.asarray(targets[:, idx]), t)
        losses.append(float(loss))
    return params.replace(w=trainable[0], b=trainable[1], u=trainable[2]), losses
