"""Dispatcher for the grouped (per-expert) matmul of MoE layers.

`grouped_matmul(x, w, group_sizes)` computes, for rows sorted by group,
    y[rows of group g] = x[rows of group g] @ w[g]
Rows past `sum(group_sizes)` produce zeros. Every MoE layer of every family goes through here, so a kernel
added later (FP4 weights, Pallas) changes one place.

implementation:
  "xla"    -> `jax.lax.ragged_dot` (portable; the reference every other implementation is tested against)
  "pallas" -> Pallas kernels (not available in this version: raises NotImplementedError)
  "auto"   -> the best available for the backend; today that is "xla" everywhere.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Implementation = Literal["auto", "xla", "pallas"]
_IMPLEMENTATIONS = ("auto", "xla", "pallas")


def resolve_implementation(implementation: str) -> str:
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "auto":
        return "xla"
    return implementation


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    implementation: Implementation = "auto",
    preferred_element_type=None,
) -> jax.Array:
    """x: [M, K] rows sorted by group; w: [G, K, N]; group_sizes: [G] int32 summing to <= M. Returns [M, N]."""
    impl = resolve_implementation(implementation)
    if impl == "pallas":
        raise NotImplementedError(
            "the Pallas grouped matmul is not in this version; use implementation='xla' or 'auto'"
        )
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"grouped_matmul shapes: x {x.shape} must be [M, K], w {w.shape} [G, K, N], "
            f"group_sizes {group_sizes.shape} [G]"
        )
    out_dtype = preferred_element_type or jnp.result_type(x.dtype, w.dtype)
    return jax.lax.ragged_dot(
        x, w.astype(x.dtype), group_sizes.astype(jnp.int32), preferred_element_type=out_dtype
    )
