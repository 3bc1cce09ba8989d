"""What admitting requests costs the serving engine: a prefill alone or in a group, and the held context's flush.

  python benchmarks/admission_costs.py [--prompt-len 64] [--slots 32] [--flush-rows 1,4,16] [--repeats 15]
                                       [--quick] [--out DIR | --write-docs]

The server's default engine on the shipped pair (widths 1 and 4, `Engine.warmup()` first: nothing timed compiles),
its runner called directly, every call waited for (`RoundRunner.sync`):

- **Prefill**: `--prompt-len`-token held-out prompts prefilled and written into slots (`RoundRunner.prefill`, then
  `insert` into the first slots, padding rows dropped): one prompt alone, two prompts one by one, two and four
  prompts in one group of 4 rows (the engine's group size: padding rows cost what real ones cost on a CPU). Paired
  (`timing.paired_runs`, the order reversed every other run); medians.
- **Flush**: `RoundRunner.flush_context` of the first R rows holding a `--prompt-len`-token prompt each (what a
  drafting round after an admission appends first: `--flush-rows`), and of rows holding nothing. Each timed flush
  follows an untimed admission of R requests, so every one appends whole prompts; medians. And one prompt admitted
  into the last of R rows whose others hold nothing (what most admissions are): the flush of the bucket's R rows
  against the flush of that row alone (`flush_context(R, slots=[R - 1])`, a gathered flush: what the engine runs).

Writes admission_costs.{json,md,png} to --out (default bench_out/) or, with --write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import time

import numpy as np

import harness as h

DEFAULTS = dict(prompt_len=64, slots=32, flush_rows="1,4,16", repeats=15)
QUICK = dict(slots=4, flush_rows="1,2", repeats=2)


def main(argv=None) -> int:
    d = DEFAULTS
    p = h.parser(__doc__, {"--slots": d["slots"], "--flush-rows": d["flush_rows"]}, prompt_len=d["prompt_len"],
                 repeats=d["repeats"])
    args = h.parse(p, argv, quick=QUICK)
    flush_rows = h.int_list(p, args.flush_rows, "--flush-rows")
    if max(flush_rows) > args.slots or args.slots < 4:
        p.error("--slots must be at least 4 and at least the largest --flush-rows")
    log = h.logger("admission_costs")
    import dflash_jax
    from dflash_jax.serve.engine import Engine, Request, SamplingParams
    from dflash_jax.timing import load_average, paired_runs

    pair = dflash_jax.load(None, dequantize_experts="auto")
    pool = h.prompts(pair, max(max(flush_rows), 4), args.prompt_len)
    eng = Engine(pair, slots=args.slots, max_prompt_len=2 * args.prompt_len, max_new_tokens=128, block_size=4,
                 widths=(1, 4))
    t = time.perf_counter()
    eng.warmup()
    log(f"engine warmed in {time.perf_counter() - t:.1f} s (widths 1 and 4, {args.slots} slots)")
    runner = eng.runner
    loads = [(load_average() or (0.0,))[0]]

    def request(i: int) -> Request:
        return Request(id=i, prompt=list(pool[i % len(pool)]), max_new_tokens=8, sampling=SamplingParams(),
                       stop_ids=[], seed=0)

    def prefill(n: int, group: int):
        batch = eng._batch([request(i) for i in range(n)], group)

        def run():
            index = np.full(group, args.slots, np.int32)  # padding rows dropped, as an admission drops them
            index[:n] = np.arange(n)
            runner.insert(runner.prefill(batch), index)
            runner.sync()
        return run

    alone = prefill(1, 1)
    modes = {"1 prompt alone": alone, "2 prompts one by one": lambda: (alone(), alone()),
             "2 prompts, a group of 4": prefill(2, 4), "4 prompts, a group of 4": prefill(4, 4)}
    for fn in modes.values():
        fn()
    timings = paired_runs(modes, args.repeats)
    prefill_ms = {m: float(np.median(timings.seconds(m))) * 1e3 for m in modes}
    for m, ms in prefill_ms.items():
        log(f"prefill, {m}: {ms:.2f} ms")
    loads.append((load_average() or (0.0,))[0])

    flush_ms = {}
    for rows in flush_rows:
        held, empty = [], []
        for _ in range(args.repeats):
            eng._reset()
            group = eng.prefill_groups[-1]
            for start in range(0, rows, group):  # held prompts, untimed, admitted as the engine groups them
                eng._admit([request(i) for i in range(start, min(rows, start + group))],
                           list(range(start, min(rows, start + group))), None)
            runner.sync()
            t0 = time.perf_counter()
            runner.flush_context(rows)
            runner.sync()
            held.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            runner.flush_context(rows)  # nothing pending now
            runner.sync()
            empty.append(time.perf_counter() - t0)
        one = {"bucket": [], "gathered": []}
        for r in range(args.repeats):
            for how in (("bucket", "gathered") if r % 2 == 0 else ("gathered", "bucket")):
                eng._reset()
                if rows > 1:  # the other rows: admitted and flushed (untimed), holding nothing
                    for start in range(0, rows - 1, group):
                        eng._admit([request(i) for i in range(start, min(rows - 1, start + group))],
                                   list(range(start, min(rows - 1, start + group))), None)
                    runner.flush_context(rows)
                eng._admit([request(rows - 1)], [rows - 1], None)
                runner.sync()
                t0 = time.perf_counter()
                runner.flush_context(rows, None if how == "bucket" else [rows - 1])
                runner.sync()
                one[how].append(time.perf_counter() - t0)
        flush_ms[rows] = dict(held=float(np.median(held)) * 1e3, empty=float(np.median(empty)) * 1e3,
                              **{f"one_{k}": float(np.median(v)) * 1e3 for k, v in one.items()})
        log(f"flush of {rows} row(s): {flush_ms[rows]['held']:.2f} ms holding a prompt each, "
            f"{flush_ms[rows]['empty']:.2f} ms holding nothing; one new prompt among them "
            f"{flush_ms[rows]['one_bucket']:.2f} ms (the bucket's) / {flush_ms[rows]['one_gathered']:.2f} ms (its row)")
    loads.append((load_average() or (0.0,))[0])

    result = dict(benchmark="admission_costs", machine=h.machine(), prompt_len=args.prompt_len, slots=args.slots,
                  repeats=args.repeats, context_rows=eng.context_rows, prefill_ms=prefill_ms,
                  flush_ms={str(r): v for r, v in flush_ms.items()}, load_range=[min(loads), max(loads)])
    lines = [
        "# What admitting requests costs the serving engine (CPU)",
        "",
        f"`{h.command('admission_costs.py', args, DEFAULTS)}` - the default engine (widths 1 and 4, {args.slots} "
        f"slots, a hold of {eng.context_rows} context rows per slot), {args.prompt_len}-token held-out prompts, "
        f"medians of {args.repeats} runs, load average (1 min) {min(loads):.1f} - {max(loads):.1f}.",
        "",
        "Prefill (and the insert into slots), paired:",
        "",
        *h.table(["prefill", "ms"], [[m, f"{ms:.2f}"] for m, ms in prefill_ms.items()]),
        "",
        "The held context's flush before a drafting round (`RoundRunner.flush_context`):",
        "",
        *h.table(["rows", "holding a prompt each (ms)", "holding nothing (ms)",
                  "one new prompt: the bucket's flush (ms)", "one new prompt: its row's, gathered (ms)"],
                 [[str(r), f"{v['held']:.2f}", f"{v['empty']:.2f}", f"{v['one_bucket']:.2f}",
                   f"{v['one_gathered']:.2f}"] for r, v in flush_ms.items()]),
    ]

    def draw(axes):
        left, right = axes
        left.barh(list(prefill_ms), list(prefill_ms.values()))
        left.set_xlabel("prefill ms")
        x = np.arange(len(flush_ms))
        for i, (key, label) in enumerate((("held", "holding a prompt"), ("empty", "holding nothing"),
                                          ("one_bucket", "one new prompt, bucket"),
                                          ("one_gathered", "one new prompt, gathered"))):
            right.bar(x + 0.2 * (i - 1.5), [v[key] for v in flush_ms.values()], 0.2, label=label)
        right.set_xticks(x, [str(r) for r in flush_ms])
        right.set_xlabel("rows flushed")
        right.set_ylabel("ms")
        right.legend(fontsize=7)

    h.Report(args, "admission_costs").write(result, lines, draw=draw, ncols=2, figsize=(11, 3.4),
                                            image="prefill and flush times")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
