"""A warm start loads its compiled programs ahead of need, on a second core.

A warm start of the serving engine reads every program it runs from the persistent compilation cache
(`compile_cache`). Reading one is mostly XLA loading the executable (linking its kernels' object code: about
25 ms a program on the shipped pair at 32 slots, 2 of a 5 s warm-up), and XLA does that without the GIL, while
the rest of a warm-up (tracing, lowering, first runs) holds the main thread.

`prefetching(label)` is a context in which the cache's reads are recorded in order. At its end, the keys it read
are written to a manifest in the cache directory, named after `label` and the first key read. In a later process,
the first read of the same context finds that manifest, and one worker thread loads the programs it names, in
order, while the main thread goes on. A program the main thread asks for is taken from the worker when it is
loaded (or waited for while it loads); one the worker has not reached yet is loaded by the main thread, as
without this module.

What the worker loads is what JAX itself would: the same checked entry (`compile_cache.GuardedCache`), for the
same device list and the same compile options. The manifest holds each program's serialized compile options
(XLA's protobuf: data), and a prefetched program is used only when they equal the asking call's, byte for byte;
anything else (no manifest, a damaged one, another device list, a key not cached) is read the usual way. A
manifest is a cache entry too: checked header, atomic write. DFLASH_PREFETCH_PROGRAMS=0 turns it off.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

from dflash_jax import compile_cache

ENV = "DFLASH_PREFETCH_PROGRAMS"
_FORMAT = 1
MANIFEST_PREFIX = "prefetch-manifest-"
_NEEDS = ("get_executable_and_time", "decompress_executable", "extract_executable_and_time")
_install_lock = threading.Lock()
_active: list = []  # the live Prefetch (at most one)
counts = {"prefetched": 0, "read": 0}  # this process's cache reads through a prefetching context, by how served


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _jax_cc():
    cc = compile_cache.jax_cache_module()
    if cc is None or not all(hasattr(cc, name) for name in _NEEDS):
        return None
    return cc


def _install() -> bool:
    """Routes JAX's cache reads through the live context's `Prefetch.read` (installed once per process)."""
    cc = _jax_cc()
    if cc is None:
        return False
    with _install_lock:
        if getattr(cc.get_executable_and_time, "_dflash_jax_prefetch", False):
            return True
        original = cc.get_executable_and_time

        def get_executable_and_time(cache_key, compile_options, backend, executable_devices):
            live = _active[0] if _active else None
            if live is None:
                return original(cache_key, compile_options, backend, executable_devices)
            return live.read(cache_key, compile_options, backend, executable_devices, original)

        get_executable_and_time._dflash_jax_prefetch = True
        cc.get_executable_and_time = get_executable_and_time
        return True


def manifest_key(label: str, first_key: str) -> str:
    return MANIFEST_PREFIX + hashlib.sha256(f"{label}\x00{first_key}".encode()).hexdigest()


def encode_manifest(programs: list) -> bytes:
    options: dict[bytes, int] = {}
    rows = [[key, options.setdefault(opts, len(options))] for key, opts in programs]
    table = [base64.b64encode(o).decode("ascii") for o in options]
    return json.dumps({"format": _FORMAT, "options": table, "programs": rows}).encode()


def decode_manifest(data: bytes) -> list | None:
    """[(key, options bytes)] of a manifest, or None when it is not one this module wrote."""
    try:
        doc = json.loads(data.decode())
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            return None
        table = [base64.b64decode(o.encode("ascii"), validate=True) for o in doc["options"]]
        return [(str(key), table[int(i)]) for key, i in doc["programs"]]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


class Prefetch:
    """One prefetching context's record and worker (see the module's doc)."""

    def __init__(self, label: str, directory: str):
        self.label = label
        self.directory = directory
        self.lock = threading.Lock()
        self.read_keys: list = []  # (key, options bytes), first read of each key, in order
        self._seen: set = set()
        self.first: str | None = None
        self.manifest: list | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.futures: dict = {}
        self.backend = self.devices = self.options_type = None
        self.prefetched = 0

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, compile_cache.entry_name(key))

    def _start(self, first_key: str, backend, devices, options_type) -> None:
        """Reads the manifest of (label, first key) and starts its worker."""
        key = manifest_key(self.label, first_key)
        data = compile_cache.read_entry(self._path(key), key)
        self.manifest = decode_manifest(data) if data is not None else None
        if not self.manifest:
            return
        self.backend, self.devices, self.options_type = backend, devices, options_type
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dflash-prefetch")
        for program, options in self.manifest:
            if program != first_key and program not in self.futures:
                self.futures[program] = self.pool.submit(self._load, program, options)

    def _load(self, key: str, options: bytes):
        store = compile_cache.jax_store()
        if not isinstance(store, compile_cache.GuardedCache) or store.directory != self.directory:
            return None
        data = store.get(key)
        if data is None:
            return None
        cc = _jax_cc()
        serialized, compile_time = cc.extract_executable_and_time(cc.decompress_executable(data))
        executable = self.backend.deserialize_executable(serialized, self.devices,
                                                         self.options_type.ParseFromString(options))
        return executable, compile_time, options

    def read(self, key, compile_options, backend, devices, original):
        options = compile_options.SerializeAsString()
        with self.lock:
            if key not in self._seen:
                self._seen.add(key)
                self.read_keys.append((key, options))
            if self.first is None:
                self.first = key
                self._start(key, backend, devices, type(compile_options))
            future = self.futures.pop(key, None)
        if future is not None and not future.cancel() and backend is self.backend and devices == self.devices:
            try:
                got = future.result()
            except Exception:  # read the usual way below, which reports what is wrong
                got = None
            if got is not None and got[2] == options:
                with self.lock:
                    self.prefetched += 1
                    counts["prefetched"] += 1
                return got[0], got[1]
        with self.lock:
            counts["read"] += 1
        return original(key, compile_options, backend, devices)

    def close(self) -> None:
        with self.lock:
            futures, self.futures = self.futures, {}
        for future in futures.values():
            future.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True)  # the one load under way (tens of ms); its result is dropped
        if self.first is None or self.manifest == self.read_keys:
            return
        key = manifest_key(self.label, self.first)
        compile_cache.write_entry(self._path(key), key, encode_manifest(self.read_keys))


@contextlib.contextmanager
def prefetching(label: str) -> Iterator[Prefetch | None]:
    """Records the compilation cache's reads in this context, and loads ahead those a past context of the same
    `label` (and the same first program) read (the module's doc). Yields the Prefetch, or None where it is off:
    DFLASH_PREFETCH_PROGRAMS=0, no cache directory of this library's, another JAX layout, or a prefetching
    context already live (the inner one does nothing)."""
    directory = compile_cache.program_directory()
    if not enabled() or directory is None or not _install():
        yield None
        return
    with _install_lock:
        live = None if _active else Prefetch(label, directory)
        if live is not None:
            _active.append(live)
    if live is None:
        yield None
        return
    try:
        yield live
    finally:
        _active.remove(live)
        live.close()
