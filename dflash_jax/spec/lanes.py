"""Lanes: a batch's rows split into groups that run side by side, one host thread each, on a CPU's cores.

One XLA:CPU program keeps about 1.2 of a machine's cores busy at these model sizes: most of a decode step is
small ops that run one after the other on the calling thread. The rows of a batch are independent, so the
jitted drivers (`spec.loop.generate`, `decode.greedy_generate`) can split them into `lanes` groups of equal
batch bucket and run each group's program on its own thread: the CPU client runs the calls concurrently, and all
the groups share one compiled program (the same shapes). Each row keeps its own inputs: prompt, budget, sampling,
stop ids and random key (`split_prepared` keeps every row's key and fold), so a row's tokens are what the whole
batch gives it (the same sums; only the batch shape of the program changes).

`choose_lanes` decides: on a CPU backend, outside a mesh, one lane per usable core up to one per row; anywhere
else (a GPU runs one program at a time; a mesh lays the batch out itself) one lane. `DFLASH_LANES` overrides
"auto" where lanes apply (a positive integer; 1 turns lanes off). benchmarks/lanes.py measures the split.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading
from typing import Callable, Sequence

import jax
import numpy as np

LANES_ENV = "DFLASH_LANES"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _on_one_cpu_device(weights) -> bool:
    leaves = jax.tree_util.tree_leaves(weights)
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            continue
        devices = sharding.device_set
        return len(devices) == 1 and next(iter(devices)).platform == "cpu"
    return jax.default_backend() == "cpu"


def check_lanes(lanes) -> None:
    if lanes == "auto":
        return
    if isinstance(lanes, bool) or not isinstance(lanes, (int, np.integer)) or lanes < 1:
        raise ValueError(f"lanes must be 'auto' or a positive integer (1: the whole batch in one program), "
                         f"got {lanes!r}")


def choose_lanes(rows: int, lanes="auto", weights=None) -> int:
    """How many lanes a batch of `rows` real rows runs in. lanes: "auto" (one per usable core, at most one per row,
    on a CPU outside a mesh, where `DFLASH_LANES` overrides it) or a positive integer (at most one per row; on a GPU or a
    mesh, anything above 1 is refused: those run the batch in one program)."""
    check_lanes(lanes)
    meshed = not jax.sharding.get_abstract_mesh().empty
    cpu = _on_one_cpu_device(weights) and not meshed
    if lanes == "auto":  # the environment's choice applies where lanes do (a GPU or a mesh: one lane)
        env = os.environ.get(LANES_ENV, "").strip()
        if env and (not env.isdigit() or int(env) < 1):
            raise ValueError(f"{LANES_ENV}={env!r}: set a positive integer (1: no lanes) or unset it")
        if not cpu:
            return 1
        lanes = int(env) if env else usable_cores()
    lanes = int(lanes)
    if lanes > 1 and not cpu:
        raise ValueError(f"lanes={lanes}: lanes split a batch over a CPU's cores; on a GPU or a mesh the batch runs "
                         "in one program: use lanes=1 or 'auto'")
    return max(1, min(lanes, rows))


def lane_slices(rows: int, lanes: int) -> list[np.ndarray]:
    """`rows` real rows in `lanes` contiguous groups, balanced (sizes differ by at most one), in order."""
    bounds = np.linspace(0, rows, lanes + 1).round().astype(int)
    return [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def split_prepared(prep, lanes: int, buckets) -> list:
    """A `session.Prepared` batch as `lanes` batches of the same shapes (the batch bucket of the largest group):
    each group's real rows in order, every row's traced settings and random key as they were, and padding rows
    (one-token prompts with a budget of 1: done from the start) filling each group to its bucket."""
    n = prep.num_prompts
    groups = lane_slices(n, lanes)
    batch = buckets.batch_size(max(len(g) for g in groups))
    out = []
    for rows in groups:
        pad = batch - len(rows)
        index = np.concatenate([rows, np.full((pad,), rows[0])]).astype(np.int64)
        take = lambda x: np.asarray(x)[index]  # noqa: E731
        params = jax.tree_util.tree_map(take, prep.params)
        tokens, lengths = take(prep.tokens), take(prep.lengths)
        if pad:  # as `requests.pad_prompts` pads: the one-token prompt [0]
            tokens[len(rows):] = 0
            lengths[len(rows):] = 1
            params = dataclasses.replace(params, budget=np.concatenate([params.budget[:len(rows)],
                                                                        np.ones((pad,), params.budget.dtype)]))
        fields = dict(tokens=tokens, lengths=lengths, params=params, key_data=take(prep.key_data),
                      key_fold=take(prep.key_fold), num_prompts=len(rows))
        if prep.positions is not None:
            fields["positions"] = take(prep.positions)
        if prep.prompt_lengths is not None:
            fields["prompt_lengths"] = np.asarray(prep.prompt_lengths)[rows]
        out.append(dataclasses.replace(prep, **fields))
    return out


# JAX's configuration contexts are per thread: a lane's thread enters the caller's (precision, device, x64,
# promotion rules), so every lane traces and runs its program as the caller's thread would.
_CONTEXTS = (("jax_default_matmul_precision", "default_matmul_precision"), ("jax_default_device", "default_device"),
             ("jax_enable_x64", "enable_x64"), ("jax_numpy_rank_promotion", "numpy_rank_promotion"),
             ("jax_numpy_dtype_promotion", "numpy_dtype_promotion"))


def _caller_contexts() -> list[tuple[Callable, object]]:
    found = []
    for option, manager in _CONTEXTS:
        enter = getattr(jax, manager, None)
        if enter is not None and hasattr(jax.config, option):
            found.append((enter, getattr(jax.config, option)))
    return found


def _in_contexts(fn: Callable, contexts) -> Callable:
    def run(item):
        with contextlib.ExitStack() as stack:
            for enter, value in contexts:
                stack.enter_context(enter(value))
            return fn(item)
    return run


def lane_pool(lanes: int) -> concurrent.futures.ThreadPoolExecutor:
    """The worker threads of `lanes` lanes (the first runs on the caller's thread): for a caller that runs lanes
    often (the serving engine, every round), so no call starts and joins threads of its own."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=max(lanes - 1, 1), thread_name_prefix="dflash-lane")


def run_lanes(fn: Callable, items: Sequence, pool: concurrent.futures.ThreadPoolExecutor | None = None) -> list:
    """`fn(item)` for every item, each on its own thread (the first on the caller's, the others in the caller's JAX
    configuration contexts), results in order; once every lane has stopped, the first lane error is raised.
    `pool`: a `lane_pool` of at least `len(items)` lanes to run them on (None: threads of this call's own)."""
    if len(items) == 1:
        return [fn(items[0])]
    if pool is None:
        with lane_pool(len(items)) as own:
            return run_lanes(fn, items, own)
    worker = _in_contexts(fn, _caller_contexts())
    futures = [pool.submit(worker, item) for item in items[1:]]
    first, error = None, None
    try:
        first = fn(items[0])
    except BaseException as e:  # noqa: BLE001 - re-raised once the other lanes stop
        error = e
    results = []
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as e:  # noqa: BLE001
            if error is None or isinstance(error, threading.BrokenBarrierError):
                error = e  # a lane's own error, over another lane's broken wait for it
    if error is not None:
        raise error
    return [first] + results
