"""Weight declarations: the stored name, shape and (optionally) dtype of every array of a family's weights.

Each family declares its weights once: its weight dataclasses' fields carry their declarations (`param`,
`sub`, `layers`, below), and `declare_tree` / `build_tree` read the flat declarations and build the pytree
off the types (the family's `declare_weights(cfg)` / `weights_from_flat`, reached through the registry). The same
declarations check a converted checkpoint at load time (`dflash_jax.pair.load`) and drive the converter
(`convert`'s tables add only the HF name rules). Names are the pytree paths: `layers.{i}.attn.q`, ...
An FP4 tensor kept packed from its source is declared as two parts `NAME#blocks` / `NAME#scales`.

A family's HuggingFace layout is an `HFTable` over these names: regex rules from the HF tensor names onto
the declared names (`Placement`: which array, which region of it, which piece of its coverage grid, how the
source is transposed). `convert` runs the tables (`convert.table.assemble`); the tables live with their family.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable


# Logical sharding axes of a declared dimension (`Target.axes`); `dflash_jax.sharding` maps them to mesh axes.
HEADS, FFN, VOCAB, EXPERTS = "heads", "ffn", "vocab", "experts"


@dataclasses.dataclass(frozen=True)
class Target:
    """One declared array: `shape`; `coverage`, the grid of pieces a converter assembles it from (() = one
    piece; e.g. (E, 2) for a per-expert gate/up table); `dtype` (None: the checkpoint's chosen dtype);
    `axes`, the logical sharding axis of each dimension (None: replicated; None for the whole field: the
    name rules of `logical_axes`); `unit`, the granularity of a sharded dimension (attention projections
    shard along whole GQA groups: k / v by KV heads, q / o by the query heads of one KV head)."""

    shape: tuple[int, ...]
    coverage: tuple[int, ...] = ()
    dtype: Any = None
    axes: tuple[str | None, ...] | None = None
    unit: int = 1


# Name rules for declarations without explicit axes: (regex on the stored name, axes of its leading dims).
# Routed expert tables (and their FP4 parts, biases) shard along E; dense MLPs (the shared expert too) along
# their intermediate dimension; the vocabulary along V. Anything else (norms, routers, Qwen3.5's fused
# DeltaNet projections, whose columns interleave q/k/v head groups) is replicated. Attention projections shard
# along whole heads: `attention_targets` declares the head width, other declarations get it from the family.
_AXIS_RULES = (
    (r".*mlp\.(gate_up|down)(#blocks|#scales)?", (EXPERTS,)),
    (r".*mlp\.(gate_up_bias|down_bias)", (EXPERTS,)),
    (r"(.*\.)?mlp\.(shared\.)?(gate|up)", (None, FFN)),
    (r"(.*\.)?mlp\.(shared\.)?down", (FFN, None)),
    (r".*attn\.(q|k|v)", (None, HEADS)),  # the family supplies the head width (`ModelFamily.sharded_declarations`)
    (r".*attn\.o", (HEADS, None)),
    (r".*attn\.(q|k|v)_bias", (HEADS,)),
    (r".*attn\.sinks", (HEADS,)),
    (r"embed", (VOCAB, None)),
    (r"lm_head", (None, VOCAB)),
)


def logical_axes(name: str, target: Target) -> tuple[str | None, ...]:
    """The logical sharding axis of each dimension of a declared array: `target.axes` when declared, else
    the first name rule that matches (an expert table's rule applies when its leading dimension is E, i.e.
    rank >= 2), else replicated."""
    rank = len(target.shape)
    if target.axes is not None:
        return tuple(target.axes) + (None,) * (rank - len(target.axes))
    for pattern, lead in _AXIS_RULES:
        if re.fullmatch(pattern, name):
            if lead == (EXPERTS,) and rank < 2:
                break
            if lead != (EXPERTS,) and rank != len(lead):
                break
            return tuple(lead) + (None,) * (rank - len(lead))
    return (None,) * rank


def fp4_part(key: str, part: str) -> str:
    """The declared name of one part (`blocks` / `scales`) of an MXFP4 tensor kept packed from the source."""
    return f"{key}#{part}"


def attention_targets(prefix: str, *, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                      qk_norm: bool = True) -> dict[str, Target]:
    """Declarations of one GQA attention block stored `[in, out]`: q/k/v/o (+ biases, + per-head q/k norms)."""
    qd, kvd = num_heads * head_dim, num_kv_heads * head_dim
    # a split keeps whole GQA groups: the query heads of one KV head (q, o) and whole KV heads (k, v) shard together
    group = head_dim * max(1, num_heads // max(1, num_kv_heads))
    out = {
        prefix + "attn.q": Target((hidden, qd), axes=(None, HEADS), unit=group),
        prefix + "attn.k": Target((hidden, kvd), axes=(None, HEADS), unit=head_dim),
        prefix + "attn.v": Target((hidden, kvd), axes=(None, HEADS), unit=head_dim),
        prefix + "attn.o": Target((qd, hidden), axes=(HEADS, None), unit=group),
    }
    if qk_norm:
        out[prefix + "attn.q_norm"] = Target((head_dim,))
        out[prefix + "attn.k_norm"] = Target((head_dim,))
    if bias:
        out.update({
            prefix + "attn.q_bias": Target((qd,), axes=(HEADS,), unit=group),
            prefix + "attn.k_bias": Target((kvd,), axes=(HEADS,), unit=head_dim),
            prefix + "attn.v_bias": Target((kvd,), axes=(HEADS,), unit=head_dim),
            prefix + "attn.o_bias": Target((hidden,)),
        })
    return out


def layer_getter(flat: dict[str, Any], i: int, *, required: bool = False):
    """`g(name)` -> `flat["layers.{i}.name"]` (None when absent, unless `required`)."""
    if required:
        return lambda k: flat[f"layers.{i}.{k}"]
    return lambda k: flat.get(f"layers.{i}.{k}")


# ---- HuggingFace layouts: name rules onto the declarations ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one HF tensor goes: the declared array `key`, the `region` of it the tensor fills, the piece(s) of
    its coverage grid it covers (`cover`), and the axes permutation applied to the source first (`transpose`)."""

    key: str  # target name
    region: Any = Ellipsis  # index into the target array
    cover: Any = ()  # index into the target's coverage grid
    transpose: tuple[int, ...] | None = None  # axes permutation applied to the source tensor


Rule = tuple[re.Pattern, Callable[[re.Match], Placement]]


def rule(pattern: str, handler: Callable[[re.Match], Placement]) -> Rule:
    """A conversion rule: HF tensor names matching `pattern` (in full) go where `handler(match)` says."""
    return re.compile(pattern), handler


def ignore_nothing(cfg) -> Callable[[str], bool]:
    return lambda name: False


@dataclasses.dataclass(frozen=True)
class HFTable:
    """A family's HuggingFace checkpoint layout. `rules(cfg)`: the name rules; `ignore(cfg)(name)`: source
    tensors to skip (a tied checkpoint's lm_head, a vision tower); `targets_for_checkpoint(cfg, keys)`: the
    declarations when they depend on the checkpoint's tensor names (gpt-oss experts: packed MXFP4 or dense),
    None for the family's `declare_weights(cfg)`."""

    rules: Callable[[Any], list[Rule]]
    ignore: Callable[[Any], Callable[[str], bool]] = ignore_nothing
    targets_for_checkpoint: Callable[[Any, list[str]], dict[str, Target]] | None = None


# ---- weights declared once: the weight dataclasses' fields carry their declarations --------------------------
#
# A family's weight pytree type IS its declaration: each array field is `param(shape, ...)` (its shape and
# sharding as functions of the config), each nested weights field `sub(...)`, the per-layer tuple `layers(...)`
# (which weights type layer i has). `declare_tree(root, cfg)` walks the type into the flat declarations
# (`{stored name: Target}`, names = pytree paths) and `build_tree(root, flat, cfg)` builds the pytree from the
# flat arrays: one description, read both ways.

_DECLARE = "declare"


@dataclasses.dataclass(frozen=True)
class Param:
    """The declaration of one array field: `shape(cfg)`; `coverage` / `unit` (values or functions of cfg),
    `dtype`, `axes` as in `Target`; `when(cfg)`: the array exists only when true (an optional field, None
    otherwise)."""

    shape: Callable[[Any], tuple[int, ...]]
    coverage: Any = ()
    dtype: Any = None
    axes: tuple[str | None, ...] | None = None
    unit: Any = 1
    when: Callable[[Any], bool] | None = None
    held: Callable[[Any], tuple[int, ...]] | None = None  # the pytree's shape when it differs from the stored one
    # custom(cfg, layer, options) -> {name suffix: Target}: a field stored in a form chosen per checkpoint (an
    # MXFP4 table kept packed from its source: parts "#blocks" / "#scales"; or dense: suffix "")
    custom: Callable[[Any, int | None, dict], dict[str, Target]] | None = None


@dataclasses.dataclass(frozen=True)
class Sub:
    """A nested weights field: `choose(cfg, layer)` -> its weights type (layer: the index inside `layers`, or
    None); `when(cfg)` as in `Param`; `view(cfg)`: the config its fields' shapes read (e.g. a shared expert's
    width as `intermediate_size`), default the config itself."""

    choose: Callable[[Any, int | None], type]
    when: Callable[[Any], bool] | None = None
    view: Callable[[Any], Any] | None = None
    stored: str | None = None  # the stored name when it differs from the field's (a release's naming)


@dataclasses.dataclass(frozen=True)
class Layers:
    """The per-layer tuple: `cfg.num_layers` entries, entry i of type `choose(cfg, i)`, stored under
    `{stored}.{i}.` (default: the field's name); `when` and `view` as in `Sub`."""

    choose: Callable[[Any, int], type]
    when: Callable[[Any], bool] | None = None
    view: Callable[[Any], Any] | None = None
    stored: str | None = None


def _value(v, cfg):
    return v(cfg) if callable(v) else v


def param(shape: Callable[[Any], tuple[int, ...]], *, coverage: Any = (), dtype: Any = None,
          axes: tuple[str | None, ...] | None = None, unit: Any = 1, when: Callable[[Any], bool] | None = None,
          held: Callable[[Any], tuple[int, ...]] | None = None,
          custom: Callable[[Any, int | None, dict], dict[str, Target]] | None = None):
    """A weights-dataclass field declaring one array (see `Param`); optional (`when`) fields default to None.
    `held(cfg)`: the shape the pytree holds the stored array in (a reshape of the same elements), when they differ."""
    extra = {} if when is None else {"default": None}
    meta = Param(shape, coverage, dtype, axes, unit, when, held, custom)
    return dataclasses.field(metadata={"pytree_node": True, _DECLARE: meta}, **extra)


def sub(choose: type | Callable[[Any, int | None], type], *, when: Callable[[Any], bool] | None = None,
        view: Callable[[Any], Any] | None = None, stored: str | None = None):
    """A weights-dataclass field holding nested weights of type `choose` (or `choose(cfg, layer)`; see `Sub`)."""
    pick = choose if not isinstance(choose, type) else (lambda cfg, layer: choose)
    extra = {} if when is None else {"default": None}
    return dataclasses.field(metadata={"pytree_node": True, _DECLARE: Sub(pick, when, view, stored)}, **extra)


def layers(choose: type | Callable[[Any, int], type], *, when: Callable[[Any], bool] | None = None,
           view: Callable[[Any], Any] | None = None, stored: str | None = None):
    """The weights-dataclass field holding a per-layer weights tuple (layer i of type `choose(cfg, i)`; see
    `Layers`)."""
    pick = choose if not isinstance(choose, type) else (lambda cfg, i: choose)
    extra = {} if when is None else {"default": None}
    return dataclasses.field(metadata={"pytree_node": True, _DECLARE: Layers(pick, when, view, stored)}, **extra)


def _declared_fields(weights_type: type):
    for f in dataclasses.fields(weights_type):
        meta = f.metadata.get(_DECLARE)
        if meta is not None:
            yield f.name, meta


def declare_tree(root: type, cfg, prefix: str = "", layer: int | None = None, **options) -> dict[str, Target]:
    """The declarations (`{stored name: Target}`) of weights type `root` for `cfg`, read off its fields;
    `options` reach the fields' `custom` declarations (e.g. which expert tables a checkpoint keeps packed)."""
    out: dict[str, Target] = {}
    for name, meta in _declared_fields(root):
        if getattr(meta, "when", None) is not None and not meta.when(cfg):
            continue
        key = prefix + (getattr(meta, "stored", None) or name)
        if isinstance(meta, Param) and meta.custom is not None:
            out.update({key + suffix: t for suffix, t in meta.custom(cfg, layer, options).items()})
        elif isinstance(meta, Param):
            out[key] = Target(tuple(meta.shape(cfg)), coverage=tuple(_value(meta.coverage, cfg)), dtype=meta.dtype,
                              axes=meta.axes, unit=_value(meta.unit, cfg))
        elif isinstance(meta, Sub):
            inner = cfg if meta.view is None else meta.view(cfg)
            out.update(declare_tree(meta.choose(cfg, layer), inner, key + ".", layer, **options))
        else:
            inner = cfg if meta.view is None else meta.view(cfg)
            for i in range(cfg.num_layers):
                out.update(declare_tree(meta.choose(cfg, i), inner, f"{key}.{i}.", i, **options))
    return out


def build_tree(root: type, flat: dict[str, Any], cfg, prefix: str = "", layer: int | None = None):
    """The weights pytree of type `root` from `{stored name: array}` (the names `declare_tree` declares)."""
    kw = {}
    for name, meta in _declared_fields(root):
        if getattr(meta, "when", None) is not None and not meta.when(cfg):
            kw[name] = None
            continue
        key = prefix + (getattr(meta, "stored", None) or name)
        if isinstance(meta, Param):
            kw[name] = flat[key] if meta.held is None else flat[key].reshape(meta.held(cfg))
        elif isinstance(meta, Sub):
            inner = cfg if meta.view is None else meta.view(cfg)
            kw[name] = build_tree(meta.choose(cfg, layer), flat, inner, key + ".", layer)
        else:
            inner = cfg if meta.view is None else meta.view(cfg)
            kw[name] = tuple(build_tree(meta.choose(cfg, i), flat, inner, f"{key}.{i}.", i)
                             for i in range(cfg.num_layers))
    return root(**kw)
