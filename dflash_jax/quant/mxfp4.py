"""MXFP4 (OCP Microscaling Formats v1.0, MX element type E2M1), as shipped by gpt-oss.

Layout for a logical tensor ``x[..., K]`` (K = contraction / input axis, weights kept
in HF ``[..., out, in]`` order):

* ``blocks``: uint8 ``[..., K//32, 16]`` -- the 32 E2M1 codes of each block, two per
  byte, element ``2i`` in the low nibble (gpt-oss ``*_blocks`` tensors);
* ``scales``: uint8 ``[..., K//32]`` -- one E8M0 byte ``s`` per block (gpt-oss
  ``*_scales`` tensors).

Dequantization::

    x[..., 32*g + j] = E2M1(code[..., g, j]) * 2^(s[..., g] - 127)     (s != 255)
    x[..., 32*g + j] = NaN                                               (s == 255)

computed exactly (the product has at most two significant bits, so it is
representable in float32 and bfloat16 unless it overflows to inf); this matches
``transformers.integrations.mxfp4.convert_moe_packed_tensors`` bit for bit, except
that HF returns ``[E, K, rows]`` (transposed) and does not treat 255 as NaN.

Quantization (the OCP MX v1.0 shared-scale conversion rule), per block of 32 values::

    amax = max_j |x_j|
    X    = floor(log2(amax)) - emax_elem,   emax_elem = 2  (E2M1 max 6 = 1.5 * 2^2)
    s    = clamp(X + 127, 0, 254)           (E8M0 byte; amax == 0 -> s = 0, i.e. 2^-127)
    code_j = RNE_E2M1(x_j / 2^X)            (round to nearest even, saturate to +-6)

``floor(log2(amax))`` is read exactly from the float32 exponent field ``F`` of
``amax`` (``floor(log2 amax) = F - 127``), so ``s = max(F - 2, 0)``; a non-finite
``amax`` (inf/NaN in the block) gives ``s = 255`` (NaN). Since ``2^X`` is a power of
two, ``x / 2^X`` is exact and ``|x / 2^X| < 8``; values in ``(6, 8)`` saturate to 6 as
the spec prescribes.

The container (:class:`MXFP4Tensor`) and :func:`dequantize_mxfp4` are defined in
:mod:`pallas_kernels.formats` (the kernels read them) and re-exported here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.quant.fp4 import check_block_multiple, encode_xp, f32_exponent_field, pack_xp, pow2_f32
from pallas_kernels.formats import (  # the container and its decode belong to the kernels that read it
    E8M0_BIAS,
    E8M0_NAN,
    MXFP4_BLOCK_SIZE,
    MXFP4Tensor,
    dequantize_mxfp4,
    dequantize_mxfp4_xp,
)

#: Exponent of the largest E2M1 normal (6 = 1.5 * 2^2), ``emax_elem`` in the OCP spec.
E2M1_EMAX = 2


def _quantize_xp(xp: Any, x: Any, fn: str) -> tuple[Any, Any]:
    g = check_block_multiple(fn, tuple(x.shape), MXFP4_BLOCK_SIZE)
    xb = x.astype(xp.float32).reshape(*x.shape[:-1], g, MXFP4_BLOCK_SIZE)
    amax = xp.max(xp.abs(xb), axis=-1)
    field = f32_exponent_field(xp, amax)  # floor(log2 amax) + 127 for normal amax
    s = xp.where(field == 255, E8M0_NAN, xp.maximum(field - E2M1_EMAX, 0))
    # 1 / 2^X = 2^(127 - s); s <= 252 for finite amax, so this is a normal float32.
    inv_scale = pow2_f32(xp, xp.where(s == E8M0_NAN, 0, E8M0_BIAS - s))
    codes = encode_xp(xp, xb * inv_scale[..., None])
    return pack_xp(xp, codes), s.astype(xp.uint8)


@jax.jit
def _quantize_jit(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _quantize_xp(jnp, x, "quantize_mxfp4")


def quantize_mxfp4(x: Any) -> MXFP4Tensor:
    """Quantize ``x[..., K]`` (K a multiple of 32) to MXFP4 along the last axis.

    Per 32-element block: ``s = clamp(floor(log2 amax) - 2 + 127, 0, 254)``,
    ``code = RNE_E2M1(x / 2^(s-127))`` saturated to +-6 (see module docstring).
    Input is read as float32 (exact for bf16/fp16/fp32 inputs). Jit-able.

    Raises:
      ValueError: if the last axis is not a multiple of 32.
    """
    blocks, scales = _quantize_jit(jnp.asarray(x))
    return MXFP4Tensor(blocks=blocks, scales=scales)


def quantize_mxfp4_np(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """Host-side (numpy) :func:`quantize_mxfp4`; returns ``(blocks, scales)``, bit-identical."""
    return _quantize_xp(np, np.asarray(x), "quantize_mxfp4_np")


def dequantize_mxfp4_np(blocks: Any, scales: Any, dtype: Any = np.float32) -> np.ndarray:
    """Host-side (numpy) :func:`dequantize_mxfp4`, bit-identical; dtype may be ``ml_dtypes.bfloat16``."""
    return dequantize_mxfp4_xp(np, np.asarray(blocks), np.asarray(scales), dtype)
