"""Table-driven checkpoint conversion: regex -> (target array, region, transform), shape-checked per key.

Every target array of the weight pytree is declared up front with its shape (from the config) and a
*coverage grid*: the pieces it is assembled from (one piece for a plain tensor; `[E, 2]` for a stacked
gate/up expert table filled expert by expert, or all at once from a fused tensor). Each source tensor
matches exactly one rule, which names the target, the region of the target it fills and the piece(s) it
covers. Unknown names, pieces written twice, wrong shapes and pieces never written all raise
`CheckpointError`. Tensors are cast to the target dtype one at a time, so peak extra memory is one
source tensor.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from convert.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class Target:
    shape: tuple[int, ...]
    coverage: tuple[int, ...] = ()  # shape of the grid of pieces; () = one piece


@dataclasses.dataclass(frozen=True)
class Placement:
    key: str  # target name
    region: Any = Ellipsis  # index into the target array
    cover: Any = ()  # index into the target's coverage grid
    transpose: tuple[int, ...] | None = None  # axes permutation applied to the source tensor


Rule = tuple[re.Pattern, Callable[[re.Match], Placement]]


def rule(pattern: str, handler: Callable[[re.Match], Placement]) -> Rule:
    return re.compile(pattern), handler


def assemble(
    tensors: Iterable[tuple[str, np.ndarray]],
    targets: dict[str, Target],
    rules: list[Rule],
    *,
    dtype,
    ignore: Callable[[str], bool] = lambda name: False,
    source: str = "checkpoint",
    on_complete: Callable[[str, np.ndarray], Any] | None = None,
) -> dict[str, Any]:
    """Fills every target from `tensors`; returns {target name: array (or on_complete's result)}.

    `on_complete(name, array)` is called as soon as a target's last piece arrives (e.g. to move it to
    the device and drop the host copy); its result is what is returned for that name.
    """
    buffers: dict[str, np.ndarray] = {}
    coverage = {k: np.zeros(t.coverage, bool) for k, t in targets.items()}
    done: dict[str, Any] = {}
    for name, tensor in tensors:
        placement = None
        for pattern, handler in rules:
            m = pattern.fullmatch(name)
            if m:
                placement = handler(m)
                break
        if placement is None:
            if ignore(name):
                continue
            raise CheckpointError(
                f"{source}: tensor {name!r} is not part of the model the config describes "
                "(a checkpoint of another model, or a config that does not match its weights)"
            )
        key = placement.key
        if key not in targets:
            raise CheckpointError(
                f"{source}: tensor {name!r} maps to {key!r}, which the config does not have "
                "(layer index or layer kind does not match config.json)"
            )
        cov = coverage[key]
        if np.any(cov[placement.cover]) or key in done:
            raise CheckpointError(f"{source}: tensor {name!r} fills part of {key!r} that another tensor "
                                  "already filled (duplicate tensors)")
        piece = np.asarray(tensor)
        if placement.transpose is not None:
            piece = piece.transpose(placement.transpose)
        buf = buffers.get(key)
        if buf is None:
            buf = buffers[key] = np.empty(targets[key].shape, dtype)
        region_shape = buf[placement.region].shape
        if piece.shape != region_shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(np.shape(tensor))}, but the config implies "
                f"{_source_shape(region_shape, placement.transpose)}; the config does not match the weights"
            )
        buf[placement.region] = piece.astype(dtype)
        cov[placement.cover] = True
        if cov.all():
            arr = buffers.pop(key)
            done[key] = on_complete(key, arr) if on_complete else arr
    missing = [k for k in targets if k not in done]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"{source}: missing tensors for {shown} (incomplete or truncated checkpoint)")
    return done


def _source_shape(region_shape: tuple[int, ...], transpose: tuple[int, ...] | None) -> tuple[int, ...]:
    if transpose is None:
        return tuple(region_shape)
    inverse = np.argsort(transpose)
    return tuple(region_shape[i] for i in inverse)


def iter_with_progress(items: Iterator, total: int, desc: str, enabled: bool) -> Iterator:
    if not enabled:
        yield from items
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="tensor") as bar:
        for item in items:
            yield item
            bar.update(1)
