"""The target forward run layer by layer from Python, with each MoE layer's experts from a provider.

This is the lossless offloaded forward. For every decoder layer l, in order:
  1. a jitted call runs the attention (or, for Qwen3.5, the DeltaNet / gated-attention) sub-layer, the
     post-attention norm and the router: the layer's EXACT routing (the same router on the same input as
     the resident forward);
  2. the host reads the routed expert ids (a [b*T, k] int32 transfer) and asks the provider for weight
     operands covering them (the provider fetches what is missing into the device pool);
  3. the runner checks on the host that every routed expert is resident in those operands; the experts
     then run on the pool through the slot table, in the same jitted call as step 1 of the next layer
     (one dispatch and one host sync per MoE layer).
So an expert GEMM never runs before the experts it reads are on the device, by construction and checked,
whatever any prediction said. Optionally (`ahead_width`), step 1 also applies the next MoE layer's router to
this layer's post-attention residual and step 2 hands that prediction to a hook that can prefetch the next
layer's experts one layer ahead (see `forward_layerwise`). Dense (non-MoE) layers run whole in one call.

One driver serves every family: the maths is the model module's own layer-wise pieces (`block_context`,
the attention / mixer sub-layer, `mlp_input`, `route`, `mlp_sublayer`), reached through the family adapter
of `offload.families`; only the program boundaries differ from the model's `forward`. Each layer's part of
the cache (K/V buffers, or a DeltaNet layer's state and rollback buffer) flows through its jitted call and
the adapter assembles the same cache object as the jitted forward, so `spec.session.commit_verify` and the
family's `rollback` work on it unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.qwen3 import ForwardOutput
from dflash_jax.offload.families import family_of_config
from dflash_jax.offload.predictors import router_topk


@dataclasses.dataclass
class ExpertOperands:
    """What a provider hands the runner for one MoE layer: `tables`, the layer's expert slot pools in the
    family's `expert_fields` order (`(gate_up, down)`; gpt-oss: `(gate_up, down, gate_up_bias, down_bias)`),
    the device slot table `slot_of` (None: identity, the pools are the whole tables) and `resident` [E] bool,
    the host's record of which experts those pools hold (the runner asserts every routed expert is resident)."""

    tables: tuple
    slot_of: jax.Array | None
    resident: np.ndarray


# provider(layer index, routed expert ids [b*T, k] numpy) -> ExpertOperands
ExpertProvider = Callable[[int, np.ndarray], ExpertOperands]
# ahead(target MoE layer j, predicted experts [b*T, width] numpy, their routing probabilities [b*T, width] numpy):
# the in-verify route-ahead hook, called for layer j right after the MoE layer before it was routed and supplied,
# before that layer's experts are dispatched (the loop prefetches j's missing experts there)
AheadHook = Callable[[int, np.ndarray, np.ndarray], None]


class NonResidentExpert(AssertionError):
    """An expert GEMM was about to read an expert that is not on the device (a provider bug)."""


@functools.partial(jax.jit, static_argnames=("fam", "cfg"))
def _begin(fam, weights, tokens, cache, num_valid, cfg):
    return fam.begin(weights, tokens, cache, num_valid, cfg)


def _route_ahead(fam, nxt, x, cfg, width):
    """The in-verify route-ahead prediction (`predictors.NextLayerResidual`): the next MoE layer's router parts
    `nxt` (`fam.router_parts`) applied to this layer's post-attention residual `x` [b, T, H] -> (experts
    [b*T, width], probs [b*T, width], logits [b*T, E]); None when `nxt` is None."""
    if nxt is None:
        return None
    norm_w, router, bias = nxt
    return router_topk(x.reshape(-1, x.shape[-1]), norm_w, router, bias, width, cfg.rms_norm_eps,
                       tuple(sorted(fam.router_norm.items())), fam.router_topk_first)


def _attend_and_route_impl(fam, layer, x, state, ctx, cfg, kind, nxt=None, width=0):
    x, state = fam.mixer(layer, x, state, ctx, kind, cfg)
    h = fam.mlp_input(layer, x, cfg)
    return x, h, fam.route(layer, h, cfg), state, _route_ahead(fam, nxt, x, cfg, width)


_attend_and_route = jax.jit(_attend_and_route_impl, static_argnames=("fam", "cfg", "kind", "width"))


@functools.partial(jax.jit, static_argnames=("fam", "cfg", "implementation"))
def _experts(fam, layer, x, h, routing, tables, slot_of, cfg, implementation):
    return fam.experts(layer, x, h, routing, tables, slot_of, cfg, implementation)


@functools.partial(jax.jit, static_argnames=("fam", "cfg", "kind", "implementation", "width"))
def _experts_then_attend(fam, prev, layer, x, h, routing, tables, slot_of, state, ctx, cfg, kind, implementation,
                         nxt=None, width=0):
    """Layer l's experts, then layer l+1's attention and router (and, with `nxt`, the route-ahead prediction
    of the MoE layer after it): one dispatch per MoE layer instead of two."""
    done = fam.experts(prev, x, h, routing, tables, slot_of, cfg, implementation)
    x, h, routing, state, guess = _attend_and_route_impl(fam, layer, done, state, ctx, cfg, kind, nxt, width)
    return done, x, h, routing, state, guess


@functools.partial(jax.jit, static_argnames=("fam", "cfg", "kind", "implementation"))
def _dense_layer(fam, layer, x, state, ctx, cfg, kind, implementation):
    x, state = fam.mixer(layer, x, state, ctx, kind, cfg)
    return fam.dense(layer, x, fam.mlp_input(layer, x, cfg), cfg, implementation), state


@functools.partial(jax.jit, static_argnames=("fam", "cfg", "logits"))
def _finish(fam, weights, x, num_valid, cfg, logits):
    return fam.finish(weights, x, num_valid, cfg, logits)


@dataclasses.dataclass
class LayerwiseOutput:
    """`out`: the ForwardOutput (router_experts [b, T, k] and router_logits [b, T, E] of every MoE layer);
    `routed`: {MoE layer: [b*T, k] int32 numpy}, the exact routing read on the host; `layer_seconds`: host
    wall time per layer (dispatch, routing read, provider, dispatch); `ahead` / `ahead_logits`: the in-verify
    route-ahead predictions (see `forward_layerwise`)."""

    out: ForwardOutput
    routed: dict[int, np.ndarray]
    layer_seconds: list[float]
    # with `ahead_width`: {MoE layer j: [b*T, width] int32 numpy} the in-verify prediction of layer j (read on the
    # host with the previous MoE layer's routing) and {j: [b*T, E] fp32 device array} its router logits
    ahead: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    ahead_logits: dict[int, jax.Array] = dataclasses.field(default_factory=dict)


def forward_layerwise(
    weights, tokens: jax.Array, cache, cfg, *, provider: ExpertProvider,
    num_valid: jax.Array | None = None, tap_layers: tuple[int, ...] = (), logits: str = "all",
    implementation: str = "auto", ahead: AheadHook | None = None, ahead_width: int | None = None,
) -> LayerwiseOutput:
    """The family's `forward` (Qwen3 / Qwen3-MoE, gpt-oss, Qwen3.5-MoE) layer by layer; MoE layer experts
    come from `provider` (see module doc).

    weights: target weights whose MoE layers need not carry expert tables (`store.strip_experts`).
    Arguments and results otherwise as the family's `forward` (router logits always returned; the cache is
    the family's cache type, e.g. `Qwen3_5Cache` with the DeltaNet states and rollback buffers).

    ahead_width: in-verify route-ahead (`predictors.NextLayerResidual`). In the jitted call that routes MoE
    layer i, the next MoE layer j's router (its post-attention norm, router and bias, as the family applies
    them) also runs on layer i's post-attention residual (the hidden state entering layer i's MoE sub-layer),
    giving each row's top-`ahead_width` experts of layer j. That small array is read on the host in the same
    transfer as layer i's routing (no extra sync) and handed to `ahead(j, experts, probs)` after layer i's
    provider call and before layer i's experts are dispatched, so copies issued there overlap layer i's
    experts and layer j's attention. The first MoE layer gets no prediction; the programs are shared by all
    layers of a kind (the next layer's weights are traced arguments)."""
    import time

    fam = family_of_config(cfg)
    if not isinstance(weights, fam.weights_type):
        raise TypeError(f"{type(cfg).__name__} needs {fam.weights_type.__name__} weights, got {type(weights).__name__}")
    if logits not in ("all", "last", "none"):
        raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
    b, t = tokens.shape
    if num_valid is None:
        num_valid = jnp.full((b,), t, jnp.int32)
    x, ctx = _begin(fam, weights, tokens, cache, num_valid, cfg)
    last = cfg.num_layers - 1
    taps, routers, router_logits, states = {}, [], [], []
    routed: dict[int, np.ndarray] = {}
    seconds = []
    pending = None  # (index, layer, h, routing, operands) of a MoE layer routed and supplied, experts not yet run

    def finished(i, x):  # layer i's output h[i+1]
        if i in tap_layers and i != last:
            taps[i] = x

    moe_ids = [i for i, layer in enumerate(weights.layers) if fam.is_moe(layer)]
    next_moe = dict(zip(moe_ids, moe_ids[1:])) if ahead_width else {}
    ahead_out: dict[int, np.ndarray] = {}
    ahead_logits: dict[int, jax.Array] = {}

    for i, layer in enumerate(weights.layers):
        t0 = time.perf_counter()
        kind = fam.kind(cfg, i)
        state = fam.layer_cache(cache, i, cfg)
        if not fam.is_moe(layer):
            if pending is not None:
                j, prev, h, routing, ops = pending
                x = _experts(fam, prev, x, h, routing, ops.tables, ops.slot_of, cfg, implementation)
                finished(j, x)
                pending = None
            x, state = _dense_layer(fam, layer, x, state, ctx, cfg, kind, implementation)
            finished(i, x)
            routers.append(None)
            router_logits.append(None)
        else:
            target = next_moe.get(i)
            nxt = None if target is None else fam.router_parts(weights.layers[target])
            width = 0 if target is None else int(ahead_width)
            if pending is None:
                x, h, routing, state, guess = _attend_and_route(fam, layer, x, state, ctx, cfg, kind, nxt, width)
            else:  # the previous layer's experts and this layer's attention + router in one call
                j, prev, h, routing, ops = pending
                done, x, h, routing, state, guess = _experts_then_attend(
                    fam, prev, layer, x, h, routing, ops.tables, ops.slot_of, state, ctx, cfg, kind, implementation,
                    nxt, width)
                finished(j, done)
            # waits for this layer's routing (the exact expert set) and, in the same transfer, the prediction
            experts, guessed = jax.device_get((routing.experts, None if guess is None else guess[:2]))
            experts = np.asarray(experts)
            ops = provider(i, experts)
            if len(ops.tables) != len(fam.expert_fields):
                raise ValueError(f"layer {i}: the provider gave {len(ops.tables)} expert tables, {fam.name} needs "
                                 f"{len(fam.expert_fields)} ({', '.join(fam.expert_fields)})")
            if not ops.resident[experts].all():
                bad = np.setdiff1d(experts, np.flatnonzero(ops.resident))
                raise NonResidentExpert(f"layer {i}: experts {bad.tolist()} are routed but not resident")
            if guessed is not None:  # before layer i's experts are dispatched (next iteration / after the loop)
                ahead_out[target] = np.asarray(guessed[0])
                ahead_logits[target] = guess[2]
                if ahead is not None:
                    ahead(target, ahead_out[target], np.asarray(guessed[1]))
            pending = (i, layer, h, routing, ops)
            routed[i] = experts
            routers.append(routing.experts.reshape(b, t, -1))
            router_logits.append(routing.logits.reshape(b, t, -1))
        states.append(state)
        seconds.append(time.perf_counter() - t0)
    if pending is not None:
        j, prev, h, routing, ops = pending
        x = _experts(fam, prev, x, h, routing, ops.tables, ops.slot_of, cfg, implementation)
        finished(j, x)
    normed, out_logits = _finish(fam, weights, x, num_valid, cfg, logits)
    if last in tap_layers:
        taps[last] = normed
    out = ForwardOutput(
        logits=out_logits, taps=tuple(taps[i] for i in tap_layers), router_experts=tuple(routers),
        cache=fam.new_cache(cache, ctx, states, cfg), router_logits=tuple(router_logits))
    return LayerwiseOutput(out=out, routed=routed, layer_seconds=seconds, ahead=ahead_out, ahead_logits=ahead_logits)
