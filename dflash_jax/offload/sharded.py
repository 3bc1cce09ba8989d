"""The device expert cache on a mesh: each device caches its own share of the slots.

`ShardedExpertCache` is `cache.ExpertCache` with every slab split along its slots over the mesh's expert axes
(`nn.moe.expert_axes`, the split the expert tables of a resident model get): device d holds slots
[d S/n, (d+1) S/n) of each slab, and the MoE layers, which read the slab through `slot_of` under the mesh,
run the expert-parallel dispatch over the slots (`nn.moe.swiglu_experts`: each shard computes the rows whose
expert sits in one of its own slots). Everything else is the shared cache's: which (layer, expert) a slot
holds, eviction, passes, pinning, the copies (a row copied into slot s lands on the device that holds s).

  with jax.set_mesh(mesh):
      gen = OffloadedGenerator(shard_pair(pair, mesh), budget_bytes=budget,
                               pool_factory=functools.partial(ShardedExpertCache, mesh=mesh))
      result = gen.generate(prompts, max_new_tokens=64)

Under the mesh the host store's tables are replicated over the mesh's devices' pinned host memory
(`store.memory_sharding`), so any device can pull any expert into its slots. budget_bytes is the whole
cache's (its slots over all devices: each device holds about budget / n). A slab whose slot count does not
divide by the shard count gets extra rows that never hold an expert (zeros, or the trap row's poison with
poison=True), so the split is even; outputs equal the single-device run's (tests/sharding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from dflash_jax.nn.moe import EXPERT_AXIS, TENSOR_AXIS, expert_axes
from dflash_jax.offload.cache import ExpertCache


def shard_count(mesh) -> int:
    """Devices a slab's slots split over: the expert and tensor axes together (padding makes them divide)."""
    sizes = dict(mesh.shape)
    return sizes.get(EXPERT_AXIS, 1) * sizes.get(TENSOR_AXIS, 1)


def place_slab_leaf(leaf: jax.Array, mesh, *, poison: bool) -> jax.Array:
    """One slab leaf [rows, ...] padded to a multiple of `shard_count(mesh)` rows (zeros; copies of the trap
    row when poisoned) and split along the rows over `expert_axes`."""
    n = shard_count(mesh)
    pad = -leaf.shape[0] % n
    if pad:
        fill = jnp.repeat(leaf[-1:], pad, axis=0) if poison else jnp.zeros((pad,) + leaf.shape[1:], leaf.dtype)
        leaf = jnp.concatenate([leaf, fill], axis=0)
    axes = expert_axes(leaf.shape[0], mesh)
    return jax.device_put(leaf, NamedSharding(mesh, PartitionSpec(axes or None)))


class ShardedExpertCache(ExpertCache):
    """`ExpertCache` whose slabs are split along their slots over `mesh`'s expert axes (module doc); built
    under `jax.set_mesh(mesh)`. The other keyword arguments are ExpertCache's."""

    def __init__(self, store, budget_bytes: int, *, mesh, **kwargs):
        if kwargs.get("transfer", "pull_rows") != "pull_rows":
            raise ValueError("a ShardedExpertCache copies with transfer='pull_rows'")
        super().__init__(store, budget_bytes, **kwargs)
        self.mesh = mesh
        for slab in self.slabs:
            slab.leaves = [place_slab_leaf(leaf, mesh, poison=self.poison) for leaf in slab.leaves]

    def device_rows(self) -> list[int]:
        """Slab rows each device holds, per slab."""
        return [int(slab.leaves[0].addressable_shards[0].data.shape[0]) for slab in self.slabs]
