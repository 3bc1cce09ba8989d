"""Route-ahead predictor study: coverage and waste of every predictor on held-out text.

  python benchmarks/route_ahead.py [--checkpoint DIR] [--work DIR] [--block 8] [--train-prompts 96]
                                   [--eval-prompts 24] [--prompt-len 96] [--max-new 96] [--out DIR | --write-docs]

Model: `--checkpoint DIR` (a convert-weights pair with split.json), else the route-study pair trained into
`--work` by `train.tiny_pair.Recipe.route_study()` (Qwen3-MoE, 4 layers, 64 experts top-4; resumable,
~20 minutes on 2 CPU cores). A pair with few experts (the shipped pair: 8, top-2, ~6 of 8 routed per
block) cannot separate predictors from chance; 64 experts top-4 has the ratio of the real targets.

Data: speculative rounds with every expert resident (batch 1, greedy), recording per round the draft's
hidden states and the verify block's tokens (what a predictor may read before the verify), each MoE
layer's exact routing and router logits (what the verify then did), and what the in-verify "residual"
predictor reads (the next MoE layer's router on each MoE layer's residual; its copies have only a
one-layer window to hide behind, the others the draft + verify window). Learned predictors train on rounds over
windows of TRAINING files and are scored on windows of the pair's HELD-OUT files (split.json).

Per (round, MoE layer): R = the experts the verify routed (union over the block's rows), P = the predicted
set. coverage = sum |P & R| / sum |R|, waste = sum |P - R| / sum |P| (expert-weighted, as
`offload.RouteAheadStats`); `random cov.` = mean |P| / E, what a random set of the same size covers.
Writes route_ahead.json and route_ahead.md to --out (default bench_out/, ignored by git) or, with
--write-docs, to docs/benchmarks/.
"""

from __future__ import annotations

import os
import platform
import sys
import time

import numpy as np

import harness as h


def record_rounds(pair, prompts, *, block_size: int, max_new_tokens: int, progress: bool = True):
    """Per prompt, the list of its rounds: {"hidden" [B, H], "tokens" [B], "routed" {l: [B, k]},
    "logits" {l: [B, E]}} from resident greedy speculative decoding."""
    from dflash_jax.offload.store import moe_layer_ids
    from study.rounds import record_rounds as record

    layers = moe_layer_ids(pair.target)
    out = []
    for i, prompt in enumerate(prompts):
        if progress and i % 8 == 0:
            print(f"[route_ahead] recording rounds: prompt {i}/{len(prompts)}", flush=True)
        out.append(record(pair, [prompt], block_size=block_size, max_new_tokens=max_new_tokens, ahead=True))
    return out, layers


def fit_predictors(pair, sequences, layers, *, steps: int) -> dict:
    """The learned predictors on the recorded training rounds: "linear" (draft hidden states only) and
    "token" (+ the verify block's token embeddings)."""
    from dflash_jax.offload.route_model import init_from_target
    from dflash_jax.train.route_predictor import train_route_predictor
    from study.rounds import rounds_to_arrays

    rounds = [r for seq in sequences for r in seq]
    hidden, tokens, targets = rounds_to_arrays(rounds, layers, pair.target_cfg.moe.num_experts)
    embeds = np.asarray(pair.target.embed, np.float32)[tokens]
    eps = pair.target_cfg.rms_norm_eps
    out = {"losses": {}}
    for name, token_features in (("linear", False), ("token", True)):
        params, losses = train_route_predictor(
            init_from_target(pair.target, layers, token_features=token_features), hidden, targets, eps=eps,
            steps=steps, batch=512, token_embeds=embeds if token_features else None)
        out[name] = params
        out["losses"][name] = [float(np.mean(losses[:20])), float(np.mean(losses[-50:]))]
    return out


def predictor_grid(pair, learned):
    """(name, knob, predictor) of every predictor scored."""
    from dflash_jax.offload.predictors import DraftRouter, LearnedRouter, NextLayerResidual, PreviousRound, Union

    k, e = pair.target_cfg.moe.top_k, pair.target_cfg.moe.num_experts
    layers = learned["layers"]
    eps = pair.target_cfg.rms_norm_eps
    widths = sorted({k, 2 * k, 3 * k, 4 * k} & set(range(1, e + 1)))
    grid = []
    for w in widths[:2]:
        grid.append(("previous", f"w={w}", PreviousRound(width=w)))
    for w in widths[:3]:
        grid.append(("residual (in verify, one-layer window)", f"w={w}", NextLayerResidual(width=w)))
    for w in widths:
        grid.append(("draft_router", f"w={w}", DraftRouter(pair.target, pair.target_cfg, width=w)))
        grid.append(("learned (hidden)", f"w={w}", LearnedRouter(learned["linear"], layers, eps=eps, width=w)))
        grid.append(("learned (hidden + token)", f"w={w}",
                     LearnedRouter(learned["token"], layers, eps=eps, width=w, embed=pair.target.embed)))
    for t in (0.9, 0.7, 0.5, 0.3, 0.2, 0.1):
        grid.append(("learned (hidden)", f"t={t}", LearnedRouter(learned["linear"], layers, eps=eps, threshold=t)))
        grid.append(("learned (hidden + token)", f"t={t}",
                     LearnedRouter(learned["token"], layers, eps=eps, threshold=t, embed=pair.target.embed)))
    for t in (0.3, 0.1):
        grid.append(("previous + learned (hidden + token)", f"w={k} / t={t}", Union(
            PreviousRound(width=k),
            LearnedRouter(learned["token"], layers, eps=eps, threshold=t, embed=pair.target.embed))))
    grid.append(("learned (hidden + token) + residual", f"t=0.3 / w={k}", Union(
        LearnedRouter(learned["token"], layers, eps=eps, threshold=0.3, embed=pair.target.embed),
        NextLayerResidual(width=k))))
    return grid


def main(argv=None) -> int:
    p = h.parser(__doc__, {
        "--checkpoint": (None, "a converted pair with split.json (default: train the route-study pair)"),
        "--work": ("route_study_work", "work dir of the route-study pair (resumable)"), "--block": 8,
        "--train-prompts": 96, "--eval-prompts": 24, "--steps": (1500, "optax steps of each learned predictor")},
        prompt_len=96, max_new=96)
    args = h.parse(p, argv, quick=dict(train_prompts=2, eval_prompts=1, prompt_len=16, max_new=8, steps=2))
    for name in ("block", "train_prompts", "eval_prompts", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")

    import jax

    import dflash_jax
    from study.evaluate import score_predictor

    t0 = time.perf_counter()
    if args.checkpoint:
        directory = args.checkpoint
    else:
        from convert.cli import convert
        from dflash_jax.train.tiny_pair import Recipe, train_tiny_pair

        directory = os.path.join(args.work, "pair")
        if not os.path.exists(os.path.join(directory, "manifest.json")):
            train_tiny_pair(args.work, directory, recipe=Recipe.route_study(), convert=convert)
    pair = dflash_jax.load(directory)
    cfg = pair.target_cfg
    if cfg.moe is None:
        p.error(f"{directory}: the target has no MoE layers; route prediction needs a MoE target")
    train_prompts = h.prompts(pair, args.train_prompts, args.prompt_len, seed=1, split="train")
    eval_prompts = h.prompts(pair, args.eval_prompts, args.prompt_len, seed=0)
    train_rounds, layers = record_rounds(pair, train_prompts, block_size=args.block, max_new_tokens=args.max_new)
    eval_rounds, _ = record_rounds(pair, eval_prompts, block_size=args.block, max_new_tokens=args.max_new)
    print("[route_ahead] training the learned predictors", flush=True)
    learned = fit_predictors(pair, train_rounds, layers, steps=args.steps)
    learned["layers"] = layers
    rows = []
    for name, knob, predictor in predictor_grid(pair, learned):
        r = score_predictor(predictor, eval_rounds, layers, num_experts=cfg.moe.num_experts, top_k=cfg.moe.top_k)
        rows.append({"predictor": name, "knob": knob, **r})
        print(f"[route_ahead] {name:28s} {knob:10s} coverage {r['coverage']:.3f} waste {r['waste']:.3f} "
              f"P {r['mean_predicted']:.1f} R {r['mean_routed']:.1f}", flush=True)
    info = {
        "pair": os.path.basename(os.path.normpath(directory)), "block": args.block,
        "num_experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k, "moe_layers": list(layers),
        "train_prompts": len(train_prompts), "eval_prompts": len(eval_prompts), "prompt_len": args.prompt_len,
        "max_new": args.max_new, "train_rounds": sum(len(r) for r in train_rounds),
        "eval_rounds": sum(len(r) for r in eval_rounds), "predictor_steps": args.steps,
        "train_loss": {k: [round(v[0], 4), round(v[-1], 4)] for k, v in learned["losses"].items()},
        "backend": jax.default_backend(), "machine": platform.machine(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    h.Report(args, "route_ahead").write({"info": info, "rows": rows}, markdown(info, rows))
    return 0


def markdown(info, rows) -> list[str]:
    lines = [
        "# Route-ahead predictors: coverage and waste on held-out text", "",
        "Generated by `python benchmarks/route_ahead.py --write-docs` (rows in `route_ahead.json`). Pair: "
        f"`{info['pair']}` (Qwen3-MoE, {info['num_experts']} experts top-{info['top_k']}, MoE layers "
        f"{info['moe_layers']}), block size {info['block']}, batch 1, greedy. Learned predictors trained on "
        f"{info['train_rounds']} rounds over {info['train_prompts']} windows of training files; scored on "
        f"{info['eval_rounds']} rounds over {info['eval_prompts']} windows of held-out files "
        f"({info['prompt_len']}-token prompts, {info['max_new']} new tokens).", "",
        "Per (round, MoE layer): R = experts the verify routed (union over the block's rows), P = predicted set. "
        "coverage = sum |P & R| / sum |R|; waste = sum |P - R| / sum |P|; `random cov.` = mean |P| / E (a random "
        "set of the same size). Knobs: `w=K` predicts each row's top-K experts; `t=X` predicts every expert whose "
        "probability of being routed by some row of the block, 1 - prod_rows(1 - p_row), is >= X. `residual` predicts "
        "nothing for the first MoE layer (it has no layer before it), which its coverage counts as misses; its copies "
        "have one layer of compute to hide behind, the others the draft forward plus the verify.", "",
        *h.table(["predictor", "knob", "coverage", "waste", "mean P", "mean R", "random cov."],
                 [[r["predictor"], r["knob"], f"{r['coverage']:.3f}", f"{r['waste']:.3f}", f"{r['mean_predicted']:.1f}",
                   f"{r['mean_routed']:.1f}", f"{r['random_coverage']:.3f}"] for r in rows]),
    ]
    lines += ["", f"Backend {info['backend']}, {info['seconds']} s in all. Predictor training BCE (first, last): "
              + ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in info["train_loss"].items()) + "."]
    return lines


if __name__ == "__main__":
    sys.exit(main())
