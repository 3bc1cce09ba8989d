"""The target distribution a sampled run must reproduce, and draws from it.

`sampling_probs` defines the distribution: logits / temperature, restricted to the top-k logits (k > 0),
then to the smallest set of most likely tokens whose mass reaches top_p (a token is kept when the mass of
the tokens ranked before it is < top_p), renormalized. Plain decoding with the same parameters samples
each token from exactly this distribution; speculative sampling must emit tokens with the same law.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

AcceptanceMode = Literal["exact_match", "rejection"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """temperature 0 = greedy. For temperature > 0:
    mode "exact_match": the draft proposes its argmax; the target samples each block row and a proposal
    is accepted when it equals the target's sample (lossless: a one-hot proposal under rejection sampling).
    mode "rejection": the draft samples each slot from its own (processed) distribution q; proposal d at
    a row is accepted with probability min(1, p(d) / q(d)); the first rejection resamples from
    normalize(max(p - q, 0)) (speculative sampling; exact in distribution)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    mode: AcceptanceMode = "exact_match"

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.mode not in ("exact_match", "rejection"):
            raise ValueError(f"mode must be 'exact_match' or 'rejection', got {self.mode!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Probabilities [..., V] in fp32 of the processed distribution (see module doc)."""
    scores = logits.astype(jnp.float32) / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = jax.lax.top_k(scores, params.top_k)[0][..., -1:]
        scores = jnp.where(scores >= kth, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    if params.top_p < 1.0:
        order = jnp.argsort(-probs, axis=-1)
        sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
        keep_sorted = (jnp.cumsum(sorted_probs, axis=-1) - sorted_probs) < params.top_p
        keep = jnp.zeros_like(keep_sorted).at[
            tuple(jnp.indices(order.shape)[:-1]) + (order,)
        ].set(keep_sorted)
        probs = jnp.where(keep, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


def sample_from(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One draw per row of probs [..., V] (int32 [...])."""
    logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)


def next_token(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Greedy argmax or a draw from the processed distribution."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample_from(key, sampling_probs(logits, params))
