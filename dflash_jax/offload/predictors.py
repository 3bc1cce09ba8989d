"""Route-ahead predictors: before a verify runs, guess each MoE layer's routed expert set.

One interface: `predictor.predict(inputs: RoundInputs) -> {layer: expert ids in priority order}` (distinct
ids, most likely first; the prefetch takes them in this order until the layer's unpinned slots are used).
`needs_draft` says whether the prediction reads the draft's output (then it can only be issued after the
draft forward; otherwise it can be issued before it, widening the window the copies hide behind).

Predictions never affect correctness: the verify computes the exact routing and fetches what is missing.

- `PreviousRound(width)`: the experts the previous verify routed to (width > top_k: each previous row's
  top-`width` experts by router probability).
- `DraftRouter(weights, cfg, width)`: every target layer's router applied to the draft's final hidden states
  of the block (each row's top-`width` experts), after that layer's post-attention RMSNorm weights; each
  family's router as its model applies it (gpt-oss: router bias, top-k then softmax).
- `LearnedRouter(params, layers, eps, width | threshold, embed)`: a per-layer linear map (`route_model`) on the
  draft hidden [+ verify-block token], fitted to the verify's routing by `train.route_predictor`, initialized
  from the target routers; a block-level probability threshold as the alternative knob to the width.
- `NextLayerResidual(width)` ("residual"): predicts INSIDE the verify: the next MoE layer's router on the current
  MoE layer's post-attention residual, prefetched one layer ahead (`in_verify`; `predict` gives {}).
- `Union(a, b, ...)`: the union, in interleaved priority order (its in-verify part, if any, adds to it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.offload.families import family_of_weights
from dflash_jax.offload.route_model import route_probs
from dflash_jax.offload.store import moe_layer_ids


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
    block_tokens: jax.Array | None = None  # [b, B] the verify block [anchor, d_1 .. d_{B-1}]
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


@functools.partial(jax.jit, static_argnames=("fam", "cfg", "width"))
def route_stacked(fam, routers, hidden, cfg, width):
    """hidden [rows, H]; `routers` stacked over L MoE layers (`ModelFamily.routers_of`) -> (experts [L, rows, width],
    probs [L, rows, width]): the family's routing (`fam.route_rows`) of the rows by every layer's router."""

    def one(router):
        routing = fam.route_rows(router, hidden, cfg, top_k=width)
        return routing.experts, routing.probs

    return jax.vmap(one)(routers)


class DraftRouter:
    """Target routers on the draft's hidden states: for MoE layer l, the layer's routing (`route_rows`: its
    post-attention norm and router exactly as its family's verify applies them: plain norm for Qwen3, fp32
    scale and router bias for gpt-oss, zero-centred for Qwen3.5) of the block's B draft rows, each row's
    top-`width` experts (width None: top_k) by the family's rule (Qwen: softmax over all experts; gpt-oss:
    biased logits, softmax over the top `width`), ranked by summed probability."""

    needs_draft = True

    def __init__(self, weights, cfg, *, width: int | None = None, name: str = "draft_router"):
        self.fam = family_of_weights(weights)
        self.name, self.width, self.cfg = name, width, cfg
        self.layers = moe_layer_ids(weights)
        self.routers = self.fam.routers_of(weights, self.layers)

    def predict(self, inputs: RoundInputs) -> dict[int, np.ndarray]:
        if inputs.draft_hidden is None:
            return {}
        width = self.width or inputs.top_k
        hidden = inputs.draft_hidden.reshape(-1, inputs.draft_hidden.shape[-1])
        experts, probs = route_stacked(self.fam, self.routers, hidden, self.cfg, width)
        experts, probs = np.asarray(experts), np.asarray(probs)
        return {layer: ranked_union(experts[j], probs[j]) for j, layer in enumerate(self.layers)}


class LearnedRouter:
    """A trained per-layer predictor (`route_model.LinearRouteWeights`) on the draft's hidden
    states (and, for weights with token features, the verify block's tokens through `embed`, the target's
    embedding): per row and expert p = sigmoid(logit), an estimate of P(row routed to e).
    Selection: `threshold` t -> every expert with P(some row of the block routes to e) = 1 - prod_rows(1 - p)
    >= t, most probable first (one knob for the whole block's set); otherwise each row's top-`width`
    experts (None: top_k), ranked by summed probability."""

    needs_draft = True

    def __init__(self, params, layers: tuple[int, ...], *, eps: float, width: int | None = None,
                 threshold: float | None = None, embed: jax.Array | None = None, name: str = "learned"):
        if threshold is not None and not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        if params.u is not None and embed is None:
            raise ValueError("these route-predictor weights read the verify block's tokens: pass the target's "
                             "embedding as embed=")
        self.params, self.layers, self.eps, self.width, self.name = params, tuple(layers), eps, width, name
        self.threshold, self.embed = threshold, embed

    def predict(self, inputs: RoundInputs) -> dict[int, np.ndarray]:
        if inputs.draft_hidden is None:
            return {}
        hidden = inputs.draft_hidden.reshape(-1, inputs.draft_hidden.shape[-1])
        tokens = None
        if self.params.u is not None:
            if inputs.block_tokens is None:
                return {}
            tokens = jnp.asarray(inputs.block_tokens).reshape(-1)
        probs = np.asarray(route_probs(self.params, hidden, tokens, self.embed, self.eps), np.float64)
        out = {}
        for j, layer in enumerate(self.layers):
            if self.threshold is not None:
                block_p = 1.0 - np.prod(1.0 - probs[j], axis=0)
                order = np.lexsort((np.arange(block_p.size), -block_p))
                out[layer] = order[block_p[order] >= self.threshold].astype(np.int32)
            else:
                width = self.width or inputs.top_k
                idx = np.argsort(-probs[j], axis=-1, kind="stable")[:, :width]
                out[layer] = ranked_union(idx, np.take_along_axis(probs[j], idx, axis=-1))
        return out


class Union:
    """The union of several predictors' sets, interleaving their priority lists (a1, b1, a2, b2, ...)."""

    def __init__(self, *predictors, name: str | None = None):
        self.predictors = predictors
        self.name = name or "+".join(p.name for p in predictors)
        self.needs_draft = any(p.needs_draft for p in predictors)
        self.in_verify = any(getattr(p, "in_verify", False) for p in predictors)  # see `NextLayerResidual`

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


@dataclasses.dataclass
class NextLayerResidual:
    """"Previous-layer residual inside the verify": during the layer-wise verify, as soon as MoE layer i's
    attention and router have run, the NEXT MoE layer j's router (with layer j's post-attention norm, as its
    family applies it: `ModelFamily.route_rows`) is applied to layer i's post-attention residual stream (the hidden state
    entering layer i's MoE sub-layer), and each row's top-`width` experts (None: top_k) are layer j's
    prediction. It is computed inside the jitted call that routes layer i and read on the host together with
    layer i's exact routing (`offload.forward.forward_layerwise(ahead=, ahead_width=)`), so the loop can
    prefetch layer j's missing experts while layer i's experts and layer j's attention compute: the hide
    window is one layer. `predict` returns {}: nothing is predicted before the verify (`in_verify` tells the
    loop to enable the hook); the first MoE layer gets no prediction. Composes with `Union`: the union's
    before-verify parts prefetch as usual and this part adds to them."""

    width: int | None = None
    name: str = "residual"
    needs_draft: bool = False
    in_verify: bool = True

    def predict(self, inputs: RoundInputs) -> dict[int, np.ndarray]:
        return {}

    def rank(self, experts: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """The in-verify prediction of one layer: rows' top-`width` experts [rows, width] (and their routing
        probabilities) -> distinct ids ranked by summed probability."""
        return ranked_union(experts, probs)

    def from_logits(self, logits: np.ndarray, top_k: int) -> np.ndarray:
        """Offline (`study.evaluate`): the prediction from recorded next-layer router logits [rows, E] (each
        row's top-`width` by logit order: the set `rank` gets in the verify for every family; the priority
        order may differ for gpt-oss, which ranks by the softmax over the top `width`)."""
        idx, p = _top_width(np.asarray(logits, np.float64), self.width or top_k)
        return ranked_union(idx, p)


def in_verify_part(predictor):
    """The in-verify part of a predictor (a `NextLayerResidual`, possibly inside a `Union`), or None."""
    if predictor is None:
        return None
    for part in getattr(predictor, "predictors", ()):
        found = in_verify_part(part)
        if found is not None:
            return found
    if getattr(predictor, "in_verify", False) and not hasattr(predictor, "predictors"):
        return predictor
    return None


_PARTS = ("previous", "draft_router", "residual")
PREDICTORS = ("none", "previous", "draft_router", "residual", "previous+draft_router", "previous+residual",
              "draft_router+residual", "previous+draft_router+residual")


def make_predictor(name: str, weights, cfg, *, width: int | None = None):
    """A predictor by name (`PREDICTORS`: "none" or a "+"-joined union of previous, draft_router, residual);
    `width` = experts per token predicted (default: top_k)."""
    if name == "none":
        return NoPrediction()
    parts = name.split("+")
    if not parts or any(p not in _PARTS for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(f"unknown predictor {name!r}; choose one of {', '.join(PREDICTORS)}")
    made = []
    for part in parts:
        if part == "previous":
            made.append(PreviousRound(width=width))
        elif part == "draft_router":
            made.append(DraftRouter(weights, cfg, width=width))
        else:
            made.append(NextLayerResidual(width=width))
    return made[0] if len(made) == 1 else Union(*made)
