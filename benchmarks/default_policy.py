"""Benchmark: the measured default (`decode.measured_policy`, what dflash-generate runs when no proposer is
named) and the draft's chain against the fastest plain path, at batch 1 / 4 / 16 / 32.

  python benchmarks/default_policy.py [--pair NAME] [--batches 1,4,16,32] [--prompt-len 64] [--max-new 64]
                                      [--repeats 3] [--threads one|all] [--quick] [--out DIR | --write-docs]

The pair's experts are loaded as dflash-generate loads them (`dequantize_experts="auto"`: on a CPU the FP4 tables
are dequantized once at load), for every mode alike. Per batch size, on that many held-out prompts:
  - plain: `decode.greedy_generate`, the batched plain greedy loop (no draft);
  - chain: the jitted DFlash loop at the draft's block;
  - default: `generate_default` under `measured_policy` (plain decoding and the chain each timed on the same
    prompts first, the chain kept only where it measures faster by the margin); the calibration's seconds are
    reported (the cold start it adds).
Paired, interleaved runs (`timing.paired_runs`: every mode once per repeat, back to back, order reversed every
other repeat), wall and process CPU seconds, medians; the load average is recorded. Every output is checked equal
to plain greedy's. Writes default_policy_<pair>.{json,md} to --out (default bench_out/) or docs/benchmarks/.
"""

from __future__ import annotations

import functools
import sys
import time

import harness as h

DEFAULTS = dict(prompts=32, prompt_len=64, max_new=64, repeats=3, threads="one")


def main(argv=None) -> int:
    p = h.parser(__doc__, {"--batches": "1,4,16,32"}, checkpoint=None, pair=None, **DEFAULTS)
    args = h.parse(p, argv, quick=dict(prompts=2, prompt_len=16, max_new=8, repeats=1, batches="1,2"))
    batches = h.int_list(p, args.batches, "--batches")

    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec import generate
    from dflash_jax.decode import generate_default, measured_policy

    pair = h.load_pair(args, dequantize_experts="auto")
    name = args.pair or "tiny_pair"
    block = pair.draft_cfg.block_size
    pool = h.prompts(pair, max(args.prompts, max(batches)), args.prompt_len)
    n = args.max_new
    load_before = h.load_average()
    rows = []
    for b in batches:
        prompts = pool[:b]
        t0, c0 = time.perf_counter(), time.process_time()
        policy = measured_policy(pair, prompts, block_size=block)
        calib = (time.perf_counter() - t0, time.process_time() - c0)
        chosen = policy.shapes[policy.reachable()[0]]
        modes = {
            "plain": lambda: greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=n, stop_ids=[]),
            "chain": lambda: generate(pair, prompts, max_new_tokens=n, block_size=block).tokens,
            "default": functools.partial(lambda pol: generate_default(pair, prompts, pol, max_new_tokens=n).tokens,
                                         policy),
        }
        outputs = {m: fn() for m, fn in modes.items()}  # compiled before any timing
        lossless = {m: outputs[m] == outputs["plain"] for m in modes}
        t = h.paired_runs(modes, args.repeats)
        tokens = b * n
        row = {"batch": b, "chosen": "plain" if chosen.budget == 1 else f"chain B={chosen.budget}",
               "measured_ms_per_round": [round(s * 1e3, 3) for s in policy.seconds()],
               "measured_tokens_per_round": list(policy.tokens_per_round()),
               "calibration_s": {"wall": round(calib[0], 2), "cpu": round(calib[1], 2)},
               "lossless": lossless, "load_1min": t.loads[-1][0] if t.loads and t.loads[-1] else None}
        for clock in ("wall", "cpu"):
            rate = {m: tokens / t.stat(m, clock, "median") for m in modes}
            row[clock] = {"tokens_per_s": {m: round(v, 1) for m, v in rate.items()},
                          "vs_plain": {m: round(rate[m] / rate["plain"], 3) for m in modes}}
        rows.append(row)
        print(row, flush=True)
    mach = h.machine()
    result = {"pair": name, "block_size": block, "expert_tables": "as dflash-generate loads them (auto)",
              "prompt_len": args.prompt_len, "max_new_tokens": n, "repeats": args.repeats, "threads": args.threads,
              "machine": mach["machine"], "backend": mach["backend"], "load_before": load_before, "by_batch": rows}
    cmd = h.command("default_policy.py", args, dict(batches="1,4,16,32", **DEFAULTS),
                    f" --pair {name}" if args.pair else "")
    md = [f"# `{name}`: the measured default and the chain against plain decoding, by batch size (CPU)", "",
          f"`{cmd}` - held-out stdlib prompts of {args.prompt_len} tokens, {n} new tokens each, greedy; "
          f"{mach['machine']}, backend {mach['backend']}; XLA threads: {args.threads}; expert tables as "
          "dflash-generate loads them (dequantized once at load on a CPU), the same for every mode. plain = "
          "`decode.greedy_generate` (the fastest plain path); chain = the DFlash loop at the draft's block "
          f"{block}; default = the loop under `decode.measured_policy` (plain decoding and the chain "
          "timed on the same prompts first; the chain kept only where it measures > 5% faster). Paired, "
          f"interleaved runs, {args.repeats} repeats, medians, end to end (prefill included). Load average (1 min) "
          f"over the run: {h.load_span(rows)}.", ""]
    md += h.table(["batch", "plain tok/s (CPU-s)", "chain / plain (CPU)", "default / plain (CPU)",
                   "chain / plain (wall)", "default / plain (wall)", "default chose", "calibration s (wall)",
                   "outputs == plain greedy"],
                  [[r["batch"], r["cpu"]["tokens_per_s"]["plain"], f"{r['cpu']['vs_plain']['chain']:.2f}x",
                    f"{r['cpu']['vs_plain']['default']:.2f}x", f"{r['wall']['vs_plain']['chain']:.2f}x",
                    f"{r['wall']['vs_plain']['default']:.2f}x", r["chosen"], r["calibration_s"]["wall"],
                    "yes" if all(r["lossless"].values()) else "NO"] for r in rows])
    h.Report(args, f"default_policy_{name}").write(result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
