"""Loading HuggingFace checkpoint directories straight into dflash_jax weight pytrees (no conversion step).

`load_hf_target(dir)` -> (config, weights); `load_hf_pair(target_dir, draft_dir)` -> `dflash_jax.pair.Pair`
with dense experts. They live in `convert` (which may import `dflash_jax`, never the other way round):
the runtime itself reads only converted checkpoints (`dflash_jax.load`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from convert.safetensors_io import HFCheckpoint
from convert.table import FamilyTable, FP4Joiner, assemble, iter_with_progress, table_targets
from dflash_jax.config import ConfigError, from_hf_config
from dflash_jax.models.family import families, family_of
from dflash_jax.errors import CheckpointError, UsageError

_DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp32": jnp.float32, "float32": jnp.float32}
AUTO = "auto"
_BF16 = np.dtype(jnp.bfloat16)
_FP32 = np.dtype(np.float32)


def resolve_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise UsageError(f"dtype must be one of {sorted(set(_DTYPES))}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise UsageError(f"dtype must be bfloat16 or float32, got {dtype!r}") from None
    if dtype not in (_BF16, _FP32):
        raise UsageError(f"dtype must be bfloat16 or float32, got {dtype}")
    return dtype


def source_precision(source_dtype) -> np.dtype:
    """The stored dtype that keeps a source tensor's values exactly: bfloat16 (and 8-bit floats, which
    bfloat16 holds exactly) stay bfloat16; float16 / float32 / float64 become float32 (float16 has more
    mantissa bits than bfloat16; float64 beyond float32 is not representable in the runtime)."""
    source_dtype = np.dtype(source_dtype)
    if source_dtype == _BF16 or (source_dtype.kind == "V" and source_dtype.name.startswith("float8")):
        return _BF16
    return _FP32


def dtype_rule(dtype):
    """What `assemble` takes for a `--dtype` value: "auto" keeps each tensor's source precision."""
    if isinstance(dtype, str) and dtype == AUTO:
        return lambda key, source_dtype: source_precision(source_dtype)
    return resolve_dtype(dtype)


def table_for(cfg, source: str = "checkpoint"):
    """The conversion table (targets / rules / ignore / build_weights) of a target config's registered family:
    its HF layout (`ModelFamily.hf_table`) over its declarations (`convert.table.FamilyTable`)."""
    try:
        fam = family_of(cfg)
    except TypeError:
        fam = None
    if fam is None or fam.hf_table is None:
        known = sorted(f.name for f in families() if f.hf_table is not None)
        raise ConfigError(f"{source}: {type(cfg).__name__} is not a target model family this converter knows "
                          f"(it converts {', '.join(known)})")
    return FamilyTable(fam)


def load_hf_model(directory: str | os.PathLike, *, dtype="fp32", progress: bool = False):
    """Reads a HF checkpoint directory (release layout) tensor by tensor into `(config, weights)`.

    Each tensor is cast to `dtype` ("fp32", "bf16" or "auto": each tensor's source precision) on the host
    and moved to the default device as soon as its target array is complete, so host memory holds at most
    one target array (one layer's expert table) at a time.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    rule = dtype_rule(dtype)
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
        dtype=rule,
        ignore=table.ignore(cfg),
        source=directory,
        on_complete=placed,
    )
    return cfg, table.build_weights(placed.done, cfg)


def load_hf_target(directory: str | os.PathLike, *, dtype="fp32", progress: bool = False):
    """`(config, weights)` of a target model from a HuggingFace checkpoint directory (was
    `dflash_jax.load_hf_target`)."""
    return load_hf_model(directory, dtype=dtype, progress=progress)


def load_hf_pair(target_dir: str | os.PathLike, draft_dir: str | os.PathLike, *, dtype="fp32"):
    """A `dflash_jax.pair.Pair` straight from the HuggingFace directories (dense experts, no conversion
    step; was `dflash_jax.pair.load_hf_pair`)."""
    from convert.draft import load_hf_draft  # convert.draft imports this module (resolve_dtype)
    from dflash_jax.pair import Pair, check_pair

    target_cfg, target = load_hf_model(target_dir, dtype=dtype)
    draft_cfg, draft = load_hf_draft(draft_dir, dtype)
    check_pair(target_cfg, draft_cfg)
    return Pair(target_cfg=target_cfg, target=target, draft_cfg=draft_cfg, draft=draft,
                manifest={"expert_format": "dense", "tensors": {"target": {}}}, directory=os.fspath(target_dir))
