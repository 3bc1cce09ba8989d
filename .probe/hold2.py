"""in-process engines (one per mode, SLOTS slots) paired over client counts; ratio to plain."""
import os, sys, collections
import numpy as np
sys.path.insert(0, "benchmarks")
import harness as h
import dflash_jax
from dflash_jax.serve.engine import Engine, generate
from dflash_jax.timing import paired_runs

CLIENTS = [int(x) for x in os.environ.get("CLIENTS", "1,4,16,32").split(",")]
REPS = int(os.environ.get("REPS", "5"))
N = int(os.environ.get("N", "128"))
PER = int(os.environ.get("PER", "4"))
SLOTS = int(os.environ.get("SLOTS", "32"))
pair = dflash_jax.load(None, dequantize_experts="auto")
base = h.prompts(pair, 64, 64)
pool = [base[i % len(base)] for i in range(max(CLIENTS) * PER)]
MODES = eval(os.environ.get("MODES", "{'plain': dict(block_size=1), 'b4': dict(block_size=4), "
                                     "'w14': dict(block_size=4, widths=(1, 4))}"))
engines = {}
for m, kw in MODES.items():
    e = Engine(pair, slots=SLOTS, max_prompt_len=64, max_new_tokens=N, max_queue=4 * SLOTS, **kw)
    e.warmup([64])
    engines[m] = e
print("context rows", {m: e.context_rows for m, e in engines.items()}, flush=True)
for c in CLIENTS:
    def run(e):
        if c == 1:
            out = []
            for p in pool[:PER]:
                out += [r.tokens for r in generate(e, [p], max_new_tokens=N)]
            return out
        # c clients: c requests live at a time (a new one when one ends), PER per client
        reqs, todo = [], list(pool[: PER * c])
        live = []
        while todo or live:
            while todo and len(live) < c:
                live.append(e.submit(todo.pop(0), max_new_tokens=N))
                reqs.append(live[-1])
            e.step()
            live = [r for r in live if r.finish_reason is None]
        return [r.tokens for r in reqs]
    modes = {m: (lambda e=e: run(e)) for m, e in engines.items()}
    outs = {m: f() for m, f in modes.items()}
    base = outs["plain"]
    assert all(o == base for o in outs.values()), "outputs differ"
    before = {m: collections.Counter(e.width_rounds) for m, e in engines.items()}
    flushes = {m: e.context_flushes for m, e in engines.items()}
    t = paired_runs(modes, REPS)
    for m in MODES:
        r = [b / a for a, b in zip(t.wall[m], t.wall["plain"])]
        rc = [b / a for a, b in zip(t.cpu[m], t.cpu["plain"])]
        wr = collections.Counter(engines[m].width_rounds); wr.subtract(before[m])
        print(f"clients {c:2d} {m:6s}: tok/s {c * PER * N / np.median(t.wall[m]):7.0f}  speed vs plain wall "
              f"{np.median(r):.3f} ({min(r):.2f}-{max(r):.2f}) cpu {np.median(rc):.3f}  widths {dict(wr)} "
              f"flushes {engines[m].context_flushes - flushes[m]}", flush=True)
