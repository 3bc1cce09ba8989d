"""Dense Qwen3 and Qwen3-MoE: the config and its HF parser (`model_type` "qwen3" / "qwen3_moe")."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

from dflash_jax.config import (  # noqa: F401  (the shared toolkit)
    FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, ConfigError, Fields, MoEConfig, RopeConfig, check_field,
    check_heads, default_per_layer, parse_rope, require_positive,
)


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
        require_positive(self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                          "intermediate_size", "rms_norm_eps")
        check_heads(self.num_heads, self.num_kv_heads)
        default_per_layer(self, "layer_windows", None)
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



def parse_hf_config(f: Fields) -> Qwen3Config:
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
        rope=parse_rope(f, head_dim),
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


def tiny_config(**overrides) -> Qwen3Config:
    """A tiny Qwen3-MoE (4 layers, 8 experts top-2) for tests and examples; `overrides` replace fields."""
    kw = dict(
        model_type="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6, rotary_dim=16),
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True),
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def small_config(vocab_size: int, eos_id: int, num_experts: int = 8, top_k: int = 2,
                 expert_intermediate: int = 256) -> Qwen3Config:
    """The shipped pair's target shape (`train.tiny_pair.Recipe`): 4 layers, hidden 128, MoE in every layer."""
    return Qwen3Config(
        model_type="qwen3_moe", vocab_size=vocab_size, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=32, intermediate_size=512, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0, rotary_dim=32),
        max_position_embeddings=4096, moe=MoEConfig(num_experts=num_experts, top_k=top_k,
                                                    intermediate_size=expert_intermediate, norm_topk_prob=True),
        eos_token_ids=(eos_id,),
    )
