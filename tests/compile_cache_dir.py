"""A compilation cache in a temp dir for one test (the session keeps it off, `tests/conftest.py`)."""

from __future__ import annotations

import contextlib

import jax

from dflash_jax import compile_cache, stored


@contextlib.contextmanager
def temp_compile_cache(directory):
    """The compilation cache, and so the stored programs and prefetch manifests, in `directory` (a path), off again
    after; nothing traced, lowered or memoized before it is reused inside (as in a new process)."""
    stored.forget()
    jax.clear_caches()
    where = compile_cache.enable(str(directory))
    assert where == str(directory)
    try:
        yield directory
    finally:
        compile_cache.disable()
        jax.clear_caches()
