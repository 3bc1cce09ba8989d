"""Attention over a cache cut to its live prefix: a buffer cut to whole chunks of the chunked path that hold every
live row (what a serving round's length bucket computes over) gives the attention of the whole buffer bit for bit,
at live lengths on, before and after chunk boundaries, causal with a window and sinks, and over a cache with keys
outside it (the draft's block)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.nn.attention import AttentionTuning, cached_causal_attention, kv_cache_attention

TUNING = AttentionTuning(chunk=16, dense_max_rows=32)
ROWS = 128


def _buffers(b, rows, hkv, d, seed):
    """Block rows [b, T, Hkv, d] (a forward's keys and values)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(k1, (b, rows, hkv, d), jnp.float32),
            jax.random.normal(k2, (b, rows, hkv, d), jnp.float32))


def _cache(b, rows, hkv, d, seed):
    """Cache buffers in the cache's layout [b, Hkv, S, d]."""
    return tuple(jnp.swapaxes(x, 1, 2) for x in _buffers(b, rows, hkv, d, seed))


@pytest.mark.parametrize("lengths", [(15, 3), (16, 16), (17, 40), (47, 48), (63, 1)])
@pytest.mark.parametrize("window,sinks", [(None, False), (20, True)])
def test_cut_buffer_equals_whole_buffer(lengths, window, sinks):
    b, t, hq, hkv, d = len(lengths), 3, 4, 2, 8
    k_buf, v_buf = _cache(b, ROWS, hkv, d, 0)
    q = jax.random.normal(jax.random.key(1), (b, t, hq, d), jnp.float32)
    k, v = _buffers(b, t, hkv, d, 2)
    starts = jnp.asarray(lengths, jnp.int32)
    positions = starts[:, None] + jnp.arange(t)[None]
    sink = jnp.linspace(-1.0, 1.0, hq) if sinks else None
    whole = cached_causal_attention(q, k, v, k_buf, v_buf, positions, window=window, scale=0.3, sinks=sink,
                                    tuning=TUNING)
    need = max(lengths) + t
    for cut in (48, 64, 112):  # whole chunks of 16, each > dense_max_rows: the chunked path
        if cut < need:
            continue
        part = cached_causal_attention(q, k, v, k_buf[:, :, :cut], v_buf[:, :, :cut], positions, window=window,
                                       scale=0.3, sinks=sink, tuning=TUNING)
        np.testing.assert_array_equal(np.asarray(part[0]), np.asarray(whole[0]))
        np.testing.assert_array_equal(np.asarray(part[1]), np.asarray(whole[1][:, :, :cut]))
        np.testing.assert_array_equal(np.asarray(whole[1][:, :, cut:]), np.asarray(k_buf[:, :, cut:]))  # untouched


@pytest.mark.parametrize("lengths", [(5, 31), (32, 33)])
def test_cut_buffer_with_extra_keys(lengths):
    """Non-causal attention over the live rows plus keys outside the cache (the draft's form)."""
    b, t, hq, hkv, d = len(lengths), 4, 4, 2, 8
    k_buf, v_buf = _cache(b, ROWS, hkv, d, 3)
    q = jax.random.normal(jax.random.key(4), (b, t, hq, d), jnp.float32)
    kx, vx = _buffers(b, t, hkv, d, 5)
    kv_lengths = jnp.asarray(lengths, jnp.int32)
    positions = kv_lengths[:, None] + jnp.arange(t)[None]
    extra = (kx, vx, jnp.ones((b, t, t), bool))
    whole = kv_cache_attention(q, k_buf, v_buf, positions, kv_lengths, scale=0.2, causal=False, extra=extra,
                               tuning=TUNING)
    part = kv_cache_attention(q, k_buf[:, :, :48], v_buf[:, :, :48], positions, kv_lengths, scale=0.2, causal=False,
                              extra=extra, tuning=TUNING)
    np.testing.assert_array_equal(np.asarray(part), np.asarray(whole))


def test_dense_and_chunked_agree_to_rounding():
    """Why a length bucket never cuts a cache into the dense path: the dense softmax over the live rows matches the
    chunked one only to rounding (the runner's buckets stay on the chunked path)."""
    b, t, hq, hkv, d = 2, 2, 4, 2, 8
    k_buf, v_buf = _cache(b, ROWS, hkv, d, 6)
    q = jax.random.normal(jax.random.key(7), (b, t, hq, d), jnp.float32)
    kv_lengths = jnp.asarray([20, 30], jnp.int32)
    positions = kv_lengths[:, None] - 1 + jnp.zeros((1, t), jnp.int32)
    chunked = kv_cache_attention(q, k_buf, v_buf, positions, kv_lengths, scale=0.3, tuning=TUNING)
    dense = kv_cache_attention(q, k_buf[:, :, :32], v_buf[:, :, :32], positions, kv_lengths, scale=0.3, tuning=TUNING)
    np.testing.assert_allclose(np.asarray(dense), np.asarray(chunked), rtol=1e-5, atol=1e-6)
