"""Offloaded generation: the speculative rounds driven from Python with the target's experts in host memory.

  gen = OffloadedGenerator(pair, budget_bytes=..., prefetcher="draft_router", block_size=8)
  result = gen.generate(prompts, max_new_tokens=64)            # prefill + rounds until every sequence is done
  session = gen.prefill(prompts, max_new_tokens=64, sampling=..., stop_ids=..., seed=...)
  while not session.done:
      stats = gen.round(session)                               # one round -> RoundStats (also to the observers)
  result = gen.result(session)
  result = generate_offloaded(pair, prompts, budget_bytes=..., predictor=..., max_new_tokens=...)   # one call

The generator holds what does not depend on a request: the host expert store, the target without its expert
tables, the pool size the budget buys, the prefetcher and the verify policy. A request is validated and
mapped to bucketed shapes by `spec.session.prepare`: its token budgets, sampling settings, stop ids and keys
are traced per-sequence data (`RowParams`), so every request of a bucket (batch, prompt length, output and
cache length) runs the programs the first one compiled; only a pool row copy of a chunk size not seen before
(`store.pull_rows`, at most log2(S) + 1 of them) compiles later.

The baselines of the offload study, all through this one loop (B0, all experts resident, is the ordinary
`spec.generate` / `spec.generate_stepping`):
  B1  block_size=1, prefetcher "none": plain decoding, experts fetched on demand;
  B2  block_size=B, prefetcher "none": DFlash, on-demand fetch only;
  B3  block_size=B, a predictor: DFlash, the predicted experts prefetched BEFORE the verify is dispatched.

One round (`OffloadedGenerator.round`):
  1. predictors that do not read the draft predict and their prefetch is issued (before the draft);
  2. draft forward (`spec.session.draft_round`, jitted);
  3. predictors that read the draft predict; their prefetch is issued;
  4. the verify runs layer by layer (`offload.forward.forward_layerwise`): each MoE layer's exact routing is
     read on the host, missing experts are fetched on demand into the pool, and only then its experts run;
     with an in-verify predictor ("residual", `predictors.NextLayerResidual`) the next MoE layer's router on
     this layer's residual is read with the routing and the next layer's predicted experts are prefetched
     before this layer's experts are dispatched (hidden behind one layer's compute);
  5. acceptance / emission / rollback (`spec.session.commit_verify`, jitted), stats to the observers.
Steps 1, 3 and the in-verify part of 4 are the prefetcher's (`RoutePrefetcher`: a predictor plus the pool
policy; pass another object with the same methods to change it). With verify="auto", when the budget holds
every expert (all pinned) nothing can miss and steps 4-5 run as one jitted program on the pool instead (no
per-layer host round trips).
The output is the resident model's output: the same functions on the same inputs, experts read from the
pool only when resident (checked per layer). Tested token for token against the resident run.

Prefill streams each MoE layer's whole table to the device for that layer only (a prompt routes to nearly
every expert, so moving the table once is the least a prefill can move); its routing is the profile that
placement pins from. Each session owns its pool (placed from its own prefill); the pool budget covers that
decode-time pool, the prefill's one-layer transient buffer is outside it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import compile_cache
from dflash_jax.models import draft as draft_model
from dflash_jax.models.family import family_of
from dflash_jax.offload.bandwidth import probe_host_to_device_bandwidth
from dflash_jax.offload.cache import ExpertCache, min_budget_bytes, slab_groups, slab_slots
from dflash_jax.offload.forward import ExpertOperands, forward_layerwise, host_device
from dflash_jax.offload.hybrid import HostCompute, flops_per_row
from dflash_jax.offload.placement import cache_reserve, plan_shared, routing_profile, warm_shared
from dflash_jax.offload.predictors import NoPrediction, PreviousRound, RoundInputs, in_verify_part, make_predictor
from dflash_jax.offload.sharded import ShardedExpertCache
from dflash_jax.offload.provider import ExpertProvider
from dflash_jax.offload.stats import RoundStats, RoundTokens, RouteAheadStats, TraceObserver
from dflash_jax.offload.store import HostExpertStore, moe_layer_ids, strip_experts
from dflash_jax.sharding.place import shard_weights
from dflash_jax.spec.loop import LOOP_BUCKETS, GenerationResult, generation_result
from dflash_jax.spec.requests import Buckets
from dflash_jax.spec.sampling import SamplingParams
from dflash_jax.spec.loop import prepare_tree
from dflash_jax.spec.policy import AdaptivePolicy, choose_shape, update_calibration
from dflash_jax.spec.round import Chain, as_proposer, commit, commit_jit, propose_jit, verify_forward
from dflash_jax.spec.session import Prepared, SpecState, init_target_cache, prepare, start_state
from dflash_jax.spec.tree import TreeShape


@functools.partial(jax.jit, static_argnames=("spec", "cache_len"))
def start_prepared(target_w, draft_w, out, lengths, params, key_data, key_fold, spec, positions=None,
                   cache_len: int | None = None):
    """The state after the layer-wise prefill `out`, with the prepared per-sequence settings and keys (as
    `spec.session.begin_prepared` makes them); `positions`: the prompt rows' positions of a compressed prefill;
    `cache_len`: the slots of the draft's new cache (`session.start_state`)."""
    keys = jax.vmap(lambda d, f: jax.random.fold_in(jax.random.wrap_key_data(d), f))(key_data, key_fold)
    return start_state(target_w, draft_w, out, lengths, None, keys, spec, params=params, context_positions=positions,
                       cache_len=cache_len)


@functools.partial(jax.jit, static_argnames=("spec", "proposer", "implementation", "router_logits"))
def _verify_on_full_pool(pooled_w, state, proposal, spec, proposer, implementation, router_logits):
    """The verify and commit as ONE program on target weights whose MoE layers read a pool that holds every expert
    of every layer (nothing can miss, so the layer-wise host round trips would buy nothing); returns (state,
    per-layer router experts, per-layer router logits or None)."""
    out = verify_forward(pooled_w, state, proposal, spec, implementation, router_logits=router_logits)
    new, _ = commit(state, proposal, out, spec, proposer)
    return new, out.router_experts, out.router_logits if router_logits else None


@dataclasses.dataclass
class OffloadResult(GenerationResult):
    route_ahead: RouteAheadStats | None = None


# ----------------------------------------------------------------------------------------------------------
# the prefetcher
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class RoundPrefetch:
    """One round's prefetch record: the predictor's inputs, per MoE layer what was predicted (P, before-verify
    and in-verify parts together), what the prefetches moved, what the in-verify hook moved and when it was
    issued, and `t_issue`, when the before-verify prefetch was issued (the start of its hide window)."""

    inputs: RoundInputs
    pool: ExpertCache
    predicted: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    prefetched: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    late_moved: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    late_issued: dict[int, float] = dataclasses.field(default_factory=dict)
    t_issue: float = 0.0


class RoutePrefetcher:
    """Route-ahead prefetch into the pool from a predictor (`offload.predictors`). The generator calls, each
    round: `begin_round(pool, inputs)` -> a `RoundPrefetch`; `before_draft(rec)`; after the draft (with the
    draft's tokens / hidden states in `rec.inputs`) `after_draft(rec)`; and during the layer-wise verify, when
    `in_verify_width` is not None, `in_verify(rec, layer, experts, probs)` for each MoE layer but the first.

    Prefetches are best effort (`ExpertCache.prefetch`: as many of the most likely as fit); with
    `protect_previous` a prefetch never evicts an expert the previous verify routed to (a prediction that is
    wrong half the time would otherwise push out experts that are likely reused)."""

    def __init__(self, predictor, *, protect_previous: bool = True):
        self.predictor = predictor or NoPrediction()
        self.protect_previous = protect_previous
        self.late = in_verify_part(self.predictor)  # the in-verify (one layer ahead) part, e.g. "residual"

    @property
    def name(self) -> str:
        return self.predictor.name

    @property
    def needs_draft(self) -> bool:
        return bool(self.predictor.needs_draft)

    def in_verify_width(self, top_k: int) -> int | None:
        return None if self.late is None else (self.late.width or top_k)

    def reads_previous_logits(self, top_k: int) -> bool:
        """Whether a part predicts from the previous verify's router logits (`PreviousRound` wider than top_k)."""
        def walk(p):
            if isinstance(p, PreviousRound):
                return bool(p.width and p.width > top_k)
            return any(walk(q) for q in getattr(p, "predictors", ()))
        return walk(self.predictor)

    def begin_round(self, pool: ExpertCache, inputs: RoundInputs) -> RoundPrefetch:
        return RoundPrefetch(inputs=inputs, pool=pool, t_issue=time.perf_counter())

    def _keep(self, rec: RoundPrefetch, layer: int) -> list[np.ndarray]:
        previous = rec.inputs.previous_routed
        if self.protect_previous and previous:
            return [np.asarray(previous[layer], np.int32).reshape(-1)]
        return []

    def _issue(self, rec: RoundPrefetch, prediction: dict) -> None:
        for layer in rec.inputs.layers:
            ids = np.asarray(prediction.get(layer, ()), np.int32)
            rec.predicted[layer] = ids
            keep = self._keep(rec, layer)
            protect = np.unique(np.concatenate(keep)) if keep else ()
            rec.prefetched[layer] = rec.pool.prefetch(layer, ids, protect=protect).experts

    def before_draft(self, rec: RoundPrefetch) -> None:
        if not self.needs_draft:
            rec.t_issue = time.perf_counter()
            self._issue(rec, self.predictor.predict(rec.inputs))

    def after_draft(self, rec: RoundPrefetch) -> None:
        if self.needs_draft:
            rec.t_issue = time.perf_counter()
            self._issue(rec, self.predictor.predict(rec.inputs))

    def in_verify(self, rec: RoundPrefetch, layer: int, experts: np.ndarray, probs: np.ndarray) -> None:
        """Called before the previous MoE layer's experts are dispatched: prefetch `layer`'s predicted experts.
        It adds to the before-verify prediction: never evicts what that predicted (nor, with protect_previous,
        what the previous verify routed to); it writes only `layer`'s pool, so the experts of the layer about
        to run are untouched."""
        ids = self.late.rank(experts, probs)
        before = np.asarray(rec.predicted.get(layer, ()), np.int32)
        keep = [before] + self._keep(rec, layer)
        rec.late_issued[layer] = time.perf_counter()
        moved = rec.pool.prefetch(layer, ids, protect=np.unique(np.concatenate(keep))).experts
        rec.predicted[layer] = np.concatenate([before, ids[~np.isin(ids, before)]])
        rec.prefetched[layer] = np.concatenate([np.asarray(rec.prefetched.get(layer, ()), np.int32), moved])
        rec.late_moved[layer] = moved


# ----------------------------------------------------------------------------------------------------------
# a request in flight
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class OffloadSession:
    """One request batch between `OffloadedGenerator.prefill` and its last round: the prepared request
    (`spec`, bucketed prompts, per-sequence settings), the speculative state, the session's expert pool and
    placement, the route-ahead stats of its rounds so far (`route_ahead`) and its observers. `done` is True
    when every sequence is finished; `gen.result(session)` gives the `OffloadResult` (any time)."""

    prepared: Prepared
    state: SpecState
    pool: ExpertCache
    pinned: dict[int, np.ndarray]
    reserve: int
    initial_bytes: int
    full_pool: bool
    observers: tuple
    route_ahead: RouteAheadStats
    trace: TraceObserver | None
    host: dict  # host copies of the state after the last step: anchor, num_generated, done
    t_start: float
    prefill_s: float
    prefill_routed_bytes: int = 0  # the experts the prefill's tokens routed to (what an on-demand prefill moves)
    draft_s: float = 0.0
    verify_s: float = 0.0
    t_last: float = 0.0
    rounds: int = 0
    previous_routed: dict[int, np.ndarray] | None = None
    previous_logits: dict[int, np.ndarray] | None = None
    adaptive: dict | None = None  # an adaptive tree policy's per-sequence calibration and rounds per shape

    @property
    def spec(self):
        return self.prepared.spec

    @property
    def done(self) -> bool:
        return bool(self.host["done"].all())


def _host_view(state: SpecState) -> dict:
    anchor, num, done = jax.device_get((state.anchor, state.num_generated, state.done))
    return {"anchor": np.asarray(anchor), "num_generated": np.asarray(num), "done": np.asarray(done)}


_VERIFY = ("auto", "layerwise", "single")


class OffloadedGenerator:
    """Speculative (or, with block_size 1, plain) generation with the target's routed experts in host memory
    and a device pool of `budget_bytes` (see module doc). Lossless: the output equals the resident run's.

    prefetcher: a predictor name (`offload.predictors.PREDICTORS`), a predictor object (`predict` /
      `needs_draft` / `name`, and `in_verify` / `rank` / `width` for one that prefetches one layer ahead
      inside the verify, `predictors.NextLayerResidual`, alone or in a `Union`), or a `RoutePrefetcher`
      (or an object with its methods) for another prefetch policy.
    width: experts per token a named predictor predicts (default top_k).
    block_size: the verify width B (default: the draft's trained block size; 1 = plain decoding).
    pin: see below; the cache's other slots start with the next hottest (`placement.warm_shared`); False: the
      cache starts empty.
    crf_lambda: the pool's LRFU decay. protect_previous: see `RoutePrefetcher`.
    verify: "auto" = one jitted program on the pool when every expert is pinned (nothing can miss), layer by
      layer otherwise; "layerwise" = always layer by layer; "single" = one program (the budget must hold
      every expert, with pin=True).
    implementation: the MoE grouped-matmul implementation (`nn.moe`).
    store: a `HostExpertStore` of `pair.target` to reuse (default: built here; a pair loaded with
      expert_memory="pinned_host" is used in place).
    pool_factory: `pool_factory(store, budget_bytes, *, pinned, crf_lambda)` -> the session's device expert cache
      (default `cache.ExpertCache`, one cache shared by every MoE layer; tests pass
      `functools.partial(ExpertCache, poison=True)`).
    hybrid: a `hybrid.HostCompute` (cost-model figures): each round, missing experts whose host compute beats
      their copy are computed on the host CPU device instead of being copied (None: every expert on the device).
    bandwidth: host->device bytes/s for the transfer-time estimates in the stats (default:
      `bandwidth.probe_host_to_device_bandwidth()`, measured once per process).
    buckets: the compiled shapes (`spec.requests.Buckets`; default the loops' buckets, batch padded).
    proposer: what each round proposes (`spec.round`): a `Chain` (its width is the block size; `head=True`: the
      branch head's chain), or a tree / adaptive policy as `tree` below (None: the chain of `block_size`).
    tree: a `spec.tree.TreeShape`: each round verifies a token tree of `tree.budget` nodes (the draft's most
      probable continuations, `spec.tree`) instead of the chain; the experts its nodes route to are fetched as
      for a chain (None: the chain of `block_size`). A `spec.policy.AdaptivePolicy`: each round's shape (chain B
      or tree N) is chosen on the host before the draft (`spec.policy.choose_shape`), its costs e.g. seconds per
      round measured with this budget (expert copies included); counts in `stats["adaptive_rounds"]`.
    observers: objects with `on_round(RoundStats)` called after every round of every request.
    mesh: a `jax.sharding.Mesh` to run on (build the generator and run it under `jax.set_mesh(mesh)`): the
      non-expert weights and the draft are placed by their declarations (`dflash_jax.sharding`), the host
      store is replicated into every device's host memory, and the default cache is a
      `sharded.ShardedExpertCache` (each device caches its share of the slots). Load the pair without a mesh
      (experts in "pinned_host"). Hybrid placement does not combine with a mesh.

    Any budget from `min_budget_bytes` (one expert of each expert shape) up runs: a layer whose routed union
    does not fit in the cache runs its experts in passes (`cache.ExpertCache.plan_passes`); below it the
    constructor raises PoolTooSmall naming the minimum, before anything is compiled.
    pin: True = pin the prefill's hottest (layer, expert) pairs in the slots one layer's routed union leaves
      (`placement.plan_shared`); an int = at most that many of them; False / 0 = pin nothing.
    Each session owns its cache: sessions alive at the same time hold `budget_bytes` each (drop a session, or
    finish it, before the next when the device has room for one cache)."""

    def __init__(self, pair, *, budget_bytes: int, prefetcher="none", width: int | None = None,
                 block_size: int | None = None, pin: bool = True, crf_lambda: float = 0.5,
                 protect_previous: bool = True, verify: str = "auto", implementation: str = "auto",
                 store: HostExpertStore | None = None, pool_factory: Callable[..., Any] = ExpertCache,
                 bandwidth: float | None = None, buckets: Buckets | None = None, observers: Sequence[Any] = (),
                 hybrid: HostCompute | None = None, tree: TreeShape | AdaptivePolicy | None = None,
                 mesh=None, proposer=None):
        cfg = pair.target_cfg
        if not getattr(cfg, "is_moe", False):
            raise ValueError("offloaded generation needs an MoE target (this target has no routed experts)")
        if verify not in _VERIFY:
            raise ValueError(f"verify must be one of {', '.join(_VERIFY)}, got {verify!r}")
        self.pair, self.cfg = pair, cfg
        self.chain_head = False  # the chain from the draft's branch head (proposer=Chain(head=True))
        self.store = store or HostExpertStore(pair.target)
        self.stripped = strip_experts(pair.target)
        self.mesh = mesh
        if mesh is not None:
            self.stripped, pool_factory = self._on_mesh(mesh, hybrid, pool_factory)
        self.layers = moe_layer_ids(pair.target)
        self.top_k = cfg.moe.top_k
        self.budget_bytes = int(budget_bytes)
        self.min_budget_bytes = min_budget_bytes(self.store)
        self.groups = list(zip(slab_groups(self.store), slab_slots(self.store, self.budget_bytes)))  # raises
        self.slots = int(sum(n for _, n in self.groups))
        self.hybrid = hybrid
        if proposer is not None:
            if tree is not None:
                raise ValueError("pass the round's proposer once: proposer= (tree= is its older name)")
            if isinstance(proposer, Chain):
                if proposer.width is not None:
                    block_size = proposer.width if block_size is None else block_size
                self.chain_head = proposer.head
                if proposer.head and getattr(pair.draft, "branch_head", None) is None:
                    raise ValueError("the head chain proposes from the draft's branch head, and this pair's draft has "
                                     "none: load a pair shipped with branch_head.safetensors")
            else:
                tree = proposer
        if tree is not None and not isinstance(tree, (TreeShape, AdaptivePolicy)):
            raise TypeError(f"proposer must be a spec.round.Chain, a spec.tree.TreeShape or a spec.policy.AdaptivePolicy, "
                            f"got {type(tree).__name__}")
        # an adaptive policy provisions (cache rows, expert reserve, draft block) only the shapes it can choose;
        # with one reachable shape the session is exactly that fixed shape's
        self.policy, self._only = (tree, None) if isinstance(tree, AdaptivePolicy) else (None, None)
        if self.policy is not None:
            tree = self.policy.pruned()
            if len(tree.shapes) == 1:
                self._only = tree.shapes[0]
                tree, block_size = (None, self._only.budget) if self._only.is_chain else (self._only, block_size)
            elif block_size is None and all(s.is_chain for s in tree.shapes):
                block_size = max(s.budget for s in tree.shapes)
        self.tree = tree
        self.widest = 0 if tree is None else (tree.budget if isinstance(tree, TreeShape)
                                              else max(s.budget for s in tree.shapes))
        self._host_tables: dict[int, tuple] = {}
        if isinstance(prefetcher, str):
            prefetcher = make_predictor(prefetcher, self.stripped, cfg, width=width)
        if not hasattr(prefetcher, "begin_round"):  # a predictor
            prefetcher = RoutePrefetcher(prefetcher, protect_previous=protect_previous)
        self.prefetcher = prefetcher
        self.width = width
        self.block_size, self.pin, self.crf_lambda = block_size, pin, crf_lambda
        self.implementation, self.pool_factory = implementation, pool_factory
        self.bandwidth = probe_host_to_device_bandwidth() if bandwidth is None else float(bandwidth)
        self.buckets = LOOP_BUCKETS if buckets is None else buckets
        self.observers = tuple(observers)
        # With every expert pinned nothing can miss: the verify runs as one program on the pool (B0 residency).
        holds_all = pin is True and all(n >= len(g) * self.store.num_experts for g, n in self.groups)
        if verify == "single" and not holds_all:
            raise ValueError(
                f"verify='single' needs every expert pinned: pin=True and a budget of at least "
                f"{self.store.total_bytes} bytes (this one buys {self.slots} of "
                f"{len(self.layers) * self.store.num_experts} expert slots)")
        self.full_pool = holds_all and verify != "layerwise"
        reads_logits = getattr(prefetcher, "reads_previous_logits", lambda top_k: False)
        self.wants_logits = bool(width and width > self.top_k) or reads_logits(self.top_k)

    # ---- a request -----------------------------------------------------------------------------------------
    def whole_table(self, layer, experts):
        """The expert provider of a prefill: every expert of `layer`, its whole table streamed to the device."""
        return ExpertOperands(self.store.device_tables(layer), None, np.ones(self.store.num_experts, bool))

    def _on_mesh(self, mesh, hybrid, pool_factory):
        """The stripped target and the draft placed on `mesh`; the default cache split over its expert axes."""
        if hybrid is not None:
            raise ValueError("hybrid placement (host compute) does not combine with a mesh: pass hybrid=None")
        fam = family_of(self.cfg)
        stripped = shard_weights(self.stripped, fam.sharded_declarations(self.cfg), mesh)
        self.pair = dataclasses.replace(self.pair, draft=shard_weights(
            self.pair.draft, draft_model.declare_weights(self.pair.draft_cfg), mesh))
        if pool_factory is ExpertCache:
            pool_factory = functools.partial(ShardedExpertCache, mesh=mesh)
        return stripped, pool_factory

    def prefill(self, prompts: Sequence[Sequence[int]], *, max_new_tokens, sampling=SamplingParams(),
                stop_ids=(), seed=0, observers: Sequence[Any] = (), trace: bool = False, kept=None) -> OffloadSession:
        """Validates and buckets the request (`spec.session.prepare`: max_new_tokens, sampling, stop_ids, seed
        one value for every prompt or one per prompt), prefills it layer by layer with whole expert tables,
        builds the session's pool from the prefill's routing and returns the `OffloadSession`.
        observers: more `on_round` observers for this request; trace: keep a `TraceObserver` (the result's
        `trace`). kept: one index list per prompt, a compressed prefill of those tokens at their original
        positions (PFlash, `dflash_jax.pflash.compress`); None = every token."""
        compile_cache.ensure_enabled()
        t_start = time.perf_counter()
        request = dict(block_size=self.block_size, max_new_tokens=max_new_tokens, sampling=sampling,
                       stop_ids=stop_ids, seed=seed, buckets=self.buckets)
        prep = (prepare(self.pair, prompts, kept=kept, **request) if self.tree is None
                else prepare_tree(self.pair, prompts, widest=self.widest, kept=kept, **request))
        positions = None if prep.positions is None else jnp.asarray(prep.positions)
        spec, cfg, store = prep.spec, self.cfg, self.store
        batch = prep.tokens.shape[0]
        verify_width = self.widest or spec.block_size  # the widest verify (a tree's nodes, a policy's widest shape)

        # ---- prefill: every layer's table streamed through the device once ----
        lengths = jnp.asarray(prep.lengths)
        cache = init_target_cache(cfg, batch, spec.max_len, self.pair.target.embed.dtype, verify_width=verify_width)
        pre = forward_layerwise(self.stripped, jnp.asarray(prep.tokens), cache, cfg, provider=self.whole_table,
                                num_valid=lengths, tap_layers=spec.taps, logits="last",
                                implementation=self.implementation, positions=positions)
        state = start_prepared(self.stripped, self.pair.draft, pre.out, lengths, prep.params, prep.key_data,
                               prep.key_fold, spec, positions)
        host = _host_view(state)
        prefill_s = time.perf_counter() - t_start

        # ---- placement and pool ----
        valid = (np.arange(prep.tokens.shape[1])[None, :] < prep.lengths[:, None]).reshape(-1)
        profile = routing_profile({l: e[valid] for l, e in pre.routed.items()}, store.num_experts)
        routed_bytes = sum(int(np.count_nonzero(profile[l])) * store.expert_bytes(l) for l in profile)
        reserve = cache_reserve(store.num_experts, self.top_k, batch, verify_width)
        pinned = plan_shared(profile, self.groups, reserve) if self.pin else {l: np.zeros(0, np.int32)
                                                                               for l in self.layers}
        if self.pin is not True and self.pin:  # at most `pin` pins: the hottest of the plan
            hot = sorted(((-int(profile[l][e]), l, int(e)) for l, ids in pinned.items() for e in ids))[: int(self.pin)]
            pinned = {l: np.sort(np.asarray([e for _, ll, e in hot if ll == l], np.int32)) for l in self.layers}
        pool = self.pool_factory(store, self.budget_bytes, pinned=pinned, crf_lambda=self.crf_lambda)
        for layer, experts in (warm_shared(profile, self.groups, pinned) if self.pin else {}).items():
            pool.fetch(layer, experts)
        initial_bytes = sum(int(pool.resident(l).sum()) * store.expert_bytes(l) for l in self.layers)
        pool.block_until_ready()
        full_pool = self.full_pool and all(pool.pinned(l).all() for l in self.layers)
        tracer = TraceObserver() if trace else None
        observers = self.observers + tuple(observers) + ((tracer,) if tracer else ())
        session = OffloadSession(prepared=prep, state=state, pool=pool, pinned=pinned, reserve=reserve,
                              initial_bytes=initial_bytes, full_pool=full_pool, observers=observers,
                              prefill_routed_bytes=routed_bytes,
                              route_ahead=RouteAheadStats(), trace=tracer, host=host, t_start=t_start,
                              prefill_s=prefill_s, t_last=time.perf_counter())
        if isinstance(self.tree, AdaptivePolicy):
            zeros = np.zeros(batch, np.float32)
            session.adaptive = {"accepted": zeros, "expected": zeros, "chosen": np.zeros(len(self.tree.shapes), int)}
        return session

    def _round_proposer(self, session: OffloadSession):
        """This round's proposer (`spec.round`): the chain of the spec's block, the fixed tree, or the adaptive
        policy's choice (before the draft, from the session's calibration)."""
        if not isinstance(self.tree, AdaptivePolicy):
            return Chain(head=self.chain_head) if self.tree is None else as_proposer(self.tree)
        a = session.adaptive  # numpy on the host: no device round trip per round
        a["choice"] = int(choose_shape(self.tree, a["accepted"], a["expected"], ~session.host["done"]))
        return as_proposer(self.tree.shapes[a["choice"]])

    def round(self, session: OffloadSession) -> RoundStats:
        """One round: prefetch -> draft -> prefetch -> verify (layer-wise, fetching what is missing) -> commit.
        Updates the session, hands the `RoundStats` to the session's observers and returns it."""
        if session.done:
            raise ValueError("this session is finished (session.done): nothing left to generate")
        spec, pool, state = session.spec, session.pool, session.state
        layers, top_k, store = self.layers, self.top_k, self.store
        inputs = RoundInputs(round=session.rounds, layers=layers, top_k=top_k,
                             previous_routed=session.previous_routed, previous_logits=session.previous_logits)
        rec = self.prefetcher.begin_round(pool, inputs)

        t0 = time.perf_counter()
        self.prefetcher.before_draft(rec)
        proposer = self._round_proposer(session)
        proposal = propose_jit(proposer, self.stripped, self.pair.draft, state, spec)
        block, proposals = proposal.tokens, proposal.proposals
        jax.block_until_ready(block)
        t1 = time.perf_counter()
        if self.prefetcher.needs_draft:
            inputs.draft_tokens = proposals
            inputs.draft_hidden = proposal.hidden
            inputs.block_tokens = block
        self.prefetcher.after_draft(rec)
        provider = self.expert_provider(pool).begin(predicted=rec.predicted, prefetched=rec.prefetched,
                                                    late_moved=rec.late_moved, late_issued=rec.late_issued)

        t2 = time.perf_counter()
        logits = None
        if session.full_pool:
            state, router_experts, router_logits = _verify_on_full_pool(
                pool.pooled_weights(self.stripped), state, proposal, spec, proposer, self.implementation,
                self.wants_logits)
            pool.returned(router_experts)
            routed = {l: np.asarray(router_experts[l]).reshape(-1, top_k) for l in layers}
            for l in layers:  # the stats (every expert is resident: nothing moves)
                provider(l, routed[l])
            logits = router_logits
        else:
            width = self.prefetcher.in_verify_width(top_k)
            ahead = None if width is None else functools.partial(self.prefetcher.in_verify, rec)
            verify = forward_layerwise(self.stripped, block, state.target_cache, self.cfg,
                                       provider=provider, tap_layers=spec.taps, logits="all",
                                       implementation=self.implementation, ahead=ahead, ahead_width=width,
                                       dispatched=lambda i, x: pool.returned(x),
                                       tree=None if proposal.tree is None else proposal.tree.block())
            state, _ = commit_jit(state, proposal, verify.out, spec, proposer)
            routed = verify.routed
            logits = verify.out.router_logits
        provider.end()
        before = session.host
        output, num, acc, bonus, anchor, done = jax.device_get(
            (state.output, state.num_generated, state.last_accepted, state.last_bonus, state.anchor, state.done))
        t3 = time.perf_counter()

        live = ~before["done"]
        tokens = RoundTokens(
            live=live, anchor=before["anchor"], proposals=np.asarray(proposals), accepted=np.asarray(acc),
            bonus=np.asarray(bonus),
            emitted=[list(map(int, output[i, before["num_generated"][i]:num[i]])) if live[i] else []
                     for i in range(len(live))])
        stats = RoundStats(round=session.rounds, layers=[provider.stats[l] for l in layers], draft_s=t1 - t0,
                           verify_s=t3 - t2, hide_window_s=t3 - rec.t_issue, bandwidth=self.bandwidth,
                           tokens=tokens)
        session.state = state
        if session.adaptive is not None:
            a, c = session.adaptive, session.adaptive["choice"]
            acc_sum, exp_sum = update_calibration(self.tree, a["accepted"], a["expected"], c, np.asarray(acc),
                                                  np.asarray(before["done"]))
            a.update(accepted=np.asarray(acc_sum), expected=np.asarray(exp_sum))
            a["chosen"][c] += 1
        session.host = {"anchor": np.asarray(anchor), "num_generated": np.asarray(num), "done": np.asarray(done)}
        session.draft_s += t1 - t0
        session.verify_s += t3 - t2
        session.previous_routed = routed
        if self.wants_logits:
            session.previous_logits = {l: np.asarray(logits[l]).reshape(-1, store.num_experts) for l in layers}
        session.rounds += 1
        session.t_last = time.perf_counter()
        session.route_ahead.on_round(stats)
        for observer in session.observers:
            observer.on_round(stats)
        return stats

    def host_experts(self, layer: int, experts: np.ndarray, missing: np.ndarray) -> np.ndarray:
        """The missing experts of `layer` hybrid placement computes on the host this round (cost model)."""
        if self.hybrid is None or len(missing) == 0:
            return np.zeros(0, np.int64)
        rows = np.bincount(np.asarray(experts).reshape(-1), minlength=self.store.num_experts)
        return self.hybrid.choose(missing, rows, flops_per_row=flops_per_row(self.cfg.hidden_size,
                                                                               self.cfg.moe.intermediate_size),
                                  expert_bytes=self.store.expert_bytes(layer))

    def host_tables(self, layer: int) -> tuple:
        """Layer `layer`'s whole expert tables on the host CPU device (hybrid placement computes there)."""
        if layer not in self._host_tables:
            le = self.store.layers[layer]
            cpu = host_device()
            where = jax.sharding.SingleDeviceSharding(cpu, memory_kind=cpu.default_memory().kind)
            self._host_tables[layer] = le.tables([jax.device_put(leaf, where) for leaf in le.leaves])
        return self._host_tables[layer]

    def expert_provider(self, cache) -> ExpertProvider:
        """The per-verify expert protocol over `cache` (`offload.provider.ExpertProvider`), with this generator's
        hybrid placement (the host computes the missing experts its cost model picks)."""
        return ExpertProvider(cache, self.store.expert_bytes, host_tables=self.host_tables,
                              host_choice=self.host_experts if self.hybrid is not None else None)

    def result(self, session: OffloadSession) -> OffloadResult:
        """The session's tokens, acceptance lengths and stats (`stats`: time split; `offload`: budget, pool and
        placement; `route_ahead`: `RouteAheadStats.to_json()`), its per-round `route_ahead` and, with trace,
        its `trace` (padding rows of the batch bucket sliced off)."""
        spec, prep, store = session.spec, session.prepared, self.store
        seconds = session.t_last - session.t_start
        offload = {
            "budget_bytes": self.budget_bytes, "pool_bytes": session.pool.bytes, "cache_slots": self.slots,
            "min_budget_bytes": self.min_budget_bytes, "placement": "hybrid" if self.hybrid else "device",
            "num_experts": store.num_experts, "moe_layers": len(self.layers), "expert_bytes_all": store.total_bytes,
            "pinned_per_layer": {str(l): int(len(p)) for l, p in session.pinned.items()},
            "cache_reserve": session.reserve, "predictor": self.prefetcher.name, "width": self.width or self.top_k,
            "prefill_bytes": store.total_bytes, "prefill_routed_bytes": session.prefill_routed_bytes,
            "initial_load_bytes": session.initial_bytes,
            "bandwidth_bytes_per_s": self.bandwidth, "verify": "single" if session.full_pool else "layerwise",
        }
        run_stats = {
            "loop": "offloaded", "seconds": seconds, "block_size": spec.block_size, "method": spec.method,
            "proposer": ("adaptive" if self.policy is not None else "tree" if self.tree is not None
                         else "head-chain" if self.chain_head else "chain"),
            "tree": ("adaptive" if self.policy is not None
                     else {"budget": self.tree.budget, "branch": self.tree.branch} if self.tree is not None else None),
            "shapes": {"batch": int(prep.tokens.shape[0]), "prompt": int(prep.tokens.shape[1]),
                       "output": spec.output_len, "cache": spec.max_len},
            "time_split": {"prefill_s": session.prefill_s, "draft_s": session.draft_s, "verify_s": session.verify_s,
                           "host_s": seconds - session.prefill_s - session.draft_s - session.verify_s},
            "offload": offload, "route_ahead": session.route_ahead.to_json(),
        }
        trace = session.trace.rounds if session.trace is not None else None
        if self.policy is not None:
            counts = (dict(zip(self.tree.shapes, session.adaptive["chosen"])) if session.adaptive is not None
                      else {self._only: session.rounds})
            run_stats["adaptive_rounds"] = {sh.label() + ("" if sh.is_chain else f" K={sh.branch}"):
                                            int(counts.get(sh, 0)) for sh in self.policy.shapes}
        base = generation_result(session.state, run_stats, trace=trace, rows=prep.num_prompts)
        return OffloadResult(tokens=base.tokens, acceptance_lengths=base.acceptance_lengths, stats=base.stats,
                             trace=base.trace, route_ahead=session.route_ahead)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens, sampling=SamplingParams(), stop_ids=(),
                 seed=0, observers: Sequence[Any] = (), trace: bool = False, kept=None) -> OffloadResult:
        """`prefill`, rounds until every sequence is done, `result` (kept: a compressed prefill, see `prefill`)."""
        session = self.prefill(prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                               seed=seed, observers=observers, trace=trace, kept=kept)
        while not session.done:
            self.round(session)
        return self.result(session)


_MOVED = {
    "poison": "pass pool_factory=functools.partial(ExpertCache, poison=True)",
    "warmup": "run the request twice on one OffloadedGenerator (the second call runs compiled code)",
    "single_program_when_full": "pass verify='layerwise' (or 'auto')",
}


def generate_offloaded(pair, prompts: Sequence[Sequence[int]], *, budget_bytes: int, predictor="none",
                       block_size: int | None = None, max_new_tokens, width: int | None = None,
                       sampling=SamplingParams(), stop_ids=(), seed=0, **policy) -> OffloadResult:
    """One request through a new `OffloadedGenerator` (`predictor` is its `prefetcher`; `policy`: its other
    keyword arguments: pin, crf_lambda, protect_previous, verify, implementation, store, pool_factory,
    bandwidth, buckets, observers). Serving several requests? Keep one `OffloadedGenerator`."""
    for name, hint in _MOVED.items():
        if name in policy:
            raise TypeError(f"generate_offloaded no longer takes {name}=: {hint}")
    gen = OffloadedGenerator(pair, budget_bytes=budget_bytes, prefetcher=predictor, width=width,
                             block_size=block_size, **policy)
    return gen.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids, seed=seed)
