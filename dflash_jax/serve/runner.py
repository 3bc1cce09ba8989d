"""The device side of the serving engine: a `RoundRunner` owns the batched state of the engine's slots and every
program that runs on it; the host `serve.engine.Engine` decides (who joins, which width, who verifies) and calls it.

What the engine calls, in host terms (numpy in, numpy out; device arrays stay opaque to it):

  reset(dummy)                     the state of `slots` free rows (one dummy row's prefill, every row done)
  prefill(batch) -> rows           one prefill of a `PrefillBatch` of k rows, outside the batched state
  first_tokens(rows)               their first tokens and done flags (host)
  insert(rows, index)              rows written into slots (an index past the last slot drops the row)
  fork(rows, src, key_data, fold)  `n` samples of one prompt: prefilled row src[i] copied into row i with its own
                                   key and its first token drawn again from the prefill's last logits
  first_logprobs(rows)             the target's log-probs of the last prefill's (or fork's) first tokens (host)
  round_logprobs()                 ... of the tokens the last verify committed, when its plan asked (host)
  prompt_logprobs(tokens)          ... of each prompt token given the ones before it (a target forward; host)
  release(free) / move_row(s, d)   rows marked done (a cancel); one row copied over another (compaction)
  prefill_start / _chunk / _finish a long prompt prefilled one chunk per round (`chunked_prefill` runners)
  pending_context()                each row's committed rows the draft has not seen (`deferred_context` runners)
  flush_context(rows, slots)       the first `rows` rows' pending context appended to the draft's cache (same);
                                   with `slots`, only those slots' (a gathered few: the cost follows them)
  catch_up(rows, tokens, back)     ... and then the context rows of positions whose width-1 rounds skipped them,
                                   from one target forward over their tokens (`catches_up` runners)
  draft(proposer, rows)            the proposal of the first `rows` rows -> `Drafted` (device, dispatched)
  demand(drafted)                  each computed row's projected experts [rows, L, E] (host)
  byte_costs(table)                the scheduler's per-(layer, expert) byte cost of a round
  verify(drafted, plan, info)      the verify of the rows `plan.active` selects; the others stay as they were
  fetch()                          (num_generated, done, output) of every row (host)
  burst(proposer, active, rows, n, until_finish)
                                   up to n rounds of one proposer in one device call, every row `active` selects
                                   verifying each round (`bursts` runners) -> `Burst` (host: per-round commits)
  begin_round / end_round          per-round bookkeeping around the engine's `step` (stats into its RoundInfo)
  warm_extra()                     what the runner compiles beyond the engine's warm-up rounds

Capability flags say what a runner's rounds can do; the engine reads them instead of asking what type it is:
`chunked_prefill`, `deferred_context`, `catches_up` (width-1 rounds may skip the draft's taps, caught up before the
row drafts again), `overlapped_verify` (the verify may be dispatched before the scheduler runs, when every live row
verifies), `bursts` (several rounds per device call, when every live row verifies and the host
needs to look only after them).

Runners here: `ResidentRunner` (the target's experts on the device; every round one jitted draft and one jitted
verify over the round's row bucket; optionally on a mesh) and `FakeRunner` (numpy only, no model: deterministic
tokens, for testing the host engine in seconds). `serve.offload_runner.OffloadedRunner` serves with the experts in
host memory behind a device cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import cache as cache_slots
from dflash_jax.cache import SLOT_AXIS, KVCache, holds_slots
from dflash_jax.models.family import family_of
from dflash_jax.nn.attention import follows_gpu_budget, get_attention_tuning, reads_in_place
from dflash_jax.spec import prefill as chunked
from dflash_jax.spec.round import (
    Chain, can_catch_up, catch_up_context, check_proposer, commit, flush_context, propose, round_spec, round_step,
    skips_context, verify_forward,
)
from dflash_jax.spec.sampling import next_token_rows
from dflash_jax.spec.session import (
    RowParams, SpecConfig, SpecState, init_target_cache, map_rows, prefill_rows, split_rows,
)
from dflash_jax.spec.tree import TreeShape, pad_cols, widen_for_tree
from dflash_jax.stored import stored_jit


def array_types(tree) -> tuple | None:
    """What jit's dispatch keys on in `tree`'s arrays: the tree's structure and each leaf's type, shape, dtype,
    weak type, sharding and whether it is committed (None for None)."""
    if tree is None:
        return None
    leaves, treedef = jax.tree.flatten(tree)
    return (str(treedef),) + tuple(
        (type(x).__name__, getattr(x, "shape", None), str(getattr(x, "dtype", None)), getattr(x, "weak_type", None),
         repr(getattr(x, "sharding", None)), getattr(x, "committed", None)) for x in leaves)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the host engine fixes for its runner: the compiled shapes and the proposers of its widths."""

    spec: SpecConfig
    slots: int
    row_buckets: tuple[int, ...]  # the row counts a round is computed for
    proposers: dict = dataclasses.field(hash=False)  # {verify width: proposer} the engine chooses from
    widest: int  # the widest verify (a tree may be wider than the block)
    # the draft's context rows each row's state holds (None: the block's): wider, width-1 rounds leave the draft's
    # context pending there, and the engine flushes it before a drafting round or when full (`flush_context`)
    context_rows: int | None = None

    @property
    def held(self) -> int:
        """The context columns of the state (`context_rows`, else the block)."""
        return self.spec.block_size if self.context_rows is None else int(self.context_rows)


@dataclasses.dataclass
class PrefillBatch:
    """Host inputs of one prefill of k rows: prompts right-padded to one bucket, each row's settings and key."""

    tokens: np.ndarray  # [k, P] int32
    lengths: np.ndarray  # [k] int32: real prompt tokens
    params: RowParams
    key_data: np.ndarray  # [k, ...] the PRNG key data of each row's seed
    key_fold: np.ndarray  # [k] int32
    real: int = 0  # rows that are requests (0: warm-up or the empty state's dummy rows)
    # [k, P] int32: the tokens' RoPE positions (an engine that compresses prompts, `pflash.Compressor`: a row's kept
    # tokens at their original positions, padding after the last); None: slot positions
    positions: np.ndarray | None = None


@dataclasses.dataclass
class Drafted:
    """One round's proposal between `draft` and `verify` (device arrays, dispatched)."""

    proposer: Any
    rows: int  # the rows computed (a row bucket)
    proposal: Any
    lengths: Any  # the draft cache's lengths after the draft
    demand: Any  # [rows, L, E] bool: each row's projected experts
    length: int | None = None  # the cache rows the round computes over (a length bucket; None: all of them)


@dataclasses.dataclass
class Burst:
    """What a burst of rounds did (`RoundRunner.burst`), on the host."""

    rounds: int  # the rounds it ran (at most the count asked; fewer once every row is done, or one finished)
    committed: np.ndarray  # [rounds, rows] int: the tokens each row committed in each round (0: done or left out)
    length: int | None = None  # the cache rows its rounds computed over (a length bucket; None: all of them)


@dataclasses.dataclass
class RoundPlan:
    """The host's decision for a round's verify, for a runner that acts on it (prefetch) or records it."""

    active: np.ndarray  # [slots] bool: the rows that verify
    live: tuple = ()  # the slots holding a live request
    demand: np.ndarray | None = None  # [rows, L, E] bool (None: the verify was dispatched before it was fetched)
    priced_bytes: float = 0.0  # the round's byte cost to the scheduler
    logprobs: np.ndarray | None = None  # [slots] bool: rows whose committed tokens' log-probs are computed


class RoundRunner:
    """The device programs of a serving engine and the state they run on (module docstring). A subclass sets
    `moe_layers` and `expert_bytes` ([L, E]: the bytes of one expert's tables per MoE layer) and implements the
    methods below; the flags say what its rounds can do."""

    chunked_prefill = False  # long prompts prefilled one chunk per round
    # the cache rows a round may compute over (`ResidentRunner`: each round the smallest holding its rows' live
    # lengths; None: the whole cache); the engine's warm-up compiles its rounds once per entry, each pinned in turn
    length_buckets: tuple = (None,)
    pin_length = None  # the length bucket every round takes while set (warm-up); None: chosen per round
    deferred_context = False  # width-1 rounds may leave the draft's context append to the next drafting round
    catches_up = False  # `catch_up`: width-1 rounds may skip the draft's context, caught up before drafting
    overlapped_verify = False  # the verify may be dispatched before the scheduler runs (every live row verifies)
    bursts = False  # `burst`: several rounds of every live row in one device call
    forks = False  # `fork`: n samples of one prompt share its prefill
    # rounds of greedy rows run the program without the sampling work (`SpecConfig.greedy_only`) while the engine sets
    # `greedy_rows` (every live row greedy); on a GPU that program has no conditional for the host to run
    greedy_rounds = False
    token_logprobs = False  # `first_logprobs` / `round_logprobs` (every proposer: a tree's committed path found again)
    prompt_scores = False  # `prompt_logprobs`
    mesh = None

    def __init__(self, pair, layout: Layout):
        self.pair, self.layout = pair, layout
        self.spec, self.slots = layout.spec, layout.slots
        self.state = None
        self.moe_layers: tuple = ()
        self.expert_bytes = np.zeros((0, 0))
        self._greedy_spec = dataclasses.replace(self.spec, greedy_only=True)
        self.greedy_rows = False

    @property
    def round_spec(self) -> SpecConfig:
        """The spec of a round's draft and verify (and of a call of several): the greedy rows' program
        (`SpecConfig.greedy_only`) while the engine says every live row is greedy (`greedy_rows`) and the runner's
        rounds run it (`greedy_rounds`), else `spec`. The engine sets `greedy_rows` before a round's draft and leaves
        it until the round's verify has run."""
        return self._greedy_spec if self.greedy_rows and self.greedy_rounds else self.spec

    @property
    def ready(self) -> bool:
        """Whether the batched state exists (`reset` makes it)."""
        return self.state is not None

    def drop(self) -> None:
        """Forgets the state (after a failed round); the next `reset` makes a fresh one."""
        self.state = None

    def carried(self):
        """Every array this runner's programs take from one call of it to the next (a pytree), so that the warm-up
        can tell whether its second pass would meet a type its first did not (`Engine.warmup`); None where that is
        not known (the warm-up then always runs its second pass)."""
        return None

    @property
    def cache_bytes(self) -> int | None:
        """Device bytes of the runner's expert cache (None: no cache, the experts are resident)."""
        return None

    default_byte_budget = None  # the scheduler's per-round byte budget when the engine is given none

    def reset(self, dummy: PrefillBatch) -> None:
        raise NotImplementedError

    def prefill(self, batch: PrefillBatch):
        raise NotImplementedError

    def first_tokens(self, rows) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def insert(self, rows, index: np.ndarray) -> None:
        raise NotImplementedError

    def release(self, free: np.ndarray) -> None:
        raise NotImplementedError

    def move_row(self, src: int, dst: int) -> None:
        raise NotImplementedError

    def prefill_start(self, tokens: np.ndarray, valid: np.ndarray, positions: np.ndarray | None = None):
        raise NotImplementedError(f"{type(self).__name__} prefills whole prompts (chunked_prefill is off)")

    def prefill_chunk(self, pre, tokens: np.ndarray, valid: np.ndarray, wait: bool = True,
                      positions: np.ndarray | None = None):
        raise NotImplementedError(f"{type(self).__name__} prefills whole prompts (chunked_prefill is off)")

    def prefill_copy(self, pre):
        """An independent copy of a partial prefill (the prefix cache's snapshot, and a restored one: every chunk
        donates the prefill it extends). Device arrays are copied; other leaves are immutable."""
        return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, pre)

    def prefill_snapshot(self, pre, length: int):
        """The prefix cache's copy of a partial prefill of `length` prompt tokens (default: `prefill_copy`; a runner
        may keep only the live rows, `snapshot_rows`)."""
        return self.prefill_copy(pre)

    def prefill_restore(self, snapshot):
        """A partial prefill to continue from a snapshot (the snapshot stays intact: the next chunk donates it)."""
        return self.prefill_copy(snapshot)

    def snapshot_rows(self, length: int) -> int:
        """The cache rows a snapshot of `length` prompt tokens keeps (a compiled shape per distinct value)."""
        return self.spec.max_len

    @staticmethod
    def prefill_nbytes(pre) -> int:
        """Bytes a partial prefill holds on the device (its leaves; 8 for a host scalar)."""
        return int(sum(getattr(x, "nbytes", 8) for x in jax.tree.leaves(pre)))

    def prefill_finish(self, pre, batch: PrefillBatch):
        raise NotImplementedError(f"{type(self).__name__} prefills whole prompts (chunked_prefill is off)")

    def pending_context(self) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} does not defer the draft's context")

    def flush_context(self, rows: int, slots: Sequence[int] | None = None) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not defer the draft's context")

    def catch_up(self, rows: int, tokens: np.ndarray, back: np.ndarray) -> None:
        """`spec.round.catch_up_context` of the first `rows` rows: their pending context appended, then the context
        rows of each slot's `min(back, CATCH_UP_CHUNK)` positions from `back` [slots] before its cache's end, whose
        tokens are `tokens` [slots, CATCH_UP_CHUNK] (zeros past the count)."""
        raise NotImplementedError(f"{type(self).__name__} does not catch up skipped context")

    def draft(self, proposer, rows: int) -> Drafted:
        raise NotImplementedError

    def demand(self, drafted: Drafted) -> np.ndarray:
        return np.asarray(drafted.demand)

    def byte_costs(self, table: np.ndarray) -> np.ndarray:
        """The scheduler's byte cost of each (MoE layer, expert) this round (default: its bytes)."""
        return table

    def verify(self, drafted: Drafted, plan: RoundPlan, info=None) -> None:
        raise NotImplementedError

    def fetch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError

    def sync(self) -> None:
        """Waits until every dispatched program has run (timing)."""

    def burst(self, proposer, active: np.ndarray, rows: int, count: int, until_finish: bool = False) -> Burst:
        """Up to `count` rounds (at most `MAX_BURST`) of `proposer` in one device call: every row where `active` is set
        drafts and verifies each round until it is done; the other rows keep their state. Stops early once every
        active row is done, or (`until_finish`) once one of them finished. A round of it is the round `draft` +
        `verify` run with the same proposer and every active row verifying: the same tokens."""
        raise NotImplementedError(f"{type(self).__name__} runs one round per call (bursts is off)")

    def warm_burst(self, proposer, rows: int, rounds: int = 1) -> None:
        """Runs the `burst` program of `proposer` over the first `rows` rows once with `rounds` rounds in it, every row
        idle (nothing changes), and waits for it: warm-up, so that serving finds it compiled and run, and the cost
        table's timing of rounds as they are served (`Engine.measure_rounds`). A runner without `bursts`: nothing."""

    def round(self, proposer, active: np.ndarray, rows: int, logprobs: np.ndarray | None = None) -> None:
        """One round of the rows where `active` is set, for warm-up and cost measurement: draft, the host fetch
        of the demand, verify (and the log-probs of the rows `logprobs` selects)."""
        drafted = self.draft(proposer, rows)
        self.verify(drafted, RoundPlan(active=active, demand=self.demand(drafted), logprobs=logprobs))

    def begin_round(self, info) -> None:
        """Before the engine's admissions of a round (`info`: its RoundInfo)."""

    def end_round(self, info, verified: bool) -> None:
        """After the round's emission (`verified`: some row verified)."""

    def warm_extra(self) -> None:
        """Compiles what the engine's warm-up rounds (no row verifying) leave out."""

    def fork(self, rows, src: np.ndarray, key_data: np.ndarray, key_fold: np.ndarray):
        raise NotImplementedError(f"{type(self).__name__} does not fork prefilled rows (n > 1)")

    def first_logprobs(self, rows) -> "TokenLogprobs":
        raise NotImplementedError(f"{type(self).__name__} computes no log-probabilities")

    def round_logprobs(self) -> "TokenLogprobs | None":
        return None

    def prompt_logprobs(self, tokens: np.ndarray) -> "TokenLogprobs":
        raise NotImplementedError(f"{type(self).__name__} computes no prompt log-probabilities")


# ----------------------------------------------------------------------------------------------------------
# log-probabilities (the server's `logprobs`, `top_logprobs` and `echo`) and `n` samples of one prompt
# ----------------------------------------------------------------------------------------------------------

TOP_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's bound for chat)


@dataclasses.dataclass
class TokenLogprobs:
    """Host arrays: the target's log-probability of each token (log-softmax of its logits at temperature 1, before
    any sampling setting: what OpenAI reports) and the `TOP_LOGPROBS` most likely tokens at that position."""

    logprob: np.ndarray  # [...] fp32
    top_logprob: np.ndarray  # [..., K] fp32, descending
    top_id: np.ndarray  # [..., K] int32

    @staticmethod
    def of(arrays) -> "TokenLogprobs":
        lp, top_lp, top_id = jax.device_get(arrays)
        return TokenLogprobs(np.asarray(lp, np.float32), np.asarray(top_lp, np.float32), np.asarray(top_id, np.int32))


def log_softmax_top(logits, tokens, k: int):
    """(log p(tokens) [...], the top-k log-probs [..., k], their ids [..., k]) of logits [..., V] in fp32."""
    lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(lsm, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top_lp, top_id = jax.lax.top_k(lsm, k)
    return lp, top_lp, top_id.astype(jnp.int32)


_first_logprobs = stored_jit(log_softmax_top, static_argnames=("k",))


@stored_jit(static_argnames=("k",))
def committed_logprobs(logits, output, start, k: int):
    """The log-probs of a chain verify's committed tokens: `logits` [rows, W, V] of the verify block, `output`
    [>= rows, N] after the commit, `start` [>= rows] each row's tokens before it. Block row j's logits score the j-th
    token the round committed, `output[start + j]` (entries past the committed ones are scratch)."""
    rows, w = logits.shape[:2]
    pos = jnp.minimum(start[:rows, None] + jnp.arange(w)[None], output.shape[1] - 1)
    tokens = jnp.maximum(jnp.take_along_axis(output[:rows], pos, axis=1), 0)
    return log_softmax_top(logits, tokens, k)


def tree_path_logits(logits, tree, tokens):
    """[b, D+1, V]: the tree verify's logits at the committed path's node of each depth. `logits` [b, N, V] of the
    tree's nodes, `tree` its `spec.tree.Tree`, `tokens` [b, D+1] the tokens the round committed (entries past them:
    ids no node carries, e.g. -1). Siblings carry distinct tokens, so the path is the chain of nodes whose tokens are
    the committed ones, depth by depth, as the acceptance walked it (`spec.tree.accept_tree`); the logits of its node
    at depth j score committed token j (the proposal at depth j + 1, or the bonus)."""
    depth = tree.depth
    parent_depth = jnp.maximum(depth - 1, 0)
    want = jnp.take_along_axis(tokens, jnp.minimum(parent_depth, tokens.shape[1] - 1), axis=1)
    match = ((tree.tokens == want) & tree.valid).at[:, 0].set(True)
    reached = jnp.all(~tree.mask | match[:, None, :], axis=-1)  # [b, N]: every node on its path matches
    levels = jnp.arange(tokens.shape[1])
    sel = reached[:, None, :] & (depth[:, None, :] == levels[None, :, None])  # [b, D+1, N]
    path = jnp.argmax(sel, axis=-1)  # past the committed depth: node 0 (scratch)
    return jnp.take_along_axis(logits, path[..., None], axis=1)


@stored_jit(static_argnames=("k",))
def tree_committed_logprobs(logits, tree, output, start, k: int):
    """`committed_logprobs` of a tree verify: the log-probs of the tokens the round committed, each scored by the
    logits of its parent node on the committed path (`tree_path_logits`)."""
    rows, n = logits.shape[:2]
    pos = start[:rows, None] + jnp.arange(n)[None]  # a node's depth is below N: at most N committed tokens
    tokens = jnp.where(pos < output.shape[1], jnp.take_along_axis(output[:rows], jnp.minimum(pos, output.shape[1] - 1),
                                                                  axis=1), -1)
    path_logits = tree_path_logits(logits, tree, tokens)
    return log_softmax_top(path_logits, jnp.maximum(tokens, 0), k)


@stored_jit(static_argnames=("spec", "k"))
def prompt_logprobs_of(target_w, tokens, spec: SpecConfig, k: int):
    """The log-prob of each prompt token after the first given the ones before it (one target forward over
    `tokens` [1, P], right-padded: padding never changes the rows before it), and the top-k at each position."""
    cache = init_target_cache(spec.target, tokens.shape[0], spec.max_len, target_w.embed.dtype,
                              verify_width=spec.block_size)
    out = family_of(spec.target).forward(target_w, tokens, cache, spec.target, logits="all")
    return log_softmax_top(out.logits[:, :-1], tokens[:, 1:], k)


@stored_jit
def fork_rows(rows: SpecState, logits, src, key_data, key_fold):
    """Row i of the result is prefilled row `src[i]` with its own key (`fold_in(key_data[i], key_fold[i])`, as a
    prefill keys a row) and its first token drawn again from that row's prefill logits: exactly the row a prefill
    of the same prompt with that key makes, at the cost of a gather. Returns (rows, their logits)."""
    state = map_rows(lambda x: x[src], rows)
    logits = logits[src]
    keys = jax.vmap(lambda d, f: jax.random.fold_in(jax.random.wrap_key_data(d), f))(key_data, key_fold)
    key, k_first = split_rows(keys)
    first = next_token_rows(k_first, logits, state.params.sampling)
    stopped = jnp.any(first[:, None] == state.params.stop_ids, axis=-1) | (state.params.budget <= 1)
    return state.replace(key=key, anchor=first, output=state.output.at[:, 0].set(first), done=stopped), logits


# ----------------------------------------------------------------------------------------------------------
# the resident runner's programs (each compiled once per engine shape; the prefill once per prompt bucket)
# ----------------------------------------------------------------------------------------------------------

@stored_jit(donate_argnames=("state",))
def _insert_rows(state: SpecState, rows: SpecState, slots) -> SpecState:
    """Writes row i of the k-row state `rows` into row `slots[i]` (traced [k] int32) of the batched state;
    a slot index past the last slot drops the row (the padding rows of a prefill group). Each cache's K/V buffers
    take only the slots the rows fill (`cache.put_rows`, up to their longest length): the rest of a slot's row is
    scratch, and a prompt of 64 tokens in a 4096-slot cache copies 64 slots of each buffer, not 4096. Likewise the
    draft's context rows (`context`, fewer columns than the state's hold where a prefill held its prompt's) fill the
    leading columns of the slot's: a row's columns past its pending count are never read."""
    def put(big, small):
        return big.at[slots].set(small.astype(big.dtype), mode="drop")

    def node(big, small):
        if not holds_slots(big):
            return map_rows(put, big, small)
        rest = map_rows(put, big.replace(keys=(), values=()), small.replace(keys=(), values=()))
        count = jnp.max(small.lengths)
        return rest.replace(keys=tuple(cache_slots.put_rows(b, s, slots, count) for b, s in zip(big.keys, small.keys)),
                            values=tuple(cache_slots.put_rows(b, s, slots, count)
                                         for b, s in zip(big.values, small.values)))

    held, width = state.context, rows.context.shape[1]
    narrow = width < held.shape[1]
    if narrow:  # a held prompt's rows: the leading columns of the slot's hold
        held = held.at[slots, :width].set(rows.context.astype(held.dtype), mode="drop")
        state, rows = state.replace(context=held[:, :0]), rows.replace(context=rows.context[:, :0])
    new = jax.tree.map(node, state, rows, is_leaf=holds_slots)
    return new.replace(context=held) if narrow else new


@stored_jit(donate_argnames=("state",))
def _move_row(state: SpecState, src, dst) -> SpecState:
    """Copies row `src` (traced int32) of the batched state over row `dst`, every leaf, the KV buffers up to the
    row's length (`cache.copy_row`): the compaction that keeps live requests within the smallest row bucket. In
    place (the state is donated)."""
    def move(x):
        return x.at[dst].set(x[src])

    def node(n):
        if not holds_slots(n):
            return map_rows(move, n)
        rest = map_rows(move, n.replace(keys=(), values=()))
        count = n.lengths[src]
        return rest.replace(keys=tuple(cache_slots.copy_row(b, src, dst, count) for b in n.keys),
                            values=tuple(cache_slots.copy_row(b, src, dst, count) for b in n.values))

    return jax.tree.map(node, state, is_leaf=holds_slots)


@stored_jit(static_argnames=("spec", "hold", "cache_len"))
def _prefill_rows(target_w, draft_w, tokens, lengths, params, key_data, key_fold, spec: SpecConfig, positions=None,
                  hold: int | None = None, cache_len: int | None = None):
    """`session.prefill_rows`: the prefilled rows and their last logits in fp32 (lossless; what sampling reads); with
    `hold`, the prompt's draft context held pending (`session.start_state`); caches of `cache_len` slots."""
    state, logits = prefill_rows(target_w, draft_w, tokens, lengths, params, key_data, key_fold, spec, positions,
                                 hold, cache_len)
    return state, logits.astype(jnp.float32)


def prefill_slots(max_len: int, prompt: int) -> int:
    """The slots of a prefill's caches for a prompt bucket of `prompt` tokens whose rows are copied into a state of
    `max_len`-slot caches up to their lengths (`_insert_rows`): the smallest of `length_buckets(max_len, prompt)`
    holding the prompt. Those are whole chunks of the chunked attention that take the path the whole cache takes
    (or the whole cache where it takes the dense path), so every key and logit is the whole cache's, bit for bit;
    the CPU kernel reads each row's live keys wherever they lie. A 64-token prompt of a 4096-slot engine prefills
    into 768 slots, not 4096 (the zeros of an empty cache cost about a millisecond a row there)."""
    return next((b for b in length_buckets(max_len, prompt) if b >= prompt), max_len)


def head_rows(tree, rows: int, length: int | None = None, in_place: bool = False):
    """The first `rows` rows of every leaf (a static slice; the identity when that is all of them). length: also
    every KV cache buffer (a `KVCache`'s keys and values) cut to its first `length` slots (`cut_slots`). in_place:
    every cache's K/V buffers (`cache.holds_slots`) left whole instead, all rows and slots (attention that reads
    each row's keys where they lie, `nn.attention.reads_in_place`): nothing copied in, nothing written back."""
    def first(x):
        return x if x.shape[0] == rows else x[:rows]

    def node(n):
        if not holds_slots(n):
            return map_rows(first, n)
        rest = map_rows(first, n.replace(keys=(), values=()))
        if in_place:
            return rest.replace(keys=n.keys, values=n.values)
        keys, values = map_rows(first, (n.keys, n.values))
        if length is not None and isinstance(n, KVCache):
            keys, values = cut_slots(keys, length), cut_slots(values, length)
        return rest.replace(keys=keys, values=values)

    return jax.tree.map(node, tree, is_leaf=holds_slots)


def cut_slots(buffers, length: int | None):
    """KV buffers (any tree of them, `cache.kv_shape`) cut to their first `length` slots (None, or S <= length: as they
    are). A round whose rows' live lengths (and the block it writes) fit in `length` slots computes the same over the
    cut buffers: slots past a row's length are never read, and the chunked attention reads the same chunks of a cut
    holding whole chunks (`ResidentRunner.length_buckets`)."""
    if length is None:
        return buffers
    return jax.tree.map(lambda x: x if x.shape[SLOT_AXIS] <= length else cache_slots.cut_slots(x, length), buffers)


def put_head_rows(full, head):
    """`full` with its leading block replaced by `head` (its first rows, and for KV buffers cut by `head_rows` their
    first slots): a dynamic-update-slice, in place when `full` is donated."""
    def put(f, h):
        if f.shape == h.shape:
            return h.astype(f.dtype)
        return jax.lax.dynamic_update_slice(f, h.astype(f.dtype), (0,) * f.ndim)
    return map_rows(put, full, head)


@stored_jit(donate_argnames=("state",))
def release_rows(state: SpecState, free) -> SpecState:
    """Marks the rows where `free` [b] bool is set as done (a cancelled request stops at once)."""
    return state.replace(done=state.done | free)


def _project_experts(routers, hidden, cfg):
    """bool [b, L, E]: the experts each row's block is projected to route to, per MoE layer (the family's routing,
    `route_rows`, of `hidden` [b, W, H] by each MoE layer's router `routers`, stacked over L; each row's top-k)."""
    fam = family_of(cfg)
    b, w, h = hidden.shape
    flat = hidden.reshape(b * w, h)
    experts = jax.vmap(lambda router: fam.route_rows(router, flat, cfg).experts)(routers)  # [L, b*W, k]
    onehot = jax.nn.one_hot(experts, cfg.moe.num_experts, dtype=jnp.bool_).any(axis=2)  # [L, b*W, E]
    return onehot.reshape(onehot.shape[0], b, w, cfg.moe.num_experts).any(axis=2).transpose(1, 0, 2)


def keep_rows(active, new: SpecState, old: SpecState) -> SpecState:
    """Row `i` of `new` where `active[i]`, else row `i` of `old`. KV buffers are the exception (`cache.holds_slots`:
    a `KVCache`, a hybrid target's cache): a row's slots at or past its length are scratch (never read; `cache`
    module invariant), and a verify writes only there, so the buffers are taken from `new` as they are (whole ones
    too: `head_rows`'s in_place) and only the rest (lengths, a DeltaNet's states) is selected. That saves a select
    over every cache buffer per round (and the copy XLA makes to keep the old buffers alive for it)."""
    def sel(n, o):
        mask = active.reshape(active.shape + (1,) * (n.ndim - 1))
        return jnp.where(mask, n, o)

    def node(n, o):
        if holds_slots(n):
            rest = map_rows(sel, n.replace(keys=(), values=()), o.replace(keys=(), values=()))
            return rest.replace(keys=n.keys, values=n.values)
        return map_rows(sel, n, o)

    return jax.tree.map(node, new, old, is_leaf=holds_slots)


@stored_jit(static_argnames=("spec", "proposer", "rows", "length", "in_place"),
                   donate_argnames=("draft_buffers",))
def _draft(target_w, draft_w, state: SpecState, draft_buffers, routers, spec: SpecConfig, proposer,
           rows: int | None = None, length: int | None = None, in_place: bool = False):
    """The proposal of `proposer` (`spec.round.propose`: a chain of any width up to the state's block
    `spec.block_size`, or a tree) and each row's projected expert set (every MoE layer's router on the draft's
    hidden states of the verified rows; the anchor's embedding when nothing is drafted).

    The draft cache's K/V buffers come apart from the state (`state.draft_cache` has none) and are donated:
    appending the context rows writes them in place instead of copying every buffer each round. Returns
    (the proposal without its cache, the cache's new buffers, its new lengths, the demand).

    rows: compute only the first `rows` rows of the state (a row bucket >= the live rows, which the engine keeps
    within the smallest bucket); the proposal, the lengths and the demand have `rows` rows, the buffers all of them (the
    first `rows` written in place).

    length: the draft cache's buffers cut to their first `length` slots for the draft (a length bucket holding every
    computed row's context and the rows the draft writes; `cut_slots`), written back in place: a round then copies
    the live slots, not the whole cache.

    in_place: the buffers whole instead (`head_rows`), the draft's attention reading its rows in place."""
    full_buffers = draft_buffers
    if rows is not None or length is not None:
        rows = state.done.shape[0] if rows is None else rows
        state = head_rows(state, rows)
        if draft_buffers is not None and not in_place:
            draft_buffers = cut_slots(head_rows(draft_buffers, rows), length)
    if draft_buffers is not None:
        state = state.replace(draft_cache=state.draft_cache.replace(keys=draft_buffers[0], values=draft_buffers[1]))
    proposal = propose(proposer, target_w, draft_w, state, spec)
    hidden = proposal.hidden if proposal.hidden is not None else target_w.embed[state.anchor][:, None]
    demand = _project_experts(routers, hidden, spec.target)
    cache = proposal.draft_cache
    proposal = proposal.replace(draft_cache=None, hidden=None)
    if cache is None:
        return proposal, None, None, demand
    buffers = (cache.keys, cache.values)
    if rows is not None:
        buffers = put_head_rows(full_buffers, buffers)
    return proposal, buffers, cache.lengths, demand


def verify_rows(state: SpecState, proposal, draft_lengths, active, rows: int | None, length: int | None = None,
                in_place: bool = False):
    """The state a round verifies: its first `rows` rows (and with `length`, its KV buffers' first `length` slots;
    with `in_place`, its KV buffers whole: `head_rows`),
    the draft cache holding the buffers `_draft` wrote and the lengths after it, and every row where `active` [b] is
    unset counted done (nothing committed). Returns (the run state, the proposal with its cache, active cut to the
    rows)."""
    if rows is not None or length is not None:
        rows = state.done.shape[0] if rows is None else rows
        state, active = head_rows(state, rows, length, in_place), active[:rows]
    if state.draft_cache is not None:
        proposal = proposal.replace(draft_cache=state.draft_cache.replace(lengths=draft_lengths))
    return state.replace(done=state.done | ~active), proposal, active


def settle_rows(full: SpecState, old: SpecState, new: SpecState, active, rows: int | None) -> SpecState:
    """The round's new rows where `active`, the old ones elsewhere (`keep_rows`), written back into the full state's
    first `rows` rows."""
    new = new.replace(done=jnp.where(active, new.done, old.done))
    new = keep_rows(active, new, old)
    return new if rows is None else put_head_rows(full, new)


def _deferring(proposer, spec: SpecConfig) -> bool:
    """Whether `proposer`'s rounds leave the draft's context alone (a width-1 chain that defers or skips it)."""
    return isinstance(proposer, Chain) and proposer.leaves_context and bool(spec.taps)


def lift_context(state: SpecState, proposer, spec: SpecConfig, rounds: int, rows: int | None = None):
    """A round's state with the held context rows lifted out (`Layout.context_rows`, wider than the block), so the
    rows a round cuts, keeps and writes back carry a few columns of it, not the whole hold: a deferring width-1
    round gets `rounds` empty columns to write its own rows into (a call's rounds; for its first `rows` rows only,
    the rows it computes: `lower_context` writes back only theirs), a drafting round the block's columns (it appends
    every pending row: at most a block). Returns (that state, what `lower_context` puts back; None when the state
    holds only the block's columns)."""
    held, pending = state.context, state.num_context
    if held.shape[1] <= spec.block_size:
        return state, None
    if skips_context(proposer):  # no context rows at all: the hold stays out of the round
        return state.replace(context=held[:, :0]), (held, pending, None)
    if _deferring(proposer, spec):
        narrow = jnp.zeros((held.shape[0] if rows is None else rows, rounds, held.shape[2]), held.dtype)
        return state.replace(context=narrow, num_context=jnp.zeros_like(pending)), (held, pending, True)
    return state.replace(context=held[:, : spec.block_size]), (held, pending, False)


def lower_context(state: SpecState, lifted) -> SpecState:
    """The held context back into the state after the round (`lift_context`): a deferring round's new rows written
    after each row's pending ones (its count added to theirs), a drafting round's next rows into the first columns
    (in place in the hold: the state is donated)."""
    if lifted is None:
        return state
    held, pending, deferring = lifted
    if deferring is None:  # a skipping round: nothing written, nothing added
        return state.replace(context=held, num_context=pending)
    if deferring:  # the narrow columns' rows: all of them, or the first rows a round computed
        b, width = state.context.shape[:2]
        cols = pending[:b, None] + jnp.arange(width, dtype=pending.dtype)[None]
        held = held.at[jnp.arange(b)[:, None], cols].set(state.context, mode="drop")
        return state.replace(context=held, num_context=pending + state.num_context)
    return state.replace(context=jax.lax.dynamic_update_slice_in_dim(held, state.context, 0, axis=1))


@stored_jit(static_argnames=("spec", "proposer", "rows", "length", "in_place"), donate_argnames=("state",))
def _verify(target_w, state: SpecState, proposal, draft_lengths, active, spec: SpecConfig, proposer,
            rows: int | None = None, length: int | None = None, in_place: bool = False) -> SpecState:
    """The verify of `proposal` for the rows where `active` [b] is set (`spec.round.verify_forward` + `commit`);
    every other row keeps its old state (`keep_rows`). The state keeps the layout of its block `spec.block_size`.
    `state.draft_cache` holds the buffers `_draft` wrote and the lengths before it; `draft_lengths` are the
    lengths after it.

    rows: only the first `rows` rows are computed (the proposal has `rows` rows); the others are returned as they
    were, and the first `rows` are written back in place (the state is donated). Returns (the state, the verify's
    logits [rows, W, V]: read only when a request asked for log-probs).

    length: every KV buffer cut to its first `length` slots for the round (a length bucket holding every computed
    row's cache and the block the verify writes; `cut_slots`) and written back in place, so a round's copies follow
    the live lengths, not the cache's capacity; the same result (`ResidentRunner.length_buckets`).

    in_place: every KV buffer whole instead, read and written in place (`head_rows`; `ResidentRunner.in_place`)."""
    if length is not None and rows is None:
        rows = state.done.shape[0]
    state, lifted = lift_context(state, proposer, spec, 1, rows)
    old = head_rows(state, rows, None, in_place) if rows is not None else state
    run, proposal, active = verify_rows(state, proposal, draft_lengths, active, rows, length, in_place)
    out = verify_forward(target_w, run, proposal, round_spec(proposer, spec))
    new, _ = commit(run, proposal, out, spec, proposer)
    return lower_context(settle_rows(state, old, new, active, rows), lifted), out.logits


MAX_BURST = 64  # the most rounds one burst runs (`RoundRunner.burst`)


def burst_rounds(target_w, draft_w, state: SpecState, active, count, until_finish, spec: SpecConfig, proposer,
                 rows: int | None = None, length: int | None = None, min_rounds=0, in_place: bool = False):
    """The program of a serving call of several rounds (`ResidentRunner.burst` runs it jitted and stored, `_burst`;
    unjitted here for compiling elsewhere, e.g. for a GPU without one: `tests/gpu_compile`). Up to `count` rounds (`spec.round.round_step`) of the rows where `active` [b] is set, in one `while_loop`,
    the others kept as they were (`settle_rows`). Cut to the first `rows` rows and every KV buffer to its first
    `length` slots once for the whole burst, written back once (`_verify`'s `rows` and `length`); with `in_place`
    the KV buffers stay whole in the loop, read and written where they lie (`_verify`'s `in_place`).

    A deferring width-1 chain (`Chain(1, defer_context=True)`) defers every round: each round's context row joins
    the row's pending ones (held context rows, `Layout.context_rows`: the engine leaves room for the call's rounds,
    flushing first when a row's would not fit, `flush_context`). The rounds never read the draft's cache, and write
    their rows into `MAX_BURST` columns of their own (`lift_context`), so neither the draft's cache nor the hold is in
    the loop or the cut rows' copies: such a call costs what a block-1 engine's does.

    Stops after `count` rounds, once every active row is done, or with `until_finish` once one of them finished;
    runs at least `min_rounds` (traced) rounds even so (warm-up: rounds of rows that are all idle change nothing, and
    a program's loop runs once before serving: XLA:CPU sets up a program's kernels on their first run, 20 - 70 ms).
    Returns (the state, the tokens each row committed in each round [MAX_BURST, rows] int32, the rounds run)."""
    rows = state.done.shape[0] if rows is None else rows
    deferring = _deferring(proposer, spec)
    if deferring:  # the rounds never read the draft's cache: it stays out of the loop (and out of the cut rows' copies)
        draft_cache = state.draft_cache
        state = state.replace(draft_cache=None)
    state, lifted = lift_context(state, proposer, spec, MAX_BURST, rows)
    old = head_rows(state, rows, None, in_place)
    run = head_rows(state, rows, length, in_place)
    active = active[:rows]
    run = run.replace(done=run.done | ~active)
    done_before = run.done

    def one(s, p):
        return round_step(target_w, draft_w, s, spec, p)[0]

    def step(s):
        return one(s, proposer)

    def body(carry):
        i, s, committed = carry
        new = step(s)
        return i + 1, new, committed.at[i].set(new.num_generated - s.num_generated)

    def cond(carry):
        i, s, _ = carry
        finished = jnp.any(s.done & ~done_before)
        return ((i < count) & jnp.any(~s.done) & ~(until_finish & finished)) | (i < min_rounds)

    ran, new, committed = jax.lax.while_loop(cond, body, (jnp.int32(0), run, jnp.zeros((MAX_BURST, rows), jnp.int32)))
    state = lower_context(settle_rows(state, old, new, active, rows), lifted)
    if deferring:
        state = state.replace(draft_cache=draft_cache)
    return state, committed, ran


_burst = stored_jit(burst_rounds, static_argnames=("spec", "proposer", "rows", "length", "in_place"),
                    donate_argnames=("state",))

FLUSH_CHUNK = 64  # the context columns one step of a flush appends (`flush_context`'s chunk)


@stored_jit(static_argnames=("spec", "rows", "chunk"), donate_argnames=("state",))
def _flush(draft_w, state: SpecState, spec: SpecConfig, rows: int, chunk: int):
    """`spec.round.flush_context` of the first `rows` rows, `chunk` columns a step (the state's context width kept)."""
    return flush_context(draft_w, state, spec, rows=rows, chunk=chunk)


FLUSH_GROUPS = (1, 2, 4, 8, 16)  # the slots a gathered flush appends at once (`ResidentRunner.flush_context`'s `slots`)


@stored_jit(static_argnames=("spec", "chunk"), donate_argnames=("state",))
def _flush_slots(draft_w, state: SpecState, index, spec: SpecConfig, chunk: int):
    """`spec.round.flush_context` of the slots `index` [g] only (gathered; an index past the slots: padding),
    `chunk` columns a step."""
    return flush_context(draft_w, state, spec, chunk=chunk, index=index)


CATCH_UP_CHUNK = 32  # the skipped positions one catch-up forward computes per row (`RoundRunner.catch_up`)


@stored_jit(static_argnames=("spec", "rows", "chunk"), donate_argnames=("state",))
def _catch_up(target_w, draft_w, state: SpecState, tokens, back, spec: SpecConfig, rows: int, chunk: int):
    """`spec.round.catch_up_context` of the first `rows` rows (`tokens` [rows, CATCH_UP_CHUNK], `back` [rows])."""
    return catch_up_context(target_w, draft_w, state, tokens, back, spec, rows=rows, chunk=chunk)


def kv_buffers(pre) -> tuple:
    """((target keys, target values), (draft keys, draft values) or None) of a partial prefill (`spec.prefill.Prefill`):
    the per-layer [b, rows, heads, dim] buffers of its caches (slot = position)."""
    tc, dc = pre.target_cache, pre.draft_cache
    return (tc.keys, tc.values), (None if dc is None else (dc.keys, dc.values))


def with_kv_buffers(pre, buffers):
    """`pre` with its caches' KV buffers replaced (`kv_buffers`' form; None: emptied, for copying the rest)."""
    (tk, tv), draft = buffers if buffers is not None else (((), ()), ((), ()))
    out = pre.replace(target_cache=pre.target_cache.replace(keys=tk, values=tv))
    if pre.draft_cache is not None:
        dk, dv = draft
        out = out.replace(draft_cache=pre.draft_cache.replace(keys=dk, values=dv))
    return out


@functools.partial(jax.jit, static_argnames=("rows",))
def _cut_rows(buffers, rows: int):
    return jax.tree.map(lambda x: cache_slots.cut_slots(x, rows), buffers)


@functools.partial(jax.jit, static_argnames=("rows",))
def _grow_rows(buffers, rows: int):
    return jax.tree.map(lambda x: cache_slots.grow_slots(x, rows), buffers)


@stored_jit(static_argnames=("slots", "max_len"))
def _broadcast_rows(row: SpecState, slots: int, max_len: int) -> SpecState:
    """`slots` copies of a one-row state, every row done (free), each cache's K/V buffers `max_len` slots long (a
    prefill's rows may hold fewer: `prefill_slots`). One program: its outputs are committed to the device as every
    round's are, so the rounds meet the state they will serve (`Engine.warmup`)."""
    def widen(n):
        if not holds_slots(n):
            return n
        pad = lambda x: jnp.pad(x, [(0, 0)] * SLOT_AXIS + [(0, max_len - x.shape[SLOT_AXIS])]  # noqa: E731
                                + [(0, 0)] * (x.ndim - SLOT_AXIS - 1))
        return n.replace(keys=tuple(map(pad, n.keys)), values=tuple(map(pad, n.values)))

    rows = jax.tree.map(lambda x: jnp.concatenate([x] * slots, axis=0), jax.tree.map(widen, row, is_leaf=holds_slots))
    return rows.replace(done=jnp.ones((slots,), bool))


LENGTH_BUCKET_STEP = 4  # each length bucket this many times the one before (a few compiled shapes)


def length_buckets(max_len: int, block_rows: int) -> tuple:
    """The cache lengths a resident round is compiled for: whole chunks of the chunked attention
    (`nn.attention.AttentionTuning`, read now), the smallest the fewest that still takes the chunked path for a block
    of `block_rows` rows, then `LENGTH_BUCKET_STEP` times larger while at most half the cache, and `max_len` (the
    whole cache: nothing cut). Each bucket is one more compile of every round program at warm-up (a bucket near the
    whole cache would save little for it).
    A cut of whole chunks holding every live row reads the chunks the whole cache reads, in the same order: the same
    attention bit for bit. A cache that takes the dense path (small, at most `dense_max_rows`; on a GPU any whose
    scores fit the budget, `follows_gpu_budget`) is never cut (a dense softmax over fewer slots may round
    differently): (max_len,)."""
    tuning = get_attention_tuning()
    if follows_gpu_budget(tuning) or not tuning.use_chunked(max_len, block_rows):
        return (max_len,)
    length = tuning.chunk
    while length < max_len and not tuning.use_chunked(length, block_rows):
        length += tuning.chunk
    out = []
    while 2 * length <= max_len:
        out.append(length)
        length *= LENGTH_BUCKET_STEP
    return tuple(out) + (max_len,)


def expert_byte_table(pair, layers, num_experts) -> np.ndarray:
    """[L, E]: the bytes of one expert's tables (gate_up + down, as stored) in each MoE layer."""
    out = np.zeros((len(layers), num_experts))
    for j, i in enumerate(layers):
        mlp = pair.target.layers[i].mlp
        total = sum(int(x.nbytes) for x in jax.tree.leaves((mlp.gate_up, mlp.down)))
        out[j] = total / num_experts
    return out


def _on_mesh(method):
    """Runs a runner method under `jax.set_mesh(runner.mesh)` when the runner has a mesh (`nn.moe` then traces
    its expert-parallel dispatch; jit's cache is keyed by the context mesh)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.mesh is None:
            return method(self, *args, **kwargs)
        with jax.set_mesh(self.mesh):
            return method(self, *args, **kwargs)
    return run


class ResidentRunner(RoundRunner):
    """The target's experts resident on the device (or placed on a `mesh` by the pair's weight declarations,
    `dflash_jax.sharding`). One batched `SpecState` of `slots` rows for the engine's life; each round one jitted
    draft (`_draft`: the proposal and each row's projected experts) and one jitted verify (`_verify`) of the first
    `rows` rows (a row bucket), written back in place (the state is donated). A row the verify leaves out is put
    back as it was (`keep_rows`), so a row that sits out a round is the row it was."""

    chunked_prefill = True
    deferred_context = True
    overlapped_verify = True
    bursts = True
    forks = token_logprobs = prompt_scores = True
    greedy_rounds = True

    @property
    def catches_up(self) -> bool:
        """The target's cache can be re-read at any prefix (`spec.round.can_catch_up`)."""
        return bool(self.spec.taps) and can_catch_up(self.spec.target)

    def __init__(self, pair, layout: Layout, *, mesh=None):
        if mesh is not None:  # weights placed by their declarations; every jitted call traced under the mesh
            from dflash_jax.sharding import shard_pair
            pair = shard_pair(pair, mesh)
        super().__init__(pair, layout)
        self.mesh = mesh
        for p in layout.proposers.values():
            check_proposer(p, self.spec, pair.draft)
        self.tree = next((p for p in layout.proposers.values() if isinstance(p, TreeShape)), None)
        tcfg = pair.target_cfg
        fam = family_of(tcfg)
        layers = fam.moe_layer_ids(pair.target)
        self.moe_layers = layers
        self._routers = fam.routers_of(pair.target, layers)
        self.expert_bytes = expert_byte_table(pair, layers, tcfg.moe.num_experts)
        self.top_logprobs = min(TOP_LOGPROBS, int(tcfg.vocab_size))
        self.last_logits = None  # [k, V] the last prefill's (or fork's) last logits
        self._round_logprobs = None  # the last verify's committed log-probs (device), when its plan asked
        # attention reading each row's keys where they lie: a round computes on the whole KV buffers (no cut rows or
        # slots copied in and written back), and a single length bucket (the whole cache) serves every round
        self.in_place = mesh is None and all(reads_in_place(x.dtype) for x in (pair.target.embed, pair.draft.fc))
        self.length_buckets = ((self.spec.max_len,) if self.in_place
                               else length_buckets(self.spec.max_len, layout.widest + self.spec.block_size))
        self._length_bound = None  # (each slot's cache length bound [slots], the state it holds for)

    def carried(self):
        """The state: what a program reads that an earlier call wrote (the pair and the routers are constants; the
        last prefill's logits are written by every admission before its programs read them; the verify's log-probs
        and the length bound are read on the host)."""
        return self.state

    def _widen(self, rows: SpecState) -> SpecState:
        """Prefilled rows with the target cache able to take the widest verify (a tree wider than the block). Their
        draft context rows stay as wide as the prefill made them (a held prompt's, as the prompt): `insert` writes
        them into the leading columns of the state's (`Layout.context_rows`)."""
        if self.tree is None:
            return rows
        return rows.replace(target_cache=widen_for_tree(self.spec.target, rows.target_cache, self.layout.widest))

    # -- rows in and out -------------------------------------------------------------------------------

    @_on_mesh
    def reset(self, dummy: PrefillBatch) -> None:
        row = self.prefill(dummy)
        self.state = _broadcast_rows(row.replace(context=pad_cols(row.context, self.layout.held)), self.slots,
                                     self.spec.max_len)

    @_on_mesh
    def prefill(self, batch: PrefillBatch) -> SpecState:
        """The batch's rows, their caches as long as the prompt bucket needs (`prefill_slots`): `insert` copies
        them into the state up to their lengths."""
        slots = prefill_slots(self.spec.max_len, batch.tokens.shape[1])
        state, self.last_logits = _prefill_rows(self.pair.target, self.pair.draft, batch.tokens, batch.lengths,
                                                batch.params, batch.key_data, batch.key_fold, self.spec,
                                                batch.positions, self._prompt_hold(batch),
                                                None if slots == self.spec.max_len else slots)
        return self._widen(state)

    def _prompt_hold(self, batch: PrefillBatch) -> int | None:
        """The held context columns a prefill puts the prompt's draft context in (`Layout.context_rows`), where the
        state holds more than a block, the prompt fits, and its rows sit at slot positions; else None (appended)."""
        held = self.layout.held
        if held <= self.spec.block_size or batch.positions is not None or batch.tokens.shape[1] > held:
            return None
        return held

    @_on_mesh
    def fork(self, rows: SpecState, src, key_data, key_fold) -> SpecState:
        rows, self.last_logits = fork_rows(rows, self.last_logits, np.asarray(src, np.int32), key_data,
                                           np.asarray(key_fold, np.int32))
        return rows

    @_on_mesh
    def first_logprobs(self, rows: SpecState) -> TokenLogprobs:
        return TokenLogprobs.of(_first_logprobs(self.last_logits, rows.output[:, 0], k=self.top_logprobs))

    def round_logprobs(self) -> TokenLogprobs | None:
        return None if self._round_logprobs is None else TokenLogprobs.of(self._round_logprobs)

    @_on_mesh
    def prompt_logprobs(self, tokens: np.ndarray) -> TokenLogprobs:
        return TokenLogprobs.of(prompt_logprobs_of(self.pair.target, np.asarray(tokens, np.int32), self.spec,
                                                   k=self.top_logprobs))

    def _verify_start(self, plan: RoundPlan):
        """Each row's token count before a verify whose plan asks for log-probs (a copy: the state is donated)."""
        if plan.logprobs is None or not np.any(plan.logprobs):
            return None
        return jnp.copy(self.state.num_generated)

    def _after_verify(self, start, logits, tree=None) -> None:
        """The committed tokens' log-probs when the plan asked: a chain's block rows score them in order; a tree's
        committed path is found again from its tokens (`tree_path_logits`)."""
        if start is None:
            self._round_logprobs = None
        elif tree is None:
            self._round_logprobs = committed_logprobs(logits, self.state.output, start, k=self.top_logprobs)
        else:
            self._round_logprobs = tree_committed_logprobs(logits, tree, self.state.output, start,
                                                           k=self.top_logprobs)

    def first_tokens(self, rows: SpecState) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(rows.output)[:, 0], np.asarray(rows.done)

    @_on_mesh
    def insert(self, rows: SpecState, index: np.ndarray) -> None:
        self.state = _insert_rows(self.state, rows, index)

    @_on_mesh
    def release(self, free: np.ndarray) -> None:
        self.state = release_rows(self.state, free)

    @_on_mesh
    def move_row(self, src: int, dst: int) -> None:
        self.state = _move_row(self.state, np.int32(src), np.int32(dst))

    @_on_mesh
    def prefill_start(self, tokens, valid, positions=None):
        pre = chunked.prefill_start_jit(self.pair.target, self.pair.draft, tokens, valid, self.spec,
                                        positions=positions)
        jax.block_until_ready(pre.logits)  # the round's draft and verify are timed on their own
        return pre

    @_on_mesh
    def prefill_chunk(self, pre, tokens, valid, wait: bool = True, positions=None):
        pre = chunked.prefill_chunk_jit(self.pair.target, self.pair.draft, pre, tokens, valid, self.spec,
                                        positions=positions)
        if wait:
            jax.block_until_ready(pre.logits)
        return pre

    @_on_mesh
    def prefill_finish(self, pre, batch: PrefillBatch) -> SpecState:
        self.last_logits = pre.logits
        return self._widen(chunked.prefill_finish_jit(self.pair.target, self.pair.draft, pre, batch.params,
                                                      batch.key_data, batch.key_fold, self.spec))

    def snapshot_rows(self, length: int) -> int:
        """The power of two of cache rows >= `length` (at least 16), at most the cache's: a few compiled shapes, a
        snapshot at most twice its live rows."""
        return int(min(self.spec.max_len, max(16, 1 << max(int(length) - 1, 0).bit_length())))

    @_on_mesh
    def prefill_snapshot(self, pre, length: int):
        """Only the live rows: each KV buffer (the target's attention layers, the draft's context) cut to
        `snapshot_rows(length)` rows; every other leaf (lengths, a hybrid target's recurrent state and conv tail, the
        logits) copied whole."""
        small = _cut_rows(kv_buffers(pre), self.snapshot_rows(length))
        return with_kv_buffers(self.prefill_copy(with_kv_buffers(pre, None)), small)

    @_on_mesh
    def prefill_restore(self, snapshot):
        """The snapshot's KV rows written into zeroed buffers of the cache's rows (a cold prefill's buffers hold
        zeros past its length too: the restored prefill equals it bit for bit)."""
        big = _grow_rows(kv_buffers(snapshot), self.spec.max_len)
        return with_kv_buffers(self.prefill_copy(with_kv_buffers(snapshot, None)), big)

    def pending_context(self) -> np.ndarray:
        return np.asarray(self.state.num_context)

    @property
    def _flush_chunk(self) -> int:
        """The context columns a flush (or a catch-up's flush) appends per step: `FLUSH_CHUNK`, or the hold."""
        return min(FLUSH_CHUNK, self.layout.held)

    @_on_mesh
    def flush_context(self, rows: int, slots: Sequence[int] | None = None) -> None:
        """The pending context of the first `rows` rows appended; with `slots` (a few of them), only theirs: a
        gathered flush of the smallest `FLUSH_GROUPS` size holding them, when that is fewer rows than `rows` (a
        flush computes every row's columns up to the longest pending run: one admitted prompt in a bucket of 16
        rows otherwise costs 16 prompts' appends)."""
        chunk = self._flush_chunk
        group = None if slots is None else next((g for g in FLUSH_GROUPS if g >= len(slots)), None)
        if group is not None and group < rows:
            index = np.full(group, self.slots, np.int32)  # padding: past the slots, nothing done
            index[: len(slots)] = slots
            self.state = _flush_slots(self.pair.draft, self.state, index, self.spec, chunk)
            return
        self.state = _flush(self.pair.draft, self.state, self.spec, rows, chunk)

    @_on_mesh
    def warm_extra(self) -> None:
        """The gathered flushes (`flush_context`'s `slots`) of every `FLUSH_GROUPS` size, on padding slots only
        (nothing appended), where the state holds context rows past a block."""
        if self.spec.taps and self.layout.held > self.spec.block_size:
            chunk = self._flush_chunk
            for group in FLUSH_GROUPS:
                if group < self.slots:
                    index = np.full(group, self.slots, np.int32)
                    self.state = _flush_slots(self.pair.draft, self.state, index, self.spec, chunk)

    @_on_mesh
    def catch_up(self, rows: int, tokens: np.ndarray, back: np.ndarray) -> None:
        self.state = _catch_up(self.pair.target, self.pair.draft, self.state, np.asarray(tokens, np.int32)[:rows],
                               np.asarray(back, np.int32)[:rows], self.spec, rows,
                               self._flush_chunk)

    # -- the round -------------------------------------------------------------------------------------

    def length_bucket(self, rows: int, rounds: int = 1, proposer=None) -> int:
        """The smallest length bucket holding the first `rows` rows' caches through `rounds` rounds of `proposer`
        (every KV cache's length, what each round may add and the slots written past the last one: `growth`); the
        last bucket is the whole cache. `pin_length` overrides it (warm-up).
        The lengths are read from the device (a few int32 per cache) only when the state changed outside the rounds
        (a reset, insert, move): after that each round adds its growth to every row's bound (a round grows a
        cache by at most that), so the bucket is never too small and seldom larger than needed."""
        if self.pin_length is not None:
            return self.pin_length
        if len(self.length_buckets) == 1:
            return self.length_buckets[0]
        bound = self._bound()
        if bound is None:  # no KV cache to cut
            return self.length_buckets[-1]
        grow, past = self.growth(proposer)
        self._length_bound = (bound + rounds * grow - self.layout.widest, None)  # set to the state after the rounds
        need = int(np.max(bound[:rows])) + rounds * grow + past
        return next((b for b in self.length_buckets if b >= need), self.length_buckets[-1])

    def growth(self, proposer=None) -> tuple[int, int]:
        """(the slots a round of `proposer` may add to a row's caches, the slots it writes past the last round's
        lengths): a deferring width-1 chain verifies one row and leaves the draft's cache alone (1, 0); a chain of
        width w commits at most w and drafts a block after (w, B); anything else (None: any round) the widest
        verify and a block."""
        if isinstance(proposer, Chain) and proposer.width is not None:
            if _deferring(proposer, self.spec):
                return 1, 0
            return int(proposer.width), self.spec.block_size
        return self.layout.widest, self.spec.block_size

    def _bound(self) -> np.ndarray | None:
        """Each slot's cache length bound before the next round (`length_bucket`); None: the state has no KV cache."""
        if self._length_bound is None or self._length_bound[1] is not self.state:
            lengths = [n.lengths for n in jax.tree.leaves(self.state, is_leaf=lambda x: isinstance(x, KVCache))
                       if isinstance(n, KVCache)]
            if not lengths:
                return None
            bound = np.max(np.stack([np.asarray(x) for x in jax.device_get(lengths)]), axis=0)
            self._length_bound = (bound - self.layout.widest, self.state)  # read once per state
        return self._length_bound[0] + self.layout.widest

    def burst_rounds(self, rows: int, count: int, proposer=None) -> int:
        """At most `count` rounds (and `MAX_BURST`) of `proposer`, fewer when more would need a longer length bucket
        than one round does (a longer cut costs every round of the burst more)."""
        count = max(1, min(int(count), MAX_BURST))
        if self.pin_length is not None or len(self.length_buckets) == 1 or count == 1:
            return count
        bound = self._bound()
        if bound is None:
            return count
        grow, past = self.growth(proposer)
        top, last = int(np.max(bound[:rows])), self.length_buckets[-1]
        one = next((b for b in self.length_buckets if b >= top + grow + past), last)
        if one == last:  # the whole cache: nothing cut, nothing to outgrow
            return count
        return max(1, min(count, (one - top - past) // grow))

    @_on_mesh
    def draft(self, proposer, rows: int) -> Drafted:
        """The draft of the first `rows` rows over the round's length bucket (`length_bucket`). The state's
        draft-cache buffers are donated to the draft, and the state takes the buffers it returns (with the old
        lengths until the verify)."""
        length = self.length_bucket(rows, 1, proposer)
        cache = self.state.draft_cache
        state, buffers = self.state, None
        if cache is not None:
            state, buffers = state.replace(draft_cache=cache.replace(keys=(), values=())), (cache.keys, cache.values)
        proposal, buffers, lengths, demand = _draft(self.pair.target, self.pair.draft, state, buffers, self._routers,
                                                    self.round_spec, proposer, rows, length, self.in_place)
        if cache is not None:
            self.state = self.state.replace(draft_cache=cache.replace(keys=buffers[0], values=buffers[1]))
        return Drafted(proposer=proposer, rows=rows, proposal=proposal, lengths=lengths, demand=demand, length=length)

    @_on_mesh
    def verify(self, drafted: Drafted, plan: RoundPlan, info=None) -> None:
        start = self._verify_start(plan)
        self.state, logits = _verify(self.pair.target, self.state, drafted.proposal, drafted.lengths, plan.active,
                                     self.round_spec, drafted.proposer, drafted.rows, drafted.length, self.in_place)
        if self._length_bound is not None and drafted.length is not None:
            self._length_bound = (self._length_bound[0], self.state)  # the bound holds for the state this verify made
        self._after_verify(start, logits, drafted.proposal.tree)

    @_on_mesh
    def burst(self, proposer, active, rows, count, until_finish=False) -> Burst:
        count = self.burst_rounds(rows, count, proposer)
        length = self.length_bucket(rows, count, proposer)
        self.state, committed, ran = _burst(self.pair.target, self.pair.draft, self.state, np.asarray(active, bool),
                                            np.int32(count), np.bool_(until_finish), self.round_spec, proposer, rows,
                                            length, np.int32(0), self.in_place)
        if self._length_bound is not None and length is not None:
            self._length_bound = (self._length_bound[0], self.state)
        ran, committed = jax.device_get((ran, committed))
        return Burst(rounds=int(ran), committed=np.asarray(committed)[: int(ran)], length=length)

    @_on_mesh
    def burst_program(self, proposer, rows: int, *, in_place: bool | None = None):
        """The lowered program (`jax.stages.Lowered`) that a call of `proposer`'s rounds of the first `rows` rows runs
        on the current state (`burst`; `in_place`: as the runner runs it, or forced either way), for inspection: its
        text, its compiled cost and memory analyses."""
        return _burst.lower(self.pair.target, self.pair.draft, self.state, np.zeros(self.slots, bool), np.int32(1),
                            np.bool_(False), self.round_spec, proposer, rows, self.length_buckets[-1], np.int32(0),
                            self.in_place if in_place is None else bool(in_place))

    @_on_mesh
    def warm_burst(self, proposer, rows, rounds=1) -> None:
        rounds = max(1, min(int(rounds), MAX_BURST))
        length = self.length_bucket(rows, rounds, proposer)
        self.state, _, ran = _burst(self.pair.target, self.pair.draft, self.state, np.zeros(self.slots, bool),
                                    np.int32(rounds), np.bool_(False), self.round_spec, proposer, rows, length,
                                    np.int32(rounds), self.in_place)
        jax.block_until_ready(ran)

    def fetch(self):
        return jax.device_get((self.state.num_generated, self.state.done, self.state.output))

    def sync(self) -> None:
        jax.block_until_ready(self.state.done)


# ----------------------------------------------------------------------------------------------------------
# a runner without a model, for the host engine's tests
# ----------------------------------------------------------------------------------------------------------

def fake_pair(*, block_size: int = 4, vocab_size: int = 256, max_position_embeddings: int = 4096):
    """A stand-in pair for `FakeRunner`: the tiny MoE target's config and a draft config, no weights."""
    import types

    from dflash_jax import testing

    target = testing.tiny_qwen3_moe_config(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings)
    draft = testing.tiny_draft_config(target, block_size=block_size)
    return types.SimpleNamespace(target_cfg=target, draft_cfg=draft, target=None, draft=None)


class FakeRunner(RoundRunner):
    """A runner of numpy rows and deterministic tokens, no model: the host engine's admission, queue, cancel,
    compaction, scheduling, stop and emission logic run in milliseconds a round.

    Row `r`'s tokens are a function of its prompt and position only (`FakeRunner.token`), and each verify of a
    row at width w commits `FakeRunner.accepted(...)` of them (1 .. w, by the prompt and position), stopping at a
    stop id or the budget, so a request's output is `FakeRunner.alone(...)` however its rounds were scheduled,
    whatever slot it sat in, and whatever joined and left around it; a row moved, dropped, inserted twice or
    verified while it sits out shows as a wrong output. A long prompt's chunks are hashed in order into its row,
    so a skipped or repeated chunk shows too. Every call is counted in `calls`."""

    chunked_prefill = True
    overlapped_verify = True
    bursts = True
    forks = token_logprobs = prompt_scores = True

    def __init__(self, pair, layout: Layout, *, mesh=None, num_layers: int = 2, num_experts: int = 8):
        super().__init__(pair, layout)
        self.moe_layers = tuple(range(num_layers))
        self.expert_bytes = np.full((num_layers, num_experts), 1000.0)
        self.vocab = int(layout.spec.target.vocab_size)
        self.calls = {k: 0 for k in ("prefill", "insert", "release", "move_row", "draft", "verify", "chunk", "fork",
                                     "prompt_logprobs", "burst")}
        self.verified_rows: list[np.ndarray] = []  # per verify: the rows it committed for
        self._round_logprobs = None

    # -- the tokens ----------------------------------------------------------------------------------

    @staticmethod
    def key(prompt) -> int:
        h = 7
        for t in prompt:
            h = (h * 1_000_003 + int(t) + 1) % (2**31 - 1)
        return h

    @staticmethod
    def token(key: int, position: int, vocab: int) -> int:
        return int((key * 2654435761 + position * 40503 + 11) % vocab)

    @staticmethod
    def accepted(key: int, position: int, width: int) -> int:
        return 1 + (key + position) % max(width, 1)

    @staticmethod
    def forked(key: int, fold: int) -> int:
        """The key of sample `fold` of a prompt (`n` > 1); sample 0 is the prompt's own."""
        return key if fold == 0 else (key * 31 + fold * 7919) % (2**31 - 1)

    @staticmethod
    def logprob(token: int, position: int) -> float:
        """The fake log-prob of `token` at output position `position` (prompt positions: negative)."""
        return -0.25 * ((int(token) * 7 + int(position) * 3) % 13) - 0.01

    def _logprobs(self, tokens: np.ndarray, positions: np.ndarray) -> TokenLogprobs:
        k = min(TOP_LOGPROBS, self.vocab)
        lp = np.vectorize(self.logprob, otypes=[np.float32])(tokens, positions) if tokens.size else \
            np.zeros(tokens.shape, np.float32)
        top_id = (tokens[..., None] + np.arange(k)) % self.vocab
        return TokenLogprobs(lp, (lp[..., None] - 0.5 * np.arange(k)).astype(np.float32), top_id.astype(np.int32))

    @classmethod
    def alone(cls, prompt, max_new_tokens: int, vocab: int, stop_ids=(), fold: int = 0) -> list[int]:
        """The request's output run alone: its tokens up to the budget or the first stop id (included)."""
        key, out = cls.forked(cls.key(prompt), fold), []
        for pos in range(max_new_tokens):
            out.append(cls.token(key, pos, vocab))
            if out[-1] in stop_ids:
                break
        return out

    # -- rows ----------------------------------------------------------------------------------------

    def _rows(self, keys, budgets, stops) -> dict:
        k, n = len(keys), self.spec.output_len
        rows = dict(key=np.asarray(keys, np.int64), budget=np.asarray(budgets, np.int64),
                    stops=np.asarray(stops, np.int64).reshape(k, -1), output=np.full((k, n), -1, np.int64),
                    num_generated=np.ones(k, np.int64), done=np.zeros(k, bool))
        for i in range(k):
            rows["output"][i, 0] = self.token(int(keys[i]), 0, self.vocab)
            rows["done"][i] = rows["budget"][i] <= 1 or rows["output"][i, 0] in rows["stops"][i]
        return rows

    def reset(self, dummy: PrefillBatch) -> None:
        row = self.prefill(dummy)
        self.state = {k: np.repeat(v, self.slots, axis=0) for k, v in row.items()}
        self.state["done"][:] = True

    def prefill(self, batch: PrefillBatch) -> dict:
        self.calls["prefill"] += 1
        k = batch.tokens.shape[0]
        keys = [self.key(batch.tokens[i, : batch.lengths[i]].tolist()) for i in range(k)]
        return self._rows(keys, batch.params.budget, batch.params.stop_ids)

    def first_tokens(self, rows):
        return rows["output"][:, 0].copy(), rows["done"].copy()

    def insert(self, rows, index) -> None:
        self.calls["insert"] += 1
        for i, slot in enumerate(np.asarray(index)):
            if slot < self.slots:
                for k, v in rows.items():
                    self.state[k][slot] = v[i]

    def release(self, free) -> None:
        self.calls["release"] += 1
        self.state["done"] |= np.asarray(free, bool)

    def move_row(self, src: int, dst: int) -> None:
        self.calls["move_row"] += 1
        for v in self.state.values():
            v[dst] = v[src]

    def prefill_start(self, tokens, valid, positions=None):
        return self.prefill_chunk(7, tokens, valid)

    def prefill_chunk(self, pre, tokens, valid, wait: bool = True, positions=None):
        self.calls["chunk"] += 1
        h = pre
        for t in tokens[0, : int(valid[0])]:  # `key` continued over the chunk
            h = (h * 1_000_003 + int(t) + 1) % (2**31 - 1)
        return h

    def prefill_finish(self, pre, batch: PrefillBatch) -> dict:
        return self._rows([pre], batch.params.budget, batch.params.stop_ids)

    def fork(self, rows, src, key_data, key_fold) -> dict:
        self.calls["fork"] += 1
        src = np.asarray(src)
        keys = [self.forked(int(rows["key"][i]), int(f)) for i, f in zip(src, key_fold)]
        return self._rows(keys, rows["budget"][src], rows["stops"][src])

    def first_logprobs(self, rows) -> TokenLogprobs:
        first = rows["output"][:, 0]
        return self._logprobs(first, np.zeros_like(first))

    def round_logprobs(self) -> TokenLogprobs | None:
        return self._round_logprobs

    def prompt_logprobs(self, tokens) -> TokenLogprobs:
        self.calls["prompt_logprobs"] += 1
        tokens = np.asarray(tokens)[:, 1:]
        return self._logprobs(tokens, -1 - np.arange(tokens.shape[1])[None] + np.zeros_like(tokens))

    # -- the round -------------------------------------------------------------------------------------

    def draft(self, proposer, rows: int) -> Drafted:
        self.calls["draft"] += 1
        width = proposer.budget if isinstance(proposer, TreeShape) else proposer.width
        L, E = self.expert_bytes.shape
        demand = np.zeros((rows, L, E), bool)
        for r in range(rows):
            for j in range(L):
                demand[r, j, (self.state["key"][r] + self.state["num_generated"][r] + j) % E] = True
        return Drafted(proposer=proposer, rows=rows, proposal=int(width), lengths=None, demand=demand)

    def verify(self, drafted: Drafted, plan: RoundPlan, info=None) -> None:
        self.calls["verify"] += 1
        s = self.state
        active = np.asarray(plan.active, bool)[: drafted.rows]
        committed = np.zeros(self.slots, bool)
        start = s["num_generated"][: drafted.rows].copy()
        for r in np.flatnonzero(active):
            if s["done"][r]:
                continue
            committed[r] = True
            key, pos = int(s["key"][r]), int(s["num_generated"][r])
            for _ in range(self.accepted(key, pos, drafted.proposal)):
                t = self.token(key, pos, self.vocab)
                s["output"][r, pos] = t
                pos += 1
                if pos >= s["budget"][r] or t in s["stops"][r]:
                    s["done"][r] = True
                    break
            s["num_generated"][r] = pos
        self.verified_rows.append(committed)
        self._round_logprobs = None
        if plan.logprobs is not None and np.any(plan.logprobs):
            pos = np.minimum(start[:, None] + np.arange(int(drafted.proposal))[None], s["output"].shape[1] - 1)
            tokens = np.maximum(np.take_along_axis(s["output"][: drafted.rows], pos, axis=1), 0)
            self._round_logprobs = self._logprobs(tokens, pos)

    def warm_burst(self, proposer, rows, rounds=1) -> None:
        """`rounds` rounds of every row idle (nothing changes)."""
        idle = np.zeros(self.slots, bool)
        for _ in range(max(1, min(int(rounds), MAX_BURST))):
            self.round(proposer, idle, rows)

    def burst(self, proposer, active, rows, count, until_finish=False) -> Burst:
        """`verify` up to `count` times (the runner's draft each round), as one call."""
        self.calls["burst"] += 1
        active = np.asarray(active, bool)
        before_done = self.state["done"][:rows].copy()
        committed = []
        for _ in range(max(1, min(int(count), MAX_BURST))):
            if not np.any(active[:rows] & ~self.state["done"][:rows]):
                break
            start = self.state["num_generated"][:rows].copy()
            self.verify(self.draft(proposer, rows), RoundPlan(active=active))
            committed.append(self.state["num_generated"][:rows] - start)
            if until_finish and np.any(self.state["done"][:rows] & active[:rows] & ~before_done):
                break
        return Burst(rounds=len(committed), committed=np.asarray(committed, np.int64).reshape(-1, rows))

    def fetch(self):
        s = self.state
        return s["num_generated"].copy(), s["done"].copy(), s["output"].copy()


__all__ = ["Burst", "CATCH_UP_CHUNK", "MAX_BURST", "kv_buffers", "with_kv_buffers", "Drafted", "FakeRunner", "Layout",
           "PrefillBatch", "ResidentRunner", "RoundPlan", "RoundRunner", "TOP_LOGPROBS", "TokenLogprobs",
           "committed_logprobs", "expert_byte_table", "fake_pair", "length_buckets", "cut_slots", "fork_rows",
           "log_softmax_top", "prompt_logprobs_of", "tree_committed_logprobs", "tree_path_logits", "head_rows",
           "keep_rows", "put_head_rows", "release_rows", "settle_rows", "verify_rows"]
