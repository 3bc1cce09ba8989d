"""RMSNorm, in the two conventions the supported families use."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(
    x: jax.Array, weight: jax.Array, eps: float, *, zero_centered: bool = False, scale_in_fp32: bool = False
) -> jax.Array:
    """`x / sqrt(mean(x^2) + eps)` computed in fp32, then scaled by the weight.

    Plain (Qwen3): the normalized value is cast back to `x.dtype` *before* the multiply by `w`, as the
    reference does, so bf16 runs round at the same place.
    `scale_in_fp32` (gpt-oss, whose norm weights are fp32): `w * normalized` in fp32, one cast at the end.
    Zero-centred (Qwen3.5): `normalized * (1 + w)` entirely in fp32, cast to `x.dtype` at the end.
    """
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    if scale_in_fp32:
        return (weight.astype(jnp.float32) * normed).astype(x.dtype)
    return (weight * normed.astype(x.dtype)).astype(x.dtype)
