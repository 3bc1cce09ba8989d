"""Fixed-size KV caches with per-sequence length counters.

Invariant that makes everything else simple: the row at slot `p` of a sequence's cache holds the key/value
of the token at absolute position `p`. Attention masks are computed from positions, so rows at or past a
sequence's length are never read (causality hides them), and rolling back a speculative extension is only
a move of the length counter: the stale rows are overwritten by the next extension.

One exception, opt-in: a compressed prefill (`dflash_jax.pflash`) writes only some of a prompt's tokens, at
their original RoPE positions. Its cache carries `position_offset` [b]: every later row at slot s sits at
RoPE position `s + position_offset`, while masks stay by slot (the kept rows are in order, so causality by
slot is causality by position). None (the default) is an offset of 0: slot = position, as above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Per-layer key/value buffers `[batch, max_len, kv_heads, head_dim]` and lengths `[batch]` int32."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    lengths: jax.Array
    position_offset: jax.Array | None = None  # [b] int32: RoPE position = slot + offset (None: 0)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]


def init_kv_cache(
    *, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype
) -> KVCache:
    shape = (batch, max_len, num_kv_heads, head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    return KVCache(
        keys=tuple(zeros() for _ in range(num_layers)),
        values=tuple(zeros() for _ in range(num_layers)),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def write_rows(buffer: jax.Array, rows: jax.Array, starts: jax.Array) -> jax.Array:
    """Writes `rows[b, t]` to `buffer[b, starts[b] + t]`; rows that would fall past the end are dropped."""
    batch, width = rows.shape[:2]
    slots = starts[:, None] + jnp.arange(width, dtype=starts.dtype)
    b_idx = jnp.broadcast_to(jnp.arange(batch)[:, None], slots.shape)
    return buffer.at[b_idx, slots].set(rows.astype(buffer.dtype), mode="drop")


def rollback(cache, lengths: jax.Array):
    """Sets each sequence's length to `min(lengths, current)`: forgets rows, never invents them.

    Works for any cache pytree with a `lengths` field. Used after a width-B verify to keep the committed
    prefix (`start + accepted + 1`).
    """
    lengths = jnp.asarray(lengths, jnp.int32)
    return cache.replace(lengths=jnp.minimum(jnp.broadcast_to(lengths, cache.lengths.shape), cache.lengths))
