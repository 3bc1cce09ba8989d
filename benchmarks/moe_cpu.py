"""MoE experts on a CPU: the routed rows' tiles against XLA's grouped matmul and the all-experts path, per layer
and end to end, and host expert compute at real expert shapes against this machine's copy bandwidth.

  python benchmarks/moe_cpu.py [--batches 1,4,16,32] [--max-new 48] [--repeats 2] [--processes 1] [--write-docs]

Three parts, one report (docs/benchmarks/moe_cpu.{json,md,png}):
  layer       one MoE layer of the shipped pair's shape (8 experts, top-2, 128 -> 256, fp32) at 1 .. 1024 tokens,
              each path of `nn.moe.swiglu_experts` on a CPU: "xla" (`ragged_dot`: every row through every
              expert behind a 0/1 mask), "dense" (every token through every expert), "tiles" (the routed rows
              only), "stream" (the routed rows through the compiled kernel, `cpu_kernels.dense_rows`) and "auto"
              (the library's choice, `nn.moe.routed_path`); process CPU ms per call, paired runs.
  end to end  the shipped pair (experts dequantized at load, as `dflash-generate` runs on a CPU), plain greedy
              decoding and DFlash chains at blocks 8 and 16, batches of held-out prompts (26 windows, repeated to fill a
              batch of 32), in separate processes
              per MoE path (DFLASH_MOE_CPU_PATH=xla: the path before the tiles; auto: the library's), alternated;
              tokens/s wall and per process CPU second; every output checked against plain greedy of its process.
  host        one MoE layer's routed experts at the real shapes of Qwen3-30B-A3B (128 experts, top-8,
              2048 -> 768) and gpt-oss-20b (32 experts, top-4, 2880 -> 2880), bf16 and MXFP4 tables (random),
              1 / 4 / 16 tokens: bytes of routed experts (as stored) read per second, against this machine's
              measured copy bandwidth (`np.copyto` of 256 MiB), the CPU paths in one process: "tiles" (each
              tile's expert gathered, then dequantized and multiplied) and "stream" (the compiled kernels of
              `pallas_kernels.cpu_kernels`: MXFP4 codes read once as stored, bf16 tables read in place), and the one
              "auto" takes. Each call routes the tokens afresh (`--host-routings` routings: as in decoding, each
              layer and step reads its own experts, not ones a previous call left in cache); each path runs its own
              calls back to back, the medians of the per-call rates reported. The paths are not interleaved: a
              tiles call allocates and fills GBs of dequantized temporaries, and a stream call right after one
              measured about half its rate back to back (an earlier protocol, interleaved: MXFP4 27% - 38% of copy).
--parts host --write-docs keeps the other parts' tables from the tracked report (their own run and load).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import harness as H

PATHS = ("xla", "dense", "tiles", "stream", "auto")
HOST_PATHS = ("tiles", "stream")
LAYER_TOKENS = (1, 4, 16, 64, 256, 1024)
REAL_SHAPES = {"Qwen3-30B-A3B": (128, 8, 2048, 768), "gpt-oss-20b": (32, 4, 2880, 2880)}


def layer_part(args, log) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from dflash_jax.nn import moe

    e, k, h, inter = 8, 2, 128, 256
    rng = np.random.default_rng(0)
    gu = jnp.asarray(rng.standard_normal((e, h, 2 * inter), np.float32) * 0.05)
    dn = jnp.asarray(rng.standard_normal((e, inter, h), np.float32) * 0.05)
    rows = []
    for t in args.layer_tokens:
        x = jnp.asarray(rng.standard_normal((t, h), np.float32))
        weights, experts = jax.lax.top_k(jax.nn.softmax(jnp.asarray(rng.standard_normal((t, e), np.float32))), k)
        calls = max(1, 256 // t)
        # the tables are arguments, as in a forward (constants would let XLA prepare them once at compile time)
        fns = {p: jax.jit(lambda x, ex, w, gu, dn, p=p: moe.swiglu_experts(x, ex, w, gu, dn, implementation=p))
               for p in PATHS if p != "auto"}
        fns["auto"] = jax.jit(lambda x, ex, w, gu, dn: moe.swiglu_experts(x, ex, w, gu, dn))
        ref = np.asarray(fns["xla"](x, experts.astype(jnp.int32), weights, gu, dn))
        err = {p: float(np.max(np.abs(np.asarray(f(x, experts.astype(jnp.int32), weights, gu, dn)) - ref)))
               for p, f in fns.items()}

        def mode(f):
            def run():
                for _ in range(calls):
                    out = f(x, experts.astype(jnp.int32), weights, gu, dn)
                return jax.block_until_ready(out)
            return run

        timings = H.paired_runs({p: mode(f) for p, f in fns.items()}, args.layer_repeats)
        row = {"tokens": t, "auto_path": moe.routed_path("auto", gu, jnp.float32, t, k),
               "cpu_ms": {p: timings.stat(p, "cpu", "median") / calls * 1e3 for p in fns},
               "max_abs_err_vs_xla": err}
        rows.append(row)
        log(f"layer T={t}: " + ", ".join(f"{p} {ms:.3f} ms" for p, ms in row["cpu_ms"].items())
            + f" (auto = {row['auto_path']})")
    return rows


def copy_bandwidth() -> float:
    src = np.ones(256 << 20, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best


def host_part(args, log) -> dict:
    import jax
    import jax.numpy as jnp

    from dflash_jax.nn import moe
    from pallas_kernels.formats import MXFP4Tensor

    bandwidth = copy_bandwidth()
    log(f"host: copy bandwidth {bandwidth / 1e9:.2f} GB/s")
    rows = []
    for model, (e, k, h, inter) in REAL_SHAPES.items():
        for fmt in args.host_formats:
            rng = np.random.default_rng(1)
            if fmt == "bf16":
                gu = jnp.asarray(rng.standard_normal((e, h, 2 * inter), np.float32) * 0.02, jnp.bfloat16)
                dn = jnp.asarray(rng.standard_normal((e, inter, h), np.float32) * 0.02, jnp.bfloat16)
            else:  # random codes and E8M0 scales near 2^-7, drawn packed (quantizing GBs of floats adds nothing)
                def table(n, kk):
                    return MXFP4Tensor(jnp.asarray(rng.integers(0, 256, (e, n, kk // 32, 16), dtype=np.uint8)),
                                       jnp.asarray(rng.integers(118, 124, (e, n, kk // 32), dtype=np.uint8)))
                gu, dn = table(2 * inter, h), table(h, inter)
            expert_bytes = sum(a.nbytes for a in jax.tree.leaves((gu, dn))) // e
            fns = {p: jax.jit(lambda x, ex, w, gu, dn, p=p: moe.swiglu_experts(x, ex, w, gu, dn, implementation=p))
                   for p in HOST_PATHS}
            for t in args.host_tokens:
                x = jnp.asarray(rng.standard_normal((t, h), np.float32))
                routings = [jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
                            for _ in range(args.host_routings)]
                w = jnp.full((t, k), 1.0 / k, jnp.float32)
                outs = {p: np.asarray(f(x, routings[0], w, gu, dn)) for p, f in fns.items()}  # compiles
                diff = float(np.max(np.abs(outs["stream"] - outs["tiles"])))
                scale = float(np.max(np.abs(outs["tiles"])))
                auto = moe.routed_path("auto", gu, jnp.float32, t, k)
                row = {"model": model, "table": fmt, "tokens": t, "expert_bytes": expert_bytes, "auto_path": auto,
                       "max_abs_diff": diff, "max_abs_out": scale, "paths": {}}
                loads = []
                for p in sorted(fns, key=lambda p: p != "stream"):  # each path's calls apart (module docstring)
                    f = fns[p]
                    calls = args.host_routings if p == "stream" else args.host_repeats
                    jax.block_until_ready(f(x, routings[-1], w, gu, dn))  # after the other path's calls
                    rates, walls, cpus, routed = [], [], [], []
                    for i in range(calls):
                        ex = routings[i % len(routings)]
                        n_routed = len(np.unique(np.asarray(ex)))
                        w0, c0 = time.perf_counter(), time.process_time()
                        jax.block_until_ready(f(x, ex, w, gu, dn))
                        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
                        rates.append(n_routed * expert_bytes / wall)
                        walls.append(wall)
                        cpus.append(cpu)
                        routed.append(n_routed)
                    loads.append(os.getloadavg()[0])
                    rate = float(np.median(rates))
                    row["paths"][p] = {"ms": float(np.median(walls)) * 1e3, "cpu_ms": float(np.median(cpus)) * 1e3,
                                       "bytes_per_s": rate, "of_copy_bandwidth": rate / bandwidth, "calls": calls,
                                       "routed_experts": float(np.median(routed))}
                row["routed_experts"] = row["paths"]["stream"]["routed_experts"]
                row["load"] = {"median": float(np.median(loads)), "min": min(loads), "max": max(loads)}
                taken = row["paths"].get(auto, row["paths"]["tiles"])
                row.update(ms=taken["ms"], bytes_per_s=taken["bytes_per_s"], of_copy_bandwidth=taken["of_copy_bandwidth"])
                rows.append(row)
                log(f"host {model} {fmt} T={t}: {row['routed_experts']:.0f} experts, " + ", ".join(
                    f"{p} {r['ms']:.1f} ms {r['bytes_per_s'] / 1e9:.2f} GB/s = {r['of_copy_bandwidth']:.2f} x copy"
                    for p, r in row["paths"].items()) + f"; auto = {auto}; max |stream - tiles| {diff:.2e} "
                    f"(outputs up to {scale:.2e})")
            del gu, dn
    return {"copy_bytes_per_s": bandwidth, "rows": rows}


def child(args) -> None:
    """One process, one MoE path (DFLASH_MOE_CPU_PATH set by the parent): every batch, plain and DFlash."""
    import jax

    import dflash_jax
    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec.loop import generate

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR, dequantize_experts=True)
    pool = H.prompts(pair, max(args.batches), args.prompt_len)
    out = []
    for b in args.batches:
        prompts = [pool[i % len(pool)] for i in range(b)]  # the held-out windows, repeated past the last
        modes = {"plain": lambda: greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=args.max_new)}
        for block in args.blocks:
            modes[f"dflash B={block}"] = (lambda block=block: generate(pair, prompts, max_new_tokens=args.max_new,
                                                                        block_size=block))
        results = {m: f() for m, f in modes.items()}  # compiles
        tokens = {m: [list(map(int, s[:args.max_new])) for s in (r if m == "plain" else r.tokens)]
                  for m, r in results.items()}
        taus = {m: float(np.mean([r.mean_acceptance(i) for i in range(b)])) for m, r in results.items() if m != "plain"}
        timings = H.paired_runs(modes, args.repeats)
        jax.clear_caches()
        out.append({"batch": b, "equal_to_plain": {m: tokens[m] == tokens["plain"] for m in modes}, "tau": taus,
                    "tokens_per_s": {m: b * args.max_new / timings.stat(m, "wall") for m in modes},
                    "tokens_per_cpu_s": {m: b * args.max_new / timings.stat(m, "cpu") for m in modes},
                    "load": timings.load_summary()})
        print(json.dumps(out[-1]), flush=True)
    with open(args.child, "w") as fh:
        json.dump(out, fh)


def end_to_end_part(args, log) -> dict:
    runs = {p: [] for p in ("xla", "auto")}
    for i in range(args.processes):
        for path in (("xla", "auto") if i % 2 == 0 else ("auto", "xla")):
            with tempfile.TemporaryDirectory() as tmp:
                dest = os.path.join(tmp, "out.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--child", dest, "--batches",
                       ",".join(map(str, args.batches)), "--blocks", ",".join(map(str, args.blocks)),
                       "--max-new", str(args.max_new), "--prompt-len", str(args.prompt_len),
                       "--repeats", str(args.repeats)]
                log(f"end to end: process {i + 1}/{args.processes}, MoE path {path}")
                subprocess.run(cmd, check=True, env=dict(os.environ, DFLASH_MOE_CPU_PATH=path))
                with open(dest) as fh:
                    runs[path].append(json.load(fh))
    rows = []
    for bi, b in enumerate(args.batches):
        for mode in runs["auto"][0][bi]["tokens_per_s"]:
            cell = {"batch": b, "mode": mode}
            for path in runs:
                per = [r[bi] for r in runs[path]]
                cell[path] = {"tokens_per_s": float(np.median([p["tokens_per_s"][mode] for p in per])),
                              "tokens_per_cpu_s": float(np.median([p["tokens_per_cpu_s"][mode] for p in per])),
                              "equal_to_plain": all(p["equal_to_plain"][mode] for p in per),
                              "tau": per[0]["tau"].get(mode)}
            rows.append(cell)
    return {"rows": rows, "runs": runs}


def markdown(args, result) -> list[str]:
    lines = ["# MoE experts on a CPU: the compiled kernels, routed tiles, grouped matmul and all experts", "",
             f"`{args.command}` - {result['machine']['machine']}, jax {result['machine']['jax']}. "
             "Method and parts: the script's docstring. Load average (1 min) over the run: "
             f"{result['load_before']} before, {result['load_after']} after." + "".join(
                 f" The {part.replace('_', ' ')} part is from an earlier run (load {old['load_before']} before, "
                 f"{old['load_after']} after)." for part, old in result.get("carried", {}).items()), ""]
    if result.get("layer"):
        lines += ["## One layer (the shipped pair's shape: 8 experts, top-2, 128 -> 256, fp32)", "",
                  "Process CPU ms per call, paired runs (median); auto = the path `routed_path` takes.", ""]
        lines += H.table(["tokens", *PATHS, "auto takes", "tiles vs xla"],
                         [[r["tokens"], *(f"{r['cpu_ms'][p]:.3f}" for p in PATHS), r["auto_path"],
                           f"{r['cpu_ms']['xla'] / r['cpu_ms']['tiles']:.2f}x"] for r in result["layer"]])
        lines.append("")
    if result.get("end_to_end"):
        lines += ["## End to end: the shipped pair, batched (experts dequantized at load)", "",
                  "tokens/s wall (and per process CPU second), medians over processes; xla = `ragged_dot` (the path "
                  "before the tiles), auto = the library's path now; `==` every output equal to plain greedy.", ""]
        plain = {(r["batch"]): r for r in result["end_to_end"]["rows"] if r["mode"] == "plain"}
        body = []
        for r in result["end_to_end"]["rows"]:
            base = plain[r["batch"]]["auto"]["tokens_per_s"]
            body.append([r["batch"], r["mode"], f"{r['xla']['tokens_per_s']:.0f} ({r['xla']['tokens_per_cpu_s']:.0f})",
                         f"{r['auto']['tokens_per_s']:.0f} ({r['auto']['tokens_per_cpu_s']:.0f})",
                         f"{r['auto']['tokens_per_s'] / r['xla']['tokens_per_s']:.2f}x",
                         f"{r['auto']['tokens_per_s'] / base:.2f}x",
                         "-" if r["auto"]["tau"] is None else f"{r['auto']['tau']:.2f}",
                         "yes" if r["xla"]["equal_to_plain"] and r["auto"]["equal_to_plain"] else "NO"])
        lines += H.table(["batch", "mode", "xla tok/s (CPU)", "auto tok/s (CPU)", "auto / xla",
                          "vs plain (auto)", "tau", "=="], body)
        lines.append("")
    if result.get("host"):
        host = result["host"]
        lines += ["## Host expert compute at real shapes", "",
                  f"Copy bandwidth (np.copyto, 256 MiB): {host['copy_bytes_per_s'] / 1e9:.2f} GB/s. Bytes of the routed "
                  "experts as stored over the layer's wall time (median over calls, each call a fresh routing, each "
                  "path's calls back to back, both paths in one process; routed experts: the median over the calls): "
                  "tiles = the path before (each tile's expert gathered, dequantized, multiplied), stream = "
                  "`_streamed_experts` (the compiled kernels: MXFP4 codes decoded in registers, bf16 read in place); "
                  "auto = the path "
                  "`routed_path` takes; load = the 1-minute load average over the point's runs.", ""]
        lines += H.table(["model", "table", "tokens", "routed experts", "tiles ms", "tiles GB/s", "tiles of copy",
                          "stream ms", "stream GB/s", "stream of copy", "auto takes", "max abs diff", "load"],
                         [[r["model"], r["table"], r["tokens"], r["routed_experts"],
                           *(x for p in HOST_PATHS for x in (f"{r['paths'][p]['ms']:.1f}",
                                                             f"{r['paths'][p]['bytes_per_s'] / 1e9:.2f}",
                                                             f"{r['paths'][p]['of_copy_bandwidth']:.0%}")),
                           r["auto_path"], f"{r['max_abs_diff']:.1e}", f"{r['load']['median']:.1f}"]
                          for r in host["rows"]])
    return lines


def draw(result):
    def plot(axes):
        ax = axes[0]
        for p in PATHS:
            ax.plot([r["tokens"] for r in result["layer"]], [r["cpu_ms"][p] for r in result["layer"]], marker="o", label=p)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="CPU ms per layer", title="one MoE layer")
        ax.legend()
        ax = axes[1]
        rows = result["end_to_end"]["rows"] if result.get("end_to_end") else []
        for mode in dict.fromkeys(r["mode"] for r in rows):
            for path, style in (("xla", "--"), ("auto", "-")):
                pts = [(r["batch"], r[path]["tokens_per_s"]) for r in rows if r["mode"] == mode]
                ax.plot(*zip(*pts), style, marker="o", label=f"{mode} ({path})")
        ax.set(xscale="log", xlabel="batch", ylabel="tokens/s", title="shipped pair, batched")
        ax.legend(fontsize=7)
    return plot


DEFAULTS = {"batches": "1,4,16,32", "blocks": "8,16", "max_new": 48, "prompt_len": 128, "repeats": 2}


def main(argv=None) -> int:
    p = H.parser(__doc__, {"--batches": (DEFAULTS["batches"], "batch sizes, comma-separated"),
                           "--processes": (1, "processes per MoE path, alternated"),
                           "--parts": ("layer,end_to_end,host", "parts to run"),
                           "--host-formats": ("bf16,mxfp4", "expert tables of the host part"),
                           "--child": (None, "internal: run one process's end-to-end measurements into this file")},
                 blocks=DEFAULTS["blocks"], max_new=DEFAULTS["max_new"], prompt_len=DEFAULTS["prompt_len"],
                 repeats=DEFAULTS["repeats"])
    args = H.parse(p, argv, quick={"batches": "1,4", "max_new": 16, "parts": "layer,end_to_end",
                                   "host_formats": "bf16"})
    args.command = H.command("moe_cpu.py", args, DEFAULTS,
                             "" if args.parts == "layer,end_to_end,host" else f" --parts {args.parts}")
    args.batches = H.int_list(p, args.batches, "--batches")
    args.blocks = H.int_list(p, args.blocks, "--blocks", minimum=2)
    args.host_formats = [f for f in args.host_formats.split(",") if f]
    if set(args.host_formats) - {"bf16", "mxfp4"}:
        p.error("--host-formats takes bf16 and/or mxfp4")
    parts = [x for x in args.parts.split(",") if x]
    if set(parts) - {"layer", "end_to_end", "host"}:
        p.error("--parts takes layer, end_to_end and/or host")
    if args.child:
        child(args)
        return 0
    args.layer_tokens = LAYER_TOKENS[:3] if args.quick else LAYER_TOKENS
    args.layer_repeats = 3 if args.quick else 7
    args.host_tokens, args.host_repeats = ((1,) if args.quick else (1, 4, 16)), (2 if args.quick else 3)
    args.host_routings = 2 if args.quick else 12  # stream calls per point, each a fresh routing
    log = H.logger("moe_cpu")
    result = {"machine": H.machine(), "load_before": H.load_average(), "args": {k: v for k, v in vars(args).items()
                                                                               if k not in ("out_dir",)}}
    if "layer" in parts:
        result["layer"] = layer_part(args, log)
    if "end_to_end" in parts:
        result["end_to_end"] = end_to_end_part(args, log)
    if "host" in parts:
        result["host"] = host_part(args, log)
    result["load_after"] = H.load_average()
    if args.write_docs:  # parts not run now keep their tables from the tracked report
        tracked = os.path.join(H.DOCS, "moe_cpu.json")
        if os.path.exists(tracked):
            with open(tracked) as fh:
                old = json.load(fh)
            for part in ("layer", "end_to_end", "host"):
                if part not in parts and part in old:
                    result[part] = old[part]
                    # the part's own run: carried along again if the tracked report carried it already
                    result.setdefault("carried", {})[part] = old.get("carried", {}).get(part) or {
                        "load_before": old.get("load_before"), "load_after": old.get("load_after")}
    report = H.Report(args, "moe_cpu")
    report.write(result, markdown(args, result),
                 draw=draw(result) if result.get("layer") and result.get("end_to_end") else None,
                 image="one layer's CPU time by path; batched tokens/s before and after", ncols=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
