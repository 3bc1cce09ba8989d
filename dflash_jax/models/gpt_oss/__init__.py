"""gpt-oss (gpt-oss-20b, gpt-oss-120b) as a pure function over a weight pytree.

Per layer (pre-norm residual blocks; RMSNorm eps 1e-5 with fp32 weights scaling the fp32 normalized value):

  h = RMSNorm_in(x)
  q, k, v = h Wq + bq, h Wk + bk, h Wv + bv;  q, k = YaRN-RoPE(q), YaRN-RoPE(k)   (no q/k norm)
  x = x + softmax([q k^T / sqrt(d) + mask | sink_h])[:, :-1] v Wo + bo
      mask: causal, plus a sliding window W on `sliding_attention` layers (q - k < W, the token itself
      included); sink_h: one learned logit per query head, an extra column whose probability is dropped
  h = RMSNorm_post(x);  l = h W_r + b_r;  (w, e) = softmax over the top-k of l
  x = x + sum_j w_j (act(h W1_e + b1_e) W2_e + b2_e)     act = `nn.moe.clamped_swiglu`

Expert tables: `gate_up` is either an `MXFP4Tensor` of logical shape [E, 2I, H] (the release's packed
[out, in] layout, kept packed in memory and dequantized inside the grouped matmul) or a dense [E, H, 2I]
array; `down` is an `MXFP4Tensor` [E, H, I] or dense [E, I, H]. The release interleaves gate and up
(gate = even rows/columns, up = odd); the converter de-interleaves them once at load time (a row
permutation of the packed blocks, exact and cheap) so that every family shares the "gate half first"
convention of `nn.moe.swiglu_experts`; the biases `gate_up_bias` [E, 2I] are permuted the same way.

The registered `GPT_OSS` family runs these pieces through the one decoder loop (`models.decoder`): `forward`
has Qwen3's contract (prefill, width-B extension and one-token decoding in one function); rollback of a
rejected suffix is a counter move. Its per-expert leaves (`expert_fields`: packed tables and biases) may be a
device slot pool addressed through the layer's `slot_of` (expert offload).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax.models import decoder
from dflash_jax.models.decoder import BlockContext, ForwardOutput, RouterWeights, Routing, lm_head_logits
from dflash_jax.models.declare import Target, build_tree, declare_tree, layers, param, sub
from dflash_jax.models.family import ModelFamily, register
from dflash_jax.models.gpt_oss.config import GptOssConfig, parse_hf_config, tiny_config
from dflash_jax.models.qwen3 import block_context as qwen3_block_context
from dflash_jax.nn.attention import cached_causal_attention
from dflash_jax.nn.moe import clamped_swiglu, swiglu_experts, topk_softmax_router
from dflash_jax.nn.norms import rms_norm
from dflash_jax.nn.rope import apply_rope
from dflash_jax.quant import MXFP4_BLOCK_SIZE, MXFP4Tensor, quantize_mxfp4_np

__all__ = [
    "GptOssAttentionWeights",
    "GptOssMoEWeights",
    "GptOssLayerWeights",
    "GptOssWeights",
    "ForwardOutput",
    "GPT_OSS",
    "init_cache",
    "block_context",
    "attention_sublayer",
    "mlp_input",
    "route",
    "route_rows",
    "mlp_sublayer",
    "final_norm",
    "forward",
    "rollback",
    "forward_jit",
    "random_weights",
    "tiny_config",
    "declare_weights",
    "weights_from_flat",
]


# The weight dataclasses are the declarations (`models.declare`): every array field states its shape from the
# config (norms fp32, as released); the expert tables declare themselves packed (MXFP4 parts) or dense per
# checkpoint (`_expert_table`). `declare_weights` / `weights_from_flat` read them off the types.
def _biased(c) -> bool:
    return c.attention_bias


@struct.dataclass
class GptOssAttentionWeights:
    q: jax.Array = param(lambda c: (c.hidden_size, c.num_heads * c.head_dim))  # [H, Hq*d]
    k: jax.Array = param(lambda c: (c.hidden_size, c.num_kv_heads * c.head_dim))  # [H, Hkv*d]
    v: jax.Array = param(lambda c: (c.hidden_size, c.num_kv_heads * c.head_dim))  # [H, Hkv*d]
    o: jax.Array = param(lambda c: (c.num_heads * c.head_dim, c.hidden_size))  # [Hq*d, H]
    sinks: jax.Array = param(lambda c: (c.num_heads,))  # [Hq]
    q_bias: jax.Array | None = param(lambda c: (c.num_heads * c.head_dim,), when=_biased)
    k_bias: jax.Array | None = param(lambda c: (c.num_kv_heads * c.head_dim,), when=_biased)
    v_bias: jax.Array | None = param(lambda c: (c.num_kv_heads * c.head_dim,), when=_biased)
    o_bias: jax.Array | None = param(lambda c: (c.hidden_size,), when=_biased)


def _expert_table(proj: str):
    """The declaration of one expert table (`proj` "gate_up" / "down"): packed MXFP4 parts of logical
    `[E, out, in]` (the release's form; declared `#blocks` / `#scales`), or dense `[E, in, out]`, as the
    `packed(layer, proj)` option of `declare_weights` says (default: packed)."""

    def declare(c, layer, options):
        e, inter, h = c.moe.num_experts, c.moe.intermediate_size, c.hidden_size
        rows, cols = (2 * inter, h) if proj == "gate_up" else (h, inter)
        packed = options.get("packed")
        if packed is not None and not packed(layer, proj):
            return {"": Target((e, cols, rows))}
        groups = cols // MXFP4_BLOCK_SIZE
        return {"#blocks": Target((e, rows, groups, MXFP4_BLOCK_SIZE // 2), dtype=np.uint8),
                "#scales": Target((e, rows, groups), dtype=np.uint8)}

    return declare


@struct.dataclass
class GptOssMoEWeights:
    router: jax.Array = param(lambda c: (c.hidden_size, c.moe.num_experts))  # [H, E]
    router_bias: jax.Array = param(lambda c: (c.moe.num_experts,))  # [E]
    # MXFP4Tensor logical [E, 2I, H] or dense [E, H, 2I]; gate half first
    gate_up: Any = param(None, custom=_expert_table("gate_up"))
    gate_up_bias: jax.Array = param(lambda c: (c.moe.num_experts, 2 * c.moe.intermediate_size))  # [E, 2I], gate first
    down: Any = param(None, custom=_expert_table("down"))  # MXFP4Tensor logical [E, H, I] or dense [E, I, H]
    down_bias: jax.Array = param(lambda c: (c.moe.num_experts, c.hidden_size))  # [E, H]
    slot_of: jax.Array | None = None  # [E] int32 slot of each expert in a pool; None: the tables are whole


@struct.dataclass
class GptOssLayerWeights:
    input_norm: jax.Array = param(lambda c: (c.hidden_size,), dtype=np.float32)  # [H] fp32
    attn: GptOssAttentionWeights = sub(GptOssAttentionWeights)
    post_norm: jax.Array = param(lambda c: (c.hidden_size,), dtype=np.float32)  # [H] fp32
    mlp: GptOssMoEWeights = sub(GptOssMoEWeights)


@struct.dataclass
class GptOssWeights:
    embed: jax.Array = param(lambda c: (c.vocab_size, c.hidden_size))  # [V, H]
    layers: tuple[GptOssLayerWeights, ...] = layers(GptOssLayerWeights)
    final_norm: jax.Array = param(lambda c: (c.hidden_size,), dtype=np.float32)  # [H] fp32
    lm_head: jax.Array | None = param(lambda c: (c.hidden_size, c.vocab_size),  # [H, V]; None when tied
                                      when=lambda c: not c.tie_word_embeddings)


def _linear(x, w, b):
    y = x @ w
    return y if b is None else y + b


def _norm(x, w, cfg: GptOssConfig):
    return rms_norm(x, w, cfg.rms_norm_eps, scale_in_fp32=True)


def _attention(h, attn: GptOssAttentionWeights, k_buf, v_buf, positions, cos, sin, window, cfg: GptOssConfig,
               tree_mask=None):
    b, t, _ = h.shape
    d = cfg.head_dim
    q = apply_rope(_linear(h, attn.q, attn.q_bias).reshape(b, t, cfg.num_heads, d), cos, sin)
    k = apply_rope(_linear(h, attn.k, attn.k_bias).reshape(b, t, cfg.num_kv_heads, d), cos, sin)
    v = _linear(h, attn.v, attn.v_bias).reshape(b, t, cfg.num_kv_heads, d)
    out, k_buf, v_buf = cached_causal_attention(
        q, k, v, k_buf, v_buf, positions, window=window, scale=d**-0.5, sinks=attn.sinks, tree_mask=tree_mask
    )
    return _linear(out.reshape(b, t, -1), attn.o, attn.o_bias), k_buf, v_buf


# The layer-wise pieces below are what the decoder loop runs (`GptOssFamily`); they share the shapes of every
# family: `BlockContext`, `Routing`, h = the post-attention-normed rows [b*T, H].


def block_context(
    weights: GptOssWeights, tokens: jax.Array, cache, cfg: GptOssConfig, num_valid: jax.Array | None = None
) -> tuple[jax.Array, BlockContext]:
    """The embedded block `x` [b, T, H] and its `BlockContext` (positions `cache.lengths + [0, T)`): the same
    as Qwen3's (gpt-oss's YaRN attention scaling lives in its RoPE tables)."""
    return qwen3_block_context(weights, tokens, cache, cfg, num_valid)


def attention_sublayer(
    layer: GptOssLayerWeights, x: jax.Array, k_buf: jax.Array, v_buf: jax.Array, ctx: BlockContext,
    window: int | None, cfg: GptOssConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`x + attn(input_norm(x))` (sinks, sliding `window` or full), writing the block's K/V rows at the cache
    lengths; returns (x, k_buf, v_buf)."""
    attn_out, k_buf, v_buf = _attention(
        _norm(x, layer.input_norm, cfg), layer.attn, k_buf, v_buf, ctx.positions, ctx.cos, ctx.sin, window, cfg,
        tree_mask=ctx.tree_mask)
    return x + attn_out, k_buf, v_buf


def attention_queries(layer: GptOssLayerWeights, x: jax.Array, ctx: BlockContext, window, cfg: GptOssConfig):
    """The post-RoPE queries [b, T, Hq, d] `attention_sublayer` attends with (the PFlash scorer's)."""
    h = _norm(x, layer.input_norm, cfg)
    b, t, _ = h.shape
    return apply_rope(_linear(h, layer.attn.q, layer.attn.q_bias).reshape(b, t, cfg.num_heads, cfg.head_dim),
                      ctx.cos, ctx.sin)


def mlp_input(layer: GptOssLayerWeights, x: jax.Array, cfg: GptOssConfig) -> jax.Array:
    """`post_norm(x)` flattened to [b*T, H]: the router's and the experts' input."""
    return _norm(x, layer.post_norm, cfg).reshape(-1, x.shape[-1])


def route(mlp: GptOssMoEWeights | RouterWeights, h: jax.Array, cfg: GptOssConfig, top_k: int | None = None
          ) -> Routing:
    """The exact routing of post-normed rows `h` [b*T, H]: top-k of the biased logits, softmax over those k;
    `top_k` defaults to the config's."""
    weights, experts, logits = topk_softmax_router(h, mlp.router, mlp.router_bias,
                                                   cfg.moe.top_k if top_k is None else top_k)
    return Routing(weights=weights, experts=experts, logits=logits, probs=weights)


def route_rows(router: RouterWeights, x: jax.Array, cfg: GptOssConfig, top_k: int) -> Routing:
    """The family's routing function (`ModelFamily.route_rows`): `route` of the post-attention-normed rows
    (fp32-scaled norm)."""
    return route(router, _norm(x, router.norm, cfg), cfg, top_k)


def mlp_sublayer(
    layer: GptOssLayerWeights, x: jax.Array, h: jax.Array, cfg: GptOssConfig, implementation: str = "auto", *,
    routing: Routing | None = None,
) -> jax.Array:
    """`x + moe(h)` with h = `mlp_input(layer, x)`: the experts run on `routing` (computed here when None) over
    the layer's tables and biases, a slot pool when `layer.mlp.slot_of` is set (`nn.moe.swiglu_experts`)."""
    mlp = layer.mlp
    routing = route(mlp, h, cfg) if routing is None else routing
    out = swiglu_experts(
        h, routing.experts, routing.weights, mlp.gate_up, mlp.down, gate_up_bias=mlp.gate_up_bias,
        down_bias=mlp.down_bias, activation=functools.partial(clamped_swiglu, alpha=cfg.swiglu_alpha,
                                                             limit=cfg.swiglu_limit),
        slot_of=mlp.slot_of, implementation=implementation,
    )
    return x + out.reshape(x.shape)


def final_norm(weights: GptOssWeights, x: jax.Array, cfg: GptOssConfig) -> jax.Array:
    """The final RMSNorm of the last layer's output (what the logits and the last layer's tap read)."""
    return _norm(x, weights.final_norm, cfg)



from dflash_jax.models.gpt_oss.hf import HF_TABLE  # noqa: E402  (the layout reads the declarations below at call time)


class GptOssFamily(ModelFamily):
    """gpt-oss: every layer MoE, alternating sliding / full attention with sinks, biased top-k router."""

    name = "gpt_oss"
    config_type, weights_type, moe_type = GptOssConfig, GptOssWeights, GptOssMoEWeights
    model_types = ("gpt_oss",)
    expert_fields = ("gate_up", "down", "gate_up_bias", "down_bias")
    parse_hf = staticmethod(parse_hf_config)
    hf_table = HF_TABLE
    draft_model_types = ("gpt_oss",)  # z-lab ships gpt-oss drafts with the target's config class

    def random_weights(self, cfg, key, dtype=jnp.float32, *, expert_format: str = "dense"):
        if expert_format not in ("dense", "mxfp4"):
            raise ValueError(f"gpt-oss experts are 'dense' or 'mxfp4' (the release's packed form), got "
                             f"{expert_format!r}")
        return random_weights(cfg, key, dtype, expert_format=expert_format)

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

    def router_of(self, layer):
        return RouterWeights(norm=layer.post_norm, router=layer.mlp.router, router_bias=layer.mlp.router_bias)


GPT_OSS = register(GptOssFamily())


def init_cache(cfg: GptOssConfig, batch: int, max_len: int, dtype=jnp.float32):
    return GPT_OSS.init_cache(cfg, batch, max_len, dtype)


forward, forward_jit = decoder.family_forwards(GPT_OSS)
rollback = GPT_OSS.rollback


def random_weights(cfg, key: jax.Array, dtype=jnp.float32, *, expert_format: str = "mxfp4"):
    """Random gpt-oss weights (scales as in `random_qwen3_weights`; sinks N(0, 1), biases N(0, 0.1^2));
    experts as MXFP4 tensors (`expert_format="mxfp4"`, the release's form) or dense tables ("dense").
    Norm weights are fp32, as in the release. Drawn with numpy on the host (fast for many small arrays)."""
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
        attn = GptOssAttentionWeights(
            q=mat(h, qd), k=mat(h, kvd), v=mat(h, kvd), o=mat(qd, h), sinks=vec(cfg.num_heads, scale=1.0),
            q_bias=vec(qd) if bias else None, k_bias=vec(kvd) if bias else None,
            v_bias=vec(kvd) if bias else None, o_bias=vec(h) if bias else None,
        )
        mlp = GptOssMoEWeights(
            router=mat(h, e), router_bias=vec(e), gate_up=experts(2 * inter, h), gate_up_bias=vec(e, 2 * inter),
            down=experts(h, inter), down_bias=vec(e, h),
        )
        layers.append(GptOssLayerWeights(input_norm=norm(h), attn=attn, post_norm=norm(h), mlp=mlp))
    embed = arr(rng.standard_normal((cfg.vocab_size, h)))
    lm_head = None if cfg.tie_word_embeddings else mat(h, cfg.vocab_size)
    return GptOssWeights(embed=embed, layers=tuple(layers), final_norm=norm(h), lm_head=lm_head)


def declare_weights(cfg: GptOssConfig, *, packed=None) -> dict[str, Target]:
    """The declared arrays of gpt-oss weights (`models.declare`), read off `GptOssWeights`. `packed(layer, proj)`:
    whether that expert table is kept MXFP4-packed (declared as `#blocks` / `#scales` parts, logical
    `[E, out, in]`) or dense `[E, in, out]`; default: packed, as in the release."""
    return declare_tree(GptOssWeights, cfg, packed=packed)


def weights_from_flat(flat: dict[str, Any], cfg: GptOssConfig) -> GptOssWeights:
    """The weight pytree from `{declared name: array}` (packed experts already joined into MXFP4Tensors)."""
    return build_tree(GptOssWeights, flat, cfg)
