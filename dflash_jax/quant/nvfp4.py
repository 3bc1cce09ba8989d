"""NVFP4: E2M1 elements in 16-element blocks, FP8 E4M3 block scales, fp32 tensor scale.

Layout for a logical tensor ``x[..., K]`` (K = contraction / input axis):

* ``packed``: uint8 ``[..., K//2]`` -- E2M1 codes, element ``2i`` in the low nibble;
* ``block_scales``: ``float8_e4m3fn`` ``[..., K//16]`` -- one scale per 16 elements;
* ``tensor_scale``: float32 -- the per-tensor ("global") scale. Normally a scalar;
  it may also have a *prefix* of the leading shape (e.g. ``[E]`` for one scale per
  expert of an ``[E, N, K]`` stack, which is what ``jax.vmap(quantize_nvfp4)``
  produces); it is broadcast as ``tensor_scale[..., None, ..., None]``.

Dequantization (evaluated left to right in float32, then cast to ``dtype``)::

    x[..., 16*g + j] = (E2M1(code[..., 16*g + j]) * float(block_scales[..., g])) * tensor_scale

(the first product is exact: at most 2 x 4 significant bits).

Quantization (NVIDIA's NVFP4 recipe)::

    tensor_scale = amax(|x|) / (6 * 448)                       (unless given)
    bs_g         = E4M3_RNE_sat( (amax_g / 6) / tensor_scale )   amax_g = max_j |x_16g+j|
    code_j       = RNE_E2M1( x_j / (float(bs_g) * tensor_scale) )  saturated to +-6

where ``E4M3_RNE_sat`` rounds to the nearest E4M3 value (ties to even, subnormals
with quantum 2^-9 below 2^-6) and saturates to +-448 -- note that a plain
``astype(float8_e4m3fn)`` does NOT saturate (it returns NaN above 464), so rounding is
done explicitly here, without relying on backend fp8 conversions. With the default
tensor scale the block scale lies in [0, 448]. All three divisions are correctly
rounded float32 divisions (as in torch/numpy), not XLA's reciprocal-multiply rewrite. A zero tensor scale (all-zero input) or
a block scale that rounds to zero (``amax_g`` below ~2^-10 / 448 of the tensor amax)
gives zero codes (keeping the sign of x) instead of NaN.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dflash_jax.quant.fp4 import (
    E2M1_MAX,
    _bitcast,
    _check_block_multiple,
    _check_uint8,
    _decode_xp,
    _encode_xp,
    _f32_exponent_field,
    _pack_xp,
    _pow2_f32,
    _true_divide,
    _unpack_xp,
)

#: Elements per NVFP4 block (one E4M3 scale each).
NVFP4_BLOCK_SIZE = 16
#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
#: Smallest E4M3 normal exponent (2^-6); subnormal spacing is 2^-9.
_E4M3_EMIN = -6
_E4M3_MANT_BITS = 3


def _round_to_e4m3_xp(xp: Any, v: Any) -> Any:
    """float32 -> float32 holding the nearest float8_e4m3fn value (RNE, saturating).

    With ``e = max(floor(log2|v|), -6)`` the E4M3 spacing at ``|v|`` is ``q = 2^(e-3)``,
    so the rounded magnitude is ``round_half_even(|v| / q) * q`` (both scalings are
    exact powers of two), then clamped to 448. NaN stays NaN, +-inf -> +-448, sign
    (including -0) is kept. The result converts to float8_e4m3fn exactly.
    """
    a = xp.abs(v)
    e = xp.clip(_f32_exponent_field(xp, a) - 127, _E4M3_EMIN, 127)
    r = xp.round(a * _pow2_f32(xp, _E4M3_MANT_BITS - e)) * _pow2_f32(xp, e - _E4M3_MANT_BITS)
    r = xp.minimum(r, xp.float32(E4M3_MAX))
    return xp.where(xp.signbit(v), -r, r)


def _expand_prefix(xp: Any, ts: Any, ndim: int, lead: tuple[int, ...], fn: str) -> Any:
    """Reshape a scalar / leading-prefix tensor scale so it broadcasts over ``ndim`` dims."""
    if ts.ndim > len(lead) or tuple(ts.shape) != tuple(lead[: ts.ndim]):
        raise ValueError(
            f"{fn}: tensor_scale must be a scalar or match a prefix of the leading shape {tuple(lead)}; "
            f"got shape {tuple(ts.shape)}"
        )
    return ts.reshape(*ts.shape, *([1] * (ndim - ts.ndim)))


def _quantize_xp(xp: Any, x: Any, tensor_scale: Any, fn: str) -> tuple[Any, Any, Any]:
    g = _check_block_multiple(fn, tuple(x.shape), NVFP4_BLOCK_SIZE)
    x32 = x.astype(xp.float32)
    if tensor_scale is None:
        amax_t = xp.max(xp.abs(x32)) if x32.size else xp.float32(0)
        ts = _true_divide(xp, amax_t, xp.float32(E2M1_MAX * E4M3_MAX)).astype(xp.float32)
    else:
        ts = xp.asarray(tensor_scale, xp.float32)
    tsb = _expand_prefix(xp, ts, x.ndim, tuple(x.shape[:-1]), fn)  # broadcasts against [..., G]
    xb = x32.reshape(*x.shape[:-1], g, NVFP4_BLOCK_SIZE)
    amax_b = xp.max(xp.abs(xb), axis=-1)
    ts_pos = tsb > 0
    per_elem_max = _true_divide(xp, amax_b, xp.float32(E2M1_MAX))
    bs = xp.where(ts_pos, _true_divide(xp, per_elem_max, xp.where(ts_pos, tsb, 1)), 0)
    bs = _round_to_e4m3_xp(xp, bs.astype(xp.float32))
    denom = bs * tsb
    ok = denom > 0
    signed_zero = xp.where(xp.signbit(xb), xp.float32(-0.0), xp.float32(0.0))
    y = xp.where(ok[..., None], _true_divide(xp, xb, xp.where(ok, denom, 1)[..., None]), signed_zero)
    packed = _pack_xp(xp, _encode_xp(xp, y.astype(xp.float32)))
    packed = packed.reshape(*x.shape[:-1], x.shape[-1] // 2)
    return packed, bs.astype(ml_dtypes.float8_e4m3fn), ts


def _dequantize_xp(xp: Any, packed: Any, block_scales: Any, tensor_scale: Any, dtype: Any) -> Any:
    _check_uint8("NVFP4 packed", packed)
    if np.dtype(block_scales.dtype) == np.uint8:  # raw bytes, e.g. straight from safetensors
        block_scales = _bitcast(xp, block_scales, ml_dtypes.float8_e4m3fn)
    if np.dtype(block_scales.dtype) != np.dtype(ml_dtypes.float8_e4m3fn):
        raise TypeError(f"NVFP4 block_scales must be float8_e4m3fn (or its uint8 bytes); got {block_scales.dtype}")
    if (
        packed.ndim < 1
        or tuple(packed.shape[:-1]) != tuple(block_scales.shape[:-1])
        or packed.shape[-1] * 2 != block_scales.shape[-1] * NVFP4_BLOCK_SIZE
    ):
        raise ValueError(
            "NVFP4 expects packed [..., K//2] and block_scales [..., K//16]; "
            f"got packed {tuple(packed.shape)} and block_scales {tuple(block_scales.shape)}"
        )
    ts = xp.asarray(tensor_scale, xp.float32)
    tsb = _expand_prefix(xp, ts, block_scales.ndim, tuple(block_scales.shape[:-1]), "dequantize_nvfp4")
    *lead, g = block_scales.shape
    codes = _unpack_xp(xp, packed).reshape(*lead, g, NVFP4_BLOCK_SIZE)
    vals = _decode_xp(xp, codes, np.float32)
    out = (vals * block_scales.astype(xp.float32)[..., None]) * tsb[..., None]
    out = out.reshape(*lead, g * NVFP4_BLOCK_SIZE)
    if np.dtype(dtype) == np.float32:
        return out
    with np.errstate(over="ignore"):
        return out.astype(dtype)


@jax.jit
def _quantize_jit(x: jax.Array, tensor_scale: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    return _quantize_xp(jnp, x, tensor_scale, "quantize_nvfp4")


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_jit(packed: jax.Array, block_scales: jax.Array, tensor_scale: Any, dtype: np.dtype) -> jax.Array:
    return _dequantize_xp(jnp, packed, block_scales, tensor_scale, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """An NVFP4-quantized array with logical shape ``[..., K]`` (a pytree).

    Attributes:
      packed: uint8 ``[..., K//2]``, E2M1 codes (low nibble = even element).
      block_scales: float8_e4m3fn ``[..., K//16]``.
      tensor_scale: float32 scalar (or a prefix of the leading shape, see module doc).
    """

    packed: Any
    block_scales: Any
    tensor_scale: Any

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantized) shape ``(..., K)``."""
        *lead, kp = self.packed.shape
        return (*lead, kp * 2)

    @property
    def ndim(self) -> int:
        return len(self.packed.shape)

    def dequantize(self, dtype: Any = jnp.bfloat16) -> jax.Array:
        """See :func:`dequantize_nvfp4`."""
        return dequantize_nvfp4(self.packed, self.block_scales, self.tensor_scale, dtype)


def quantize_nvfp4(x: Any, tensor_scale: Any = None) -> NVFP4Tensor:
    """Quantize ``x[..., K]`` (K a multiple of 16) to NVFP4 along the last axis.

    ``tensor_scale`` defaults to ``amax(|x|) / 2688``; pass one explicitly (scalar or
    leading-prefix shape, must be > 0) to share a global scale across tensors. See the
    module docstring for the exact recipe. Jit-able.

    Raises:
      ValueError: if the last axis is not a multiple of 16 or tensor_scale has a bad shape.
    """
    packed, bs, ts = _quantize_jit(jnp.asarray(x), tensor_scale)
    return NVFP4Tensor(packed=packed, block_scales=bs, tensor_scale=ts)


def dequantize_nvfp4(packed: Any, block_scales: Any, tensor_scale: Any, dtype: Any = jnp.bfloat16) -> jax.Array:
    """``(E2M1(code) * float(block_scale)) * tensor_scale`` in float32, cast to ``dtype``.

    ``packed`` uint8 ``[..., K//2]``, ``block_scales`` float8_e4m3fn (or raw uint8
    bytes) ``[..., K//16]``, ``tensor_scale`` float32 scalar/prefix. Returns
    ``[..., K]``. Jit-able.
    """
    return _dequantize_jit(jnp.asarray(packed), jnp.asarray(block_scales), tensor_scale, dtype=np.dtype(dtype))


def quantize_nvfp4_np(x: Any, tensor_scale: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host-side (numpy) :func:`quantize_nvfp4`; returns ``(packed, block_scales, tensor_scale)``."""
    return _quantize_xp(np, np.asarray(x), tensor_scale, "quantize_nvfp4_np")


def dequantize_nvfp4_np(packed: Any, block_scales: Any, tensor_scale: Any, dtype: Any = np.float32) -> np.ndarray:
    """Host-side (numpy) :func:`dequantize_nvfp4`."""
    return _dequantize_xp(np, np.asarray(packed), np.asarray(block_scales), tensor_scale, dtype)
