"""Gated DeltaNet (Yang et al., arXiv 2412.06464): causal conv, the gated delta rule, and its cache.

Notation, per sequence and value head (batch and head axes omitted):
  q_t, k_t in R^dk (L2-normalized, q_t also scaled by dk^-0.5), v_t in R^dv, beta_t in (0, 1),
  g_t <= 0 (log decay), S in R^{dk x dv} (fp32). One step of the gated delta rule is
      S <- e^{g_t} S
      S <- S + k_t (beta_t (v_t - S^T k_t))^T          (write the correction of what S predicts for k_t)
      o_t = S^T q_t
A step with `g = 0, beta = 0` leaves S unchanged: that is how padded tokens are kept out of the state.

Two forms compute the same thing: `gated_delta_rule_step` (a scan over tokens) and
`gated_delta_rule_chunked` (the chunked / WY form: within a chunk of C tokens the C updates are condensed
into a unit-lower-triangular inverse and a few matmuls; a scan runs over chunks only).

The cache of one layer (`GatedDeltaNetCache`) keeps the state at a checkpoint length plus what the
extension after it needs to be committed to any prefix: its keys, log decays and the pseudo-values the forward
that wrote it solved for (see `committed_state`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


_HIGHEST = jax.lax.Precision.HIGHEST
# Decay factors below e^-30 (1e-13, far below fp32 resolution) are flushed to zero in the chunked form: the
# products of such factors inside the triangular solve are denormal numbers, which make CPUs ~200x slower.
_FLUSH_LOG_DECAY = -30.0
CHUNK = 64  # the chunked form's default chunk of tokens


def _acc(*dtypes) -> jnp.dtype:
    """Accumulation dtype: fp32, or fp64 when an input is fp64 (lets tests prove the math in fp64)."""
    return jnp.result_type(jnp.float32, *dtypes)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`x / sqrt(sum(x^2) + eps)` over the last axis, in fp32 (eps inside the square root)."""
    xf = x.astype(_acc(x.dtype))
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def causal_depthwise_conv(window: jax.Array, weight: jax.Array) -> jax.Array:
    """Depthwise causal conv over a window that starts with the K-1 rows before the block.

    window: [b, K-1+T, C] (the carried tail, then the T new rows); weight: [K, C] (tap K-1 multiplies the
    current row). Returns fp32 `out[b, t, c] = sum_j weight[j, c] * window[b, t + j, c]` for t < T.
    No bias, no activation.
    """
    k = weight.shape[0]
    t = window.shape[1] - (k - 1)
    acc = _acc(window.dtype, weight.dtype)
    w = weight.astype(acc)
    xf = window.astype(acc)
    out = xf[:, 0:t] * w[0]
    for j in range(1, k):
        out = out + xf[:, j : j + t] * w[j]
    return out


def conv_tail(window: jax.Array, offsets: jax.Array, kernel_size: int) -> jax.Array:
    """`window[b, n : n + K - 1]` with n = offsets[b]: for a window `concat(tail_before, x_1..x_T)` and n
    committed rows, the K-1 pre-conv rows ending at row n (the conv tail after those n rows)."""
    idx = offsets[:, None] + jnp.arange(kernel_size - 1, dtype=offsets.dtype)
    return jnp.take_along_axis(window, idx[:, :, None], axis=1)


def with_tail(window: jax.Array, tail: jax.Array) -> jax.Array:
    """`window` with its first K-1 rows replaced by `tail` [b, K-1, C], as one concatenation: a GPU runs it inside
    the round's CUDA graph, where XLA turns an update of a slice (`.at[:, :K-1].set`) into an in-place copy it
    launches on its own, between graphs (one split of the round's graph per DeltaNet layer)."""
    return jnp.concatenate([tail.astype(window.dtype), window[:, tail.shape[1]:]], axis=1)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """The Gated DeltaNet output norm: `rms_norm(x) * w * silu(gate)`, plain weight (NOT zero-centred).

    As the reference: normalize in fp32, cast to `x.dtype`, multiply by `w`, then by `silu(gate)` in fp32,
    cast to `x.dtype` at the end.
    """
    acc = _acc(x.dtype)
    xf = x.astype(acc)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    scaled = (weight.astype(x.dtype) * normed).astype(acc)
    return (scaled * jax.nn.silu(gate.astype(acc))).astype(x.dtype)


def decay_and_beta(a: jax.Array, b: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`g = -exp(A_log) * softplus(a + dt_bias)` and `beta = sigmoid(b)`, both fp32, [..., Hv]."""
    acc = _acc(a.dtype, b.dtype)
    g = -jnp.exp(a_log.astype(acc)) * jax.nn.softplus(a.astype(acc) + dt_bias.astype(acc))
    beta = jax.nn.sigmoid(b).astype(acc)
    return g, beta


def _per_value_head(x: jax.Array, num_value_heads: int) -> jax.Array:
    """[b, T, H, d] -> [b, T, Hv, d], key head h serving value heads h*G .. h*G+G-1."""
    h = x.shape[2]
    return x if h == num_value_heads else jnp.repeat(x, num_value_heads // h, axis=2)


def _heads_first(x: jax.Array, num_value_heads: int, dtype) -> jax.Array:
    """[b, T, H, d] -> [b, Hv, T, d] in `dtype` (`_per_value_head`)."""
    return jnp.swapaxes(_per_value_head(x, num_value_heads).astype(dtype), 1, 2)


def gated_delta_rule_step(
    q: jax.Array | None,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    values: bool = False,
):
    """The gated delta rule one token at a time (a `lax.scan` over T).

    q, k: [b, T, Hk, dk] (k L2-normalized, q normalized and scaled; q may be None when only the state is
    wanted); v: [b, T, Hv, dv]; g, beta: [b, T, Hv] fp32; state: [b, Hv, dk, dv] fp32.
    Returns (o [b, T, Hv, dv] fp32 or None, final state), and with `values` also each step's written correction
    `beta_t (v_t - e^{g_t} S^T k_t)` [b, T, Hv, dv] (for T = 1: the pseudo-value of `gated_delta_rule_chunked`
    against the initial state). (All math runs in the state's dtype, at least fp32.)
    """
    hv = v.shape[2]
    acc = _acc(state.dtype)
    kk, vv = _heads_first(k, hv, acc), _heads_first(v, hv, acc)
    qq = _heads_first(q, hv, acc) if q is not None else jnp.zeros_like(kk)
    gg, bb = jnp.swapaxes(g.astype(acc), 1, 2), jnp.swapaxes(beta.astype(acc), 1, 2)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[..., None, None]
        predicted = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=_HIGHEST)
        correction = b_t[..., None] * (v_t - predicted)
        s = s + k_t[..., :, None] * correction[..., None, :]
        o_t = jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=_HIGHEST)
        return s, (o_t, correction)

    time_major = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731  [b, Hv, T, ...] -> [T, b, Hv, ...]
    state, (o, u) = jax.lax.scan(step, state.astype(acc), tuple(map(time_major, (qq, kk, vv, gg, bb))))
    o = None if q is None else jnp.moveaxis(o, 0, 1)  # [T, b, Hv, dv] -> [b, T, Hv, dv]
    return (o, state, jnp.moveaxis(u, 0, 1)) if values else (o, state)


def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """`(I + L)^-1` for strictly lower-triangular L [..., C, C], by recursive 2x2 block inversion.

    `[[A, 0], [X, D]]^-1 = [[A^-1, 0], [-D^-1 X A^-1, D^-1]]`: starting from the 1x1 diagonal blocks (1),
    each level merges pairs of inverted diagonal blocks, so log2(C) levels of batched matmuls give the exact
    inverse (C is padded to a power of two with identity rows, which leave the leading block unchanged).

    Matmuls only, on purpose: `lax.linalg.triangular_solve` lowers on the CPU to a LAPACK call that XLA
    runs for several batch entries at once on its thread pool, and with a multi-threaded BLAS underneath
    those concurrent calls can stall the program (seen as training steps that never finish).
    """
    c = lower.shape[-1]
    n = 1 << max(c - 1, 0).bit_length()
    if n != c:
        pad = [(0, 0)] * (lower.ndim - 2) + [(0, n - c), (0, n - c)]
        lower = jnp.pad(lower, pad)
    batch = lower.shape[:-2]
    inv = jnp.ones(batch + (n, 1, 1), lower.dtype)  # inverses of the diagonal blocks, [..., n/s, s, s]
    s = 1
    while s < n:
        nb = n // (2 * s)
        blocks = lower.reshape(batch + (nb, 2 * s, nb, 2 * s))
        blocks = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., nb, 2s, 2s]
        x = blocks[..., s:, :s]
        pairs = inv.reshape(batch + (nb, 2, s, s))
        a_inv, d_inv = pairs[..., 0, :, :], pairs[..., 1, :, :]
        corner = -jnp.einsum("...ij,...jk,...kl->...il", d_inv, x, a_inv, precision=_HIGHEST)
        zero = jnp.zeros_like(a_inv)
        top = jnp.concatenate([a_inv, zero], axis=-1)
        bottom = jnp.concatenate([corner, d_inv], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)
        s *= 2
    return inv.reshape(batch + (n, n))[..., :c, :c]


def gated_delta_rule_chunked(
    q: jax.Array | None,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    chunk_size: int = CHUNK,
    values: bool = False,
):
    """The gated delta rule in chunks of C tokens (same arguments and results as `gated_delta_rule_step`;
    `values`: also the pseudo-values U [b, T, Hv, dv], each against its chunk's initial state, so against `state`
    where T <= C).

    Within a chunk with initial state S0 and cumulative log decay `G_t = g_1 + ... + g_t`, the state after t
    steps is `S_t = e^{G_t} S0 + sum_{i<=t} e^{G_t - G_i} k_i u_i^T`, where the pseudo-values u_i solve
        u_i + beta_i sum_{j<i} e^{G_i - G_j} (k_i . k_j) u_j = beta_i (v_i - e^{G_i} S0^T k_i),
    i.e. `(I + A) U = diag(beta) V - diag(beta e^G) K S0` with A strictly lower triangular. Both right-hand
    sides are solved once per chunk (`W_v`, `W_k`), so the sequential part is `U = W_v - W_k S0`,
        O = diag(e^G) Q S0 + (M o Q K^T) U,     M[t, i] = e^{G_t - G_i} for i <= t else 0,
        S_C = e^{G_C} S0 + (diag(e^{G_C - G}) K)^T U.
    Every exponent is <= 0 (g <= 0), so nothing overflows; factors `e^x` with x < -30 (below 1e-13) are
    flushed to 0 (no denormals). T is padded to a multiple of C with `g = beta = 0` rows, which change
    nothing. All math in fp32.
    """
    b, t, _, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    acc = _acc(state.dtype)
    c = max(1, min(chunk_size, t))
    pad = (-t) % c
    n = (t + pad) // c

    def prep(x):  # [b, T, H, d] -> [b, Hv, N, C, d]
        x = _heads_first(x, hv, acc)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
        return x.reshape(b, hv, n, c, x.shape[-1])

    def prep_gate(x):  # [b, T, Hv] -> [b, Hv, N, C]
        x = jnp.swapaxes(x.astype(acc), 1, 2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, pad))).reshape(b, hv, n, c)

    kk, vv = prep(k), prep(v)
    gg, bb = prep_gate(g), prep_gate(beta)
    cum = jnp.cumsum(gg, axis=-1)  # G_t
    rows = jnp.arange(c)
    incl = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]

    def decay_of(log_decay, mask=True):  # e^x for x <= 0, flushed to 0 below e^-30
        return jnp.exp(jnp.where(mask & (log_decay >= _FLUSH_LOG_DECAY), log_decay, -jnp.inf))

    decay = decay_of(cum[..., :, None] - cum[..., None, :], incl)  # M
    kkt = jnp.einsum("bhnid,bhnjd->bhnij", kk, kk, precision=_HIGHEST)
    lower = jnp.where(strict, bb[..., :, None] * decay * kkt, 0.0)
    inverse = unit_lower_inverse(lower)  # (I + A)^-1
    solve = lambda rhs: jnp.einsum("...ij,...jd->...id", inverse, rhs, precision=_HIGHEST)  # noqa: E731
    w_v = solve(bb[..., None] * vv)
    from_start = decay_of(cum)  # e^{G_t}
    w_k = solve((bb * from_start)[..., None] * kk)
    k_to_end = decay_of(cum[..., -1:] - cum)[..., None] * kk
    chunk_decay = from_start[..., -1]  # [b, Hv, N]
    if q is not None:
        qq = prep(q)
        intra = jnp.where(incl, decay * jnp.einsum("bhnid,bhnjd->bhnij", qq, kk, precision=_HIGHEST), 0.0)
        q_from_start = from_start[..., None] * qq
    else:
        intra = q_from_start = jnp.zeros((b, hv, n, 0), acc)

    def chunk(s, xs):
        w_v_n, w_k_n, k_end_n, decay_n, intra_n, q_n = xs
        u = w_v_n - jnp.einsum("bhck,bhkv->bhcv", w_k_n, s, precision=_HIGHEST)
        if q is not None:
            o = jnp.einsum("bhck,bhkv->bhcv", q_n, s, precision=_HIGHEST)
            o = o + jnp.einsum("bhij,bhjv->bhiv", intra_n, u, precision=_HIGHEST)
        else:
            o = None
        s = decay_n[..., None, None] * s + jnp.einsum("bhck,bhcv->bhkv", k_end_n, u, precision=_HIGHEST)
        return s, (o, u if values else None)

    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731
    state, (o, u) = jax.lax.scan(
        chunk,
        state.astype(acc),
        tuple(map(chunk_major, (w_v, w_k, k_to_end, chunk_decay, intra, q_from_start))),
    )
    time_major = lambda x: jnp.swapaxes(jnp.moveaxis(x, 0, 2).reshape(b, hv, n * c, dv)[:, :, :t], 1, 2)  # noqa: E731
    o = None if q is None else time_major(o)
    return (o, state, time_major(u)) if values else (o, state)


def gated_delta_rule(q, k, v, g, beta, state, *, chunk_size: int = CHUNK, values: bool = False):
    """Picks the form by width: the step form for T = 1 (decode), the chunked form otherwise. `values`: also
    the pseudo-values against `state` (`committed_state`), which needs T <= chunk_size."""
    if values and k.shape[1] > chunk_size:
        raise ValueError(f"the pseudo-values against the initial state need one chunk: T = {k.shape[1]} > "
                         f"chunk_size = {chunk_size}")
    if k.shape[1] == 1:
        return gated_delta_rule_step(q, k, v, g, beta, state, values=values)
    return gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=chunk_size, values=values)


# --------------------------------------------------------------------------------------------------
# Per-layer cache with exact rollback
# --------------------------------------------------------------------------------------------------


@struct.dataclass
class GatedDeltaNetCache:
    """One Gated DeltaNet layer's carried state, valid at a checkpoint length `c` (kept by the model).

    state: [b, Hv, dk, dv] fp32, the recurrent state S after c tokens.
    conv_window: [b, K-1+W, C]: the K-1 pre-conv rows ending at c, then the (up to W) pre-conv rows of the
      extension that followed the checkpoint.
    k [b, W, Hk, dk] (L2-normalized), u [b, W, Hv, dv], g [b, W, Hv] (fp32): the extension's keys, its
      pseudo-values against `state` (`gated_delta_rule_chunked`: what the forward that wrote the rows solved for,
      U = (I + A)^-1 (diag(beta) V - diag(beta e^G) K S)) and its log decays.
    The state after c + m tokens (0 <= m <= rows written) is `e^{G_m} S + sum_{i<=m} e^{G_m - G_i} k_i u_i^T`, and
    the conv tail is `conv_window[m : m + K - 1]` (see `committed_state`). W = 0 keeps no extension.
    """

    state: jax.Array
    conv_window: jax.Array
    k: jax.Array
    u: jax.Array
    g: jax.Array

    @property
    def width(self) -> int:
        return self.k.shape[1]

    @property
    def kernel_size(self) -> int:
        return self.conv_window.shape[1] - self.k.shape[1] + 1


def init_gated_deltanet_cache(
    *, batch: int, num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int,
    conv_dim: int, kernel_size: int, width: int, dtype,
) -> GatedDeltaNetCache:
    f32 = _acc(dtype)  # fp32 (fp64 for an fp64 model)
    return GatedDeltaNetCache(
        state=jnp.zeros((batch, num_value_heads, key_head_dim, value_head_dim), f32),
        conv_window=jnp.zeros((batch, kernel_size - 1 + width, conv_dim), dtype),
        k=jnp.zeros((batch, width, num_key_heads, key_head_dim), f32),
        u=jnp.zeros((batch, width, num_value_heads, value_head_dim), f32),
        g=jnp.zeros((batch, width, num_value_heads), f32),
    )


def mask_steps(g: jax.Array, beta: jax.Array, num_steps: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Zeroes g and beta of the steps t >= num_steps[b], which then leave the state unchanged."""
    valid = jnp.arange(g.shape[1])[None, :] < num_steps[:, None]
    return jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)


def committed_state(cache: GatedDeltaNetCache, steps: jax.Array):
    """(state, conv tail) after the first `steps[b]` rows of the kept extension, as a fresh run leaves them.

    steps: [b] int32 in [0, W]. The state is the chunked form's closing formula over those rows, from the
    pseudo-values the forward that wrote them already solved: `e^{G_m} S + (diag(e^{G_m - G}) K_m)^T U_m` with G
    the cumulative log decay of the first m rows (rows past them weigh 0). One contraction per layer, no
    triangular solve and no conditional; no committed row leaves S exactly as it was (every weight 0, e^0 = 1).
    Decay factors below e^-30 are flushed to 0, as in the chunked form.
    Returns (state [b, Hv, dk, dv] fp32, tail [b, K-1, C]).
    """
    ksize = cache.kernel_size
    steps = jnp.clip(steps.astype(jnp.int32), 0, cache.width)
    tail = conv_tail(cache.conv_window, steps, ksize)
    if cache.width == 0:
        return cache.state, tail
    acc = _acc(cache.state.dtype)
    kept = jnp.arange(cache.width)[None, :] < steps[:, None]  # [b, W]
    cum = jnp.cumsum(jnp.where(kept[..., None], cache.g.astype(acc), 0.0), axis=1)  # G_i, [b, W, Hv]
    total = cum[:, -1]  # G_m, [b, Hv]
    to_end = total[:, None] - cum
    weight = jnp.where(kept[..., None] & (to_end >= _FLUSH_LOG_DECAY), jnp.exp(jnp.minimum(to_end, 0.0)), 0.0)
    kk = _per_value_head(cache.k, cache.u.shape[2]).astype(acc)
    start = jnp.where(total >= _FLUSH_LOG_DECAY, jnp.exp(total), 0.0)
    state = start[..., None, None] * cache.state.astype(acc) + jnp.einsum(
        "bwh,bwhk,bwhv->bhkv", weight, kk, cache.u.astype(acc), precision=_HIGHEST)
    return state.astype(cache.state.dtype), tail
