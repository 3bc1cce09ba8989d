"""Device meshes with the named axes `data`, `expert`, `tensor`, and `--mesh` specs such as `expert=4,tensor=2`.

  data     sequences of a batch (each data shard runs its own rows)
  expert   routed experts: each MoE layer's tables are split along E (`nn.moe.expert_axes`)
  tensor   attention heads, dense MLP columns, the vocabulary; E as well, when it divides (see `nn.moe`)

Every mesh has all three axes (size 1 when not named), so programs and shardings never ask which exist.
A mesh's devices are `jax.devices()` (all processes' devices after `jax.distributed.initialize`), in order.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np

from dflash_jax.errors import UsageError
from dflash_jax.nn.moe import DATA_AXIS, EXPERT_AXIS, TENSOR_AXIS

AXES = (DATA_AXIS, EXPERT_AXIS, TENSOR_AXIS)
_EXAMPLE = "e.g. --mesh expert=4,tensor=2 (axes: data, expert, tensor; sizes multiply to the device count)"


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """`"expert=4,tensor=2"` -> {"data": 1, "expert": 4, "tensor": 2}; a UsageError naming the bad part."""
    sizes = dict.fromkeys(AXES, 1)
    seen = set()
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not parts:
        raise UsageError(f"--mesh {spec!r} names no axis; {_EXAMPLE}")
    for part in parts:
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in AXES:
            raise UsageError(f"--mesh part {part!r} is not AXIS=SIZE with AXIS one of {', '.join(AXES)}; {_EXAMPLE}")
        if name in seen:
            raise UsageError(f"--mesh names axis {name!r} twice; {_EXAMPLE}")
        seen.add(name)
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1 or str(size) != value.strip():
            raise UsageError(f"--mesh {name}={value.strip()!r}: a size must be a positive integer; {_EXAMPLE}")
        sizes[name] = size
    return sizes


def make_mesh(sizes: str | Mapping[str, int], devices: Sequence | None = None) -> jax.sharding.Mesh:
    """A (data, expert, tensor) mesh over the first prod(sizes) of `devices` (default `jax.devices()`).

    sizes: a `--mesh` spec string or {axis: size} (missing axes: 1). A UsageError when the sizes ask for
    more devices than there are, naming how to get them."""
    if isinstance(sizes, str):
        sizes = parse_mesh_spec(sizes)
    unknown = sorted(set(sizes) - set(AXES))
    if unknown:
        raise UsageError(f"mesh axes {unknown} are not among {', '.join(AXES)}; {_EXAMPLE}")
    shape = tuple(int(sizes.get(a, 1)) for a in AXES)
    if any(s < 1 for s in shape):
        raise UsageError(f"mesh sizes must be positive, got {dict(zip(AXES, shape))}; {_EXAMPLE}")
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(shape)
    if need > len(devices):
        raise UsageError(
            f"mesh {describe(shape)} needs {need} devices, {len(devices)} available; use a smaller mesh, or on a "
            f"CPU set XLA_FLAGS=--xla_force_host_platform_device_count={need} before jax starts, or start every "
            "host with jax.distributed.initialize (docs/sharding.md)")
    return jax.sharding.Mesh(np.asarray(devices[:need], dtype=object).reshape(shape), AXES)


def describe(mesh_or_shape) -> str:
    """`data=1,expert=4,tensor=2` for a mesh or a shape tuple in AXES order."""
    shape = tuple(mesh_or_shape.shape[a] for a in AXES) if hasattr(mesh_or_shape, "shape") and isinstance(
        mesh_or_shape.shape, Mapping) else tuple(mesh_or_shape)
    return ",".join(f"{a}={s}" for a, s in zip(AXES, shape))
