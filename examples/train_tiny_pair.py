"""Reproduces the small trained pairs shipped with the package (dflash_jax/assets/tiny_pair, and with
`--family qwen3_5` the hybrid pair dflash_jax/assets/tiny_pair_qwen3_5).

  python examples/train_tiny_pair.py                    # full recipe (under an hour on 2 CPU cores)
  python examples/train_tiny_pair.py --family qwen3_5 --work hybrid_work   # the hybrid Qwen3.5-MoE pair
      (about an hour on 2 CPU cores shared with other jobs: tokens 1, target 30, continuations 4,
      draft (1200 steps) + convert about 25; the default pair's tokenizer is reused)
  python examples/train_tiny_pair.py --quick --work quick_work   # smoke run (toy sizes)
  python examples/train_tiny_pair.py --out dflash_jax/assets/tiny_pair   # replace the shipped pair
  python examples/train_tiny_pair.py --dflash2 --work d2_work --draft-steps 800 --prompts 2048 \
      --selector-refit-prompts 6144 --selector-refit-top-k 16
      # a DFlash 2 draft for the shipped target, from its DFlash 1 draft (`train.dflash2.train_dflash2_pair`): joint
      # training on 2048 continuations, then a fresh 16-candidate selector fit alone on the frozen draft over 6144
      # (`--selector-refit-steps`, 0: no refit); the pair in <work>/pair (the shipped variant
      # dflash_jax/assets/tiny_pair_dflash2 was made this way)

By default everything, the converted pair included, goes under --work (default `tiny_pair_work/` at the
repository root, ignored by git; the pair in `<work>/pair`): the shipped pair is replaced only when --out
names it explicitly.

A Qwen3-MoE target (4 layers, 8 experts top-2, 3.6M parameters, 3.1M of them in the MXFP4 experts) trained on
the Python standard library's source with a BPE tokenizer, then a 2-layer DFlash draft trained with the DFlash
objective on the target's own greedy continuations. Every stage resumes from --work after an interruption.
Held-out files (by name) are listed in split.json and never trained on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WORK = os.path.join(ROOT, "tiny_pair_work")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=DEFAULT_WORK,
                   help="working directory (resumable; default: tiny_pair_work/ at the repository root, "
                        "ignored by git)")
    p.add_argument("--out", default=None,
                   help="where the converted pair is written (default: <work>/pair; the shipped pair, "
                        "dflash_jax/assets/tiny_pair, is replaced only when named here)")
    p.add_argument("--quick", action="store_true",
                   help="toy sizes: checks the whole pipeline (about 1.5 minutes on 2 idle CPU cores)")
    p.add_argument("--family", choices=("qwen3", "qwen3_5"), default="qwen3",
                   help="the target's family: qwen3 (Qwen3-MoE, the default pair) or qwen3_5 (Qwen3.5-MoE: "
                        "Gated DeltaNet + gated attention + shared expert, `Recipe.hybrid()`)")
    p.add_argument("--dflash2", action="store_true",
                   help="train a DFlash 2 draft for a shipped target instead (the Qwen3-MoE pair's, or with --family "
                        "qwen3_5 the hybrid pair's), starting from its DFlash 1 draft (identity convolutions, a fresh "
                        "candidate selector), on the same corpus recipe")
    p.add_argument("--prompts", type=int, help="greedy continuations in the draft's corpus")
    p.add_argument("--selector-top-k", type=int, help="with --dflash2: the selector's candidates per position")
    p.add_argument("--selector-refit-steps", type=int, default=None,
                   help="with --dflash2: steps of the selector refit on the frozen draft after the joint training "
                        "(train.dflash2.SelectorRefit; default its steps, 0: no refit)")
    p.add_argument("--selector-refit-prompts", type=int, default=None,
                   help="with --dflash2: greedy continuations in the refit's corpus (default: --prompts; more "
                        "extend the corpus, the joint stage keeping its first --prompts rows)")
    p.add_argument("--selector-refit-top-k", type=int, default=None,
                   help="with --dflash2: the refit selector's candidates per position (default: --selector-top-k)")
    p.add_argument("--draft-lr", type=float)
    p.add_argument("--target-steps", type=int)
    p.add_argument("--draft-steps", type=int)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from convert.cli import convert
    from dflash_jax.train.tiny_pair import Recipe, train_tiny_pair

    recipe = Recipe.hybrid() if args.family == "qwen3_5" else Recipe()
    if args.quick:
        recipe = dataclasses.replace(Recipe.quick(), family=recipe.family)
    overrides = {k: v for k, v in (("target_steps", args.target_steps), ("draft_steps", args.draft_steps),
                                   ("seed", args.seed), ("prompts", args.prompts)) if v is not None}
    for k, v in overrides.items():
        if v < 0:
            p.error(f"--{k.replace('_', '-')} must be >= 0")
    recipe = dataclasses.replace(recipe, **overrides)
    if args.draft_lr is not None:
        recipe = dataclasses.replace(recipe, draft_lr=args.draft_lr)
    out = args.out if args.out is not None else os.path.join(args.work, "pair")
    if args.dflash2:
        import dflash_jax
        from dflash_jax.train.dflash2 import SelectorRefit, train_dflash2_pair

        if args.quick:
            p.error("--dflash2 trains a draft for a shipped pair's target (no --quick)")
        # continuing from a trained draft: a smaller learning rate than from scratch unless one is given
        recipe = dataclasses.replace(recipe, draft_version=2,
                                     draft_lr=1e-3 if args.draft_lr is None else args.draft_lr)
        if args.selector_top_k is not None:
            recipe = dataclasses.replace(recipe, selector_top_k=args.selector_top_k)
        refit = SelectorRefit(prompts=args.selector_refit_prompts, top_k=args.selector_refit_top_k)
        if args.selector_refit_steps is not None:
            if args.selector_refit_steps < 0:
                p.error("--selector-refit-steps must be >= 0")
            refit = dataclasses.replace(refit, steps=args.selector_refit_steps) if args.selector_refit_steps else None
        shipped = dflash_jax.SHIPPED_PAIR if args.family == "qwen3" else dflash_jax.SHIPPED_PAIRS["tiny_pair_qwen3_5"]
        pair = dflash_jax.load(shipped, dequantize_experts=True)
        summary = train_dflash2_pair(pair, args.work, out, convert=convert, recipe=recipe, refit=refit)
        print(json.dumps(summary, indent=1))
        return 0
    if recipe.family != "qwen3" and not args.quick:
        # the hybrid pair shares the shipped pair's tokenizer (same corpus, same ids)
        import shutil

        from dflash_jax import SHIPPED_PAIR
        os.makedirs(args.work, exist_ok=True)
        tok = os.path.join(args.work, "tokenizer.json")
        if not os.path.exists(tok):
            shutil.copy2(os.path.join(SHIPPED_PAIR, "tokenizer.json"), tok)
    summary = train_tiny_pair(args.work, out, recipe=recipe, convert=convert)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
