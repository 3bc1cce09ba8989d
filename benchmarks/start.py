"""Server start: process start to a ready `/health`, `dflash-serve` in several modes beside vLLM's DFlash server.

  python benchmarks/start.py [--rounds 3] [--slots 32] [--prompt-len 128] [--max-new 128] [--no-vllm]
                             [--peers-venv DIR] [--out DIR | --write-docs] [--quick]

Each mode is a separate server process on the shipped pair, started by the same poll (`peers.start_server`:
`/health` every 50 ms) and stopped once ready. One untimed start of each mode first (it fills the compilation cache
and the stored programs where a change of the library emptied them), then `--rounds` rounds in which every mode
starts once, in turn, the order reversed every other round: a busy spell of the shared machine lands on every mode.
Modes:

  default                    `dflash-serve`'s default: widths 1 and 4 chosen per round (`--widths 1,B`, block 4);
                             the warm-up compiles, runs and times width 4, and width 1 is warmed after `/health`
  default, no prefetch       the same with DFLASH_PREFETCH_PROGRAMS=0: the warm-up's main thread reads every
                             compiled program itself (`dflash_jax.prefetch`)
  default, no stored         the same with DFLASH_STORED_PROGRAMS=0: every program traced and lowered again
                             (`dflash_jax.stored`)
  block 4                    `--widths fixed`: every round verifies 4 (the default before widths 1,4)
  plain                      `--block-size 1`
  widths auto                `--block-size 4 --widths auto`: widths 1, 2, 4 chosen per round (width 4 warmed before
                             `/health`, 1 and 2 after)
  vLLM k = 3                 vLLM's OpenAI server, the exported pair, DFlash with 3 speculative tokens (the venv
                             `benchmarks/peers.py` makes; skipped with --no-vllm)

Also timed, in fresh processes: `import jax` alone (its dtype extension, `ml_dtypes`, is a tenth of a start at some
versions). Every server holds the same slots and context. Writes start.{json,md,png} to --out (default bench_out/)
or, with --write-docs, docs/benchmarks/. --quick: plain and the default only, one round, 4 slots, no vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import harness as h
import peers

OURS = {
    "default": ([], {}),
    "default, no prefetch": ([], {"DFLASH_PREFETCH_PROGRAMS": "0"}),
    "default, no stored": ([], {"DFLASH_STORED_PROGRAMS": "0"}),
    "block 4": (["--widths", "fixed"], {}),
    "plain": (["--block-size", "1"], {}),
    "widths auto": (["--block-size", "4", "--widths", "auto"], {}),
}
VLLM_MODE = "vLLM k = 3"
DEFAULTS = dict(rounds=3, slots=32, prompt_len=128, max_new=128)
QUICK = dict(rounds=1, slots=4, no_vllm=True)


def build_parser():
    return h.parser(__doc__, {"--rounds": (3, "timed rounds (every mode starts once a round)"),
                              "--slots": (32, "server slots"),
                              "--prompt-len": (128, "longest prompt (ours: --max-prompt-len)"),
                              "--max-new": (128, "longest completion (ours: --max-new-tokens)"),
                              "--no-vllm": (False, "ours only (vLLM is not started)"),
                              "--peers-venv": (peers.DEFAULT_VENV, "the vLLM venv (created when missing)"),
                              "--torch-wheel": (None, "a CPU torch wheel (file or requirement) to install first"),
                              "--extra-index-url": (None, "an extra pip index for the CPU torch")})


def import_seconds(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = build_parser()
    args = h.parse(p, argv, quick=QUICK)
    log = h.logger("start")
    modes = dict(OURS) if not args.quick else {k: OURS[k] for k in ("default", "plain")}
    serve = os.path.join(os.path.dirname(sys.executable), "dflash-serve")
    base = [serve, "--model-name", "tiny", "--slots", str(args.slots), "--max-prompt-len", str(args.prompt_len),
            "--max-new-tokens", str(args.max_new), "--log-level", "warning"]
    commands = {name: (base + flags, dict(os.environ, **env) if env else None) for name, (flags, env) in modes.items()}
    with h.workdir(args, "dflash-start-") as work:
        if not args.no_vllm:
            vpy = peers.ensure_venv(args, log)
            target, draft = peers.export_pair(os.path.join(work, "pair"))
            spec = json.dumps({"method": "dflash", "model": draft, "num_speculative_tokens": 3})
            commands[VLLM_MODE] = ([vpy, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--dtype",
                                    "float32", "--served-model-name", "tiny", "--max-model-len",
                                    str(args.prompt_len + args.max_new), "--max-num-seqs", str(args.slots),
                                    "--speculative-config", spec],
                                   dict(peers.vllm_env(vpy), VLLM_ENABLE_V1_MULTIPROCESSING="1"))

        def start(name: str) -> dict:
            cmd, env = commands[name]
            port = peers.free_port()
            load = os.getloadavg()[0]
            proc, seconds = peers.start_server(cmd + ["--port", str(port)], env, port,
                                               os.path.join(work, f"{name.replace(' ', '_')}.log"))
            peers.stop_server(proc)
            log(f"{name}: {seconds:.2f} s (load {load:.1f})")
            return {"seconds": seconds, "load_1min": load}

        result = {"setup": {"slots": args.slots, "prompt_len": args.prompt_len, "max_new": args.max_new,
                            "rounds": args.rounds, "machine": h.machine(), "vllm": None if args.no_vllm else VLLM},
                  "first": {}, "rounds": [], "imports": {}}
        for name in commands:
            result["first"][name] = start(name)
        names = list(commands)
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            result["rounds"].append({name: start(name) for name in order})
        for module in ("ml_dtypes", "jax"):
            result["imports"][module] = min(import_seconds(module) for _ in range(3))
        import ml_dtypes

        result["setup"]["ml_dtypes"] = ml_dtypes.__version__
        result["setup"]["load_at_end"] = os.getloadavg()[0]
    write(args, result)
    return 0


VLLM = peers.VLLM


def write(args, result: dict) -> None:
    rounds = result["rounds"]
    names = list(rounds[0]) if rounds else []
    names = [n for n in list(OURS) + [VLLM_MODE] if n in names]
    s = result["setup"]
    lines = ["# Server start: process start to a ready `/health`", "",
             f"Written by `{h.command('start.py', args, DEFAULTS)}` (not in CI). The shipped pair, {s['slots']} slots, "
             f"prompts up to {s['prompt_len']} tokens, {s['max_new']} new tokens. Machine: {s['machine']['machine']}; "
             f"load {h.load_span([x for r in rounds for x in r.values()])} during the timed starts. One untimed "
             f"start of every mode first, then {s['rounds']} rounds of one start per mode (order reversed every "
             f"other round). ml_dtypes {s['ml_dtypes']}.", ""]
    vllm = VLLM_MODE in names
    header = ["mode", "first start (s)"] + [f"round {i + 1} (s)" for i in range(len(rounds))] + ["median (s)"]
    if vllm:
        header.append("/ vLLM, start by start")
    table = []
    for name in names:
        times = [r[name]["seconds"] for r in rounds]
        row = [name, f"{result['first'][name]['seconds']:.2f}"] + [f"{t:.2f}" for t in times]
        row.append(f"{sorted(times)[len(times) // 2]:.2f}")
        if vllm:
            ratios = [r[name]["seconds"] / r[VLLM_MODE]["seconds"] for r in rounds]
            row.append(" / ".join(f"{x:.2f}x" for x in ratios))
        table.append(row)
    lines += h.table(header, table)
    lines += ["", "Imports, fresh process, best of 3: "
              + ", ".join(f"`import {m}` {t:.2f} s" for m, t in result["imports"].items()) + "."]

    def draw(ax):
        for i, name in enumerate(names):
            ys = [r[name]["seconds"] for r in rounds]
            ax.scatter([i] * len(ys), ys, s=18)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("start to /health (s)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)

    h.Report(args, "start").write(result, lines, draw=draw, image="start times by mode", figsize=(9, 4))


if __name__ == "__main__":
    sys.exit(main())
