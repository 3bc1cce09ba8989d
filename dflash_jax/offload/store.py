"""The host expert store: every MoE layer's stacked expert tables, kept in host memory.

A layer's routed experts are the pytree of its family's expert fields (`offload.families`): `(gate_up, down)`
for Qwen3-MoE and Qwen3.5-MoE (whose shared expert is not routed and stays resident), `(gate_up, down,
gate_up_bias, down_bias)` for gpt-oss. Tables are dense `[E, K, N]` arrays or FP4 tensors (`MXFP4Tensor` /
`NVFP4Tensor`, e.g. gpt-oss's packed release experts) whose parts are stacked along a leading expert axis;
biases are `[E, N]`. A leaf whose leading axis has length E is *per expert* (dense tables, FP4 codes and
block scales, a per-expert NVFP4 tensor scale, expert biases); any other leaf (a scalar NVFP4 tensor scale)
is *shared* by all experts. Per-expert leaves
live in `pinned_host` memory (placed with `jax.device_put` and a memory-kind sharding, as `dflash_jax.load(...,
expert_memory="pinned_host")` already does); shared leaves stay on the device (they are a few bytes).

Rows move to the device pool with `pull_rows`: a jitted dynamic-slice of each per-expert leaf followed by
a `device_put` to device memory inside the jit (the supported way to read chosen rows of a pinned-host
array; a gather or scatter on host memory is not).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.offload.families import family_of_weights, is_moe_layer  # noqa: F401 (re-exported)

HOST_MEMORY = "pinned_host"


def memory_sharding(kind: str) -> jax.sharding.Sharding:
    """The single-device sharding of the default device in memory `kind` ("device", "pinned_host", ...); under
    a context mesh (`jax.set_mesh`) the mesh's replicated sharding in that memory, so that the offloaded loop's
    arrays sit on the mesh's devices (`offload.sharded`)."""
    mesh = jax.sharding.get_mesh()
    if mesh is not None and not mesh.empty:
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=kind)
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def memory_kind(x: jax.Array) -> str | None:
    return getattr(getattr(x, "sharding", None), "memory_kind", None)


def _placed(leaf, sharding: jax.sharding.Sharding) -> bool:
    """`leaf` already sits where `sharding` puts it (memory kind and devices): kept in place, not copied."""
    have = getattr(leaf, "sharding", None)
    return (have is not None and have.memory_kind == sharding.memory_kind
            and have.is_equivalent_to(sharding, leaf.ndim))


def moe_layer_ids(weights) -> tuple[int, ...]:
    """Indices of the routed-MoE decoder layers of a target weight pytree (every layer for gpt-oss and
    Qwen3.5-MoE; Qwen3 may mix dense and MoE layers)."""
    fam = family_of_weights(weights)
    return tuple(i for i, layer in enumerate(weights.layers) if fam.is_moe(layer))


def strip_experts(weights):
    """The target weights without routed expert tables (every per-expert field of every MoE layer set to
    None): what stays resident on the device in offloaded inference (attention / DeltaNet, norms, routers,
    shared experts, embeddings, head)."""
    fam = family_of_weights(weights)
    layers = tuple(layer.replace(mlp=fam.strip(layer.mlp)) if fam.is_moe(layer) else layer for layer in weights.layers)
    return weights.replace(layers=layers)


@dataclasses.dataclass
class LayerExperts:
    """One MoE layer's expert tables split into leaves.

    leaves[j]: per-expert leaves `[E, ...]` in host memory, shared leaves on the device; `per_expert[j]` says
    which. `treedef` rebuilds the expert tables (the family's `expert_fields`, e.g. `(gate_up, down)`) from
    leaves. `expert_bytes`: bytes of one expert (the per-expert leaves' bytes / E, biases included), what a
    fetch of one expert moves."""

    treedef: Any
    leaves: list[jax.Array]
    per_expert: tuple[bool, ...]
    num_experts: int
    expert_bytes: int

    def tables(self, leaves) -> tuple:
        """The expert tables (`expert_fields` order) rebuilt from `leaves` (same order and kinds as `self.leaves`)."""
        return jax.tree.unflatten(self.treedef, list(leaves))


class HostExpertStore:
    """Per MoE layer the stacked expert tables in host memory (`memory` = "pinned_host" by default).

    layers: {layer index: LayerExperts}. Construction moves tables that are not already in `memory` there
    (a pair loaded with `expert_memory="pinned_host"` is used in place, without a copy)."""

    def __init__(self, weights, *, memory: str = HOST_MEMORY):
        self.memory = memory
        self.family = family_of_weights(weights)
        self.expert_fields = self.family.expert_fields
        self.layers: dict[int, LayerExperts] = {}
        host = memory_sharding(memory)
        for i in moe_layer_ids(weights):
            mlp = weights.layers[i].mlp
            tables = self.family.expert_tables(mlp)
            missing = [f for f, t in zip(self.expert_fields, tables) if t is None]
            if missing:
                raise ValueError(f"layer {i} has no expert tables {missing} (weights passed through strip_experts?)")
            num_experts = mlp.router.shape[-1]
            leaves, treedef = jax.tree.flatten(tables)
            bad = [leaf.shape for leaf in leaves if leaf.ndim >= 1 and leaf.shape[0] != num_experts and leaf.size > 1]
            if bad:
                raise ValueError(f"layer {i}: expert table parts of shapes {bad} are neither per expert (leading axis "
                                 f"{num_experts}, the router's width) nor scalars")
            per_expert = tuple(leaf.ndim >= 1 and leaf.shape[0] == num_experts for leaf in leaves)
            placed = [
                (leaf if _placed(leaf, host) else jax.device_put(leaf, host)) if indexed
                else jax.device_put(leaf, memory_sharding("device"))
                for leaf, indexed in zip(leaves, per_expert)]
            nbytes = sum(int(leaf.nbytes) for leaf, indexed in zip(leaves, per_expert) if indexed)
            self.layers[i] = LayerExperts(treedef=treedef, leaves=placed, per_expert=per_expert,
                                          num_experts=num_experts, expert_bytes=nbytes // num_experts)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(self.layers)

    @property
    def num_experts(self) -> int:
        return next(iter(self.layers.values())).num_experts

    def expert_bytes(self, layer: int) -> int:
        return self.layers[layer].expert_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of every routed expert of every layer (what B0 keeps on the device)."""
        return sum(le.expert_bytes * le.num_experts for le in self.layers.values())

    def device_tables(self, layer: int) -> tuple:
        """A device copy of layer `layer`'s whole expert tables (prefill streams tables one layer at a time)."""
        dev = memory_sharding("device")
        le = self.layers[layer]
        return le.tables([jax.device_put(leaf, dev) if indexed else leaf
                          for leaf, indexed in zip(le.leaves, le.per_expert)])


@functools.partial(jax.jit, donate_argnums=(0,))
def pull_rows(pool_leaves: tuple, table_leaves: tuple, experts: jax.Array, slots: jax.Array) -> tuple:
    """`pool[slots[j]] = table[experts[j]]` for every per-expert leaf pair; returns the new pool leaves.

    pool_leaves: device arrays `[S, ...]` (donated); table_leaves: host (or device) arrays `[E, ...]`;
    experts, slots: [n] int32 (n is static: callers split a fetch into power-of-two chunks so that a few
    compiled sizes move exactly the requested rows). Each row is a dynamic slice of the host table moved to
    device memory inside the jit."""
    out = []
    n = experts.shape[0]
    for pool, table in zip(pool_leaves, table_leaves):
        rows = [jax.device_put(jax.lax.dynamic_index_in_dim(table, experts[j], keepdims=False),
                               jax.memory.Space.Device) for j in range(n)]
        out.append(pool.at[slots].set(jnp.stack(rows).astype(pool.dtype)))
    return tuple(out)


def power_of_two_chunks(n: int) -> list[tuple[int, int]]:
    """[(start, size)] covering range(n) with decreasing powers of two (n = 13 -> sizes 8, 4, 1)."""
    chunks, start, size = [], 0, 1 << max(n.bit_length() - 1, 0)
    while start < n:
        while size > n - start:
            size >>= 1
        chunks.append((start, size))
        start += size
    return chunks


def as_int32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(-1)
