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

TUNING = AttentionTuning(chunk=16, dense_max_rows=32, kernel=False)  # the XLA paths (the CPU kernel: tests/kernels)
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


def test_dense_attention_with_extra_keys_reads_the_cache_in_place():
    """The dense path over a cache and keys beside it (the draft's block) takes one softmax over both, each read where
    it is: the same as attending over the two joined (to rounding: the value sums split in two), without the join,
    which copied every layer's whole K/V buffers every round (`nn.attention._attend` with parts)."""
    b, t, hq, hkv, d = 2, 4, 4, 2, 8
    k_buf, v_buf = _cache(b, 32, hkv, d, 8)
    q = jax.random.normal(jax.random.key(9), (b, t, hq, d), jnp.float32)
    kx, vx = _buffers(b, t, hkv, d, 10)
    kv_lengths = jnp.asarray([7, 29], jnp.int32)
    positions = kv_lengths[:, None] + jnp.arange(t)[None]
    block = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, axis=0).at[1, 0, 3].set(True)
    got = kv_cache_attention(q, k_buf, v_buf, positions, kv_lengths, scale=0.3, causal=False,
                             extra=(kx, vx, block), tuning=TUNING)
    # the reference: the extra rows written into a longer buffer past every live row, visible by their own mask
    keys = jnp.concatenate([k_buf, jnp.swapaxes(kx, 1, 2)], axis=2)
    values = jnp.concatenate([v_buf, jnp.swapaxes(vx, 1, 2)], axis=2)
    slots = jnp.arange(32)[None, None, :] < kv_lengths[:, None, None]
    mask = jnp.concatenate([jnp.broadcast_to(slots, (b, t, 32)), block], axis=2)
    scores = jnp.einsum("bthd,bhsd->bhts", q.reshape(b, t, hkv, hq // hkv, d).reshape(b, t, hq, d),
                        jnp.repeat(keys, hq // hkv, axis=1)) * 0.3
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
    want = jnp.einsum("bhts,bhsd->bthd", probs, jnp.repeat(values, hq // hkv, axis=1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    hlo = jax.jit(lambda *a: kv_cache_attention(*a, scale=0.3, causal=False, extra=(kx, vx, block), tuning=TUNING)
                  ).lower(q, k_buf, v_buf, positions, kv_lengths).compile().as_text()
    joined = "f32[%d,%d,%d,%d]" % (b, hkv, 32 + t, d)
    assert not [line for line in hlo.splitlines() if f"= {joined}" in line], "the cache was joined with the block"


def test_a_gpu_takes_the_dense_path_where_its_scores_fit_and_large_chunks_beyond():
    """On a GPU the chunked path's loop is one the host drives (a wait per trip and layer), so a call whose dense
    scores fit `gpu_dense_bytes` takes the dense path whatever the buffer's rows, and a larger one the chunked path
    in the largest chunks the budget allows. Other platforms keep `chunk` and `dense_max_rows`."""
    from pallas_kernels import target

    tuning = AttentionTuning()
    assert tuning.gpu_path(32, 16, 8192) is None  # a width-16 verify of 32 query heads over an 8192-row cache
    assert tuning.gpu_path(32, 16, 131072) is None  # 256 MiB of scores
    assert tuning.gpu_path(32, 4096, 8192) == 2048  # a 4096-token prefill chunk: 4 GiB dense, 2048-row chunks
    assert tuning.gpu_path(32, 4096, 1024) is None
    assert AttentionTuning(gpu_dense_bytes=1 << 20).gpu_path(32, 16, 8192) == 512  # 512 x 2 KiB of scores
    assert AttentionTuning(gpu_dense_bytes=1 << 18).gpu_path(32, 16, 8192) == 256  # never below `chunk`
    assert AttentionTuning(dense_max_rows=None).gpu_path(32, 4096, 1 << 20) is None  # dense forced
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="gpu_dense_bytes"):
            AttentionTuning(gpu_dense_bytes=bad)

    b, t, hq, hkv, d = 1, 4, 4, 2, 8
    k_buf, v_buf = _cache(b, ROWS, hkv, d, 8)
    q = jax.random.normal(jax.random.key(9), (b, t, hq, d), jnp.float32)
    lengths = jnp.asarray([50], jnp.int32)
    positions = lengths[:, None] - t + jnp.arange(t)[None]

    def loops(tuning, platform):
        with target.compiling_for(platform):
            jaxpr = jax.make_jaxpr(lambda *a: kv_cache_attention(*a, scale=0.3, tuning=tuning))(
                q, k_buf, v_buf, positions, lengths)
        return "while" in str(jaxpr)

    assert loops(TUNING, "cpu") and not loops(TUNING, "gpu")
    assert loops(AttentionTuning(chunk=16, dense_max_rows=32, kernel=False, gpu_dense_bytes=None), "gpu")
    assert loops(AttentionTuning(chunk=16, dense_max_rows=0, kernel=False), "gpu")  # chunked forced
    with target.compiling_for("gpu"):
        on_gpu = kv_cache_attention(q, k_buf, v_buf, positions, lengths, scale=0.3, tuning=TUNING)
    chunked = kv_cache_attention(q, k_buf, v_buf, positions, lengths, scale=0.3, tuning=TUNING)
    np.testing.assert_allclose(np.asarray(on_gpu), np.asarray(chunked), rtol=1e-5, atol=1e-6)
