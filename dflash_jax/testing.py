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


def tiny_gpt_oss_config(**overrides):
    """A tiny gpt-oss: alternating sliding (window 16) / full layers, the release's YaRN, 8 experts top-2."""
    from dflash_jax.config import GptOssConfig

    kw = dict(
        vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=150000.0, rotary_dim=16, kind="yarn", factor=32.0, original_max_position_embeddings=4096,
                        truncate=False),
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=64, norm_topk_prob=True, router="topk_softmax"),
        layer_windows=(16, None, 16, None),
    )
    kw.update(overrides)
    return GptOssConfig(**kw)


def random_gpt_oss_weights(cfg, key: jax.Array, dtype=jnp.float32, *, expert_format: str = "mxfp4"):
    """Random gpt-oss weights (scales as in `random_qwen3_weights`; sinks N(0, 1), biases N(0, 0.1^2));
    experts as MXFP4 tensors (`expert_format="mxfp4"`, the release's form) or dense tables ("dense").
    Norm weights are fp32, as in the release. Drawn with numpy on the host (fast for many small arrays)."""
    import numpy as np

    from dflash_jax.models import gpt_oss
    from dflash_jax.quant import MXFP4Tensor, quantize_mxfp4_np

    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))

    def arr(x, dt=dtype):
        return jnp.asarray(np.asarray(x, np.float32), dt)

    def mat(*shape):
        return arr(rng.standard_normal(shape) / np.sqrt(shape[-2]))

    def vec(*shape, scale=0.1):
        return arr(scale * rng.standard_normal(shape))

    def norm(n):
        return arr(1.0 + 0.2 * rng.standard_normal(n), jnp.float32)

    h, d, e, inter = cfg.hidden_size, cfg.head_dim, cfg.moe.num_experts, cfg.moe.intermediate_size
    qd, kvd = cfg.num_heads * d, cfg.num_kv_heads * d

    def experts(n_out, k_in):  # logical [E, out, in]
        w = (rng.standard_normal((e, n_out, k_in)) / np.sqrt(k_in)).astype(np.float32)
        if expert_format == "mxfp4":
            blocks, scales = quantize_mxfp4_np(w)
            return MXFP4Tensor(blocks=jnp.asarray(blocks), scales=jnp.asarray(scales))
        return arr(np.swapaxes(w, 1, 2))

    layers = []
    for _ in range(cfg.num_layers):
        bias = cfg.attention_bias
        attn = gpt_oss.GptOssAttentionWeights(
            q=mat(h, qd), k=mat(h, kvd), v=mat(h, kvd), o=mat(qd, h), sinks=vec(cfg.num_heads, scale=1.0),
            q_bias=vec(qd) if bias else None, k_bias=vec(kvd) if bias else None,
            v_bias=vec(kvd) if bias else None, o_bias=vec(h) if bias else None,
        )
        mlp = gpt_oss.GptOssMoEWeights(
            router=mat(h, e), router_bias=vec(e), gate_up=experts(2 * inter, h), gate_up_bias=vec(e, 2 * inter),
            down=experts(h, inter), down_bias=vec(e, h),
        )
        layers.append(gpt_oss.GptOssLayerWeights(input_norm=norm(h), attn=attn, post_norm=norm(h), mlp=mlp))
    embed = arr(rng.standard_normal((cfg.vocab_size, h)))
    lm_head = None if cfg.tie_word_embeddings else mat(h, cfg.vocab_size)
    return gpt_oss.GptOssWeights(embed=embed, layers=tuple(layers), final_norm=norm(h), lm_head=lm_head)


def tiny_qwen3_5_config(**overrides):
    """A tiny Qwen3.5-MoE: DeltaNet and gated-attention layers mixed (linear, linear, full, linear), dk != dv,
    Hv = 2 Hk, partial RoPE (8 of 32 head dims), 8 experts top-2 and a narrower shared expert."""
    from dflash_jax.config import LINEAR_ATTENTION, FULL_ATTENTION, Qwen3_5Config

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


def random_qwen3_5_weights(cfg, key: jax.Array, dtype=jnp.float32):
    """Random Qwen3.5-MoE weights: matrices N(0, 1/fan_in) (the conv N(0, 1/K)), zero-centred norm weights
    0.2 N(0, 1) (so the scale 1 + w is jittered like `random_qwen3_weights`' norms), the DeltaNet output norm
    1 + 0.2 N(0, 1), A_log / dt_bias 0.1 N(0, 1). Drawn with numpy on the host."""
    import numpy as np

    from dflash_jax.config import FULL_ATTENTION
    from dflash_jax.models import qwen3_5

    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))

    def arr(x):
        return jnp.asarray(np.asarray(x, np.float32), dtype)

    def mat(*shape):
        return arr(rng.standard_normal(shape) / np.sqrt(shape[-2]))

    def vec(n, scale=0.1, offset=0.0):
        return arr(offset + scale * rng.standard_normal(n))

    h, d, e, inter = cfg.hidden_size, cfg.head_dim, cfg.moe.num_experts, cfg.moe.intermediate_size
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    conv_dim, shared = cfg.linear_conv_dim, cfg.shared_expert_intermediate_size  # conv_dim = 2 Hk dk + Hv dv
    layers = []
    for kind in cfg.layer_types:
        if kind == FULL_ATTENTION:
            mixer = qwen3_5.GatedAttentionWeights(
                q=mat(h, cfg.num_heads * 2 * d), k=mat(h, cfg.num_kv_heads * d), v=mat(h, cfg.num_kv_heads * d),
                o=mat(cfg.num_heads * d, h), q_norm=vec(d, 0.2), k_norm=vec(d, 0.2))
        else:
            mixer = qwen3_5.GatedDeltaNetWeights(
                qkv=mat(h, conv_dim), z=mat(h, hv * dv), b=mat(h, hv), a=mat(h, hv),
                conv=mat(cfg.linear_conv_kernel, conv_dim), a_log=vec(hv), dt_bias=vec(hv), norm=vec(dv, 0.2, 1.0),
                out=mat(hv * dv, h))
        mlp = qwen3_5.SparseMoEWeights(
            router=mat(h, e), gate_up=mat(e, h, 2 * inter), down=mat(e, inter, h),
            shared=qwen3.MLPWeights(gate=mat(h, shared), up=mat(h, shared), down=mat(shared, h)),
            shared_gate=mat(h, 1))
        layers.append(qwen3_5.DecoderLayerWeights(input_norm=vec(h, 0.2), mixer=mixer, post_norm=vec(h, 0.2), mlp=mlp))
    embed = arr(rng.standard_normal((cfg.vocab_size, h)))
    lm_head = None if cfg.tie_word_embeddings else mat(h, cfg.vocab_size)
    return qwen3_5.Qwen3_5Weights(embed=embed, layers=tuple(layers), final_norm=vec(h, 0.2), lm_head=lm_head)


def make_agreeable(target_w, draft_w: draft.DraftWeights, *, strength: float = 2.0, tokens: tuple[int, int] = (7, 9)):
    """(target, draft) weights that agree on something, so speculative rounds accept a mix of 0..B-1
    proposals: both final norms amplify hidden dim 0 and the target's lm_head (which the draft shares)
    maps its sign to one of two tokens. Needs an untied lm_head. Any target family."""
    from dflash_jax.models import qwen3_5

    head = target_w.lm_head.at[0, :].set(0.0).at[0, tokens[0]].set(strength).at[0, tokens[1]].set(-strength)
    scale = 29.0 if isinstance(target_w, qwen3_5.Qwen3_5Weights) else 30.0  # zero-centred norm: 1 + 29
    target_w = target_w.replace(final_norm=target_w.final_norm.at[0].set(scale), lm_head=head)
    return target_w, draft_w.replace(final_norm=draft_w.final_norm.at[0].set(30.0))


def quantize_experts(weights, expert_format: str = "mxfp4"):
    """The same Qwen3 / Qwen3.5 weights with every MoE layer's routed expert tables quantized to
    `expert_format` ("mxfp4" / "nvfp4"; logical `[E, out, in]` FP4 tensors, as `convert-weights` writes them)."""
    from dflash_jax.quant import quantize_mxfp4, quantize_nvfp4

    quantize = {"mxfp4": quantize_mxfp4, "nvfp4": quantize_nvfp4}[expert_format]
    from dflash_jax.models import qwen3_5

    layers = []
    for layer in weights.layers:
        if isinstance(layer.mlp, (qwen3.MoEWeights, qwen3_5.SparseMoEWeights)):
            mlp = layer.mlp.replace(gate_up=quantize(jnp.swapaxes(layer.mlp.gate_up, 1, 2)),
                                    down=quantize(jnp.swapaxes(layer.mlp.down, 1, 2)))
            layer = layer.replace(mlp=mlp)
        layers.append(layer)
    return weights.replace(layers=tuple(layers))


def random_pair(cfg=None, *, seed: int = 0, agreeable: bool = True, expert_format: str = "dense",
                **draft_overrides):
    """A `dflash_jax.pair.Pair` of random tiny weights (`tiny_qwen3_moe_config()` by default; a
    `GptOssConfig` or `Qwen3_5Config` builds that family's target), made agreeable (`make_agreeable`) unless
    told otherwise, experts dense or quantized ("mxfp4" / "nvfp4" for the Qwen families; gpt-oss experts are
    "dense" or "mxfp4", the release's packed form, drawn directly in it)."""
    from dflash_jax.config import GptOssConfig, Qwen3_5Config
    from dflash_jax.pair import Pair, check_pair

    cfg = cfg or tiny_qwen3_moe_config()
    dcfg = tiny_draft_config(cfg, **draft_overrides)
    check_pair(cfg, dcfg)
    key = jax.random.key(seed)
    if isinstance(cfg, GptOssConfig):
        if expert_format not in ("dense", "mxfp4"):
            raise ValueError(f"gpt-oss experts are 'dense' or 'mxfp4', got {expert_format!r}")
        target_w = random_gpt_oss_weights(cfg, key, expert_format=expert_format)
    elif isinstance(cfg, Qwen3_5Config):
        target_w = random_qwen3_5_weights(cfg, key)
    else:
        target_w = random_qwen3_weights(cfg, key)
    draft_w = random_draft_weights(dcfg, jax.random.key(seed + 1))
    if agreeable:
        target_w, draft_w = make_agreeable(target_w, draft_w)
    if expert_format != "dense" and not isinstance(cfg, GptOssConfig):
        target_w = quantize_experts(target_w, expert_format)
    return Pair(target_cfg=cfg, target=target_w, draft_cfg=dcfg, draft=draft_w,
                manifest={"expert_format": expert_format, "tensors": {"target": {}}}, directory="")
