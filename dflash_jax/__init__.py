"""dflash_jax: lossless DFlash speculative decoding for Mixture-of-Experts LLMs in JAX."""

from dflash_jax.config import ConfigError, from_hf_config
from dflash_jax.errors import CheckpointError

__version__ = "0.1.0"


def load(directory, *, expert_memory: str = "device", verify: bool = True):
    """A converted target + draft pair (`dflash_jax.pair.Pair`) from a `convert-weights` checkpoint; `verify`
    checks every file's sha256 first (see `dflash_jax.pair.load`). HuggingFace directories load with
    `convert.load_hf_target` / `convert.load_hf_pair`."""
    from dflash_jax.pair import load as _load

    return _load(directory, expert_memory=expert_memory, verify=verify)


def __getattr__(name):
    if name == "load_hf_target":  # moved: the runtime never imports the converter
        raise AttributeError("dflash_jax.load_hf_target moved to convert.load_hf_target")
    raise AttributeError(f"module 'dflash_jax' has no attribute {name!r}")


__all__ = ["CheckpointError", "ConfigError", "from_hf_config", "load", "__version__"]
