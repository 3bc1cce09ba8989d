"""HuggingFace checkpoints -> dflash_jax checkpoints (`convert-weights`), and loading HF directories directly.

  convert.convert(target_dir, draft_dir, out_dir, ...)   the conversion (`convert.pipeline.convert`)
  convert.load_hf_target(dir)                            (config, weights) of a HF target directory
  convert.load_hf_pair(target_dir, draft_dir)            a `dflash_jax.pair.Pair` with dense experts

Importing the package is light (the names above load jax on first use), so `convert-weights --help` and a
Ctrl-C during start-up stay fast and clean.
"""

from dflash_jax.errors import CheckpointError

_LAZY = {"convert": "convert.pipeline", "load_hf_target": "convert.loader", "load_hf_pair": "convert.loader"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'convert' has no attribute {name!r}")


__all__ = ["CheckpointError", "convert", "load_hf_pair", "load_hf_target"]
