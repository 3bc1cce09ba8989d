"""The compiled CPU attention kernel (`pallas_kernels.cpu_kernels.kv_attention`) against the XLA dense path it
replaces in `nn.attention.kv_cache_attention`, and the properties it adds: a row's result follows only its own live
keys (not the buffer's size, the other rows or the block it is verified in)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.nn import attention as A
from pallas_kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels could not be built here")

XLA = A.AttentionTuning(kernel=False)


def _inputs(seed, b, t, hq, hkv, s, d, x=0):
    rng = np.random.default_rng(seed)

    def f(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    q, k, v = f(b, t, hq, d), f(b, hkv, s, d), f(b, hkv, s, d)
    extra = None
    if x:
        extra = (f(b, x, hkv, d), f(b, x, hkv, d), jnp.asarray(rng.random((b, t, x)) < 0.6))
    return q, k, v, extra


@pytest.mark.parametrize("b,t,hq,hkv,s,d,causal,x,window,sinks", [
    (3, 1, 4, 2, 64, 32, True, 0, None, False),     # a decode step
    (2, 4, 4, 2, 128, 32, True, 0, None, False),    # a width-4 verify
    (2, 7, 8, 2, 40, 64, False, 0, None, False),    # non-causal, a head width of 64
    (1, 16, 2, 1, 33, 20, True, 0, None, False),    # a head width that is not a multiple of the vector width
    (2, 4, 2, 1, 50, 160, True, 0, None, False),    # heads wider than 128: the kernel's scalar loops
    (3, 4, 4, 2, 64, 32, False, 4, None, False),    # the draft's block beside its context cache
    (2, 16, 8, 2, 100, 64, False, 16, None, False),
    (2, 4, 4, 2, 30, 32, True, 4, None, False),
    (3, 4, 8, 2, 96, 64, True, 0, 16, True),        # gpt-oss: a sliding window and sinks
    (3, 1, 8, 2, 96, 64, True, 0, None, True),      # sinks alone
    (2, 5, 4, 2, 60, 32, False, 3, 7, False),       # a window without causality, beside-keys
    (2, 4, 2, 1, 70, 160, True, 0, 9, True),        # window and sinks in the scalar loops
])
def test_the_kernel_equals_the_dense_path_to_rounding(b, t, hq, hkv, s, d, causal, x, window, sinks):
    q, k, v, extra = _inputs(b * 100 + s, b, t, hq, hkv, s, d, x)
    sinks = jnp.linspace(-1.0, 2.0, hq, dtype=jnp.float32) if sinks else None
    lengths = jnp.asarray([0, s, s // 3][:b], jnp.int32)  # a row with nothing live, a full one, a partial one
    positions = jnp.maximum(lengths[:, None] - (0 if x else t) + jnp.arange(t)[None], -1)
    kw = dict(scale=0.17, causal=causal, extra=extra, window=window, sinks=sinks)
    want = A.kv_cache_attention(q, k, v, positions, lengths, tuning=XLA, **kw)
    got = cpu_kernels.kv_attention(q, k, v, positions, lengths, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
    if not x:  # a query that sees nothing gets zeros, as the dense path gives
        assert not np.any(np.asarray(got)[0])


def test_a_rows_result_follows_only_its_own_live_keys():
    """Bit for bit: the same row in a longer buffer, beside other rows of other lengths, and each query of a width-4
    verify block against the same query decoded alone (T = 1): what makes a speculative round's logits equal plain
    decoding's, not only its tokens."""
    q, k, v, _ = _inputs(1, 2, 4, 4, 2, 64, 32)
    lengths = jnp.asarray([40, 21], jnp.int32)
    positions = lengths[:, None] - 4 + jnp.arange(4)[None]
    base = np.asarray(cpu_kernels.kv_attention(q, k, v, positions, lengths, scale=0.2, causal=True))
    pad = jnp.zeros((2, 2, 64, 32), jnp.float32) + 7.0  # garbage past every live slot
    longer = cpu_kernels.kv_attention(q, jnp.concatenate([k, pad], 2), jnp.concatenate([v, pad], 2), positions,
                                      lengths, scale=0.2, causal=True)
    np.testing.assert_array_equal(np.asarray(longer), base)
    other = cpu_kernels.kv_attention(q, k, v, positions, jnp.asarray([40, 64], jnp.int32).at[1].set(21),
                                     scale=0.2, causal=True)
    np.testing.assert_array_equal(np.asarray(other), base)
    alone = cpu_kernels.kv_attention(q[:1], k[:1], v[:1], positions[:1], lengths[:1], scale=0.2, causal=True)
    np.testing.assert_array_equal(np.asarray(alone), base[:1])
    for t in range(4):  # each verify position decoded on its own: the cache holds keys up to its position
        one = cpu_kernels.kv_attention(q[:, t:t + 1], k, v, positions[:, t:t + 1], positions[:, t] + 1, scale=0.2,
                                       causal=True)
        np.testing.assert_array_equal(np.asarray(one)[:, 0], base[:, t])


def test_kv_cache_attention_takes_the_kernel_where_it_applies():
    q, k, v, _ = _inputs(3, 2, 2, 4, 2, 32, 16)
    lengths = jnp.asarray([5, 32], jnp.int32)
    positions = lengths[:, None] - 2 + jnp.arange(2)[None]

    def text(q_dtype=jnp.float32, **kw):
        fn = lambda q_: A.kv_cache_attention(q_, k, v, positions, lengths, scale=0.3, **kw)  # noqa: E731
        return jax.jit(fn).lower(q.astype(q_dtype)).as_text()

    assert cpu_kernels.ATTENTION_TARGET in text()
    assert cpu_kernels.ATTENTION_TARGET in text(window=8, sinks=jnp.zeros(4, jnp.float32))
    assert cpu_kernels.ATTENTION_TARGET not in text(tuning=XLA)
    assert cpu_kernels.ATTENTION_TARGET not in text(q_dtype=jnp.bfloat16)  # float32 only


def test_the_kernels_gradient_is_the_dense_paths():
    q, k, v, extra = _inputs(4, 2, 3, 4, 2, 24, 16, x=3)
    lengths = jnp.asarray([9, 24], jnp.int32)
    positions = lengths[:, None] + jnp.arange(3)[None]

    def loss(tuning):
        def f(q_, k_, v_, kx, sinks):
            out = A.kv_cache_attention(q_, k_, v_, positions, lengths, scale=0.25, causal=False,
                                       extra=(kx, extra[1], extra[2]), window=12, sinks=sinks, tuning=tuning)
            return jnp.sum(out * jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape) / out.size)
        return jax.grad(f, argnums=(0, 1, 2, 3, 4))(q, k, v, extra[0], jnp.asarray([0.5, -1.0, 0.0, 2.0]))

    for got, want in zip(loss(A.AttentionTuning()), loss(XLA)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_the_first_rows_of_larger_buffers_are_read_in_place():
    """Buffers with more rows than the queries (a serving round over the first rows of its cache, `reads_in_place`):
    the kernel reads the first rows where they lie, bit for bit what it gives on the cut rows; XLA's paths cut them
    first (the same to rounding); the gradient is the dense path's on those rows and zero past them."""
    q, k, v, extra = _inputs(5, 5, 4, 4, 2, 48, 32, x=2)
    b = 3
    q, extra = q[:b], tuple(e[:b] for e in extra)
    lengths = jnp.asarray([17, 48, 1], jnp.int32)
    positions = jnp.minimum(lengths[:, None] + jnp.arange(4)[None], 47)
    kw = dict(scale=0.2, causal=True, extra=extra, window=20)
    cut = np.asarray(cpu_kernels.kv_attention(q, k[:b], v[:b], positions, lengths, **kw))
    np.testing.assert_array_equal(np.asarray(cpu_kernels.kv_attention(q, k, v, positions, lengths, **kw)), cut)
    np.testing.assert_array_equal(np.asarray(A.kv_cache_attention(q, k, v, positions, lengths, **kw)), cut)
    for tuning in (XLA, A.AttentionTuning(kernel=False, dense_max_rows=0, chunk=16)):
        np.testing.assert_allclose(np.asarray(A.kv_cache_attention(q, k, v, positions, lengths, tuning=tuning, **kw)),
                                   cut, rtol=1e-5, atol=2e-6)
    assert A.reads_in_place(jnp.float32)
    assert not A.reads_in_place(jnp.bfloat16)
    assert not A.reads_in_place(jnp.float32, A.AttentionTuning(in_place=False))
    assert not A.reads_in_place(jnp.float32, XLA)

    def grads(k_, v_, tuning):
        def f(q_, k_, v_):
            out = A.kv_cache_attention(q_, k_, v_, positions, lengths, tuning=tuning, **kw)
            return jnp.sum(out * jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape) / out.size)
        return jax.grad(f, argnums=(0, 1, 2))(q, k_, v_)

    got, want = grads(k, v, A.AttentionTuning()), grads(k[:b], v[:b], XLA)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(np.asarray(g[:b]), np.asarray(w), rtol=1e-5, atol=1e-6)
        assert not np.any(np.asarray(g[b:]))
