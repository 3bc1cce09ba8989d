"""Mesh checks run in a process of their own (8 CPU devices need XLA_FLAGS before jax starts).

  python mesh_checks.py OUT_JSON FAMILY:MESH[:sample] ...

For each case: the family's tiny random pair (`case_pair`), greedy and (with `:sample`) sampled generation
from fixed prompts and seeds, once on one device and once on the mesh (`run_case`); the JSON holds both
token lists, the acceptance lengths, and what the mesh did to the weights (the expert table's local rows on
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


def run_case(pair, mesh, prompts, *, sample: bool = True) -> dict:
    """Generation of `pair` on `mesh` (greedy, and sampled with a fixed seed)."""
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


def moe_check(meshes) -> dict:
    """`swiglu_experts` on a mesh against the default path: max |difference| per mesh and table format, and
    the collectives of the compiled sharded program."""
    from dflash_jax.nn.moe import clamped_swiglu, swiglu_experts
    from dflash_jax.quant import quantize_mxfp4
    from dflash_jax.sharding import make_mesh

    k = jax.random.split(jax.random.key(0), 6)
    t, h, inter, e = 12, 64, 32, 8
    x = jax.random.normal(k[0], (t, h))
    logits = jax.random.normal(k[1], (t, e))
    top, experts = jax.lax.top_k(logits, 2)
    weights = jax.nn.softmax(top, -1)
    gate_up = jax.random.normal(k[2], (e, h, 2 * inter)) * 0.1
    down = jax.random.normal(k[3], (e, inter, h)) * 0.1
    gub, dnb = jax.random.normal(k[4], (e, 2 * inter)), jax.random.normal(k[5], (e, h))
    fp4 = (quantize_mxfp4(jnp.swapaxes(gate_up, 1, 2)), quantize_mxfp4(jnp.swapaxes(down, 1, 2)))
    act = lambda g, u: clamped_swiglu(g, u, alpha=1.702, limit=7.0)  # noqa: E731
    fn = jax.jit(lambda x, gu, dn, b1, b2: swiglu_experts(x, experts, weights, gu, dn, gate_up_bias=b1,
                                                          down_bias=b2, activation=act, implementation="xla"))
    out = {}
    for spec in meshes:
        mesh = make_mesh(spec)
        row = {}
        for name, (gu, dn) in {"dense": (gate_up, down), "mxfp4": fp4}.items():
            want = fn(x, gu, dn, gub, dnb)
            with jax.set_mesh(mesh):
                compiled = fn.lower(x, gu, dn, gub, dnb).compile()
            got, hlo = compiled(x, gu, dn, gub, dnb), compiled.as_text()
            row[name] = float(jnp.max(jnp.abs(got - want)))
            row[name + "_all_reduce"] = hlo.count(" all-reduce(") + hlo.count(" all-reduce-start(")
        out[spec] = row
    return out


def main(argv: list[str]) -> None:
    from dflash_jax.sharding import make_mesh

    out_path, cases = argv[0], argv[1:]
    report = {"devices": len(jax.devices())}
    meshes = sorted({c.split(":")[1] for c in cases})
    t0 = time.perf_counter()
    report["moe"] = moe_check(meshes)
    print("moe", report["moe"], f"{time.perf_counter() - t0:.1f} s", flush=True)
    singles: dict[str, dict] = {}
    for case in cases:
        family, spec, *flags = case.split(":")
        pair = case_pair(family)
        sample = "sample" in flags
        if family not in singles or (sample and "sampled" not in singles[family]):
            singles[family] = {"greedy": _generate(pair, CASE_PROMPTS, SamplingParams())}
            if sample:
                singles[family]["sampled"] = _generate(pair, CASE_PROMPTS, SAMPLED)
        report[case] = {"single": singles[family], "mesh": run_case(pair, make_mesh(spec), CASE_PROMPTS,
                                                                    sample=sample)}
        print(case, "greedy equal:", report[case]["mesh"]["greedy"] == singles[family]["greedy"],
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    with open(out_path, "w") as fh:
        json.dump(report, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
