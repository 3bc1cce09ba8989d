"""DFlash generation with the jitted loop, step by step in library calls.

  python examples/generate.py [--checkpoint DIR] [--prompt "def fib(n):"] [--block-size 8]

1. `dflash_jax.load` a converted pair (default: the small trained pair shipped with the package);
2. `dflash_jax.spec.generate` prefills, then runs every draft/verify round inside one jitted
   `lax.while_loop` (caches donated, no host round trip until the end);
3. the same output comes from plain greedy decoding of the target (lossless), checked here.
"""

from __future__ import annotations

import argparse
import sys

from tokenizers import Tokenizer

import dflash_jax
from dflash_jax.cli.generate import SHIPPED_PAIR
from dflash_jax.decode import greedy_generate
from dflash_jax.spec import SamplingParams, generate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=SHIPPED_PAIR)
    p.add_argument("--prompt", default="def fib(n):")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)

    pair = dflash_jax.load(args.checkpoint)
    tok = Tokenizer.from_file(pair.tokenizer_path)
    prompt = tok.encode(args.prompt).ids
    result = generate(pair, [prompt], max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                      sampling=SamplingParams(temperature=args.temperature), warmup=True)
    print(args.prompt + tok.decode(result.tokens[0]))
    s = result.stats
    print(f"\n{s['generated_tokens']} tokens in {s['rounds']} rounds: tau = {s['mean_acceptance']:.2f} tokens/round, "
          f"{s['tokens_per_second']:.1f} tok/s (block size {s['block_size']})", file=sys.stderr)
    if args.temperature == 0:
        plain = greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=args.max_new_tokens)
        same = plain[0][: len(result.tokens[0])] == result.tokens[0]
        print(f"identical to the target's own greedy output: {same}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
