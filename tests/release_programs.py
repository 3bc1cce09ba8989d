"""Between test modules, a test process that holds many compiled programs lets them go.

XLA:CPU maps every compiled program's code and data into the process (about three memory maps per kernel). A
long-lived xdist worker runs hundreds of tests, each compiling its own shapes and configurations, and the jitted
functions the library keeps at module level hold their programs for the life of the process. A worker of the fast
set reached 55,000 maps two thirds of the way through, against Linux's default limit of 65,530
(`vm.max_map_count`); past it every mmap fails, and the next compile crashed the worker (a SIGSEGV inside
`backend_compile_and_load`) or, where a thread could not get its stack, could hang it.

So after the last test of a module (its module fixtures torn down), when the process holds more than half the
limit, jax's caches are cleared and the stored programs' memo forgotten (`stored.forget`): the next module compiles
what it needs again. Never inside a module: tests that prove a second run compiles nothing share one module's
programs. Loaded from conftest.py.
"""

from __future__ import annotations

import gc
import os

import pytest

FRACTION_ENV = "DFLASH_TEST_MAP_FRACTION"  # the fraction of the limit past which programs are let go (default 0.5)
_DEFAULT_LIMIT = 65530


def map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return _DEFAULT_LIMIT


def map_count() -> int | None:
    """This process's memory maps (None where /proc is absent)."""
    try:
        with open("/proc/self/maps", "rb") as fh:
            return sum(1 for _ in fh)
    except OSError:
        return None


def release() -> None:
    """Drops every compiled program nothing else holds: jax's caches, the stored programs' memo."""
    import jax

    from dflash_jax import stored

    stored.forget()
    jax.clear_caches()
    gc.collect()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield
    if nextitem is not None and nextitem.path != item.path:  # the module's own fixtures are gone by now
        count = map_count()
        if count is not None and count > float(os.environ.get(FRACTION_ENV, "0.5")) * map_limit():
            release()
    return result
