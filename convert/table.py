"""Table-driven checkpoint conversion: regex -> (target array, region, transform), shape-checked per key.

Every target array of the weight pytree is declared up front with its shape (from the config) and a
*coverage grid*: the pieces it is assembled from (one piece for a plain tensor; `[E, 2]` for a stacked
gate/up expert table filled expert by expert, or all at once from a fused tensor). Each source tensor
matches exactly one rule, which names the target, the region of the target it fills and the piece(s) it
covers. Unknown names, pieces written twice, wrong shapes and pieces never written all raise
`CheckpointError`. Tensors are cast to the target dtype one at a time, so peak extra memory is one
source tensor.

A target may fix its own dtype (`Target.dtype`: fp32 norm weights, uint8 packed FP4 codes); integer
targets take their source bytes as they are and reject any other source dtype. An FP4 tensor kept packed
from the source (gpt-oss MXFP4 experts) is declared as two targets `NAME#blocks` and `NAME#scales`;
`FP4Joiner` hands the pair on as one `MXFP4Tensor` named NAME.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from convert.errors import CheckpointError
from dflash_jax.models.declare import (  # noqa: F401  (the tables' vocabulary, defined with the declarations)
    Placement, Rule, Target, attention_targets, fp4_part, rule,
)


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

    `dtype` is the dtype of targets that do not fix their own, or a function `(target name, source dtype)
    -> dtype` (e.g. to keep each tensor's source precision); a later piece of wider dtype widens its target.
    A float target takes only floating-point sources (a float tensor labelled as integers is refused).
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
        target = targets[key]
        region_shape = _region_shape(target.shape, placement.region)
        if piece.shape != region_shape:  # checked before the target is allocated
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(np.shape(tensor))}, but the config implies "
                f"{_source_shape(region_shape, placement.transpose)}; the config does not match the weights"
            )
        want = np.dtype(target.dtype if target.dtype is not None else
                        (dtype(key, piece.dtype) if callable(dtype) else dtype))
        where = getattr(tensor, "filename", None) or source  # a memory-mapped source names its file
        if np.issubdtype(want, np.integer):
            if piece.dtype != want:
                raise CheckpointError(f"{where}: tensor {name!r} has dtype {piece.dtype}, but {key!r} holds packed "
                                      f"{want} codes; the checkpoint is not in the layout its names say")
        elif not _is_float(piece.dtype):
            raise CheckpointError(f"{where}: tensor {name!r} is stored as {piece.dtype}, but {key!r} holds "
                                  "floating-point weights; the file's header has the wrong dtype (a damaged or "
                                  "hand-edited file): re-download it")
        buf = buffers.get(key)
        if buf is None:
            buf = buffers[key] = np.empty(target.shape, want)
        elif want.itemsize > buf.dtype.itemsize and target.dtype is None:  # a wider piece: keep its precision
            buf = buffers[key] = buf.astype(want)
        buf[placement.region] = piece.astype(buf.dtype)
        cov[placement.cover] = True
        if cov.all():
            arr = buffers.pop(key)
            done[key] = on_complete(key, arr) if on_complete else arr
    missing = [k for k in targets if k not in done]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"{source}: missing tensors for {shown} (incomplete or truncated checkpoint)")
    return done


def _is_float(dtype: np.dtype) -> bool:
    """numpy floats and the ml_dtypes ones (bfloat16, float8_*), which numpy reports as kind 'V'."""
    return dtype.kind == "f" or (dtype.kind == "V" and "float" in dtype.name)


def _region_shape(shape: tuple[int, ...], region: Any) -> tuple[int, ...]:
    """The shape of `target[region]`, computed on a zero-stride view (nothing the target's size is allocated)."""
    view = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape=shape, strides=(0,) * len(shape))
    return view[region].shape


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


FP4_PARTS = ("blocks", "scales")


def joined_keys(keys: Iterable[str]) -> list[str]:
    """Target names after `FP4Joiner`: the `#blocks` / `#scales` pairs become one name, order kept."""
    out: dict[str, None] = {}
    for key in keys:
        out[key.partition("#")[0]] = None
    return list(out)


class FP4Joiner:
    """An `on_complete` for `assemble` that joins `NAME#blocks` and `NAME#scales` into one `MXFP4Tensor`
    NAME before passing it to `on_complete(NAME, tensor)`; other targets pass straight through.

    `done` maps every (joined) name to what `on_complete` returned for it.
    """

    def __init__(self, on_complete: Callable[[str, Any], Any] | None = None):
        self.on_complete = on_complete or (lambda name, value: value)
        self.done: dict[str, Any] = {}
        self._parts: dict[str, dict[str, np.ndarray]] = {}

    def __call__(self, name: str, array: np.ndarray) -> Any:
        from dflash_jax.quant import MXFP4Tensor

        base, sep, part = name.partition("#")
        if not sep:
            self.done[name] = self.on_complete(name, array)
            return self.done[name]
        if part not in FP4_PARTS:
            raise ValueError(f"unknown FP4 part {part!r} in target {name!r}")
        parts = self._parts.setdefault(base, {})
        parts[part] = array
        if len(parts) < len(FP4_PARTS):
            return None
        del self._parts[base]
        self.done[base] = self.on_complete(base, MXFP4Tensor(blocks=parts["blocks"], scales=parts["scales"]))
        return self.done[base]


def table_targets(table: Any, cfg: Any, keys: Iterable[str]) -> dict[str, Target]:
    """A table's targets for a checkpoint with tensor names `keys`: tables whose layout depends on the
    checkpoint (gpt-oss experts: packed MXFP4 or dense) define `targets_for_checkpoint(cfg, keys)`."""
    for_checkpoint = getattr(table, "targets_for_checkpoint", None)
    return for_checkpoint(cfg, list(keys)) if for_checkpoint else table.targets(cfg)


@dataclasses.dataclass(frozen=True)
class FamilyTable:
    """The conversion table of a registered family (a target `ModelFamily` or the draft's): its HF layout
    (`models.declare.HFTable`) with the family's declarations and pytree builder, as the converter reads it."""

    family: Any

    def targets(self, cfg) -> dict[str, Target]:
        return self.family.declare_weights(cfg)

    @property
    def targets_for_checkpoint(self):
        return self.family.hf_table.targets_for_checkpoint

    def rules(self, cfg) -> list[Rule]:
        return self.family.hf_table.rules(cfg)

    def ignore(self, cfg):
        return self.family.hf_table.ignore(cfg)

    def build_weights(self, flat: dict, cfg):
        return self.family.weights_from_flat(flat, cfg)
