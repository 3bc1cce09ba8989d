"""Benchmark: the jitted DFlash loop with and without compaction (`spec.loop.run_compacting`: the live rows of a
batch continue in the batch bucket of half its rows once they fit it), against plain decoding, by batch size.

  python benchmarks/compaction.py [--pair NAME] [--batches 1,4,8,16,32] [--blocks 4,8,16] [--prompt-len 64]
                                  [--max-new 64] [--repeats 3] [--threads one|all] [--quick] [--out DIR | --write-docs]

A static batch runs until its slowest row finishes; with speculation the rows finish many rounds apart (each
row's acceptance is its own), so every finished row keeps costing its share of each round. Per batch size, on
that many held-out prompts, greedy, expert tables as dflash-generate loads them:
  - plain: `decode.greedy_generate` (the fastest plain path; every row has the same budget, so it never compacts);
  - chain B (whole): `spec.generate(..., compact=False)`, the loop before compaction;
  - chain B (compacted): `spec.generate(..., compact=True)`.
Paired, interleaved runs (`timing.paired_runs`), wall and process CPU seconds, medians, end to end (prefill
included); the rounds the slowest row ran and the rows' mean rounds; every output checked equal to plain greedy's.
Writes compaction_<pair>.{json,md,png} to --out (default bench_out/) or docs/benchmarks/.
"""

from __future__ import annotations

import sys

import numpy as np

import harness as h

DEFAULTS = dict(prompts=32, prompt_len=64, max_new=64, repeats=3, threads="one")


def main(argv=None) -> int:
    p = h.parser(__doc__, {"--batches": "1,4,8,16,32", "--blocks": "4,8,16"}, checkpoint=None, pair=None, **DEFAULTS)
    args = h.parse(p, argv, quick=dict(prompts=4, prompt_len=16, max_new=8, repeats=1, batches="4", blocks="4"))
    batches = h.int_list(p, args.batches, "--batches")
    blocks = h.int_list(p, args.blocks, "--blocks", minimum=2)

    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec import generate

    pair, name, pool, log, load_before = h.batched_workload(args, batches, "compaction")
    n = args.max_new
    rows = []
    for b in batches:
        prompts = pool[:b]
        modes = {"plain": lambda: greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=n,
                                                  stop_ids=[])}
        for block in blocks:
            for compact in (False, True):
                modes[f"B={block} {'compacted' if compact else 'whole'}"] = (
                    lambda block=block, compact=compact: generate(pair, prompts, max_new_tokens=n, block_size=block,
                                                                  compact=compact))
        outputs, t, row = h.measure_modes(modes, b, args.repeats, log)
        plain = outputs["plain"]
        tokens = b * n
        for m, out in outputs.items():
            toks = out if m == "plain" else out.tokens
            entry = {"lossless": toks == plain}
            for clock in ("wall", "cpu"):
                entry[f"tokens_per_s_{clock}"] = round(tokens / t.stat(m, clock, "median"), 1)
            if m != "plain":
                rounds = [len(a) for a in out.acceptance_lengths]
                entry.update(rounds_slowest=int(out.stats["rounds"]), rounds_mean=round(float(np.mean(rounds)), 2),
                             tau=round(out.stats["mean_acceptance"], 3), compactions=out.stats["compactions"])
            row["modes"][m] = entry
        plain_rate = row["modes"]["plain"]
        for m, e in row["modes"].items():
            for clock in ("wall", "cpu"):
                e[f"vs_plain_{clock}"] = round(e[f"tokens_per_s_{clock}"] / plain_rate[f"tokens_per_s_{clock}"], 3)
        rows.append(row)
        log(f"batch {b}: " + ", ".join(f"{m} {e['vs_plain_cpu']:.2f}x" for m, e in row["modes"].items()))
    mach = h.machine()
    result = {"pair": name, "blocks": blocks, "prompt_len": args.prompt_len, "max_new_tokens": n,
              "repeats": args.repeats, "threads": args.threads, "machine": mach["machine"], "backend": mach["backend"],
              "load_before": load_before, "by_batch": rows}
    cmd = h.command("compaction.py", args, dict(batches="1,4,8,16,32", blocks="4,8,16", **DEFAULTS),
                    f" --pair {name}" if args.pair else "")
    md = [f"# `{name}`: the DFlash loop with and without compaction, against plain decoding (CPU)", "",
          f"`{cmd}` - held-out stdlib prompts of {args.prompt_len} tokens, {n} new tokens each, greedy; "
          f"{mach['machine']}, backend {mach['backend']}; XLA threads: {args.threads}; expert tables as "
          "dflash-generate loads them. plain = `decode.greedy_generate`; whole = `spec.generate(compact=False)`; "
          "compacted = `spec.generate(compact=True)` (the live rows continue in the batch bucket of half the rows "
          "once they fit it). Paired, interleaved runs, "
          f"{args.repeats} repeats, medians, end to end (prefill included). Load average (1 min) over the run: "
          f"{h.load_span(rows)}.", ""]
    header = ["batch", "block", "tau", "rounds: slowest row / mean", "compactions", "whole / plain (CPU)",
              "compacted / plain (CPU)", "compacted / whole (CPU)", "compacted / whole (wall)", "outputs == plain"]
    table = []
    for r in rows:
        for block in blocks:
            w, c = r["modes"][f"B={block} whole"], r["modes"][f"B={block} compacted"]
            table.append([r["batch"], block, c["tau"], f"{c['rounds_slowest']} / {c['rounds_mean']}", c["compactions"],
                          f"{w['vs_plain_cpu']:.2f}x", f"{c['vs_plain_cpu']:.2f}x",
                          f"{c['tokens_per_s_cpu'] / w['tokens_per_s_cpu']:.2f}x",
                          f"{c['tokens_per_s_wall'] / w['tokens_per_s_wall']:.2f}x",
                          "yes" if w["lossless"] and c["lossless"] else "NO"])
    md += h.table(header, table)
    md += ["", "plain decoding, tokens per process CPU second: " + ", ".join(
        f"batch {r['batch']} {r['modes']['plain']['tokens_per_s_cpu']:.0f}" for r in rows) + "."]

    def draw(ax):
        width = 0.8 / (2 * len(blocks))
        x = np.arange(len(rows))
        for i, block in enumerate(blocks):
            for j, kind in enumerate(("whole", "compacted")):
                ax.bar(x + (2 * i + j) * width, [r["modes"][f"B={block} {kind}"]["vs_plain_cpu"] for r in rows], width,
                       label=f"B={block} {kind}", hatch="" if kind == "whole" else "//")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x + width * (2 * len(blocks) - 1) / 2, [f"batch {r['batch']}" for r in rows])
        ax.set_ylabel("tokens / CPU-s vs plain decoding")
        ax.legend(fontsize=7, ncol=len(blocks))

    h.Report(args, f"compaction_{name}").write(result, md, draw=draw, image="DFlash with and without compaction, "
                                                                             "against plain decoding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
