"""Benchmark: chain vs token-tree verification vs the adaptive policy on the shipped pair.

  python benchmarks/tree.py [--checkpoint DIR] [--prompts 6] [--prompt-len 64] [--max-new 64]
                            [--chains 4,8,16] [--trees 8,16,32] [--branch 4] [--out DIR | --write-docs]

Prompts are windows of the pair's held-out standard-library files, run as one batch. In one run, per
verify shape (chain B, tree of budget N with `--branch` candidates per node, the adaptive policy):
  - tokens per round (tau: tokens committed per round and sequence, the bonus included);
  - expert union per round: distinct experts the verify's rows route to, per MoE layer, mean over layers
    and rounds (a Python-stepped run of the same shape; the chain's through the tree code with branch 1);
  - tokens/s of the warmed jitted loop: the fastest of `--repeats` runs, the runs of all shapes interleaved
    (repeat 1 of every shape, then repeat 2, ...) so that a shared machine's load drifts across all alike.
Every output is checked equal to the target's plain greedy output. The adaptive policy's costs are the
per-round seconds measured for the fixed shapes in this run (`spec.tree.VerifyCost`); it is then timed
interleaved with the fastest fixed shape again, and their ratio comes from that paired measurement. Writes tree.{json,md}
(+ tree.png with matplotlib) to --out (default bench_out/) or, with --write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from _output import add_output_args, output_dir


def log(msg: str) -> None:
    print(f"[tree] {msg}", file=sys.stderr, flush=True)


def interleaved(runs: dict, repeats: int) -> dict:
    """{name: fastest seconds} over `repeats` rounds of one run of each (compiled) function."""
    best = {}
    for r in range(repeats):
        for name, fn in runs.items():
            seconds = fn().stats["seconds"]
            best[name] = min(best.get(name, seconds), seconds)
        log(f"timing repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in best.items()))
    return best


def taus(result) -> float:
    acc = [a for seq in result.acceptance_lengths for a in seq]
    return float(np.mean(acc))


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    labels = [r["shape"] for r in rows]
    colors = ["tab:blue" if r["kind"] == "chain" else "tab:green" if r["kind"] == "tree" else "tab:red"
              for r in rows]
    for ax, key, title in zip(axes, ("tokens_per_round", "expert_union_per_round", "tokens_per_second"),
                              ("tokens per round", "experts per layer per verify", "tokens/s (CPU)")):
        vals = [r[key] if r[key] is not None else 0 for r in rows]
        ax.bar(labels, vals, color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--chains", default="4,8,16")
    p.add_argument("--trees", default="8,16,32,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--branch", type=int, default=4)
    add_output_args(p)
    args = p.parse_args(argv)
    out_dir = output_dir(args)

    import jax

    import dflash_jax
    from dflash_jax import SHIPPED_PAIR
    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec import generate
    from dflash_jax.spec.tree import (
        AdaptivePolicy, TreeShape, VerifyCost, generate_tree, generate_tree_stepping,
    )
    from dflash_jax.train.data import file_windows

    pair = dflash_jax.load(args.checkpoint or SHIPPED_PAIR)
    prompts = file_windows(pair, "held_out", args.prompts, args.prompt_len)
    n = args.max_new
    chains = [int(b) for b in args.chains.split(",")]
    trees = [int(t) for t in args.trees.split(",")]
    log(f"{len(prompts)} prompts of {args.prompt_len} tokens, {n} new tokens, chains {chains}, trees {trees} "
        f"(branch {args.branch})")

    t0 = time.perf_counter()
    plain = greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=n)
    log(f"plain greedy reference ({time.perf_counter() - t0:.0f} s)")

    shapes = [("chain", TreeShape(b, 1)) for b in chains] + [("tree", TreeShape(t, args.branch)) for t in trees]

    def runner(kind, shape):
        if kind == "chain":
            return lambda: generate(pair, prompts, max_new_tokens=n, block_size=shape.budget, warmup=False)
        return lambda: generate_tree(pair, prompts, max_new_tokens=n, tree_budget=shape.budget, branch=shape.branch,
                                     warmup=False)

    rows, runs = [], {}
    for kind, shape in shapes:  # compile, check lossless, count experts (untimed)
        t0 = time.perf_counter()
        runs[shape.label()] = runner(kind, shape)
        res = runs[shape.label()]()
        assert res.tokens == plain, f"{shape.label()}: output differs from plain greedy"
        stepped, rounds = generate_tree_stepping(pair, prompts, max_new_tokens=n, shape=shape)
        assert stepped.tokens == plain
        live = np.concatenate([r["live"] for r in rounds])
        union = float(np.concatenate([r["expert_union"] for r in rounds])[live].mean())
        off = float(np.concatenate([r["off_chain"] for r in rounds])[live].mean())
        rows.append(dict(kind=kind, shape=shape.label(), budget=shape.budget, branch=shape.branch,
                         tokens_per_round=round(taus(res), 3), expert_union_per_round=round(union, 2),
                         off_chain_rounds=round(off, 3), tokens=sum(len(t) for t in res.tokens),
                         rounds=int(res.stats["rounds"])))
        log(f"{shape.label():>14}: tau {rows[-1]['tokens_per_round']:.2f}, experts/layer {union:.1f} "
            f"({time.perf_counter() - t0:.0f} s)")
    best = interleaved(runs, args.repeats)
    for r in rows:
        r["seconds"] = round(best[r["shape"]], 4)
        r["tokens_per_second"] = round(r["tokens"] / best[r["shape"]], 1)
        r["seconds_per_round"] = best[r["shape"]] / max(1, r["rounds"])

    # the adaptive policy, its costs the per-round seconds just measured for every fixed shape
    cost = VerifyCost(tuple(r["seconds_per_round"] for r in rows))
    policy = AdaptivePolicy(tuple(s for _, s in shapes), cost)
    fastest_fixed = max(rows, key=lambda r: r["tokens_per_second"])
    adaptive = lambda: generate_tree(pair, prompts, max_new_tokens=n, adaptive=policy)  # noqa: E731
    res = adaptive()
    assert res.tokens == plain, "adaptive: output differs from plain greedy"
    paired = interleaved({"adaptive": adaptive, fastest_fixed["shape"]: runs[fastest_fixed["shape"]]}, args.repeats)
    chosen = res.stats["adaptive_rounds"]
    total = max(1, sum(chosen.values()))
    union = sum(c / total * r["expert_union_per_round"] for c, r in zip(chosen.values(), rows))
    tokens = sum(len(t) for t in res.tokens)
    rows.append(dict(kind="adaptive", shape="adaptive", budget=None, branch=None,
                     tokens_per_round=round(taus(res), 3), expert_union_per_round=round(union, 2),
                     off_chain_rounds=None, tokens=tokens, tokens_per_second=round(tokens / paired["adaptive"], 1),
                     seconds=round(paired["adaptive"], 4), rounds=int(res.stats["rounds"]),
                     seconds_per_round=paired["adaptive"] / max(1, res.stats["rounds"]), chosen=chosen))
    log(f"adaptive: tau {rows[-1]['tokens_per_round']:.2f}, {rows[-1]['tokens_per_second']:.0f} tok/s, "
        f"shapes {chosen}")
    adaptive_ratio = paired[fastest_fixed["shape"]] / paired["adaptive"]

    best_chain = max((r for r in rows if r["kind"] == "chain"), key=lambda r: r["tokens_per_round"])
    best_tree = max((r for r in rows if r["kind"] == "tree"), key=lambda r: r["tokens_per_round"])
    summary = dict(
        tree_over_best_chain_tokens_per_round=round(best_tree["tokens_per_round"] / best_chain["tokens_per_round"], 3),
        best_chain=best_chain["shape"], best_tree=best_tree["shape"], fastest_fixed=fastest_fixed["shape"],
        adaptive_over_fastest_fixed_tokens_per_second=round(adaptive_ratio, 3),
    )
    for r in rows:
        r["seconds_per_round"] = round(r["seconds_per_round"], 5)
    result = dict(checkpoint=os.path.basename((args.checkpoint or SHIPPED_PAIR).rstrip("/")),
                  prompts=len(prompts), repeats=args.repeats, prompt_len=args.prompt_len, max_new=n, branch=args.branch,
                  platform=f"{platform.machine()} {jax.devices()[0].platform}, jax {jax.__version__}",
                  rows=rows, summary=summary, lossless=True)
    with open(os.path.join(out_dir, "tree.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    has_plot = plot(rows, os.path.join(out_dir, "tree.png"))
    md = ["# Chain vs tree verification vs the adaptive policy (shipped pair)", "",
          f"`python benchmarks/tree.py --write-docs` - {len(prompts)} held-out stdlib prompts of {args.prompt_len} "
          f"tokens as one batch, {n} new tokens each, greedy; {result['platform']}. Every run's output equals the "
          "target's plain greedy output. Expert union: distinct experts per MoE layer that one verify's rows route "
          "to (mean over layers and rounds; the adaptive row weights the fixed shapes' figures by the rounds it "
          "chose them).", "",
          "| shape | tokens / round | experts / layer / verify | off-chain rounds | tokens/s | rounds |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        off = "" if r["off_chain_rounds"] is None else f"{r['off_chain_rounds']:.2f}"
        md.append(f"| {r['shape']} | {r['tokens_per_round']:.2f} | {r['expert_union_per_round']:.1f} | {off} | "
                  f"{r['tokens_per_second']:.0f} | {r['rounds']} |")
    md += ["", f"Best tree ({summary['best_tree']}) over the best chain ({summary['best_chain']}) in tokens per "
           f"round: **{summary['tree_over_best_chain_tokens_per_round']:.2f}x**. Adaptive over the fastest fixed "
           f"shape ({summary['fastest_fixed']}) in tokens/s, timed in alternation: "
           f"**{summary['adaptive_over_fastest_fixed_tokens_per_second']:.2f}x** (shapes chosen: {chosen}).", "",
           "Tokens/s are CPU figures on a shared 2-core machine (fastest of the interleaved repeats; the adaptive row's "
           "from its paired repeats with the fastest fixed shape, which the ratio above compares); the chain rows run "
           "the chain loop (its draft at block B), the tree rows the tree loop (the draft at its trained block 16); "
           "expert unions of the chains come from the tree code with one candidate per node.", ""]
    if has_plot:
        md += ["![tree benchmark](tree.png)", ""]
    with open(os.path.join(out_dir, "tree.md"), "w") as fh:
        fh.write("\n".join(md))
    log(f"wrote {out_dir}/tree.json, tree.md" + (", tree.png" if has_plot else ""))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
