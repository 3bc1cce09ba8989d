"""The layer-wise placement's expert provider: the per-verify protocol over the device `ExpertCache`, written once.

`forward.forward_layerwise` asks a provider for each MoE layer's experts once the layer's routing is known. Every
offloaded driver (the offloaded loop, `OffloadedGenerator.round`, and the serving engine's `OffloadedRunner`) hands
it an `ExpertProvider`, which owns the protocol and its stats:

  provider.begin(rows=..., predicted=..., prefetched=...)   before the verify: nothing held or lent from before
  provider(layer, experts)                                  per MoE layer, called by the forward:
      the previous layer's experts are released (they were dispatched); the routed experts the hybrid placement
      computes on the host are set apart; the rest are split into passes that fit the cache (`plan_passes`);
      one pass: fetch (missing experts copied in), touch (eviction scores), hold (no prefetch of a later layer
      may evict them while they are lent) and the operands; several: one pass at a time, each held until the next
  provider.end()                                             after the verify: release, and the cache's clock ticks

`rows` [b*T] bool marks the block rows whose outputs count (the serving engine verifies only its admitted rows in a
row bucket): experts only the other rows route to are not fetched; those rows read any resident slot instead (the
"lenient" operands), and compute garbage nobody reads. `stats[layer]` is each layer's `LayerRoundStats` (hits,
on-demand fetches, host experts, passes, and, given the prediction, coverage and waste).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator

import jax
import numpy as np

from dflash_jax.offload.cache import ExpertCache
from dflash_jax.offload.forward import ExpertOperands
from dflash_jax.offload.stats import LayerRoundStats, layer_round_stats
from dflash_jax.offload.store import memory_sharding

# host_choice(layer, routed experts [n, k], missing experts) -> the missing experts computed on the host this round
HostChoice = Callable[[int, np.ndarray, np.ndarray], np.ndarray]


class ExpertProvider:
    """The per-verify expert protocol of the layer-wise placement over one `ExpertCache` (module doc).

    cache: the device expert cache; expert_bytes(layer): one expert's bytes; host_choice / host_tables: the hybrid
    placement's cost model and each layer's whole tables on the host CPU device (None: every expert on the
    device)."""

    def __init__(self, cache: ExpertCache, expert_bytes: Callable[[int], int], *,
                 host_choice: HostChoice | None = None, host_tables: Callable[[int], tuple] | None = None):
        self.cache = cache
        self.expert_bytes = expert_bytes
        self.host_choice = host_choice
        self.host_tables = host_tables
        self.begin()

    def begin(self, rows: np.ndarray | None = None, predicted: dict | None = None, prefetched: dict | None = None,
              late_moved: dict | None = None, late_issued: dict | None = None) -> "ExpertProvider":
        """A verify starts: nothing is held or lent from a round that failed half-way. rows: [b*T] bool, the
        block rows that count (None: all); predicted / prefetched: {layer: expert ids} the route-ahead asked for
        and moved before the verify; late_moved / late_issued: the in-verify prefetch's moves and issue times."""
        self.cache.returned()
        self.cache.release()
        self.rows = None if rows is None else np.asarray(rows, bool)
        # the dicts themselves (not copies): the in-verify prefetch fills late_moved / late_issued during the verify
        self.predicted = {} if predicted is None else predicted
        self.prefetched = {} if prefetched is None else prefetched
        self.late_moved = {} if late_moved is None else late_moved
        self.late_issued = {} if late_issued is None else late_issued
        self.stats: dict[int, LayerRoundStats] = {}
        self.routed: dict[int, np.ndarray] = {}
        return self

    def __call__(self, layer: int, experts: np.ndarray):
        cache = self.cache
        experts = np.asarray(experts)
        mine = experts if self.rows is None else experts[self.rows]
        wanted = np.unique(mine)
        ignored = np.zeros(0, np.int64) if self.rows is None else np.setdiff1d(np.unique(experts[~self.rows]), wanted)
        resident = cache.resident(layer).copy()
        missing = wanted[~resident[wanted]]
        host = (self.host_choice(layer, mine, missing) if self.host_choice is not None and len(missing)
                else np.zeros(0, np.int64))
        on_device = np.setdiff1d(wanted, host)
        cache.release()  # the previous layer's experts were dispatched
        passes = cache.plan_passes(layer, on_device) if len(on_device) else []
        self.routed[layer] = mine
        window = time.perf_counter() - self.late_issued[layer] if layer in self.late_issued else 0.0
        self.stats[layer] = layer_round_stats(
            layer, predicted=self.predicted.get(layer, ()), routed=mine, resident=np.flatnonzero(resident),
            prefetched=self.prefetched.get(layer, ()), expert_bytes=self.expert_bytes(layer),
            prefetched_in_verify=self.late_moved.get(layer, ()), in_verify_window_s=window, host=host,
            passes=max(len(passes) + (1 if len(host) else 0), 1))
        if len(passes) <= 1 and not len(host):
            group = passes[0] if passes else np.zeros(0, np.int32)
            cache.fetch(layer, group)
            cache.touch(layer, group)
            cache.hold(layer, group)
            return self._lenient(self._operands(layer), layer, ignored)
        return (self._lenient(ops, layer, ignored) if i == 0 else ops
                for i, ops in enumerate(self.passes(layer, passes, host)))

    def end(self) -> None:
        """The verify is over: nothing held, and the cache's clock ticks (its recency scores age a round)."""
        self.cache.release()
        self.cache.advance()

    def _operands(self, layer: int, mask: np.ndarray | None = None) -> ExpertOperands:
        cache = self.cache
        return ExpertOperands(cache.operands(layer), cache.slot_table(layer), cache.resident(layer), mask=mask)

    def passes(self, layer: int, passes: list[np.ndarray], host: np.ndarray) -> Iterator[ExpertOperands]:
        """The layer's passes (see `forward.forward_layerwise`): each device pass fetches its group (evicting the
        previous group's unpinned experts when it must) and holds it until the next pass; then the host pass."""
        cache = self.cache
        e = len(cache.resident(layer))
        for i, group in enumerate(passes):
            cache.release(layer)
            cache.fetch(layer, group)
            if i == 0:
                cache.touch(layer, np.concatenate(passes))
            cache.hold(layer, group)
            mask = np.zeros(e, bool)
            mask[group] = True
            yield self._operands(layer, mask)
        if len(host):
            mask = np.zeros(e, bool)
            mask[host] = True
            yield ExpertOperands(self.host_tables(layer), None, np.ones(e, bool), mask=mask, host=True)

    def _lenient(self, ops: ExpertOperands, layer: int, ignored: np.ndarray) -> ExpertOperands:
        """`ops` with the experts only rows that do not count route to (`ignored`) counted in: in the pass's mask,
        marked resident, their slot-table entries pointed at a resident slot (such a row computes garbage there
        that nobody reads). Rows that count never route to them."""
        if not len(ignored):
            return ops
        if ops.host:  # the whole table on the host: every expert is there
            mask = ops.mask.copy()
            mask[ignored] = True
            return dataclasses.replace(ops, mask=mask)
        cache = self.cache
        n = cache.layer_slots(layer)
        table = cache.layers[layer].slot_of.copy()
        here = table[table < n]
        table[ignored] = here[0] if len(here) else 0
        resident = ops.resident.copy()
        resident[ignored] = True
        mask = None
        if ops.mask is not None:
            mask = ops.mask.copy()
            mask[ignored] = True
        return ExpertOperands(ops.tables, jax.device_put(table, memory_sharding("device")), resident, mask=mask)
