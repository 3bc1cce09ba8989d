"""Mixture-of-experts: router and expert dispatch through `pallas_kernels.ops.grouped_matmul`.

Dispatch: T tokens x top-k gives T*k (token, expert, weight) rows; rows are sorted by expert, the expert
FFN runs as grouped matmuls over the sorted rows (group g = rows routed to expert g), results are unsorted
and summed per token with the routing weights.

The weight operand is a *slot pool* `[S, ...]`: `slot_of[e]` says which pool slot holds expert e. With all
experts resident the pool is the expert table and `slot_of` is the identity (pass None); an offloaded
layer runs the same code on a smaller pool. Expert biases (gpt-oss) belong to the pool too: `[S, 2I]` and
`[S, H]`, indexed by slot, added after each grouped matmul.

Routers: `softmax_topk_router` (Qwen: softmax over all experts, top-k, optional renormalization) and
`topk_softmax_router` (gpt-oss: top-k of the biased logits, softmax over those k). Activations over the
gate/up halves: `silu_glu` (SwiGLU) and `clamped_swiglu` (gpt-oss).
"""

from __future__ import annotations

from typing import Callable

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


def topk_softmax_router(
    x: jax.Array, router_w: jax.Array, router_b: jax.Array | None, top_k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """gpt-oss router: `l = x @ W_r + b_r` in fp32, the top-k of the raw logits, `softmax` over those k.

    x: [T, H]; router_w: [H, E]; router_b: [E] or None. Returns (weights [T, k] fp32, experts [T, k] int32,
    logits [T, E] fp32).
    """
    logits = jnp.dot(x, router_w, preferred_element_type=jnp.float32)
    if router_b is not None:
        logits = logits + router_b.astype(jnp.float32)
    top, experts = jax.lax.top_k(logits, top_k)
    return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32), logits


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU: `silu(gate) * up`."""
    return jax.nn.silu(gate) * up


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """gpt-oss: `g = min(gate, limit)`, `u = clip(up, -limit, limit)`, `(u + 1) * g * sigmoid(alpha * g)`.

    The clamp is one-sided on the gate (large negative gates already give ~0) and two-sided on up.
    """
    g = jnp.minimum(gate, limit)
    u = jnp.clip(up, -limit, limit)
    return (u + 1) * (g * jax.nn.sigmoid(alpha * g))


def _read_after(token: jax.Array, *tables):
    """`tables` unchanged, made to depend on `token` (this layer's routing) so that XLA cannot dequantize
    FP4 tables before the layer runs. Without it XLA hoists every layer's dequantization (it depends on
    the weights only) to the start of the program and holds all layers' dense tables at once (measured on
    CPU: temp memory = all layers' dense experts). The dependency adds `min(token) < 0` (never true for
    group sizes, but not provable by the compiler) to the packed uint8 parts (codes, E8M0 scales): exact,
    and fused into the dequantization."""
    if not any(ops.is_fp4(t) for t in tables):
        return tables
    never = (jnp.min(token) < 0).astype(jnp.uint8)

    def tie(leaf):
        return leaf + never if leaf.dtype == jnp.uint8 else leaf

    return tuple(jax.tree.map(tie, t) if ops.is_fp4(t) else t for t in tables)


def _dense_experts(x, slots, weights, gate_up, down, num_slots, gate_up_bias, down_bias, activation):
    combine = jnp.einsum("tk,tks->ts", weights.astype(jnp.float32),
                         jax.nn.one_hot(slots, num_slots, dtype=jnp.float32))  # [T, S] routing weights
    gu = jnp.einsum("th,shn->tsn", x, ops.dense_weight(gate_up, x.dtype), preferred_element_type=jnp.float32)
    if gate_up_bias is not None:
        gu = gu + gate_up_bias.astype(jnp.float32)
    inter = gu.shape[-1] // 2
    act = activation(gu[..., :inter], gu[..., inter:]).astype(x.dtype)
    y = jnp.einsum("tsi,sih->tsh", act, ops.dense_weight(down, x.dtype), preferred_element_type=jnp.float32)
    if down_bias is not None:
        y = y + down_bias.astype(jnp.float32)
    return jnp.einsum("tsh,ts->th", y, combine).astype(x.dtype)


def swiglu_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    slot_of: jax.Array | None = None,
    implementation: ops.Implementation = "auto",
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    activation: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """`sum_j weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t)))` with e = experts[t, j].

    x: [T, H]; experts, weights: [T, k]; gate_up: [S, H, 2I] (gate columns first); down: [S, I, H]
    (or FP4 tensors of logical shape [S, 2I, H] / [S, H, I]; see `pallas_kernels.ops`).
    gate_up_bias [S, 2I] / down_bias [S, H] (optional, gate half first like the columns): added to each
    row's grouped-matmul output, by the row's slot. activation(gate, up): `silu_glu` when None.
    implementation "dense": every token through every slot's expert, combined by the routing weights (the
    same sum; k-sparse FLOPs traded for dense einsums: for training small many-expert models on CPU, where
    `ragged_dot`'s cost grows with the number of groups). Otherwise sorted dispatch + `ops.grouped_matmul`.
    """
    t, k = experts.shape
    num_slots, _, two_inter = ops.weight_dims(gate_up)
    slots = experts if slot_of is None else slot_of[experts]
    if implementation == "dense":
        return _dense_experts(x, slots, weights, gate_up, down, num_slots, gate_up_bias, down_bias,
                              activation or silu_glu)
    flat = slots.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of_row = order // k
    slot_of_row = flat[order]
    x_sorted = jnp.take(x, token_of_row, axis=0)
    group_sizes = jnp.bincount(flat, length=num_slots).astype(jnp.int32)
    if ops.resolve_implementation(implementation, gate_up, x.dtype) == "xla":  # dequantizes whole tables
        gate_up, down = _read_after(group_sizes, gate_up, down)
    gu = ops.grouped_matmul(x_sorted, gate_up, group_sizes, implementation=implementation)
    if gate_up_bias is not None:
        gu = gu + jnp.take(gate_up_bias, slot_of_row, axis=0).astype(gu.dtype)
    inter = two_inter // 2
    act = (activation or silu_glu)(gu[:, :inter], gu[:, inter:])
    y_sorted = ops.grouped_matmul(act, down, group_sizes, implementation=implementation)
    if down_bias is not None:
        y_sorted = y_sorted + jnp.take(down_bias, slot_of_row, axis=0).astype(y_sorted.dtype)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, -1)
    out = jnp.einsum("tkh,tk->th", y.astype(jnp.float32), weights.astype(jnp.float32))
    return out.astype(x.dtype)
