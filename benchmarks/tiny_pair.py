"""Benchmark on the shipped pair: acceptance (tau) by block size, DFlash vs plain decoding, jit vs Python loop.

  python benchmarks/tiny_pair.py [--checkpoint DIR | --pair NAME] [--prompts 10] [--prompt-len 128] [--max-new 256]
                                 [--repeats 3] [--threads one|all] [--out DIR | --write-docs]
  python benchmarks/tiny_pair.py --pair tiny_pair_qwen3_5 --blocks 4,8,16 --write-docs   # the hybrid pair

Prompts are windows of the held-out standard-library files (split.json of the pair, never trained on).
In one run, with compiled (warmed-up) jitted loops and batch 1 as in interactive use:
  - tau = tokens committed per round, per block size;
  - tokens/s of the DFlash jitted loop vs the plain greedy jitted loop of the same target -> speedup, from
    paired, interleaved runs: per prompt, `--repeats` times [plain, DFlash at each block size] back to back;
    wall time and process CPU time, best-of and median per prompt (with `--threads one`, the default, XLA's CPU
    runtime runs on one thread for both modes, so CPU time measures the work and is steady under load);
    the load average is recorded;
  - rounds/s of the jitted while_loop vs the Python stepping loop, and the host share of a round.
Every DFlash run's output is checked equal to the plain greedy output (lossless). Writes <name>.{json,md,png} to
--out (default bench_out/, ignored by git) or, with --write-docs, to docs/benchmarks/; <name> is the pair's name
(tiny_pair for the default pair or --checkpoint, tiny_pair_qwen3_5 for `--pair tiny_pair_qwen3_5`). A report's
hand-written reading below the line `<!-- reading: kept across --write-docs reruns -->` is kept on a rerun.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time

import numpy as np

from report_output import add_output_args, output_dir, save_figure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def timed(fn):
    """(result, wall seconds, process CPU seconds) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def plain_without_rollback(pair, n: int):
    """Plain greedy decoding as `decode.greedy_generate` (same buckets, prefill and decode loop), but with a target
    cache that keeps no rollback rows (`verify_width=0`): for a DeltaNet target every step then commits its state
    directly instead of keeping the row (greedy_generate keeps one, replayed by the next step). The strictest plain
    baseline; the same target forward at width 1. Returns prompt -> generated ids."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.decode import decode_loop
    from dflash_jax.spec import requests as rq
    from dflash_jax.spec.session import init_target_cache, target_family

    cfg, weights, buckets = pair.target_cfg, pair.target, rq.Buckets(pad_batch=True)

    @functools.partial(jax.jit, static_argnums=2)
    def prefill(tokens, lengths, max_len):
        cache = init_target_cache(cfg, tokens.shape[0], max_len, weights.embed.dtype, verify_width=0)
        out = target_family(cfg).forward(weights, tokens, cache, cfg, num_valid=lengths, logits="last")
        return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.cache

    output_len = buckets.output_len(n)

    def run(prompt):
        checked = rq.check_prompts([prompt], cfg.vocab_size)
        prompt_len = buckets.prompt_len(len(prompt))
        max_len = min(buckets.cache_len(prompt_len + output_len), cfg.max_position_embeddings)
        tokens, lengths = rq.pad_prompts(checked, min(prompt_len, max_len), buckets.batch_size(1))
        first, cache = prefill(tokens, lengths, max_len)
        stops = np.full((buckets.stops_len(0),), -1, np.int32)
        budgets = np.full((tokens.shape[0],), n, np.int32)
        out, num, _ = decode_loop(weights, first, cache, stops, budgets, cfg, output_len)
        out, num = np.asarray(out), np.asarray(num)
        return list(map(int, out[0, : num[0]]))

    return run


def repeated_share(prompt, out, n: int = 8) -> float:
    """Share of the generated tokens that end an n-gram already seen in the prompt or earlier output: how much a
    greedy continuation loops (drafts accept more on repeated text)."""
    seq = list(prompt) + list(out)
    seen, repeated = set(), 0
    for j in range(n, len(seq) + 1):
        gram = tuple(seq[j - n: j])
        repeated += j > len(prompt) and gram in seen
        seen.add(gram)
    return repeated / max(len(out), 1)


def load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


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
    save_figure(fig, path)
    return True


READING_MARK = "<!-- reading: kept across --write-docs reruns -->"


def summary(times: dict, key: str, tokens: int, base: str = "plain") -> dict:
    """tokens/s of the plain loop `base` and each block size from per-prompt lists of timings, by the sum over
    prompts of each prompt's best (minimum) and median time; per-prompt ratios of the medians."""
    out = {}
    for stat, fn in (("best", np.min), ("median", np.median)):
        plain = sum(fn(r[key]) for r in times[base])
        out[f"plain_tokens_per_s_{stat}"] = round(tokens / plain, 1)
        for block, runs in times["dflash"].items():
            t = sum(fn(r[key]) for r in runs)
            out.setdefault(block, {})[f"tokens_per_s_{stat}"] = round(tokens / t, 1)
            out[block][f"speedup_{stat}"] = round(plain / t, 3)
    for block, runs in times["dflash"].items():
        ratios = [np.median(p[key]) / np.median(r[key]) for p, r in zip(times[base], runs)]
        out[block]["speedup_per_prompt_min"] = round(float(np.min(ratios)), 3)
        out[block]["speedup_per_prompt_max"] = round(float(np.max(ratios)), 3)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="default: the shipped pair")
    p.add_argument("--pair", default=None, metavar="NAME", help="a shipped pair by name (dflash_jax.SHIPPED_PAIRS)")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and mode (interleaved)")
    p.add_argument("--blocks", default="1,2,4,8,16")
    p.add_argument("--threads", choices=("one", "all"), default="one",
                   help="one: XLA's CPU runtime on one thread (--xla_cpu_multi_thread_eigen=false "
                        "intra_op_parallelism_threads=1), for plain and DFlash alike, so CPU time = work; all: XLA's "
                        "defaults")
    p.add_argument("--dequantize-experts", choices=("no", "yes"), default="no",
                   help="no: the FP4 expert tables as stored, dequantized inside every forward (plain and DFlash "
                        "alike); yes: dequantized once at load (what dflash-generate does on a CPU). With yes the "
                        "outputs are named <pair>_dense")
    add_output_args(p)
    args = p.parse_args(argv)
    if min(args.prompts, args.prompt_len, args.max_new, args.repeats) < 1:
        p.error("--prompts, --prompt-len, --max-new and --repeats must be >= 1")
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        p.error(f"--blocks must be comma-separated integers, not {args.blocks!r}")
    if min(blocks) < 1:
        p.error("--blocks must be >= 1")
    if args.threads == "one":  # before jax is imported; the same flags for both modes
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + ONE_THREAD).strip()

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

    if args.prompt_len + args.max_new > pair.target_cfg.max_position_embeddings:
        raise SystemExit(f"--prompt-len + --max-new ({args.prompt_len + args.max_new}) exceeds the target's "
                         f"{pair.target_cfg.max_position_embeddings} positions: ask for fewer tokens")
    try:
        prompts = file_windows(pair, "held_out", args.prompts, args.prompt_len)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(str(e))
    n = args.max_new
    load_before = load_avg()

    def plain(prompt):
        return greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=n, stop_ids=[])[0]

    def dflash(prompt, block):
        return generate(pair, [prompt], max_new_tokens=n, block_size=block)

    from dflash_jax.spec.session import target_family

    # a DeltaNet target: also the plain loop whose cache keeps no rollback row (the strictest baseline)
    strict = plain_without_rollback(pair, n) if target_family(pair.target_cfg).needs_rollback_width else None
    # every program compiled before any timing
    plain(prompts[0])
    if strict is not None:
        strict(prompts[0])
    for block in blocks:
        dflash(prompts[0], block)
    baselines = ["plain"] + (["plain_w0"] if strict is not None else [])
    times = {"plain": [], "plain_w0": [], "dflash": {b: [] for b in blocks}}
    taus, lossless, lengths, loads = {b: [] for b in blocks}, {b: True for b in blocks}, {b: [] for b in blocks}, []
    per_prompt = []
    for i, prompt in enumerate(prompts):
        # paired and interleaved: each repeat runs plain, then every block size, on this prompt, so each ratio
        # compares runs made moments apart on a shared, noisy machine
        ref = None
        rec = {k: {"wall": [], "cpu": []} for k in baselines + blocks}
        for _ in range(args.repeats):
            for base in baselines:
                out, wall, cpu = timed(lambda: (plain if base == "plain" else strict)(prompt))
                ref = out if ref is None else ref
                if out != ref:
                    raise SystemExit(f"{base} decoding disagrees with plain greedy: the reference is ill-defined")
                rec[base]["wall"].append(wall)
                rec[base]["cpu"].append(cpu)
            for block in blocks:
                res, wall, cpu = timed(lambda: dflash(prompt, block))
                rec[block]["wall"].append(wall)
                rec[block]["cpu"].append(cpu)
                lossless[block] &= res.tokens[0] == ref  # checked on every run
                if len(rec[block]["wall"]) == 1:
                    taus[block].append(res.mean_acceptance())
                    lengths[block] += res.acceptance_lengths[0]
        for base in baselines:
            times[base].append(rec[base])
        for block in blocks:
            times["dflash"][block].append(rec[block])
        loads.append(load_avg())
        per_prompt.append({
            "repeated_8gram_share": round(repeated_share(prompt, ref), 3),
            "tau": {b: round(taus[b][-1], 3) for b in blocks},
            "cpu_speedup_median": {b: round(float(np.median(rec["plain"]["cpu"]) / np.median(rec[b]["cpu"])), 3)
                                   for b in blocks}})
        print(f"prompt {i + 1}/{len(prompts)}: plain {n / min(rec['plain']['wall']):.1f} tok/s; " + ", ".join(
            f"B={b} {min(rec['plain']['wall']) / min(rec[b]['wall']):.2f}x" for b in blocks)
            + f"; load {loads[-1]}", flush=True)
    tokens = len(prompts) * n
    wall, cpu = summary(times, "wall", tokens), summary(times, "cpu", tokens)
    strict_sum = {k: summary(times, k, tokens, "plain_w0") for k in ("wall", "cpu")} if strict is not None else None
    rows = []
    for block in blocks:
        row = {"block_size": block, "tau": round(float(np.mean(taus[block])), 3),
               "tokens_per_s": wall[block]["tokens_per_s_best"], "plain_tokens_per_s": wall["plain_tokens_per_s_best"],
               "speedup": round(wall[block]["speedup_best"], 2), "lossless": bool(lossless[block]),
               "wall": wall[block], "cpu": cpu[block],
               "vs_plain_without_rollback": None if strict_sum is None else
               {k: {s: strict_sum[k][block][f"speedup_{s}"] for s in ("best", "median")} for k in ("wall", "cpu")},
               # rounds that committed k tokens, k = 1..block (accepted proposals + the bonus)
               "acceptance_histogram": np.bincount(lengths[block], minlength=block + 1)[1:].tolist()}
        rows.append(row)
        print(row, flush=True)
    # jit vs Python stepping at the draft's trained block size
    block = pair.draft_cfg.block_size if pair.draft_cfg.block_size in blocks else blocks[-1]
    prompt = prompts[0]
    jit_res, jit_dt, _ = min((timed(lambda: dflash(prompt, block)) for _ in range(2)), key=lambda r: r[1])
    generate_stepping(pair, [prompt], max_new_tokens=n, block_size=block)  # compile
    step_res, step_dt, _ = min((timed(lambda: generate_stepping(pair, [prompt], max_new_tokens=n, block_size=block))
                                for _ in range(2)), key=lambda r: r[1])
    split = step_res.stats["time_split"]
    loops = {
        "block_size": block, "rounds": jit_res.stats["rounds"],
        "jit_rounds_per_s": round(jit_res.stats["rounds"] / jit_dt, 1),
        "python_rounds_per_s": round(step_res.stats["rounds"] / step_dt, 1),
        "python_time_split_s": {k: round(v, 4) for k, v in split.items()},
        "host_share_of_round": round(split["host_s"] / (step_dt - split["prefill_s"]), 3),
    }
    print(loops)
    xla_flags = os.environ.get("XLA_FLAGS", "")
    result = {"checkpoint": os.path.basename(pair.directory.rstrip("/")), "prompts": len(prompts),
              "prompt_len": args.prompt_len, "max_new_tokens": n, "repeats": args.repeats,
              "backend": jax.default_backend(), "threads": args.threads, "xla_flags": xla_flags,
              "expert_tables": "dense (dequantized at load)" if dense else "as stored (FP4 dequantized per forward)",
              "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "load_average_1_5_15": {"before": load_before, "after_each_prompt": loads},
              "plain_tokens_per_s": {"wall": {k: wall[f"plain_tokens_per_s_{k}"] for k in ("best", "median")},
                                     "cpu": {k: cpu[f"plain_tokens_per_s_{k}"] for k in ("best", "median")}},
              "plain_without_rollback_tokens_per_s": None if strict_sum is None else {
                  m: {k: strict_sum[m][f"plain_tokens_per_s_{k}"] for k in ("best", "median")}
                  for m in ("wall", "cpu")},
              "by_block_size": rows, "per_prompt": per_prompt, "loops": loops,
              "times_s": {"plain": times["plain"], "plain_without_rollback": times["plain_w0"],
                          "dflash": {str(b): v for b, v in times["dflash"].items()}}}
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
                (("prompts", 10), ("prompt_len", 128), ("max_new", 256), ("repeats", 3), ("threads", "one"))
                if getattr(args, k) != d) + \
        (" --dequantize-experts yes" if dense else "") + " --write-docs"
    threads = ("XLA's CPU runtime on one thread for both modes (`XLA_FLAGS=" + ONE_THREAD + "`)"
               if args.threads == "one" else "XLA's default threading")
    loads_seen = [x[0] for x in loads if x]
    md = [f"# {title}: acceptance and speed (CPU)", "",
          f"`{cmd}` - {len(prompts)} held-out stdlib prompts of {args.prompt_len} tokens, "
          f"{n} new tokens each, greedy, batch 1, compiled loops; {result['machine']}, "
          f"backend {result['backend']}; {threads}; expert tables {result['expert_tables']}. "
          f"Paired runs: for each prompt, {args.repeats} rounds of [plain, then DFlash at each block size] back to "
          "back, every run's output checked against the plain greedy output. Tokens/s = prompts x new tokens over "
          "the sum over prompts of each prompt's best (or median) time, end to end (prefill included); "
          "speedup = DFlash tokens/s over plain tokens/s of the same statistic; wall = elapsed time, "
          "CPU = process CPU time (with one XLA thread: the work done, steadier on a loaded machine). "
          f"Load average (1 min) over the run: {min(loads_seen, default=0):.1f} - {max(loads_seen, default=0):.1f} "
          f"(before: {load_before[0] if load_before else '?'}).",
          "",
          f"Plain greedy: {wall['plain_tokens_per_s_best']} tok/s wall (best), {wall['plain_tokens_per_s_median']} "
          f"(median); {cpu['plain_tokens_per_s_best']} tok per CPU-s (best), {cpu['plain_tokens_per_s_median']} "
          "(median)." + ("" if strict_sum is None else
          f" Plain greedy with no rollback row kept (`verify_width=0`, the strictest plain loop of a DeltaNet "
          f"target): {strict_sum['wall']['plain_tokens_per_s_best']} tok/s wall (best), "
          f"{strict_sum['cpu']['plain_tokens_per_s_best']} tok per CPU-s (best)."), "",
          "| block size | tau (tokens/round) | DFlash tok/s wall, best | speedup wall, best | speedup wall, median "
          "| speedup CPU, best | speedup CPU, median | per-prompt speedup (wall, median), min - max "
          "| output == plain greedy |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['block_size']} | {r['tau']} | {r['wall']['tokens_per_s_best']} | "
                  f"{r['wall']['speedup_best']:.2f}x | {r['wall']['speedup_median']:.2f}x | "
                  f"{r['cpu']['speedup_best']:.2f}x | {r['cpu']['speedup_median']:.2f}x | "
                  f"{r['wall']['speedup_per_prompt_min']:.2f} - {r['wall']['speedup_per_prompt_max']:.2f} | "
                  f"{'yes' if r['lossless'] else 'NO'} |")
    if strict_sum is not None:
        md += ["", "Against the plain loop that keeps no rollback row (same statistics):", "",
               "| block size | speedup wall, best | speedup wall, median | speedup CPU, best | speedup CPU, median |",
               "|---|---|---|---|---|"]
        for r in rows:
            v = r["vs_plain_without_rollback"]
            md.append(f"| {r['block_size']} | {v['wall']['best']:.2f}x | {v['wall']['median']:.2f}x | "
                      f"{v['cpu']['best']:.2f}x | {v['cpu']['median']:.2f}x |")
    md += ["", "Per prompt (the plain greedy output's share of tokens ending an 8-gram seen before: how much the "
           "continuation repeats itself; tau; the CPU-time speedup of the medians):", "",
           "| prompt | repeated 8-gram share | " + " | ".join(f"tau B={b}" for b in blocks) + " | "
           + " | ".join(f"speedup B={b}" for b in blocks) + " |", "|---|---|" + "---|" * (2 * len(blocks))]
    for i, pp in enumerate(per_prompt):
        md.append(f"| {i + 1} | {pp['repeated_8gram_share']:.2f} | " + " | ".join(f"{pp['tau'][b]:.2f}" for b in blocks)
                  + " | " + " | ".join(f"{pp['cpu_speedup_median'][b]:.2f}x" for b in blocks) + " |")
    md += ["", f"Loops at block size {block}: jitted while_loop {loops['jit_rounds_per_s']} rounds/s, Python "
           f"stepping loop {loops['python_rounds_per_s']} rounds/s; in the stepping loop the host (dispatch, "
           f"transfers, Python) takes {loops['host_share_of_round'] * 100:.0f}% of the decode time "
           f"(split: {loops['python_time_split_s']}).", ""]
    if plot(rows, os.path.join(out_dir, f"{stem}.png")):
        md += [f"![tau and speedup by block size; tokens per round histograms]({stem}.png)", ""]
    md_path = os.path.join(out_dir, f"{stem}.md")
    if os.path.exists(md_path):  # a hand-written reading below the mark survives the rerun
        old = open(md_path).read()
        if READING_MARK in old:
            md += [READING_MARK + old.split(READING_MARK, 1)[1].rstrip("\n"), ""]
    with open(md_path, "w") as fh:
        fh.write("\n".join(md))
    print(f"wrote {out_dir}/{stem}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
