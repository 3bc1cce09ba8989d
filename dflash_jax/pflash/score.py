"""The PFlash scorer: how much the end of a prompt attends to each of its tokens.

A scorer is any target model the library runs (`Scorer`: a config and its weights; the shipped pair's target by
default, or any converted checkpoint's). It prefills the whole prompt once, in a prompt-length bucket, and for
every attention layer takes the post-RoPE queries of the prompt's last `window` tokens (the family's
`attention_queries`) against every cached key of that layer:

  p[l, h, w, s] = softmax_s(q[l, h, w] . k[l, h // G, s] / sqrt(d))      causal, s < n (the prompt length)
  score[s]      = mean over layers l, heads h and window queries w of p[l, h, w, s]

so the scores sum to 1 over the prompt. Masks follow the slot order of the prefill; sliding windows are not
applied to the scores (every attention layer scores the whole prompt). Linear-attention (DeltaNet) layers have
no attention to read and do not score. Everything runs in one jitted program per (scorer, prompt bucket,
window); the scores come back as a numpy array.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax.cache import cut_slots
from dflash_jax.models.decoder import Steps, run_layers
from dflash_jax.models.family import family_of
from dflash_jax.spec import requests as rq

DEFAULT_WINDOW = 32


@dataclasses.dataclass(frozen=True, eq=False)
class Scorer:
    """A model that scores prompt tokens: a registered target family's config and weights."""

    cfg: Any
    weights: Any
    name: str = "scorer"

    @classmethod
    def from_pair(cls, pair, name: str | None = None, *, layers: int | None = None) -> "Scorer":
        """The target of a loaded pair (`dflash_jax.load`) as the scorer; `layers`: only its first `layers` decoder
        layers (a cheaper scorer: the scores come from the attention layers among them)."""
        import os

        weights = pair.target
        if layers is not None:
            n = len(weights.layers)
            layers = rq.check_int(layers, "layers", low=1, high=n + 1, what=f"a layer count in [1, {n}]")
            weights = weights.replace(layers=weights.layers[:layers])
        base = name or (os.path.basename(str(pair.directory).rstrip("/")) or "pair") + ":target"
        return cls(cfg=pair.target_cfg, weights=weights, name=base if layers is None else f"{base}[:{layers}]")


def load_scorer(directory: str) -> Scorer:
    """The target of a `convert-weights` checkpoint directory as a scorer (e.g. `dflash_jax.SHIPPED_PAIR`)."""
    from dflash_jax.pair import load

    return Scorer.from_pair(load(directory, dequantize_experts="auto"))


def _window_attention(q, k_buf, n, window: int):
    """[P] the attention mass of the window queries (the last `window` of the first n rows of q [1, P, Hq, d])
    on every key slot of k_buf [1, Hkv, S, d] (S >= P, `cache.kv_shape`), averaged over heads and window queries."""
    b, p, hq, d = q.shape
    hkv = k_buf.shape[1]
    g = hq // hkv
    start = jnp.maximum(n - window, 0)
    qw = lax.dynamic_slice_in_dim(q, start, window, axis=1).reshape(b, window, hkv, g, d)
    keys = cut_slots(k_buf, p)
    scores = jnp.einsum("bwkgd,bksd->bkgws", qw, keys, preferred_element_type=jnp.float32) * d**-0.5
    q_slot = start + jnp.arange(window, dtype=jnp.int32)
    k_slot = jnp.arange(p, dtype=jnp.int32)
    mask = (k_slot[None, :] <= q_slot[:, None]) & (k_slot[None, :] < n) & (q_slot[:, None] < n)  # [W, P]
    scores = jnp.where(mask, scores, -1e30)
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)
    queries = jnp.maximum(jnp.minimum(n, window), 1).astype(jnp.float32)
    return probs.sum(axis=(0, 1, 2, 3)) / (hq * queries)


class _ScoringSteps(Steps):
    """The resident decoder loop that also records every attention layer's window attention."""

    def __init__(self, fam, cfg, n, window: int):
        super().__init__(fam, cfg)
        self.n, self.window, self.scores = n, window, []

    def attend(self, i, layer, x, state, ctx, moe):
        q = self.fam.attention_queries(layer, x, ctx, self.fam.kind(self.cfg, i), self.cfg)
        x_out, h, routing, state = super().attend(i, layer, x, state, ctx, moe)
        if q is not None:
            self.scores.append(_window_attention(q, state[0], self.n, self.window))
        return x_out, h, routing, state


@functools.partial(jax.jit, static_argnames=("cfg", "window"))
def _scores(weights, tokens, n, cfg, window: int):
    fam = family_of(cfg)
    cache = fam.init_cache(cfg, 1, tokens.shape[1], weights.embed.dtype, verify_width=1)
    steps = _ScoringSteps(fam, cfg, n, window)
    run_layers(steps, weights, tokens, cache, num_valid=n[None], logits="none")
    if not steps.scores:
        raise ValueError(f"this {fam.name} scorer has no attention layer among its {len(weights.layers)} layers: "
                         "keep more layers (Scorer.from_pair(pair, layers=...))")
    return jnp.mean(jnp.stack(steps.scores), axis=0)


def score_tokens(scorer: Scorer, prompt_ids: Sequence[int], *, window: int = DEFAULT_WINDOW,
                 buckets: rq.Buckets | None = None) -> np.ndarray:
    """[n] float32 importance of each prompt token (see module doc); sums to 1."""
    if not isinstance(scorer, Scorer):
        raise TypeError(f"scorer must be a pflash.Scorer (Scorer.from_pair(pair) or load_scorer()), "
                        f"got {type(scorer).__name__}")
    rq.check_int(window, "window", low=1, what="a positive integer")
    prompt = rq.check_prompts([prompt_ids], scorer.cfg.vocab_size)[0]
    n = len(prompt)
    if n > scorer.cfg.max_position_embeddings:
        raise ValueError(f"the prompt ({n} tokens) exceeds the scorer's {scorer.cfg.max_position_embeddings} "
                         "positions: use a scorer with a longer context")
    buckets = rq.DEFAULT_BUCKETS if buckets is None else buckets
    p = buckets.prompt_len(n)
    tokens = np.zeros((1, p), np.int32)
    tokens[0, :n] = prompt
    scores = _scores(scorer.weights, tokens, jnp.int32(n), scorer.cfg, min(int(window), p))
    return np.asarray(scores, np.float32)[:n]
