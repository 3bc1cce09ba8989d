"""Expert and tensor parallelism on a `jax.sharding` mesh with axes (data, expert, tensor).

  mesh = make_mesh("expert=4,tensor=2")          # or parse_mesh_spec / a dict; all processes' devices
  pair = dflash_jax.load(ckpt_dir, mesh=mesh)     # each array restored straight into its sharding
  pair = shard_pair(pair, mesh)                   # (or place weights already in memory)
  with jax.set_mesh(mesh):                        # traces the MoE dispatch under shard_map (nn.moe)
      result = generate(pair, prompts, max_new_tokens=64)

Shardings come from the weight declarations (`models.declare`): see `place`. Outputs equal the single-
device outputs (greedy: the same tokens; tests/sharding). docs/sharding.md has the layout, the measured
communication per verify round and how to launch several hosts (`jax.distributed.initialize`).
"""

from dflash_jax.sharding.mesh import AXES, describe, make_mesh, parse_mesh_spec
from dflash_jax.sharding.place import (Plan, checkpoint_shardings, mesh_axes, partition_spec, plan, put, shard_pair, shard_weights,
                                       weight_shardings)

__all__ = ["AXES", "Plan", "checkpoint_shardings", "describe", "make_mesh", "mesh_axes", "parse_mesh_spec", "partition_spec", "plan",
           "put", "shard_pair", "shard_weights", "weight_shardings"]
