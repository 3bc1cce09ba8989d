"""Benchmark on the shipped pair: acceptance (tau) by block size, DFlash vs plain decoding, jit vs Python loop.

  python benchmarks/tiny_pair.py [--checkpoint DIR | --pair NAME] [--prompts 10] [--prompt-len 128] [--max-new 256]
                                 [--repeats 3] [--threads one|all] [--quick] [--out DIR | --write-docs]
  python benchmarks/tiny_pair.py --pair tiny_pair_qwen3_5 --blocks 4,8,16 --write-docs   # the hybrid pair

Prompts are windows of the held-out standard-library files (split.json of the pair, never trained on).
In one run, with compiled (warmed-up) jitted loops and batch 1 as in interactive use:
  - tau = tokens committed per round, per block size;
  - tokens/s of the DFlash jitted loop vs the plain greedy jitted loop of the same target -> speedup, from
    paired, interleaved runs (`harness.paired_items`): per prompt, `--repeats` times [plain, DFlash at each
    block size] back to back;
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

import functools
import os
import sys

import numpy as np

import harness as h

DEFAULTS = dict(prompts=10, prompt_len=128, max_new=256, repeats=3, threads="one")


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


def summary(times: list, clock: str, tokens: int, blocks, base: str = "plain") -> dict:
    """tokens/s of the plain loop `base` and each block size, by the sum over prompts of each prompt's best
    (minimum) and median time; per-prompt ratios of the medians."""
    out = {}
    for stat, name in (("min", "best"), ("median", "median")):
        plain = h.rate(times, base, tokens, clock, stat)
        out[f"plain_tokens_per_s_{name}"] = round(plain, 1)
        for b in blocks:
            t = h.rate(times, b, tokens, clock, stat)
            out.setdefault(b, {}).update({f"tokens_per_s_{name}": round(t, 1), f"speedup_{name}": round(t / plain, 3)})
    for b in blocks:
        ratios = [t.stat(base, clock, "median") / t.stat(b, clock, "median") for t in times]
        out[b].update(speedup_per_prompt_min=round(min(ratios), 3), speedup_per_prompt_max=round(max(ratios), 3))
    return out


def main(argv=None) -> int:
    p = h.parser(__doc__, {"--blocks": "1,2,4,8,16", "--dequantize-experts": (
        "no", "no: the FP4 expert tables as stored, dequantized inside every forward (plain and DFlash alike); yes: "
              "dequantized once at load (what dflash-generate does on a CPU). With yes the outputs are named "
              "<pair>_dense", ("no", "yes"))}, checkpoint=None, pair=None, **DEFAULTS)
    args = h.parse(p, argv, quick=dict(prompts=1, prompt_len=32, max_new=8, repeats=1, blocks="1,4"))
    blocks = h.int_list(p, args.blocks, "--blocks")

    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec import generate, generate_stepping
    from dflash_jax.spec.session import target_family

    stem = args.pair if args.pair and args.pair != "tiny_pair" else "tiny_pair"
    dense = args.dequantize_experts == "yes"
    stem += "_dense" if dense else ""
    pair = h.load_pair(args, dequantize_experts=dense)
    if args.prompt_len + args.max_new > pair.target_cfg.max_position_embeddings:
        raise SystemExit(f"--prompt-len + --max-new ({args.prompt_len + args.max_new}) exceeds the target's "
                         f"{pair.target_cfg.max_position_embeddings} positions: ask for fewer tokens")
    prompts = h.prompts(pair, args.prompts, args.prompt_len)
    n = args.max_new
    load_before = h.load_average()
    modes = {"plain": lambda prompt: greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=n,
                                                     stop_ids=[])[0]}
    # a DeltaNet target: also the plain loop whose cache keeps no rollback row (the strictest baseline)
    if target_family(pair.target_cfg).needs_rollback_width:
        modes["plain_w0"] = plain_without_rollback(pair, n)
    for b in blocks:
        modes[b] = functools.partial(lambda prompt, b: generate(pair, [prompt], max_new_tokens=n, block_size=b), b=b)
    for fn in modes.values():  # every program compiled before any timing
        fn(prompts[0])
    outputs = h.Outputs("plain", key=lambda r: r if isinstance(r, list) else r.tokens[0])
    per_prompt = []

    def progress(i, prompt, t):
        first = {b: outputs.first[b][-1] for b in blocks}
        per_prompt.append({
            "repeated_8gram_share": round(repeated_share(prompt, outputs.expected), 3),
            "tau": {b: round(first[b].mean_acceptance(), 3) for b in blocks},
            "cpu_speedup_median": {b: round(t.stat("plain", "cpu", "median") / t.stat(b, "cpu", "median"), 3)
                                   for b in blocks}})
        print(f"prompt {i + 1}/{len(prompts)}: plain {n / t.stat('plain'):.1f} tok/s; " + ", ".join(
            f"B={b} {t.stat('plain') / t.stat(b):.2f}x" for b in blocks) + f"; load {t.loads[-1]}", flush=True)

    # paired and interleaved: each repeat runs plain, then every block size, on one prompt, so each ratio compares
    # runs made moments apart on a shared, noisy machine
    times = h.paired_items(prompts, lambda prompt: {k: functools.partial(fn, prompt) for k, fn in modes.items()},
                           args.repeats, outputs=outputs, log=progress)
    if not outputs.lossless.get("plain_w0", True):
        raise SystemExit("plain_w0 decoding disagrees with plain greedy: the reference is ill-defined")
    tokens = len(prompts) * n
    wall, cpu = summary(times, "wall", tokens, blocks), summary(times, "cpu", tokens, blocks)
    strict = ({c: summary(times, c, tokens, blocks, "plain_w0") for c in ("wall", "cpu")} if "plain_w0" in modes
              else None)
    rows = []
    for b in blocks:
        lengths = [x for r in outputs.first[b] for x in r.acceptance_lengths[0]]
        rows.append({"block_size": b, "tau": round(float(np.mean([r.mean_acceptance() for r in outputs.first[b]])), 3),
                     "tokens_per_s": wall[b]["tokens_per_s_best"], "plain_tokens_per_s": wall["plain_tokens_per_s_best"],
                     "speedup": round(wall[b]["speedup_best"], 2), "lossless": bool(outputs.lossless[b]),
                     "wall": wall[b], "cpu": cpu[b],
                     "vs_plain_without_rollback": None if strict is None else
                     {c: {s: strict[c][b][f"speedup_{s}"] for s in ("best", "median")} for c in ("wall", "cpu")},
                     # rounds that committed k tokens, k = 1..block (accepted proposals + the bonus)
                     "acceptance_histogram": np.bincount(lengths, minlength=b + 1)[1:].tolist()})
        print(rows[-1], flush=True)
    # jit vs Python stepping at the draft's trained block size
    block = pair.draft_cfg.block_size if pair.draft_cfg.block_size in blocks else blocks[-1]
    generate_stepping(pair, [prompts[0]], max_new_tokens=n, block_size=block)  # compile
    last = {}
    loop_times = h.paired_runs({"jit": functools.partial(modes[block], prompts[0]), "python": functools.partial(
        generate_stepping, pair, [prompts[0]], max_new_tokens=n, block_size=block)}, 2,
        on_run=lambda m, r, res: last.update({m: res}))
    jit_dt, step_dt = loop_times.stat("jit"), loop_times.stat("python")
    split = last["python"].stats["time_split"]
    loops = {"block_size": block, "rounds": last["jit"].stats["rounds"],
             "jit_rounds_per_s": round(last["jit"].stats["rounds"] / jit_dt, 1),
             "python_rounds_per_s": round(last["python"].stats["rounds"] / step_dt, 1),
             "python_time_split_s": {k: round(v, 4) for k, v in split.items()},
             "host_share_of_round": round(split["host_s"] / (step_dt - split["prefill_s"]), 3)}
    print(loops)
    loads = [t.loads[-1] for t in times]
    mach = h.machine()
    result = {"checkpoint": os.path.basename(pair.directory.rstrip("/")), "prompts": len(prompts),
              "prompt_len": args.prompt_len, "max_new_tokens": n, "repeats": args.repeats,
              "backend": mach["backend"], "threads": args.threads, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "expert_tables": "dense (dequantized at load)" if dense else (
                  "as stored (FP4 dequantized per forward)" if mach["backend"] == "cpu"
                  else "as stored, multiplied by the Pallas FP4 kernel inside every forward"),
              "machine": mach["machine"], "load_average_1_5_15": {"before": load_before, "after_each_prompt": loads},
              "plain_tokens_per_s": {"wall": {k: wall[f"plain_tokens_per_s_{k}"] for k in ("best", "median")},
                                     "cpu": {k: cpu[f"plain_tokens_per_s_{k}"] for k in ("best", "median")}},
              "plain_without_rollback_tokens_per_s": None if strict is None else {
                  c: {k: strict[c][f"plain_tokens_per_s_{k}"] for k in ("best", "median")} for c in ("wall", "cpu")},
              "by_block_size": rows, "per_prompt": per_prompt, "loops": loops,
              "times_s": {str(k): [{"wall": t.wall[k], "cpu": t.cpu[k]} for t in times] for k in modes}}
    kind = {"qwen3_5": "hybrid Qwen3.5-MoE"}.get(pair.target_cfg.model_type.removesuffix("_moe"), "")
    name = stem.removesuffix("_dense")
    title = (f"The shipped {kind} pair `{name}`" if name != "tiny_pair" else "The shipped pair") + (
        ", expert tables dequantized at load" if dense else "")
    cmd = h.command("tiny_pair.py", args, dict(blocks="1,2,4,8,16", **DEFAULTS),
                    (f" --pair {name}" if name != "tiny_pair" else "") + (" --dequantize-experts yes" if dense else ""))
    threads = ("XLA's CPU runtime on one thread for both modes (`XLA_FLAGS=" + h.ONE_THREAD + "`)"
               if args.threads == "one" else "XLA's default threading")
    if result["backend"] != "cpu":
        threads = "the host's XLA CPU runtime idle (every forward on the accelerator)"
    loads_seen = [x[0] for x in loads if x]
    md = [f"# {title}: acceptance and speed ({'CPU' if result['backend'] == 'cpu' else result['backend'].upper()})", "",
          f"`{cmd}` - {len(prompts)} held-out stdlib prompts of {args.prompt_len} tokens, "
          f"{n} new tokens each, greedy, batch 1, compiled loops; {result['machine']}, "
          f"backend {result['backend']}; {threads}; expert tables {result['expert_tables']}. "
          f"Paired runs: for each prompt, {args.repeats} rounds of [plain, then DFlash at each block size] back to "
          "back, every run's output checked against the plain greedy output. Tokens/s = prompts x new tokens over "
          "the sum over prompts of each prompt's best (or median) time, end to end (prefill included); "
          "speedup = DFlash tokens/s over plain tokens/s of the same statistic; wall = elapsed time, "
          "CPU = process CPU time (with one XLA thread: the work done, steadier on a loaded machine). "
          f"Load average (1 min) over the run: {min(loads_seen, default=0):.1f} - {max(loads_seen, default=0):.1f} "
          f"(before: {load_before[0] if load_before else '?'}).", "",
          f"Plain greedy: {wall['plain_tokens_per_s_best']} tok/s wall (best), {wall['plain_tokens_per_s_median']} "
          f"(median); {cpu['plain_tokens_per_s_best']} tok per CPU-s (best), {cpu['plain_tokens_per_s_median']} "
          "(median)." + ("" if strict is None else
          f" Plain greedy with no rollback row kept (`verify_width=0`, the strictest plain loop of a DeltaNet "
          f"target): {strict['wall']['plain_tokens_per_s_best']} tok/s wall (best), "
          f"{strict['cpu']['plain_tokens_per_s_best']} tok per CPU-s (best)."), ""]
    md += h.table(["block size", "tau (tokens/round)", "DFlash tok/s wall, best", "speedup wall, best",
                   "speedup wall, median", "speedup CPU, best", "speedup CPU, median",
                   "per-prompt speedup (wall, median), min - max", "output == plain greedy"],
                  [[r["block_size"], r["tau"], r["wall"]["tokens_per_s_best"], f"{r['wall']['speedup_best']:.2f}x",
                    f"{r['wall']['speedup_median']:.2f}x", f"{r['cpu']['speedup_best']:.2f}x",
                    f"{r['cpu']['speedup_median']:.2f}x",
                    f"{r['wall']['speedup_per_prompt_min']:.2f} - {r['wall']['speedup_per_prompt_max']:.2f}",
                    "yes" if r["lossless"] else "NO"] for r in rows])
    if strict is not None:
        md += ["", "Against the plain loop that keeps no rollback row (same statistics):", ""]
        md += h.table(["block size", "speedup wall, best", "speedup wall, median", "speedup CPU, best",
                       "speedup CPU, median"],
                      [[r["block_size"]] + [f"{r['vs_plain_without_rollback'][c][s]:.2f}x" for c in ("wall", "cpu")
                                            for s in ("best", "median")] for r in rows])
    md += ["", "Per prompt (the plain greedy output's share of tokens ending an 8-gram seen before: how much the "
           "continuation repeats itself; tau; the CPU-time speedup of the medians):", ""]
    md += h.table(["prompt", "repeated 8-gram share"] + [f"tau B={b}" for b in blocks]
                  + [f"speedup B={b}" for b in blocks],
                  [[i + 1, f"{pp['repeated_8gram_share']:.2f}"] + [f"{pp['tau'][b]:.2f}" for b in blocks]
                   + [f"{pp['cpu_speedup_median'][b]:.2f}x" for b in blocks] for i, pp in enumerate(per_prompt)])
    md += ["", f"Loops at block size {block}: jitted while_loop {loops['jit_rounds_per_s']} rounds/s, Python "
           f"stepping loop {loops['python_rounds_per_s']} rounds/s; in the stepping loop the host (dispatch, "
           f"transfers, Python) takes {loops['host_share_of_round'] * 100:.0f}% of the decode time "
           f"(split: {loops['python_time_split_s']})."]

    def draw(axes):  # tau and speedup by block size, and per block size the histogram of tokens per round
        ax1, ax2 = axes
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

    h.Report(args, stem).write(result, md, draw=draw, ncols=2, figsize=(10, 3.6),
                               image="tau and speedup by block size; tokens per round histograms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
