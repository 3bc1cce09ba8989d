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


class ConfigError(ValueError):
    """A configuration the library cannot run exactly; the message names the cause and the fix."""


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
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim must be a positive even number, got {self.rotary_dim}")
        if self.kind == "yarn" and not self.original_max_position_embeddings:
            raise ConfigError("YaRN RoPE needs original_max_position_embeddings")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A top-k routed mixture of SwiGLU experts.

    `router="softmax_topk"`: softmax over all experts in fp32, top-k, optionally renormalized
    (`norm_topk_prob`); the Qwen families.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    router: Literal["softmax_topk"] = "softmax_topk"

    def __post_init__(self):
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
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
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


class _Fields:
    """Reads fields of an HF config dict and remembers which were used, to reject the rest."""

    def __init__(self, raw: Mapping[str, Any], source: str):
        self.raw = dict(raw)
        self.source = source
        self.used: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.raw.get(key, default)

    def require(self, key: str) -> Any:
        self.used.add(key)
        if key not in self.raw or self.raw[key] is None:
            raise ConfigError(f"{self.source}: required field '{key}' is missing")
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


_PARSERS: dict[str, Callable[[_Fields], Any]] = {
    "qwen3": _parse_qwen3,
    "qwen3_moe": _parse_qwen3,
}

# Families the project knows of, whose forward has not landed yet.
_PLANNED = ("qwen3_5_moe", "qwen3_5_moe_text", "gpt_oss")


def load_hf_config_dict(path: str | os.PathLike) -> dict[str, Any]:
    """Reads `config.json` from a checkpoint directory (or the file itself)."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise ConfigError(f"no config.json at {file}: point at a HuggingFace checkpoint directory")
    try:
        with open(file) as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON ({e}); re-download or re-export the checkpoint") from e


def from_hf_config(config: Mapping[str, Any] | str | os.PathLike, *, source: str | None = None):
    """Parses an HF `config.json` (a dict, a file, or a checkpoint directory) into a frozen config."""
    if not isinstance(config, Mapping):
        source = source or os.fspath(config)
        config = load_hf_config_dict(config)
    source = source or "config"
    model_type = config.get("model_type")
    if model_type not in _PARSERS:
        if model_type in _PLANNED:
            raise ConfigError(f"{source}: model_type '{model_type}' is not supported yet by this version "
                              f"of dflash_jax (supported: {', '.join(sorted(_PARSERS))})")
        raise ConfigError(f"{source}: unknown model_type {model_type!r} "
                          f"(supported: {', '.join(sorted(_PARSERS))})")
    return _PARSERS[model_type](_Fields(config, source))


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
