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

`forward` has Qwen3's contract (`dflash_jax.models.qwen3.forward`): prefill, width-B extension and one-token
decoding in one function; rollback of a rejected suffix is `dflash_jax.cache.rollback`. It is composed of
layer-wise pieces (`block_context`, `attention_sublayer`, `mlp_input`, `route`, `mlp_sublayer`, `final_norm`)
that the host-offload path (`dflash_jax.offload`) also runs one layer at a time, with the per-expert leaves
(`EXPERT_FIELDS`: packed tables and biases) from a device slot pool (`forward(..., expert_pools=, slot_of=)`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.cache import KVCache, init_kv_cache, rollback
from dflash_jax.config import GptOssConfig
from dflash_jax.models.qwen3 import BlockContext, ForwardOutput, Routing, lm_head_logits
from dflash_jax.models.qwen3 import block_context as qwen3_block_context
from dflash_jax.nn.attention import cached_causal_attention
from dflash_jax.nn.decoder import LogitsMode, layer_taps, select_logits
from dflash_jax.nn.moe import clamped_swiglu, swiglu_experts, topk_softmax_router
from dflash_jax.nn.norms import rms_norm
from dflash_jax.nn.rope import apply_rope

__all__ = [
    "GptOssAttentionWeights",
    "GptOssMoEWeights",
    "GptOssLayerWeights",
    "GptOssWeights",
    "ForwardOutput",
    "EXPERT_FIELDS",
    "init_cache",
    "block_context",
    "attention_sublayer",
    "mlp_input",
    "route",
    "mlp_sublayer",
    "final_norm",
    "forward",
    "rollback",
    "forward_jit",
]


@struct.dataclass
class GptOssAttentionWeights:
    q: jax.Array  # [H, Hq*d]
    k: jax.Array  # [H, Hkv*d]
    v: jax.Array  # [H, Hkv*d]
    o: jax.Array  # [Hq*d, H]
    sinks: jax.Array  # [Hq]
    q_bias: jax.Array | None = None
    k_bias: jax.Array | None = None
    v_bias: jax.Array | None = None
    o_bias: jax.Array | None = None


@struct.dataclass
class GptOssMoEWeights:
    router: jax.Array  # [H, E]
    router_bias: jax.Array  # [E]
    gate_up: Any  # MXFP4Tensor logical [E, 2I, H] or dense [E, H, 2I]; gate half first
    gate_up_bias: jax.Array  # [E, 2I], gate half first
    down: Any  # MXFP4Tensor logical [E, H, I] or dense [E, I, H]
    down_bias: jax.Array  # [E, H]


@struct.dataclass
class GptOssLayerWeights:
    input_norm: jax.Array  # [H] fp32
    attn: GptOssAttentionWeights
    post_norm: jax.Array  # [H] fp32
    mlp: GptOssMoEWeights


@struct.dataclass
class GptOssWeights:
    embed: jax.Array  # [V, H]
    layers: tuple[GptOssLayerWeights, ...]
    final_norm: jax.Array  # [H] fp32
    lm_head: jax.Array | None  # [H, V]; None when tied to the embedding


def init_cache(cfg: GptOssConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    return init_kv_cache(num_layers=cfg.num_layers, batch=batch, max_len=max_len, num_kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, dtype=dtype)


def _linear(x, w, b):
    y = x @ w
    return y if b is None else y + b


def _norm(x, w, cfg: GptOssConfig):
    return rms_norm(x, w, cfg.rms_norm_eps, scale_in_fp32=True)


def _attention(h, attn: GptOssAttentionWeights, k_buf, v_buf, positions, cos, sin, window, cfg: GptOssConfig):
    b, t, _ = h.shape
    d = cfg.head_dim
    q = apply_rope(_linear(h, attn.q, attn.q_bias).reshape(b, t, cfg.num_heads, d), cos, sin)
    k = apply_rope(_linear(h, attn.k, attn.k_bias).reshape(b, t, cfg.num_kv_heads, d), cos, sin)
    v = _linear(h, attn.v, attn.v_bias).reshape(b, t, cfg.num_kv_heads, d)
    out, k_buf, v_buf = cached_causal_attention(
        q, k, v, k_buf, v_buf, positions, window=window, scale=d**-0.5, sinks=attn.sinks
    )
    return _linear(out.reshape(b, t, -1), attn.o, attn.o_bias), k_buf, v_buf


# The layer-wise pieces below compose `forward`; the host-offload path (`dflash_jax.offload`) calls them one
# layer at a time so that it can read a layer's exact routing before that layer's experts run. They share
# `qwen3`'s shapes: `BlockContext`, `Routing`, h = the post-attention-normed rows [b*T, H].

# The per-expert fields of `GptOssMoEWeights`, in the order of an expert pool `(gate_up, down, gate_up_bias,
# down_bias)` (`forward(expert_pools=...)`, `dflash_jax.offload`).
EXPERT_FIELDS = ("gate_up", "down", "gate_up_bias", "down_bias")


def block_context(
    weights: GptOssWeights, tokens: jax.Array, cache: KVCache, cfg: GptOssConfig, num_valid: jax.Array | None = None
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
        _norm(x, layer.input_norm, cfg), layer.attn, k_buf, v_buf, ctx.positions, ctx.cos, ctx.sin, window, cfg)
    return x + attn_out, k_buf, v_buf


def mlp_input(layer: GptOssLayerWeights, x: jax.Array, cfg: GptOssConfig) -> jax.Array:
    """`post_norm(x)` flattened to [b*T, H]: the router's and the experts' input."""
    return _norm(x, layer.post_norm, cfg).reshape(-1, x.shape[-1])


def route(mlp: GptOssMoEWeights, h: jax.Array, cfg: GptOssConfig) -> Routing:
    """The exact routing of `h` [b*T, H]: top-k of the biased logits, softmax over those k."""
    weights, experts, logits = topk_softmax_router(h, mlp.router, mlp.router_bias, cfg.moe.top_k)
    return Routing(weights=weights, experts=experts, logits=logits)


def mlp_sublayer(
    layer: GptOssLayerWeights, x: jax.Array, h: jax.Array, cfg: GptOssConfig, implementation: str = "auto", *,
    routing: Routing | None = None, gate_up=None, down=None, gate_up_bias=None, down_bias=None,
    slot_of: jax.Array | None = None,
) -> jax.Array:
    """`x + moe(h)` with h = `mlp_input(layer, x)`: the experts run on `routing` (computed here when None) over
    the operands `gate_up` / `down` / `gate_up_bias` / `down_bias` (default: the layer's own tables), a slot
    pool `[S, ...]` addressed through `slot_of` [E] int32 (identity when None; `nn.moe.swiglu_experts`)."""
    mlp = layer.mlp
    routing = route(mlp, h, cfg) if routing is None else routing
    pick = lambda given, own: own if given is None else given  # noqa: E731
    out = swiglu_experts(
        h, routing.experts, routing.weights, pick(gate_up, mlp.gate_up), pick(down, mlp.down),
        gate_up_bias=pick(gate_up_bias, mlp.gate_up_bias), down_bias=pick(down_bias, mlp.down_bias),
        activation=functools.partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit),
        slot_of=slot_of, implementation=implementation,
    )
    return x + out.reshape(x.shape)


def final_norm(weights: GptOssWeights, x: jax.Array, cfg: GptOssConfig) -> jax.Array:
    """The final RMSNorm of the last layer's output (what the logits and the last layer's tap read)."""
    return _norm(x, weights.final_norm, cfg)


def forward(
    weights: GptOssWeights,
    tokens: jax.Array,
    cache: KVCache,
    cfg: GptOssConfig,
    *,
    num_valid: jax.Array | None = None,
    tap_layers: tuple[int, ...] = (),
    logits: LogitsMode = "all",
    implementation: str = "auto",
    return_router_logits: bool = False,
    expert_pools: tuple | None = None,
    slot_of: tuple | None = None,
) -> ForwardOutput:
    """Runs `tokens` [b, T] at positions `cache.lengths[b] + [0, T)`; see `dflash_jax.models.qwen3.forward`
    for the contract (num_valid = right padding, tap_layers = DFlash taps `h[i+1]`, logits modes,
    return_router_logits = each layer's biased router logits [b, T, E] fp32, expert_pools / slot_of = per-layer
    slot pools `(gate_up, down, gate_up_bias, down_bias)` `[S, ...]` and slot tables [E])."""
    x, ctx = block_context(weights, tokens, cache, cfg, num_valid)
    b, t = tokens.shape
    outputs, routers, router_logits, new_k, new_v = [], [], [], [], []
    for i, layer in enumerate(weights.layers):
        x, k_buf, v_buf = attention_sublayer(layer, x, cache.keys[i], cache.values[i], ctx, cfg.layer_windows[i], cfg)
        new_k.append(k_buf)
        new_v.append(v_buf)
        h = mlp_input(layer, x, cfg)
        routing = route(layer.mlp, h, cfg)
        pool = expert_pools[i] if expert_pools is not None else None
        x = mlp_sublayer(layer, x, h, cfg, implementation, routing=routing,
                         **({} if pool is None else dict(zip(EXPERT_FIELDS, pool))),
                         slot_of=None if slot_of is None else slot_of[i])
        outputs.append(x)
        routers.append(routing.experts.reshape(b, t, -1))
        router_logits.append(routing.logits.reshape(b, t, -1))
    x = final_norm(weights, x, cfg)
    return ForwardOutput(
        logits=select_logits(x, ctx.num_valid, logits, functools.partial(lm_head_logits, weights)),
        taps=layer_taps(outputs, x, tap_layers),
        router_experts=tuple(routers),
        cache=KVCache(keys=tuple(new_k), values=tuple(new_v), lengths=ctx.starts + ctx.num_valid.astype(jnp.int32)),
        router_logits=tuple(router_logits) if return_router_logits else None,
    )


forward_jit = jax.jit(
    forward, static_argnames=("cfg", "tap_layers", "logits", "implementation", "return_router_logits"))
