"""The dflash_jax checkpoint format, read side: manifest, chunks, checksums (`convert` writes it).

Layout of a checkpoint directory:
  manifest.json          format and converter version, both HF configs, formats, every tensor's shape /
                         dtype / format / bytes, the sha256 and size of every file written (`checksums`),
                         the sha256 of every source file
  target/globals/        orbax checkpoint: embed, final_norm, lm_head (anything not under layers.N)
  target/layers/NNNN/    orbax checkpoint: one decoder layer (expert tables stacked, possibly FP4)
  draft/globals/, draft/layers/NNNN/
  tokenizer files copied from the target directory, when present

Reading checks, in order: the manifest's structure (every field and type), then every file it lists
(size always; sha256 unless `verify=False`), then each restored tensor against the manifest's shape,
dtype and format. The manifest's configs are checked against its tensor list by the pair loader.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from typing import Any, Callable

import jax
import numpy as np

from dflash_jax.errors import CheckpointError, open_regular, safe_relpath
from dflash_jax.quant import MXFP4Tensor, NVFP4Tensor

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 2: per-file checksums
READABLE_VERSIONS = (1, 2)
CHECKSUM = "sha256"
TENSOR_FORMATS = ("dense", "mxfp4", "nvfp4")
REDO = "re-run convert-weights to write it again"
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def chunk_of(key: str) -> tuple[str, str]:
    """Flat key -> (chunk directory, key inside the chunk)."""
    m = _LAYER.fullmatch(key)
    if m:
        return f"layers/{int(m[1]):04d}", m[2]
    return "globals", key


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
    """Manifest entry of one tensor (host or device array, or FP4 tensor): logical shape, storage dtype,
    format, bytes. Reads only attributes, so describing a device array copies nothing."""
    if isinstance(value, (MXFP4Tensor, NVFP4Tensor)):
        fmt = "mxfp4" if isinstance(value, MXFP4Tensor) else "nvfp4"
        parts = jax.tree.leaves(value)
        return {"format": fmt, "shape": [int(d) for d in value.shape], "bytes": int(sum(p.nbytes for p in parts))}
    return {"format": "dense", "shape": [int(d) for d in value.shape], "dtype": str(value.dtype),
            "bytes": int(value.nbytes)}


def file_sha256(path: str, *, chunk: int = 16 * 2**20, on_read: Callable[[int], Any] | None = None) -> tuple[str, int]:
    """(hex sha256, size) of a regular file, read in 16 MiB pieces (`on_read(n)` after each, for progress)."""
    h = hashlib.sha256()
    size = 0
    with open_regular(path) as fh:
        while block := fh.read(chunk):
            h.update(block)
            size += len(block)
            if on_read is not None:
                on_read(len(block))
    return h.hexdigest(), size


# ----------------------------------------------------------------------------------------------------------
# manifest
# ----------------------------------------------------------------------------------------------------------


def _damaged(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; the checkpoint is damaged or was edited: {REDO}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_tensor_entry(path: str, where: str, key: Any, info: Any) -> None:
    if not isinstance(key, str) or not isinstance(info, dict):
        raise _damaged(path, f"{where} entry {key!r} is not a name with an object")
    fmt = info.get("format")
    if fmt not in TENSOR_FORMATS:
        raise _damaged(path, f"{where}.{key}.format is {fmt!r} (expected one of {', '.join(TENSOR_FORMATS)})")
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _damaged(path, f"{where}.{key}.shape is {shape!r} (expected a list of sizes)")
    if not _is_int(info.get("bytes")) or info["bytes"] < 0:
        raise _damaged(path, f"{where}.{key}.bytes is {info.get('bytes')!r} (expected a byte count)")
    if fmt == "dense" and not isinstance(info.get("dtype"), str):
        raise _damaged(path, f"{where}.{key}.dtype is {info.get('dtype')!r} (expected a dtype name)")


def _check_checksums(path: str, checksums: Any) -> None:
    if not isinstance(checksums, dict) or checksums.get("algorithm") != CHECKSUM:
        raise _damaged(path, f"checksums must be an object with algorithm {CHECKSUM!r}")
    files = checksums.get("files")
    if not isinstance(files, dict) or not files:
        raise _damaged(path, "checksums.files must list the checkpoint's files")
    for rel, entry in files.items():
        if not safe_relpath(rel):
            raise _damaged(path, f"checksums.files names {rel!r}, which is not a path inside the checkpoint")
        if (not isinstance(entry, dict) or not _is_int(entry.get("bytes")) or entry["bytes"] < 0
                or not isinstance(entry.get(CHECKSUM), str) or not _HEX64.fullmatch(entry[CHECKSUM])):
            raise _damaged(path, f"checksums.files.{rel} must have bytes and a {CHECKSUM} hex digest")


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The validated manifest of a checkpoint directory; CheckpointError naming the field otherwise."""
    directory = os.fspath(directory)
    if not os.path.exists(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is a file, not a checkpoint directory (a convert-weights output)")
    path = os.path.join(directory, MANIFEST)
    if not os.path.lexists(path):
        raise CheckpointError(
            f"{directory} has no {MANIFEST}: it is not a dflash_jax checkpoint (make one with convert-weights; "
            "a HuggingFace directory loads with convert.load_hf_target)"
        )
    try:
        with open_regular(path) as fh:
            manifest = json.loads(fh.read().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSON and UTF-8 errors
        if isinstance(e, CheckpointError):
            raise
        raise _damaged(path, f"not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise _damaged(path, f"holds a {type(manifest).__name__}, not an object")
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: checkpoint format version {version!r} is not one this dflash_jax reads "
                              f"({', '.join(map(str, READABLE_VERSIONS))}); {REDO} with this version")
    for field in ("target_config", "draft_config"):
        if not isinstance(manifest.get(field), dict):
            raise _damaged(path, f"field {field!r} is missing or not an object")
    if not isinstance(manifest.get("expert_format"), str):
        raise _damaged(path, "field 'expert_format' is missing or not a string")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict) or not all(isinstance(tensors.get(m), dict) and tensors[m]
                                                for m in ("target", "draft")):
        raise _damaged(path, "field 'tensors' must hold non-empty 'target' and 'draft' objects")
    for model in ("target", "draft"):
        for key, info in tensors[model].items():
            _check_tensor_entry(path, f"tensors.{model}", key, info)
    if version >= 2:
        _check_checksums(path, manifest.get("checksums"))
    return manifest


# ----------------------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------------------


def verify_files(directory: str, manifest: dict[str, Any], *, checksums: bool = True) -> None:
    """Checks every file the manifest lists: present, regular, of the recorded size and (with `checksums`)
    of the recorded sha256. Files the manifest does not list are not read."""
    files = manifest.get("checksums", {}).get("files")
    if files is None:
        if checksums:
            raise CheckpointError(
                f"{os.path.join(directory, MANIFEST)} has no checksums (format version "
                f"{manifest.get('format_version')}, written before convert-weights recorded them): {REDO}, or "
                "load it unchecked with verify=False")
        return
    for rel, entry in sorted(files.items()):
        path = os.path.join(directory, *rel.split("/"))
        if not os.path.lexists(path):
            raise CheckpointError(f"{path} is missing (listed in {MANIFEST}): the checkpoint is incomplete; copy it "
                                  f"again or {REDO}")
        if checksums:
            digest, size = file_sha256(path)
        else:
            with open_regular(path) as fh:
                size, digest = os.fstat(fh.fileno()).st_size, None
        if size != entry["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, {MANIFEST} records {entry['bytes']}: the file is "
                                  f"truncated or was replaced; copy the checkpoint again or {REDO}")
        if digest is not None and digest != entry[CHECKSUM]:
            raise CheckpointError(f"{path} does not match its {CHECKSUM} in {MANIFEST}: the file is damaged or was "
                                  f"modified; copy the checkpoint again or {REDO}")


# ----------------------------------------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------------------------------------


def _get_nested(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            raise KeyError(key)
        tree = tree[part]
    return tree


class _QuietOrbax:
    """Keeps orbax's background-thread error logs (tracebacks through absl) off the user's terminal while
    its errors are raised to us and reported in one line."""

    def __enter__(self):
        self.logger = logging.getLogger("absl")
        self.level = self.logger.level
        self.logger.setLevel(logging.CRITICAL)
        return self

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def quiet_orbax() -> _QuietOrbax:
    return _QuietOrbax()


def _restore_target(ckpt, path: str, chunk: str, sharding: Callable[[str, str | None, tuple], Any]) -> Any:
    """The chunk's stored tree as `jax.ShapeDtypeStruct`s carrying `sharding(flat key, FP4 part or None,
    shape)`, so orbax reads each array straight into its sharding (each process only its own pieces)."""
    prefix = "" if chunk == "globals" else f"layers.{int(chunk.split('/')[1])}."
    meta = ckpt.metadata(path).item_metadata.tree

    def one(keypath, m):
        parts = [str(k.key) for k in keypath]
        inner = ".".join(parts)
        key, part = (prefix + inner, None) if len(parts) == 1 or _LAYER_PART.search(inner) is None else (
            prefix + ".".join(parts[:-1]), parts[-1])
        return jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding(key, part, tuple(m.shape)))

    return jax.tree_util.tree_map_with_path(one, meta)


_LAYER_PART = re.compile(r"\.(blocks|scales|packed|block_scales|tensor_scale)$")  # an FP4 tensor's stored parts


def read_model(root: str, tensors: dict[str, dict[str, Any]], place: Callable[[str, Any, dict], Any], *,
               sharding: Callable[[str, str | None, tuple], Any] | None = None) -> dict[str, Any]:
    """Restores every chunk under `root`; returns {flat key: placed tensor}. Each restored tensor must have
    the manifest's format, shape, dtype and size. `sharding(key, FP4 part or None, shape)`: restore each
    array straight into that sharding (a mesh, `dflash_jax.sharding`) instead of the host."""
    import orbax.checkpoint as ocp

    by_chunk: dict[str, list[str]] = {}
    for key in tensors:
        by_chunk.setdefault(chunk_of(key)[0], []).append(key)
    flat: dict[str, Any] = {}
    with ocp.StandardCheckpointer() as ckpt, quiet_orbax():
        for chunk, keys in sorted(by_chunk.items()):
            path = os.path.join(os.path.abspath(root), chunk)
            if not os.path.isdir(path):
                raise CheckpointError(f"checkpoint chunk {path} is missing; the checkpoint is incomplete: {REDO}")
            try:
                tree = ckpt.restore(path) if sharding is None else ckpt.restore(
                    path, _restore_target(ckpt, path, chunk, sharding))
            except Exception as e:  # orbax / tensorstore raise many types for a damaged chunk
                raise CheckpointError(f"checkpoint chunk {path} cannot be read ({type(e).__name__}: "
                                      f"{' '.join(str(e).split())[:300]}); {REDO}") from None
            for key in keys:
                info = tensors[key]
                try:
                    value = tree_to_tensor(_get_nested(tree, chunk_of(key)[1]), info["format"])
                except (KeyError, TypeError):
                    raise CheckpointError(f"checkpoint chunk {path} has no tensor {key} (or not in its "
                                          f"{info['format']} parts) although {MANIFEST} lists it; {REDO}") from None
                stored = describe(value)
                expected = {k: info[k] for k in stored if k in info}
                if stored != expected:
                    raise CheckpointError(f"{path}: tensor {key} is stored as {stored}, {MANIFEST} says {expected}; "
                                          f"the checkpoint is damaged or was edited: {REDO}")
                flat[key] = place(key, value, info)
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
