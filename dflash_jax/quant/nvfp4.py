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

The container (:class:`NVFP4Tensor`) and :func:`dequantize_nvfp4` are defined in
:mod:`pallas_kernels.formats` (the kernels read them) and re-exported here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dflash_jax.quant.fp4 import (
    E2M1_MAX,
    check_block_multiple,
    encode_xp,
    f32_exponent_field,
    pack_xp,
    pow2_f32,
    true_divide,
)
from pallas_kernels.formats import (  # the container and its decode belong to the kernels that read it
    NVFP4_BLOCK_SIZE,
    NVFP4Tensor,
    dequantize_nvfp4,
    dequantize_nvfp4_xp,
    expand_prefix,
)

#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
#: Smallest E4M3 normal exponent (2^-6); subnormal spacing is 2^-9.
_E4M3_EMIN = -6
_E4M3_MANT_BITS = 3


def round_to_e4m3_xp(xp: Any, v: Any) -> Any:
    """float32 -> float32 holding the nearest float8_e4m3fn value (RNE, saturating).

    With ``e = max(floor(log2|v|), -6)`` the E4M3 spacing at ``|v|`` is ``q = 2^(e-3)``,
    so the rounded magnitude is ``round_half_even(|v| / q) * q`` (both scalings are
    exact powers of two), then clamped to 448. NaN stays NaN, +-inf -> +-448, sign
    (including -0) is kept. The result converts to float8_e4m3fn exactly.
    """
    a = xp.abs(v)
    e = xp.clip(f32_exponent_field(xp, a) - 127, _E4M3_EMIN, 127)
    r = xp.round(a * pow2_f32(xp, _E4M3_MANT_BITS - e)) * pow2_f32(xp, e - _E4M3_MANT_BITS)
    r = xp.minimum(r, xp.float32(E4M3_MAX))
    return xp.where(xp.signbit(v), -r, r)


def _quantize_xp(xp: Any, x: Any, tensor_scale: Any, fn: str) -> tuple[Any, Any, Any]:
    g = check_block_multiple(fn, tuple(x.shape), NVFP4_BLOCK_SIZE)
    x32 = x.astype(xp.float32)
    if tensor_scale is None:
        amax_t = xp.max(xp.abs(x32)) if x32.size else xp.float32(0)
        ts = true_divide(xp, amax_t, xp.float32(E2M1_MAX * E4M3_MAX)).astype(xp.float32)
    else:
        ts = xp.asarray(tensor_scale, xp.float32)
    tsb = expand_prefix(xp, ts, x.ndim, tuple(x.shape[:-1]), fn)  # broadcasts against [..., G]
    xb = x32.reshape(*x.shape[:-1], g, NVFP4_BLOCK_SIZE)
    amax_b = xp.max(xp.abs(xb), axis=-1)
    ts_pos = tsb > 0
    per_elem_max = true_divide(xp, amax_b, xp.float32(E2M1_MAX))
    bs = xp.where(ts_pos, true_divide(xp, per_elem_max, xp.where(ts_pos, tsb, 1)), 0)
    bs = round_to_e4m3_xp(xp, bs.astype(xp.float32))
    denom = bs * tsb
    ok = denom > 0
    signed_zero = xp.where(xp.signbit(xb), xp.float32(-0.0), xp.float32(0.0))
    y = xp.where(ok[..., None], true_divide(xp, xb, xp.where(ok, denom, 1)[..., None]), signed_zero)
    packed = pack_xp(xp, encode_xp(xp, y.astype(xp.float32)))
    packed = packed.reshape(*x.shape[:-1], x.shape[-1] // 2)
    return packed, bs.astype(ml_dtypes.float8_e4m3fn), ts


@jax.jit
def _quantize_jit(x: jax.Array, tensor_scale: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    return _quantize_xp(jnp, x, tensor_scale, "quantize_nvfp4")


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


def quantize_nvfp4_np(x: Any, tensor_scale: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host-side (numpy) :func:`quantize_nvfp4`; returns ``(packed, block_scales, tensor_scale)``."""
    return _quantize_xp(np, np.asarray(x), tensor_scale, "quantize_nvfp4_np")


def dequantize_nvfp4_np(packed: Any, block_scales: Any, tensor_scale: Any, dtype: Any = np.float32) -> np.ndarray:
    """Host-side (numpy) :func:`dequantize_nvfp4`."""
    return dequantize_nvfp4_xp(np, np.asarray(packed), np.asarray(block_scales), tensor_scale, dtype)
