"""Offline scoring of route-ahead predictors on recorded rounds (`study.rounds.record_rounds`).

Each recorded round is replayed to a predictor exactly as the offloaded loop would show it (`RoundInputs`:
this round's draft hidden states and verify-block tokens, the previous round's routing and router logits),
and its prediction is compared with what the verify then routed. Per (round, MoE layer): R = the routed
experts (union over the block's rows), P = the predicted set; sums over rounds and layers give
coverage = sum |P & R| / sum |R| and waste = sum |P - R| / sum |P| (expert-weighted, the definitions of
`offload.stats`), the mean |P| and |R|, and `random_coverage` = mean |P| / E (what a uniformly random set
of the same size covers on average).

A predictor with an in-verify part (`predictors.NextLayerResidual`, alone or in a `Union`) needs rounds recorded
with `record_rounds(..., ahead=True)`: their "ahead_logits" hold, per MoE layer j after the first, layer j's
router logits on the previous MoE layer's post-attention residual in the verify, from which the part's
prediction is taken (each row's top-`width`) and added to the before-verify prediction, as the loop does.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dflash_jax.offload.predictors import RoundInputs, in_verify_part


def score_predictor(predictor, sequences: list[list[dict]], layers: tuple[int, ...], *, num_experts: int,
                    top_k: int) -> dict:
    """`sequences`: per independent generation, its rounds in order (the previous round is the one before
    in the same list). Returns coverage, waste, mean_predicted, mean_routed, random_coverage, cases."""
    covered = routed_total = predicted_total = 0
    cases = 0
    late = in_verify_part(predictor)
    for rounds in sequences:
        previous = None
        for t, r in enumerate(rounds):
            b = r["batch"]
            width = r["hidden"].shape[0] // b
            inputs = RoundInputs(
                round=t, layers=tuple(layers), top_k=top_k,
                draft_tokens=jnp.asarray(r["tokens"].reshape(b, width)[:, 1:]),
                draft_hidden=jnp.asarray(r["hidden"].reshape(b, width, -1)),
                block_tokens=jnp.asarray(r["tokens"].reshape(b, width)),
                previous_routed=None if previous is None else previous["routed"],
                previous_logits=None if previous is None else previous["logits"])
            prediction = dict(predictor.predict(inputs))
            if late is not None:
                if "ahead_logits" not in r:
                    raise ValueError(f"predictor {predictor.name!r} predicts inside the verify: score it on rounds "
                                     "recorded with record_rounds(..., ahead=True)")
                for layer, logits in r["ahead_logits"].items():
                    before = np.asarray(prediction.get(layer, np.zeros(0, np.int32)), np.int32)
                    prediction[layer] = np.union1d(before, late.from_logits(logits, top_k))
            for layer in layers:
                routed = np.unique(r["routed"][layer])
                pred = np.unique(np.asarray(prediction.get(layer, np.zeros(0, np.int32))))
                covered += len(np.intersect1d(routed, pred))
                routed_total += len(routed)
                predicted_total += len(pred)
                cases += 1
            previous = r
    mean_p = predicted_total / max(cases, 1)
    return {
        "coverage": covered / max(routed_total, 1),
        "waste": (predicted_total - covered) / max(predicted_total, 1),
        "mean_predicted": mean_p, "mean_routed": routed_total / max(cases, 1),
        "random_coverage": min(mean_p / num_experts, 1.0), "cases": cases,
    }
