"""plain vs width-1-only engines, client-driven admission; per-step split (admitting steps / others)."""
import os, sys, collections, time
import numpy as np
sys.path.insert(0, "benchmarks")
import harness as h
import dflash_jax
from dflash_jax.serve.engine import Engine
from dflash_jax.timing import paired_runs

C = int(os.environ.get("C", "16")); REPS = int(os.environ.get("REPS", "7")); N = 128
PER = int(os.environ.get("PER", "8")); SLOTS = int(os.environ.get("SLOTS", "32"))
pair = dflash_jax.load(None, dequantize_experts="auto")
pool = h.prompts(pair, C * PER, 64)
MODES = eval(os.environ.get("MODES", "{'plain': dict(block_size=1), 'w1': dict(block_size=4, widths=(1,))}"))
engines = {}
for m, kw in MODES.items():
    e = Engine(pair, slots=SLOTS, max_prompt_len=64, max_new_tokens=N, max_queue=4 * SLOTS, **kw)
    e.warmup([64]); engines[m] = e
split = {m: collections.Counter() for m in MODES}
def run(m):
    e = engines[m]
    reqs, todo, live = [], [pool[i % len(pool)] for i in range(PER * C)], []
    while todo or live:
        while todo and len(live) < C:
            live.append(e.submit(todo.pop(0), max_new_tokens=N)); reqs.append(live[-1])
        t = time.perf_counter(); info = e.step(); dt = time.perf_counter() - t
        k = "admit" if info.admitted else "round"
        split[m][k] += dt; split[m]["n_" + k] += 1; split[m]["rounds"] += info.rounds
        live = [r for r in live if r.finish_reason is None]
    return [r.tokens for r in reqs]
modes = {m: (lambda m=m: run(m)) for m in MODES}
outs = {m: f() for m, f in modes.items()}
assert all(o == outs["plain"] for o in outs.values())
for s in split.values(): s.clear()
t = paired_runs(modes, REPS)
for m in MODES:
    r = [b / a for a, b in zip(t.wall[m], t.wall["plain"])]
    print(f"C {C} {m}: wall {np.median(t.wall[m]):.3f}s speed vs plain {np.median(r):.3f} "
          f"({' '.join(f'{x:.2f}' for x in r)}) | " + ", ".join(f"{k} {v / REPS:.4g}" for k, v in sorted(split[m].items())),
          flush=True)
