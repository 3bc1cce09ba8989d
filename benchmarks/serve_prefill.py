"""What a long prompt arriving mid-stream costs the requests already running: chunked prefill vs whole.

  python benchmarks/serve_prefill.py [--running 3] [--long-len 1024] [--chunk 64] [--max-tokens 160]
                                     [--long-tokens 16] [--repeats 3] [--quick] [--out DIR | --write-docs]

The engine alone (no HTTP), on the shipped pair, at a fixed verify width (the draft's block size) so both modes
run the same rounds. `--running` requests (16-token prompts of the pair's held-out text, greedy, `ignore_eos`
style: no stop ids) decode; after `--warm-rounds` rounds a request with a `--long-len`-token prompt arrives.
"whole": the engine prefills it in one forward between two rounds (`Engine(prefill_chunk=None)`, the prompt
padded to its bucket); "chunked": one `--chunk`-token chunk per round (`Engine(prefill_chunk=C)`) while the
running requests keep decoding, then it takes its slot. Both engines are warmed up first (no compiles are
timed; checked) and alternate for `--repeats` runs (`timing.paired_runs`: the order reversed every other run).

Measured for the running requests over the rounds from the long prompt's arrival to its first token (the
admission window) and over the whole run: inter-token latency (each emission's gap spread over the tokens it
carries) p50 / p99 and the longest gap between two emissions of a running request (the stall); for the long
request its TTFT (from arrival) and the rounds its prefill took. Outputs are checked equal across the modes
(lossless). Bounded: repeats x 2 modes x (running requests of max-tokens + one long prompt). Writes
serve_prefill.{json,md,png} to --out (default bench_out/) or, with --write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import numpy as np

import harness as h


def prompts_from_pair(pair, n: int, length: int, seed: int):
    """`n` windows of `length` tokens of the pair's held-out standard-library files (random ids if there are none)."""
    try:
        from dflash_jax.train.data import file_windows

        out = file_windows(pair, "held_out", n + seed, length)[seed:]
        if len(out) == n and all(len(p) == length for p in out):
            return [list(map(int, p)) for p in out]
    except Exception:  # no held-out text: random ids time the same
        pass
    rng = np.random.default_rng(seed)
    return [rng.integers(3, pair.target_cfg.vocab_size - 2, length).tolist() for _ in range(n)]


def run_once(engine, running_prompts, long_prompt, args):
    """One scenario on a warm engine; returns its measurements and the outputs."""
    from dflash_jax.compile_cache import CompileCounter

    stamps = {}

    def on_tokens(req, new):
        stamps.setdefault(req.id, []).append((time.perf_counter(), len(new)))

    rounds = []
    engine.observers.append(rounds.append)
    try:
        with CompileCounter() as counter:
            running = [engine.submit(p, max_new_tokens=args.max_tokens, stop_ids=[], on_tokens=on_tokens)
                       for p in running_prompts]
            for _ in range(args.warm_rounds):
                engine.step()
            arrival_round = len(rounds)
            t_arrive = time.perf_counter()
            long = engine.submit(long_prompt, max_new_tokens=args.long_tokens, stop_ids=[], on_tokens=on_tokens)
            while long.first_token_at is None:
                engine.step()
            t_first = long.first_token_at
            window_rounds = len(rounds) - arrival_round
            engine.run_until_idle()
    finally:
        engine.observers.remove(rounds.append)
    if counter.compiles:
        raise SystemExit(f"{counter.compiles} compiles while serving: the warm-up missed a program")

    def gaps(req, lo=None, hi=None):
        """(per-token inter-token latencies, emission gaps) of `req` for emissions inside [lo, hi]."""
        seq = stamps.get(req.id, [])
        per_token, whole = [], []
        for (t0, _), (t1, n) in zip(seq, seq[1:]):
            if (lo is not None and t1 < lo) or (hi is not None and t0 > hi):
                continue
            whole.append(t1 - t0)
            per_token += [(t1 - t0) / n] * n
        return per_token, whole

    win_itl, win_gap, all_itl, all_gap = [], [], [], []
    for r in running:
        a, b = gaps(r, t_arrive, t_first)
        win_itl += a
        win_gap += b
        a, b = gaps(r, None, None)
        all_itl += a
        all_gap += b
    ms = 1e3
    return dict(
        window_itl_ms_p50=h.percentile(win_itl, 50) * ms, window_itl_ms_p99=h.percentile(win_itl, 99) * ms,
        window_stall_ms=max(win_gap) * ms if win_gap else float("nan"),
        itl_ms_p50=h.percentile(all_itl, 50) * ms, itl_ms_p99=h.percentile(all_itl, 99) * ms,
        stall_ms=max(all_gap) * ms if all_gap else float("nan"),
        long_ttft_ms=(t_first - t_arrive) * ms, long_prefill_rounds=window_rounds,
        prefill_chunks=sum(i.prefill_chunks for i in rounds),
    ), [r.tokens for r in running] + [long.tokens]


def main(argv=None) -> int:
    p = h.parser(__doc__, {
        "--running": (3, "requests decoding when the long prompt arrives"),
        "--long-len": (1024, "tokens of the long prompt"),
        "--chunk": (64, "the chunked engine's prefill chunk (tokens per round)"),
        "--long-tokens": (16, "tokens the long request generates"),
        "--warm-rounds": (3, "rounds the running requests decode before it arrives")}, max_tokens=160, repeats=3)
    args = h.parse(p, argv, quick=dict(running=1, long_len=64, chunk=32, max_tokens=8, long_tokens=2, warm_rounds=1,
                                       repeats=1))
    for name in ("running", "long_len", "chunk", "long_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.long_len <= args.chunk:
        p.error("--long-len must exceed --chunk (a prompt of one chunk joins whole)")

    import jax

    import dflash_jax
    from dflash_jax.serve.engine import Engine

    pair = dflash_jax.load()
    running_prompts = prompts_from_pair(pair, args.running, 16, seed=0)
    long_prompt = prompts_from_pair(pair, 1, args.long_len, seed=1)[0]
    engines = {}
    for mode, chunk in (("whole", None), ("chunked", args.chunk)):
        t = time.perf_counter()
        eng = Engine(pair, slots=args.running + 1, max_prompt_len=args.long_len, max_new_tokens=args.max_tokens,
                     widths=None, round_seconds=None, prefill_chunk=chunk)
        eng.warmup([16] if chunk else [16, args.long_len])
        engines[mode] = eng
        print(f"[warm-up] {mode}: {time.perf_counter() - t:.1f}s", flush=True)
    runs = []
    outputs = h.Outputs("whole", key=lambda res: res[1])

    def record(mode, rep, res):
        outputs.see(mode, rep, res)
        m = res[0]
        runs.append(dict(mode=mode, repeat=rep, load=(h.load_average() or (float("nan"),))[0], **m))
        print(f"[{rep + 1}/{args.repeats}] {mode:7s}: window ITL p50 {m['window_itl_ms_p50']:.1f} ms, "
              f"p99 {m['window_itl_ms_p99']:.1f} ms, longest gap {m['window_stall_ms']:.1f} ms, "
              f"long TTFT {m['long_ttft_ms']:.0f} ms ({m['long_prefill_rounds']} rounds)", flush=True)

    h.paired_runs({mode: functools.partial(run_once, eng, running_prompts, long_prompt, args)
                   for mode, eng in engines.items()}, args.repeats, on_run=record)
    if not outputs.lossless["chunked"]:
        raise SystemExit("chunked and whole prefill produced different tokens (not lossless)")

    keys = ("window_itl_ms_p50", "window_itl_ms_p99", "window_stall_ms", "itl_ms_p50", "itl_ms_p99", "stall_ms",
            "long_ttft_ms", "long_prefill_rounds")
    by = {mode: [r for r in runs if r["mode"] == mode] for mode in ("whole", "chunked")}
    summary = {mode: {k: float(np.median([r[k] for r in rs])) for k in keys} for mode, rs in by.items()}
    ratios = {k: float(np.median([c[k] / w[k] for c, w in zip(by["chunked"], by["whole"])]))
              for k in ("window_itl_ms_p99", "window_stall_ms", "long_ttft_ms")}
    config = {k: v for k, v in vars(args).items() if k not in ("write_docs", "out", "out_dir", "quick")}
    result = dict(
        config=dict(config, block_size=engines["chunked"].block_size, slots=args.running + 1,
                    chunk_bucket=engines["chunked"].prefill_chunk, pair="shipped tiny pair (fp32)",
                    platform=h.machine()["platform"], device=str(jax.devices()[0]), cpus=os.cpu_count()),
        runs=runs, summary=summary, ratios_chunked_over_whole=ratios, lossless=True,
    )
    w, c = summary["whole"], summary["chunked"]
    lines = [
        "# A long prompt arriving mid-stream: chunked vs whole prefill", "",
        f"`python benchmarks/serve_prefill.py --running {args.running} --long-len {args.long_len} --chunk "
        f"{args.chunk} --max-tokens {args.max_tokens} --repeats {args.repeats}` on the shipped tiny pair (fp32), "
        f"engine alone (no HTTP), {args.running} running requests (16-token prompts, greedy, {args.max_tokens} "
        f"tokens), then one {args.long_len}-token prompt; fixed verify width {engines['chunked'].block_size}; "
        f"{jax.devices()[0].platform.upper()}, {os.cpu_count()} cores (shared; load average "
        f"{np.mean([r['load'] for r in runs]):.1f}). Medians over {args.repeats} runs per mode, modes alternating. "
        "Same tokens in both modes (checked).", "",
        "Running requests, from the long prompt's arrival to its first token (the admission window):", ""]
    lines += h.table(["prefill", "ITL p50 (ms)", "ITL p99 (ms)", "longest gap (ms)", "long prompt TTFT (ms)",
                      "its prefill rounds"],
                     [[name, f"{v['window_itl_ms_p50']:.1f}", f"{v['window_itl_ms_p99']:.1f}",
                       f"{v['window_stall_ms']:.0f}", f"{v['long_ttft_ms']:.0f}", f"{v['long_prefill_rounds']:.0f}"]
                      for name, v in (("whole", w), (f"chunked ({args.chunk}/round)", c))])
    lines += [
        "", f"Chunked / whole (median of per-run ratios): ITL p99 {ratios['window_itl_ms_p99']:.2f}x, longest gap "
        f"{ratios['window_stall_ms']:.2f}x, the long prompt's TTFT {ratios['long_ttft_ms']:.2f}x.", "",
        f"Over the whole run: ITL p50 / p99 {w['itl_ms_p50']:.1f} / {w['itl_ms_p99']:.1f} ms (whole) vs "
        f"{c['itl_ms_p50']:.1f} / {c['itl_ms_p99']:.1f} ms (chunked)."]

    def draw(ax):
        keys = [("window_itl_ms_p50", "ITL p50"), ("window_itl_ms_p99", "ITL p99"),
                ("window_stall_ms", "longest gap"), ("long_ttft_ms", "long prompt TTFT")]
        x = np.arange(len(keys))
        for i, mode in enumerate(("whole", "chunked")):
            ax.bar(x + (i - 0.5) * 0.38, [summary[mode][k] for k, _ in keys], 0.38, label=mode, color=f"C{i}")
        ax.set_xticks(x, [label for _, label in keys])
        ax.set_ylabel("ms (median over runs)")
        ax.set_yscale("log")
        ax.set_title("running requests while a long prompt is admitted")
        ax.legend()

    h.Report(args, "serve_prefill").write(result, lines, draw=draw, figsize=(7, 3.6), image="chunked vs whole prefill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
