"""The serving engine's rounds with the target's routed experts in host memory: the scheduler's demand drives
prefetch.

`Engine(pair, experts="offload", budget_bytes=..., slots=4, ...)` serves requests that arrive and leave at any
round with the host engine's slots, admissions, scheduler, width choice and emission, and this module's
`OffloadedRunner` running the rounds: the target's routed experts in a host store
(`offload.store.HostExpertStore`) and ONE device expert cache of `budget_bytes` shared by every MoE layer and every
request (`offload.cache.ExpertCache`, copies issued as `jax.device_put` of host rows). One round:

  1. admissions: a waiting group is prefilled layer by layer with each MoE layer's whole table streamed to
     the device for that layer only (`offload.forward.forward_layerwise`, as `OffloadedGenerator.prefill`);
  2. the draft of the round's rows, and each row's projected expert set [L, E] (the draft-router projection
     of `runner.ResidentRunner.draft`): the scheduler's per-row expert demand;
  3. the scheduler (`scheduler.schedule`) admits verifies under the budgets. With byte_cost="missing" (the
     default) a round's byte cost is the bytes of the admitted rows' projected union that are NOT resident in
     the cache (what the prefetch has to move), and the byte budget defaults to the cache's bytes: a round
     moves at most a cache's worth, rows whose experts are resident are cheap, and a row whose experts were
     evicted waits its turn (the deficit rule and its wait bound are unchanged). byte_cost="all" prices the
     whole union, as the resident engine does;
  4. prefetch: that union (and only that: rows that sit the round out move nothing), each layer's experts
     ranked by how many admitted rows project them, is put into the cache before the verify is dispatched
     (`ExpertCache.prefetch`: best effort, never evicting a pinned or held expert nor what the previous
     verify routed to);
  5. the verify runs layer by layer over the round's row bucket (the live rows are kept within the smallest bucket,
     by the engine): each MoE layer's exact routing is read on the host and what the
     admitted rows route to and is not resident is fetched on demand (passes when it does not fit; hybrid
     placement may compute it on the host), with `OffloadedGenerator`'s provider pieces. The rows that do
     not verify (sitting out, or free slots) still flow through the batched forward, but their outputs are
     thrown away (every row is put back as it was, `runner.keep_rows`); their experts are not fetched: the
     layer's slot table points them at a resident slot. So whatever the prediction, every admitted row's
     expert products read exactly its routed experts: the verify is the resident verify, and each request's
     output is its output run alone.

Stats: `RoundInfo.offload` (an `OffloadRound`: bytes moved by prefetch / on demand / prefill, hits and misses
of the admitted rows' routing, experts predicted vs used vs covered, passes, the prefetch set), running totals
in `OffloadedRunner.offload_totals` (`engine.runner.offload_summary()`), and Prometheus metrics (`attach_metrics`)
when served.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.offload.cache import ExpertCache
from dflash_jax.offload.forward import forward_layerwise
from dflash_jax.offload.loop import OffloadedGenerator, start_prepared
from dflash_jax.offload.placement import cache_reserve, plan_shared, routing_profile, warm_shared
from dflash_jax.serve.runner import (
    Drafted, Layout, PrefillBatch, ResidentRunner, RoundPlan, head_rows, prefill_slots, put_head_rows, settle_rows,
    verify_rows,
)
from dflash_jax.spec import prefill as chunked
from dflash_jax.spec.round import commit, verify_width
from dflash_jax.spec.session import SpecConfig, SpecState, init_target_cache
from dflash_jax.stored import stored_jit

PREDICTORS = ("draft_router", "none")  # what drives the prefetch: the scheduler's demand, or nothing (on demand)


@dataclasses.dataclass
class OffloadRound:
    """What one round moved and how the prediction did (in `RoundInfo.offload`). Counts are (MoE layer, expert)
    pairs: `predicted` the union of the admitted rows' projected experts (the prefetch request), `used` the
    union of what their verify routed to, `covered` both; `hits` used pairs resident when their layer ran,
    `misses` used pairs fetched on demand, `host` those computed on the host (hybrid placement)."""

    prefetched_bytes: int = 0
    on_demand_bytes: int = 0
    prefill_bytes: int = 0  # whole tables streamed by this round's admissions (one layer at a time)
    hits: int = 0
    misses: int = 0
    host: int = 0
    predicted: int = 0
    used: int = 0
    covered: int = 0
    prefetched: int = 0
    passes: int = 0
    predicted_bytes: int = 0
    used_bytes: int = 0
    requested: dict = dataclasses.field(default_factory=dict)  # {MoE layer: expert ids prefetch was asked for}
    row_demand: dict = dataclasses.field(default_factory=dict)  # {slot: bool [L, E]} every live row's projection
    resident_bytes: int = 0  # the cache's resident bytes after the round
    priced_bytes: float = 0.0  # the round's byte cost to the scheduler (byte_cost="missing": the union not resident)

    @property
    def moved_bytes(self) -> int:
        """Bytes moved host -> device for the verify (prefetch + on demand; the prefill's streaming apart)."""
        return self.prefetched_bytes + self.on_demand_bytes

    @property
    def hit_rate(self) -> float:
        return self.hits / self.used if self.used else 1.0

    @property
    def coverage(self) -> float:
        return self.covered / self.used if self.used else 1.0

    def to_json(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("requested", "row_demand")}
        return dict(out, moved_bytes=self.moved_bytes, hit_rate=self.hit_rate, coverage=self.coverage)


_TOTALS = ("prefetched_bytes", "on_demand_bytes", "prefill_bytes", "hits", "misses", "host", "predicted", "used",
           "covered", "prefetched", "passes")


@stored_jit(static_argnames=("spec", "proposer"))
def _commit(state: SpecState, proposal, draft_lengths, out, active, spec: SpecConfig, proposer) -> SpecState:
    """`runner._verify` after its target forward: acceptance and commit (`spec.round.commit`) for the rows where
    `active` is set, every other row kept as it was; `out` is the layer-wise forward of `proposal.tokens`."""
    run, proposal, active = verify_rows(state, proposal, draft_lengths, active, None)
    new, _ = commit(run, proposal, out, spec, proposer)
    return settle_rows(state, state, new, active, None)


_head_jit = jax.jit(head_rows, static_argnums=1)  # the first rows of the state (a row bucket)
_put_head_jit = jax.jit(put_head_rows, donate_argnums=0)  # ... written back in place


class OffloadedRunner(ResidentRunner):
    """`runner.ResidentRunner` with the target's routed experts in host memory and one device expert cache (module
    doc): the draft, the inserts and the compaction are the resident runner's (on the target without its expert
    tables); the prefill runs layer by layer with each layer's whole table streamed, and the verify layer by layer
    from the cache, after the prefetch of the admitted rows' projected union.

    budget_bytes: device bytes of the expert cache (any value from `offload.min_budget_bytes` up; a layer whose
      routed experts do not fit runs in passes; below the minimum: `offload.PoolTooSmall` naming it).
    predictor: "draft_router" (prefetch the admitted rows' projected union before the verify) or "none"
      (fetch on demand only: the baseline).
    pin: False (the default): nothing pinned, the cache is LRFU over every request's experts; True or a count:
      at the first admission, pin the hottest (layer, expert) pairs of those prompts' prefill in what one
      round's routed union leaves (`placement.plan_shared`, as `OffloadedGenerator`).
    byte_cost: what the scheduler's byte budget counts (by default the cache's bytes, the engine's
      `expert_byte_budget="auto"`), "missing" (the default): the bytes of the admitted rows' projected union not
      resident in the cache (to move), or "all": the union's bytes.
    hybrid: an `offload.HostCompute`: missing experts the cost model prefers to compute on the host are.
    transfer: the cache's copies ("device_put": host rows put on the device ahead of the verify; "pull_rows").
    store: a `HostExpertStore` of `pair.target` to reuse. bandwidth: host->device bytes/s (default: probed).
    No mesh: offloaded serving runs on one device."""

    chunked_prefill = True  # a long prompt's chunks run layer by layer with whole tables, one chunk per round
    deferred_context = True  # the verify's commit (`spec.round.commit`) keeps a deferring width-1 round's row pending
    catches_up = False  # a catch-up forward would need every table streamed: width-1 rounds hold their taps instead
    overlapped_verify = False  # the verify is driven from the host, layer by layer, after the prefetch
    bursts = False  # each round is driven from the host (prefetch, layer by layer): a round per call
    prompt_scores = False  # echo's prompt log-probs would need a whole-prompt forward with every table streamed
    default_byte_budget = "cache"  # a round moves at most the cache's bytes

    def carried(self):
        """Not known: the expert cache and its tables are carried too (the warm-up runs both passes)."""
        return None

    def __init__(self, pair, layout: Layout, *, budget_bytes: int, predictor: str = "draft_router", pin=False,
                 byte_cost: str = "missing", hybrid=None, transfer: str = "device_put", crf_lambda: float = 0.5,
                 store=None, bandwidth: float | None = None, poison: bool = False, mesh=None):
        if mesh is not None:
            raise ValueError("the offloaded engine runs on one device: drop mesh (or serve resident on the mesh)")
        if predictor not in PREDICTORS:
            raise ValueError(f"predictor must be one of {', '.join(PREDICTORS)} for serving (the prefetch follows the "
                             f"scheduler's demand, the draft-router projection), got {predictor!r}")
        if byte_cost not in ("missing", "all"):
            raise ValueError(f"byte_cost must be 'missing' or 'all', got {byte_cost!r}")
        if not getattr(pair.target_cfg, "is_moe", False):
            raise ValueError("offloaded serving needs an MoE target (this target has no routed experts)")
        # what a request does not change: the host store, the stripped target, the provider pieces (budget checked)
        self.gen = OffloadedGenerator(pair, budget_bytes=int(budget_bytes), prefetcher="none", pin=False,
                                      hybrid=hybrid, store=store, bandwidth=bandwidth, verify="layerwise")
        self.store = self.gen.store
        self.budget_bytes = int(budget_bytes)
        self.predictor, self.pin, self.transfer, self.byte_cost = predictor, pin, transfer, byte_cost
        self.crf_lambda, self.poison = crf_lambda, poison
        self.pool = self._new_cache({})
        super().__init__(pair, layout)
        # every program the resident runner runs on the target (draft, projection) gets the target without expert
        # tables: nothing here can read an expert that is not in the cache
        self.pair = dataclasses.replace(self.pair, target=self.gen.stripped)
        self._pin_pending = bool(pin)
        self._previous: dict[int, np.ndarray] = {}
        self._prefill_bytes = 0
        self.offload_totals = {k: 0 for k in _TOTALS}
        self.offload_totals["rounds"] = 0

    @property
    def cache_bytes(self) -> int:
        return self.pool.bytes

    def _new_cache(self, pinned: dict) -> ExpertCache:
        return ExpertCache(self.store, self.budget_bytes, pinned=pinned, poison=self.poison,
                           crf_lambda=self.crf_lambda, transfer=self.transfer)

    # -- prefill: layer by layer, whole tables streamed ----------------------------------------------------------

    def prefill(self, batch: PrefillBatch) -> SpecState:
        """The batch prefilled layer by layer (each MoE layer's whole table streamed to the device for that layer
        only); the first real requests' routing pins the cache when `pin` asks for it."""
        spec, gen = self.spec, self.gen
        tokens = batch.tokens
        slots = prefill_slots(spec.max_len, tokens.shape[1])  # as long as the prompt bucket needs (`insert`)
        cache = init_target_cache(spec.target, tokens.shape[0], slots, gen.stripped.embed.dtype,
                                  verify_width=spec.block_size)
        lengths = jnp.asarray(batch.lengths)
        positions = None if batch.positions is None else jnp.asarray(batch.positions, jnp.int32)
        pre = forward_layerwise(gen.stripped, jnp.asarray(tokens), cache, spec.target, provider=gen.whole_table,
                                num_valid=lengths, tap_layers=spec.taps, logits="last",
                                implementation=gen.implementation, positions=positions)
        self._prefill_bytes += self.store.total_bytes
        self._last_prefill = (pre.routed, np.asarray(lengths), tokens.shape[1])
        self.last_logits = jnp.asarray(pre.out.logits, jnp.float32)
        state = self._widen(start_prepared(gen.stripped, self.pair.draft, pre.out, lengths, batch.params,
                                           batch.key_data, batch.key_fold, spec, positions,
                                           None if slots == spec.max_len else slots))
        if self._pin_pending and batch.real:  # the first real requests: pin from their routing
            self._pin_from_prefill(batch.real)
        return state

    def prefill_start(self, tokens, valid, positions=None):
        """The first chunk of a long prompt, on empty caches (`prefill_chunk`)."""
        pre = chunked.prefill_init_jit(self.gen.stripped, self.pair.draft, int(tokens.shape[0]), self.spec)
        return self.prefill_chunk(pre, tokens, valid, positions=positions)

    def prefill_chunk(self, pre, tokens, valid, wait: bool = True, positions=None):
        """One chunk of a long prompt: the target forward layer by layer with each MoE layer's whole table streamed
        for that layer only (as a whole prefill), then the chunk's taps join the draft's context
        (`spec.prefill.prefill_absorb`). Nothing of the decode's expert cache moves."""
        gen, spec = self.gen, self.spec
        valid = jnp.asarray(valid, jnp.int32)
        positions = None if positions is None else jnp.asarray(positions, jnp.int32)
        out = forward_layerwise(gen.stripped, jnp.asarray(tokens, jnp.int32), pre.target_cache, spec.target,
                                provider=gen.whole_table, num_valid=valid, tap_layers=spec.taps, logits="last",
                                implementation=gen.implementation, positions=positions)
        self._prefill_bytes += self.store.total_bytes
        pre = chunked.prefill_absorb_jit(self.pair.draft, pre, out.out, valid, spec, positions)
        if wait:
            jax.block_until_ready(pre.logits)
        return pre

    def prefill_finish(self, pre, batch: PrefillBatch) -> SpecState:
        """The state after the last chunk: the first token, as a whole prefill's (`spec.prefill.prefill_finish`)."""
        self.last_logits = pre.logits
        return self._widen(chunked.prefill_finish_jit(self.gen.stripped, self.pair.draft, pre, batch.params,
                                                      batch.key_data, batch.key_fold, self.spec))

    def _pin_from_prefill(self, n: int) -> None:
        """Rebuilds the cache with the hottest (layer, expert) pairs of the last prefill's first `n` prompts
        pinned (`placement.plan_shared`) and the rest of the slots warm (`warm_shared`)."""
        routed, lengths, width = self._last_prefill
        valid = (np.arange(width)[None, :] < lengths[:n, None])
        profile = routing_profile({l: e.reshape(-1, width, e.shape[-1])[:n][valid] for l, e in routed.items()},
                                  self.store.num_experts)
        reserve = cache_reserve(self.store.num_experts, self.gen.top_k, self.slots, self.spec.block_size)
        pinned = plan_shared(profile, self.gen.groups, reserve)
        if self.pin is not True:  # at most `pin` pins: the hottest of the plan
            hot = sorted((-int(profile[l][e]), l, int(e)) for l, ids in pinned.items() for e in ids)[: int(self.pin)]
            pinned = {l: np.sort(np.asarray([e for _, ll, e in hot if ll == l], np.int32)) for l in pinned}
        self.pool = self._new_cache(pinned)
        for layer, experts in warm_shared(profile, self.gen.groups, pinned).items():
            self.pool.fetch(layer, experts)
        self._pin_pending = False

    # -- the offloaded verify ----------------------------------------------------------------------------------

    def _prefetch(self, demand: np.ndarray, active: np.ndarray, rec: OffloadRound | None) -> dict:
        """Prefetches the union of the admitted rows' projected experts (`demand` [slots, L, E] bool, `active`
        [slots] bool) into the cache, each layer's experts most-demanded first. Returns {layer: ids asked}."""
        counts = demand[active].sum(axis=0)  # [L, E]
        asked = {}
        for j, layer in enumerate(self.moe_layers):
            ids = np.flatnonzero(counts[j])
            ids = ids[np.argsort(-counts[j][ids], kind="stable")].astype(np.int32)
            asked[layer] = ids
            if self.predictor == "none" or not len(ids):
                continue
            moved = self.pool.prefetch(layer, ids, protect=self._previous.get(layer, ())).experts
            if rec is not None:
                rec.prefetched += len(moved)
                rec.prefetched_bytes += len(moved) * self.store.expert_bytes(layer)
        return asked if self.predictor != "none" else {layer: np.zeros(0, np.int32) for layer in self.moe_layers}

    def _offload_verify(self, drafted: Drafted, active: np.ndarray, asked: dict, rec: OffloadRound | None) -> SpecState:
        """The verify of the first `drafted.rows` rows (a row bucket holding every live row; the others are free and
        come back as they were), layer by layer from the cache, then `_commit`."""
        pool, gen = self.pool, self.gen
        draft, draft_lengths, proposer, bucket = drafted.proposal, drafted.lengths, drafted.proposer, drafted.rows
        width = verify_width(proposer, self.spec)
        full = self.state
        state = full if bucket == self.slots else _head_jit(full, bucket)
        active = active[:bucket]
        # [bucket * width]: the block rows of verifying slots (the others' experts are not fetched)
        provider = gen.expert_provider(pool).begin(rows=np.repeat(active, width), predicted=asked)

        tree = None if draft.tree is None else draft.tree.block()
        out = forward_layerwise(gen.stripped, draft.tokens, state.target_cache, self.spec.target, provider=provider,
                                tap_layers=self.spec.taps, logits="all", implementation=gen.implementation,
                                dispatched=lambda i, x: pool.returned(x), tree=tree)
        new = _commit(state, draft, draft_lengths, out.out, jnp.asarray(active), self.round_spec, proposer)
        self._verify_logits = out.out.logits
        provider.end()
        if rec is not None:
            for s in provider.stats.values():
                rec.hits += s.hits
                rec.misses += s.on_demand
                rec.host += s.host
                rec.predicted += s.predicted
                rec.used += s.routed
                rec.covered += s.covered
                rec.passes += s.passes
                rec.on_demand_bytes += s.on_demand * s.expert_bytes
                rec.predicted_bytes += s.predicted * s.expert_bytes
                rec.used_bytes += s.routed * s.expert_bytes
        self._previous = {layer: np.unique(e) for layer, e in provider.routed.items()}
        return new if bucket == self.slots else _put_head_jit(full, new)

    # -- the round (the engine's, with the prefetch and the offloaded verify) -----------------------------------

    def byte_costs(self, table: np.ndarray) -> np.ndarray:
        """byte_cost="missing": resident experts move nothing, so they cost nothing; "all": the table."""
        if self.byte_cost != "missing":
            return table
        return np.where(np.stack([self.pool.resident(l) for l in self.moe_layers]), 0.0, table)

    def verify(self, drafted: Drafted, plan: RoundPlan, info=None) -> None:
        """The prefetch of the admitted rows' projected union (`plan.demand`), then the verify from the cache."""
        rec = None if info is None else info.offload
        demand = self.demand(drafted) if plan.demand is None else plan.demand
        if rec is not None:
            rec.row_demand = {s: demand[s] for s in plan.live}
            rec.priced_bytes = plan.priced_bytes
        asked = self._prefetch(demand, plan.active[: drafted.rows], rec)
        if rec is not None:
            rec.requested = asked
        start = self._verify_start(plan)
        self.state = self._offload_verify(drafted, plan.active, asked, rec)
        self._after_verify(start, self._verify_logits, drafted.proposal.tree)

    def begin_round(self, info) -> None:
        info.offload = OffloadRound()
        self._prefill_bytes = 0

    def end_round(self, info, verified: bool) -> None:
        rec = info.offload
        rec.prefill_bytes = self._prefill_bytes
        rec.resident_bytes = self.pool.resident_bytes()
        for k in _TOTALS:
            self.offload_totals[k] += getattr(rec, k)
        self.offload_totals["rounds"] += int(verified)

    def warm_extra(self) -> None:
        """Two rounds per row bucket and width that verify every (free) slot on a scratch cache, so that what only a
        verify with rows that route somewhere compiles (copies of each chunk size into the cache, expert passes when
        the cache is small) is compiled too, and the resident runner's own (`ResidentRunner.warm_extra`). The cache
        starts empty afterwards."""
        super().warm_extra()
        layer, n = self.moe_layers[0], 1
        while n <= min(self.store.num_experts, self.pool.capacity(layer)):  # every copy size into the cache
            self._new_cache({}).fetch(layer, np.arange(n))
            n *= 2
        everyone = np.ones(self.slots, bool)  # free rows are done: a verify commits nothing to them
        for _ in range(2):
            for rows in self.layout.row_buckets:
                for proposer in self.layout.proposers.values():
                    self.round(proposer, everyone, rows)
        self.sync()
        self.pool = self._new_cache({})
        self._previous = {}

    def reset_cache(self) -> None:
        """An empty expert cache (pins dropped) and zeroed totals, e.g. between benchmark points; call it while no
        round runs."""
        self.pool = self._new_cache({})
        self._previous = {}
        self.offload_totals = {k: 0 for k in self.offload_totals}

    def offload_summary(self) -> dict:
        """The totals so far, with the cache's size and the per-round and per-pair rates."""
        t = dict(self.offload_totals)
        rounds = max(t["rounds"], 1)
        t.update(cache_bytes=self.pool.bytes, budget_bytes=self.budget_bytes, expert_bytes_all=self.store.total_bytes,
                 moved_bytes=t["prefetched_bytes"] + t["on_demand_bytes"],
                 moved_bytes_per_round=(t["prefetched_bytes"] + t["on_demand_bytes"]) / rounds,
                 hit_rate=t["hits"] / t["used"] if t["used"] else 1.0,
                 coverage=t["covered"] / t["used"] if t["used"] else 1.0,
                 predictor=self.predictor, placement="hybrid" if self.gen.hybrid is not None else "device")
        return t



# ----------------------------------------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------------------------------------

def attach_metrics(engine, registry) -> None:
    """Adds the offload metrics of an engine with offloaded experts (`Engine(experts="offload")`) to a
    `prometheus_client` registry and feeds them from every round:
    dflash_offload_round_bytes_moved (histogram), dflash_offload_bytes_moved_total{kind=prefetch|on_demand|
    prefill}, dflash_offload_expert_lookups_total{result=hit|miss|host}, dflash_offload_experts_total{set=
    predicted|used|covered}, dflash_offload_cache_bytes / dflash_offload_cache_resident_bytes (gauges)."""
    from prometheus_client import Counter, Gauge, Histogram

    moved = Histogram("dflash_offload_round_bytes_moved", "Expert bytes moved host to device per round (prefetch + "
                      "on demand)", buckets=(0,) + tuple(2.0 ** k for k in range(10, 40, 2)), registry=registry)
    kinds = Counter("dflash_offload_bytes_moved", "Expert bytes moved host to device, by kind", ["kind"],
                    registry=registry)
    lookups = Counter("dflash_offload_expert_lookups", "(MoE layer, expert) pairs the verified rows routed to: "
                      "resident (hit), fetched on demand (miss) or computed on the host", ["result"], registry=registry)
    sets = Counter("dflash_offload_experts", "(MoE layer, expert) pairs: predicted (the admitted rows' projected "
                   "union, prefetched), used (routed by the verify), covered (both)", ["set"], registry=registry)
    cache = Gauge("dflash_offload_cache_bytes", "Device bytes of the expert cache", registry=registry)
    resident = Gauge("dflash_offload_cache_resident_bytes", "Bytes of the experts resident in the cache",
                     registry=registry)
    runner = engine.runner
    cache.set(runner.pool.bytes)

    def on_round(info) -> None:
        rec = getattr(info, "offload", None)
        if rec is None:
            return
        if info.verified:
            moved.observe(rec.moved_bytes)
        kinds.labels(kind="prefetch").inc(rec.prefetched_bytes)
        kinds.labels(kind="on_demand").inc(rec.on_demand_bytes)
        kinds.labels(kind="prefill").inc(rec.prefill_bytes)
        lookups.labels(result="hit").inc(rec.hits)
        lookups.labels(result="miss").inc(rec.misses)
        lookups.labels(result="host").inc(rec.host)
        sets.labels(set="predicted").inc(rec.predicted)
        sets.labels(set="used").inc(rec.used)
        sets.labels(set="covered").inc(rec.covered)
        cache.set(runner.pool.bytes)
        resident.set(rec.resident_bytes)

    engine.observers.append(on_round)


def attach_server_metrics(engine) -> int:
    """`attach_metrics` into the registry of every server observing `engine` (`serve.server.create_app` adds one):
    /metrics then shows the offload metrics too. Returns how many registries got them."""
    n = 0
    for obs in list(engine.observers):
        registry = getattr(getattr(getattr(obs, "__self__", None), "metrics", None), "registry", None)
        if registry is not None:
            attach_metrics(engine, registry)
            n += 1
    return n
