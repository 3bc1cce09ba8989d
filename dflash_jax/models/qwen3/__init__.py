"""Dense Qwen3 and Qwen3-MoE decoders: weight pytrees, layer pieces and the registered `QWEN3` family.

`forward` (the one decoder loop of `models.decoder` over this family's pieces) serves every use: prefill of
a (right-padded) batch of prompts, extension of a cache by a width-B speculative block, and plain one-token
decoding. It writes the new K/V rows at each sequence's current length, advances the lengths by the number
of valid tokens, and returns the logits, the requested hidden-state taps and the router choices. Rolling a
speculative block back is `QWEN3.rollback(cache, committed_lengths)` (a counter move).

Weights are stored [in, out] so a projection is `x @ w`; expert tables are stacked per layer:
`gate_up [E, H, 2I]` (gate columns first) and `down [E, I, H]`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.nn.attention import cached_causal_attention
from dflash_jax.nn.init import ParamInit
from dflash_jax.models import decoder
from dflash_jax.models.decoder import (  # noqa: F401  (re-exported: the shapes every family shares)
    BlockContext, ForwardOutput, LogitsMode, RouterWeights, Routing, block_positions, lm_head_logits,
)
from dflash_jax.models.declare import HEADS, Target, build_tree, declare_tree, layers, param, sub
from dflash_jax.models.family import ModelFamily, register
from dflash_jax.models.qwen3.config import Qwen3Config, parse_hf_config, small_config, tiny_config
from dflash_jax.nn.mlp import swiglu
from dflash_jax.nn.moe import softmax_topk_router, swiglu_experts
from dflash_jax.nn.norms import rms_norm
from dflash_jax.nn.rope import apply_rope, rope_cos_sin
from dflash_jax.quant import quantize_mxfp4, quantize_nvfp4

def _group(c) -> int:
    """The query-head width of one KV head: a tensor-parallel split keeps whole GQA groups together."""
    return c.head_dim * max(1, c.num_heads // max(1, c.num_kv_heads))


def _biased(c) -> bool:
    return c.attention_bias


# The weight dataclasses are the declarations (`models.declare`): every array field states its shape (and
# sharding unit) from the config; `declare_weights` / `weights_from_flat` read them off the types.
@struct.dataclass
class AttentionWeights:
    q: jax.Array = param(lambda c: (c.hidden_size, c.num_heads * c.head_dim), axes=(None, HEADS), unit=_group)
    k: jax.Array = param(lambda c: (c.hidden_size, c.num_kv_heads * c.head_dim), axes=(None, HEADS),
                         unit=lambda c: c.head_dim)
    v: jax.Array = param(lambda c: (c.hidden_size, c.num_kv_heads * c.head_dim), axes=(None, HEADS),
                         unit=lambda c: c.head_dim)
    o: jax.Array = param(lambda c: (c.num_heads * c.head_dim, c.hidden_size), axes=(HEADS, None), unit=_group)
    q_norm: jax.Array = param(lambda c: (c.head_dim,))
    k_norm: jax.Array = param(lambda c: (c.head_dim,))
    q_bias: jax.Array | None = param(lambda c: (c.num_heads * c.head_dim,), axes=(HEADS,), unit=_group, when=_biased)
    k_bias: jax.Array | None = param(lambda c: (c.num_kv_heads * c.head_dim,), axes=(HEADS,),
                                     unit=lambda c: c.head_dim, when=_biased)
    v_bias: jax.Array | None = param(lambda c: (c.num_kv_heads * c.head_dim,), axes=(HEADS,),
                                     unit=lambda c: c.head_dim, when=_biased)
    o_bias: jax.Array | None = param(lambda c: (c.hidden_size,), when=_biased)


@struct.dataclass
class MLPWeights:
    gate: jax.Array = param(lambda c: (c.hidden_size, c.intermediate_size))  # [H, I]
    up: jax.Array = param(lambda c: (c.hidden_size, c.intermediate_size))  # [H, I]
    down: jax.Array = param(lambda c: (c.intermediate_size, c.hidden_size))  # [I, H]


@struct.dataclass
class MoEWeights:
    router: jax.Array = param(lambda c: (c.hidden_size, c.moe.num_experts))  # [H, E]
    # [E, H, 2I] (or a slot pool [S, H, 2I] with `slot_of`), assembled per expert and gate / up half
    gate_up: jax.Array = param(lambda c: (c.moe.num_experts, c.hidden_size, 2 * c.moe.intermediate_size),
                               coverage=lambda c: (c.moe.num_experts, 2))
    down: jax.Array = param(lambda c: (c.moe.num_experts, c.moe.intermediate_size, c.hidden_size),
                            coverage=lambda c: (c.moe.num_experts,))  # [E, I, H]
    slot_of: jax.Array | None = None  # [E] int32 slot of each expert in a pool; None: the tables are whole


@struct.dataclass
class DecoderLayerWeights:
    input_norm: jax.Array = param(lambda c: (c.hidden_size,))
    attn: AttentionWeights = sub(AttentionWeights)
    post_norm: jax.Array = param(lambda c: (c.hidden_size,))
    mlp: MLPWeights | MoEWeights = sub(lambda c, i: MoEWeights if c.moe_layers[i] else MLPWeights)


@struct.dataclass
class Qwen3Weights:
    embed: jax.Array = param(lambda c: (c.vocab_size, c.hidden_size))  # [V, H]
    layers: tuple[DecoderLayerWeights, ...] = layers(DecoderLayerWeights)
    final_norm: jax.Array = param(lambda c: (c.hidden_size,))  # [H]
    lm_head: jax.Array | None = param(lambda c: (c.hidden_size, c.vocab_size),  # [H, V]; None when tied
                                      when=lambda c: not c.tie_word_embeddings)


def embed_tokens(weights: Qwen3Weights, tokens: jax.Array) -> jax.Array:
    return jnp.take(weights.embed, tokens, axis=0)


def _project(x, w, b):
    y = x @ w
    return y if b is None else y + b


def qkv_projection(
    x: jax.Array, attn: AttentionWeights, cos: jax.Array, sin: jax.Array, *, num_heads, num_kv_heads,
    head_dim, eps
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Qwen3 q/k/v: projection, per-head RMSNorm of q and k (before RoPE), RoPE on q and k."""
    b, t, _ = x.shape
    q = _project(x, attn.q, attn.q_bias).reshape(b, t, num_heads, head_dim)
    k = _project(x, attn.k, attn.k_bias).reshape(b, t, num_kv_heads, head_dim)
    v = _project(x, attn.v, attn.v_bias).reshape(b, t, num_kv_heads, head_dim)
    q = apply_rope(rms_norm(q, attn.q_norm, eps), cos, sin)
    k = apply_rope(rms_norm(k, attn.k_norm, eps), cos, sin)
    return q, k, v


def block_context(
    weights, tokens: jax.Array, cache, cfg, num_valid: jax.Array | None = None
) -> tuple[jax.Array, BlockContext]:
    """The embedded block `x` [b, T, H] and its `BlockContext` (positions `cache.lengths + [0, T)`); shared
    by every family that embeds with `weights.embed` and uses `cfg.rope`."""
    b, t = tokens.shape
    starts = cache.lengths
    if num_valid is None:
        num_valid = jnp.full((b,), t, jnp.int32)
    positions = block_positions(starts, t)
    x = embed_tokens(weights, tokens)
    cos, sin = rope_cos_sin(cfg.rope, positions, x.dtype)
    return x, BlockContext(positions=positions, starts=starts, cos=cos, sin=sin,
                           num_valid=jnp.asarray(num_valid, jnp.int32))


def attention_sublayer(
    layer: DecoderLayerWeights, x: jax.Array, k_buf: jax.Array, v_buf: jax.Array, ctx: BlockContext,
    window: int | None, cfg: Qwen3Config,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`x + attn(input_norm(x))`, writing the block's K/V rows at `ctx.starts`; returns (x, k_buf, v_buf)."""
    h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
    q, k, v = qkv_projection(h, layer.attn, ctx.cos, ctx.sin, num_heads=cfg.num_heads,
                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps)
    out, k_buf, v_buf = cached_causal_attention(q, k, v, k_buf, v_buf, ctx.positions, window=window,
                                                scale=cfg.head_dim**-0.5, tree_mask=ctx.tree_mask)
    out = _project(out.reshape(x.shape[0], x.shape[1], -1), layer.attn.o, layer.attn.o_bias)
    return x + out, k_buf, v_buf


def attention_queries(layer: DecoderLayerWeights, x: jax.Array, ctx: BlockContext, window, cfg: Qwen3Config):
    """The post-RoPE queries [b, T, Hq, d] `attention_sublayer` attends with (the PFlash scorer's)."""
    h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
    q, _, _ = qkv_projection(h, layer.attn, ctx.cos, ctx.sin, num_heads=cfg.num_heads,
                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps)
    return q


def mlp_input(layer: DecoderLayerWeights, x: jax.Array, cfg: Qwen3Config) -> jax.Array:
    """`post_norm(x)` flattened to [b*T, H]: the router's and the experts' input."""
    return rms_norm(x, layer.post_norm, cfg.rms_norm_eps).reshape(-1, x.shape[-1])


def route(mlp: MoEWeights | RouterWeights, h: jax.Array, cfg: Qwen3Config, top_k: int | None = None) -> Routing:
    """The exact routing of post-normed rows `h` [b*T, H] (fp32 softmax over all experts, top-k, renormalized if
    configured); `top_k` defaults to the config's."""
    return softmax_routing(h, mlp.router, cfg.moe.top_k if top_k is None else top_k, cfg.moe.norm_topk_prob)


def softmax_routing(h: jax.Array, router: jax.Array, top_k: int, normalize: bool) -> Routing:
    """Qwen routing: softmax over all experts in fp32, each row's top-k (`probs`), renormalized to sum 1 as the
    weights when `normalize`."""
    probs, experts, logits = softmax_topk_router(h, router, top_k, normalize=False)
    weights = probs / jnp.sum(probs, axis=-1, keepdims=True) if normalize else probs
    return Routing(weights=weights, experts=experts, logits=logits, probs=probs)


def route_rows(router: RouterWeights, x: jax.Array, cfg: Qwen3Config, top_k: int) -> Routing:
    """The family's routing function (`ModelFamily.route_rows`): `route` of the post-attention-normed rows."""
    return route(router, rms_norm(x, router.norm, cfg.rms_norm_eps), cfg, top_k)


def mlp_sublayer(
    layer: DecoderLayerWeights, x: jax.Array, h: jax.Array, cfg: Qwen3Config, implementation: str = "auto", *,
    routing: Routing | None = None,
) -> jax.Array:
    """`x + mlp(h)` with h = `mlp_input(layer, x)`. For MoE layers the experts run on `routing` (computed here
    when None) over the layer's tables, a slot pool when `layer.mlp.slot_of` is set (`nn.moe.swiglu_experts`)."""
    mlp = layer.mlp
    if isinstance(mlp, MLPWeights):
        return x + swiglu(h.reshape(x.shape), mlp.gate, mlp.up, mlp.down)
    routing = route(mlp, h, cfg) if routing is None else routing
    out = swiglu_experts(h, routing.experts, routing.weights, mlp.gate_up, mlp.down, slot_of=mlp.slot_of,
                         implementation=implementation)
    return x + out.reshape(x.shape)


def final_norm(weights: Qwen3Weights, x: jax.Array, cfg: Qwen3Config) -> jax.Array:
    return rms_norm(x, weights.final_norm, cfg.rms_norm_eps)



from dflash_jax.models.qwen3.hf import HF_TABLE, export_hf  # noqa: E402  (the layout reads the weight types above)


class Qwen3Family(ModelFamily):
    """Dense Qwen3 and Qwen3-MoE (dense and MoE layers may mix: `cfg.moe_layers`)."""

    name = "qwen3"
    config_type, weights_type, moe_type = Qwen3Config, Qwen3Weights, MoEWeights
    model_types = ("qwen3", "qwen3_moe")
    expert_fields = ("gate_up", "down")
    parse_hf = staticmethod(parse_hf_config)
    hf_table = HF_TABLE
    export_hf = staticmethod(export_hf)
    small_config_fn = staticmethod(small_config)

    def random_weights(self, cfg, key, dtype=jnp.float32, *, expert_format: str = "dense"):
        return quantize_expert_tables(random_weights(cfg, key, dtype), expert_format)

    block_context_fn = staticmethod(block_context)
    attention_fn = staticmethod(attention_sublayer)
    attention_queries_fn = staticmethod(attention_queries)
    mlp_input_fn = staticmethod(mlp_input)
    route_rows_fn = staticmethod(route_rows)
    tiny_config_fn = staticmethod(tiny_config)
    mlp_fn = staticmethod(mlp_sublayer)
    final_norm_fn = staticmethod(final_norm)
    declare_fn = staticmethod(lambda cfg: declare_weights(cfg))
    from_flat_fn = staticmethod(lambda flat, cfg: weights_from_flat(flat, cfg))


QWEN3 = register(Qwen3Family())


def init_cache(cfg: Qwen3Config, batch: int, max_len: int, dtype=jnp.float32):
    return QWEN3.init_cache(cfg, batch, max_len, dtype)


forward, forward_jit = decoder.family_forwards(QWEN3)
rollback = QWEN3.rollback


def select_logits(weights, normed: jax.Array, num_valid: jax.Array, logits: LogitsMode):
    """Logits of final-normed hidden states [b, T, H]: every row ("all"), each sequence's last valid row
    ("last", [b, V]) or None ("none")."""
    return decoder.select_logits(normed, num_valid, logits, functools.partial(lm_head_logits, weights))


def random_weights(cfg: Qwen3Config, key: jax.Array, dtype=jnp.float32, *,
                   norm_jitter: float = 0.2) -> Qwen3Weights:
    """Random target weights (`nn.init.ParamInit`); `norm_jitter=0` gives the usual training initialization."""
    init = ParamInit(key, 16 + 16 * cfg.num_layers, dtype, norm_jitter)
    mat, norm, keys = init.mat, init.norm, init.keys

    h, d = cfg.hidden_size, cfg.head_dim
    layers = []
    for i in range(cfg.num_layers):
        attn = AttentionWeights(
            q=mat(h, cfg.num_heads * d), k=mat(h, cfg.num_kv_heads * d), v=mat(h, cfg.num_kv_heads * d),
            o=mat(cfg.num_heads * d, h), q_norm=norm(d), k_norm=norm(d),
        )
        if cfg.moe_layers[i]:
            e, inter = cfg.moe.num_experts, cfg.moe.intermediate_size
            mlp = MoEWeights(router=mat(h, e), gate_up=mat(e, h, 2 * inter), down=mat(e, inter, h))
        else:
            mlp = MLPWeights(gate=mat(h, cfg.intermediate_size), up=mat(h, cfg.intermediate_size),
                             down=mat(cfg.intermediate_size, h))
        layers.append(DecoderLayerWeights(input_norm=norm(h), attn=attn, post_norm=norm(h), mlp=mlp))
    embed = jax.random.normal(next(keys), (cfg.vocab_size, h), jnp.float32).astype(dtype)
    lm_head = None if cfg.tie_word_embeddings else mat(h, cfg.vocab_size)
    return Qwen3Weights(embed=embed, layers=tuple(layers), final_norm=norm(h), lm_head=lm_head)


def quantize_expert_tables(weights, expert_format: str):
    """The same weights with every MoE layer's routed expert tables (`gate_up` [E, H, 2I], `down` [E, I, H])
    quantized to `expert_format` ("dense": unchanged; "mxfp4" / "nvfp4": logical `[E, out, in]` FP4 tensors, as
    `convert-weights` writes them). Serves every family with Qwen-layout expert tables."""
    if expert_format == "dense":
        return weights
    if expert_format not in ("mxfp4", "nvfp4"):
        raise ValueError(f"expert_format must be 'dense', 'mxfp4' or 'nvfp4', got {expert_format!r}")
    quantize = {"mxfp4": quantize_mxfp4, "nvfp4": quantize_nvfp4}[expert_format]
    layers = []
    for layer in weights.layers:
        if hasattr(layer.mlp, "gate_up"):
            mlp = layer.mlp.replace(gate_up=quantize(jnp.swapaxes(layer.mlp.gate_up, 1, 2)),
                                    down=quantize(jnp.swapaxes(layer.mlp.down, 1, 2)))
            layer = layer.replace(mlp=mlp)
        layers.append(layer)
    return weights.replace(layers=tuple(layers))


def declare_weights(cfg: Qwen3Config) -> dict[str, Target]:
    """The declared arrays of Qwen3 / Qwen3-MoE weights (`models.declare`): read off `Qwen3Weights`."""
    return declare_tree(Qwen3Weights, cfg)


def attention_weights_from(g) -> AttentionWeights:
    """A Qwen3-style attention block from a getter of its flat target names (`attn.q`, ...)."""
    names = ("q", "k", "v", "o", "q_norm", "k_norm", "q_bias", "k_bias", "v_bias", "o_bias")
    return AttentionWeights(**{n: g(f"attn.{n}") for n in names})


def weights_from_flat(flat: dict[str, Any], cfg: Qwen3Config) -> Qwen3Weights:
    """The weight pytree from `{declared name: array}` (`models.declare.build_tree` over `Qwen3Weights`)."""
    return build_tree(Qwen3Weights, flat, cfg)
