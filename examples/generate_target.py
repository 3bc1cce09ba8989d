"""End-to-end greedy generation of an MoE target with the jitted decode loop.

  python examples/generate_target.py                      # a tiny random Qwen3-MoE, no download
  python examples/generate_target.py --checkpoint HF_DIR  # any Qwen3 / Qwen3-MoE HF checkpoint dir

Prints the generated ids and the decode rate (compile time excluded).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="HF checkpoint directory (default: a tiny random Qwen3-MoE)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--prompt-len", type=int, default=300, help="random prompt length")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.prompt_len < 1 or args.max_new_tokens < 1:
        parser.error("--prompt-len and --max-new-tokens must be >= 1")

    from convert import load_hf_target
    from dflash_jax import ConfigError, testing
    from dflash_jax.decode import greedy_generate

    if args.checkpoint:
        from dflash_jax import CheckpointError

        try:
            cfg, weights = load_hf_target(args.checkpoint, dtype=args.dtype, progress=True)
        except (ConfigError, CheckpointError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        cfg = testing.tiny_qwen3_moe_config()
        weights = testing.random_qwen3_weights(cfg, jax.random.key(args.seed))
    prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, args.prompt_len).tolist()
    greedy_generate(weights, cfg, [prompt], max_new_tokens=args.max_new_tokens)  # compile
    t0 = time.perf_counter()
    out = greedy_generate(weights, cfg, [prompt], max_new_tokens=args.max_new_tokens)[0]
    dt = time.perf_counter() - t0
    print(f"model: {cfg.model_type}, {cfg.num_layers} layers, "
          f"{cfg.moe.num_experts if cfg.moe else 0} experts, backend {jax.default_backend()}")
    print(f"prompt: {len(prompt)} tokens; generated {len(out)} tokens:")
    print(" ".join(map(str, out)))
    print(f"{len(out) / dt:.1f} tokens/s (prefill + decode, compiled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
