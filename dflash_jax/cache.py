"""Fixed-size KV caches with per-sequence length counters.

Invariant that makes everything else simple: the row at slot `p` of a sequence's cache holds the key/value
of the token at absolute position `p`. Attention masks are computed from positions, so rows at or past a
sequence's length are never read (causality hides them), and rolling back a speculative extension is only
a move of the length counter: the stale rows are overwritten by the next extension.

One exception, opt-in: a compressed prefill (`dflash_jax.pflash`) writes only some of a prompt's tokens, at
their original RoPE positions. Its cache carries `position_offset` [b]: every later row at slot s sits at
RoPE position `s + position_offset`, while masks stay by slot (the kept rows are in order, so causality by
slot is causality by position). None (the default) is an offset of 0: slot = position, as above.

Layout: each layer's buffer is `[batch, kv_heads, max_len, head_dim]` (slots on axis `SLOT_AXIS` = 2), so that
attention's two products read every (row, head)'s slots as one contiguous `[S, d]` matrix: with slots on axis 1
(`[b, S, Hkv, d]`), XLA:CPU copied each layer's whole cache into that order on every step (measured: a fifth of a
batch-32 decode step's op time on the shipped pair). Rows written and read (`write_rows`, `take_slots`) keep the
model's `[b, T, Hkv, d]` order; only the buffer is heads-major.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Per-layer key/value buffers `[batch, kv_heads, max_len, head_dim]` and lengths `[batch]` int32."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    lengths: jax.Array
    position_offset: jax.Array | None = None  # [b] int32: RoPE position = slot + offset (None: 0)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[SLOT_AXIS]


SLOT_AXIS = 2  # a KV buffer's slot (position) axis: [b, Hkv, S, d]

SLOT_FIELDS = frozenset(("keys", "values", "lengths"))


def holds_slots(node) -> bool:
    """Whether `node` is a cache of slot = position K/V buffers: a dataclass with `keys`, `values` (tuples of
    buffers) and `lengths` fields (a `KVCache`, a hybrid target's cache). Such buffers are written only at slots at
    or past each row's length, so a round may take them as it left them for every row (`serve.runner.keep_rows`)."""
    return (dataclasses.is_dataclass(node) and not isinstance(node, type)
            and SLOT_FIELDS <= {f.name for f in dataclasses.fields(node)})


def kv_shape(batch: int, max_len: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """The shape of one layer's K (or V) buffer."""
    return (batch, num_kv_heads, max_len, head_dim)


def init_kv_cache(
    *, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype
) -> KVCache:
    shape = kv_shape(batch, max_len, num_kv_heads, head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    return KVCache(
        keys=tuple(zeros() for _ in range(num_layers)),
        values=tuple(zeros() for _ in range(num_layers)),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def write_rows(buffer: jax.Array, rows: jax.Array, starts: jax.Array, batch: jax.Array | None = None) -> jax.Array:
    """Writes `rows[b, t]` ([b, T, Hkv, d]) to slot `starts[b] + t` of `buffer` [b, Hkv, S, d]; rows that would
    fall past the end are dropped. batch: as in `write_slots`."""
    width = rows.shape[1]
    slots = starts[:, None] + jnp.arange(width, dtype=starts.dtype)
    return write_slots(buffer, rows, slots, batch)


def _batch_index(slots: jax.Array, batch: jax.Array | None = None) -> jax.Array:
    index = jnp.arange(slots.shape[0]) if batch is None else jnp.asarray(batch, jnp.int32)
    return jnp.broadcast_to(index[:, None], slots.shape)


def write_slots(buffer: jax.Array, rows: jax.Array, slots: jax.Array, batch: jax.Array | None = None) -> jax.Array:
    """Writes `rows[b, t]` ([b, T, Hkv, d]) to slot `slots[b, t]` of `buffer` [b, Hkv, S, d] (slots past the end
    are dropped). The two advanced indices around the head axis put the indexed dims first: [b, T, Hkv, d].
    batch: [b] int32, the buffer row each of `rows`' rows goes to (None: row b to row b), so a few rows gathered
    from a larger batch are written back in place (an index past the buffer's rows: dropped). Distinct indices.

    A write of one row to one slot (b = T = 1: a decode step of one sequence, the serving engine's round at one
    row) goes with a second update to slot S, past the end, which is dropped: XLA rewrites a one-element scatter
    into a select against the buffer's old value there, and where the buffer is the first row of a larger donated
    one (the engine's row bucket) the program then copied every KV buffer whole, twice, on every round (at 32
    slots of 384 rows: 4 of a 5 ms round)."""
    if slots.size == 1:
        slots = jnp.concatenate([slots, jnp.full_like(slots, buffer.shape[SLOT_AXIS])], axis=1)
        rows = jnp.concatenate([rows, rows], axis=1)
    return buffer.at[_batch_index(slots, batch), :, slots].set(rows.astype(buffer.dtype), mode="drop")


def take_slots(buffer: jax.Array, slots: jax.Array) -> jax.Array:
    """`buffer` [b, Hkv, S, d] at slots `slots` [b, T]: rows [b, T, Hkv, d]."""
    return buffer[_batch_index(slots), :, slots]


def move_slots(buffer: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """`buffer` [b, Hkv, S, d] with slot `dst[b, t]` set to what slot `src[b, t]` held (dst past the end dropped)."""
    return write_slots(buffer, take_slots(buffer, src), dst)


COPY_CHUNK = 64  # the slots a row copy (`put_rows`, `copy_row`) moves per step


def _chunks(count, slots: int) -> tuple:
    """(chunk, steps): the chunk a copy of a row's first `count` slots (traced) moves per step, and how many steps
    cover them (rounded up to whole chunks, at most the buffer's `slots`)."""
    chunk = min(COPY_CHUNK, slots)
    return chunk, (jnp.clip(count, 0, slots) + chunk - 1) // chunk


def put_rows(buffer: jax.Array, rows: jax.Array, dst: jax.Array, count) -> jax.Array:
    """`buffer` [B, Hkv, S, d] with row `dst[i]` (traced [k]; past the last row: dropped) given row i of `rows`
    [k, Hkv, S', d] (S' <= S) in its first `count` slots (traced; whole `COPY_CHUNK`s, at most S'), the rest of the
    row left as it was.
    A row's slots at or past its length are never read (the module's invariant), so inserting a row whose length is
    at most `count` needs no more: a 64-token prompt into a 4096-slot cache moves 64 slots, not 4096."""
    size = rows.shape[SLOT_AXIS]
    chunk, steps = _chunks(count, size)

    def step(i, buf):
        start = jnp.minimum(i * chunk, size - chunk)  # the last chunk may overlap the one before: the same data
        part = jax.lax.dynamic_slice_in_dim(rows, start, chunk, axis=SLOT_AXIS)  # [k, Hkv, chunk, d]
        at = start + jnp.arange(chunk)
        return buf.at[dst[:, None], :, at[None, :]].set(part.transpose(0, 2, 1, 3).astype(buf.dtype), mode="drop")

    return jax.lax.fori_loop(0, steps, step, buffer)


def copy_row(buffer: jax.Array, src, dst, count) -> jax.Array:
    """`buffer` [B, Hkv, S, d] with row `dst`'s first `count` slots (traced; whole `COPY_CHUNK`s) set to row `src`'s
    (both traced, in range): moving a row of length at most `count` (`put_rows`)."""
    _, heads, size, dim = buffer.shape
    chunk, steps = _chunks(count, size)

    def step(i, buf):
        start = jnp.minimum(i * chunk, size - chunk)
        part = jax.lax.dynamic_slice(buf, (src, 0, start, 0), (1, heads, chunk, dim))
        return jax.lax.dynamic_update_slice(buf, part, (dst, 0, start, 0))

    return jax.lax.fori_loop(0, steps, step, buffer)


def cut_slots(buffer: jax.Array, length: int) -> jax.Array:
    """`buffer`'s first `length` slots (a static slice)."""
    return jax.lax.slice_in_dim(buffer, 0, length, axis=SLOT_AXIS)


def grow_slots(buffer: jax.Array, length: int) -> jax.Array:
    """`buffer` zero-padded to `length` slots."""
    pad = [(0, 0)] * buffer.ndim
    pad[SLOT_AXIS] = (0, length - buffer.shape[SLOT_AXIS])
    return jnp.pad(buffer, pad)


def rollback(cache, lengths: jax.Array):
    """Sets each sequence's length to `min(lengths, current)`: forgets rows, never invents them.

    Works for any cache pytree with a `lengths` field. Used after a width-B verify to keep the committed
    prefix (`start + accepted + 1`).
    """
    lengths = jnp.asarray(lengths, jnp.int32)
    return cache.replace(lengths=jnp.minimum(jnp.broadcast_to(lengths, cache.lengths.shape), cache.lengths))
