"""The compiled CPU attention kernel (`cpu_kernels.kv_attention`) against XLA's dense and chunked paths.

  python benchmarks/cpu_attention.py [--rows 16] [--buffers 512,4096] [--clients 1,4,16] [--processes 1]
                                     [--repeats 30] [--quick] [--out DIR | --write-docs]

- **One attention call** at the shipped target's shapes (4 query heads, 2 KV heads of 32): `--rows` rows whose
  live lengths are drawn from 64 - 256, a decode step (T = 1) and a width-4 verify (T = 4), over cache buffers of
  `--buffers` slots: `nn.attention.kv_cache_attention` with the kernel, with XLA's dense path (every slot read) and
  with its chunked path (chunks of 256 up to the longest live row). Jitted, paired runs (`timing.paired_runs`),
  medians.
- **Served, in-process**: the engines of `width_choice.py` (plain, the default widths 1 and 4, block 4; 32 slots,
  64-token prompts, 64 - 192 new tokens, 6 requests per client one after another, greedy) at `--clients`, in a
  child process per setting (the attention path is chosen when a program is traced: one process each), the
  settings alternating `--processes` times; tokens/s over each engine's own steps' time (medians of 3 runs) and
  every engine's tokens checked equal across both settings.

Writes cpu_attention.{json,md,png} to --out (default bench_out/) or, with --write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import numpy as np

import harness as h

DEFAULTS = dict(rows=16, buffers="512,4096", clients="1,4,16", processes=1, repeats=30)
QUICK = dict(rows=2, buffers="512", clients="1", repeats=3)
SETTINGS = ("kernel", "xla")
TUNINGS = {"kernel": {}, "kernel, cut": {"in_place": False}, "xla": {"kernel": False}}  # AttentionTuning fields


def _calls(args, buffers, log):
    import jax
    import jax.numpy as jnp

    from dflash_jax.nn.attention import AttentionTuning, kv_cache_attention
    from dflash_jax.timing import paired_runs
    from pallas_kernels import cpu_kernels

    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels could not be built here (a C++ compiler is needed)")
    tunings = {"kernel": AttentionTuning(), "xla dense": AttentionTuning(kernel=False, dense_max_rows=None),
               "xla chunked": AttentionTuning(kernel=False, dense_max_rows=0)}
    rng = np.random.default_rng(0)
    out = []
    for buffer in buffers:
        for t in (1, 4):
            lengths = jnp.asarray(rng.integers(64, 257, args.rows), jnp.int32)
            q = jnp.asarray(rng.standard_normal((args.rows, t, 4, 32)), jnp.float32)
            k, v = (jnp.asarray(rng.standard_normal((args.rows, 2, buffer, 32)), jnp.float32) for _ in range(2))
            positions = lengths[:, None] - t + jnp.arange(t)[None]
            fns = {name: jax.jit(lambda q_, k_, v_, tu=tu: kv_cache_attention(q_, k_, v_, positions, lengths,
                                                                               scale=32 ** -0.5, tuning=tu))
                   for name, tu in tunings.items()}
            ref = np.asarray(fns["xla dense"](q, k, v))
            for fn in fns.values():
                np.testing.assert_allclose(np.asarray(fn(q, k, v)), ref, rtol=1e-5, atol=2e-6)
            timings = paired_runs({n: (lambda fn=fn: fn(q, k, v).block_until_ready()) for n, fn in fns.items()},
                                  args.repeats)
            us = {n: float(np.median(timings.seconds(n))) * 1e6 for n in fns}
            log(f"buffer {buffer}, T = {t}: " + ", ".join(f"{n} {x:.1f} us" for n, x in us.items()))
            out.append(dict(buffer=buffer, t=t, us=us))
    return out


def _child(setting: str, clients: list[int]) -> dict:
    """One process's served runs under `setting` (`TUNINGS`: the engines traced under it)."""
    import dflash_jax
    from dflash_jax.nn.attention import AttentionTuning, set_attention_tuning
    from dflash_jax.serve.engine import Engine
    from width_choice import serve

    set_attention_tuning(AttentionTuning(**TUNINGS[setting]))
    pair = dflash_jax.load(None, dequantize_experts="auto")
    pool = h.prompts(pair, 192, 64)
    draws = np.random.default_rng(0).uniform(0.5, 1.5, (max(clients), 6))
    lengths = np.maximum(1, np.rint(128 * draws)).astype(int)
    kw = dict(slots=32, max_prompt_len=128, max_new_tokens=int(lengths.max()))
    modes = {"plain": dict(block_size=1), "default (widths 1, 4)": dict(block_size=4, widths=(1, 4)),
             "block 4": dict(block_size=4)}
    engines = {name: Engine(pair, **kw, **m) for name, m in modes.items()}
    for e in engines.values():
        e.warmup()
    order, result = list(engines), {}
    for c in clients:
        def budget(cl, i):
            return int(lengths[cl, i])
        first = serve(engines, order, pool, c, 6, budget, {m: collections.Counter() for m in engines})
        rates = collections.defaultdict(list)
        for r in range(3):
            got = serve(engines, order if r % 2 == 0 else order[::-1], pool, c, 6, budget,
                        {m: collections.Counter() for m in engines})
            for name, (rate, _) in got.items():
                rates[name].append(rate)
        result[str(c)] = {name: dict(rate=float(np.median(rates[name])),
                                     outputs=repr(sorted(first[name][1].items()))) for name in engines}
    return result


def served_settings(settings, clients: list[int], processes: int, log) -> list[dict]:
    """The served engines of `_child` under each of `settings` (two: `TUNINGS` keys), a child process per setting,
    alternating `processes` times. Rows: clients, engine, each setting's median tokens/s, the first over the second.
    Exits when any engine's tokens differ between the settings."""
    served = {s: [] for s in settings}
    for i in range(processes):
        for setting in (settings if i % 2 == 0 else settings[::-1]):
            log(f"served, {setting} (process {i + 1} of {processes}) ...")
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", setting,
                                   ",".join(map(str, clients))], capture_output=True, text=True,
                                  cwd=os.path.dirname(os.path.abspath(__file__)))
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if done.returncode != 0 or line is None:
                raise SystemExit(f"the {setting} child failed:\n{done.stderr[-3000:]}")
            served[setting].append(json.loads(line[len("RESULT "):]))
    first, second = settings
    rows, same = [], True
    for c in clients:
        for m in served[first][0][str(c)]:
            got = {s: float(np.median([run[str(c)][m]["rate"] for run in served[s]])) for s in settings}
            same &= len({run[str(c)][m]["outputs"] for s in settings for run in served[s]}) == 1
            rows.append(dict(clients=c, mode=m, **got, ratio=got[first] / got[second]))
            log(f"{c} clients, {m}: {first} {got[first]:.0f} tok/s, {second} {got[second]:.0f} "
                f"({rows[-1]['ratio']:.2f}x)")
    if not same:
        raise SystemExit(f"served tokens differ between {first} and {second}")
    return rows


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(_child(sys.argv[2], [int(c) for c in sys.argv[3].split(",")])), flush=True)
        return 0
    d = DEFAULTS
    p = h.parser(__doc__, {"--rows": d["rows"], "--buffers": d["buffers"], "--clients": d["clients"],
                           "--processes": d["processes"]}, repeats=d["repeats"])
    args = h.parse(p, argv, quick=QUICK)
    clients = h.int_list(p, args.clients, "--clients")
    buffers = h.int_list(p, args.buffers, "--buffers")
    if args.processes < 1:
        p.error("--processes must be >= 1")
    log = h.logger("cpu_attention")
    from dflash_jax.timing import load_average

    loads = [(load_average() or (0.0,))[0]]
    calls = _calls(args, buffers, log)
    rows = served_settings(SETTINGS, clients, args.processes, log)
    loads.append((load_average() or (0.0,))[0])
    result = dict(benchmark="cpu_attention", machine=h.machine(), rows=args.rows, calls=calls, served=rows,
                  processes=args.processes, load_range=[min(loads), max(loads)])
    lines = [
        "# The CPU attention kernel against XLA's attention (CPU)",
        "",
        f"`{h.command('cpu_attention.py', args, DEFAULTS)}` - {result['machine']['cpu']}, the kernels' vector path "
        f"{result['machine']['simd']}; load average (1 min) {min(loads):.1f} - {max(loads):.1f}. Method: the script's "
        "docstring.",
        "",
        f"One `kv_cache_attention` call, {args.rows} rows of live lengths 64 - 256, 4 query heads over 2 KV heads of "
        f"32 (us, medians of {args.repeats} paired runs):",
        "",
        *h.table(["buffer slots", "T", *calls[0]["us"], "dense / kernel"],
                 [[str(c["buffer"]), str(c["t"]), *(f"{x:.1f}" for x in c["us"].values()),
                   f"{c['us']['xla dense'] / c['us']['kernel']:.1f}x"] for c in calls]),
        "",
        f"Served in-process (tokens/s, medians; {args.processes} process(es) per setting, alternating); every "
        "engine's tokens equal under both settings:",
        "",
        *h.table(["clients", "engine", "kernel", "XLA", "kernel / XLA"],
                 [[str(r["clients"]), r["mode"], f"{r['kernel']:.0f}", f"{r['xla']:.0f}", f"{r['ratio']:.2f}x"]
                  for r in rows]),
    ]

    def draw(axes):
        left, right = axes
        x = np.arange(len(calls))
        for i, name in enumerate(calls[0]["us"]):
            left.bar(x + 0.27 * (i - 1), [c["us"][name] for c in calls], 0.27, label=name)
        left.set_xticks(x, [f"S={c['buffer']}\nT={c['t']}" for c in calls])
        left.set_ylabel("us per call")
        left.set_yscale("log")
        left.legend(fontsize=7)
        x = np.arange(len(rows))
        right.bar(x, [r["ratio"] for r in rows])
        right.axhline(1.0, color="k", lw=0.8)
        right.set_xticks(x, [f"{r['clients']}c\n{r['mode'].split(' (')[0]}" for r in rows], fontsize=7)
        right.set_ylabel("served tokens/s, kernel / XLA")

    h.Report(args, "cpu_attention").write(result, lines, draw=draw, ncols=2, figsize=(12, 3.8),
                                          image="attention call times and served tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
