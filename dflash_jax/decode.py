"""Plain (non-speculative) greedy decoding of a target: the baseline every speculative run is checked
against, and the reference for "greedy speculative output equals the target's own greedy output".

`prefill` runs a right-padded batch of prompts; `decode_loop` is one jitted `lax.while_loop` that feeds
one token per step with static shapes, writes into a fixed-size output buffer and stops per sequence at a
stop token or `max_new_tokens`.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax.config import Qwen3Config


@struct.dataclass
class DecodeState:
    tokens: jax.Array  # [b, max_new] generated ids (-1 past the end)
    num_generated: jax.Array  # [b]
    done: jax.Array  # [b] bool
    cache: Any  # the target family's cache
    step: jax.Array  # scalar


def pad_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts into [b, T] int32 and returns (tokens, lengths); validates ids and lengths."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for i, p in enumerate(prompts):
        arr = np.asarray(p, np.int64)
        if arr.min() < 0 or arr.max() >= vocab_size:
            bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
            raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
        tokens[i, : len(p)] = arr
    return tokens, lengths


@functools.partial(jax.jit, static_argnames=("cfg", "max_len", "implementation"))
def _prefill(weights, tokens, lengths, cfg: Qwen3Config, max_len: int, implementation: str = "auto"):
    from dflash_jax.spec.session import init_target_cache, target_family

    cache = init_target_cache(cfg, tokens.shape[0], max_len, weights.embed.dtype, verify_width=1)
    out = target_family(cfg).forward(weights, tokens, cache, cfg, num_valid=lengths, logits="last",
                                     implementation=implementation)
    return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.cache


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "implementation"))
def _decode_loop(weights, first, cache, stop_ids, cfg: Qwen3Config, max_new_tokens: int,
                 implementation: str = "auto"):
    from dflash_jax.spec.session import target_family

    fam = target_family(cfg)
    b = first.shape[0]
    is_stop = lambda tok: jnp.isin(tok, stop_ids)  # noqa: E731
    state = DecodeState(
        tokens=jnp.full((b, max_new_tokens), -1, jnp.int32).at[:, 0].set(first),
        num_generated=jnp.ones((b,), jnp.int32),
        done=is_stop(first) | (max_new_tokens <= 1),
        cache=cache,
        step=jnp.int32(1),
    )

    def cond(s: DecodeState):
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def body(s: DecodeState):
        last = s.tokens[jnp.arange(b), s.num_generated - 1]
        out = fam.forward(weights, last[:, None], s.cache, cfg, num_valid=(~s.done).astype(jnp.int32),
                          logits="last", implementation=implementation)
        nxt = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
        write = jnp.where(s.done, s.tokens[:, -1], nxt)
        col = jnp.where(s.done, max_new_tokens - 1, s.num_generated)
        tokens = s.tokens.at[jnp.arange(b), col].set(jnp.where(s.done, s.tokens[jnp.arange(b), col], write))
        num = s.num_generated + (~s.done).astype(jnp.int32)
        done = s.done | is_stop(nxt) | (num >= max_new_tokens)
        return DecodeState(tokens=tokens, num_generated=num, done=done, cache=out.cache, step=s.step + 1)

    final = jax.lax.while_loop(cond, body, state)
    return final.tokens, final.num_generated


def greedy_generate(
    weights,
    cfg: Qwen3Config,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    implementation: str = "auto",
) -> list[list[int]]:
    """Greedy continuation of each prompt (stop tokens included in the output, then generation stops).
    `implementation`: the MoE experts' (see `nn.moe.swiglu_experts`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    tokens, lengths = pad_prompts(prompts, cfg.vocab_size)
    max_len = int(lengths.max()) + max_new_tokens
    first, cache = _prefill(weights, jnp.asarray(tokens), jnp.asarray(lengths), cfg, max_len, implementation)
    stops = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
    out, num = _decode_loop(weights, first, cache, stops, cfg, max_new_tokens, implementation)
    out, num = np.asarray(out), np.asarray(num)
    return [list(map(int, out[i, : num[i]])) for i in range(len(prompts))]
