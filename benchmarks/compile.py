"""Compile cost per request on the shipped pair: capacity mode (the loops' default) against the bucketed shapes.

  python benchmarks/compile.py [--checkpoint DIR] [--pairs 3] [--repeats 15] [--quick] [--out DIR | --write-docs]

Capacity mode (`Buckets(capacity=N)`): cache rows, output buffer and prompt buffer are fixed by the capacity (2048
here, capped at the target's positions) and the prefill runs in chunks inside one program, so every prompt and
budget that fit run the same two compiled programs (prefill, loop). The loops' default (`spec.loop.LOOP_BUCKETS`)
adds tiers below the capacity (`Buckets.floor`: 256, 512, 1024, 2048 rows), a pair of programs per tier; (a)
measures the single capacity (the tiers' bound), (b) the CLI's default. The bucketed shapes (`Buckets(pad_batch=True)`) compile a
prefill and a loop per prompt / budget bucket.

(a) One process, persistent compilation cache off (every compile is a real one): a first `generate` call, then
    requests with prompts of 9 to 1000 tokens and budgets of 17 to 300 (greedy and sampled), in capacity mode and,
    for comparison, in the bucketed shapes. Programs compiled and compile seconds from `jax.monitoring`
    (`compile_cache.CompileCounter`). Goal: 0 programs compiled after the first call in capacity mode.
(b) Pairs of `dflash-generate` processes on a fresh cache directory (DFLASH_JAX_CACHE_DIR, a temp dir): the
    first with one prompt and budget, the second with another prompt length and budget. Goal: the second's wall
    time <= 0.4x the first's (median over the pairs); one `--bucketed` pair for comparison.
(c) Per-round time at ~64 live rows (a 56-token held-out prompt, 17 new tokens: 56 to 73 live rows), greedy,
    batch 1: the compiled loop of the bucketed shapes (192 cache rows, dense attention) against capacity 2048
    and 4096 (chunked attention up to the live length), interleaved, median of --repeats runs each; the ratio of
    the medians and the median of the paired ratios.
(d) Prefill time of a 9, a 200 and a 1000-token prompt (capacity: chunks of 128 in one program; bucketed: one
    forward over the prompt bucket), interleaved, medians.
Writes compile.json, compile.md and compile.png to --out (default bench_out/) or, with --write-docs,
docs/benchmarks/.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import harness as h
from harness import ROOT

# (prompt tokens, max_new_tokens, temperature, top_k): the first call, then the later requests
FIRST = (40, 64, 0.0, 0)
LATER = [(9, 17, 0.0, 0), (130, 300, 0.0, 0), (300, 150, 0.8, 0), (600, 64, 0.0, 0), (1000, 17, 0.0, 0),
         (250, 200, 1.0, 50), (1000, 300, 0.0, 0)]


log = h.logger("compile bench", sys.stderr)


def _prompts(pair, lengths) -> dict[int, list[int]]:
    return {n: [int(t) for t in h.prompts(pair, 1, n, seed=n)[0]] for n in sorted(set(lengths))}


def in_process(pair, prompts) -> dict:
    from dflash_jax.compile_cache import CompileCounter
    from dflash_jax.spec import Buckets, SamplingParams, generate

    modes = {"capacity": Buckets(capacity=2048, pad_batch=True, grow=True), "bucketed": Buckets(pad_batch=True)}
    out = {}
    for mode, buckets in modes.items():
        rows = []
        for i, (n, budget, t, k) in enumerate([FIRST] + LATER):
            log(f"(a) {mode}: request {i + 1}/{len(LATER) + 1}: prompt {n}, budget {budget}, T {t:g}, top-k {k}")
            with CompileCounter() as c:
                t0 = time.perf_counter()
                r = generate(pair, [prompts[n]], max_new_tokens=budget, stop_ids=(), seed=i, buckets=buckets,
                             sampling=SamplingParams(temperature=t, top_k=k))
                wall = time.perf_counter() - t0
            rows.append({"prompt_len": n, "max_new_tokens": budget, "temperature": t, "top_k": k,
                         "programs_compiled": c.compiles, "traces": c.traces, "compile_s": c.seconds, "wall_s": wall,
                         "generated": len(r.tokens[0]), "tau": r.stats["mean_acceptance"],
                         "shapes": r.stats["shapes"], "tokens": r.tokens[0]})
            log(f"  {c.compiles} programs, {c.seconds:.2f} s compiling, {wall:.2f} s wall, tau "
                f"{r.stats['mean_acceptance']:.2f}")
        out[mode] = {"requests": rows, "later_programs": sum(r["programs_compiled"] for r in rows[1:]),
                     "later_compile_s": sum(r["compile_s"] for r in rows[1:]), "first_compile_s": rows[0]["compile_s"]}
    greedy = [i for i, (_, _, t, _) in enumerate([FIRST] + LATER) if t == 0]
    sampled = [i for i in range(len(LATER) + 1) if i not in greedy]
    cap, buck = out["capacity"]["requests"], out["bucketed"]["requests"]
    out["greedy_identical"] = all(cap[i]["tokens"] == buck[i]["tokens"] for i in greedy)
    out["sampled_identical"] = all(cap[i]["tokens"] == buck[i]["tokens"] for i in sampled)
    for rows in (cap, buck):
        for r in rows:
            r.pop("tokens")
    out["goal_met"] = out["capacity"]["later_programs"] == 0
    return out


def cli_pair(checkpoint, prompts, index: int, bucketed: bool) -> dict:
    """Two `dflash-generate` processes on one fresh cache directory: other prompt length and budget second."""
    cache = tempfile.mkdtemp(prefix="dflash_compile_bench_")
    runs = [(40, 64), (150, 100)]
    try:
        env = dict(os.environ, DFLASH_JAX_CACHE_DIR=cache)
        rows = []
        for i, (n, budget) in enumerate(runs):
            cmd = [sys.executable, "-m", "dflash_jax.cli.generate", "--prompt-ids", ",".join(map(str, prompts[n])),
                   "--max-new-tokens", str(budget), "--json"] + (["--bucketed"] if bucketed else [])
            if checkpoint:
                cmd += ["--checkpoint", checkpoint]
            log(f"(b) {'bucketed' if bucketed else 'capacity'} pair {index + 1}, process {i + 1}: prompt {n}, budget "
                f"{budget} (cache dir {'empty' if i == 0 else 'filled by the first'})")
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise SystemExit(f"dflash-generate failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
            out = json.loads(proc.stdout)
            notice = any("compiling" in line for line in proc.stderr.splitlines())
            rows.append({"prompt_len": n, "max_new_tokens": budget, "wall_s": wall,
                         "generation_s": out["stats"]["seconds"], "compiling_notice": notice,
                         "shapes": out["stats"]["shapes"]})
            log(f"  {wall:.2f} s wall, {out['stats']['seconds']:.3f} s generating, 'compiling' line: {notice}")
        entries = sum(len(files) for _, _, files in os.walk(cache))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {"first": rows[0], "second": rows[1], "ratio": rows[1]["wall_s"] / rows[0]["wall_s"], "cache_files": entries}


def cli_runs(checkpoint, prompts, pairs: int) -> dict:
    runs = [cli_pair(checkpoint, prompts, i, bucketed=False) for i in range(pairs)]
    bucketed = cli_pair(checkpoint, prompts, 0, bucketed=True)
    median = statistics.median(r["ratio"] for r in runs)
    return {"command": "dflash-generate --prompt-ids <40 ids> --max-new-tokens 64 --json, then "
                       "--prompt-ids <150 ids> --max-new-tokens 100", "pairs": runs, "median_ratio": median,
            "bucketed": bucketed, "goal_met": median <= 0.4}


def per_round(pair, prompt, repeats: int) -> dict:
    import jax
    import numpy as np

    from dflash_jax.spec import Buckets
    from dflash_jax.spec.loop import run_loop
    from dflash_jax.spec.session import begin_prepared, prepare

    budget = 17
    modes = {"bucketed": Buckets(pad_batch=True), "capacity 2048": Buckets(capacity=2048, pad_batch=True),
             "capacity 4096": Buckets(capacity=4096, pad_batch=True)}
    preps = {m: prepare(pair, [prompt], max_new_tokens=budget, stop_ids=(), buckets=b) for m, b in modes.items()}

    def once(prep):
        state = begin_prepared(pair, prep)
        jax.block_until_ready(state.anchor)
        t0 = time.perf_counter()
        state = run_loop(pair.target, pair.draft, state, prep.spec)
        jax.block_until_ready(state.output)
        seconds = time.perf_counter() - t0
        return seconds, int(state.rounds[0]), np.asarray(state.output[0, : int(state.num_generated[0])]).tolist()

    first = {m: once(p) for m, p in preps.items()}  # compiles
    same = len({tuple(f[2]) for f in first.values()}) == 1
    t = h.paired_runs({m: (lambda p=p: once(p)) for m, p in preps.items()}, repeats, seconds_of=lambda r: r[0],
                      on_repeat=lambda r, _: log(f"(c) per-round timing, repeat {r + 1}/{repeats}"))
    ms = {m: [1000 * x / first[m][1] for x in t.wall[m]] for m in modes}
    base = ms["bucketed"]
    out = {"prompt_len": len(prompt), "max_new_tokens": budget, "live_rows": [len(prompt), len(prompt) + budget],
           "repeats": repeats, "rounds": first["bucketed"][1], "same_tokens": same, "modes": {}}
    for m in modes:
        out["modes"][m] = {"cache_rows": preps[m].spec.max_len, "ms_per_round_median": statistics.median(ms[m]),
                           "ms_per_round": ms[m], "ratio_of_medians": statistics.median(ms[m]) / statistics.median(base),
                           "median_paired_ratio": statistics.median(a / b for a, b in zip(ms[m], base))}
    return out


def prefill_times(pair, prompts, lengths, repeats: int) -> dict:
    import jax

    from dflash_jax.spec import Buckets
    from dflash_jax.spec.session import begin_prepared, prepare

    modes = {"bucketed": Buckets(pad_batch=True), "capacity 2048": Buckets(capacity=2048, pad_batch=True)}
    preps = {(m, n): prepare(pair, [prompts[n]], max_new_tokens=64, stop_ids=(), buckets=b)
             for m, b in modes.items() for n in lengths}

    runs = {key: (lambda p=p: jax.block_until_ready(begin_prepared(pair, p).anchor)) for key, p in preps.items()}
    for run in runs.values():
        run()  # compiles
    t = h.paired_runs(runs, repeats, on_repeat=lambda r, _: log(f"(d) prefill timing, repeat {r + 1}/{repeats}"))
    ms = {key: [1000 * x for x in t.wall[key]] for key in preps}
    return {"rows": [{"prompt_len": n, **{f"{m} ms": statistics.median(ms[(m, n)]) for m in modes},
                      "prompt_bucket": int(preps[("bucketed", n)].tokens.shape[1])} for n in lengths],
            "chunk": int(preps[("capacity 2048", lengths[0])].chunk), "repeats": repeats}


def draw(data: dict, axes) -> None:
    ax1, ax2 = axes
    for mode, style in (("bucketed", "o-"), ("capacity", "s-")):
        rows = data["in_process"][mode]["requests"]
        total, ys = 0.0, []
        for r in rows:
            total += r["compile_s"]
            ys.append(total)
        ax1.plot(range(1, len(rows) + 1), ys, style, label=mode)
    ax1.set_xlabel("request (1 = first call)")
    ax1.set_ylabel("cumulative compile s")
    ax1.set_title("(a) compile seconds over requests of other prompt lengths / budgets", fontsize=9)
    ax1.legend()
    modes = data["per_round"]["modes"]
    ax2.boxplot([m["ms_per_round"] for m in modes.values()])
    ax2.set_xticks(range(1, len(modes) + 1), [f"{k}\n({m['cache_rows']} rows)" for k, m in modes.items()])
    ax2.set_ylabel("ms per round")
    ax2.set_title(f"(c) per-round time at {data['per_round']['live_rows'][0]}-{data['per_round']['live_rows'][1]} "
                  "live rows", fontsize=9)


def markdown(data: dict) -> list[str]:
    a, b, c, d = data["in_process"], data["cli"], data["per_round"], data["prefill"]
    cap, buck = a["capacity"], a["bucketed"]
    lines = [
        "# Compile cost per request: capacity mode vs bucketed shapes (shipped pair)",
        "",
        f"Machine: {data['machine']}; load average {data['load_average']:.1f} when it started (a shared machine: "
        "absolute seconds are inflated; counts and ratios are what the goals are about). Generated by "
        "`python benchmarks/compile.py --write-docs`.",
        "",
        "Capacity mode (`Buckets(capacity=N)`, the default of `generate`, `generate_stepping`, the tree loops and",
        "`dflash-generate`; N = min(2048, the target's positions)): cache rows, output buffer and prompt buffer are",
        "fixed by N, and the prefill runs in chunks of 128 tokens inside one program with the chunk count traced",
        "(`spec.prefill.capacity_begin`). Any prompt + budget + block size <= N runs the same compiled prefill and",
        "loop; by default a longer request runs at the next power of two of rows that holds it (one more program), and an explicit capacity (`--capacity`,",
        "`Buckets(capacity=...)`) refuses it with one message naming how to raise it. The bucketed shapes stay behind `buckets=Buckets(...)` / `dflash-generate "
        "--bucketed`.",
        "",
        "## (a) Requests of other prompt lengths and budgets in one process (persistent cache off)",
        "",
        *h.table(["request", "prompt", "budget", "T", "top-k", "capacity: programs", "compile s", "wall s",
                  "bucketed: programs", "compile s", "wall s", "bucketed shapes (prompt/output/cache)"],
                 [["first call" if i == 0 else i + 1, rc["prompt_len"], rc["max_new_tokens"], f"{rc['temperature']:g}",
                   rc["top_k"], rc["programs_compiled"], f"{rc['compile_s']:.2f}", f"{rc['wall_s']:.2f}",
                   rb["programs_compiled"], f"{rb['compile_s']:.2f}", f"{rb['wall_s']:.2f}",
                   "{prompt}/{output}/{cache}".format(**rb["shapes"])]
                  for i, (rc, rb) in enumerate(zip(cap["requests"], buck["requests"]))]),
    ]
    shc = cap["requests"][0]["shapes"]
    lines += [
        "",
        f"Capacity mode (shapes prompt/output/cache {shc['prompt']}/{shc['output']}/{shc['cache']} in the stats; the "
        f"compiled prompt buffer is {shc['cache']} columns): after the first call, {len(LATER)} requests with prompts "
        f"of 9 to 1000 tokens and budgets of 17 to 300 compiled **{cap['later_programs']} programs** "
        f"({cap['later_compile_s']:.2f} s) vs {cap['first_compile_s']:.2f} s for the first call (goal 0: "
        f"{'met' if a['goal_met'] else 'NOT met'}). The bucketed shapes compiled {buck['later_programs']} programs "
        f"({buck['later_compile_s']:.2f} s) for the same requests; their first call compiled in "
        f"{buck['first_compile_s']:.2f} s (the capacity programs, with the prefill's chunk loop and attention's "
        "live-length loop, take a little longer once). Greedy tokens identical in both modes: "
        f"{a['greedy_identical']}; sampled tokens (same seeds) identical: {a['sampled_identical']}.",
        "",
        "## (b) A second `dflash-generate` process with another prompt and budget (one fresh cache dir per pair)",
        "",
        f"`{b['command']}`",
        "",
        *h.table(["pair", "mode", "first wall s", "second wall s", "second / first",
                  "'compiling' line (first, second)", "generation s (first, second)"],
                 [[i + 1 if i < len(b["pairs"]) else "-", "capacity" if i < len(b["pairs"]) else "bucketed",
                   f"{r['first']['wall_s']:.2f}", f"{r['second']['wall_s']:.2f}", f"{r['ratio']:.2f}",
                   ", ".join("yes" if x["compiling_notice"] else "no" for x in (r["first"], r["second"])),
                   f"{r['first']['generation_s']:.3f}, {r['second']['generation_s']:.3f}"]
                  for i, r in enumerate(b["pairs"] + [b["bucketed"]])]),
    ]
    lines += [
        "",
        f"Median second / first wall time in capacity mode: **{b['median_ratio']:.2f}x** (goal <= 0.4x: "
        f"{'met' if b['goal_met'] else 'NOT met'}); the bucketed pair: {b['bucketed']['ratio']:.2f}x (the second "
        "process's prompt and budget fall in other buckets: it compiles again). The first processes' wall time moves "
        f"with the shared machine's load ({min(r['first']['wall_s'] for r in b['pairs']):.1f} to "
        f"{max(r['first']['wall_s'] for r in b['pairs']):.1f} s); the second ones took "
        f"{min(r['second']['wall_s'] for r in b['pairs']):.1f} to {max(r['second']['wall_s'] for r in b['pairs']):.1f} s "
        f"in capacity mode against {b['bucketed']['second']['wall_s']:.1f} s bucketed. What a warm process still "
        "spends is importing jax, loading the pair, tracing and lowering; the persistent cache removes XLA's compile.",
        "",
        f"## (c) Per-round time at {c['live_rows'][0]} to {c['live_rows'][1]} live rows",
        "",
        f"A {c['prompt_len']}-token held-out prompt, {c['max_new_tokens']} new tokens, greedy, batch 1, block size 16: "
        f"{c['rounds']} rounds per run; the compiled loop alone (`spec.loop.run_loop`), {c['repeats']} runs of each "
        f"mode interleaved. Same tokens in every mode: {c['same_tokens']}.",
        "",
        *h.table(["mode", "cache rows", "median ms / round", "ratio of medians", "median paired ratio"],
                 [[m, r["cache_rows"], f"{r['ms_per_round_median']:.2f}", f"{r['ratio_of_medians']:.3f}",
                   f"{r['median_paired_ratio']:.3f}"] for m, r in c["modes"].items()]),
    ]
    c2 = c["modes"]["capacity 2048"]
    lines += [
        "",
        f"Capacity 2048 vs the bucketed program: **{c2['median_paired_ratio']:.3f}x** per round (median of paired "
        "ratios). Attention reads the cache only up to the live length (`nn.attention.kv_cache_attention`, chunks of "
        "256 rows), so a round does not pay for the capacity's empty rows.",
        "",
        "## (d) Prefill time",
        "",
        f"Capacity mode runs ceil(prompt / {d['chunk']}) chunks of {d['chunk']} tokens; the bucketed prefill is one "
        f"forward over the prompt bucket. Median of {d['repeats']} interleaved runs (prefill and first token).",
        "",
        *h.table(["prompt", "bucketed ms (prompt bucket)", "capacity 2048 ms"],
                 [[r["prompt_len"], f"{r['bucketed ms']:.1f} ({r['prompt_bucket']})", f"{r['capacity 2048 ms']:.1f}"]
                  for r in d["rows"]]),
        "",
        "A prompt shorter than a chunk pays for a whole chunk (the price of one program for every length); long",
        "prompts run in chunks whose attention reads only the rows already written.",
    ]
    return lines


def main(argv=None) -> int:
    p = h.parser(__doc__, {"--pairs": (3, "dflash-generate process pairs in capacity mode (median)")},
                 checkpoint=None, repeats=15)
    args = h.parse(p, argv, quick=dict(pairs=1, repeats=1))
    if args.pairs < 1:
        p.error("--pairs must be >= 1")
    import jax

    import dflash_jax
    from dflash_jax import compile_cache
    from dflash_jax.cli.generate import SHIPPED_PAIR

    compile_cache.disable()  # in this process: measure real compiles
    data = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, JAX {jax.__version__} "
                       f"({jax.default_backend()})", "load_average": os.getloadavg()[0]}
    pair = dflash_jax.load(args.checkpoint or SHIPPED_PAIR)
    prompts = _prompts(pair, [n for n, *_ in [FIRST] + LATER] + [40, 150, 56, 200])
    log("(a) requests of other prompt lengths and budgets in one process")
    data["in_process"] = in_process(pair, prompts)
    log("(b) dflash-generate: a second process with another prompt and budget")
    data["cli"] = cli_runs(args.checkpoint, prompts, args.pairs)
    log("(c) per-round time at ~64 live rows")
    data["per_round"] = per_round(pair, prompts[56], args.repeats)
    log("(d) prefill time")
    data["prefill"] = prefill_times(pair, prompts, [9, 200, 1000], max(1 if args.quick else 3, args.repeats // 2))
    data["command"] = shlex.join(["python", "benchmarks/compile.py"] + (argv if argv is not None else sys.argv[1:]))
    report = h.Report(args, "compile")
    report.write(None, markdown(data), draw=functools.partial(draw, data), ncols=2, figsize=(11, 4),
                 image="compile seconds and per-round time")
    with open(report.path("json"), "w") as f:
        json.dump(data, f, indent=2)
    a, b, c = data["in_process"], data["cli"], data["per_round"]["modes"]["capacity 2048"]
    log(f"capacity: {a['capacity']['later_programs']} programs after the first call (bucketed "
        f"{a['bucketed']['later_programs']}); second/first process wall {b['median_ratio']:.2f}x; per round "
        f"{c['median_paired_ratio']:.3f}x the bucketed program; written to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
