"""Loading a HuggingFace checkpoint directory straight into a dflash_jax weight pytree."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from convert import gpt_oss as gpt_oss_table
from convert import qwen3 as qwen3_table
from convert import qwen3_5 as qwen3_5_table
from convert.errors import CheckpointError
from convert.safetensors_io import HFCheckpoint
from convert.table import FP4Joiner, assemble, iter_with_progress, table_targets
from dflash_jax.config import ConfigError, GptOssConfig, Qwen3_5Config, Qwen3Config, from_hf_config

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


def table_for(cfg, source: str = "checkpoint"):
    """The conversion table module (targets / rules / ignore / build_weights) of a target family."""
    if isinstance(cfg, Qwen3Config):
        return qwen3_table
    if isinstance(cfg, GptOssConfig):
        return gpt_oss_table
    if isinstance(cfg, Qwen3_5Config):
        return qwen3_5_table
    raise ConfigError(f"{source}: {type(cfg).__name__} is not a target model family this loader knows")


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
    table = table_for(cfg, directory)
    ckpt = HFCheckpoint(directory)
    keys = ckpt.keys()
    # FP4 tensors kept packed from the source arrive as blocks + scales and move on as one MXFP4Tensor
    placed = FP4Joiner(lambda name, arr: jax.device_put(arr))
    assemble(
        iter_with_progress(ckpt.items(), len(keys), "loading", progress),
        table_targets(table, cfg, keys),
        table.rules(cfg),
        dtype=np_dtype,
        ignore=table.ignore(cfg),
        source=directory,
        on_complete=placed,
    )
    return cfg, table.build_weights(placed.done, cfg)
