"""Where each weight lives on a mesh: logical axes from the weight declarations -> `NamedSharding`s.

The declarations (`models.declare.Target.axes`, else `declare.logical_axes`' name rules) give each dimension a
logical axis; this module maps it to mesh axes:
  experts          E over `nn.moe.expert_axes` (expert x tensor when E divides, else expert, else replicated):
                   exactly the split the expert dispatch's `shard_map` reads, so no table is ever resharded
  heads            `tensor`, when the dimension holds whole heads per shard (dim / unit divides by the
                   tensor size); otherwise replicated (e.g. 2 KV heads on tensor=4)
  ffn, vocab       `tensor`, when the dimension divides
Anything else is replicated. A replicated fallback is always correct (XLA's partitioner inserts whatever
collectives the program needs); `plan` lists what was sharded how, so docs and tests can state it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dflash_jax.models import declare
from dflash_jax.nn.moe import TENSOR_AXIS, expert_axes


def mesh_axes(logical: str | None, dim: int, unit: int, mesh) -> tuple[str, ...]:
    """The mesh axes one dimension of `dim` elements with logical axis `logical` shards over (() = none)."""
    sizes = dict(mesh.shape)
    if logical is None:
        return ()
    if logical == declare.EXPERTS:
        return expert_axes(dim, mesh)
    tensor = sizes.get(TENSOR_AXIS, 1)
    if logical in (declare.HEADS, declare.FFN, declare.VOCAB) and tensor > 1 and dim % unit == 0 \
            and (dim // unit) % tensor == 0:
        return (TENSOR_AXIS,)
    return ()


def partition_spec(name: str, target: declare.Target, shape: tuple[int, ...], mesh) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` declared as `name` / `target`. `shape` may be a part of the
    declared tensor (an FP4 tensor's codes or scales): then only a leading expert axis carries over."""
    axes = declare.logical_axes(name, target)
    if tuple(shape) != tuple(target.shape):
        lead = axes[0] if axes else None
        if lead != declare.EXPERTS or not shape or shape[0] != target.shape[0]:
            return PartitionSpec()
        axes = (lead,) + (None,) * (len(shape) - 1)
    spec = []
    for logical, dim in zip(axes, shape):
        found = mesh_axes(logical, dim, target.unit if logical != declare.EXPERTS else 1, mesh)
        spec.append(None if not found else found[0] if len(found) == 1 else found)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def _path_name(path) -> list[str]:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return parts


def _declared(declared: dict[str, declare.Target], parts: list[str], shape) -> tuple[str, declare.Target]:
    """(declared name, target) of a leaf at pytree path `parts`: the name itself, an FP4 part `NAME#part`,
    or the FP4 tensor NAME the leaf belongs to; undeclared leaves get the name rules on their own shape."""
    name = ".".join(parts)
    if name in declared:
        return name, declared[name]
    parent = ".".join(parts[:-1])
    for candidate in (f"{parent}#{parts[-1]}", parent):
        if candidate in declared:
            return candidate, declared[candidate]
    return (parent if parts else name), declare.Target(tuple(shape))


def weight_shardings(weights, declared: dict[str, declare.Target], mesh) -> Any:
    """A pytree like `weights` (arrays, FP4 tensors, None) of `NamedSharding`s on `mesh`."""

    def one(path, leaf):
        name, target = _declared(declared, _path_name(path), leaf.shape)
        return NamedSharding(mesh, partition_spec(name, target, tuple(leaf.shape), mesh))

    return jax.tree_util.tree_map_with_path(one, weights)


def put(value, sharding: NamedSharding):
    """`value` (host or device array) as a global array with `sharding`; each process supplies only the
    pieces its own devices hold, so it also places onto a mesh spanning several processes. An array already
    in `sharding` (e.g. restored by `dflash_jax.load(mesh=)`) is returned as it is."""
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_weights(weights, declared: dict[str, declare.Target], mesh):
    """`weights` placed on `mesh` in the shardings of their declarations."""
    return jax.tree.map(put, weights, weight_shardings(weights, declared, mesh))


def shard_pair(pair, mesh):
    """A `Pair` (or any object with `target_cfg`, `target`, `draft_cfg`, `draft`) with both models' weights
    placed on `mesh`: the target by its family's declarations, the draft by the draft's."""
    from dflash_jax.models import draft as draft_model
    from dflash_jax.models.family import family_of

    target = shard_weights(pair.target, family_of(pair.target_cfg).sharded_declarations(pair.target_cfg), mesh)
    drafted = shard_weights(pair.draft, draft_model.declare_weights(pair.draft_cfg), mesh)
    return dataclasses.replace(pair, target=target, draft=drafted)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `weight_shardings` does with one model on one mesh: {declared name: PartitionSpec}, and the
    bytes one device holds against the whole model's."""

    specs: dict[str, PartitionSpec]
    device_bytes: int
    total_bytes: int

    def sharded(self, axis: str) -> list[str]:
        return [k for k, s in self.specs.items() if any(axis == a or (isinstance(a, tuple) and axis in a)
                                                         for a in s)]


def plan(declared: dict[str, declare.Target], mesh, default_itemsize: int = 2) -> Plan:
    """The sharding of every declared array on `mesh` and the bytes it leaves on one device (arrays as
    declared: FP4 parts in their declared uint8, arrays of no declared dtype at `default_itemsize` bytes)."""
    specs, dev, total = {}, 0, 0
    sizes = dict(mesh.shape)
    for name, target in declared.items():
        spec = partition_spec(name, target, tuple(target.shape), mesh)
        specs[name] = spec
        n = math.prod(target.shape) * (np.dtype(target.dtype).itemsize if target.dtype is not None
                                       else default_itemsize)
        split = math.prod(math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e)) for e in spec
                          if e is not None)
        total += n
        dev += n // split
    return Plan(specs=specs, device_bytes=dev, total_bytes=total)


def checkpoint_shardings(declared: dict[str, declare.Target], mesh) -> Callable[[str, str | None, tuple], Any]:
    """`sharding(flat key, FP4 part or None, stored shape)` for `checkpoint.read_model`: the sharding of
    each stored array of one model on `mesh`, by its declaration."""

    def sharding(key: str, part: str | None, shape: tuple) -> NamedSharding:
        parts = key.split(".") + ([part] if part else [])
        name, target = _declared(declared, parts, shape)
        return NamedSharding(mesh, partition_spec(name, target, tuple(shape), mesh))

    return sharding
