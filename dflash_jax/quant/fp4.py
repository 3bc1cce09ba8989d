"""E2M1 ("FP4") element codec shared by the MXFP4 and NVFP4 block formats.

E2M1 is a 4-bit float: 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit, no
inf/NaN. Code ``c = s<<3 | e<<1 | m`` has the value

    (-1)^s * (m / 2)            if e == 0   (zero / subnormal: 0, 0.5)
    (-1)^s * (1 + m/2) * 2^(e-1) otherwise   (1, 1.5, 2, 3, 4, 6)

which gives the table :data:`E2M1_VALUES` (codes 0..15)::

    0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6

Packing: two codes per byte, element ``2i`` in the LOW nibble and element ``2i+1``
in the HIGH nibble (``byte = code[2i] | code[2i+1] << 4``), as in the gpt-oss
release and NVIDIA's NVFP4 checkpoints.

Every routine here is written once against an array namespace ``xp`` (``numpy`` or
``jax.numpy``) so the host-side (numpy, no jax arrays) converter helpers and the
jit-able JAX path share one implementation. The decode side (bit-exact decode,
unpacking) lives with the FP4 containers in :mod:`pallas_kernels.formats`, which
the kernels own; this module adds the encoder, packing and the public codec API.
Nothing relies on the ``float4_e2m1fn`` / ``float8_*`` dtypes for rounding:
encoding is done with exact comparisons and decoding with integer bit arithmetic,
so results are identical on every backend and immune to flush-to-zero of float32
subnormals (XLA:CPU flushes subnormal results of float arithmetic; see tests).
Divisions go through :func:`true_divide` because XLA otherwise turns them into
reciprocal multiplies that are not correctly rounded.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.formats import bitcast, decode_xp, unpack_xp

# ----------------------------------------------------------------------------------
# The code table (single source of truth).
# ----------------------------------------------------------------------------------

#: Value of each E2M1 code 0..15 (index = code).
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip

#: Largest finite E2M1 magnitude.
E2M1_MAX: float = E2M1_VALUES[7]


def _encode_thresholds() -> tuple[tuple[float, bool], ...]:
    """Round-to-nearest-even decision points derived from :data:`E2M1_VALUES`.

    For consecutive magnitudes ``v[i] < v[i+1]`` (codes ``i`` and ``i+1``) the
    decision point is the midpoint ``t = (v[i] + v[i+1]) / 2``. A magnitude equal
    to ``t`` is a tie and goes to the code with an even mantissa bit, i.e. the even
    code: if ``i+1`` is even the tie rounds up (``a >= t``), otherwise it rounds down
    (``a > t``). The magnitude code of ``a`` is the number of thresholds it passes.
    This yields: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    """
    mags = E2M1_VALUES[:8]
    return tuple(((mags[i] + mags[i + 1]) / 2.0, (i + 1) % 2 == 0) for i in range(7))


_THRESHOLDS = _encode_thresholds()

# ----------------------------------------------------------------------------------
# Backend helpers (the decode side's are in pallas_kernels.formats).
# ----------------------------------------------------------------------------------


def true_divide(xp: Any, a: Any, b: Any) -> Any:
    """Correctly rounded IEEE ``a / b`` (broadcasting), identical under numpy and XLA.

    XLA's algebraic simplifier rewrites ``A / broadcast(B)`` and ``A / constant`` into
    ``A * (1 / B)``, which is off by one ulp for roughly a quarter of float32 inputs
    (observed on XLA:CPU, jax 0.10.2), also under jit/vmap. Materializing the divisor at
    full shape behind an ``optimization_barrier`` keeps a genuine elementwise division.
    """
    if xp is np:
        return np.divide(a, b)
    # The select makes the divisor depend on ``a`` -- so it is materialized at full shape
    # and stays batched under vmap (an unbatched divisor would be broadcast again by the
    # batching rule) -- without changing any quotient (NaN / 1 == NaN / b).
    b_full = xp.where(xp.isnan(a), xp.ones_like(b), b)
    return a / lax.optimization_barrier(b_full)


def f32_exponent_field(xp: Any, x: Any) -> Any:
    """Biased exponent field (bits 23..30) of float32 ``x`` as int32.

    For a normal positive float32 ``a``, ``floor(log2(a)) == field - 127`` exactly;
    zero and subnormals give 0, inf/NaN give 255.
    """
    bits = bitcast(xp, x.astype(xp.float32), xp.uint32)
    return ((bits >> 23) & 0xFF).astype(xp.int32)


def pow2_f32(xp: Any, e: Any) -> Any:
    """Exact ``2.0**e`` as float32 for integer ``e`` in [-126, 127] (normal range)."""
    return bitcast(xp, ((e + 127).astype(xp.uint32) << 23), xp.float32)


# ----------------------------------------------------------------------------------
# Encode / decode (namespace-generic cores).
# ----------------------------------------------------------------------------------


def encode_xp(xp: Any, y: Any) -> Any:
    """float -> E2M1 codes (uint8), round-to-nearest-even, saturating to +-6.

    ``mag = #thresholds passed by |y|`` (see :func:`_encode_thresholds`),
    ``code = signbit(y) << 3 | mag``. Signed zero is preserved (-0.0 and small
    negatives -> code 8), +-inf saturate to +-6, NaN maps to a zero code.
    """
    a = xp.abs(y)
    mag = xp.zeros(a.shape, xp.uint8)
    for t, ties_up in _THRESHOLDS:
        mag = mag + ((a >= t) if ties_up else (a > t)).astype(xp.uint8)
    return mag | (xp.signbit(y).astype(xp.uint8) << 3)


def pack_xp(xp: Any, codes: Any) -> Any:
    """uint8 codes ``[..., K]`` -> bytes ``[..., K//2]`` (low nibble first)."""
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(
            f"pack_fp4: last axis must have even length (two codes per byte); got shape {tuple(codes.shape)}"
        )
    c = codes.astype(xp.uint8) & 0x0F
    return c[..., 0::2] | (c[..., 1::2] << 4)


def check_block_multiple(fn: str, shape: tuple[int, ...], block: int) -> int:
    """The number of ``block``-sized groups of the last axis of ``shape``; ValueError naming ``fn`` otherwise."""
    if len(shape) == 0 or shape[-1] % block:
        raise ValueError(
            f"{fn}: the last (contraction) axis must be a multiple of the block size {block}; got shape {tuple(shape)}"
        )
    return shape[-1] // block


# ----------------------------------------------------------------------------------
# Public JAX API.
# ----------------------------------------------------------------------------------


_encode_jit = jax.jit(functools.partial(encode_xp, jnp))
_decode_jit = jax.jit(functools.partial(decode_xp, jnp), static_argnums=1)
_pack_jit = jax.jit(functools.partial(pack_xp, jnp))
_unpack_jit = jax.jit(functools.partial(unpack_xp, jnp))


def e2m1_encode(x: Any) -> Any:
    """Round ``x`` to E2M1 codes (uint8 in [0, 16), one code per element).

    Round-to-nearest, ties-to-even mantissa, saturating at +-6:
    ``0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, +-100->+-6``.
    The sign of zero is kept (``-0.0 -> code 8``); NaN -> a zero code.
    """
    return _encode_jit(jnp.asarray(x, jnp.float32))


def e2m1_decode(codes: Any, dtype: Any = np.float32) -> Any:
    """E2M1 codes (integer array, values 0..15) -> values, exactly :data:`E2M1_VALUES`."""
    return _decode_jit(jnp.asarray(codes), np.dtype(dtype))


def pack_fp4(codes: Any) -> Any:
    """Pack 4-bit codes ``[..., K]`` into bytes ``[..., K//2]``.

    ``packed[..., i] = codes[..., 2i] | codes[..., 2i+1] << 4`` (low nibble first).
    """
    return _pack_jit(jnp.asarray(codes))


def unpack_fp4(packed: Any) -> Any:
    """Inverse of :func:`pack_fp4`: bytes ``[..., K//2]`` -> uint8 codes ``[..., K]``."""
    return _unpack_jit(jnp.asarray(packed))


# ----------------------------------------------------------------------------------
# Host-side (numpy) API, bit-identical to the JAX functions above.
# ----------------------------------------------------------------------------------


def e2m1_encode_np(x: Any) -> np.ndarray:
    """numpy twin of :func:`e2m1_encode`."""
    return encode_xp(np, np.asarray(x, np.float32))


def e2m1_decode_np(codes: Any, dtype: Any = np.float32) -> np.ndarray:
    """numpy twin of :func:`e2m1_decode`."""
    return decode_xp(np, np.asarray(codes), dtype)


def pack_fp4_np(codes: Any) -> np.ndarray:
    """numpy twin of :func:`pack_fp4`."""
    return pack_xp(np, np.asarray(codes))


def unpack_fp4_np(packed: Any) -> np.ndarray:
    """numpy twin of :func:`unpack_fp4`."""
    return unpack_xp(np, np.asarray(packed))
