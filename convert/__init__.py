"""HuggingFace checkpoints -> dflash_jax weight pytrees (and, later, dflash_jax checkpoints)."""

from convert.errors import CheckpointError

__all__ = ["CheckpointError"]
