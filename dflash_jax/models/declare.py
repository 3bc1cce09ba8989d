"""Weight declarations: the stored name, shape and (optionally) dtype of every array of a family's weights.

Each family declares its weights once (`declare_weights(cfg)` in its model module, reached through the
registry) and builds its weight pytree from a flat `{name: array}` (`weights_from_flat`). The same
declarations check a converted checkpoint at load time (`dflash_jax.pair.load`) and drive the converter
(`convert`'s tables add only the HF name rules). Names are the pytree paths: `layers.{i}.attn.q`, ...
An FP4 tensor kept packed from its source is declared as two parts `NAME#blocks` / `NAME#scales`.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Target:
    """One declared array: `shape`; `coverage`, the grid of pieces a converter assembles it from (() = one
    piece; e.g. (E, 2) for a per-expert gate/up table); `dtype` (None: the checkpoint's chosen dtype)."""

    shape: tuple[int, ...]
    coverage: tuple[int, ...] = ()
    dtype: Any = None


def fp4_part(key: str, part: str) -> str:
    """The declared name of one part (`blocks` / `scales`) of an MXFP4 tensor kept packed from the source."""
    return f"{key}#{part}"


def attention_targets(prefix: str, *, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                      qk_norm: bool = True) -> dict[str, Target]:
    """Declarations of one GQA attention block stored `[in, out]`: q/k/v/o (+ biases, + per-head q/k norms)."""
    qd, kvd = num_heads * head_dim, num_kv_heads * head_dim
    out = {
        prefix + "attn.q": Target((hidden, qd)),
        prefix + "attn.k": Target((hidden, kvd)),
        prefix + "attn.v": Target((hidden, kvd)),
        prefix + "attn.o": Target((qd, hidden)),
    }
    if qk_norm:
        out[prefix + "attn.q_norm"] = Target((head_dim,))
        out[prefix + "attn.k_norm"] = Target((head_dim,))
    if bias:
        out.update({
            prefix + "attn.q_bias": Target((qd,)),
            prefix + "attn.k_bias": Target((kvd,)),
            prefix + "attn.v_bias": Target((kvd,)),
            prefix + "attn.o_bias": Target((hidden,)),
        })
    return out


def layer_getter(flat: dict[str, Any], i: int, *, required: bool = False):
    """`g(name)` -> `flat["layers.{i}.name"]` (None when absent, unless `required`)."""
    if required:
        return lambda k: flat[f"layers.{i}.{k}"]
    return lambda k: flat.get(f"layers.{i}.{k}")
