"""The DFlash block-diffusion draft (z-lab `DFlashDraftModel`) as pure functions over a weight pytree.

The math, with `taps` the target's hidden states `h[i+1]` (output of target layer i) for the configured
`target_layer_ids`, concatenated along features:

  ctx   = RMSNorm_hidden(taps @ fc)                                  one row per context position
  x     = embed_target[block_tokens] * input_embedding_scale         block = [anchor, MASK x (B-1)]
  per draft layer:
    h     = RMSNorm_in(x)                                           (the block stream only, never ctx)
    q     = RoPE(RMSNorm_q(h Wq + bq))                               queries: block rows only
    k_ctx = RoPE(RMSNorm_k(ctx Wk + bk)),  v_ctx = ctx Wv + bv       at the context rows' own positions
    k_blk = RoPE(RMSNorm_k(h Wk + bk)),    v_blk = h Wv + bv         at positions start + [0, B)
    x     = x + (softmax(q [k_ctx; k_blk]^T / sqrt(d) + mask) [v_ctx; v_blk]) Wo + bo
    x     = x + down(silu(RMSNorm_post(x) Wg) * (RMSNorm_post(x) Wu))
  hidden = RMSNorm_final(x);  logits = head(hidden) * output_multiplier  (then c tanh(logits / c) if softcapped)

Masks (absolute positions; context keys always lie before the block): `full_attention` layers see every
context row and the whole block (non-causal); `sliding_attention` layers are causal within the block and
see keys with `q - k < W`. A config's `is_causal` overrides the causality of every layer (a non-causal
window then also hides block keys with `k - q >= W`). No shift: the output at block slot j predicts the
token at slot j.

The context K/V of every layer depend on the context features only (never on the block), so they are
computed once per context row and kept in a `KVCache` (slot p = position p). Block K/V are never stored:
they change every round. `draft_forward` appends the new context rows and runs the block in one call;
`append_context` alone feeds a long prompt in chunks.

DFlash 2 drafts (`cfg.dflash2`, z-lab `DFlash2DraftModel`; docs/dflash2.md) wrap each sublayer of the block
stream in a grouped dynamic causal convolution (`ConvWeights`, `dynamic_conv`): with h the sublayer's normed
input, `prepare` feeds the sublayer `conv(h; base[0], dyn_0(h))` and `finish` turns its output a into
`conv(a; base[1], dyn_1(h))`, where `conv(x; w, d)[t, c] = sum_j (w[j, c] + d[t, j, c // G]) x[t - j, c]` over
taps j < K that stay inside the block (zero before the block's first slot). The context rows never pass the
convolutions. Their candidate selector (`SelectorWeights`) is the draft's conditional head: it sits where a
branch head sits (`DraftWeights.branch_head`), so every proposer built on a head (the head chain, head trees)
runs on it.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.cache import KVCache, init_kv_cache, write_rows
from dflash_jax.models.draft.config import DRAFT_ARCHITECTURES, DraftConfig, parse_hf_config, tiny_config
from dflash_jax.models.declare import Target, build_tree, declare_tree, param, sub
from dflash_jax.models.declare import layers as per_layer
from dflash_jax.models.family import DraftFamily, register_draft
from dflash_jax.models.qwen3 import (
    AttentionWeights, DecoderLayerWeights, MLPWeights, qkv_projection,
)
from dflash_jax.nn.attention import attention_mask, gqa_attention, kv_cache_attention
from dflash_jax.nn.init import ParamInit
from dflash_jax.nn.mlp import swiglu
from dflash_jax.nn.norms import rms_norm
from dflash_jax.nn.rope import apply_rope, rope_cos_sin

# An lm_head: [H, V] array, None for "tied to the embedding" (`embed.T`), or a function hidden -> logits.
Head = Union[jax.Array, None, Callable[[jax.Array], jax.Array]]

__all__ = [
    "BranchHeadWeights",
    "ConvWeights",
    "LayerConvs",
    "SelectorWeights",
    "dynamic_conv",
    "selector_scores",
    "selector_transition",
    "selector_logits",
    "is_selector",
    "branch_head_logits",
    "init_branch_head",
    "DraftWeights",
    "init_draft_cache",
    "context_features",
    "project_context",
    "append_context",
    "draft_forward",
    "draft_forward_jit",
    "draft_forward_blocks",
    "draft_logits",
]


@struct.dataclass
class BranchHeadWeights:
    """A branch head: the draft's distribution at block position k given the token at position k - 1.

    One draft forward predicts every position of the block from the anchor alone (marginals). Below a node
    of a token tree the marginals ignore which token the node holds, so after a branch the later argmaxes
    are often wrong. The head conditions on it:

        logits_k(x | parent) = lm_head(h_k + silu([h_k ; n(e(parent))] @ w_in) @ w_out)

    h_k: the draft's final-normed hidden state at position k, e(parent): the target's embedding of the
    token at position k - 1 (the anchor for k = 1), n: RMS normalization without a gain. `w_out` starts at 0
    (the head starts as the marginals). Trained on teacher-forced target paths (`train.branch_head`), i.e.
    it models P(x_k | the path up to k - 1 is the target's), the quantity a best-first tree ranks by."""

    w_in: jax.Array  # [2H, F]
    w_out: jax.Array  # [F, H]


@struct.dataclass
class ConvWeights:
    """One grouped dynamic causal convolution (DFlash 2): `base` [2, K, H] (the static per-channel kernels of
    `prepare` (row 0) and `finish` (row 1), tap j reading the position j back) and `projection` [H, 2 * K * G]
    ([in, out]; G = H / conv_group_size groups): column `s * K * G + j * G + g` is the dynamic correction of
    kernel s, tap j, channel group g."""

    base: jax.Array = param(lambda c: (2, c.conv_kernel_size, c.hidden_size))
    projection: jax.Array = param(
        lambda c: (c.hidden_size, 2 * c.conv_kernel_size * (c.hidden_size // c.conv_group_size)))


@struct.dataclass
class LayerConvs:
    """A DFlash 2 draft layer's convolutions: around its attention and around its MLP (stored beside the layer's
    other arrays, as the release names them: `layers.{i}.attention_conv.*`, `layers.{i}.mlp_conv.*`)."""

    attention: ConvWeights = sub(ConvWeights, stored="attention_conv")
    mlp: ConvWeights = sub(ConvWeights, stored="mlp_conv")


@struct.dataclass
class SelectorWeights:
    """DFlash 2's candidate selector: codebooks `predecessor` and `successor` [V, r] and `projection` [H, r]
    ([in, out]). At a block position with final-normed hidden h, given the token p at the previous position,
    the candidates are the top `cfg.selector_top_k` tokens c of the draft's logits u, scored

        score(c | p, h) = u[c] + <predecessor[p] * (h @ projection), successor[c]>

    and every other token is out (score -inf): the selector's q(. | p) = softmax(score / T)."""

    predecessor: jax.Array = param(lambda c: (c.vocab_size, c.selector_rank))
    successor: jax.Array = param(lambda c: (c.vocab_size, c.selector_rank))
    projection: jax.Array = param(lambda c: (c.hidden_size, c.selector_rank))


@struct.dataclass
class DraftWeights:
    """fc [n_taps * H_target, H] ([in, out]); layers with `attn: AttentionWeights` (biases when the config
    has attention_bias) and `mlp: MLPWeights`; `hidden_norm` and `final_norm` [H]; `convs`: a DFlash 2
    draft's `LayerConvs`, one per layer (None for DFlash 1); `branch_head`: the draft's conditional head, an
    optional `BranchHeadWeights` (a pair ships it beside its checkpoint; head chains and token trees are built
    from it) or a DFlash 2 draft's `SelectorWeights` (from its checkpoint)."""

    fc: jax.Array = param(lambda c: (c.num_taps * c.target_hidden_size, c.hidden_size))
    hidden_norm: jax.Array = param(lambda c: (c.hidden_size,))
    layers: tuple[DecoderLayerWeights, ...] = per_layer(DecoderLayerWeights, view=lambda c: _DenseLayers(c))
    final_norm: jax.Array = param(lambda c: (c.hidden_size,))
    # declared (stored as `selector.*`) for a DFlash 2 draft; a branch head is attached after loading
    branch_head: BranchHeadWeights | SelectorWeights | None = sub(SelectorWeights, when=lambda c: c.dflash2,
                                                                  stored="selector")
    convs: tuple[LayerConvs, ...] | None = per_layer(LayerConvs, when=lambda c: c.dflash2, stored="layers")


class _DenseLayers:
    """The draft config as its Qwen3 decoder layers' declarations read it: every layer's MLP is dense."""

    def __init__(self, cfg):
        self._cfg = cfg
        self.moe_layers = (False,) * cfg.num_layers

    def __getattr__(self, name):
        return getattr(self._cfg, name)


def is_selector(head) -> bool:
    """Whether a draft's conditional head is a DFlash 2 candidate selector (not a trained branch head)."""
    return isinstance(head, SelectorWeights)


def init_branch_head(hidden_size: int, key: jax.Array, *, width: int | None = None,
                     dtype=jnp.float32) -> BranchHeadWeights:
    """A fresh branch head (`w_out` = 0: exactly the marginals until trained); width F defaults to 2H."""
    f = width or 2 * hidden_size
    w_in = jax.random.normal(key, (2 * hidden_size, f), jnp.float32) / (2 * hidden_size) ** 0.5
    return BranchHeadWeights(w_in=w_in.astype(dtype), w_out=jnp.zeros((f, hidden_size), dtype))


def branch_head_logits(head: BranchHeadWeights | SelectorWeights, hidden: jax.Array, parent: jax.Array,
                       cfg: DraftConfig, *, embed: jax.Array, lm_head: Head) -> jax.Array:
    """fp32 logits [..., V] at positions with final-normed hidden states [..., H] whose previous block
    position holds the tokens `parent` [...] (see `BranchHeadWeights`; a `SelectorWeights` head gives
    `selector_logits`: its scores on its candidates, -inf elsewhere)."""
    if is_selector(head):
        return selector_logits(head, hidden, parent, cfg, embed=embed, lm_head=lm_head)
    e = _embed_block(embed, parent, cfg).astype(jnp.float32)
    e = e * jax.lax.rsqrt(jnp.mean(e * e, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    h = hidden.astype(jnp.float32)
    z = jnp.concatenate([h, e], axis=-1)
    delta = jax.nn.silu(z @ head.w_in.astype(jnp.float32)) @ head.w_out.astype(jnp.float32)
    return draft_logits((h + delta).astype(hidden.dtype), cfg, embed=embed, lm_head=lm_head)


def selector_scores(selector: SelectorWeights, hidden: jax.Array, parent: jax.Array, cfg: DraftConfig, *,
                    embed: jax.Array, lm_head: Head) -> tuple[jax.Array, jax.Array]:
    """The selector's candidates and their transition scores at positions with final-normed hidden states
    [..., H] given the previous position's tokens `parent` [...]: (scores [..., K] fp32, candidates [..., K]
    int32), K = `cfg.selector_top_k`, candidates in descending order of the draft's logits."""
    unary, candidates = jax.lax.top_k(draft_logits(hidden, cfg, embed=embed, lm_head=lm_head), cfg.selector_top_k)
    return unary + selector_transition(selector, hidden, parent, candidates), candidates.astype(jnp.int32)


def selector_transition(selector: SelectorWeights, hidden: jax.Array, parent: jax.Array,
                        candidates: jax.Array) -> jax.Array:
    """The selector's pairwise term `<predecessor[p] * (h @ projection), successor[c]>` [..., K] fp32 for the
    tokens `candidates` [..., K] at positions with hidden states [..., H] and previous tokens `parent` [...]
    (`selector_scores` adds it to the candidates' logits; training scores any candidate set with it)."""
    f32 = jnp.float32
    query = jnp.take(selector.predecessor, parent, axis=0).astype(f32) * (
        hidden.astype(f32) @ selector.projection.astype(f32))  # [..., r]
    return jnp.einsum("...r,...kr->...k", query, jnp.take(selector.successor, candidates, axis=0).astype(f32))


def selector_logits(selector: SelectorWeights, hidden: jax.Array, parent: jax.Array, cfg: DraftConfig, *,
                    embed: jax.Array, lm_head: Head) -> jax.Array:
    """`selector_scores` as a full-vocabulary row [..., V] fp32: the candidates' scores, -inf elsewhere (so
    `softmax(row / T)` is the selector's q over its K candidates, and its argmax the greedy choice)."""
    scores, candidates = selector_scores(selector, hidden, parent, cfg, embed=embed, lm_head=lm_head)
    vocab = selector.successor.shape[0]
    lead = scores.shape[:-1]
    flat_scores, flat_cands = scores.reshape(-1, scores.shape[-1]), candidates.reshape(-1, candidates.shape[-1])
    rows = jnp.arange(flat_scores.shape[0])[:, None]
    row = jnp.full((flat_scores.shape[0], vocab), -jnp.inf, jnp.float32).at[rows, flat_cands].set(flat_scores)
    return row.reshape(lead + (vocab,))


def dynamic_conv(x: jax.Array, kernel: jax.Array, dynamic: jax.Array, group_size: int, width: int) -> jax.Array:
    """`y[t, c] = sum_j (kernel[j, c] + dynamic[t, j, c // group_size]) * x[t - j, c]` over the taps j < K, within
    blocks of `width` consecutive positions (x[t - j] is 0 when t - j lies before t's block).
    x [b, T, H] (T a multiple of `width`), kernel [K, H], dynamic [b, T, K, H / group_size] -> [b, T, H]."""
    b, t, h = x.shape
    taps, groups = kernel.shape[0], h // group_size
    blocks = x.reshape(b, t // width, width, groups, group_size)
    dyn = dynamic.reshape(b, t // width, width, taps, groups)
    out = jnp.zeros_like(blocks)
    for j in range(min(taps, width)):  # a tap reaching past the block start reads zeros only
        shifted = blocks if j == 0 else jnp.pad(blocks[:, :, :-j], ((0, 0), (0, 0), (j, 0), (0, 0), (0, 0)))
        weight = kernel[j].reshape(groups, group_size).astype(x.dtype) + dyn[:, :, :, j, :, None].astype(x.dtype)
        out = out + weight * shifted
    return out.reshape(b, t, h)


def _conv_prepare(conv: ConvWeights, h: jax.Array, cfg: DraftConfig, width: int):
    """The convolution before a sublayer: (its input, the dynamic kernel [b, T, K, G] its `finish` applies)."""
    b, t, _ = h.shape
    dyn = (h @ conv.projection).reshape(b, t, 2, cfg.conv_kernel_size, -1)
    return dynamic_conv(h, conv.base[0], dyn[:, :, 0], cfg.conv_group_size, width), dyn[:, :, 1]


def _conv_finish(conv: ConvWeights, out: jax.Array, dynamic: jax.Array, cfg: DraftConfig, width: int):
    return dynamic_conv(out, conv.base[1], dynamic, cfg.conv_group_size, width)


def init_draft_cache(cfg: DraftConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """The context K/V cache, one buffer pair per draft layer, lengths 0.

    `max_len` must cover the longest committed context plus the static context width C of a call (the
    C rows are written whole; those past `num_context` sit beyond the length, invisible)."""
    return init_kv_cache(
        num_layers=cfg.num_layers, batch=batch, max_len=max_len, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=dtype,
    )


def context_features(taps: tuple[jax.Array, ...] | list[jax.Array]) -> jax.Array:
    """`concat(taps, axis=-1)`: [b, T, H_t] each, in `target_layer_ids` order -> [b, T, n_taps * H_t]."""
    return jnp.concatenate(tuple(taps), axis=-1)


def project_context(weights: DraftWeights, cfg: DraftConfig, features: jax.Array) -> jax.Array:
    """`ctx = RMSNorm_hidden(features @ fc)`: [b, C, n_taps * H_t] -> [b, C, H]."""
    return rms_norm(features @ weights.fc, weights.hidden_norm, cfg.rms_norm_eps)


def _linear(x, w, b):
    y = x @ w
    return y if b is None else y + b


def _context_kv(ctx, attn: AttentionWeights, cos, sin, cfg: DraftConfig):
    b, c, _ = ctx.shape
    k = _linear(ctx, attn.k, attn.k_bias).reshape(b, c, cfg.num_kv_heads, cfg.head_dim)
    v = _linear(ctx, attn.v, attn.v_bias).reshape(b, c, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(rms_norm(k, attn.k_norm, cfg.rms_norm_eps), cos, sin), v


def append_context(
    weights: DraftWeights, cfg: DraftConfig, *, context_features: jax.Array, num_context: jax.Array,
    cache: KVCache, positions: jax.Array | None = None, batch: jax.Array | None = None,
) -> KVCache:
    """Projects context rows [b, C, n_taps * H_t] at positions `cache.lengths + [0, C)` into every layer's
    K/V and writes them at those slots; lengths advance by `num_context` [b] (rows past it are padding).
    positions: [b, C] explicit RoPE positions of the rows (a compressed prefill's kept rows,
    `dflash_jax.pflash`); the cache's `position_offset` then makes later rows continue after each sequence's
    last one. None: slot + the cache's `position_offset` (if any).
    batch: [b] int32, the cache rows the features belong to, distinct (None: row i is the cache's row i): a few
    rows of a larger cache appended in place, the others untouched (an index past the cache's rows: dropped)."""
    if batch is not None:
        batch = jnp.asarray(batch, jnp.int32)
    take = (lambda x: x) if batch is None else (lambda x: jnp.take(x, batch, axis=0, mode="clip"))  # noqa: E731
    starts = take(cache.lengths)
    c = context_features.shape[1]
    num_context = jnp.asarray(num_context, jnp.int32)
    offset = None if cache.position_offset is None else take(cache.position_offset)
    if positions is None:
        positions = starts[:, None] + jnp.arange(c, dtype=jnp.int32)
        if offset is not None:
            positions = positions + offset[:, None]
    else:
        positions = jnp.asarray(positions, jnp.int32)
        last = positions[jnp.arange(positions.shape[0]), jnp.clip(num_context - 1, 0, c - 1)]
        kept = last + 1 - (starts + num_context)
        offset = jnp.where(num_context > 0, kept, jnp.zeros_like(kept) if offset is None else offset)
    ctx = project_context(weights, cfg, context_features)
    cos, sin = rope_cos_sin(cfg.rope, positions, ctx.dtype)
    keys, values = [], []
    for i, layer in enumerate(weights.layers):
        k, v = _context_kv(ctx, layer.attn, cos, sin, cfg)
        keys.append(write_rows(cache.keys[i], k, starts, batch))
        values.append(write_rows(cache.values[i], v, starts, batch))
    lengths = starts + num_context
    if batch is not None:  # the gathered rows' lengths (and offsets) back into the whole cache's
        lengths = cache.lengths.at[batch].set(lengths, mode="drop")
        if offset is not None:
            base = cache.position_offset if cache.position_offset is not None else jnp.zeros_like(cache.lengths)
            offset = base.at[batch].set(offset, mode="drop")
    return KVCache(keys=tuple(keys), values=tuple(values), lengths=lengths, position_offset=offset)


def _kind_mask(q_positions, k_positions, *, causal: bool, window: int | None):
    """A layer kind's position rule: causal or not; a window hides `q - k >= W` and, when not causal, also
    `k - q >= W`."""
    mask = attention_mask(q_positions, k_positions, causal=causal, window=window)
    if window is not None and not causal:
        mask &= k_positions[:, None, :] - q_positions[:, :, None] < window
    return mask


def _cache_attend(k_buf, v_buf, positions, start, block_mask, *, causal: bool, window: int | None,
                  cfg: DraftConfig):
    """The inference attention of a block at `positions` [b, B]: the live context slots (< start) of the
    layer's cache under the kind's rule, then the block's own keys under `block_mask` [b, B, B]. Reads the
    cache only up to the live length (`kv_cache_attention`)."""

    def attend(q, k, v):
        return kv_cache_attention(q, k_buf, v_buf, positions, start, scale=cfg.head_dim**-0.5, causal=causal,
                                  window=window, extra=(k, v, block_mask))

    return attend


def _concat_attend(ctx_keys, ctx_values, mask, cfg: DraftConfig):
    """Dense attention over given context K/V then the block's own, under `mask` [b, T, S_ctx + T]."""

    def attend(q, k, v):
        keys = jnp.concatenate([ctx_keys, k.astype(ctx_keys.dtype)], axis=1)
        values = jnp.concatenate([ctx_values, v.astype(ctx_values.dtype)], axis=1)
        return gqa_attention(q, keys, values, mask, scale=cfg.head_dim**-0.5)

    return attend


def draft_logits(hidden: jax.Array, cfg: DraftConfig, *, embed: jax.Array, lm_head: Head) -> jax.Array:
    """fp32 `head(hidden) * output_multiplier`, soft-capped `c * tanh(logits / c)` when configured."""
    if lm_head is None:
        logits = jnp.dot(hidden, embed.T, preferred_element_type=jnp.float32)
    elif callable(lm_head):
        logits = lm_head(hidden).astype(jnp.float32)
    else:
        logits = jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32)
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        cap = cfg.final_logit_softcapping
        logits = jnp.tanh(logits / cap) * cap
    return logits


def _embed_block(embed: jax.Array, tokens: jax.Array, cfg: DraftConfig) -> jax.Array:
    x = jnp.take(embed, tokens, axis=0)
    if cfg.input_embedding_scale != 1.0:
        x = (x * cfg.input_embedding_scale).astype(embed.dtype)
    return x


def _block_layer(layer: DecoderLayerWeights, x, cos, sin, attend, cfg: DraftConfig, convs: LayerConvs | None = None,
                 width: int | None = None):
    """One draft layer on the block stream x [b, T, H]: queries from the block; `attend(q, k, v)` attends
    them over the context and the block's own keys / values k, v (`_cache_attend`, `_concat_attend`).
    convs: a DFlash 2 layer's convolutions around both sublayers, over blocks of `width` positions."""
    b, t, _ = x.shape
    h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
    if convs is not None:
        h, finish = _conv_prepare(convs.attention, h, cfg, width)
    q, k, v = qkv_projection(
        h, layer.attn, cos, sin, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
    )
    out = _linear(attend(q, k, v).reshape(b, t, -1), layer.attn.o, layer.attn.o_bias)
    if convs is not None:
        out = _conv_finish(convs.attention, out, finish, cfg, width)
    x = x + out
    mlp: MLPWeights = layer.mlp
    h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
    if convs is not None:
        h, finish = _conv_prepare(convs.mlp, h, cfg, width)
    out = swiglu(h, mlp.gate, mlp.up, mlp.down)
    if convs is not None:
        out = _conv_finish(convs.mlp, out, finish, cfg, width)
    return x + out


def _layer_convs(weights: DraftWeights, cfg: DraftConfig, i: int) -> LayerConvs | None:
    if cfg.dflash2 != (weights.convs is not None):
        raise ValueError("a DFlash 2 config needs weights with convolutions (DraftWeights.convs) and a DFlash 1 "
                         "config weights without: load the weights with the config they were converted with")
    return None if weights.convs is None else weights.convs[i]


def draft_forward(
    weights: DraftWeights,
    cfg: DraftConfig,
    *,
    embed: jax.Array,
    lm_head: Head,
    block_tokens: jax.Array,
    context_features: jax.Array,
    num_context: jax.Array,
    cache: KVCache,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One draft call: append the new context rows, then run the block.

    embed [V, H] and lm_head [H, V] (None: tied, `embed.T`; or a function) are the TARGET's.
    block_tokens [b, B] int32, normally `[anchor, MASK x (B-1)]`; context_features [b, C, n_taps * H_t]
    (`context_features(taps)` of the target's rows not yet in the cache) of which the first
    `num_context[b]` rows are real. The rows sit at `cache.lengths + [0, C)`; the block sits at
    `start + [0, B)` with `start = cache.lengths + num_context` (the committed length).
    Returns (logits [b, B, V] fp32, hidden [b, B, H] after the final norm, the cache with the context rows
    appended: `new_cache.lengths == start`; the block's K/V are not kept).
    """
    cache = append_context(weights, cfg, context_features=context_features, num_context=num_context, cache=cache)
    start = cache.lengths
    b, width = block_tokens.shape
    positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)
    x = _embed_block(embed, block_tokens, cfg)
    rope_positions = positions if cache.position_offset is None else positions + cache.position_offset[:, None]
    cos, sin = rope_cos_sin(cfg.rope, rope_positions, x.dtype)  # masks stay by slot (`cache.KVCache`)
    masks = {}
    for i, layer in enumerate(weights.layers):
        causal, window = kind = (cfg.layer_causal[i], cfg.layer_windows[i])
        if kind not in masks:  # the block's own keys
            masks[kind] = _kind_mask(positions, positions, causal=causal, window=window)
        attend = _cache_attend(cache.keys[i], cache.values[i], positions, start, masks[kind], causal=causal,
                               window=window, cfg=cfg)
        x = _block_layer(layer, x, cos, sin, attend, cfg, _layer_convs(weights, cfg, i), width)
    hidden = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    return draft_logits(hidden, cfg, embed=embed, lm_head=lm_head), hidden, cache


def draft_forward_blocks(
    weights: DraftWeights,
    cfg: DraftConfig,
    *,
    embed: jax.Array,
    lm_head: Head,
    block_tokens: jax.Array,
    context_features: jax.Array,
    anchors: jax.Array,
    widths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Many blocks over ONE context per sequence at once: the training form of `draft_forward`.

    block_tokens [n, A, B] (block a of sequence i sits at positions `anchors[i, a] + [0, B)`);
    context_features [n, L, n_taps * H_t], the target's taps at positions 0 .. L-1; anchors [n, A].
    Block a sees exactly what `draft_forward` shows it at inference with `anchors[i, a]` committed tokens:
    the context rows strictly before its anchor (under the layer's causal / window rule) and its own B
    keys; never another block (nor, for DFlash 2, another block's positions through the convolutions). The
    context K/V are projected once per sequence and shared by its A blocks
    (the inference form would project them A times). widths [n, A] (optional, 1..B): block a acts as a
    width-`widths[i, a]` block, its first w slots seeing only each other (inference at block size w); slots
    past w are computed but meaningless. Returns (logits [n, A, B, V] fp32, hidden [n, A, B, H]).
    """
    n, a, width = block_tokens.shape
    length = context_features.shape[1]
    ctx = project_context(weights, cfg, context_features)
    ctx_pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (n, length))
    ctx_cos, ctx_sin = rope_cos_sin(cfg.rope, ctx_pos, ctx.dtype)
    q_pos = (anchors[..., None] + jnp.arange(width, dtype=jnp.int32)).reshape(n, a * width).astype(jnp.int32)
    block_id = jnp.repeat(jnp.arange(a, dtype=jnp.int32), width)
    q_anchor = jnp.repeat(anchors.astype(jnp.int32), width, axis=1)  # [n, A*B]
    k_pos = jnp.concatenate([ctx_pos, q_pos], axis=1)
    own_block = jnp.broadcast_to(block_id[:, None] == block_id[None, :], (n, a * width, a * width))
    if widths is not None:  # keys past their block's width are invisible
        slot = jnp.tile(jnp.arange(width, dtype=jnp.int32), a)
        own_block = own_block & (slot[None, :] < jnp.repeat(widths.astype(jnp.int32), width, axis=1))[:, None, :]
    visible = jnp.concatenate([ctx_pos[:, None, :] < q_anchor[:, :, None], own_block], axis=2)
    x = _embed_block(embed, block_tokens.reshape(n, a * width), cfg)
    cos, sin = rope_cos_sin(cfg.rope, q_pos, x.dtype)
    masks = {}
    for i, layer in enumerate(weights.layers):
        kind = (cfg.layer_causal[i], cfg.layer_windows[i])
        if kind not in masks:
            masks[kind] = _kind_mask(q_pos, k_pos, causal=kind[0], window=kind[1]) & visible
        k_ctx, v_ctx = _context_kv(ctx, layer.attn, ctx_cos, ctx_sin, cfg)
        x = _block_layer(layer, x, cos, sin, _concat_attend(k_ctx, v_ctx, masks[kind], cfg), cfg,
                         _layer_convs(weights, cfg, i), width)
    hidden = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    logits = draft_logits(hidden, cfg, embed=embed, lm_head=lm_head)
    return logits.reshape(n, a, width, -1), hidden.reshape(n, a, width, -1)


# lm_head must be an array or None here (a function would have to be static); wrap `draft_forward` in
# your own jit to close over a head function.
draft_forward_jit = jax.jit(draft_forward, static_argnames=("cfg",))


def random_weights(cfg: DraftConfig, key: jax.Array, dtype=jnp.float32, *,
                   norm_jitter: float = 0.2) -> DraftWeights:
    """Random draft weights (`nn.init.ParamInit`; zero attention biases when the config has them)."""
    init = ParamInit(key, 8 + 16 * cfg.num_layers, dtype, norm_jitter)
    h, d = cfg.hidden_size, cfg.head_dim
    layers = []
    for _ in range(cfg.num_layers):
        bias = (lambda n: jnp.zeros((n,), dtype)) if cfg.attention_bias else (lambda n: None)
        attn = AttentionWeights(
            q=init.mat(h, cfg.num_heads * d), k=init.mat(h, cfg.num_kv_heads * d), v=init.mat(h, cfg.num_kv_heads * d),
            o=init.mat(cfg.num_heads * d, h), q_norm=init.norm(d), k_norm=init.norm(d),
            q_bias=bias(cfg.num_heads * d), k_bias=bias(cfg.num_kv_heads * d), v_bias=bias(cfg.num_kv_heads * d),
            o_bias=bias(h))
        mlp = MLPWeights(gate=init.mat(h, cfg.intermediate_size), up=init.mat(h, cfg.intermediate_size),
                               down=init.mat(cfg.intermediate_size, h))
        layers.append(DecoderLayerWeights(input_norm=init.norm(h), attn=attn, post_norm=init.norm(h), mlp=mlp))
    weights = DraftWeights(fc=init.mat(cfg.num_taps * cfg.target_hidden_size, h), hidden_norm=init.norm(h),
                           layers=tuple(layers), final_norm=init.norm(h))
    if not cfg.dflash2:
        return weights
    # DFlash 2: convolutions away from the identity and random codebooks (a key of their own, so DFlash 1
    # weights of a key stay what they were)
    keys = iter(jax.random.split(jax.random.fold_in(key, 2), 4 * cfg.num_layers + 3))
    normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
    k, groups = cfg.conv_kernel_size, h // cfg.conv_group_size

    def conv():
        base = jnp.zeros((2, k, h), jnp.float32).at[:, 0].set(1.0) + 0.3 * normal(2, k, h)
        return ConvWeights(base=base.astype(dtype), projection=(0.3 * normal(h, 2 * k * groups) / h**0.5).astype(dtype))

    convs = tuple(LayerConvs(attention=conv(), mlp=conv()) for _ in range(cfg.num_layers))
    r = cfg.selector_rank
    selector = SelectorWeights(predecessor=normal(cfg.vocab_size, r).astype(dtype),
                               successor=(normal(cfg.vocab_size, r) / r**0.5).astype(dtype),
                               projection=(normal(h, r) / h**0.5).astype(dtype))
    return weights.replace(convs=convs, branch_head=selector)


def declare_weights(cfg: DraftConfig) -> dict[str, Target]:
    """The declared arrays of DFlash draft weights (`models.declare`): read off `DraftWeights`."""
    return declare_tree(DraftWeights, cfg)


def weights_from_flat(flat: dict[str, Any], cfg: DraftConfig) -> DraftWeights:
    """The weight pytree from `{declared name: array}` (`models.declare.build_tree` over `DraftWeights`)."""
    return build_tree(DraftWeights, flat, cfg)


from dflash_jax.models.draft.hf import HF_TABLE, export_hf  # noqa: E402  (the layout reads the weight types above)


class DFlashDraftFamily(DraftFamily):
    """The DFlash draft (`DFlashDraftModel`) and DFlash 2 (`DFlash2DraftModel`: convolutions, candidate selector)."""

    name = "dflash"
    config_type, weights_type = DraftConfig, DraftWeights
    architectures = DRAFT_ARCHITECTURES
    parse_hf = staticmethod(parse_hf_config)
    hf_table = HF_TABLE
    export_hf = staticmethod(export_hf)
    declare_fn = staticmethod(lambda cfg: declare_weights(cfg))
    from_flat_fn = staticmethod(lambda flat, cfg: weights_from_flat(flat, cfg))
    tiny_config_fn = staticmethod(tiny_config)
    random_weights_fn = staticmethod(lambda cfg, key, dtype: random_weights(cfg, key, dtype))


DFLASH = register_draft(DFlashDraftFamily())
