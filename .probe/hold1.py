"""plain engine vs block-B engine held at width 1: in-process, paired; per-phase time split."""
import os, sys, time, collections
import numpy as np
sys.path.insert(0, "benchmarks")
import harness as h
import dflash_jax
from dflash_jax.serve.engine import Engine, generate
from dflash_jax.timing import paired_runs

CLIENTS = [int(x) for x in os.environ.get("CLIENTS", "1,16").split(",")]
REPS = int(os.environ.get("REPS", "4"))
N = int(os.environ.get("N", "128"))
pair = dflash_jax.load(None, dequantize_experts="auto")
PER = int(os.environ.get("PER", "2"))
pool = h.prompts(pair, 64 * PER, 128)
MODES = eval(os.environ.get("MODES", "{'plain': dict(block_size=1), 'held4': dict(block_size=4, widths=(1,))}"))
for c in CLIENTS:
    engines = {}
    for m, kw in MODES.items():
        e = Engine(pair, slots=max(c, 2) if c > 1 else 1, max_prompt_len=256, max_new_tokens=N, **kw)
        e.warmup()
        engines[m] = e
    split = {m: collections.Counter() for m in MODES}
    def obs(m):
        def f(info):
            k = "admit" if info.admitted else ("round" if info.width else "other")
            split[m][k] += info.seconds
            split[m]["n_" + k] += 1
        return f
    for m, e in engines.items():
        e.observers.append(obs(m))
    def run(e):
        if c == 1:
            out = []
            for p in pool[:PER]:
                out += [r.tokens for r in generate(e, [p], max_new_tokens=N)]
            return out
        return [r.tokens for r in generate(e, pool[: PER * c], max_new_tokens=N)]
    modes = {m: (lambda e=e: run(e)) for m, e in engines.items()}
    outs = {m: f() for m, f in modes.items()}
    base = next(iter(outs.values()))
    assert all(o == base for o in outs.values()), "outputs differ"
    for s in split.values(): s.clear()
    t = paired_runs(modes, REPS)
    names = list(MODES)
    for m in names:
        r = [a / b for a, b in zip(t.wall[m], t.wall[names[0]])]
        print(f"clients {c} {m}: median {np.median(t.wall[m]):.3f}s ratio {np.median(r):.3f} "
              f"({' '.join(f'{x:.3f}' for x in r)}) split " +
              ", ".join(f"{k} {v / REPS:.3f}" for k, v in sorted(split[m].items())), flush=True)
