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
    `ragged_dot`'s cost grows with the number of groups). Otherwise sorted dispatch + `ops.grouped_matmul`,
    and under a context mesh with an `expert` axis (`jax.set_mesh`, see `expert_parallel_mesh`) the same
    dispatch per expert shard under `shard_map` (whole tables only: a slot pool runs the default path).
    """
    num_slots = ops.weight_dims(gate_up)[0]
    slots = experts if slot_of is None else slot_of[experts]
    if implementation == "dense":
        return _dense_experts(x, slots, weights, gate_up, down, num_slots, gate_up_bias, down_bias,
                              activation or silu_glu)
    mesh = expert_parallel_mesh()
    if mesh is not None and slot_of is None and expert_axes(num_slots, mesh):
        return _expert_parallel(x, experts, weights, gate_up, down, mesh, implementation=implementation,
                                gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation)
    y = _routed_rows(x, slots, gate_up, down, num_slots, implementation, gate_up_bias, down_bias, activation)
    out = jnp.einsum("tkh,tk->th", y.astype(jnp.float32), weights.astype(jnp.float32))
    return out.astype(x.dtype)


def _routed_rows(x, slots, gate_up, down, num_slots, implementation, gate_up_bias, down_bias, activation):
    """[T, k, H] expert outputs of every (token, choice) row: rows sorted by slot, grouped matmuls, unsorted."""
    t, k = slots.shape
    two_inter = ops.weight_dims(gate_up)[2]
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
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, -1)


# ----------------------------------------------------------------------------------------------------------
# expert parallelism: the same sum with the expert tables sharded along E over a device mesh
# ----------------------------------------------------------------------------------------------------------

EXPERT_AXIS, TENSOR_AXIS, DATA_AXIS = "expert", "tensor", "data"


def expert_parallel_mesh():
    """The mesh expert dispatch shards over: the context mesh (`jax.set_mesh`) when it has an `expert`
    axis and none of its axes is already manual (inside someone's `shard_map`); None otherwise. The
    context mesh is part of jit's cache key, so a program traced without a mesh is never reused with one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names or mesh.manual_axes:
        return None
    return mesh


def expert_axes(num_experts: int, mesh) -> tuple[str, ...]:
    """The mesh axes a table of `num_experts` experts shards its E dimension over: `expert` and `tensor`
    together when E divides by their product, else `expert` alone when it divides, else none (replicated).
    Axes of size 1 are left out. `dflash_jax.sharding` places the tables by the same rule."""
    sizes = dict(mesh.shape)
    for axes in ((EXPERT_AXIS, TENSOR_AXIS), (EXPERT_AXIS,)):
        if not all(a in sizes for a in axes):
            continue
        n = 1
        for a in axes:
            n *= sizes[a]
        if n > 1 and num_experts % n == 0:
            return tuple(a for a in axes if sizes[a] > 1)
    return ()


def _expert_parallel(x, experts, weights, gate_up, down, mesh, *, implementation, gate_up_bias, down_bias,
                     activation):
    """`swiglu_experts` under `shard_map` with the tables sharded along E (`expert_axes`): every shard sees
    all of its data shard's tokens (the verify's few tokens are already there; no dispatch collective),
    runs its own experts' rows through the local grouped matmuls (rows routed elsewhere are computed on
    local group 0 and masked to exactly zero), combines them with the routing weights in fp32, and one
    psum over the expert axes sums the shards' partial outputs. With top-k = 2 that sum adds the same two
    products as the single-device combine."""
    from jax.sharding import PartitionSpec as P

    num_experts = ops.weight_dims(gate_up)[0]
    axes = expert_axes(num_experts, mesh)
    sizes = dict(mesh.shape)
    data = sizes.get(DATA_AXIS, 1)
    tokens = P(DATA_AXIS, None) if data > 1 and x.shape[0] % data == 0 else P(None, None)

    def table(t):  # E-leading parts split along E; a part shared by all experts (NVFP4's tensor scale) replicated
        return jax.tree.map(lambda a: P(axes) if a.ndim and a.shape[0] == num_experts else P(), t)

    def shard(x, experts, weights, gate_up, down, gate_up_bias, down_bias):
        local_count = ops.weight_dims(gate_up)[0]
        index = 0
        for a in axes:  # the shard's position along the (major-to-minor) expert axes
            index = index * sizes[a] + jax.lax.axis_index(a)
        local = experts - index * local_count
        mine = (local >= 0) & (local < local_count)
        y = _routed_rows(x, jnp.where(mine, local, 0), gate_up, down, local_count, implementation,
                         gate_up_bias, down_bias, activation)
        y = jnp.where(mine[..., None], y.astype(jnp.float32), 0.0)
        part = jnp.einsum("tkh,tk->th", y, jnp.where(mine, weights.astype(jnp.float32), 0.0))
        return jax.lax.psum(part, axes)

    biases = (gate_up_bias, down_bias)
    out = jax.shard_map(
        shard, mesh=mesh,
        in_specs=(tokens, tokens, tokens, table(gate_up), table(down)) + tuple(
            None if b is None else table(b) for b in biases),
        out_specs=tokens,
    )(x, experts, weights, gate_up, down, *biases)
    return out.astype(x.dtype)
