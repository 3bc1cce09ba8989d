"""The drivers of the round (`spec.round`): any proposer, resident experts.

`generate` runs the whole decode as one jitted `lax.while_loop`: the state pytree is donated and carried on the
device; the host sees it again only at the end. `generate_stepping` drives the same round from Python, one jitted
propose and one jitted verify+commit at a time: for debugging, per-round traces and outcomes, and the
draft/verify/host time split. Both take a proposer (`spec.round.Chain`, a `spec.tree.TreeShape`) or an adaptive
policy (`spec.policy.AdaptivePolicy`: the shape chosen per round), and return a `GenerationResult`.
`generate_tree` / `generate_tree_stepping` are the same drivers with the tree options spelled out.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import compile_cache
from dflash_jax.spec.calibration_file import pair_calibration
from dflash_jax.spec.lanes import check_lanes, choose_lanes, run_lanes, split_prepared
from dflash_jax.spec.policy import AdaptivePolicy, choose_shape, update_calibration
from dflash_jax.spec.requests import DEFAULT_CAPACITY, Buckets, capacity_error
from dflash_jax.spec.round import (
    Chain, Proposer, adaptive_round, adaptive_start, as_proposer, check_proposer, propose_jit, round_step,
    verify_commit_jit, verify_width,
)
from dflash_jax.spec.sampling import SamplingParams
from dflash_jax.spec.session import Prepared, SpecConfig, SpecState, begin_prepared, map_rows, prepare
from dflash_jax.spec.tree import (
    DEFAULT_BRANCH, DEFAULT_TEMPERATURE, TreeCalibration, TreeShape, widen_for_tree,
)
from dflash_jax.stored import stored_jit

# The loops' shapes: capacity mode (cache rows = output columns = min(DEFAULT_CAPACITY, the target's positions);
# the prefill in chunks inside one program), so any prompt and budget that fit run one compiled prefill and one
# compiled loop per batch bucket. The batch is padded to its bucket (the padding is sliced off the result). The
# bucketed shapes stay behind `buckets=Buckets(...)` (no capacity). A request past the capacity grows it to the next
# power of two that holds it (one more program) instead of being refused. A request that needs fewer rows runs at
# the smallest tier of LOOP_FLOOR * 2^k that holds it (`Buckets.floor`): at most four programs per batch bucket up
# to the default capacity, and a short generation's rounds read a cache of its own size.
LOOP_FLOOR = 256
LOOP_BUCKETS = Buckets(capacity=DEFAULT_CAPACITY, pad_batch=True, grow=True, floor=LOOP_FLOOR)


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per sequence (first token included)
    acceptance_lengths: list[list[int]]  # tokens committed per round, per sequence
    stats: dict
    trace: list[dict] | None = None  # per round (sequence 0 ... b-1): proposal, accepted, bonus

    def mean_acceptance(self, i: int = 0) -> float:
        acc = self.acceptance_lengths[i]
        return float(np.mean(acc)) if acc else 0.0


@stored_jit(static_argnames=("spec", "proposer"), donate_argnames=("state",))
def run_loop(target_w, draft_w, state: SpecState, spec: SpecConfig, proposer: Proposer = Chain(),
             min_live=0) -> SpecState:
    """Rounds of `proposer` until every sequence is done (each round emits >= 1 token per live sequence), or
    until at most `min_live` (traced: one program for any value) are live."""
    return jax.lax.while_loop(lambda s: jnp.sum(~s.done) > min_live,
                              lambda s: round_step(target_w, draft_w, s, spec, proposer)[0], state)


@functools.partial(jax.jit, static_argnames=("spec", "policy"), donate_argnames=("astate",))
def run_adaptive_loop(target_w, draft_w, astate, spec: SpecConfig, policy: AdaptivePolicy, min_live=0):
    """Adaptive rounds (`spec.round.adaptive_round`) until every sequence is done (or at most `min_live` live)."""
    return jax.lax.while_loop(lambda a: jnp.sum(~a.spec_state.done) > min_live,
                              lambda a: adaptive_round(target_w, draft_w, a, spec, policy), astate)


# ----------------------------------------------------------------------------------------------------------
# compaction: a static batch whose rows finish at different rounds continues on the live rows only
# ----------------------------------------------------------------------------------------------------------

# The jitted loop's batch is static, so a finished row keeps costing its share of every round until the last row
# finishes; with speculation the rows finish many rounds apart (one row's acceptance is not another's). Compaction
# stops the loop when the live rows fit the batch bucket of half the rows, gathers them into a state of that
# bucket (the finished rows' results kept on the host) and continues there: one more compiled loop per bucket.
COMPACT_MIN_BATCH = 8  # `compact="auto"` compacts batches of at least this many rows (below, a round's cost
#                        hardly falls with its rows on a CPU, and each smaller bucket is one more compile)


@dataclasses.dataclass
class RowResults:
    """Every sequence's results on the host, by the sequence's index in the request."""

    output: np.ndarray  # [n, N] int32
    num_generated: np.ndarray  # [n]
    acceptance: np.ndarray  # [n, N]
    rounds: np.ndarray  # [n]

    @classmethod
    def empty(cls, n: int, columns: int) -> "RowResults":
        return cls(output=np.full((n, columns), -1, np.int32), num_generated=np.zeros((n,), np.int32),
                   acceptance=np.zeros((n, columns), np.int32), rounds=np.zeros((n,), np.int32))

    @classmethod
    def concat(cls, parts: Sequence["RowResults"]) -> "RowResults":
        """The rows of `parts` one after the other (lanes' results, in the request's order)."""
        if len(parts) == 1:
            return parts[0]
        cols = max(p.output.shape[1] for p in parts)
        pad = lambda x, fill: np.pad(x, ((0, 0), (0, cols - x.shape[1])), constant_values=fill)  # noqa: E731
        return cls(output=np.concatenate([pad(p.output, -1) for p in parts]),
                   num_generated=np.concatenate([p.num_generated for p in parts]),
                   acceptance=np.concatenate([pad(p.acceptance, 0) for p in parts]),
                   rounds=np.concatenate([p.rounds for p in parts]))

    @classmethod
    def of(cls, state: SpecState) -> "RowResults":
        return cls(output=_host(state.output), num_generated=_host(state.num_generated),
                   acceptance=_host(state.acceptance), rounds=_host(state.rounds))

    def put(self, state: SpecState, rows: np.ndarray, index: np.ndarray) -> None:
        """Rows `rows` of the state are sequences `index[rows]` of the request."""
        if rows.size == 0:
            return
        got = RowResults.of(state)
        for name in ("output", "num_generated", "acceptance", "rounds"):
            getattr(self, name)[index[rows]] = getattr(got, name)[rows]


@jax.jit
def take_rows(tree, rows):
    """The rows `rows` (traced [k] int32) of a pytree whose leaves all lead with the batch axis."""
    return map_rows(lambda x: x[rows], tree)


def compaction_target(batch: int, buckets: Buckets, compact) -> int:
    """The live rows at which a loop over `batch` rows stops to compact: the largest batch bucket at most half
    the rows (0: run to the end). compact: True, False, or "auto" (batches of at least `COMPACT_MIN_BATCH`)."""
    if compact is False or batch < 2 or not buckets.pad_batch:
        return 0
    if compact == "auto" and batch < COMPACT_MIN_BATCH:
        return 0
    half = batch // 2
    while half > 0 and buckets.batch_size(half) > batch // 2:
        half -= 1
    return half if half > 0 and buckets.batch_size(half) == half else 0


def compaction_sizes(batch: int, buckets: Buckets, compact) -> list[int]:
    """The batch sizes a compacting run over `batch` rows may continue at, largest first (each one more
    compiled loop)."""
    sizes = []
    while (batch := compaction_target(batch, buckets, compact)) > 0:
        sizes.append(batch)
    return sizes


def _single_device(state: SpecState) -> bool:
    sharding = getattr(state.anchor, "sharding", None)
    return sharding is not None and len(sharding.device_set) == 1


def run_compacting(run, state: SpecState, extra, num_rows: int, buckets: Buckets, compact="auto"):
    """Drives `run(state, extra, min_live) -> (state, extra)` (a jitted loop; `extra`: None, or the
    `spec.round.AdaptiveState` an adaptive loop carries, whose per-row sums are compacted with the state) to the
    end, compacting the live rows into smaller batch buckets on the way (`compaction_target`). Rows past
    `num_rows` are padding. Returns (final state, extra, RowResults of the `num_rows` sequences, compactions)."""
    index = np.arange(state.anchor.shape[0])
    index[num_rows:] = -1
    if not _single_device(state):
        compact = False  # a state laid out over a mesh keeps its batch (the mesh divides it)
    results, compactions = None, 0
    while True:
        batch = state.anchor.shape[0]
        target = compaction_target(batch, buckets, compact)
        state, extra = run(state, extra, target)
        if target == 0:
            break
        done = _host(state.done)
        live = np.flatnonzero(~done)
        if live.size == 0:
            break
        if results is None:
            results = RowResults.empty(num_rows, state.output.shape[1])
        results.put(state, np.flatnonzero(done & (index >= 0)), index)
        size = target  # always the next bucket down (a few known programs, which `warmup` compiles)
        pad = np.full((size - live.size,), np.flatnonzero(done)[0])  # copies of a finished row: done, inert
        rows = np.concatenate([live, pad]).astype(np.int32)
        state = take_rows(state, rows)
        if extra is not None:  # an adaptive policy's per-row sums (its shape counts are the batch's)
            extra = extra.replace(spec_state=state, accepted_sum=take_rows(extra.accepted_sum, rows),
                                  expected_sum=take_rows(extra.expected_sum, rows))
        index = np.concatenate([index[live], np.full((pad.size,), -1)])
        compactions += 1
    if results is None:
        results = RowResults.of(state)
        results = RowResults(*(getattr(results, f.name)[:num_rows] for f in dataclasses.fields(RowResults)))
    else:
        results.put(state, np.flatnonzero(index >= 0), index)
    return state, extra, results, compactions


def _host(x) -> np.ndarray:
    """A result array on the host; on a mesh spanning several processes, gathered from all of them."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils  # only multi-process runs need it

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def generation_result(state: SpecState, stats: dict, trace=None, rows: int | None = None,
                      results: RowResults | None = None) -> GenerationResult:
    """The first `rows` sequences (default: all) of a finished state (or of `results`, the rows collected by a
    compacting run)."""
    r = RowResults.of(state) if results is None else results
    out, num, acc, rounds = r.output, r.num_generated, r.acceptance, r.rounds
    rows = out.shape[0] if rows is None else rows
    out, num, acc, rounds = out[:rows], num[:rows], acc[:rows], rounds[:rows]
    tokens = [list(map(int, out[i, : num[i]])) for i in range(rows)]
    acceptance = [list(map(int, acc[i, : rounds[i]])) for i in range(rows)]
    total_rounds = int(rounds.sum())
    emitted = int(sum(len(t) - 1 for t in tokens))
    stats = dict(stats)
    stats.update(rounds=int(rounds.max()) if rounds.size else 0,
                 generated_tokens=int(num.sum()),
                 mean_acceptance=(emitted / total_rounds) if total_rounds else 0.0)
    if stats.get("seconds"):
        stats["tokens_per_second"] = int(num.sum()) / stats["seconds"]
    if trace is not None:
        trace = [r[:rows] for r in trace]
    return GenerationResult(tokens=tokens, acceptance_lengths=acceptance, stats=stats, trace=trace)


def _prepare(pair, prompts, max_new_tokens, block_size, sampling, stop_ids, seed, buckets,
             branch_head: bool = False, kept=None) -> Prepared:
    compile_cache.ensure_enabled()
    if branch_head and getattr(pair.draft, "branch_head", None) is None:
        raise ValueError("branch_head=True proposes the chain from the draft's branch head, and this pair's draft has "
                         "none: load a pair shipped with branch_head.safetensors, or attach one "
                         "(dflash_jax.pair.with_branch_head)")
    prep = prepare(pair, prompts, block_size=block_size, max_new_tokens=max_new_tokens, sampling=sampling,
                   stop_ids=stop_ids, seed=seed, buckets=LOOP_BUCKETS if buckets is None else buckets, kept=kept)
    if branch_head:
        prep = dataclasses.replace(prep, spec=dataclasses.replace(prep.spec, chain_head=True))
    return prep


def shape_stats(prep: Prepared) -> dict:
    """The block size, acceptance method and compiled shapes of a prepared batch (the start of a run's stats)."""
    spec = prep.spec
    return {"block_size": spec.block_size, "method": spec.method,
            "shapes": {"batch": int(prep.tokens.shape[0]), "prompt": int(prep.tokens.shape[1]),
                       "output": spec.output_len, "cache": spec.max_len}}


def prepare_tree(pair, prompts, *, widest: int, block_size=None, buckets=None, **request) -> Prepared:
    """`session.prepare` with the cache sized for a verify of `widest` rows (a tree may be wider than B)."""
    compile_cache.ensure_enabled()
    buckets = LOOP_BUCKETS if buckets is None else buckets
    prep = prepare(pair, prompts, block_size=block_size, buckets=buckets, **request)
    spec = prep.spec
    max_pos = spec.target.max_position_embeddings
    if buckets.fixed:  # the capacity's rows already (grown for the widest verify when the buckets grow)
        need = int(np.max(prep.lengths)) + int(np.max(prep.params.budget)) + widest
        max_len = max(spec.max_len, buckets.capacity_rows(max_pos, need))
        spec = dataclasses.replace(spec, output_len=max(spec.output_len, max_len))
    else:
        need = prep.tokens.shape[1] + spec.output_len + max(widest, spec.block_size)
        max_len = min(buckets.cache_len(need), max_pos)
    budget = int(np.max(prep.params.budget))
    need = int(np.max(prep.lengths)) + budget + widest
    if need > max_len:
        if buckets.fixed:
            raise capacity_error(need, buckets.capacity, max_pos, f"prompt + max_new_tokens + the tree budget {widest}")
        raise ValueError(f"prompt + max_new_tokens + the tree budget {widest} exceeds the target's "
                         f"{max_pos} positions")
    return dataclasses.replace(prep, spec=dataclasses.replace(spec, max_len=max_len))


def begin_tree(pair, prep: Prepared, widest: int) -> SpecState:
    """`session.begin_prepared` with the target cache widened for trees of up to `widest` nodes."""
    state = begin_prepared(pair, prep)
    return state.replace(target_cache=widen_for_tree(prep.spec.target, state.target_cache, widest))


def shape_label(p) -> str:
    """A proposer's name in stats: `chain B=8`, `tree N=16 K=4`."""
    if isinstance(p, TreeShape) and not p.is_chain:
        return f"tree N={p.budget} K={p.branch}"
    if isinstance(p, TreeShape):
        return f"chain B={p.budget}"
    return p.label()


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a driver runs: one proposer, or an adaptive policy over shapes (pruned to those it can choose)."""

    proposer: Proposer | None
    policy: AdaptivePolicy | None
    full_policy: AdaptivePolicy | None  # the policy as given (stats name every shape)

    @property
    def shapes(self) -> tuple:
        return (self.proposer,) if self.policy is None else self.policy.shapes

    def widest(self, spec_block: int) -> int:
        return max(verify_width(s, _BlockOnly(spec_block)) for s in self.shapes)

    @property
    def trees(self) -> bool:
        return any(not as_proposer(s).is_chain for s in self.shapes)


@dataclasses.dataclass(frozen=True)
class _BlockOnly:
    block_size: int


def plan_run(pair, proposer=None, *, branch_head: bool = False) -> RunPlan:
    """The run plan of a proposer argument: None (the argmax chain; the head chain with `branch_head`), a
    `Chain`, a `TreeShape` or an `AdaptivePolicy`. A policy keeps only the shapes it can choose; with one left it
    runs as that fixed shape."""
    if proposer is None:
        proposer = Chain(head=branch_head)
    if isinstance(proposer, AdaptivePolicy):
        policy = proposer.pruned()
        if len(policy.shapes) == 1:
            return RunPlan(as_proposer(policy.shapes[0]), None, proposer)
        return RunPlan(None, policy, proposer)
    proposer = as_proposer(proposer)
    if isinstance(proposer, Chain) and proposer.head and getattr(pair.draft, "branch_head", None) is None:
        raise ValueError("the head chain proposes from the draft's branch head, and this pair's draft has none: load "
                         "a pair shipped with branch_head.safetensors, or attach one "
                         "(dflash_jax.pair.with_branch_head)")
    return RunPlan(proposer, None, None)


def _prepare_plan(pair, prompts, plan: RunPlan, block_size, buckets, request) -> tuple[Prepared, int]:
    if block_size is None:
        chains = [as_proposer(s) for s in plan.shapes]
        if all(c.is_chain and c.width is not None for c in chains):
            block_size = max(c.width for c in chains)  # chains only: the draft block of the widest
    draft_block = pair.draft_cfg.block_size if block_size is None else block_size
    widest = plan.widest(draft_block) if isinstance(draft_block, int) else draft_block
    if widest > draft_block:
        prep = prepare_tree(pair, prompts, widest=widest, block_size=block_size, buckets=buckets, **request)
    else:
        prep = _prepare(pair, prompts, request["max_new_tokens"], block_size, request["sampling"],
                        request["stop_ids"], request["seed"], buckets, kept=request.get("kept"))
    for s in plan.shapes:
        check_proposer(s, prep.spec, pair.draft)
    return prep, max(widest, prep.spec.block_size)


def _begin(pair, prep: Prepared, plan: RunPlan, widest: int) -> SpecState:
    return begin_tree(pair, prep, widest) if plan.trees else begin_prepared(pair, prep)


def _plan_stats(plan: RunPlan, state: SpecState, chosen=None, rounds=None) -> dict:
    """The proposer's name, and an adaptive run's rounds per shape (every shape of the policy as given).
    rounds: the sequences' rounds (default: the state's)."""
    if plan.full_policy is None:
        return {"proposer": shape_label(plan.proposer)}
    if plan.policy is None:  # one reachable shape ran every round
        counts = {plan.proposer: int(np.max(_host(state.rounds) if rounds is None else rounds))}
    else:
        counts = {as_proposer(s): int(n) for s, n in zip(plan.policy.shapes, np.asarray(chosen))}
    return {"proposer": "adaptive",
            "adaptive_rounds": {shape_label(s): counts.get(as_proposer(s), 0) for s in plan.full_policy.shapes}}


def generate(pair, prompts: Sequence[Sequence[int]], *, max_new_tokens, proposer=None, block_size: int | None = None,
             sampling=SamplingParams(), stop_ids=(), seed=0, warmup: bool = False,
             buckets: Buckets | None = None, branch_head: bool = False, kept=None,
             compact="auto", lanes="auto") -> GenerationResult:
    """DFlash generation in one jitted while_loop (a few, with compaction; one per lane, side by side).

    proposer: what each round proposes (`spec.round`): None = the draft's argmax chain of the block (the branch
    head's chain with `branch_head=True`; the pair's draft must carry one), a `Chain`, a `TreeShape` (a token
    tree), or an `AdaptivePolicy` (the shape chosen per round from the state). block_size: the draft block (the
    widest chain's by default when only chains run).

    max_new_tokens, sampling, stop_ids, seed: one value for every prompt, or one per prompt (stop_ids: one list
    of ids, or one list per prompt); they are traced, so requests that differ only in them (and in prompt lengths
    inside one bucket) reuse one compiled program. `warmup=True` compiles first (without running a round) so
    `stats.seconds` times only the run (prefill + decode; `prefill_s` the prefill and first token alone, and the
    process CPU seconds `cpu_s` / `prefill_cpu_s`). kept: a compressed prefill (PFlash: one index list per prompt,
    `dflash_jax.pflash.compress`), any proposer (`session.prepare(kept=)`; `stats.pflash` counts the tokens).
    compact: when the live rows of a batch of at least `COMPACT_MIN_BATCH` fit the batch bucket of half its rows,
    continue on them alone ("auto"; True: any batch of 2 or more; False: never): the finished rows stop costing a
    share of every round, for one more compiled loop per bucket (`run_compacting`; `stats.compactions`). Every
    sequence's tokens are the same either way (its rows, its key). lanes: "auto" (on a CPU, the rows split over
    the usable cores, each group's loop on its own thread: `spec.lanes`) or a positive integer (1: one loop);
    `stats.lanes` says how many ran."""
    plan = plan_run(pair, proposer, branch_head=branch_head)
    check_lanes(lanes)
    if compact not in (True, False, "auto"):
        raise ValueError(f"compact must be True, False or 'auto', got {compact!r}")
    request = dict(max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids, seed=seed, kept=kept)
    prep, widest = _prepare_plan(pair, prompts, plan, block_size, buckets, request)
    spec = prep.spec
    loop_buckets = LOOP_BUCKETS if buckets is None else buckets

    def run(state, sums, min_live):
        if plan.policy is None:
            return run_loop(pair.target, pair.draft, state, spec, plan.proposer, min_live), None
        if sums is None:
            sums = adaptive_start(state, plan.policy)
        else:
            sums = sums.replace(spec_state=state)
        sums = run_adaptive_loop(pair.target, pair.draft, sums, spec, plan.policy, min_live)
        return sums.spec_state, sums

    num_lanes = choose_lanes(prep.num_prompts, lanes, pair.target)
    parts = [prep] if num_lanes == 1 else split_prepared(prep, num_lanes, loop_buckets)

    if warmup:  # compile the prefill and the loops: a state with every sequence done runs no round
        state = _begin(pair, parts[0], plan, widest)
        state = state.replace(done=jnp.ones_like(state.done))
        sizes = compaction_sizes(state.anchor.shape[0], loop_buckets, compact) if _single_device(state) else []
        states = [state]
        for size in sizes:  # each compaction's gather, from the bucket before it
            states.append(take_rows(states[-1], np.zeros((size,), np.int32)))
            if plan.policy is not None:  # the adaptive sums' gather
                take_rows(jnp.zeros((states[-2].anchor.shape[0],), jnp.float32), np.zeros((size,), np.int32))
        for rows in states:
            jax.block_until_ready(run(rows, None, 0)[0].output)
    t0, c0 = time.perf_counter(), time.process_time()
    prefilled = {}
    barrier = threading.Barrier(len(parts), action=lambda: prefilled.update(
        wall=time.perf_counter() - t0, cpu=time.process_time() - c0))

    def lane(part):  # every lane's prefill, then (once all are done: the prefill's time) every lane's loop
        try:
            state = _begin(pair, part, plan, widest)
            jax.block_until_ready(state.anchor)
            barrier.wait()
        except BaseException:
            barrier.abort()  # the other lanes stop waiting (BrokenBarrierError); this error is the one raised
            raise
        state, sums, results, compactions = run_compacting(run, state, None, part.num_prompts, loop_buckets, compact)
        return state, (None if sums is None else np.asarray(sums.chosen)), results, compactions

    ran = run_lanes(lane, parts)
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    state = ran[0][0]
    chosen = None if ran[0][1] is None else sum(r[1] for r in ran)
    results = RowResults.concat([r[2] for r in ran])
    stats = dict(shape_stats(prep), loop="jit", seconds=seconds, cpu_s=cpu_s, prefill_s=prefilled["wall"],
                 prefill_cpu_s=prefilled["cpu"], compactions=sum(r[3] for r in ran), lanes=num_lanes,
                 **_plan_stats(plan, state, chosen, results.rounds), **compression_stats(prep))
    if num_lanes > 1:
        stats["shapes"]["batch"] = int(parts[0].tokens.shape[0])
    return generation_result(state, stats, rows=prep.num_prompts, results=results)


def compression_stats(prep: Prepared) -> dict:
    """`{"pflash": {prompt_tokens, kept_tokens}}` of a compressed batch (`prepare(kept=)`), else {}."""
    if prep.prompt_lengths is None:
        return {}
    n = prep.num_prompts
    return {"pflash": {"prompt_tokens": [int(x) for x in prep.prompt_lengths[:n]],
                       "kept_tokens": [int(x) for x in prep.lengths[:n]]}}


def generate_stepping(pair, prompts: Sequence[Sequence[int]], *, max_new_tokens, proposer=None,
                      block_size: int | None = None, sampling=SamplingParams(), stop_ids=(), seed=0,
                      trace: bool = False, warmup: bool = False, buckets: Buckets | None = None,
                      branch_head: bool = False, outcomes: list | None = None, kept=None) -> GenerationResult:
    """The same rounds driven from Python (`generate`'s arguments): one jitted propose and one jitted verify+commit
    per round, timed separately (each synchronized). An adaptive policy chooses on the host, as the jitted loop
    does on the device (the same choices). outcomes: a list that receives one dict per round (numpy arrays [b] of
    the `RoundOutcome` fields, `live`: rows not done before the round, `proposer`: the shape's label)."""
    plan = plan_run(pair, proposer, branch_head=branch_head)
    request = dict(max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids, seed=seed, kept=kept)
    prep, widest = _prepare_plan(pair, prompts, plan, block_size, buckets, request)
    spec = prep.spec
    policy = plan.policy
    shapes = [plan.proposer] if policy is None else [as_proposer(s) for s in policy.shapes]
    if warmup:  # one round of every shape compiles the prefill, the draft and the verify
        for p in shapes:
            state = _begin(pair, prep, plan, widest)
            jax.block_until_ready(verify_commit_jit(pair.target, state, propose_jit(p, pair.target, pair.draft, state,
                                                                                     spec), spec, p)[0].output)
    t0 = time.perf_counter()
    state = _begin(pair, prep, plan, widest)
    jax.block_until_ready(state.anchor)
    t_prefill = time.perf_counter() - t0
    t_draft = t_verify = 0.0
    rounds = []
    b = prep.tokens.shape[0]
    acc_sum, exp_sum = np.zeros((b,), np.float32), np.zeros((b,), np.float32)
    chosen = np.zeros((len(shapes),), np.int64)
    done = np.asarray(state.done)
    while not done.all():
        choice = 0
        if policy is not None:
            choice = int(choose_shape(policy, acc_sum, exp_sum, ~done))
        p = shapes[choice]
        chosen[choice] += 1
        t1 = time.perf_counter()
        proposal = propose_jit(p, pair.target, pair.draft, state, spec)
        jax.block_until_ready(proposal.tokens)
        t2 = time.perf_counter()
        before = np.asarray(state.num_generated) if trace else None
        state, outcome = verify_commit_jit(pair.target, state, proposal, spec, p)
        jax.block_until_ready(state.num_generated)
        t3 = time.perf_counter()
        t_draft += t2 - t1
        t_verify += t3 - t2
        if policy is not None:
            acc_sum, exp_sum = update_calibration(policy, acc_sum, exp_sum, choice, np.asarray(outcome.accepted), done)
        if outcomes is not None:
            row = {k: np.asarray(v) for k, v in dataclasses.asdict(outcome).items()}
            row.update(live=~done, proposer=shape_label(p))
            outcomes.append(row)
        if trace:
            after, out = np.asarray(state.num_generated), np.asarray(state.output)
            acc, bonus = np.asarray(state.last_accepted), np.asarray(state.last_bonus)
            proposals = np.asarray(proposal.proposals)
            rows = []
            for i in range(len(before)):
                if done[i]:
                    rows.append(None)
                    continue
                rows.append({"anchor": int(np.asarray(proposal.tokens)[i, 0]), "proposal": list(map(int, proposals[i])),
                             "accepted": int(acc[i]), "bonus": int(bonus[i]),
                             "emitted": list(map(int, out[i, before[i]: after[i]]))})
            rounds.append(rows)
        done = np.asarray(state.done)
    seconds = time.perf_counter() - t0
    host = seconds - t_prefill - t_draft - t_verify
    stats = dict(shape_stats(prep), loop="python", seconds=seconds,
                 time_split={"prefill_s": t_prefill, "draft_s": t_draft, "verify_s": t_verify, "host_s": host},
                 **_plan_stats(plan, state, chosen), **compression_stats(prep))
    return generation_result(state, stats, trace=rounds if trace else None, rows=prep.num_prompts)


def tree_plan(pair, *, tree_budget: int = 16, branch: int = DEFAULT_BRANCH, temperature: float = DEFAULT_TEMPERATURE,
              calibration: TreeCalibration | str | None = "pair", adaptive: AdaptivePolicy | bool = False,
              branch_head: bool = True):
    """The proposer of the tree options (`generate_tree`): a `TreeShape`, or the adaptive policy."""
    if isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or tree_budget < 1:
        raise ValueError(f"tree_budget must be a positive integer, got {tree_budget!r}")
    if isinstance(branch, bool) or not isinstance(branch, int) or branch < 1:
        raise ValueError(f"branch must be a positive integer, got {branch!r}")
    if isinstance(calibration, str):
        if calibration != "pair":
            raise ValueError(f"calibration must be a TreeCalibration, None or 'pair', got {calibration!r}")
        calibration = pair_calibration(pair)
    if adaptive:
        return AdaptivePolicy() if adaptive is True else adaptive
    return TreeShape(tree_budget, branch, temperature, calibration, use_head=branch_head)


def generate_tree(pair, prompts, *, max_new_tokens, tree_budget: int = 16, branch: int = DEFAULT_BRANCH,
                  temperature: float = DEFAULT_TEMPERATURE, calibration: TreeCalibration | str | None = "pair",
                  adaptive: AdaptivePolicy | bool = False, block_size: int | None = None,
                  sampling=SamplingParams(), stop_ids=(), seed=0, warmup: bool = False,
                  buckets: Buckets | None = None, branch_head: bool = True):
    """Tree-verified DFlash generation in one jitted while_loop: `generate` with `proposer=` the tree of these
    options (`tree_plan`).

    tree_budget N: nodes per verify (the anchor included); branch: candidates per node (1 = a chain of
    width N); temperature: the draft's distributions sharpened by 1/T for the build (`TreeShape`);
    calibration: a fitted acceptance model for the build (`TreeCalibration`; `spec.calibration_file`);
    "pair" (the default) the one shipped with the pair (`pair_calibration`; the plain build when it has none);
    None the plain build (the draft's marginals).
    branch_head: build from the draft's branch head when the pair carries one (`build_tree_from_head`; the
    shipped pair does); False: from the marginals (and `calibration`).
    adaptive: True (the default policy) or an `AdaptivePolicy`: the shape is chosen per round.
    Every family verifies trees (Qwen3.5's DeltaNet layers along each node's path)."""
    proposer = tree_plan(pair, tree_budget=tree_budget, branch=branch, temperature=temperature,
                         calibration=calibration, adaptive=adaptive, branch_head=branch_head)
    if isinstance(proposer, TreeShape) and not proposer.is_chain and (block_size or pair.draft_cfg.block_size) < 2:
        raise ValueError("tree verification needs a draft block of at least 2 (one proposal position)")
    res = generate(pair, prompts, max_new_tokens=max_new_tokens, proposer=proposer, block_size=block_size,
                   sampling=sampling, stop_ids=stop_ids, seed=seed, warmup=warmup, buckets=buckets)
    res.stats.update(tree_budget=tree_budget, branch=branch)
    return res


def generate_tree_stepping(pair, prompts, *, max_new_tokens, shape: TreeShape, block_size: int | None = None,
                           sampling=SamplingParams(), stop_ids=(), seed=0, buckets: Buckets | None = None):
    """The tree rounds driven from Python (`generate_stepping` with `proposer=shape`); returns (GenerationResult,
    rounds) where rounds[r] is a dict of numpy arrays [b] per `RoundOutcome` field plus `live` (sequences not done
    before the round). For traces, tests and benchmarks (expert union per round)."""
    rounds: list = []
    res = generate_stepping(pair, prompts, max_new_tokens=max_new_tokens, proposer=shape, block_size=block_size,
                            sampling=sampling, stop_ids=stop_ids, seed=seed, buckets=buckets, outcomes=rounds)
    res.stats.update(tree_budget=shape.budget, branch=shape.branch)
    return res, rounds
