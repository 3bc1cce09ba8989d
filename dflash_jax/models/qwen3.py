"""Dense Qwen3 and Qwen3-MoE decoders as pure functions over weight pytrees.

One function, `forward`, serves every use: prefill of a (right-padded) batch of prompts, extension of a
cache by a width-B speculative block, and plain one-token decoding. It writes the new K/V rows at each
sequence's current length, advances the lengths by the number of valid tokens, and returns the logits,
the requested hidden-state taps and the router choices. Rolling a speculative block back is
`dflash_jax.cache.rollback(cache, committed_lengths)`.

Weights are stored [in, out] so a projection is `x @ w`; expert tables are stacked per layer:
`gate_up [E, H, 2I]` (gate columns first) and `down [E, I, H]`.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.cache import KVCache, init_kv_cache
from dflash_jax.config import Qwen3Config
from dflash_jax.nn.attention import cached_causal_attention
from dflash_jax.nn.decoder import block_positions
from dflash_jax.nn.mlp import swiglu
from dflash_jax.nn.moe import softmax_topk_router, swiglu_experts
from dflash_jax.nn.norms import rms_norm
from dflash_jax.nn.rope import apply_rope, rope_cos_sin

LogitsMode = Literal["all", "last", "none"]


@struct.dataclass
class AttentionWeights:
    q: jax.Array  # [H, Hq*d]
    k: jax.Array  # [H, Hkv*d]
    v: jax.Array  # [H, Hkv*d]
    o: jax.Array  # [Hq*d, H]
    q_norm: jax.Array  # [d]
    k_norm: jax.Array  # [d]
    q_bias: jax.Array | None = None
    k_bias: jax.Array | None = None
    v_bias: jax.Array | None = None
    o_bias: jax.Array | None = None


@struct.dataclass
class MLPWeights:
    gate: jax.Array  # [H, I]
    up: jax.Array  # [H, I]
    down: jax.Array  # [I, H]


@struct.dataclass
class MoEWeights:
    router: jax.Array  # [H, E]
    gate_up: jax.Array  # [E, H, 2I]
    down: jax.Array  # [E, I, H]


@struct.dataclass
class DecoderLayerWeights:
    input_norm: jax.Array
    attn: AttentionWeights
    post_norm: jax.Array
    mlp: MLPWeights | MoEWeights


@struct.dataclass
class Qwen3Weights:
    embed: jax.Array  # [V, H]
    layers: tuple[DecoderLayerWeights, ...]
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None  # [H, V]; None when tied to the embedding


@struct.dataclass
class ForwardOutput:
    """logits: [b, T, V] ("all"), [b, V] ("last": each sequence's last valid token) or None, fp32.
    taps: `h[i+1]` for each requested layer i, [b, T, H] (as in HF `output_hidden_states`, the last
    layer's entry is taken after the final norm). router_experts: per layer [b, T, k] int32, None for
    dense layers. cache: the cache with the new rows written and lengths advanced by `num_valid`."""

    logits: jax.Array | None
    taps: tuple[jax.Array, ...]
    router_experts: tuple[jax.Array | None, ...]
    cache: KVCache
    router_logits: tuple[jax.Array | None, ...] | None = None  # per layer [b, T, E] fp32, when requested


def init_cache(cfg: Qwen3Config, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    return init_kv_cache(
        num_layers=cfg.num_layers,
        batch=batch,
        max_len=max_len,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,
    )


def embed_tokens(weights: Qwen3Weights, tokens: jax.Array) -> jax.Array:
    return jnp.take(weights.embed, tokens, axis=0)


def lm_head_logits(weights: Qwen3Weights, normed_hidden: jax.Array) -> jax.Array:
    """fp32 logits from final-normed hidden states (the tied embedding when there is no lm_head)."""
    head = weights.lm_head if weights.lm_head is not None else weights.embed.T
    return jnp.dot(normed_hidden, head, preferred_element_type=jnp.float32)


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


def _attention_block(x, attn, k_buf, v_buf, positions, starts, cos, sin, window, cfg: Qwen3Config):
    q, k, v = qkv_projection(
        x, attn, cos, sin, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        eps=cfg.rms_norm_eps,
    )
    out, k_buf, v_buf = cached_causal_attention(q, k, v, k_buf, v_buf, positions, window=window,
                                                scale=cfg.head_dim**-0.5)
    out = _project(out.reshape(x.shape[0], x.shape[1], -1), attn.o, attn.o_bias)
    return out, k_buf, v_buf


@struct.dataclass
class BlockContext:
    """What every layer of one forward shares: the block's absolute positions [b, T], where its rows are
    written (`starts` [b], the cache lengths before the call), the RoPE tables and `num_valid` [b]."""

    positions: jax.Array
    starts: jax.Array
    cos: jax.Array
    sin: jax.Array
    num_valid: jax.Array


@struct.dataclass
class Routing:
    """One MoE layer's exact routing of a block: `weights` [b*T, k] fp32 (renormalized when configured),
    `experts` [b*T, k] int32, router `logits` [b*T, E] fp32."""

    weights: jax.Array
    experts: jax.Array
    logits: jax.Array


# The layer-wise pieces below compose `forward`; the host-offload path (`dflash_jax.offload`) calls them one
# layer at a time so that it can read a layer's exact routing before that layer's experts run.

# The per-expert fields of `MoEWeights`, in the order of an expert pool `(gate_up, down)` (`forward(expert_pools=
# ...)`, `dflash_jax.offload`).
EXPERT_FIELDS = ("gate_up", "down")


def block_context(
    weights: Qwen3Weights, tokens: jax.Array, cache: KVCache, cfg: Qwen3Config, num_valid: jax.Array | None = None
) -> tuple[jax.Array, BlockContext]:
    """The embedded block `x` [b, T, H] and its `BlockContext` (positions `cache.lengths + [0, T)`)."""
    b, t = tokens.shape
    starts = cache.lengths
    if num_valid is None:
        num_valid = jnp.full((b,), t, jnp.int32)
    positions = block_positions(starts, t)
    x = embed_tokens(weights, tokens)
    cos, sin = rope_cos_sin(cfg.rope, positions, x.dtype)
    return x, BlockContext(positions=positions, starts=starts, cos=cos, sin=sin, num_valid=num_valid)


def attention_sublayer(
    layer: DecoderLayerWeights, x: jax.Array, k_buf: jax.Array, v_buf: jax.Array, ctx: BlockContext,
    window: int | None, cfg: Qwen3Config,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`x + attn(input_norm(x))`, writing the block's K/V rows at `ctx.starts`; returns (x, k_buf, v_buf)."""
    h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
    attn_out, k_buf, v_buf = _attention_block(
        h, layer.attn, k_buf, v_buf, ctx.positions, ctx.starts, ctx.cos, ctx.sin, window, cfg)
    return x + attn_out, k_buf, v_buf


def mlp_input(layer: DecoderLayerWeights, x: jax.Array, cfg: Qwen3Config) -> jax.Array:
    """`post_norm(x)` flattened to [b*T, H]: the router's and the experts' input."""
    return rms_norm(x, layer.post_norm, cfg.rms_norm_eps).reshape(-1, x.shape[-1])


def route(mlp: MoEWeights, h: jax.Array, cfg: Qwen3Config) -> Routing:
    """The exact routing of `h` [b*T, H] (fp32 softmax over all experts, top-k, renormalized if configured)."""
    weights, experts, logits = softmax_topk_router(h, mlp.router, cfg.moe.top_k, normalize=cfg.moe.norm_topk_prob)
    return Routing(weights=weights, experts=experts, logits=logits)


def mlp_sublayer(
    layer: DecoderLayerWeights, x: jax.Array, h: jax.Array, cfg: Qwen3Config, implementation: str = "auto", *,
    routing: Routing | None = None, gate_up=None, down=None, slot_of: jax.Array | None = None,
) -> jax.Array:
    """`x + mlp(h)` with h = `mlp_input(layer, x)`. For MoE layers the experts run on `routing` (computed here
    when None) over the weight operands `gate_up` / `down` (default: the layer's full tables), a slot pool
    `[S, ...]` addressed through `slot_of` [E] int32 (identity when None; see `nn.moe.swiglu_experts`)."""
    mlp = layer.mlp
    if isinstance(mlp, MLPWeights):
        return x + swiglu(h.reshape(x.shape), mlp.gate, mlp.up, mlp.down)
    routing = route(mlp, h, cfg) if routing is None else routing
    out = swiglu_experts(
        h, routing.experts, routing.weights, mlp.gate_up if gate_up is None else gate_up,
        mlp.down if down is None else down, slot_of=slot_of, implementation=implementation)
    return x + out.reshape(x.shape)


def forward(
    weights: Qwen3Weights,
    tokens: jax.Array,
    cache: KVCache,
    cfg: Qwen3Config,
    *,
    num_valid: jax.Array | None = None,
    tap_layers: tuple[int, ...] = (),
    logits: LogitsMode = "all",
    implementation: str = "auto",
    return_router_logits: bool = False,
    expert_pools: tuple | None = None,
    slot_of: tuple | None = None,
) -> ForwardOutput:
    """Runs `tokens` [b, T] at positions `cache.lengths[b] + [0, T)`.

    num_valid: [b] number of real tokens per row (right padding); defaults to T. Padded rows are computed
    and written past the new length, where no later query can see them.
    tap_layers: static tuple of layer indices i whose output `h[i+1]` to return (the DFlash taps).
    The cache must have room: `cache.lengths + T <= cache.max_len` (rows past the end are dropped).
    return_router_logits: also return each MoE layer's router logits (training's load-balancing loss).
    expert_pools / slot_of: optional per-layer overrides of the MoE weight operands: `expert_pools[i]` a
    `(gate_up, down)` slot pool `[S, ...]` (None: the layer's own tables) addressed through `slot_of[i]`
    [E] int32 (None: identity). Every routed expert must be resident in its layer's pool.
    """
    x, ctx = block_context(weights, tokens, cache, cfg, num_valid)
    b, t = tokens.shape
    taps: dict[int, jax.Array] = {}
    routers, router_logits = [], []
    new_k, new_v = [], []
    last = cfg.num_layers - 1
    for i, layer in enumerate(weights.layers):
        x, k_buf, v_buf = attention_sublayer(layer, x, cache.keys[i], cache.values[i], ctx, cfg.layer_windows[i], cfg)
        new_k.append(k_buf)
        new_v.append(v_buf)
        h = mlp_input(layer, x, cfg)
        routing = route(layer.mlp, h, cfg) if isinstance(layer.mlp, MoEWeights) else None
        pool = expert_pools[i] if expert_pools is not None else None
        x = mlp_sublayer(layer, x, h, cfg, implementation, routing=routing,
                         gate_up=None if pool is None else pool[0], down=None if pool is None else pool[1],
                         slot_of=None if slot_of is None else slot_of[i])
        routers.append(None if routing is None else routing.experts.reshape(b, t, -1))
        router_logits.append(None if routing is None else routing.logits.reshape(b, t, -1))
        if i in tap_layers and i != last:
            taps[i] = x
    x = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    if last in tap_layers:
        taps[last] = x
    out_logits = select_logits(weights, x, ctx.num_valid, logits)
    new_cache = KVCache(keys=tuple(new_k), values=tuple(new_v), lengths=ctx.starts + ctx.num_valid.astype(jnp.int32))
    return ForwardOutput(
        logits=out_logits,
        taps=tuple(taps[i] for i in tap_layers),
        router_experts=tuple(routers),
        cache=new_cache,
        router_logits=tuple(router_logits) if return_router_logits else None,
    )


def select_logits(weights: Qwen3Weights, normed: jax.Array, num_valid: jax.Array, logits: LogitsMode):
    """Logits of final-normed hidden states [b, T, H]: every row ("all"), each sequence's last valid row
    ("last", [b, V]) or None ("none")."""
    b, t = normed.shape[:2]
    if logits == "all":
        return lm_head_logits(weights, normed)
    if logits == "last":
        idx = jnp.clip(num_valid - 1, 0, t - 1)
        return lm_head_logits(weights, normed[jnp.arange(b), idx])
    if logits == "none":
        return None
    raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")


forward_jit = jax.jit(
    forward, static_argnames=("cfg", "tap_layers", "logits", "implementation", "return_router_logits"))


def rollback(cache: KVCache, lengths: jax.Array) -> KVCache:
    """Keeps each sequence's first `lengths` positions (slot = position: a counter move)."""
    from dflash_jax.cache import rollback as _rollback

    return _rollback(cache, lengths)
