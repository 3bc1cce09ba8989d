"""The target forward run layer by layer from Python, with each MoE layer's experts from a provider.

This is the lossless offloaded forward: the one decoder loop (`models.decoder.run_layers`) with its pieces
as separately jitted steps (`LayerwiseSteps`) and an expert hook. For every decoder layer l, in order:
  1. a jitted call runs the mixer sub-layer (attention, or Qwen3.5's DeltaNet / gated attention), the
     post-attention norm and the router: the layer's EXACT routing (the same router on the same input as
     the resident forward);
  2. the hook reads the routed expert ids on the host (a [b*T, k] int32 transfer) and asks the provider for
     weight operands covering them (the provider fetches what is missing into the device pool), checks that
     every routed expert is resident in them, and hands the loop the layer with its experts on the pool
     (`ModelFamily.with_expert_pool`: the slot table travels inside the layer's weights);
  3. a jitted call runs the layer's experts on the pool; or, when the provider gives *passes* (the layer's
     routed union does not fit in the device cache at once, or hybrid placement computes cold experts on the
     host CPU device), one jitted call per pass, each computing the rows routed to the pass's experts (the
     others weighted 0) and chaining the residual: x + the sum of every routed row's contribution, each
     routed expert in exactly one pass (checked). Equal to one pass up to fp32 summation order.
So an expert GEMM never runs before the experts it reads are on the device, by construction and checked,
whatever any prediction said. Optionally (`ahead_width`), step 1 also applies the next MoE layer's router to
this layer's post-attention residual and step 2 hands that prediction to a hook that can prefetch the next
layer's experts one layer ahead (see `forward_layerwise`). Dense (non-MoE) layers run without a host read.
Each layer's part of the cache flows through its jitted call and the family assembles the same cache object
as the resident forward, so `spec.session.commit_verify` and the family's `rollback` work on it unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.decoder import ForwardOutput, Routing, Steps, route_layer, run_layers
from dflash_jax.models.family import family_of


@dataclasses.dataclass
class ExpertOperands:
    """What a provider hands the runner for one MoE layer: `tables`, the layer's expert slot pools in the
    family's `expert_fields` order (`(gate_up, down)`; gpt-oss: `(gate_up, down, gate_up_bias, down_bias)`),
    the device slot table `slot_of` (None: identity, the pools are the whole tables) and `resident` [E] bool,
    the host's record of which experts those pools hold (the runner asserts every routed expert is resident)."""

    tables: tuple
    slot_of: jax.Array | None
    resident: np.ndarray
    # a pass over part of the routed experts (see `forward_layerwise`): [E] bool, the experts this pass computes
    # (None: every routed expert, one pass); `host`: the tables are the whole table on the host CPU device and
    # the pass runs there (hybrid placement), its output moved back to the device
    mask: np.ndarray | None = None
    host: bool = False


# provider(layer index, routed expert ids [b*T, k] numpy) -> ExpertOperands, or an iterable of ExpertOperands with
# masks (passes; the next pass is taken only after the previous one was dispatched, so a provider can reuse slots)
ExpertProvider = Callable[[int, np.ndarray], "ExpertOperands | Iterable[ExpertOperands]"]
# ahead(target MoE layer j, predicted experts [b*T, width] numpy, their routing probabilities [b*T, width] numpy):
# the in-verify route-ahead hook, called for layer j right after the MoE layer before it was routed and supplied,
# before that layer's experts are dispatched (the loop prefetches j's missing experts there)
AheadHook = Callable[[int, np.ndarray, np.ndarray], None]


class NonResidentExpert(AssertionError):
    """An expert GEMM was about to read an expert that is not on the device (a provider bug)."""


@functools.partial(jax.jit, static_argnames=("fam", "cfg"))
def begin_forward(fam, weights, tokens, cache, num_valid, cfg):
    return fam.block_context(weights, tokens, cache, num_valid, cfg)


def _route_ahead(fam, nxt, x, cfg, width):
    """The in-verify route-ahead prediction (`predictors.NextLayerResidual`): the next MoE layer's router `nxt`
    (`fam.router_of`) applied by the family's routing (`fam.route_rows`) to this layer's post-attention residual
    `x` [b, T, H] -> (experts [b*T, width], probs [b*T, width], logits [b*T, E]); None when `nxt` is None."""
    if nxt is None:
        return None
    routing = fam.route_rows(nxt, x.reshape(-1, x.shape[-1]), cfg, top_k=width)
    return routing.experts, routing.probs, routing.logits


@functools.partial(jax.jit, static_argnames=("fam", "cfg", "kind", "moe", "width"))
def attend_layer(fam, layer, x, state, ctx, cfg, kind, moe, nxt=None, width=0):
    x, state = fam.mixer(layer, x, state, ctx, kind, cfg)
    h = fam.mlp_input(layer, x, cfg)
    routing = route_layer(fam, layer, x, cfg) if moe else None
    return x, h, routing, state, _route_ahead(fam, nxt, x, cfg, width)


@functools.partial(jax.jit, static_argnames=("fam", "cfg", "implementation"))
def mlp_layer(fam, layer, x, h, routing, cfg, implementation):
    if routing is None:
        return fam.dense(layer, x, h, cfg, implementation)
    return fam.experts(layer, x, h, routing, cfg, implementation)


@functools.partial(jax.jit, static_argnames=("fam", "cfg", "implementation", "first"))
def _mlp_pass(fam, layer, x, h, routing, mask, cfg, implementation, first):
    """One pass of a MoE layer's experts: the rows routed to experts in `mask` [E] bool keep their weights, the
    others get weight 0 and are pointed at an expert of the pass (resident, so the zero-weighted product is
    finite and adds an exact 0); passes after the first add only the routed part (`routed_only`: a shared
    expert is added once). Chaining x through the passes gives x + the sum of every routed row's contribution."""
    in_pass = mask[routing.experts]
    anchor = jnp.argmax(mask).astype(routing.experts.dtype)
    part = Routing(weights=jnp.where(in_pass, routing.weights, 0).astype(routing.weights.dtype),
                   experts=jnp.where(in_pass, routing.experts, anchor), logits=routing.logits)
    if not first:
        layer = layer.replace(mlp=fam.routed_only(layer.mlp))
    return fam.experts(layer, x, h, part, cfg, implementation)


@dataclasses.dataclass
class _Passes:
    """What the expert hook hands the decoder loop for a layer computed in passes: the layer weights (without
    expert tables) and the passes, the first already placed, the rest taken one at a time."""

    layer: object
    first: ExpertOperands
    rest: object  # iterator of ExpertOperands
    check: Callable[[ExpertOperands], None]
    routed: np.ndarray  # the layer's distinct routed experts


def host_device():
    """The JAX CPU device hybrid placement computes cold experts on."""
    return jax.devices("cpu")[0]


def _chain(first, rest):
    yield first
    yield from rest


@functools.partial(jax.jit, static_argnames=("fam", "cfg", "logits"))
def finish_forward(fam, weights, x, num_valid, cfg, logits):
    return fam.finish(weights, x, num_valid, cfg, logits)


class LayerwiseSteps(Steps):
    """The decoder loop's pieces as separately jitted programs (shared by all layers of a kind: the layer's
    weights are traced arguments), timing each layer on the host and, with `next_moe`, computing the in-verify
    route-ahead prediction of the next MoE layer with each MoE layer's routing."""

    def __init__(self, fam, cfg, implementation, weights, next_moe: dict[int, int], width: int,
                 dispatched: Callable[[int, jax.Array], None] | None = None):
        super().__init__(fam, cfg, implementation)
        self.dispatched = dispatched or (lambda i, x: None)
        self.weights, self.next_moe, self.width = weights, next_moe, width
        self.guess = None  # (target MoE layer, (experts, probs, logits)) of the last attend, if any
        self.starts: list[float] = []

    def begin(self, weights, tokens, cache, num_valid):
        return begin_forward(self.fam, weights, tokens, cache, num_valid, self.cfg)

    def attend(self, i, layer, x, state, ctx, moe):
        self.starts.append(time.perf_counter())
        target = self.next_moe.get(i) if moe else None
        nxt = None if target is None else self.fam.router_of(self.weights.layers[target])
        x, h, routing, state, guess = attend_layer(self.fam, layer, x, state, ctx, self.cfg, self.fam.kind(self.cfg, i),
                                              moe, nxt, 0 if target is None else self.width)
        self.guess = None if guess is None else (target, guess)
        return x, h, routing, state

    def mlp(self, i, layer, x, h, routing):
        if not isinstance(layer, _Passes):
            x = mlp_layer(self.fam, layer, x, h, routing, self.cfg, self.implementation)
            self.dispatched(i, x)
            return x
        passes, covered = layer, []
        first = True
        for ops in _chain(passes.first, passes.rest):
            passes.check(ops)
            lw = passes.layer.replace(mlp=self.fam.with_expert_pool(passes.layer.mlp, ops.tables, ops.slot_of))
            mask = np.asarray(ops.mask, bool)
            if ops.host:  # hybrid placement: this pass runs on the host CPU device, its output comes back
                home = x.sharding
                lw, xin, hin, rin, m = jax.device_put((lw, x, h, routing, mask), host_device())
                x = jax.device_put(_mlp_pass(self.fam, lw, xin, hin, rin, m, self.cfg, self.implementation, first),
                                   home)
            else:
                x = _mlp_pass(self.fam, lw, x, h, routing, jnp.asarray(mask), self.cfg, self.implementation, first)
            covered.append(np.flatnonzero(mask))
            first = False
            self.dispatched(i, x)
        got = np.concatenate(covered)
        if len(got) != len(np.unique(got)) or np.setdiff1d(passes.routed, got).size:
            raise NonResidentExpert(f"layer {i}: the passes computed experts {sorted(got.tolist())}, the layer was "
                                    f"routed to {passes.routed.tolist()} (each routed expert exactly once)")
        return x

    def finish(self, weights, x, num_valid, logits):
        self.starts.append(time.perf_counter())
        return finish_forward(self.fam, weights, x, num_valid, self.cfg, logits)


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
    dispatched: Callable[[int, jax.Array], None] | None = None, tree=None, positions: jax.Array | None = None,
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
    layers of a kind (the next layer's weights are traced arguments).

    tree: a `models.decoder.TreeBlock` when `tokens` is a token tree (`spec.tree`), as for `forward`.

    dispatched(i, x): called right after each of layer i's expert calls (every pass) is dispatched, with its
    output x: the operands it read may be written again once x is computed (a shared device cache defers
    copies into its slab until the call is dispatched and waits for x before it overwrites a slot).

    positions: explicit RoPE positions [b, T] (a compressed prefill, `models.decoder.forward`)."""
    fam = family_of(cfg)
    if not isinstance(weights, fam.weights_type):
        raise TypeError(f"{type(cfg).__name__} needs {fam.weights_type.__name__} weights, got {type(weights).__name__}")
    b, t = tokens.shape
    if num_valid is None:
        num_valid = jnp.full((b,), t, jnp.int32)
    moe_ids = fam.moe_layer_ids(weights)
    next_moe = dict(zip(moe_ids, moe_ids[1:])) if ahead_width else {}
    steps = LayerwiseSteps(fam, cfg, implementation, weights, next_moe, int(ahead_width or 0), dispatched)
    routed: dict[int, np.ndarray] = {}
    ahead_out: dict[int, np.ndarray] = {}
    ahead_logits: dict[int, jax.Array] = {}

    def place_experts(i, layer, routing):
        # waits for this layer's routing (the exact expert set) and, in the same transfer, the prediction
        guess = steps.guess
        experts, guessed = jax.device_get((routing.experts, None if guess is None else guess[1][:2]))
        experts = np.asarray(experts)
        given = provider(i, experts)
        if isinstance(given, ExpertOperands) and given.mask is None and not given.host:
            ops, rest = given, None
        else:
            it = iter([given] if isinstance(given, ExpertOperands) else given)
            ops, rest = next(it), it

        def check(ops):
            if len(ops.tables) != len(fam.expert_fields):
                raise ValueError(f"layer {i}: the provider gave {len(ops.tables)} expert tables, {fam.name} needs "
                                 f"{len(fam.expert_fields)} ({', '.join(fam.expert_fields)})")
            if ops.mask is None and rest is not None:
                raise ValueError(f"layer {i}: every pass of a layer computed in passes needs its expert mask")
            need = experts if ops.mask is None else experts[np.asarray(ops.mask, bool)[experts]]
            if not ops.resident[need].all():
                bad = np.setdiff1d(need, np.flatnonzero(ops.resident))
                raise NonResidentExpert(f"layer {i}: experts {bad.tolist()} are routed but not resident")

        check(ops)
        if guessed is not None:  # before layer i's experts are dispatched
            target = guess[0]
            ahead_out[target] = np.asarray(guessed[0])
            ahead_logits[target] = guess[1][2]
            if ahead is not None:
                ahead(target, ahead_out[target], np.asarray(guessed[1]))
        routed[i] = experts
        if rest is not None:
            return _Passes(layer=layer, first=ops, rest=rest, check=check, routed=np.unique(experts))
        return layer.replace(mlp=fam.with_expert_pool(layer.mlp, ops.tables, ops.slot_of))

    out = run_layers(steps, weights, tokens, cache, num_valid=num_valid, tap_layers=tap_layers, logits=logits,
                     return_router_logits=True, expert_hook=place_experts, tree=tree, positions=positions)
    seconds = list(np.diff(steps.starts))
    return LayerwiseOutput(out=out, routed=routed, layer_seconds=seconds, ahead=ahead_out, ahead_logits=ahead_logits)
