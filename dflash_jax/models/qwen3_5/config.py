"""Qwen3.5-MoE (hybrid Gated DeltaNet / gated attention): the config and its HF parser."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

from dflash_jax.config import (  # noqa: F401  (the shared toolkit)
    FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, ConfigError, Fields, MoEConfig, RopeConfig, check_field,
    check_heads, default_per_layer, parse_rope, require_positive,
)


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
        require_positive(self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                          "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                          "linear_value_head_dim", "rms_norm_eps")
        check_heads(self.num_heads, self.num_kv_heads)
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


def parse_hf_config(f: Fields) -> Qwen3_5Config:
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
    t = Fields(text, f"{f.source} (text_config)")
    if t.get("model_type", "qwen3_5_moe_text") != "qwen3_5_moe_text":
        raise ConfigError(f"{t.source}: model_type {text['model_type']!r}, expected 'qwen3_5_moe_text'")
    return _parse_qwen3_5_text(t, wrapper_tie=wrapper_tie)


def _parse_qwen3_5_text(f: Fields, *, wrapper_tie: bool | None) -> Qwen3_5Config:
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
    rope_fields = Fields(rope_raw, f.source)
    rope = parse_rope(rope_fields, head_dim)
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


def tiny_config(**overrides):
    """A tiny Qwen3.5-MoE: DeltaNet and gated-attention layers mixed (linear, linear, full, linear), dk != dv,
    Hv = 2 Hk, partial RoPE (8 of 32 head dims), 8 experts top-2 and a narrower shared expert."""
    kw = dict(
        vocab_size=512, hidden_size=64, num_layers=4,
        layer_types=(LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION),
        num_heads=4, num_kv_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=12, linear_conv_kernel=4,
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True),
        shared_expert_intermediate_size=24, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0, rotary_dim=8),
        max_position_embeddings=2048,
    )
    kw.update(overrides)
    return Qwen3_5Config(**kw)


def small_config(vocab_size: int, eos_id: int, num_experts: int = 8, top_k: int = 2,
                 expert_intermediate: int = 256) -> Qwen3_5Config:
    """The hybrid pair's target shape (`train.tiny_pair.Recipe.hybrid`): three Gated DeltaNet layers then one
    gated full-attention layer (the release's 1-in-4 pattern), partial RoPE (a quarter of the head dims), a
    shared expert beside the routed ones."""
    return Qwen3_5Config(
        vocab_size=vocab_size, hidden_size=128, num_layers=4,
        layer_types=(LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION),
        num_heads=4, num_kv_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel=4,
        moe=MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=expert_intermediate, norm_topk_prob=True),
        shared_expert_intermediate_size=256, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0, rotary_dim=8),
        max_position_embeddings=4096, eos_token_ids=(eos_id,),
    )
