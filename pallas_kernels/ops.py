"""Dispatcher for the grouped (per-expert) matmul of MoE layers.

`grouped_matmul(x, w, group_sizes)` computes, for rows sorted by group,
    y[rows of group g] = x[rows of group g] @ W[g]          W[g]: [K, N]
Rows past `sum(group_sizes)` produce zeros. Every MoE layer of every family goes through here, so a kernel
added later changes one place.

Weight operands (the "slot pool" of a layer's experts):
  - a dense array `[G, K, N]` ([in, out] per group);
  - an `MXFP4Tensor` / `NVFP4Tensor` of logical shape `[G, N, K]`: the HF `[out, in]` orientation, with
    the FP4 blocks along the contraction axis K as the formats require.

implementation:
  "xla"    -> dequantize (FP4) then `jax.lax.ragged_dot` (portable; the reference every other
              implementation is tested against)
  "pallas" -> Pallas kernels (not available in this version: raises NotImplementedError)
  "auto"   -> the best available for the backend; today that is "xla" everywhere.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

from dflash_jax.quant import MXFP4Tensor, NVFP4Tensor

Implementation = Literal["auto", "xla", "pallas"]
_IMPLEMENTATIONS = ("auto", "xla", "pallas")
FP4Tensor = (MXFP4Tensor, NVFP4Tensor)


def resolve_implementation(implementation: str) -> str:
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "auto":
        return "xla"
    return implementation


def is_fp4(w: Any) -> bool:
    return isinstance(w, FP4Tensor)


def weight_dims(w: Any) -> tuple[int, int, int]:
    """(groups G, contraction K, output N) of a grouped weight operand."""
    if is_fp4(w):
        g, n, k = w.shape
        return g, k, n
    g, k, n = w.shape
    return g, k, n


def dense_weight(w: Any, dtype) -> jax.Array:
    """The `[G, K, N]` dense form of a weight operand (dequantizes FP4; reads the whole pool)."""
    if is_fp4(w):
        return jnp.swapaxes(w.dequantize(dtype), -1, -2)
    return w.astype(dtype)


def grouped_matmul(
    x: jax.Array,
    w: Any,
    group_sizes: jax.Array,
    *,
    implementation: Implementation = "auto",
    preferred_element_type=None,
) -> jax.Array:
    """x: [M, K] rows sorted by group; w: see module doc; group_sizes: [G] int32, sum <= M. Returns [M, N]."""
    impl = resolve_implementation(implementation)
    if impl == "pallas":
        raise NotImplementedError(
            "the Pallas grouped matmul is not in this version; use implementation='xla' or 'auto'"
        )
    g, k, _ = weight_dims(w)
    if x.ndim != 2 or x.shape[1] != k or group_sizes.shape != (g,):
        raise ValueError(
            f"grouped_matmul shapes: x {x.shape} must be [M, {k}], group_sizes {group_sizes.shape} [{g}] "
            f"for a weight of {g} groups, contraction {k}"
        )
    out_dtype = preferred_element_type or x.dtype
    return jax.lax.ragged_dot(
        x, dense_weight(w, x.dtype), group_sizes.astype(jnp.int32), preferred_element_type=out_dtype
    )
