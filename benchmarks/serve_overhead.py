"""The server's overhead per token at one client: `dflash-serve` against the same engine driven in-process.

  python benchmarks/serve_overhead.py [--blocks 1,4] [--prompts 8] [--max-tokens 128] [--prompt-len 64]
                                      [--repeats 5] [--slots 4] [--baseline REV] [--quick] [--out DIR | --write-docs]

For each block size (1: plain decoding, no speculation; 4: DFlash, `dflash-serve`'s default) one app is built by
`dflash-serve`'s own builder (`cli.serve.build_app`, the same flags a user gives: `--block-size B --slots 4
--max-prompt-len P --max-new-tokens N`) and served by uvicorn on 127.0.0.1 in this process, with the settings
`dflash-serve` runs it with. Two ways to run the same prompts on that one engine (its thread started by the app's
lifespan, as when served):

  in-process   `Engine.submit` with an `on_tokens` callback that hands each round's ids to this thread through a
               queue (what a library user of the engine does); the server's own observers (its Prometheus metrics)
               are detached for these runs: the engine alone.
  served       one streaming completion per prompt from a client in another process (httpx, one keep-alive
               connection, Server-Sent Events parsed line by line, as the `openai` client does), greedy,
               `ignore_eos`: the tokens of each chunk's `token_ids`.

Paired by request (`timing.paired_runs`): each repeat runs one prompt in every mode back to back, the order
reversed every other repeat, `--repeats` passes over the prompts, so a busy spell of the shared machine lands on
both sides of a pair. Measured per run: wall seconds and this process's CPU seconds (the server's whole work; the
client's process is apart, its CPU reported beside) over the tokens produced: ms per token; the overhead is the
served run's ms per token less the in-process one's of the same repeat (median and quartiles). On Linux the process's
CPU time is also split by thread (per-thread CPU clocks): the engine's thread, the HTTP event loop, the text worker
threads, the caller, and XLA's threads (the rest). Both modes produce the same tokens for every prompt (checked).
`--baseline REV` serves the same engines a second time with the HTTP layer of git revision REV (its
serve/server.py and serve/metrics.py, loaded beside today's): a third mode, so a change to the server is measured
before / after in one paired run. `--slots 0` builds `dflash-serve`'s default capacity (slots and prompt length
fitted to memory; minutes of warm-up). Writes serve_overhead.{json,md} to --out (default bench_out/) or, with
--write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import socket
import sys
import threading
import time

import numpy as np

import harness as h


# ---- the client (its own process, as real clients are) ----------------------------------------------------------
def _client_main(conn) -> None:
    """Serves jobs from the benchmark: (base URL, [prompts], max_tokens) -> ([ids per prompt], CPU seconds)."""
    import httpx

    with httpx.Client(timeout=600) as http:
        while True:
            job = conn.recv()
            if job is None:
                return
            base, prompts, max_tokens = job
            c0, out = time.process_time(), []
            for prompt in prompts:
                ids: list[int] = []
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "stream": True, "ignore_eos": True}
                with http.stream("POST", base + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            ids += json.loads(line[6:])["choices"][0]["token_ids"]
                out.append(ids)
            conn.send((out, time.process_time() - c0))


class Client:
    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_client_main, args=(child,), daemon=True)
        self.proc.start()
        self.cpu = 0.0

    def run(self, base, prompts, max_tokens):
        self.conn.send((base, prompts, max_tokens))
        out, cpu = self.conn.recv()
        self.cpu = cpu
        return out

    def close(self):
        self.conn.send(None)
        self.proc.join(30)


# ---- the server (this process) ----------------------------------------------------------------------------------
def baseline_server(ref: str):
    """The HTTP layer of git revision `ref` (its serve/server.py, with its serve/metrics.py), loaded from `git show`
    as a module beside today's: the same engine served by both gives a paired before / after."""
    import subprocess
    import types

    def source(path):
        return subprocess.check_output(["git", "show", f"{ref}:{path}"], cwd=h.ROOT, text=True)

    metrics = types.ModuleType("baseline_metrics")
    exec(compile(source("dflash_jax/serve/metrics.py"), f"{ref}:metrics.py", "exec"), metrics.__dict__)
    text = source("dflash_jax/serve/server.py").replace("from dflash_jax.serve.metrics import Metrics\n", "")
    server = types.ModuleType("baseline_server")
    server.Metrics = metrics.Metrics
    exec(compile(text, f"{ref}:server.py", "exec"), server.__dict__)
    return server


def serve_app(app, name: str):
    """uvicorn serving `app` on a free port of 127.0.0.1 in a thread named `name`, as `dflash-serve` runs it."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=name)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


GROUPS = ("engine thread", "event loop", "text workers", "caller and other Python threads", "XLA's threads")


def group_of(name: str) -> str:
    if name == "dflash-engine":
        return "engine thread"
    if name.startswith("http-loop"):
        return "event loop"
    return "text workers" if name.startswith("dflash-text") else "caller and other Python threads"


def thread_cpu() -> dict:
    """{thread ident: (group, CPU seconds so far)} of this process's Python threads (Linux: each thread's CPU clock);
    {} where the platform has no per-thread clocks."""
    out = {}
    for t in threading.enumerate():
        try:
            out[t.ident] = (group_of(t.name), time.clock_gettime(time.pthread_getcpuclockid(t.ident)))
        except (AttributeError, OSError, TypeError):
            return {}
    return out


def cpu_by_group(before: dict, after: dict, total: float) -> dict:
    """CPU seconds by thread group between two `thread_cpu` readings; "XLA's threads": the process's CPU time
    `total` less its Python threads' (the threads XLA computes on)."""
    out = {g: 0.0 for g in GROUPS}
    if not after:
        return {}
    for ident, (group, secs) in after.items():
        out[group] += secs - before.get(ident, (group, 0.0))[1]
    out["XLA's threads"] = total - sum(out.values())
    return out


class Served:
    """One `dflash-serve` app of block size `block`, built by the CLI's builder and run by uvicorn in a thread; with
    `baseline` (a module from `baseline_server`) the same engine is also served by that revision's HTTP layer."""

    def __init__(self, block: int, args, baseline=None):
        from dflash_jax.cli import serve as cli
        from dflash_jax.cli.generate import load_tokenizer

        argv = ["--block-size", str(block), "--max-new-tokens", str(args.max_tokens)]
        if args.slots:  # else dflash-serve's default capacity: slots and prompt length fitted to memory
            argv += ["--slots", str(args.slots), "--max-prompt-len", str(args.prompt_len)]
        if args.checkpoint:
            argv += ["--checkpoint", args.checkpoint]
        self.flags = " ".join(argv)
        parsed = cli.build_parser().parse_args(argv)
        t = time.perf_counter()
        self.app, self.engine = cli.build_app(parsed)
        self.warm_s = time.perf_counter() - t
        self.observers = {"served": list(self.engine.observers)}  # each app's metrics observe the rounds it serves
        self.servers = {"served": serve_app(self.app, f"http-loop-served-{block}")}
        if baseline is not None:
            pair = self.engine.pair
            eos = tuple(t for t in pair.target_cfg.eos_token_ids if 0 <= t < pair.target_cfg.vocab_size)
            app = baseline.create_app(self.engine, load_tokenizer(pair), model_name="baseline", eos_ids=eos)
            self.observers["baseline"] = [o for o in self.engine.observers if o not in self.observers["served"]]
            self.servers["baseline"] = serve_app(app, f"http-loop-baseline-{block}")
        self.engine.observers[:] = []

    def base(self, which: str) -> str:
        return self.servers[which][2]

    def serve(self, which: str, client, prompts, max_tokens):
        """Every prompt streamed by `client` from the app `which` ("served", "baseline")."""
        self.engine.observers[:] = self.observers[which]
        try:
            return client.run(self.base(which), prompts, max_tokens)
        finally:
            self.engine.observers[:] = []

    def in_process(self, prompts, max_tokens):
        """Every prompt through `Engine.submit` on the running engine thread, its ids consumed here (no server
        observes these rounds: the engine alone)."""
        from dflash_jax.spec.sampling import SamplingParams

        out = []
        for prompt in prompts:
            q: queue.SimpleQueue = queue.SimpleQueue()
            self.engine.submit(prompt, max_new_tokens=max_tokens, sampling=SamplingParams(temperature=0.0),
                               on_tokens=lambda req, new: q.put(new), on_finish=lambda req: q.put(None))
            ids: list[int] = []
            while (new := q.get()) is not None:
                ids += new
            out.append(ids)
        return out

    def close(self):
        for server, thread, _ in self.servers.values():
            server.should_exit = True
            thread.join(60)


DEFAULTS = {"blocks": "1,4", "prompts": 8, "max_tokens": 128, "prompt_len": 64, "repeats": 5, "slots": 4,
            "baseline": None}


def main(argv=None) -> int:
    p = h.parser(__doc__, {
        "--slots": (4, "the engine's slots (--max-prompt-len: --prompt-len); 0: dflash-serve's default capacity "
                       "(slots and prompt length fitted to memory)"),
        "--baseline": (None, "a git revision: also serve the same engines with that revision's HTTP layer "
                             "(serve/server.py and serve/metrics.py), a paired before / after")},
        checkpoint=None, **{k: v for k, v in DEFAULTS.items() if k not in ("slots", "baseline")})
    args = h.parse(p, argv, quick=dict(prompts=2, max_tokens=16, prompt_len=16, repeats=1))
    blocks = h.int_list(p, args.blocks, "--blocks")

    from dflash_jax import compile_cache

    compile_cache.ensure_enabled()
    t_start = time.perf_counter()
    baseline = baseline_server(args.baseline) if args.baseline else None
    servers = {b: Served(b, args, baseline) for b in blocks}
    print("built: " + ", ".join(f"B={b} {s.warm_s:.0f}s" for b, s in servers.items()), flush=True)
    pair = servers[blocks[0]].engine.pair
    prompts = h.prompts(pair, args.prompts, args.prompt_len)
    client = Client()
    apps = ["served"] + (["baseline"] if baseline else [])
    label = {"served": "served", "baseline": f"served ({args.baseline})"}
    current = [0]  # the prompt of this repeat: every mode runs it, then the next repeat takes the next prompt

    def timed_by_thread(fn):
        def run():
            before, c0 = thread_cpu(), time.process_time()
            out = fn([prompts[current[0]]])
            return out[0], cpu_by_group(before, thread_cpu(), time.process_time() - c0)
        return run

    modes = {}
    for b, s in servers.items():
        modes[f"in-process B={b}"] = timed_by_thread(lambda ps, s=s: s.in_process(ps, args.max_tokens))
        for app in apps:
            modes[f"{label[app]} B={b}"] = timed_by_thread(
                lambda ps, s=s, app=app: s.serve(app, client, ps, args.max_tokens))
    outputs: dict = {m: {} for m in modes}  # mode -> prompt -> ids
    groups: dict = {m: [] for m in modes}  # mode -> [CPU seconds by thread group] per run
    client_cpu: dict = {m: [] for m in modes}
    for i in range(len(prompts)):  # one untimed pass of every prompt and mode: first requests, connections, caches
        current[0] = i
        for name, fn in modes.items():
            outputs[name][i] = fn()[0]

    wrong: dict = {m: [] for m in modes}  # mode -> [(prompt, tokens received, tokens expected)] of runs that differ

    def on_run(mode, rep, result):
        ids, by_group = result
        expected = outputs[f"in-process B={mode.rsplit('=', 1)[1]}"][current[0]]
        if ids != expected:
            wrong[mode].append((current[0], len(ids), len(expected)))
            print(f"{mode}: prompt {current[0]}: {len(ids)} tokens, not the engine's {len(expected)} "
                  f"({'a prefix' if ids == expected[:len(ids)] else 'different'})", flush=True)
        groups[mode].append(by_group)
        client_cpu[mode].append(client.cpu if mode.startswith("served") else 0.0)

    def on_repeat(rep, timings):
        current[0] = (rep + 1) % len(prompts)
        if (rep + 1) % len(prompts) == 0:
            print(f"pass {(rep + 1) // len(prompts)}: " + ", ".join(
                f"{m} {1e3 * sum(timings.wall[m][-len(prompts):]) / (len(prompts) * args.max_tokens):.2f}"
                for m in modes) + f" ms/token; load {h.load_average()[0]:.2f}", flush=True)

    # paired by prompt: each repeat runs one prompt in every mode back to back (order reversed every other
    # repeat), so a busy spell of the shared machine lands on every mode of a pair; `--repeats` passes of all
    current[0] = 0
    timings = h.paired_runs(modes, args.repeats * len(prompts), on_run=on_run, on_repeat=on_repeat)
    tokens = {m: [len(outputs[m][i % len(prompts)]) for i in range(args.repeats * len(prompts))] for m in modes}
    rows, result_blocks, breakdown = [], {}, []
    for b in blocks:
        ip = f"in-process B={b}"
        per = {"tokens_per_request": args.max_tokens}
        for app in apps:
            sv = f"{label[app]} B={b}"
            if app == "served":  # lossless: this server streams exactly the engine's tokens, every run
                assert outputs[sv] == outputs[ip] and not wrong[sv], f"{sv}: tokens differ from the engine's: {wrong[sv]}"
            per.setdefault("runs_with_other_tokens", {})[app] = wrong[sv]
            one = {}
            for clock in ("wall", "cpu"):
                x = 1e3 * timings.seconds(ip, clock) / np.asarray(tokens[ip])
                y = 1e3 * timings.seconds(sv, clock) / np.asarray(tokens[sv])
                d = y - x
                one[clock] = {"in_process_ms": round(float(np.median(x)), 3),
                              "served_ms": round(float(np.median(y)), 3), "overhead_ms": round(float(np.median(d)), 3),
                              "overhead_iqr_ms": [round(float(np.percentile(d, 25)), 3),
                                                  round(float(np.percentile(d, 75)), 3)]}
            one["client_cpu_ms"] = round(1e3 * float(np.median(np.asarray(client_cpu[sv]) / tokens[sv])), 3)
            per[app] = one
            w, c = one["wall"], one["cpu"]
            rows.append([f"{b}" + (" (plain)" if b == 1 else " (DFlash)"),
                         "this revision" if app == "served" else f"`{args.baseline}`", f"{w['in_process_ms']:.2f}",
                         f"{w['served_ms']:.2f}", f"**{w['overhead_ms']:.2f}** [{w['overhead_iqr_ms'][0]:.2f}, "
                         f"{w['overhead_iqr_ms'][1]:.2f}]", f"{c['in_process_ms']:.2f}", f"{c['served_ms']:.2f}",
                         f"**{c['overhead_ms']:.2f}** [{c['overhead_iqr_ms'][0]:.2f}, {c['overhead_iqr_ms'][1]:.2f}]",
                         f"{one['client_cpu_ms']:.2f}"])
        for m in [ip] + [f"{label[app]} B={b}" for app in apps]:
            if groups[m] and groups[m][0]:
                ms = {g: 1e3 * float(np.median([r[g] / n for r, n in zip(groups[m], tokens[m])])) for g in GROUPS}
                per.setdefault("cpu_ms_by_thread", {})[m] = {g: round(v, 3) for g, v in ms.items()}
                breakdown.append([m] + [f"{ms[g]:.3f}" for g in GROUPS])
        result_blocks[b] = per
    load = timings.load_summary()
    mach = h.machine()
    flags = servers[blocks[0]].flags.replace(f"--block-size {blocks[0]}", "--block-size B")
    result = {"benchmark": "serve_overhead", "blocks": result_blocks, "baseline": args.baseline, "load_avg_1m": load,
              "repeats": args.repeats, "prompts": args.prompts, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "flags": flags, "seconds": {"wall": timings.wall, "cpu": timings.cpu}, "machine": {k: mach[k] for k in ("platform", "cpus", "jax", "backend")},
              "total_s": round(time.perf_counter() - t_start, 1)}
    lines = [
        "# Server overhead per token at one client", "",
        f"`{h.command('serve_overhead.py', args, DEFAULTS)}` on the shipped pair, {mach['backend']} backend, "
        f"{mach['machine']}. One engine per block size, built by `dflash-serve`'s own builder (`{flags}`) and "
        "served by uvicorn on 127.0.0.1 in the benchmark's process; the same engine (its thread running) driven "
        "in-process through `Engine.submit`, the ids handed to the caller's thread by `on_tokens`. "
        + (f"The same engine is also served by the HTTP layer of `{args.baseline}` (its serve/server.py and "
           "serve/metrics.py), a paired before / after. " if baseline else "")
        + f"One client: {args.prompts} held-out prompts of {args.prompt_len} tokens, {args.max_tokens} new tokens "
        "each (greedy, `ignore_eos`), one after the other; served: streamed from a client in another process "
        f"(httpx, SSE). Paired by request: each run is one prompt in every mode back to back, the order reversed "
        f"every other run, {args.repeats} passes over the prompts ({args.repeats * args.prompts} runs per mode); ms "
        "per token: the median over runs; the overhead: served minus in-process in the same run (median [quartiles]). "
        "CPU: the server process's CPU time (engine, event loop, worker threads), the client's process apart. "
        "Every run of this revision's server streamed exactly the engine's tokens (checked)"
        + ("" if not baseline else "; " + (", ".join(
            f"{len(v)} of {len(timings.wall[m])} runs of {m} did not ({', '.join(f'{n} of {e} tokens' for _, n, e in v[:4])})"
            for m, v in wrong.items() if v) or f"so did every run of `{args.baseline}`'s"))
        + ". Load average (1 min, after each run) "
        f"{load['min']:.2f} / {load['median']:.2f} / {load['max']:.2f} (min / median / max) on a shared 2-core "
        "machine.", ""]
    lines += h.table(["block", "server", "in-process ms/token", "served ms/token", "overhead ms/token [IQR]",
                      "in-process CPU ms/token", "served CPU ms/token", "CPU overhead [IQR]",
                      "client CPU ms/token"], rows, align="llrrrrrrr")
    if breakdown:
        lines += ["", "Where the server process's CPU time goes, ms per token by thread (medians over the runs; Linux "
                  "per-thread CPU clocks): the engine's thread (rounds, emission, the server's metrics observer), "
                  "the HTTP event loop (request parsing, the stream: detokenizing, SSE framing, socket writes), the "
                  "text worker threads (tokenizing, the whole-text decodes), the caller (in-process: the thread "
                  "consuming the ids), XLA's compute threads (the rest of the process's CPU time):", ""]
        lines += h.table(["mode"] + list(GROUPS), breakdown, align="l" + "r" * len(GROUPS))
    client.close()
    for s in servers.values():
        s.close()
    h.Report(args, "serve_overhead").write(result, lines)
    print(json.dumps(result_blocks), f"load {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
