"""The dflash_jax checkpoint: a target + draft pair, experts in the chosen format, written by chunks.

Layout of a checkpoint directory:
  manifest.json          converter version, both HF configs, formats, every tensor's shape/dtype/format,
                         sha256 of every source file
  target/globals/        orbax checkpoint: embed, final_norm, lm_head (anything not under layers.N)
  target/layers/NNNN/    orbax checkpoint: one decoder layer (expert tables stacked, possibly FP4)
  draft/globals/, draft/layers/NNNN/
  tokenizer files copied from the target directory, when present

Chunks are written as soon as their last tensor arrives, so conversion holds about one layer in memory;
loading restores chunk by chunk and can place expert tables in `pinned_host` memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable

import jax
import numpy as np

from convert.errors import CheckpointError
from dflash_jax.quant import MXFP4Tensor, NVFP4Tensor

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def chunk_of(key: str) -> tuple[str, str]:
    """Flat key -> (chunk directory, key inside the chunk)."""
    m = _LAYER.fullmatch(key)
    if m:
        return f"layers/{int(m[1]):04d}", m[2]
    return "globals", key


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _get_nested(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree[part]
    return tree


def tensor_to_tree(value: Any) -> Any:
    """An array or FP4 tensor -> what orbax stores (FP4 tensors as dicts of their parts)."""
    if isinstance(value, MXFP4Tensor):
        return {"blocks": np.asarray(value.blocks), "scales": np.asarray(value.scales)}
    if isinstance(value, NVFP4Tensor):
        return {"packed": np.asarray(value.packed), "block_scales": np.asarray(value.block_scales),
                "tensor_scale": np.asarray(value.tensor_scale)}
    return np.asarray(value)


def tree_to_tensor(tree: Any, fmt: str) -> Any:
    if fmt == "mxfp4":
        return MXFP4Tensor(blocks=tree["blocks"], scales=tree["scales"])
    if fmt == "nvfp4":
        return NVFP4Tensor(packed=tree["packed"], block_scales=tree["block_scales"], tensor_scale=tree["tensor_scale"])
    return tree


def describe(value: Any) -> dict[str, Any]:
    """Manifest entry of one tensor: logical shape, storage dtype, format, bytes."""
    if isinstance(value, (MXFP4Tensor, NVFP4Tensor)):
        fmt = "mxfp4" if isinstance(value, MXFP4Tensor) else "nvfp4"
        parts = tensor_to_tree(value)
        return {"format": fmt, "shape": list(value.shape),
                "bytes": int(sum(np.asarray(p).nbytes for p in parts.values()))}
    arr = np.asarray(value)
    return {"format": "dense", "shape": list(arr.shape), "dtype": str(arr.dtype), "bytes": int(arr.nbytes)}


class ChunkWriter:
    """Collects finished target arrays and saves each chunk (layer) with orbax once it is complete."""

    def __init__(self, root: str, keys: list[str], finalize: Callable[[str, np.ndarray], Any]):
        import orbax.checkpoint as ocp

        self.root = os.path.abspath(root)
        self.finalize = finalize
        self.pending: dict[str, set[str]] = {}
        for key in keys:
            self.pending.setdefault(chunk_of(key)[0], set()).add(key)
        self.buffers: dict[str, dict[str, Any]] = {}
        self.manifest: dict[str, Any] = {}
        self._checkpointer = ocp.StandardCheckpointer()

    def add(self, key: str, array: np.ndarray) -> None:
        chunk, inner = chunk_of(key)
        value = self.finalize(key, array)
        self.manifest[key] = describe(value)
        self.buffers.setdefault(chunk, {})[inner] = tensor_to_tree(value)
        self.pending[chunk].discard(key)
        if not self.pending[chunk]:
            tree = _nest(self.buffers.pop(chunk))
            self._checkpointer.save(os.path.join(self.root, chunk), tree)
            self._checkpointer.wait_until_finished()

    def close(self) -> None:
        self._checkpointer.close()


def read_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if not os.path.exists(path):
        raise CheckpointError(
            f"{directory} has no {MANIFEST}: it is not a dflash_jax checkpoint (make one with convert-weights; "
            "a HuggingFace directory loads with dflash_jax.load_hf_target)"
        )
    with open(path) as fh:
        manifest = json.load(fh)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{directory}: checkpoint format version {manifest.get('format_version')} is not "
                              f"{FORMAT_VERSION}; re-run convert-weights with this version")
    return manifest


def read_model(root: str, tensors: dict[str, dict[str, Any]], place: Callable[[str, Any, dict], Any]) -> dict[str, Any]:
    """Restores every chunk under `root`; returns {flat key: placed tensor}."""
    import orbax.checkpoint as ocp

    by_chunk: dict[str, list[str]] = {}
    for key in tensors:
        by_chunk.setdefault(chunk_of(key)[0], []).append(key)
    flat: dict[str, Any] = {}
    with ocp.StandardCheckpointer() as ckpt:
        for chunk, keys in sorted(by_chunk.items()):
            path = os.path.join(os.path.abspath(root), chunk)
            if not os.path.isdir(path):
                raise CheckpointError(f"checkpoint chunk {path} is missing; the checkpoint is incomplete")
            tree = ckpt.restore(path)
            for key in keys:
                inner = chunk_of(key)[1]
                flat[key] = place(key, tree_to_tensor(_get_nested(tree, inner), tensors[key]["format"]), tensors[key])
            del tree
    return flat


def is_expert_table(key: str, info: dict[str, Any]) -> bool:
    """Stacked per-expert tables ([E, ...], 3-D) of MoE layers, the arrays offload moves around."""
    return key.rsplit(".", 2)[-2:][0] == "mlp" and key.split(".")[-1] in ("gate_up", "down") and len(info["shape"]) == 3


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """Places restored tensors: expert tables in `expert_memory` ("device" or "pinned_host"), the rest on
    the device."""

    expert_memory: str = "device"

    def __call__(self, key: str, value: Any, info: dict[str, Any]) -> Any:
        kind = self.expert_memory if is_expert_table(key, info) else "device"
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
        return jax.tree.map(lambda a: jax.device_put(a, sharding), value)
