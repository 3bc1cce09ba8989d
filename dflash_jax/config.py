"""Model configurations: the shared parts and the strict HF parsing toolkit.

Each family's frozen, keyword-only config dataclass and its HF parser live in the family's package
(`dflash_jax/models/<family>/config.py`); this module keeps what they share: `RopeConfig`, `MoEConfig`, the
layer-type names, the strict field reader (`Fields`, `check_field`, `parse_rope`, the checks of sizes) and
`from_hf_config`, which dispatches through the parsers the model-family registry registers here.
HuggingFace field names appear only in the parsers; the rest of the library speaks in the dataclasses' own
names. A config is hashable, so it can be a static argument of `jax.jit`.

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


from dflash_jax.errors import ConfigError  # noqa: F401  (defined with the other error classes; re-exported here)


def check_heads(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")


def require_positive(cfg, *names: str) -> None:
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


def default_per_layer(cfg, field: str, value) -> None:
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
        require_positive(self, "theta", "factor")
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
        require_positive(self, "num_experts", "intermediate_size")
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ConfigError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")


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


def check_field(source: str, key: str, value: Any, name: str | None = None) -> None:
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
                check_field(source, k, v, f"{name}.{k}")


class Fields:
    """Reads fields of an HF config dict and remembers which were used, to reject the rest. Every value read
    is type- and range-checked (`check_field`)."""

    def __init__(self, raw: Mapping[str, Any], source: str):
        self.raw = dict(raw)
        self.source = source
        self.used: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        if key in self.raw:
            check_field(self.source, key, self.raw[key])
        return self.raw.get(key, default)

    def require(self, key: str) -> Any:
        self.used.add(key)
        if key not in self.raw or self.raw[key] is None:
            raise ConfigError(f"{self.source}: required field '{key}' is missing")
        check_field(self.source, key, self.raw[key])
        return self.raw[key]

    def ignore(self, *keys: str) -> None:
        self.used.update(keys)

    def check_all_used(self) -> None:
        unknown = sorted(set(self.raw) - self.used - _IGNORED_EVERYWHERE)
        if unknown:
            raise ConfigError(
                f"{self.source}: fields {unknown} are not understood by dflash_jax; running without them "
                "could compute a different model. If they are harmless for inference, add them to the "
                "ignore list of the family's parser (dflash_jax/models/<family>/config.py); otherwise the model "
                "is not supported yet."
            )


def parse_rope(f: Fields, head_dim: int) -> RopeConfig:
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


# Layer-type names of HF `layer_types` (shared vocabulary of the families' configs).
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


# The HF parsers, filled by registration only: each target family registers its parser under its `model_type`s
# (`models.family.register`), the draft under its `architectures` (`models.family.register_draft`). Nothing
# here names a family; `from_hf_config` dispatches through what the registry put here.
HF_PARSERS: dict[str, Callable[[Fields], Any]] = {}
HF_ARCHITECTURE_PARSERS: dict[str, Callable[[Fields], Any]] = {}


def register_hf_parser(parser: Callable[[Fields], Any], *, model_types: tuple[str, ...] = (),
                       architectures: tuple[str, ...] = ()) -> None:
    """Registers `parser` for configs of those `model_type`s (targets) or listing those `architectures`
    (drafts, whatever their model_type); called by the model-family registry, once per family."""
    for table, keys in ((HF_PARSERS, model_types), (HF_ARCHITECTURE_PARSERS, architectures)):
        for key in keys:
            if key in table and table[key] is not parser:
                raise ValueError(f"two parsers registered for {key!r}")
            table[key] = parser


def registered_model_types() -> tuple[str, ...]:
    """The HF `model_type`s a registered target family parses."""
    return tuple(sorted(HF_PARSERS))


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
        architectures = config.get("architectures") or ()
        if isinstance(architectures, (list, tuple)):
            drafts = [a for a in architectures if a in HF_ARCHITECTURE_PARSERS]
            if drafts:  # drafts are known by their architecture (their model_type names a target's)
                return HF_ARCHITECTURE_PARSERS[drafts[0]](Fields(config, source))
        model_type = config.get("model_type")
        if model_type not in HF_PARSERS:
            raise ConfigError(f"{source}: unknown model_type {model_type!r} "
                              f"(supported: {', '.join(registered_model_types()) or 'none registered: import dflash_jax.models'})")
        return HF_PARSERS[model_type](Fields(config, source))
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

