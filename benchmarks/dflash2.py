"""Benchmark: DFlash 1 against DFlash 2 drafts of the same target, chains and trees, at equal verify width.

  python benchmarks/dflash2.py [--dflash1 DIR] [--dflash2 DIR] [--prompts 10] [--prompt-len 128] [--max-new 128]
                               [--blocks 8,16] [--repeats 2] [--threads one|all] [--quick] [--out DIR | --write-docs]

Two converted pairs with the same target (checked tensor by tensor): `--dflash1` (default: the shipped pair,
whose DFlash 1 draft carries a branch head) and `--dflash2` (default: the shipped DFlash 2 variant,
`dflash_jax.SHIPPED_PAIRS["tiny_pair_dflash2"]`). Proposers, each at verify width B for every `--blocks` B:
  - DFlash 1 chain: the draft's argmax chain, block B (`Chain()`);
  - head chain: the DFlash 1 draft's branch-head chain (`Chain(head=True)`);
  - head tree: a token tree of B nodes, 4 candidates a node, built from the branch head (`TreeShape(B)`);
  - DFlash 2 selector chain: the DFlash 2 draft's selector chain (`Chain(head=True)` on that draft);
  - DFlash 2 selector tree: a tree of B nodes whose children are the selector's top candidates (`TreeShape(B)`).
Trees build without a calibration file (neither pair's own fit), so both drafts are ranked the same way.
Prompts are windows of the held-out standard-library files (split.json, never trained on). Batch 1, greedy,
compiled (warmed-up) jitted loops; paired, interleaved runs (`harness.paired_items`): per prompt, `--repeats`
times [plain greedy, then every proposer at every width] back to back; every output checked equal to the plain
greedy output. Reports tokens per round (tau: tokens committed per round, the bonus included), tokens/s
(prompts x new tokens over the sum of each prompt's best time, wall and process CPU) and the ratios to the
DFlash 1 chain at the same width. Writes dflash2.{json,md,png} to --out (default bench_out/) or, with
--write-docs, to docs/benchmarks/.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import harness as h

PROPOSERS = ("dflash1 chain", "head chain", "head tree", "dflash2 selector chain", "dflash2 selector tree")
DEFAULTS = dict(prompts=10, prompt_len=128, max_new=128, blocks="8,16", repeats=2, threads="one")
log = h.logger("dflash2")


def same_target(a, b) -> bool:
    import jax

    la, lb = jax.tree.leaves(a.target), jax.tree.leaves(b.target)
    return a.target_cfg == b.target_cfg and len(la) == len(lb) and all(
        x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def main(argv=None) -> int:
    p = h.parser(__doc__, {"--dflash1": (None, "a converted pair with a DFlash 1 draft (default: the shipped pair)"),
                           "--dflash2": (None, "a converted pair with a DFlash 2 draft, same target (default: the "
                                               "shipped tiny_pair_dflash2)")}, **DEFAULTS)
    args = h.parse(p, argv, quick=dict(prompts=1, prompt_len=32, max_new=8, blocks="4", repeats=1))
    blocks = h.int_list(p, args.blocks, "--blocks", minimum=2)  # a tree needs one proposal position

    import dflash_jax
    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec import generate
    from dflash_jax.spec.round import Chain
    from dflash_jax.spec.tree import DEFAULT_BRANCH, TreeShape

    d2_dir = args.dflash2 or dflash_jax.SHIPPED_PAIRS.get("tiny_pair_dflash2")
    if d2_dir is None or not os.path.isdir(d2_dir):
        raise SystemExit("no DFlash 2 pair: pass --dflash2 DIR (a converted pair whose draft is a DFlash2DraftModel)")
    pair1, pair2 = dflash_jax.load(args.dflash1 or dflash_jax.SHIPPED_PAIR), dflash_jax.load(d2_dir)
    if pair1.draft_cfg.dflash2 or not pair2.draft_cfg.dflash2:
        raise SystemExit("--dflash1 needs a DFlash 1 draft and --dflash2 a DFlash 2 draft")
    if pair1.draft.branch_head is None:
        raise SystemExit("the DFlash 1 pair has no branch head (branch_head.safetensors): head chains need one")
    if not same_target(pair1, pair2):
        raise SystemExit("the two pairs' targets differ: compare drafts of one target")
    prompts = h.prompts(pair1, args.prompts, args.prompt_len)
    n = args.max_new

    def run(pair, proposer, block):
        return lambda prompt: generate(pair, [prompt], max_new_tokens=n, block_size=block, proposer=proposer)

    runs = {"plain": lambda prompt: greedy_generate(pair1.target, pair1.target_cfg, [prompt], max_new_tokens=n,
                                                    stop_ids=[])[0]}
    for b in blocks:
        tree = TreeShape(b, DEFAULT_BRANCH, use_head=True)
        for name, pair, proposer in (("dflash1 chain", pair1, Chain()), ("head chain", pair1, Chain(head=True)),
                                     ("head tree", pair1, tree), ("dflash2 selector chain", pair2, Chain(head=True)),
                                     ("dflash2 selector tree", pair2, tree)):
            runs[f"{name} B={b}"] = run(pair, proposer, b)
    load_before = h.load_average()
    log(f"compiling plain + {len(runs) - 1} proposer programs")
    for key, fn in runs.items():
        _, wall, _ = h.timed(lambda: fn(prompts[0]))
        log(f"  {key}: {wall:.1f} s")
    outputs = h.Outputs("plain", key=lambda r: r if isinstance(r, list) else r.tokens[0])

    def progress(i, _, t):
        tau = {k: np.mean(outputs.first[k][-1].acceptance_lengths[0]) for k in runs if k != "plain"}
        log(f"prompt {i + 1}/{len(prompts)}: " + "; ".join(
            f"B={b} tau " + " / ".join(f"{tau[f'{name} B={b}']:.2f}" for name in PROPOSERS) for b in blocks)
            + f"; load {t.loads[-1]}")

    times = h.paired_items(prompts, lambda prompt: {k: (lambda fn=fn: fn(prompt)) for k, fn in runs.items()},
                           args.repeats, outputs=outputs, log=progress)
    tokens = len(prompts) * n
    rows = []
    for b in blocks:
        for name in PROPOSERS:
            key = f"{name} B={b}"
            lengths = [list(r.acceptance_lengths[0]) for r in outputs.first[key]]
            committed = [x for seq in lengths for x in seq]
            rows.append({"proposer": name, "block": b, "tau": round(float(np.mean(committed)), 3),
                         "tau_per_prompt": [round(float(np.mean(s)), 3) for s in lengths], "rounds": len(committed),
                         "tokens_per_s": round(h.rate(times, key, tokens, "wall"), 1),
                         "tokens_per_cpu_s": round(h.rate(times, key, tokens, "cpu"), 1),
                         "lossless": bool(outputs.lossless[key]),
                         "acceptance_histogram": np.bincount(committed, minlength=b + 1)[1:].tolist()})
    for r in rows:
        base = next(x for x in rows if x["block"] == r["block"] and x["proposer"] == "dflash1 chain")
        for k in ("tau", "tokens_per_s", "tokens_per_cpu_s"):
            r[f"{k}_vs_dflash1_chain"] = round(r[k] / base[k], 3)
        log(str({k: v for k, v in r.items() if k not in ("tau_per_prompt", "acceptance_histogram")}))
    plain_rate = {c: round(h.rate(times, "plain", tokens, c), 1) for c in ("wall", "cpu")}
    d2 = pair2.draft_cfg
    loads = [t.loads[-1] for t in times]
    result = {
        "dflash1_pair": os.path.basename(pair1.directory.rstrip("/")),
        "dflash2_pair": os.path.basename(pair2.directory.rstrip("/")),
        "dflash2_fields": {k: getattr(d2, k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                       "selector_top_k")},
        "tree_branch": DEFAULT_BRANCH, "prompts": len(prompts), "prompt_len": args.prompt_len, "max_new_tokens": n,
        "repeats": args.repeats, "backend": h.machine()["backend"], "threads": args.threads,
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "machine": h.machine()["machine"],
        "load_average_1_5_15": {"before": load_before, "after_each_prompt": loads},
        "plain_tokens_per_s": plain_rate, "rows": rows,
        "times_s": {k: [{"wall": t.wall[k], "cpu": t.cpu[k]} for t in times] for k in runs},
    }
    loads_seen = [x[0] for x in loads if x]
    md = ["# DFlash 1 and DFlash 2 drafts of one target: chains and trees (CPU)", "",
          f"`{h.command('dflash2.py', args, DEFAULTS)}` - DFlash 1 pair `{result['dflash1_pair']}` (its draft and "
          f"branch head), DFlash 2 pair `{result['dflash2_pair']}` (same target, tensor for tensor; DFlash 2 fields "
          f"{result['dflash2_fields']}); {len(prompts)} held-out stdlib prompts of {args.prompt_len} tokens, {n} new "
          f"tokens each, greedy, batch 1, compiled jitted loops; {result['machine']}, backend {result['backend']}, "
          f"XLA threads: {args.threads}. Paired runs: per prompt, {args.repeats} rounds of [plain greedy, then every "
          "proposer at every width] back to back; every output checked equal to the plain greedy output. tau = "
          "tokens committed per round (bonus included); tokens/s = prompts x new tokens over the sum of each "
          "prompt's best time (end to end, prefill included), wall and process CPU. Trees: B nodes, "
          f"{DEFAULT_BRANCH} candidates a node, no calibration file. Load average (1 min) over the run: "
          f"{min(loads_seen, default=0):.1f} - {max(loads_seen, default=0):.1f}.", "",
          f"Plain greedy: {plain_rate['wall']} tok/s wall, {plain_rate['cpu']} tok per CPU-s.", ""]
    md += h.table(["B", "proposer", "tau", "tau / DFlash 1 chain", "tok/s wall", "tok/s / DFlash 1 chain",
                   "tok per CPU-s", "CPU / DFlash 1 chain", "output == plain greedy"],
                  [[r["block"], r["proposer"], f"{r['tau']:.2f}", f"{r['tau_vs_dflash1_chain']:.2f}x",
                    r["tokens_per_s"], f"{r['tokens_per_s_vs_dflash1_chain']:.2f}x", r["tokens_per_cpu_s"],
                    f"{r['tokens_per_cpu_s_vs_dflash1_chain']:.2f}x", "yes" if r["lossless"] else "NO"] for r in rows])

    def draw(axes):
        width, x = 0.8 / len(PROPOSERS), np.arange(len(blocks))
        for i, name in enumerate(PROPOSERS):
            got = {r["block"]: r for r in rows if r["proposer"] == name}
            axes[0].bar(x + i * width, [got[b]["tau"] for b in blocks], width, label=name)
            axes[1].bar(x + i * width, [got[b]["tokens_per_s"] for b in blocks], width, label=name)
        for ax, what in zip(axes, ("tokens per round (tau)", "tokens/s (wall, best)")):
            ax.set_xticks(x + 0.4 - width / 2, [f"B={b}" for b in blocks])
            ax.set_ylabel(what)
        axes[0].legend(fontsize="small")

    h.Report(args, "dflash2").write(result, md, draw=draw, ncols=2, figsize=(11, 3.8),
                                    image="tokens per round and tokens/s by proposer and width")
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
