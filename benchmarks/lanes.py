"""Benchmark: lanes (`spec.lanes`), a batch's rows split into groups run side by side on their own threads, against
the whole batch in one program, for plain decoding and DFlash, by batch size.

  python benchmarks/lanes.py [--pair NAME] [--batches 2,4,16,32] [--blocks 8] [--lanes 2] [--prompt-len 96]
                             [--max-new 128] [--repeats 3] [--quick] [--out DIR | --write-docs]

One XLA:CPU program keeps about 1.2 cores busy at the shipped pairs' sizes (most of a step is small ops run one after
the other). Per batch size, on that many held-out prompts, greedy, expert tables as dflash-generate loads them:
  - plain, 1 lane / L lanes: `decode.greedy_generate(lanes=1)` / `(lanes=L)`;
  - chain B, 1 lane / L lanes: `spec.generate(block_size=B, lanes=1)` / `(lanes=L)`.
Paired, interleaved runs (`timing.paired_runs`), wall and process CPU seconds, medians, end to end (prefill
included), XLA's default threading (lanes are about the cores); every output checked equal to plain greedy's.
Writes lanes_<pair>.{json,md,png} to --out (default bench_out/) or docs/benchmarks/.
"""

from __future__ import annotations

import sys

import numpy as np

import harness as h

DEFAULTS = dict(prompts=32, prompt_len=96, max_new=128, repeats=3, threads="all")


def main(argv=None) -> int:
    p = h.parser(__doc__, {"--batches": "2,4,16,32", "--blocks": "8", "--lanes": "2"}, checkpoint=None, pair=None,
                 **DEFAULTS)
    args = h.parse(p, argv, quick=dict(prompts=4, prompt_len=16, max_new=8, repeats=1, batches="4", blocks="4"))
    batches = h.int_list(p, args.batches, "--batches")
    blocks = h.int_list(p, args.blocks, "--blocks", minimum=2)
    lanes = h.int_list(p, args.lanes, "--lanes", minimum=2)[0]

    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec import generate
    from dflash_jax.spec.lanes import usable_cores

    pair, name, pool, log, load_before = h.batched_workload(args, batches, "lanes")
    n = args.max_new
    rows = []
    for b in batches:
        prompts = pool[:b]
        modes = {}
        for k in (1, lanes):
            modes[f"plain, {k} lane{'s' if k > 1 else ''}"] = (
                lambda k=k: greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=n, stop_ids=[],
                                            lanes=k))
            for block in blocks:
                modes[f"B={block}, {k} lane{'s' if k > 1 else ''}"] = (
                    lambda k=k, block=block: generate(pair, prompts, max_new_tokens=n, block_size=block, lanes=k))
        outputs, t, row = h.measure_modes(modes, b, args.repeats, log)
        plain = outputs["plain, 1 lane"]
        tokens = b * n
        for m, out in outputs.items():
            toks = out if m.startswith("plain") else out.tokens
            entry = {"lossless": toks == plain}
            for clock in ("wall", "cpu"):
                entry[f"tokens_per_s_{clock}"] = round(tokens / t.stat(m, clock, "median"), 1)
            if not m.startswith("plain"):
                entry.update(tau=round(out.stats["mean_acceptance"], 3), lanes=out.stats["lanes"])
            row["modes"][m] = entry
        rows.append(row)
        log(f"batch {b}: " + ", ".join(f"{m} {e['tokens_per_s_wall']:.0f}" for m, e in row["modes"].items()))
    mach = h.machine()
    result = {"pair": name, "blocks": blocks, "lanes": lanes, "usable_cores": usable_cores(),
              "prompt_len": args.prompt_len, "max_new_tokens": n, "repeats": args.repeats,
              "machine": mach["machine"], "backend": mach["backend"], "load_before": load_before, "by_batch": rows}
    cmd = h.command("lanes.py", args, dict(batches="2,4,16,32", blocks="8", lanes="2", **DEFAULTS),
                    f" --pair {name}" if args.pair else "")
    md = [f"# `{name}`: lanes against one program per batch (CPU)", "",
          f"`{cmd}` - held-out stdlib prompts of {args.prompt_len} tokens, {n} new tokens each, greedy; "
          f"{mach['machine']} ({usable_cores()} usable), backend {mach['backend']}, XLA's default threading; expert "
          f"tables as dflash-generate loads them. 1 lane: the whole batch in one program; {lanes} lanes: the rows in "
          f"{lanes} groups, each group's loop on its own thread (`spec.lanes`, what `lanes=\"auto\"` runs on this "
          f"machine). Paired, interleaved runs, {args.repeats} repeats, medians, end to end (prefill included). Load "
          f"average (1 min) over the run: {h.load_span(rows)}.", ""]
    kinds = ["plain"] + [f"B={block}" for block in blocks]
    header = ["batch", "mode", "1 lane tokens/s (wall)", f"{lanes} lanes tokens/s (wall)", "lanes / 1 (wall)",
              "lanes / 1 (CPU)", f"{lanes} lanes / plain 1 lane (wall)", "outputs == plain"]
    table = []
    for r in rows:
        base = r["modes"]["plain, 1 lane"]["tokens_per_s_wall"]
        for kind in kinds:
            one, many = r["modes"][f"{kind}, 1 lane"], r["modes"][f"{kind}, {lanes} lanes"]
            table.append([r["batch"], kind, f"{one['tokens_per_s_wall']:.0f}", f"{many['tokens_per_s_wall']:.0f}",
                          f"{many['tokens_per_s_wall'] / one['tokens_per_s_wall']:.2f}x",
                          f"{many['tokens_per_s_cpu'] / one['tokens_per_s_cpu']:.2f}x",
                          f"{many['tokens_per_s_wall'] / base:.2f}x",
                          "yes" if one["lossless"] and many["lossless"] else "NO"])
    md += h.table(header, table)

    def draw(ax):
        width = 0.8 / (2 * len(kinds))
        x = np.arange(len(rows))
        for i, kind in enumerate(kinds):
            for j, k in enumerate((1, lanes)):
                label = f"{kind}, {k} lane{'s' if k > 1 else ''}"
                ax.bar(x + (2 * i + j) * width, [r["modes"][label]["tokens_per_s_wall"] for r in rows], width,
                       label=label, hatch="" if k == 1 else "//")
        ax.set_xticks(x + width * (2 * len(kinds) - 1) / 2, [f"batch {r['batch']}" for r in rows])
        ax.set_ylabel("tokens / s (wall)")
        ax.legend(fontsize=7, ncol=len(kinds))

    h.Report(args, f"lanes_{name}").write(result, md, draw=draw, image="lanes against one program per batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
