"""Recorded rounds of resident speculative decoding: the data route-ahead predictors are fitted
(`train.route_predictor`) and scored offline (`study.evaluate`) on.

Each round contributes the draft's hidden states `h` [b*B, H] (one row per block slot), the verify block's
tokens and, per MoE layer l, the experts the verify routed each row's token to (verify row j holds the token
at block slot j, the same position the draft hidden row j describes) with the router logits.
"""

from __future__ import annotations

import jax
import numpy as np

from dflash_jax.offload.families import family_of_config
from dflash_jax.offload.forward import ExpertOperands, forward_layerwise
from dflash_jax.offload.store import moe_layer_ids
from dflash_jax.spec.round import Chain, commit, commit_jit, propose_jit, verify_forward
from dflash_jax.spec.session import begin


def record_rounds(pair, prompts, *, block_size: int | None = None, max_new_tokens: int = 64,
                  ahead: bool = False) -> list[dict]:
    """The rounds of resident greedy speculative decoding over `prompts`, one dict per round:
    "hidden" [b*B, H] fp32 (the draft's final-normed hidden states), "tokens" [b*B] (the verify block
    `[anchor, d_1 .. d_{B-1}]`), "routed" {layer: [b*B, k]} and "logits" {layer: [b*B, E] fp32} (the verify's
    exact routing and router logits per MoE layer). Everything a predictor may read before a verify
    ("hidden", "tokens", the previous round) and what the verify then did.

    ahead: also record what the in-verify predictor (`offload.predictors.NextLayerResidual`) reads: "ahead_logits"
    {MoE layer j: [b*B, E] fp32}, layer j's router (with its post-attention norm and bias) on the previous MoE
    layer's post-attention residual (no entry for the first MoE layer). The verify then runs layer by layer on
    the whole expert tables (`offload.forward.forward_layerwise`, the same functions: the same tokens), one host
    sync per MoE layer; [rows, E] per layer is all it adds to a round."""
    layers = moe_layer_ids(pair.target)
    spec, state = begin(pair, prompts, block_size=block_size, max_new_tokens=max_new_tokens)
    chain = Chain()

    @jax.jit
    def resident_verify(state, proposal):
        out = verify_forward(pair.target, state, proposal, spec, router_logits=True)
        return (commit(state, proposal, out, spec, chain)[0], proposal.tokens,
                tuple(out.router_experts[i] for i in layers), tuple(out.router_logits[i] for i in layers), {})

    adapter = family_of_config(spec.target)
    every = np.ones(spec.target.moe.num_experts, bool)

    def whole(layer, experts):
        return ExpertOperands(adapter.expert_tables(pair.target.layers[layer].mlp), None, every)

    def layerwise_verify(state, proposal):  # with the in-verify prediction inputs
        block = proposal.tokens
        lw = forward_layerwise(pair.target, block, state.target_cache, spec.target, provider=whole,
                               tap_layers=spec.taps, logits="all", ahead_width=spec.target.moe.top_k)
        out = lw.out
        return (commit_jit(state, proposal, out, spec, chain)[0], block, tuple(out.router_experts[i] for i in layers),
                tuple(out.router_logits[i] for i in layers), lw.ahead_logits)

    verify = layerwise_verify if ahead else resident_verify
    rounds = []
    while not np.asarray(state.done).all():
        proposal = propose_jit(chain, pair.target, pair.draft, state, spec)
        state, block, routed, logits, ahead_logits = verify(state, proposal)
        h = np.asarray(proposal.hidden, np.float32)
        rows = h.shape[0] * h.shape[1]
        rounds.append({
            "batch": h.shape[0], "hidden": h.reshape(-1, h.shape[-1]), "tokens": np.asarray(block).reshape(-1),
            "routed": {l: np.asarray(r).reshape(rows, -1) for l, r in zip(layers, routed)},
            "logits": {l: np.asarray(g, np.float32).reshape(rows, -1) for l, g in zip(layers, logits)},
        })
        if ahead:
            rounds[-1]["ahead_logits"] = {l: np.asarray(g, np.float32).reshape(rows, -1)
                                          for l, g in ahead_logits.items()}
    return rounds


def rounds_to_arrays(rounds: list[dict], layers: tuple[int, ...], num_experts: int):
    """(hidden [N, H], tokens [N], multi-hot targets [L, N, E] uint8) over all rows of `rounds`."""
    hidden = np.concatenate([r["hidden"] for r in rounds])
    tokens = np.concatenate([r["tokens"] for r in rounds])
    targets = np.zeros((len(layers), hidden.shape[0], num_experts), np.uint8)
    row = 0
    for r in rounds:
        n = r["hidden"].shape[0]
        for j, layer in enumerate(layers):
            np.put_along_axis(targets[j, row: row + n], r["routed"][layer], 1, axis=1)
        row += n
    return hidden, tokens, targets


def collect_route_data(pair, prompts, *, block_size: int | None = None, max_new_tokens: int = 64):
    """(hidden [N, H] fp32, targets [L, N, E] uint8, layers) from resident speculative rounds over `prompts`."""
    layers = moe_layer_ids(pair.target)
    rounds = record_rounds(pair, prompts, block_size=block_size, max_new_tokens=max_new_tokens)
    hidden, _, targets = rounds_to_arrays(rounds, layers, pair.target_cfg.moe.num_experts)
    return hidden, targets, layers
