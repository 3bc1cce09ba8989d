"""A round's cost at one client on `dflash-serve`'s default capacity, with and without length buckets.

  python benchmarks/serve_length_buckets.py [--repeats 2] [--prompts 8] [--max-tokens 128] [--block-size 1]

Three engines' worth of modes on the shipped pair, in-process (`serve.engine.generate`, greedy, stop ids off):
  small      4 slots, prompts up to 64 tokens (256-row caches)
  default    16 slots, prompts up to 4091 tokens (4096-row caches: `dflash-serve`'s default capacity on a CPU),
             each round over its length bucket (`ResidentRunner.length_buckets`)
  whole      the same engine with one bucket, the whole cache (what every round computed before length buckets)
Paired by request (`timing.paired_runs`): each run is one prompt in every mode back to back, the order reversed every
other repeat. Reports ms per token (wall and this process's CPU), the median over runs, and the paired ratios; checks
that every mode produced the same tokens."""

from __future__ import annotations

import argparse
import json

import numpy as np

import dflash_jax
from dflash_jax.serve.engine import Engine, generate as serve_generate
from dflash_jax.spec import SamplingParams
from dflash_jax.timing import paired_runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=1)
    args = ap.parse_args(argv)
    pair = dflash_jax.load()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, args.prompt_len).tolist() for _ in range(args.prompts)]
    common = dict(block_size=args.block_size, max_new_tokens=args.max_tokens, prefix_cache_bytes=0)
    small = Engine(pair, slots=4, max_prompt_len=args.prompt_len, **common)
    big = Engine(pair, slots=16, max_prompt_len=4091, **common)
    for eng in (small, big):
        eng.warmup([args.prompt_len])
    buckets = big.runner.length_buckets

    def run(eng, prompt, lengths):
        eng.runner.length_buckets = lengths
        try:
            req = serve_generate(eng, [prompt], max_new_tokens=args.max_tokens, sampling=SamplingParams())[0]
        finally:
            eng.runner.length_buckets = buckets if eng is big else eng.runner.length_buckets
        return req.tokens

    tokens, walls, cpus = {}, {m: [] for m in ("small", "default", "whole")}, {m: [] for m in ("small", "default", "whole")}
    for i, prompt in enumerate(prompts):
        modes = {"small": lambda: run(small, prompt, small.runner.length_buckets),
                 "default": lambda: run(big, prompt, buckets),
                 "whole": lambda: run(big, prompt, (big.spec.max_len,))}
        out = {}
        t = paired_runs(modes, args.repeats, on_run=lambda m, r, res: out.setdefault(m, []).append(res))
        assert all(o == out["small"][0] for v in out.values() for o in v), f"prompt {i}: the modes' tokens differ"
        n = len(out["small"][0])
        for m in walls:
            walls[m] += [w / n * 1e3 for w in t.wall[m]]
            cpus[m] += [c / n * 1e3 for c in t.cpu[m]]
        loads = t.load_summary()
    res = {"length_buckets": list(buckets), "block_size": args.block_size, "runs_per_mode": len(walls["small"]),
           "load_last": loads}
    for m in walls:
        res[m] = {"wall_ms_per_token": float(np.median(walls[m])), "cpu_ms_per_token": float(np.median(cpus[m]))}
    for m in ("default", "whole"):
        res[f"{m}/small"] = {"wall": float(np.median(np.array(walls[m]) / np.array(walls["small"]))),
                             "cpu": float(np.median(np.array(cpus[m]) / np.array(cpus["small"])))}
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
