"""One speculative round as pure functions over pytrees: `begin`, `draft_round`, `verify_round`.

  spec, state = begin(pair, prompts, ...)    validate, prefill, first token (the first anchor), draft context
  draft = draft_round(tw, dw, state, spec)   B-1 proposals from one draft forward
  state = verify_round(tw, state, draft, spec)   width-B target forward, accept, commit/rollback

Static vs traced. `SpecConfig` (a jit static argument) holds only what is a model or a compiled shape:
the two configs, the block size B, the cache length, the output-buffer length and the acceptance method
("exact_match" or "rejection"); the batch and prompt-bucket sizes are array shapes. Everything a request
varies is traced data in the state, one value per sequence (`RowParams`): the token budget, temperature
(0 = greedy for that sequence), top-p, top-k and stop ids, plus a PRNG key per sequence. So one compiled
program serves every request of a bucket (`spec.requests.Buckets`), and one batch can mix greedy and
sampled sequences with different budgets.

Every array has a static shape: a verify is always width B and caches are fixed-size buffers with length
counters, so the same compiled round serves every round and every sequence of the batch, each at its own
length. Sequences that are done keep flowing through the round with nothing committed.

Round arithmetic for one sequence whose target cache holds `start` committed tokens:
  block   = [anchor, d_1 .. d_{B-1}] at positions start .. start+B-1
  a       = accepted proposals (0 .. B-1), bonus = the target's token after d_a
  emitted = d_1 .. d_a, bonus, cut at its budget and after its first stop token (`produced` <= a+1)
  commit  = target cache rolled back to start + produced (the anchor and d_1 .. d_{produced-1});
            the draft's next context rows are the verify taps of those rows; next anchor = last emitted.

Inputs are checked at the non-jitted entry points (`begin`, `prepare`, the loops; `verify_round` and
`draft_round` when called eagerly with concrete arrays). The jitted functions (`draft_round_jit`,
`verify_round_jit`, `commit_verify` inside jit, the loop) trust their inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax.cache import KVCache
from dflash_jax.models.draft.config import DraftConfig
from dflash_jax.models import draft as draft_model
from dflash_jax.models.family import family_of
from dflash_jax.spec.accept import match_accept, rejection_accept
from dflash_jax.spec import requests as rq
from dflash_jax.spec.sampling import (
    AcceptanceMode, RowSampling, SamplingParams, by_sampling, greedy_tokens, next_token_rows, processed_scores,
    sample_probs_rows, sampling_probs, seed_key_data, specialize_greedy,
)
from dflash_jax.stored import stored_jit


def target_family(cfg):
    """The registered `ModelFamily` of a target config (`models.family`): `init_cache`, `forward`,
    `rollback`, ...; its weights have `.embed` [V, H] and `.lm_head` [H, V] (None when tied)."""
    return family_of(cfg)


def init_target_cache(cfg, batch: int, max_len: int, dtype, *, verify_width: int):
    """A target cache that can roll a width-`verify_width` forward back to any prefix. Linear-attention
    families (Qwen3.5) keep the verify block's inputs for that, sized by the verify width."""
    return family_of(cfg).init_cache(cfg, batch, max_len, dtype, verify_width=verify_width)


@dataclasses.dataclass(frozen=True)
class StaticRequest:
    """A budget and sampling settings baked into a `SpecConfig` for callers of `start_state` that pass no
    per-sequence `RowParams` (the `make_spec` form): those compile once per value. New code passes
    `RowParams`, which are traced."""

    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()

    def rows(self, batch: int, stop_ids: jax.Array) -> "RowParams":
        stop_ids = jnp.asarray(stop_ids, jnp.int32).reshape(-1)
        s = self.sampling
        return RowParams(
            budget=jnp.full((batch,), self.max_new_tokens, jnp.int32),
            sampling=RowSampling(temperature=jnp.full((batch,), s.temperature, jnp.float32),
                                 top_p=jnp.full((batch,), s.top_p, jnp.float32),
                                 top_k=jnp.full((batch,), s.top_k, jnp.int32)),
            stop_ids=jnp.broadcast_to(stop_ids[None], (batch, stop_ids.shape[0])),
        )


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """The static part of a speculative run (a jit static argument): models and compiled shapes only.

    max_len: cache rows (a bucket: `Buckets.cache_len(prompt bucket + output_len + block_size)`).
    output_len: output-buffer columns (a bucket >= every sequence's budget).
    method: the acceptance rule of the sampled sequences; greedy sequences run in either.
    static_request: only for the `make_spec` form (see `StaticRequest`); None when settings are traced."""

    target: Any
    draft: DraftConfig
    block_size: int
    max_len: int
    output_len: int
    method: AcceptanceMode = "exact_match"
    static_request: StaticRequest | None = None
    # the chain's proposals from the draft's branch head, one position after another (`head_chain_draft`);
    # False: the draft's per-position argmax (DFlash). Needs a draft that carries a head.
    chain_head: bool = False
    # every row of every state run with this spec is greedy: the rounds compile no sampling work and no conditional
    # to skip it (`sampling.by_sampling`). `prepare` sets it for a batch whose every request is greedy where
    # `sampling.specialize_greedy()` (a GPU, which runs a conditional from the host). A state with a sampled live
    # row is refused where its settings are concrete (`check_state`, `start_state`).
    greedy_only: bool = False

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(self.draft.target_layer_ids) if self.block_size > 1 else ()


@struct.dataclass
class RowParams:
    """Per-sequence request settings, traced (arrays with a leading batch dimension b)."""

    budget: jax.Array  # [b] int32: tokens to generate, the first one included (<= spec.output_len)
    sampling: RowSampling  # [b] temperature (0 = greedy), top_p, top_k
    stop_ids: jax.Array  # [b, S] int32, -1 = unused slot


@struct.dataclass
class SpecState:
    target_cache: Any
    draft_cache: KVCache | None
    anchor: jax.Array  # [b] last emitted token: slot 0 of the next block
    context: jax.Array  # [b, B, F] target taps of committed rows the draft has not seen yet
    num_context: jax.Array  # [b]
    output: jax.Array  # [b, N] emitted tokens, -1 past num_generated (N = spec.output_len)
    num_generated: jax.Array  # [b]
    done: jax.Array  # [b] bool
    acceptance: jax.Array  # [b, N] tokens emitted per round
    rounds: jax.Array  # [b] rounds run while not done
    params: RowParams  # per-sequence budget, sampling settings, stop ids
    key: jax.Array  # [b] one PRNG key per sequence (its draws do not depend on the batch it runs in)
    last_accepted: jax.Array  # [b] proposals accepted in the last round (trace)
    last_bonus: jax.Array  # [b] the last round's bonus token (trace)

    @property
    def stop_ids(self) -> jax.Array:
        return self.params.stop_ids


def map_rows(fn, *trees):
    """`jax.tree.map` of `fn` over pytrees whose every leaf has a leading batch axis (a `SpecState`, its rows);
    PRNG key arrays go through their data (`fn` sees uint32 arrays), so `fn` may index, gather or scatter rows."""
    def one(*xs):
        if jnp.issubdtype(xs[0].dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(xs[0])
            out = fn(*(jax.random.key_data(x) for x in xs))
            return jax.random.wrap_key_data(out, impl=impl)
        return fn(*xs)
    return jax.tree.map(one, *trees)


@struct.dataclass
class RoundOutcome:
    """What one round did, per sequence: proposals accepted, the verify's distinct experts per MoE layer (mean
    over layers; 0 for dense targets), the draft's expected accepted depth of a tree (0 for chains), and whether
    the accepted path left the draft's argmax chain (a tree node of rank > 0 was accepted)."""

    accepted: jax.Array  # [b] int32
    expert_union: jax.Array  # [b] fp32
    expected: jax.Array  # [b] fp32
    off_chain: jax.Array  # [b] bool


@struct.dataclass
class Draft:
    tokens: jax.Array  # [b, B-1] proposals
    probs: jax.Array | None  # [b, B-1, V] the proposal distributions (rejection method only)
    draft_cache: KVCache | None  # with this round's context rows appended
    hidden: jax.Array | None = None  # [b, B, H] the draft's final-normed hidden states (route-ahead input)


# ----------------------------------------------------------------------------------------------------------
# requests -> static config + traced rows
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Prepared:
    """A validated request batch: the static `spec`, the right-padded prompt bucket and the traced rows.
    Rows past `num_prompts` pad the batch to its bucket (one-token prompts, done from the start)."""

    spec: SpecConfig
    tokens: np.ndarray  # [b, T] int32 (T = the prompt bucket)
    lengths: np.ndarray  # [b] int32
    params: RowParams  # numpy arrays
    key_data: np.ndarray  # [b, ...] uint32 base key per sequence
    key_fold: np.ndarray  # [b] int32: sequence i draws from fold_in(base key i, key_fold[i])
    num_prompts: int
    # [b, T] int32: the tokens' RoPE positions when the prefill is compressed (`prepare(kept=)`: each prompt's kept
    # tokens at their original positions, padding continuing after the last); None: slot positions
    positions: np.ndarray | None = dataclasses.field(default=None, kw_only=True)
    # [num_prompts] the prompts' lengths before compression (None: not compressed)
    prompt_lengths: np.ndarray | None = dataclasses.field(default=None, kw_only=True)


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Checked prompts, right-padded to the longest: ([b, T] int32, lengths [b])."""
    checked = rq.check_prompts(prompts, vocab_size)
    return rq.pad_prompts(checked, max(len(p) for p in checked), len(checked))


def prepare(pair, prompts, *, block_size: int | None = None, max_new_tokens, sampling=SamplingParams(),
            stop_ids=(), seed=0, buckets: rq.Buckets | None = None, kept=None) -> Prepared:
    """Validates a request batch at the Python boundary and maps it to bucketed shapes; with
    `buckets.capacity` set, to the capacity's fixed shapes (a `spec.prefill.CapacityPrepared`).

    kept: a compressed prefill (PFlash, `dflash_jax.pflash.compress`): one index list per prompt (None in the list:
    every token), strictly increasing and keeping the prompt's last token; the batch then holds the kept tokens
    and their original positions (`Prepared.positions`), and decoding continues at the original length.

    max_new_tokens, sampling, stop_ids, seed: one value for every prompt or one per prompt (stop_ids: a
    list of ids, or one list per prompt). Raises TypeError / ValueError naming the argument (a request that
    does not fit the capacity: one ValueError naming it and how to raise it)."""
    buckets = rq.DEFAULT_BUCKETS if buckets is None else buckets
    if not isinstance(buckets, rq.Buckets):
        raise TypeError(f"buckets must be a spec.requests.Buckets, got {type(buckets).__name__}")
    dcfg, tcfg = pair.draft_cfg, pair.target_cfg
    if block_size is None:
        block_size = dcfg.block_size
    if not rq.is_int(block_size) or not 1 <= block_size <= dcfg.block_size:
        raise ValueError(f"block size must be between 1 and the draft's trained block size {dcfg.block_size}, "
                         f"got {block_size!r}")
    block_size = int(block_size)
    checked = rq.check_prompts(prompts, tcfg.vocab_size)
    n = len(checked)
    budgets = rq.check_budgets(max_new_tokens, n)
    rows, method = rq.check_sampling(sampling, n)
    stops = rq.check_stop_ids(stop_ids, n, tcfg.vocab_size)
    seeds = rq.check_seeds(seed, n)
    original = np.array([len(p) for p in checked], np.int64)
    if kept is not None:
        kept = rq.check_kept(checked, kept)
        checked = [p[k] for p, k in zip(checked, kept)]
    lengths_real = np.array([len(p) for p in checked], np.int64)
    far = int(np.argmax(original + budgets))  # positions reach the original length + the budget
    max_pos = tcfg.max_position_embeddings
    if int(original[far] + budgets[far]) + block_size > max_pos:
        raise ValueError(f"prompt ({int(original[far])}) + max_new_tokens ({int(budgets[far])}) exceeds the "
                         f"target's {max_pos} positions (with the block size {block_size})"
                         + ("; a compressed prefill keeps the original positions" if kept is not None else ""))
    worst = int(np.argmax(lengths_real + budgets))
    batch = buckets.batch_size(n)
    prompt_len = buckets.prompt_len(int(lengths_real.max()))
    if buckets.fixed:  # every shape from the capacity: one program for any prompt and budget that fit
        need = int(lengths_real[worst] + budgets[worst]) + block_size
        max_len = output_len = buckets.capacity_rows(max_pos, need)
        if need > max_len:
            raise rq.capacity_error(need, buckets.capacity, max_pos,
                                    f"prompt ({int(lengths_real[worst])}) + max_new_tokens ({int(budgets[worst])}) + "
                                    f"block size ({block_size})")
    else:
        output_len = buckets.output_len(int(budgets.max()))
        max_len = min(buckets.cache_len(prompt_len + output_len + block_size), max_pos)
    prompt_len = min(prompt_len, max_len)
    tokens, lengths = rq.pad_prompts(checked, prompt_len, batch)
    pad = batch - n
    params = RowParams(
        budget=np.concatenate([budgets, np.ones(pad, np.int32)]),
        sampling=RowSampling.of(rows + [SamplingParams()] * pad),
        stop_ids=rq.pad_stop_ids(stops, buckets.stops_len(max(len(s) for s in stops)), batch),
    )
    if isinstance(seeds, int):
        base = seed_key_data(seeds)
        key_data = np.broadcast_to(base, (batch,) + base.shape).copy()
        key_fold = np.arange(batch, dtype=np.int32)
    else:
        key_data = np.stack([seed_key_data(s) for s in seeds + [0] * pad])
        key_fold = np.zeros(batch, np.int32)
    spec = SpecConfig(target=tcfg, draft=dcfg, block_size=block_size, max_len=max_len, output_len=output_len,
                      method=method, greedy_only=specialize_greedy() and all(r.greedy for r in rows))
    compressed = {}
    if kept is not None:
        compressed = dict(positions=rq.kept_positions(kept, prompt_len, batch), prompt_lengths=original.astype(np.int32))
    if buckets.fixed:
        from dflash_jax.spec.prefill import CapacityPrepared  # prefill builds on this module

        return CapacityPrepared(spec=spec, tokens=tokens, lengths=lengths, params=params, key_data=key_data,
                                key_fold=key_fold, num_prompts=n, chunk=buckets.chunk_len(max_len),
                                buffer=buckets.prompt_buffer(max_len), **compressed)
    return Prepared(spec=spec, tokens=tokens, lengths=lengths, params=params, key_data=key_data, key_fold=key_fold,
                    num_prompts=n, **compressed)


def make_spec(pair, prompts, *, block_size, max_new_tokens, sampling=SamplingParams()):
    """The form for callers that run their own prefill and call `start_state` without per-sequence settings
    (the offload loop): returns (spec, tokens [b, T] right-padded to the prompt bucket, lengths [b]), with
    the budget and sampling settings baked into `spec.static_request` (compiled per value)."""
    prep = prepare(pair, prompts, block_size=block_size, max_new_tokens=max_new_tokens, sampling=sampling)
    rq.check_int(max_new_tokens, "max_new_tokens", low=1, what="a positive integer")
    if not isinstance(sampling, SamplingParams):
        raise TypeError("make_spec takes one SamplingParams for the whole batch")
    spec = dataclasses.replace(prep.spec, static_request=StaticRequest(int(max_new_tokens), sampling))
    return spec, prep.tokens, prep.lengths


# ----------------------------------------------------------------------------------------------------------
# the round
# ----------------------------------------------------------------------------------------------------------

def split_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's key [b] split in two: (the keys carried on [b], the keys used now [b])."""
    split = jax.vmap(jax.random.split)(keys)
    return split[:, 0], split[:, 1]


# A row's key (`SpecState.key`) stays the same for its whole life; a round's draws come from two streams of it:
# the round's key, folded with the row's output length when the round starts (every round that commits starts at a
# new length, so no two rounds share one), for the draft's draws and the rejection rule; and, for the target's
# draws under the exact-match rule (what is committed), one key per OUTPUT POSITION, so the token at position p is
# drawn with the same key whatever the widths, proposers or rounds that reach it: a seeded sample does not depend on
# how its rounds were shaped (the serving engine's `--widths auto`, a tree, another block size).
_ROUND_STREAM, _POSITION_STREAM = 0, 1


def round_keys(state: "SpecState") -> jax.Array:
    """[b] this round's keys: each row's key, its round stream, folded with its output length."""
    return jax.vmap(lambda k, n: jax.random.fold_in(jax.random.fold_in(k, _ROUND_STREAM), n))(
        state.key, state.num_generated)


def position_draws(state: "SpecState", scores: jax.Array, offsets: jax.Array) -> jax.Array:
    """[b, W] int32: one draw per column from softmax(scores [b, W, V]), column j of row i drawn for output position
    `num_generated[i] + offsets[i, j]` with that position's key alone (`offsets` [b, W] or [1, W])."""
    offsets = jnp.broadcast_to(offsets, scores.shape[:2])

    def row(key, n, s, off):
        stream = jax.random.fold_in(key, _POSITION_STREAM)
        return jax.vmap(lambda o, x: jax.random.categorical(jax.random.fold_in(stream, n + o), x))(off, s)

    return jax.vmap(row)(state.key, state.num_generated, scores, offsets).astype(jnp.int32)


def emit_tokens(state: SpecState, accepted, bonus, proposals, spec: SpecConfig):
    """Writes d_1..d_a, bonus (cut by each sequence's budget and stop tokens) into the output; returns
    (state, produced)."""
    b, width = proposals.shape[0], spec.block_size
    n = spec.output_len
    j = jnp.arange(width)
    padded = jnp.concatenate([proposals, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(j[None] < accepted[:, None], padded, bonus[:, None])  # e_j for j <= a
    budget = state.params.budget
    remaining = budget - state.num_generated
    produced = jnp.minimum(accepted + 1, remaining)
    is_stop = _is_stop(emitted, state.params.stop_ids) & (j[None] < produced[:, None])
    first_stop = jnp.argmax(is_stop, axis=1)
    hit = jnp.any(is_stop, axis=1)
    produced = jnp.where(hit, first_stop + 1, produced)
    produced = jnp.where(state.done, 0, produced).astype(jnp.int32)
    cols = state.num_generated[:, None] + j[None]
    cols = jnp.where(j[None] < produced[:, None], cols, n)  # out of range: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], cols.shape)
    output = state.output.at[rows, cols].set(emitted, mode="drop")
    num_generated = state.num_generated + produced
    last = jnp.take_along_axis(emitted, jnp.maximum(produced - 1, 0)[:, None], axis=1)[:, 0]
    acceptance = state.acceptance.at[jnp.arange(b), jnp.where(state.done, n, state.rounds)].set(
        produced, mode="drop")
    new = state.replace(
        output=output,
        num_generated=num_generated,
        done=state.done | hit | (num_generated >= budget),
        anchor=jnp.where(produced > 0, last, state.anchor),
        acceptance=acceptance,
        rounds=state.rounds + (~state.done).astype(jnp.int32),
    )
    return new, produced


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """tokens [b, ...] against each sequence's stop ids [b, S] (-1 never matches)."""
    stops = stop_ids.reshape(stop_ids.shape[:1] + (1,) * (tokens.ndim - 1) + stop_ids.shape[1:])
    return jnp.any(tokens[..., None] == stops, axis=-1)


@stored_jit(static_argnames=("spec",))
def begin_arrays(target_w, draft_w, tokens, lengths, params, key_data, key_fold, spec: SpecConfig,
                 positions=None) -> SpecState:
    """The prefill of a batch from `prepare`'s arrays (right-padded tokens [b, T], lengths [b], per-row settings,
    key data and folds): the target forward, then `start_state`. Jitted; `begin_prepared` is its usual caller.
    positions [b, T]: the tokens' explicit RoPE positions (a compressed prefill, `dflash_jax.pflash`: the kept
    tokens at their original positions, padding continuing after the last); None: slot positions."""
    return prefill_rows(target_w, draft_w, tokens, lengths, params, key_data, key_fold, spec, positions)[0]


def prefill_rows(target_w, draft_w, tokens, lengths, params, key_data, key_fold, spec: SpecConfig, positions=None,
                 hold: int | None = None, cache_len: int | None = None):
    """`begin_arrays` (not jitted) that also returns the prefill's last logits [b, V] (the distribution the first
    token was drawn from: the server's logprobs and its `n` samples of one prompt read them). hold: `start_state`'s.
    cache_len (static): the slots of the rows' caches (default `spec.max_len`), at least the prompt's: rows that
    are copied into a larger state up to their lengths (the serving engine's insert) need no more, and an empty
    4096-slot cache costs its zeros."""
    fam = target_family(spec.target)
    keys = jax.vmap(lambda d, f: jax.random.fold_in(jax.random.wrap_key_data(d), f))(key_data, key_fold)
    cache = init_target_cache(spec.target, tokens.shape[0], cache_len or spec.max_len, target_w.embed.dtype,
                              verify_width=spec.block_size)
    out = fam.forward(target_w, tokens, cache, spec.target, num_valid=lengths, tap_layers=spec.taps, logits="last",
                      positions=positions)
    return (start_state(target_w, draft_w, out, lengths, None, keys, spec, params=params, context_positions=positions,
                        hold=hold, cache_len=cache_len), out.logits)


def start_state(target_w, draft_w, out, lengths, stop_ids, key, spec: SpecConfig,
                params: RowParams | None = None, context_positions: jax.Array | None = None,
                draft_cache: KVCache | None = None, hold: int | None = None,
                cache_len: int | None = None) -> SpecState:
    """The state after a prefill `out` (a ForwardOutput with "last" logits and the draft taps): the first
    token, the draft's context cache fed with the prompt taps. `target_w` is read for `embed.dtype` only.

    params: the per-sequence settings; None = `spec.static_request` for every sequence with the shared
    stop ids `stop_ids` [S] (the `make_spec` form). key: one key (sequence i draws from fold_in(key, i))
    or one key per sequence [b]. context_positions: [b, T] the prompt rows' RoPE positions when the prefill
    ran at explicit positions (`dflash_jax.pflash`), None = slot positions. draft_cache: the draft's context
    cache already fed with every prompt row (a chunked prefill, `spec.prefill`); `out.taps` are then not read.
    hold (static): the prompt rows' taps held as the state's pending context rows (as many columns as the prompt, a
    block at least; a hold of `hold` columns takes them), instead of appended to the draft's cache now (the serving
    engine's held context, which a drafting round appends first: a request that never drafts never pays the draft);
    only at slot positions, a prompt of at most `hold` rows.
    cache_len: the slots of a new draft cache (default `spec.max_len`; `prefill_rows`)."""
    b = lengths.shape[0]
    if params is None:
        if spec.static_request is None:
            raise ValueError("start_state needs per-sequence `params` (RowParams) or a spec from make_spec")
        params = spec.static_request.rows(b, stop_ids)
    if key.ndim == 0:
        key = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b))
    check_greedy_only(params.sampling.temperature, spec, "start_state")
    key, k_first = split_rows(key)
    first = next_token_rows(k_first, out.logits, params.sampling, spec.greedy_only)
    feat = spec.draft.num_taps * spec.target.hidden_size
    context, pending = jnp.zeros((b, spec.block_size, feat), target_w.embed.dtype), jnp.zeros((b,), jnp.int32)
    if hold is not None and spec.block_size > 1 and draft_cache is None and spec.taps:
        taps = draft_model.context_features(out.taps).astype(target_w.embed.dtype)
        if context_positions is not None or taps.shape[1] > hold:
            raise ValueError(f"a held prompt needs slot positions and at most {hold} rows, got {taps.shape[1]}")
        draft_cache = draft_model.init_draft_cache(spec.draft, b, cache_len or spec.max_len, draft_w.fc.dtype)
        # as wide as the prompt, a block at least: the serving engine's insert writes them into the leading columns
        # of the row's hold (`Layout.context_rows`), whose columns past the pending count are never read
        context = jnp.pad(taps, [(0, 0), (0, max(spec.block_size - taps.shape[1], 0)), (0, 0)])
        pending = jnp.asarray(lengths, jnp.int32)
    elif spec.block_size > 1 and draft_cache is None:
        draft_cache = draft_model.init_draft_cache(spec.draft, b, cache_len or spec.max_len, draft_w.fc.dtype)
        draft_cache = draft_model.append_context(
            draft_w, spec.draft, context_features=draft_model.context_features(out.taps), num_context=lengths,
            cache=draft_cache, positions=context_positions)
    elif spec.block_size == 1:
        draft_cache = None
    n = spec.output_len
    done = _is_stop(first, params.stop_ids) | (params.budget <= 1)
    return SpecState(
        target_cache=out.cache,
        draft_cache=draft_cache,
        anchor=first,
        context=context,
        num_context=pending,
        output=jnp.full((b, n), -1, jnp.int32).at[:, 0].set(first),
        num_generated=jnp.ones((b,), jnp.int32),
        done=done,
        acceptance=jnp.zeros((b, n), jnp.int32),
        rounds=jnp.zeros((b,), jnp.int32),
        params=params,
        key=key,
        last_accepted=jnp.zeros((b,), jnp.int32),
        last_bonus=jnp.zeros((b,), jnp.int32),
    )


def all_greedy(state: SpecState) -> jax.Array:
    """True when no live sequence samples: the sampling work of a round is then skipped (a real branch)."""
    return jnp.all(state.params.sampling.greedy | state.done)


def by_rows(state: SpecState, spec: SpecConfig, greedy, sampled):
    """`greedy()` where no live row of `state` samples, else `sampled()`: with `spec.greedy_only` statically (the
    sampling work is not compiled), otherwise a conditional on `all_greedy(state)`."""
    return by_sampling(spec.greedy_only, None if spec.greedy_only else all_greedy(state), greedy, sampled)


def check_greedy_only(temperature, spec: SpecConfig, where: str, done=None) -> None:
    """ValueError when `spec.greedy_only` and a concrete live row's temperature is not 0 (rows `done` aside): its
    program would decode it greedily without a word."""
    if not spec.greedy_only or not _concrete(temperature) or (done is not None and not _concrete(done)):
        return
    t = np.asarray(temperature)
    live = (t != 0) if done is None else (t != 0) & ~np.asarray(done)
    if live.any():
        i = int(np.argmax(live))
        raise ValueError(f"{where}: row {i} samples (temperature {float(t.reshape(-1)[i]):g}) but the spec was built "
                         "for greedy rows only (greedy_only=True): prepare the batch with its sampling settings, or "
                         "use a spec with greedy_only=False")


def draft_round(target_w, draft_w, state: SpecState, spec: SpecConfig) -> Draft:
    """B-1 proposals from one draft forward over [anchor, MASK x (B-1)] (empty when B == 1). Greedy
    sequences and the exact-match method propose the draft's argmax; sampled sequences under the rejection
    method draw from the draft's processed distribution q (kept in `Draft.probs`)."""
    check_state(state, spec)
    b = state.anchor.shape[0]
    gamma = spec.block_size - 1
    if gamma == 0:
        return Draft(tokens=jnp.zeros((b, 0), jnp.int32), probs=None, draft_cache=state.draft_cache)
    block = jnp.concatenate(
        [state.anchor[:, None], jnp.full((b, gamma), spec.draft.mask_token_id, jnp.int32)], axis=1)
    logits, hidden, draft_cache = draft_model.draft_forward(
        draft_w, spec.draft, embed=target_w.embed, lm_head=target_w.lm_head, block_tokens=block,
        context_features=state.context, num_context=state.num_context, cache=state.draft_cache)
    if spec.chain_head:
        return head_chain_draft(target_w, draft_w, state, spec, hidden, draft_cache)
    logits = logits[:, 1:]
    argmax = greedy_tokens(logits)
    if spec.method == "exact_match":
        return Draft(tokens=argmax, probs=None, draft_cache=draft_cache, hidden=hidden)
    rows = state.params.sampling

    def sampled():
        probs = sampling_probs(logits, rows)
        keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(round_keys(state))
        return jnp.where(rows.greedy[:, None], argmax, sample_probs_rows(keys, probs)), probs

    def greedy():
        return argmax, jnp.zeros(logits.shape, jnp.float32)

    tokens, probs = by_rows(state, spec, greedy, sampled)
    return Draft(tokens=tokens, probs=probs, draft_cache=draft_cache, hidden=hidden)


def head_chain_draft(target_w, draft_w, state: SpecState, spec: SpecConfig, hidden: jax.Array, draft_cache) -> Draft:
    """The chain's B-1 proposals from the draft's branch head (`models.draft.BranchHeadWeights`), position by
    position: d_k from the head's distribution at position k given d_{k-1} (d_0 = the anchor), over the one
    draft forward's hidden states. Greedy sequences and the exact-match method take the head's argmax; sampled
    sequences under the rejection method draw d_k from the head's processed distribution given their own
    d_{k-1}, which `Draft.probs` keeps: the proposal is autoregressive, so the rejection rule stays exact.

    A DFlash 2 draft's head is its candidate selector (`models.draft.SelectorWeights`): this is then the
    selector's chain, its path walked from the anchor, and a sampled d_k is drawn from softmax(score / T) over
    the K candidates (the request's top-k / top-p do not restrict it, as in z-lab's `dflash_generate`), kept as
    a vocabulary row that is 0 off the candidates, so the rejection rule applies unchanged."""
    head = getattr(draft_w, "branch_head", None)
    if head is None:
        raise ValueError("spec.chain_head needs a draft that carries a branch head (dflash_jax.pair.with_branch_head, "
                         "or a pair shipped with branch_head.safetensors) or a DFlash 2 candidate selector")
    rows = state.params.sampling
    if draft_model.is_selector(head):  # q over the candidates at the temperature only
        rows = RowSampling(temperature=rows.temperature, top_p=jnp.ones_like(rows.top_p),
                           top_k=jnp.zeros_like(rows.top_k))
    sampled = spec.method != "exact_match"
    gamma = spec.block_size - 1
    # per position a key of a stream no other draw of the round touches: fold_in(key, i) is split(key)[i] here,
    # and split(key)[1]'s children are the acceptance's uniforms, so fold_in(fold_in(key, 1), 0) would draw
    # d_1 with the very bits its acceptance test uses (measured: chi-square p ~ 1e-13 against the target)
    keys = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, 2), max(gamma, 1)))(round_keys(state))

    def step(prev, xs):
        h, k = xs
        logits = draft_model.branch_head_logits(head, h, prev, spec.draft, embed=target_w.embed,
                                                lm_head=target_w.lm_head)
        argmax = greedy_tokens(logits)
        if not sampled:
            return argmax, (argmax, jnp.zeros((prev.shape[0], 0), jnp.float32))

        def draw():
            probs = sampling_probs(logits[:, None], rows)[:, 0]
            drawn = sample_probs_rows(keys[:, k], probs[:, None])[:, 0]
            return jnp.where(rows.greedy, argmax, drawn), probs

        tok, probs = by_rows(state, spec, lambda: (argmax, jnp.zeros(logits.shape, jnp.float32)), draw)
        return tok, (tok, probs)

    _, (tokens, probs) = jax.lax.scan(step, state.anchor, (jnp.swapaxes(hidden[:, 1:gamma + 1], 0, 1),
                                                           jnp.arange(gamma, dtype=jnp.int32)))
    tokens = jnp.swapaxes(tokens, 0, 1)
    probs = jnp.swapaxes(probs, 0, 1) if sampled else None
    return Draft(tokens=tokens, probs=probs, draft_cache=draft_cache, hidden=hidden)


def verify_round(target_w, state: SpecState, draft: Draft, spec: SpecConfig) -> SpecState:
    """Width-B target forward over [anchor, proposals], acceptance, emission, commit/rollback.
    Called eagerly with concrete arrays it checks the draft tokens (ids inside the vocabulary, shape
    [b, B-1]); inside jit (`verify_round_jit`, the loop) it trusts them."""
    _check_draft(state, draft, spec)
    fam = target_family(spec.target)
    out = fam.forward(target_w, verify_block(state, draft), state.target_cache, spec.target, tap_layers=spec.taps,
                      logits="all")
    return commit_verify(state, draft, out, spec)


def verify_block(state: SpecState, draft: Draft) -> jax.Array:
    """[b, B] the tokens a verify runs: `[anchor, d_1 .. d_{B-1}]`."""
    return jnp.concatenate([state.anchor[:, None], draft.tokens], axis=1)


def commit_verify(state: SpecState, draft: Draft, out, spec: SpecConfig) -> SpecState:
    """Acceptance, emission and commit/rollback from the verify forward's output `out` (a ForwardOutput of
    `verify_block(state, draft)` with "all" logits and the draft taps, run on `state.target_cache`).
    Greedy sequences accept the longest prefix matching the target's argmax; sampled ones use
    `spec.method` (exact-match against the target's own draws, or rejection sampling)."""
    fam = target_family(spec.target)
    start = state.target_cache.lengths
    _, k_acc = split_rows(round_keys(state))
    rows = state.params.sampling
    greedy = rows.greedy
    target_argmax = greedy_tokens(out.logits)
    if spec.method == "exact_match" or spec.block_size == 1:
        def sampled():  # block row j draws output position num_generated + j (`position_draws`)
            scores = processed_scores(out.logits, rows)
            draws = position_draws(state, scores, jnp.arange(scores.shape[1])[None])
            return jnp.where(greedy[:, None], target_argmax, draws)

        target_tokens = by_rows(state, spec, lambda: target_argmax, sampled)
        accepted, bonus = match_accept(draft.tokens, target_tokens)
    else:
        greedy_accepted, greedy_bonus = match_accept(draft.tokens, target_argmax)

        def sampled():
            acc, bon = rejection_accept(k_acc, draft.tokens, sampling_probs(out.logits, rows), draft.probs)
            return jnp.where(greedy, greedy_accepted, acc), jnp.where(greedy, greedy_bonus, bon)

        accepted, bonus = by_rows(state, spec, lambda: (greedy_accepted, greedy_bonus), sampled)
    new, produced = emit_tokens(state, accepted, bonus, draft.tokens, spec)
    context = draft_model.context_features(out.taps) if spec.taps else state.context
    return new.replace(
        target_cache=fam.rollback(out.cache, start + produced),
        draft_cache=draft.draft_cache,
        context=context,
        num_context=produced,
        last_accepted=accepted,
        last_bonus=bonus,
    )


draft_round_jit = stored_jit(draft_round, static_argnames=("spec",))
verify_round_jit = stored_jit(verify_round, static_argnames=("spec",), donate_argnames=("state",))


def _concrete(x) -> bool:
    return x is not None and not isinstance(x, jax.core.Tracer)


def check_state(state: SpecState, spec: SpecConfig) -> None:
    """TypeError / ValueError when `state` and `spec` are not a SpecState and the SpecConfig it was built for."""
    if not isinstance(state, SpecState):
        raise TypeError(f"state must be a SpecState (from begin), got {type(state).__name__}")
    if not isinstance(spec, SpecConfig):
        raise TypeError(f"spec must be the SpecConfig that begin returned, got {type(spec).__name__}")
    if _concrete(state.output) and state.output.shape[1] != spec.output_len:
        raise ValueError(f"this state was built for another spec (output buffer {state.output.shape[1]}, spec "
                         f"{spec.output_len}): pass the spec that begin returned with it")
    check_greedy_only(state.params.sampling.temperature, spec, "check_state", state.done)


def _check_draft(state: SpecState, draft: Draft, spec: SpecConfig) -> None:
    """Eager calls only: a verify of out-of-vocabulary proposals would index past the logits and emit a
    wrong bonus without a word."""
    check_state(state, spec)
    if not isinstance(draft, Draft):
        raise TypeError(f"draft must be a Draft (from draft_round), got {type(draft).__name__}")
    tokens = draft.tokens
    if not _concrete(tokens):
        return
    b, gamma = state.anchor.shape[0], spec.block_size - 1
    if tuple(tokens.shape) != (b, gamma):
        raise ValueError(f"draft.tokens must have shape [batch, block_size - 1] = {[b, gamma]}, "
                         f"got {list(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"draft.tokens must be integer token ids, got dtype {tokens.dtype}")
    values = np.asarray(tokens)
    vocab = spec.target.vocab_size
    bad = (values < 0) | (values >= vocab)
    if bad.any():
        i, j = map(int, np.argwhere(bad)[0])
        raise ValueError(f"draft.tokens[{i}, {j}] = {int(values[i, j])} is outside the vocabulary [0, {vocab}): "
                         "proposals must be token ids of the target")
    if spec.method == "rejection" and gamma > 0 and draft.probs is None:
        raise ValueError("the rejection method needs draft.probs (the proposal distributions)")


def begin(pair, prompts, *, block_size: int | None = None, max_new_tokens, sampling=SamplingParams(),
          stop_ids=(), seed=0, buckets: rq.Buckets | None = None):
    """Validates the request batch (`prepare`), prefills it, and returns (SpecConfig, SpecState).

    The state has one row per prompt (plus padding rows, done from the start, when `buckets.pad_batch`).
    max_new_tokens, sampling, stop_ids, seed: one value for all prompts or one per prompt."""
    prep = prepare(pair, prompts, block_size=block_size, max_new_tokens=max_new_tokens, sampling=sampling,
                   stop_ids=stop_ids, seed=seed, buckets=buckets)
    return prep.spec, begin_prepared(pair, prep)


def begin_prepared(pair, prep: Prepared) -> SpecState:
    """The prefill of a `prepare`d batch: one compiled program per spec and prompt bucket, or, for a batch
    prepared in capacity mode, one per capacity (chunks of the fixed prompt buffer, `spec.prefill.capacity_begin`)."""
    from dflash_jax import compile_cache
    from dflash_jax.spec.prefill import CapacityPrepared, capacity_begin_jit

    check_greedy_only(prep.params.sampling.temperature, prep.spec, "begin")
    compile_cache.ensure_enabled()
    if isinstance(prep, CapacityPrepared):
        return capacity_begin_jit(pair.target, pair.draft, prep.prompt_buffer(), prep.lengths, prep.params,
                                  prep.key_data, prep.key_fold, prep.spec, chunk=prep.chunk,
                                  positions=prep.position_buffer())
    return begin_arrays(pair.target, pair.draft, prep.tokens, prep.lengths, prep.params, prep.key_data, prep.key_fold,
                        prep.spec, positions=prep.positions)
