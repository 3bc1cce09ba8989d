"""The DFlash draft (z-lab `DFlashDraftModel`, `DFlash2DraftModel`): the config and its HF parser (found by
architecture: a draft's model_type names the target family it was built for)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

from dflash_jax.config import (  # noqa: F401  (the shared toolkit)
    FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, ConfigError, Fields, MoEConfig, RopeConfig, check_field,
    check_heads, default_per_layer, parse_rope, require_positive,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """A DFlash block-diffusion draft: a stack of Qwen3 decoder layers conditioned on target taps.

    The draft has no embedding and no lm_head of its own: blocks are embedded with the target's
    embedding (times `input_embedding_scale`) and read out with the target's head
    (`logits = head(h) * output_multiplier`, then `c * tanh(logits / c)` when `final_logit_softcapping = c`).
    `fc` maps `len(target_layer_ids) * target_hidden_size -> hidden_size`; the reference sizes it with the
    draft's own hidden size, so `target_hidden_size == hidden_size`.

    Per draft layer i: `layer_windows[i]` is the sliding window W (None = no window) and `layer_causal[i]`
    whether block queries are causal. A key at position k is visible from a query at position q iff
    (not causal or k <= q) and (no window or (q - k < W and (causal or k - q < W))); context keys are
    always at positions before the block, so only the window can hide them.
    """

    model_type: Literal["qwen3", "gpt_oss"]
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    num_target_layers: int | None = None
    vocab_size: int | None = None
    attention_bias: bool = False
    layer_windows: tuple[int | None, ...] = ()
    layer_causal: tuple[bool, ...] = ()
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 32768
    # DFlash 2 (z-lab `DFlash2DraftModel`, docs/dflash2.md): version 2 drafts carry a grouped dynamic causal
    # convolution around every attention and MLP sublayer (`conv_kernel_size` taps, one dynamic correction per
    # `conv_group_size` channels) and a candidate selector (top-`selector_top_k` candidates, rank-`selector_rank`
    # codebooks). Version 1 drafts leave the four fields None.
    version: Literal[1, 2] = 1
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None

    def __post_init__(self):
        require_positive(self, "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                          "intermediate_size", "rms_norm_eps")
        self._check_version()
        check_heads(self.num_heads, self.num_kv_heads)
        default_per_layer(self, "layer_windows", None)
        if not self.layer_causal:
            object.__setattr__(self, "layer_causal", (False,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers or len(self.layer_causal) != self.num_layers:
            raise ConfigError("layer_windows and layer_causal need one entry per draft layer")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ConfigError(f"sliding windows must be positive, got {self.layer_windows}")
        if not self.target_layer_ids:
            raise ConfigError("a DFlash draft needs at least one target layer id")
        if any(i < 0 for i in self.target_layer_ids):
            raise ConfigError(f"target_layer_ids must be non-negative, got {list(self.target_layer_ids)}")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ConfigError(
                f"target_layer_ids {list(self.target_layer_ids)} reach past the target's "
                f"{self.num_target_layers} layers"
            )
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.rope.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary_dim={self.rope.rotary_dim} exceeds head_dim={self.head_dim}")

    def _check_version(self) -> None:
        if self.version not in (1, 2):
            raise ConfigError(f"a DFlash draft's version is 1 (DFlashDraftModel) or 2 (DFlash2DraftModel), "
                              f"got {self.version!r}")
        if self.version == 1:
            for name in DFLASH2_FIELDS:
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name} is a DFlash 2 field, but this is a DFlash 1 draft (DFlashDraftModel): "
                                      "use version=2 (architectures [\"DFlash2DraftModel\"]) for a draft with "
                                      f"convolutions and a candidate selector, or drop {name}")
            return
        for name in DFLASH2_FIELDS:
            if getattr(self, name) is None:
                raise ConfigError(f"a DFlash 2 draft (DFlash2DraftModel) needs {name}: set it (dflash_config."
                                  f"{name}), or use a DFlash 1 draft (DFlashDraftModel) without convolutions and "
                                  "selector")
        require_positive(self, *DFLASH2_FIELDS)
        if self.hidden_size % self.conv_group_size:
            raise ConfigError(f"conv_group_size={self.conv_group_size} must divide hidden_size={self.hidden_size} "
                              "(each group of channels shares one dynamic kernel)")
        if self.vocab_size is None:
            raise ConfigError("a DFlash 2 draft needs vocab_size (its selector's codebooks have one row per token)")
        if self.selector_top_k > self.vocab_size:
            raise ConfigError(f"selector_top_k={self.selector_top_k} exceeds vocab_size={self.vocab_size}: the "
                              "selector keeps at most every token")

    @property
    def dflash2(self) -> bool:
        """Whether this is a DFlash 2 draft (convolutions and a candidate selector)."""
        return self.version == 2

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's taps when a config names none: one draft layer -> `(n // 2,)`; otherwise k ids evenly
    spaced from 1 to n - 3: `round(1 + i * (n - 4) / (k - 1))` (Python's round: half to even)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


DRAFT_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
#: The config fields only a DFlash 2 draft (`DFlash2DraftModel`) has.
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Keys the reference reads through `dflash_config` first and the top level second.
_DRAFT_VALUE_KEYS = (
    "mask_token_id", "target_layer_ids", "block_size", "input_embedding_scale", "output_multiplier",
    "final_logit_softcapping",
) + DFLASH2_FIELDS
# Fields a draft config may carry that the reference's Qwen3 draft layers never read: the draft has no
# embedding (tie_word_embeddings), `auto_map` points at remote code, and gpt-oss drafts copy the target's
# MoE knobs into their config.
_DRAFT_IGNORED = (
    "tie_word_embeddings", "eos_token_id", "auto_map", "initial_context_length", "num_local_experts",
    "num_experts_per_tok", "experts_per_token", "swiglu_limit",
)


def parse_hf_config(f: Fields) -> DraftConfig:
    """A DFlash draft config, read with the semantics of the transformers `Qwen3Config` the reference loads
    it into (whatever its model_type): `sliding_window` counts only with `use_sliding_window`, missing
    `layer_types` follow `max_window_layers`, and `is_causal` (when set) overrides every layer's causality.
    """
    architectures = [a for a in (f.raw.get("architectures") or ()) if a in DRAFT_ARCHITECTURES]
    if len(set(architectures)) > 1:
        raise ConfigError(f"{f.source}: architectures lists both DFlashDraftModel and DFlash2DraftModel; keep the "
                          "one the checkpoint is (DFlash2DraftModel when it has attention_conv / candidate_selector "
                          "tensors)")
    version = 2 if architectures[0] == "DFlash2DraftModel" else 1
    model_type = f.require("model_type")
    if model_type not in ("qwen3", "gpt_oss"):
        raise ConfigError(f"{f.source}: DFlash draft with model_type {model_type!r}; supported: qwen3, gpt_oss")
    if f.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{f.source}: hidden_act must be 'silu', got {f.raw['hidden_act']!r}")
    dflash = f.get("dflash_config") or {}
    if not isinstance(dflash, Mapping):
        raise ConfigError(f"{f.source}: dflash_config must be an object, got {type(dflash).__name__}")
    unknown = sorted(set(dflash) - set(_DRAFT_VALUE_KEYS))
    if unknown:
        raise ConfigError(f"{f.source}: dflash_config fields {unknown} are not understood by dflash_jax "
                          "(a newer draft variant?); running without them could compute a different draft")

    def value(name, default=None):
        f.used.add(name)
        if dflash.get(name) is not None:
            return dflash[name]
        check_field(f.source, name, f.raw.get(name))
        return f.raw[name] if f.raw.get(name) is not None else default

    dflash2 = {name: value(name) for name in DFLASH2_FIELDS}
    for name, v in dflash2.items():
        if version == 1 and v is not None:
            raise ConfigError(f"{f.source}: {name} is a DFlash 2 field, but architectures says DFlashDraftModel: "
                              "set architectures to [\"DFlash2DraftModel\"] if the checkpoint carries "
                              "attention_conv / mlp_conv / candidate_selector tensors, else remove the field")
        if version == 2 and v is None:
            raise ConfigError(f"{f.source}: a DFlash2DraftModel config needs dflash_config.{name} (the reference "
                              "cannot build its convolutions / selector without it); add it, or set architectures "
                              "to [\"DFlashDraftModel\"] for a DFlash 1 draft")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{f.source}: dflash_config.{name} must be a positive integer, got {v!r}; fix it")

    hidden = int(f.require("hidden_size"))
    num_layers = int(f.require("num_hidden_layers"))
    heads = int(f.require("num_attention_heads"))
    kv_heads = int(f.require("num_key_value_heads"))
    head_dim = int(f.require("head_dim"))

    window = f.get("sliding_window")
    window = window if f.get("use_sliding_window", False) else None
    layer_types = f.get("layer_types")
    max_window_layers = f.get("max_window_layers", 28)  # Qwen3Config's default
    if layer_types is None:
        start = int(max_window_layers or 0)
        layer_types = ["sliding_attention" if window is not None and i >= start else "full_attention"
                       for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ConfigError(f"{f.source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    is_causal = f.get("is_causal")
    windows: list[int | None] = []
    causal: list[bool] = []
    for i, kind in enumerate(layer_types):
        if kind == "sliding_attention":
            if window is None:
                raise ConfigError(
                    f"{f.source}: draft layer {i} is sliding_attention but there is no effective sliding_window "
                    "(the reference reads sliding_window only when use_sliding_window is true, and its "
                    "generation loop cannot build a cache for a window of None); set use_sliding_window"
                )
            windows.append(int(window))
            causal.append(True if is_causal is None else bool(is_causal))
        elif kind == "full_attention":
            windows.append(None)
            causal.append(False if is_causal is None else bool(is_causal))
        else:
            raise ConfigError(f"{f.source}: draft layer type {kind!r} is not supported")

    num_target_layers = f.get("num_target_layers")
    num_target_layers = None if num_target_layers is None else int(num_target_layers)
    ids = value("target_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise ConfigError(f"{f.source}: neither dflash_config.target_layer_ids nor num_target_layers is set; "
                              "the draft's taps are unknown")
        ids = default_target_layer_ids(num_target_layers, num_layers)
    mask_token_id = value("mask_token_id")
    if mask_token_id is None:
        raise ConfigError(f"{f.source}: dflash_config.mask_token_id is missing; the draft block cannot be built")
    softcap = value("final_logit_softcapping")
    softcap = float(softcap) if softcap is not None and float(softcap) > 0 else None
    vocab = f.get("vocab_size")
    f.ignore(*_DRAFT_IGNORED)
    cfg = DraftConfig(
        model_type=model_type,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(f.require("intermediate_size")),
        rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(f, head_dim),
        target_layer_ids=tuple(int(i) for i in ids),
        mask_token_id=int(mask_token_id),
        block_size=int(value("block_size", 16)),
        num_target_layers=num_target_layers,
        vocab_size=None if vocab is None else int(vocab),
        attention_bias=bool(f.get("attention_bias", False)),
        layer_windows=tuple(windows),
        layer_causal=tuple(causal),
        input_embedding_scale=float(value("input_embedding_scale", 1.0)),
        output_multiplier=float(value("output_multiplier", 1.0)),
        final_logit_softcapping=softcap,
        max_position_embeddings=int(f.get("max_position_embeddings", 32768)),
        version=version,
        **dflash2,
    )
    f.check_all_used()
    return cfg


def tiny_config(target, **overrides) -> DraftConfig:
    """A tiny draft for a tiny target config (`ModelFamily.tiny_config`): 2 layers tapping layers 0 and L - 2."""
    kw = dict(
        model_type="qwen3", hidden_size=target.hidden_size, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6, rotary_dim=16),
        target_layer_ids=(0, target.num_layers - 2), mask_token_id=target.vocab_size - 1, block_size=8,
        num_target_layers=target.num_layers, vocab_size=target.vocab_size,
    )
    kw.update(overrides)
    return DraftConfig(**kw)
