"""The host expert store: every MoE layer's stacked expert tables, kept in host memory.

A layer's routed experts are the pytree `(gate_up, down)` of `MoEWeights`: dense `[E, K, N]` arrays or FP4
tensors (`MXFP4Tensor` / `NVFP4Tensor`) whose parts are stacked along a leading expert axis. A leaf whose
leading axis has length E is *per expert* (dense tables, FP4 codes and block scales, a per-expert NVFP4
tensor scale); any other leaf (a scalar NVFP4 tensor scale) is *shared* by all experts. Per-expert leaves
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

from dflash_jax.models.qwen3 import MoEWeights

HOST_MEMORY = "pinned_host"


def memory_sharding(kind: str) -> jax.sharding.Sharding:
    """The single-device sharding of the default device in memory `kind` ("device", "pinned_host", ...)."""
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def memory_kind(x: jax.Array) -> str | None:
    return getattr(getattr(x, "sharding", None), "memory_kind", None)


def is_moe_layer(layer) -> bool:
    return isinstance(layer.mlp, MoEWeights)


def moe_layer_ids(weights) -> tuple[int, ...]:
    """Indices of the routed-MoE decoder layers of a target weight pytree."""
    return tuple(i for i, layer in enumerate(weights.layers) if is_moe_layer(layer))


def strip_experts(weights):
    """The target weights without routed expert tables (`gate_up = down = None` in every MoE layer): what
    stays resident on the device in offloaded inference (attention, norms, routers, embeddings, head)."""
    layers = tuple(
        layer.replace(mlp=layer.mlp.replace(gate_up=None, down=None)) if is_moe_layer(layer) else layer
        for layer in weights.layers)
    return weights.replace(layers=layers)


@dataclasses.dataclass
class LayerExperts:
    """One MoE layer's expert tables split into leaves.

    leaves[j]: per-expert leaves `[E, ...]` in host memory, shared leaves on the device; `per_expert[j]` says
    which. `treedef` rebuilds `(gate_up, down)` from leaves. `expert_bytes`: bytes of one expert (the
    per-expert leaves' bytes / E), what a fetch of one expert moves."""

    treedef: Any
    leaves: list[jax.Array]
    per_expert: tuple[bool, ...]
    num_experts: int
    expert_bytes: int

    def tables(self, leaves) -> tuple[Any, Any]:
        """`(gate_up, down)` rebuilt from `leaves` (same order and kinds as `self.leaves`)."""
        return jax.tree.unflatten(self.treedef, list(leaves))


class HostExpertStore:
    """Per MoE layer the stacked expert tables in host memory (`memory` = "pinned_host" by default).

    layers: {layer index: LayerExperts}. Construction moves tables that are not already in `memory` there
    (a pair loaded with `expert_memory="pinned_host"` is used in place, without a copy)."""

    def __init__(self, weights, *, memory: str = HOST_MEMORY):
        self.memory = memory
        self.layers: dict[int, LayerExperts] = {}
        host = memory_sharding(memory)
        for i in moe_layer_ids(weights):
            mlp = weights.layers[i].mlp
            if mlp.gate_up is None:
                raise ValueError(f"layer {i} has no expert tables (weights passed through strip_experts?)")
            num_experts = mlp.router.shape[-1]
            leaves, treedef = jax.tree.flatten((mlp.gate_up, mlp.down))
            per_expert = tuple(leaf.ndim >= 1 and leaf.shape[0] == num_experts for leaf in leaves)
            placed = [
                (leaf if memory_kind(leaf) == memory else jax.device_put(leaf, host)) if indexed
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

    def device_tables(self, layer: int) -> tuple[Any, Any]:
        """A device copy of layer `layer`'s whole `(gate_up, down)` (prefill streams tables one layer at a time)."""
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
