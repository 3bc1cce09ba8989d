"""Qwen3.5-MoE: a hybrid of Gated DeltaNet (linear attention) and gated full-attention layers, MoE MLPs.

Layer i (pre-norm residual, zero-centred `rms(x) * (1 + w)` norms everywhere except the DeltaNet output):
  h = x + mixer_i(norm(x));   out = h + moe(norm(h))
  mixer = Gated DeltaNet (`linear_attention`) or gated attention (`full_attention`), see below;
  moe(x) = sum_j p_j SwiGLU_{e_j}(x) + sigmoid(x . w_sg) SwiGLU_shared(x), with (p, e) = top-k of
           softmax(x W_r), p renormalized to sum 1.

Gated attention: `q_proj` rows per head are `[q_h | gate_h]`; q and k get per-head zero-centred RMSNorm,
then RoPE on the first `rotary_dim` dims; `o = softmax(q k^T / sqrt(d)) v` (causal, GQA);
`out = o_proj(o * sigmoid(gate))`.

Gated DeltaNet: `[q|k|v] = silu(causal_conv(x W_qkv))` (depthwise, kernel K, no bias), q and k
L2-normalized (q also times dk^-0.5), `beta = sigmoid(x W_b)`, `g = -exp(A_log) softplus(x W_a + dt_bias)`,
the gated delta rule (`dflash_jax.nn.gated_deltanet`) per value head, then
`out = out_proj(rms_norm(o) * w * silu(x W_z))`.

Cache (`Qwen3_5Cache`): K/V buffers for the full-attention layers (slot = position, as `KVCache`), and for
each DeltaNet layer a `GatedDeltaNetCache`: the fp32 state at `linear_lengths` plus what the last extension
(up to `rollback_width` rows) wrote: its keys, log decays and pseudo-values against that state. A forward of
width T <= rollback_width starts from the committed state, keeps that state as the new checkpoint and keeps its
own T rows; so any later length inside the block is one contraction away (the chunked form's closing formula
over the accepted rows, `gated_deltanet.committed_state`: no replay of the delta rule). Rolling back is
therefore exact, inside jit and with static shapes: `rollback(cache, lengths)` commits each sequence's accepted
rows onto the checkpoint (and picks the conv tail out of the kept pre-conv rows). Moving `lengths` alone (e.g.
`dflash_jax.cache.rollback`) is also correct: the next forward commits the accepted rows before it runs.

Memory kept for rollback, per sequence and DeltaNet layer, W = rollback_width, C = 2 Hk dk + Hv dv:
  (K-1+W) C activations (conv window) + W (Hk dk + Hv dv + Hv) fp32 (k, u, g).
For Qwen3.5-35B-A3B (30 DeltaNet layers, Hk 16, Hv 32, dk = dv = 128, C 8192, bf16 activations), W = 16:
(19 * 8192 * 2 B + 16 * 6176 * 4 B) * 30 = 20.2 MiB, against 60 MiB for the recurrent states themselves
(32 * 128 * 128 * 4 B * 30) and 960 MiB for keeping every per-step state of a width-16 block. No second copy
of the state is kept: the checkpoint IS the state, and the committed state is rebuilt from it.

Token trees (`spec.tree`): a tree block of N nodes (`ctx.tree_mask`) runs every DeltaNet layer along each node's
root-to-node path: the conv reads the node's own ancestors (`_tree_conv`), and the paths run as a batch of N
sequences through the delta rule from the committed state (`_tree_delta_rule`), so every node's output is
exactly its path's. The nodes' rows are kept in node order (width >= N: `widen_rollback`); after acceptance
`commit_tree_path` puts the accepted path's rows in sequence order and `rollback` commits them (each node's
pseudo-values are its own path's, against the committed state, so the path's rows in order are a chain's).

The registered `QWEN3_5` family runs the layer-wise pieces (`block_context`, `layer_cache`, `mixer_sublayer`,
`mlp_input`, `route`, `mlp_sublayer`, `final_norm`, `assemble_cache`) through the one decoder loop
(`models.decoder`), resident or layer by layer (expert offload, the routed experts from a device slot pool
through the layer's `slot_of`); the shared expert and the DeltaNet states stay with the layer and the cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax.cache import SLOT_AXIS, kv_shape, move_slots
from dflash_jax.config import FULL_ATTENTION
from dflash_jax.models import decoder
from dflash_jax.models.decoder import BlockContext, ForwardOutput, LogitsMode, RouterWeights, Routing, lm_head_logits
from dflash_jax.models.declare import Target, build_tree, declare_tree, layers, param, sub
from dflash_jax.models.family import ModelFamily, register
from dflash_jax.models.qwen3_5.config import Qwen3_5Config, parse_hf_config, small_config, tiny_config
from dflash_jax.models.qwen3 import MLPWeights, quantize_expert_tables, softmax_routing
from dflash_jax.models.qwen3 import block_context as qwen3_block_context
from dflash_jax.nn import gated_deltanet as gdn
from dflash_jax.nn.attention import cached_causal_attention
from dflash_jax.nn.mlp import swiglu
from dflash_jax.nn.moe import swiglu_experts
from dflash_jax.nn.norms import rms_norm
from dflash_jax.nn.rope import apply_rope

DEFAULT_ROLLBACK_WIDTH = 16


# The weight dataclasses are the declarations (`models.declare`): every array field states its shape from the
# config; `declare_weights` / `weights_from_flat` read them off the types.
@struct.dataclass
class GatedAttentionWeights:
    q: jax.Array = param(lambda c: (c.hidden_size, c.num_heads * 2 * c.head_dim))  # [H, Hq*2d]: per head [q_h | gate_h]
    k: jax.Array = param(lambda c: (c.hidden_size, c.num_kv_heads * c.head_dim))  # [H, Hkv*d]
    v: jax.Array = param(lambda c: (c.hidden_size, c.num_kv_heads * c.head_dim))  # [H, Hkv*d]
    o: jax.Array = param(lambda c: (c.num_heads * c.head_dim, c.hidden_size))  # [Hq*d, H]
    q_norm: jax.Array = param(lambda c: (c.head_dim,))  # [d], zero-centred
    k_norm: jax.Array = param(lambda c: (c.head_dim,))  # [d], zero-centred


def _value_width(c) -> int:
    return c.linear_num_value_heads * c.linear_value_head_dim


@struct.dataclass
class GatedDeltaNetWeights:
    qkv: jax.Array = param(lambda c: (c.hidden_size, c.linear_conv_dim))  # [H, C], C = 2*Hk*dk + Hv*dv (q, k, v)
    z: jax.Array = param(lambda c: (c.hidden_size, _value_width(c)))  # [H, Hv*dv]
    b: jax.Array = param(lambda c: (c.hidden_size, c.linear_num_value_heads))  # [H, Hv]
    a: jax.Array = param(lambda c: (c.hidden_size, c.linear_num_value_heads))  # [H, Hv]
    # [K, C], stored [K, 1, C] (the release's depthwise [C, 1, K] transposed)
    conv: jax.Array = param(lambda c: (c.linear_conv_kernel, 1, c.linear_conv_dim),
                            held=lambda c: (c.linear_conv_kernel, c.linear_conv_dim))
    a_log: jax.Array = param(lambda c: (c.linear_num_value_heads,))  # [Hv]
    dt_bias: jax.Array = param(lambda c: (c.linear_num_value_heads,))  # [Hv]
    norm: jax.Array = param(lambda c: (c.linear_value_head_dim,))  # [dv], plain weight
    out: jax.Array = param(lambda c: (_value_width(c), c.hidden_size))  # [Hv*dv, H]


@dataclasses.dataclass(frozen=True)
class _SharedExpertShape:
    """What the shared expert's `MLPWeights` declarations read: its width as `intermediate_size`."""

    hidden_size: int
    intermediate_size: int


@struct.dataclass
class SparseMoEWeights:
    router: jax.Array = param(lambda c: (c.hidden_size, c.moe.num_experts))  # [H, E]
    gate_up: jax.Array = param(lambda c: (c.moe.num_experts, c.hidden_size, 2 * c.moe.intermediate_size),
                               coverage=lambda c: (c.moe.num_experts, 2))  # [E, H, 2I] (gate columns first)
    down: jax.Array = param(lambda c: (c.moe.num_experts, c.moe.intermediate_size, c.hidden_size),
                            coverage=lambda c: (c.moe.num_experts,))  # [E, I, H]
    shared: MLPWeights = sub(MLPWeights, view=lambda c: _SharedExpertShape(  # the shared SwiGLU expert
        hidden_size=c.hidden_size, intermediate_size=c.shared_expert_intermediate_size))
    shared_gate: jax.Array = param(lambda c: (c.hidden_size, 1))  # [H, 1]
    slot_of: jax.Array | None = None  # [E] int32 slot of each routed expert in a pool; None: the tables are whole


@struct.dataclass
class DecoderLayerWeights:
    input_norm: jax.Array = param(lambda c: (c.hidden_size,))
    mixer: GatedDeltaNetWeights | GatedAttentionWeights = sub(
        lambda c, i: GatedAttentionWeights if c.layer_types[i] == FULL_ATTENTION else GatedDeltaNetWeights)
    post_norm: jax.Array = param(lambda c: (c.hidden_size,))
    mlp: SparseMoEWeights = sub(SparseMoEWeights)


@struct.dataclass
class Qwen3_5Weights:
    embed: jax.Array = param(lambda c: (c.vocab_size, c.hidden_size))  # [V, H]
    layers: tuple[DecoderLayerWeights, ...] = layers(DecoderLayerWeights)
    final_norm: jax.Array = param(lambda c: (c.hidden_size,))  # [H], zero-centred
    lm_head: jax.Array | None = param(lambda c: (c.hidden_size, c.vocab_size),  # [H, V]; None when tied
                                      when=lambda c: not c.tie_word_embeddings)


@struct.dataclass
class Qwen3_5Cache:
    """keys/values: one `[b, Hkv, max_len, d]` buffer per full-attention layer (in layer order; `cache.kv_shape`).
    linear: one `GatedDeltaNetCache` per DeltaNet layer (in layer order), valid at `linear_lengths`.
    lengths: [b] committed tokens per sequence; `linear_lengths <= lengths <= linear_lengths + W`."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    linear: tuple[gdn.GatedDeltaNetCache, ...]
    lengths: jax.Array
    linear_lengths: jax.Array
    position_offset: jax.Array | None = None  # [b] int32: RoPE position = slot + offset (`cache.KVCache`)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[SLOT_AXIS]

    @property
    def rollback_width(self) -> int:
        return self.linear[0].width if self.linear else 0


def init_cache(
    cfg: Qwen3_5Config, batch: int, max_len: int, dtype=jnp.float32, *, rollback_width: int = DEFAULT_ROLLBACK_WIDTH
) -> Qwen3_5Cache:
    """An empty cache. `rollback_width` W: forwards of width <= W can be rolled back to any prefix (use the
    verify block size); a wider forward (a prefill) commits its rows. W = 0 keeps nothing (plain decoding).
    Set W >= the verify width: a verify wider than W commits, and rolling it back is then clamped (`rollback`)
    or, through a bare move of `lengths`, leaves the DeltaNet states ahead of the KV cache.
    """
    shape = kv_shape(batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    num_full = len(cfg.full_layers)
    linear = tuple(
        gdn.init_gated_deltanet_cache(
            batch=batch, num_key_heads=cfg.linear_num_key_heads, num_value_heads=cfg.linear_num_value_heads,
            key_head_dim=cfg.linear_key_head_dim, value_head_dim=cfg.linear_value_head_dim,
            conv_dim=cfg.linear_conv_dim, kernel_size=cfg.linear_conv_kernel, width=rollback_width, dtype=dtype,
        )
        for _ in cfg.linear_layers
    )
    zeros = jnp.zeros((batch,), jnp.int32)
    return Qwen3_5Cache(
        keys=tuple(jnp.zeros(shape, dtype) for _ in range(num_full)),
        values=tuple(jnp.zeros(shape, dtype) for _ in range(num_full)),
        linear=linear,
        lengths=zeros,
        linear_lengths=zeros,
    )


def _norm(x, w, cfg: Qwen3_5Config):
    return rms_norm(x, w, cfg.rms_norm_eps, zero_centered=True)


def _gated_attention(x, w: GatedAttentionWeights, k_buf, v_buf, positions, starts, cos, sin, cfg: Qwen3_5Config,
                     tree_mask=None):
    b, t, _ = x.shape
    d = cfg.head_dim
    q_and_gate = (x @ w.q).reshape(b, t, cfg.num_heads, 2 * d)
    q, gate = q_and_gate[..., :d], q_and_gate[..., d:].reshape(b, t, cfg.num_heads * d)
    k = (x @ w.k).reshape(b, t, cfg.num_kv_heads, d)
    v = (x @ w.v).reshape(b, t, cfg.num_kv_heads, d)
    q = apply_rope(_norm(q, w.q_norm, cfg), cos, sin)
    k = apply_rope(_norm(k, w.k_norm, cfg), cos, sin)
    out, k_buf, v_buf = cached_causal_attention(q, k, v, k_buf, v_buf, positions, window=None, scale=d**-0.5,
                                                tree_mask=tree_mask)
    out = out.reshape(b, t, -1)
    return (out * jax.nn.sigmoid(gate)) @ w.o, k_buf, v_buf


def tree_paths(mask: jax.Array, depths: jax.Array) -> jax.Array:
    """[b, N, N] int32: `paths[b, t, j]` = node t's ancestor at depth j (t itself for j >= depth(t)), from a
    token tree's ancestor-or-self mask [b, N, N] and node depths [b, N]."""
    n = mask.shape[-1]
    levels = jnp.arange(n, dtype=depths.dtype)
    sel = mask[:, :, None, :] & (depths[:, None, None, :] == levels[None, None, :, None])  # [b, t, j, u]
    own = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :, None], sel.shape[:3])
    return jnp.where(sel.any(-1), jnp.argmax(sel, axis=-1).astype(jnp.int32), own)


def _tree_conv(tail, mixed, paths, depths, conv_w):
    """The causal conv of every tree node along its own path: node t at depth d sees the pre-conv rows of its
    ancestors at depths d-K+1 .. d, and the committed tail for depths below 0. tail [b, K-1, C], mixed
    [b, N, C] -> [b, N, C] fp32."""
    b, n, c = mixed.shape
    ksize = conv_w.shape[0]
    rows = jnp.concatenate([tail, mixed.astype(tail.dtype)], axis=1)  # [b, K-1+N, C]
    at = depths[:, :, None] - (ksize - 1) + jnp.arange(ksize, dtype=depths.dtype)  # [b, N, K] depth of each tap
    anc = jnp.take_along_axis(paths, jnp.clip(at, 0, n - 1), axis=2)
    idx = jnp.where(at >= 0, ksize - 1 + anc, ksize - 1 + at)
    window = jnp.take_along_axis(rows, idx.reshape(b, n * ksize, 1), axis=1).reshape(b * n, ksize, c)
    return gdn.causal_depthwise_conv(window, conv_w).reshape(b, n, c)


def _tree_delta_rule(q, k, v, g, beta, state, paths, depths):
    """The gated delta rule along a token tree, exactly: every node's root-to-node path runs as one sequence of
    a batch (steps past the node masked), from the committed state; node t's output and pseudo-value are its
    path's at depth(t). q, k [b, N, Hk, dk]; v [b, N, Hv, dv]; g, beta [b, N, Hv]; state [b, Hv, dk, dv] ->
    (o, u), each [b, N, Hv, dv]."""
    b, n = paths.shape[:2]
    rows = jnp.arange(b)[:, None, None]

    def along(a):  # [b, N, ...] -> [b*N, N, ...]: node t's path, by depth
        return a[rows, paths].reshape((b * n, n) + a.shape[2:])

    gp, bp = gdn.mask_steps(along(g), along(beta), (depths + 1).reshape(-1))
    o, _, u = gdn.gated_delta_rule(along(q), along(k), along(v), gp, bp, jnp.repeat(state, n, axis=0),
                                   chunk_size=max(gdn.CHUNK, n), values=True)

    def at_node(a):  # [b*N, N, ...] -> [b, N, ...]: node t's path at depth(t)
        a = a.reshape((b, n, n) + a.shape[2:])
        return jnp.take_along_axis(a, depths[:, :, None, None, None], axis=2)[:, :, 0]

    return at_node(o), at_node(u)


def deltanet_mixer(x, w: GatedDeltaNetWeights, lin: gdn.GatedDeltaNetCache, steps, num_valid, cfg: Qwen3_5Config,
                    tree=None):
    """One DeltaNet layer on x [b, T, H]; returns (out, new layer cache). `steps` = rows of the kept extension
    that are committed (lengths - linear_lengths). `tree`: (ancestor mask [b, T, T], depths [b, T]) when the
    block is a token tree: each node's conv window and delta-rule state follow its own root-to-node path, and
    the kept rows are the nodes' (in node order; `commit_tree_path` puts the accepted path's rows in order)."""
    b, t, _ = x.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    ksize = cfg.linear_conv_kernel
    state, tail = gdn.committed_state(lin, steps)
    mixed = x @ w.qkv  # [b, T, C] pre-conv rows
    window = jnp.concatenate([tail, mixed.astype(tail.dtype)], axis=1)
    if tree is None:
        conv = gdn.causal_depthwise_conv(window, w.conv)
    else:
        if t > lin.width:
            raise ValueError(f"a token tree of {t} nodes needs a DeltaNet rollback width >= {t}, the cache has "
                             f"{lin.width} (`widen_rollback`)")
        paths = tree_paths(*tree)
        conv = _tree_conv(tail, mixed, paths, tree[1], w.conv)
    conv = jax.nn.silu(conv).astype(x.dtype)
    q = conv[..., : hk * dk].reshape(b, t, hk, dk)
    k = conv[..., hk * dk : 2 * hk * dk].reshape(b, t, hk, dk)
    v = conv[..., 2 * hk * dk :].reshape(b, t, hv, dv).astype(lin.u.dtype)
    q = gdn.l2_normalize(q) * dk**-0.5
    k = gdn.l2_normalize(k)
    g, beta = gdn.decay_and_beta(x @ w.a, x @ w.b, w.a_log, w.dt_bias)
    g, beta = gdn.mask_steps(g, beta, num_valid)  # padded rows leave the state alone
    width = lin.width
    keep = t <= width  # keep the checkpoint and this block's rows: any prefix can be committed
    if tree is not None:
        (o, u), new_state = _tree_delta_rule(q, k, v, g, beta, state, paths, tree[1]), state
    elif keep:  # one chunk: the pseudo-values against the checkpoint
        o, new_state, u = gdn.gated_delta_rule(q, k, v, g, beta, state, chunk_size=max(gdn.CHUNK, t), values=True)
    else:
        o, new_state = gdn.gated_delta_rule(q, k, v, g, beta, state)
    z = (x @ w.z).reshape(b, t, hv, dv)
    out = gdn.gated_rms_norm(o.astype(x.dtype), z, w.norm, cfg.rms_norm_eps).reshape(b, t, hv * dv) @ w.out

    if keep:
        pad = lambda a: jnp.pad(a, [(0, 0), (0, width - t)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        new = gdn.GatedDeltaNetCache(state=state, conv_window=pad(window), k=pad(k), u=pad(u), g=pad(g))
    else:  # too wide to keep: commit the valid rows
        new_tail = gdn.conv_tail(window, num_valid, ksize)
        new = lin.replace(state=new_state, conv_window=gdn.with_tail(lin.conv_window, new_tail))
    return out, new


# The layer-wise pieces below are what the decoder loop runs (`Qwen3_5Family`).


def block_context(
    weights: Qwen3_5Weights, tokens: jax.Array, cache: Qwen3_5Cache, cfg: Qwen3_5Config,
    num_valid: jax.Array | None = None,
) -> tuple[jax.Array, BlockContext]:
    """The embedded block `x` [b, T, H] and its `BlockContext` (positions `cache.lengths + [0, T)`)."""
    x, base = qwen3_block_context(weights, tokens, cache, cfg, num_valid)
    return x, base.replace(steps=base.starts - cache.linear_lengths)


def layer_cache(cache: Qwen3_5Cache, i: int, cfg: Qwen3_5Config):
    """Layer i's part of the cache: `(k_buf, v_buf)` of a full-attention layer, the `GatedDeltaNetCache` of a
    DeltaNet layer."""
    if cfg.layer_types[i] == FULL_ATTENTION:
        j = cfg.full_layers.index(i)
        return cache.keys[j], cache.values[j]
    return cache.linear[cfg.linear_layers.index(i)]


def mixer_sublayer(
    layer: DecoderLayerWeights, x: jax.Array, state, ctx: BlockContext, layer_type: str, cfg: Qwen3_5Config
):
    """`x + mixer(input_norm(x))` for a layer of `layer_type`; `state` = the layer's cache part (`layer_cache`).
    Returns (x, the layer's new cache part)."""
    h = _norm(x, layer.input_norm, cfg)
    if layer_type == FULL_ATTENTION:
        k_buf, v_buf = state
        mixed, k_buf, v_buf = _gated_attention(
            h, layer.mixer, k_buf, v_buf, ctx.positions, ctx.starts, ctx.cos, ctx.sin, cfg, tree_mask=ctx.tree_mask)
        return x + mixed, (k_buf, v_buf)
    tree = None if ctx.tree_mask is None else (ctx.tree_mask, ctx.positions - ctx.starts[:, None])
    mixed, lin = deltanet_mixer(h, layer.mixer, state, ctx.steps, ctx.num_valid, cfg, tree=tree)
    return x + mixed, lin


def attention_queries(layer: DecoderLayerWeights, x: jax.Array, ctx: BlockContext, layer_type: str,
                      cfg: Qwen3_5Config):
    """The post-RoPE queries [b, T, Hq, d] a full-attention layer attends with (the PFlash scorer's); None for
    a DeltaNet layer."""
    if layer_type != FULL_ATTENTION:
        return None
    h, w, d = _norm(x, layer.input_norm, cfg), layer.mixer, cfg.head_dim
    b, t, _ = h.shape
    q = (h @ w.q).reshape(b, t, cfg.num_heads, 2 * d)[..., :d]
    return apply_rope(_norm(q, w.q_norm, cfg), ctx.cos, ctx.sin)


def assemble_cache(cache: Qwen3_5Cache, ctx: BlockContext, states, cfg: Qwen3_5Config) -> Qwen3_5Cache:
    """The cache after a forward of width T from every layer's new cache part (`mixer_sublayer`, in layer
    order): lengths advanced by `num_valid`; the DeltaNet checkpoint stays at the old lengths when the block was
    kept for rollback (T <= rollback_width) and moves with them otherwise (the forward committed)."""
    t = ctx.positions.shape[1]
    full = [s for s, kind in zip(states, cfg.layer_types) if kind == FULL_ATTENTION]
    lengths = ctx.starts + ctx.num_valid
    return Qwen3_5Cache(
        keys=tuple(k for k, _ in full),
        values=tuple(v for _, v in full),
        linear=tuple(s for s, kind in zip(states, cfg.layer_types) if kind != FULL_ATTENTION),
        lengths=lengths,
        linear_lengths=ctx.starts if t <= cache.rollback_width else lengths,
    )


def mlp_input(layer: DecoderLayerWeights, x: jax.Array, cfg: Qwen3_5Config) -> jax.Array:
    """`post_norm(x)` flattened to [b*T, H]: the router's, the experts' and the shared expert's input."""
    return _norm(x, layer.post_norm, cfg).reshape(-1, x.shape[-1])


def route(mlp: SparseMoEWeights | RouterWeights, h: jax.Array, cfg: Qwen3_5Config, top_k: int | None = None
          ) -> Routing:
    """The exact routing of post-normed rows `h` [b*T, H]: fp32 softmax over all experts, top-k, renormalized;
    `top_k` defaults to the config's."""
    return softmax_routing(h, mlp.router, cfg.moe.top_k if top_k is None else top_k, True)


def route_rows(router: RouterWeights, x: jax.Array, cfg: Qwen3_5Config, top_k: int) -> Routing:
    """The family's routing function (`ModelFamily.route_rows`): `route` of the post-attention-normed rows
    (zero-centred norm)."""
    return route(router, _norm(x, router.norm, cfg), cfg, top_k)


def mlp_sublayer(
    layer: DecoderLayerWeights, x: jax.Array, h: jax.Array, cfg: Qwen3_5Config, implementation: str = "auto", *,
    routing: Routing | None = None,
) -> jax.Array:
    """`x + routed(h) + sigmoid(h w_sg) shared(h)` with h = `mlp_input(layer, x)`. The routed experts run on
    `routing` (computed here when None) over the layer's tables, a slot pool when `layer.mlp.slot_of` is set;
    the shared expert is always the layer's own."""
    mlp = layer.mlp
    routing = route(mlp, h, cfg) if routing is None else routing
    routed = swiglu_experts(h, routing.experts, routing.weights, mlp.gate_up, mlp.down, slot_of=mlp.slot_of,
                            implementation=implementation)
    shared = swiglu(h, mlp.shared.gate, mlp.shared.up, mlp.shared.down)
    shared = jax.nn.sigmoid(h @ mlp.shared_gate) * shared
    return x + (routed + shared).reshape(x.shape)


def final_norm(weights: Qwen3_5Weights, x: jax.Array, cfg: Qwen3_5Config) -> jax.Array:
    """The final (zero-centred) RMSNorm of the last layer's output."""
    return _norm(x, weights.final_norm, cfg)



from dflash_jax.models.qwen3_5.hf import HF_TABLE, export_hf  # noqa: E402  (the layout reads the weight types above)


class Qwen3_5Family(ModelFamily):
    """Qwen3.5-MoE: DeltaNet and gated-attention mixers, MoE with a shared expert, exact in-jit rollback."""

    name = "qwen3_5"
    config_type, weights_type, moe_type = Qwen3_5Config, Qwen3_5Weights, SparseMoEWeights
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    expert_fields = ("gate_up", "down")
    parse_hf = staticmethod(parse_hf_config)
    hf_table = HF_TABLE
    export_hf = staticmethod(export_hf)
    small_config_fn = staticmethod(small_config)
    needs_rollback_width = True

    def init_cache(self, cfg, batch, max_len, dtype=jnp.float32, *, verify_width: int = 0):
        return init_cache(cfg, batch, max_len, dtype, rollback_width=verify_width)

    def rollback(self, cache, lengths):
        return rollback(cache, lengths)

    def random_weights(self, cfg, key, dtype=jnp.float32, *, expert_format: str = "dense"):
        return quantize_expert_tables(random_weights(cfg, key, dtype), expert_format)

    def linear_router(self, router):
        linear = super().linear_router(router)
        return linear.replace(norm=1.0 + linear.norm)  # the zero-centred norm scales by 1 + w

    block_context_fn = staticmethod(block_context)
    attention_queries_fn = staticmethod(attention_queries)
    mlp_input_fn = staticmethod(mlp_input)
    route_rows_fn = staticmethod(route_rows)
    tiny_config_fn = staticmethod(tiny_config)
    mlp_fn = staticmethod(mlp_sublayer)
    final_norm_fn = staticmethod(final_norm)
    declare_fn = staticmethod(lambda cfg: declare_weights(cfg))
    from_flat_fn = staticmethod(lambda flat, cfg: weights_from_flat(flat, cfg))

    def routed_only(self, mlp):
        zeros = functools.partial(jax.tree.map, jnp.zeros_like)
        return mlp.replace(shared=zeros(mlp.shared), shared_gate=zeros(mlp.shared_gate))

    def kind(self, cfg, i):
        return cfg.layer_types[i]

    def layer_cache(self, cache, i, cfg):
        return layer_cache(cache, i, cfg)

    def mixer(self, layer, x, state, ctx, kind, cfg):
        return mixer_sublayer(layer, x, state, ctx, kind, cfg)

    def new_cache(self, cache, ctx, states, cfg):
        return assemble_cache(cache, ctx, states, cfg)

    # token trees (`spec.tree`): the DeltaNet rows of a tree are kept in node order, then put in path order
    def widen_for_tree(self, cache, width: int):
        return widen_rollback(cache, width)

    def commit_tree_path(self, cache, start, path):
        return commit_tree_path(cache, start, path)


def rollback(cache: Qwen3_5Cache, lengths: jax.Array) -> Qwen3_5Cache:
    """Keeps the first `lengths[b]` tokens of each sequence, exactly: afterwards every DeltaNet layer's
    `state` and conv tail are those after exactly `lengths[b]` tokens, as a fresh prefill would leave them.

    `lengths` is clamped to `[linear_lengths, current lengths]`: only rows of the last forward of width
    <= rollback_width can be forgotten. Full-attention layers roll back by the length alone (slot = position).
    """
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), cache.lengths.shape)
    lengths = jnp.clip(lengths, cache.linear_lengths, cache.lengths)
    steps = lengths - cache.linear_lengths
    linear = []
    for lin in cache.linear:
        state, tail = gdn.committed_state(lin, steps)
        linear.append(lin.replace(state=state, conv_window=gdn.with_tail(lin.conv_window, tail)))
    return cache.replace(linear=tuple(linear), lengths=lengths, linear_lengths=lengths)


def widen_rollback(cache: Qwen3_5Cache, width: int) -> Qwen3_5Cache:
    """The same cache able to keep (and roll back) forwards of up to `width` rows: the kept-extension buffers
    are zero-padded (rows past the kept ones are never read), so every committed state is unchanged. A token
    tree of N nodes needs width >= N."""
    if cache.rollback_width >= width:
        return cache

    def pad(a):
        return jnp.pad(a, [(0, 0), (0, width - cache.rollback_width)] + [(0, 0)] * (a.ndim - 2))

    return cache.replace(linear=tuple(
        lin.replace(conv_window=pad(lin.conv_window), k=pad(lin.k), u=pad(lin.u), g=pad(lin.g))
        for lin in cache.linear))


def commit_tree_path(cache: Qwen3_5Cache, start: jax.Array, path: jax.Array) -> Qwen3_5Cache:
    """After a token-tree forward (rows in node order): puts the path's rows in sequence order, in every layer.
    `path` [b, W] = the node at each depth of the accepted path. Full-attention K/V rows move from slot
    start + node to start + depth; each DeltaNet layer's kept rows (pre-conv window, k, u, g) from row node to
    row depth, so that `rollback(cache, start + n)` commits exactly the path's first n nodes."""
    b, w = path.shape
    rows = jnp.arange(b)[:, None]
    depth = jnp.arange(w, dtype=jnp.int32)[None]

    def move(buf, src, dst):
        return buf.at[rows, dst].set(buf[rows, src], mode="drop")

    src, dst = start[:, None] + path, start[:, None] + depth
    keys = tuple(move_slots(k, src, dst) for k in cache.keys)
    values = tuple(move_slots(v, src, dst) for v in cache.values)
    linear = []
    for lin in cache.linear:
        off = lin.kernel_size - 1
        linear.append(lin.replace(
            conv_window=move(lin.conv_window, off + path, off + depth),
            k=move(lin.k, path, depth), u=move(lin.u, path, depth), g=move(lin.g, path, depth)))
    return cache.replace(keys=keys, values=values, linear=tuple(linear))


def committed_linear_states(cache: Qwen3_5Cache) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """(state [b, Hv, dk, dv] fp32, conv tail [b, K-1, C]) of every DeltaNet layer at `cache.lengths`."""
    steps = cache.lengths - cache.linear_lengths
    return tuple(gdn.committed_state(lin, steps) for lin in cache.linear)


QWEN3_5 = register(Qwen3_5Family())
# If T <= cache.rollback_width, `forward`'s cache can be rolled back to any length in [old length, new length]
# (`rollback`); a wider forward commits. Padded rows (num_valid) never touch a sequence's DeltaNet state or conv
# tail, and their K/V rows sit past its length.
forward, forward_jit = decoder.family_forwards(QWEN3_5)
rollback_jit = jax.jit(rollback)


def random_weights(cfg, key: jax.Array, dtype=jnp.float32):
    """Random Qwen3.5-MoE weights: matrices N(0, 1/fan_in) (the conv N(0, 1/K)), zero-centred norm weights
    0.2 N(0, 1) (so the scale 1 + w is jittered like `random_qwen3_weights`' norms), the DeltaNet output norm
    1 + 0.2 N(0, 1), A_log / dt_bias 0.1 N(0, 1). Drawn with numpy on the host."""

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
            mixer = GatedAttentionWeights(
                q=mat(h, cfg.num_heads * 2 * d), k=mat(h, cfg.num_kv_heads * d), v=mat(h, cfg.num_kv_heads * d),
                o=mat(cfg.num_heads * d, h), q_norm=vec(d, 0.2), k_norm=vec(d, 0.2))
        else:
            mixer = GatedDeltaNetWeights(
                qkv=mat(h, conv_dim), z=mat(h, hv * dv), b=mat(h, hv), a=mat(h, hv),
                conv=mat(cfg.linear_conv_kernel, conv_dim), a_log=vec(hv), dt_bias=vec(hv), norm=vec(dv, 0.2, 1.0),
                out=mat(hv * dv, h))
        mlp = SparseMoEWeights(
            router=mat(h, e), gate_up=mat(e, h, 2 * inter), down=mat(e, inter, h),
            shared=MLPWeights(gate=mat(h, shared), up=mat(h, shared), down=mat(shared, h)),
            shared_gate=mat(h, 1))
        layers.append(DecoderLayerWeights(input_norm=vec(h, 0.2), mixer=mixer, post_norm=vec(h, 0.2), mlp=mlp))
    embed = arr(rng.standard_normal((cfg.vocab_size, h)))
    lm_head = None if cfg.tie_word_embeddings else mat(h, cfg.vocab_size)
    return Qwen3_5Weights(embed=embed, layers=tuple(layers), final_norm=vec(h, 0.2), lm_head=lm_head)


def declare_weights(cfg: Qwen3_5Config) -> dict[str, Target]:
    """The declared arrays of Qwen3.5-MoE weights (`models.declare`): read off `Qwen3_5Weights`."""
    return declare_tree(Qwen3_5Weights, cfg)


def weights_from_flat(flat: dict[str, Any], cfg: Qwen3_5Config) -> Qwen3_5Weights:
    """The weight pytree from `{declared name: array}` (`models.declare.build_tree` over `Qwen3_5Weights`)."""
    return build_tree(Qwen3_5Weights, flat, cfg)
