"""Reading HuggingFace safetensors checkpoints tensor by tensor, memory-mapped, into numpy.

The `safetensors` package's numpy backend cannot return bfloat16 (numpy has no such dtype), and its
flax backend puts every tensor on an accelerator. The file format is a little-endian u64 header length,
a JSON header `{name: {dtype, shape, data_offsets}}`, then the raw bytes; mapping it with numpy and
`ml_dtypes` gives zero-copy host arrays of every dtype, so a converter's peak memory is one tensor.
"""

from __future__ import annotations

import json
import os
import struct as _struct
from typing import Iterator

import ml_dtypes
import numpy as np

from convert.errors import CheckpointError

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


class SafetensorsFile:
    """One `.safetensors` file: names, shapes and dtypes from the header; tensors as read-only memmaps."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as fh:
                (header_len,) = _struct.unpack("<Q", fh.read(8))
                if header_len > 100 * 2**20:
                    raise ValueError("header too large")
                header = json.loads(fh.read(header_len))
        except (OSError, ValueError, _struct.error) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file ({e}); re-download it") from e
        self.metadata = header.pop("__metadata__", None) or {}
        self._entries = header
        self._data_start = 8 + header_len

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> str:
        return self._entries[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        if entry["dtype"] not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
        dtype = np.dtype(_DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize:
            raise CheckpointError(f"{self.path}: tensor {name} has {end - begin} bytes for shape {shape}")
        if count == 0:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + begin, shape=shape)


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
        if os.path.exists(index):
            with open(index) as fh:
                weight_map = json.load(fh).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(
                f"{directory} has no *.safetensors files; dflash_jax reads safetensors checkpoints only "
                "(convert .bin/.pt checkpoints with transformers' save_pretrained first)"
            )
        self._files: dict[str, SafetensorsFile] = {}
        self._owner: dict[str, SafetensorsFile] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise CheckpointError(f"{directory}: shard {name} listed in the index is missing")
            shard = SafetensorsFile(path)
            self._files[name] = shard
            for key in shard.keys():
                if key in self._owner:
                    raise CheckpointError(
                        f"{directory}: tensor {key} appears in both {os.path.basename(self._owner[key].path)} "
                        f"and {name}; remove the stray shard"
                    )
                self._owner[key] = shard

    def keys(self) -> list[str]:
        return list(self._owner)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._owner[name].shape(name)

    def get(self, name: str) -> np.ndarray:
        return self._owner[name].get(name)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """Tensors one at a time, in file order (sequential reads)."""
        for shard in self._files.values():
            for key in shard.keys():
                yield key, shard.get(key)
