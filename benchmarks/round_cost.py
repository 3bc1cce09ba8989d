"""The cost of a serving round by verify width and rows: what a width-w round costs against w width-1 rounds.

  python benchmarks/round_cost.py [--rows 1,4,16,32] [--widths 1,2,4,8,16] [--rounds 16] [--repeats 7]
                                  [--processes 3] [--against DIR] [--quick] [--out DIR | --write-docs]

The serving engine's rounds as it runs them (`Engine(block_size=16, widths=...)` on the shipped pair, experts as
`dflash_jax.load` keeps them on this machine, warmed): at each row bucket and width, one device call of `--rounds`
rounds (`RoundRunner.warm_burst`: draft, verify and commit of every row, the rows idle so that nothing changes),
timed `--repeats` times; ms per round is the call's median over its rounds. Each measurement runs in a fresh
process, `--processes` of them one after another; a point's figure is the median over processes.

`--against DIR`: a checkout of the library (another commit) measured the same way, its processes alternating with
this tree's (this, that, this, ...), so that both meet the machine's load alike; the report gives both and their
ratio point by point. A speculative round pays where its cost is below its tokens per round times a width-1
round's: the ratio to width 1 is the bar a width's acceptance must clear. Writes round_cost.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import harness as h

DEFAULTS = dict(rows="1,4,16,32", widths="1,2,4,8,16", rounds=16, repeats=7, processes=3, against=None)
QUICK = dict(rows="1", widths="1,2", rounds=2, repeats=2, processes=1)


def measure(rows: list[int], widths: list[int], rounds: int, repeats: int) -> dict:
    """{"RxW": ms per round} in this process."""
    import dflash_jax
    from dflash_jax.serve.engine import Engine

    pair = dflash_jax.load(None, dequantize_experts="auto")
    engine = Engine(pair, block_size=max(widths), widths=tuple(widths), slots=max(rows), max_prompt_len=128,
                    max_new_tokens=192, lanes=1)
    engine.warmup()
    out = {}
    for r in rows:
        for w in widths:
            proposer = engine.proposers[w]
            engine.runner.warm_burst(proposer, r, rounds)  # the call's program warm at this length
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                engine.runner.warm_burst(proposer, r, rounds)
                times.append((time.perf_counter() - t) / rounds * 1e3)
            out[f"{r}x{w}"] = float(np.median(times))
    return out


def main(argv=None) -> int:
    d = DEFAULTS
    p = h.parser(__doc__, {"--rows": d["rows"], "--widths": d["widths"], "--rounds": d["rounds"],
                           "--processes": (d["processes"], "fresh processes per tree, one after another"),
                           "--against": (d["against"], "a checkout to measure beside this tree"),
                           "--worker": (False, "internal: measure in this process and print JSON")},
                 repeats=d["repeats"])
    if argv is None and "--worker" in sys.argv:  # a measuring process: no output directory, one JSON line
        args = p.parse_args()
        print(json.dumps(measure(h.int_list(p, args.rows, "--rows"), h.int_list(p, args.widths, "--widths"),
                                 args.rounds, args.repeats)))
        return 0
    args = h.parse(p, argv, quick=QUICK)
    rows, widths = h.int_list(p, args.rows, "--rows"), h.int_list(p, args.widths, "--widths")
    if 1 not in widths:
        p.error("--widths must include 1 (the ratios are to a width-1 round)")
    if args.rounds < 1 or args.processes < 1:
        p.error("--rounds and --processes must be >= 1")
    against = h.check_checkout(p, args.against)
    from dflash_jax.timing import load_average

    log = h.logger("round_cost")
    here = h.ROOT
    trees = {"this": here} if against is None else {"this": here, "against": against}
    runs = {name: [] for name in trees}
    loads = [(load_average() or (0.0,))[0]]
    for i in range(args.processes):
        for name, tree in (trees.items() if i % 2 == 0 else list(trees.items())[::-1]):
            t = time.perf_counter()
            runs[name].append(h.in_tree(tree, __file__, ["--rows", args.rows, "--widths", args.widths,
                                                         "--rounds", str(args.rounds), "--repeats", str(args.repeats)]))
            loads.append((load_average() or (0.0,))[0])
            log(f"process {i + 1}/{args.processes}, {name}: {time.perf_counter() - t:.0f} s")
    cost = {name: {k: float(np.median([r[k] for r in got])) for k in got[0]} for name, got in runs.items()}
    points = []
    for r in rows:
        for w in widths:
            row = dict(rows=r, width=w)
            for name in trees:
                ms, one = cost[name][f"{r}x{w}"], cost[name][f"{r}x1"]
                row[name] = dict(ms=ms, to_width1=ms / one, per_position=ms / (w * one),
                                 processes=[got[f"{r}x{w}"] for got in runs[name]])
            if "against" in trees:
                row["this_over_against"] = row["this"]["ms"] / row["against"]["ms"]
            points.append(row)
    commits = {name: h.revision(tree) for name, tree in trees.items()}
    result = dict(benchmark="round_cost", machine=h.machine(), rows=rows, widths=widths, rounds=args.rounds,
                  repeats=args.repeats, processes=args.processes, commits=commits,
                  load_1min=max(loads), load_range=[min(loads), max(loads)], points=points)
    by = {(q["rows"], q["width"]): q for q in points}
    shown = argparse.Namespace(**{**vars(args), "against": "DIR" if args.against else None})  # no machine path
    header = ["rows"] + [f"width {w}" for w in widths]
    lines = [
        "# The cost of a serving round by verify width (CPU)",
        "",
        f"`{h.command('round_cost.py', shown, DEFAULTS)}` - commit {commits['this']}"
        + (f" against DIR, a checkout of commit {commits['against']}" if args.against else "")
        + f"; the shipped pair, the serving engine's device calls of {args.rounds} rounds at each row bucket and width "
        f"(rows idle: caches as the warm-up leaves them, so attention reads little), median of {args.repeats} calls, "
        f"median over {args.processes} fresh processes" + (", alternating with the baseline's" if args.against else "")
        + f". Load average (1 min) {min(loads):.1f} - {max(loads):.1f}.",
        "",
        "ms per round, and in brackets the cost against a width-1 round of the same rows (a width-w round pays where "
        "it commits more tokens than that):",
        "",
        *h.table(header, [[str(r)] + [f"{by[r, w]['this']['ms']:.3f} ({by[r, w]['this']['to_width1']:.2f}x)"
                                      for w in widths] for r in rows]),
    ]
    if args.against:
        lines += [
            "",
            "The baseline checkout, the same way:",
            "",
            *h.table(header, [[str(r)] + [f"{by[r, w]['against']['ms']:.3f} ({by[r, w]['against']['to_width1']:.2f}x)"
                                          for w in widths] for r in rows]),
            "",
            "This tree's round over the baseline's:",
            "",
            *h.table(header, [[str(r)] + [f"{by[r, w]['this_over_against']:.2f}" for w in widths] for r in rows]),
        ]

    def draw(ax):
        for i, r in enumerate(rows):
            name = f"{r} row{'s' if r > 1 else ''}"
            ax.plot(widths, [by[r, w]["this"]["to_width1"] for w in widths], marker="o", color=f"C{i}", label=name)
            if args.against:
                ax.plot(widths, [by[r, w]["against"]["to_width1"] for w in widths], ls="--", marker="x",
                        color=f"C{i}", alpha=0.6, label=f"{name}, baseline")
        ax.plot(widths, widths, color="k", lw=0.8, label="w width-1 rounds")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("verify width")
        ax.set_ylabel("round cost / width-1 round")
        ax.legend(fontsize=7)

    h.Report(args, "round_cost").write(result, lines, draw=draw, image="round cost against a width-1 round",
                                       figsize=(6, 4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
