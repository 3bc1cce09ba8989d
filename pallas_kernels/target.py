"""The platform the kernels are traced for: the default backend, or the one a deviceless compile targets.

`ops.grouped_matmul(implementation="auto")` takes the Pallas kernel only where it runs compiled (the GPU), and
the kernel runs in interpret mode elsewhere; both ask `platform()`. A program traced here for another
platform (an ahead-of-time compile for an H200 on a CPU-only machine, `tests/gpu_compile`) is traced inside
`compiling_for("gpu")`, so it takes the kernel path the GPU would take. The override is a context variable:
it affects only code traced inside the `with` block, in this thread. Trace such programs with a fresh
`jax.jit` (a cached trace does not know which platform it was traced for).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax

_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("pallas_kernels_platform", default=None)


def platform() -> str:
    """"gpu", "cpu", "tpu", ...: the platform kernels are traced for."""
    return _PLATFORM.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(name: str) -> Iterator[None]:
    """Trace kernels for platform `name` ("gpu" for CUDA) inside the block, whatever the default backend."""
    token = _PLATFORM.set(name)
    try:
        yield
    finally:
        _PLATFORM.reset(token)
