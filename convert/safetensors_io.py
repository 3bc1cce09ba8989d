"""Reading HuggingFace safetensors checkpoints tensor by tensor, memory-mapped, into numpy.

The `safetensors` package's numpy backend cannot return bfloat16 (numpy has no such dtype), and its
flax backend puts every tensor on an accelerator. The file format is a little-endian u64 header length,
a JSON header `{name: {dtype, shape, data_offsets}}`, then the raw bytes; mapping it with numpy and
`ml_dtypes` gives zero-copy host arrays of every dtype, so a converter's peak memory is one tensor.

Nothing in a header is trusted: every entry's dtype, shape and offsets are checked before anything is
mapped (offsets inside the data section, sizes matching the shape, no two tensors sharing bytes), so a
damaged or hand-edited file is one error naming the file and the tensor, never weights read from the
header or from another tensor. Files are opened only if they are regular files inside the checkpoint
directory (symlinks are followed inside it, or into a HuggingFace cache's `blobs` folder).
"""

from __future__ import annotations

import json
import os
import struct as _struct
from typing import Iterator

import ml_dtypes
import numpy as np

from dflash_jax.errors import CheckpointError, open_regular, safe_relpath

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


_MAX_HEADER = 100 * 2**20
_REFETCH = "re-download it (an interrupted download or a damaged copy)"


def trusted_file(directory: str, name: str, *, listed_in: str | None = None) -> str:
    """The path of file `name` of checkpoint `directory`, if reading it stays inside the checkpoint: `name`
    is a plain relative path, and a symlink resolves inside the directory or into the `blobs` folder of a
    HuggingFace cache (`.../snapshots/REV/x -> ../../blobs/HASH`)."""
    where = f"{listed_in}: " if listed_in else ""
    if not safe_relpath(name):
        raise CheckpointError(f"{where}file name {name!r} points outside {directory}; a checkpoint reads only its "
                              "own files: fix or re-download the index")
    path = os.path.join(directory, *name.split("/"))
    if not os.path.lexists(path):
        raise CheckpointError(f"{where}{path} is missing; " + ("the index lists it: re-download the checkpoint"
                                                                 if listed_in else "re-download the checkpoint"))
    real = os.path.realpath(path)
    root = os.path.realpath(directory)
    roots = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    if not any(real == r or real.startswith(r + os.sep) for r in roots):
        raise CheckpointError(f"{path} is a symbolic link to {real}, outside {directory}; copy the file into the "
                              "checkpoint directory (links are followed only inside it or into a HuggingFace "
                              "cache's blobs folder)")
    return path


def _is_size(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class SafetensorsFile:
    """One `.safetensors` file: names, shapes and dtypes from the (validated) header; tensors as read-only
    memmaps."""

    def __init__(self, path: str):
        self.path = path
        with open_regular(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is not a readable safetensors file: it has {size} bytes, too few for "
                                      f"the header; {_REFETCH}")
            (header_len,) = _struct.unpack("<Q", head)
            if header_len > _MAX_HEADER or 8 + header_len > size:
                raise CheckpointError(f"{path} is not a readable safetensors file: its header length {header_len} "
                                      f"does not fit the file's {size} bytes (not safetensors, or truncated); "
                                      f"{_REFETCH}")
            raw = fh.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file (header: {e}); {_REFETCH}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: the safetensors header is a {type(header).__name__}, not an object; "
                                  f"{_REFETCH}")
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not isinstance(metadata, dict):
            raise CheckpointError(f"{path}: __metadata__ is a {type(metadata).__name__}, not an object; {_REFETCH}")
        self.metadata = metadata or {}
        self._data_start = 8 + header_len
        self._check_entries(header, size - self._data_start)
        self._entries = header

    def _check_entries(self, header: dict, data_size: int) -> None:
        spans = []
        for name, entry in header.items():
            bad = f"{self.path}: tensor {name!r}"
            if not isinstance(entry, dict):
                raise CheckpointError(f"{bad} has a {type(entry).__name__} entry, not an object; {_REFETCH}")
            dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
            if not isinstance(dtype, str):
                raise CheckpointError(f"{bad} has no dtype (got {dtype!r}); {_REFETCH}")
            if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
                raise CheckpointError(f"{bad} has shape {shape!r}, not a list of sizes; {_REFETCH}")
            if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_size(o) for o in offsets)
                    or offsets[0] > offsets[1]):
                raise CheckpointError(f"{bad} has data_offsets {offsets!r}, not [begin, end] byte offsets; {_REFETCH}")
            begin, end = offsets
            if end > data_size:
                raise CheckpointError(f"{bad} ends at byte {self._data_start + end} of a {self._data_start + data_size}"
                                      f"-byte file: the file is truncated; {_REFETCH}")
            if dtype in _DTYPES:
                count = 1
                for d in shape:
                    count *= d
                if end - begin != count * np.dtype(_DTYPES[dtype]).itemsize:
                    raise CheckpointError(f"{bad} has {end - begin} bytes for {dtype} shape {tuple(shape)}; "
                                          f"{_REFETCH}")
            if end > begin:
                spans.append((begin, end, name))
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise CheckpointError(f"{self.path}: tensors {n0!r} and {n1!r} share bytes {b1}..{min(e0, e1)}; "
                                      f"{_REFETCH}")

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> str:
        return self._entries[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        if entry["dtype"] not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']} (supported: "
                                  f"{', '.join(_DTYPES)})")
        dtype = np.dtype(_DTYPES[entry["dtype"]])
        begin, _ = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if 0 in shape:
            return np.zeros(shape, dtype)
        try:
            return np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + begin, shape=shape)
        except (OSError, ValueError) as e:  # the file changed since its header was read
            raise CheckpointError(f"{self.path}: tensor {name} cannot be mapped ({e}); {_REFETCH}") from None


class HFCheckpoint:
    """A HuggingFace checkpoint directory: `config.json` plus one or more safetensors shards.

    Sharded checkpoints are read through `model.safetensors.index.json`; otherwise every `*.safetensors`
    file in the directory is read. A tensor name present in two files is an error.
    """

    def __init__(self, directory: str | os.PathLike):
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise CheckpointError(f"checkpoint directory {directory} does not exist")
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.lexists(index):
            files = sorted(set(self._weight_map(index).values()))
            listed_in = index
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            listed_in = None
        if not files:
            raise CheckpointError(
                f"{directory} has no *.safetensors files; dflash_jax reads safetensors checkpoints only "
                "(convert .bin/.pt checkpoints with transformers' save_pretrained first)"
            )
        self._files: dict[str, SafetensorsFile] = {}
        self._owner: dict[str, SafetensorsFile] = {}
        for name in files:
            shard = SafetensorsFile(trusted_file(directory, name, listed_in=listed_in))
            self._files[name] = shard
            for key in shard.keys():
                if key in self._owner:
                    raise CheckpointError(
                        f"{directory}: tensor {key} appears in both {os.path.basename(self._owner[key].path)} "
                        f"and {name}; remove the stray shard"
                    )
                self._owner[key] = shard

    @staticmethod
    def _weight_map(index: str) -> dict[str, str]:
        path = trusted_file(os.path.dirname(index), os.path.basename(index))
        try:
            with open_regular(path) as fh:
                data = json.loads(fh.read().decode("utf-8"))
        except (ValueError, RecursionError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{index} is not valid JSON ({e}); re-download it") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names; re-download it")
        return weight_map

    @property
    def files(self) -> list[str]:
        """Paths of the shards read."""
        return [f.path for f in self._files.values()]

    def keys(self) -> list[str]:
        return list(self._owner)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._owner[name].shape(name)

    def dtype(self, name: str) -> str:
        """The safetensors dtype name (`BF16`, `F32`, `U8`, ...)."""
        return self._owner[name].dtype(name)

    def get(self, name: str) -> np.ndarray:
        return self._owner[name].get(name)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """Tensors one at a time, in file order (sequential reads)."""
        for shard in self._files.values():
            for key in shard.keys():
                yield key, shard.get(key)
