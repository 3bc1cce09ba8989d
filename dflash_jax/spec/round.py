"""The round, once: `propose` -> a placement's verify forward -> `commit`, for every proposer.

  proposal = propose(proposer, tw, dw, state, spec)       one draft forward, then the proposer's build
  out      = verify_forward(tw, state, proposal, spec)      the width-N target forward (resident placement)
  state, outcome = commit(state, proposal, out, spec)      acceptance, emission, commit/rollback, context
  state, outcome = round(tw, dw, state, spec, proposer)    the three in one (jittable; also `round_step`)

Proposers (static, hashable: a jit static argument) say what the draft proposes each round:
  `Chain(width, head)`   the argmax chain of `width` - 1 proposals (DFlash), or the branch head's chain
                         (`head=True`, `session.head_chain_draft`); sampled rows under the rejection method
                         draw from q, kept for the acceptance;
  `TreeShape(N, K)`      a best-first token tree of N nodes with K candidates per node, from the marginals or
                         from the branch head (`spec.tree`); `TreeShape(N, 1)` is the chain `Chain(N)`.
A chain is the trivial tree; it keeps its own commit (no K/V rows to move, the rejection rule over q).

The state keeps the layout of its spec's block (the draft's context rows [b, B, F]); a round of a narrower
chain pads its context rows back to that width here, and a width-1 round on a speculative state still feeds
the draft's context cache (`Chain(1)`), or leaves the new row pending for the next drafting round
(`Chain(1, defer_context=True)`, which the caller may use only while every live row's pending rows leave room),
or computes no taps at all (`Chain(1, skip_context=True)`: the row's context is left for `catch_up_context`, one
wide target pass over the skipped rows before the draft next reads them).

Placements (where the target's experts come from) enter through the verify forward: `verify_forward` is the
resident one (one program with the round); the offloaded placement runs the same forward layer by layer
(`offload.forward.forward_layerwise`, host-driven) between a jitted `propose` and a jitted `commit`. Drivers
(the jitted loop, the Python stepping loop, the serving engine) compose these pieces with any proposer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Union

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.models import draft as draft_model
from dflash_jax.models.family import family_of
from dflash_jax.spec.policy import AdaptivePolicy, choose_shape, update_calibration
from dflash_jax.spec.session import (
    Draft, RoundOutcome, SpecConfig, SpecState, check_state, commit_verify, draft_round,
)
from dflash_jax.spec.tree import Tree, TreeShape, commit_tree, expert_union, pad_cols, round_tree, tree_draft
from dflash_jax.stored import stored_jit


@dataclasses.dataclass(frozen=True)
class Chain:
    """The chain proposer: `width` - 1 proposals verified as one width-`width` block (None: the state's block).

    head: propose from the draft's branch head, one position after another (the draft must carry one).
    defer_context (width 1 only): do not feed the draft's context cache this round; the verify's row joins the
    pending context rows, which the next drafting round appends at once (a width-1 round then costs what a
    block-1 round costs). The caller guarantees room: every live row has fewer than B pending rows.
    skip_context (width 1 only): compute no taps at all (the round is a block-1 engine's round: no tap outputs, no
    context row written); the row's pending rows stay as they were, and the committed position has no context
    row until `catch_up_context` computes the skipped positions' taps in one wide target pass (the caller
    tracks which positions those are). Only for targets whose cache can be re-read at any prefix
    (`can_catch_up`)."""

    width: int | None = None
    head: bool = False
    defer_context: bool = False
    skip_context: bool = False

    def __post_init__(self):
        if self.width is not None and (isinstance(self.width, bool) or not isinstance(self.width, int)
                                       or self.width < 1):
            raise ValueError(f"a chain's width must be a positive integer, got {self.width!r}")
        if self.defer_context and self.width != 1:
            raise ValueError("defer_context applies to a width-1 chain only")
        if self.skip_context and (self.width != 1 or self.defer_context):
            raise ValueError("skip_context applies to a width-1 chain only, without defer_context")

    @property
    def is_chain(self) -> bool:
        return True

    def label(self) -> str:
        return ("head chain" if self.head else "chain") + (f" B={self.width}" if self.width else "")

    @property
    def leaves_context(self) -> bool:
        """The round appends nothing to the draft's context cache (`defer_context` or `skip_context`)."""
        return self.defer_context or self.skip_context


def skips_context(proposer) -> bool:
    """Whether `proposer`'s rounds compute no taps (`Chain(1, skip_context=True)`)."""
    return isinstance(proposer, Chain) and proposer.skip_context


def round_spec(proposer, spec: SpecConfig) -> SpecConfig:
    """The spec a round of `proposer` verifies and commits with: where it skips the context, the block-1 spec (no
    taps; a width-1 round's verify and commit read nothing else of the block)."""
    return dataclasses.replace(spec, block_size=1) if skips_context(proposer) and spec.taps else spec


def can_catch_up(cfg) -> bool:
    """Whether a target of config `cfg` can catch up skipped context rows (`catch_up_context`): its cache must be
    re-readable at any prefix, a slot-per-position KV cache (not a linear-attention state)."""
    return not family_of(cfg).needs_rollback_width


Proposer = Union[Chain, TreeShape]


def as_proposer(p) -> Proposer:
    """A proposer from a `Chain` or a `TreeShape` (a branch-1 shape is the chain of its budget)."""
    if isinstance(p, Chain):
        return p
    if isinstance(p, TreeShape):
        return Chain(p.budget) if p.is_chain else p
    raise TypeError(f"a proposer is a spec.round.Chain or a spec.tree.TreeShape, got {type(p).__name__}")


def verify_width(proposer: Proposer, spec: SpecConfig) -> int:
    """The rows of the proposer's verify on a state of `spec`."""
    proposer = as_proposer(proposer)
    if isinstance(proposer, Chain):
        return spec.block_size if proposer.width is None else proposer.width
    return proposer.budget


def check_proposer(proposer: Proposer, spec: SpecConfig, draft_w=None) -> Proposer:
    """The proposer, checked against the state's spec (and the draft's weights when given); ValueError naming
    the cause and the fix."""
    proposer = as_proposer(proposer)
    if isinstance(proposer, Chain):
        width = verify_width(proposer, spec)
        if width > spec.block_size:
            raise ValueError(f"a chain of width {width} is wider than the state's block {spec.block_size}: start the "
                             "state with a block of at least that width")
        if proposer.head and draft_w is not None and getattr(draft_w, "branch_head", None) is None:
            raise ValueError("the head chain proposes from the draft's branch head, and this pair's draft has none: "
                             "load a pair shipped with branch_head.safetensors, or attach one "
                             "(dflash_jax.pair.with_branch_head)")
        return proposer
    if spec.block_size < 2:
        raise ValueError("tree verification needs a draft block of at least 2 (one proposal position)")
    return proposer


@struct.dataclass
class Proposal:
    """One round's proposal: the verify block and what its acceptance needs."""

    tokens: jax.Array  # [b, N] int32: the rows the verify runs (node 0 = the anchor; a chain's d_1 .. d_{N-1})
    probs: jax.Array | None  # [b, N-1, V] a chain's proposal distributions (rejection method), else None
    tree: Tree | None  # the token tree (None: a chain)
    draft_cache: object  # the draft's context cache after this round's append
    hidden: jax.Array | None  # [b, N, H] each verified row's draft hidden state (route-ahead input), or None

    @property
    def proposals(self) -> jax.Array:
        return self.tokens[:, 1:]


def propose(proposer: Proposer, target_w, draft_w, state: SpecState, spec: SpecConfig) -> Proposal:
    """The proposer's verify block from one draft forward over [anchor, MASK x (B'-1)] (none at width 1)."""
    proposer = as_proposer(proposer)
    if state.context.shape[1] > spec.block_size:
        # held context rows (`flush_context`): the caller leaves every row at most a block pending, so the draft
        # reads the block's columns (the commit keeps the state's width)
        state = state.replace(context=state.context[:, : spec.block_size])
    anchor = state.anchor[:, None]
    if isinstance(proposer, Chain):
        width = verify_width(proposer, spec)
        if width == 1:
            cache = state.draft_cache
            if spec.taps and not proposer.leaves_context:
                cache = draft_model.append_context(draft_w, spec.draft, context_features=state.context,
                                                   num_context=state.num_context, cache=cache)
            return Proposal(tokens=anchor, probs=None, tree=None, draft_cache=cache, hidden=None)
        sub = dataclasses.replace(spec, block_size=width, chain_head=proposer.head)
        draft = draft_round(target_w, draft_w, state, sub)
        return Proposal(tokens=jnp.concatenate([anchor, draft.tokens], axis=1), probs=draft.probs, tree=None,
                        draft_cache=draft.draft_cache, hidden=draft.hidden)
    check_state(state, spec)
    draft = tree_draft(target_w, draft_w, state, spec)
    tree = round_tree(target_w, draft_w, state.anchor, draft, proposer, spec)
    return Proposal(tokens=tree.tokens, probs=None, tree=tree, draft_cache=draft.draft_cache,
                    hidden=draft.node_hidden(tree))


def verify_forward(target_w, state: SpecState, proposal: Proposal, spec: SpecConfig, implementation: str = "auto",
                   router_logits: bool = False):
    """The resident placement's verify: one width-N target forward over the proposal (a `ForwardOutput` with
    every row's logits, the draft taps of the state's spec, the per-layer router experts, and the router logits
    when asked)."""
    tree = None if proposal.tree is None else proposal.tree.block()
    return family_of(spec.target).forward(target_w, proposal.tokens, state.target_cache, spec.target,
                                          tap_layers=spec.taps, logits="all", tree=tree,
                                          implementation=implementation, return_router_logits=router_logits)


def commit(state: SpecState, proposal: Proposal, out, spec: SpecConfig, proposer: Proposer = Chain()):
    """Acceptance, emission, commit/rollback and the draft's next context rows from a verify forward's output
    `out` (of `proposal.tokens` on `state.target_cache`, with the taps of `spec`, run by any placement).
    Returns (state, RoundOutcome)."""
    proposer = as_proposer(proposer)
    if proposal.tree is not None:
        return commit_tree(state, proposal.tree, proposal.draft_cache, out, spec)
    if skips_context(proposer):  # no taps: the row's pending context rows stay as they were
        new, outcome = commit(state, proposal, out, round_spec(proposer, spec), Chain(1))
        return new.replace(context=state.context, num_context=state.num_context), outcome
    width = proposal.tokens.shape[1]
    sub = dataclasses.replace(spec, block_size=width)
    draft = Draft(tokens=proposal.proposals, probs=proposal.probs, draft_cache=proposal.draft_cache)
    new = commit_verify(state, draft, out, sub)
    if spec.taps:  # the context rows of the state's layout (a width-1 sub-spec has no taps of its own)
        rows = draft_model.context_features(out.taps).astype(state.context.dtype)  # [b, width, F]
        if isinstance(proposer, Chain) and proposer.defer_context:
            pending = state.num_context
            context = state.context.at[jnp.arange(rows.shape[0]), pending].set(rows[:, 0], mode="drop")
            new = new.replace(context=context, num_context=pending + new.num_context)
        else:
            new = new.replace(context=pad_cols(rows, state.context.shape[1]))
    accepted = new.last_accepted
    zeros = jnp.zeros(accepted.shape, jnp.float32)
    cfg = spec.target
    num_experts = cfg.moe.num_experts if getattr(cfg, "moe", None) is not None else 1
    outcome = RoundOutcome(accepted=accepted, expert_union=jnp.broadcast_to(
        expert_union(out.router_experts, num_experts), accepted.shape), expected=zeros,
        off_chain=jnp.zeros(accepted.shape, bool))
    return new, outcome


def flush_context(draft_w, state: SpecState, spec: SpecConfig, width: int | None = None,
                  rows: int | None = None, chunk: int | None = None, index: jax.Array | None = None) -> SpecState:
    """The state with every pending context row appended to the draft's context cache now (what the next drafting
    round would append first, so the draft sees the same context), none left pending, and the context rows `width`
    columns wide (None: as wide as they are).

    A state may hold more pending rows than a block: the serving engine's width-1 rounds leave the draft's context
    pending in columns past the block (`Chain(1, defer_context=True)`, up to the state's context width), and flush
    them only when a drafting round comes (which reads a block's columns: `propose`) or the columns fill, so a
    request that never drafts again never pays the draft's context.
    rows (static): only the first `rows` rows append, in place in the full buffers; the others keep their pending
    rows (which must fit in `width` columns).
    chunk (static): append `chunk` columns at a time, as many times as the longest pending run among the rows needs
    (a `while_loop`: the cost follows the rows pending, not the context's width); None: every column at once.
    Each context row's K/V depends on that row alone, so chunks append exactly what one append would.
    index (instead of `rows`): [g] int32, distinct: only those rows append (gathered, their K/V and lengths written
    back in place; an index past the batch: padding, nothing done), so the cost follows the rows that need it (the
    serving engine's newly admitted prompts), not a whole row bucket's pending columns."""
    if not spec.taps:
        return state
    width = state.context.shape[1] if width is None else width
    b = state.num_context.shape[0]
    if index is not None:
        index = jnp.asarray(index, jnp.int32)
        features = jnp.take(state.context, index, axis=0, mode="clip")
        pending = jnp.where(index < b, jnp.take(state.num_context, index, mode="clip"), 0)
        cache = _append_rows(draft_w, state.draft_cache, features, pending, spec, chunk, index)
        return state.replace(draft_cache=cache, context=pad_cols(state.context, width),
                             num_context=state.num_context.at[index].set(0, mode="drop"))
    rows = b if rows is None else rows
    cache = _append_rows(draft_w, state.draft_cache, state.context[:rows], state.num_context[:rows], spec, chunk)
    # the flushed rows' columns are left as they are: past `num_context` a row's columns are never read (zeroing
    # them made XLA copy the whole hold, every slot's, twice a flush)
    return state.replace(draft_cache=cache, context=pad_cols(state.context, width),
                         num_context=state.num_context.at[:rows].set(0))


def _append_rows(draft_w, full, features, pending, spec: SpecConfig, chunk: int | None, index=None):
    """The draft's context cache `full` with the first `features.shape[0]` rows' first `pending` [rows] context rows
    of `features` [rows, C, F] appended (in place in the full buffers), `chunk` columns at a time (None: all).
    index: [rows] the cache rows the features belong to instead (`append_context`'s `batch`)."""
    rows = features.shape[0]
    head = full
    if index is None:
        head = full.replace(lengths=full.lengths[:rows],
                            position_offset=None if full.position_offset is None else full.position_offset[:rows])
    if chunk is None or chunk >= features.shape[1]:
        cache = draft_model.append_context(draft_w, spec.draft, context_features=features, num_context=pending,
                                           cache=head, batch=index)
    else:
        features = pad_cols(features, -(-features.shape[1] // chunk) * chunk)
        trips = (jnp.max(pending) + chunk - 1) // chunk

        def body(carry):
            k, c = carry
            part = jax.lax.dynamic_slice_in_dim(features, k * chunk, chunk, axis=1)
            num = jnp.clip(pending - k * chunk, 0, chunk)
            return k + 1, draft_model.append_context(draft_w, spec.draft, context_features=part, num_context=num,
                                                     cache=c, batch=index)

        _, cache = jax.lax.while_loop(lambda c: c[0] < trips, body, (jnp.int32(0), head))
    if index is None and rows < full.lengths.shape[0]:  # the head rows' lengths (and offsets) back into the full ones
        cache = cache.replace(lengths=full.lengths.at[:rows].set(cache.lengths), position_offset=(
            None if full.position_offset is None else full.position_offset.at[:rows].set(cache.position_offset)))
    return cache


def catch_up_context(target_w, draft_w, state: SpecState, tokens, back, spec: SpecConfig, rows: int | None = None,
                     chunk: int | None = None) -> SpecState:
    """The draft's context caught up over positions whose rounds skipped it (`Chain(1, skip_context=True)`): every
    pending context row appended first (`flush_context`), then the context rows of each row's `min(back, K)`
    committed positions starting `back` [rows] positions before its cache's end, from one width-K target forward
    over `tokens` [rows, K] (those positions' tokens, real up to the count). The forward reads the target's cache
    as it is and writes nothing back (its K/V rows of those positions are the ones the rounds wrote); its taps are
    what the skipping rounds would have computed, up to the rounding of a wider forward. A row with `back` 0 only
    flushes. Call it again with `back - K` for longer runs (oldest positions first, as the draft's cache needs).
    rows (static): only the first `rows` rows (the others keep everything); chunk: as in `flush_context`."""
    if not spec.taps:
        return state
    state = flush_context(draft_w, state, spec, rows=rows, chunk=chunk)
    b = state.num_context.shape[0]
    rows = b if rows is None else rows
    fam = family_of(spec.target)
    cache = jax.tree.map(lambda x: x[:rows], state.target_cache)
    back = jnp.asarray(back, jnp.int32)[:rows]
    count = jnp.minimum(back, tokens.shape[1])
    cache = fam.rollback(cache, cache.lengths - back)
    out = fam.forward(target_w, tokens[:rows], cache, spec.target, num_valid=count, tap_layers=spec.taps,
                      logits="none")
    features = draft_model.context_features(out.taps).astype(state.context.dtype)
    return state.replace(draft_cache=_append_rows(draft_w, state.draft_cache, features, count, spec, chunk))


def round_step(target_w, draft_w, state: SpecState, spec: SpecConfig, proposer: Proposer = Chain()):
    """One resident round of any proposer: propose, verify, commit. Returns (state, RoundOutcome)."""
    proposal = propose(proposer, target_w, draft_w, state, spec)
    return commit(state, proposal, verify_forward(target_w, state, proposal, round_spec(proposer, spec)), spec,
                  proposer)


def spec_round(target_w, draft_w, state: SpecState, spec: SpecConfig) -> SpecState:
    """The chain round of the state's block (the branch head's chain when `spec.chain_head`)."""
    return round_step(target_w, draft_w, state, spec, Chain(head=spec.chain_head))[0]


@struct.dataclass
class AdaptiveState:
    """A state under an adaptive policy: the rows' decayed acceptance sums and the rounds each shape ran."""

    spec_state: SpecState
    accepted_sum: jax.Array  # [b] fp32, decayed
    expected_sum: jax.Array  # [b] fp32, decayed
    chosen: jax.Array  # [num shapes] int32: rounds per shape


def adaptive_start(state: SpecState, policy: AdaptivePolicy) -> AdaptiveState:
    b = state.anchor.shape[0]
    return AdaptiveState(spec_state=state, accepted_sum=jnp.zeros((b,), jnp.float32),
                         expected_sum=jnp.zeros((b,), jnp.float32),
                         chosen=jnp.zeros((len(policy.shapes),), jnp.int32))


def adaptive_round(target_w, draft_w, astate: AdaptiveState, spec: SpecConfig, policy: AdaptivePolicy):
    """Pick the shape (`policy.choose_shape`, from the state only), run its round (one branch of a `lax.switch`:
    exactly `round` with that proposer), update the calibration. Returns the new AdaptiveState."""
    state = astate.spec_state
    choice = choose_shape(policy, astate.accepted_sum, astate.expected_sum, ~state.done)
    branches = [functools.partial(lambda s, p: round_step(target_w, draft_w, s, spec, p)[0], p=as_proposer(shape))
                for shape in policy.shapes]
    new = jax.lax.switch(choice, branches, state)
    acc, exp_ = update_calibration(policy, astate.accepted_sum, astate.expected_sum, choice, new.last_accepted,
                                   state.done)
    return AdaptiveState(spec_state=new, accepted_sum=acc, expected_sum=exp_,
                         chosen=astate.chosen.at[choice].add(1))


round_jit = stored_jit(round_step, static_argnames=("spec", "proposer"), donate_argnames=("state",))
propose_jit = stored_jit(propose, static_argnames=("proposer", "spec"))
commit_jit = stored_jit(commit, static_argnames=("spec", "proposer"))


@stored_jit(static_argnames=("spec", "proposer"), donate_argnames=("state",))
def verify_commit_jit(target_w, state: SpecState, proposal: Proposal, spec: SpecConfig, proposer: Proposer = Chain()):
    """The resident verify and the commit of a proposal, one program (the stepping driver's second half)."""
    return commit(state, proposal, verify_forward(target_w, state, proposal, spec), spec, proposer)


round = round_step  # noqa: A001  (the round's public name; modules that need the builtin import round_step)

__all__ = ["AdaptiveState", "Chain", "Proposal", "Proposer", "adaptive_round", "adaptive_start", "as_proposer",
           "can_catch_up", "catch_up_context", "check_proposer", "commit", "commit_jit", "flush_context", "propose",
           "propose_jit", "round", "round_jit", "round_spec", "round_step", "skips_context", "spec_round",
           "verify_commit_jit", "verify_forward", "verify_width"]
