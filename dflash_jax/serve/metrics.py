"""Prometheus metrics of a serving engine (`prometheus_client`, one registry per server)."""

from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dflash_jax.spec.policy import width_label


class Metrics:
    """Acceptance length (tokens committed per verified sequence), tokens/s, queue depth, slots in use,
    expert bytes per round, compile events, rounds and requests. `on_round` takes the engine's RoundInfo."""

    def __init__(self, window_s: float = 10.0):
        r = self.registry = CollectorRegistry()
        self.acceptance = Histogram("dflash_acceptance_length", "Tokens committed per verified sequence and round",
                                    buckets=tuple(range(1, 17)) + (32,), registry=r)
        self.tokens = Counter("dflash_generated_tokens", "Tokens generated", registry=r)
        self.tokens_per_second = Gauge("dflash_tokens_per_second", "Tokens generated per second (last 10 s)",
                                       registry=r)
        self.queue_depth = Gauge("dflash_queue_depth", "Requests waiting for a slot", registry=r)
        self.slots_in_use = Gauge("dflash_slots_in_use", "Batch slots holding a live request", registry=r)
        self.expert_bytes = Histogram("dflash_round_expert_bytes",
                                      "Bytes of the union of the verified rows' projected experts per round",
                                      buckets=tuple(2.0 ** k for k in range(10, 40, 2)), registry=r)
        self.verified = Histogram("dflash_round_verified_sequences", "Sequences verified per round",
                                  buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.admissions = Counter("dflash_scheduler_admissions", "Verifies admitted by the scheduler, by how: "
                                  "deficit (its turn), work (spare capacity), forced (progress)", ["how"],
                                  registry=r)
        self.sat_out = Counter("dflash_scheduler_sat_out", "Live sequences the scheduler kept out of a round's verify",
                               registry=r)
        self.compiles = Counter("dflash_compile_events", "XLA compiles during serving rounds", registry=r)
        self.rounds = Counter("dflash_rounds", "Engine rounds run", registry=r)
        self.burst_verifies = Counter("dflash_burst_verifies", "Verifies run in device calls of several rounds "
                                      "(every live sequence, no scheduler decision; --rounds-per-call)", registry=r)
        self.burst_calls = Counter("dflash_burst_calls", "Device calls that ran several rounds", registry=r)
        self.widths = Counter("dflash_round_width", "Rounds that verified at each width (the engine's choice)",
                              ["width"], registry=r)
        self.rows = Counter("dflash_round_rows", "Rounds by the row bucket computed (the live requests are kept in "
                            "the smallest bucket of as many rows; a round computes the smallest compiled bucket "
                            "holding them)", ["rows"], registry=r)
        self.prefill_chunks = Counter("dflash_prefill_chunks", "Chunks of long prompts prefilled (one per round at "
                                      "most, between the live rows' rounds)", registry=r)
        self.prefill_tokens = Counter("dflash_prefill_tokens", "Prompt tokens prefilled (whole prompts and chunks); "
                                      "its rate over rounds is the prefill tokens per round", registry=r)
        self.compressed_tokens = Counter("dflash_prefill_compressed_tokens", "Prompt tokens a compressed prefill "
                                         "left out (PFlash, --pflash-keep)", registry=r)
        self.prefix_query = Counter("dflash_prefix_cache_query_tokens", "Prompt tokens of the chunked prefills that "
                                    "looked up the prefix cache", registry=r)
        self.prefix_hit = Counter("dflash_prefix_cache_hit_tokens", "Prompt tokens a cached prefix covered (not "
                                  "prefilled again)", registry=r)
        self.round_seconds = Histogram("dflash_round_seconds", "Wall time of an engine round", registry=r)
        self.finished = Counter("dflash_requests_finished", "Requests finished, by finish reason", ["reason"],
                                registry=r)
        self._recent = collections.deque()  # (time, tokens) of the rounds in the last `window_s`
        self._recent_tokens = 0  # their sum, kept as rounds come and go (a round costs O(1), not O(window))
        self._window = window_s
        self._children: dict = {}  # (metric, label) -> its labelled child, looked up once

    def _child(self, metric, **label):
        key = (id(metric), *label.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**label)
        return child

    def on_round(self, info, *, queue_depth: int, slots_in_use: int) -> None:
        """Called on the engine's thread after every round: counters that did not move are not touched (each
        update takes a lock), the labelled children are looked up once, and the tokens/s window is a running sum."""
        for n in info.committed:
            self.acceptance.observe(n)
        if info.tokens:
            self.tokens.inc(info.tokens)
        if info.verified:
            if info.expert_bytes is not None:  # a call of several rounds projects no experts
                self.expert_bytes.observe(info.expert_bytes)
            self.verified.observe(info.verified)
        if getattr(info, "burst", False):
            self.burst_calls.inc()
            self.burst_verifies.inc(len(info.committed))
        for how in info.how.values():
            self._child(self.admissions, how=how).inc()
        if info.live > info.verified:
            self.sat_out.inc(info.live - info.verified)
        if info.compiles:
            self.compiles.inc(info.compiles)
        rounds = getattr(info, "rounds", 1)  # a device call of several rounds counts each
        self.rounds.inc(rounds)
        if info.width:
            self._child(self.widths, width=width_label(info.width)).inc(rounds)
        if getattr(info, "rows", 0):
            self._child(self.rows, rows=str(info.rows)).inc(rounds)
        for counter, name in ((self.prefill_chunks, "prefill_chunks"), (self.prefill_tokens, "prefill_tokens"),
                              (self.compressed_tokens, "compressed_tokens"), (self.prefix_query, "prefix_query_tokens"),
                              (self.prefix_hit, "prefix_hit_tokens")):
            value = getattr(info, name, 0)
            if value:
                counter.inc(value)
        self.round_seconds.observe(info.seconds)
        for reason in info.finished:
            self._child(self.finished, reason=reason).inc()
        now = time.monotonic()
        self._recent.append((now, info.tokens))
        self._recent_tokens += info.tokens
        while self._recent and self._recent[0][0] < now - self._window:
            self._recent_tokens -= self._recent.popleft()[1]
        span = max(now - self._recent[0][0], 1e-3) if len(self._recent) > 1 else None
        self.tokens_per_second.set(self._recent_tokens / span if span else 0.0)
        self.set_levels(queue_depth=queue_depth, slots_in_use=slots_in_use)

    def set_levels(self, *, queue_depth: int, slots_in_use: int) -> None:
        self.queue_depth.set(queue_depth)
        self.slots_in_use.set(slots_in_use)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
