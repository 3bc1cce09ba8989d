"""dflash_jax: lossless DFlash speculative decoding for Mixture-of-Experts LLMs in JAX."""

from dflash_jax.config import ConfigError, from_hf_config

__version__ = "0.1.0"


def load_hf_target(directory, *, dtype="fp32", progress: bool = False):
    """`(config, weights)` of a target model from a HuggingFace checkpoint directory."""
    from convert.loader import load_hf_model

    return load_hf_model(directory, dtype=dtype, progress=progress)


def load(directory, *, expert_memory: str = "device"):
    """A converted target + draft pair (`dflash_jax.pair.Pair`) from a `convert-weights` checkpoint."""
    from dflash_jax.pair import load as _load

    return _load(directory, expert_memory=expert_memory)


__all__ = ["ConfigError", "from_hf_config", "load", "load_hf_target", "__version__"]
