"""Dispatcher for the grouped (per-expert) matmul of MoE layers.

`grouped_matmul(x, w, group_sizes)` computes, for rows sorted by group,
    y[rows of group g] = x[rows of group g] @ W[g]          W[g]: [K, N]
Rows past `sum(group_sizes)` produce zeros. Every MoE layer of every family goes through here, so a kernel
added later changes one place. A group's weights reach only its own rows: a NaN / inf in an expert with no
rows (a poisoned or never-written pool slot, a broken checkpoint's unused expert) changes no output, in
every implementation.

Weight operands (the "slot pool" of a layer's experts):
  - a dense array `[G, K, N]` ([in, out] per group);
  - an `MXFP4Tensor` / `NVFP4Tensor` of logical shape `[G, N, K]`: the HF `[out, in]` orientation, with
    the FP4 blocks along the contraction axis K as the formats require.

implementation:
  "xla"    -> dequantize (FP4) then `jax.lax.ragged_dot` (portable; the reference every other
              implementation is tested against). Dequantizes the whole pool, routed or not. XLA's
              ragged_dot on CPU multiplies every group's weights by a 0/1 row mask, so a non-finite
              weight of any group would reach every row (0 * inf = NaN): the weights of groups without
              rows are zeroed first (one select, fused into the dequantization for FP4) and rows past
              sum(group_sizes) are zeroed after.
  "pallas" -> `pallas_kernels.fp4_grouped_matmul` for FP4 weights (Triton on GPU, interpret mode
              elsewhere): reads only the routed groups' FP4 bytes and dequantizes in registers.
              Activations bfloat16 / float32 only. Dense weights raise NotImplementedError: XLA's
              ragged_dot already streams dense bf16 weights, a Pallas dense kernel would add nothing
              the verify needs (the pool is FP4).
  "auto"   -> "pallas" on GPU (`target.platform() == "gpu"`) for the FP4 weights and activations
              the kernel takes (`fp4_grouped_matmul.supports`: bfloat16 / float32 activations, NVFP4
              tensor scales (), [G] or [G, N]), "xla" for everything else (CPU, TPU, dense weights).
              On a backend without the kernel the XLA path dequantizes FP4 tables on every call;
              `dflash_jax.load(..., dequantize_experts=...)` dequantizes them once at load instead.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

from pallas_kernels import fp4_grouped_matmul as _fp4
from pallas_kernels import target
from pallas_kernels.formats import FP4Tensor

Implementation = Literal["auto", "xla", "pallas"]
_IMPLEMENTATIONS = ("auto", "xla", "pallas")


def resolve_implementation(implementation: str, w: Any = None, x_dtype: Any = None) -> str:
    """The concrete implementation ("xla" | "pallas") a call with weight `w` and activations of
    `x_dtype` runs; "auto" picks Pallas only on GPU for FP4 weights with supported activations."""
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "auto":
        pallas_ok = kernel_available() and x_dtype is not None and _fp4.supports(w, x_dtype)
        return "pallas" if pallas_ok else "xla"
    return implementation


def kernel_available() -> bool:
    """Whether the FP4 kernel runs compiled on the default backend (the GPU); elsewhere it only
    interprets, far slower than XLA's dequantize + ragged_dot."""
    return target.platform() == "gpu"


def is_fp4(w: Any) -> bool:
    return isinstance(w, FP4Tensor)


def weight_dims(w: Any) -> tuple[int, int, int]:
    """(groups G, contraction K, output N) of a grouped weight operand."""
    if is_fp4(w):
        g, n, k = w.shape
        return g, k, n
    g, k, n = w.shape
    return g, k, n


def take_groups(w: Any, index: jax.Array) -> Any:
    """The weight operand of groups `index` [n] of `w` (a dense `[n, K, N]` array, or an FP4 tensor of those
    groups' packed bytes: only they are read, so dequantizing the result reads only the routed experts).
    An NVFP4 tensor scale shared by all groups (shape ()) is kept as is."""
    if is_fp4(w):
        groups = w.shape[0]
        return jax.tree.map(lambda a: jnp.take(a, index, axis=0) if a.ndim and a.shape[0] == groups else a, w)
    return jnp.take(w, index, axis=0)


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
    impl = resolve_implementation(implementation, w, x.dtype)
    g, k, _ = weight_dims(w)
    if x.ndim != 2 or x.shape[1] != k or group_sizes.shape != (g,):
        raise ValueError(
            f"grouped_matmul shapes: x {x.shape} must be [M, {k}], group_sizes {group_sizes.shape} [{g}] "
            f"for a weight of {g} groups, contraction {k}"
        )
    if impl == "pallas":
        if not is_fp4(w):
            raise NotImplementedError(
                "implementation='pallas' covers FP4 (MXFP4/NVFP4) weights only; dense weights go through "
                "implementation='xla' (or 'auto')"
            )
        return _fp4.fp4_grouped_matmul(x, w, group_sizes, preferred_element_type=preferred_element_type)
    out_dtype = preferred_element_type or x.dtype
    group_sizes = group_sizes.astype(jnp.int32)
    routed = (group_sizes > 0)[:, None, None]
    dense = jnp.where(routed, dense_weight(w, x.dtype), jnp.zeros((), x.dtype))
    y = jax.lax.ragged_dot(x, dense, group_sizes, preferred_element_type=out_dtype)
    live = jnp.arange(x.shape[0], dtype=jnp.int32) < jnp.sum(jnp.maximum(group_sizes, 0))
    return jnp.where(live[:, None], y, jnp.zeros((), y.dtype))
