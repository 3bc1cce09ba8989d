"""Rotary position embeddings (rotate-half convention): default, partial rotary and YaRN.

Frequencies are computed on the host in float32 numpy, in the order the reference computes them, so that
angles at positions of several thousand agree to the last bits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import RopeConfig, rope_attention_factor


def inverse_frequencies(rope: RopeConfig) -> np.ndarray:
    """`inv_freq[j]` for j < rotary_dim / 2.

    default: `theta ** -(2j / d)`.
    YaRN (arXiv 2309.00071): blend of extrapolated `1/theta^(2j/d)` and interpolated `1/(factor theta^(2j/d))`
    frequencies; dims with more than `beta_fast` rotations over the original context keep extrapolation,
    dims with fewer than `beta_slow` are interpolated, with a linear ramp in between:
      corr(r) = d * ln(L_orig / (2 pi r)) / (2 ln theta)
      low, high = floor(corr(beta_fast)), ceil(corr(beta_slow))   (no rounding when truncate=False)
      ramp_j = clip((j - low) / (high - low), 0, 1)
      inv_freq = interp * ramp + extrap * (1 - ramp)
    """
    d = rope.rotary_dim
    pos_freqs = np.float32(rope.theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    extrap = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rope.kind == "default":
        return extrap
    interp = (np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrap_weight = (np.float32(1.0) - ramp).astype(np.float32)
    return (interp * (1 - extrap_weight) + extrap * extrap_weight).astype(np.float32)


def rope_cos_sin(rope: RopeConfig, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape `positions.shape + (rotary_dim,)`, scaled by YaRN's attention factor."""
    inv_freq = jnp.asarray(inverse_frequencies(rope))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    scale = rope_attention_factor(rope)
    return (jnp.cos(angles) * scale).astype(dtype), (jnp.sin(angles) * scale).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates the first `cos.shape[-1]` dims of `x` [..., T, heads, head_dim]; the rest pass through.

    `cos`/`sin` are [..., T, rotary_dim]; `out = x * cos + rotate_half(x) * sin` with
    `rotate_half([a, b]) = [-b, a]` over the rotary dims.
    """
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    cos, sin = cos[..., None, :], sin[..., None, :]
    half = rd // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = rot * cos + rotated * sin
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out
