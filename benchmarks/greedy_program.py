"""What the greedy rows' program saves: the same greedy generation with and without `SpecConfig.greedy_only`.

  python benchmarks/greedy_program.py [--pair NAME] [--blocks 1,8] [--prompts 6] [--prompt-len 128] [--max-new 128]
                                      [--repeats 3] [--threads one|all] [--quick] [--out DIR | --write-docs]

A batch whose every row is greedy runs a program without the sampling work where the platform runs a conditional
from the host (a GPU: `spec.sampling.specialize_greedy`); the general program skips that work at run time with two
conditionals a round, each a predicate the host copies back and waits for on a GPU, between CUDA graphs. This runs
`spec.generate` (batch 1, the jitted loop) at each block size both ways (`spec.sampling.greedy_programs(True)` /
`(False)`), paired and interleaved per prompt (`harness.paired_items`), every output checked equal. On a CPU the
two programs differ by the conditionals alone (a conditional costs next to nothing there): the ratio is a control
near 1.0x; on a GPU it is the program's gain. Writes greedy_program.{json,md,png} to --out (default bench_out/) or,
with --write-docs, to docs/benchmarks/ (named greedy_program_<backend>_<pair>).
"""

from __future__ import annotations

import functools

import harness as h

DEFAULTS = dict(prompts=6, prompt_len=128, max_new=128, repeats=3, threads="one")


def main(argv=None) -> int:
    p = h.parser(__doc__, {"--blocks": "1,8"}, pair=None, checkpoint=None, **DEFAULTS)
    args = h.parse(p, argv, quick=dict(prompts=1, prompt_len=32, max_new=8, repeats=1, blocks="1,4"))
    blocks = h.int_list(p, args.blocks, "--blocks")

    import jax

    from dflash_jax.spec import generate
    from dflash_jax.spec.sampling import greedy_programs

    pair = h.load_pair(args, dequantize_experts="auto")  # as dflash-generate places them
    prompts = h.prompts(pair, args.prompts, args.prompt_len)
    n = args.max_new
    log = h.logger("greedy_program")

    def run(prompt, block, greedy):
        with greedy_programs(greedy):
            return generate(pair, [prompt], max_new_tokens=n, block_size=block)

    modes = {(b, g): functools.partial(run, block=b, greedy=g) for b in blocks for g in (False, True)}
    names = {m: f"B={m[0]} {'greedy' if m[1] else 'general'}" for m in modes}
    for fn in modes.values():  # every program compiled before any timing
        fn(prompts[0])
    reference = names[(blocks[0], False)]
    outputs = h.Outputs(reference, key=lambda r: r.tokens[0])
    times = h.paired_items(prompts, lambda prompt: {names[m]: functools.partial(fn, prompt) for m, fn in modes.items()},
                           args.repeats, outputs=outputs, alternate=True,
                           log=lambda i, prompt, t: log(f"prompt {i + 1}/{len(prompts)}"))
    tokens = len(prompts) * n
    rows = []
    for b in blocks:
        general, greedy = names[(b, False)], names[(b, True)]
        rows.append({
            "block_size": b,
            "general_tok_s": round(h.rate(times, general, tokens), 1),
            "greedy_tok_s": round(h.rate(times, greedy, tokens), 1),
            "speedup_wall_best": round(h.rate(times, greedy, tokens) / h.rate(times, general, tokens), 3),
            "speedup_wall_median": round(h.rate(times, greedy, tokens, statistic="median")
                                         / h.rate(times, general, tokens, statistic="median"), 3),
            "speedup_cpu_median": round(h.rate(times, greedy, tokens, "cpu", "median")
                                        / h.rate(times, general, tokens, "cpu", "median"), 3),
            "same_tokens": bool(outputs.lossless.get(greedy, False) and outputs.lossless.get(general, False)),
        })
    backend = jax.default_backend()
    result = {"machine": h.machine(), "backend": backend, "devices": [str(d) for d in jax.devices()],
              "pair": args.pair or "tiny_pair",
              "command": h.command("greedy_program.py", args, dict(blocks="1,8", pair=None, **DEFAULTS)),
              "prompts": len(prompts), "prompt_len": args.prompt_len, "max_new": n, "repeats": args.repeats,
              "by_block_size": rows}
    lines = [f"# The greedy rows' program against the general one ({backend})", "",
             f"`{result['command']}` - {result['pair']}, batch 1, {len(prompts)} held-out prompts of "
             f"{args.prompt_len} tokens, {n} new tokens, greedy, the jitted loop, experts as `dflash_jax.load` "
             "places them (dequantized at load on a CPU, FP4 through the kernel on a GPU); "
             f"{args.repeats} paired runs per "
             f"prompt, interleaved; {result['machine']['machine']} ({result['machine']['cpu']}), backend {backend}"
             + (", XLA's CPU runtime on one thread" if backend == "cpu" and args.threads == "one" else "")
             + ". Tokens/s: prompts x new tokens over the sum of each prompt's best run; speedup: the greedy "
             "program's tokens/s over the general program's.", ""]
    lines += h.table(["block", "general tok/s", "greedy tok/s", "speedup (wall, best)", "speedup (wall, median)",
                      "speedup (CPU, median)", "same tokens"],
                     [[r["block_size"], r["general_tok_s"], r["greedy_tok_s"], f"{r['speedup_wall_best']:.3f}x",
                       f"{r['speedup_wall_median']:.3f}x", f"{r['speedup_cpu_median']:.3f}x",
                       "yes" if r["same_tokens"] else "NO"] for r in rows])

    def draw(ax):
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["general_tok_s"] for r in rows], width=0.4, label="general program")
        ax.bar([x + 0.2 for x in xs], [r["greedy_tok_s"] for r in rows], width=0.4, label="greedy rows' program")
        ax.set_xticks(list(xs), [f"block {r['block_size']}" for r in rows])
        ax.set_ylabel("tokens/s (best)")
        ax.set_title(f"{result['pair']} on {backend}")
        ax.legend()

    stem = "greedy_program" + (f"_{backend}_{result['pair']}" if args.write_docs else "")
    h.Report(args, stem).write(result, lines, draw=draw, image="tokens/s by program", figsize=(6, 3.6))
    if not all(r["same_tokens"] for r in rows):
        raise SystemExit("the two programs decoded different tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
