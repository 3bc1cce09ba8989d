"""Serving rounds on the whole KV buffers (`ResidentRunner.in_place`) against rounds that cut their rows out.

  python benchmarks/kv_in_place.py [--clients 1,4,16,32] [--processes 1] [--profile-clients 16] [--quick]
                                   [--out DIR | --write-docs]

Where attention reads each row's keys where they lie (the CPU kernel, `nn.attention.reads_in_place`), a round of the
first `rows` rows of the engine's slots computes on the whole cache buffers and writes its new keys into them in
place. Before, each call copied those rows of every KV buffer out (and a length bucket of their slots), and wrote
them back after: `AttentionTuning(in_place=False)`, the same kernel over the cut copies.

- **Served, in-process**: the engines of `cpu_attention.py` (plain, the default widths 1 and 4, block 4; 32 slots,
  64-token prompts, 64 - 192 new tokens, 6 requests per client one after another, greedy; lanes as the engine
  chooses) at `--clients`, in a child process per setting (the setting is read when a program is traced), the
  settings alternating `--processes` times; tokens/s over each engine's own steps' time (medians of 3 runs), every
  engine's tokens checked equal across the settings.
- **Where the time goes**: one engine per mode with one lane at `--profile-clients` clients, its runner switched
  between the two settings in one process (`ResidentRunner.in_place`), a whole served run under `jax.profiler`;
  XLA op time per committed token, by op kind (the largest kinds), the same tokens checked.

Writes kv_in_place.{json,md,png} to --out (default bench_out/) or, with --write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import tempfile

import numpy as np

import harness as h
from cpu_attention import served_settings

DEFAULTS = dict(clients="1,4,16,32", processes=1, profile_clients=16)
QUICK = dict(clients="1", profile_clients=2)
SETTINGS = ("kernel", "kernel, cut")  # `cpu_attention.TUNINGS`: in place, and cut rows
PROFILE_MODES = {"plain": dict(block_size=1), "block 4": dict(block_size=4)}
TOP_KINDS = 8


def _op_times(trace_dir: str) -> collections.Counter:
    """Microseconds of XLA op time by op kind (the op's name up to its first dot) in a `jax.profiler` trace."""
    path = glob.glob(trace_dir + "/**/*.trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    out = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and "hlo_op" in e.get("args", {}):
            out[e["name"].split(".")[0]] += e["dur"]
    return out


def _profile(clients: int, log) -> list[dict]:
    import jax

    import dflash_jax
    from dflash_jax.serve.engine import Engine, generate
    from dflash_jax.spec import SamplingParams

    pair = dflash_jax.load(None, dequantize_experts="auto")
    prompts = h.prompts(pair, clients, 64)
    rows = []
    for mode, kw in PROFILE_MODES.items():
        eng = Engine(pair, slots=32, max_prompt_len=128, max_new_tokens=160, lanes=1, **kw)
        eng.warmup()
        got = {}
        for in_place in (True, False):
            eng.runner.in_place = in_place
            generate(eng, prompts, max_new_tokens=160, sampling=SamplingParams())  # each setting's programs warm
            with tempfile.TemporaryDirectory() as d:
                with jax.profiler.trace(d, create_perfetto_trace=True):
                    reqs = generate(eng, prompts, max_new_tokens=160, sampling=SamplingParams())
                times = _op_times(d)
            tokens = sum(len(r.tokens) for r in reqs)
            got[in_place] = (times, tokens, [r.tokens for r in reqs])
            log(f"profile {mode}, in place {in_place}: {sum(times.values()) / tokens:.1f} us of ops a token")
        if got[True][2] != got[False][2]:
            raise SystemExit(f"profile {mode}: the tokens differ between the settings")
        for in_place, (times, tokens, _) in got.items():
            rows.append(dict(mode=mode, setting=SETTINGS[0] if in_place else SETTINGS[1], clients=clients,
                             tokens=tokens, total_us=sum(times.values()) / tokens,
                             us_per_token={k: v / tokens for k, v in times.items()}))
    return rows


def _top_kinds(profile: list[dict]) -> list[str]:
    """The `TOP_KINDS` op kinds of most time over all the profiled runs."""
    total = collections.Counter()
    for r in profile:
        total.update(r["us_per_token"])
    return [k for k, _ in total.most_common(TOP_KINDS)]


def main(argv=None) -> int:
    d = DEFAULTS
    p = h.parser(__doc__, {"--clients": d["clients"], "--processes": d["processes"],
                           "--profile-clients": d["profile_clients"]})
    args = h.parse(p, argv, quick=QUICK)
    clients = h.int_list(p, args.clients, "--clients")
    if args.processes < 1:
        p.error("--processes must be >= 1")
    if args.profile_clients < 1:
        p.error("--profile-clients must be >= 1")
    log = h.logger("kv_in_place")
    from pallas_kernels import cpu_kernels

    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels could not be built here (a C++ compiler is needed)")
    loads = [h.load_average()[0] if h.load_average() else 0.0]
    served = served_settings(SETTINGS, clients, args.processes, log)
    profile = _profile(args.profile_clients, log)
    loads.append(h.load_average()[0] if h.load_average() else 0.0)
    result = dict(benchmark="kv_in_place", machine=h.machine(), served=served, profile=profile,
                  processes=args.processes, load_range=[min(loads), max(loads)])
    kinds = _top_kinds(profile)
    lines = [
        "# Serving rounds on the whole KV buffers against cut rows (CPU)",
        "",
        f"`{h.command('kv_in_place.py', args, DEFAULTS)}` - load average (1 min) {min(loads):.1f} - "
        f"{max(loads):.1f}. Method: the script's docstring. In place: `ResidentRunner.in_place` (the default where "
        "the CPU kernel reads the cache); cut: `AttentionTuning(in_place=False)`, the same kernel over each call's "
        "cut rows.",
        "",
        f"Served in-process (tokens/s, medians; {args.processes} process(es) per setting, alternating); every "
        "engine's tokens equal under both settings:",
        "",
        *h.table(["clients", "engine", "in place", "cut", "in place / cut"],
                 [[str(r["clients"]), r["mode"], f"{r[SETTINGS[0]]:.0f}", f"{r[SETTINGS[1]]:.0f}",
                   f"{r['ratio']:.2f}x"] for r in served]),
        "",
        f"XLA op time per committed token (us) at {args.profile_clients} clients, one lane, under `jax.profiler` "
        "(the same tokens under both settings):",
        "",
        *h.table(["engine", "setting", "total", *kinds, "other"],
                 [[r["mode"], "in place" if r["setting"] == SETTINGS[0] else "cut", f"{r['total_us']:.1f}",
                   *(f"{r['us_per_token'].get(k, 0.0):.1f}" for k in kinds),
                   f"{r['total_us'] - sum(r['us_per_token'].get(k, 0.0) for k in kinds):.1f}"] for r in profile]),
    ]

    def draw(axes):
        left, right = axes
        x = np.arange(len(served))
        left.bar(x, [r["ratio"] for r in served])
        left.axhline(1.0, color="k", lw=0.8)
        left.set_xticks(x, [f"{r['clients']}c\n{r['mode'].split(' (')[0]}" for r in served], fontsize=7)
        left.set_ylabel("served tokens/s, in place / cut")
        labels = [f"{r['mode']}\n{'in place' if r['setting'] == SETTINGS[0] else 'cut'}" for r in profile]
        bottom = np.zeros(len(profile))
        for k in kinds:
            v = np.array([r["us_per_token"].get(k, 0.0) for r in profile])
            right.bar(labels, v, bottom=bottom, label=k)
            bottom += v
        right.set_ylabel("XLA op time, us per token")
        right.legend(fontsize=6)
        right.tick_params(axis="x", labelsize=7)

    h.Report(args, "kv_in_place").write(result, lines, draw=draw, ncols=2, figsize=(12, 3.8),
                                        image="served tokens/s ratio and op time per token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
