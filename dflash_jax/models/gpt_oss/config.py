"""gpt-oss (gpt-oss-20b / gpt-oss-120b): the config and its HF parser."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

from dflash_jax.config import (  # noqa: F401  (the shared toolkit)
    FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, ConfigError, Fields, MoEConfig, RopeConfig, check_field,
    check_heads, default_per_layer, parse_rope, require_positive,
)


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
        require_positive(self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                          "rms_norm_eps")
        check_heads(self.num_heads, self.num_kv_heads)
        default_per_layer(self, "layer_windows", None)
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


def _alias(f: Fields, names: tuple[str, ...], default: Any = None) -> Any:
    """One value under several names (a current one and legacy ones); they must agree when repeated."""
    values = {name: f.get(name) for name in names}
    given = {name: v for name, v in values.items() if v is not None}
    if len(set(given.values())) > 1:
        raise ConfigError(f"{f.source}: {', '.join(f'{k}={v}' for k, v in given.items())} disagree; make them equal")
    return next(iter(given.values())) if given else default


def parse_hf_config(f: Fields) -> GptOssConfig:
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
    rope_fields = Fields(rope_raw, f.source)
    rope = parse_rope(rope_fields, head_dim)
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


def tiny_config(**overrides):
    """A tiny gpt-oss: alternating sliding (window 16) / full layers, the release's YaRN, 8 experts top-2."""
    kw = dict(
        vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=150000.0, rotary_dim=16, kind="yarn", factor=32.0, original_max_position_embeddings=4096,
                        truncate=False),
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=64, norm_topk_prob=True, router="topk_softmax"),
        layer_windows=(16, None, 16, None),
    )
    kw.update(overrides)
    return GptOssConfig(**kw)
