"""FP4 weight containers (MXFP4, NVFP4) and their exact decode: the operand types of the FP4 kernels.

The kernels own the formats they read, so `pallas_kernels` depends on nothing above it;
`dflash_jax.quant` re-exports these classes and adds quantization, the element encoder and the
numpy twins. Quantized axes are always the LAST axis (the contraction / input axis of a weight stored
HF-style as ``[..., out, in]``).

E2M1 ("FP4") elements: 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit, no inf/NaN; code
``c = s<<3 | e<<1 | m`` has the value ``(-1)^s * (m/2)`` if ``e == 0`` else ``(-1)^s * (1 + m/2) * 2^(e-1)``
(``0, .5, 1, 1.5, 2, 3, 4, 6`` and their negatives). Two codes per byte, element ``2i`` in the LOW nibble.

MXFP4 (OCP Microscaling v1.0, gpt-oss), logical ``x[..., K]``:

* ``blocks``: uint8 ``[..., K//32, 16]`` -- 32 packed codes per block (gpt-oss ``*_blocks``);
* ``scales``: uint8 ``[..., K//32]`` -- one E8M0 byte ``s`` per block (gpt-oss ``*_scales``);
* ``x[..., 32*g + j] = E2M1(code[..., g, j]) * 2^(s[..., g] - 127)``, NaN where ``s == 255``.

NVFP4, logical ``x[..., K]``:

* ``packed``: uint8 ``[..., K//2]``; ``block_scales``: ``float8_e4m3fn`` ``[..., K//16]``;
* ``tensor_scale``: float32, a scalar or a *prefix* of the leading shape (e.g. ``[E]``, one scale per
  expert of an ``[E, N, K]`` stack), broadcast as ``tensor_scale[..., None, ..., None]``;
* ``x[..., 16*g + j] = (E2M1(code) * float(block_scales[..., g])) * tensor_scale`` in float32, left to
  right (the first product is exact), then cast to the requested dtype.

Decoding is integer bit arithmetic, written once against an array namespace ``xp`` (``numpy`` or
``jax.numpy``), so the jit-able path and the host-side numpy twins in `dflash_jax.quant` share one
implementation and agree bit for bit on every backend (no float4/float8 dtype conversions, no
flush-to-zero of float32 subnormals).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

#: Elements per MXFP4 block (one E8M0 scale each).
MXFP4_BLOCK_SIZE = 32
#: E8M0 bias: a scale byte ``s`` means ``2^(s - 127)``.
E8M0_BIAS = 127
#: E8M0 byte that encodes NaN.
E8M0_NAN = 0xFF
#: Elements per NVFP4 block (one E4M3 scale each).
NVFP4_BLOCK_SIZE = 16

# ----------------------------------------------------------------------------------
# Namespace-generic decode cores (numpy or jax.numpy).
# ----------------------------------------------------------------------------------


def bitcast(xp: Any, a: Any, dtype: Any) -> Any:
    """Same-width bit reinterpretation for numpy or jax arrays."""
    if xp is np:
        return np.asarray(a).view(dtype)
    return lax.bitcast_convert_type(a, dtype)


def _is_bf16(dtype: Any) -> bool:
    return np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)


def _f32_bits_to(xp: Any, bits: Any, dtype: Any) -> Any:
    """float32 bit patterns (uint32) -> array of ``dtype``.

    bfloat16 is produced by taking the top 16 bits, which is exact for every value
    the FP4 decoders emit (at most 2 significant bits, exponent within float32's);
    other dtypes go through float32 and an ordinary (round-to-nearest-even) cast.
    """
    if _is_bf16(dtype):
        return bitcast(xp, (bits >> 16).astype(xp.uint16), ml_dtypes.bfloat16)
    f = bitcast(xp, bits.astype(xp.uint32), xp.float32)
    if np.dtype(dtype) == np.float32:
        return f
    with np.errstate(over="ignore"):  # e.g. float16: overflow to inf is the intended result
        return f.astype(dtype)


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


def decode_xp(xp: Any, codes: Any, dtype: Any) -> Any:
    """E2M1 codes -> values of ``dtype`` (exactly the E2M1 table)."""
    bits = _scaled_decode_bits_xp(xp, codes, xp.full((), E8M0_BIAS, xp.int32))
    return _f32_bits_to(xp, bits, dtype)


def unpack_xp(xp: Any, packed: Any) -> Any:
    """Bytes ``[..., K//2]`` -> uint8 codes ``[..., K]`` (low nibble first)."""
    if packed.ndim == 0:
        raise ValueError("unpack_fp4: expected an array with at least one axis")
    p = packed.astype(xp.uint8)
    pair = xp.stack([p & 0x0F, p >> 4], axis=-1)
    return pair.reshape(*p.shape[:-1], p.shape[-1] * 2)


def _check_uint8(name: str, a: Any) -> None:
    if np.dtype(a.dtype) != np.uint8:
        raise TypeError(f"{name} must be uint8; got {a.dtype}")


def expand_prefix(xp: Any, ts: Any, ndim: int, lead: tuple[int, ...], fn: str) -> Any:
    """Reshape a scalar / leading-prefix tensor scale so it broadcasts over ``ndim`` dims."""
    if ts.ndim > len(lead) or tuple(ts.shape) != tuple(lead[: ts.ndim]):
        raise ValueError(
            f"{fn}: tensor_scale must be a scalar or match a prefix of the leading shape {tuple(lead)}; "
            f"got shape {tuple(ts.shape)}"
        )
    return ts.reshape(*ts.shape, *([1] * (ndim - ts.ndim)))


def dequantize_mxfp4_xp(xp: Any, blocks: Any, scales: Any, dtype: Any) -> Any:
    """``dequantize_mxfp4`` in the array namespace ``xp`` (numpy or jax.numpy)."""
    _check_uint8("MXFP4 blocks", blocks)
    _check_uint8("MXFP4 scales", scales)
    if blocks.ndim < 2 or blocks.shape[-1] != MXFP4_BLOCK_SIZE // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            "MXFP4 expects blocks [..., K//32, 16] and scales [..., K//32]; "
            f"got blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}"
        )
    codes = unpack_xp(xp, blocks)  # [..., G, 32]
    bits = _scaled_decode_bits_xp(xp, codes, scales[..., None])
    out = _f32_bits_to(xp, bits, dtype)
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK_SIZE)


def dequantize_nvfp4_xp(xp: Any, packed: Any, block_scales: Any, tensor_scale: Any, dtype: Any) -> Any:
    """``dequantize_nvfp4`` in the array namespace ``xp`` (numpy or jax.numpy)."""
    _check_uint8("NVFP4 packed", packed)
    if np.dtype(block_scales.dtype) == np.uint8:  # raw bytes, e.g. straight from safetensors
        block_scales = bitcast(xp, block_scales, ml_dtypes.float8_e4m3fn)
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
    tsb = expand_prefix(xp, ts, block_scales.ndim, tuple(block_scales.shape[:-1]), "dequantize_nvfp4")
    *lead, g = block_scales.shape
    codes = unpack_xp(xp, packed).reshape(*lead, g, NVFP4_BLOCK_SIZE)
    vals = decode_xp(xp, codes, np.float32)
    out = (vals * block_scales.astype(xp.float32)[..., None]) * tsb[..., None]
    out = out.reshape(*lead, g * NVFP4_BLOCK_SIZE)
    if np.dtype(dtype) == np.float32:
        return out
    with np.errstate(over="ignore"):
        return out.astype(dtype)


# ----------------------------------------------------------------------------------
# JAX API: the containers and their dequantization.
# ----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_mxfp4_jit(blocks: jax.Array, scales: jax.Array, dtype: np.dtype) -> jax.Array:
    return dequantize_mxfp4_xp(jnp, blocks, scales, dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize_nvfp4_jit(packed: jax.Array, block_scales: jax.Array, tensor_scale: Any, dtype: np.dtype) -> jax.Array:
    return dequantize_nvfp4_xp(jnp, packed, block_scales, tensor_scale, dtype)


def dequantize_mxfp4(blocks: Any, scales: Any, dtype: Any = jnp.bfloat16) -> jax.Array:
    """``blocks`` uint8 ``[..., G, 16]`` + ``scales`` uint8 ``[..., G]`` -> ``[..., 32*G]``.

    ``out = E2M1(code) * 2^(s - 127)`` exactly (NaN where ``s == 255``), rounded once
    to ``dtype`` (a no-op for float32/bfloat16 except overflow to inf; float16 may
    round/overflow as any cast). Jit-able.
    """
    return _dequantize_mxfp4_jit(jnp.asarray(blocks), jnp.asarray(scales), dtype=np.dtype(dtype))


def dequantize_nvfp4(packed: Any, block_scales: Any, tensor_scale: Any, dtype: Any = jnp.bfloat16) -> jax.Array:
    """``(E2M1(code) * float(block_scale)) * tensor_scale`` in float32, cast to ``dtype``.

    ``packed`` uint8 ``[..., K//2]``, ``block_scales`` float8_e4m3fn (or raw uint8
    bytes) ``[..., K//16]``, ``tensor_scale`` float32 scalar/prefix. Returns
    ``[..., K]``. Jit-able.
    """
    return _dequantize_nvfp4_jit(jnp.asarray(packed), jnp.asarray(block_scales), tensor_scale, dtype=np.dtype(dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP4Tensor:
    """An MXFP4-quantized array with logical shape ``[..., K]`` (a pytree).

    Attributes:
      blocks: uint8 ``[..., K//32, 16]``, packed E2M1 codes (low nibble = even element).
      scales: uint8 ``[..., K//32]``, E8M0 block scale bytes (value ``2^(s-127)``).
    """

    blocks: Any
    scales: Any

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantized) shape ``(..., K)``."""
        *lead, g = self.scales.shape
        return (*lead, g * MXFP4_BLOCK_SIZE)

    @property
    def ndim(self) -> int:
        return len(self.scales.shape)

    def dequantize(self, dtype: Any = jnp.bfloat16) -> jax.Array:
        """See :func:`dequantize_mxfp4`."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype)


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


#: Both FP4 container types (for ``isinstance`` checks).
FP4Tensor = (MXFP4Tensor, NVFP4Tensor)
