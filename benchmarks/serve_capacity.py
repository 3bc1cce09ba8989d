"""Serving at a large capacity: what the engine's cache size costs an admission, a compaction move and closed-loop
clients' tokens/s, this tree beside a checkout of another commit.

  python benchmarks/serve_capacity.py [--capacities 128,4091] [--clients 4,16] [--requests-per-client 4]
                                      [--prompt-len 64] [--max-tokens 128] [--repeats 2] [--processes 2]
                                      [--against DIR] [--quick] [--out DIR | --write-docs]

`dflash-serve` sizes its caches for the longest prompt it takes (`--max-prompt-len`, by default 4091 tokens: 4096-slot
caches) while most requests use a few hundred slots. For each capacity (the engine's `max_prompt_len`) a plain engine
(block 1) and the default engine (widths 1 and 4) on the shipped pair, as many slots as the most `--clients`, warmed
(nothing timed compiles). In one process, every engine:

- **admission**: one `--prompt-len`-token held-out prompt admitted into a free slot of a fresh state as the engine
  admits it (`Engine._admit`: the prefill, the insert into the state, the first token), every engine in turn (the
  order reversed every other turn), 5 x `--repeats` turns, median ms;
- **move**: a compaction move of a row holding that prompt (`RoundRunner.move_row`) into a free slot of the same lane
  and of the other lane (on a CPU the slots split over two lanes, `serve.lanes`), median ms;
- **tokens/s**: `--clients` closed-loop clients each sending `--requests-per-client` requests of `--max-tokens` new
  tokens (greedy), every engine's clients served at once, one engine step each in turn (the order reversed every
  other turn; each engine's tokens/s over its own steps' time), `--repeats` runs, median; every engine's tokens equal
  to the plain engine's at the first capacity.

`--processes` fresh processes per tree; `--against DIR` measures a checkout of the library (another commit) the same
way, its processes alternating with this tree's. A point's figure is the median over processes. Writes
serve_capacity.{json,md,png} to --out (default bench_out/) or, with --write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import numpy as np

import harness as h

DEFAULTS = dict(capacities="128,4091", clients="4,16", requests_per_client=4, prompt_len=64, max_tokens=128,
                repeats=2, processes=2, against=None)
QUICK = dict(capacities="32,600", clients="2", requests_per_client=1, prompt_len=16, max_tokens=8, repeats=1,
             processes=1)
KINDS = {"plain": dict(block_size=1), "default": dict(block_size=4, widths=(1, 4))}


def measure(capacities: list[int], clients: list[int], per: int, prompt_len: int, max_tokens: int,
            repeats: int) -> dict:
    """This process's figures: {"admission_ms" | "move_ms" | "tokens_per_s": {point: value}}."""
    import dflash_jax
    from dflash_jax.serve.engine import Engine, Request, SamplingParams
    from width_choice import serve

    pair = dflash_jax.load(None, dequantize_experts="auto")
    pool = h.prompts(pair, max(max(clients) * per, 2), prompt_len)
    engines = {}
    for cap in capacities:
        for kind, kw in KINDS.items():
            eng = Engine(pair, slots=max(2, max(clients)), max_prompt_len=cap, max_new_tokens=max_tokens, **kw)
            eng.warmup()
            engines[f"{kind} @ {cap}"] = eng
    out = {"admission_ms": {}, "move_ms": {}, "tokens_per_s": {}}

    def request() -> Request:
        return Request(id=-1, prompt=list(pool[0]), max_new_tokens=max_tokens, sampling=SamplingParams(),
                       stop_ids=[], seed=0)

    def admitted(eng) -> None:  # a fresh state (untimed), one prompt admitted into slot 0
        eng._reset()
        eng._admit([request()], [0], None)
        eng.runner.sync()

    def timed_after(setup, fn, names) -> dict:
        """{name: median seconds of fn(name)} over 5 x repeats turns, each turn every engine in turn (the order
        reversed every other turn), setup(name) untimed before each."""
        times = collections.defaultdict(list)
        for r in range(5 * repeats):
            for name in (names if r % 2 == 0 else names[::-1]):
                setup(name)
                t = time.perf_counter()
                fn(name)
                engines[name.split(",")[0]].runner.sync()
                times[name].append(time.perf_counter() - t)
        return {name: float(np.median(v)) for name, v in times.items()}

    def fresh(name):
        engines[name]._reset()
        engines[name].runner.sync()

    got = timed_after(fresh, lambda name: engines[name]._admit([request()], [0], None), list(engines))
    out["admission_ms"] = {name: t * 1e3 for name, t in got.items()}
    moves = {}  # a row holding the prompt (slot 0) moved within its lane and, with two lanes, to the other
    for name, eng in engines.items():
        lanes = getattr(eng.runner, "n", 1)
        moves[f"{name}, same lane"] = lanes
        if lanes > 1:
            moves[f"{name}, other lane"] = 1
    got = timed_after(lambda m: admitted(engines[m.split(",")[0]]),
                      lambda m: engines[m.split(",")[0]].runner.move_row(0, moves[m]), list(moves))
    out["move_ms"] = {m: t * 1e3 for m, t in got.items()}
    for eng in engines.values():
        eng._reset()
    for c in clients:
        order = list(engines)
        first = serve(engines, order, pool, c, per, max_tokens, {m: collections.Counter() for m in order})
        for name, (_, got) in first.items():  # untimed: each engine's first run of this point; outputs checked
            if got != first[order[0]][1]:
                raise SystemExit(f"{name} at {c} clients: tokens differ from {order[0]}'s")
        rates = collections.defaultdict(list)
        for r in range(repeats):
            got = serve(engines, order if r % 2 == 0 else order[::-1], pool, c, per, max_tokens,
                        {m: collections.Counter() for m in order})
            for name, (rate, _) in got.items():
                rates[name].append(rate)
        for name in order:
            out["tokens_per_s"][f"{name}, {c} clients"] = float(np.median(rates[name]))
    return out


def main(argv=None) -> int:
    d = DEFAULTS
    p = h.parser(__doc__, {"--capacities": (d["capacities"], "engines' max_prompt_len values"),
                           "--clients": d["clients"], "--requests-per-client": d["requests_per_client"],
                           "--processes": (d["processes"], "fresh processes per tree, one after another"),
                           "--against": (d["against"], "a checkout to measure beside this tree"),
                           "--worker": (False, "internal: measure in this process and print JSON")},
                 prompt_len=d["prompt_len"], max_tokens=d["max_tokens"], repeats=d["repeats"])
    worker = argv is None and "--worker" in sys.argv  # a measuring process: no output directory, one JSON line
    args = p.parse_args() if worker else h.parse(p, argv, quick=QUICK)
    capacities = h.int_list(p, args.capacities, "--capacities")
    clients = h.int_list(p, args.clients, "--clients")
    if min(capacities) < args.prompt_len:
        p.error(f"--capacities must each hold a --prompt-len prompt ({args.prompt_len} tokens)")
    if args.requests_per_client < 1 or args.processes < 1 or args.repeats < 1:
        p.error("--requests-per-client, --processes and --repeats must be >= 1")
    if worker:
        print(json.dumps(measure(capacities, clients, args.requests_per_client, args.prompt_len, args.max_tokens,
                                 args.repeats)))
        return 0
    against = h.check_checkout(p, args.against)
    from dflash_jax.timing import load_average

    log = h.logger("serve_capacity")
    trees = {"this": h.ROOT} if against is None else {"this": h.ROOT, "against": against}
    argv_worker = ["--capacities", args.capacities, "--clients", args.clients, "--requests-per-client",
                   str(args.requests_per_client), "--prompt-len", str(args.prompt_len), "--max-tokens",
                   str(args.max_tokens), "--repeats", str(args.repeats)]
    runs = {name: [] for name in trees}
    loads = [(load_average() or (0.0,))[0]]
    for i in range(args.processes):
        for name, tree in (trees.items() if i % 2 == 0 else list(trees.items())[::-1]):
            t = time.perf_counter()
            runs[name].append(h.in_tree(tree, __file__, argv_worker))
            loads.append((load_average() or (0.0,))[0])
            log(f"process {i + 1}/{args.processes}, {name}: {time.perf_counter() - t:.0f} s")
    fig = {name: {part: {k: float(np.median([r[part][k] for r in got])) for k in got[0][part]}
                  for part in got[0]} for name, got in runs.items()}
    commits = {name: h.revision(tree) for name, tree in trees.items()}
    result = dict(benchmark="serve_capacity", machine=h.machine(), capacities=capacities, clients=clients,
                  requests_per_client=args.requests_per_client, prompt_len=args.prompt_len,
                  max_tokens=args.max_tokens, repeats=args.repeats, processes=args.processes, commits=commits,
                  load_1min=max(loads), load_range=[min(loads), max(loads)], figures=fig,
                  processes_figures=runs)
    small, large = capacities[0], capacities[-1]
    names = list(trees)

    def growth(name, kind, c):  # tokens/s at the largest capacity over the smallest
        rate = fig[name]["tokens_per_s"]
        return rate[f"{kind} @ {large}, {c} clients"] / rate[f"{kind} @ {small}, {c} clients"]

    def cells(part, key):
        vals = [fig[n][part].get(key) for n in names]
        out = [f"{v:.2f}" if part != "tokens_per_s" else f"{v:.0f}" for v in vals]
        if len(vals) == 2:
            out.append(f"{vals[0] / vals[1]:.2f}")
        return out

    shown = argparse.Namespace(**{**vars(args), "against": "DIR" if args.against else None})  # no machine path
    tree_cols = [f"{n} ({commits[n]})" for n in names] + (["this / against"] if len(names) == 2 else [])
    lines = [
        "# Serving at a large capacity (CPU)",
        "",
        f"`{h.command('serve_capacity.py', shown, DEFAULTS)}` - "
        + ", ".join(f"{n}: commit {commits[n]}" for n in names)
        + f"; {args.processes} fresh process(es) per tree, alternating; medians over processes. Capacity = the "
        f"engine's `max_prompt_len` (caches of that plus {args.max_tokens} new tokens and a block). "
        f"Load average (1 min) {min(loads):.1f} - {max(loads):.1f}.",
        "",
        f"One {args.prompt_len}-token prompt admitted (prefill, insert, first token), ms:",
        "",
        *h.table(["engine"] + tree_cols, [[k] + cells("admission_ms", k) for k in fig["this"]["admission_ms"]]),
        "",
        "A compaction move of a row holding it, ms:",
        "",
        *h.table(["engine, move"] + tree_cols, [[k] + cells("move_ms", k) for k in fig["this"]["move_ms"]]),
        "",
        f"Closed-loop clients, {args.requests_per_client} requests each of {args.max_tokens} new tokens, tokens/s:",
        "",
        *h.table(["engine, clients"] + tree_cols, [[k] + cells("tokens_per_s", k)
                                                   for k in fig["this"]["tokens_per_s"]]),
        "",
        f"Capacity {large} over capacity {small}, tokens/s:",
        "",
        *h.table(["engine, clients"] + [f"{n} ({commits[n]})" for n in names],
                 [[f"{kind}, {c} clients"] + [f"{growth(n, kind, c):.2f}" for n in names]
                  for kind in KINDS for c in clients]),
    ]

    def draw(ax):
        x = np.arange(len(clients) * len(KINDS))
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            ax.bar(x + i * width, [growth(n, kind, c) for kind in KINDS for c in clients], width,
                   label=f"{n} ({commits[n]})")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(x + width * (len(names) - 1) / 2, [f"{k}\n{c} clients" for k in KINDS for c in clients])
        ax.set_ylabel(f"tokens/s, capacity {large} / {small}")
        ax.legend()

    h.Report(args, "serve_capacity").write(result, lines, draw=draw, image="tokens/s at a large capacity over a small",
                                           figsize=(7, 4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
