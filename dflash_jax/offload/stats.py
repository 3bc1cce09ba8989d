"""Route-ahead statistics, measured per round and per MoE layer against the verify's exact routing.

For one layer in one round, with P the predicted expert set, R the routed set (the distinct experts the
verify's rows were routed to, every computed row counted) and H the experts already resident when the
layer ran (after any prefetch, before any on-demand fetch):
  covered  = |P & R|                  coverage = covered / |R|       (1 when R is empty)
  wasted   = |P - R|                  waste    = wasted / |P|        (0 when P is empty)
  hits     = |R & H|                  hit rate = hits / |R|          (1 when R is empty)
  on-demand fetches = |R - H| (moved after the routing was known, exposed latency)
  prefetched = experts the prefetch actually moved (predicted and not yet resident)
P counts every prediction for the layer: the before-verify predictors' and, with an in-verify predictor
("residual"), the prediction made one layer earlier inside the verify; `prefetched` likewise counts both, and
`prefetched_in_verify` the part the in-verify hook moved.
Bytes are the expert counts times the layer's bytes per expert (FP4 blocks + scales when FP4).
Aggregates over layers and rounds are expert-weighted (micro averages): sum(covered) / sum(routed), etc.

Per round also: bytes moved by prefetch and on demand, the estimated transfer time of each at a host->device
bandwidth, and the hide window (the wall time the prefetch could overlap: see `RoundStats`). Before-verify
prefetches hide behind the round's window (issue -> end of the verify); an in-verify prefetch of layer j hides
only behind one layer: `in_verify_window_s`, the wall time from its issue (right after the previous MoE layer
was routed) to layer j's routing being read (the previous layer's experts + layer j's attention and router).

Observers. The offloaded generator (`offload.loop.OffloadedGenerator`) hands every finished round's `RoundStats`
to its observers, objects with `on_round(stats)` (`RoundObserver`): `RouteAheadStats` collects them for the
summaries above (each session keeps one), `TraceObserver` keeps a per-round token trace (the stepping loop's
format) with the bytes each round moved. `RoundStats.tokens` (`RoundTokens`) says what the round did to each
sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Protocol

import numpy as np


def _set(values) -> np.ndarray:
    return np.unique(np.asarray(list(values) if not isinstance(values, np.ndarray) else values, np.int64).reshape(-1))


@dataclasses.dataclass(frozen=True)
class LayerRoundStats:
    layer: int
    predicted: int
    routed: int
    covered: int
    wasted: int
    hits: int
    on_demand: int
    prefetched: int
    expert_bytes: int
    prefetched_in_verify: int = 0  # the part of `prefetched` moved by the in-verify hook
    in_verify_window_s: float = 0.0  # that prefetch's hide window (issue -> this layer's routing read)
    host: int = 0  # missing experts computed on the host (hybrid placement): not moved, not on demand
    passes: int = 1  # expert passes the layer ran (more than one: its routed union did not fit at once)

    @property
    def coverage(self) -> float:
        return self.covered / self.routed if self.routed else 1.0

    @property
    def waste(self) -> float:
        return self.wasted / self.predicted if self.predicted else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.routed if self.routed else 1.0

    @property
    def bytes_moved(self) -> int:
        return (self.on_demand + self.prefetched) * self.expert_bytes


def layer_round_stats(layer: int, *, predicted: Iterable[int], routed: Iterable[int], resident: Iterable[int],
                      prefetched: Iterable[int] = (), expert_bytes: int = 0, prefetched_in_verify: Iterable[int] = (),
                      in_verify_window_s: float = 0.0, host: Iterable[int] = (), passes: int = 1) -> LayerRoundStats:
    """The stats of one layer in one round from sets of expert ids (see module doc): `resident` = experts
    on the device when the layer ran, before on-demand fetches; `prefetched` = experts any prefetch moved
    (before-verify and in-verify); `prefetched_in_verify` = those the in-verify hook moved, with its hide
    window `in_verify_window_s`; `host` = missing experts computed on the host instead of fetched (hybrid
    placement); `passes` = expert passes the layer ran."""
    p, r, h = _set(predicted), _set(routed), _set(resident)
    on_host = np.intersect1d(_set(host), np.setdiff1d(r, h))
    late = _set(prefetched_in_verify)
    moved = np.union1d(_set(prefetched), late)
    return LayerRoundStats(
        layer=layer, predicted=len(p), routed=len(r), covered=len(np.intersect1d(p, r)),
        wasted=len(np.setdiff1d(p, r)), hits=len(np.intersect1d(r, h)),
        on_demand=len(np.setdiff1d(np.setdiff1d(r, h), on_host)), host=len(on_host), passes=int(passes),
        prefetched=len(moved), expert_bytes=int(expert_bytes), prefetched_in_verify=len(late),
        in_verify_window_s=float(in_verify_window_s))


_SUMS = ("predicted", "routed", "covered", "wasted", "hits", "on_demand", "prefetched", "prefetched_in_verify", "host",
         "passes")


def _totals(layers: Iterable[LayerRoundStats]) -> dict:
    layers = list(layers)
    t = {k: int(sum(getattr(s, k) for s in layers)) for k in _SUMS}
    b = {f"{k}_bytes": int(sum(getattr(s, k) * s.expert_bytes for s in layers)) for k in _SUMS}
    t.update(b)
    t["coverage"] = t["covered"] / t["routed"] if t["routed"] else 1.0
    t["waste"] = t["wasted"] / t["predicted"] if t["predicted"] else 0.0
    t["hit_rate"] = t["hits"] / t["routed"] if t["routed"] else 1.0
    t["coverage_bytes"] = t["covered_bytes"] / t["routed_bytes"] if t["routed_bytes"] else 1.0
    t["waste_bytes"] = t["wasted_bytes"] / t["predicted_bytes"] if t["predicted_bytes"] else 0.0
    t["bytes_moved"] = t["on_demand_bytes"] + t["prefetched_bytes"]
    return t


@dataclasses.dataclass
class RoundTokens:
    """What one round did to each sequence of the batch (host copies): `live` [b] bool (False: the sequence was
    done before the round and nothing was committed), `anchor` [b] (slot 0 of the verify block), `proposals`
    [b, B-1], `accepted` [b] (proposals accepted), `bonus` [b] (the target's token after them), `emitted` the
    tokens committed this round per sequence (cut by its budget and stop ids)."""

    live: np.ndarray
    anchor: np.ndarray
    proposals: np.ndarray
    accepted: np.ndarray
    bonus: np.ndarray
    emitted: list[list[int]]

    def rows(self) -> list[dict | None]:
        """One dict per sequence as in `spec.generate_stepping`'s trace (None for a sequence already done)."""
        return [
            {"anchor": int(self.anchor[i]), "proposal": list(map(int, self.proposals[i])),
             "accepted": int(self.accepted[i]), "bonus": int(self.bonus[i]), "emitted": list(self.emitted[i])}
            if self.live[i] else None
            for i in range(len(self.live))]


@dataclasses.dataclass
class RoundStats:
    """One round. `layers`: per MoE layer. Times in seconds: `draft_s` / `verify_s` measured wall times of
    the draft forward and of the offloaded verify (including on-demand fetches); `hide_window_s` the wall
    time between issuing the before-verify prefetch and the end of the verify (what its copies can overlap
    with); in-verify prefetches hide only behind their layer's `in_verify_window_s` (one layer's compute);
    `bandwidth` the host->device bytes/s used for the transfer estimates; `tokens` what the round did to each
    sequence (`RoundTokens`; None when not recorded)."""

    round: int
    layers: list[LayerRoundStats]
    draft_s: float = 0.0
    verify_s: float = 0.0
    hide_window_s: float = 0.0
    bandwidth: float = 0.0
    tokens: RoundTokens | None = None

    @property
    def bytes_moved(self) -> int:
        """Host->device expert bytes of the round (prefetched + on demand, every layer)."""
        return int(sum(s.bytes_moved for s in self.layers))

    def totals(self) -> dict:
        t = _totals(self.layers)
        bw = self.bandwidth
        t["prefetch_transfer_s"] = t["prefetched_bytes"] / bw if bw else 0.0
        t["in_verify_prefetch_transfer_s"] = t["prefetched_in_verify_bytes"] / bw if bw else 0.0
        t["on_demand_transfer_s"] = t["on_demand_bytes"] / bw if bw else 0.0
        # before-verify prefetch copies hide behind the round's window, each layer's in-verify copies behind that
        # layer's one-layer window (link contention between them ignored); whatever does not fit, and every
        # on-demand copy, is exposed
        early = t["prefetch_transfer_s"] - t["in_verify_prefetch_transfer_s"]
        late = sum(max(0.0, s.prefetched_in_verify * s.expert_bytes / bw - s.in_verify_window_s)
                   for s in self.layers) if bw else 0.0
        t["exposed_transfer_s"] = max(0.0, early - self.hide_window_s) + late + t["on_demand_transfer_s"]
        t["in_verify_window_s"] = float(sum(s.in_verify_window_s for s in self.layers))
        t.update(round=self.round, draft_s=self.draft_s, verify_s=self.verify_s, hide_window_s=self.hide_window_s)
        return t


@dataclasses.dataclass
class RouteAheadStats:
    """All rounds of a run (`rounds`), with expert-weighted summaries overall and per layer."""

    rounds: list[RoundStats] = dataclasses.field(default_factory=list)

    def add(self, round_stats: RoundStats) -> None:
        self.rounds.append(round_stats)

    on_round = add  # a `RoundObserver`

    def summary(self) -> dict:
        out = _totals(s for r in self.rounds for s in r.layers)
        per_round = [r.totals() for r in self.rounds]
        for key in ("prefetch_transfer_s", "in_verify_prefetch_transfer_s", "on_demand_transfer_s",
                    "exposed_transfer_s", "hide_window_s", "in_verify_window_s", "draft_s", "verify_s"):
            out[key] = float(sum(r[key] for r in per_round))
        out["rounds"] = len(self.rounds)
        # rounds in which no layer had to fetch on demand: a single-program verify on the pool as it stood after
        # the prefetch would have been exact in those rounds
        out["rounds_without_misses"] = sum(1 for r in self.rounds if all(s.on_demand == 0 for s in r.layers))
        out["bytes_moved_per_round"] = out["bytes_moved"] / len(self.rounds) if self.rounds else 0.0
        return out

    def per_layer(self) -> dict[int, dict]:
        layers: dict[int, list[LayerRoundStats]] = {}
        for r in self.rounds:
            for s in r.layers:
                layers.setdefault(s.layer, []).append(s)
        return {layer: _totals(v) for layer, v in sorted(layers.items())}

    def to_json(self, *, rounds: bool = False) -> dict:
        out = {"summary": self.summary(),
               "per_layer": {str(k): {m: v[m] for m in ("coverage", "waste", "hit_rate", "bytes_moved")}
                             for k, v in self.per_layer().items()}}
        if rounds:
            out["rounds"] = [r.totals() for r in self.rounds]
        return out


class RoundObserver(Protocol):
    """What the offloaded generator calls after every round (`OffloadedGenerator(observers=)`, or per request
    `generate(..., observers=)` / `prefill(..., observers=)`)."""

    def on_round(self, stats: RoundStats) -> None: ...


class TraceObserver:
    """A per-round trace: `rounds[r][i]` = sequence i in round r as in `spec.generate_stepping`'s trace
    (`anchor`, `proposal`, `accepted`, `bonus`, `emitted`) plus `bytes_moved`, the host->device expert bytes of
    that round (the whole batch's) and the round's `hits` / `misses` (routed experts resident / not resident when
    their layer ran), `on_demand` (misses fetched), `host` (misses computed on the host), `prefetched`, prefetch
    `coverage` and expert `passes` (all layers); None for a sequence already done. `bytes_moved[r]` per round."""

    def __init__(self):
        self.rounds: list[list[dict | None]] = []
        self.bytes_moved: list[int] = []

    def on_round(self, stats: RoundStats) -> None:
        moved = stats.bytes_moved
        self.bytes_moved.append(moved)
        t = _totals(stats.layers)
        extra = dict(bytes_moved=moved, hits=t["hits"], misses=t["routed"] - t["hits"], on_demand=t["on_demand"],
                     host=t["host"], prefetched=t["prefetched"], coverage=t["coverage"], passes=t["passes"])
        rows = stats.tokens.rows() if stats.tokens is not None else []
        self.rounds.append([None if r is None else dict(r, **extra) for r in rows])
