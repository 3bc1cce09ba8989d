"""Benchmark: the GPU path compiled for an NVIDIA H200 on a machine without a GPU (deviceless XLA:GPU + ptxas).

    pip install -e '.[gpu-compile]'     # jax's CUDA plugin pinned to jax, triton's ptxas / libdevice
    python benchmarks/h200_compile.py                 # kernel shapes + rounds + offload pieces -> bench_out/
    python benchmarks/h200_compile.py --quick         # the kernel at verify shapes only (--kernel-only)
    python benchmarks/h200_compile.py --write-docs    # docs/benchmarks/h200_compile.{json,md}

What is compiled (`tests/gpu_compile/programs.py`, weights abstract: nothing allocated), for Qwen3-Coder-30B-A3B,
gpt-oss-120b and Qwen3.5-35B-A3B (release configs; draft sizes assumed as in `study.cost_model`):
  * the FP4 Pallas kernel (`fp4_grouped_matmul`, MXFP4) for each expert matrix at the verify width (16 tokens)
    and at a 4096-token prefill: launch grid, threads, shared memory (XLA's thunk sequence), registers and
    spills (ptxas -v on the kernel's PTX), the MMA instructions of the PTX;
  * one width-16 verify round and one draft round per family at batch 1, 1024-token prompt, 8192-row cache;
  * the offloaded layer-wise pieces (`offload.forward`): block context, each layer kind's mixer + router, one
    MoE layer's experts on a pool of 16 x top-k slots, the final norm + logits;
  * the shipped pairs' rounds (`spec.round.round_step`, the chain of blocks 1 / 4 / 8 / 16, a 128-token prompt,
    FP4 experts through the kernel): how each runs on the GPU (`deviceless.Launches`: kernel launches, CUDA graphs,
    loops and conditionals the host drives), and what that predicts for DFlash against the same loop at block 1
    where the rounds are launch bound, as these tiny models are (`--pairs`).
Reported per program: `memory_analysis()` (arguments, outputs, aliased, temporaries; peak vs the H200's 141 GB),
the cost analysis (flops, bytes accessed: XLA's HLO cost analysis of the compiled GPU module, which counts a
custom call's whole operands, so the verify's figure includes every expert of every layer), and roofline
times at the H200's 4.8 TB/s HBM bandwidth (NVIDIA H200 datasheet). The verify's "routed" bytes replace the
expert tables by the expected distinct experts a width-16 block routes to under uniform routing
(`study.cost_model.distinct_experts`): what the kernel reads.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import time
from pathlib import Path

# A deviceless compile: the CUDA plugin must not look for CUDA libraries (see tests/gpu_compile/deviceless.py).
if "JAX_PLATFORMS" not in os.environ and not glob.glob("/dev/nvidia[0-9]*"):
    os.environ["JAX_PLATFORMS"] = "cpu"

import harness as h  # noqa: E402  (puts the repository root on the path: study, tests.gpu_compile)
import jax  # noqa: E402

from study import cost_model as cm  # noqa: E402
from tests.gpu_compile import deviceless as dl  # noqa: E402

GB = 1e9
COST_MODEL_KEYS = {"Qwen3-Coder-30B-A3B": "qwen3-30b-a3b", "gpt-oss-120b": "gpt-oss-120b",
                   "Qwen3.5-35B-A3B": "qwen3.5-35b-a3b"}
BF16_FLOPS = 989e12  # dense BF16 tensor FLOP/s (NVIDIA H200 datasheet: 1,979 TFLOPS with sparsity)
TAUS = (1.0, 3.0, 6.0)  # tokens committed per round: illustrative, not measured here


NOTES = {
    "rounds": "Verify reads = the target's weights without the experts no token of the block routes to, plus the "
              "live rows of its KV cache (1040 of 8192). The HLO-bytes column is XLA's HLO cost analysis of the "
              "compiled module, shown for completeness: it does not count the Pallas custom call's weight reads "
              "(8.6 GB for Qwen3-Coder, under its 15.4 GB of experts) and counts gathers' whole tables, so it is "
              "no bound either way. The cost model "
              "(`study.cost_model`, `benchmarks/offload_cost_model.py`) charges per layer attention + router "
              "(+ shared expert) weights and the routed experts, plus the lm_head; its non-expert bytes are "
              "compared with the compiled program's weights minus experts. Outputs minus aliased bytes are the "
              "draft's KV cache, which the verify passes through without donation (a copy per round, e.g. 78 MB "
              "for Qwen3-Coder: 16 us).",
    "offload": "Each piece is one jitted program of the layer-wise (offloaded) verify; per MoE layer the "
               "round runs `attend` (mixer + router, whose routing the host reads) then `experts` on the "
               "device pool (16 x top-k slots). Reads: XLA's count, except `begin` (the block's embedding rows; "
               "XLA counts the whole table) and `experts` (the expected routed experts of one layer, which the "
               "kernel reads and XLA does not count). Both per-layer programs are tens of microseconds at 4.8 "
               "TB/s, the same order as the cost model's assumed 50 us host sync per MoE layer, and a missing "
               "expert (2.5 MB for Qwen3-Coder, 13.3 MB for gpt-oss) takes 43-230 us over PCIe 5 at 58 GB/s: "
               "the offloaded verify is bound by the link and the sync, not by HBM.",
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def blocks_per_sm(k) -> int:
    """Resident blocks per SM allowed by registers (allocated in units of 8 per thread), shared memory and
    threads (Hopper: 64K registers, 228 KB, 2048 threads, 32 blocks per SM)."""
    hw = dl.H200
    regs = -(-(k.registers or 1) // 8) * 8 * k.threads
    smem = hw["shared_memory_per_sm"] // max(k.shared_memory_bytes + 1024, 1)  # 1 KB reserved per block
    return int(min(hw["registers_per_sm"] // regs, smem, hw["threads_per_sm"] // k.threads, 32))


def kernel_rows(pg, phases) -> list[dict]:
    from pallas_kernels import fp4_grouped_matmul as fgm

    rows = []
    for shape in pg.kernel_shapes(phases):
        log(f"kernel: {shape.label}")
        c = dl.compile_for_h200(pg.kernel_program, *pg.kernel_args(shape), name=shape.label,
                                kernel_names=("grouped_matmul",))
        k = c.kernels[0]
        tokens = shape.m // shape.top_k
        routed = cm.distinct_experts(shape.groups, shape.top_k, tokens)
        per_group = shape.n * (shape.k // 2 + shape.k // 32)
        t = fgm.default_tuning(shape.m, shape.k, shape.n)
        rows.append({
            **{f: getattr(shape, f) for f in ("model", "matrix", "phase", "groups", "n", "k", "m", "top_k")},
            "tuning": {"block_m": t.block_m, "block_n": t.block_n, "block_k": t.block_k, "num_warps": t.num_warps,
                       "num_stages": t.num_stages},
            "kernel": k.as_dict(),
            "blocks_per_sm": blocks_per_sm(k),
            "expected_routed_experts": routed,
            "routed_bytes": routed * per_group,
            "roofline_us": routed * per_group / dl.H200["hbm_bytes_per_s"] * 1e6,
            "flop_roofline_us": 2 * shape.m * shape.n * shape.k / BF16_FLOPS * 1e6,
            "argument_bytes": c.argument_bytes, "temp_bytes": c.temp_bytes, "compile_seconds": c.compile_seconds,
        })
    return rows


PROGRAMS = {"verify": "verify", "verify_greedy": "verify (greedy rows)", "draft": "draft"}


def greedy_spec(spec):
    """The spec a GPU runs for a batch of greedy rows (`session.prepare` picks it there: `SpecConfig.greedy_only`)."""
    import dataclasses

    return dataclasses.replace(spec, greedy_only=True)


def round_rows(pg, models) -> list[dict]:
    rows = []
    for model in models:
        spec, state, drafted = pg.round_inputs(model)
        target, draft = pg.abstract_weights(model)
        cfg = pg.configs(model)[0]
        experts = pg.expert_bytes(model)
        log(f"{model}: verify round (width {pg.WIDTH})")
        v = dl.compile_for_h200(pg.verify_program, target, state, drafted, spec=spec, name=f"{model} verify",
                                kernel_names=("grouped_matmul",), donate_argnums=(1,))
        log(f"{model}: verify round of greedy rows")
        g = dl.compile_for_h200(pg.verify_program, target, state, drafted, spec=greedy_spec(spec),
                                name=f"{model} verify (greedy rows)", structure=True, donate_argnums=(1,))
        log(f"{model}: draft round")
        d = dl.compile_for_h200(pg.draft_program, target, draft, state, spec=spec, name=f"{model} draft",
                                structure=True)
        rows.append(derive(pg, {"model": model, "verify": v.as_dict(), "verify_greedy": g.as_dict(),
                                "draft": d.as_dict()}))
    return rows


# the measured tokens per round of each shipped pair's chains (greedy: the tokens are the same on any backend), from
# the reports of `benchmarks/tiny_pair.py` beside this one
PAIR_TAUS = {"tiny_pair": "tiny_pair_h200.json", "tiny_pair_qwen3_5": "tiny_pair_qwen3_5_dense.json"}
PAIR_BLOCKS = (1, 4, 8, 16)


def pair_taus(name: str) -> dict:
    """{block: tau} from the pair's benchmark report in docs/benchmarks ({} where there is none)."""
    path = Path(h.ROOT) / "docs" / "benchmarks" / PAIR_TAUS.get(name, "")
    if not path.is_file():
        return {}
    return {int(r["block_size"]): float(r["tau"]) for r in json.loads(path.read_text()).get("by_block_size", [])}


def pair_rows(names, blocks=PAIR_BLOCKS) -> list[dict]:
    """One round of each shipped pair's chain at each block, compiled for the H200 with the pair's own weights
    (FP4 experts through the kernel) made abstract: how it runs (`Launches`)."""
    import functools

    import dflash_jax
    from dflash_jax.spec import session
    from dflash_jax.spec.round import Chain, round_step

    rows = []
    for name in names:
        pair = dflash_jax.load(dflash_jax.SHIPPED_PAIRS[name])
        taus = pair_taus(name)
        prompt = [[5 + i % 50 for i in range(128)]]
        for block in blocks:
            prep = session.prepare(pair, prompt, block_size=block, max_new_tokens=256)
            state = jax.eval_shape(functools.partial(session.begin_arrays, spec=prep.spec), pair.target, pair.draft,
                                   prep.tokens, prep.lengths, prep.params, prep.key_data, prep.key_fold)

            def one(target, draft, state, *, spec, proposer):
                return round_step(target, draft, state, spec, proposer)[0]

            for program, spec in (("greedy rows", greedy_spec(prep.spec)), ("any rows", prep.spec)):
                log(f"{name}: round at block {block}, {program}")
                c = dl.compile_for_h200(one, pair.target, pair.draft, state, name=f"{name} B={block}", structure=True,
                                        donate_argnums=(2,), spec=spec, proposer=Chain(block))
                rows.append({"pair": name, "block": block, "program": program,
                             "tau": taus.get(block, 1.0 if block == 1 else None), "launches": c.launches.as_dict(),
                             "compile_seconds": c.compile_seconds})
    return rows


def pair_predictions(rows) -> list[dict]:
    """Per pair and block: tokens per second against the same loop at block 1, were a round's time its kernel
    launches' (launch bound): tau x launches(block 1) / launches(block), without and with the conditionals'
    branches (the DeltaNet rollback's replay and the sampled path's branches; at most one of each runs)."""
    out = []
    for r in rows:
        base = next((b for b in rows if b["pair"] == r["pair"] and b["block"] == 1
                     and b.get("program") == r.get("program")), None)
        if base is None or r["tau"] is None:
            continue
        lo = r["launches"]["kernels"] + r["launches"]["in_conditionals"]
        hi = r["launches"]["kernels"]
        out.append({"pair": r["pair"], "block": r["block"], "program": r.get("program"), "tau": r["tau"],
                    "vs_block1_all_branches": r["tau"] * (base["launches"]["kernels"]
                                                          + base["launches"]["in_conditionals"]) / lo,
                    "vs_block1_no_branches": r["tau"] * base["launches"]["kernels"] / hi})
    return out


def span(p: dict) -> str:
    """A prediction's tokens/s against block 1: one figure where no branch can change it, else the range."""
    lo, hi = p["vs_block1_no_branches"], p["vs_block1_all_branches"]
    return f"{lo:.2f}x" if abs(lo - hi) < 5e-3 else f"{lo:.2f}x - {hi:.2f}x"


def _nbytes(tree) -> int:
    import numpy as np

    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def derive_piece(pg, row: dict) -> dict:
    """An offload piece's read bytes: XLA's count, except where it is not the traffic: `begin` gathers the
    block's embedding rows (XLA counts the whole table) and `experts` reads the expected routed experts of one
    layer through the kernel (XLA does not count the custom call's weight reads)."""
    model, piece = row["model"], row["piece"]
    cfg = pg.configs(model)[0]
    reads = row["bytes_accessed"]
    if piece == "begin":
        reads = pg.WIDTH * cfg.hidden_size * 2
    elif piece.startswith("experts"):
        per_expert = pg.expert_bytes(model) / sum(cfg.moe_layers) / cfg.moe.num_experts
        reads = cm.distinct_experts(cfg.moe.num_experts, cfg.moe.top_k, pg.WIDTH) * per_expert
    row["read_bytes"] = reads
    row["roofline_us"] = reads / dl.H200["hbm_bytes_per_s"] * 1e6
    return row


def derive(pg, row: dict) -> dict:
    """The verify's read bytes and rooflines from the compile and the programs' shapes. The verify reads the
    target's weights except the experts no token of the block routes to (expected distinct experts of a
    uniform top-k routing) and the live rows of the target's KV cache (prompt + block of MAX_LEN rows:
    attention reads up to the live length); the draft round's bytes are XLA's count for its program."""
    model = row["model"]
    cfg = pg.configs(model)[0]
    spec, state, drafted = pg.round_inputs(model)
    target, _ = pg.abstract_weights(model)
    experts = pg.expert_bytes(model)
    weights = _nbytes(target)
    kv = _nbytes(state.target_cache)
    live = (pg.PROMPT + pg.WIDTH) / pg.MAX_LEN
    routed = cm.distinct_experts(cfg.moe.num_experts, cfg.moe.top_k, pg.WIDTH)
    read = weights - experts + experts * routed / cfg.moe.num_experts + kv * live
    t_verify = read / dl.H200["hbm_bytes_per_s"]
    t_draft = row["draft"]["bytes_accessed"] / dl.H200["hbm_bytes_per_s"]
    key = COST_MODEL_KEYS[model]
    spec_cm, hw = cm.MODELS[key], cm.HARDWARE["h200-pcie5"]
    row.update({
        "expert_bytes": experts, "weight_bytes": weights, "target_kv_bytes": kv, "kv_live_fraction": live,
        "moe_layers": sum(cfg.moe_layers), "expected_routed_experts_per_layer": routed,
        "verify_read_bytes": read, "verify_roofline_ms": t_verify * 1e3,
        "verify_hlo_roofline_ms": row["verify"]["bytes_accessed"] / dl.H200["hbm_bytes_per_s"] * 1e3,
        "draft_roofline_ms": t_draft * 1e3,
        "tokens_per_second": {str(tau): tau / (t_verify + t_draft) for tau in TAUS},
        "cost_model": {"key": key, "verify_ms": cm.verify_time(spec_cm, hw, pg.WIDTH) * 1e3,
                       "draft_ms": cm.draft_time(spec_cm, hw) * 1e3, "resident_bytes": spec_cm.resident_bytes,
                       "all_expert_bytes": spec_cm.all_expert_bytes,
                       "non_expert_bytes": spec_cm.resident_bytes - spec_cm.draft_bytes},
    })
    return row


def offload_rows(pg, models) -> list[dict]:
    rows = []
    for model in models:
        for name, (fn, args, kwargs) in pg.offload_pieces(model).items():
            log(f"{model}: offload piece {name}")
            c = dl.compile_for_h200(fn, *args, name=f"{model} {name}", kernel_names=("grouped_matmul",), **kwargs)
            rows.append(derive_piece(pg, {"model": model, "piece": name, **c.as_dict()}))
    return rows


def gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def findings(result: dict) -> list[str]:
    """The report's conclusions, computed from its numbers."""
    out = []
    rounds = result.get("rounds") or []
    if rounds:
        worst = max(rounds, key=lambda r: r["verify"]["peak_bytes"])
        temp = max(r["verify"]["temp_bytes"] for r in rounds)
        out.append(f"- **Memory.** Every verify program fits the H200: the largest, {worst['model']}, peaks at "
                   f"{gib(worst['verify']['peak_bytes'])} GiB of 131.3 GiB (weights with MXFP4 experts + caches); "
                   f"temporaries stay under {temp / 2**30:.2f} GiB, so no dequantized copy of any expert table "
                   "exists: the kernel reads FP4 in place.")
        parts = [f"{r['model']} {r['verify_roofline_ms']:.2f} ms (cost model {r['cost_model']['verify_ms']:.2f})"
                 for r in rounds]
        out.append("- **Verify round at 4.8 TB/s.** " + "; ".join(parts) + ". With the draft, one round bounds "
                   "plain-equivalent decoding (tau = 1) at " + ", ".join(
                       f"{r['tokens_per_second']['1.0']:.0f}" for r in rounds) + " tokens/s; DFlash multiplies "
                   "that by tau. The cost model's verify time adds 20 us of launches per layer (assumed) to "
                   "nearly the same bytes.")
        parts = [f"{r['model']} {(r['weight_bytes'] - r['expert_bytes']) / GB:.2f} GB compiled vs "
                 f"{r['cost_model']['non_expert_bytes'] / GB:.2f} GB modeled" for r in rounds]
        out.append("- **Offload cost model, resident bytes.** " + "; ".join(parts) + ". The Qwen3-Coder and "
                   "gpt-oss terms match the compiled weights within 1%; Qwen3.5-35B-A3B's is low "
                   "(its DeltaNet mixers and shared experts are approximated), which makes the model's B0 and "
                   "its device budget for Qwen3.5 optimistic by that gap.")
    with_loops = [r for r in rounds if (r["verify"].get("launches") or {}).get("host_loops")]
    if rounds and all(r["verify"].get("launches") for r in rounds):
        parts = [f"{r['model']} {r['verify']['launches']['host_loops']} loops and "
                 f"{r['verify']['launches']['host_conditionals']} conditionals, {r['verify']['launches']['kernels']} "
                 f"kernels in {r['verify']['launches']['graphs']} graphs" for r in rounds]
        greedy = [r for r in rounds if (r.get("verify_greedy") or {}).get("launches")]
        out.append("- **How a verify runs.** " + "; ".join(parts) + ". " + (
            "The loops are the chunked attention's (a traced trip count over the live chunks, one per attention "
            "layer): the host runs each, reading its predicate back every trip. On a GPU that is a wait per trip "
            "and layer, to measure against the dense path (`AttentionTuning`) on the GPU run." if with_loops else
            "No loop is left to the host.") + ("" if not greedy else " The conditionals skip the sampling work when "
            "no row samples; the program of greedy rows (`SpecConfig.greedy_only`, which `prepare` picks on a GPU) "
            "has none: " + "; ".join(f"{r['model']} {r['verify_greedy']['launches']['host_conditionals']} "
                                     f"conditionals, {r['verify_greedy']['launches']['graphs']} graph(s)"
                                     for r in greedy) + "."))
    pairs = result.get("pairs") or []
    if pairs:
        pred = {(p["pair"], p["block"], p.get("program")): p for p in pair_predictions(pairs)}
        parts = []
        for (name, block, program), p in sorted(pred.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]))):
            if block == 8:
                parts.append(f"{name} {span(p)} ({program or 'any rows'}, tau {p['tau']:.2f})")
        if parts:
            out.append("- **The shipped pairs, launch bound.** Were a round's time its kernel launches', DFlash at "
                       "block 8 would make " + "; ".join(parts) + " the tokens/s of the same loop at block 1 (the "
                       "hybrid pair's goal is 1.5x): where a range, it spans the conditionals' branches, none or all "
                       "run.")
    kernels = result.get("kernels") or []
    verify = [k for k in kernels if k["phase"] == "verify"]
    prefill = [k for k in kernels if k["phase"] == "prefill"]
    if verify:
        regs = sorted({k["kernel"]["registers"] for k in verify})
        out.append(f"- **Kernel, verify tiles.** `mma.sync` m16n8k16 (bf16 -> f32), {regs[0]}-{regs[-1]} "
                   "registers per thread with no spills, ~33 KB shared memory: 3 blocks (12 warps) per SM, register "
                   "bound. The roofline of a layer's routed experts is 12-94 us; whether the kernel reaches it "
                   "needs the GPU run (`benchmarks/gpu_suite.sh`).")
    if prefill:
        out.append("- **Kernel, prefill tiles.** Hopper `wgmma` m64n128k16, 160-162 KB shared memory (above the "
                   "48 KB default, under the 227 KB opt-in limit) and 243-254 registers: one 4-warp block per SM, "
                   "a low occupancy; 8 warps per block is the first tuning to try on a GPU.")
    return out


def markdown(result: dict) -> list[str]:
    hw = dl.H200
    out = ["# H200 deviceless compile report", "",
           f"Generated by `benchmarks/h200_compile.py` on {result['machine']} (no GPU): jax {result['jax']}, "
           f"`jax.jit(...).lower(abstract arrays).compile()` for an H200 target description ({hw['sms']} SMs, "
           f"{hw['memory_bytes'] / GB:.0f} GB, sm_90a) through XLA:GPU and triton's ptxas. Nothing ran on a GPU: "
           "the numbers are compile-time facts (memory, launch shapes, registers, instructions) and rooflines.", "",
           f"Bandwidth used for every roofline: **{hw['hbm_bytes_per_s'] / 1e12:.1f} TB/s** HBM3e (NVIDIA H200 "
           "Tensor Core GPU datasheet); memory: 141 GB (same source). A measured H200 copy reaches less (the kernel "
           "benchmark's `--write-docs` run on a GPU measures it), so these are lower bounds on time.", ""]
    found = findings(result)
    if found:
        out += ["## Findings", ""] + found + [""]
    if result.get("kernels"):
        out += ["## The FP4 kernel (MXFP4, `fp4_grouped_matmul`)", "",
                "Expected routed experts: distinct experts of a uniform top-k routing of the tokens; routed bytes: "
                "their FP4 codes + E8M0 scales (what the kernel reads); roofline = routed bytes / 4.8 TB/s.", "",
                ]

        def kernel_cells(r):
            k, t = r["kernel"], r["tuning"]
            mma = ", ".join(m.replace(".sync.aligned", "") for m in k["mma"] if "mma" in m.split(".")[-1] or
                            m.startswith("mma.") or "mma_async" in m) or "-"
            return [r["model"], r["matrix"], r["phase"], f"{r['m']} x {r['n']} x {r['k']}, {r['groups']}",
                    f"{t['block_m']}, {t['block_n']}, {t['block_k']} / {t['num_warps']}", tuple(k["grid"]),
                    f"{k['shared_memory_bytes'] / 1024:.1f}", k["registers"], k["spill_bytes"], r["blocks_per_sm"],
                    mma, f"{r['expected_routed_experts']:.1f}", f"{r['routed_bytes'] / 1e6:.1f}",
                    f"{r['roofline_us']:.1f}",
                    f"{r.get('flop_roofline_us', 2 * r['m'] * r['n'] * r['k'] / BF16_FLOPS * 1e6):.1f}"]

        out += h.table(["model", "matrix", "phase", "M x N x K, G", "tile (m, n, k) / warps", "grid", "smem KB", "regs",
                        "spill B", "blocks/SM", "MMA", "routed experts", "routed MB", "HBM roofline us",
                        "FLOP roofline us"], [kernel_cells(r) for r in result["kernels"]])
        out += ["", f"Limits: {hw['shared_memory_per_block'] // 1024} KB shared memory per block by default, "
                f"{hw['shared_memory_per_block_optin'] // 1024} KB with opt-in; 64K registers per SM "
                "(255 per thread); blocks/SM: resident blocks allowed by registers, shared memory and threads. "
                "MMA as read from the PTX: the verify tiles (16 rows) use the warp-level `mma.sync` m16n8k16 "
                "(Hopper's `wgmma` needs 64-row warpgroup tiles), the prefill tiles (64 rows) use `wgmma` "
                "m64n128k16 with 160-162 KB of shared memory (over the 48 KB default, under the 227 KB opt-in) "
                "and one block per SM. FLOP roofline: 2 M N K at 989 TFLOP/s dense BF16 (H200 datasheet); the "
                "prefill is compute bound, the verify memory bound.", ""]
    if result.get("rounds"):
        out += ["## Rounds at real size (batch 1, 1024-token prompt, 8192-row cache, MXFP4 experts)", "",
                ]
        out += h.table(["model", "program", "arguments GiB", "outputs GiB", "aliased GiB", "temporaries GiB",
                        "peak GiB (of 131.3)", "GFLOP", "HLO bytes accessed GB", "compile s"],
                       [[r["model"], prog, gib(c["argument_bytes"]), gib(c["output_bytes"]), gib(c["alias_bytes"]),
                         gib(c["temp_bytes"]), gib(c["peak_bytes"]), f"{c['flops'] / 1e9:.1f}",
                         f"{c['bytes_accessed'] / GB:.2f}", f"{c['compile_seconds']:.0f}"]
                        for r in result["rounds"] for prog in ("verify", "draft") for c in (r[prog],)])
        out += ["", "Verify roofline and what it predicts (tokens/s = tau / (verify + draft), tau = tokens "
                "committed per round, not measured here):", "",
                ]
        out += h.table(["model", "weights GB (experts)", "routed experts / layer", "verify reads GB", "verify ms",
                        "verify ms (HLO bytes)", "draft ms", "tok/s tau=1", "tau=3", "tau=6",
                        "cost model: non-expert GB, verify ms / draft ms"],
                       [[r["model"], f"{r['weight_bytes'] / GB:.1f} ({r['expert_bytes'] / GB:.1f})",
                         f"{r['expected_routed_experts_per_layer']:.1f}", f"{r['verify_read_bytes'] / GB:.2f}",
                         f"{r['verify_roofline_ms']:.2f}", f"{r['verify_hlo_roofline_ms']:.1f}",
                         f"{r['draft_roofline_ms']:.2f}"]
                        + [f"{r['tokens_per_second'][t]:.0f}" for t in ("1.0", "3.0", "6.0")]
                        + [f"{r['cost_model']['non_expert_bytes'] / GB:.2f}, {r['cost_model']['verify_ms']:.2f} / "
                           f"{r['cost_model']['draft_ms']:.2f}"] for r in result["rounds"]])
        out += ["", NOTES["rounds"], ""]
    if result.get("rounds") and all(r["verify"].get("launches") for r in result["rounds"]):
        out += ["## How the rounds run on the GPU", "",
                "From XLA's thunk sequence after its passes (`tests/gpu_compile/deviceless.py`, `Launches`): kernel "
                "launches and device copies (each once, a loop's body once), those inside conditionals' branches, "
                "CUDA graphs (command buffers), the loops and conditionals the host drives (a predicate read back "
                "per trip or branch), and launches outside every graph.", ""]
        out += h.table(["model", "program", "kernels", "in conditionals", "graphs", "host loops",
                        "host conditionals", "launched alone"],
                       [[r["model"], PROGRAMS[prog]] + [r[prog]["launches"][k] for k in
                                              ("kernels", "in_conditionals", "graphs", "host_loops",
                                               "host_conditionals", "outside")]
                        for r in result["rounds"] for prog in ("verify", "verify_greedy", "draft")
                        if (r.get(prog) or {}).get("launches")])
        out += [""]
    if result.get("pairs"):
        pred = {(p["pair"], p["block"], p.get("program")): p for p in pair_predictions(result["pairs"])}
        out += ["## The shipped pairs' rounds (batch 1, 128-token prompt, FP4 experts through the kernel)", "",
                "One round (`spec.round.round_step`) of the chain at each block, compiled with the pair's own "
                "weights: the program of greedy rows (`SpecConfig.greedy_only`, what `prepare` gives a greedy batch "
                "on a GPU) and the one any rows may run. tau: tokens per round measured by `benchmarks/tiny_pair.py` "
                "(greedy: the same tokens on any backend). Prediction: tokens/s against the same program at block 1 "
                "were a round's time its kernel launches' (these tiny models are launch bound on a GPU), counting "
                "no conditional branch and every one.", ""]
        out += h.table(["pair", "block", "program", "kernels", "in conditionals", "graphs", "host loops",
                        "host conditionals", "launched alone", "tau", "predicted vs block 1"],
                       [[r["pair"], r["block"], r.get("program", "any rows")]
                        + [r["launches"][k] for k in ("kernels", "in_conditionals", "graphs", "host_loops",
                                                      "host_conditionals", "outside")]
                        + (["-", "-"] if (r["pair"], r["block"], r.get("program")) not in pred else
                           [f"{r['tau']:.2f}", span(pred[(r["pair"], r["block"], r.get("program"))])])
                        for r in result["pairs"]])
        out += [""]
    if result.get("offload"):
        out += ["## Offloaded layer-wise pieces (one width-16 verify block)", "",
                ]
        out += h.table(["model", "piece", "arguments MiB", "temporaries MiB", "peak MiB", "GFLOP", "HLO bytes MB",
                        "reads MB", "roofline us"],
                       [[r["model"], r["piece"], f"{r['argument_bytes'] / 2**20:.1f}", f"{r['temp_bytes'] / 2**20:.1f}",
                         f"{r['peak_bytes'] / 2**20:.1f}", f"{r['flops'] / 1e9:.2f}",
                         f"{r['bytes_accessed'] / 1e6:.1f}",
                         f"{r['read_bytes'] / 1e6:.1f}", f"{r['roofline_us']:.1f}"] for r in result["offload"]])
        out += ["", NOTES["offload"], ""]
    return out


def main(argv=None) -> int:
    ap = h.parser(__doc__, {
        "--kernel-only": (False, "the kernel at verify shapes only (what --quick runs)"),
        "--models": (None, "comma-separated subset of the models (default: all three)"),
        "--no-offload": (False, "skip the offloaded layer-wise pieces"),
        "--pairs": ("tiny_pair,tiny_pair_qwen3_5", "the shipped pairs whose rounds to compile (empty: none)"),
        "--render": (None, "only re-render the markdown from this JSON report")})
    args = h.parse(ap, argv, quick=dict(kernel_only=True))
    if args.render:
        result = json.loads(Path(args.render).read_text())
        if result.get("rounds"):
            from tests.gpu_compile import programs as pg

            result["rounds"] = [derive(pg, r) for r in result["rounds"]]
        if result.get("offload"):
            from tests.gpu_compile import programs as pg

            result["offload"] = [derive_piece(pg, r) for r in result["offload"]]
            (Path(args.out_dir) / "h200_compile.json").write_text(json.dumps(result, indent=1, default=float))
        h.Report(args, "h200_compile").markdown(markdown(result))
        return 0
    if not dl.plugin_available():
        raise SystemExit("needs the gpu-compile extra: pip install -e '.[gpu-compile]'")
    from tests.gpu_compile import programs as pg

    models = args.models.split(",") if args.models else list(pg.MODELS)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "jax": jax.__version__,
              "device": dl.H200, "hbm_bytes_per_s_source": "NVIDIA H200 Tensor Core GPU datasheet (4.8 TB/s, 141 GB)"}
    report = h.Report(args, "h200_compile")

    def write():  # after every section: a long run that fails late keeps what it compiled
        with open(report.path("json"), "w") as fh:
            json.dump(result, fh, indent=1, default=float)
        report.markdown(markdown(result))

    result["notes"] = NOTES
    result["kernels"] = kernel_rows(pg, ("verify",) if args.kernel_only else ("verify", "prefill"))
    write()
    if not args.kernel_only:
        result["rounds"] = round_rows(pg, models)
        write()
        if args.pairs:
            result["pairs"] = pair_rows([p for p in args.pairs.split(",") if p])
            write()
        if not args.no_offload:
            result["offload"] = offload_rows(pg, models)
            write()
    log(f"wrote {report.path('md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
