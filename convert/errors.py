"""Kept for imports written before the error classes moved to `dflash_jax.errors`."""

from dflash_jax.errors import CheckpointError, UsageError

__all__ = ["CheckpointError", "UsageError"]
