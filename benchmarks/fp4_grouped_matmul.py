"""Benchmark: Pallas FP4 grouped matmul vs the XLA path at verify widths.

    python benchmarks/fp4_grouped_matmul.py            # full run (GPU): writes bench_out/ (--write-docs: docs/benchmarks/)
    python benchmarks/fp4_grouped_matmul.py --quick    # fewer widths / formats / repetitions
    python benchmarks/fp4_grouped_matmul.py --tiny --interpret --quick   # CPU smoke run
    python benchmarks/fp4_grouped_matmul.py --expert-policy   # plain decoding, FP4 vs dequantized at load

For each model's expert shapes (gate_up `[E, 2I, H]`, down `[E, H, I]`, FP4 `[out, in]`), format and
verify width T (tokens), a random top-k routing gives M = T*k rows. Reported per case:

  * routed experts and routed bytes: FP4 codes + block scales of the experts with rows (what the
    kernel must read);
  * Pallas time per call and effective bandwidth = routed bytes / time, as a fraction of the measured
    HBM copy bandwidth (read + write bytes / time of a large device-to-device copy);
  * the XLA path's time (`ops.grouped_matmul(implementation="xla")`: dequantize the pool, ragged_dot)
    and the speedup.

Timing: each jitted call runs the op on `--layers` distinct weight pools (as a forward would run
consecutive layers) so the routed bytes come from HBM rather than L2 and dispatch cost is amortized;
the Pallas and XLA calls alternate (`timing.paired_runs`), the median of `--reps` calls is divided by the
layer count. Weights are random FP4 bytes with realistic
scale ranges, generated on the device (no quantization of huge float tables).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import harness as h
from dflash_jax.quant import MXFP4Tensor, NVFP4Tensor
from pallas_kernels import fp4_grouped_matmul as fgm
from pallas_kernels import ops


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int


MODELS = {
    "qwen3-30b-a3b": ModelShapes("Qwen3-30B-A3B", hidden=2048, intermediate=768, experts=128, top_k=8),
    "gpt-oss-120b": ModelShapes("gpt-oss-120b", hidden=2880, intermediate=2880, experts=128, top_k=4),
}
TINY = {
    "qwen3-30b-a3b": ModelShapes("Qwen3-30B-A3B (tiny)", hidden=128, intermediate=64, experts=16, top_k=8),
    "gpt-oss-120b": ModelShapes("gpt-oss-120b (tiny)", hidden=96, intermediate=96, experts=16, top_k=4),
}


def random_pool(key, fmt: str, e: int, n: int, k: int):
    """A random FP4 pool of logical shape [e, n, k] with realistic scales (|w| ~ 1e-2)."""
    kb, ks = jax.random.split(key)
    if fmt == "mxfp4":
        blocks = jax.random.bits(kb, (e, n, k // 32, 16), jnp.uint8)
        scales = jax.random.randint(ks, (e, n, k // 32), 118, 123).astype(jnp.uint8)  # 2^-9 .. 2^-5
        return MXFP4Tensor(blocks, scales)
    packed = jax.random.bits(kb, (e, n, k // 2), jnp.uint8)
    # E4M3 bytes 0x30..0x5F: 0.25 .. 15 (finite), tensor scale per expert
    bs = jax.lax.bitcast_convert_type(
        jax.random.randint(ks, (e, n, k // 16), 0x30, 0x60).astype(jnp.uint8), jnp.float8_e4m3fn
    )
    return NVFP4Tensor(packed, bs, jnp.full((e,), 2e-3, jnp.float32))


def random_routing(rng: np.random.Generator, tokens: int, e: int, k: int) -> np.ndarray:
    """Group sizes of a uniform random top-k routing (k distinct experts per token)."""
    experts = np.stack([rng.permutation(e)[:k] for _ in range(tokens)])
    return np.bincount(experts.reshape(-1), minlength=e).astype(np.int32)


def time_calls(calls: dict, reps: int) -> tuple[dict, dict]:
    """({name: median wall seconds}, {name: output}) of the calls (name -> (fn, args)), compiled and warmed up
    first, then timed interleaved (`harness.paired_runs`)."""
    runs = {name: (lambda fn=fn, args=args: jax.block_until_ready(fn(*args))) for name, (fn, args) in calls.items()}
    outs = {name: run() for name, run in runs.items()}
    for run in runs.values():
        run()
    t = h.paired_runs(runs, reps)
    return {name: t.stat(name, "wall", "median") for name in runs}, outs


def copy_bandwidth(nbytes: int, reps: int) -> float:
    """HBM copy bandwidth (bytes read + written per second) of a large device-to-device copy."""
    a = jnp.zeros((nbytes // 4,), jnp.uint32)
    fn = jax.jit(lambda a: a ^ jnp.uint32(1))  # a real read + write (a plain copy may be elided)
    return 2 * a.nbytes / time_calls({"copy": (fn, (a,))}, reps)[0]["copy"]


def layered(impl: str, interpret: bool | None):
    """jit of `[op(x_l, w_l, gs_l) for l in layers]`: one dispatch, distinct weights per layer."""

    def op(x, w, gs):
        if impl == "pallas":
            return fgm.fp4_grouped_matmul(x, w, gs, interpret=interpret)
        return ops.grouped_matmul(x, w, gs, implementation="xla")

    return jax.jit(lambda xs, ws, gss: [op(x, w, g) for x, w, g in zip(xs, ws, gss)])


def run(args) -> dict:
    backend = jax.default_backend()
    models = TINY if args.tiny else MODELS
    interpret = True if args.interpret else None
    rng = np.random.default_rng(args.seed)
    key = jax.random.PRNGKey(args.seed)
    copy_bytes = (64 << 20) if args.tiny else (2 << 30)
    hbm = copy_bandwidth(copy_bytes, args.reps)
    results = []
    for model_key in args.models:
        ms = models[model_key]
        projections = {
            "gate_up": (2 * ms.intermediate, ms.hidden),  # (N, K)
            "down": (ms.hidden, ms.intermediate),
        }
        for fmt in args.formats:
            for proj, (n, k) in projections.items():
                keys = jax.random.split(key, args.layers + 1)
                key = keys[0]
                pools = [random_pool(kk, fmt, ms.experts, n, k) for kk in keys[1:]]
                jax.block_until_ready(pools)
                for tokens in args.widths:
                    m = tokens * ms.top_k
                    gss = [random_routing(rng, tokens, ms.experts, ms.top_k) for _ in range(args.layers)]
                    xs = [jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16) for _ in range(args.layers)]
                    gss_dev = [jnp.asarray(g) for g in gss]
                    calls = {"pallas": (layered("pallas", interpret), (xs, pools, gss_dev))}
                    if not args.skip_xla:
                        calls["xla"] = (layered("xla", None), (xs, pools, gss_dev))
                    times, ys = time_calls(calls, args.reps)
                    t_pallas, t_xla, rel = times["pallas"] / args.layers, None, None
                    if not args.skip_xla:
                        t_xla = times["xla"] / args.layers
                        # sanity: both paths agree (bf16 outputs, fp32 accumulation in both)
                        a = np.asarray(ys["pallas"][0].astype(jnp.float32))
                        b = np.asarray(ys["xla"][0].astype(jnp.float32))
                        rel = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
                    del ys
                    routed = [int(np.count_nonzero(g)) for g in gss]
                    routed_bytes = statistics.mean(fgm.routed_weight_bytes(pools[0], g) for g in gss)
                    pool_bytes = fgm.routed_weight_bytes(pools[0], np.ones(ms.experts))
                    bw = routed_bytes / t_pallas
                    row = dict(
                        model=ms.name, format=fmt, projection=proj, tokens=tokens, rows=m, n=n, k=k,
                        experts=ms.experts, top_k=ms.top_k,
                        routed_experts=statistics.mean(routed), routed_mb=routed_bytes / 1e6,
                        pool_mb=pool_bytes / 1e6,
                        pallas_us=t_pallas * 1e6, pallas_gbps=bw / 1e9, fraction_of_copy_bw=bw / hbm,
                        xla_us=None if t_xla is None else t_xla * 1e6,
                        speedup_vs_xla=None if t_xla is None else t_xla / t_pallas,
                        max_rel_diff_vs_xla=rel,
                        tuning=dataclasses.asdict(fgm.default_tuning(m, k, n)),
                    )
                    results.append(row)
                    print(
                        f"{ms.name:>22} {fmt} {proj:>7} T={tokens:<3} experts={row['routed_experts']:6.1f} "
                        f"{row['routed_mb']:8.2f} MB  pallas {row['pallas_us']:9.1f} us "
                        f"{row['pallas_gbps']:8.1f} GB/s ({100 * row['fraction_of_copy_bw']:5.1f}% copy)  "
                        + ("" if t_xla is None else f"xla {row['xla_us']:9.1f} us  x{row['speedup_vs_xla']:.2f}  ")
                        + ("" if rel is None else f"rel diff {rel:.1e}"),
                        flush=True,
                    )
    device = jax.devices()[0]
    return dict(
        benchmark="fp4_grouped_matmul",
        backend=backend,
        device=getattr(device, "device_kind", str(device)),
        jax_version=jax.__version__,
        python=platform.python_version(),
        interpret=bool(args.interpret) or backend != "gpu",
        tiny_shapes=bool(args.tiny),
        layers=args.layers,
        reps=args.reps,
        copy_bandwidth_gbps=hbm / 1e9,
        command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        results=results,
    )


def markdown(report: dict) -> list[str]:
    lines = ["# FP4 grouped matmul: Pallas kernel vs XLA path", ""]
    real_gpu = report["backend"] == "gpu" and not report["interpret"] and not report["tiny_shapes"]
    if not real_gpu:
        lines += [
            "**GPU figures pending.** This file comes from a CPU smoke run "
            f"(backend `{report['backend']}`, interpret mode, "
            f"{'tiny shapes' if report['tiny_shapes'] else 'full shapes'}): it shows the script works end "
            "to end; its timings say nothing about GPU performance. Rerun on a GPU with "
            "`python benchmarks/fp4_grouped_matmul.py` to fill in the real figures.",
            "",
        ]
    lines += [
        f"- device: {report['device']} (backend `{report['backend']}`), jax {report['jax_version']}",
        f"- command: `{report['command']}`",
        f"- measured copy bandwidth (read + write): {report['copy_bandwidth_gbps']:.1f} GB/s",
        f"- per-call time = median over {report['reps']} calls of {report['layers']} layers' ops, / layers",
        "- effective bandwidth = FP4 bytes (codes + scales) of the routed experts / Pallas time",
        "",
    ]

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    lines += h.table(["model", "fmt", "proj", "tokens", "rows", "routed experts", "routed MB", "Pallas us", "GB/s",
                      "% copy BW", "XLA us", "speedup", "max rel diff"],
                     [[r["model"], r["format"], r["projection"], r["tokens"], r["rows"], f"{r['routed_experts']:.1f}",
                       f"{r['routed_mb']:.2f}", f"{r['pallas_us']:.1f}", f"{r['pallas_gbps']:.1f}",
                       f"{100 * r['fraction_of_copy_bw']:.1f}", fmt(r["xla_us"], ".1f"),
                       fmt(r["speedup_vs_xla"], ".2f") + ("x" if r["speedup_vs_xla"] is not None else ""),
                       fmt(r["max_rel_diff_vs_xla"], ".1e")] for r in report["results"]], align="---rrrrrrrrrr")
    return lines


def parse_args(argv=None):
    p = h.parser(__doc__, {
        "--tiny": (False, "tiny expert shapes (CPU smoke run)"),
        "--interpret": (False, "run the Pallas kernel in interpret mode"),
        "--models": (",".join(MODELS), f"comma list of {sorted(MODELS)}"),
        "--formats": ("mxfp4,nvfp4", "comma list of mxfp4,nvfp4 (--quick: mxfp4)"),
        "--widths": ("1,4,8,16,32", "verify widths in tokens (--quick: 1,8,32)"),
        "--layers": (8, "distinct weight pools per timed call (--quick: 4)"),
        "--reps": (20, "timed calls per case (--quick: 5)"), "--skip-xla": (False, "do not time the XLA path"),
        "--expert-policy": (False, "instead: plain decoding of the shipped pair, FP4 experts vs dequantized at load"),
        "--policy-prompts": (4, "--expert-policy: held-out prompts"),
        "--policy-new-tokens": (64, "--expert-policy: new tokens per prompt"),
        "--no-write": (False, "print only")}, seed=0)
    a = h.parse(p, argv, quick=dict(formats="mxfp4", widths="1,8,32", layers=4, reps=5, policy_prompts=1,
                                    policy_new_tokens=8))
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = [m for m in a.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    a.formats = [f.strip() for f in a.formats.split(",")]
    if any(f not in ("mxfp4", "nvfp4") for f in a.formats):
        p.error(f"--formats must be a comma list of mxfp4,nvfp4; got {a.formats}")
    a.widths = h.int_list(p, a.widths, "--widths")
    return a


def expert_policy(args) -> dict:
    """Plain greedy decoding of the shipped pair with its MXFP4 experts as stored (the XLA path dequantizes
    every table on every call) vs dequantized once at load (`dflash_jax.load(dequantize_experts=True)`, what
    "auto" picks on the CPU): tokens/s of each, runs alternated prompt by prompt in one process."""
    import dflash_jax
    from dflash_jax.decode import greedy_generate
    from dflash_jax.pair import dense_expert_bytes, dense_experts_wanted, with_dense_experts

    fp4 = dflash_jax.load()
    dense = with_dense_experts(fp4)
    prompts = h.prompts(fp4, args.policy_prompts, 128)
    n = args.policy_new_tokens
    runs = {"fp4": fp4, "dense at load": dense}

    def decode(pair, prompt):
        return greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=n, stop_ids=[])[0]

    outputs = {name: decode(pair, prompts[0]) for name, pair in runs.items()}  # compile each once
    assert outputs["fp4"] == outputs["dense at load"], "dequantizing at load changed the output"
    reps = 3
    t = h.paired_items(prompts, lambda prompt: {name: (lambda pair=pair: decode(pair, prompt))
                                                for name, pair in runs.items()}, reps, alternate=True)
    seconds = {name: sum(x.stat(name, "wall", "mean") * reps for x in t) for name in runs}
    tokens = reps * len(prompts) * n
    tps = {name: tokens / s for name, s in seconds.items()}
    print(json.dumps(tps))
    return {
        "backend": jax.default_backend(), "jax": jax.__version__, "machine": f"{platform.machine()}, "
        f"{os.cpu_count()} cores", "prompts": len(prompts), "prompt_tokens": 128, "new_tokens": n,
        "reps": reps, "auto_dequantizes_here": bool(dense_experts_wanted(fp4, "auto")),
        "fp4_expert_bytes": fp4.expert_bytes, "dense_expert_bytes": dense_expert_bytes(fp4),
        "dense_dtype": str(fp4.target.embed.dtype),
        "tokens_per_second": tps, "speedup": tps["dense at load"] / tps["fp4"], "outputs_equal": True,
    }


def expert_policy_markdown(r: dict) -> list[str]:
    tps = r["tokens_per_second"]
    return [
        "# FP4 experts on a backend without the kernel: dequantize once at load", "",
        f"Plain greedy decoding of the shipped pair (`benchmarks/fp4_grouped_matmul.py --expert-policy`), backend "
        f"`{r['backend']}` ({r['machine']}), jax {r['jax']}: {r['prompts']} held-out prompts of {r['prompt_tokens']} "
        f"tokens, {r['new_tokens']} new tokens each, {r['reps']} passes, the two runs alternated prompt by prompt "
        "in one process; outputs equal.", "",
        *h.table(["experts", "bytes", "plain tok/s"],
                 [["MXFP4 as stored (XLA path dequantizes per call)", f"{r['fp4_expert_bytes'] / 1e6:.2f} MB",
                   f"{tps['fp4']:.1f}"],
                  [f"dequantized at load ({r['dense_dtype']}, the compute dtype)",
                   f"{r['dense_expert_bytes'] / 1e6:.2f} MB", f"{tps['dense at load']:.1f}"]], align="-rr"), "",
        f"Dequantizing at load: **{r['speedup']:.2f}x** plain tokens/s. `dflash_jax.load(dequantize_experts=\"auto\")` "
        f"and `dflash-generate` (default `--dequantize-experts auto`) do it here: "
        f"{'yes' if r['auto_dequantizes_here'] else 'no'} (no FP4 kernel on this backend; dense tables within 25% of "
        "memory). Where the Pallas kernel runs (a GPU) the experts stay FP4."]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.expert_policy:
        result = expert_policy(args)
        if not args.no_write:
            h.Report(args, "fp4_grouped_matmul_expert_policy").write(result, expert_policy_markdown(result))
        return 0
    if jax.default_backend() != "gpu" and not args.tiny:
        print("note: no GPU backend; full shapes in interpret mode are very slow (use --tiny for a smoke run)",
              file=sys.stderr)
    report = run(args)
    if not args.no_write:
        h.Report(args, "fp4_grouped_matmul").write(report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
