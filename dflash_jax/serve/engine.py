"""Continuous batching on the round API: a fixed number of slots, requests joining and leaving between rounds.

The engine is the host side of serving: requests, the queue, the slots, the chunked-prefill state machine, the
width choice, the scheduler call, emission, the background thread, metrics and stats. Every device program, and
the batched state they run on, belongs to its `serve.runner.RoundRunner`: `ResidentRunner` (the target's experts
on the device, `experts="device"`, the default) or `serve.offload_runner.OffloadedRunner` (the experts in host
memory behind one device cache, `experts="offload"`). The engine reads the runner's capability flags
(`chunked_prefill`, `deferred_context`, `overlapped_verify`) rather than asking what it is, and this module runs
no jitted program itself.

The runner keeps ONE batched state of `slots` rows (a compiled shape) for the engine's whole life. Waiting
requests join in groups: one prefill of up to 4 of them together (a group size of 1 or 4, prompts right-padded
to the group's largest prompt bucket), whose rows are then written into free slots (`RoundRunner.insert`). A free
slot is a row that is done. Nothing a request varies (prompt length inside a bucket, budget, sampling settings,
stop ids, seed, slot) is a compiled shape, so after `warmup()` no request compiles anything (tested with
`compile_cache.CompileCounter`). A prompt longer than `prefill_chunk` joins by chunks instead (`spec.prefill`),
one chunk per round while the live rows keep decoding, its one-row state held outside the batch and a slot
reserved for it, then inserted like a grouped prefill's row.

Live requests are kept within the smallest row bucket that holds as many rows: when the highest live row lies
past it, that row moves down into the lowest free slot (`RoundRunner.move_row`, every leaf of the row); a move that
would not shrink the bucket is not made, and admissions take the lowest free slots. Each round computes only the
smallest compiled row bucket (`row_buckets`: 1, 2, 4, .., slots) holding the live rows, so one client on a 32-slot
engine costs a one-row round.

One round (`step`):
  1. admit queued requests into free slots (grouped prefill + insert; their first token is emitted at once; a
     long prompt's next chunk, and its insert after the last one);
  2. choose the round's verify width from the compiled widths (`choose_width`: the most expected tokens per
     second, from each live row's acceptance so far and the round time of each width at the round's row
     bucket, measured at warm-up and learned from the rounds served, plus the host's per-round work; every
     width but the cheapest must win by `width_margin`; now and then a stale neighbouring width runs to re-measure it);
  3. draft every live slot at that width (`RoundRunner.draft`: the draft forward, plus each row's projected
     expert set: every MoE layer's router on the draft's hidden states of the block, the route-ahead "draft
     router" projection); width 1 drafts nothing, and leaves the draft's context append to the next drafting
     round;
  4. the scheduler (`scheduler.schedule`, pure) picks the slots that verify under the round's budgets of
     verify tokens and expert bytes (with both budgets unlimited every live slot verifies: on a runner with
     `overlapped_verify` the verify is started first and the scheduler runs, for its deficits and stats, while
     it computes);
  5. verify (`RoundRunner.verify`): the target forward over the round's rows at that width, acceptance, commit,
     and every row the scheduler left out (or that is free) put back as it was before the round. So a row that
     sits out a round is the row it was, and a row that verifies computes what it computes alone: each
     request's output is its output run alone (greedy: the same tokens at any mix of widths; sampled: the same
     draws from its own per-request key as `spec.generate`, keyed by output position, so at any mix of widths
     under the exact-match rule; the target's distribution);
  6. one host fetch (counts, done flags, output buffer); new tokens go to each request's callback; finished or
     cancelled requests free their slots, and the live rows are compacted.

Several rounds per device call (`rounds_per_call`, a runner with `bursts`): while every live row verifies every
round and the host has nothing to do between rounds (no log-probs asked, no chunked prefill running), steps 3-6
run as one device call of up to `MAX_BURST` rounds at the chosen width (`RoundRunner.burst`), sized to
`call_seconds` by the rounds' measured time (an explored width: `EXPLORE_CALL_ROUNDS`), and the host fetches and
emits once after it. Each of its rounds is the round above with every live row verifying, so the outputs are the
same.

Width-1 rounds hold the draft's context (`defer_context`): the committed row's target taps wait in the row's state,
and only a drafting round (or a full hold) appends them to the draft's cache, all at once. A width-1 round, alone or
in a call, then costs what a block-1 engine's does, and a request that never drafts again never pays the draft.

A server's warm-up may leave the narrower widths for later (`warmup(later_widths=True)`): it compiles, runs and
times the widest width only, and the engine warms the others while it has nothing to serve (`warm_later`), or, while
busy, a row bucket's at a time once `BUSY_WARM_ROUNDS` rounds have run since the last. The chooser picks among a row
bucket's warm widths.

`Engine` is synchronous and single-threaded (`submit` / `step` / `run_until_idle`); `start()` runs the
rounds on a background thread for the server (`submit` and `cancel` are thread-safe).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import statistics
import threading
import time
from typing import Callable, Sequence

import numpy as np

from dflash_jax import compile_cache, prefetch
from dflash_jax.serve import scheduler as sched
from dflash_jax.serve.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache, prefix_keys
from dflash_jax.serve.runner import (
    CATCH_UP_CHUNK, MAX_BURST, TOP_LOGPROBS, Layout, PrefillBatch, ResidentRunner, RoundPlan, RoundRunner,
    TokenLogprobs, array_types,
)
from dflash_jax.spec.policy import (
    BucketCosts, CostRule, acceptance_upper, call_occupancy, choose_width, decide_width, default_widths,
    explore_acceptance, exploration_loss, join_widths, observe_cost, shape_order, shape_rows, width_label,
    with_drafting, with_host,
)
from dflash_jax.spec import requests as rq
from dflash_jax.spec.sampling import RowSampling, SamplingParams, seed_key_data, specialize_greedy
from dflash_jax.spec.round import Chain, check_proposer
from dflash_jax.spec.session import RowParams, SpecConfig
from dflash_jax.spec.tree import TreeShape


PREFILL_GROUPS = (1, 4)  # batch sizes of a prefill of several waiting requests (larger groups delay first tokens)
PREFILL_WINDOW = 5  # the served prefills of a (group, prompt bucket) whose median prices it (`prefill_cost`)
MEASURE_CALL_ROUNDS = 8  # the rounds of each timed call of `measure_rounds` (served rounds run in calls of several)
ACCEPTANCE_DECAY = 0.9  # per verify: the acceptance estimate follows a request's recent rounds
# the device time one call of several rounds aims at (`rounds_per_call="auto"`): a stream gets its tokens at
# least this often, a request that arrives meanwhile waits at most this long, and the host's per-call work is
# paid once per this much compute
DEFAULT_CALL_SECONDS = 0.05
# the fewest rounds of a call that explores a width the chooser did not pick: few, so that exploring a width that
# does not pay costs little, but enough that the call's own work (`call_overhead`) is at most 1 / EXPLORE_CALL_SHARE
# of it (`_explore_count`): a round is priced net of that work, timed with an error that a short call magnifies
EXPLORE_CALL_ROUNDS = 3
EXPLORE_CALL_SHARE = 3
ACCEPTANCE_CALL_ROUNDS = 8  # the most rounds of a call run to measure the draft's acceptance (`explore_acceptance`)
ACCEPTANCE_VERIFIES = 16  # the row verifies such a call aims at: 8 rounds of one or two rows, 4 of 4, 1 of 16
# a drafting width that a try found wanting in a row bucket (the next choice there is narrower) waits twice as long
# before the next try there, up to this many times `CostRule.accept_after` rounds; one chosen after a try resets it
ACCEPT_BACKOFF = 16
# the engine's drafting evidence (decayed accepted + rejected proposals, about 3 a verify at width 4) up to which the
# acceptance is still being learned: a try is free (not charged to the budget) and runs at the next call where it
# may win, whatever the backoff. Until the draft's acceptance is known, a pessimistic prior, or a first try that met
# a hard stretch (the start of a response) and priced its short call high, would otherwise ration the tries that
# measure it: at one client on the shipped pair an engine held width 1 for a dozen requests, waiting 32 then 64
# calls between tries, while width 4 served 15% more
ACCEPT_FREE_EVIDENCE = 64.0
# per round: the acceptance exploration's credit (`CostRule.accept_budget` of the served time) fades over a few hundred
# rounds, so a quiet spell does not pay for a run of explorations later
CREDIT_DECAY = 1.0 - 1.0 / 256
FLUSH_DECAY = 0.98  # per step: the admissions per committed token that price the held context's flushes
# per served step of a row bucket: each (bucket, width)'s served tokens per row-second (`served_rate`) follow its
# recent steps; a width's figure counts once it holds this many (decayed) steps, so one that stops running fades
# out after a few hundred steps of its bucket and the round model may pick it again. A few calls are enough: at 4
# clients on the shipped pair a call runs up to 64 rounds, and width 1 had served 6.4 steps of its bucket when the
# model switched to width 4 (which served 0.73x its rate); with 8 needed, width 1 never ran again to reach them
SERVED_DECAY = 0.99
SERVED_STEPS = 4.0
LONG_RUN_DECAY = 0.99  # per drafting verify: the engine's long-run acceptance, what held estimates fade toward
WORTH_PRIOR = 32.0  # tokens: the weight of "as the chain model expects" in a width's measured scale (`worth_scale`)
WORTH_SCALE_RANGE = (0.8, 1.25)  # the most a width's measured scale moves the chain model's expected tokens
# the most device bytes the held draft context of every slot takes (`defer_context="auto"`): on the shipped pairs a
# whole request's rows; a model of wide taps holds fewer, and pays the draft's context once the hold fills
HOLD_BYTES = 64 << 20
# a busy engine with widths still to warm (`warmup(later_widths=True)`) warms the round's row bucket once this many
# rounds have run since its last busy warm (its programs first, then their timing: each a few rounds' time, once per
# row bucket). Counted in rounds, not steps: the same time between warms whatever a call's length (8 calls of 16
# rounds before calls ran up to 64; counted in calls, a one-client server then ran a whole request or more at its
# one warm width before the narrower width joined)
BUSY_WARM_ROUNDS = 128
# the background loop starts a step of the warm-up left for later only once the engine has had nothing to serve for
# this long (seconds): a closed-loop client sends its next request within milliseconds of the last one's end, and a
# step (a program's load and first run, or a bucket's timing: 0.1 - 0.3 s on a CPU) started in that gap held the
# request until it ended (one client on a fresh server: 0.3x plain's tokens/s while the steps lasted). Under steady
# traffic the busy warm-up (`BUSY_WARM_ROUNDS`) warms the buckets the traffic uses instead.
IDLE_WARM_AFTER = 0.05


class RequestError(ValueError):
    """A request the engine cannot serve (the message names the cause and the fix): a 400 for the server."""


class QueueFull(RuntimeError):
    """The engine's queue is full (a 429 for the server)."""


def _median(times) -> float | None:
    """The median of the last timings kept (a deque of `PREFILL_WINDOW`), None before any (`statistics.median`: the
    same value as numpy's for a few floats, at a tenth of its cost; the width choice reads it every call)."""
    return float(statistics.median(times)) if times else None


def default_row_buckets(slots: int) -> tuple[int, ...]:
    """The row counts a round is compiled for: 1, 2, 4, .. below `slots`, and `slots`. A round computes the
    smallest bucket that holds the live requests (kept within the smallest bucket of as many rows), so its cost
    follows the load."""
    return default_widths(slots)


# ----------------------------------------------------------------------------------------------------------
# requests
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Request:
    """One generation request and what it produced. `on_tokens(request, new_ids)` is called from the engine's
    thread with each round's new tokens; `on_finish(request)` once at the end."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: list[int]
    seed: int
    on_tokens: Callable | None = None
    on_finish: Callable | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    acceptance: list[int] = dataclasses.field(default_factory=list)  # tokens committed per verify
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    slot: int | None = None
    submitted_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    rounds_waited: int = 0  # rounds live but not admitted to verify
    accept_hits: float = 0.0  # proposals accepted (decayed), for the width choice
    accept_misses: float = 0.0  # rejections (decayed)
    cancel_requested: bool = False
    cancel_reason: str = "cancelled"
    done_event: threading.Event = dataclasses.field(default_factory=threading.Event)
    logprobs: int | None = None  # alternatives per token to report with each token's log-prob (None: no log-probs)
    prompt_logprobs: bool = False  # score the prompt's tokens too (echo)
    index: int = 0  # which of its prompt's n samples this is (its key is the seed's, folded with the index)
    siblings: list = dataclasses.field(default_factory=list)  # on sample 0: samples 1 .. n-1, admitted with it
    token_logprobs: list = dataclasses.field(default_factory=list)  # the target's log-prob of each of `tokens`
    top_logprobs: list = dataclasses.field(default_factory=list)  # per token: [(id, log-prob)] x `logprobs`
    prompt_scores: TokenLogprobs | None = None  # prompt_logprobs: of prompt[1:] ([P-1], [P-1, K])

    kept: np.ndarray | None = None  # the prompt indices its compressed prefill keeps (`compress`; None: all)
    # the index in `tokens` of the first token whose position's draft context row a width-1 round skipped
    # (`Engine.skip_context`; None: none skipped since its last catch-up)
    skipped_from: int | None = None

    def wait(self, timeout: float | None = None) -> bool:
        return self.done_event.wait(timeout)

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens its prefill runs: the prompt, or its kept tokens when the engine compressed it."""
        return self.prompt if self.kept is None else [self.prompt[i] for i in self.kept]

    def prefill_positions(self, width: int) -> np.ndarray:
        """[width] int32 RoPE positions of its prefill tokens right-padded to `width`: the kept tokens' original
        positions (or 0, 1, ..), the padding continuing after the last."""
        pos = np.arange(len(self.prompt), dtype=np.int32) if self.kept is None else np.asarray(self.kept, np.int32)
        n = len(pos)
        return np.concatenate([pos, pos[-1] + 1 + np.arange(width - n, dtype=np.int32)])[:width]

    @property
    def samples(self) -> list:
        """This request and its siblings: the `n` samples of its prompt, by index."""
        return [self] + self.siblings


@dataclasses.dataclass
class RoundInfo:
    """What one `step` did (also fed to the metrics)."""

    admitted: int = 0  # requests prefilled into slots
    live: int = 0  # slots with a live request at the draft
    verified: int = 0  # slots the scheduler admitted to verify
    tokens: int = 0  # tokens emitted (first tokens of new requests included)
    committed: list = dataclasses.field(default_factory=list)  # tokens committed per verified sequence
    verify_tokens: int = 0
    expert_bytes: float | None = 0.0  # bytes of the union of the verified rows' projected experts (None: a burst)
    finished: list = dataclasses.field(default_factory=list)  # finish reasons of the requests that ended
    how: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    compiles: int = 0
    width: int = 0  # the verify width chosen for the round (0: no verify)
    rows: int = 0  # the row bucket the round computed (the smallest holding as many rows as are live)
    explored: bool = False  # the width ran to re-measure its cost (not the chooser's pick; `explore_width`)
    prefill_chunks: int = 0  # chunks of long prompts prefilled this round (at most one: the round's prefill budget)
    prefill_tokens: int = 0  # prompt tokens prefilled this round (whole prompts and chunks)
    compressed_tokens: int = 0  # prompt tokens the round's compressed prefills left out (`compress`)
    prefix_query_tokens: int = 0  # prompt tokens of the chunked prefills that looked up the prefix cache
    prefix_hit_tokens: int = 0  # of those, the tokens a cached prefix covered (not prefilled again)
    offload: object = None  # what an offloaded runner moved (`serve.offload_runner.OffloadRound`); None: resident
    rounds: int = 1  # the verify rounds the step's device call ran (several: `Engine.rounds_per_call`)
    burst: bool = False  # the step's rounds ran as one call (`RoundRunner.burst`; no scheduler, no projection)


_DUMMY = Request(id=-1, prompt=[0], max_new_tokens=1, sampling=SamplingParams(), stop_ids=[], seed=0)


@dataclasses.dataclass
class _Prefilling:
    """A request whose prompt is prefilled by chunks, one per round: its one-row partial state (`spec.prefill`)
    is held outside the batch, and the request stays in the queue (its slot reserved) until its last chunk."""

    req: Request
    pre: object  # the runner's partial one-row prefill (`RoundRunner.prefill_start`)
    done: int  # prompt tokens prefilled so far
    keys: list = dataclasses.field(default_factory=list)  # its prefix keys at chunk boundaries (`prefix_cache`)


class Engine:
    """Continuous batching over `slots` rows of one compiled round (module docstring).

    block_size: the widest verify B (1 = no speculation: one target token per round; default: the draft's).
    widths: the verify widths (each <= block_size) the engine chooses from each round, by the cost model below;
    None: block_size only (a fixed width). "auto": `default_widths(block_size)`. One draft and one verify are
    compiled per width at warm-up; the state has the layout of the widest, so any width serves any round.
    round_seconds: {width: seconds of one round}, a fixed cost table for every row bucket; None: `cost_table`
    {rows: {width: seconds}} measured by `warmup()` (`measure_rounds`: paired, medians of ratios).
    learn_costs: keep the table current from the rounds served, per row bucket (`observe_cost`), with a bounded
    exploration of the widths next to the chosen one whose entries are stale (`explore_width`, by `cost_rule`;
    `explore_rounds` / `explore_seconds` count it), and what each width served overruling the table's choice
    (`served_choice`). Default (None): on, unless `round_seconds` fixes the table (then the table alone decides).
    defer_context: a width-1 round skips the draft's context append (the target taps of the committed row) and
    holds the row pending in the row's state (`context_rows` of them: "auto" with True, or a number of rows), as a
    prefill holds its prompt's rows (a prompt prefilled whole that fits, at its slot positions); a drafting round
    first appends every pending row of its rows at once (`RoundRunner.flush_context`), as does a call whose rounds
    would overflow the hold (the same draft context, so the same proposals; outputs never depend on it). A width-1
    round then costs what a round of a block-1 engine does, and a request that finishes while held at width 1 never
    pays the draft. "auto": a whole request's rows (its prompt, output buffer and a verify) within `HOLD_BYTES` of
    held rows over all slots, at least a block and a call's rounds. While a live row holds more than a block, the
    chooser explores no drafting width (it would flush the hold to re-price a width).
    skip_context: with `defer_context`, where the runner can (`RoundRunner.catches_up`: resident experts and a
    target whose cache re-reads at any prefix, not Qwen3.5's linear attention), a width-1 round computes no taps
    at all (`Chain(1, skip_context=True)`: the block-1 engine's round), and the next drafting round of a row first
    computes the skipped positions' context rows in one wide target pass over them (`RoundRunner.catch_up`, up to
    `CATCH_UP_CHUNK` positions a call), appended with the held ones; the catch-up's taps equal the skipped rounds'
    up to a wider forward's rounding. A trade: on the shipped pair (CPU) width-1 rounds then cost what a block-1
    engine's do (held taps: 1% - 2.5% more), but a caught-up position costs 8x - 11x what holding its taps did
    (50 us at one row, 22 us a row at 16), so it pays only where rows seldom draft again; off by default.
    acceptance_exploration: a wider width that the acceptance estimate rules out but an optimistic one would pick is
    tried now and then, a short call, to measure what the draft accepts (`explore_acceptance`), within
    `CostRule.accept_budget` of the served time (each try's expected loss at the current estimate is spent from it;
    the first try, before any drafting verify, is free; a width a try found wanting waits twice as long before the
    next try in its row bucket, `ACCEPT_BACKOFF`); the engine's learned widths (`learn_costs`) only. Without
    it, an engine whose prior (`acceptance_prior`) or warm-up table undersells a drafting width never runs it, so
    never learns better: on the shipped pair (CPU) at one client it held width 1 (0.94x - 1.01x plain) where block 4
    made 1.07x - 1.17x and the tries found width 4 (1.04x - 1.17x). On by default.
    greedy_programs: a round whose every live row is greedy runs the program without the sampling work
    (`SpecConfig.greedy_only`, `RoundRunner.round_spec`), the other rounds the general one: two programs per round
    shape, both compiled at warm-up. None: where the platform runs a conditional from the host
    (`spec.sampling.specialize_greedy`: a GPU, where the general program's two conditionals a round are each a
    predicate copied back and waited for, between CUDA graphs); on a CPU one program serves every row.
    width_margin: a width other than the cheapest is chosen only when its expected tokens per second beat the
    cheapest's by this factor (`spec.policy.choose`, the chooser every driver shares) (0.1: 10%; the table is
    measured, with error, and a near-tie is not worth the risk of losing to no speculation). acceptance_prior: the
    per-proposal acceptance assumed before any verify (then learned per request and engine-wide).
    row_buckets: the row counts a round is compiled for ("auto": 1, 2, 4, .. and `slots`; None: `slots` only).
    Live requests are kept within the smallest bucket of as many rows (a row moves down when that shrinks the
    bucket), and a round computes only the smallest bucket holding them, so its cost follows the load, not the
    slot count.
    max_prompt_len / max_new_tokens: the largest request served (requests beyond them get a RequestError);
    they fix the cache and output-buffer shapes. method: acceptance rule of sampled requests
    ("exact_match" | "rejection"). token_budget / expert_byte_budget: the scheduler's per-round budgets
    (None: unlimited; "cache": the runner's expert cache's bytes; "auto", the default: the runner's default,
    unlimited for resident experts, "cache" for offloaded ones). max_queue: requests waiting for a slot before
    `submit` raises QueueFull.
    experts: where the target's routed experts live, "device" (`serve.runner.ResidentRunner`) or "offload"
    (host memory behind one device cache: `serve.offload_runner.OffloadedRunner`; `runner_options` are its
    keywords: budget_bytes (required), predictor, pin, byte_cost, hybrid, transfer, store, bandwidth, ...).
    runner: a `serve.runner.RoundRunner` class to run the rounds instead (called as
    `runner(pair, layout, mesh=mesh, **runner_options)`; `serve.runner.FakeRunner` tests the host side).
    mesh: a (data, expert, tensor) `jax.sharding` mesh (`dflash_jax.sharding.make_mesh`): the pair is placed on
    it by its weight declarations and every round runs on it (outputs equal the single-device engine's).
    prefill_chunk: a prompt longer than this many tokens (rounded up to a prompt bucket) joins by chunks, one
    chunk per round between the live rows' rounds (`spec.prefill`: its partial one-row state held outside the
    batch, then inserted into a free slot reserved for it), so it never stalls them for more than one chunk;
    shorter prompts join whole. One prefill per chunk width (the prompt buckets up to the chunk) is compiled at
    warm-up, so `max_prompt_len` may reach the target's context. None: every prompt joins whole (one prefill
    program per prompt bucket up to `max_prompt_len`). A runner without `chunked_prefill` (the offloaded one,
    whose layer-wise prefill fetches each prompt's experts whole) always prefills whole prompts.
    prefix_cache_bytes: the prefix cache's budget (`serve.prefix_cache`; 0 or None: off): a prompt that joins by
    chunks starts from the longest cached snapshot of its first k chunks (the caches of a cold prefill at that
    boundary, bit for bit) and feeds the cache at each boundary it passes; least recently used evicted first.
    rounds_per_call: the rounds one device call may run (`RoundRunner.burst`, a runner with `bursts`), while every
    live row verifies every round (unlimited scheduler budgets), no row asks for log-probs, no long prompt is being
    prefilled by chunks and the chooser explores no width: the host then looks (emission, admissions, cancels,
    the next width) once per call instead of once per round. A request that arrives meanwhile waits for the call
    to end (a call of a full engine ends as soon as a row finishes); a stream gets the call's tokens at once.
    "auto" (the default): as many rounds as fit in `call_seconds` by the rounds' measured time (at most
    `runner.MAX_BURST`); 1: a round per call. Outputs never depend on it.
    lanes: the slots split over this many resident runners whose calls run side by side on their own threads
    (`serve.lanes.LanedRunner`: slot s in lane s % lanes); "auto" (the default): one per usable core on a CPU
    outside a mesh with resident experts (`DFLASH_LANES` overrides it), at most what divides `slots`; 1 elsewhere.
    Outputs never depend on it."""

    def __init__(self, pair, *, slots: int = 4, block_size: int | None = None, max_prompt_len: int = 256,
                 max_new_tokens: int = 256, method: str = "exact_match", token_budget: int | None = None,
                 expert_byte_budget: float | str | None = "auto", max_queue: int = 64,
                 buckets: rq.Buckets | None = None,
                 widths: Sequence[int] | str | None = None, round_seconds: dict | None = None,
                 acceptance_prior: float = 0.7, learn_costs: bool | None = None, mesh=None,
                 row_buckets: Sequence[int] | str | None = "auto", width_margin: float = 0.1,
                 cost_rule: CostRule | None = None, defer_context: bool | int = True, skip_context: bool = False,
                 acceptance_exploration: bool = True, greedy_programs: bool | None = None,
                 prefill_chunk: int | None = 256,
                 proposer=None, experts: str = "device", runner: type[RoundRunner] | None = None, compress=None,
                 prefix_cache_bytes: int | None = DEFAULT_PREFIX_CACHE_BYTES,
                 rounds_per_call: int | str = "auto", call_seconds: float = DEFAULT_CALL_SECONDS,
                 lanes: int | str = "auto", **runner_options):
        tcfg, dcfg = pair.target_cfg, pair.draft_cfg
        if runner is None:
            runner = self._runner_of(experts, runner_options)
            self.lanes = self._lanes_of(lanes, slots, runner, mesh, pair)
            if self.lanes > 1:
                from dflash_jax.serve.lanes import LanedRunner
                runner, runner_options = LanedRunner, dict(runner_options, lanes=self.lanes)
        else:
            if lanes not in ("auto", 1):
                raise ValueError("lanes apply to the engine's own resident runner, not to a runner= given")
            self.lanes = 1
        tree = self._tree_of(proposer, pair)
        head = self._head_of(proposer)
        if widths is not None and not isinstance(widths, str) and any(isinstance(w, TreeShape) for w in widths):
            raise ValueError("a tree joins the widths through proposer=TreeShape(...): widths are chain widths")
        if tree is not None:  # the tree every round, or (with widths) the tree among the chain widths
            block_size = dcfg.block_size if block_size is None else block_size
            if widths is None:
                widths = ()
        if block_size is None:
            block_size = max(widths) if widths is not None and not isinstance(widths, str) else dcfg.block_size
        rq.check_int(slots, "slots", low=1, what="a positive integer")
        rq.check_int(block_size, "block_size", low=1, high=dcfg.block_size + 1,
                     what=f"between 1 and the draft's trained block size {dcfg.block_size}")
        if widths is None:
            widths = (int(block_size),)
        elif isinstance(widths, str):
            if widths != "auto":
                raise ValueError(f"widths must be 'auto' or a list of verify widths, got {widths!r}")
            widths = default_widths(int(block_size))
        widths = tuple(sorted({int(w) for w in widths}))
        if widths and (widths[0] < 1 or widths[-1] > block_size):
            raise ValueError(f"widths must be verify widths between 1 and block_size {block_size}, got {list(widths)}")
        if tree is not None:  # the tree is one more shape the chooser prices (`spec.policy.expected_tokens`)
            widths = widths + (tree,)
        if round_seconds is not None:
            round_seconds = {w if isinstance(w, TreeShape) else int(w): float(t) for w, t in round_seconds.items()}
            if set(round_seconds) != set(widths) or not all(t > 0 for t in round_seconds.values()):
                raise ValueError(f"round_seconds must give a positive time for each width {list(widths)}, "
                                 f"got {round_seconds}")
        if row_buckets is None:
            row_buckets = (int(slots),)
        elif isinstance(row_buckets, str):
            if row_buckets != "auto":
                raise ValueError(f"row_buckets must be 'auto', None or a list of row counts, got {row_buckets!r}")
            row_buckets = default_row_buckets(int(slots))
        row_buckets = tuple(sorted({int(r) for r in row_buckets} | {int(slots)}))
        if row_buckets[0] < 1 or row_buckets[-1] > slots:
            raise ValueError(f"row_buckets must be row counts between 1 and slots {slots}, got {list(row_buckets)}")
        if not width_margin >= 0.0:
            raise ValueError(f"width_margin must be >= 0, got {width_margin}")
        if not 0.0 <= acceptance_prior < 1.0:
            raise ValueError(f"acceptance_prior must be in [0, 1), got {acceptance_prior}")
        if rounds_per_call != "auto":
            rq.check_int(rounds_per_call, "rounds_per_call", low=1, high=MAX_BURST + 1,
                         what=f"'auto' or a number of rounds between 1 and {MAX_BURST}")
        if not (isinstance(call_seconds, (int, float)) and 0.0 < call_seconds < 60.0):
            raise ValueError(f"call_seconds must be a positive number of seconds below 60, got {call_seconds!r}")
        rq.check_int(max_prompt_len, "max_prompt_len", low=1, what="a positive integer")
        if prefill_chunk is not None:
            rq.check_int(prefill_chunk, "prefill_chunk", low=1, what="a positive number of tokens (or None)")
        max_pos = tcfg.max_position_embeddings
        widest = max([int(block_size)] + [shape_rows(w) for w in widths])  # a tree may be wider than the block
        if int(max_prompt_len) + 1 + widest > max_pos:
            raise ValueError(f"max_prompt_len {max_prompt_len} exceeds the target's context: its {max_pos} positions "
                             f"hold a prompt of at most {max_pos - 1 - widest} tokens (one new token and a "
                             f"verify of {widest} rows after it); lower max_prompt_len")
        rq.check_int(max_new_tokens, "max_new_tokens", low=1, what="a positive integer")
        rq.check_int(max_queue, "max_queue", low=0, what="a non-negative integer")
        if method not in ("exact_match", "rejection"):
            raise ValueError(f"method must be 'exact_match' or 'rejection', got {method!r}")
        if getattr(tcfg, "moe", None) is None:
            raise ValueError("the serving engine's scheduler needs an MoE target (num_experts); this target is dense")
        if isinstance(expert_byte_budget, str) and expert_byte_budget not in ("auto", "cache"):
            raise ValueError(f"expert_byte_budget must be 'auto', 'cache', None or a number of bytes, got "
                             f"{expert_byte_budget!r}")
        self.slots, self.block_size, self.method = int(slots), int(block_size), method
        self.widest = widest
        self.tree = tree
        self.buckets = rq.DEFAULT_BUCKETS if buckets is None else buckets
        self.max_prompt_len = self.buckets.prompt_len(int(max_prompt_len))
        max_pos = tcfg.max_position_embeddings
        self.output_len = self.buckets.output_len(int(max_new_tokens))
        max_len = min(self.buckets.cache_len(self.max_prompt_len + self.output_len + widest), max_pos)
        # the bucket may pass the context: the prompts served stop there (the request checked above fits)
        self.max_prompt_len = min(self.max_prompt_len, max_len - widest - 1)
        self.max_new_tokens = int(max_new_tokens)
        self.stops_len = self.buckets.stops_len(4)
        self._prefilling: _Prefilling | None = None
        self._joining: list[Request] = []  # requests being prefilled into slots (out of the queue)
        self.prefill_chunks = 0  # chunks of long prompts prefilled (total)
        if compress is not None and not (callable(compress) and callable(getattr(compress, "warm", None))):
            raise TypeError(f"compress must be a pflash.Compressor (a scorer and a keep ratio or budget), got "
                            f"{type(compress).__name__}")
        self.compress = compress
        self.compressed_tokens = 0  # prompt tokens the compressed prefills left out (total)
        self.prefill_tokens = 0  # prompt tokens prefilled (total: whole prompts and chunks)
        self.spec = SpecConfig(target=tcfg, draft=dcfg, block_size=self.block_size, max_len=max_len,
                               output_len=self.output_len, method=method)
        self.widths = widths
        if not isinstance(skip_context, bool):
            raise TypeError(f"skip_context must be True or False, got {skip_context!r}")
        if not isinstance(acceptance_exploration, bool):
            raise TypeError(f"acceptance_exploration must be True or False, got {acceptance_exploration!r}")
        # width-1 rounds hold the draft's context (`defer_context`): the runner's state holds `context_rows` rows
        if not isinstance(defer_context, bool):
            least = self.block_size + MAX_BURST
            rq.check_int(defer_context, "defer_context", low=least,
                         what=f"True, False or the context rows held, at least {least} (a block and a call's rounds)")
        self.defer_context = (not isinstance(defer_context, bool) or defer_context) and bool(self.spec.taps) \
            and runner.deferred_context and 1 in widths
        whole = self.max_prompt_len if prefill_chunk is None else min(self.max_prompt_len,
                                                                       self.buckets.prompt_len(int(prefill_chunk)))
        self.context_rows = self._context_rows(defer_context, pair, whole) if self.defer_context else self.block_size
        self.row_buckets = row_buckets
        # the proposer of each width the chooser picks from (`spec.round`): chains of the width, or the one tree
        self.proposers = {w: w if isinstance(w, TreeShape) else Chain(w, head=head and w > 1) for w in widths}
        for p in self.proposers.values():
            check_proposer(p, self.spec)  # the runner checks them against the draft's weights too
        # the device side: the batched state and every program on it
        self.runner = runner(pair, Layout(spec=self.spec, slots=self.slots, row_buckets=row_buckets,
                                          proposers=self.proposers, widest=widest, context_rows=self.context_rows),
                             mesh=mesh, **runner_options)
        self.skip_context = skip_context and self.defer_context and self.runner.catches_up
        if greedy_programs is not None and not isinstance(greedy_programs, bool):
            raise TypeError(f"greedy_programs must be True, False or None (the platform's choice), got "
                            f"{greedy_programs!r}")
        self.greedy_programs = bool(specialize_greedy() if greedy_programs is None else greedy_programs) \
            and self.runner.greedy_rounds
        self.greedy_rounds = 0  # rounds that ran the greedy rows' program (`greedy_programs`)
        self._catch_up_warm: set = set()  # the row buckets whose catch-up ran (`_warm_catch_up`)
        self.catch_ups = 0  # calls that computed skipped positions' context rows (`skip_context`)
        self.caught_up_rows = 0  # the context rows they computed
        self.prefill_chunk = (None if prefill_chunk is None or not self.runner.chunked_prefill
                              else self.buckets.prompt_len(int(prefill_chunk)))
        if prefix_cache_bytes is not None:
            rq.check_int(prefix_cache_bytes, "prefix_cache_bytes", low=0, what="a number of bytes (0 or None: off)")
        # snapshots at chunk boundaries: only prompts that join by chunks use (and feed) it
        self.prefix_cache = (PrefixCache(int(prefix_cache_bytes)) if prefix_cache_bytes and self.prefill_chunk
                             else None)
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.round_seconds = round_seconds
        self.cost_table: dict[int, dict[int, float]] = {}  # rows -> width -> seconds (measured at warm-up)
        self.learn_costs = (round_seconds is None) if learn_costs is None else bool(learn_costs)
        self.cost_rule = CostRule() if cost_rule is None else cost_rule
        if not isinstance(self.cost_rule, CostRule):
            raise ValueError(f"cost_rule must be a CostRule, got {type(cost_rule).__name__}")
        self._costs: dict[int, BucketCosts] = {}  # rows -> the bucket's learned costs (while serving)
        self._explored = None  # the width this round explores (None: the chosen one runs)
        self._accept_explore = False  # it explores to measure the acceptance (a longer call)
        self._accept_wait: dict[int, int] = {}  # rows -> rounds before the next acceptance try there (`ACCEPT_BACKOFF`)
        self._accept_tried: dict[int, object] = {}  # rows -> the width a try ran there, awaiting the next choice
        self._marks = (0, 0)  # moves and flushes when the step began (`_settle`)
        self.explore_rounds = collections.Counter()  # rounds run at an explored width, by width
        self.explore_seconds = 0.0  # their wall time
        self.deferred_rounds = 0  # width-1 rounds that deferred the draft's context append (alone or in a call)
        self.context_flushes = 0  # calls that appended the held context (before a drafting round, or a full hold)
        self.width_margin = float(width_margin)
        self.acceptance_explores = 0  # calls of a wider width run to measure the draft's acceptance
        self.acceptance_exploration = acceptance_exploration  # (the constructor's docstring)
        self._explore_credit = 0.0  # seconds the acceptance exploration may still lose
        self._accept_rounds = ACCEPTANCE_CALL_ROUNDS  # the rounds of this step's acceptance exploration
        # rows -> the last timed flushes of the held context before a drafting round (their median prices one; a
        # bucket's first is not kept: its loop's kernels are set up then, warm-up's flush appends nothing), and the
        # decayed (steps that admitted a request, tokens committed): what drafting adds per token
        # (`drafting_per_token`)
        self._flush_times: dict[int, collections.deque] = {}
        self._admit_rate = [0.0, 0.0]
        # (group, prompt bucket) -> the last served prefills' seconds (the prefill, its insert and first tokens):
        # whether waiting requests prefill together or one by one (`_split_cheaper`)
        self._prefill_times: dict[tuple[int, int], collections.deque] = {}
        self.split_admissions = 0  # times a group of waiting requests was split (one prefilled alone: cheaper)
        # the engine-wide acceptance (decayed hits / misses): the prior of a row that has not verified yet
        self._prior = float(acceptance_prior)
        self._hits, self._misses = 2.0 * self._prior, 2.0 * (1.0 - self._prior)
        self._long_hits = self._long_misses = 0.0  # every drafting verify's evidence, decayed by LONG_RUN_DECAY
        self._worth = {}  # chain width -> [tokens committed, tokens the model expected] of its verifies (decayed)
        self._incumbent = {}  # row bucket -> the width its last chosen (not explored) call ran
        self.width_rounds = collections.Counter()
        self.rows_rounds = collections.Counter()  # rounds by the row bucket computed
        self.rounds_per_call = rounds_per_call if rounds_per_call == "auto" else int(rounds_per_call)
        self.call_seconds = float(call_seconds)
        self.burst_calls = 0  # device calls that ran several rounds (`rounds_per_call`)
        self.burst_rounds = 0  # the rounds they ran
        self._round_time: dict = {}  # (rows, width) -> a served round's device seconds (decayed mean)
        # rows -> a call's host work (an empty call: dispatch, the rows cut and put back, the fetch), timed at
        # warm-up; a learned round's cost in a call of several is its share of the call's time less this
        self.call_overhead: dict = {}
        self.moves = 0  # rows moved down to keep live requests within the smallest bucket (`_compact`)
        self.host_seconds = 0.0  # per served round, beyond its cost-table entry (host work, serving): decayed mean
        # the same per (row bucket, width) chosen: one figure for every width priced a width-1 round with a drafting
        # round's host work (at 4 rows 0.15 ms, where a width-1 round's is about half that)
        self.host_by: dict[tuple, float] = {}
        # (row bucket, width) -> decayed [steps, committed tokens, row-seconds] of its served steps, from the end of
        # the step's admissions (a drafting width's flush of the held context, the round's host and device work):
        # where they differ clearly from what the round model expects, they choose (`served_choice`)
        self._served: dict[tuple, list] = {}
        self.served_overrules = 0  # rounds whose width the served rates chose over the round model's
        self.switch_trials = 0  # switches to a drafting width not served lately in its bucket, run as a short call
        self._admitted_at = 0.0
        self._round_start = 0.0  # when this step's round began (its admissions, flush and the wait for them left out)
        self._host_samples = 0
        self._device_seconds = 0.0
        if expert_byte_budget == "auto":
            expert_byte_budget = self.runner.default_byte_budget
        if expert_byte_budget == "cache":
            expert_byte_budget = self.runner.cache_bytes
            if expert_byte_budget is None:
                raise ValueError("expert_byte_budget='cache' needs an expert cache (experts='offload')")
        self.budgets = sched.Budgets(tokens=token_budget, expert_bytes=expert_byte_budget)
        self.max_queue = int(max_queue)
        self.moe_layers = self.runner.moe_layers
        self.expert_bytes = self.runner.expert_bytes  # [L, E]: the bytes of one expert's tables per MoE layer
        self.sched_state = sched.SchedulerState()
        self.requests: dict[int, Request] = {}  # slot -> request
        self.queue: collections.deque[Request] = collections.deque()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread = None
        self._stopping = False
        self.observers: list[Callable[[RoundInfo], None]] = []
        self.rounds = 0
        self.warm = False
        self._ready: dict = {}  # rows -> the widths warm there (`warmup(later_widths=True)`); absent: every width
        self._later: collections.deque = collections.deque()  # warm-up left for later: (kind, rows, length)
        self._busy_warm: dict = {}  # rows -> what a busy engine has warmed of the bucket ("programs")
        self._later_widths: tuple = ()  # the widths left for later
        self._later_label = ""  # the prefetching label of the later steps (`_open_later_loads`)
        self._later_loads = None  # their prefetching context, open from the first later step to the last
        self._idle_since = 0.0  # when the background loop last had something to serve (`IDLE_WARM_AFTER`)
        # whether a busy engine warms the later widths (`warm_later`): not after a warm-up that compiled afresh
        self.busy_warm = True
        self._steps = 0
        self._rounds_since_warm = 0  # rounds since the last busy warm (`BUSY_WARM_ROUNDS`)

    def _context_rows(self, defer_context, pair, prompt: int) -> int:
        """The draft context rows a row's state holds (`defer_context`): at least a block and a call's rounds; "auto"
        a request's rows (a prompt prefilled whole, at most `prompt` rows, its output and a verify) where they fit in
        `HOLD_BYTES` over the slots."""
        least = self.block_size + MAX_BURST
        if not isinstance(defer_context, bool):  # checked above
            return int(defer_context)
        features = len(self.spec.taps) * int(pair.target_cfg.hidden_size)
        per_row = features * np.dtype(pair.target.embed.dtype).itemsize * self.slots
        fits = HOLD_BYTES // max(per_row, 1)
        return int(max(least, min(prompt + self.output_len + self.widest, fits)))

    @staticmethod
    def _tree_of(proposer, pair) -> TreeShape | None:
        """The tree a `proposer` argument asks for (None: chains). Accepted: None / "chain", "head-chain", a
        `spec.round.Chain` of the block (head or not), a `spec.tree.TreeShape` (branch 1: the chain of its budget)."""
        if proposer is None or isinstance(proposer, str) or isinstance(proposer, Chain):
            if isinstance(proposer, str) and proposer not in ("chain", "head-chain"):
                raise ValueError("proposer must be 'chain', 'head-chain', a spec.round.Chain or a spec.tree.TreeShape, "
                                 f"got {proposer!r}")
            if isinstance(proposer, Chain) and (proposer.width is not None or proposer.defer_context):
                raise ValueError("the engine chooses each round's chain width itself (widths=): pass Chain() or "
                                 "Chain(head=True)")
            return None
        if not isinstance(proposer, TreeShape):
            raise TypeError(f"proposer must be 'chain', 'head-chain', a spec.round.Chain or a spec.tree.TreeShape, got "
                            f"{type(proposer).__name__}")
        if proposer.is_chain:
            raise ValueError(f"a branch-1 TreeShape is the chain of width {proposer.budget}: pass widths="
                             f"[{proposer.budget}] instead")
        return proposer

    @staticmethod
    def _runner_of(experts: str, options: dict) -> type[RoundRunner]:
        """The runner class of an `experts` placement."""
        if experts == "device":
            if options:
                raise TypeError(f"{', '.join(sorted(options))}: offload options need experts='offload'")
            return ResidentRunner
        if experts == "offload":
            from dflash_jax.serve.offload_runner import OffloadedRunner
            return OffloadedRunner
        raise ValueError(f"experts must be 'device' or 'offload', got {experts!r}")

    @staticmethod
    def _lanes_of(lanes, slots, runner, mesh, pair) -> int:
        """The lanes the slots split into (`serve.lanes`): "auto" on a CPU outside a mesh with resident experts, one
        per usable core (`spec.lanes.choose_lanes`, `DFLASH_LANES` overriding it), at most what divides `slots`
        evenly; 1 elsewhere. An explicit count > 1 where lanes do not apply is refused."""
        from dflash_jax.spec import lanes as spec_lanes

        spec_lanes.check_lanes(lanes)
        if lanes != "auto" and int(lanes) > 1 and (runner is not ResidentRunner or mesh is not None):
            raise ValueError(f"lanes={lanes}: lanes split the slots of resident experts over a CPU's cores; with "
                             "experts='offload' or a mesh the engine runs one program: use lanes=1 or 'auto'")
        if runner is not ResidentRunner or mesh is not None or not isinstance(slots, int) or slots < 2:
            return 1
        n = spec_lanes.choose_lanes(slots, lanes, weights=pair.target)
        if lanes != "auto" and slots % n:
            raise ValueError(f"lanes={lanes} does not divide slots {slots} evenly: give slots a multiple of it")
        while slots % n:
            n -= 1
        return n

    @staticmethod
    def _head_of(proposer) -> bool:
        return proposer == "head-chain" or (isinstance(proposer, Chain) and proposer.head)

    def _proposer(self, width: int, defer: bool = False):
        """This round's proposer at `width` (when `defer`, the width-1 chain that leaves the draft's context: skips
        it with `skip_context`, else holds it)."""
        if not defer:
            return self.proposers[width]
        return Chain(1, skip_context=True) if self.skip_context else Chain(1, defer_context=True)

    @property
    def pair(self):
        """The pair the runner runs (placed on the mesh; offloaded: the target without its expert tables)."""
        return self.runner.pair

    @property
    def mesh(self):
        return self.runner.mesh

    @property
    def running(self) -> bool:
        """Whether rounds run on the engine's background thread (`start()` until `stop()`)."""
        return self._thread is not None

    @property
    def chunked_prefill(self) -> bool:
        return self.runner.chunked_prefill

    @property
    def deferred_context(self) -> bool:
        return self.runner.deferred_context


    # -- requests --------------------------------------------------------------------------------------

    def validate(self, prompt: Sequence[int], *, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_ids: Sequence[int] = (), seed: int = 0, n: int = 1, logprobs: int | None = None,
                 prompt_logprobs: bool = False) -> None:
        """Raises RequestError (naming the cause and the fix) for a request this engine cannot serve."""
        vocab = self.spec.target.vocab_size
        if not rq.is_int(n) or not 1 <= n <= self.slots:
            raise RequestError(f"n must be an integer between 1 and this server's {self.slots} slots (its samples "
                               f"decode together), got {n!r}")
        if n > 1 and not self.runner.forks:
            raise RequestError(f"n > 1 is not available with the {type(self.runner).__name__}: send n requests")
        if logprobs is not None or prompt_logprobs:
            if logprobs is not None and (not rq.is_int(logprobs) or not 0 <= logprobs <= TOP_LOGPROBS):
                raise RequestError(f"logprobs must be an integer between 0 and {TOP_LOGPROBS}, got {logprobs!r}")
            if not self.runner.token_logprobs:
                raise RequestError(f"log-probabilities are not available with the {type(self.runner).__name__}")
            if prompt_logprobs and not self.runner.prompt_scores:
                raise RequestError(f"prompt log-probabilities (echo) are not available with the "
                                   f"{type(self.runner).__name__}")
        if hasattr(prompt, "__len__") and len(prompt) > self.max_prompt_len:  # before looking at each id
            raise RequestError(f"the prompt has {len(prompt)} tokens; this server takes at most "
                               f"{self.max_prompt_len} (shorten the prompt or restart with a larger --max-prompt-len)")
        try:
            rq.check_prompts([list(prompt)], vocab)
            rq.check_int(max_new_tokens, "max_tokens", low=1, high=2**31, what="a positive integer")
            rq.check_stop_ids(list(stop_ids), 1, vocab)
            rq.check_seeds(seed, 1)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from None
        if not isinstance(sampling, SamplingParams):
            raise RequestError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        try:  # the row's traced settings (int32 / float32) are built here, never first inside a round
            RowSampling.of([sampling])
        except (OverflowError, TypeError, ValueError) as e:
            raise RequestError(f"sampling settings out of range: {e}") from None
        if not sampling.greedy and sampling.mode != self.method:
            raise RequestError(f"this engine samples with the {self.method!r} acceptance rule; the request asks "
                               f"for {sampling.mode!r}")
        if len(prompt) > self.max_prompt_len:
            raise RequestError(f"the prompt has {len(prompt)} tokens; this server takes at most "
                               f"{self.max_prompt_len} (shorten the prompt or restart with a larger --max-prompt-len)")
        if max_new_tokens > self.max_new_tokens:
            raise RequestError(f"max_tokens {max_new_tokens} is beyond this server's context: at most "
                               f"{self.max_new_tokens} new tokens (lower max_tokens or restart with a larger "
                               "--max-new-tokens)")
        if len(stop_ids) > self.stops_len:
            raise RequestError(f"{len(stop_ids)} stop token ids; at most {self.stops_len} per request")
        room = self.spec.max_len - self.widest
        if len(prompt) + max_new_tokens > room:  # only when the cache is capped at the target's context
            raise RequestError(f"the prompt ({len(prompt)} tokens) and max_tokens {max_new_tokens} exceed this "
                               f"server's context of {room} tokens: lower max_tokens or shorten the prompt")

    def submit(self, prompt: Sequence[int], *, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
               stop_ids: Sequence[int] = (), seed: int = 0, on_tokens=None, on_finish=None, n: int = 1,
               logprobs: int | None = None, prompt_logprobs: bool = False) -> Request:
        """Queues a request (validated first: RequestError). Raises QueueFull when `max_queue` are waiting.

        n: independent samples of the prompt (`Request.samples`, sample i keyed by the seed folded with i; sample 0
        is the request a lone `n=1` submit makes): prefilled once, forked into n slots when they are all free.
        logprobs: report the target's log-prob of each generated token (`Request.token_logprobs`) and its
        `logprobs` most likely alternatives (`Request.top_logprobs`). prompt_logprobs: score the prompt too
        (`Request.prompt_scores`, one target forward over it at admission)."""
        self.validate(prompt, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids, seed=seed, n=n,
                      logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        now = time.perf_counter()
        # a compressing engine scores the prompt here, on the caller's thread (never inside a round)
        kept = None if self.compress is None else self.compress([int(t) for t in prompt])
        if kept is not None:
            kept = np.asarray(kept, np.int32)

        def one(index: int) -> Request:
            return Request(id=next(self._ids), prompt=[int(t) for t in prompt], max_new_tokens=int(max_new_tokens),
                           sampling=sampling, stop_ids=[int(t) for t in stop_ids], seed=int(seed),
                           on_tokens=on_tokens, on_finish=on_finish, submitted_at=now,
                           logprobs=None if logprobs is None else int(logprobs),
                           prompt_logprobs=bool(prompt_logprobs) and index == 0, index=index, kept=kept)

        req = one(0)
        req.siblings = [one(i) for i in range(1, int(n))]
        with self._wake:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"{len(self.queue)} requests are already waiting (the queue holds {self.max_queue}):"
                                " retry later")
            self.queue.append(req)
            self._wake.notify_all()
        return req

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """Stops a request: it leaves the queue, or its slot is freed before the next round. `reason` is its
        finish reason ("stop" when the caller found a stop string in its text)."""
        with self._wake:
            req.cancel_reason = reason
            req.cancel_requested = True
            self._wake.notify_all()

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot (one in chunked prefill not counted)."""
        return len(self.queue) - (self._prefilling is not None)

    @property
    def slots_in_use(self) -> int:
        return len(self.requests)

    # -- the state -------------------------------------------------------------------------------------

    def _batch(self, reqs: list, rows: int | None = None) -> PrefillBatch:
        """The host inputs of one prefill of `reqs` (None: a dummy one-token request, as the empty state's and
        warm-up's rows): a batch of `rows` rows (default: as many as requests; padding rows are one-token prompts),
        every prompt right-padded to the largest prompt bucket among them."""
        reqs = [_DUMMY if r is None else r for r in reqs]
        rows = len(reqs) if rows is None else rows
        cap = self._prompt_cap()  # a prompt prefilled whole; a longer one (its chunks done) up to max_prompt_len
        width = max(self.prompt_bucket(n, cap if n <= cap else self.max_prompt_len)
                    for n in (len(r.prefill_ids) for r in reqs))
        tokens, lengths = rq.pad_prompts([np.asarray(r.prefill_ids, np.int32) for r in reqs], width, rows)
        positions = None
        if self.compress is not None:  # every row at explicit positions: one state layout for all of them
            positions = np.stack([r.prefill_positions(width) for r in reqs]
                                 + [np.arange(width, dtype=np.int32)] * (rows - len(reqs)))
        pad = rows - len(reqs)
        samplings = [r.sampling for r in reqs] + [SamplingParams()] * pad
        params = RowParams(budget=np.array([r.max_new_tokens for r in reqs] + [1] * pad, np.int32),
                           sampling=RowSampling.of(samplings),
                           stop_ids=rq.pad_stop_ids([r.stop_ids for r in reqs], self.stops_len, rows))
        key_data = np.stack([seed_key_data(r.seed) for r in reqs] + [seed_key_data(0)] * pad)
        real = len(reqs) if reqs[0].id >= 0 else 0  # warm-up's requests and the dummy have id -1
        return PrefillBatch(tokens=tokens, lengths=lengths, params=params, key_data=key_data,
                            key_fold=np.zeros(rows, np.int32), real=real, positions=positions)

    def _reset(self) -> None:
        """The runner's state of `slots` free rows."""
        self.runner.reset(self._batch([None]))

    @property
    def prefill_groups(self) -> tuple[int, ...]:
        """The batch sizes a group of waiting requests is prefilled at (compiled per prompt bucket)."""
        return tuple(g for g in PREFILL_GROUPS if g == 1 or g <= self.slots)

    def _admit(self, reqs: list, slots: list, info: RoundInfo | None) -> None:
        """Prefills `reqs` together (one batch of the smallest group size that holds them) and writes them into
        `slots`; emits their first tokens."""
        for r in reqs:
            self._score_prompt(r)
        batch = self._batch(reqs, next(g for g in self.prefill_groups if g >= len(reqs)))
        if info is not None:  # timed alone: what the step dispatched before it runs first, as it would anyway
            self.runner.sync()
        t0 = time.perf_counter()
        with compile_cache.CompileCounter() as counter:
            rows = self.runner.prefill(batch)
            self._place(reqs, slots, rows, len(batch.lengths), info)
            if info is not None:
                self.runner.sync()
        if info is not None and not counter.traces and not counter.compiles:
            key = (len(batch.lengths), int(batch.tokens.shape[1]))
            self._prefill_times.setdefault(key, collections.deque(maxlen=PREFILL_WINDOW)).append(
                time.perf_counter() - t0)
        if info is not None:
            info.prefill_tokens += sum(len(r.prefill_ids) for r in reqs)
            self.prefill_tokens += sum(len(r.prefill_ids) for r in reqs)
            left_out = sum(len(r.prompt) - len(r.prefill_ids) for r in reqs)
            info.compressed_tokens += left_out
            self.compressed_tokens += left_out
        return rows

    def prefill_cost(self, group: int, width: int) -> float | None:
        """The measured seconds of a prefill of `group` rows padded to `width` tokens (its insert and first tokens
        included): the median of the last `PREFILL_WINDOW` served ones, None before any."""
        return _median(self._prefill_times.get((group, width)))

    def _split_cheaper(self, reqs: list) -> bool:
        """Whether prefilling `reqs` one by one measured cheaper than together (the group padded to its size and to
        the longest prompt's bucket): a CPU computes a padded row as a real one, a GPU a few rows at about one's
        cost. False until both were measured (a group is the default)."""
        if len(reqs) < 2 or any(len(r.samples) > 1 for r in reqs):
            return False
        widths = [self.prompt_bucket(len(r.prefill_ids)) for r in reqs]
        group = self.prefill_cost(next(g for g in self.prefill_groups if g >= len(reqs)), max(widths))
        alone = [self.prefill_cost(1, w) for w in widths]
        return group is not None and None not in alone and sum(alone) < group

    def _place(self, reqs: list, slots: list, rows, n: int, info: RoundInfo | None) -> None:
        """Writes the runner's prefilled `n` rows `rows` into `slots` (rows past them: dropped); emits the first
        tokens. A request of n samples has its row forked first (`RoundRunner.fork`: sample i keyed by the seed
        folded with i, its first token drawn again), so its prompt is prefilled once."""
        if any(r.siblings for r in reqs):
            src = [i for i, r in enumerate(reqs) for _ in r.samples]
            reqs = [sample for r in reqs for sample in r.samples]
            rows, n = self._fork(rows, src, reqs), self.slots
        index = np.full(n, self.slots, np.int32)  # padding rows: dropped
        index[: len(slots)] = slots
        self.runner.insert(rows, index)
        if info is None:
            return
        first, done = self.runner.first_tokens(rows)
        scores = None
        if any(r.logprobs is not None for r in reqs):
            s = self.runner.first_logprobs(rows)  # [n] -> one token per row
            scores = TokenLogprobs(s.logprob[:, None], s.top_logprob[:, None], s.top_id[:, None])
        finished = np.zeros(self.slots, bool)
        for i, (req, slot) in enumerate(zip(reqs, slots)):
            req.slot = slot
            self.requests[slot] = req
            info.admitted += 1
            self._record_logprobs(req, scores, i, 1)
            self._emit(req, [int(first[i])], info)
            if done[i]:
                self._finish(req, self._reason(req), info)
                finished[slot] = True
        if finished.any():
            self.runner.release(finished)

    def _fork(self, rows, src: list, samples: list):
        """`slots` rows: row i the prefilled row src[i] as sample `samples[i]` (padding rows: copies of row 0)."""
        pad = self.slots - len(src)
        key_data = np.stack([seed_key_data(r.seed) for r in samples] + [seed_key_data(0)] * pad)
        fold = np.array([r.index for r in samples] + [0] * pad, np.int32)
        return self.runner.fork(rows, np.array(list(src) + [0] * pad, np.int32), key_data, fold)

    def _score_prompt(self, req: Request) -> None:
        """The prompt's log-probs of an echo request (`RoundRunner.prompt_logprobs`: one target forward, padded to
        the prompt's bucket; compiled per bucket the first time one is asked)."""
        if not req.prompt_logprobs or req.prompt_scores is not None:
            return
        n = len(req.prompt)
        tokens = np.zeros((1, self.prompt_bucket(n, self.max_prompt_len)), np.int32)
        tokens[0, :n] = req.prompt
        s = self.runner.prompt_logprobs(tokens)
        req.prompt_scores = TokenLogprobs(s.logprob[0, : n - 1], s.top_logprob[0, : n - 1], s.top_id[0, : n - 1])
        for sample in req.siblings:  # one prompt, one score
            sample.prompt_scores = req.prompt_scores

    @staticmethod
    def _record_logprobs(req: Request, scores: TokenLogprobs | None, row: int, count: int) -> None:
        """Appends the log-probs of `req`'s next `count` tokens (row `row` of `scores`) when it asked for them."""
        if scores is None or req.logprobs is None or count <= 0:
            return
        k = req.logprobs
        req.token_logprobs.extend(float(x) for x in scores.logprob[row, :count])
        for ids, lps in zip(scores.top_id[row, :count, :k].tolist(), scores.top_logprob[row, :count, :k].tolist()):
            req.top_logprobs.append(list(zip(ids, lps)))

    def warmup(self, prompt_buckets: Sequence[int] | None = None, *, later_widths: bool | str = False) -> float:
        """Compiles the prefill for every prompt bucket up to max_prompt_len (or the given lengths), the
        insert, the draft and the verify (and what else the runner compiles, `RoundRunner.warm_extra`). Returns
        the seconds it took. Every program is called twice over, the second time on the state the first pass left,
        unless that state has the types the first pass started from (`RoundRunner.carried`, `array_types`): then
        the second pass would call the same programs. A warm start loads the programs ahead (`prefetch`).

        later_widths: of several widths, only the widest is compiled, run and timed now (a server answers
        `/health` as soon as it can serve the block); the others join each row bucket's choice once the engine
        has warmed and timed them there (`warm_later`: while idle, or a bucket at a time while busy). True: only
        where an earlier whole warm-up of this configuration left a marker in the compilation cache (the later
        programs then load in tens of ms; compiled afresh, each would hold a request arriving meanwhile for
        seconds), else every width now, and the marker is written; "always": whatever the cache holds."""
        t0 = time.perf_counter()
        compile_cache.ensure_enabled()
        now = self.widths
        marker = self._warm_marker(prompt_buckets) if later_widths and len(self.widths) > 1 else None
        if later_widths == "always" or (marker is not None and compile_cache.read_entry(*marker) is not None):
            now = (max(self.widths, key=shape_order),) if len(self.widths) > 1 else now
        label = (f"Engine.warmup {type(self.runner).__name__} slots={self.slots} widths={now} "
                 f"rows={self.row_buckets} prompts={prompt_buckets} max_prompt={self.max_prompt_len}")
        with prefetch.prefetching(label), compile_cache.CompileCounter() as counter:  # a warm start loads its
            self._warmup(prompt_buckets, now)  # programs ahead, on a second core
        # programs compiled afresh (a cold compilation cache): the later widths' would compile too, seconds each, so a
        # busy engine leaves them to its idle time rather than hold its live streams that long
        self.busy_warm = counter.compiles <= counter.cache_hits
        if marker is not None and now == self.widths:  # warmed whole: a later start may leave widths for later
            compile_cache.write_entry(*marker, b"warmed whole")
        self._ready = {} if now == self.widths else {rows: now for rows in self.row_buckets}
        self._later_widths = tuple(w for w in self.widths if w not in now)
        self._busy_warm = {}
        self._later = collections.deque()
        self._later_label = f"{label} later={self._later_widths}"
        if now != self.widths:  # each bucket's programs of every length (the longest first), then their timing
            for rows in self.row_buckets:
                self._later.extend(("programs", rows, n) for n in sorted(self.runner.length_buckets, reverse=True))
                self._later.append(("timed", rows, None))
        return time.perf_counter() - t0

    def _warm_marker(self, prompt_buckets) -> tuple[str, str] | None:
        """(path, key) of the cache entry saying this configuration was warmed whole here (the engine's programs,
        the library's sources, what tracing reads); None without a persistent cache."""
        import hashlib
        import importlib.metadata
        import os

        from dflash_jax import stored

        directory = compile_cache.active_dir()
        if directory is None:
            return None
        what = (f"{type(self.runner).__name__} slots={self.slots} widths={self.widths} rows={self.row_buckets} "
                f"prompts={prompt_buckets} max_prompt={self.max_prompt_len} output={self.output_len} "
                f"block={self.block_size} held={self.context_rows} chunk={self.prefill_chunk} "
                f"calls={self.rounds_per_call} lanes={getattr(self.runner, 'n', 1)}")
        parts = [what, stored.source_hash(), stored.trace_context(), importlib.metadata.version("jax")]
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
        return os.path.join(directory, f"dflash-warmed-{key}"), key

    @property
    def warming(self) -> int:
        """Warm-up steps left for later (`warmup(later_widths=True)`): 0 once every width is warm everywhere."""
        return len(self._later)

    @property
    def widths_warming(self) -> tuple:
        """The widths some row bucket does not choose yet (`warmup(later_widths=True)`)."""
        return tuple(w for w in self._later_widths if any(w not in ws for ws in self._ready.values()))

    def ready_widths(self, rows: int) -> tuple:
        """The widths the chooser picks among in the row bucket: every width, unless some are still to warm."""
        return self._ready.get(rows, self.widths)

    def warm_later(self, busy: bool = False, rows: int | None = None) -> bool:
        """One step of the warm-up left for later (`warmup(later_widths=True)`); returns whether one ran. Idle (no
        request queued or live): the next of every bucket's programs of each length, pinned, then the bucket's
        paired timing (`measure_rounds`), after which its widths join the choice. Busy (`busy`): the current row
        bucket's programs at the lengths the live rows need (an idle round and call of each width, as the rounds a
        row sits out), then its timing at those lengths; a length no busy or idle step warmed yet is loaded by the
        first round that needs it. Not while busy after a warm-up that compiled afresh (a cold compilation cache:
        each step would compile for seconds while the live streams wait). `rows`: the busy step's row bucket (default:
        the live rows')."""
        if not self._later or (busy and not self.busy_warm):
            return False
        try:
            if busy:
                rows = self.row_bucket(sorted(self.requests)) if rows is None else rows
                if rows not in self._ready:
                    return False
                done = self._busy_warm.get(rows)
                if done is None:
                    self._warm_widths(rows, None)
                    self._busy_warm[rows] = "programs"
                else:
                    self._join(rows)
            else:
                item = kind, rows, length = self._later[0]
                if kind == "programs":
                    self._warm_widths(rows, length)
                elif rows in self._ready:
                    self._join(rows)
                if self._later and self._later[0] == item:  # taken off once done: `warming` counts it while it runs
                    self._later.popleft()
            if not self._later:
                self._close_later_loads()
            return True
        except Exception as e:  # the widths already warm go on serving; the others stay out of the choice
            import sys

            self._later.clear()
            self._close_later_loads()
            print(f"dflash_jax: the later warm-up stopped ({type(e).__name__}: {e}); the widths "
                  f"{sorted({w for ws in self._ready.values() for w in ws}, key=shape_order)} serve", file=sys.stderr)
            return False

    def _open_later_loads(self) -> None:
        """While the background loop runs the warm-up left for later (`start`), from its start until the last step:
        one prefetching context (`prefetch.prefetching`) over all the steps, so that a warm start's worker thread loads
        the later programs from the compilation cache (about 50 ms each on a CPU) while the engine serves between the
        steps, in the order a past start's later steps read them; each step then finds its programs loaded. Only the
        loop opens it (it ends with the last step, or the loop): an engine stepped by its caller leaves none open
        behind it. Another context live in the process (a second engine warming up) leaves this one off."""
        if self._later_loads is None:
            stack = contextlib.ExitStack()
            stack.enter_context(prefetch.prefetching(self._later_label))
            self._later_loads = stack

    def _close_later_loads(self) -> None:
        """Ends the later steps' prefetching context (its manifest written for the next start), if open."""
        stack, self._later_loads = self._later_loads, None
        if stack is not None:
            stack.close()

    def finish_warmup(self) -> int:
        """Runs what `warmup(later_widths=True)` left, now (the engine idle); returns the steps it ran."""
        if self.queue or self.requests:
            raise RuntimeError("finish_warmup runs on an idle engine (no request queued or live)")
        n = 0
        while self.warm_later():
            n += 1
        return n

    def _warm_widths(self, rows: int, length: int | None) -> None:
        """An idle round and call (no row active: every row keeps its state) of every width the bucket does not
        choose yet, with the round's length pinned (idle) or as the live rows need (None)."""
        idle = np.zeros(self.slots, bool)
        scored = np.ones(self.slots, bool) if self.runner.token_logprobs else None
        if 1 in self._later_widths:
            self._warm_catch_up(rows)
        self.runner.pin_length = length
        serving = self.runner.greedy_rows
        try:
            for w, greedy in itertools.product(self._later_widths, self._round_programs()):
                self.runner.greedy_rows = greedy
                self._round(w, idle, rows, logprobs=None if self.requests else scored)
                if self.runner.bursts and self.rounds_per_call != 1:
                    self.runner.warm_burst(self._proposer(w, w == 1 and self.defer_context), rows)
        finally:
            self.runner.pin_length = None
            self.runner.greedy_rows = serving
        self.runner.sync()

    def _warm_catch_up(self, rows: int, again: bool = False) -> None:
        """Compiles and runs the row bucket's catch-up of skipped context rows (`skip_context`) once (`again`: even
        if it ran: warm-up's second pass), with nothing to catch up (it appends the rows' held ones, as any drafting
        round's flush would)."""
        if self.skip_context and (again or rows not in self._catch_up_warm):
            self.runner.catch_up(rows, np.zeros((self.slots, CATCH_UP_CHUNK), np.int32), np.zeros(self.slots, np.int32))
            self._catch_up_warm.add(rows)

    def _join(self, rows: int) -> None:
        """Times every width of the bucket (paired) and lets the chooser pick among them all there: a learned
        table gains the new widths at the load it shows now (`join_widths`)."""
        if self.round_seconds is None:
            measured = self.measure_rounds(row_buckets=[rows])[rows]
            if rows in self._costs:
                self._costs[rows] = join_widths(self._costs[rows], measured, self.cost_rule)
                self.cost_table[rows] = self._costs[rows].seconds
            else:
                self.cost_table[rows] = measured
        del self._ready[rows]
        self._busy_warm.pop(rows, None)
        self._later = collections.deque(item for item in self._later if not (item[0] == "timed" and item[1] == rows))

    def _warmup(self, prompt_buckets: Sequence[int] | None, widths: tuple) -> None:
        if not self.runner.ready:
            self._reset()
        if prompt_buckets is None:
            sizes, n = [], 1
            while True:
                sizes.append(self.prompt_bucket(n))
                if sizes[-1] >= self._prompt_cap():
                    break
                n = sizes[-1] + 1
        else:
            sizes = sorted({self.prompt_bucket(n) for n in prompt_buckets})
        if self.compress is not None:  # the scorer of every prompt length it may compress
            self.compress.warm(self.max_prompt_len)
        idle = np.zeros(self.slots, bool)
        for second in (False, True):  # the second pass runs on states that are outputs of the first
            before = None if second else array_types(self.runner.carried())
            for width in sizes:
                for group in self.prefill_groups:
                    reqs = [Request(id=-1, prompt=[0] * width, max_new_tokens=1, sampling=SamplingParams(),
                                    stop_ids=[], seed=0)] * group
                    free = [s for s in range(self.slots) if s not in self.requests][:group]
                    rows = self._admit(reqs, free, None)  # dummy rows that are done: their slots stay free
                    self._warm_samples(reqs, rows)
            if self.prefill_chunk is not None and self.max_prompt_len > self.prefill_chunk:
                self._warm_chunks()
            self.runner.release(idle)
            self.runner.move_row(self.slots - 1, self.slots - 1)  # a no-op
            scored = np.ones(self.slots, bool) if self.runner.token_logprobs else None
            for length, greedy in itertools.product(self.runner.length_buckets, self._round_programs()):
                self.runner.pin_length = length  # a round's cache rows (its live lengths'); pinned in turn
                self.runner.greedy_rows = greedy  # and each program a round may run
                try:
                    for rows in self.row_buckets:
                        for w in widths:
                            self._round(w, idle, rows, logprobs=scored)
                            if self.runner.bursts and self.rounds_per_call != 1:  # its calls of several rounds,
                                # with a round run (a program's first run sets up its kernels: 20 - 70 ms on a CPU)
                                self.runner.warm_burst(self._proposer(w, w == 1 and self.defer_context), rows)
                finally:
                    self.runner.pin_length = None
                    self.runner.greedy_rows = self.greedy_programs  # the rounds timed below: greedy rows
            if self.defer_context:  # the append of held rows (`_flush_held`): held prompts need it at any width
                for rows in self.row_buckets:
                    self.runner.flush_context(rows)  # (a gathered flush of a few rows: `warm_extra`)
                    if 1 in widths:  # width 1 serves now: the catch-up of the rows its rounds skip
                        self._warm_catch_up(rows, again=True)
            if before is not None and before == array_types(self.runner.carried()):
                break  # the first pass's outputs have its inputs' types: a second would call the same programs
        self.runner.sync()
        if self.round_seconds is None and not self.cost_table:
            self.cost_table = self.measure_rounds(widths=widths)
        self.runner.warm_extra()
        self.warm = True

    def measure_rounds(self, repeats: int = 5, row_buckets: Sequence[int] | None = None,
                       widths: Sequence | None = None) -> dict:
        """{rows: {width: seconds}} of one round computing `rows` rows (draft + host transfer of the demand +
        verify; compute does not depend on which of those rows are live) for every row bucket and width.
        Paired, so that a busy spell of a shared machine cancels out: each repeat times every width of a row
        bucket back to back (the order reversed every other repeat), and a width's entry is the median over
        repeats of its time over the narrowest width's time in the same repeat, times the narrowest width's
        median. A runner of calls of several rounds (`bursts`) is timed as it serves: a call of
        `MEASURE_CALL_ROUNDS` rounds, less an empty call's time (`call_overhead`, at most half the narrowest), over the
        rounds. Needs the programs compiled (`warmup`). widths: these only (default: every width)."""
        from dflash_jax.timing import paired_runs

        widths = self.widths if widths is None else tuple(widths)
        idle = np.zeros(self.slots, bool)
        bursts = self.runner.bursts and self.rounds_per_call != 1
        n = MEASURE_CALL_ROUNDS if bursts else 1
        table = {}
        for rows in (self.row_buckets if row_buckets is None else row_buckets):
            def rounds(w, rows=rows):
                if bursts:  # as served: a call of several rounds (a width-1 call holding the draft's context)
                    self.runner.warm_burst(self._proposer(w, w == 1 and self.defer_context), rows, n)
                else:
                    self._round(w, idle, rows)
                    self.runner.sync()

            def empty_call(rows=rows):  # a call of no round (every row idle): the host work of a call
                self.runner.burst(self._proposer(widths[0]), idle, rows, 1)
                self.runner.fetch()

            fns = {w: (lambda w=w: rounds(w)) for w in widths}
            if bursts:
                fns["call"] = empty_call
            runs = paired_runs(fns, repeats)
            row = {w: runs.paired_seconds(w, widths[0]) for w in widths}
            if bursts:  # a round costs its share of the call less the call's host work
                call = min(runs.paired_seconds("call", widths[0]), 0.5 * min(row.values()))
                row = {w: (t - call) / n for w, t in row.items()}
                self.call_overhead[rows] = call
            table[rows] = row
        return table

    def row_bucket(self, live: Sequence[int]) -> int:
        """The rows a round computes: the smallest row bucket holding every live slot."""
        top = max(live) + 1 if len(live) else 1
        return next(r for r in self.row_buckets if r >= top)

    def _round_programs(self) -> tuple[bool, ...]:
        """The programs a round of this engine may run, as `RoundRunner.greedy_rows` values (`greedy_programs`)."""
        return (False, True) if self.greedy_programs else (False,)

    def _round(self, width: int, active: np.ndarray, rows: int | None = None, defer: bool | None = None,
               logprobs: np.ndarray | None = None) -> None:
        """One round of the rows where `active` is set (warm-up, `measure_rounds`); defer None: as served (a
        width-1 round holds the draft's context when the engine does; rows that do not verify keep their state, so
        there is always room). logprobs: the rows whose log-probs the round computes."""
        rows = self.slots if rows is None else rows
        defer = (width == 1 and self.defer_context) if defer is None else defer
        self.runner.round(self._proposer(width, defer), active, rows, logprobs=logprobs)

    def _warm_samples(self, reqs: list, rows) -> None:
        """Compiles what a prefilled group of `reqs` (its rows `rows`) may run beyond its insert: its first tokens'
        log-probs, and the fork of its rows into n samples and their insert (dropped)."""
        if self.runner.token_logprobs:
            self.runner.first_logprobs(rows)
        if self.runner.forks and self.slots > 1:
            rows = self._fork(rows, [0] * self.slots, [reqs[0]] * self.slots)
            self.runner.insert(rows, np.full(self.slots, self.slots, np.int32))
            if self.runner.token_logprobs:
                self.runner.first_logprobs(rows)

    def _held_top(self, live: Sequence[int], skipped: bool = True) -> int:
        """The most context rows a live row leaves for its next drafting round: its pending ones, plus (`skipped`)
        the positions whose rows its width-1 rounds skipped (`skip_context`); 0 when the engine holds none."""
        if not self.defer_context or not len(live):
            return 0
        held = self.runner.pending_context()[np.asarray(live)]
        if skipped and self.skip_context:
            held = held + np.asarray([self._skipped(self.requests[s]) for s in live])
        return int(held.max())

    @staticmethod
    def _skipped(req: Request) -> int:
        """The positions of `req` whose context rows were skipped (`skip_context`): its tokens from `skipped_from`
        up to, not including, the last (the next round's anchor, not yet forwarded)."""
        return 0 if req.skipped_from is None else max(len(req.tokens) - 1 - req.skipped_from, 0)

    def _mark_skipping(self, live: Sequence[int]) -> None:
        """A width-1 step that skips the draft's context: each live row's skipped positions start at its anchor
        unless they started before."""
        if self.skip_context:
            for s in live:
                req = self.requests[s]
                if req.skipped_from is None:
                    req.skipped_from = max(len(req.tokens) - 1, 0)

    def _catch_up(self, live: Sequence[int], rows: int) -> None:
        """Computes the context rows of every live row's skipped positions (`RoundRunner.catch_up`, oldest first,
        `CATCH_UP_CHUNK` a call; the pending rows appended first)."""
        back = np.zeros(self.slots, np.int32)
        for s in live:
            back[s] = self._skipped(self.requests[s])
        total = int(back.sum())
        while back.any():
            tokens = np.zeros((self.slots, CATCH_UP_CHUNK), np.int32)
            for s in np.flatnonzero(back):
                seq = self.requests[s].tokens
                start = len(seq) - 1 - int(back[s])
                part = seq[start: start + min(CATCH_UP_CHUNK, int(back[s]))]
                tokens[s, : len(part)] = part
            self.runner.catch_up(rows, tokens, back)
            self.catch_ups += 1
            back = np.maximum(back - CATCH_UP_CHUNK, 0)
        for s in live:
            self.requests[s].skipped_from = None
        self.caught_up_rows += total

    def _flush_held(self, width, live: Sequence[int], rows: int, count: int) -> None:
        """Appends the held context of the round's rows first when this step needs it (`defer_context`): a
        drafting round reads at most a block of pending rows (and none skipped: `skip_context` rows are caught up
        first), and a width-1 call of `count` rounds holds a row more each round (none when it skips). Only the rows
        over that limit append (a gathered flush where they are few: a prompt admitted into a bucket of many rows
        costs its own append, not the bucket's); the others keep their few pending rows for the round."""
        if not self.defer_context:
            return
        drafting = shape_rows(width) > 1
        if not drafting and self.skip_context:  # width-1 rounds that skip add no held rows: the hold cannot fill
            return
        skipped = drafting and any(self._skipped(self.requests[s]) for s in live)
        if drafting:
            if not skipped:  # a drafting round feeds the draft's context again: nothing skipped from here
                for s in live:
                    self.requests[s].skipped_from = None
        limit = self.block_size if drafting else self.context_rows - (0 if self.skip_context else count)
        pending = self.runner.pending_context()
        over = [s for s in live if pending[s] > limit]
        if skipped or over:
            if drafting:  # timed alone (what the step dispatched before it runs first, as it would anyway)
                self.runner.sync()
                t0 = time.perf_counter()
            if skipped:  # the held rows appended first, then the skipped positions' rows
                self._catch_up(live, rows)
            else:
                self.runner.flush_context(rows, over)
            self.context_flushes += 1
            if drafting:  # what drafting costs per admission (`drafting_per_token`)
                self.runner.sync()
                seconds = time.perf_counter() - t0
                if rows in self._flush_times:
                    self._flush_times[rows].append(seconds)
                else:  # the bucket's first: not kept
                    self._flush_times[rows] = collections.deque(maxlen=PREFILL_WINDOW)

    def _note_served(self, info: RoundInfo, seconds: float) -> None:
        """Adds a served step (its committed tokens over `seconds` times its live rows) to its (bucket, width)'s
        figures, the bucket's older steps faded (`SERVED_DECAY`)."""
        for key, v in self._served.items():
            if key[0] == info.rows:
                v[:] = [SERVED_DECAY * x for x in v]
        v = self._served.setdefault((info.rows, info.width), [0.0, 0.0, 0.0])
        v[0] += 1.0
        v[1] += max(info.tokens - info.admitted, 0)  # an admitted request's first token is its prefill's
        v[2] += seconds * max(info.live, 1)

    def served_rate(self, rows: int, width) -> tuple[float, float] | None:
        """(committed tokens per row-second, decayed steps) of the chosen steps of `width` in the row bucket `rows`
        (admissions left out: what the width itself serves), None before any."""
        v = self._served.get((rows, width))
        return None if v is None or v[2] <= 0.0 else (v[1] / v[2], v[0])

    def served_choice(self, rows: int, width):
        """The width the served rates pick over the round model's `width` in the row bucket `rows`, or None where
        they do not overrule it. Where both it and the narrowest width have at least `SERVED_STEPS` recent steps:
        a drafting width that served fewer tokens per row-second than the narrowest gives way to it; and where the
        model picks the narrowest, the drafting width that served the most, if it beat the narrowest by more than
        `width_margin`, runs instead. The model (costs, acceptance, host work, flushes) misses what the outcome
        shows: the acceptance while a width runs, what switching costs. Each keeps being measured while it runs,
        and one that stops running fades out (`SERVED_DECAY`), so the model decides again."""
        base = min(self.widths, key=shape_order)
        rate = {}
        for w in self.widths:
            got = self.served_rate(rows, w)
            if got is not None and got[1] >= SERVED_STEPS:
                rate[w] = got[0]
        if base not in rate:
            return None
        if width != base:
            return base if width in rate and rate[width] < rate[base] else None
        best = max((w for w in rate if w != base), key=lambda w: rate[w], default=None)
        return best if best is not None and rate[best] > (1.0 + self.width_margin) * rate[base] else None

    def flush_seconds(self, rows: int) -> float | None:
        """The seconds a flush of the held context of the first `rows` rows takes before a drafting round: the
        median of the last `PREFILL_WINDOW` timed, None before any."""
        return _median(self._flush_times.get(rows))

    def drafting_per_token(self, rows: int) -> float:
        """What drafting adds per committed token beyond its rounds (`defer_context`): a prompt's context is held
        at admission and appended before the next drafting round, a flush of the row bucket (`flush_seconds`)
        per step that admitted requests, over the tokens committed per such step (decayed). 0 until a flush
        of the bucket was timed, and for an engine that appends the context at admission."""
        flush = self.flush_seconds(rows)
        steps, tokens = self._admit_rate
        if not self.defer_context or flush is None or tokens <= 0.0:
            return 0.0
        return flush * steps / tokens

    @property
    def worth_scale(self) -> dict:
        """{chain width: what its verifies committed over what the chain model expected of them}, each with
        `WORTH_PRIOR` tokens of "as expected" and within `WORTH_SCALE_RANGE` (decayed per verify like the long-run
        acceptance). The model takes a row's proposals as accepted independently at one rate; a draft's acceptance
        varies along a request (easy stretches, hard ones), and the expected tokens of a round grow faster than
        linearly in it, so at one estimate the model undersells what a drafting width commits (by about 5% at width
        4 on the shipped pair at 1 - 4 rows); this puts each width's own outcome back into the choice."""
        lo, hi = WORTH_SCALE_RANGE
        return {w: min(max((got + WORTH_PRIOR) / (want + WORTH_PRIOR), lo), hi)
                for w, (got, want) in self._worth.items()}

    def row_acceptance(self, req: Request) -> float:
        """The estimated probability that a proposal of `req` is accepted given the ones before it: its decayed
        accepted / (accepted + rejected) proposals, with the engine-wide estimate as a prior of weight 2."""
        g = self._hits / (self._hits + self._misses)
        return (req.accept_hits + 2.0 * g) / (req.accept_hits + req.accept_misses + 2.0)

    def seconds_table(self, rows: int) -> dict:
        """{width: seconds} of a round computing `rows` rows: `round_seconds` when given, else the measured table
        of that row bucket (a rough default before warm-up); learned from served rounds once it has any."""
        if rows in self._costs:
            return self._costs[rows].seconds
        ready = self.ready_widths(rows)
        if self.round_seconds is not None:
            return {w: self.round_seconds[w] for w in ready}
        return self.cost_table.get(rows) or {w: 1.0 + shape_rows(w) / 16.0 for w in ready}

    def bucket_costs(self, rows: int) -> BucketCosts:
        """The row bucket's learned costs (from its warm-up or given table until a round of it is served)."""
        costs = self._costs.get(rows)
        return costs if costs is not None else BucketCosts.fresh(self.seconds_table(rows), self.cost_rule)

    def choose_width(self, live: Sequence[int]) -> int:
        """This round's verify width (`decide_width`: `choose_width` over the live rows' acceptance and the cost
        table of the row bucket the round computes, and, when the table is learned, the exploration of a stale
        neighbouring width; `self._explored` says which)."""
        self._explored = None
        if len(self.widths) == 1:
            return self.widths[0]
        # every round also pays the host's work around the draft and the verify (the same at every width, so it
        # favours the wider verifies, which need fewer rounds)
        rows = self.row_bucket(live)
        alphas, costs = [self.row_acceptance(self.requests[s]) for s in live], self.bucket_costs(rows)
        rule = self.cost_rule if self.learn_costs else None
        # before a served round has shown it, a round's host work is at least its share of a whole call's
        host = self.host_seconds if self._host_samples else self.call_overhead.get(rows, 0.0) / MAX_BURST
        host = {w: self.host_by.get((rows, w), host) for w in costs.seconds}  # chosen rounds' own, else engine-wide
        # drafting widths also pay the held context's flushes, one per admission (per token: scaled by each width's
        # expected tokens per round)
        drafting = self.drafting_per_token(rows)
        scale = self.worth_scale if self._worth else None
        occupancy = self._occupancy(live, rows, alphas, costs.seconds, scale)
        if occupancy is not None:  # what each width's calls commit over what their rows x rounds would
            scale = {w: (scale or {}).get(w, 1.0) * f for w, f in occupancy.items()}
        # the width the bucket runs now pays no margin: a change needs the clear gain both ways
        incumbent = self._incumbent.get(rows)
        width, explored = decide_width(alphas, costs, host, self.width_margin, rule, drafting, scale, incumbent)
        if explored and shape_rows(width) > 1 and self._held_top(live) > self.block_size:
            # re-pricing a drafting width would append the held context first: not while a live row holds more
            # than a block (the table keeps its entry, scaled by the load the chosen width's rounds show)
            width, explored = decide_width(alphas, costs, host, self.width_margin, None, drafting, scale, incumbent)
        if not explored and rule is not None and self.acceptance_exploration:
            # what the draft accepts, measured where an optimistic estimate says a wider width could win (held rows'
            # evidence fades toward the prior, which may undersell the draft): a short call now and then, with the
            # held context appended first, within the exploration's budget of the served time
            evidence = [self.requests[s].accept_hits + self.requests[s].accept_misses + 2.0 for s in live]
            wait = self._accept_wait.get(rows, rule.accept_after)  # (a replaced rule only where it backed off)
            learning = self._long_hits + self._long_misses <= ACCEPT_FREE_EVIDENCE
            wait = 1 if learning else wait  # the acceptance not known yet: a try at the next call that hopes
            arule = rule if wait == rule.accept_after else dataclasses.replace(rule, accept_after=wait)
            hope = explore_acceptance(acceptance_upper(alphas, evidence), costs, width, host, self.width_margin,
                                      arule, drafting, scale)
            rounds = max(1, min(ACCEPTANCE_CALL_ROUNDS, -(-ACCEPTANCE_VERIFIES // len(live))))
            if hope is not None and not learning:  # while learning: free
                # what it is expected to lose at the current estimate, the held context's append included
                first = (self.flush_seconds(rows) or 0.0) if self._held_top(live) > self.block_size else 0.0
                seconds = with_drafting(with_host(costs.seconds, host), alphas, drafting, scale)
                loss = exploration_loss(alphas, seconds, width, hope, rounds, first, scale)
                hope = hope if loss <= self._explore_credit else None
                self._explore_credit -= loss if hope is not None else 0.0
            if hope is not None:
                width, explored = hope, True
                self.acceptance_explores += 1
                self._accept_explore, self._accept_rounds = True, rounds
        other = None if explored or not self.learn_costs else self.served_choice(rows, width)
        if other is not None:  # what the widths served overrules what the model expects
            width = other
            self.served_overrules += 1
        if (not explored and rule is not None and shape_rows(width) > 1 and width != incumbent
                and costs.unserved(width, rule)):
            # a switch to a drafting width this bucket has not served lately runs a short call first, priced from its
            # own rounds (an exploration), and the model decides again on that: its price is the warm-up's (idle
            # rows: short caches, nothing held to append) or an old one, while the width the bucket runs is priced
            # from its live rows, whose caches grow. Long requests' width-1 price then climbs past what the old one
            # implies and the model switches: at 4 clients on the shipped pair, to width-4 rounds that served 0.38x
            # width 1's tokens, in calls of 50 ms, until the served rates overruled them 8 calls later
            self.switch_trials += 1
            explored = True
        if not explored and rows in self._accept_tried:  # the verdict on the bucket's last try
            tried, base = self._accept_tried.pop(rows), self.cost_rule.accept_after
            wanting = shape_rows(width) < shape_rows(tried)
            wait = self._accept_wait.get(rows, base)
            self._accept_wait[rows] = min(2 * wait, ACCEPT_BACKOFF * base) if wanting else base
        self._explored = width if explored else None
        if not explored:
            self._incumbent[rows] = width
        return width

    def _occupancy(self, live: Sequence[int], rows: int, alphas, shapes, scale) -> dict | None:
        """{width: the share of its call's rows x rounds that commit} (`call_occupancy`) for the live rows' budgets
        left, where this step would run a call of several rounds that ends only when every row is done (no request
        waiting for a slot, which would end it at the first row's finish); None where it would not. Stop tokens
        are not foreseen: a budget is what a row may still commit."""
        if len(live) < 2 or self.queue or not self._bursts(
                any(self.requests[s].logprobs is not None for s in live)):
            return None
        remaining = [self.requests[s].max_new_tokens - len(self.requests[s].tokens) for s in live]
        return call_occupancy(alphas, remaining, {w: self._call_rounds(rows, w) for w in shapes}, scale)

    def learn_cost(self, info: RoundInfo, priced: bool = True) -> None:
        """Updates the round's bucket entry from its device time (draft + verify + fetch) and counts an explored
        round (`priced` False: counted only, a call cut short)."""
        if info.explored:
            self.explore_rounds[info.width] += 1
            self.explore_seconds += info.seconds
        if (not priced or not self.learn_costs or len(self.widths) < 2 or info.compiles
                or info.width not in self.proposers):
            return
        costs = observe_cost(self.bucket_costs(info.rows), info.width, self._round_seconds(info),
                             self.cost_rule, info.explored)
        self._costs[info.rows] = costs
        if self.round_seconds is None:
            self.cost_table[info.rows] = costs.seconds

    def _round_seconds(self, info: RoundInfo) -> float:
        """A served round's cost as the table prices it: a round alone, its device time; a round of a call of
        several, its share of the call's time less the call's host work (`call_overhead`, at most half of it), so a
        short call (an explored width) and a long one (the chosen width) price their rounds alike."""
        seconds = self._device_seconds
        if info.burst:
            seconds -= min(self.call_overhead.get(info.rows, 0.0), 0.5 * seconds)
        return seconds / info.rounds

    def _observe_acceptance(self, req: Request, width: int, committed: int, finished: bool) -> None:
        """Updates the acceptance estimates from one verify: `committed - 1` proposals accepted of `width - 1`,
        and a rejection when fewer than all were accepted (unless the budget or a stop cut the round).

        A width-1 round proposes nothing, so it cannot show whether the draft got better: the request's own
        evidence fades instead (decayed like a verify's), its estimate returning to the engine-wide one, so a
        request the chooser moved to width 1 after a few poor rounds is tried at a wider width again."""
        d = ACCEPTANCE_DECAY
        chain = not isinstance(width, TreeShape)
        # a chain proposes width - 1 positions; a tree's path reaches at most the draft block's last position
        width = self.block_size if not chain else width
        if width < 2:
            req.accept_hits, req.accept_misses = d * req.accept_hits, d * req.accept_misses
            return
        if finished:
            return
        if chain:  # what the chooser's chain model expected of this verify, against what it committed
            a = min(self.row_acceptance(req), 0.999)
            seen = self._worth.setdefault(width, [0.0, 0.0])
            seen[0] = LONG_RUN_DECAY * seen[0] + committed
            seen[1] = LONG_RUN_DECAY * seen[1] + (1.0 - a ** width) / (1.0 - a)
        hits = float(committed - 1)
        misses = 1.0 if committed < width else 0.0
        req.accept_hits, req.accept_misses = d * req.accept_hits + hits, d * req.accept_misses + misses
        self._hits, self._misses = d * self._hits + hits, d * self._misses + misses
        d = LONG_RUN_DECAY
        self._long_hits, self._long_misses = d * self._long_hits + hits, d * self._long_misses + misses

    # -- one round -------------------------------------------------------------------------------------

    def _finish(self, req: Request, reason: str, info: RoundInfo) -> None:
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        if req.slot is not None:
            self.requests.pop(req.slot, None)
            req.slot = None
        info.finished.append(reason)
        if req.on_finish is not None:
            req.on_finish(req)
        req.done_event.set()

    def _emit(self, req: Request, new: list[int], info: RoundInfo) -> None:
        if not new:
            return
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.tokens.extend(new)
        info.tokens += len(new)
        if req.on_tokens is not None:
            req.on_tokens(req, new)

    def _reason(self, req: Request) -> str:
        return "stop" if req.tokens and req.tokens[-1] in req.stop_ids else "length"

    def step(self) -> RoundInfo:
        """One round: admissions, draft, schedule, verify, emission. Returns what it did."""
        info = RoundInfo()
        t0 = time.perf_counter()
        self._explored, self._accept_explore, self._cut_short = None, False, False
        with compile_cache.CompileCounter() as counter:
            self._step(info)
        info.compiles = counter.compiles
        t_end = time.perf_counter()
        info.seconds = t_end - t0
        info.explored = bool(info.width) and self._explored == info.width
        # a call its rows' finishing cut short spreads the call's fixed work over fewer rounds than the width's calls
        # run: not a price of the width's rounds (the served rates count it, as serving pays it)
        priced = not self._cut_short
        if info.width and not info.compiles and not info.prefill_chunks and priced:
            # what a served round takes beyond its own device time (as the table prices it, `_round_seconds`): the
            # host's work (choice, scheduling, emission, callbacks, a call's share), from the round's start (the
            # step's admissions, flush and the wait for them left out). What the compute itself takes beyond its
            # table entry (live rows' longer caches, a loaded machine) is the cost table's to learn (`learn_cost`),
            # not this: it grows with the width. Kept engine-wide and per (row bucket, width), of chosen calls only:
            # an explored call (or a switch's trial) is short, its host share per round several times a whole
            # call's, and a first figure from one (258 us a round against 14 us in the calls after it, at 4 rows
            # on the shipped pair) priced every width's rounds that much higher, which favours the wide ones. A
            # width is priced with its own where it has one (`choose_width`).
            if not info.explored:
                over = max((t_end - self._round_start) / info.rounds - self._round_seconds(info), 0.0)
                self.host_seconds = over if not self._host_samples else 0.9 * self.host_seconds + 0.1 * over
                self._host_samples += 1
                key = (info.rows, info.width)
                self.host_by[key] = over if key not in self.host_by else 0.8 * self.host_by[key] + 0.2 * over
        if info.width and not info.compiles and not info.prefill_chunks:
            # explored calls too: an acceptance try is what first shows a drafting width served (its few rounds
            # carry a whole call's host work: it shows no more than the width serves)
            self._note_served(info, t_end - self._admitted_at)
        d = FLUSH_DECAY
        self._admit_rate = [d * self._admit_rate[0] + (info.admitted > 0), d * self._admit_rate[1] + info.tokens]
        if info.width:
            if self._accept_explore:  # a try ran: the bucket's next choice is its verdict (`ACCEPT_BACKOFF`)
                self._accept_tried[info.rows] = info.width
            if not self._accept_explore and not info.compiles:  # the acceptance exploration's budget
                self._explore_credit = (CREDIT_DECAY ** info.rounds * self._explore_credit
                                        + self.cost_rule.accept_budget * info.seconds)
            self.learn_cost(info, priced)
            if not info.compiles and priced:  # what a round of this bucket and width takes (sizes the calls of several)
                seconds, key = self._device_seconds / info.rounds, (info.rows, info.width)
                old = self._round_time.get(key)
                self._round_time[key] = seconds if old is None else 0.8 * old + 0.2 * seconds
        self.rounds += info.rounds
        for obs in self.observers:
            obs(info)
        self._steps += 1
        self._rounds_since_warm += info.rounds
        # the step's row bucket, even where its call finished every request (a call of up to `MAX_BURST` rounds often
        # holds a whole request at one client: waiting for a step that leaves rows live, width 1 never joined there)
        if self._later and info.rows and self._rounds_since_warm >= BUSY_WARM_ROUNDS and not self._stopping:
            self._rounds_since_warm = 0
            self.warm_later(busy=True, rows=info.rows)  # after the step's observers: its figures are the round's
        return info

    def _admissions(self, info: RoundInfo) -> None:
        """Cancellations, then the waiting requests that fit in free slots, prefilled in groups (one batched
        prefill each) into the lowest free slots."""
        with self._wake:
            cancelled_queue = [r for r in self.queue if r.cancel_requested]
            for r in cancelled_queue:
                self.queue.remove(r)
        for r in cancelled_queue:
            for sample in r.samples:  # its siblings were never admitted
                if sample.finish_reason is None:
                    self._finish(sample, r.cancel_reason, info)
        free = np.zeros(self.slots, bool)
        for slot, r in list(self.requests.items()):
            if r.cancel_requested:
                free[slot] = True
                self._finish(r, r.cancel_reason, info)
        if free.any():
            self.runner.release(free)
        if self._prefilling is not None and self._prefilling.req.cancel_requested:
            self._prefilling = None  # cancelled mid-prefill (finished above): its partial state is dropped
        self._compact()
        chunk_ran = self._advance_prefill(info)  # one chunk per round: the round's prefill budget
        self._compact()
        while self._room() > 0:
            free = [s for s in range(self.slots) if s not in self.requests]
            room = self._room()
            start = None
            with self._wake:
                # in arrival order: whole prompts join in groups; a long one starts its chunked prefill (one at a
                # time, its slots reserved) and the requests behind it may take the other free slots. A request of
                # n samples needs n free slots; the requests behind it wait for it (first come, first served)
                line = [r for r in self.queue if self._prefilling is None or r is not self._prefilling.req]
                whole = next((i for i, r in enumerate(line) if self._chunked(r)), len(line))
                take, used = 0, 0
                for r in line[: min(whole, self.prefill_groups[-1])]:
                    if used + len(r.samples) > room:
                        break
                    take, used = take + 1, used + len(r.samples)
                if take and next(g for g in self.prefill_groups if g >= take) > 2 * take:
                    take = max(g for g in self.prefill_groups if g <= take)  # not mostly padding rows
                if take > 1 and self._split_cheaper(line[:take]):  # one now, the next ones by the same rule
                    take = 1
                    self.split_admissions += 1
                reqs = line[:take]
                for r in reqs:
                    self.queue.remove(r)
                if (not reqs and line and whole == 0 and self._prefilling is None and not chunk_ran
                        and len(line[0].samples) <= room):
                    start = line[0]
            if start is not None:
                self._start_prefill(start, info)
                chunk_ran = True
                continue
            if not reqs:
                break
            self._joining = reqs  # out of the queue, not yet in a slot: a failed prefill must not lose them
            self._admit(reqs, free[: sum(len(r.samples) for r in reqs)], info)
            self._joining = []
            self._compact()  # a request that ended at its first token

    def prompt_bucket(self, n: int, cap: int | None = None) -> int:
        """The padded length of an `n`-token prefill: `buckets.prompt` times a power of two, without the fine 1.5x
        steps the loops take (half the prefill programs to compile at start, at most 2x padding), capped at `cap`
        (default: the longest prompt prefilled whole, `max_prompt_len` or the chunk)."""
        return min(rq.bucket(int(n), self.buckets.prompt), self._prompt_cap() if cap is None else int(cap))

    def _prompt_cap(self) -> int:
        return min(self.max_prompt_len, self.prefill_chunk or self.max_prompt_len)

    def _room(self) -> int:
        """Free slots not reserved for the request in chunked prefill (and its samples)."""
        reserved = 0 if self._prefilling is None else len(self._prefilling.req.samples)
        return self.slots - len(self.requests) - reserved

    def _step(self, info: RoundInfo) -> None:
        if not self.runner.ready:
            self._reset()
        self.runner.begin_round(info)
        self._marks = (self.moves, self.context_flushes)  # what this step dispatched before its round (`_settle`)
        self._admissions(info)
        self._admitted_at = time.perf_counter()
        verified = self._round_step(info) if self.requests else False
        self.runner.end_round(info, verified)

    # -- chunked prefill ---------------------------------------------------------------------------------

    def _chunked(self, req: Request) -> bool:
        """Whether `req` joins by chunks (its prompt is longer than one chunk)."""
        return self.prefill_chunk is not None and len(req.prefill_ids) > self.prefill_chunk

    def chunk_widths(self) -> list[int]:
        """The compiled chunk shapes: the prompt buckets up to the chunk (a prompt's last chunk is padded to its
        bucket), the chunk the widest."""
        out, n = [], 1
        while self.prefill_chunk is not None:
            out.append(self.prompt_bucket(n, self.prefill_chunk))
            if out[-1] >= self.prefill_chunk:
                break
            n = out[-1] + 1
        return out

    def _chunk_inputs(self, req: Request, start: int):
        """The chunk of `req`'s prefill tokens from token `start`: ([1, bucket] int32 right-padded, [1] real tokens,
        [1, bucket] int32 positions or None when the engine does not compress)."""
        ids = req.prefill_ids
        n = min(self.prefill_chunk, len(ids) - start)
        width = self.prompt_bucket(n, self.prefill_chunk)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :n] = ids[start: start + n]
        positions = None
        if self.compress is not None:
            positions = req.prefill_positions(start + width)[None, start:]
        return tokens, np.array([n], np.int32), positions

    def _count_chunk(self, n: int, info: RoundInfo) -> None:
        info.prefill_chunks += 1
        info.prefill_tokens += n
        self.prefill_chunks += 1
        self.prefill_tokens += n

    def _start_prefill(self, req: Request, info: RoundInfo) -> None:
        """The first chunk of a long prompt (`spec.prefill.prefill_start`): its one-row state starts outside the
        batch; the request stays queued, a slot reserved for it."""
        self._score_prompt(req)
        info.compressed_tokens += len(req.prompt) - len(req.prefill_ids)
        self.compressed_tokens += len(req.prompt) - len(req.prefill_ids)
        keys = []
        if self.prefix_cache is not None:
            ids = req.prefill_ids
            positions = None if req.kept is None else req.prefill_positions(len(ids))
            keys = prefix_keys(ids, self.prefill_chunk, positions)
            hit = self.prefix_cache.lookup(keys)
            info.prefix_query_tokens += len(ids)
            self.prefix_query_tokens += len(ids)
            if hit is not None:  # the cached prefix's caches, then the rest by the same chunks as a cold prefill
                info.prefix_hit_tokens += hit.length
                self.prefix_hit_tokens += hit.length
                self._prefilling = _Prefilling(req=req, pre=self.runner.prefill_restore(hit.payload), done=hit.length,
                                               keys=keys)
                self._advance_prefill(info)
                return
        tokens, valid, positions = self._chunk_inputs(req, 0)
        # waited for: the round's draft and verify are timed alone
        pre = self.runner.prefill_start(tokens, valid, positions=positions)
        self._prefilling = _Prefilling(req=req, pre=pre, done=int(valid[0]), keys=keys)
        self._count_chunk(int(valid[0]), info)
        self._snapshot(self._prefilling)

    def _advance_prefill(self, info: RoundInfo) -> bool:
        """The next chunk of the request in chunked prefill, if any (returns whether a chunk ran). After its last
        chunk its state is finished (`prefill_finish`: the first token, as a whole-prompt prefill), written into
        a free slot and its first token emitted."""
        p = self._prefilling
        if p is None:
            return False
        tokens, valid, positions = self._chunk_inputs(p.req, p.done)
        last = p.done + int(valid[0]) >= len(p.req.prefill_ids)
        p.pre = self.runner.prefill_chunk(p.pre, tokens, valid, wait=not last, positions=positions)
        p.done += int(valid[0])
        self._count_chunk(int(valid[0]), info)
        if not last:
            self._snapshot(p)
            return True
        self._prefilling = None
        with self._wake:
            self.queue.remove(p.req)
        rows = self.runner.prefill_finish(p.pre, self._batch([p.req]))
        free = [s for s in range(self.slots) if s not in self.requests]
        self._place([p.req], free[: len(p.req.samples)], rows, 1, info)
        return True

    def _snapshot(self, p: _Prefilling) -> None:
        """Keeps a copy of the partial prefill in the prefix cache when it ends at a chunk boundary the cache does
        not hold yet (the next chunk donates it)."""
        if self.prefix_cache is None or not p.keys or p.done % self.prefill_chunk:
            return
        k = p.done // self.prefill_chunk - 1
        if k >= len(p.keys) or p.keys[k][1] in self.prefix_cache:
            return
        snapshot = self.runner.prefill_snapshot(p.pre, p.done)  # the live rows only
        self.prefix_cache.store(p.keys[k][1], p.done, snapshot, self.runner.prefill_nbytes(snapshot))

    def _warm_chunks(self) -> None:
        """Compiles the chunked prefill: the first chunk, a next chunk of every width, the finish and its insert
        (a dummy row, dropped)."""
        c = self.prefill_chunk
        at = (lambda start, width: None if self.compress is None  # noqa: E731
              else np.arange(start, start + width, dtype=np.int32)[None])
        pre = self.runner.prefill_start(np.zeros((1, c), np.int32), np.array([c], np.int32), positions=at(0, c))
        if self.prefix_cache is not None:  # the snapshot's and the restore's programs, per snapshot shape
            shapes = {}
            for end in range(c, self.max_prompt_len, c):
                shapes.setdefault(self.runner.snapshot_rows(end), end)
            for end in shapes.values():
                self.runner.prefill_restore(self.runner.prefill_snapshot(pre, end))
        for width in self.chunk_widths():  # 0 real tokens: the dummy prompt stays inside the cache
            pre = self.runner.prefill_chunk(pre, np.zeros((1, width), np.int32), np.zeros(1, np.int32),
                                            positions=at(c, width))
        rows = self.runner.prefill_finish(pre, self._batch([None]))
        self.runner.insert(rows, np.full(1, self.slots, np.int32))

    def _compact(self) -> None:
        """Keeps the live requests within the smallest row bucket that holds as many rows: while the highest live row
        lies past it, that row moves down into the lowest free slot (`RoundRunner.move_row`: every leaf of the row, so
        the request continues exactly as it was). A round then computes only the smallest row bucket holding the live
        rows. A move that would leave the bucket as it is is not made (live slots 0, 2, 3 compute bucket 4 as slots
        0, 1, 2 do, and the next admission takes slot 1): a move copies every leaf of a row (0.5 - 0.6 ms on a CPU at
        the shipped pair's 32 slots), and with steady clients most moves were of that kind."""
        while self.requests:
            n = len(self.requests)
            top = max(self.requests)
            if self.row_bucket([top]) <= self.row_bucket([n - 1]):
                return
            hole = next(s for s in range(n) if s not in self.requests)
            self.runner.move_row(top, hole)
            req = self.requests.pop(top)
            req.slot = hole
            self.requests[hole] = req
            self.moves += 1

    def _unlimited(self) -> bool:
        """Both scheduler budgets unlimited: every live row verifies every round (the scheduler still runs, for
        its deficits and stats, while the verify computes)."""
        return self.budgets.tokens is None and self.budgets.expert_bytes is None

    def _round_step(self, info: RoundInfo) -> bool:
        """Width, draft, schedule, verify, emission for the live slots. Returns whether a row verified."""
        self._round_start = time.perf_counter()
        live = sorted(self.requests)
        rows = self.row_bucket(live)
        info.live, info.rows = len(live), rows
        width = self.choose_width(live)
        info.width = width
        self.width_rounds[width] += 1
        greedy = self.greedy_programs and all(self.requests[s].sampling.greedy for s in live)
        self.runner.greedy_rows = greedy  # the round's programs (`RoundRunner.round_spec`)
        self.greedy_rounds += greedy
        self.rows_rounds[rows] += 1
        scored = np.zeros(self.slots, bool)  # the rows whose committed tokens' log-probs are computed
        scored[[s for s in live if self.requests[s].logprobs is not None]] = True
        scored = scored if scored.any() else None
        count = self._burst_count(rows, width, scored)
        t_wait = time.perf_counter()
        self._flush_held(width, live, rows, count)
        self._settle(info)
        self._round_start += time.perf_counter() - t_wait  # the flush and the wait are not the round's host work
        if count > 1:
            return self._burst_step(info, live, rows, width, count)
        defer = width == 1 and self.defer_context
        self.deferred_rounds += defer
        if defer:
            self._mark_skipping(live)
        proposer = self._proposer(width, defer)
        t_device = time.perf_counter()
        drafted = self.runner.draft(proposer, rows)
        overlap = self.runner.overlapped_verify and self._unlimited()
        if overlap:  # every live row verifies: start the verify now, schedule (stats) while it runs
            active = np.zeros(self.slots, bool)
            active[live] = True
            self.runner.verify(drafted, RoundPlan(active=active, live=tuple(live), logprobs=scored), info)
        demand = self.runner.demand(drafted)
        t_draft = time.perf_counter() - t_device
        demands = [sched.Demand(key=self.requests[s].id, tokens=shape_rows(width), experts=demand[s]) for s in live]
        decision = sched.schedule(demands, self.sched_state, self.budgets, self.runner.byte_costs(self.expert_bytes))
        self.sched_state = decision.state
        slot_of = {self.requests[s].id: s for s in live}
        if not overlap:
            active = np.zeros(self.slots, bool)
            for key in decision.admitted:
                active[slot_of[key]] = True
        for key in decision.waiting:
            self.requests[slot_of[key]].rounds_waited += 1
        union = demand[active[:rows]].any(axis=0)
        info.verified, info.verify_tokens = int(active.sum()), decision.tokens
        info.expert_bytes = float(self.expert_bytes[union].sum())  # the union's bytes, whatever the scheduler priced
        info.how = {slot_of[k]: v for k, v in decision.how.items()}
        t_device = time.perf_counter()
        if not overlap:
            self.runner.verify(drafted, RoundPlan(active=active, live=tuple(live), demand=demand,
                                                  priced_bytes=decision.expert_bytes, logprobs=scored), info)
        after, done, output = self.runner.fetch()
        scores = None if scored is None else self.runner.round_logprobs()
        self._device_seconds = t_draft + time.perf_counter() - t_device
        for s in live:
            req = self.requests[s]
            if not active[s]:
                continue
            new = output[s, len(req.tokens): after[s]].tolist()
            req.acceptance.append(len(new))
            info.committed.append(len(new))
            self._observe_acceptance(req, width, len(new), bool(done[s]))
            self._record_logprobs(req, scores, s, len(new))
            self._emit(req, new, info)
            if done[s]:
                self._finish(req, self._reason(req), info)
        if shape_rows(width) < 2:  # the engine-wide estimate fades toward the prior in rounds that propose nothing
            self._fade_prior()
        self._compact()
        return bool(active.any())

    def _settle(self, info: RoundInfo) -> None:
        """Waits for what this step dispatched before its round (admissions, releases, moves, a flush), so that the
        round's device time, which prices its width (`learn_cost`), is the round's alone; they run before it either
        way (it reads their output). A step that dispatched none of them waits for nothing."""
        if (info.admitted or info.prefill_chunks or info.finished
                or (self.moves, self.context_flushes) != self._marks):
            self.runner.sync()

    def _bursts(self, logprobs: bool) -> bool:
        """Whether this step's rounds may run as one device call (`rounds_per_call`): a runner with bursts, every
        live row verifying every round (no budget), no log-probs asked (`logprobs` False), no chunked prefill
        running."""
        return (self.rounds_per_call != 1 and self.runner.bursts and not logprobs and self._unlimited()
                and self._prefilling is None)

    def _call_rounds(self, rows: int, width) -> int:
        """The rounds of a device call of `width` in the row bucket `rows`: `rounds_per_call`, or ("auto") as many
        as fit in `call_seconds` at the width's served round time (before it served: the table's price)."""
        if self.rounds_per_call != "auto":
            return self.rounds_per_call
        seconds = self._round_time.get((rows, width))
        if seconds is None:  # not served yet: the table's price (a round net of a call's host work, plus it)
            table = self.seconds_table(rows)
            if width not in table:
                return 1
            seconds = table[width] + self.call_overhead.get(rows, 0.0) / MAX_BURST
        # rounded to the nearest count (a round timed alone pays what a call of several spreads over its rounds)
        return max(1, min(MAX_BURST, int(self.call_seconds / max(seconds, 1e-6) + 0.5)))

    def _burst_count(self, rows: int, width, scored) -> int:
        """The rounds this step's device call runs (`rounds_per_call`; 1: a round of its own, the host looking at
        its draft, schedule and verify)."""
        if not self._bursts(scored is not None):
            return 1
        count = self._call_rounds(rows, width)
        if self._explored == width:  # a short call, priced net of the call's host work (`_round_seconds`): a width
            # that does not pay costs a few rounds, not a whole call; enough rounds to show the draft's acceptance
            return min(count, self._accept_rounds if self._accept_explore else self._explore_count(rows, width))
        return count

    def _explore_count(self, rows: int, width) -> int:
        """The rounds of a call exploring `width` in the row bucket `rows`: `EXPLORE_CALL_ROUNDS`, or more where the
        call's own work (`call_overhead`) would be more than 1 / `EXPLORE_CALL_SHARE` of the call at the width's table
        price. On a CPU a call's cut and write-back of its rows' caches cost 1 - 3 ms, 3 - 8 width-1 rounds; a
        3-round call of a cheap width was then mostly that work, and an error of 15% in it priced the width's rounds
        40% wrong."""
        price = self.seconds_table(rows).get(width)
        over = self.call_overhead.get(rows, 0.0)
        if not price or not over:
            return EXPLORE_CALL_ROUNDS
        return max(EXPLORE_CALL_ROUNDS, int(np.ceil((EXPLORE_CALL_SHARE - 1) * over / price)))

    def _burst_step(self, info: RoundInfo, live: list, rows: int, width, count: int) -> bool:
        """Up to `count` rounds of every live row at `width` in one device call (`RoundRunner.burst`), then one
        fetch and emission. The call ends early when every row is done, or, with requests waiting for a slot,
        when one finishes. A width-1 call holds the draft's context round by round (`defer_context`)."""
        active = np.zeros(self.slots, bool)
        active[live] = True
        proposer = self._proposer(width, width == 1 and self.defer_context)
        if width == 1 and self.defer_context:
            self._mark_skipping(live)
        t_device = time.perf_counter()
        burst = self.runner.burst(proposer, active, rows, count, until_finish=bool(self.queue))
        after, done, output = self.runner.fetch()
        self._device_seconds = time.perf_counter() - t_device
        ran = max(burst.rounds, 1)
        self._cut_short = burst.rounds < count and bool(np.any(done[live]))  # a row's finishing ended the call
        info.rounds, info.verified, info.burst, info.expert_bytes = ran, len(live), True, None
        info.verify_tokens = shape_rows(width) * int(np.count_nonzero(burst.committed[:, live]))
        self.burst_calls += 1
        self.burst_rounds += burst.rounds
        if width == 1 and self.defer_context:  # the call's rounds held the draft's context
            self.deferred_rounds += burst.rounds
        self.width_rounds[width] += ran - 1  # the step counted one
        self.rows_rounds[rows] += ran - 1
        narrow = shape_rows(width) < 2
        for s in live:
            req = self.requests[s]
            counts = [int(c) for c in burst.committed[:, s] if c > 0]
            req.acceptance.extend(counts)
            info.committed.extend(counts)
            if narrow:  # rounds that propose nothing: the request's evidence fades, once per round
                d = ACCEPTANCE_DECAY ** len(counts)
                req.accept_hits, req.accept_misses = d * req.accept_hits, d * req.accept_misses
            else:
                for i, c in enumerate(counts):
                    self._observe_acceptance(req, width, c, bool(done[s]) and i == len(counts) - 1)
            self._emit(req, output[s, len(req.tokens): after[s]].tolist(), info)
            if done[s]:
                self._finish(req, self._reason(req), info)
        if shape_rows(width) < 2:
            self._fade_prior(ran)
        self._compact()
        return True

    @property
    def long_run_acceptance(self) -> float:
        """What the draft accepted over the engine's drafting verifies (decayed by `LONG_RUN_DECAY` per verify, so
        the last few hundred count), with `acceptance_prior` as a prior of weight 2."""
        return (self._long_hits + 2.0 * self._prior) / (self._long_hits + self._long_misses + 2.0)

    def _fade_prior(self, rounds: int = 1) -> None:
        """The engine-wide acceptance estimate fades toward the long-run one over `rounds` rounds that propose
        nothing (their long-run figure unchanged, so at once): held at width 1, the engine keeps what its drafting
        rounds showed, not the constructor's prior alone."""
        d, prior = ACCEPTANCE_DECAY ** rounds, self.long_run_acceptance
        self._hits = d * self._hits + (1 - d) * 2.0 * prior
        self._misses = d * self._misses + (1 - d) * 2.0 * (1.0 - prior)

    # -- loops -----------------------------------------------------------------------------------------

    def run_until_idle(self, max_rounds: int | None = None) -> int:
        """Steps until no request is queued or live; returns the rounds run."""
        n = 0
        while self.queue or self.requests:
            self.step()
            n += 1
            if max_rounds is not None and n >= max_rounds:
                break
        return n

    def start(self) -> None:
        """Runs rounds on a background thread until `stop()` (sleeping while idle)."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self._later:
            self._open_later_loads()
        while True:
            with self._wake:
                while not self._stopping and not self.queue and not self.requests and not self._later:
                    self._wake.wait(0.5)
                if self._stopping and not self.requests and not self.queue:
                    self._close_later_loads()
                    return
                idle = not self.queue and not self.requests
            if idle:  # nothing to serve: a step of the warm-up left for later (`warmup(later_widths=True)`), once
                # nothing came for `IDLE_WARM_AFTER` (a closed-loop client's next request is not held by a step)
                quiet = time.perf_counter() - self._idle_since
                if quiet < IDLE_WARM_AFTER:
                    with self._wake:
                        if not self.queue and not self._stopping:
                            self._wake.wait(IDLE_WARM_AFTER - quiet)
                    continue
                self.warm_later()
                continue
            try:
                self.step()
            except Exception as e:  # a failed round fails its requests, never the server
                info = RoundInfo()
                with self._wake:
                    queued = list(self.queue)
                    self.queue.clear()
                waiting = [sample for r in queued + self._joining for sample in r.samples]
                failed = {id(r): r for r in list(self.requests.values()) + waiting}
                for r in failed.values():
                    if r.finish_reason is None:
                        r.error = f"{type(e).__name__}: {e}"
                        self._finish(r, "error", info)
                self.requests.clear()
                self._joining = []
                self._prefilling = None
                self.runner.drop()
            self._idle_since = time.perf_counter()

    def stop(self, *, cancel: bool = False, timeout: float | None = 30.0) -> None:
        """Graceful shutdown: no new requests; in-flight ones finish (or are cancelled with `cancel`)."""
        with self._wake:
            self._stopping = True
            if cancel:
                for r in list(self.queue) + list(self.requests.values()):
                    r.cancel_requested = True
            self._wake.notify_all()
        thread = self._thread  # stop may run on two threads at once (a signal's drain, the app's shutdown)
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():  # still busy: cancel what is left and wait for the round to end
                with self._wake:
                    for r in list(self.queue) + list(self.requests.values()):
                        r.cancel_requested = True
                    self._wake.notify_all()
                thread.join(timeout)
        with self._wake:
            if self._thread is thread and (thread is None or not thread.is_alive()):
                self._thread = None
                self._stopping = False  # stopped: the engine may be started (or stepped) again


def attach_cost_metrics(engine: Engine) -> int:
    """Adds the cost table's learning to the /metrics of every server observing `engine`
    (`serve.server.create_app` adds one): `dflash_width_explore_rounds_total{width}` and
    `dflash_width_explore_seconds_total` (the rounds run at an explored width, and their wall time),
    `dflash_width_switch_trials_total` (switches run as a short call first, `Engine.switch_trials`) and
    `dflash_cost_table_seconds{rows,width}` (the table the chooser prices widths with, as learned). Returns how
    many registries got them."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):
            rounds = CounterMetricFamily("dflash_width_explore_rounds",
                                         "Rounds run at a width other than the chosen one to re-measure its cost (a "
                                         "stale neighbour, an acceptance try, a switch's trial)", labels=["width"])
            for w in engine.widths:
                rounds.add_metric([width_label(w)], float(engine.explore_rounds.get(w, 0)))
            yield rounds
            yield CounterMetricFamily("dflash_width_explore_seconds", "Wall time of the explored rounds",
                                      value=float(engine.explore_seconds))
            yield CounterMetricFamily("dflash_width_switch_trials", "Switches to a drafting width its row bucket had "
                                      "not served lately, run as one short call first",
                                      value=float(engine.switch_trials))
            table = GaugeMetricFamily("dflash_cost_table_seconds", "The width chooser's round time by row bucket and "
                                      "width (measured at warm-up, then learned from served rounds)",
                                      labels=["rows", "width"])
            for rows in engine.row_buckets:
                for w, t in sorted(engine.seconds_table(rows).items(), key=lambda kv: shape_order(kv[0])):
                    table.add_metric([str(rows), width_label(w)], float(t))
            yield table

    n = 0
    for obs in list(engine.observers):
        registry = getattr(getattr(getattr(obs, "__self__", None), "metrics", None), "registry", None)
        if registry is not None and not getattr(registry, "_dflash_costs", False):
            registry.register(Collector())
            registry._dflash_costs = True
            n += 1
    return n


def generate(engine: Engine, prompts: Sequence[Sequence[int]], *, max_new_tokens, sampling=SamplingParams(),
             stop_ids=(), seed=0) -> list[Request]:
    """Submits every prompt and runs the engine until all are done (the synchronous form)."""
    n = len(prompts)
    budgets = rq.per_row(max_new_tokens, n, "max_new_tokens", lambda v: not rq.is_sequence(v))
    samplings = rq.per_row(sampling, n, "sampling", lambda v: isinstance(v, SamplingParams))
    seeds = rq.per_row(seed, n, "seed", lambda v: not rq.is_sequence(v))
    nested = bool(stop_ids) and all(rq.is_sequence(s) for s in stop_ids)
    stops = rq.per_row(list(stop_ids), n, "stop_ids", lambda v: not nested)
    reqs = [engine.submit(p, max_new_tokens=m, sampling=s, stop_ids=st, seed=sd)
            for p, m, s, st, sd in zip(prompts, budgets, samplings, stops, seeds)]
    engine.run_until_idle()
    return reqs
