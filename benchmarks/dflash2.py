"""Benchmark: DFlash 1 against DFlash 2 drafts of the same target, chains and trees, at equal verify width.

  python benchmarks/dflash2.py [--dflash1 DIR] [--dflash2 DIR] [--prompts 10] [--prompt-len 128] [--max-new 128]
                               [--blocks 8,16] [--repeats 2] [--threads one|all] [--out DIR | --write-docs]

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
compiled (warmed-up) jitted loops; paired, interleaved runs: per prompt, `--repeats` times [plain greedy, then
every proposer at every width] back to back; every output checked equal to the plain greedy output.
Reports tokens per round (tau: tokens committed per round, the bonus included), tokens/s (prompts x new tokens
over the sum of each prompt's best time, wall and process CPU) and the ratios to the DFlash 1 chain at the same
width. Writes dflash2.{json,md,png} to --out (default bench_out/) or, with --write-docs, to docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from report_output import add_output_args, output_dir, save_figure

ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
READING_MARK = "<!-- reading: kept across --write-docs reruns -->"
PROPOSERS = ("dflash1 chain", "head chain", "head tree", "dflash2 selector chain", "dflash2 selector tree")


def log(msg: str) -> None:
    print(f"[dflash2] {msg}", flush=True)


def timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def load_avg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def same_target(a, b) -> bool:
    import jax

    la, lb = jax.tree.leaves(a.target), jax.tree.leaves(b.target)
    return a.target_cfg == b.target_cfg and len(la) == len(lb) and all(
        x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def plot(rows: list[dict], blocks: list[int], path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(PROPOSERS)
    x = np.arange(len(blocks))
    for i, name in enumerate(PROPOSERS):
        got = {r["block"]: r for r in rows if r["proposer"] == name}
        ax1.bar(x + i * width, [got[b]["tau"] for b in blocks], width, label=name)
        ax2.bar(x + i * width, [got[b]["tokens_per_s"] for b in blocks], width, label=name)
    for ax, what in ((ax1, "tokens per round (tau)"), (ax2, "tokens/s (wall, best)")):
        ax.set_xticks(x + 0.4 - width / 2, [f"B={b}" for b in blocks])
        ax.set_ylabel(what)
    ax1.legend(fontsize="small")
    save_figure(fig, path)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dflash1", default=None, help="a converted pair with a DFlash 1 draft (default: the shipped pair)")
    p.add_argument("--dflash2", default=None,
                   help="a converted pair with a DFlash 2 draft, same target (default: the shipped tiny_pair_dflash2)")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--blocks", default="8,16")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per prompt and proposer (interleaved)")
    p.add_argument("--threads", choices=("one", "all"), default="one",
                   help="one: XLA's CPU runtime on one thread for every mode (CPU time = work); all: XLA's defaults")
    add_output_args(p)
    args = p.parse_args(argv)
    if min(args.prompts, args.prompt_len, args.max_new, args.repeats) < 1:
        p.error("--prompts, --prompt-len, --max-new and --repeats must be >= 1")
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        p.error(f"--blocks must be comma-separated integers, not {args.blocks!r}")
    if min(blocks) < 2:
        p.error("--blocks must be >= 2 (a tree needs one proposal position)")
    if args.threads == "one":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + ONE_THREAD).strip()

    import jax

    import dflash_jax
    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec import generate
    from dflash_jax.spec.round import Chain
    from dflash_jax.spec.tree import DEFAULT_BRANCH, TreeShape
    from dflash_jax.train.data import file_windows

    d2_dir = args.dflash2 or dflash_jax.SHIPPED_PAIRS.get("tiny_pair_dflash2")
    if d2_dir is None or not os.path.isdir(d2_dir):
        raise SystemExit("no DFlash 2 pair: pass --dflash2 DIR (a converted pair whose draft is a DFlash2DraftModel)")
    pair1 = dflash_jax.load(args.dflash1 or dflash_jax.SHIPPED_PAIR)
    pair2 = dflash_jax.load(d2_dir)
    if pair1.draft_cfg.dflash2 or not pair2.draft_cfg.dflash2:
        raise SystemExit("--dflash1 needs a DFlash 1 draft and --dflash2 a DFlash 2 draft")
    if pair1.draft.branch_head is None:
        raise SystemExit("the DFlash 1 pair has no branch head (branch_head.safetensors): head chains need one")
    if not same_target(pair1, pair2):
        raise SystemExit("the two pairs' targets differ: compare drafts of one target")
    prompts = file_windows(pair1, "held_out", args.prompts, args.prompt_len)
    n = args.max_new

    def run(pair, proposer, block):
        return lambda prompt: generate(pair, [prompt], max_new_tokens=n, block_size=block, proposer=proposer)

    runs = {}
    for b in blocks:
        tree = TreeShape(b, DEFAULT_BRANCH, use_head=True)
        runs[("dflash1 chain", b)] = run(pair1, Chain(), b)
        runs[("head chain", b)] = run(pair1, Chain(head=True), b)
        runs[("head tree", b)] = run(pair1, tree, b)
        runs[("dflash2 selector chain", b)] = run(pair2, Chain(head=True), b)
        runs[("dflash2 selector tree", b)] = run(pair2, tree, b)

    def plain(prompt):
        return greedy_generate(pair1.target, pair1.target_cfg, [prompt], max_new_tokens=n, stop_ids=[])[0]

    load_before = load_avg()
    log(f"compiling plain + {len(runs)} proposer programs")
    plain(prompts[0])
    for key, fn in runs.items():
        t0 = time.perf_counter()
        fn(prompts[0])
        log(f"  {key[0]} B={key[1]}: {time.perf_counter() - t0:.1f} s")
    keys = ["plain"] + list(runs)
    times = {k: [] for k in keys}  # per prompt: {"wall": [...], "cpu": [...]}
    lengths = {k: [] for k in runs}
    lossless = {k: True for k in runs}
    loads = []
    for i, prompt in enumerate(prompts):
        rec = {k: {"wall": [], "cpu": []} for k in keys}
        ref = None
        for _ in range(args.repeats):
            out, wall, cpu = timed(lambda: plain(prompt))
            ref = out if ref is None else ref
            rec["plain"]["wall"].append(wall)
            rec["plain"]["cpu"].append(cpu)
            for key, fn in runs.items():
                res, wall, cpu = timed(lambda: fn(prompt))
                rec[key]["wall"].append(wall)
                rec[key]["cpu"].append(cpu)
                lossless[key] &= res.tokens[0] == ref
                if len(rec[key]["wall"]) == 1:
                    lengths[key].append(list(res.acceptance_lengths[0]))
        for k in keys:
            times[k].append(rec[k])
        loads.append(load_avg())
        tau = {k: np.mean(lengths[k][-1]) for k in runs}
        log(f"prompt {i + 1}/{len(prompts)}: " + "; ".join(
            f"B={b} tau " + " / ".join(f"{tau[(name, b)]:.2f}" for name in PROPOSERS) for b in blocks)
            + f"; load {loads[-1]}")
    tokens = len(prompts) * n

    def rate(key, what):
        return tokens / sum(min(r[what]) for r in times[key])

    rows = []
    for b in blocks:
        for name in PROPOSERS:
            key = (name, b)
            committed = [x for seq in lengths[key] for x in seq]
            rows.append({"proposer": name, "block": b, "tau": round(float(np.mean(committed)), 3),
                         "tau_per_prompt": [round(float(np.mean(s)), 3) for s in lengths[key]],
                         "rounds": len(committed),
                         "tokens_per_s": round(rate(key, "wall"), 1), "tokens_per_cpu_s": round(rate(key, "cpu"), 1),
                         "lossless": bool(lossless[key]),
                         "acceptance_histogram": np.bincount(committed, minlength=b + 1)[1:].tolist()})
    for r in rows:
        base = next(x for x in rows if x["block"] == r["block"] and x["proposer"] == "dflash1 chain")
        r["tau_vs_dflash1_chain"] = round(r["tau"] / base["tau"], 3)
        r["tokens_per_s_vs_dflash1_chain"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
        r["tokens_per_cpu_s_vs_dflash1_chain"] = round(r["tokens_per_cpu_s"] / base["tokens_per_cpu_s"], 3)
        log(str({k: v for k, v in r.items() if k not in ("tau_per_prompt", "acceptance_histogram")}))
    plain_rate = {"wall": round(rate("plain", "wall"), 1), "cpu": round(rate("plain", "cpu"), 1)}
    d2 = pair2.draft_cfg
    result = {
        "dflash1_pair": os.path.basename(pair1.directory.rstrip("/")),
        "dflash2_pair": os.path.basename(pair2.directory.rstrip("/")),
        "dflash2_fields": {k: getattr(d2, k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                       "selector_top_k")},
        "tree_branch": DEFAULT_BRANCH, "prompts": len(prompts), "prompt_len": args.prompt_len, "max_new_tokens": n,
        "repeats": args.repeats, "backend": jax.default_backend(), "threads": args.threads,
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_1_5_15": {"before": load_before, "after_each_prompt": loads},
        "plain_tokens_per_s": plain_rate, "rows": rows,
        "times_s": {" ".join(map(str, k)) if isinstance(k, tuple) else k: v for k, v in times.items()},
    }
    out_dir = output_dir(args)
    with open(os.path.join(out_dir, "dflash2.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    loads_seen = [x[0] for x in loads if x]
    cmd = "python benchmarks/dflash2.py" + "".join(
        f" --{k.replace('_', '-')} {getattr(args, k)}" for k, d in
        (("prompts", 10), ("prompt_len", 128), ("max_new", 128), ("blocks", "8,16"), ("repeats", 2), ("threads", "one"))
        if getattr(args, k) != d) + " --write-docs"
    md = ["# DFlash 1 and DFlash 2 drafts of one target: chains and trees (CPU)", "",
          f"`{cmd}` - DFlash 1 pair `{result['dflash1_pair']}` (its draft and branch head), DFlash 2 pair "
          f"`{result['dflash2_pair']}` (same target, tensor for tensor; DFlash 2 fields {result['dflash2_fields']}); "
          f"{len(prompts)} held-out stdlib prompts of {args.prompt_len} tokens, {n} new tokens each, greedy, batch 1, "
          f"compiled jitted loops; {result['machine']}, backend {result['backend']}, XLA threads: {args.threads}. "
          f"Paired runs: per prompt, {args.repeats} rounds of [plain greedy, then every proposer at every width] back "
          "to back; every output checked equal to the plain greedy output. tau = tokens committed per round (bonus "
          "included); tokens/s = prompts x new tokens over the sum of each prompt's best time (end to end, prefill "
          f"included), wall and process CPU. Trees: B nodes, {DEFAULT_BRANCH} candidates a node, no calibration file. "
          f"Load average (1 min) over the run: {min(loads_seen, default=0):.1f} - {max(loads_seen, default=0):.1f}.",
          "", f"Plain greedy: {plain_rate['wall']} tok/s wall, {plain_rate['cpu']} tok per CPU-s.", "",
          "| B | proposer | tau | tau / DFlash 1 chain | tok/s wall | tok/s / DFlash 1 chain | tok per CPU-s "
          "| CPU / DFlash 1 chain | output == plain greedy |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['block']} | {r['proposer']} | {r['tau']:.2f} | {r['tau_vs_dflash1_chain']:.2f}x | "
                  f"{r['tokens_per_s']} | {r['tokens_per_s_vs_dflash1_chain']:.2f}x | {r['tokens_per_cpu_s']} | "
                  f"{r['tokens_per_cpu_s_vs_dflash1_chain']:.2f}x | {'yes' if r['lossless'] else 'NO'} |")
    md.append("")
    if plot(rows, blocks, os.path.join(out_dir, "dflash2.png")):
        md += ["![tokens per round and tokens/s by proposer and width](dflash2.png)", ""]
    md_path = os.path.join(out_dir, "dflash2.md")
    if os.path.exists(md_path):
        old = open(md_path).read()
        if READING_MARK in old:
            md += [READING_MARK + old.split(READING_MARK, 1)[1].rstrip("\n"), ""]
    with open(md_path, "w") as fh:
        fh.write("\n".join(md))
    log(f"wrote {out_dir}/dflash2.{{json,md,png}}")
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
