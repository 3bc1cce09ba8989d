"""Loading a HuggingFace checkpoint directory straight into a dflash_jax weight pytree."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from convert import qwen3 as qwen3_table
from convert.errors import CheckpointError
from convert.safetensors_io import HFCheckpoint
from convert.table import assemble, iter_with_progress
from dflash_jax.config import ConfigError, Qwen3Config, from_hf_config

_DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp32": jnp.float32, "float32": jnp.float32}


def resolve_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(set(_DTYPES))}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float32)):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype}")
    return dtype


def load_hf_model(directory: str | os.PathLike, *, dtype="fp32", progress: bool = False):
    """Reads a HF checkpoint directory (release layout) tensor by tensor into `(config, weights)`.

    Each tensor is cast to `dtype` on the host and moved to the default device as soon as its target
    array is complete, so host memory holds at most one target array (one layer's expert table) at a time.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    np_dtype = resolve_dtype(dtype)
    cfg = from_hf_config(directory)
    ckpt = HFCheckpoint(directory)
    if isinstance(cfg, Qwen3Config):
        table = qwen3_table
    else:  # pragma: no cover - from_hf_config rejects the rest
        raise ConfigError(f"{directory}: no weight table for {type(cfg).__name__}")
    keys = ckpt.keys()
    flat = assemble(
        iter_with_progress(ckpt.items(), len(keys), "loading", progress),
        table.targets(cfg),
        table.rules(cfg),
        dtype=np_dtype,
        ignore=table.ignore(cfg),
        source=directory,
        on_complete=lambda name, arr: jax.device_put(arr),
    )
    return cfg, table.build_weights(flat, cfg)
