"""The serving engine's width choice, in-process: closed-loop clients against engines of the same slots.

  python benchmarks/width_choice.py [--clients 1,4,16,32] [--requests-per-client 2] [--prompt-len 64]
                                    [--max-tokens 128] [--length-spread 0] [--slots 32] [--repeats 3]
                                    [--call-rounds N] [--quick] [--out DIR | --write-docs]

Engines on the shipped pair (experts as `dflash_jax.load` keeps them on this machine), all built and warmed in one
process: plain (block 1), the server's default (widths 1 and 4 chosen per round), the same with
`acceptance_exploration=False`, the same with `skip_context=True` (width-1 rounds compute no taps; caught up before
drafting), a block-4 engine whose only width is 1 (what a drafting engine's width-1 rounds cost against plain's,
no choice made), block 4 (`--widths fixed`), and a second plain engine built last (the control: two identical engines
measured apart by the harness alone). At each client count c, c clients each send
`--requests-per-client` requests one after another (the next when the last ends: `Engine.submit`, then
`Engine.step` until it finishes), greedy. Every request asks for `--max-tokens` new tokens, or with
`--length-spread F` > 0 a length drawn uniformly from max_tokens * [1 - F, 1 + F] (the same draws for every engine):
with equal lengths and prompts, closed-loop clients of plain decoding finish together and are admitted together,
a lockstep that any width choice breaks and that served traffic seldom shows. The engines serve their clients at
once, one engine step each in turn (the order reversed every other turn), so that every engine meets the machine's
load as the others do (runs one after another drifted by 5% - 10% on a shared machine); one untimed run, then
`--repeats` runs (the engines' order reversed every other run). Tokens/s over each engine's own steps' time; the
ratio to plain is the median of the per-run ratios (and, beside it, the ratio to the geometric mean of both plain
engines' rates in the run, which the build order and the buffers' placement move less); the rounds each engine ran
at each width, its acceptance explorations and its long-run acceptance. Every engine's tokens are checked against
plain's. Writes width_choice.{json,md,png} (with --length-spread: width_choice_spread.*) to --out (default
bench_out/) or, with --write-docs, docs/benchmarks/.

`--call-rounds N`: the length of a device call instead. The engines are plain and the default, each as it runs
(`rounds_per_call="auto"`: up to `MAX_BURST` rounds a call, sized to 50 ms) and with calls of at most N rounds
(`rounds_per_call=N`); writes width_choice_calls.*.
"""

from __future__ import annotations

import collections
import sys
import time

import numpy as np

import harness as h

CONTROL = "plain, a second engine (control)"
MODES = {
    "plain": dict(block_size=1),
    "default (widths 1, 4)": dict(block_size=4, widths=(1, 4)),
    "default, acceptance exploration off": dict(block_size=4, widths=(1, 4), acceptance_exploration=False),
    "default, width 1 skips the taps": dict(block_size=4, widths=(1, 4), skip_context=True),
    # a drafting engine with width 1 its only width: no choice made, so what it loses to plain is the drafting
    # engine's width-1 round and admissions, not the chooser
    "block 4 held at width 1": dict(block_size=4, widths=(1,)),
    "block 4": dict(block_size=4),
    # a second plain engine, built and warmed last: its ratio to plain is the harness's spread between two identical
    # engines (the same programs, other buffers), the floor under every other engine's ratio
    CONTROL: dict(block_size=1),
}
DEFAULTS = dict(clients="1,4,16,32", requests_per_client=2, slots=32, prompt_len=64, max_tokens=128, repeats=3,
                length_spread=0.0, call_rounds=0)

QUICK = dict(clients="1,4", requests_per_client=1, max_tokens=32, repeats=1, slots=4)


def call_modes(rounds: int) -> dict:
    """Plain and the default, each with calls of at most `rounds` rounds and as it runs (`--call-rounds`)."""
    out = {}
    for name in ("plain", "default (widths 1, 4)"):
        out[f"{name.split(' (')[0]}, calls of up to {rounds}"] = dict(MODES[name], rounds_per_call=rounds)
        out[name] = MODES[name]
    return out


class Clients:
    """Closed-loop clients of one engine: each sends its next prompt when its last request ends. `step()` runs one
    engine step and counts its time and tokens."""

    def __init__(self, engine, pool, clients: int, per: int, max_tokens, widths: collections.Counter):
        """max_tokens: each request's new tokens, one number or a function of (client, request index)."""
        self.engine, self.widths = engine, widths
        budget = max_tokens if callable(max_tokens) else (lambda c, i: max_tokens)
        self.queue = {c: [(pool[(c * per + i) % len(pool)], budget(c, i)) for i in range(per)]
                      for c in range(clients)}
        self.live = {c: self._submit(c) for c in range(clients)}
        self.outputs, self.tokens, self.seconds = collections.defaultdict(list), 0, 0.0

    def step(self) -> None:
        t = time.perf_counter()
        info = self.engine.step()
        for c, req in list(self.live.items()):
            if req.finish_reason is None:
                continue
            self.outputs[c].append(req.tokens)
            self.tokens += len(req.tokens)
            del self.live[c]
            if self.queue[c]:
                self.live[c] = self._submit(c)
        self.seconds += time.perf_counter() - t
        if info.width:
            self.widths[info.width] += info.rounds

    def _submit(self, c: int):
        prompt, tokens = self.queue[c].pop(0)
        return self.engine.submit(prompt, max_new_tokens=tokens)


def serve(engines: dict, order: list, pool, clients: int, per: int, max_tokens, widths: dict):
    """Every engine's clients served at once, one engine step each in turn (`order`, reversed every other turn),
    so that each engine meets the machine's load as the others do. Returns {engine: (tokens/s of its own steps'
    time, outputs)}."""
    runs = {name: Clients(engines[name], pool, clients, per, max_tokens, widths[name]) for name in order}
    turn = 0
    while any(run.live for run in runs.values()):
        for name in (order if turn % 2 == 0 else order[::-1]):
            if runs[name].live:
                runs[name].step()
        turn += 1
    return {name: (run.tokens / run.seconds, dict(run.outputs)) for name, run in runs.items()}


def main(argv=None) -> int:
    d = DEFAULTS
    p = h.parser(__doc__, {"--clients": d["clients"], "--requests-per-client": d["requests_per_client"],
                           "--slots": d["slots"], "--length-spread": d["length_spread"],
                           "--call-rounds": (d["call_rounds"], "compare calls of at most N rounds (0: off)")},
                 prompt_len=d["prompt_len"], max_tokens=d["max_tokens"],
                 repeats=d["repeats"])
    args = h.parse(p, argv, quick=QUICK)
    clients = h.int_list(p, args.clients, "--clients")
    if args.requests_per_client < 1 or args.slots < max(clients):
        p.error("--requests-per-client must be >= 1 and --slots at least the largest --clients")
    if not 0.0 <= args.length_spread < 1.0:
        p.error(f"--length-spread must be in [0, 1), got {args.length_spread:g}")
    draws = np.random.default_rng(0).uniform(1.0 - args.length_spread, 1.0 + args.length_spread,
                                             (max(clients), args.requests_per_client))
    lengths = np.maximum(1, np.rint(args.max_tokens * draws)).astype(int)
    if args.call_rounds < 0:
        p.error(f"--call-rounds must be >= 0, got {args.call_rounds}")
    modes = call_modes(args.call_rounds) if args.call_rounds else MODES

    def budget(c, i):
        return int(lengths[c, i])
    log = h.logger("width_choice")
    import dflash_jax
    from dflash_jax.serve.engine import Engine
    from dflash_jax.timing import load_average

    pair = dflash_jax.load(None, dequantize_experts="auto")
    pool = h.prompts(pair, max(max(clients) * args.requests_per_client, 8), args.prompt_len)
    engines = {}
    for name, kw in modes.items():
        t = time.perf_counter()
        engines[name] = Engine(pair, slots=args.slots, max_prompt_len=2 * args.prompt_len,
                               max_new_tokens=int(lengths.max()), **kw)
        engines[name].warmup()
        log(f"{name}: warmed in {time.perf_counter() - t:.1f} s")
    rows = []
    for c in clients:
        rates, widths = collections.defaultdict(list), {m: collections.Counter() for m in modes}
        loads = [(load_average() or (0.0,))[0]]
        order = list(engines)
        # untimed: each engine's first run of this point; outputs checked
        first = serve(engines, order, pool, c, args.requests_per_client, budget,
                      {m: collections.Counter() for m in modes})
        for name, (_, out) in first.items():
            if out != first["plain"][1]:
                raise SystemExit(f"{name} at {c} clients: tokens differ from plain's")
        for r in range(args.repeats):
            got = serve(engines, order if r % 2 == 0 else order[::-1], pool, c, args.requests_per_client,
                        budget, widths)
            for name, (rate, _) in got.items():
                rates[name].append(rate)
            loads.append((load_average() or (0.0,))[0])
        pair_rates = [np.sqrt(a * b) for a, b in zip(rates["plain"], rates[CONTROL])] if CONTROL in modes else None
        for name in modes:
            ratios = [a / b for a, b in zip(rates[name], rates["plain"])]
            both = None if pair_rates is None else float(np.median([a / b for a, b in zip(rates[name], pair_rates)]))
            total = sum(widths[name].values()) or 1
            rows.append(dict(mode=name, clients=c, tokens_per_s=float(np.median(rates[name])),
                             ratio=float(np.median(ratios)), ratio_range=[min(ratios), max(ratios)],
                             ratio_to_plain_pair=both,
                             width4_share=widths[name].get(4, 0) / total,
                             rounds_by_width={str(k): v for k, v in sorted(widths[name].items())},
                             load_1min=max(loads), load_range=[min(loads), max(loads)]))
            log(f"{c} clients, {name}: {rows[-1]['tokens_per_s']:.0f} tok/s, {rows[-1]['ratio']:.2f}x plain, "
                f"width 4 in {100 * rows[-1]['width4_share']:.0f}% of rounds")
    stats = {name: dict(acceptance_explores=getattr(e, "acceptance_explores", 0),
                        long_run_acceptance=getattr(e, "long_run_acceptance", None)) for name, e in engines.items()}
    result = dict(benchmark="width_choice", machine=h.machine(), clients=clients, slots=args.slots,
                  requests_per_client=args.requests_per_client, prompt_len=args.prompt_len,
                  max_tokens=args.max_tokens, length_spread=args.length_spread, repeats=args.repeats, rows=rows,
                  engines=stats)
    by = {(r["mode"], r["clients"]): r for r in rows}
    lines = [
        "# The serving engine's width choice, in-process (CPU)",
        "",
        f"`{h.command('width_choice.py', args, DEFAULTS)}` - {args.slots} slots, {args.requests_per_client} "
        f"requests per client one after another, {args.prompt_len}-token held-out prompts, "
        + (f"{args.max_tokens} new tokens" if not args.length_spread else
           f"{lengths.min()} - {lengths.max()} new tokens (max_tokens {args.max_tokens} x [1 - "
           f"{args.length_spread:g}, 1 + {args.length_spread:g}])")
        + f", greedy, every engine's tokens equal to plain's; {args.repeats} runs per point, in each every "
        "engine's clients served at once, one engine step each in turn (each engine's tokens/s over its own steps' "
        f"time). Load average (1 min) {h.load_span(rows)}. Tokens/s (median) and its ratio "
        "to plain (median of per-run ratios); in brackets, the share of rounds at width 4.",
        "",
        *h.table(["engine"] + [f"{c} client{'s' if c > 1 else ''}" for c in clients],
                 [[m] + [f"{by[m, c]['tokens_per_s']:.0f} ({by[m, c]['ratio']:.2f}x, "
                         f"{100 * by[m, c]['width4_share']:.0f}%)" for c in clients] for m in modes]),
        "",
        *([] if CONTROL not in modes else [
            "Against both plain engines (each run's tokens/s over the geometric mean of plain's and the control's; the "
            "control's ratio to plain above is the spread between two identical engines):",
            "",
            *h.table(["engine"] + [f"{c} client{'s' if c > 1 else ''}" for c in clients],
                     [[m] + [f"{by[m, c]['ratio_to_plain_pair']:.2f}x" for c in clients] for m in modes]),
            ""]),
        "Acceptance explorations and long-run acceptance: " + ", ".join(
            f"{m}: {s['acceptance_explores']} / {s['long_run_acceptance']:.3f}" for m, s in stats.items()),
    ]

    def draw(ax):
        x = np.arange(len(clients))
        for i, m in enumerate(modes):
            bar = 0.8 / len(modes)
            ax.bar(x + (i - (len(modes) - 1) / 2) * bar, [by[m, c]["ratio"] for c in clients], bar, label=m)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x, [str(c) for c in clients])
        ax.set_xlabel("clients")
        ax.set_ylabel("tokens/s over plain")
        ax.legend(fontsize=7)

    name = "width_choice_calls" if args.call_rounds else (
        "width_choice_spread" if args.length_spread else "width_choice")
    h.Report(args, name).write(result, lines, draw=draw, image="tokens/s over plain by engine and clients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
