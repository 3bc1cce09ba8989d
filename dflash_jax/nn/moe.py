"""Mixture-of-experts: router and expert dispatch through `pallas_kernels.ops.grouped_matmul`.

Dispatch: T tokens x top-k gives T*k (token, expert, weight) rows; rows are sorted by expert, the expert
FFN runs as grouped matmuls over the sorted rows (group g = rows routed to expert g), results are unsorted
and summed per token with the routing weights.

The weight operand is a *slot pool* `[S, ...]`: `slot_of[e]` says which pool slot holds expert e. With all
experts resident the pool is the expert table and `slot_of` is the identity (pass None); an offloaded
layer runs the same code on a smaller pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import ops


def softmax_topk_router(
    x: jax.Array, router_w: jax.Array, top_k: int, *, normalize: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Qwen router: `p = softmax(x @ W_r)` in fp32 over all experts, top-k of p, optionally renormalized.

    x: [T, H]; router_w: [H, E]. Returns (weights [T, k] fp32, experts [T, k] int32, logits [T, E] fp32).
    """
    logits = jnp.dot(x, router_w, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), logits


def swiglu_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    slot_of: jax.Array | None = None,
    implementation: ops.Implementation = "auto",
) -> jax.Array:
    """`sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))` with e = experts[t, j].

    x: [T, H]; experts, weights: [T, k]; gate_up: [S, H, 2I] (gate columns first); down: [S, I, H]
    (or FP4 tensors of logical shape [S, 2I, H] / [S, H, I]; see `pallas_kernels.ops`).
    """
    t, k = experts.shape
    num_slots, _, two_inter = ops.weight_dims(gate_up)
    slots = experts if slot_of is None else slot_of[experts]
    flat = slots.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of_row = order // k
    x_sorted = jnp.take(x, token_of_row, axis=0)
    group_sizes = jnp.bincount(flat, length=num_slots).astype(jnp.int32)
    gu = ops.grouped_matmul(x_sorted, gate_up, group_sizes, implementation=implementation)
    inter = two_inter // 2
    act = jax.nn.silu(gu[:, :inter]) * gu[:, inter:]
    y_sorted = ops.grouped_matmul(act, down, group_sizes, implementation=implementation)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, -1)
    out = jnp.einsum("tkh,tk->th", y.astype(jnp.float32), weights.astype(jnp.float32))
    return out.astype(x.dtype)
