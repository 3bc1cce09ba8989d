"""Serving in lanes: the engine's slots spread over several resident runners, each with its own batched state, whose
calls of several rounds run side by side on their own threads (`Engine(lanes=...)`, `dflash-serve --lanes`).

One XLA:CPU program keeps about 1.2 - 1.5 of a machine's cores busy at the shipped pairs' sizes; calls from
different threads run concurrently (`spec.lanes`, the library's form of the same idea). `LanedRunner` gives the
engine the runner it expects, over `n` `ResidentRunner`s of `slots / n` rows each:

  slot s  ->  lane s % n, row s // n

The engine keeps its live requests within the smallest row bucket of as many rows, so the live rows interleave over
the lanes and stay balanced (a row bucket of R slots is ceil((R - l) / n) rows of lane l). Whole-batch work runs in
every lane (reset, release, fetch, the round); a prefill (and its chunks, fork and first-token log-probs) runs in
lane 0, whose rows `insert` then scatters: each lane writes the rows bound for it and drops the others. A compaction
move within a lane is that lane's `move_row`; across lanes, the row is taken from one state (its K/V cut to the
smallest length bucket holding it) and inserted into the other (every leaf, the K/V up to the row's length). Every
lane runs the same compiled programs (the same shapes), so lanes compile nothing more than one runner of `slots / n`
rows.

A call of several rounds (`burst`) runs each lane's burst on its own thread, and so do a round's `draft` and `verify`
(a round of its own: log-probs, a width explored, the first round of a row bucket). A row's rounds are the
rounds it runs in any lane: the outputs are the single runner's (`tests/serve/test_engine_lanes.py`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from dflash_jax.cache import holds_slots
from dflash_jax.serve.runner import (
    Burst, Drafted, Layout, PrefillBatch, ResidentRunner, RoundPlan, RoundRunner, TokenLogprobs, cut_slots,
    length_buckets,
)
from dflash_jax.spec import lanes as spec_lanes
from dflash_jax.spec.session import SpecState, map_rows
from dflash_jax.stored import stored_jit


@functools.partial(stored_jit, static_argnames=("length",))
def take_row(state: SpecState, row, length: int | None = None) -> SpecState:
    """Row `row` (traced int32) of a batched state as a one-row state; with `length`, each cache's K/V buffers cut to
    their first `length` slots (at least the row's length: `insert` copies no more)."""
    def take(x):
        return jax.lax.dynamic_index_in_dim(x, row, 0, keepdims=True)

    def node(n):
        if not holds_slots(n) or length is None:
            return map_rows(take, n)
        return map_rows(take, n.replace(keys=cut_slots(n.keys, length), values=cut_slots(n.values, length)))

    return jax.tree.map(node, state, is_leaf=holds_slots)


def row_length(state: SpecState, row: int) -> int:
    """The most slots row `row` of a batched state fills in any of its caches (a host read of their lengths)."""
    nodes = [n for n in jax.tree.leaves(state, is_leaf=holds_slots) if holds_slots(n)]
    return max((int(np.asarray(n.lengths)[row]) for n in nodes), default=0)


def lane_rows(rows: int, lane: int, lanes: int) -> int:
    """The rows of lane `lane` among the first `rows` slots (slot s in lane s % lanes)."""
    return max(0, -(-(rows - lane) // lanes))


def interleave(parts, rows: int, lanes: int):
    """Per-lane arrays (axis 0: the lane's first rows; None: a lane with none) as one array of `rows` slots."""
    first = next(p for p in parts if p is not None)
    out = np.zeros((rows,) + first.shape[1:], first.dtype)
    for lane, part in enumerate(parts):
        if part is not None:
            out[lane:rows:lanes] = part[: lane_rows(rows, lane, lanes)]
    return out


class LanedRunner(RoundRunner):
    """`n` resident runners of `slots / n` rows behind one runner (module docstring)."""

    chunked_prefill = True
    deferred_context = True
    overlapped_verify = True
    bursts = True
    forks = token_logprobs = prompt_scores = True
    greedy_rounds = True

    def __init__(self, pair, layout: Layout, *, mesh=None, lanes: int = 2):
        if mesh is not None:
            raise ValueError("lanes split the slots over a CPU's cores; a mesh runs them in one program: lanes=1")
        if isinstance(lanes, bool) or not isinstance(lanes, (int, np.integer)) or lanes < 2:
            raise ValueError(f"a laned runner needs at least 2 lanes, got {lanes!r}")
        if layout.slots % lanes:
            raise ValueError(f"slots {layout.slots} do not split evenly into {lanes} lanes: give slots a multiple "
                             f"of {lanes}, or lanes=1")
        super().__init__(pair, layout)
        self.n = int(lanes)
        per = layout.slots // self.n
        buckets = sorted({lane_rows(r, lane, self.n) for r in layout.row_buckets for lane in range(self.n)} - {0})
        self.lane_layout = Layout(spec=layout.spec, slots=per, row_buckets=tuple(buckets),
                                  proposers=layout.proposers, widest=layout.widest, context_rows=layout.context_rows)
        self.lanes = [ResidentRunner(pair, self.lane_layout) for _ in range(self.n)]
        self._pool = spec_lanes.lane_pool(self.n)  # the lanes' threads, kept across calls (one call every round)
        first = self.lanes[0]
        self.moe_layers, self.expert_bytes = first.moe_layers, first.expert_bytes
        self.length_buckets = first.length_buckets
        self.take_buckets = length_buckets(self.spec.max_len, 1)  # the cuts a row moved across lanes is taken with
        self._logprob_rows = 0  # the rows of the last verify (its log-probs, interleaved)

    # -- state ---------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return all(lane.ready for lane in self.lanes)

    def drop(self) -> None:
        for lane in self.lanes:
            lane.drop()

    @property
    def in_place(self) -> bool:
        """Whether every lane's rounds compute on its whole KV buffers (`ResidentRunner.in_place`)."""
        return all(lane.in_place for lane in self.lanes)

    @property
    def pin_length(self):
        return self.lanes[0].pin_length if hasattr(self, "lanes") else None

    @pin_length.setter
    def pin_length(self, value) -> None:
        for lane in getattr(self, "lanes", ()):
            lane.pin_length = value

    @property
    def greedy_rows(self) -> bool:
        return self.lanes[0].greedy_rows if hasattr(self, "lanes") else False

    @greedy_rows.setter
    def greedy_rows(self, value) -> None:
        for lane in getattr(self, "lanes", ()):
            lane.greedy_rows = bool(value)

    def carried(self):
        parts = [lane.carried() for lane in self.lanes]
        return None if any(p is None for p in parts) else parts

    def _split(self, rows: int) -> list[int]:
        return [lane_rows(rows, lane, self.n) for lane in range(self.n)]

    def _each(self, fn, items=None) -> list:
        """fn(lane, item) for every lane with an item (None: skipped), each on its own thread."""
        items = [()] * self.n if items is None else items
        work = [(lane, item) for lane, item in zip(self.lanes, items) if item is not None]
        return spec_lanes.run_lanes(lambda pair: fn(*pair), work, self._pool)

    # -- rows in and out (whole batch: every lane; a prefill: lane 0) ------------------------------------------

    def reset(self, dummy: PrefillBatch) -> None:
        for lane in self.lanes:
            lane.reset(dummy)

    def prefill(self, batch: PrefillBatch):
        return self.lanes[0].prefill(batch)

    def first_tokens(self, rows):
        return self.lanes[0].first_tokens(rows)

    def fork(self, rows, src, key_data, key_fold):
        return self.lanes[0].fork(rows, src, key_data, key_fold)

    def first_logprobs(self, rows) -> TokenLogprobs:
        return self.lanes[0].first_logprobs(rows)

    def prompt_logprobs(self, tokens: np.ndarray) -> TokenLogprobs:
        return self.lanes[0].prompt_logprobs(tokens)

    def insert(self, rows, index: np.ndarray) -> None:
        index = np.asarray(index, np.int64)
        per = self.lane_layout.slots
        for lane, runner in enumerate(self.lanes):
            mine = (index < self.slots) & (index % self.n == lane)
            if mine.any():  # the other rows dropped (an index past the lane's last slot)
                runner.insert(rows, np.where(mine, index // self.n, per).astype(np.int32))

    def release(self, free: np.ndarray) -> None:
        free = np.asarray(free, bool)
        for lane, runner in enumerate(self.lanes):
            if free[lane::self.n].any():
                runner.release(free[lane::self.n])

    def move_row(self, src: int, dst: int) -> None:
        a, b = self.lanes[src % self.n], self.lanes[dst % self.n]
        if a is b:
            a.move_row(src // self.n, dst // self.n)
            return
        row = src // self.n
        b.insert(take_row(a.state, np.int32(row), self._take_slots(row_length(a.state, row))),
                 np.array([dst // self.n], np.int32))

    def _take_slots(self, length: int) -> int:
        """The slots a row filling `length` of them is taken with across lanes: the smallest length bucket of the
        cache holding it (`runner.length_buckets(max_len, 1)`: a few compiled shapes, each warmed)."""
        return next(b for b in self.take_buckets if b >= length)

    def prefill_start(self, tokens, valid, positions=None):
        return self.lanes[0].prefill_start(tokens, valid, positions)

    def prefill_chunk(self, pre, tokens, valid, wait: bool = True, positions=None):
        return self.lanes[0].prefill_chunk(pre, tokens, valid, wait=wait, positions=positions)

    def prefill_copy(self, pre):
        return self.lanes[0].prefill_copy(pre)

    def prefill_snapshot(self, pre, length: int):
        return self.lanes[0].prefill_snapshot(pre, length)

    def prefill_restore(self, snapshot):
        return self.lanes[0].prefill_restore(snapshot)

    def snapshot_rows(self, length: int) -> int:
        return self.lanes[0].snapshot_rows(length)

    @staticmethod
    def prefill_nbytes(pre) -> int:
        return ResidentRunner.prefill_nbytes(pre)

    def prefill_finish(self, pre, batch: PrefillBatch):
        return self.lanes[0].prefill_finish(pre, batch)

    def pending_context(self) -> np.ndarray:
        return interleave([lane.pending_context() for lane in self.lanes], self.slots, self.n)

    def flush_context(self, rows: int, slots=None) -> None:
        split = self._split(rows)
        if slots is None:
            self._each(lambda runner, r: runner.flush_context(r), [r if r else None for r in split])
            return
        mine = [[s // self.n for s in slots if s % self.n == lane] for lane in range(self.n)]  # each lane's rows
        self._each(lambda runner, item: runner.flush_context(*item),
                   [(r, m) if r and m else None for r, m in zip(split, mine)])

    @property
    def catches_up(self) -> bool:
        return all(lane.catches_up for lane in self.lanes)

    def catch_up(self, rows: int, tokens: np.ndarray, back: np.ndarray) -> None:
        tokens, back = np.asarray(tokens), np.asarray(back)
        items = [(r, tokens[lane::self.n], back[lane::self.n]) if r else None
                 for lane, r in enumerate(self._split(rows))]
        self._each(lambda runner, item: runner.catch_up(*item), items)

    # -- the round -------------------------------------------------------------------------------------

    def draft(self, proposer, rows: int) -> Drafted:
        split = [r or None for r in self._split(rows)]
        done = iter(self._each(lambda runner, r: runner.draft(proposer, r), split))
        parts = [next(done) if r else None for r in split]
        return Drafted(proposer=proposer, rows=rows, proposal=parts, lengths=None, demand=None)

    def demand(self, drafted: Drafted) -> np.ndarray:
        return interleave([None if d is None else np.asarray(d.demand) for d in drafted.proposal], drafted.rows,
                          self.n)

    def verify(self, drafted: Drafted, plan: RoundPlan, info=None) -> None:
        def part(x):
            return None if x is None else [np.asarray(x)[lane::self.n] for lane in range(self.n)]
        active, logprobs = part(plan.active), part(plan.logprobs)
        items = [None if d is None else (d, RoundPlan(active=active[lane],
                                                      logprobs=None if logprobs is None else logprobs[lane]))
                 for lane, d in enumerate(drafted.proposal)]
        self._each(lambda runner, item: runner.verify(*item), items)
        self._logprob_rows = drafted.rows

    def round_logprobs(self) -> TokenLogprobs | None:
        parts = [lane.round_logprobs() if r else None
                 for lane, r in zip(self.lanes, self._split(self._logprob_rows))]
        if all(p is None for p in parts):
            return None
        return TokenLogprobs(*(interleave([None if p is None else np.asarray(getattr(p, f.name)) for p in parts],
                                          self._logprob_rows, self.n)
                               for f in dataclasses.fields(TokenLogprobs)))

    def warm_burst(self, proposer, rows, rounds=1) -> None:
        split = self._split(rows)
        self._each(lambda runner, r: runner.warm_burst(proposer, r, rounds), [r if r else None for r in split])

    def burst(self, proposer, active, rows, count, until_finish=False) -> Burst:
        active = np.asarray(active, bool)
        split = self._split(rows)
        items = [(active[lane::self.n], r) if r else None for lane, r in enumerate(split)]
        done = self._each(lambda runner, item: runner.burst(proposer, item[0], item[1], count, until_finish), items)
        results = iter(done)
        parts = [next(results) if item is not None else None for item in items]
        ran = max(p.rounds for p in parts if p is not None)
        committed = np.zeros((ran, rows), np.int64)
        for lane, p in enumerate(parts):
            if p is not None and p.rounds:
                committed[: p.rounds, lane:rows:self.n] = p.committed[:, : split[lane]]
        return Burst(rounds=ran, committed=committed)

    def fetch(self):
        got = [lane.fetch() for lane in self.lanes]
        return tuple(interleave([g[i] for g in got], self.slots, self.n) for i in range(3))

    def sync(self) -> None:
        for lane in self.lanes:
            lane.sync()

    def warm_extra(self) -> None:
        """Each lane's, and a move across lanes (a row taken from one lane's state, inserted into another's)."""
        for lane in self.lanes:
            lane.warm_extra()
            lane.release(np.zeros(self.lane_layout.slots, bool))  # a cancel (the engine's warm-up frees no lane's row)
        for length in self.take_buckets:  # each shape a row is taken with
            row = take_row(self.lanes[1].state, np.int32(0), length)
            self.lanes[0].insert(row, np.array([self.lane_layout.slots], np.int32))  # past the last slot: dropped


__all__ = ["LanedRunner", "interleave", "lane_rows", "row_length", "take_row"]
