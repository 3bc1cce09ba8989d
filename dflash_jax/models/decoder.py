"""The one decoder loop every target family runs, resident (inside jit) or layer by layer (expert offload).

  x, ctx = block_context(tokens)
  for each layer i:
      x, state_i = mixer(layer_i, x, cache_i)         attention / DeltaNet sub-layer, writes the layer's cache part
      h = mlp_input(layer_i, x)
      MoE layer:  routing = route_rows(router_of(layer_i), x)   (the family's one routing function)
                  layer_i = hook(i, layer_i, routing)  (offload: the experts `routing` reads, on the device)
                  x = experts(layer_i, x, h, routing)
      dense:      x = dense(layer_i, x, h)
  normed, logits = finish(x); cache = new_cache(states)

The family supplies the pieces (`models.family.ModelFamily`); `Steps` decides the program boundaries: the
resident forward traces every piece into the caller's program, the offloaded forward
(`offload.forward.forward_layerwise`) runs them as separately jitted steps so that the host can read each
MoE layer's exact routing and place the experts it reads before they run. Same pieces, same order, same
numbers.
"""

from __future__ import annotations

import functools
from typing import Callable, Literal

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.nn.rope import rope_cos_sin

LogitsMode = Literal["all", "last", "none"]


@struct.dataclass
class BlockContext:
    """What every layer of one forward shares: the block's absolute positions [b, T], where its rows are
    written (`starts` [b], the cache lengths before the call), the RoPE tables, `num_valid` [b] int32 and, for
    families with linear attention, `steps` [b] (the committed rows of the kept extension)."""

    positions: jax.Array
    starts: jax.Array
    cos: jax.Array
    sin: jax.Array
    num_valid: jax.Array
    steps: jax.Array | None = None
    tree_mask: jax.Array | None = None  # [b, T, T] bool: a token tree's ancestor-or-self mask (`with_tree`)


@struct.dataclass
class Routing:
    """One MoE layer's exact routing of a block: `weights` [b*T, k] fp32 (renormalized when configured),
    `experts` [b*T, k] int32, router `logits` [b*T, E] fp32; `probs` [b*T, k] fp32, the family's routing
    probability of each chosen expert before any renormalization (what route-ahead predictions rank by)."""

    weights: jax.Array
    experts: jax.Array
    logits: jax.Array
    probs: jax.Array | None = None


@struct.dataclass
class RouterWeights:
    """What one MoE layer's router reads (`ModelFamily.router_of`): the post-attention norm weights `norm` [H],
    the router `router` [H, E] and its bias `router_bias` [E] (gpt-oss; None otherwise). Every MoE layer of a
    family has the same structure, so a stack of them (leading axis L) is what `ModelFamily.route_rows` is
    vmapped over."""

    norm: jax.Array
    router: jax.Array
    router_bias: jax.Array | None = None


@struct.dataclass
class ForwardOutput:
    """logits: [b, T, V] ("all"), [b, V] ("last": each sequence's last valid token) or None, fp32.
    taps: `h[i+1]` for each requested layer i, [b, T, H] (as in HF `output_hidden_states`, the last
    layer's entry is taken after the final norm). router_experts: per layer [b, T, k] int32, None for
    dense layers. cache: the cache with the new rows written and lengths advanced by `num_valid`."""

    logits: jax.Array | None
    taps: tuple[jax.Array, ...]
    router_experts: tuple[jax.Array | None, ...]
    cache: object
    router_logits: tuple[jax.Array | None, ...] | None = None  # per layer [b, T, E] fp32, when requested


@struct.dataclass
class TreeBlock:
    """A token tree verified as one block: node t sits at depth `depths[b, t]` (position start + depth) and
    sees the block rows u with `mask[b, t, u]` (its ancestors and itself); nodes are in topological order
    (a parent before its children), node 0 is the root at depth 0."""

    depths: jax.Array  # [b, T] int32
    mask: jax.Array  # [b, T, T] bool


def with_tree(ctx: BlockContext, tree: TreeBlock, rope, dtype) -> BlockContext:
    """The block context of a tree block: positions start + depth, their RoPE tables, the ancestor mask."""
    positions = ctx.starts[:, None] + tree.depths.astype(jnp.int32)
    cos, sin = rope_cos_sin(rope, positions, dtype)
    return ctx.replace(positions=positions, cos=cos, sin=sin, tree_mask=tree.mask)


def with_rope_positions(ctx: BlockContext, positions: jax.Array, rope, dtype) -> BlockContext:
    """The block context with RoPE tables at `positions` [b, T] (masks stay by slot, `ctx.positions`): a
    compressed prefill's explicit positions, or slot + the cache's `position_offset` (`cache.KVCache`)."""
    cos, sin = rope_cos_sin(rope, positions, dtype)
    return ctx.replace(cos=cos, sin=sin)


def block_positions(starts: jax.Array, width: int) -> jax.Array:
    """[b, T] absolute positions of a block of `width` tokens written at each sequence's length `starts`."""
    return starts[:, None] + jnp.arange(width, dtype=jnp.int32)


def select_logits(
    normed: jax.Array, num_valid: jax.Array, mode: LogitsMode, head: Callable[[jax.Array], jax.Array]
) -> jax.Array | None:
    """Logits of final-normed hidden states [b, T, H]: every row ("all"), each sequence's last valid row
    ("last", [b, V]) or none."""
    if mode == "all":
        return head(normed)
    if mode == "last":
        b, t = normed.shape[:2]
        idx = jnp.clip(num_valid - 1, 0, t - 1)
        return head(normed[jnp.arange(b), idx])
    if mode == "none":
        return None
    raise ValueError(f"logits must be 'all', 'last' or 'none', got {mode!r}")


def lm_head_logits(weights, normed_hidden: jax.Array) -> jax.Array:
    """fp32 logits from final-normed hidden states (the tied embedding when there is no lm_head)."""
    head = weights.lm_head if weights.lm_head is not None else weights.embed.T
    return jnp.dot(normed_hidden, head, preferred_element_type=jnp.float32)


class Steps:
    """The program boundaries of the loop. This base class traces every piece into the caller's program
    (the resident forward); `offload.forward` subclasses it with separately jitted steps."""

    def __init__(self, fam, cfg, implementation: str = "auto"):
        self.fam, self.cfg, self.implementation = fam, cfg, implementation

    def begin(self, weights, tokens, cache, num_valid):
        return self.fam.block_context(weights, tokens, cache, num_valid, self.cfg)

    def attend(self, i, layer, x, state, ctx, moe: bool):
        """Layer i's mixer sub-layer, its MLP input and (MoE layers) routing: (x, h, routing | None, state)."""
        fam, cfg = self.fam, self.cfg
        x, state = fam.mixer(layer, x, state, ctx, fam.kind(cfg, i), cfg)
        return x, fam.mlp_input(layer, x, cfg), route_layer(fam, layer, x, cfg) if moe else None, state

    def mlp(self, i, layer, x, h, routing):
        """Layer i's MLP sub-layer (`routing` None: a dense layer)."""
        if routing is None:
            return self.fam.dense(layer, x, h, self.cfg, self.implementation)
        return self.fam.experts(layer, x, h, routing, self.cfg, self.implementation)

    def finish(self, weights, x, num_valid, logits):
        return self.fam.finish(weights, x, num_valid, self.cfg, logits)

    def new_cache(self, cache, ctx, states):
        return self.fam.new_cache(cache, ctx, states, self.cfg)


def route_layer(fam, layer, x: jax.Array, cfg) -> Routing:
    """MoE layer `layer`'s exact routing of the residual stream `x` [..., H] entering its MLP sub-layer: the
    family's one routing function (`ModelFamily.route_rows`, post-attention norm included) on the flattened rows.
    (The norm it shares with `mlp_input` is computed once: XLA merges the identical expressions.)"""
    return fam.route_rows(fam.router_of(layer), x.reshape(-1, x.shape[-1]), cfg)


# hook(layer index, layer weights, routing) -> the layer weights its experts run on (e.g. with a slot pool)
ExpertHook = Callable[[int, object, Routing], object]


def run_layers(steps: Steps, weights, tokens: jax.Array, cache, *, num_valid: jax.Array | None = None,
               tap_layers: tuple[int, ...] = (), logits: LogitsMode = "all", return_router_logits: bool = False,
               expert_hook: ExpertHook | None = None, tree: TreeBlock | None = None,
               positions: jax.Array | None = None) -> ForwardOutput:
    """The decoder loop (see module doc) over `steps`. `expert_hook` may replace a MoE layer's weights once
    its exact routing is known (the offloaded forward places the routed experts there). `tree`: the block is
    a token tree (`TreeBlock`; linear-attention layers run each node's path, see `models.qwen3_5`). `positions`: explicit RoPE positions (see `forward`)."""
    fam, cfg = steps.fam, steps.cfg
    if logits not in ("all", "last", "none"):
        raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
    b, t = tokens.shape
    if num_valid is None:
        num_valid = jnp.full((b,), t, jnp.int32)
    x, ctx = steps.begin(weights, tokens, cache, num_valid)
    if tree is not None:
        ctx = with_tree(ctx, tree, cfg.rope, x.dtype)
    offset = getattr(cache, "position_offset", None)
    if positions is not None:
        if tree is not None:
            raise ValueError("explicit positions and a token tree cannot be combined")
        positions = jnp.asarray(positions, jnp.int32)
        if positions.shape != (b, t):
            raise ValueError(f"positions must have the tokens' shape {(b, t)}, got {tuple(positions.shape)}")
        ctx = with_rope_positions(ctx, positions, cfg.rope, x.dtype)
    elif offset is not None:
        ctx = with_rope_positions(ctx, ctx.positions + offset[:, None], cfg.rope, x.dtype)
    last = len(weights.layers) - 1
    taps: dict[int, jax.Array] = {}
    routers, router_logits, states = [], [], []
    for i, layer in enumerate(weights.layers):
        moe = fam.is_moe(layer)
        x, h, routing, state = steps.attend(i, layer, x, fam.layer_cache(cache, i, cfg), ctx, moe)
        if routing is not None and expert_hook is not None:
            layer = expert_hook(i, layer, routing)
        x = steps.mlp(i, layer, x, h, routing)
        states.append(state)
        routers.append(None if routing is None else routing.experts.reshape(b, t, -1))
        router_logits.append(None if routing is None else routing.logits.reshape(b, t, -1))
        if i in tap_layers and i != last:
            taps[i] = x
    normed, out_logits = steps.finish(weights, x, num_valid, logits)
    if last in tap_layers:
        taps[last] = normed
    new_cache = steps.new_cache(cache, ctx, states)
    if positions is not None:  # later rows continue after each sequence's last explicit position
        last_pos = positions[jnp.arange(b), jnp.clip(num_valid - 1, 0, t - 1)]
        kept = last_pos + 1 - new_cache.lengths
        new_cache = new_cache.replace(position_offset=jnp.where(
            num_valid > 0, kept, jnp.zeros_like(kept) if offset is None else offset).astype(jnp.int32))
    elif offset is not None:
        new_cache = new_cache.replace(position_offset=offset)
    return ForwardOutput(
        logits=out_logits,
        taps=tuple(taps[i] for i in tap_layers),
        router_experts=tuple(routers),
        cache=new_cache,
        router_logits=tuple(router_logits) if return_router_logits else None,
    )


def forward(fam, weights, tokens: jax.Array, cache, cfg, *, num_valid: jax.Array | None = None,
            tap_layers: tuple[int, ...] = (), logits: LogitsMode = "all", implementation: str = "auto",
            return_router_logits: bool = False, tree: TreeBlock | None = None,
            positions: jax.Array | None = None) -> ForwardOutput:
    """Runs `tokens` [b, T] at positions `cache.lengths[b] + [0, T)` through family `fam`'s decoder.

    One function serves every use: prefill of a right-padded batch, extension by a width-B speculative
    block, one-token decoding.
    num_valid: [b] number of real tokens per row (right padding); defaults to T. Padded rows are computed
    and written past the new length, where no later query can see them.
    tap_layers: static tuple of layer indices i whose output `h[i+1]` to return (the DFlash taps).
    The cache must have room: `cache.lengths + T <= max_len` (rows past the end are dropped).
    return_router_logits: also return each MoE layer's router logits (training's load-balancing loss).
    A MoE layer whose weights carry a slot pool (`ModelFamily.with_expert_pool`) reads its experts through
    the layer's `slot_of` table; every routed expert must then be resident in the pool.
    tree: a `TreeBlock` when `tokens` is a token tree (node t at position `cache.lengths + depths[:, t]`,
    attending to the committed rows and its ancestors only); rows are still written at `lengths + [0, T)`
    and the caller moves the accepted path into place (`spec.tree`).
    positions: [b, T] int32 explicit RoPE positions of the tokens (a compressed prefill, `dflash_jax.pflash`:
    the kept tokens at their original positions, increasing). Rows are still written at slots
    `lengths + [0, T)` and masks stay by slot; the returned cache's `position_offset` makes every later row
    continue after each sequence's last valid position. None: slot + the cache's `position_offset` (if any).
    """
    if not isinstance(weights, fam.weights_type):
        raise TypeError(f"{type(cfg).__name__} needs {fam.weights_type.__name__} weights, got {type(weights).__name__}")
    return run_layers(Steps(fam, cfg, implementation), weights, tokens, cache, num_valid=num_valid,
                      tap_layers=tap_layers, logits=logits, return_router_logits=return_router_logits, tree=tree,
                      positions=positions)


_STATIC = ("cfg", "tap_layers", "logits", "implementation", "return_router_logits")


@functools.partial(jax.jit, static_argnames=("fam",) + _STATIC)
def forward_jit(fam, weights, tokens, cache, cfg, *, num_valid=None, tap_layers=(), logits="all",
                implementation="auto", return_router_logits=False, positions=None) -> ForwardOutput:
    """`forward`, jitted with the family, config and modes static."""
    return forward(fam, weights, tokens, cache, cfg, num_valid=num_valid, tap_layers=tap_layers, logits=logits,
                   implementation=implementation, return_router_logits=return_router_logits, positions=positions)


def family_forwards(fam):
    """(forward, forward_jit) of one family with the model-module signature `forward(weights, tokens, cache,
    cfg, *, num_valid, tap_layers, logits, implementation, return_router_logits)`: what each model module
    exports, so that callers holding a module need not pass the family."""

    def family_forward(weights, tokens, cache, cfg, *, num_valid=None, tap_layers=(), logits="all",
                       implementation="auto", return_router_logits=False) -> ForwardOutput:
        return forward(fam, weights, tokens, cache, cfg, num_valid=num_valid, tap_layers=tap_layers, logits=logits,
                       implementation=implementation, return_router_logits=return_router_logits)

    family_forward.__doc__ = f"`models.decoder.forward` of the {fam.name} family (see there for the arguments)."
    return family_forward, jax.jit(family_forward, static_argnames=_STATIC)
