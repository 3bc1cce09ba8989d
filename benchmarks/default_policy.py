"""Benchmark: the measured default (`decode.measured_policy`, what dflash-generate runs when no proposer is
named) and the draft's chains against the fastest plain path, at batch 1 / 4 / 16 / 32 and prompt by prompt at
batch 1.

  python benchmarks/default_policy.py [--pair NAME] [--batches 1,4,16,32] [--per-prompt 10] [--chains 4,8,16]
                                      [--prompt-len 64] [--max-new 128] [--repeats 9] [--threads one|all]
                                      [--quick] [--out DIR | --write-docs]

The pair's experts are loaded as dflash-generate loads them (`dequantize_experts="auto"`: on a CPU the FP4 tables
are dequantized once at load), for every mode alike. Per batch size, on that many held-out prompts, and for each
of the first --per-prompt prompts alone:
  - plain: `decode.greedy_generate`, the batched plain greedy loop (no draft);
  - chain B=N: the jitted DFlash loop at block N (by batch: the draft's trained block; prompt by prompt: each
    block of --chains);
  - default: `generate_default` under `measured_policy` (plain decoding and the trained block's chain each timed
    on the same prompts first, 16 tokens, the chain kept only where it measures faster by the margin); the
    calibration's seconds are reported (the cold start it adds).
Each mode paired with plain decoding alone (`timing.paired_runs` of the two: back to back, order reversed every
other repeat), wall and process CPU seconds, medians; the load average is recorded. Every output is checked equal
to plain greedy's. Writes default_policy_<pair>.{json,md} to --out (default bench_out/) or docs/benchmarks/.
"""

from __future__ import annotations

import collections
import functools
import sys
import time

import harness as h

DEFAULTS = dict(prompts=32, prompt_len=64, max_new=128, repeats=9, threads="one")


def _paired_with_plain(modes, repeats, tokens):
    """Each mode but "plain" paired with plain decoding alone (alternating: in one rotation of three or more modes
    the one run after a chain, whose draft and programs evict the target's from the caches, starts colder more
    often than the others). -> ({mode: Timings}, {clock: {"tokens_per_s": .., "vs_plain": ..}}), plain's rate from
    the first pairing, every ratio within its pair."""
    pairs = {m: h.paired_runs({"plain": modes["plain"], m: fn}, repeats) for m, fn in modes.items() if m != "plain"}
    first = next(iter(pairs.values()))
    out = {}
    for clock in ("wall", "cpu"):
        rate = {"plain": tokens / first.stat("plain", clock, "median")}
        rate |= {m: tokens / t.stat(m, clock, "median") for m, t in pairs.items()}
        ratio = {m: t.stat("plain", clock, "median") / t.stat(m, clock, "median") for m, t in pairs.items()}
        out[clock] = {"tokens_per_s": {m: round(v, 1) for m, v in rate.items()},
                      "vs_plain": {"plain": 1.0} | {m: round(v, 3) for m, v in ratio.items()}}
    return pairs, out


def main(argv=None) -> int:
    p = h.parser(__doc__, {"--batches": "1,4,16,32", "--per-prompt": (10, "batch-1 runs, one prompt each, as "
                                                                      "dflash-generate calibrates and runs them"),
                           "--chains": ("4,8,16", "the chains timed prompt by prompt (blocks up to the draft's)")},
                 checkpoint=None, pair=None, **DEFAULTS)
    args = h.parse(p, argv, quick=dict(prompts=2, prompt_len=16, max_new=8, repeats=1, batches="1,2", per_prompt=2))
    batches = h.int_list(p, args.batches, "--batches")
    blocks = h.int_list(p, args.chains, "--chains")

    from dflash_jax.cli.generate import shape_name
    from dflash_jax.decode import generate_default, greedy_generate, measured_policy
    from dflash_jax.spec import generate

    pair = h.load_pair(args, dequantize_experts="auto")
    name = args.pair or "tiny_pair"
    block = pair.draft_cfg.block_size
    if not all(2 <= c <= block for c in blocks):
        p.error(f"--chains: blocks 2 .. {block} (the draft's trained block), got {args.chains}")
    pool = h.prompts(pair, max(args.prompts, max(batches), args.per_prompt), args.prompt_len)
    n = args.max_new
    load_before = h.load_average()

    def measured(prompts, chains):
        """The default's calibration on `prompts` (as dflash-generate: plain decoding and the draft's chain),
        then every mode's outputs (compiled before any timing) and the paired timings."""
        t0, c0 = time.perf_counter(), time.process_time()
        policy = measured_policy(pair, prompts)  # as dflash-generate runs it: plain and the trained block's chain
        calib = {"wall": round(time.perf_counter() - t0, 2), "cpu": round(time.process_time() - c0, 2)}
        chosen = policy.shapes[policy.reachable()[0]]
        modes = {"plain": functools.partial(greedy_generate, pair.target, pair.target_cfg, prompts,
                                            max_new_tokens=n, stop_ids=[]),
                 "default": lambda: generate_default(pair, prompts, policy, max_new_tokens=n).tokens}
        modes |= {f"chain B={c}": functools.partial(lambda c: generate(pair, prompts, max_new_tokens=n,
                                                                       block_size=c).tokens, c) for c in chains}
        outputs = {m: fn() for m, fn in modes.items()}
        _, rates = _paired_with_plain(modes, args.repeats, len(prompts) * n)
        return {"chosen": shape_name(chosen), "calibration_s": calib,
                "measured": {shape_name(s): {"ms_per_round": round(t * 1e3, 3), "tokens_per_round": tau}
                             for s, t, tau in zip(policy.shapes, policy.seconds(), policy.tokens_per_round())},
                "lossless": {m: outputs[m] == outputs["plain"] for m in modes}, "load_1min": (h.load_average() or [None])[0],
                **rates}

    rows = []
    for b in batches:
        row = {"batch": b, **measured(pool[:b], (block,))}
        rows.append(row)
        print({k: row[k] for k in ("batch", "chosen", "calibration_s", "wall")}, flush=True)
    singles = []
    for i, prompt in enumerate(pool[: args.per_prompt]):
        row = {"prompt": i, **measured([prompt], blocks)}
        singles.append(row)
        print({k: row[k] for k in ("prompt", "chosen", "calibration_s", "wall")}, flush=True)
    mach = h.machine()
    result = {"pair": name, "block_size": block, "chains_by_prompt": list(blocks),
              "expert_tables": "as dflash-generate loads them (auto)", "prompt_len": args.prompt_len,
              "max_new_tokens": n, "repeats": args.repeats, "threads": args.threads, "machine": mach["machine"],
              "backend": mach["backend"], "load_before": load_before, "by_batch": rows, "batch1_by_prompt": singles}
    cmd = h.command("default_policy.py", args, dict(batches="1,4,16,32", per_prompt=10, chains="4,8,16", **DEFAULTS),
                    f" --pair {name}" if args.pair else "")
    chains = ", ".join(map(str, blocks))
    md = [f"# `{name}`: the measured default and the draft's chains against plain decoding (CPU)", "",
          f"`{cmd}` - held-out stdlib prompts of {args.prompt_len} tokens, {n} new tokens each, greedy; "
          f"{mach['machine']}, backend {mach['backend']}; XLA threads: {args.threads}; expert tables as "
          "dflash-generate loads them (dequantized once at load on a CPU), the same for every mode. plain = "
          "`decode.greedy_generate` (the fastest plain path); chain B = the DFlash loop at block B; default = "
          "the loop under `decode.measured_policy`, what dflash-generate runs with no proposer named (plain "
          f"decoding and the chain at block {block} timed on the same prompts first, 16 tokens each; the chain kept "
          "only where it measures > 5% faster than plain). Prompt by prompt, the chains of blocks "
          f"{chains} are timed too. Each mode paired with plain decoding alone, "
          f"alternating runs, {args.repeats} repeats, medians, ratios within a pair, end to end (prefill included; "
          f"the calibration not: its seconds are listed). Load average (1 min) over the run: "
          f"{h.load_span(rows + singles)}.", "", "## By batch size", ""]

    def x(r, mode, clock):
        return f"{r[clock]['vs_plain'][mode]:.2f}x"

    def same(r):
        return "yes" if all(r["lossless"].values()) else "NO"

    md += h.table(["batch", "plain tok/s (CPU-s)", f"chain B={block} / plain (CPU)", "default / plain (CPU)",
                   f"chain B={block} / plain (wall)", "default / plain (wall)", "default chose",
                   "calibration s (wall)", "outputs == plain greedy"],
                  [[r["batch"], r["cpu"]["tokens_per_s"]["plain"], x(r, f"chain B={block}", "cpu"),
                    x(r, "default", "cpu"), x(r, f"chain B={block}", "wall"), x(r, "default", "wall"), r["chosen"],
                    r["calibration_s"]["wall"], same(r)] for r in rows])
    if singles:
        heads = [f"chain B={c}" for c in blocks]
        md += ["", "## Batch 1, prompt by prompt (as dflash-generate runs one prompt)", "",
               "Each prompt calibrated on itself, then timed; ratios against plain decoding by CPU time, wall in "
               f"brackets; the default's measured tokens per round of the chain at block {block} (16 tokens).", ""]
        md += h.table(["prompt", "default chose", f"measured tau B={block}"] + [f"{c} / plain" for c in heads]
                      + ["default / plain", "calibration s (wall)", "outputs == plain greedy"],
                      [[r["prompt"], r["chosen"], f"{r['measured'][f'chain B={block}']['tokens_per_round']:.2f}"]
                       + [f"{x(r, c, 'cpu')} ({x(r, c, 'wall')})" for c in heads + ["default"]]
                       + [r["calibration_s"]["wall"], same(r)] for r in singles])
        total = {}
        for clock in ("wall", "cpu"):  # the prompts one after another: tokens over the sum of the medians' times
            secs = {m: sum(1.0 / r[clock]["tokens_per_s"][m] for r in singles) for m in heads + ["default", "plain"]}
            total[clock] = {m: round(secs["plain"] / v, 3) for m, v in secs.items()}
        result["batch1_total_vs_plain"] = total
        chose = collections.Counter(r["chosen"] for r in singles)
        md += ["", f"All {len(singles)} prompts one after another (tokens over the summed median times): default "
               f"{total['cpu']['default']:.2f}x plain by CPU time ({total['wall']['default']:.2f}x wall); "
               + ", ".join(f"{c} {total['cpu'][c]:.2f}x ({total['wall'][c]:.2f}x)" for c in heads)
               + f". The default chose: {', '.join(f'{k} {v}' for k, v in sorted(chose.items()))}."]
    h.Report(args, f"default_policy_{name}").write(result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
