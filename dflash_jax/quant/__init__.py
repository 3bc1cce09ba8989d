"""FP4 weight formats (pure ``jax.numpy``, jit-able, plus bit-identical numpy twins).

* :mod:`dflash_jax.quant.fp4` -- the E2M1 element codec and nibble packing;
* :mod:`dflash_jax.quant.mxfp4` -- MXFP4 (OCP MX v1.0; gpt-oss checkpoints);
* :mod:`dflash_jax.quant.nvfp4` -- NVFP4 (E4M3 block scales + fp32 tensor scale).

The containers ``MXFP4Tensor`` / ``NVFP4Tensor`` and their jnp dequantization are defined in
:mod:`pallas_kernels.formats` (the kernels' operand types; the bottom layer) and re-exported here
unchanged: ``dflash_jax.quant.MXFP4Tensor is pallas_kernels.formats.MXFP4Tensor``.

Quantized axes are always the LAST axis (the contraction / input axis of a weight
stored HF-style as ``[..., out, in]``).
"""

from dflash_jax.quant.fp4 import (
    E2M1_MAX,
    E2M1_VALUES,
    e2m1_decode,
    e2m1_decode_np,
    e2m1_encode,
    e2m1_encode_np,
    pack_fp4,
    pack_fp4_np,
    unpack_fp4,
    unpack_fp4_np,
)
from dflash_jax.quant.mxfp4 import (
    MXFP4_BLOCK_SIZE,
    MXFP4Tensor,
    dequantize_mxfp4,
    dequantize_mxfp4_np,
    quantize_mxfp4,
    quantize_mxfp4_np,
)
from dflash_jax.quant.nvfp4 import (
    E4M3_MAX,
    NVFP4_BLOCK_SIZE,
    NVFP4Tensor,
    dequantize_nvfp4,
    dequantize_nvfp4_np,
    quantize_nvfp4,
    quantize_nvfp4_np,
)

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "MXFP4_BLOCK_SIZE",
    "MXFP4Tensor",
    "NVFP4_BLOCK_SIZE",
    "NVFP4Tensor",
    "dequantize_mxfp4",
    "dequantize_mxfp4_np",
    "dequantize_nvfp4",
    "dequantize_nvfp4_np",
    "e2m1_decode",
    "e2m1_decode_np",
    "e2m1_encode",
    "e2m1_encode_np",
    "pack_fp4",
    "pack_fp4_np",
    "quantize_mxfp4",
    "quantize_mxfp4_np",
    "quantize_nvfp4",
    "quantize_nvfp4_np",
    "unpack_fp4",
    "unpack_fp4_np",
]
