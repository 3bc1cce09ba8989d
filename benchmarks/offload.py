"""Offload benchmark: B0-B3 x expert budget x block size x predictor, one JSON row per run.

  python benchmarks/offload.py [--checkpoint DIR] [--prompts 2] [--prompt-len 64] [--max-new 48]
                               [--blocks 1,4,8] [--budgets 0.25,0.5,1.0] [--predictors ...] [--tag NAME]
                               [--quick] [--out DIR | --write-docs]

  B0  all experts resident: `spec.generate_stepping` (and the jitted `spec.generate`) at each block size
  B1  block 1, experts offloaded, on-demand fetch (`offload.OffloadedGenerator`, prefetcher "none")
  B2  block B, offloaded, on-demand fetch only
  B3  block B, offloaded, route-ahead prefetch issued before the verify, for each predictor
Budgets are fractions of all routed experts' bytes (cache slots = fraction x E x MoE layers). Every offloaded
output is checked equal to the resident output (`lossless` in each row). Also measured: the per-layer cost
of the layer-wise verify (a full cache verified layer by layer vs in one program) and the host->device
bandwidth of this machine.

Model: `--checkpoint DIR` (a convert-weights pair; held-out prompts when it has split.json, as
benchmarks/tiny_pair.py), else a random agreeable Qwen3-MoE pair (`dflash_jax.testing.random_pair`, 32
experts top-2, 4 layers) with random prompts. Runs on whatever backend JAX picks (CPU here; a GPU if
present). Appends rows to offload.jsonl and rewrites offload.md from all of them, in --out (default bench_out/) or,
with --write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import json
import os
import platform

import numpy as np

import harness as h


def learned_predictor(pair, args, train_prompts):
    """Trains `train.route_predictor` on rounds over `train_prompts`; returns (LearnedRouter, info)."""
    from dflash_jax.offload.predictors import LearnedRouter
    from dflash_jax.offload.route_model import init_from_target
    from dflash_jax.train.route_predictor import train_route_predictor
    from study.rounds import collect_route_data

    block = max(int(b) for b in args.blocks.split(","))
    hidden, targets, layers = collect_route_data(pair, train_prompts, block_size=block, max_new_tokens=args.max_new)
    params, losses = train_route_predictor(init_from_target(pair.target, layers), hidden, targets,
                                           eps=pair.target_cfg.rms_norm_eps, steps=args.learned_steps)
    info = dict(train_rows=int(hidden.shape[0]), loss_first=losses[0], loss_last=losses[-1])
    return LearnedRouter(params, layers, eps=pair.target_cfg.rms_norm_eps), info


def verify_overhead(pair, store, prompts, block: int, repeats: int = 30) -> dict:
    """Best-of-`repeats` wall time of one width-`block` verify on a cache holding every expert: as ONE jitted
    program (`qwen3.forward` with the cache) vs layer by layer (`offload.forward.forward_layerwise`); the difference
    per MoE layer is the layer-wise verify's own cost (dispatch + routing read + host bookkeeping)."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.models import qwen3
    from dflash_jax.offload import ExpertCache
    from dflash_jax.offload.forward import ExpertOperands, forward_layerwise
    from dflash_jax.offload.store import strip_experts

    cfg = pair.target_cfg
    expert_cache = ExpertCache(store, store.total_bytes,
                               pinned={l: np.arange(store.num_experts) for l in store.layer_ids})
    stripped = strip_experts(pair.target)
    tokens = jnp.asarray([prompts[0]], jnp.int32)
    cache = qwen3.forward_jit(pair.target, tokens, qwen3.init_cache(cfg, 1, tokens.shape[1] + block), cfg).cache
    blk = tokens[:, :block]
    pooled = expert_cache.pooled_weights(stripped)

    def provide(layer, experts):
        return ExpertOperands(expert_cache.operands(layer), expert_cache.slot_table(layer),
                              expert_cache.resident(layer))

    runs = {
        "single": lambda: qwen3.forward_jit(pooled, blk, cache, cfg).logits,
        "layerwise": lambda: forward_layerwise(stripped, blk, cache, cfg, provider=provide).out.logits,
    }
    runs = {name: (lambda fn=fn: jax.block_until_ready(fn())) for name, fn in runs.items()}
    for fn in runs.values():
        fn()  # compiles
    t = h.paired_runs(runs, repeats)
    best = {name: t.stat(name) for name in runs}
    layers = len(store.layer_ids)
    return dict(single_ms=best["single"] * 1e3, layerwise_ms=best["layerwise"] * 1e3,
                per_layer_overhead_ms=(best["layerwise"] - best["single"]) * 1e3 / layers)


def overlap(pair, store, prompts, *, block: int, experts: int, repeats: int = 5) -> dict:
    """Whether host->device expert copies issued ahead run while the device computes (the measurement hook for
    a GPU; on a CPU both are host work and nothing overlaps). Best of `repeats` wall times of
      copy:    `experts` expert copies into a shared `ExpertCache` (transfer="device_put": host row buffers
               `jax.device_put` to the device, then written into the slab), alone;
      compute: one width-`block` verify on a cache holding every expert (one program), alone;
      both:    the copies issued, then the verify dispatched at once, waiting for both.
    overlap = (copy + compute - both) / min(copy, compute): 1 = the shorter one fully hidden, 0 = serialized.
    Also the same with transfer="pull_rows" (the jitted copy on the compute stream)."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.models.family import family_of
    from dflash_jax.offload import ExpertCache
    from dflash_jax.offload.store import strip_experts
    from dflash_jax.spec.session import init_target_cache

    cfg = pair.target_cfg
    e = store.num_experts
    full = ExpertCache(store, store.total_bytes, pinned={l: np.arange(e) for l in store.layer_ids})
    weights = full.pooled_weights(strip_experts(pair.target))
    fam = family_of(cfg)
    fam_forward = jax.jit(lambda w, t, c: fam.forward(w, t, c, cfg).logits)
    tokens = jnp.asarray(np.asarray(prompts[0][:block])[None, :], jnp.int32)
    cache = init_target_cache(cfg, 1, 256, pair.target.embed.dtype, verify_width=block)
    jax.block_until_ready(fam_forward(weights, tokens, cache))
    eb = store.expert_bytes(store.layer_ids[0])
    layer = store.layer_ids[-1]
    out = {}
    for transfer in ("device_put", "pull_rows"):
        target = ExpertCache(store, (experts + 1) * eb, transfer=transfer)
        rng = np.random.default_rng(0)

        def copies():
            target.fetch(layer, rng.choice(e, experts, replace=False))
            target.block_until_ready()

        def both():
            target.fetch(layer, rng.choice(e, experts, replace=False))
            logits = fam_forward(weights, tokens, cache)
            target.block_until_ready()
            jax.block_until_ready(logits)

        copies()  # compiles the copy programs
        def compute():
            jax.block_until_ready(fam_forward(weights, tokens, cache))

        t = h.paired_runs({"copy": copies, "compute": compute, "both": both}, repeats, alternate=False)
        best = {k: t.stat(k) for k in t.modes}
        hidden = best["copy"] + best["compute"] - best["both"]
        out[transfer] = dict({f"{k}_ms": v * 1e3 for k, v in best.items()},
                             overlap=hidden / min(best["copy"], best["compute"]), copied_bytes=experts * eb)
    return out


def overlap_main(args) -> int:
    import jax

    from dflash_jax.offload import HostExpertStore

    pair, prompts, source, _ = load_model(args)
    store = HostExpertStore(pair.target)
    block = max(int(b) for b in args.blocks.split(","))
    row = dict(mode="overlap", tag=args.tag, backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
               model=args.checkpoint or "random", block=block,
               **overlap(pair, store, prompts, block=block, experts=min(store.num_experts - 1, 16)))
    print(json.dumps(row), flush=True)
    with open(os.path.join(args.out_dir, "offload.jsonl"), "a") as fh:
        fh.write(json.dumps(row) + "\n")
    return 0


def run_offloaded(pair, prompts, *, budget_bytes, block, **policy):
    """One offloaded configuration: an `OffloadedGenerator` serves the request twice, the first run compiles
    (its programs are the second's), the second is the row."""
    from dflash_jax.offload import OffloadedGenerator

    request = {k: policy.pop(k) for k in ("max_new_tokens", "stop_ids")}
    gen = OffloadedGenerator(pair, budget_bytes=budget_bytes, block_size=block, **policy)
    gen.generate(prompts, **request)
    return gen.generate(prompts, **request)


def load_model(args):
    import dflash_jax
    from dflash_jax import testing
    from dflash_jax.config import MoEConfig

    if args.checkpoint:
        pair = dflash_jax.load(args.checkpoint)  # resident for B0; the offloaded runs copy experts to pinned host
        if os.path.exists(os.path.join(pair.directory, "split.json")):
            train = h.prompts(pair, args.train_prompts, args.prompt_len, args.seed + 1, split="train")
            return (pair, h.prompts(pair, args.prompts, args.prompt_len, args.seed), "held-out stdlib text", train)
        source = "random token prompts"
    else:
        cfg = testing.tiny_qwen3_moe_config(
            moe=MoEConfig(num_experts=32, top_k=2, intermediate_size=64, norm_topk_prob=True),
            max_position_embeddings=4096)
        pair = testing.random_pair(cfg, seed=args.seed, expert_format=args.expert_format)
        source = "random token prompts"
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, pair.target_cfg.vocab_size - 1, args.prompt_len).tolist()
               for _ in range(args.prompts + args.train_prompts)]
    return pair, prompts[: args.prompts], source, prompts[args.prompts:]


def summarize(result, reference, extra) -> dict:
    s = result.stats
    row = dict(extra)
    row.update(tokens=int(sum(len(t) for t in result.tokens)), seconds=s["seconds"],
               tokens_per_s=sum(len(t) for t in result.tokens) / s["seconds"], mean_acceptance=s["mean_acceptance"],
               rounds=s["rounds"], lossless=result.tokens == reference)
    if "time_split" in s:
        row.update({k: v for k, v in s["time_split"].items()})
    if "route_ahead" in s:
        ra = s["route_ahead"]["summary"]
        off = s["offload"]
        row.update(slots=off["cache_slots"], pool_bytes=off["pool_bytes"],
                   pinned=sum(off["pinned_per_layer"].values()),
                   coverage=ra["coverage"], waste=ra["waste"], hit_rate=ra["hit_rate"], bytes_moved=ra["bytes_moved"],
                   on_demand_bytes=ra["on_demand_bytes"], prefetched_bytes=ra["prefetched_bytes"],
                   bytes_per_token=ra["bytes_moved"] / max(1, row["tokens"]),
                   exposed_transfer_s=ra["exposed_transfer_s"], hide_window_s=ra["hide_window_s"],
                   prefetch_transfer_s=ra["prefetch_transfer_s"], on_demand_transfer_s=ra["on_demand_transfer_s"],
                   rounds_without_misses=ra["rounds_without_misses"],
                   # mean set sizes per layer and round; a random guess of |P| experts covers |P| / E on average
                   mean_predicted=ra["predicted"] / max(1, ra["rounds"] * off["moe_layers"]),
                   mean_routed=ra["routed"] / max(1, ra["rounds"] * off["moe_layers"]),
                   random_coverage=ra["predicted"] / max(1, ra["rounds"] * off["moe_layers"]) / off["num_experts"],
                   # what an in-jit fetch with static shapes would move: every round, every layer, the cache reserve
                   static_fetch_bytes=ra["rounds"] * off["moe_layers"] * off["cache_reserve"]
                   * (off["expert_bytes_all"] // (off["moe_layers"] * off["num_experts"])))
    return row


def main(argv=None) -> int:
    p = h.parser(__doc__, {
        "--budgets": "0.25,0.5,1.0", "--predictors": "previous,draft_router,previous+draft_router",
        "--widths": ("", "extra predictor widths (experts per token) for B3, e.g. 4"),
        "--expert-format": ("mxfp4", None, ("dense", "mxfp4", "nvfp4")), "--tag": "cpu-random",
        "--learned": (False, "also train the learned linear route predictor (on --train-prompts other prompts) and "
                             "run it"),
        "--train-prompts": 16, "--learned-steps": 300,
        "--overlap": (False, "only measure whether expert copies issued ahead overlap the verify's compute (for a "
                             "GPU): prints one JSON row and appends it to offload.jsonl")},
        checkpoint=None, prompts=2, prompt_len=64, max_new=48, blocks="1,4,8", seed=0)
    args = h.parse(p, argv, quick=dict(prompts=1, prompt_len=16, max_new=4, blocks="1,4", budgets="0.5",
                                       predictors="previous", train_prompts=1, tag="quick"))
    if args.overlap:
        return overlap_main(args)

    import jax

    from dflash_jax.offload import HostExpertStore
    from dflash_jax.offload.bandwidth import probe_host_to_device_bandwidth
    from dflash_jax.spec import generate, generate_stepping

    pair, prompts, source, train_prompts = load_model(args)
    cfg = pair.target_cfg
    store = HostExpertStore(pair.target)
    per_slot = sum(store.expert_bytes(layer) for layer in store.layer_ids)
    num_experts = store.num_experts
    bandwidth = probe_host_to_device_bandwidth()
    blocks = [int(b) for b in args.blocks.split(",")]
    budgets = [float(b) for b in args.budgets.split(",")]
    predictors = [x for x in args.predictors.split(",") if x]
    learned_info = {}
    if args.learned:
        from dflash_jax.offload.predictors import PreviousRound, Union

        learned, learned_info = learned_predictor(pair, args, train_prompts)
        predictors += [learned, Union(PreviousRound(), learned)]
    widths = [None] + [int(w) for w in args.widths.split(",") if w]
    env = dict(tag=args.tag, backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
               machine=platform.machine(), model=(args.checkpoint or "random"), prompts=len(prompts),
               prompt_len=args.prompt_len, max_new=args.max_new, experts=num_experts, top_k=cfg.moe.top_k,
               moe_layers=len(store.layer_ids), expert_bytes=per_slot // len(store.layer_ids),
               expert_format=pair.expert_format, bandwidth=bandwidth, prompt_source=source)
    rows = []

    def emit(row):
        row = dict(env, **row)
        rows.append(row)
        print(json.dumps(row), flush=True)

    kw = dict(max_new_tokens=args.max_new, stop_ids=())
    for block in blocks:
        generate_stepping(pair, prompts, block_size=block, **kw)  # compile (its own warmup uses other shapes)
        b0 = generate_stepping(pair, prompts, block_size=block, **kw)
        reference = b0.tokens
        emit(summarize(b0, reference, dict(mode="B0", loop="stepping", block=block, budget=1.0, predictor="-")))
        b0j = generate(pair, prompts, block_size=block, warmup=True, **kw)
        emit(summarize(b0j, reference, dict(mode="B0", loop="jit", block=block, budget=1.0, predictor="-")))
        for frac in budgets:
            budget = int(round(frac * num_experts)) * per_slot
            runs = [("B1" if block == 1 else "B2", "none", None)]
            if block > 1:
                runs += [("B3", name, w) for name in predictors for w in widths
                         if isinstance(name, str) or w is None]
            for mode, name, width in runs:
                label = name if isinstance(name, str) else name.name
                try:
                    r = run_offloaded(pair, prompts, budget_bytes=budget, prefetcher=name, width=width, block=block,
                                      store=store, bandwidth=bandwidth, **kw)
                except Exception as e:  # a budget below one block's routed union per layer
                    emit(dict(mode=mode, loop="offloaded", block=block, budget=frac, predictor=label, width=width,
                              error=f"{type(e).__name__}: {e}"))
                    continue
                emit(summarize(r, reference, dict(mode=mode, loop="offloaded", block=block, budget=frac,
                                                  predictor=label, width=width or cfg.moe.top_k,
                                                  **({"learned": learned_info} if "learned" in label else {}))))
        emit(dict(mode="verify-overhead", loop="-", block=block, budget=1.0, predictor="-",
                  **verify_overhead(pair, store, prompts, block)))
        if block > 1:  # the layer-wise verify's own cost: a full pool, layer by layer vs one program
            budget = num_experts * per_slot
            lw = run_offloaded(pair, prompts, budget_bytes=budget, block=block, store=store, bandwidth=bandwidth,
                               verify="layerwise", **kw)
            emit(summarize(lw, reference, dict(mode="B2-layerwise-full", loop="offloaded", block=block, budget=1.0,
                                               predictor="none")))
    report = h.Report(args, "offload")
    with open(report.path("jsonl"), "a") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    report.markdown(markdown(report.path("jsonl")))
    return 0


def _fmt(v, spec=".2f"):
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _sizes(r) -> str:
    if "mean_predicted" not in r:
        return "-"
    return f"{r['mean_predicted']:.1f} / {r['mean_routed']:.1f}"


def markdown(jsonl: str) -> list[str]:
    with open(jsonl) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    tags = []
    for r in rows:
        if r["tag"] not in tags:
            tags.append(r["tag"])
    out = ["# Offload benchmark: B0-B3", "",
           "Generated by `python benchmarks/offload.py` (rows in `offload.jsonl`, one JSON object per run). B0: all "
           "experts resident; B1: plain decoding, experts offloaded, on-demand fetch; B2: DFlash, on-demand only; "
           "B3: DFlash with route-ahead prefetch issued before the verify. `budget` = fraction of all routed experts "
           "the device pool holds. `lossless` = output identical to B0's. `MB moved/tok` = host->device expert bytes "
           "per generated token; `exposed s` = estimated transfer time not hidden behind the prefetch window at the "
           "measured bandwidth (`offload.stats`). `mean P / R`: mean predicted / routed experts per layer and round; "
           "`random cov.` = mean P / E, the coverage a uniformly random guess of the same size would get. On the "
           "CPU backend \"device\" and \"pinned_host\" are both host RAM, so tokens/s show the loop's compute and "
           "host overheads, not a PCIe link; bytes, coverage, waste and hit rates are backend independent.", ""]
    for tag in tags:
        sub = [r for r in rows if r["tag"] == tag]
        e = sub[-1]
        out += [f"## {tag}", "",
                f"{e['backend']} ({e['device']}), model {e['model']}: {e['moe_layers']} MoE layers x {e['experts']} "
                f"experts top-{e['top_k']}, {e['expert_bytes']} B per expert ({e['expert_format']}); "
                f"{e['prompts']} prompts x {e['prompt_len']} tokens ({e['prompt_source']}), {e['max_new']} new "
                f"tokens each; measured host->device bandwidth {e['bandwidth'] / 1e9:.2f} GB/s.", ""]

        def cells(r):
            if "error" in r:
                return [r["mode"], r["block"], r["budget"], r["predictor"]] + ["-"] * 11 + [r["error"][:60]]
            off, pred = "coverage" in r, "coverage" in r and r["predictor"] != "none"
            return [r["mode"] + (" (jit)" if r["loop"] == "jit" else ""), r["block"], r["budget"], r["predictor"],
                    _fmt(r.get("width")), f"{r['tokens_per_s']:.1f}", f"{r['mean_acceptance']:.2f}",
                    _fmt(r.get("hit_rate")) if off else "-", _fmt(r.get("coverage")) if pred else "-",
                    _fmt(r.get("waste")) if pred else "-", _sizes(r) if pred else "-",
                    _fmt(r.get("random_coverage")) if pred else "-",
                    _fmt(r["bytes_per_token"] / 1e6, ".3f") if off else "-",
                    _fmt(r.get("exposed_transfer_s"), ".4f") if off else "-", _fmt(r.get("verify_s"), ".3f"),
                    r["lossless"]]

        out += h.table(["mode", "block", "budget", "predictor", "width", "tok/s", "tau", "hit rate", "coverage",
                        "waste", "mean P / R", "random cov.", "MB moved/tok", "exposed s", "verify s", "lossless"],
                       [cells(r) for r in sub if r["mode"] != "verify-overhead"])
        overhead = [r for r in sub if r["mode"] == "verify-overhead"]
        if overhead:
            out += ["", "Cost of the layer-wise verify (best of 30, full pool, batch 1): one jitted program vs layer "
                    "by layer.", ""]
            out += h.table(["block", "one program ms", "layer-wise ms", "overhead per MoE layer ms"],
                           [[r["block"], f"{r['single_ms']:.2f}", f"{r['layerwise_ms']:.2f}",
                             f"{r['per_layer_overhead_ms']:.2f}"] for r in overhead])
        out.append("")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
