"""A persistent XLA compilation cache for the library and the CLIs, so a second process starts warm.

Where: `$DFLASH_JAX_CACHE_DIR` if set (`off` disables it), else `$XDG_CACHE_HOME/dflash_jax/jax`, else
`~/.cache/dflash_jax/jax`. Every program is cached, however small or quick to compile. The generation
entry points (`spec.generate`, `spec.begin`, `decode.greedy_generate`, `dflash-generate`) call
`ensure_enabled()`; a cache directory the user configured in JAX itself (`jax_compilation_cache_dir`,
`JAX_COMPILATION_CACHE_DIR`) is left as it is.

`compile_notice` prints one line while a compile that the cache could not serve runs (the CLI uses it).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable, Iterator

import jax

ENV = "DFLASH_JAX_CACHE_DIR"
_OFF = {"off", "0", "false", "no", "none", "disabled"}
_state = {"resolved": False, "dir": None}
_lock = threading.Lock()


def default_dir() -> str | None:
    """The directory the environment asks for, or None when it says `off`."""
    value = os.environ.get(ENV)
    if value is not None and value.strip():
        if value.strip().lower() in _OFF:
            return None
        return os.path.abspath(os.path.expanduser(value.strip()))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dflash_jax", "jax")


def enable(path: str | None = None) -> str | None:
    """Points JAX's persistent compilation cache at `path` (default: `default_dir()`), caching every
    program. Returns the directory in use, or None when disabled or when the directory cannot be created
    (then nothing changes). A JAX cache directory configured by the user wins."""
    with _lock:
        configured = jax.config.jax_compilation_cache_dir
        if path is None and configured and not _state["dir"]:
            _state.update(resolved=True, dir=configured)
            return configured
        target = default_dir() if path is None else path
        if target is None:
            _state.update(resolved=True, dir=None)
            return None
        try:
            os.makedirs(target, exist_ok=True)
        except OSError:
            _state.update(resolved=True, dir=None)
            return None
        if configured != target:
            if configured:  # moving an initialized cache: let JAX open the new one
                from jax.experimental.compilation_cache import compilation_cache as cc

                cc.reset_cache()
            jax.config.update("jax_compilation_cache_dir", target)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        _state.update(resolved=True, dir=target)
        return target


def disable() -> None:
    """No persistent cache from this library in this process (a JAX setting made elsewhere stays)."""
    with _lock:
        if _state["dir"] and jax.config.jax_compilation_cache_dir == _state["dir"]:
            jax.config.update("jax_compilation_cache_dir", None)
        _state.update(resolved=True, dir=None)


def ensure_enabled() -> str | None:
    """`enable()` once per process (later calls return the first answer)."""
    if _state["resolved"]:
        return _state["dir"]
    return enable()


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
    """The CLI's line: what is compiling and whether the next run will find it cached."""
    def say():
        where = ("cached for next time" if active_dir() else
                 f"compilation cache off: {ENV} to enable")
        print(f"{prog}: compiling the generation program for this shape (first run for it; {where}) ...",
              file=stream or sys.stderr, flush=True)

    return say
