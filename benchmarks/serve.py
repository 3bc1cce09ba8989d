"""Load benchmark of `dflash-serve` on the shipped pair, over loopback HTTP: DFlash vs the same engine without
speculation (block size 1), at concurrency 1, 4, 16, 32.

  python benchmarks/serve.py [--concurrency 1,4,16,32] [--requests-per-client 2] [--max-tokens 64]
                             [--prompt-len 64] [--modes auto8,4,tree16] [--repeats 4] [--slots 32]
                             [--quick] [--out DIR | --write-docs]

For each mode (`autoN`: the engine picks each round's verify width from 1, 2, 4 .. N by its cost model; `1+N`: from
widths 1 and N; `treeN`:
a token tree of N nodes, branch 4, every round; a fixed
block size N; and B=1) one engine of `--slots` slots (default: the largest concurrency; 0: an engine per
concurrency with as many slots as clients) is built and warmed up (compiles excluded) behind the
OpenAI-compatible server on 127.0.0.1 (uvicorn, in this process); it serves every concurrency, computing each
round only for the row bucket (1, 2, 4, ..) that holds its live requests. At each concurrency c,
c clients (asyncio + httpx, in a separate process, as real clients are) each send `--requests-per-client`
streaming completions back to back, at least 8 requests per point (prompts: token windows of the pair's
held-out standard-library files; greedy; `ignore_eos`, so every mode produces exactly the same tokens, which
is checked). The modes alternate for `--repeats` runs (`timing.paired_runs`: the order reversed every other
run), so a busy spell of
the (shared) machine does not land on one mode only; the speedup is the median of the per-run ratios to B=1.

Measured: output tokens/s over the run, the server process's CPU seconds per output token (process CPU time of
the process running the engine and the HTTP loop over the run: the work done, which other jobs' load on a shared
machine inflates far less than wall time; the load average is recorded with every run), TTFT and inter-token
latency (each streamed chunk's gap spread over
the tokens it carries) p50 / p99, tokens per verify (acceptance) and expert bytes per round (the union of the
verified rows' projected experts), the last two from the server's /metrics; the width chooser's explored rounds (the cost table is learned while
serving). Bounded: repeats x modes x
max(c * requests-per-client, 8) requests of max-tokens tokens per concurrency. Writes serve.{json,md,png} to
--out (default bench_out/) or, with --write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import sys
import threading
import time

import numpy as np

import harness as h


def start_server(app):
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    return srv, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def one_client(http, base, prompts, max_tokens, records):
    for prompt in prompts:
        t0 = time.perf_counter()
        stamps, ids = [], []
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        async with http.stream("POST", base + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                new = json.loads(line[6:])["choices"][0]["token_ids"]
                if new:
                    stamps.append((time.perf_counter(), len(new)))
                    ids += new
        records.append({"prompt": prompt, "t0": t0, "stamps": stamps, "ids": ids})


async def load(base, per_client, max_tokens):
    import httpx

    records: list[dict] = []
    limits = httpx.Limits(max_connections=len(per_client) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(one_client(http, base, ps, max_tokens, records) for ps in per_client))
    return records


def _client_process(base, work, max_tokens, conn):
    t0 = time.perf_counter()
    records = asyncio.run(load(base, work, max_tokens))
    conn.send((records, time.perf_counter() - t0))
    conn.close()


def run_clients(base, work, max_tokens):
    """The load runs in its own process (as real clients do): the server process's threads (the HTTP loop and
    the engine) do not share their interpreter lock with the clients'. Timestamps are perf_counter readings of
    the client process only."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_client_process, args=(base, work, max_tokens, child), daemon=True)
    proc.start()
    records, wall = parent.recv()
    proc.join(60)
    return records, wall


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


class Point:
    """One mode at one concurrency: a warmed engine behind a running server."""

    def __init__(self, pair, tokenizer, mode, slots, prompt_len, max_tokens):
        from dflash_jax.serve.engine import Engine, attach_cost_metrics
        from dflash_jax.serve.server import create_app

        self.mode, self.slots = mode, slots
        adaptive = mode.startswith("auto")
        tree = mode.startswith("tree")  # treeN: a token tree of N nodes (branch 4) every round
        proposer = None
        if tree:
            from dflash_jax.spec import TreeShape

            proposer = TreeShape(int(mode[4:]), 4)
        listed = "+" in mode  # "1+4": the verify width chosen per round from these
        widths = sorted(int(w) for w in mode.split("+")) if listed else "auto" if adaptive else None
        self.block_size = (pair.draft_cfg.block_size if tree else max(widths) if listed
                           else int(mode[4:] if adaptive else mode))
        self.engine = Engine(pair, slots=slots, block_size=self.block_size, max_prompt_len=prompt_len,
                             max_new_tokens=max_tokens, max_queue=4 * slots, widths=widths, proposer=proposer)
        t = time.perf_counter()
        self.engine.warmup([prompt_len])
        self.warm_s = time.perf_counter() - t
        self.warm_table = {r: dict(t) for r, t in self.engine.cost_table.items()}  # before any served round
        self.server, self.thread, self.base = start_server(create_app(self.engine, tokenizer, model_name="tiny"))
        attach_cost_metrics(self.engine)

    def metrics(self) -> dict:
        import httpx

        text = httpx.get(self.base + "/metrics").text
        names = ("dflash_rounds_total", "dflash_acceptance_length_count", "dflash_acceptance_length_sum",
                 "dflash_round_expert_bytes_sum", "dflash_round_expert_bytes_count", "dflash_compile_events_total",
                 "dflash_round_seconds_sum")
        out = {n: metric_sum(text, n) for n in names}
        for line in text.splitlines():
            if line.startswith("dflash_round_width_total{"):
                out["width " + line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
            if line.startswith("dflash_round_rows_total{"):
                out["rows " + line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
        return out

    def close(self):
        self.server.should_exit = True
        self.thread.join(60)


def measure(point: Point, work, max_tokens, concurrency: int) -> dict:
    """One load run on a point; the engine's counters are read before and after (deltas)."""
    before = point.metrics()
    explored = sum(point.engine.explore_rounds.values())
    cpu = time.process_time()  # this process: the engines and their HTTP loops (the clients run in another)
    records, wall = run_clients(point.base, work, max_tokens)
    cpu = time.process_time() - cpu
    load = (h.load_average() or (float("nan"),))[0]
    explored = sum(point.engine.explore_rounds.values()) - explored
    after = point.metrics()
    m = {k: after[k] - before.get(k, 0.0) for k in after}
    tokens = sum(len(r["ids"]) for r in records)
    ttft = [r["stamps"][0][0] - r["t0"] for r in records if r["stamps"]]
    itl = []
    for r in records:
        for (a, _), (b, n) in zip(r["stamps"], r["stamps"][1:]):
            itl += [(b - a) / n] * n
    verified, count = m["dflash_acceptance_length_count"], m["dflash_round_expert_bytes_count"]
    return {
        "mode": point.mode, "block_size": point.block_size, "concurrency": concurrency, "slots": point.slots,
        "requests": len(records), "tokens": tokens,
        "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1), "wall_exact_s": wall, "cpu_exact_s": cpu,
        "cpu_s": round(cpu, 3), "cpu_ms_per_token": round(1e3 * cpu / max(tokens, 1), 3), "load_avg_1m": round(load, 2),
        "explored_rounds": explored,
        "ttft_ms_p50": round(1e3 * h.percentile(ttft, 50), 1), "ttft_ms_p99": round(1e3 * h.percentile(ttft, 99), 1),
        "itl_ms_p50": round(1e3 * h.percentile(itl, 50), 2), "itl_ms_p99": round(1e3 * h.percentile(itl, 99), 2),
        "tokens_per_verify": round(m["dflash_acceptance_length_sum"] / verified, 2) if verified else None,
        "rounds": int(m["dflash_rounds_total"]),
        "expert_mb_per_round": round(m["dflash_round_expert_bytes_sum"] / count / 1e6, 4) if count else None,
        "all_expert_mb": round(float(point.engine.expert_bytes.sum()) / 1e6, 4),
        "compiles_while_serving": int(m["dflash_compile_events_total"]), "warmup_s": round(point.warm_s, 1),
        "rounds_by_width": {k.split()[1]: int(v) for k, v in sorted(m.items()) if k.startswith("width ") and v},
        "rounds_by_rows": {k.split()[1]: int(v) for k, v in sorted(m.items()) if k.startswith("rows ") and v},
        "engine_busy_s": round(m["dflash_round_seconds_sum"], 3),
        "round_ms_by_width": {str(w): round(1e3 * t, 2) for w, t in
                              point.engine.seconds_table(point.engine.row_bucket(range(concurrency))).items()},
        "warmup_round_ms_by_width": {str(w): round(1e3 * t, 2) for w, t in
                                     point.warm_table.get(point.engine.row_bucket(range(concurrency)), {}).items()},
        "outputs": {json.dumps(r["prompt"]): r["ids"] for r in records},
    }


def width_key(label: str) -> tuple:
    """Widths in order: the chain widths by size, then the trees ("tree16x4")."""
    return (0, int(label), "") if label.isdigit() else (1, 0, label)


def mode_label(mode: str) -> str:
    if mode.startswith("tree"):
        return f"DFlash tree N={mode[4:]} (branch 4)"
    if mode.startswith("auto"):
        return f"DFlash, width by load (<= {mode[4:]})"
    if "+" in mode:
        return f"DFlash, width by load from {mode.replace('+', ', ')}"
    return f"DFlash B={mode}" if mode != "1" else "no speculation (B=1)"


def main(argv=None) -> int:
    p = h.parser(__doc__, {
        "--concurrency": "1,4,16,32", "--requests-per-client": 2,
        "--modes": ("auto8,4", "DFlash modes besides B=1: `autoN` (the verify width chosen per round by the engine's "
                               "cost model from 1, 2, 4, .. N), `A+B+..` (chosen from the widths A, B, ..; the "
                               "block the widest) or a fixed block size N (default auto8,4)"),
        "--slots": (None, "the engine's slots, one engine per mode for every concurrency (default: the largest "
                          "concurrency); 0: an engine per concurrency with as many slots as clients")},
        checkpoint=None, max_tokens=64, prompt_len=64, repeats=4)
    args = h.parse(p, argv, quick=dict(concurrency="1,2", requests_per_client=1, max_tokens=8, prompt_len=16,
                                       repeats=1, modes="4"))
    levels = h.int_list(p, args.concurrency, "--concurrency")
    slots = max(levels) if args.slots is None else int(args.slots)
    if slots < 0 or 0 < slots < max(levels):
        p.error(f"--slots {slots} is below the largest concurrency {max(levels)}: give at least that many, or 0")

    from dflash_jax import compile_cache
    from dflash_jax.cli.generate import load_tokenizer

    compile_cache.ensure_enabled()
    pair = h.load_pair(args, dequantize_experts="auto")  # the experts as `dflash-serve` loads them
    tokenizer = load_tokenizer(pair)
    prompts = h.prompts(pair, max(levels) * args.requests_per_client, args.prompt_len)
    dmodes = [m.strip() for m in args.modes.split(",") if m.strip() and m.strip() != "1"]
    modes = dmodes + ["1"]
    rows, loads = [], []
    paired: dict = {m: {} for m in dmodes}  # mode -> concurrency -> paired tokens/s ratio to B=1 {median, min, max}
    paired_cpu: dict = {m: {} for m in dmodes}  # the same by CPU seconds per token (B=1's over the mode's)
    t_start = time.perf_counter()
    shared = None
    if slots:
        shared = {m: Point(pair, tokenizer, m, slots, args.prompt_len, args.max_tokens) for m in modes}
        print("warm-ups: " + ", ".join(f"{m} {shared[m].warm_s:.0f}s" for m in modes), flush=True)
    for c in levels:
        points = ([shared[m] for m in modes] if shared else
                  [Point(pair, tokenizer, m, c, args.prompt_len, args.max_tokens) for m in modes])
        per_client = max(args.requests_per_client, -(-8 // c))  # at least 8 requests per point (low c is noisy)
        work = [[prompts[(i * per_client + j) % len(prompts)] for j in range(per_client)] for i in range(c)]
        best = {}

        def keep(mode, rep, row):
            loads.append(row["load_avg_1m"])
            if mode not in best or row["tokens_per_s"] > best[mode]["tokens_per_s"]:
                best[mode] = row
            print(f"c={c:>3} {mode:>6} run {rep + 1}: {row['tokens_per_s']:>8.1f} tok/s  "
                  f"TTFT p50 {row['ttft_ms_p50']:.0f} ms  ITL p50 {row['itl_ms_p50']:.2f} ms "
                  f"p99 {row['itl_ms_p99']:.2f} ms  tau {row['tokens_per_verify']} widths "
                  f"{row['rounds_by_width']} rows {row['rounds_by_rows']} engine busy "
                  f"{row['engine_busy_s']:.1f}s, CPU {row['cpu_ms_per_token']:.2f} ms/token, explored "
                  f"{row['explored_rounds']}, load {row['load_avg_1m']:.1f} ({row['wall_s']:.1f}s run, "
                  f"{row['warmup_s']:.0f}s warm-up, {time.perf_counter() - t_start:.0f}s so far)", flush=True)

        try:  # the modes alternate, so a busy spell of the machine hits all
            t = h.paired_runs({pt.mode: functools.partial(measure, pt, work, args.max_tokens, c) for pt in points},
                              args.repeats, on_run=keep,
                              seconds_of=lambda row: (row["wall_exact_s"], row["cpu_exact_s"]))
        finally:
            if not shared:
                for point in points:
                    point.close()
        for m in dmodes:  # tokens/s ratio = B=1's seconds over the mode's (the same tokens)
            paired[m][c], paired_cpu[m][c] = t.ratio(m, "1", "wall"), t.ratio(m, "1", "cpu")
        rows += [best[m] for m in modes]
    for point in (shared or {}).values():
        point.close()

    def row_of(c, m):
        return next(r for r in rows if r["concurrency"] == c and r["mode"] == m)

    for c in levels:  # lossless: with ignore_eos and greedy decoding every mode emits B=1's tokens for every prompt
        for m in modes:
            assert row_of(c, m)["outputs"] == row_of(c, "1")["outputs"], \
                f"{m} and B=1 outputs differ at concurrency {c}"
            assert row_of(c, m)["compiles_while_serving"] == 0

    def median_and_range(table):
        return ({m: {c: round(v["median"], 2) for c, v in by.items()} for m, by in table.items()},
                {m: {c: [round(v["min"], 2), round(v["max"], 2)] for c, v in by.items()} for m, by in table.items()})

    speedups, ratio_ranges = median_and_range(paired)
    cpu_speedups, cpu_ranges = median_and_range(paired_cpu)
    load_summary = {"min": round(min(loads), 2), "median": round(float(np.median(loads)), 2),
                    "max": round(max(loads), 2)}
    mach = h.machine()
    result = {
        "benchmark": "serve", "modes": dmodes, "speedup_by_mode_and_concurrency": speedups,
        "paired_ratio_range": ratio_ranges, "cpu_speedup_by_mode_and_concurrency": cpu_speedups,
        "paired_cpu_ratio_range": cpu_ranges, "load_avg_1m": load_summary, "repeats": args.repeats,
        "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "requests_per_client": args.requests_per_client,
        "rows": [{k: v for k, v in r.items() if k not in ("outputs", "wall_exact_s", "cpu_exact_s")} for r in rows],
        "machine": {k: mach[k] for k in ("platform", "cpus", "jax", "backend")},
        "total_s": round(time.perf_counter() - t_start, 1),
    }
    lines = [
        "# Serving benchmark (dflash-serve, loopback)", "",
        f"`python benchmarks/serve.py --write-docs` on the shipped pair, {mach['backend']} backend, "
        f"{mach['machine']}; the expert tables as `dflash-serve` loads them (`--dequantize-experts auto`: "
        f"{'dense' if pair.experts_dequantized else 'as stored'}); the server (HTTP loop and engine threads) in one "
        "process, "
        "the clients (asyncio + httpx) in another, over 127.0.0.1. "
        f"Each client sends {args.requests_per_client} streaming greedy completions back to back (at least 8 requests "
        "per point) "
        f"({args.prompt_len}-token prompts from held-out stdlib files, {args.max_tokens} tokens each, `ignore_eos`); "
        + (f"one engine of {slots} slots per mode serves every concurrency (a round computes the smallest row "
           "bucket, 1, 2, 4, .., holding the live requests, which are kept in the lowest slots). " if slots else
           "the engine has as many slots as clients. ")
        + f"{args.repeats} runs per point, the modes alternating (order "
        "reversed every other run); tokens/s and latencies: the best run; speedup: the median over the runs of "
        "the ratio to B=1 measured in the same run (range in brackets). Every mode produced the same tokens as "
        "no speculation (B=1) for every prompt (checked), and no compile happened while serving. "
        f"Load average (1 min, taken after each run) {load_summary['min']:.1f} / {load_summary['median']:.1f} / "
        f"{load_summary['max']:.1f} (min / median / max); the machine is shared with other jobs, so the CPU columns "
        "(the server process's CPU seconds per output token, and B=1's over the mode's, paired by run) are given "
        "beside wall time.", ""]

    def speedup(table, ranges, r):
        m, c = r["mode"], r["concurrency"]
        return "" if m == "1" else f"{table[m][c]:.2f}x [{ranges[m][c][0]:.2f}-{ranges[m][c][1]:.2f}]"

    def widths(r):
        text = ", ".join(f"{w}: {n}" for w, n in sorted(r["rounds_by_width"].items(), key=lambda x: width_key(x[0])))
        return text + (f" ({r['explored_rounds']} explored)" if r["explored_rounds"] else "")

    lines += h.table(
        ["concurrency", "mode", "tokens/s", "speedup [range]", "CPU ms per token", "CPU speedup [range]",
         "TTFT p50 / p99 (ms)", "ITL p50 / p99 (ms)", "tokens per verify", "rounds by width (explored)",
         "rounds by rows", "engine busy", "expert MB per round (of all)"],
        [[r["concurrency"], mode_label(r["mode"]), f"{r['tokens_per_s']:.1f}", speedup(speedups, ratio_ranges, r),
          f"{r['cpu_ms_per_token']:.2f}", speedup(cpu_speedups, cpu_ranges, r),
          f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f}", f"{r['itl_ms_p50']:.2f} / {r['itl_ms_p99']:.2f}",
          r["tokens_per_verify"], widths(r),
          ", ".join(f"{w}: {n}" for w, n in sorted(r["rounds_by_rows"].items(), key=lambda x: int(x[0]))),
          f"{100 * r['engine_busy_s'] / r['wall_s']:.0f}%", f"{r['expert_mb_per_round']} ({r['all_expert_mb']})"]
         for r in rows], align="r-rrrrrrr--rr")
    lines += ["", "ITL: each streamed chunk's gap after the previous chunk, spread evenly over the tokens it carries "
              "(DFlash delivers several tokens per round). Engine busy: the engine's round time over the run's wall "
              "time (the rest: waiting for requests, HTTP). Expert MB per round: the bytes of the union of the "
              "experts the verified rows' drafted blocks are projected to route to (the draft-router projection the "
              "scheduler prices rounds with; block 1 projects from the anchor token's embedding)."]
    tables = [r for r in rows if r["mode"].startswith("auto")]
    if tables:
        lines += ["", "The width chooser's cost table (ms per round at the row bucket of the concurrency, widths 1, 2, "
                  "4, ..), at warm-up and as learned from the served rounds (at the end of the run shown):", ""]

        def fmt(t):
            return " / ".join(f"{v:.1f}" for _, v in sorted(t.items(), key=lambda x: width_key(str(x[0]))))

        lines += [f"- {r['concurrency']} clients ({mode_label(r['mode'])}): warm-up "
                  f"{fmt(r['warmup_round_ms_by_width'])}; learned {fmt(r['round_ms_by_width'])}" for r in tables]

    def draw(axes):
        ax1, ax2, ax3 = axes
        styles = ["o-", "^-", "v-", "d-"]
        for i, (mode, style) in enumerate([(m, styles[i % 4]) for i, m in enumerate(dmodes)] + [("1", "s--")]):
            sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["concurrency"])
            label, cs, color = mode_label(mode), [r["concurrency"] for r in sel], f"C{i}"
            ax1.plot(cs, [r["tokens_per_s"] for r in sel], style, color=color, label=label)
            ax2.plot(cs, [r["ttft_ms_p50"] for r in sel], style, color=color, label=label)
            ax3.plot(cs, [r["itl_ms_p50"] for r in sel], style, color=color, label=label + " p50")
            ax3.plot(cs, [r["itl_ms_p99"] for r in sel], style, color=color, alpha=0.35, label=label + " p99")
        for ax, ylabel in ((ax1, "output tokens/s"), (ax2, "TTFT p50 (ms)"), (ax3, "inter-token latency (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize="small")
        ax3.set_yscale("log")

    h.Report(args, "serve").write(result, lines, draw=draw, ncols=3, figsize=(13, 3.6),
                                  image="tokens/s, TTFT and ITL by concurrency")
    print(json.dumps(speedups), "CPU", json.dumps(cpu_speedups), f"load {load_summary}", f"-> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
