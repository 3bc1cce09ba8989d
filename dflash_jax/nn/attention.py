"""Grouped-query attention over a KV cache, with causal, sliding-window and learned-sink variants.

Two implementations of the same attention over a `[b, Hkv, S, d]` cache buffer (`cache.SLOT_AXIS`), chosen
statically:
- dense: one softmax over all S slots under a position mask (`gqa_attention`). Cost follows the buffer.
  Reverse-differentiable; used for small buffers and whenever the block fills the buffer (training,
  full-sequence prefill), where nothing could be skipped anyway.
- chunked (flash-decoding style): a `lax.fori_loop` with a traced trip count over fixed-size KV chunks,
  from the first chunk any query's window can see up to `ceil(max(kv_lengths) / chunk)`, with an online
  fp32 softmax (running max / sum; gpt-oss sinks are the initial state of the running max and sum). Cost
  follows the live length, not the buffer. A while loop has no reverse-mode rule, so the chunked path's
  backward is the dense path's (`jax.custom_vjp`): gradients are exact, only slower.
On a CPU with the compiled kernels (`pallas_kernels.cpu_kernels`), float32 attention (windows and sinks included) is
one call instead (`cpu_kernels.kv_attention`): each query reads only its own row's visible keys, so its cost
follows the live lengths and a row's result depends on nothing else in the call (not the buffer's size, the other
rows, nor the block's width); its gradient is the dense path's. It also reads a row's keys where they lie in a buffer
with more rows than the call's queries, so a caller computing the first rows of a larger cache may hand it the whole
buffers instead of cutting them (`reads_in_place`).
On a GPU the chunked path's loop is one the host drives: each trip reads its predicate back from the device and
waits, per attention layer (XLA's thunk sequence: `tests/gpu_compile/deviceless.py`, `Launches`). Reading a whole
buffer of a verify's width costs less than those waits up to long caches, so there a call whose dense scores fit
`AttentionTuning.gpu_dense_bytes` takes the dense path, and a larger one the chunked path in chunks as large as that
budget allows (`gpu_path`).
`AttentionTuning` (chunk rows, the largest buffer kept dense, the CPU kernel, the GPU's budget) is a process-wide
setting read when a function is traced; `attention_tuning(...)` changes it and clears jit caches so that the next call
retraces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dflash_jax.cache import SLOT_AXIS, write_rows
from pallas_kernels import cpu_kernels, target

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
    return _attend(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask, scale=scale, sinks=sinks)


def _heads_major(x: jax.Array) -> jax.Array:
    """Block rows [b, T, Hkv, d] in a cache buffer's order [b, Hkv, T, d]."""
    return jnp.swapaxes(x, 1, 2)


def _attend(q, k, v, mask, *, scale, sinks):
    """`gqa_attention` over keys and values in a cache buffer's order [b, Hkv, S, d]: both products then read each
    (row, head)'s keys as one contiguous [S, d] matrix (no copy of the buffer into another order). k and v may be
    tuples of such parts (a cache buffer and a few rows beside it, the draft's block): one softmax over every
    part's keys, each part read where it is (joining them would copy the whole buffer every call)."""
    k, v = (k if isinstance(k, tuple) else (k,)), (v if isinstance(v, tuple) else (v,))
    b, t, hq, d = q.shape
    hkv = k[0].shape[1]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.concatenate([jnp.einsum("btkgd,bksd->bkgts", qg, part, preferred_element_type=jnp.float32)
                              for part in k], axis=-1) * scale
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
    # [b, Hkv, G, T, d] first, then the small output reordered: asked for [b, T, Hkv, G, d] directly, XLA:CPU
    # multiplies V^T by P^T, a product with the contraction on V's major axis that its fast matmul does not take
    out, start = None, 0
    for part in v:
        n = part.shape[SLOT_AXIS]
        pv = jnp.einsum("bkgts,bksd->bkgtd", probs[..., start: start + n].astype(part.dtype), part,
                        preferred_element_type=jnp.float32)
        out, start = (pv if out is None else out + pv), start + n
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q.dtype)


# ---------------------------------------------------------------------------------------------------------
# Which path, and its chunk size


@dataclasses.dataclass(frozen=True)
class AttentionTuning:
    """chunk: KV rows per step of the chunked path. dense_max_rows: buffers of at most this many rows take
    the dense path (also any buffer with fewer than `chunk` rows beyond the block: nothing to skip).
    `dense_max_rows=None` forces the dense path everywhere; 0 forces the chunked path where it applies.
    kernel: on a CPU with the compiled kernels, float32 attention takes `cpu_kernels.kv_attention` instead of
    either path (each query reads its own row's live keys only). in_place: with the kernel, callers that compute
    the first rows of a cache hand it the whole buffers instead of cut copies (`reads_in_place`).
    gpu_dense_bytes: on a GPU, the float32 scores (batch x query heads x queries x buffer slots x 4 bytes) up to
    which a call takes the dense path whatever the buffer's rows, and the scores one chunk of the chunked path may
    hold beyond them (`gpu_path`); None (or `dense_max_rows=0`): a GPU follows `chunk` and `dense_max_rows` as other
    platforms do."""

    chunk: int = 256
    dense_max_rows: int | None = 512
    kernel: bool = True
    in_place: bool = True
    gpu_dense_bytes: int | None = 1 << 30

    def __post_init__(self):
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.gpu_dense_bytes is not None and (isinstance(self.gpu_dense_bytes, bool)
                                                 or not isinstance(self.gpu_dense_bytes, int)
                                                 or self.gpu_dense_bytes < 1):
            raise ValueError(f"gpu_dense_bytes must be a positive integer (bytes) or None, got "
                             f"{self.gpu_dense_bytes!r}")

    def gpu_path(self, heads: int, block_rows: int, buffer_rows: int) -> int | None:
        """On a GPU (with `gpu_dense_bytes`): None for the dense path (its scores, `heads` = batch x query heads,
        fit the budget), else the chunked path's chunk: the largest power of two from `chunk` up whose scores fit
        it. A loop the host drives costs a wait per trip, so the fewer trips the better."""
        per_slot = heads * block_rows * 4
        if self.dense_max_rows is None or per_slot * buffer_rows <= self.gpu_dense_bytes:
            return None
        chunk = self.chunk
        while chunk * 2 <= buffer_rows and per_slot * chunk * 2 <= self.gpu_dense_bytes:
            chunk *= 2
        return chunk

    def use_chunked(self, buffer_rows: int, block_rows: int) -> bool:
        if self.dense_max_rows is None or buffer_rows <= self.dense_max_rows:
            return False
        return buffer_rows >= block_rows + min(self.chunk, buffer_rows)


_TUNING = AttentionTuning()


def get_attention_tuning() -> AttentionTuning:
    return _TUNING


def set_attention_tuning(tuning: AttentionTuning) -> AttentionTuning:
    """Sets the process-wide tuning; returns the previous one. The path is chosen when a function is traced,
    so a change clears jit caches (every jitted function retraces on its next call)."""
    global _TUNING
    previous = _TUNING
    if tuning != previous:
        _TUNING = tuning
        jax.clear_caches()
    return previous


@contextlib.contextmanager
def attention_tuning(**fields):
    """`with attention_tuning(dense_max_rows=None): ...` runs the block under a modified tuning."""
    previous = set_attention_tuning(dataclasses.replace(_TUNING, **fields))
    try:
        yield get_attention_tuning()
    finally:
        set_attention_tuning(previous)


# ---------------------------------------------------------------------------------------------------------
# Attention of queries over a cache buffer's live rows (plus, optionally, keys that live outside the cache)


def _visible(q_positions, k_positions, kv_lengths, *, causal: bool, window: int | None):
    """[b, T, S]: key slots below the live length, under the causal / window rule; a window on non-causal
    attention also hides keys `k - q >= W`."""
    mask = attention_mask(q_positions, k_positions, causal=causal, window=window, kv_length=kv_lengths)
    if window is not None and not causal:
        mask &= k_positions[:, None, :] - q_positions[:, :, None] < window
    return mask


class _Online(NamedTuple):
    """Running softmax state per (b, kv head, group, query): max m, sum l [b, Hkv, G, T] fp32 and the
    unnormalized output acc [b, Hkv, G, T, d] fp32."""

    m: jax.Array
    l: jax.Array
    acc: jax.Array


def _online_init(b, t, hkv, g, d, sinks) -> _Online:
    shape = (b, hkv, g, t)
    if sinks is None:
        m, l = jnp.full(shape, _NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32)
    else:  # the sink column: a logit whose probability mass is counted in the sum but reads no value
        m = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, g, 1), shape)
        l = jnp.ones(shape, jnp.float32)
    return _Online(m=m, l=l, acc=jnp.zeros(shape + (d,), jnp.float32))


def _online_step(state: _Online, qg, k, v, mask, scale) -> _Online:
    """Folds keys k, v [b, Hkv, C, d] under mask [b, T, C] into the running softmax. Masked keys add exactly
    nothing; their values must be finite (the caller zeroes rows that may hold garbage)."""
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    visible = mask[:, None, None]
    scores = jnp.where(visible, scores, _NEG_INF)
    m_new = jnp.maximum(state.m, jnp.max(scores, axis=-1))
    p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
    alpha = jnp.exp(state.m - m_new)
    pv = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return _Online(m=m_new, l=state.l * alpha + jnp.sum(p, axis=-1), acc=state.acc * alpha[..., None] + pv)


def _online_finish(state: _Online, dtype) -> jax.Array:
    """[b, T, Hq, d]: acc / l; a query with nothing visible (l == 0, or only a sink) gets zeros."""
    out = state.acc / jnp.where(state.l > 0, state.l, 1.0)[..., None]
    b, hkv, g, t, d = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d).astype(dtype)


def live_chunks(q_positions, kv_lengths, *, rows: int, chunk: int, window: int | None = None):
    """(first, stop) int32 scalars: the chunked path reads chunks `first <= i < stop` of `chunk` rows, i.e.
    up to the chunk holding the last live row of any sequence (`max(kv_lengths)`), starting, under a window
    W, at the chunk holding the earliest key any query can see (`min(q_positions) - W + 1`)."""
    chunk = min(chunk, rows)
    stop = (jnp.minimum(jnp.max(kv_lengths), rows).astype(jnp.int32) + chunk - 1) // chunk
    first = jnp.int32(0)
    if window is not None:
        first = jnp.minimum(jnp.maximum(jnp.min(q_positions).astype(jnp.int32) - window + 1, 0) // chunk, stop)
    return first, stop


def read_chunk(buf, offset, chunk):
    """Slots `offset + [0, chunk)` of a [b, Hkv, S, d] buffer: the chunked path's only read of a cache."""
    return lax.dynamic_slice_in_dim(buf, offset, chunk, axis=SLOT_AXIS)


def _chunked(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra, *, causal, window, scale, chunk):
    b, t, hq, d = q.shape
    hkv, rows = k_buf.shape[1], k_buf.shape[SLOT_AXIS]
    g = hq // hkv
    chunk = min(chunk, rows)
    qg = q.reshape(b, t, hkv, g, d)
    state = _online_init(b, t, hkv, g, d, sinks)
    first, stop = live_chunks(q_positions, kv_lengths, rows=rows, chunk=chunk, window=window)
    lengths = kv_lengths[:, None]

    def body(i, state):
        base = i * chunk
        # the last chunk of a buffer that is not a multiple of `chunk` is read from `rows - chunk`; its
        # slots below `base` belong to the previous chunk and are masked here
        offset = jnp.minimum(base, rows - chunk)
        kc = read_chunk(k_buf, offset, chunk)
        vc = read_chunk(v_buf, offset, chunk)
        slots = offset + jnp.arange(chunk, dtype=jnp.int32)
        live = (slots[None, :] >= base) & (slots[None, :] < lengths)  # [b, C]
        vc = jnp.where(live[:, None, :, None], vc, jnp.zeros((), vc.dtype))  # stale rows past the length
        k_positions = jnp.broadcast_to(slots, (b, chunk))
        mask = live[:, None, :] & _visible(q_positions, k_positions, None, causal=causal, window=window)
        return _online_step(state, qg, kc, vc, mask, scale)

    state = lax.fori_loop(first, stop, body, state)
    if extra is not None:
        k_x, v_x, mask_x = extra
        state = _online_step(state, qg, _heads_major(k_x.astype(k_buf.dtype)), _heads_major(v_x.astype(v_buf.dtype)),
                             mask_x, scale)
    return _online_finish(state, q.dtype)


def _dense(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra, *, causal, window, scale):
    b, rows = k_buf.shape[0], k_buf.shape[SLOT_AXIS]
    slots = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32), (b, rows))
    mask = _visible(q_positions, slots, kv_lengths, causal=causal, window=window)
    if extra is None:
        return _attend(q, k_buf, v_buf, mask, scale=scale, sinks=sinks)
    k_x, v_x, mask_x = extra
    return _attend(q, (k_buf, _heads_major(k_x.astype(k_buf.dtype))),
                   (v_buf, _heads_major(v_x.astype(v_buf.dtype))), jnp.concatenate([mask, mask_x], axis=2),
                   scale=scale, sinks=sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _chunked_with_dense_grad(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra, causal, window, scale, chunk):
    return _chunked(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra, causal=causal, window=window,
                    scale=scale, chunk=chunk)


def _chunked_fwd(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra, causal, window, scale, chunk):
    out = _chunked(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra, causal=causal, window=window,
                   scale=scale, chunk=chunk)
    return out, (q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra)


def _dense_grads(causal, window, scale, residuals, g):
    """The dense path's cotangents for the chunked path and the CPU kernel (residuals: their differentiable
    arguments, `(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra)`)."""
    q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra = residuals
    dense = lambda q_, k_, v_, s_, x_: _dense(  # noqa: E731
        q_, k_, v_, q_positions, kv_lengths, s_, x_, causal=causal, window=window, scale=scale)
    _, vjp = jax.vjp(dense, q, k_buf, v_buf, sinks, extra)
    dq, dk, dv, dsinks, dextra = vjp(g)
    if extra is not None:  # the mask of the extra keys is boolean: no cotangent
        dextra = (dextra[0], dextra[1], None)
    return dq, dk, dv, None, None, dsinks, dextra


def _chunked_bwd(causal, window, scale, chunk, residuals, g):
    return _dense_grads(causal, window, scale, residuals, g)


_chunked_with_dense_grad.defvjp(_chunked_fwd, _chunked_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _kernel_with_dense_grad(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra, causal, window, scale):
    return cpu_kernels.kv_attention(q, k_buf, v_buf, q_positions, kv_lengths, scale=scale, causal=causal, extra=extra,
                                    window=window, sinks=sinks)


def _kernel_fwd(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra, causal, window, scale):
    return _kernel_with_dense_grad(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra, causal, window, scale), (
        q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra)


def _kernel_bwd(causal, window, scale, residuals, g):
    """The dense path's cotangents over the queries' rows of the buffers; zeros for the rows past them."""
    q, k_buf, v_buf = residuals[:3]
    b = q.shape[0]
    if k_buf.shape[0] == b:
        return _dense_grads(causal, window, scale, residuals, g)
    dq, dk, dv, *rest = _dense_grads(causal, window, scale, (q, k_buf[:b], v_buf[:b], *residuals[3:]), g)
    pad = [(0, k_buf.shape[0] - b)] + [(0, 0)] * (k_buf.ndim - 1)
    return (dq, jnp.pad(dk, pad), jnp.pad(dv, pad), *rest)


_kernel_with_dense_grad.defvjp(_kernel_fwd, _kernel_bwd)


def follows_gpu_budget(tuning: AttentionTuning | None = None) -> bool:
    """Whether attention traced now picks its path by `AttentionTuning.gpu_path` (on a GPU, with
    `gpu_dense_bytes` set and the chunked path not forced by `dense_max_rows=0`)."""
    tuning = tuning or _TUNING
    return target.platform() == "gpu" and tuning.gpu_dense_bytes is not None and tuning.dense_max_rows != 0


def uses_kernel(q, k_buf, v_buf, tuning: AttentionTuning | None = None) -> bool:
    """Whether `kv_cache_attention` of these operands is the compiled CPU kernel (`AttentionTuning.kernel`)."""
    tuning = tuning or _TUNING
    return (tuning.kernel and target.platform() == "cpu" and cpu_kernels.supports_attention(q, k_buf, v_buf)
            and cpu_kernels.available())


def reads_in_place(dtype, tuning: AttentionTuning | None = None) -> bool:
    """Whether `kv_cache_attention` of float32 queries over cache buffers of `dtype` reads each row's live slots
    where they lie (the CPU kernel, with `AttentionTuning.in_place`): a caller that computes the first rows of a
    cache may then hand it the whole buffers (every row, every slot) and write its new keys into them in place,
    instead of cutting copies of the rows and slots it computes and writing them back. The other paths take such
    buffers too (cut to the queries' rows first), so this only tells which costs less."""
    tuning = tuning or _TUNING
    return (tuning.kernel and tuning.in_place and target.platform() == "cpu" and jnp.dtype(dtype) == jnp.float32
            and cpu_kernels.available())


def kv_cache_attention(
    q: jax.Array,
    k_buf: jax.Array,
    v_buf: jax.Array,
    q_positions: jax.Array,
    kv_lengths: jax.Array,
    *,
    scale: float,
    causal: bool = True,
    window: int | None = None,
    sinks: jax.Array | None = None,
    extra: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    tuning: AttentionTuning | None = None,
) -> jax.Array:
    """Attention of queries over the live rows of a slot = position cache buffer.

    q: [b, T, Hq, d] at `q_positions` [b, T]; k_buf, v_buf: [b', Hkv, S, d], slot p holding position p, b' >= b
    (rows past b are not read: `reads_in_place`); kv_lengths [b]: slots `>= kv_lengths[b]` are not live (never
    seen, and in the chunked path chunks past `max(kv_lengths)` are never read). A live slot p is visible to query
    q under `causal` (p <= q) and `window` W (q - p < W; without causality also p - q < W). extra: optional
    (k [b, X, Hkv, d], v, mask [b, T, X] bool), keys outside the cache (the draft's block) under their own mask.
    sinks: [Hq] logits (see `gqa_attention`). A query with nothing visible gets zeros. The path (the kernel, dense or
    chunked, same result) follows `tuning` (default: the process-wide `get_attention_tuning()`).
    """
    tuning = tuning or _TUNING
    if uses_kernel(q, k_buf, v_buf, tuning):
        return _kernel_with_dense_grad(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra, causal, window, scale)
    if k_buf.shape[0] != q.shape[0]:  # the first rows of larger buffers
        k_buf, v_buf = k_buf[: q.shape[0]], v_buf[: q.shape[0]]
    block_rows = q.shape[1]
    if follows_gpu_budget(tuning):  # None: the dense path
        chunk = tuning.gpu_path(q.shape[0] * q.shape[2], block_rows, k_buf.shape[SLOT_AXIS])
    else:
        chunk = tuning.chunk if tuning.use_chunked(k_buf.shape[SLOT_AXIS], block_rows) else None
    if chunk is None:
        return _dense(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra, causal=causal, window=window,
                      scale=scale)
    return _chunked_with_dense_grad(q, k_buf, v_buf, q_positions, kv_lengths, sinks, extra, causal, window,
                                    scale, chunk)


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
    tuning: AttentionTuning | None = None,
    tree_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal (optionally sliding-window) attention of a block over a slot = position KV cache.

    q: [b, T, Hq, d]; k, v: [b, T, Hkv, d] for the tokens at `positions` [b, T] (consecutive, starting at
    each sequence's cache length); k_buf, v_buf: [b, Hkv, S, d]. The block's keys/values are written at
    slots `positions[:, 0] + [0, T)`, then every query attends to the slots `p` with `p <= q` (and
    `q - p < window`); slots at or past the length hold stale rows that causality never shows, and that the
    chunked path never reads beyond the chunk holding the last live row (`kv_cache_attention`).
    tree_mask: optional [b, T, T] bool, a token tree verified in one block (`spec.tree`): row t sees block
    row u iff `tree_mask[b, t, u]` (its ancestors and itself), and `positions` are each node's depth
    positions (not consecutive). The rows are still written at slots `positions[:, 0] + [0, T)`; every
    query sees the committed rows below `positions[:, 0]` by position and the block's rows only through
    the tree mask (and the window). None: the plain causal block, unchanged.
    Returns (out [b, T, Hq, d], k_buf, v_buf).
    """
    starts = positions[:, 0]
    k_buf = write_rows(k_buf, k, starts)
    v_buf = write_rows(v_buf, v, starts)
    if tree_mask is None:
        out = kv_cache_attention(q, k_buf, v_buf, positions, starts + q.shape[1], scale=scale, causal=True,
                                 window=window, sinks=sinks, tuning=tuning)
        return out, k_buf, v_buf
    own = tree_mask
    if window is not None:
        own = own & (positions[:, :, None] - positions[:, None, :] < window)
    out = kv_cache_attention(q, k_buf, v_buf, positions, starts, scale=scale, causal=True, window=window,
                             sinks=sinks, extra=(k, v, own), tuning=tuning)
    return out, k_buf, v_buf
