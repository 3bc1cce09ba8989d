"""Offloaded generation: the speculative rounds driven from Python with the target's experts in host memory.

  result = generate_offloaded(pair, prompts, budget_bytes=..., predictor="draft_router", block_size=8, ...)

The baselines of the offload study, all through this one loop (B0, all experts resident, is the ordinary
`spec.generate` / `spec.generate_stepping`):
  B1  block_size=1, predictor "none": plain decoding, experts fetched on demand;
  B2  block_size=B, predictor "none": DFlash, on-demand fetch only;
  B3  block_size=B, a predictor: DFlash, the predicted experts prefetched BEFORE the verify is dispatched.

One round:
  1. predictors that do not read the draft predict and their prefetch is issued (before the draft);
  2. draft forward (`spec.session.draft_round`, jitted);
  3. predictors that read the draft predict; their prefetch is issued;
  4. the verify runs layer by layer (`offload.forward.forward_layerwise`): each MoE layer's exact routing is
     read on the host, missing experts are fetched on demand into the pool, and only then its experts run;
     with an in-verify predictor ("residual", `predictors.NextLayerResidual`) the next MoE layer's router on
     this layer's residual is read with the routing and the next layer's predicted experts are prefetched
     before this layer's experts are dispatched (hidden behind one layer's compute);
  5. acceptance / emission / rollback (`spec.session.commit_verify`, jitted), stats.
When the budget holds every expert (all pinned), nothing can miss and steps 4-5 run as one jitted program
on the pool instead (no per-layer host round trips).
The output is the resident model's output: the same functions on the same inputs, experts read from the
pool only when resident (checked per layer). Tested token for token against the resident run.

Prefill streams each MoE layer's whole table to the device for that layer only (a prompt routes to nearly
every expert, so moving the table once is the least a prefill can move); its routing is the profile that
placement pins from. The pool budget covers the decode-time pool; the prefill's one-layer transient buffer
is outside it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.offload.forward import ExpertOperands, forward_layerwise
from dflash_jax.offload.placement import cache_reserve, plan_placement, routing_profile, warm_set
from dflash_jax.offload.pool import ExpertPool, PoolTooSmall, slots_for_budget
from dflash_jax.offload.predictors import NoPrediction, RoundInputs, in_verify_part, make_predictor
from dflash_jax.offload.stats import RoundStats, RouteAheadStats, layer_round_stats
from dflash_jax.offload.store import HostExpertStore, moe_layer_ids, strip_experts
from dflash_jax.spec.loop import GenerationResult, _result
from dflash_jax.spec.sampling import SamplingParams
from dflash_jax.spec.session import (
    commit_verify, draft_round_jit, init_target_cache, make_spec, start_state, target_family, verify_block,
)

_commit_verify_jit = jax.jit(commit_verify, static_argnames=("spec",))
_start_state_jit = jax.jit(start_state, static_argnames=("spec",))


@functools.partial(jax.jit, static_argnames=("spec", "implementation"))
def _verify_on_full_pool(pooled_w, state, draft, spec, implementation):
    """The verify as ONE program on target weights whose MoE layers read a pool that holds every expert of
    every layer (nothing can miss, so the layer-wise host round trips would buy nothing); returns (state,
    per-layer router experts)."""
    out = target_family(spec.target).forward(
        pooled_w, verify_block(state, draft), state.target_cache, spec.target, tap_layers=spec.taps, logits="all",
        implementation=implementation)
    return commit_verify(state, draft, out, spec), out.router_experts


@dataclasses.dataclass
class OffloadResult(GenerationResult):
    route_ahead: RouteAheadStats | None = None


def _init_cache(spec, batch, dtype):
    """The cache `spec.session.begin` prefills (Qwen3.5: DeltaNet rollback buffers sized by the verify width)."""
    return init_target_cache(spec.target, batch, spec.max_len, dtype, verify_width=spec.block_size)


def generate_offloaded(
    pair, prompts: Sequence[Sequence[int]], *, budget_bytes: int, predictor="none", block_size: int | None = None,
    max_new_tokens: int, width: int | None = None, sampling: SamplingParams = SamplingParams(),
    stop_ids: Sequence[int] = (), seed: int = 0, pin: bool = True, poison: bool = False, crf_lambda: float = 0.5,
    bandwidth: float | None = None, implementation: str = "auto", store: HostExpertStore | None = None,
    protect_previous: bool = True, warmup: bool = False, single_program_when_full: bool = True,
) -> OffloadResult:
    """Speculative (or, with block_size 1, plain) generation with the target's routed experts in host memory
    and a device pool of `budget_bytes` (see module doc). Lossless: the output equals the resident run's.

    predictor: a name (`offload.predictors.PREDICTORS`) or an object with `predict` / `needs_draft` / `name`
    (and `in_verify` / `rank` / `width` for a predictor that prefetches one layer ahead inside the verify,
    `predictors.NextLayerResidual`, alone or in a `Union`);
    width: experts per token a named predictor predicts (default top_k). pin: pin the prefill's hottest
    experts in the slots the cache reserve leaves (`placement.plan_placement`) and start the cache slots with
    the next hottest (`placement.warm_set`); False: the pool starts empty. poison: fill free slots and a
    trap slot with blow-up values (tests). bandwidth: host->device bytes/s for the transfer-time estimates
    in the stats (default: `cost_model.probe_host_to_device_bandwidth()`, measured once). store: reuse a
    `HostExpertStore` of `pair.target` (default: built here; a pair loaded with expert_memory="pinned_host"
    is used in place). protect_previous: a prefetch never evicts an expert the previous verify routed to
    (a prediction that is wrong half the time would otherwise push out experts that are likely reused);
    prefetches are best effort (`ExpertPool.prefetch`: as many of the most likely as fit). warmup: run the
    same call once first, so that `stats["seconds"]` times compiled code. single_program_when_full: with
    every expert pinned, verify in one jitted program (False: layer-wise anyway, to measure its overhead).

    Returns an `OffloadResult`: tokens, acceptance lengths, `stats` (time split; `offload`: budget, pool and
    placement; `route_ahead`: `RouteAheadStats.to_json()`), and `route_ahead`, the per-round stats."""
    if warmup:  # the same call once, so that `stats.seconds` times a compiled run
        store = store or HostExpertStore(pair.target)
        generate_offloaded(pair, prompts, budget_bytes=budget_bytes, predictor=predictor, block_size=block_size,
                           max_new_tokens=max_new_tokens, width=width, sampling=sampling, stop_ids=stop_ids, seed=seed,
                           pin=pin, poison=poison, crf_lambda=crf_lambda, bandwidth=bandwidth,
                           implementation=implementation, store=store, protect_previous=protect_previous,
                           single_program_when_full=single_program_when_full)
    t_start = time.perf_counter()
    spec, tokens, lengths = make_spec(pair, prompts, block_size=block_size, max_new_tokens=max_new_tokens,
                                      sampling=sampling)
    cfg = pair.target_cfg
    if not getattr(cfg, "is_moe", False):
        raise ValueError("offloaded generation needs an MoE target (this target has no routed experts)")
    if isinstance(predictor, str):
        predictor = make_predictor(predictor, pair.target, cfg, width=width)
    predictor = predictor or NoPrediction()
    late = in_verify_part(predictor)  # the in-verify (one layer ahead) part, e.g. "residual"
    store = store or HostExpertStore(pair.target)
    stripped = strip_experts(pair.target)
    layers = moe_layer_ids(pair.target)
    top_k = cfg.moe.top_k
    if bandwidth is None:
        from dflash_jax.offload.cost_model import probe_host_to_device_bandwidth

        bandwidth = probe_host_to_device_bandwidth()
    slots = slots_for_budget(store, budget_bytes)
    if slots < 1:
        raise PoolTooSmall(f"expert budget {budget_bytes} bytes is below one expert per MoE layer "
                           f"({sum(store.expert_bytes(l) for l in layers)} bytes)")
    batch = tokens.shape[0]

    # ---- prefill: every layer's table streamed through the device once ----
    def whole_table(layer, experts):
        return ExpertOperands(store.device_tables(layer), None, np.ones(store.num_experts, bool))

    tokens_d, lengths_d = jnp.asarray(tokens), jnp.asarray(lengths)
    prefill = forward_layerwise(stripped, tokens_d, _init_cache(spec, batch, pair.target.embed.dtype), cfg,
                                provider=whole_table, num_valid=lengths_d, tap_layers=spec.taps, logits="last",
                                implementation=implementation)
    stops = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
    state = _start_state_jit(stripped, pair.draft, prefill.out, lengths_d, stops, jax.random.key(seed), spec)
    jax.block_until_ready(state.anchor)
    t_prefill = time.perf_counter() - t_start

    # ---- placement and pool ----
    valid = (np.arange(tokens.shape[1])[None, :] < lengths[:, None]).reshape(-1)
    profile = routing_profile({l: e[valid] for l, e in prefill.routed.items()}, store.num_experts)
    reserve = cache_reserve(store.num_experts, top_k, batch, spec.block_size)
    pinned = plan_placement(profile, slots, reserve) if pin else {l: np.zeros(0, np.int32) for l in layers}
    pool = ExpertPool(store, slots, pinned=pinned, poison=poison, crf_lambda=crf_lambda)
    warm = warm_set(profile, slots) if pin else {}
    initial_bytes = 0
    for layer, experts in warm.items():
        pool.fetch(layer, experts)
    for layer in layers:
        initial_bytes += int(pool.resident(layer).sum()) * store.expert_bytes(layer)
    pool.block_until_ready()

    # With every expert pinned nothing can miss: the verify runs as one program on the pool (B0 residency).
    full_pool = single_program_when_full and all(pool.pinned(l).all() for l in layers)
    if full_pool and width and width > top_k:
        full_pool = False  # wide previous-round predictions read the router logits of the layer-wise verify

    # ---- rounds ----
    stats = RouteAheadStats()
    previous_routed = previous_logits = None
    wants_logits = bool(width and width > top_k)
    t_draft = t_verify = 0.0
    done = np.asarray(state.done)
    round_index = 0
    while not done.all():
        inputs = RoundInputs(round=round_index, layers=layers, top_k=top_k, previous_routed=previous_routed,
                             previous_logits=previous_logits)
        prefetched: dict[int, np.ndarray] = {}
        predicted: dict[int, np.ndarray] = {}
        late_moved: dict[int, np.ndarray] = {}  # what the in-verify hook moved, per target layer
        late_issued: dict[int, float] = {}  # when it was issued (its hide window ends when the layer is routed)

        def prefetch(prediction):
            for layer in layers:
                ids = np.asarray(prediction.get(layer, ()), np.int32)
                predicted[layer] = ids
                keep = previous_routed[layer] if (protect_previous and previous_routed) else ()
                prefetched[layer] = pool.prefetch(layer, ids, protect=np.unique(keep)).experts

        t0 = time.perf_counter()
        t_issue = t0
        if not predictor.needs_draft:
            prefetch(predictor.predict(inputs))
        draft = draft_round_jit(stripped, pair.draft, state, spec)
        jax.block_until_ready(draft.tokens)
        t1 = time.perf_counter()
        if predictor.needs_draft:
            inputs.draft_tokens, inputs.draft_hidden = draft.tokens, draft.hidden
            inputs.block_tokens = verify_block(state, draft)
            t_issue = time.perf_counter()
            prefetch(predictor.predict(inputs))
        layer_stats = {}

        def on_demand(layer, experts):
            window = time.perf_counter() - late_issued[layer] if layer in late_issued else 0.0
            resident = pool.resident(layer).copy()
            pool.fetch(layer, experts)
            pool.touch(layer, experts)
            layer_stats[layer] = layer_round_stats(
                layer, predicted=predicted.get(layer, ()), routed=experts, resident=np.flatnonzero(resident),
                prefetched=prefetched.get(layer, ()), expert_bytes=store.expert_bytes(layer),
                prefetched_in_verify=late_moved.get(layer, ()), in_verify_window_s=window)
            return ExpertOperands(pool.operands(layer), pool.slot_table(layer), pool.resident(layer))

        def in_verify(layer, experts, probs):
            """The in-verify hook (before the previous MoE layer's experts are dispatched): prefetch `layer`'s
            predicted experts. It adds to the before-verify prediction: never evicts what that predicted (nor,
            with protect_previous, what the previous verify routed to); it writes only `layer`'s pool, so the
            experts of the layer about to run are untouched."""
            ids = late.rank(experts, probs)
            before = np.asarray(predicted.get(layer, ()), np.int32)
            keep = [before]
            if protect_previous and previous_routed:
                keep.append(np.asarray(previous_routed[layer], np.int32).reshape(-1))
            late_issued[layer] = time.perf_counter()
            moved = pool.prefetch(layer, ids, protect=np.unique(np.concatenate(keep))).experts
            predicted[layer] = np.concatenate([before, ids[~np.isin(ids, before)]])
            prefetched[layer] = np.concatenate([np.asarray(prefetched.get(layer, ()), np.int32), moved])
            late_moved[layer] = moved

        t2 = time.perf_counter()
        if full_pool:
            state, router_experts = _verify_on_full_pool(pool.pooled_weights(stripped), state, draft, spec,
                                                         implementation)
            routed = {l: np.asarray(router_experts[l]).reshape(-1, top_k) for l in layers}
            for l in layers:
                on_demand(l, routed[l])
        else:
            verify = forward_layerwise(stripped, verify_block(state, draft), state.target_cache, cfg,
                                       provider=on_demand, tap_layers=spec.taps, logits="all",
                                       implementation=implementation, ahead=in_verify if late is not None else None,
                                       ahead_width=(late.width or top_k) if late is not None else None)
            state = _commit_verify_jit(state, draft, verify.out, spec)
            routed = verify.routed
        done = np.asarray(state.done)
        t3 = time.perf_counter()
        t_draft += t1 - t0
        t_verify += t3 - t2
        stats.add(RoundStats(round=round_index, layers=[layer_stats[l] for l in layers], draft_s=t1 - t0,
                             verify_s=t3 - t2, hide_window_s=t3 - t_issue, bandwidth=bandwidth))
        previous_routed = routed
        if wants_logits and not full_pool:
            previous_logits = {l: np.asarray(verify.out.router_logits[l]).reshape(-1, store.num_experts)
                               for l in layers}
        pool.advance()
        round_index += 1
    seconds = time.perf_counter() - t_start
    offload = {
        "budget_bytes": int(budget_bytes), "pool_bytes": pool.bytes, "slots_per_layer": slots,
        "num_experts": store.num_experts, "moe_layers": len(layers), "expert_bytes_all": store.total_bytes,
        "pinned_per_layer": {str(l): int(len(p)) for l, p in pinned.items()}, "cache_reserve": reserve,
        "predictor": predictor.name, "width": width or top_k, "prefill_bytes": store.total_bytes,
        "initial_load_bytes": initial_bytes,
        "bandwidth_bytes_per_s": bandwidth,
    }
    run_stats = {
        "loop": "offloaded", "seconds": seconds, "block_size": spec.block_size,
        "time_split": {"prefill_s": t_prefill, "draft_s": t_draft, "verify_s": t_verify,
                       "host_s": seconds - t_prefill - t_draft - t_verify},
        "offload": offload, "route_ahead": stats.to_json(),
    }
    base = _result(state, run_stats)
    return OffloadResult(tokens=base.tokens, acceptance_lengths=base.acceptance_lengths, stats=base.stats,
                         route_ahead=stats)
