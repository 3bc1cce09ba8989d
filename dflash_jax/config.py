"""Model configurations: frozen, keyword-only dataclasses.

HuggingFace field names appear only in the `from_hf_config` parsers below; the rest of the library speaks
in the dataclasses' own names. A config is hashable, so it can be a static argument of `jax.jit`.

`from_hf_config` is strict on purpose: a field it neither understands nor explicitly ignores raises
`ConfigError`, because a silently ignored field (a rope scaling, a shared expert, a sliding window) is a
model computed wrongly with no error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable, Literal, Mapping


from dflash_jax.errors import ConfigError  # noqa: E402  (defined with the other error classes; re-exported here)


def _check_heads(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")


def _require_positive(cfg, *names: str) -> None:
    """Sizes must be positive integers and eps-like floats positive and finite: a zero size or a negative
    eps is a model that computes NaNs or nothing, never a model."""
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, float) or name in _POSITIVE_FLOAT_ATTRS:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


_POSITIVE_FLOAT_ATTRS = frozenset({"rms_norm_eps", "theta", "factor"})


def _default_per_layer(cfg, field: str, value) -> None:
    """Fills an empty per-layer tuple field of a frozen config with `value` for every layer."""
    if not getattr(cfg, field):
        object.__setattr__(cfg, field, (value,) * cfg.num_layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary position embedding, rotate-half convention.

    `rotary_dim` is the number of leading head dims that rotate (partial rotary); the rest pass through.
    `kind="yarn"` uses the YaRN frequency blend and multiplies cos/sin by `attention_factor`.
    """

    theta: float
    rotary_dim: int
    kind: Literal["default", "yarn"] = "default"
    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int | None = None
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self):
        _require_positive(self, "theta", "factor")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim must be a positive even number, got {self.rotary_dim}")
        if self.kind == "yarn" and not self.original_max_position_embeddings:
            raise ConfigError("YaRN RoPE needs original_max_position_embeddings")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A top-k routed mixture of SwiGLU experts.

    `router="softmax_topk"`: softmax over all experts in fp32, top-k, optionally renormalized
    (`norm_topk_prob`); the Qwen families. `router="topk_softmax"`: top-k of the (biased) logits, softmax
    over those k (gpt-oss).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    router: Literal["softmax_topk", "topk_softmax"] = "softmax_topk"

    def __post_init__(self):
        _require_positive(self, "num_experts", "intermediate_size")
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ConfigError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3Config:
    """Dense Qwen3 (`model_type="qwen3"`) and Qwen3-MoE (`"qwen3_moe"`) decoders.

    `layer_windows[i]` is the sliding window of layer i (None = full causal attention); a key at position
    p is visible from a query at position q iff `0 <= q - p < window`, the query's own token included.
    `moe_layers[i]` says whether layer i's MLP is the routed MoE (`moe` then is set) or dense.
    """

    model_type: Literal["qwen3", "qwen3_moe"]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    layer_windows: tuple[int | None, ...] = ()
    moe: MoEConfig | None = None
    moe_layers: tuple[bool, ...] = ()
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        _require_positive(self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                          "intermediate_size", "rms_norm_eps")
        _check_heads(self.num_heads, self.num_kv_heads)
        _default_per_layer(self, "layer_windows", None)
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (self.moe is not None,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers or len(self.moe_layers) != self.num_layers:
            raise ConfigError("layer_windows and moe_layers need one entry per layer")
        if any(self.moe_layers) and self.moe is None:
            raise ConfigError("moe_layers marks MoE layers but no MoEConfig was given")
        if self.rope.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary_dim={self.rope.rotary_dim} exceeds head_dim={self.head_dim}")

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)


# --------------------------------------------------------------------------------------------------
# HuggingFace config.json parsing
# --------------------------------------------------------------------------------------------------

# Fields that carry no information for inference (training knobs, bookkeeping, generation defaults).
_IGNORED_EVERYWHERE = frozenset(
    {
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "initializer_range",
        "attention_dropout",
        "bos_token_id",
        "pad_token_id",
        "output_router_logits",
        "router_aux_loss_coef",
        "_name_or_path",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "tokenizer_class",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "quantization_config",  # checked by the loader, which knows the tensor formats
    }
)


# Integer fields a config may set: (smallest, largest). The upper bounds lie far above every released
# model; they exist so that a damaged config (`"num_hidden_layers": 1e9`, `"vocab_size": 1e15`) is refused
# before anything is allocated.
_LAYERS, _HEADS, _WIDTH, _POSITIONS, _VOCAB = 1024, 1024, 2**20, 2**26, 2**22
_INT_FIELDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, _VOCAB), "hidden_size": (1, 2**16), "num_hidden_layers": (1, _LAYERS),
    "num_attention_heads": (1, _HEADS), "num_key_value_heads": (1, _HEADS), "head_dim": (1, 4096),
    "intermediate_size": (1, _WIDTH), "moe_intermediate_size": (1, _WIDTH),
    "shared_expert_intermediate_size": (0, _WIDTH), "num_experts": (1, 2**14), "num_local_experts": (1, 2**14),
    "num_experts_per_tok": (1, 2**14), "experts_per_token": (1, 2**14),
    "max_position_embeddings": (1, _POSITIONS), "original_max_position_embeddings": (1, _POSITIONS),
    "sliding_window": (0, _POSITIONS), "max_window_layers": (0, _LAYERS), "decoder_sparse_step": (0, _LAYERS),
    "full_attention_interval": (1, _LAYERS), "num_target_layers": (1, _LAYERS), "mask_token_id": (0, _VOCAB),
    "block_size": (1, 1024), "linear_num_key_heads": (1, _HEADS), "linear_num_value_heads": (1, _HEADS),
    "linear_key_head_dim": (1, 4096), "linear_value_head_dim": (1, 4096), "linear_conv_kernel_dim": (1, 256),
    "conv_kernel_size": (1, 256), "conv_group_size": (1, 2**16), "selector_rank": (1, 2**16),
    "selector_top_k": (1, _VOCAB),
}
_BOOL_FIELDS = frozenset({"norm_topk_prob", "tie_word_embeddings", "attention_bias", "use_sliding_window",
                          "attn_output_gate", "is_causal", "truncate", "mrope_interleaved"})
# Float fields: (must be > 0, upper bound or None). Every float must be finite.
_FLOAT_FIELDS: dict[str, tuple[bool, float | None]] = {
    "rms_norm_eps": (True, 1.0), "rope_theta": (True, None), "factor": (True, None), "beta_fast": (True, None),
    "beta_slow": (True, None), "partial_rotary_factor": (True, 1.0), "swiglu_limit": (True, None),
    "swiglu_alpha": (False, None), "attention_factor": (True, None), "mscale": (False, None),
    "mscale_all_dim": (False, None), "input_embedding_scale": (False, None), "output_multiplier": (False, None),
    "final_logit_softcapping": (False, None),
}
_INT_LIST_FIELDS = {"mlp_only_layers": (0, _LAYERS), "target_layer_ids": (0, _LAYERS), "eos_token_id": (0, 2**31)}


def _type_name(value: Any) -> str:
    return {bool: "a boolean", str: "a string", list: "a list", dict: "an object", float: "a number",
            int: "an integer"}.get(type(value), type(value).__name__)


def _check_field(source: str, key: str, value: Any, name: str | None = None) -> None:
    """Type and range of one config value (`name` is how the message shows it, e.g. `rope_parameters.factor`).
    A string "false" where a boolean belongs, a size of 1e9 layers, a negative eps: one error naming the
    file, the field and the fix, before the value is used."""
    name = name or key
    fix = f"fix {name} in {source}"
    if value is None:
        return
    if key in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {name} must be true or false (a JSON boolean), got {value!r} "
                              f"({_type_name(value)}); {fix}")
    elif key in _INT_FIELDS:
        lo, hi = _INT_FIELDS[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
            raise ConfigError(f"{source}: {name} must be a whole number, got {value!r} ({_type_name(value)}); {fix}")
        if not lo <= value <= hi:
            raise ConfigError(f"{source}: {name} = {value!r} is outside [{lo}, {hi}], the range dflash_jax accepts "
                              f"(no released model comes close); the config is damaged: {fix}")
    elif key in _FLOAT_FIELDS:
        positive, hi = _FLOAT_FIELDS[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{source}: {name} must be a finite number, got {value!r} ({_type_name(value)}); {fix}")
        if positive and value <= 0:
            raise ConfigError(f"{source}: {name} must be > 0, got {value!r} (it would make the model compute NaNs "
                              f"or nonsense); {fix}")
        if hi is not None and value > hi:
            raise ConfigError(f"{source}: {name} = {value!r} is above {hi}; {fix}")
    elif key in _INT_LIST_FIELDS:
        lo, hi = _INT_LIST_FIELDS[key]
        items = value if isinstance(value, list) else [value] if key == "eos_token_id" else None
        if items is None or not all(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi for v in items):
            raise ConfigError(f"{source}: {name} must be a list of integers in [{lo}, {hi}], got {value!r}; {fix}")
    elif key == "layer_types":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{source}: layer_types must be a list of layer type names, got {value!r}; {fix}")
    elif key in ("rope_parameters", "rope_scaling", "dflash_config", "text_config", "quantization_config"):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source}: {name} must be an object, got {value!r} ({_type_name(value)}); {fix}")
        if key != "text_config" and key != "quantization_config":
            for k, v in value.items():
                _check_field(source, k, v, f"{name}.{k}")


class _Fields:
    """Reads fields of an HF config dict and remembers which were used, to reject the rest. Every value read
    is type- and range-checked (`_check_field`)."""

    def __init__(self, raw: Mapping[str, Any], source: str):
        self.raw = dict(raw)
        self.source = source
        self.used: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        if key in self.raw:
            _check_field(self.source, key, self.raw[key])
        return self.raw.get(key, default)

    def require(self, key: str) -> Any:
        self.used.add(key)
        if key not in self.raw or self.raw[key] is None:
            raise ConfigError(f"{self.source}: required field '{key}' is missing")
        _check_field(self.source, key, self.raw[key])
        return self.raw[key]

    def ignore(self, *keys: str) -> None:
        self.used.update(keys)

    def check_all_used(self) -> None:
        unknown = sorted(set(self.raw) - self.used - _IGNORED_EVERYWHERE)
        if unknown:
            raise ConfigError(
                f"{self.source}: fields {unknown} are not understood by dflash_jax; running without them "
                "could compute a different model. If they are harmless for inference, add them to the "
                "ignore list in dflash_jax/config.py; otherwise the model is not supported yet."
            )


def _parse_rope(f: _Fields, head_dim: int) -> RopeConfig:
    """Both schemas: `rope_parameters` (transformers >= 5) and `rope_theta` + `rope_scaling` (older)."""
    params = f.get("rope_parameters")
    theta = f.get("rope_theta")
    scaling = f.get("rope_scaling")
    partial = f.get("partial_rotary_factor")
    if params and scaling:
        raise ConfigError(f"{f.source}: both rope_parameters and rope_scaling are set; keep one")
    params = dict(params or scaling or {})
    if "layer_types" in params or any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{f.source}: per-layer-type rope_parameters are not supported")
    theta = params.pop("rope_theta", theta)
    if theta is None:
        raise ConfigError(f"{f.source}: no rope_theta (neither in rope_parameters nor top level)")
    partial = params.pop("partial_rotary_factor", partial) or 1.0
    kind = params.pop("rope_type", params.pop("type", "default"))
    rotary_dim = int(head_dim * partial)
    if kind == "default":
        if params:
            raise ConfigError(f"{f.source}: unexpected rope parameters {sorted(params)} for default RoPE")
        return RopeConfig(theta=float(theta), rotary_dim=rotary_dim)
    if kind == "yarn":
        original = params.pop("original_max_position_embeddings", None) or f.get("max_position_embeddings")
        factor = params.pop("factor", None)
        if factor is None:
            factor = f.get("max_position_embeddings") / original
        out = RopeConfig(
            theta=float(theta),
            rotary_dim=rotary_dim,
            kind="yarn",
            factor=float(factor),
            beta_fast=float(params.pop("beta_fast", None) or 32.0),
            beta_slow=float(params.pop("beta_slow", None) or 1.0),
            original_max_position_embeddings=int(original),
            truncate=bool(params.pop("truncate", True)),
            attention_factor=params.pop("attention_factor", None),
            mscale=params.pop("mscale", None),
            mscale_all_dim=params.pop("mscale_all_dim", None),
        )
        if params:
            raise ConfigError(f"{f.source}: unexpected YaRN parameters {sorted(params)}")
        return out
    raise ConfigError(
        f"{f.source}: rope_type '{kind}' is not supported (supported: default, yarn)"
    )


def _parse_qwen3(f: _Fields) -> Qwen3Config:
    model_type = f.require("model_type")
    if f.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{f.source}: hidden_act must be 'silu', got {f.raw['hidden_act']!r}")
    hidden = int(f.require("hidden_size"))
    heads = int(f.require("num_attention_heads"))
    head_dim = int(f.get("head_dim") or hidden // heads)
    num_layers = int(f.require("num_hidden_layers"))
    windows: list[int | None] = [None] * num_layers
    window = f.get("sliding_window")
    use_sliding = bool(f.get("use_sliding_window", False))
    layer_types = f.get("layer_types")
    max_window_layers = f.get("max_window_layers")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ConfigError(f"{f.source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
        for i, kind in enumerate(layer_types):
            if kind == "sliding_attention":
                if not window:
                    raise ConfigError(f"{f.source}: sliding_attention layer {i} without sliding_window")
                windows[i] = int(window)
            elif kind != "full_attention":
                raise ConfigError(f"{f.source}: layer type {kind!r} is not supported for {model_type}")
    elif use_sliding and window:
        if model_type == "qwen3_moe":
            windows = [int(window)] * num_layers
        else:
            start = int(max_window_layers or 0)
            windows = [int(window) if i >= start else None for i in range(num_layers)]
    moe = None
    moe_layers = (False,) * num_layers
    if model_type == "qwen3_moe":
        num_experts = f.get("num_experts") or f.get("num_local_experts")
        f.ignore("num_experts", "num_local_experts")
        if not num_experts:
            raise ConfigError(f"{f.source}: qwen3_moe config without num_experts")
        shared = f.get("shared_expert_intermediate_size", 0)
        if shared:
            raise ConfigError(f"{f.source}: a shared expert (shared_expert_intermediate_size={shared}) "
                              "is not part of qwen3_moe; is this a qwen2_moe checkpoint?")
        moe = MoEConfig(
            num_experts=int(num_experts),
            top_k=int(f.require("num_experts_per_tok")),
            intermediate_size=int(f.require("moe_intermediate_size")),
            norm_topk_prob=bool(f.get("norm_topk_prob", False)),
        )
        sparse_step = int(f.get("decoder_sparse_step", 1) or 1)
        mlp_only = set(f.get("mlp_only_layers") or [])
        moe_layers = tuple(i not in mlp_only and (i + 1) % sparse_step == 0 for i in range(num_layers))
    eos = f.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    cfg = Qwen3Config(
        model_type=model_type,
        vocab_size=int(f.require("vocab_size")),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(f.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=int(f.require("intermediate_size")),
        rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(f, head_dim),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        attention_bias=bool(f.get("attention_bias", False)),
        max_position_embeddings=int(f.get("max_position_embeddings", 32768)),
        layer_windows=tuple(windows),
        moe=moe,
        moe_layers=moe_layers,
        eos_token_ids=eos_ids,
    )
    f.check_all_used()
    return cfg


# --------------------------------------------------------------------------------------------------
# Qwen3.5-MoE (hybrid Gated DeltaNet / gated attention): config and HF parser.
# --------------------------------------------------------------------------------------------------

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3_5Config:
    """Qwen3.5-MoE text decoder (`qwen3_5_moe`, text tower `qwen3_5_moe_text`).

    `layer_types[i]` is "linear_attention" (a Gated DeltaNet layer) or "full_attention" (gated softmax
    attention). Every layer's MLP is the routed `moe` (top-k always renormalized) plus a shared SwiGLU
    expert of width `shared_expert_intermediate_size` scaled by `sigmoid(x @ w_shared_gate)`.

    Gated DeltaNet: `linear_num_key_heads` (Hk) q/k heads of dim `linear_key_head_dim` (dk),
    `linear_num_value_heads` (Hv) value heads of dim `linear_value_head_dim` (dv); value head j reads key
    head `j // (Hv / Hk)`; the q/k/v projection passes through a causal depthwise conv of
    `linear_conv_kernel` taps. Full attention: `num_heads` query heads, each with its own output gate,
    `num_kv_heads` key/value heads of `head_dim`, RoPE on the first `rope.rotary_dim` dims.
    """

    model_type: Literal["qwen3_5_moe"] = "qwen3_5_moe"
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel: int = 4
    moe: MoEConfig
    shared_expert_intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        _require_positive(self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                          "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                          "linear_value_head_dim", "rms_norm_eps")
        _check_heads(self.num_heads, self.num_kv_heads)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in (LINEAR_ATTENTION, FULL_ATTENTION)})
        if bad:
            raise ConfigError(f"layer types {bad} are not supported (supported: {LINEAR_ATTENTION}, {FULL_ATTENTION})")
        if self.rope.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary_dim={self.rope.rotary_dim} exceeds head_dim={self.head_dim}")
        if not self.moe.norm_topk_prob:
            raise ConfigError("Qwen3.5-MoE always renormalizes its top-k routing weights (norm_topk_prob=True)")
        if self.linear_conv_kernel < 1:
            raise ConfigError(f"linear_conv_kernel must be >= 1, got {self.linear_conv_kernel}")
        if self.shared_expert_intermediate_size < 1:
            raise ConfigError("Qwen3.5-MoE needs a shared expert (shared_expert_intermediate_size >= 1)")

    @property
    def is_moe(self) -> bool:
        return True

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        return (True,) * self.num_layers

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the conv: q and k (Hk * dk each) then v (Hv * dv)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )


# Fields of the multimodal wrapper that say nothing about the text decoder.
_QWEN3_5_VISION_FIELDS = (
    "vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
)
# Text-config fields the decoder never reads: the multi-token-prediction head (`mtp.*` tensors) is not
# used for verification.
_QWEN3_5_TEXT_IGNORED = ("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")
# M-RoPE knobs: text-only positions are equal on the t/h/w axes, so M-RoPE reduces to 1-D RoPE.
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def _parse_qwen3_5(f: _Fields) -> Qwen3_5Config:
    """`qwen3_5_moe` (the release: multimodal wrapper with a `text_config`) or `qwen3_5_moe_text`.

    Read with the semantics of transformers' `Qwen3_5MoeTextConfig`: its class defaults fill absent fields
    (notably `partial_rotary_factor` 0.25 and `layer_types` from `full_attention_interval`).
    """
    model_type = f.require("model_type")
    if model_type == "qwen3_5_moe_text":
        return _parse_qwen3_5_text(f, wrapper_tie=None)
    text = f.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(f"{f.source}: a qwen3_5_moe config needs a text_config object")
    f.ignore(*_QWEN3_5_VISION_FIELDS)
    wrapper_tie = f.get("tie_word_embeddings")
    f.check_all_used()
    t = _Fields(text, f"{f.source} (text_config)")
    if t.get("model_type", "qwen3_5_moe_text") != "qwen3_5_moe_text":
        raise ConfigError(f"{t.source}: model_type {text['model_type']!r}, expected 'qwen3_5_moe_text'")
    return _parse_qwen3_5_text(t, wrapper_tie=wrapper_tie)


def _parse_qwen3_5_text(f: _Fields, *, wrapper_tie: bool | None) -> Qwen3_5Config:
    f.get("model_type")
    if f.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{f.source}: hidden_act must be 'silu', got {f.raw['hidden_act']!r}")
    if f.get("attention_bias", False):
        raise ConfigError(f"{f.source}: attention_bias=true is not supported for qwen3_5_moe")
    if f.get("attn_output_gate", True) is not True:
        raise ConfigError(f"{f.source}: attn_output_gate=false (attention without its output gate) is not "
                          "supported for qwen3_5_moe")
    if f.get("mamba_ssm_dtype", "float32") not in ("float32", None):
        raise ConfigError(f"{f.source}: mamba_ssm_dtype={f.raw['mamba_ssm_dtype']!r}; dflash_jax keeps the "
                          "linear-attention state in float32 only")
    if f.get("mlp_only_layers"):
        raise ConfigError(f"{f.source}: mlp_only_layers={f.raw['mlp_only_layers']}: dense MLP layers are not "
                          "part of qwen3_5_moe (every layer is MoE)")
    if int(f.get("decoder_sparse_step", 1) or 1) != 1:
        raise ConfigError(f"{f.source}: decoder_sparse_step={f.raw['decoder_sparse_step']}: qwen3_5_moe has "
                          "an MoE in every layer")
    # The reference renormalizes the top-k weights whatever this field says.
    f.ignore("norm_topk_prob")
    num_layers = int(f.require("num_hidden_layers"))
    layer_types = f.get("layer_types")
    interval = f.get("full_attention_interval")
    if layer_types is None:
        interval = int(interval or 4)
        if interval < 1:
            raise ConfigError(f"{f.source}: full_attention_interval must be >= 1, got {interval}")
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
        raise ConfigError(f"{f.source}: layer_types must list one type per layer ({num_layers} layers)")
    for i, kind in enumerate(layer_types):
        if kind not in (LINEAR_ATTENTION, FULL_ATTENTION):
            raise ConfigError(f"{f.source}: layer {i} has type {kind!r}; qwen3_5_moe layers are "
                              f"{LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}")
    hidden = int(f.require("hidden_size"))
    heads = int(f.require("num_attention_heads"))
    head_dim = int(f.get("head_dim") or 256)

    # RoPE: drop the M-RoPE knobs (1-D for text) and apply the class default partial_rotary_factor 0.25.
    rope_raw = dict(f.raw)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(rope_raw.get(key), Mapping):
            rope_raw[key] = {k: v for k, v in rope_raw[key].items() if k not in _MROPE_KEYS}
    params = rope_raw.get("rope_parameters") or rope_raw.get("rope_scaling") or {}
    if "partial_rotary_factor" not in params and rope_raw.get("partial_rotary_factor") is None:
        rope_raw["partial_rotary_factor"] = 0.25
    rope_fields = _Fields(rope_raw, f.source)
    rope = _parse_rope(rope_fields, head_dim)
    f.used |= rope_fields.used

    num_experts = f.get("num_experts", 256)
    moe = MoEConfig(
        num_experts=int(num_experts),
        top_k=int(f.get("num_experts_per_tok", 8)),
        intermediate_size=int(f.get("moe_intermediate_size", 512)),
        norm_topk_prob=True,
    )
    eos = f.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    tie = f.get("tie_word_embeddings")
    if tie is not None and wrapper_tie is not None and bool(tie) != bool(wrapper_tie):
        raise ConfigError(f"{f.source}: tie_word_embeddings is {tie} in text_config but {wrapper_tie} at the top "
                          "level; make them agree")
    tie = bool(tie if tie is not None else (wrapper_tie or False))
    f.ignore(*_QWEN3_5_TEXT_IGNORED)
    cfg = Qwen3_5Config(
        vocab_size=int(f.require("vocab_size")),
        hidden_size=hidden,
        num_layers=num_layers,
        layer_types=tuple(layer_types),
        num_heads=heads,
        num_kv_heads=int(f.get("num_key_value_heads") or 2),
        head_dim=head_dim,
        linear_num_key_heads=int(f.get("linear_num_key_heads") or 16),
        linear_num_value_heads=int(f.get("linear_num_value_heads") or 32),
        linear_key_head_dim=int(f.get("linear_key_head_dim") or 128),
        linear_value_head_dim=int(f.get("linear_value_head_dim") or 128),
        linear_conv_kernel=int(f.get("linear_conv_kernel_dim") or 4),
        moe=moe,
        shared_expert_intermediate_size=int(f.get("shared_expert_intermediate_size", 512)),
        rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)),
        rope=rope,
        tie_word_embeddings=tie,
        max_position_embeddings=int(f.get("max_position_embeddings", 32768)),
        eos_token_ids=eos_ids,
    )
    f.check_all_used()
    return cfg


# --------------------------------------------------------------------------------------------------
# gpt-oss (gpt-oss-20b / gpt-oss-120b): config and HF parser.
# --------------------------------------------------------------------------------------------------

SLIDING_ATTENTION = "sliding_attention"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptOssConfig:
    """gpt-oss decoders (`model_type="gpt_oss"`).

    Attention: q/k/v/o projections with biases (`attention_bias`), YaRN RoPE on q and k (no q/k norm), one
    learned sink logit per query head (an extra softmax column whose probability is dropped).
    `layer_windows[i]` is layer i's sliding window (None = full causal attention), with Qwen3Config's
    convention: a key at position p is visible from a query at q iff `0 <= q - p < window`.
    MLP: every layer is a routed MoE with `moe.router == "topk_softmax"` (top-k of `x W_r + b_r`, softmax
    over those k); expert e computes `gu = x W1_e + b1_e`, `gate, up = gu[:I], gu[I:]`,
    `act = (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`, and
    `act W2_e + b2_e`. RMSNorm weights are fp32 and scale the fp32 normalized value.
    """

    model_type: Literal["gpt_oss"] = "gpt_oss"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    moe: MoEConfig
    layer_windows: tuple[int | None, ...] = ()
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        _require_positive(self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                          "rms_norm_eps")
        _check_heads(self.num_heads, self.num_kv_heads)
        _default_per_layer(self, "layer_windows", None)
        if len(self.layer_windows) != self.num_layers:
            raise ConfigError("layer_windows needs one entry per layer")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ConfigError(f"sliding windows must be positive, got {self.layer_windows}")
        if self.moe.router != "topk_softmax":
            raise ConfigError(
                f"gpt-oss routes with top-k then softmax (router='topk_softmax'), got {self.moe.router!r}"
            )
        if self.rope.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary_dim={self.rope.rotary_dim} exceeds head_dim={self.head_dim}")
        if not self.swiglu_limit > 0:
            raise ConfigError(f"swiglu_limit must be positive, got {self.swiglu_limit}")

    @property
    def is_moe(self) -> bool:
        return True

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        return (True,) * self.num_layers


# transformers' GptOssConfig defaults, used when a config.json leaves the field out.
_GPT_OSS_DEFAULT_THETA = 150000.0
_GPT_OSS_DEFAULT_ROPE = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}
# Release fields the reference model never reads: `hidden_act` (the experts always apply the clamped
# SwiGLU, whatever it says) and `initial_context_length` (the pre-YaRN context, which the release repeats
# as rope_scaling.original_max_position_embeddings).
_GPT_OSS_IGNORED = ("hidden_act", "initial_context_length")


def _alias(f: _Fields, names: tuple[str, ...], default: Any = None) -> Any:
    """One value under several names (a current one and legacy ones); they must agree when repeated."""
    values = {name: f.get(name) for name in names}
    given = {name: v for name, v in values.items() if v is not None}
    if len(set(given.values())) > 1:
        raise ConfigError(f"{f.source}: {', '.join(f'{k}={v}' for k, v in given.items())} disagree; make them equal")
    return next(iter(given.values())) if given else default


def _parse_gpt_oss(f: _Fields) -> GptOssConfig:
    """`gpt_oss`, read with the semantics of transformers' `GptOssConfig` (its class defaults fill absent
    fields: alternating sliding/full layer_types starting with sliding, YaRN factor 32 over 4096, theta
    150000). The release's `quantization_config` must be MXFP4 (or absent, for unquantized re-exports):
    which tensors hold the experts is decided by the loader from the tensor names."""
    f.get("model_type")
    quant = f.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, Mapping) else None
        if method != "mxfp4":
            raise ConfigError(f"{f.source}: quantization_config.quant_method={method!r}; gpt-oss checkpoints are "
                              "read in the release's MXFP4 layout or unquantized (bf16/fp32)")
    num_layers = int(f.require("num_hidden_layers"))
    hidden = int(f.require("hidden_size"))
    heads = int(f.require("num_attention_heads"))
    head_dim = f.get("head_dim", 64)
    head_dim = int(head_dim) if head_dim is not None else hidden // heads
    window = f.get("sliding_window", 128)
    layer_types = f.get("layer_types")
    if layer_types is None:
        layer_types = [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)]
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
        raise ConfigError(f"{f.source}: layer_types must list one type per layer ({num_layers} layers)")
    windows: list[int | None] = []
    for i, kind in enumerate(layer_types):
        if kind == SLIDING_ATTENTION:
            if not window:
                raise ConfigError(f"{f.source}: layer {i} is sliding_attention but sliding_window is {window!r}")
            windows.append(int(window))
        elif kind == FULL_ATTENTION:
            windows.append(None)
        else:
            raise ConfigError(f"{f.source}: layer {i} has type {kind!r}; gpt_oss layers are "
                              f"{SLIDING_ATTENTION!r} or {FULL_ATTENTION!r}")

    rope_raw = dict(f.raw)
    if not rope_raw.get("rope_parameters") and not rope_raw.get("rope_scaling"):
        rope_raw["rope_parameters"] = dict(_GPT_OSS_DEFAULT_ROPE)
        rope_raw.pop("rope_scaling", None)
    params = rope_raw.get("rope_parameters") or rope_raw.get("rope_scaling")
    if isinstance(params, Mapping) and params.get("rope_theta") is None and rope_raw.get("rope_theta") is None:
        rope_raw["rope_theta"] = _GPT_OSS_DEFAULT_THETA
    rope_fields = _Fields(rope_raw, f.source)
    rope = _parse_rope(rope_fields, head_dim)
    f.used |= rope_fields.used

    num_experts = _alias(f, ("num_local_experts", "num_experts"))
    top_k = _alias(f, ("num_experts_per_tok", "experts_per_token"), 4)
    if num_experts is None:
        raise ConfigError(f"{f.source}: gpt_oss config without num_local_experts")
    moe = MoEConfig(
        num_experts=int(num_experts),
        top_k=int(top_k),
        intermediate_size=int(f.require("intermediate_size")),
        norm_topk_prob=True,  # the softmax over the k chosen logits sums to one
        router="topk_softmax",
    )
    eos = f.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    f.ignore(*_GPT_OSS_IGNORED)
    alpha = f.get("swiglu_alpha")
    limit = f.get("swiglu_limit")
    cfg = GptOssConfig(
        vocab_size=int(f.require("vocab_size")),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(f.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(f.get("rms_norm_eps") or 1e-5),
        rope=rope,
        moe=moe,
        layer_windows=tuple(windows),
        swiglu_alpha=float(1.702 if alpha is None else alpha),
        swiglu_limit=float(7.0 if limit is None else limit),
        attention_bias=bool(f.get("attention_bias", True)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        max_position_embeddings=int(f.get("max_position_embeddings") or 131072),
        eos_token_ids=eos_ids,
    )
    f.check_all_used()
    return cfg


_PARSERS: dict[str, Callable[[_Fields], Any]] = {
    "gpt_oss": _parse_gpt_oss,
    "qwen3": _parse_qwen3,
    "qwen3_moe": _parse_qwen3,
    "qwen3_5_moe": _parse_qwen3_5,
    "qwen3_5_moe_text": _parse_qwen3_5,
}

# Families the project knows of, whose forward has not landed yet.
_PLANNED: tuple[str, ...] = ()


def load_hf_config_dict(path: str | os.PathLike) -> dict[str, Any]:
    """Reads `config.json` from a checkpoint directory (or the file itself); it must be a regular file
    holding a JSON object."""
    from dflash_jax.errors import open_regular

    path = os.fspath(path)
    named = os.path.basename(os.path.normpath(path)) == "config.json"  # the file itself (even if it is broken)
    file = os.path.join(path, "config.json") if os.path.isdir(path) and not named else path
    if not os.path.lexists(file):
        raise ConfigError(f"no config.json at {file}: point at a HuggingFace checkpoint directory")
    if not os.path.exists(file):
        raise ConfigError(f"{file} is a broken symbolic link (to {os.readlink(file)}); re-download the checkpoint")
    try:
        with open_regular(file, ConfigError, what="config file") as fh:
            config = json.loads(fh.read().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSON syntax and UTF-8 errors
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{file} is not valid JSON ({e}); re-download or re-export the checkpoint") from None
    if not isinstance(config, dict):
        kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(config), "null")
        raise ConfigError(f"{file} holds a JSON {kind}, not an object: it is not a model config; re-download or "
                          "re-export the checkpoint")
    return config


def from_hf_config(config: Mapping[str, Any] | str | os.PathLike, *, source: str | None = None):
    """Parses an HF `config.json` (a dict, a file, or a checkpoint directory) into a frozen config.

    Every error is a `ConfigError` that starts with `source` (the file): a wrong type anywhere in the
    config is reported as such, never as a traceback from the parser."""
    if isinstance(config, (str, os.PathLike)):
        source = source or os.fspath(config)
        config = load_hf_config_dict(config)
    source = source or "config"
    if not isinstance(config, Mapping):
        raise ConfigError(f"{source}: a config must be a JSON object, got {_type_name(config)}")
    try:
        if _is_draft_config(config):  # DFlash drafts: see the draft section at the end of this file
            return _parse_draft(_Fields(config, source))
        model_type = config.get("model_type")
        if model_type not in _PARSERS:
            if model_type in _PLANNED:
                raise ConfigError(f"{source}: model_type '{model_type}' is not supported yet by this version "
                                  f"of dflash_jax (supported: {', '.join(sorted(_PARSERS))})")
            raise ConfigError(f"{source}: unknown model_type {model_type!r} "
                              f"(supported: {', '.join(sorted(_PARSERS))})")
        return _PARSERS[model_type](_Fields(config, source))
    except ConfigError as e:
        if str(e).startswith(source):
            raise
        raise ConfigError(f"{source}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, IndexError) as e:
        raise ConfigError(f"{source}: a field has the wrong type or form ({type(e).__name__}: {e}); compare it "
                          "with the model's release config.json") from None


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """The factor YaRN multiplies cos/sin by (1 for default RoPE)."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


# ==================================================================================================
# DFlash draft (z-lab `dflash.model.DFlashDraftModel`): config and HF parser.
# Owned by the draft model (dflash_jax/models/draft.py); `from_hf_config` routes here by architecture.
# ==================================================================================================


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
        _require_positive(self, "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                          "intermediate_size", "rms_norm_eps")
        self._check_version()
        _check_heads(self.num_heads, self.num_kv_heads)
        _default_per_layer(self, "layer_windows", None)
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
        _require_positive(self, *DFLASH2_FIELDS)
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


_DRAFT_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
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


def _is_draft_config(config: Mapping[str, Any]) -> bool:
    architectures = config.get("architectures") or ()
    return isinstance(architectures, (list, tuple)) and any(a in _DRAFT_ARCHITECTURES for a in architectures)


def _parse_draft(f: _Fields) -> DraftConfig:
    """A DFlash draft config, read with the semantics of the transformers `Qwen3Config` the reference loads
    it into (whatever its model_type): `sliding_window` counts only with `use_sliding_window`, missing
    `layer_types` follow `max_window_layers`, and `is_causal` (when set) overrides every layer's causality.
    """
    architectures = [a for a in (f.raw.get("architectures") or ()) if a in _DRAFT_ARCHITECTURES]
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
        _check_field(f.source, name, f.raw.get(name))
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
        rope=_parse_rope(f, head_dim),
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
