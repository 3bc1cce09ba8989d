"""A persistent XLA compilation cache for the library and the CLIs, so a second process starts warm.

Where: `$DFLASH_JAX_CACHE_DIR` if set (`off` disables it), else `$XDG_CACHE_HOME/dflash_jax/jax`, else
`~/.cache/dflash_jax/jax`. Every program is cached, however small or quick to compile. The generation
entry points (`spec.generate`, `spec.begin`, `decode.greedy_generate`, `dflash-generate`) call
`ensure_enabled()`; a cache directory the user configured in JAX itself (`jax_compilation_cache_dir`,
`JAX_COMPILATION_CACHE_DIR`) is left as it is.

In the directories this module picks, JAX's persistent cache stores its entries through `GuardedCache`:
each entry file carries a header with the cache key, the payload's length and its sha256, checked on every
read; a damaged entry, one holding another key's program (files moved or swapped), or anything that is not a
regular file (a FIFO is never opened) is a miss with a one-line note on stderr, and the recompiled program
replaces it. Entries are written to a temporary file in the same directory and renamed into place, so a run
killed mid-write leaves no half entry. A path that cannot hold the cache (a file in its place, no permission,
a read-only disk) turns the cache off with one note naming the path and the reason; `off_reason()` and the
CLI's compile notice say why the cache is off.

`compile_notice` prints one line while a compile that the cache could not serve runs (the CLI uses it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import stat
import struct
import sys
import tempfile
import threading
import time
from typing import Callable, Iterator

import jax

from dflash_jax.errors import file_kind

try:  # the interface JAX's persistent cache stores through (jax._src: checked by tests/test_compile_cache.py)
    from jax._src import compilation_cache as _jax_cc
    from jax._src.compilation_cache_interface import CacheInterface as _CacheInterface
except ImportError:  # pragma: no cover - another JAX layout: JAX's own file cache is used as it is
    _jax_cc, _CacheInterface = None, object

ENV = "DFLASH_JAX_CACHE_DIR"
_OFF = {"off", "0", "false", "no", "none", "disabled"}
_state: dict = {"resolved": False, "dir": None, "reason": None}
_lock = threading.Lock()
_FIX = f"point {ENV} at a writable directory, or set {ENV}=off"


def default_dir() -> str | None:
    """The directory the environment asks for, or None when it says `off`."""
    value = os.environ.get(ENV)
    if value is not None and value.strip():
        if value.strip().lower() in _OFF:
            return None
        return os.path.abspath(os.path.expanduser(value.strip()))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dflash_jax", "jax")


# ----------------------------------------------------------------------------------------------------------
# notes (one line each on stderr, each kind at most once per process)
# ----------------------------------------------------------------------------------------------------------

_noted: set[str] = set()
_note_lock = threading.Lock()


def _prog() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("dflash-") else "dflash_jax"


def _note(kind: str, message: str) -> None:
    with _note_lock:
        if kind in _noted:
            return
        _noted.add(kind)
    try:
        print(f"{_prog()}: note: {' '.join(message.split())}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed: the note is lost, the run goes on
        pass


# ----------------------------------------------------------------------------------------------------------
# the entries: header (key, length, sha256) + payload, read non-blocking, written atomically
# ----------------------------------------------------------------------------------------------------------

ENTRY_SUFFIX = "-dflash"  # entry files: KEY + ENTRY_SUFFIX (JAX's own cache names its files KEY-cache)
_MAGIC = b"dflash_jax compile cache entry/1\n"
_TMP_PREFIX = ".dflash-tmp-"
_STALE_TMP_S = 3600.0  # a temporary file this old belongs to a killed run (a write takes seconds at most)


def _entry_name(key: str) -> str:
    name = key + ENTRY_SUFFIX
    if "/" in key or "\\" in key or "\x00" in key or key.startswith(".") or len(name.encode()) > 240:
        name = "h-" + hashlib.sha256(key.encode()).hexdigest() + ENTRY_SUFFIX
    return name


def _header(key: str, value: bytes) -> bytes:
    k = key.encode()
    return _MAGIC + struct.pack("<I", len(k)) + k + struct.pack("<Q", len(value)) + hashlib.sha256(value).digest()


def _clear_hint(directory: str) -> str:
    return (f"the recompiled program replaces it; if this repeats, empty the cache directory {directory} "
            f"(every file in it is a cache entry; it refills itself)")


def _parse_entry(data: bytes, key: str) -> tuple[bytes | None, str]:
    """(payload, "") for a sound entry of `key`, else (None, what is wrong)."""
    if not data.startswith(_MAGIC):
        return None, "it has no dflash_jax entry header (damaged, or not written by dflash_jax)"
    at = len(_MAGIC)
    if len(data) < at + 4:
        return None, "it is truncated"
    (klen,) = struct.unpack_from("<I", data, at)
    at += 4
    if len(data) < at + klen + 8 + 32:
        return None, "it is truncated"
    stored_key = data[at:at + klen]
    at += klen
    (length,) = struct.unpack_from("<Q", data, at)
    at += 8
    digest = data[at:at + 32]
    at += 32
    if stored_key != key.encode():
        return None, "it holds another program's entry (the cache's files were moved, copied or swapped)"
    if len(data) - at != length:
        return None, f"it is {'truncated' if len(data) - at < length else 'longer than its header says'}"
    payload = data[at:]
    if hashlib.sha256(payload).digest() != digest:
        return None, "its contents fail their sha256 (damaged on disk)"
    return payload, ""


def read_entry(path: str, key: str) -> bytes | None:
    """The payload of the entry file `path` for `key`, or None (a miss): absent, not a regular file (never
    opened then), unreadable, or failing its header checks (each with a note on stderr)."""
    directory = os.path.dirname(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        _note("unreadable", f"compilation cache entry {path} cannot be read ({e.strerror}); compiling instead")
        return None
    if not stat.S_ISREG(st.st_mode):
        _note("not-a-file", f"compilation cache entry {path} is {file_kind(st.st_mode)}, not a file; skipped "
                            f"(compiling instead): remove it (rm {path})")
        return None
    try:  # non-blocking and checked again on the descriptor: nothing swapped in after the stat can block
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        _note("unreadable", f"compilation cache entry {path} cannot be read ({e.strerror}); compiling instead")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _note("not-a-file", f"compilation cache entry {path} is {file_kind(st.st_mode)}, not a file; "
                                f"skipped (compiling instead): remove it (rm {path})")
            return None
        chunks, size = [], st.st_size
        while True:
            chunk = os.read(fd, max(size, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
        data = b"".join(chunks)
    except OSError as e:
        _note("unreadable", f"compilation cache entry {path} cannot be read ({e.strerror}); compiling instead")
        return None
    finally:
        os.close(fd)
    payload, why = _parse_entry(data, key)
    if payload is None:
        _note("damaged", f"compilation cache entry {path} is skipped: {why}; {_clear_hint(directory)}")
    return payload


def _file_mode() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_entry(path: str, key: str, value: bytes, mode: int = 0o644) -> bool:
    """Writes the entry for `key` at `path` atomically (a temporary file in the same directory, renamed over
    the old entry). A non-regular file at `path` is left alone. False (with a note) when it cannot be written."""
    directory = os.path.dirname(path)
    try:
        st = os.lstat(path)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            return False  # noted when it was read
    except FileNotFoundError:
        pass
    except OSError:
        pass
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=_TMP_PREFIX)
        with os.fdopen(fd, "wb") as fh:
            fh.write(_header(key, value))
            fh.write(value)
            with contextlib.suppress(OSError):
                os.fchmod(fh.fileno(), mode)
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError as e:
        _note("write", f"cannot write to the compilation cache {directory} ({e.strerror}); this run's programs "
                       f"are not cached: {_FIX}")
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


class GuardedCache(_CacheInterface):
    """The store behind JAX's persistent compilation cache in the directories this module picks: one file per
    key (`ENTRY_SUFFIX`), each checked against its header on every read (`read_entry`), written atomically
    (`write_entry`)."""

    def __init__(self, path: str | os.PathLike):
        self.directory = os.path.abspath(os.fspath(path))
        self._path = pathlib.Path(self.directory)
        self._mode = _state.get("mode", 0o644)

    def get(self, key: str) -> bytes | None:
        if not key:
            raise ValueError("key cannot be empty")
        return read_entry(os.path.join(self.directory, _entry_name(key)), key)

    def put(self, key: str, value: bytes) -> None:
        if not key:
            raise ValueError("key cannot be empty")
        write_entry(os.path.join(self.directory, _entry_name(key)), key, bytes(value), self._mode)


_guarded_dirs: set[str] = set()


def _install_guard(directory: str) -> bool:
    """Makes JAX store its persistent cache for `directory` in a `GuardedCache` (wrapping JAX's
    `get_file_cache`, which builds the store when the first compile needs it)."""
    if _jax_cc is None or not hasattr(_jax_cc, "get_file_cache"):
        return False
    _guarded_dirs.add(directory)
    if getattr(_jax_cc.get_file_cache, "_dflash_jax_guard", False):
        return True
    original = _jax_cc.get_file_cache

    def get_file_cache(path):
        if isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)) in _guarded_dirs:
            cache = GuardedCache(path)
            verify = getattr(getattr(_jax_cc, "config", None), "compilation_cache_check_contents", None)
            if verify is not None and verify.value and hasattr(_jax_cc, "VerificationCache"):
                return _jax_cc.VerificationCache(cache), path
            return cache, path
        return original(path)

    get_file_cache._dflash_jax_guard = True
    _jax_cc.get_file_cache = get_file_cache
    return True


def jax_cache_module():
    """JAX's persistent-cache module (`jax._src.compilation_cache`), or None in a JAX layout without it."""
    return _jax_cc


def jax_store():
    """The store JAX's persistent cache uses now (None: not built yet)."""
    store = getattr(_jax_cc, "_cache", None) if _jax_cc is not None else None
    return getattr(store, "_base_cache", store)


def _reset_jax_cache() -> None:
    if _jax_cc is not None and hasattr(_jax_cc, "reset_cache"):
        _jax_cc.reset_cache()


def remove_stale_temporaries(directory: str) -> None:
    """Temporary files of runs killed mid-write (older than an hour; a live writer's are seconds old)."""
    now = time.time()
    with contextlib.suppress(OSError):
        with os.scandir(directory) as it:
            for e in it:
                if not e.name.startswith(_TMP_PREFIX):
                    continue
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and now - st.st_mtime > _STALE_TMP_S:
                        os.unlink(e.path)


def _unusable(target: str) -> str | None:
    """Why `target` cannot hold the cache (created when missing), or None when it can."""
    try:
        os.makedirs(target, exist_ok=True)
    except FileExistsError:
        try:
            kind = "a file" if stat.S_ISREG(os.stat(target).st_mode) else file_kind(os.stat(target).st_mode)
        except OSError:
            kind = "a broken symbolic link"
        return f"{target} is {kind}, not a directory"
    except NotADirectoryError:
        return f"{target} cannot be created: a part of its path is a file, not a directory"
    except OSError as e:
        return f"{target} cannot be created ({e.strerror})"
    if not os.path.isdir(target):
        return f"{target} is not a directory"
    if not os.access(target, os.R_OK | os.X_OK):
        return f"{target} is not readable (Permission denied)"
    try:  # a real write: catches read-only disks, full disks and permissions that access() misjudges
        fd, probe = tempfile.mkstemp(dir=target, prefix=_TMP_PREFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{target} is not writable ({e.strerror})"
    return None


def off_reason() -> str | None:
    """Why this library's cache is off in this process (None: on, or not resolved yet)."""
    return _state["reason"]


def enable(path: str | None = None) -> str | None:
    """Points JAX's persistent compilation cache at `path` (default: `default_dir()`), caching every
    program in a `GuardedCache`. Returns the directory in use, or None when disabled or when the directory
    cannot hold the cache (then a note on stderr names the path and the reason, `off_reason()` says it, and
    nothing else changes). A JAX cache directory configured by the user wins."""
    with _lock:
        configured = jax.config.jax_compilation_cache_dir
        if path is None and configured and not _state["dir"]:
            _state.update(resolved=True, dir=configured, reason=None)
            return configured
        target = default_dir() if path is None else os.path.abspath(os.path.expanduser(os.fspath(path)))
        if target is None:
            value = os.environ.get(ENV, "").strip()
            _state.update(resolved=True, dir=None, reason=f"compilation cache off: {ENV}={value}")
            return None
        why = _unusable(target)
        if why is not None:
            _state.update(resolved=True, dir=None, reason=f"compilation cache off: {why}")
            _note("unusable", f"compilation cache off: {why}; programs are compiled anew in every run: {_FIX}")
            return None
        guarded = _install_guard(target)
        store = jax_store()
        if store is not None and not (guarded and isinstance(store, GuardedCache) and store.directory == target):
            _reset_jax_cache()  # JAX built its store for another directory (or its own kind): build it anew
        elif configured and configured != target:
            _reset_jax_cache()
        if configured != target:
            jax.config.update("jax_compilation_cache_dir", target)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        remove_stale_temporaries(target)
        _state.update(resolved=True, dir=target, reason=None, mode=_file_mode())
        return target


def disable(reason: str = "turned off for this run") -> None:
    """No persistent cache from this library in this process (a JAX setting made elsewhere stays).
    `reason`: what the compile notice says about it."""
    with _lock:
        if _state["dir"] and jax.config.jax_compilation_cache_dir == _state["dir"]:
            jax.config.update("jax_compilation_cache_dir", None)
            if isinstance(jax_store(), GuardedCache):
                _reset_jax_cache()  # JAX keeps a built store whatever the setting says
        _state.update(resolved=True, dir=None, reason=f"compilation cache off: {reason}")


def ensure_enabled() -> str | None:
    """`enable()` once per process (later calls return the first answer)."""
    if _state["resolved"]:
        return _state["dir"]
    return enable()


def program_directory() -> str | None:
    """Where `stored` keeps programs: the directory this module put JAX's cache in, while JAX still uses it (None
    when the cache is off, not enabled yet, or a directory the user configured in JAX itself)."""
    directory = _state.get("dir")
    if not directory or directory not in _guarded_dirs or jax.config.jax_compilation_cache_dir != directory:
        return None
    return directory


def entry_name(key: str) -> str:
    """The file name of `key`'s entry in a cache directory."""
    return _entry_name(key)


def active_dir() -> str | None:
    """The cache directory JAX uses now (None: no persistent cache)."""
    return jax.config.jax_compilation_cache_dir or None


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@contextlib.contextmanager
def compile_notice(say: Callable[[], None], *, after_s: float = 1.0) -> Iterator[None]:
    """Calls `say()` once (from a timer thread) when an XLA compile inside this block runs longer than
    `after_s` without being served by the persistent cache: the user sees why the first run waits.
    `after_s <= 0`: at the start of the first compile (cache hits included)."""
    from jax import monitoring

    said = threading.Event()
    timer: list[threading.Timer] = []

    def cancel():
        while timer:
            timer.pop().cancel()

    def fire():
        if not said.is_set():
            said.set()
            say()

    def on_start(event, value, **kwargs):
        if event == _COMPILE_EVENT and not said.is_set():
            cancel()
            if after_s <= 0:
                fire()
                return
            t = threading.Timer(after_s, fire)
            t.daemon = True
            timer.append(t)
            t.start()

    def on_event(event, **kwargs):
        if event == _HIT_EVENT:
            cancel()

    def on_duration(event, duration, **kwargs):
        if event == _COMPILE_EVENT:
            cancel()

    monitoring.register_scalar_listener(on_start)
    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield
    finally:
        cancel()
        monitoring.unregister_scalar_listener(on_start)
        monitoring.unregister_event_listener(on_event)
        monitoring.unregister_event_duration_listener(on_duration)


class CompileCounter:
    """Counts XLA compiles (backend compiles, persistent-cache hits included) and their seconds, with the
    tracing and lowering seconds, while active: `with CompileCounter() as c: ...; c.compiles`."""

    _EVENTS = {
        "/jax/core/compile/jaxpr_trace_duration": "trace_s",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
        _COMPILE_EVENT: "backend_s",
    }

    def __init__(self):
        self.compiles = 0
        self.traces = 0
        self.cache_hits = 0
        self.trace_s = self.lower_s = self.backend_s = 0.0

    @property
    def seconds(self) -> float:
        """Tracing + lowering + XLA compile (or cache load) seconds."""
        return self.trace_s + self.lower_s + self.backend_s

    def _on_duration(self, event, duration, **kwargs):
        field = self._EVENTS.get(event)
        if field is None:
            return
        setattr(self, field, getattr(self, field) + duration)
        if field == "backend_s":
            self.compiles += 1
        elif field == "trace_s":
            self.traces += 1

    def _on_event(self, event, **kwargs):
        if event == _HIT_EVENT:
            self.cache_hits += 1

    def __enter__(self):
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc):
        from jax import monitoring

        monitoring.unregister_event_duration_listener(self._on_duration)
        monitoring.unregister_event_listener(self._on_event)
        return False


def print_notice(prog: str, stream=None) -> Callable[[], None]:
    """The CLI's line: what is compiling and whether the next run will find it cached (or why not)."""
    def say():
        where = "cached for next time" if active_dir() else (off_reason() or "compilation cache off")
        print(f"{prog}: compiling the generation program for this shape (first run for it; {where}) ...",
              file=stream or sys.stderr, flush=True)

    return say
