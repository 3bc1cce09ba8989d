"""One speculative round as pure functions over pytrees: `begin`, `draft_round`, `verify_round`.

  state = begin(pair, prompts, ...)          prefill, first token (the first anchor), draft context
  draft = draft_round(pair, state)           B-1 proposals from one draft forward
  state = verify_round(pair, state, draft)   width-B target forward, accept, commit/rollback

Every array has a static shape (batch b, block B, output budget N): a verify is always width B and caches
are fixed-size buffers with length counters, so the same compiled round serves every round and every
sequence of the batch, each at its own length. Sequences that are done keep flowing through the round
with nothing committed.

Round arithmetic for one sequence whose target cache holds `start` committed tokens:
  block   = [anchor, d_1 .. d_{B-1}] at positions start .. start+B-1
  a       = accepted proposals (0 .. B-1), bonus = the target's token after d_a
  emitted = d_1 .. d_a, bonus, cut at the output budget and after the first stop token (`produced` <= a+1)
  commit  = target cache rolled back to start + produced (the anchor and d_1 .. d_{produced-1});
            the draft's next context rows are the verify taps of those rows; next anchor = last emitted.
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
from dflash_jax.config import DraftConfig, GptOssConfig, Qwen3Config
from dflash_jax.models import draft as draft_model
from dflash_jax.spec.accept import match_accept, rejection_accept
from dflash_jax.spec.sampling import SamplingParams, next_token, sample_from, sampling_probs


def target_family(cfg):
    """The model module of a target config: `init_cache`, `forward`, `rollback`; weights with
    `.embed` [V, H] and `.lm_head` [H, V] (None when tied)."""
    from dflash_jax.config import Qwen3_5Config

    if isinstance(cfg, Qwen3Config):
        from dflash_jax.models import qwen3

        return qwen3
    if isinstance(cfg, GptOssConfig):
        from dflash_jax.models import gpt_oss

        return gpt_oss
    if isinstance(cfg, Qwen3_5Config):
        from dflash_jax.models import qwen3_5

        return qwen3_5
    raise TypeError(f"no target family for {type(cfg).__name__}")


def init_target_cache(cfg, batch: int, max_len: int, dtype, *, verify_width: int):
    """A target cache that can roll a width-`verify_width` forward back to any prefix. Linear-attention
    families (Qwen3.5) keep the verify block's inputs for that, sized by the verify width."""
    fam = target_family(cfg)
    if fam.__name__.endswith("qwen3_5"):
        return fam.init_cache(cfg, batch, max_len, dtype, rollback_width=verify_width)
    return fam.init_cache(cfg, batch, max_len, dtype)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static settings of a speculative run (a jit static argument)."""

    target: Any
    draft: DraftConfig
    block_size: int
    max_new_tokens: int
    max_len: int
    sampling: SamplingParams = SamplingParams()

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(self.draft.target_layer_ids) if self.block_size > 1 else ()


@struct.dataclass
class SpecState:
    target_cache: Any
    draft_cache: KVCache | None
    anchor: jax.Array  # [b] last emitted token: slot 0 of the next block
    context: jax.Array  # [b, B, F] target taps of committed rows the draft has not seen yet
    num_context: jax.Array  # [b]
    output: jax.Array  # [b, N] emitted tokens, -1 past num_generated
    num_generated: jax.Array  # [b]
    done: jax.Array  # [b] bool
    acceptance: jax.Array  # [b, N] tokens emitted per round
    rounds: jax.Array  # [b] rounds run while not done
    stop_ids: jax.Array  # [S]
    key: jax.Array
    last_accepted: jax.Array  # [b] proposals accepted in the last round (trace)
    last_bonus: jax.Array  # [b] the last round's bonus token (trace)


@struct.dataclass
class Draft:
    tokens: jax.Array  # [b, B-1] proposals
    probs: jax.Array | None  # [b, B-1, V] the proposal distributions (rejection mode only)
    draft_cache: KVCache | None  # with this round's context rows appended
    hidden: jax.Array | None = None  # [b, B, H] the draft's final-normed hidden states (route-ahead input)


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    from dflash_jax.decode import pad_prompts

    return pad_prompts(prompts, vocab_size)


def _emit(state: SpecState, accepted, bonus, proposals, spec: SpecConfig):
    """Writes d_1..d_a, bonus (cut by budget and stop tokens) into the output; returns (state, produced)."""
    b, width = proposals.shape[0], spec.block_size
    j = jnp.arange(width)
    padded = jnp.concatenate([proposals, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(j[None] < accepted[:, None], padded, bonus[:, None])  # e_j for j <= a
    remaining = spec.max_new_tokens - state.num_generated
    produced = jnp.minimum(accepted + 1, remaining)
    is_stop = jnp.isin(emitted, state.stop_ids) & (j[None] < produced[:, None])
    first_stop = jnp.argmax(is_stop, axis=1)
    hit = jnp.any(is_stop, axis=1)
    produced = jnp.where(hit, first_stop + 1, produced)
    produced = jnp.where(state.done, 0, produced).astype(jnp.int32)
    cols = state.num_generated[:, None] + j[None]
    cols = jnp.where(j[None] < produced[:, None], cols, spec.max_new_tokens)  # out of range: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], cols.shape)
    output = state.output.at[rows, cols].set(emitted, mode="drop")
    num_generated = state.num_generated + produced
    last = jnp.take_along_axis(emitted, jnp.maximum(produced - 1, 0)[:, None], axis=1)[:, 0]
    acceptance = state.acceptance.at[jnp.arange(b), jnp.where(state.done, spec.max_new_tokens, state.rounds)].set(
        produced, mode="drop")
    new = state.replace(
        output=output,
        num_generated=num_generated,
        done=state.done | hit | (num_generated >= spec.max_new_tokens),
        anchor=jnp.where(produced > 0, last, state.anchor),
        acceptance=acceptance,
        rounds=state.rounds + (~state.done).astype(jnp.int32),
    )
    return new, produced


@functools.partial(jax.jit, static_argnames=("spec",))
def _begin(target_w, draft_w, tokens, lengths, stop_ids, key, spec: SpecConfig) -> SpecState:
    fam = target_family(spec.target)
    cache = init_target_cache(spec.target, tokens.shape[0], spec.max_len, target_w.embed.dtype,
                              verify_width=spec.block_size)
    out = fam.forward(target_w, tokens, cache, spec.target, num_valid=lengths, tap_layers=spec.taps, logits="last")
    return start_state(target_w, draft_w, out, lengths, stop_ids, key, spec)


def start_state(target_w, draft_w, out, lengths, stop_ids, key, spec: SpecConfig) -> SpecState:
    """The state after a prefill `out` (a ForwardOutput with "last" logits and the draft taps): the first
    token, the draft's context cache fed with the prompt taps. `target_w` is read for `embed.dtype` only."""
    b = lengths.shape[0]
    key, k_first = jax.random.split(key)
    first = next_token(k_first, out.logits, spec.sampling)
    feat = spec.draft.num_taps * spec.target.hidden_size
    draft_cache = None
    if spec.block_size > 1:
        draft_cache = draft_model.init_draft_cache(spec.draft, b, spec.max_len, draft_w.fc.dtype)
        draft_cache = draft_model.append_context(
            draft_w, spec.draft, context_features=draft_model.context_features(out.taps), num_context=lengths,
            cache=draft_cache)
    n = spec.max_new_tokens
    done = jnp.isin(first, stop_ids) | (n <= 1)
    return SpecState(
        target_cache=out.cache,
        draft_cache=draft_cache,
        anchor=first,
        context=jnp.zeros((b, spec.block_size, feat), target_w.embed.dtype),
        num_context=jnp.zeros((b,), jnp.int32),
        output=jnp.full((b, n), -1, jnp.int32).at[:, 0].set(first),
        num_generated=jnp.ones((b,), jnp.int32),
        done=done,
        acceptance=jnp.zeros((b, n), jnp.int32),
        rounds=jnp.zeros((b,), jnp.int32),
        stop_ids=stop_ids,
        key=key,
        last_accepted=jnp.zeros((b,), jnp.int32),
        last_bonus=jnp.zeros((b,), jnp.int32),
    )


def draft_round(target_w, draft_w, state: SpecState, spec: SpecConfig) -> Draft:
    """B-1 proposals from one draft forward over [anchor, MASK x (B-1)] (empty when B == 1)."""
    b = state.anchor.shape[0]
    gamma = spec.block_size - 1
    if gamma == 0:
        return Draft(tokens=jnp.zeros((b, 0), jnp.int32), probs=None, draft_cache=state.draft_cache)
    block = jnp.concatenate(
        [state.anchor[:, None], jnp.full((b, gamma), spec.draft.mask_token_id, jnp.int32)], axis=1)
    logits, hidden, draft_cache = draft_model.draft_forward(
        draft_w, spec.draft, embed=target_w.embed, lm_head=target_w.lm_head, block_tokens=block,
        context_features=state.context, num_context=state.num_context, cache=state.draft_cache)
    logits = logits[:, 1:]
    if spec.sampling.greedy or spec.sampling.mode == "exact_match":
        return Draft(tokens=jnp.argmax(logits, axis=-1).astype(jnp.int32), probs=None, draft_cache=draft_cache,
                     hidden=hidden)
    probs = sampling_probs(logits, spec.sampling)
    key = jax.random.fold_in(state.key, 1)
    return Draft(tokens=sample_from(key, probs), probs=probs, draft_cache=draft_cache, hidden=hidden)


def verify_round(target_w, state: SpecState, draft: Draft, spec: SpecConfig) -> SpecState:
    """Width-B target forward over [anchor, proposals], acceptance, emission, commit/rollback."""
    fam = target_family(spec.target)
    out = fam.forward(target_w, verify_block(state, draft), state.target_cache, spec.target, tap_layers=spec.taps,
                      logits="all")
    return commit_verify(state, draft, out, spec)


def verify_block(state: SpecState, draft: Draft) -> jax.Array:
    """[b, B] the tokens a verify runs: `[anchor, d_1 .. d_{B-1}]`."""
    return jnp.concatenate([state.anchor[:, None], draft.tokens], axis=1)


def commit_verify(state: SpecState, draft: Draft, out, spec: SpecConfig) -> SpecState:
    """Acceptance, emission and commit/rollback from the verify forward's output `out` (a ForwardOutput of
    `verify_block(state, draft)` with "all" logits and the draft taps, run on `state.target_cache`)."""
    fam = target_family(spec.target)
    start = state.target_cache.lengths
    key, k_acc = jax.random.split(state.key)
    if spec.sampling.greedy:
        accepted, bonus = match_accept(draft.tokens, jnp.argmax(out.logits, axis=-1).astype(jnp.int32))
    else:
        probs = sampling_probs(out.logits, spec.sampling)
        if spec.sampling.mode == "exact_match" or spec.block_size == 1:
            accepted, bonus = match_accept(draft.tokens, sample_from(k_acc, probs))
        else:
            accepted, bonus = rejection_accept(k_acc, draft.tokens, probs, draft.probs)
    new, produced = _emit(state.replace(key=key), accepted, bonus, draft.tokens, spec)
    context = draft_model.context_features(out.taps) if spec.taps else state.context
    return new.replace(
        target_cache=fam.rollback(out.cache, start + produced),
        draft_cache=draft.draft_cache,
        context=context,
        num_context=produced,
        last_accepted=accepted,
        last_bonus=bonus,
    )


def spec_round(target_w, draft_w, state: SpecState, spec: SpecConfig) -> SpecState:
    return verify_round(target_w, state, draft_round(target_w, draft_w, state, spec), spec)


draft_round_jit = jax.jit(draft_round, static_argnames=("spec",))
verify_round_jit = jax.jit(verify_round, static_argnames=("spec",), donate_argnames=("state",))


def begin(pair, prompts: Sequence[Sequence[int]], *, block_size: int | None = None, max_new_tokens: int,
          sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (), seed: int = 0):
    """Validates inputs, prefills, and returns (SpecConfig, SpecState)."""
    spec, tokens, lengths = make_spec(pair, prompts, block_size=block_size, max_new_tokens=max_new_tokens,
                                      sampling=sampling)
    stops = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
    state = _begin(pair.target, pair.draft, jnp.asarray(tokens), jnp.asarray(lengths), stops,
                   jax.random.key(seed), spec)
    return spec, state


def make_spec(pair, prompts, *, block_size, max_new_tokens, sampling):
    dcfg, tcfg = pair.draft_cfg, pair.target_cfg
    block_size = dcfg.block_size if block_size is None else block_size
    if not isinstance(block_size, int) or not 1 <= block_size <= dcfg.block_size:
        raise ValueError(f"block size must be between 1 and the draft's trained block size {dcfg.block_size}, "
                         f"got {block_size}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    tokens, lengths = validate_prompts(prompts, tcfg.vocab_size)
    max_len = int(lengths.max()) + max_new_tokens + block_size
    if max_len > tcfg.max_position_embeddings:
        raise ValueError(f"prompt ({int(lengths.max())}) + max_new_tokens ({max_new_tokens}) exceeds the target's "
                         f"{tcfg.max_position_embeddings} positions")
    spec = SpecConfig(target=tcfg, draft=dcfg, block_size=block_size, max_new_tokens=max_new_tokens,
                      max_len=max_len, sampling=sampling)
    return spec, tokens, lengths
