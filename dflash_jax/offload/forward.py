"""The target forward run layer by layer from Python, with each MoE layer's experts from a provider.

This is the lossless offloaded forward. For every decoder layer l, in order:
  1. a jitted call runs the attention sub-layer, the post-attention norm and the router: the layer's
     EXACT routing (the same router on the same input as the resident forward);
  2. the host reads the routed expert ids (a [b*T, k] int32 transfer) and asks the provider for weight
     operands covering them (the provider fetches what is missing into the device pool);
  3. the runner checks on the host that every routed expert is resident in those operands; the experts
     then run on the pool through the slot table, in the same jitted call as step 1 of the next layer
     (one dispatch and one host sync per MoE layer).
So an expert GEMM never runs before the experts it reads are on the device, by construction and checked,
whatever any prediction said. Dense (non-MoE) layers run whole in one call.

The math is `models.qwen3.forward`'s, composed from the same functions (`block_context`,
`attention_sublayer`, `mlp_input`, `route`, `mlp_sublayer`); only the program boundaries differ.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.cache import KVCache
from dflash_jax.models import qwen3
from dflash_jax.models.qwen3 import ForwardOutput, MoEWeights


@dataclasses.dataclass
class ExpertOperands:
    """What a provider hands the runner for one MoE layer: the `(gate_up, down)` slot pools, the device slot
    table (None: identity, the pools are the whole tables) and `resident` [E] bool, the host's record of
    which experts those pools hold (the runner asserts every routed expert is resident)."""

    gate_up: Any
    down: Any
    slot_of: jax.Array | None
    resident: np.ndarray


# provider(layer index, routed expert ids [b*T, k] numpy) -> ExpertOperands
ExpertProvider = Callable[[int, np.ndarray], ExpertOperands]


class NonResidentExpert(AssertionError):
    """An expert GEMM was about to read an expert that is not on the device (a provider bug)."""


@functools.partial(jax.jit, static_argnames=("cfg",))
def _begin(weights, tokens, cache, num_valid, cfg):
    return qwen3.block_context(weights, tokens, cache, cfg, num_valid)


@functools.partial(jax.jit, static_argnames=("cfg", "window"))
def _attend_and_route(layer, x, k_buf, v_buf, ctx, cfg, window):
    x, k_buf, v_buf = qwen3.attention_sublayer(layer, x, k_buf, v_buf, ctx, window, cfg)
    h = qwen3.mlp_input(layer, x, cfg)
    return x, h, qwen3.route(layer.mlp, h, cfg), k_buf, v_buf


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def _experts(layer, x, h, routing, gate_up, down, slot_of, cfg, implementation):
    return qwen3.mlp_sublayer(layer, x, h, cfg, implementation, routing=routing, gate_up=gate_up, down=down,
                              slot_of=slot_of)


@functools.partial(jax.jit, static_argnames=("cfg", "window", "implementation"))
def _experts_then_attend(prev, layer, x, h, routing, gate_up, down, slot_of, k_buf, v_buf, ctx, cfg, window,
                         implementation):
    """Layer l's experts, then layer l+1's attention and router: one dispatch per MoE layer instead of two."""
    done = qwen3.mlp_sublayer(prev, x, h, cfg, implementation, routing=routing, gate_up=gate_up, down=down,
                              slot_of=slot_of)
    x, h, routing, k_buf, v_buf = _attend_and_route(layer, done, k_buf, v_buf, ctx, cfg, window)
    return done, x, h, routing, k_buf, v_buf


@functools.partial(jax.jit, static_argnames=("cfg", "window", "implementation"))
def _dense_layer(layer, x, k_buf, v_buf, ctx, cfg, window, implementation):
    x, k_buf, v_buf = qwen3.attention_sublayer(layer, x, k_buf, v_buf, ctx, window, cfg)
    return qwen3.mlp_sublayer(layer, x, qwen3.mlp_input(layer, x, cfg), cfg, implementation), k_buf, v_buf


@functools.partial(jax.jit, static_argnames=("cfg", "logits"))
def _finish(weights, x, num_valid, cfg, logits):
    normed = qwen3.rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    return normed, qwen3.select_logits(weights, normed, num_valid, logits)


@dataclasses.dataclass
class LayerwiseOutput:
    """`out`: the ForwardOutput (router_experts [b, T, k] and router_logits [b, T, E] of every MoE layer);
    `routed`: {MoE layer: [b*T, k] int32 numpy}, the exact routing read on the host; `layer_seconds`: host
    wall time per layer (dispatch, routing read, provider, dispatch)."""

    out: ForwardOutput
    routed: dict[int, np.ndarray]
    layer_seconds: list[float]


def forward_layerwise(
    weights, tokens: jax.Array, cache: KVCache, cfg, *, provider: ExpertProvider,
    num_valid: jax.Array | None = None, tap_layers: tuple[int, ...] = (), logits: str = "all",
    implementation: str = "auto",
) -> LayerwiseOutput:
    """`models.qwen3.forward` layer by layer; MoE layer experts come from `provider` (see module doc).

    weights: target weights whose MoE layers need not carry expert tables (`store.strip_experts`).
    Arguments and results otherwise as `qwen3.forward` (router logits always returned)."""
    import time

    if not isinstance(cfg, qwen3.Qwen3Config):
        raise NotImplementedError(f"layer-wise offloaded forward covers Qwen3 / Qwen3-MoE targets, not "
                                  f"{type(cfg).__name__}")
    b, t = tokens.shape
    if num_valid is None:
        num_valid = jnp.full((b,), t, jnp.int32)
    x, ctx = _begin(weights, tokens, cache, num_valid, cfg)
    last = cfg.num_layers - 1
    taps, routers, router_logits, new_k, new_v = {}, [], [], [], []
    routed: dict[int, np.ndarray] = {}
    seconds = []
    pending = None  # (index, layer, h, routing, operands) of a MoE layer routed and supplied, experts not yet run

    def finished(i, x):  # layer i's output h[i+1]
        if i in tap_layers and i != last:
            taps[i] = x

    for i, layer in enumerate(weights.layers):
        t0 = time.perf_counter()
        window = cfg.layer_windows[i]
        if not isinstance(layer.mlp, MoEWeights):
            if pending is not None:
                j, prev, h, routing, ops = pending
                x = _experts(prev, x, h, routing, ops.gate_up, ops.down, ops.slot_of, cfg, implementation)
                finished(j, x)
                pending = None
            x, k_buf, v_buf = _dense_layer(layer, x, cache.keys[i], cache.values[i], ctx, cfg, window, implementation)
            finished(i, x)
            routers.append(None)
            router_logits.append(None)
        else:
            if pending is None:
                x, h, routing, k_buf, v_buf = _attend_and_route(layer, x, cache.keys[i], cache.values[i], ctx, cfg,
                                                                window)
            else:  # the previous layer's experts and this layer's attention + router in one call
                j, prev, h, routing, ops = pending
                done, x, h, routing, k_buf, v_buf = _experts_then_attend(
                    prev, layer, x, h, routing, ops.gate_up, ops.down, ops.slot_of, cache.keys[i], cache.values[i],
                    ctx, cfg, window, implementation)
                finished(j, done)
            experts = np.asarray(routing.experts)  # waits for this layer's routing: the exact expert set
            ops = provider(i, experts)
            if not ops.resident[experts].all():
                bad = np.setdiff1d(experts, np.flatnonzero(ops.resident))
                raise NonResidentExpert(f"layer {i}: experts {bad.tolist()} are routed but not resident")
            pending = (i, layer, h, routing, ops)
            routed[i] = experts
            routers.append(routing.experts.reshape(b, t, -1))
            router_logits.append(routing.logits.reshape(b, t, -1))
        new_k.append(k_buf)
        new_v.append(v_buf)
        seconds.append(time.perf_counter() - t0)
    if pending is not None:
        j, prev, h, routing, ops = pending
        x = _experts(prev, x, h, routing, ops.gate_up, ops.down, ops.slot_of, cfg, implementation)
        finished(j, x)
    normed, out_logits = _finish(weights, x, num_valid, cfg, logits)
    if last in tap_layers:
        taps[last] = normed
    out = ForwardOutput(
        logits=out_logits, taps=tuple(taps[i] for i in tap_layers), router_experts=tuple(routers),
        cache=KVCache(keys=tuple(new_k), values=tuple(new_v), lengths=ctx.starts + num_valid.astype(jnp.int32)),
        router_logits=tuple(router_logits))
    return LayerwiseOutput(out=out, routed=routed, layer_seconds=seconds)
