"""Tiny configs and random weights for tests, examples and benchmarks (no torch needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.config import DraftConfig, MoEConfig, Qwen3Config, RopeConfig
from dflash_jax.models import draft, qwen3


def tiny_qwen3_moe_config(**overrides) -> Qwen3Config:
    kw = dict(
        model_type="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6, rotary_dim=16),
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True),
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


class _Init:
    """Matrices ~ N(0, 1/fan_in) (activations stay O(1) through depth); norm weights 1 + jitter * N(0, 1)."""

    def __init__(self, key, n, dtype, norm_jitter):
        self.keys = iter(jax.random.split(key, n))
        self.dtype, self.jitter = dtype, norm_jitter

    def mat(self, *shape):
        return (jax.random.normal(next(self.keys), shape, jnp.float32) / jnp.sqrt(shape[-2])).astype(self.dtype)

    def norm(self, n):
        return (1.0 + self.jitter * jax.random.normal(next(self.keys), (n,), jnp.float32)).astype(self.dtype)


def random_qwen3_weights(cfg: Qwen3Config, key: jax.Array, dtype=jnp.float32, *,
                         norm_jitter: float = 0.2) -> qwen3.Qwen3Weights:
    """Random target weights (see `_Init`); `norm_jitter=0` gives the usual training initialization."""
    init = _Init(key, 16 + 16 * cfg.num_layers, dtype, norm_jitter)
    mat, norm, keys = init.mat, init.norm, init.keys

    h, d = cfg.hidden_size, cfg.head_dim
    layers = []
    for i in range(cfg.num_layers):
        attn = qwen3.AttentionWeights(
            q=mat(h, cfg.num_heads * d), k=mat(h, cfg.num_kv_heads * d), v=mat(h, cfg.num_kv_heads * d),
            o=mat(cfg.num_heads * d, h), q_norm=norm(d), k_norm=norm(d),
        )
        if cfg.moe_layers[i]:
            e, inter = cfg.moe.num_experts, cfg.moe.intermediate_size
            mlp = qwen3.MoEWeights(router=mat(h, e), gate_up=mat(e, h, 2 * inter), down=mat(e, inter, h))
        else:
            mlp = qwen3.MLPWeights(gate=mat(h, cfg.intermediate_size), up=mat(h, cfg.intermediate_size),
                                   down=mat(cfg.intermediate_size, h))
        layers.append(qwen3.DecoderLayerWeights(input_norm=norm(h), attn=attn, post_norm=norm(h), mlp=mlp))
    embed = jax.random.normal(next(keys), (cfg.vocab_size, h), jnp.float32).astype(dtype)
    lm_head = None if cfg.tie_word_embeddings else mat(h, cfg.vocab_size)
    return qwen3.Qwen3Weights(embed=embed, layers=tuple(layers), final_norm=norm(h), lm_head=lm_head)


def tiny_draft_config(target: Qwen3Config, **overrides) -> DraftConfig:
    kw = dict(
        model_type="qwen3", hidden_size=target.hidden_size, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6, rotary_dim=16),
        target_layer_ids=(0, target.num_layers - 2), mask_token_id=target.vocab_size - 1, block_size=8,
        num_target_layers=target.num_layers, vocab_size=target.vocab_size,
    )
    kw.update(overrides)
    return DraftConfig(**kw)


def random_draft_weights(cfg: DraftConfig, key: jax.Array, dtype=jnp.float32, *,
                         norm_jitter: float = 0.2) -> draft.DraftWeights:
    init = _Init(key, 8 + 16 * cfg.num_layers, dtype, norm_jitter)
    h, d = cfg.hidden_size, cfg.head_dim
    layers = []
    for _ in range(cfg.num_layers):
        bias = (lambda n: jnp.zeros((n,), dtype)) if cfg.attention_bias else (lambda n: None)
        attn = qwen3.AttentionWeights(
            q=init.mat(h, cfg.num_heads * d), k=init.mat(h, cfg.num_kv_heads * d), v=init.mat(h, cfg.num_kv_heads * d),
            o=init.mat(cfg.num_heads * d, h), q_norm=init.norm(d), k_norm=init.norm(d),
            q_bias=bias(cfg.num_heads * d), k_bias=bias(cfg.num_kv_heads * d), v_bias=bias(cfg.num_kv_heads * d),
            o_bias=bias(h))
        mlp = qwen3.MLPWeights(gate=init.mat(h, cfg.intermediate_size), up=init.mat(h, cfg.intermediate_size),
                               down=init.mat(cfg.intermediate_size, h))
        layers.append(qwen3.DecoderLayerWeights(input_norm=init.norm(h), attn=attn, post_norm=init.norm(h), mlp=mlp))
    return draft.DraftWeights(fc=init.mat(cfg.num_taps * cfg.target_hidden_size, h), hidden_norm=init.norm(h),
                              layers=tuple(layers), final_norm=init.norm(h))
