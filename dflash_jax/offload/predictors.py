"""Route-ahead predictors: before a verify runs, guess each MoE layer's routed expert set.

One interface: `predictor.predict(inputs: RoundInputs) -> {layer: expert ids in priority order}` (distinct
ids, most likely first; the prefetch takes them in this order until the layer's unpinned slots are used).
`needs_draft` says whether the prediction reads the draft's output (then it can only be issued after the
draft forward; otherwise it can be issued before it, widening the window the copies hide behind).

Predictions never affect correctness: the verify computes the exact routing and fetches what is missing.

- `PreviousRound(width)`: the experts the previous verify routed to (width > top_k: each previous row's
  top-`width` experts by router probability).
- `DraftRouter(weights, cfg, width)`: every target layer's router applied to the draft's final hidden states
  of the block (each row's top-`width` experts), after that layer's post-attention RMSNorm weights.
- `LearnedRouter(params, layers, eps, width)`: a per-layer linear map trained on (draft hidden, verify routing)
  pairs (`train.route_predictor`), initialized from the target routers.
- `Union(a, b, ...)`: the union, in interleaved priority order.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.nn.norms import rms_norm


@dataclasses.dataclass
class RoundInputs:
    """What a predictor may read before round `round`'s verify.

    layers: the MoE layer indices. draft_tokens [b, B-1] / draft_hidden [b, B, H]: this round's draft (None
    before the draft ran, or for block size 1). previous_routed: {layer: [rows, k] int32} the previous verify's
    exact routing (None in the first round); previous_logits: {layer: [rows, E] fp32 numpy} its router logits."""

    round: int
    layers: tuple[int, ...]
    top_k: int
    draft_tokens: jax.Array | None = None
    draft_hidden: jax.Array | None = None
    previous_routed: dict[int, np.ndarray] | None = None
    previous_logits: dict[int, np.ndarray] | None = None


class Predictor(Protocol):
    name: str
    needs_draft: bool

    def predict(self, inputs: RoundInputs) -> dict[int, np.ndarray]: ...


def ranked_union(experts: np.ndarray, scores: np.ndarray | None = None) -> np.ndarray:
    """Distinct ids of `experts` [rows, w] ordered by total score (default: occurrence count), ties by id."""
    experts = np.asarray(experts).reshape(-1)
    if experts.size == 0:
        return np.zeros(0, np.int32)
    scores = np.ones(experts.shape) if scores is None else np.asarray(scores, np.float64).reshape(-1)
    ids, inverse = np.unique(experts, return_inverse=True)
    total = np.bincount(inverse, weights=scores)
    return ids[np.lexsort((ids, -total))].astype(np.int32)


def _top_width(logits: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row the `width` highest-probability experts and their softmax probabilities."""
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :width]
    return idx, np.take_along_axis(p, idx, axis=-1)


@dataclasses.dataclass
class NoPrediction:
    """B2: nothing is prefetched; every miss is fetched on demand."""

    name: str = "none"
    needs_draft: bool = False

    def predict(self, inputs: RoundInputs) -> dict[int, np.ndarray]:
        return {}


@dataclasses.dataclass
class PreviousRound:
    """The previous verify's routed experts (width None or top_k), or each previous row's top-`width`."""

    width: int | None = None
    name: str = "previous"
    needs_draft: bool = False

    def predict(self, inputs: RoundInputs) -> dict[int, np.ndarray]:
        if inputs.previous_routed is None:
            return {}
        if self.width is None or self.width == inputs.top_k:
            return {layer: ranked_union(inputs.previous_routed[layer]) for layer in inputs.layers}
        out = {}
        for layer in inputs.layers:
            idx, p = _top_width(inputs.previous_logits[layer], self.width)
            out[layer] = ranked_union(idx, p)
        return out


@functools.partial(jax.jit, static_argnames=("width", "eps"))
def _draft_router_topk(hidden, norms, routers, width, eps):
    """hidden [rows, H]; norms [L, H]; routers [L, H, E] -> (experts [L, rows, width], probs [L, rows, width])."""

    def one(norm, router):
        h = rms_norm(hidden, norm, eps) if norm is not None else hidden
        p = jax.nn.softmax(jnp.dot(h, router, preferred_element_type=jnp.float32), axis=-1)
        probs, experts = jax.lax.top_k(p, width)
        return experts, probs

    return jax.vmap(one)(norms, routers)


class DraftRouter:
    """Target routers on the draft's hidden states: for MoE layer l, `softmax(RMSNorm_l(h_draft) @ W_router_l)`
    over the block's B draft rows, each row's top-`width` experts (width None: top_k), ranked by summed
    probability. `renorm=False` uses unit norm weights instead of the layer's post-attention norm weights
    (the draft hidden is already RMS-normalized by the draft's final norm)."""

    needs_draft = True

    def __init__(self, weights, cfg, *, width: int | None = None, renorm: bool = True, name: str = "draft_router"):
        from dflash_jax.offload.store import moe_layer_ids

        self.name, self.width, self.renorm, self.cfg = name, width, renorm, cfg
        self.layers = moe_layer_ids(weights)
        self.routers = jnp.stack([weights.layers[i].mlp.router for i in self.layers])
        self.norms = jnp.stack([weights.layers[i].post_norm for i in self.layers])

    def predict(self, inputs: RoundInputs) -> dict[int, np.ndarray]:
        if inputs.draft_hidden is None:
            return {}
        width = self.width or inputs.top_k
        hidden = inputs.draft_hidden.reshape(-1, inputs.draft_hidden.shape[-1])
        norms = self.norms if self.renorm else jnp.ones_like(self.norms)
        experts, probs = _draft_router_topk(hidden, norms, self.routers.astype(hidden.dtype), width,
                                            self.cfg.rms_norm_eps)
        experts, probs = np.asarray(experts), np.asarray(probs)
        return {layer: ranked_union(experts[j], probs[j]) for j, layer in enumerate(self.layers)}


class LearnedRouter:
    """A trained per-layer linear predictor (`train.route_predictor.LinearRouteWeights`) on the draft's
    hidden states: each row's top-`width` experts by `sigmoid(RMSNorm_l(h) W_l + b_l)`, ranked by summed
    probability."""

    needs_draft = True

    def __init__(self, params, layers: tuple[int, ...], *, eps: float, width: int | None = None,
                 name: str = "learned"):
        self.params, self.layers, self.eps, self.width, self.name = params, tuple(layers), eps, width, name

    def predict(self, inputs: RoundInputs) -> dict[int, np.ndarray]:
        if inputs.draft_hidden is None:
            return {}
        experts, probs = _learned_topk(self.params, inputs.draft_hidden.reshape(-1, inputs.draft_hidden.shape[-1]),
                                       self.width or inputs.top_k, self.eps)
        experts, probs = np.asarray(experts), np.asarray(probs)
        return {layer: ranked_union(experts[j], probs[j]) for j, layer in enumerate(self.layers)}


@functools.partial(jax.jit, static_argnames=("width", "eps"))
def _learned_topk(params, hidden, width, eps):
    from dflash_jax.train.route_predictor import route_logits

    probs, experts = jax.lax.top_k(jax.nn.sigmoid(route_logits(params, hidden, eps)), width)
    return experts, probs


class Union:
    """The union of several predictors' sets, interleaving their priority lists (a1, b1, a2, b2, ...)."""

    def __init__(self, *predictors, name: str | None = None):
        self.predictors = predictors
        self.name = name or "+".join(p.name for p in predictors)
        self.needs_draft = any(p.needs_draft for p in predictors)

    def predict(self, inputs: RoundInputs) -> dict[int, np.ndarray]:
        parts = [p.predict(inputs) for p in self.predictors]
        out = {}
        for layer in inputs.layers:
            lists = [part.get(layer, np.zeros(0, np.int32)) for part in parts]
            merged, seen = [], set()
            for rank in range(max((len(x) for x in lists), default=0)):
                for x in lists:
                    if rank < len(x) and int(x[rank]) not in seen:
                        seen.add(int(x[rank]))
                        merged.append(int(x[rank]))
            out[layer] = np.asarray(merged, np.int32)
        return out


PREDICTORS = ("none", "previous", "draft_router", "previous+draft_router")


def make_predictor(name: str, weights, cfg, *, width: int | None = None):
    """A predictor by name (`PREDICTORS`); `width` = experts per token predicted (default: top_k)."""
    if name == "none":
        return NoPrediction()
    if name == "previous":
        return PreviousRound(width=width)
    if name == "draft_router":
        return DraftRouter(weights, cfg, width=width)
    if name == "previous+draft_router":
        return Union(PreviousRound(width=width), DraftRouter(weights, cfg, width=width))
    raise ValueError(f"unknown predictor {name!r}; choose one of {', '.join(PREDICTORS)}")
