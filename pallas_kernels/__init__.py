"""Kernels for dflash_jax, each beside its pure-jnp reference, behind the `ops` dispatcher.

The bottom layer: imports neither `dflash_jax` nor `convert`. It owns the FP4 weight containers its kernels
read (`formats.MXFP4Tensor` / `NVFP4Tensor`, re-exported by `dflash_jax.quant`).
"""
