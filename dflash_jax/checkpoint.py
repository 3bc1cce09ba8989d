"""The dflash_jax checkpoint format, read side: manifest, chunks, checksums (`convert` writes it).

Layout of a checkpoint directory:
  manifest.json          format and converter version, both HF configs, formats, every tensor's shape /
                         dtype / format / bytes, the sha256 and size of every file written (`checksums`),
                         the sha256 of every source file
  target/globals/        orbax checkpoint: embed, final_norm, lm_head (anything not under layers.N)
  target/layers/NNNN/    orbax checkpoint: one decoder layer (expert tables stacked, possibly FP4)
  draft/globals/, draft/layers/NNNN/
  tokenizer and template files copied from the target directory, when present (`TOKENIZER_FILES`)

The manifest carries `manifest_sha256`, a sha256 over its own canonical JSON without that field
(`seal_manifest`): a manifest that was edited or damaged after it was written does not verify, and
`convert-weights --overwrite` replaces only a directory whose manifest verifies. Manifests written before
the field existed still load (format version 2); they cannot be told from edited ones, so `--overwrite`
refuses them.

Reading checks, in order: the manifest's digest and structure (every field and type), then every file it
lists (size always; sha256 unless `verify=False`, except the files beside `target/` and `draft/`, such as
the tokenizer files, which are always hashed), then each restored tensor against the manifest's shape,
dtype and format. The manifest's configs are checked against its tensor list by the pair loader.

Side files: the tokenizer and template files (`TOKENIZER_FILES`) are part of the checkpoint: listed in
`checksums.files` and verified like the weights. One that sits in the directory without being listed (added
after conversion) is refused at load; `add_side_file` records such a file. Code that reads a side file
later (a chat template from `tokenizer_config.json`) goes through `verified_side_file`, which checks it
again at the time of reading. Files written beside a checkpoint after conversion by other tools carry their
own checks (`branch_head.safetensors`, `tree_calibration.json`: a sha256 and the pair's fingerprint in the
file) or are records the runtime does not read (`split.json`, `train_summary.json`).

Draft variants: a checkpoint whose manifest names `target_from` (`TARGET_FROM`, the directory name of a sibling
checkpoint) stores only its draft (and side files): its `target/` files are read from that sibling, checked
against this manifest's own checksums for them (and its configs and tensor list, which cover the target too).
A pair that ships several drafts of one target keeps one copy of the target this way
(`make_draft_variant`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
from typing import Any, Callable

import jax
import numpy as np

from dflash_jax.errors import CheckpointError, fsync_dir, open_regular, safe_relpath
from dflash_jax.quant import MXFP4Tensor, NVFP4Tensor

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 2: per-file checksums
READABLE_VERSIONS = (1, 2)
CHECKSUM = "sha256"
TENSOR_FORMATS = ("dense", "mxfp4", "nvfp4")
REDO = "re-run convert-weights to write it again"
#: the manifest's own digest: sha256 over its canonical JSON without this field (`manifest_digest`)
MANIFEST_DIGEST = "manifest_sha256"
#: tokenizer and chat-template files convert-weights copies from the target directory; in a checkpoint they
#: are covered by the manifest's checksums like the weights (`verified_side_file`)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json", "chat_template.jinja")
#: manifest field of a draft variant: the sibling checkpoint directory whose `target/` files it reads
TARGET_FROM = "target_from"
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


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 (hex) of the manifest's canonical JSON (sorted keys, no spaces) without `MANIFEST_DIGEST`."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def seal_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """A copy of `manifest` carrying its own digest (`MANIFEST_DIGEST`, last)."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST}
    return {**body, MANIFEST_DIGEST: manifest_digest(body)}


def manifest_verifies(manifest: Any) -> bool | None:
    """True when the manifest carries a digest that matches its content, False when the digest is there
    and does not match (edited or damaged), None when it has none (written before digests existed)."""
    if not isinstance(manifest, dict) or MANIFEST_DIGEST not in manifest:
        return None
    digest = manifest[MANIFEST_DIGEST]
    return isinstance(digest, str) and digest == manifest_digest(manifest)


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> dict[str, Any]:
    """Writes `manifest` sealed (`seal_manifest`) as `directory/manifest.json`, atomically: a temporary file
    in the directory, fsynced, renamed over the old one (a crash leaves the old manifest or the new one,
    never half of one, and the temporary file is removed on any error). For tools that change a finished
    checkpoint's manifest; returns the sealed manifest."""
    directory = os.fspath(directory)
    sealed = seal_manifest(manifest)
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(sealed, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would make the manifest private
        os.replace(tmp, os.path.join(directory, MANIFEST))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
    return sealed


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
    if manifest_verifies(manifest) is False:
        raise CheckpointError(f"{path} was edited or damaged after convert-weights wrote it (its {MANIFEST_DIGEST} "
                              f"does not match its content); restore the original {MANIFEST} or {REDO}")
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
    target_from = manifest.get(TARGET_FROM)
    if target_from is not None and (not isinstance(target_from, str) or not safe_relpath(target_from)
                                    or "/" in target_from or "\\" in target_from or target_from in (".", "..")):
        raise _damaged(path, f"field {TARGET_FROM!r} must name a sibling checkpoint directory, got {target_from!r}")
    tokenizer_files = manifest.get("tokenizer_files", [])
    if not isinstance(tokenizer_files, list) or not all(isinstance(n, str) for n in tokenizer_files):
        raise _damaged(path, "field 'tokenizer_files' must be a list of file names")
    if version >= 2:
        unlisted = [n for n in tokenizer_files if n not in manifest["checksums"]["files"]]
        if unlisted:
            raise _damaged(path, f"tokenizer file {unlisted[0]} is not in checksums.files")
    return manifest


# ----------------------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------------------


def _is_side_file(rel: str) -> bool:
    """Files beside the weights (tokenizer, template): not under `target/` or `draft/`."""
    return rel.split("/", 1)[0] not in ("target", "draft")


def _record_hint(directory: str, name: str) -> str:
    return f"dflash_jax.checkpoint.add_side_file({directory!r}, {name!r})"


def _check_file(directory: str, rel: str, entry: dict[str, Any], *, hashed: bool) -> str:
    """One listed file: present, regular, of the recorded size and (`hashed`) sha256. Returns its path."""
    path = os.path.join(directory, *rel.split("/"))
    if not os.path.lexists(path):
        raise CheckpointError(f"{path} is missing (listed in {MANIFEST}): the checkpoint is incomplete; copy it "
                              f"again or {REDO}")
    if hashed:
        digest, size = file_sha256(path)
    else:
        with open_regular(path) as fh:
            size, digest = os.fstat(fh.fileno()).st_size, None
    if (size != entry["bytes"] or (digest is not None and digest != entry[CHECKSUM])) and _is_side_file(rel):
        raise CheckpointError(f"{path} was edited or damaged after convert-weights wrote it (it does not match its "
                              f"size and {CHECKSUM} in {MANIFEST}); restore the original, or record this version with "
                              f"{_record_hint(directory, rel)}")
    if size != entry["bytes"]:
        raise CheckpointError(f"{path} has {size} bytes, {MANIFEST} records {entry['bytes']}: the file is "
                              f"truncated or was replaced; copy the checkpoint again or {REDO}")
    if digest is not None and digest != entry[CHECKSUM]:
        raise CheckpointError(f"{path} does not match its {CHECKSUM} in {MANIFEST}: the file is damaged or was "
                              f"modified; copy the checkpoint again or {REDO}")
    return path


def _unlisted_side_file(directory: str, name: str) -> CheckpointError:
    return CheckpointError(
        f"{os.path.join(directory, name)} is not covered by the checksums in {MANIFEST} (it was put there after "
        f"convert-weights wrote the checkpoint, so nothing vouches for it); remove it, or record it with "
        f"{_record_hint(directory, name)}, or put it in the --target directory and re-run convert-weights")


def target_directory(directory: str | os.PathLike, manifest: dict[str, Any]) -> str:
    """The directory that holds a checkpoint's `target/` files: the checkpoint itself, or for a draft variant
    (`TARGET_FROM`) the sibling checkpoint it names. CheckpointError when that sibling is not there."""
    directory = os.fspath(directory)
    name = manifest.get(TARGET_FROM)
    if name is None:
        return directory
    root = os.path.join(os.path.dirname(os.path.abspath(directory)), name)
    if not os.path.isdir(os.path.join(root, "target")):
        raise CheckpointError(f"{directory} is a draft variant: its target is the checkpoint {name!r} beside it, and "
                              f"{os.path.join(root, 'target')} is missing; copy {name} next to it (the two ship "
                              "together)")
    return root


def make_draft_variant(pair_dir: str | os.PathLike, base_dir: str | os.PathLike) -> dict[str, Any]:
    """Turns the converted pair `pair_dir` into a draft variant of its sibling checkpoint `base_dir` (same
    parent directory), which holds the same target: the target files of `pair_dir` are deleted and its manifest
    lists the base's target files, tensors and config instead, with `target_from` naming the base (re-sealed).
    ValueError when the two targets' configs or tensor lists differ (the targets would not be the same)."""
    pair_dir, base_dir = os.fspath(pair_dir), os.fspath(base_dir)
    if os.path.dirname(os.path.abspath(pair_dir)) != os.path.dirname(os.path.abspath(base_dir)):
        raise ValueError("a draft variant and its base checkpoint must be siblings (one parent directory)")
    manifest, base = read_manifest(pair_dir), read_manifest(base_dir)
    if base.get(TARGET_FROM) is not None:
        raise ValueError(f"{base_dir} is a draft variant itself: use the checkpoint that holds the target")
    for field in ("target_config", "expert_format"):
        if manifest[field] != base[field]:
            raise ValueError(f"the two checkpoints' {field} differ: not the same target")
    if manifest["tensors"]["target"] != base["tensors"]["target"]:
        raise ValueError("the two checkpoints' target tensor lists differ: not the same target")
    files = {k: v for k, v in manifest["checksums"]["files"].items() if not k.startswith("target/")}
    files.update({k: v for k, v in base["checksums"]["files"].items() if k.startswith("target/")})
    manifest["checksums"]["files"] = dict(sorted(files.items()))
    manifest[TARGET_FROM] = os.path.basename(os.path.normpath(base_dir))
    sealed = write_manifest(pair_dir, manifest)  # first: a crash before the removal leaves a loadable variant
    import shutil

    shutil.rmtree(os.path.join(pair_dir, "target"))
    return sealed


def verify_files(directory: str, manifest: dict[str, Any], *, checksums: bool = True) -> None:
    """Checks every file the manifest lists: present, regular, of the recorded size and (with `checksums`)
    of the recorded sha256. The files beside `target/` and `draft/` (tokenizer, template) are hashed even
    without `checksums` (they are small, and read as they are), and a tokenizer or template file
    (`TOKENIZER_FILES`) that the manifest does not list is refused. Other unlisted files are not read."""
    files = manifest.get("checksums", {}).get("files")
    if files is None:
        if checksums:
            raise CheckpointError(
                f"{os.path.join(directory, MANIFEST)} has no checksums (format version "
                f"{manifest.get('format_version')}, written before convert-weights recorded them): {REDO}, or "
                "load it unchecked with verify=False")
        return
    target_root = target_directory(directory, manifest)
    for rel, entry in sorted(files.items()):
        root = target_root if rel.split("/", 1)[0] == "target" else directory
        _check_file(root, rel, entry, hashed=checksums or _is_side_file(rel))
    for name in TOKENIZER_FILES:
        if name not in files and os.path.lexists(os.path.join(directory, name)):
            raise _unlisted_side_file(directory, name)


def _side_file_name(name: Any) -> str:
    if (not safe_relpath(name) or "/" in name or name in (MANIFEST, "target", "draft")):
        raise ValueError(f"{name!r} is not the name of a file beside a checkpoint's weights (a plain file name, "
                         f"not {MANIFEST}, target or draft)")
    return name


def verified_side_file(directory: str | os.PathLike, name: str, manifest: dict[str, Any] | None = None) -> str | None:
    """The path of side file `name` (e.g. "tokenizer_config.json") of a checkpoint, checked now against the
    manifest's checksums (size and sha256), or None when the checkpoint has no such file.

    Raises CheckpointError (one line: the file, the cause, the fix) when the file is listed but missing or
    different (edited or damaged), or present but not listed (added after conversion). `manifest`: the
    checkpoint's manifest when the caller has read it (`Pair.manifest`), else it is read and validated here.
    A version-1 checkpoint has no checksums: its file is returned unchecked (such checkpoints load only with
    `verify=False`)."""
    directory = os.fspath(directory)
    name = _side_file_name(name)
    if manifest is None:
        manifest = read_manifest(directory)
    files = (manifest.get("checksums") or {}).get("files")
    path = os.path.join(directory, name)
    if files is None:
        return path if os.path.lexists(path) else None
    entry = files.get(name)
    if entry is None:
        if os.path.lexists(path):
            raise _unlisted_side_file(directory, name)
        return None
    return _check_file(directory, name, entry, hashed=True)


def add_side_file(directory: str | os.PathLike, name: str) -> dict[str, Any]:
    """Records file `name`, put beside a finished checkpoint's weights by hand (a tokenizer, a chat template
    in `tokenizer_config.json`, or a new version of one), in the checkpoint's manifest: its size and sha256
    in `checksums.files` (a tokenizer or template file also in `tokenizer_files`), the manifest resealed and
    replaced atomically (`write_manifest`). From then on it is verified like the rest. Returns the new
    manifest."""
    directory = os.fspath(directory)
    name = _side_file_name(name)
    manifest = read_manifest(directory)
    if manifest.get("checksums") is None:
        raise CheckpointError(f"{os.path.join(directory, MANIFEST)} has no checksums (format version "
                              f"{manifest.get('format_version')}); {REDO} with the file in the --target directory")
    path = os.path.join(directory, name)
    if os.path.islink(path):
        raise CheckpointError(f"{path} is a symbolic link; a checkpoint holds regular files only: copy the file there")
    digest, size = file_sha256(path)
    manifest["checksums"]["files"][name] = {"bytes": size, CHECKSUM: digest}
    if name in TOKENIZER_FILES and name not in manifest.setdefault("tokenizer_files", []):
        manifest["tokenizer_files"].append(name)
    return write_manifest(directory, manifest)


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
