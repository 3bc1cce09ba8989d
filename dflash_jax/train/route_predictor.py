"""A learned route-ahead predictor: per MoE layer a linear map from the draft's hidden states to the target
layer's routing, trained with optax.

Data (`collect_route_data`): speculative rounds run with all experts resident; each round contributes its
draft hidden states `h` [b*B, H] (one row per block slot) and, per MoE layer l, the multi-hot set of experts
the verify routed that row's token to (`y_l` [b*B, E]; verify row j holds the token at block slot j, the
same position the draft hidden row j describes).

Model (`LinearRouteWeights`): `logits_l = RMSNorm_l(h) @ W_l + b_l` with RMSNorm_l the target layer's
post-attention norm as an effective fp32 scale (`families.Family.norm_scale`: w, or 1 + w for Qwen3.5's
zero-centred norms); W_l starts as the target's router and b_l as its router bias (gpt-oss; 0 otherwise), so
step 0 reproduces each family's router logits, i.e. is `DraftRouter` (gpt-oss: top-k of these logits).
With token features (`u` set): `+ RMSNorm_l(embed[t]) @ U_l`, where t is the verify block's token in that
row (the anchor or the draft's proposal: known before the verify, and what the verify's early layers route
on most), `embed` the target's embedding, U_l starting at 0.
Loss: mean binary cross-entropy of sigmoid(logits_l) against y_l over rows, experts and layers; so
sigmoid(logits) estimates P(row routed to e), and a block's P(e routed by some row) = 1 - prod(1 - p_row).
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
    norms: jax.Array  # [L, H] the target layers' effective post-attention norm scales (fixed; Qwen3.5: 1 + w)
    w: jax.Array  # [L, H, E]
    b: jax.Array  # [L, E]
    u: jax.Array | None = None  # [L, H_embed, E] token-feature weights (None: hidden states only)


def init_from_target(weights, layers: tuple[int, ...], *, token_features: bool = False) -> LinearRouteWeights:
    """W_l = the target router of MoE layer l, b_l = its router bias (gpt-oss; 0 otherwise), the norm scale as
    the family defines it (Qwen3.5: 1 + w): `route_logits` at step 0 are the family's router logits (on fp32
    inputs), i.e. the `DraftRouter` prediction; U_l = 0."""
    from dflash_jax.offload.families import family_of_weights

    fam = family_of_weights(weights)
    w = jnp.stack([weights.layers[i].mlp.router.astype(jnp.float32) for i in layers])
    norms = jnp.stack([fam.norm_scale(weights.layers[i].post_norm) for i in layers])
    biases = [fam.router_bias(weights.layers[i].mlp) for i in layers]
    b = jnp.stack([jnp.zeros(w.shape[2], jnp.float32) if bias is None else bias.astype(jnp.float32)
                   for bias in biases])
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


def collect_route_data(pair, prompts, *, block_size: int | None = None, max_new_tokens: int = 64):
    """(hidden [N, H] fp32, targets [L, N, E] uint8, layers) from resident speculative rounds over `prompts`."""
    from dflash_jax.offload.store import moe_layer_ids

    layers = moe_layer_ids(pair.target)
    rounds = record_rounds(pair, prompts, block_size=block_size, max_new_tokens=max_new_tokens)
    hidden, _, targets = rounds_to_arrays(rounds, layers, pair.target_cfg.moe.num_experts)
    return hidden, targets, layers


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


def record_rounds(pair, prompts, *, block_size: int | None = None, max_new_tokens: int = 64,
                  ahead: bool = False) -> list[dict]:
    """The rounds of resident greedy speculative decoding over `prompts`, one dict per round:
    "hidden" [b*B, H] fp32 (the draft's final-normed hidden states), "tokens" [b*B] (the verify block
    `[anchor, d_1 .. d_{B-1}]`), "routed" {layer: [b*B, k]} and "logits" {layer: [b*B, E] fp32} (the verify's
    exact routing and router logits per MoE layer). Everything a predictor may read before a verify
    ("hidden", "tokens", the previous round) and what the verify then did.

    ahead: also record what the in-verify predictor (`offload.predictors.NextLayerResidual`) reads: "ahead_logits"
    {MoE layer j: [b*B, E] fp32}, layer j's router (with its post-attention norm and bias) on the previous MoE
    layer's post-attention residual (no entry for the first MoE layer). The verify then runs layer by layer on
    the whole expert tables (`offload.forward.forward_layerwise`, the same functions: the same tokens), one host
    sync per MoE layer; [rows, E] per layer is all it adds to a round."""
    from dflash_jax.offload.store import moe_layer_ids
    from dflash_jax.spec.session import begin, commit_verify, draft_round_jit, target_family, verify_block

    layers = moe_layer_ids(pair.target)
    spec, state = begin(pair, prompts, block_size=block_size, max_new_tokens=max_new_tokens)
    fam = target_family(spec.target)

    @jax.jit
    def resident_verify(state, draft):
        block = verify_block(state, draft)
        out = fam.forward(pair.target, block, state.target_cache, spec.target, tap_layers=spec.taps, logits="all",
                          return_router_logits=True)
        return (commit_verify(state, draft, out, spec), block, tuple(out.router_experts[i] for i in layers),
                tuple(out.router_logits[i] for i in layers), {})

    if ahead:
        from dflash_jax.offload.families import family_of_config
        from dflash_jax.offload.forward import ExpertOperands, forward_layerwise
        from dflash_jax.offload.loop import _commit_verify_jit

        adapter = family_of_config(spec.target)
        every = np.ones(spec.target.moe.num_experts, bool)

        def whole(layer, experts):
            return ExpertOperands(adapter.expert_tables(pair.target.layers[layer].mlp), None, every)

        def layerwise_verify(state, draft):  # with the in-verify prediction inputs
            block = verify_block(state, draft)
            lw = forward_layerwise(pair.target, block, state.target_cache, spec.target, provider=whole,
                                   tap_layers=spec.taps, logits="all", ahead_width=spec.target.moe.top_k)
            out = lw.out
            return (_commit_verify_jit(state, draft, out, spec), block, tuple(out.router_experts[i] for i in layers),
                    tuple(out.router_logits[i] for i in layers), lw.ahead_logits)

    verify = layerwise_verify if ahead else resident_verify
    rounds = []
    while not np.asarray(state.done).all():
        draft = draft_round_jit(pair.target, pair.draft, state, spec)
        state, block, routed, logits, ahead_logits = verify(state, draft)
        h = np.asarray(draft.hidden, np.float32)
        rows = h.shape[0] * h.shape[1]
        rounds.append({
            "batch": h.shape[0], "hidden": h.reshape(-1, h.shape[-1]), "tokens": np.asarray(block).reshape(-1),
            "routed": {l: np.asarray(r).reshape(rows, -1) for l, r in zip(layers, routed)},
            "logits": {l: np.asarray(g, np.float32).reshape(rows, -1) for l, g in zip(layers, logits)},
        })
        if ahead:
            rounds[-1]["ahead_logits"] = {l: np.asarray(g, np.float32).reshape(rows, -1)
                                          for l, g in ahead_logits.items()}
    return rounds


def rounds_to_arrays(rounds: list[dict], layers: tuple[int, ...], num_experts: int):
    """(hidden [N, H], tokens [N], multi-hot targets [L, N, E] uint8) over all rows of `rounds`."""
    hidden = np.concatenate([r["hidden"] for r in rounds])
    tokens = np.concatenate([r["tokens"] for r in rounds])
    targets = np.zeros((len(layers), hidden.shape[0], num_experts), np.uint8)
    row = 0
    for r in rounds:
        n = r["hidden"].shape[0]
        for j, layer in enumerate(layers):
            np.put_along_axis(targets[j, row: row + n], r["routed"][layer], 1, axis=1)
        row += n
    return hidden, tokens, targets
