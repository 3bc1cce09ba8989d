"""Prefill by chunks: a long prompt enters the caches C tokens at a time, with the state `begin` would build.

  pre = prefill_start(tw, dw, tokens[:, :C], num_valid, spec)       the first chunk starts the caches
  pre = prefill_chunk(tw, dw, pre, tokens[:, kC:(k+1)C], num_valid, spec)   each next chunk extends them
  state = prefill_finish(tw, dw, pre, params, key_data, key_fold, spec)     the first token, as `begin`

A chunk of C tokens (right-padded, `num_valid` [b] real ones) runs the target forward on the cache at its
positions `lengths + [0, C)` (slot = position: attention reads the earlier chunks' rows like any extension;
gpt-oss's sliding windows and sinks mask by position; Qwen3.5's Gated DeltaNet layers carry their conv tail and
recurrent state from chunk to chunk, a forward wider than the rollback width committing them, a narrower one
keeping its rows for the next forward to replay), and appends the chunk's draft taps to the draft's context
cache (`models.draft.append_context`). `Prefill.logits` holds each row's logits after its last real token so
far (a row with no real token in a chunk keeps its own), so after the last chunk they are the prefill's "last"
logits, and `prefill_finish` is `session.start_state` on them: the same first token (same key split), the same
caches (up to float rounding of differently shaped matmuls) as the one-shot `begin`.

Everything here is pure and jittable; `chunked_begin` is the whole prefill of a batch as one `lax.scan` over
its chunks (the one-shot `begin_arrays`'s signature plus the static chunk size). The serving engine runs the pieces
one chunk per round (`serve.engine`), so a long prompt never stalls the live requests for more than one chunk.

`capacity_begin` is the capacity mode's prefill (`Buckets(capacity=N)`, `CapacityPrepared`): the prompts sit in
a buffer of fixed width (the capacity in whole chunks) and a `lax.fori_loop` with a traced trip count runs
ceil(longest prompt / C) chunks, so a 9-token and a 1000-token prompt run one compiled program (one chunk and
eight of 128). `session.begin_prepared` dispatches a `CapacityPrepared` batch to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax.cache import KVCache
from dflash_jax.models import draft as draft_model
from dflash_jax.models.decoder import ForwardOutput
from dflash_jax.spec import requests as rq
from dflash_jax.spec.session import (
    Prepared, RowParams, SpecConfig, SpecState, init_target_cache, start_state, target_family,
)
from dflash_jax.stored import stored_jit


@struct.dataclass
class Prefill:
    """A prefill in progress: the target cache and the draft's context cache holding the chunks so far, and
    each row's fp32 logits after its last real token so far [b, V]."""

    target_cache: Any
    draft_cache: KVCache | None
    logits: jax.Array

    @property
    def lengths(self) -> jax.Array:
        """[b] prompt tokens prefilled so far."""
        return self.target_cache.lengths


def prefill_init(target_w, draft_w, batch: int, spec: SpecConfig) -> Prefill:
    """Empty caches of `batch` rows (the shapes `begin` builds for `spec`) and zero logits."""
    cache = init_target_cache(spec.target, batch, spec.max_len, target_w.embed.dtype, verify_width=spec.block_size)
    draft_cache = None
    if spec.block_size > 1:
        draft_cache = draft_model.init_draft_cache(spec.draft, batch, spec.max_len, draft_w.fc.dtype)
    return Prefill(target_cache=cache, draft_cache=draft_cache,
                   logits=jnp.zeros((batch, spec.target.vocab_size), jnp.float32))


def prefill_chunk(target_w, draft_w, pre: Prefill, tokens: jax.Array, num_valid: jax.Array,
                  spec: SpecConfig, positions: jax.Array | None = None) -> Prefill:
    """Extends the prefill by one chunk `tokens` [b, C] (row i's first `num_valid[i]` are real, 0 allowed): the
    target forward writes them at each row's length, their draft taps join the draft's context. positions [b, C]:
    the chunk's explicit RoPE positions (a compressed prefill, `dflash_jax.pflash`: the kept tokens at their
    original positions; the caches then carry each row's `position_offset`); None: slot positions."""
    num_valid = jnp.asarray(num_valid, jnp.int32)
    fam = target_family(spec.target)
    out = fam.forward(target_w, tokens, pre.target_cache, spec.target, num_valid=num_valid, tap_layers=spec.taps,
                      logits="last", positions=positions)
    return prefill_absorb(draft_w, pre, out, num_valid, spec, positions)


def prefill_absorb(draft_w, pre: Prefill, out, num_valid: jax.Array, spec: SpecConfig,
                   positions: jax.Array | None = None) -> Prefill:
    """The prefill after a chunk's target forward `out` (a ForwardOutput with "last" logits and the draft taps, run
    by any placement: the resident forward, or layer by layer with offloaded experts): its taps join the draft's
    context (at `positions` when the forward ran at explicit ones), each row with a real token keeps the chunk's
    last logits."""
    num_valid = jnp.asarray(num_valid, jnp.int32)
    draft_cache = pre.draft_cache
    if draft_cache is not None:
        draft_cache = draft_model.append_context(draft_w, spec.draft,
                                                 context_features=draft_model.context_features(out.taps),
                                                 num_context=num_valid, cache=draft_cache, positions=positions)
    logits = jnp.where((num_valid > 0)[:, None], out.logits.astype(jnp.float32), pre.logits)
    return Prefill(target_cache=out.cache, draft_cache=draft_cache, logits=logits)


def prefill_start(target_w, draft_w, tokens: jax.Array, num_valid: jax.Array, spec: SpecConfig,
                  positions: jax.Array | None = None) -> Prefill:
    """The first chunk: `prefill_chunk` on empty caches."""
    return prefill_chunk(target_w, draft_w, prefill_init(target_w, draft_w, tokens.shape[0], spec), tokens,
                         num_valid, spec, positions)


def prefill_finish(target_w, draft_w, pre: Prefill, params: RowParams, key_data, key_fold,
                   spec: SpecConfig) -> SpecState:
    """The state `begin` returns after the whole prompt is in (`session.start_state` on the last logits, with
    the draft's context cache the chunks fed): keys `fold_in(key(key_data[i]), key_fold[i])` as `begin_arrays`."""
    keys = jax.vmap(lambda d, f: jax.random.fold_in(jax.random.wrap_key_data(d), f))(key_data, key_fold)
    out = ForwardOutput(logits=pre.logits, taps=(), router_experts=(), cache=pre.target_cache)
    return start_state(target_w, draft_w, out, pre.lengths, None, keys, spec, params=params,
                       draft_cache=pre.draft_cache)


def chunked_begin(target_w, draft_w, tokens, lengths, params: RowParams, key_data, key_fold, spec: SpecConfig,
                  chunk: int) -> SpecState:
    """`session.begin_arrays` by chunks of `chunk` tokens (static): the prompts [b, T] (right-padded, `lengths` [b]
    real) run as ceil(T / chunk) chunks, the first starting the caches and the rest one `lax.scan` step each;
    a shorter prompt's chunks past its end are all padding and change nothing of its row."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    b, t = tokens.shape
    n = -(-t // chunk)
    tokens = jnp.pad(jnp.asarray(tokens, jnp.int32), ((0, 0), (0, n * chunk - t)))
    lengths = jnp.asarray(lengths, jnp.int32)
    valid = jnp.clip(lengths[None, :] - chunk * jnp.arange(n, dtype=jnp.int32)[:, None], 0, chunk)  # [n, b]
    pieces = tokens.reshape(b, n, chunk).transpose(1, 0, 2)  # [n, b, C]
    pre = prefill_start(target_w, draft_w, pieces[0], valid[0], spec)
    if n > 1:
        def step(carry, xs):
            return prefill_chunk(target_w, draft_w, carry, xs[0], xs[1], spec), None

        pre, _ = jax.lax.scan(step, pre, (pieces[1:], valid[1:]))
    return prefill_finish(target_w, draft_w, pre, params, key_data, key_fold, spec)


def capacity_begin(target_w, draft_w, tokens, lengths, params: RowParams, key_data, key_fold, spec: SpecConfig,
                   chunk: int, positions=None) -> SpecState:
    """`session.begin_arrays` in chunks of `chunk` tokens (static) with the chunk count traced: the prompts [b, W]
    (right-padded, `lengths` [b] real; W a multiple of `chunk`) run as ceil(max(lengths) / chunk) chunks of one
    `lax.fori_loop`, so the compiled program depends on W, never on the prompts. A chunk past a shorter prompt's
    end is all padding for its row and changes nothing of it (as in `chunked_begin`). positions [b, W]: the
    tokens' explicit RoPE positions (a compressed prefill), sliced with each chunk; None: slot positions."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    b, w = tokens.shape
    if w % chunk:
        raise ValueError(f"the prompt buffer ({w} columns) must hold whole chunks of {chunk}")
    tokens = jnp.asarray(tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    positions = None if positions is None else jnp.asarray(positions, jnp.int32)
    count = (jnp.max(lengths) + chunk - 1) // chunk

    def step(k, pre):
        start = k * chunk
        piece = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        at = None if positions is None else jax.lax.dynamic_slice_in_dim(positions, start, chunk, axis=1)
        return prefill_chunk(target_w, draft_w, pre, piece, jnp.clip(lengths - start, 0, chunk), spec, at)

    pre = prefill_init(target_w, draft_w, b, spec)
    if positions is not None:  # the loop's carry holds the offsets every chunk at explicit positions sets
        zeros = jnp.zeros((b,), jnp.int32)
        pre = pre.replace(target_cache=pre.target_cache.replace(position_offset=zeros),
                          draft_cache=None if pre.draft_cache is None
                          else pre.draft_cache.replace(position_offset=zeros))
    pre = jax.lax.fori_loop(0, count, step, pre)
    return prefill_finish(target_w, draft_w, pre, params, key_data, key_fold, spec)


@dataclasses.dataclass(frozen=True)
class CapacityPrepared(Prepared):
    """A batch `session.prepare`d in capacity mode (`Buckets(capacity=N)`): `spec` holds the capacity's cache rows
    and output columns; `tokens` are the prompts right-padded to their prompt bucket (what one-shot prefills
    read), and `begin_prepared` pads them into the fixed prompt buffer of `buffer` columns and prefills it in
    chunks of `chunk` tokens (`capacity_begin`)."""

    chunk: int
    buffer: int

    def prompt_buffer(self) -> np.ndarray:
        """[b, buffer] int32: the prompts in the capacity's prompt buffer."""
        return np.pad(self.tokens, ((0, 0), (0, self.buffer - self.tokens.shape[1])))

    def position_buffer(self) -> np.ndarray | None:
        """[b, buffer] int32: a compressed batch's positions in the prompt buffer's shape (None: slot positions)."""
        return None if self.positions is None else rq.extend_positions(self.positions, self.buffer)


# jitted forms (spec and chunk static); the engine's per-round pieces donate the prefill they extend
chunked_begin_jit = stored_jit(chunked_begin, static_argnames=("spec", "chunk"))
capacity_begin_jit = stored_jit(capacity_begin, static_argnames=("spec", "chunk"))
prefill_start_jit = stored_jit(prefill_start, static_argnames=("spec",))
prefill_chunk_jit = stored_jit(prefill_chunk, static_argnames=("spec",), donate_argnames=("pre",))
prefill_absorb_jit = stored_jit(prefill_absorb, static_argnames=("spec",), donate_argnames=("pre",))
prefill_init_jit = stored_jit(prefill_init, static_argnames=("batch", "spec"))


def _finish_apart(target_w, draft_w, pre: Prefill, logits, params: RowParams, key_data, key_fold,
                  spec: SpecConfig) -> SpecState:
    return prefill_finish(target_w, draft_w, pre.replace(logits=logits), params, key_data, key_fold, spec)


_finish_apart_jit = stored_jit(_finish_apart, static_argnames=("spec",), donate_argnames=("pre",))


def prefill_finish_jit(target_w, draft_w, pre: Prefill, params: RowParams, key_data, key_fold,
                       spec: SpecConfig) -> SpecState:
    """`prefill_finish` jitted, the prefill's caches donated (in place) but not its logits: the caller may keep them
    (the serving engine reads them for the first token's log-probs), and no result has their shape to reuse them."""
    return _finish_apart_jit(target_w, draft_w, pre.replace(logits=None), pre.logits, params, key_data, key_fold,
                             spec)

__all__ = ["CapacityPrepared", "Prefill", "prefill_absorb", "prefill_absorb_jit", "prefill_init_jit", "capacity_begin", "capacity_begin_jit", "chunked_begin", "chunked_begin_jit",
           "prefill_chunk", "prefill_chunk_jit", "prefill_finish", "prefill_finish_jit", "prefill_init", "prefill_start",
           "prefill_start_jit"]
