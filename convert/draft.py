"""`load_hf_draft`: a DFlash draft HuggingFace directory -> `(DraftConfig, DraftWeights)`, through the draft
family's conversion table (`dflash_jax.models.draft.hf`, found in the registry: `draft_family()`).
"""

from __future__ import annotations

import os

import jax

from convert.errors import CheckpointError
from convert.loader import resolve_dtype
from convert.safetensors_io import HFCheckpoint
from convert.table import FamilyTable, assemble, iter_with_progress
from dflash_jax.config import ConfigError, from_hf_config
from dflash_jax.models.family import draft_family_of


def load_hf_draft(directory: str | os.PathLike, dtype="fp32", *, progress: bool = False):
    """Reads a DFlash draft checkpoint directory into `(DraftConfig, DraftWeights)`, tensor by tensor.

    Unknown, duplicate, missing or wrongly shaped tensors raise `CheckpointError`; a config that is not a
    DFlash draft raises `ConfigError`.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise CheckpointError(f"draft checkpoint directory {directory} does not exist")
    np_dtype = resolve_dtype(dtype)
    cfg = from_hf_config(directory)
    family = draft_family_of(cfg)
    if family is None:
        raise ConfigError(f"{directory} holds a {type(cfg).__name__} checkpoint, not a DFlash draft "
                          "(config.json architectures should list DFlashDraftModel); pass the draft directory")
    ckpt = HFCheckpoint(directory)
    keys = ckpt.keys()
    table = FamilyTable(family)
    flat = assemble(
        iter_with_progress(ckpt.items(), len(keys), "loading draft", progress),
        table.targets(cfg),
        table.rules(cfg),
        dtype=np_dtype,
        source=directory,
        on_complete=lambda name, arr: jax.device_put(arr),
    )
    return cfg, table.build_weights(flat, cfg)
