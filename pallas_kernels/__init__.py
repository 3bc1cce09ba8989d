"""Kernels for dflash_jax, each beside its pure-jnp reference, behind the `ops` dispatcher."""
