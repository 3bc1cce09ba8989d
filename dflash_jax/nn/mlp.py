"""Dense gated MLP."""

from __future__ import annotations

import jax


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """`down(silu(x @ gate) * (x @ up))`; weights stored [in, out]."""
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down
