"""Writing the dflash_jax checkpoint (the format and its reader: `dflash_jax.checkpoint`).

Chunks are written as soon as their last tensor arrives, so conversion holds about one layer in memory.
Each chunk write runs inside the run's signal guard (a Ctrl-C waits for the write to finish, so orbax's
threads never write into a directory being removed), with orbax's error logs kept off the terminal and
its failures turned into one clear error naming the chunk.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from typing import Any, Callable

import numpy as np

from convert.output import naming_os_errors
from dflash_jax.checkpoint import CHECKSUM, MANIFEST, chunk_of, describe, file_sha256, quiet_orbax, tensor_to_tree
from dflash_jax.errors import CheckpointError

_OS_ERROR = re.compile(r"os_error_code='?(\d+)")
_FAILED_PATHS = (re.compile(r'Failed writing: "([^"]+)"'), re.compile(r'local file "([^"]+)"'))


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def write_error(path: str, e: BaseException) -> Exception:
    """An orbax / tensorstore write failure as an OSError naming the file (disk full, read-only, too large)
    when the message carries an OS error code, else a CheckpointError naming the chunk."""
    text = " ".join(str(e).split())
    m = _OS_ERROR.search(text)
    if m:
        code = int(m[1])
        where = next((m[1] for m in (p.search(text) for p in _FAILED_PATHS) if m), path)
        return OSError(code, os.strerror(code), where)
    if isinstance(e, OSError):
        return e
    return CheckpointError(f"writing checkpoint chunk {path} failed ({type(e).__name__}: {text[:300]})")


def _silence_orphaned_callbacks() -> None:
    """After a failed write, tensorstore's still-pending callbacks try to reach orbax's closed event loop and
    Python reports each as an "unraisable" RuntimeError traceback, around the one-line error that already
    said what happened. Those (and only those) are dropped; the filter is installed before the first write
    and stays, as they can arrive until the process exits. Every other unraisable exception goes to the
    previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "dflash_jax_filter", False):
        return

    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
            return
        previous(unraisable)

    hook.dflash_jax_filter = True
    sys.unraisablehook = hook


class ChunkWriter:
    """Collects finished target arrays and saves each chunk (layer) with orbax once it is complete."""

    def __init__(self, root: str, keys: list[str], finalize: Callable[[str, np.ndarray], Any], *,
                 critical: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        import orbax.checkpoint as ocp

        self.root = os.path.abspath(root)
        self.finalize = finalize
        self.critical = critical
        self.pending: dict[str, set[str]] = {}
        for key in keys:
            self.pending.setdefault(chunk_of(key)[0], set()).add(key)
        self.buffers: dict[str, dict[str, Any]] = {}
        self.manifest: dict[str, Any] = {}
        self._checkpointer = ocp.StandardCheckpointer()
        _silence_orphaned_callbacks()

    def add(self, key: str, array: np.ndarray) -> None:
        chunk, inner = chunk_of(key)
        value = self.finalize(key, array)
        self.manifest[key] = describe(value)
        self.buffers.setdefault(chunk, {})[inner] = tensor_to_tree(value)
        self.pending[chunk].discard(key)
        if not self.pending[chunk]:
            self._save(os.path.join(self.root, chunk), _nest(self.buffers.pop(chunk)))

    def _save(self, path: str, tree: dict[str, Any]) -> None:
        with self.critical(), quiet_orbax():
            try:
                self._checkpointer.save(path, tree)
                self._checkpointer.wait_until_finished()
            except Exception as e:
                raise write_error(path, e) from None
            # orbax's commit marker records the absolute write path (the partial directory); only object
            # stores need it, and the checkpoint must not name the machine it was written on
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, "commit_success.txt"))

    def close(self) -> None:
        with self.critical(), quiet_orbax():
            with contextlib.suppress(Exception):
                self._checkpointer.wait_until_finished()
            self._checkpointer.close()


def checksum_files(directory: str, *, skip: tuple[str, ...] = (MANIFEST,)) -> dict[str, Any]:
    """The manifest's `checksums`: size and sha256 of every file under `directory` (paths with `/`)."""
    files = {}
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, directory).replace(os.sep, "/")
            if rel in skip:
                continue
            if os.path.islink(path):
                raise CheckpointError(f"{path} is a symbolic link; a checkpoint holds regular files only")
            digest, size = file_sha256(path)
            files[rel] = {"bytes": size, CHECKSUM: digest}
    return {"algorithm": CHECKSUM, "files": files}


def write_json(path: str, data: Any) -> None:
    """Writes JSON and fsyncs it (the manifest is the last file written before the rename). A failed write
    (a full disk) is an OSError naming the file."""
    with naming_os_errors(path), open(path, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        with contextlib.suppress(OSError):
            os.fsync(fh.fileno())

