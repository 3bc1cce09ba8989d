"""A learned route-ahead predictor: per MoE layer a linear map from the draft's hidden states to the target
layer's routing, trained with optax.

Data (`collect_route_data`): speculative rounds run with all experts resident; each round contributes its
draft hidden states `h` [b*B, H] (one row per block slot) and, per MoE layer l, the multi-hot set of experts
the verify routed that row's token to (`y_l` [b*B, E]; verify row j holds the token at block slot j, the
same position the draft hidden row j describes).

Model (`LinearRouteWeights`): `logits_l = RMSNorm_l(h) @ W_l + b_l` with RMSNorm_l the target layer's
post-attention norm weights; W_l starts as the target's router (so step 0 is `DraftRouter`) and b_l at 0.
Loss: mean binary cross-entropy of sigmoid(logits_l) against y_l over rows, experts and layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from dflash_jax.nn.norms import rms_norm


@struct.dataclass
class LinearRouteWeights:
    norms: jax.Array  # [L, H] the target layers' post-attention norm weights (fixed)
    w: jax.Array  # [L, H, E]
    b: jax.Array  # [L, E]


def init_from_target(weights, layers: tuple[int, ...]) -> LinearRouteWeights:
    """W_l = the target router of MoE layer l, b_l = 0 (the `DraftRouter` prediction)."""
    w = jnp.stack([weights.layers[i].mlp.router.astype(jnp.float32) for i in layers])
    norms = jnp.stack([weights.layers[i].post_norm.astype(jnp.float32) for i in layers])
    return LinearRouteWeights(norms=norms, w=w, b=jnp.zeros(w.shape[::2], jnp.float32))


def route_logits(params: LinearRouteWeights, hidden: jax.Array, eps: float) -> jax.Array:
    """hidden [N, H] -> logits [L, N, E]."""
    h = jax.vmap(lambda n: rms_norm(hidden.astype(jnp.float32), n, eps))(params.norms)
    return jnp.einsum("lnh,lhe->lne", h, params.w) + params.b[:, None, :]


def collect_route_data(pair, prompts, *, block_size: int | None = None, max_new_tokens: int = 64):
    """(hidden [N, H] fp32, targets [L, N, E] uint8, layers) from resident speculative rounds over `prompts`."""
    from dflash_jax.offload.store import moe_layer_ids
    from dflash_jax.spec.session import begin, commit_verify, draft_round_jit, target_family, verify_block

    layers = moe_layer_ids(pair.target)
    spec, state = begin(pair, prompts, block_size=block_size, max_new_tokens=max_new_tokens)
    fam = target_family(spec.target)

    @jax.jit
    def verify(state, draft):
        out = fam.forward(pair.target, verify_block(state, draft), state.target_cache, spec.target,
                          tap_layers=spec.taps, logits="all")
        return commit_verify(state, draft, out, spec), tuple(out.router_experts[i] for i in layers)

    hidden, targets = [], []
    e = pair.target_cfg.moe.num_experts
    while not np.asarray(state.done).all():
        draft = draft_round_jit(pair.target, pair.draft, state, spec)
        state, routed = verify(state, draft)
        hidden.append(np.asarray(draft.hidden, np.float32).reshape(-1, draft.hidden.shape[-1]))
        multi_hot = np.zeros((len(layers), hidden[-1].shape[0], e), np.uint8)
        for j, r in enumerate(routed):
            r = np.asarray(r).reshape(hidden[-1].shape[0], -1)
            np.put_along_axis(multi_hot[j], r, 1, axis=1)
        targets.append(multi_hot)
    return np.concatenate(hidden), np.concatenate(targets, axis=1), layers


def train_route_predictor(params: LinearRouteWeights, hidden: np.ndarray, targets: np.ndarray, *, eps: float,
                          steps: int = 300, learning_rate: float = 3e-3, batch: int = 256, seed: int = 0):
    """Adam on the mean BCE; returns (params, losses per step)."""
    opt = optax.adam(learning_rate)
    trainable = (params.w, params.b)
    state = opt.init(trainable)

    def loss_fn(tr, h, y):
        p = params.replace(w=tr[0], b=tr[1])
        return optax.sigmoid_binary_cross_entropy(route_logits(p, h, eps), y.astype(jnp.float32)).mean()

    @jax.jit
    def step(tr, state, h, y):
        loss, grads = jax.value_and_grad(loss_fn)(tr, h, y)
        updates, state = opt.update(grads, state, tr)
        return optax.apply_updates(tr, updates), state, loss

    rng = np.random.default_rng(seed)
    losses = []
    n = hidden.shape[0]
    for _ in range(steps):
        idx = rng.integers(0, n, min(batch, n))
        trainable, state, loss = step(trainable, state, jnp.asarray(hidden[idx]), jnp.asarray(targets[:, idx]))
        losses.append(float(loss))
    return params.replace(w=trainable[0], b=trainable[1]), losses
