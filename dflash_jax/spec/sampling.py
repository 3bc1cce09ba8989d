"""The target distribution a sampled run must reproduce, and draws from it.

The processed distribution of one row with temperature T > 0, top-k k and top-p p:
  scores  = (logits - max(logits)) / T          in fp32; T below the smallest normal fp32 (1.2e-38) counts
                                                as 1.2e-38, so no T > 0 overflows (`--temperature 1e-45`)
  top-k   = keep the scores >= the k-th largest (k = 0 or k >= V: off; ties at the k-th are kept)
  top-p   = keep the scores >= the smallest one of the shortest prefix of the sorted distribution whose
            mass reaches p (a token is kept when the mass ranked strictly before it is < p; ties kept)
  probs   = softmax of the kept scores.
Temperature 0 is greedy (argmax). Plain decoding with the same settings samples each token from exactly
this distribution; speculative sampling must emit tokens with the same law.

The settings are traced values, one per sequence (`RowSampling`: arrays [b]), so one compiled program
serves a batch whose rows use different temperatures, top-k and top-p, greedy rows included. What stays
static is the acceptance *method* (`SamplingParams.mode`): "exact_match" or "rejection".
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import numbers
from typing import Iterator, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels import target

AcceptanceMode = Literal["exact_match", "rejection"]
MODES = ("exact_match", "rejection")
_SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)
# The ranges `SamplingParams` accepts (each value is traced as an fp32 / int32 row, `RowSampling`):
# temperature in [0, MAX_TEMPERATURE]: the largest finite fp32 (a larger value, 1e308 say, would be traced as inf;
# long before it every token is about equally likely, which the sampler computes without overflow).
MAX_TEMPERATURE = float(np.finfo(np.float32).max)
MAX_TOP_K = 2**31 - 1  # int32; a top_k >= the vocabulary keeps every token, like 0


def seed_key_data(seed: int) -> np.ndarray:
    """The PRNG key data of a request's seed, any integer in [-2^63, 2^63), built on the host (no device work, so
    no program is compiled while serving). With 32-bit JAX, `jax.random.key` keeps only a seed's low 32 bits, so
    seeds that differ above them would draw the same tokens; here the threefry key is the seed's two 32-bit words
    [high, low], which is what `jax.random.key` makes of a 64-bit seed with x64 on, and exactly
    `jax.random.key(seed)` for seeds in [0, 2^32). Another PRNG implementation folds the high word in."""
    seed = int(seed)
    low, high = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    if jax.config.jax_default_prng_impl == "threefry2x32":
        return np.array([high, low], np.uint32)
    key = jax.random.key(low)
    if high:
        key = jax.random.fold_in(key, high)
    return np.asarray(jax.random.key_data(key))


def _real(value, name: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int (or Fraction) beyond any float
        raise ValueError(f"{name} is far beyond the range it allows, got {value}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """One sequence's sampling settings. temperature 0 = greedy (top_p / top_k then do nothing).
    For temperature > 0:
    mode "exact_match": the draft proposes its argmax; the target samples each block row and a proposal
    is accepted when it equals the target's sample (lossless: a one-hot proposal under rejection sampling).
    mode "rejection": the draft samples each slot from its own (processed) distribution q; proposal d at
    a row is accepted with probability min(1, p(d) / q(d)); the first rejection resamples from
    normalize(max(p - q, 0)) (speculative sampling; exact in distribution).
    The values are traced (changing them never recompiles); the mode picks the compiled program.

    Ranges (anything else is a ValueError, or a TypeError for a non-number, naming the field):
      temperature  a real number in [0, MAX_TEMPERATURE = 3.4e38, fp32's largest] (NaN and inf refused); one below
                   fp32's smallest normal (1.2e-38, down to 5e-324) counts as 1.2e-38 (module doc)
      top_p        a real number in (0, 1] (NaN refused); one below fp32's smallest subnormal (1.4e-45)
                   rounds to 0 in fp32, which keeps only the most likely token(s): the p -> 0 limit
      top_k        an integer (not a bool) in [0, MAX_TOP_K = 2^31 - 1]; 0, or any value >= the
                   vocabulary size, keeps every token (so no vocabulary is needed to check it)
      mode         "exact_match" or "rejection".
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    mode: AcceptanceMode = "exact_match"

    def __post_init__(self):
        temperature = _real(self.temperature, "temperature")
        if not temperature >= 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be at most {MAX_TEMPERATURE:.4g} (the largest float32; 0 = greedy), "
                             f"got {self.temperature}")
        top_p = _real(self.top_p, "top_p")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if isinstance(self.top_k, (bool, np.bool_)) or not isinstance(self.top_k, numbers.Integral):
            raise TypeError(f"top_k must be an integer (0 = off), got {type(self.top_k).__name__} {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.top_k > MAX_TOP_K:
            raise ValueError(f"top_k must be at most 2^31 - 1 (0 = off; any value >= the vocabulary size keeps every "
                             f"token too), got {self.top_k}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'exact_match' or 'rejection', got {self.mode!r}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "top_k", int(self.top_k))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """Whether top-p or top-k is set (they act only when temperature > 0)."""
        return self.top_p < 1 or self.top_k > 0


@struct.dataclass
class RowSampling:
    """Per-sequence sampling settings as traced arrays [b] (or scalars)."""

    temperature: jax.Array  # f32, 0 = greedy
    top_p: jax.Array  # f32 in (0, 1]
    top_k: jax.Array  # int32, 0 = off

    @staticmethod
    def of(params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...]) -> "RowSampling":
        rows = [params] if isinstance(params, SamplingParams) else list(params)
        return RowSampling(temperature=np.array([p.temperature for p in rows], np.float32),
                           top_p=np.array([p.top_p for p in rows], np.float32),
                           top_k=np.array([p.top_k for p in rows], np.int32))

    @property
    def greedy(self) -> jax.Array:
        return self.temperature == 0


def _as_rows(params) -> RowSampling:
    if isinstance(params, SamplingParams):
        params = RowSampling.of(params)
    return params


def _row(x: jax.Array, ndim: int) -> jax.Array:
    """[b] (or a scalar) -> broadcastable against [b, ..., V] with `ndim` dims, without the V axis."""
    x = jnp.asarray(x)
    return x.reshape(x.shape + (1,) * (ndim - 1 - x.ndim))


def processed_scores(logits: jax.Array, params) -> jax.Array:
    """fp32 scores [..., V] of the processed distribution (module doc): `softmax` of them is it; removed
    tokens score -inf. `params`: a `SamplingParams` or a `RowSampling` whose arrays match logits'
    leading dimension(s). Rows with temperature 0 get the T -> 0 limit (0 at the maximum, -inf elsewhere)."""
    params = _as_rows(params)
    x = logits.astype(jnp.float32)
    nd = x.ndim
    t = jnp.maximum(_row(params.temperature, nd).astype(jnp.float32), _SMALLEST_NORMAL)
    gap = x - jnp.max(x, axis=-1, keepdims=True)  # <= 0: nothing can overflow
    scores = jnp.where(gap < 0, gap / t[..., None], 0.0)
    top_k = _row(params.top_k, nd).astype(jnp.int32)
    top_p = _row(params.top_p, nd).astype(jnp.float32)
    vocab = x.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1

    def restrict(scores):
        ranked = -jnp.sort(-scores, axis=-1)  # descending
        kth = jnp.take_along_axis(ranked, jnp.clip(top_k - 1, 0, vocab - 1)[..., None], axis=-1)
        kth = jnp.where(k_on[..., None], kth, -jnp.inf)
        ranked = jnp.where(ranked >= kth, ranked, -jnp.inf)
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.sum((before < top_p[..., None]) & (ranked > -jnp.inf), axis=-1, keepdims=True)
        pth = jnp.take_along_axis(ranked, jnp.maximum(kept - 1, 0), axis=-1)
        pth = jnp.where(p_on[..., None], pth, -jnp.inf)
        return jnp.where(scores >= jnp.maximum(kth, pth), scores, -jnp.inf)

    # the sort runs only when some row asks for top-k / top-p (a real branch inside jit)
    return jax.lax.cond(jnp.any(k_on | p_on), restrict, lambda s: s, scores)


def sampling_probs(logits: jax.Array, params) -> jax.Array:
    """Probabilities [..., V] in fp32 of the processed distribution (see module doc)."""
    return jax.nn.softmax(processed_scores(logits, params), axis=-1)


def sample_from(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One draw per row of probs [..., V] (int32 [...]) with one key."""
    logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """The index of the largest logit along the last axis, int32: exactly `jnp.argmax` (the first of tied maxima;
    a NaN counts as the largest, its first one taken), as two plain reductions, a maximum and the least index that
    holds it. XLA:CPU runs `argmax`'s reduction of (value, index) pairs one element at a time; these vectorize:
    5x faster over a 1024-token vocabulary, at every row and width."""
    v = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)  # NaN or not: XLA:CPU's vectorized maximum may skip NaNs
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    # one least key: a NaN's index (ahead of any maximum), else a maximum's index + v, else 2v
    key = jnp.where(jnp.isnan(logits), index, jnp.where(logits == top, index + v, 2 * v))
    first = jnp.min(key, axis=-1)
    return jnp.where(first >= v, first - v, first)


def sample_rows(keys: jax.Array, scores: jax.Array) -> jax.Array:
    """One draw per position from softmax(scores [b, ..., V]), sequence i drawing with its own key keys[i]
    (so a sequence's draws do not depend on the batch it runs in)."""
    return jax.vmap(lambda k, s: jax.random.categorical(k, s, axis=-1))(keys, scores).astype(jnp.int32)


def sample_probs_rows(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """`sample_rows` for probabilities [b, ..., V]."""
    logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
    return sample_rows(keys, logp)


def by_sampling(greedy_only: bool, all_greedy, greedy, sampled):
    """`greedy()` where no row samples, else `sampled()`. greedy_only (static): the caller guarantees every row is
    greedy, and the sampling work is not compiled at all; otherwise a conditional on `all_greedy` (a traced bool)
    skips it at run time. A GPU runs a conditional from the host (its predicate copied back and waited for,
    between CUDA graphs), so a program that knows its rows are greedy should say so."""
    if greedy_only:
        return greedy()
    return jax.lax.cond(all_greedy, greedy, sampled)


_GREEDY_PROGRAMS: contextvars.ContextVar[bool | None] = contextvars.ContextVar("dflash_greedy_programs", default=None)


def specialize_greedy() -> bool:
    """Whether a batch whose every row is greedy gets its own program, without the sampling work or the conditional
    that skips it (`by_sampling`): on a GPU, which runs each conditional from the host, twice a round. Elsewhere a
    conditional costs next to nothing, and one program serves greedy and sampled requests alike (no compile
    between them). `greedy_programs(...)` overrides the platform's choice."""
    forced = _GREEDY_PROGRAMS.get()
    return target.platform() == "gpu" if forced is None else forced


@contextlib.contextmanager
def greedy_programs(enabled: bool | None) -> Iterator[None]:
    """Inside the block (this thread), `specialize_greedy()` is `enabled` (None: the platform's choice): runs
    prepared inside it, and engines built inside it with `greedy_programs=None`, take or leave the greedy rows'
    program. For measuring what the program saves, and for testing it on a CPU."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"greedy_programs takes True, False or None, got {enabled!r}")
    token = _GREEDY_PROGRAMS.set(enabled)
    try:
        yield
    finally:
        _GREEDY_PROGRAMS.reset(token)


def next_token_rows(keys: jax.Array, logits: jax.Array, params: RowSampling, greedy_only: bool = False) -> jax.Array:
    """Per sequence: argmax where its temperature is 0, else a draw (with its own key) from its processed
    distribution. logits [b, ..., V] -> [b, ...] int32. The sampling work is skipped when every row is
    greedy (not compiled with `greedy_only`, `by_sampling`)."""
    argmax = greedy_tokens(logits)
    greedy = _row(params.temperature, logits.ndim) == 0

    def sampled():
        return jnp.where(greedy, argmax, sample_rows(keys, processed_scores(logits, params)))

    return by_sampling(greedy_only, jnp.all(greedy), lambda: argmax, sampled)


def next_token(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Greedy argmax or a draw from the processed distribution (one key, one setting for all rows)."""
    if params.greedy:
        return greedy_tokens(logits)
    return jax.random.categorical(key, processed_scores(logits, params), axis=-1).astype(jnp.int32)
