"""Prefix caching in the serving engine: 16 clients sharing a ~1000-token system prompt, the cache on vs off.

  python benchmarks/serve_prefix.py [--clients 16] [--system-len 1000] [--user-len 24] [--max-tokens 32]
                                    [--chunk 256] [--repeats 2] [--quick] [--out DIR | --write-docs]

The engine alone (no HTTP), on the shipped pair, one engine for both modes (a fixed verify width, `--chunk`-token
prefill chunks, `--clients` slots, warmed up before anything is timed; nothing compiles during a run: checked).
Each run: `--clients` requests arrive at once, each the same `--system-len`-token system prompt (the pair's held-out
text) followed by its own `--user-len` tokens, greedy, `--max-tokens` tokens each. "on": a cold prefix cache at the
run's start (the first client's prefill feeds it at every chunk boundary; the others start from the longest cached
boundary and prefill only the rest); "off": every prompt prefilled whole, by chunks. Modes alternate for
`--repeats` runs (`timing.paired_runs`). Outputs are checked equal across the modes (lossless).

Measured per run: TTFT of each client (submission to first token) p50 / p90 / max, throughput (generated tokens
over the run's wall time), prompt tokens prefilled, and the prefix cache's hit tokens. The load average is sampled
after every repeat and reported. Writes serve_prefix.{json,md,png} to --out (default bench_out/) or, with
--write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import numpy as np

import harness as h


def run_once(engine, prompts, args, cache_on: bool):
    """One run: every client's request submitted at once, the engine stepped until idle. Returns (figures, outputs)."""
    from dflash_jax.compile_cache import CompileCounter
    from dflash_jax.serve.prefix_cache import PrefixCache

    engine.prefix_cache = PrefixCache(int(args.cache_mb * 1e6)) if cache_on else None
    hits0, prefilled0 = engine.prefix_hit_tokens, engine.prefill_tokens
    with CompileCounter() as counter:
        t0 = time.perf_counter()
        reqs = [engine.submit(p, max_new_tokens=args.max_tokens) for p in prompts]
        engine.run_until_idle()
        wall = time.perf_counter() - t0
    if counter.compiles:
        raise SystemExit(f"{counter.compiles} programs compiled during a timed run (the warm-up missed a shape)")
    ttft = np.asarray([(r.first_token_at - r.submitted_at) * 1e3 for r in reqs])
    tokens = sum(len(r.tokens) for r in reqs)
    figures = dict(ttft_ms_p50=float(np.percentile(ttft, 50)), ttft_ms_p90=float(np.percentile(ttft, 90)),
                   ttft_ms_max=float(ttft.max()), ttft_ms_mean=float(ttft.mean()), wall_s=wall,
                   tokens_per_s=tokens / wall, tokens=tokens,
                   prefill_tokens=engine.prefill_tokens - prefilled0, hit_tokens=engine.prefix_hit_tokens - hits0)
    return figures, [r.tokens for r in reqs]


def main(argv=None) -> int:
    p = h.parser(__doc__, {
        "--clients": (16, "concurrent requests (and the engine's slots)"),
        "--system-len": (1000, "tokens of the shared system prompt"),
        "--user-len": (24, "tokens of each client's own message after it"),
        "--chunk": (256, "the engine's prefill chunk (cache snapshots sit at its boundaries)"),
        "--width": (4, "the fixed verify width"),
        "--cache-mb": (1024.0, "the prefix cache's budget in MB")}, max_tokens=32, repeats=2)
    args = h.parse(p, argv, quick=dict(clients=2, system_len=80, user_len=8, chunk=32, max_tokens=4, repeats=1))
    for name in ("clients", "system_len", "user_len", "chunk", "width"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.system_len + args.user_len <= args.chunk:
        p.error("--system-len + --user-len must exceed --chunk (a prompt of one chunk joins whole, uncached)")

    import jax

    import dflash_jax
    from dflash_jax.serve.engine import Engine

    pair = dflash_jax.load()
    system = h.prompts(pair, 1, args.system_len, seed=0)[0]
    users = h.prompts(pair, args.clients, args.user_len, seed=1)
    prompts = [list(map(int, system)) + list(map(int, u)) for u in users]
    print(f"[warm-up] compiling {args.clients} slots (every row bucket) and the chunked prefill ...", flush=True)
    t = time.perf_counter()
    engine = Engine(pair, slots=args.clients, max_prompt_len=args.system_len + args.user_len,
                    max_new_tokens=args.max_tokens, widths=[args.width], prefill_chunk=args.chunk,
                    prefix_cache_bytes=int(args.cache_mb * 1e6), max_queue=max(64, args.clients))
    engine.warmup()
    print(f"[warm-up] {args.clients} slots, prompts up to {engine.max_prompt_len} tokens: "
          f"{time.perf_counter() - t:.1f}s", flush=True)

    runs = []
    outputs = h.Outputs("off", key=lambda res: res[1])

    def record(mode, rep, res):
        outputs.see(mode, rep, res)
        m = res[0]
        load = (h.load_average() or (float("nan"),))[0]
        runs.append(dict(mode=mode, repeat=rep, load=load, **m))
        print(f"[{rep + 1}/{args.repeats}] cache {mode:3s}: TTFT p50 {m['ttft_ms_p50']:.0f} ms, p90 "
              f"{m['ttft_ms_p90']:.0f} ms, max {m['ttft_ms_max']:.0f} ms; {m['tokens_per_s']:.1f} tok/s; "
              f"{m['prefill_tokens']} prompt tokens prefilled, {m['hit_tokens']} from the cache; load {load:.1f}",
              flush=True)

    timings = h.paired_runs({mode: functools.partial(run_once, engine, prompts, args, mode == "on")
                             for mode in ("off", "on")}, args.repeats, on_run=record)
    if not outputs.lossless["on"]:
        raise SystemExit("prefix-cached and cold prefills produced different tokens (not lossless)")

    keys = ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_max", "ttft_ms_mean", "tokens_per_s", "wall_s", "prefill_tokens",
            "hit_tokens")
    by = {mode: [r for r in runs if r["mode"] == mode] for mode in ("off", "on")}
    summary = {mode: {k: float(np.median([r[k] for r in rs])) for k in keys} for mode, rs in by.items()}
    ratios = {k: float(np.median([a[k] / b[k] for a, b in zip(by["on"], by["off"])]))
              for k in ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_max", "tokens_per_s")}
    loads = [x[0] for x in timings.loads if x]
    load = float(np.mean([r["load"] for r in runs]))
    config = {k: v for k, v in vars(args).items() if k not in ("write_docs", "out", "out_dir", "quick")}
    result = dict(config=dict(config, prompt_len=len(prompts[0]), chunk_bucket=engine.prefill_chunk,
                              pair="shipped tiny pair (fp32)", platform=h.machine()["platform"],
                              device=str(jax.devices()[0]), cpus=os.cpu_count()),
                  runs=runs, summary=summary, ratios_on_over_off=ratios, load_average=load,
                  load_averages_per_repeat=loads, lossless=True)
    off, on = summary["off"], summary["on"]
    lines = [
        f"# Prefix caching: {args.clients} clients sharing a system prompt", "",
        f"`python benchmarks/serve_prefix.py --clients {args.clients} --system-len {args.system_len} --user-len "
        f"{args.user_len} --max-tokens {args.max_tokens} --chunk {args.chunk} --repeats {args.repeats}` on the "
        f"shipped tiny pair (fp32), engine alone (no HTTP): {args.clients} requests arrive at once, each a "
        f"{args.system_len}-token system prompt (the same for all) and its own {args.user_len} tokens "
        f"({len(prompts[0])} tokens), greedy, {args.max_tokens} tokens each; {args.clients} slots, fixed verify "
        f"width {args.width}, prefill chunks of {engine.prefill_chunk} tokens (one per round, snapshots at their "
        f"boundaries). \"on\": a cold prefix cache at each run's start; \"off\": no cache. "
        f"{jax.devices()[0].platform.upper()}, {os.cpu_count()} cores, shared with other work: load average "
        f"{load:.1f} (1-minute, sampled after each run; per repeat {', '.join(f'{x:.1f}' for x in loads)}). Medians "
        f"over {args.repeats} runs per mode, modes alternating. Same tokens in both modes (checked); nothing "
        "compiled during the runs (checked).", ""]
    lines += h.table(["prefix cache", "TTFT p50 (ms)", "TTFT p90 (ms)", "TTFT max (ms)", "throughput (tok/s)",
                      "prompt tokens prefilled", "from the cache"],
                     [[name, f"{v['ttft_ms_p50']:.0f}", f"{v['ttft_ms_p90']:.0f}", f"{v['ttft_ms_max']:.0f}",
                       f"{v['tokens_per_s']:.1f}", f"{v['prefill_tokens']:.0f}", f"{v['hit_tokens']:.0f}"]
                      for name, v in (("off", off), ("on", on))])
    lines += [
        "", f"On / off (median of per-run ratios): TTFT p50 {ratios['ttft_ms_p50']:.2f}x, p90 "
        f"{ratios['ttft_ms_p90']:.2f}x, max {ratios['ttft_ms_max']:.2f}x; throughput {ratios['tokens_per_s']:.2f}x.",
        "", "Why: with the cache off every client's prompt is prefilled whole, "
        f"{-(-len(prompts[0]) // engine.prefill_chunk)} chunks each, one chunk per round, so the last client waits for "
        "every other client's chunks; with it on, the first client's chunks leave snapshots at each boundary and "
        "every later client prefills only what follows the longest cached one."]

    def draw(ax):
        labels = [("ttft_ms_p50", "TTFT p50"), ("ttft_ms_p90", "TTFT p90"), ("ttft_ms_max", "TTFT max")]
        x = np.arange(len(labels))
        for i, mode in enumerate(("off", "on")):
            ax.bar(x + (i - 0.5) * 0.38, [summary[mode][k] for k, _ in labels], 0.38, label=f"prefix cache {mode}",
                   color=f"C{i}")
        ax.set_xticks(x, [label for _, label in labels])
        ax.set_ylabel("ms (median over runs)")
        ax.set_title(f"{args.clients} clients, shared {args.system_len}-token system prompt")
        ax.legend()

    h.Report(args, "serve_prefix").write(result, lines, draw=draw, figsize=(7, 3.6), image="TTFT with the prefix "
                                         "cache on and off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
