"""Tiny configs and random weights for tests, examples and benchmarks (no torch needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.config import MoEConfig, Qwen3Config, RopeConfig
from dflash_jax.models import qwen3


def tiny_qwen3_moe_config(**overrides) -> Qwen3Config:
    kw = dict(
        model_type="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6, rotary_dim=16),
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True),
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def random_qwen3_weights(cfg: Qwen3Config, key: jax.Array, dtype=jnp.float32) -> qwen3.Qwen3Weights:
    """Random weights at a scale that keeps activations O(1) through depth (matrices ~ N(0, 1/fan_in))."""
    keys = iter(jax.random.split(key, 16 + 16 * cfg.num_layers))

    def mat(*shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[-2])).astype(dtype)

    def norm(n):
        return (1.0 + 0.2 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(dtype)

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
