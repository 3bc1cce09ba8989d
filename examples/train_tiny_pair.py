"""Reproduces the small trained pair shipped with the package (dflash_jax/assets/tiny_pair).

  python examples/train_tiny_pair.py                    # full recipe (under an hour on 2 CPU cores)
  python examples/train_tiny_pair.py --quick --work quick_work --out quick_pair   # smoke run

A Qwen3-MoE target (4 layers, 8 experts top-2, ~2.5M parameters) trained on the Python standard library's
source with a BPE tokenizer, then a 2-layer DFlash draft trained with the DFlash objective on the target's
own greedy continuations. Every stage resumes from --work after an interruption. Held-out files (by name)
are listed in split.json and never trained on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dflash_jax", "assets",
                           "tiny_pair")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="tiny_pair_work", help="working directory (resumable)")
    p.add_argument("--out", default=DEFAULT_OUT, help="where the converted pair is written")
    p.add_argument("--quick", action="store_true", help="toy sizes: checks the pipeline in seconds")
    p.add_argument("--target-steps", type=int)
    p.add_argument("--draft-steps", type=int)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from convert.cli import convert
    from dflash_jax.train.tiny_pair import Recipe, train_tiny_pair

    recipe = Recipe.quick() if args.quick else Recipe()
    overrides = {k: v for k, v in (("target_steps", args.target_steps), ("draft_steps", args.draft_steps),
                                   ("seed", args.seed)) if v is not None}
    for k, v in overrides.items():
        if v < 0:
            p.error(f"--{k.replace('_', '-')} must be >= 0")
    recipe = dataclasses.replace(recipe, **overrides)
    summary = train_tiny_pair(args.work, args.out, recipe=recipe, convert=convert)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
