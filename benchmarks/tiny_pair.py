"""Benchmark on the shipped pair: acceptance (tau) by block size, DFlash vs plain decoding, jit vs Python loop.

  python benchmarks/tiny_pair.py [--checkpoint DIR | --pair NAME] [--prompts 8] [--prompt-len 128] [--max-new 128]
                                 [--out DIR | --write-docs]
  python benchmarks/tiny_pair.py --pair tiny_pair_qwen3_5 --blocks 4,8,16 --write-docs   # the hybrid pair

Prompts are windows of the held-out standard-library files (split.json of the pair, never trained on).
In one run, with compiled (warmed-up) jitted loops and batch 1 as in interactive use:
  - tau = tokens committed per round, per block size 1, 2, 4, 8, 16;
  - tokens/s of the DFlash jitted loop vs the plain greedy jitted loop of the same target -> speedup;
  - rounds/s of the jitted while_loop vs the Python stepping loop, and the host share of a round.
Every DFlash output is checked equal to the plain greedy output (lossless). Writes <name>.{json,md,png} to
--out (default bench_out/, ignored by git) or, with --write-docs, to docs/benchmarks/; <name> is the pair's name
(tiny_pair for the default pair or --checkpoint, tiny_pair_qwen3_5 for `--pair tiny_pair_qwen3_5`).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(fn, repeats: int = 2):
    fn()  # compile
    best = None
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return out, best


def plot(rows: list[dict], path: str) -> bool:
    """tau and speedup by block size, and per block size the histogram of tokens committed per round."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = [str(r["block_size"]) for r in rows]
    ax1.bar(labels, [r["tau"] for r in rows], color="tab:blue")
    ax1.set_xlabel("block size B")
    ax1.set_ylabel("tokens per round (tau)", color="tab:blue")
    twin = ax1.twinx()
    twin.plot(labels, [r["speedup"] for r in rows], "o-", color="tab:red")
    twin.set_ylabel("speedup over plain greedy", color="tab:red")
    twin.set_ylim(bottom=0)
    for r in rows:
        hist = np.asarray(r["acceptance_histogram"], dtype=float)
        if hist.sum():
            ax2.step(np.arange(1, len(hist) + 1), hist / hist.sum(), where="mid", marker=".",
                     label=f"B={r['block_size']}")
    ax2.set_xlabel("tokens committed in a round")
    ax2.set_ylabel("fraction of rounds")
    ax2.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="default: the shipped pair")
    p.add_argument("--pair", default=None, metavar="NAME", help="a shipped pair by name (dflash_jax.SHIPPED_PAIRS)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--blocks", default="1,2,4,8,16")
    p.add_argument("--dequantize-experts", choices=("no", "yes"), default="no",
                   help="no: the FP4 expert tables as stored, dequantized inside every forward (plain and DFlash "
                        "alike); yes: dequantized once at load (what dflash-generate does on a CPU). With yes the "
                        "outputs are named <pair>_dense")
    add_output_args(p)
    args = p.parse_args(argv)
    if min(args.prompts, args.prompt_len, args.max_new) < 1:
        p.error("--prompts, --prompt-len and --max-new must be >= 1")

    import jax

    import dflash_jax
    from dflash_jax.cli.generate import UsageError, resolve_pair
    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec import generate, generate_stepping

    try:
        directory = resolve_pair(args.checkpoint, args.pair)
    except UsageError as e:
        raise SystemExit(str(e))
    stem = args.pair if args.pair and args.pair != "tiny_pair" else "tiny_pair"
    dense = args.dequantize_experts == "yes"
    if dense:
        stem += "_dense"
    pair = dflash_jax.load(directory, dequantize_experts=dense)
    from dflash_jax.train.data import file_windows

    try:
        prompts = file_windows(pair, "held_out", args.prompts, args.prompt_len)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(str(e))
    blocks = [int(b) for b in args.blocks.split(",")]
    n = args.max_new
    rows = []
    plain_out = []

    def plain(prompt):
        return greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=n, stop_ids=[])

    for prompt in prompts:
        plain_out.append(plain(prompt)[0])  # compiles once; the reference output
    for block in blocks:
        # each prompt's plain and DFlash runs back to back, so a row's ratio compares runs made at the same
        # moment of a shared, noisy machine
        total_time, plain_time, taus, lossless, lengths = 0.0, 0.0, [], True, []
        for prompt, ref in zip(prompts, plain_out):
            _, pdt = timed(lambda: plain(prompt))
            res, dt = timed(lambda: generate(pair, [prompt], max_new_tokens=n, block_size=block))
            total_time += dt
            plain_time += pdt
            taus.append(res.mean_acceptance())
            lengths += res.acceptance_lengths[0]
            lossless &= res.tokens[0] == ref
        tps = len(prompts) * n / total_time
        plain_tps = len(prompts) * n / plain_time
        row = {"block_size": block, "tau": round(float(np.mean(taus)), 3), "tokens_per_s": round(tps, 1),
               "plain_tokens_per_s": round(plain_tps, 1), "speedup": round(tps / plain_tps, 2),
               "lossless": bool(lossless),
               # rounds that committed k tokens, k = 1..block (accepted proposals + the bonus)
               "acceptance_histogram": np.bincount(lengths, minlength=block + 1)[1:].tolist()}
        rows.append(row)
        print(row, flush=True)
    # jit vs Python stepping at the draft's trained block size
    block = pair.draft_cfg.block_size if pair.draft_cfg.block_size in blocks else blocks[-1]
    prompt = prompts[0]
    jit_res, jit_dt = timed(lambda: generate(pair, [prompt], max_new_tokens=n, block_size=block))
    step_res, step_dt = timed(lambda: generate_stepping(pair, [prompt], max_new_tokens=n, block_size=block))
    split = step_res.stats["time_split"]
    loops = {
        "block_size": block, "rounds": jit_res.stats["rounds"],
        "jit_rounds_per_s": round(jit_res.stats["rounds"] / jit_dt, 1),
        "python_rounds_per_s": round(step_res.stats["rounds"] / step_dt, 1),
        "python_time_split_s": {k: round(v, 4) for k, v in split.items()},
        "host_share_of_round": round(split["host_s"] / (step_dt - split["prefill_s"]), 3),
    }
    print(loops)
    result = {"checkpoint": os.path.basename(pair.directory.rstrip("/")), "prompts": len(prompts),
              "prompt_len": args.prompt_len, "max_new_tokens": n, "backend": jax.default_backend(),
              "expert_tables": "dense (dequantized at load)" if dense else "as stored (FP4 dequantized per forward)",
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "by_block_size": rows, "loops": loops}
    out_dir = output_dir(args)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    kind = {"qwen3_5": "hybrid Qwen3.5-MoE"}.get(pair.target_cfg.model_type.removesuffix("_moe"), "")
    name = stem.removesuffix("_dense")
    title = f"The shipped {kind} pair `{name}`" if name != "tiny_pair" else "The shipped pair"
    if dense:
        title += ", expert tables dequantized at load"
    cmd = "python benchmarks/tiny_pair.py" + (f" --pair {name}" if name != "tiny_pair" else "") + \
        (f" --blocks {args.blocks}" if args.blocks != "1,2,4,8,16" else "") + \
        "".join(f" --{k.replace('_', '-')} {getattr(args, k)}" for k, d in
                (("prompts", 8), ("prompt_len", 128), ("max_new", 128)) if getattr(args, k) != d) + \
        (" --dequantize-experts yes" if dense else "") + " --write-docs"
    md = [f"# {title}: acceptance and speed (CPU)", "",
          f"`{cmd}` - {len(prompts)} held-out stdlib prompts of {args.prompt_len} tokens, "
          f"{n} new tokens each, greedy, batch 1, compiled loops, best of 2; {result['machine']}, "
          f"backend {result['backend']}; expert tables {result['expert_tables']}. "
          "Speedup = DFlash jitted loop tokens/s over the plain greedy jitted loop of the same target, each prompt's "
          "plain and DFlash runs back to back (so each row's plain tok/s is its own).",
          "",
          "| block size | tau (tokens/round) | DFlash tok/s | plain tok/s | speedup | output == plain greedy |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['block_size']} | {r['tau']} | {r['tokens_per_s']} | {r['plain_tokens_per_s']} | "
                  f"{r['speedup']}x | {'yes' if r['lossless'] else 'NO'} |")
    md += ["", f"Loops at block size {block}: jitted while_loop {loops['jit_rounds_per_s']} rounds/s, Python "
           f"stepping loop {loops['python_rounds_per_s']} rounds/s; in the stepping loop the host (dispatch, "
           f"transfers, Python) takes {loops['host_share_of_round'] * 100:.0f}% of the decode time "
           f"(split: {loops['python_time_split_s']}).", ""]
    if plot(rows, os.path.join(out_dir, f"{stem}.png")):
        md += [f"![tau and speedup by block size; tokens per round histograms]({stem}.png)", ""]
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as fh:
        fh.write("\n".join(md))
    print(f"wrote {out_dir}/{stem}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
