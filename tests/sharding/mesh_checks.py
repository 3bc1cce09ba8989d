"""Mesh checks run in a process of their own (8 CPU devices need XLA_FLAGS before jax starts).

  python mesh_checks.py OUT_JSON FAMILY:MESH[:sample][:a2a] ...     (generate, `run_case`)
  python mesh_checks.py OUT_JSON FAMILY:MESH:engine|tree|offload ... (`engine_run`, `tree_run`, `offload_run`)

For each case: the family's tiny random pair (`case_pair`), greedy and (with `:sample`) sampled generation
from fixed prompts and seeds, once on one device and once on the mesh (`run_case`); the JSON holds both
token lists, the acceptance lengths (`:a2a`: every MoE layer on the all-to-all dispatch), and what the mesh did to the weights (the expert table's local rows on
device 0, the attention q projection's local columns). A first `moe` check compares
`nn.moe.swiglu_experts` under each mesh with the default path on FP4 and dense tables, gpt-oss biases
included, and records the collectives in its compiled HLO.
"""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dflash_jax import testing as T  # noqa: E402
from dflash_jax.spec.loop import generate  # noqa: E402
from dflash_jax.spec.sampling import SamplingParams  # noqa: E402

CASE_PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
MAX_NEW, BLOCK = 16, 4
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95)
FAMILIES = {
    # gpt-oss experts in MXFP4 (the release's format), Qwen3 / Qwen3.5 dense and NVFP4 on some cases
    "qwen3": (T.tiny_qwen3_moe_config, "dense"),
    "qwen3_nvfp4": (T.tiny_qwen3_moe_config, "nvfp4"),
    "gpt_oss": (T.tiny_gpt_oss_config, "mxfp4"),
    "qwen3_5": (T.tiny_qwen3_5_config, "dense"),
}


def case_pair(family: str):
    make_cfg, expert_format = FAMILIES[family]
    return T.random_pair(make_cfg(), seed=0, expert_format=expert_format)


def _generate(pair, prompts, sampling):
    out = generate(pair, prompts, max_new_tokens=MAX_NEW, block_size=BLOCK, sampling=sampling, seed=11)
    return {"tokens": out.tokens, "acceptance": out.acceptance_lengths}


def run_case(pair, mesh, prompts, *, sample: bool = True, dispatch: str | None = None) -> dict:
    """Generation of `pair` on `mesh` (greedy, and sampled with a fixed seed); `dispatch` forces the MoE
    dispatch of every layer (`nn.moe.choose_dispatch` reads DFLASH_MOE_DISPATCH when it traces; jax's caches
    are cleared around the case so no program traced under another dispatch is reused)."""
    if dispatch is not None:
        jax.clear_caches()
        os.environ["DFLASH_MOE_DISPATCH"] = dispatch
        try:
            return run_case(pair, mesh, prompts, sample=sample)
        finally:
            del os.environ["DFLASH_MOE_DISPATCH"]
            jax.clear_caches()
    from dflash_jax.sharding import shard_pair

    placed = shard_pair(pair, mesh)
    moe = next(layer.mlp for layer in placed.target.layers if hasattr(layer.mlp, "gate_up"))
    table = jax.tree.leaves(moe.gate_up)[0]
    result = {"expert_rows_per_device": int(table.addressable_shards[0].data.shape[0]),
              "experts": int(table.shape[0])}
    attn = next(getattr(layer, "attn", None) or layer.mixer for layer in placed.target.layers
                if hasattr(getattr(layer, "attn", None) or layer.mixer, "q"))
    result["q_cols_per_device"] = int(attn.q.addressable_shards[0].data.shape[1])
    result["q_cols"] = int(attn.q.shape[1])
    with jax.set_mesh(mesh):
        result["greedy"] = _generate(placed, prompts, SamplingParams())
        if sample:
            result["sampled"] = _generate(placed, prompts, SAMPLED)
    return result


def engine_run(pair, mesh) -> dict:
    """The serving engine (`serve.Engine(mesh=)`, 2 slots) on the case prompts, greedy and sampled requests
    side by side: tokens and acceptance per request."""
    from dflash_jax.serve.engine import Engine, generate as engine_generate

    engine = Engine(pair, slots=2, max_prompt_len=16, max_new_tokens=MAX_NEW, block_size=BLOCK, mesh=mesh)
    out = {}
    for mode, sampling in (("greedy", SamplingParams()), ("sampled", SAMPLED)):
        done = engine_generate(engine, CASE_PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling, seed=11)
        out[mode] = {"tokens": [r.tokens for r in done], "acceptance": [r.acceptance for r in done]}
    return out


def tree_run(pair, mesh) -> dict:
    """Tree verification (`spec.loop.generate_tree`, budget 8, branch 2) on the case prompts, greedy."""
    import contextlib

    from dflash_jax.spec.loop import generate_tree

    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        placed = pair if mesh is None else __import__("dflash_jax.sharding", fromlist=["shard_pair"]).shard_pair(
            pair, mesh)
        out = generate_tree(placed, CASE_PROMPTS, max_new_tokens=MAX_NEW, tree_budget=8, branch=2,
                            block_size=BLOCK)
    return {"greedy": {"tokens": out.tokens, "acceptance": out.acceptance_lengths}}


def offload_run(pair, mesh) -> dict:
    """Offloaded generation (`OffloadedGenerator`, previous-round prefetch) in a cache of 6 expert slots with
    poisoned free slots (a read of an expert that is not resident blows the output up): on one device the
    plain `ExpertCache`, on a mesh the `ShardedExpertCache` (each device holding its share of the slots)."""
    import contextlib
    import functools

    from dflash_jax.offload import ExpertCache, HostExpertStore, OffloadedGenerator
    from dflash_jax.offload.sharded import ShardedExpertCache
    from dflash_jax.sharding import shard_pair

    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        if mesh is None:
            factory = functools.partial(ExpertCache, poison=True)
        else:
            pair = shard_pair(pair, mesh)
            factory = functools.partial(ShardedExpertCache, mesh=mesh, poison=True)
        store = HostExpertStore(pair.target)
        budget = 6 * max(le.expert_bytes for le in store.layers.values())
        gen = OffloadedGenerator(pair, budget_bytes=budget, prefetcher="previous", block_size=BLOCK, store=store,
                                 pool_factory=factory, bandwidth=1e9)
        out = {}
        for mode, sampling in (("greedy", SamplingParams()), ("sampled", SAMPLED)):
            session = gen.prefill(CASE_PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling, seed=11)
            while not session.done:
                gen.round(session)
            got = gen.result(session)
            out[mode] = {"tokens": got.tokens, "acceptance": got.acceptance_lengths}
            summary = got.stats["route_ahead"]["summary"]
            out[mode + "_fetched"] = int(summary["on_demand"]) + int(summary.get("passes", 0))
            if mesh is not None:
                out[mode + "_rows_per_device"] = session.pool.device_rows()
                out[mode + "_slab_rows"] = [int(s.leaves[0].shape[0]) for s in session.pool.slabs]
    return out


# the fast test's subset: the all-to-all's edge cases (one token, overflow into the fallback) and each dispatch
# on its own (the psum on the FP4 tables)
QUICK_MOE = {("all_to_all", "1", "dense"), ("all_to_all", "overflow", "dense"), ("all_to_all", "12", "dense"),
             ("psum", "12", "mxfp4")}


def moe_check(meshes, quick: bool = False) -> dict:
    """`swiglu_experts` on a mesh against the default path, under both dispatches: max |difference| per mesh,
    dispatch, width and table format, and the collectives of the compiled sharded program. Widths 1 (a
    single token, 7 of 8 shards with no token of their own under all_to_all) and 12; a last case routes every
    token to experts 0 and 1, so the all-to-all capacity overflows and the layer takes the psum fallback."""
    from dflash_jax.nn.moe import clamped_swiglu, swiglu_experts
    from dflash_jax.quant import quantize_mxfp4
    from dflash_jax.sharding import make_mesh

    k = jax.random.split(jax.random.key(0), 6)
    h, inter, e = 64, 32, 8
    gate_up = jax.random.normal(k[2], (e, h, 2 * inter)) * 0.1
    down = jax.random.normal(k[3], (e, inter, h)) * 0.1
    gub, dnb = jax.random.normal(k[4], (e, 2 * inter)), jax.random.normal(k[5], (e, h))
    fp4 = (quantize_mxfp4(jnp.swapaxes(gate_up, 1, 2)), quantize_mxfp4(jnp.swapaxes(down, 1, 2)))
    act = lambda g, u: clamped_swiglu(g, u, alpha=1.702, limit=7.0)  # noqa: E731
    routings = {}
    for t in (1, 12):
        top, experts = jax.lax.top_k(jax.random.normal(jax.random.fold_in(k[1], t), (t, e)), 2)
        routings[str(t)] = (jax.random.normal(k[0], (t, h)), experts, jax.nn.softmax(top, -1))
    # 128 tokens all to experts 0 and 1: each shard's 16 tokens send 16 rows to one owner, over the capacity
    # of 8 (`all_to_all_capacity(16, 2, 8, 1)`)
    crowd = jnp.tile(jnp.array([[0, 1]], jnp.int32), (128, 1))
    routings["overflow"] = (jax.random.normal(k[0], (128, h)), crowd, jnp.full((128, 2), 0.5))
    out = {}
    for spec in meshes:
        mesh = make_mesh(spec)
        row = {}
        for dispatch in ("psum", "all_to_all"):
            for case, (x, experts, weights) in routings.items():
                fn = jax.jit(lambda x, e_, w_, gu, dn, b1, b2, d=dispatch: swiglu_experts(
                    x, e_, w_, gu, dn, gate_up_bias=b1, down_bias=b2, activation=act, implementation="xla",
                    dispatch=d))
                for name, (gu, dn) in {"dense": (gate_up, down), "mxfp4": fp4}.items():
                    if case != "12" and name == "mxfp4":
                        continue
                    if quick and (dispatch, case, name) not in QUICK_MOE:
                        continue
                    want = fn(x, experts, weights, gu, dn, gub, dnb)
                    with jax.set_mesh(mesh):
                        compiled = fn.lower(x, experts, weights, gu, dn, gub, dnb).compile()
                    got, hlo = compiled(x, experts, weights, gu, dn, gub, dnb), compiled.as_text()
                    key = f"{dispatch}/{case}/{name}"
                    row[key] = float(jnp.max(jnp.abs(got - want)))
                    row[key + "/all_reduce"] = hlo.count(" all-reduce(") + hlo.count(" all-reduce-start(")
                    row[key + "/all_to_all"] = hlo.count(" all-to-all(") + hlo.count(" all-to-all-start(")
        out[spec] = row
    return out


def main(argv: list[str]) -> None:
    from dflash_jax.sharding import make_mesh

    out_path, cases = argv[0], argv[1:]
    report = {"devices": len(jax.devices())}
    meshes = sorted({c.split(":")[1] for c in cases if not {"engine", "tree", "offload"} & set(c.split(":")[2:])})
    t0 = time.perf_counter()
    report["moe"] = moe_check(meshes, quick=os.environ.get("MESH_CHECKS_QUICK") == "1") if meshes else {}
    print("moe", report["moe"], f"{time.perf_counter() - t0:.1f} s", flush=True)
    singles: dict[str, dict] = {}
    for case in cases:
        family, spec, *flags = case.split(":")
        pair = case_pair(family)
        if "engine" in flags or "tree" in flags or "offload" in flags:
            run = engine_run if "engine" in flags else tree_run if "tree" in flags else offload_run
            report[case] = {"single": run(pair, None), "mesh": run(pair, make_mesh(spec))}
            print(case, "equal:", report[case]["mesh"] == report[case]["single"],
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            continue
        sample = "sample" in flags
        if family not in singles or (sample and "sampled" not in singles[family]):
            singles[family] = {"greedy": _generate(pair, CASE_PROMPTS, SamplingParams())}
            if sample:
                singles[family]["sampled"] = _generate(pair, CASE_PROMPTS, SAMPLED)
        report[case] = {"single": singles[family], "mesh": run_case(
            pair, make_mesh(spec), CASE_PROMPTS, sample=sample, dispatch="all_to_all" if "a2a" in flags else None)}
        print(case, "greedy equal:", report[case]["mesh"]["greedy"] == singles[family]["greedy"],
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    with open(out_path, "w") as fh:
        json.dump(report, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
