import os, sys, cProfile, pstats, io, time
sys.path.insert(0, "benchmarks")
import harness as h
import dflash_jax
from dflash_jax.serve.engine import Engine
C = int(os.environ.get("C", "16")); N = 128; PER = 8
pair = dflash_jax.load(None, dequantize_experts="auto")
base = h.prompts(pair, 64, 64)
MODES = {'plain': dict(block_size=1), 'w14': dict(block_size=4, widths=(1, 4)), 'w1': dict(block_size=4, widths=(1,))}
engines = {}
for m, kw in MODES.items():
    e = Engine(pair, slots=32, max_prompt_len=64, max_new_tokens=N, max_queue=128, **kw); e.warmup([64]); engines[m] = e
def run(e):
    todo, live = [base[i % len(base)] for i in range(PER * C)], []
    steps = 0
    while todo or live:
        while todo and len(live) < C:
            live.append(e.submit(todo.pop(0), max_new_tokens=N))
        e.step(); steps += 1
        live = [r for r in live if r.finish_reason is None]
    return steps
for m, e in engines.items():
    run(e)
for rep in range(2):
    for m, e in engines.items():
        pr = cProfile.Profile(); t = time.perf_counter(); pr.enable(); steps = run(e); pr.disable()
        dt = time.perf_counter() - t
        if rep == 1:
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
            print(f"==== {m}: {dt:.3f}s steps {steps}"); print("\n".join(s.getvalue().splitlines()[6:24]))
