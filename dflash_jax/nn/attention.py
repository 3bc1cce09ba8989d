"""Grouped-query attention over a KV cache, with causal, sliding-window and learned-sink variants."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.cache import write_rows

_NEG_INF = -1e30


def attention_mask(
    q_positions: jax.Array,
    k_positions: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    kv_length: jax.Array | None = None,
) -> jax.Array:
    """Boolean mask [batch, T, S]: may the query at `q_positions[b, t]` see the key at `k_positions[b, s]`?

    causal: `k <= q`. window W: `q - k < W` (the query's own token counts as one of the W).
    kv_length: keys at positions `>= kv_length[b]` are invisible (for non-causal attention over a cache).
    """
    q = q_positions[:, :, None]
    k = k_positions[:, None, :]
    mask = jnp.ones(jnp.broadcast_shapes(q.shape, k.shape), bool)
    if causal:
        mask &= k <= q
    if window is not None:
        mask &= q - k < window
    if kv_length is not None:
        mask &= k < kv_length[:, None, None]
    return mask


def gqa_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Softmax attention with grouped KV heads.

    q: [b, T, Hq, d]; k, v: [b, S, Hkv, d] with Hq = G * Hkv (query head h reads kv head h // G);
    mask: [b, T, S] bool. Scores `q.k * scale` accumulate in fp32; the softmax is fp32.
    sinks: optional [Hq] learned logits, one extra softmax column per head whose probability is dropped
    (gpt-oss): `p = softmax([s_1..s_S, sink])[:S]`.
    A query row with nothing visible returns zeros rather than NaN.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, _NEG_INF)
    if sinks is not None:
        sink_col = jnp.broadcast_to(
            sinks.astype(jnp.float32).reshape(1, hkv, g, 1, 1), (b, hkv, g, t, 1)
        )
        scores = jnp.concatenate([scores, sink_col], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = jnp.where(mask[:, None, None], probs, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def cached_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_buf: jax.Array,
    v_buf: jax.Array,
    positions: jax.Array,
    *,
    window: int | None,
    scale: float,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal (optionally sliding-window) attention of a block over a slot = position KV cache.

    q: [b, T, Hq, d]; k, v: [b, T, Hkv, d] for the tokens at `positions` [b, T] (consecutive, starting at
    each sequence's cache length); k_buf, v_buf: [b, S, Hkv, d]. The block's keys/values are written at
    slots `positions[:, 0] + [0, T)`, then every query attends to the slots `p` with `p <= q` (and
    `q - p < window`); slots at or past the length hold stale rows that causality never shows.
    Returns (out [b, T, Hq, d], k_buf, v_buf).
    """
    starts = positions[:, 0]
    k_buf = write_rows(k_buf, k, starts)
    v_buf = write_rows(v_buf, v, starts)
    slots = jnp.broadcast_to(jnp.arange(k_buf.shape[1], dtype=jnp.int32), (q.shape[0], k_buf.shape[1]))
    mask = attention_mask(positions, slots, causal=True, window=window)
    return gqa_attention(q, k_buf, v_buf, mask, scale=scale, sinks=sinks), k_buf, v_buf
