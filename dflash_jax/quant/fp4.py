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
jit-able JAX path share one implementation. Nothing relies on the
``float4_e2m1fn`` / ``float8_*`` dtypes for rounding: encoding is done with
exact comparisons and decoding with integer bit arithmetic, so results are
identical on every backend and immune to flush-to-zero of float32 subnormals
(XLA:CPU flushes subnormal results of float arithmetic; see tests). Divisions go
through :func:`_true_divide` because XLA otherwise turns them into reciprocal
multiplies that are not correctly rounded.
"""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np

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
# Backend helpers.
# ----------------------------------------------------------------------------------


def _bitcast(xp: Any, a: Any, dtype: Any) -> Any:
    """Same-width bit reinterpretation for numpy or jax arrays."""
    if xp is np:
        return np.asarray(a).view(dtype)
    from jax import lax

    return lax.bitcast_convert_type(a, dtype)


def _true_divide(xp: Any, a: Any, b: Any) -> Any:
    """Correctly rounded IEEE ``a / b`` (broadcasting), identical under numpy and XLA.

    XLA's algebraic simplifier rewrites ``A / broadcast(B)`` and ``A / constant`` into
    ``A * (1 / B)``, which is off by one ulp for roughly a quarter of float32 inputs
    (observed on XLA:CPU, jax 0.10.2), also under jit/vmap. Materializing the divisor at
    full shape behind an ``optimization_barrier`` keeps a genuine elementwise division.
    """
    if xp is np:
        return np.divide(a, b)
    from jax import lax

    # The select makes the divisor depend on ``a`` -- so it is materialized at full shape
    # and stays batched under vmap (an unbatched divisor would be broadcast again by the
    # batching rule) -- without changing any quotient (NaN / 1 == NaN / b).
    b_full = xp.where(xp.isnan(a), xp.ones_like(b), b)
    return a / lax.optimization_barrier(b_full)


def _is_bf16(dtype: Any) -> bool:
    return np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)


def _f32_bits_to(xp: Any, bits: Any, dtype: Any) -> Any:
    """float32 bit patterns (uint32) -> array of ``dtype``.

    bfloat16 is produced by taking the top 16 bits, which is exact for every value
    the FP4 decoders emit (at most 2 significant bits, exponent within float32's);
    other dtypes go through float32 and an ordinary (round-to-nearest-even) cast.
    """
    if _is_bf16(dtype):
        return _bitcast(xp, (bits >> 16).astype(xp.uint16), ml_dtypes.bfloat16)
    f = _bitcast(xp, bits.astype(xp.uint32), xp.float32)
    if np.dtype(dtype) == np.float32:
        return f
    with np.errstate(over="ignore"):  # e.g. float16: overflow to inf is the intended result
        return f.astype(dtype)


def _f32_exponent_field(xp: Any, x: Any) -> Any:
    """Biased exponent field (bits 23..30) of float32 ``x`` as int32.

    For a normal positive float32 ``a``, ``floor(log2(a)) == field - 127`` exactly;
    zero and subnormals give 0, inf/NaN give 255.
    """
    bits = _bitcast(xp, x.astype(xp.float32), xp.uint32)
    return ((bits >> 23) & 0xFF).astype(xp.int32)


def _pow2_f32(xp: Any, e: Any) -> Any:
    """Exact ``2.0**e`` as float32 for integer ``e`` in [-126, 127] (normal range)."""
    return _bitcast(xp, ((e + 127).astype(xp.uint32) << 23), xp.float32)


# ----------------------------------------------------------------------------------
# Encode / decode (namespace-generic cores).
# ----------------------------------------------------------------------------------


def _encode_xp(xp: Any, y: Any) -> Any:
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


def _scaled_decode_bits_xp(xp: Any, codes: Any, exp_biased: Any) -> Any:
    """float32 bit patterns (uint32) of ``E2M1(code) * 2^(exp_biased - 127)``.

    ``exp_biased`` is an E8M0 byte (int32 array in [0, 255], broadcast against
    ``codes``); 255 encodes NaN. The result is computed exactly without float
    arithmetic (so subnormal results are not flushed):

    * ``|E2M1(code)| = (1 + M/2) * 2^E`` with (mag code -> E, M):
      1 -> (-1, 0), 2 -> (0, 0), 3 -> (0, 1), 4 -> (1, 0), 5 -> (1, 1),
      6 -> (2, 0), 7 -> (2, 1); mag code 0 is zero.
    * float32 and E8M0 share the bias 127, so the product has float32 biased
      exponent ``b = E + exp_biased``:

      - ``1 <= b <= 254``: normal, bits ``b << 23 | M << 22``;
      - ``b >= 255``: overflow -> inf (what an IEEE float32 multiply returns);
      - ``b in {-1, 0}``: subnormal; value ``(2 + M) * 2^(b - 128)`` equals
        ``((2 + M) << (b + 21))`` units of 2^-149.
    * sign bit copied from the code; ``exp_biased == 255`` -> canonical NaN.
    """
    c = codes.astype(xp.int32)
    mag = c & 7
    e = xp.where(mag >= 2, (mag >> 1) - 1, -1)
    m = xp.where(mag >= 2, mag & 1, 0)
    s = exp_biased.astype(xp.int32)
    b = e + s
    normal = (xp.clip(b, 0, 254) << 23) | (m << 22)
    sub = (2 + m) << xp.clip(b + 21, 0, 21)
    mag_bits = xp.where(b >= 255, 0x7F800000, xp.where(b >= 1, normal, sub))
    mag_bits = xp.where(mag == 0, 0, mag_bits).astype(xp.uint32)
    bits = mag_bits | (((c >> 3) & 1).astype(xp.uint32) << 31)
    return xp.where(s == 255, xp.uint32(0x7FC00000), bits)


def _decode_xp(xp: Any, codes: Any, dtype: Any) -> Any:
    bits = _scaled_decode_bits_xp(xp, codes, xp.full((), 127, xp.int32))
    return _f32_bits_to(xp, bits, dtype)


def _pack_xp(xp: Any, codes: Any) -> Any:
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(
            f"pack_fp4: last axis must have even length (two codes per byte); got shape {tuple(codes.shape)}"
        )
    c = codes.astype(xp.uint8) & 0x0F
    return c[..., 0::2] | (c[..., 1::2] << 4)


def _unpack_xp(xp: Any, packed: Any) -> Any:
    if packed.ndim == 0:
        raise ValueError("unpack_fp4: expected an array with at least one axis")
    p = packed.astype(xp.uint8)
    pair = xp.stack([p & 0x0F, p >> 4], axis=-1)
    return pair.reshape(*p.shape[:-1], p.shape[-1] * 2)


def _check_uint8(name: str, a: Any) -> None:
    if np.dtype(a.dtype) != np.uint8:
        raise TypeError(f"{name} must be uint8; got {a.dtype}")


def _check_block_multiple(fn: str, shape: tuple[int, ...], block: int) -> int:
    if len(shape) == 0 or shape[-1] % block:
        raise ValueError(
            f"{fn}: the last (contraction) axis must be a multiple of the block size {block}; got shape {tuple(shape)}"
        )
    return shape[-1] // block


# ----------------------------------------------------------------------------------
# Public JAX API.
# ----------------------------------------------------------------------------------


@functools.cache
def _jitted() -> dict[str, Any]:
    """jit-compiled JAX entry points (built lazily so this module imports without jax)."""
    import jax
    import jax.numpy as jnp

    return {
        "encode": jax.jit(functools.partial(_encode_xp, jnp)),
        "decode": jax.jit(functools.partial(_decode_xp, jnp), static_argnums=1),
        "pack": jax.jit(functools.partial(_pack_xp, jnp)),
        "unpack": jax.jit(functools.partial(_unpack_xp, jnp)),
    }


def e2m1_encode(x: Any) -> Any:
    """Round ``x`` to E2M1 codes (uint8 in [0, 16), one code per element).

    Round-to-nearest, ties-to-even mantissa, saturating at +-6:
    ``0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, +-100->+-6``.
    The sign of zero is kept (``-0.0 -> code 8``); NaN -> a zero code.
    """
    import jax.numpy as jnp

    return _jitted()["encode"](jnp.asarray(x, jnp.float32))


def e2m1_decode(codes: Any, dtype: Any = np.float32) -> Any:
    """E2M1 codes (integer array, values 0..15) -> values, exactly :data:`E2M1_VALUES`."""
    import jax.numpy as jnp

    return _jitted()["decode"](jnp.asarray(codes), np.dtype(dtype))


def pack_fp4(codes: Any) -> Any:
    """Pack 4-bit codes ``[..., K]`` into bytes ``[..., K//2]``.

    ``packed[..., i] = codes[..., 2i] | codes[..., 2i+1] << 4`` (low nibble first).
    """
    import jax.numpy as jnp

    return _jitted()["pack"](jnp.asarray(codes))


def unpack_fp4(packed: Any) -> Any:
    """Inverse of :func:`pack_fp4`: bytes ``[..., K//2]`` -> uint8 codes ``[..., K]``."""
    import jax.numpy as jnp

    return _jitted()["unpack"](jnp.asarray(packed))


# ----------------------------------------------------------------------------------
# Host-side (numpy) API, bit-identical to the JAX functions above.
# ----------------------------------------------------------------------------------


def e2m1_encode_np(x: Any) -> np.ndarray:
    """numpy twin of :func:`e2m1_encode`."""
    return _encode_xp(np, np.asarray(x, np.float32))


def e2m1_decode_np(codes: Any, dtype: Any = np.float32) -> np.ndarray:
    """numpy twin of :func:`e2m1_decode`."""
    return _decode_xp(np, np.asarray(codes), dtype)


def pack_fp4_np(codes: Any) -> np.ndarray:
    """numpy twin of :func:`pack_fp4`."""
    return _pack_xp(np, np.asarray(codes))


def unpack_fp4_np(packed: Any) -> np.ndarray:
    """numpy twin of :func:`unpack_fp4`."""
    return _unpack_xp(np, np.asarray(packed))
