"""Offload budget sweep: tokens/s, bytes moved, hit rate and exposed transfer from the minimum expert budget to
all experts, plain decoding (AR) vs DFlash with each route-ahead predictor, one shared device expert cache.

  python benchmarks/offload_sweep.py [--checkpoint DIR | --work DIR] [--block 4] [--prompts 1] [--prompt-len 64]
                                     [--max-new 32] [--predictors none,previous,...] [--quick] [--out DIR | --write-docs]

Model: `--checkpoint DIR` (a converted pair), else the route-study pair trained by `benchmarks/route_ahead.py`
in `--work` (default route_study_work/) when it exists, else a random pair of the route-study pair's shape
(`train.tiny_pair.target_config(num_experts=64, top_k=4, expert_intermediate=32)`: Qwen3-MoE, 4 layers,
64 experts top-4 = the real targets' expert / top-k ratio; MXFP4 experts; planted draft agreement). A random
pair routes near uniformly: the worst case for caching.

Budgets (`--budgets`): "min" (one expert: every layer runs in passes of one expert), "half-union" (half of one
layer's routed union in one verify block: the largest layers run in two passes), "union" (one layer's union),
then fractions of all experts' bytes (0.25, 0.5, 0.75, 1.0). At each budget: AR (block 1, no prediction) and
DFlash at `--block` with each predictor, plus DFlash with hybrid placement (missing experts computed on the
host when `offload.hybrid.HostCompute`, measured here, says so). Every run's tokens are asserted equal to the
resident run's (AR: plain greedy; DFlash: the resident speculative run). A configuration that needs programs
not compiled yet (a new cache size or predictor) is served once untimed first; the best of `--repeats` timed
runs is the row.

Per row: tokens/s (this machine: on a CPU both memories are host RAM, so tokens/s measures the stepping
loop's dispatch and the passes, not a PCIe link), MB moved per generated token, hit rate (routed experts
resident when their layer ran), passes per layer and round, and the exposed-transfer estimate: copy time at
the measured host->device bandwidth not hidden behind the prefetch windows (`offload.stats`), per token, plus
the same bytes at an H200 + PCIe 5 link (58 GB/s, `study.cost_model`). Writes offload_sweep.json /
offload_sweep.md / offload_sweep.png to --out (default bench_out/) or, with --write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
import time

import numpy as np

import harness as h

H200_PCIE5 = 58e9  # host->device bytes/s of the cost model's H200 + PCIe 5 host (study.cost_model.HARDWARE)
log = h.logger("offload_sweep")


def load_pair(args):
    """(pair, prompts, description)."""
    import dflash_jax
    from dflash_jax import testing
    from dflash_jax.train.tiny_pair import target_config

    directory = args.checkpoint or os.path.join(args.work, "pair")
    rng = np.random.default_rng(args.seed)
    if os.path.exists(os.path.join(directory, "manifest.json")):
        pair = dflash_jax.load(directory)
        if os.path.exists(os.path.join(directory, "split.json")):
            return pair, h.prompts(pair, args.prompts, args.prompt_len, args.seed), \
                f"converted pair ({os.path.basename(os.path.normpath(directory))}), held-out text"
        desc = "converted pair, random prompts"
    else:
        cfg = target_config(num_experts=64, top_k=4, expert_intermediate=32)
        pair = testing.random_pair(cfg, seed=args.seed, expert_format="mxfp4")
        desc = "random pair of the route-study shape (4 layers, 64 experts top-4, MXFP4), random prompts"
    prompts = [rng.integers(0, pair.target_cfg.vocab_size - 2, args.prompt_len).tolist() for _ in range(args.prompts)]
    return pair, prompts, desc


def budgets(store, union: int, spec: str) -> list[tuple[str, int]]:
    eb = store.expert_bytes(store.layer_ids[0])
    out = []
    for item in spec.split(","):
        if item == "min":
            out.append(("min", eb))
        elif item == "half-union":
            out.append(("half-union", max(1, union // 2) * eb))
        elif item == "union":
            out.append(("union", union * eb))
        else:
            out.append((f"{float(item):.0%}", int(float(item) * store.total_bytes)))
    seen, unique = set(), []
    for label, b in out:
        if b not in seen:
            seen.add(b)
            unique.append((label, b))
    return unique


def row_of(result, *, mode, label, budget, predictor, placement, seconds, layers) -> dict:
    s = result.stats
    ra = s["route_ahead"]["summary"]
    tokens = int(sum(len(t) for t in result.tokens))
    rounds = max(1, ra["rounds"])
    return dict(
        mode=mode, budget=label, budget_mb=budget / 1e6, cache_mb=s["offload"]["pool_bytes"] / 1e6,
        predictor=predictor, placement=placement, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
        mean_acceptance=s["mean_acceptance"], rounds=ra["rounds"], hit_rate=ra["hit_rate"], coverage=ra["coverage"],
        waste=ra["waste"], mb_moved_per_token=ra["bytes_moved"] / 1e6 / tokens,
        prefetched_mb=ra["prefetched_bytes"] / 1e6, on_demand_mb=ra["on_demand_bytes"] / 1e6,
        host_experts=ra["host"], passes_per_layer_round=ra["passes"] / (rounds * layers),
        exposed_transfer_ms_per_token=ra["exposed_transfer_s"] * 1e3 / tokens,
        h200_pcie5_transfer_ms_per_token=ra["bytes_moved"] / H200_PCIE5 * 1e3 / tokens,
        pinned=sum(s["offload"]["pinned_per_layer"].values()), lossless=True)


def main(argv=None) -> int:
    p = h.parser(__doc__, {
        "--work": ("route_study_work", "the route-study pair's work dir, used when trained"),
        "--block": (4, "DFlash verify width"), "--budgets": "min,half-union,union,0.25,0.5,1.0",
        "--predictors": "none,previous,draft_router,residual",
        "--hybrid-predictor": ("previous", "predictor of the hybrid-placement DFlash rows")},
        checkpoint=None, prompts=1, prompt_len=64, max_new=24, repeats=3, seed=0)
    args = h.parse(p, argv, quick=dict(prompt_len=16, max_new=4, budgets="min,1.0", predictors="none,previous",
                                       repeats=1))
    if args.block < 2:
        p.error("--block must be >= 2")

    import jax

    from dflash_jax.offload import HostExpertStore, OffloadedGenerator
    from dflash_jax.offload.bandwidth import probe_host_to_device_bandwidth
    from dflash_jax.offload.hybrid import HostCompute
    from dflash_jax.spec import generate

    t_all = time.perf_counter()
    pair, prompts, desc = load_pair(args)
    cfg = pair.target_cfg
    store = HostExpertStore(pair.target)
    layers = len(store.layer_ids)
    bandwidth = probe_host_to_device_bandwidth()
    host = HostCompute.measure(bandwidth)
    kw = dict(max_new_tokens=args.max_new, stop_ids=())
    log(f"{desc}; {layers} MoE layers x {store.num_experts} experts top-{cfg.moe.top_k}, "
         f"{store.expert_bytes(store.layer_ids[0])} bytes per expert, {store.total_bytes / 1e6:.2f} MB in all; "
         f"link {bandwidth / 1e9:.1f} GB/s")
    want = {1: generate(pair, prompts, block_size=1, **kw).tokens,
            args.block: generate(pair, prompts, block_size=args.block, **kw).tokens}
    # one layer's routed union in one verify block: the most distinct experts a layer reads at once
    probe = OffloadedGenerator(pair, budget_bytes=store.total_bytes, block_size=args.block, store=store,
                               bandwidth=bandwidth).generate(prompts, **kw)
    union = max(s.routed for r in probe.route_ahead.rounds for s in r.layers)
    grid = budgets(store, union, args.budgets)
    predictors = [x for x in args.predictors.split(",") if x]
    runs = [(b, "AR", 1, "none", None) for b in grid]
    runs += [(b, "DFlash", args.block, name, None) for b in grid for name in predictors]
    runs += [(b, "DFlash", args.block, args.hybrid_predictor, host) for b in grid if b[1] < store.total_bytes]
    rows, warmed = [], set()
    for i, ((label, budget), mode, block, predictor, hybrid) in enumerate(runs):
        gen = OffloadedGenerator(pair, budget_bytes=budget, prefetcher=predictor, block_size=block, store=store,
                                 bandwidth=bandwidth, hybrid=hybrid)
        # compiled programs are shared by generators: the cache's shape (budget) and the predictor's programs
        # compile once; a configuration that brings either new is served once untimed first
        keys = {("budget", budget, block), ("predictor", predictor, block, hybrid is not None)}
        if not keys <= warmed:
            gen.generate(prompts, **kw)
            warmed |= keys
        last = {}  # the best of the timed runs: this machine is shared
        seconds = h.paired_runs({"run": lambda: gen.generate(prompts, **kw)}, args.repeats,
                                on_run=lambda m, r, res: last.update(result=res)).stat("run")
        result = last["result"]
        assert result.tokens == want[block], f"not lossless: {mode} {label} {predictor}"
        row = row_of(result, mode=mode, label=label, budget=budget, predictor=predictor,
                     placement="hybrid" if hybrid else "device", seconds=seconds, layers=layers)
        rows.append(row)
        log(f"[{i + 1}/{len(runs)}] {mode:6s} {label:>10s} ({budget / 1e6:.3f} MB) {predictor:17s} "
             f"{row['placement']:6s}: {row['tokens_per_s']:.1f} tok/s, {row['mb_moved_per_token']:.3f} MB/token, "
             f"hit {row['hit_rate']:.2f}, passes {row['passes_per_layer_round']:.2f}, lossless")
    result = dict(
        benchmark="offload_sweep", model=desc, backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
        machine=platform.machine(), moe_layers=layers, experts=store.num_experts, top_k=cfg.moe.top_k,
        expert_bytes=store.expert_bytes(store.layer_ids[0]), all_experts_mb=store.total_bytes / 1e6,
        one_layer_union=union, block=args.block, prompts=len(prompts), prompt_len=args.prompt_len,
        max_new=args.max_new, repeats=args.repeats, link_bytes_per_s=bandwidth, host_compute=dict(host.__dict__),
        seconds=time.perf_counter() - t_all, rows=rows)
    h.Report(args, "offload_sweep").write(result, markdown(result), draw=functools.partial(draw, result), ncols=2,
                                          figsize=(12, 4.5), image="tokens/s and MB moved per token by budget")
    log(f"done in {result['seconds']:.0f} s")
    return 0


def markdown(r: dict) -> list[str]:
    lines = [
        "# Offload budget sweep (one shared expert cache)", "",
        f"`benchmarks/offload_sweep.py`; {r['model']}; {r['moe_layers']} MoE layers x {r['experts']} experts "
        f"top-{r['top_k']}, {r['expert_bytes']} bytes per expert, {r['all_experts_mb']:.2f} MB of experts; one "
        f"layer's routed union in one block of {r['block']}: {r['one_layer_union']} experts. {r['prompts']} prompt "
        f"x {r['prompt_len']} tokens, {r['max_new']} new tokens; backend {r['backend']} ({r['machine']}); measured "
        f"link {r['link_bytes_per_s'] / 1e9:.1f} GB/s. Every row's tokens equal the resident run's (asserted). "
        f"Sweep time {r['seconds']:.0f} s.", "",
        "tok/s on this machine measure the stepping loop and the passes (both memories are host RAM); the "
        "exposed-transfer columns are estimates from the bytes: at the measured link, what the prefetch windows "
        "did not hide, and all bytes moved at an H200 + PCIe 5 link (58 GB/s). On the CPU backend the grouped "
        "matmul is a dense dot over every slot of the cache's slab, so large budgets cost compute here (a GPU "
        "kernel skips empty groups).", "", "## Best DFlash predictor vs AR per budget", ""]
    by_budget: dict = {}
    for row in r["rows"]:
        by_budget.setdefault(row["budget"], []).append(row)
    best_rows = []
    for label, rows in by_budget.items():
        ar = next((x for x in rows if x["mode"] == "AR"), None)
        df = [x for x in rows if x["mode"] == "DFlash" and x["placement"] == "device"]
        if ar is not None and df:
            best = max(df, key=lambda x: x["tokens_per_s"])
            best_rows.append([label, f"{ar['budget_mb']:.3f}", f"{ar['tokens_per_s']:.1f}",
                              f"{ar['mb_moved_per_token']:.3f}", f"{best['tokens_per_s']:.1f} ({best['predictor']})",
                              f"{best['mb_moved_per_token']:.3f}", f"{best['hit_rate']:.2f}",
                              f"{best['passes_per_layer_round']:.2f}", f"{best['mean_acceptance']:.2f}"])
    lines += h.table(["budget", "MB", "AR tok/s", "AR MB/token", "DFlash tok/s (predictor)", "DFlash MB/token",
                      "DFlash hit rate", "DFlash passes / layer", "tau"], best_rows)
    lines += ["", "## Every run", ""]
    lines += h.table(["mode", "budget", "MB", "predictor", "placement", "tok/s", "tau", "MB/token", "hit rate",
                      "coverage", "waste", "host experts", "passes / layer", "exposed ms/token (measured link)",
                      "ms/token at PCIe 5"],
                     [[x["mode"], x["budget"], f"{x['budget_mb']:.3f}", x["predictor"], x["placement"],
                       f"{x['tokens_per_s']:.1f}", f"{x['mean_acceptance']:.2f}", f"{x['mb_moved_per_token']:.3f}",
                       f"{x['hit_rate']:.2f}", f"{x['coverage']:.2f}", f"{x['waste']:.2f}", x["host_experts"],
                       f"{x['passes_per_layer_round']:.2f}", f"{x['exposed_transfer_ms_per_token']:.3f}",
                       f"{x['h200_pcie5_transfer_ms_per_token']:.4f}"] for x in r["rows"]])
    return lines


def draw(r: dict, axes) -> None:
    a, b = axes
    series: dict = {}
    for x in r["rows"]:
        name = "AR" if x["mode"] == "AR" else f"DFlash {x['predictor']}" + (" hybrid" if x["placement"] == "hybrid"
                                                                            else "")
        series.setdefault(name, []).append(x)
    for name, rows in series.items():
        rows = sorted(rows, key=lambda x: x["budget_mb"])
        mb = [x["budget_mb"] for x in rows]
        style = dict(marker="o", lw=2.2, color="black") if name == "AR" else dict(marker=".", lw=1.2)
        a.plot(mb, [x["tokens_per_s"] for x in rows], label=name, **style)
        b.plot(mb, [x["mb_moved_per_token"] for x in rows], label=name, **style)
    for ax, ylabel in ((a, "tokens/s (this machine)"), (b, "MB moved per generated token")):
        ax.set_xscale("log")
        ax.set_xlabel("expert cache budget (MB, log)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    b.legend(fontsize=7)
    a.figure.suptitle(f"Offload budget sweep: {r['moe_layers']} layers x {r['experts']} experts top-{r['top_k']}, "
                      f"block {r['block']} ({r['backend']})", fontsize=10)


if __name__ == "__main__":
    sys.exit(main())
