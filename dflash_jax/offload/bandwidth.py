"""The host->device link the offloaded verify copies experts over, measured (the runtime's one number from
the cost model; the model itself, with its tables of real models and machines, is `dflash_jax.study.cost_model`)."""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from dflash_jax.offload.store import memory_sharding


@functools.lru_cache(maxsize=None)
def probe_host_to_device_bandwidth(nbytes: int = 32 << 20, repeats: int = 3) -> float:
    """Measured host->device bytes/s: the best of `repeats` timed `device_put`s of an `nbytes` uint8 array
    from `pinned_host` to `device` memory (after one warm-up copy). On the CPU backend both memories are
    host RAM and this measures a memcpy. Cached per process."""
    src = jax.device_put(np.ones(nbytes, np.uint8), memory_sharding("pinned_host"))
    dev = memory_sharding("device")
    jax.block_until_ready(jax.device_put(src, dev))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(jax.device_put(src, dev))
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
