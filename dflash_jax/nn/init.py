"""Random parameter initialization shared by every family's `random_weights` (tests, examples, training)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


class ParamInit:
    """Matrices ~ N(0, 1/fan_in) (activations stay O(1) through depth); norm weights 1 + jitter * N(0, 1)."""

    def __init__(self, key, n, dtype, norm_jitter):
        self.keys = iter(jax.random.split(key, n))
        self.dtype, self.jitter = dtype, norm_jitter

    def mat(self, *shape):
        return (jax.random.normal(next(self.keys), shape, jnp.float32) / jnp.sqrt(shape[-2])).astype(self.dtype)

    def norm(self, n):
        return (1.0 + self.jitter * jax.random.normal(next(self.keys), (n,), jnp.float32)).astype(self.dtype)
