"""Communication per verify round on a (data, expert, tensor) mesh, read from the compiled HLO, and what it
costs on 8 x H200 over NVLink.

  python benchmarks/sharding.py [--models gpt-oss-120b,Qwen3-Coder-30B-A3B] [--widths 16,64] [--quick] [--write-docs]

For each model (the release configs of `tests/gpu_compile/programs.py`), verify width T (tokens per verify
round: batch x block size) and mesh of 8 devices (1x8, 2x4, 8x1 expert x tensor), the target's width-T
verify forward is compiled for 8 CPU devices with abstract weights in their declared shardings (nothing is
allocated) under `jax.set_mesh`, so the MoE layers run their `shard_map` dispatch. Every collective of the
partitioned HLO is listed with its kind, per-device result bytes and group size. Per-layer figures come from
two compiles (2 and 4 layers: the difference / 2) so the real depth is counted exactly:
bytes(L) = fixed + L x per_layer.

Cost model (stated assumptions, not measurements): ring algorithms, per-device wire bytes all-reduce
2(n-1)/n S, all-gather / reduce-scatter / all-to-all (n-1)/n S (S: the full buffer); NVLink 4 at 450 GB/s
per direction per H200 (NVIDIA's H200 datasheet: 900 GB/s bidirectional); a fixed latency per collective
(`--latency-us`, default 10 us, the order of NCCL's small-message all-reduce inside one NVLink node).
Writes sharding.json / sharding.md to bench_out/ (docs/benchmarks/ with --write-docs).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import harness as h  # noqa: E402  (puts the repository root on the path: tests.gpu_compile below)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dflash_jax.config import from_hf_config  # noqa: E402
from dflash_jax.nn import moe  # noqa: E402
from dflash_jax.models.family import family_of  # noqa: E402
from dflash_jax.quant import MXFP4Tensor  # noqa: E402
from dflash_jax.sharding import describe, make_mesh, plan, weight_shardings  # noqa: E402
from tests.gpu_compile.programs import MODELS  # noqa: E402

NVLINK_BYTES_PER_S = 450e9  # per direction per GPU (H200: 900 GB/s bidirectional NVLink 4)
MESHES = ("expert=1,tensor=8", "expert=2,tensor=4", "expert=8,tensor=1")
MAX_LEN = 4096
BLOCK = 16
EXPERT_FORMAT = {"gpt-oss-120b": "mxfp4", "Qwen3-Coder-30B-A3B": "dense", "Qwen3.5-35B-A3B": "dense"}
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8,
                "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_COLLECTIVE = re.compile(
    r"=\s*(?P<type>\(?[^=]*?\)?)\s+(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|"
    r"ragged-all-to-all)(?:-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")  # mesh['a'=8,'b'=1] {'a'}


def group_size(line: str) -> int:
    """Devices in one replica group of a collective (the three ways HLO writes them)."""
    m = _MESH_GROUPS.search(line)
    if m:
        sizes = {k.strip().strip("'"): int(v) for k, v in (kv.split("=") for kv in m[1].split(","))}
        n = 1
        for axis in filter(None, (a.strip().strip("'") for a in m[2].split(","))):
            n *= sizes[axis]
        return n
    m = _IOTA_GROUPS.search(line)
    if m:
        return int(m[2])
    m = _LIST_GROUPS.search(line)
    return len(m[1].split(",")) if m else 1


def log(msg: str) -> None:
    print(f"[sharding] {msg}", file=sys.stderr, flush=True)


def collectives(hlo: str) -> list[dict]:
    """Every collective of a partitioned HLO module: kind, per-device result bytes, group size."""
    out = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if not m or "-done(" in line:
            continue
        size = 0
        for dtype, dims in _SHAPE.findall(m["type"]):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            size += n * _DTYPE_BYTES.get(dtype, 4)
        out.append({"op": m["op"], "bytes": size, "group": group_size(line)})
    return out


def wire_bytes(c: dict) -> float:
    """Per-device bytes sent by a ring implementation of one collective."""
    n, s = c["group"], c["bytes"]
    if n <= 1:
        return 0.0
    if c["op"] == "all-reduce":
        return 2 * (n - 1) / n * s
    if c["op"] == "reduce-scatter":
        return (n - 1) * s  # result is one shard of the n-times larger input
    return (n - 1) / n * s  # all-gather (result = full), all-to-all, permutes


def summarize(cs: list[dict]) -> dict:
    by_op: dict[str, dict] = {}
    for c in cs:
        row = by_op.setdefault(c["op"], {"count": 0, "bytes": 0, "wire_bytes": 0.0})
        row["count"] += 1
        row["bytes"] += c["bytes"]
        row["wire_bytes"] += wire_bytes(c)
    return {"count": len(cs), "bytes": sum(c["bytes"] for c in cs), "wire_bytes": sum(wire_bytes(c) for c in cs),
            "by_op": by_op}


def config(model: str, layers: int):
    target = dict(MODELS[model][0])
    target["num_hidden_layers"] = layers
    if "layer_types" in target:
        target["layer_types"] = list(target["layer_types"])[:layers]
        if model.startswith("Qwen3.5"):  # keep one full-attention layer in each half
            target["layer_types"] = (["linear_attention"] * (layers // 2 - 1) + ["full_attention"]) * 2
    return from_hf_config(target)


def abstract_weights(cfg, expert_format: str):
    """The target's weights as ShapeDtypeStructs from its declarations (bf16 unless declared otherwise; a
    table declared as packed MXFP4 parts stays packed; with "dense" every expert table is bf16)."""
    fam = family_of(cfg)
    flat, packed = {}, {}
    for name, t in fam.declare_weights(cfg).items():
        base, _, part = name.partition("#")
        struct = jax.ShapeDtypeStruct(t.shape, t.dtype or jnp.bfloat16)
        if part:
            packed.setdefault(base, {})[part] = struct
        else:
            flat[name] = struct
    if packed and expert_format != "mxfp4":
        raise SystemExit(f"{type(cfg).__name__}: packed expert tables need expert format mxfp4")
    for base, parts in packed.items():
        flat[base] = MXFP4Tensor(blocks=parts["blocks"], scales=parts["scales"])
    return jax.eval_shape(lambda f: fam.weights_from_flat(f, cfg), flat)


def verify_hlo(model: str, layers: int, width: int, mesh) -> str:
    """The partitioned HLO of one width-`width` verify forward (batch width / BLOCK rows of BLOCK tokens)."""
    cfg = config(model, layers)
    fam = family_of(cfg)
    batch = max(1, width // BLOCK)
    block = width // batch
    weights = abstract_weights(cfg, EXPERT_FORMAT[model])
    shardings = weight_shardings(weights, fam.sharded_declarations(cfg), mesh)
    weights = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), weights, shardings)
    cache = jax.eval_shape(lambda: fam.init_cache(cfg, batch, MAX_LEN, jnp.bfloat16, verify_width=block))
    tokens = jax.ShapeDtypeStruct((batch, block), jnp.int32)
    fn = jax.jit(lambda w, t, c: fam.forward(w, t, c, cfg, logits="all", implementation="xla"))
    with jax.set_mesh(mesh):
        return fn.lower(weights, tokens, cache).compile().as_text()


def measure(model: str, width: int, spec: str, latency_s: float) -> dict:
    mesh = make_mesh(spec)
    t0 = time.perf_counter()
    two, four = (summarize(collectives(verify_hlo(model, n, width, mesh))) for n in (2, 4))
    per_layer = {k: (four[k] - two[k]) / 2 for k in ("count", "bytes", "wire_bytes")}
    fixed = {k: two[k] - 2 * per_layer[k] for k in ("count", "bytes", "wire_bytes")}
    layers = from_hf_config(MODELS[model][0]).num_layers
    total = {k: fixed[k] + layers * per_layer[k] for k in per_layer}
    cfg = from_hf_config(MODELS[model][0])
    p = plan(family_of(cfg).sharded_declarations(cfg), mesh)
    row = {
        "model": model, "width": width, "mesh": describe(mesh), "layers": layers,
        "per_layer": per_layer, "fixed": fixed, "round": total,
        "per_layer_ops": {op: {k: (four["by_op"][op][k] - two["by_op"].get(op, {}).get(k, 0)) / 2
                               for k in ("count", "bytes")} for op in four["by_op"]},
        "nvlink_us": 1e6 * (total["count"] * latency_s + total["wire_bytes"] / NVLINK_BYTES_PER_S),
        "nvlink_bandwidth_us": 1e6 * total["wire_bytes"] / NVLINK_BYTES_PER_S,
        "weights_per_device_gb": p.device_bytes / 1e9, "weights_total_gb": p.total_bytes / 1e9,
        "compile_s": time.perf_counter() - t0,
    }
    log(f"{model} T={width} {spec}: {total['count']:.0f} collectives, {total['bytes'] / 1e6:.2f} MB per device, "
        f"{row['nvlink_us']:.0f} us on NVLink ({row['compile_s']:.0f} s)")
    return row


def _itemsize_note() -> str:
    return ("Weights per device (`sharding.plan`): every declared array in bf16 unless declared otherwise (gpt-oss's "
            "MXFP4 expert codes and scales: uint8 as stored; Qwen3-Coder's experts bf16), target only")


def markdown(result: dict) -> list[str]:
    lines = [
        "# Communication per verify round on 8 devices (from the compiled HLO)",
        "",
        "`benchmarks/sharding.py`: the target's width-T verify forward compiled for 8 CPU devices with abstract "
        "weights in their declared shardings (`dflash_jax.sharding`) under `jax.set_mesh`; every collective of the "
        "partitioned HLO counted (per-device result bytes; per layer = (4-layer - 2-layer) / 2, scaled to the real "
        "depth). Release configs of gpt-oss-120b (MXFP4 experts) and Qwen3-Coder-30B-A3B (bf16). T = batch x 16.",
        "",
        f"Cost model for 8 x H200 over NVLink (assumptions, not measurements): ring collectives; "
        f"{NVLINK_BYTES_PER_S / 1e9:.0f} GB/s per direction per GPU (H200 datasheet: 900 GB/s bidirectional "
        f"NVLink); {result['latency_us']:.0f} us per collective (order of NCCL small-message latency in one node).",
        "",
    ]
    lines += h.table(["model", "T", "mesh (data,expert,tensor)", "collectives / round", "per layer: ops",
                      "MB / device / round", "wire MB / device", "NVLink estimate (us)", "of which bandwidth (us)",
                      "weights / device (GB)"],
                     [[r["model"], r["width"], r["mesh"], f"{r['round']['count']:.0f}",
                       ", ".join(f"{v['count']:.0f} {k}" for k, v in sorted(r["per_layer_ops"].items()) if v["count"]),
                       f"{r['round']['bytes'] / 1e6:.2f}", f"{r['round']['wire_bytes'] / 1e6:.2f}",
                       f"{r['nvlink_us']:.0f}", f"{r['nvlink_bandwidth_us']:.1f}", f"{r['weights_per_device_gb']:.1f}"]
                      for r in result["rows"]])
    lines += ["", _itemsize_note() + ".", "", "## What it means", ""]
    lines += result.get("notes", [])
    lines += dispatch_markdown(result)
    return lines


def notes(rows: list[dict], latency_us: float) -> list[str]:
    out = []
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        best = min(mine, key=lambda r: r["nvlink_us"])
        worst = max(mine, key=lambda r: r["nvlink_us"])
        out.append(
            f"- {model}: {best['round']['count']:.0f} to {worst['round']['count']:.0f} collectives per verify round; "
            f"the estimate ranges {best['nvlink_us']:.0f}-{worst['nvlink_us']:.0f} us per round "
            f"(best: {best['mesh']} at T={best['width']}), of which bandwidth is at most "
            f"{max(r['nvlink_bandwidth_us'] for r in mine):.1f} us: at verify widths the count of collectives "
            f"(latency) decides, not their bytes. Weights per device: "
            f"{min(r['weights_per_device_gb'] for r in mine):.1f}-{max(r['weights_per_device_gb'] for r in mine):.1f}"
            f" GB of {mine[0]['weights_total_gb']:.1f} GB.")
    out.append(
        "- Dispatch: these verify rows run the psum dispatch (what `auto` picks at these widths: one all-reduce "
        "of T x H fp32 per layer, no dispatch collective since every expert shard already holds the tokens after "
        "the attention); the all-to-all dispatch and the comparison by width are in the next section.")
    return out


# ----------------------------------------------------------------------------------------------------------
# MoE dispatch by width: psum vs all-to-all (one MoE layer, release shapes, compiled HLO + CPU wall time)
# ----------------------------------------------------------------------------------------------------------

DISPATCH_MESH = "expert=8,tensor=1"
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
                       r"false_computation=%?([\w.\-]+))")


def dispatch_collectives(hlo: str) -> tuple[list[dict], list[dict]]:
    """(collectives a layer runs when its routing fits the all-to-all capacity, those of the psum fallback
    branch that runs only when it does not): a collective in a `conditional`'s branch without an all-to-all
    belongs to the fallback."""
    where, comp = [], None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line[:1].isspace():  # computations start at column 0, their instructions are indented
            comp = m[1]
        where.append(comp)
    branches = set()
    for m in _BRANCHES.finditer(hlo):
        names = m[1].split(",") if m[1] else [m[2], m[3]]
        branches.update(n.strip().lstrip("%") for n in names)
    has_a2a = {c for line, c in zip(hlo.splitlines(), where) if " all-to-all(" in line or "all-to-all-start(" in line}
    run, fallback = [], []
    for line, c in zip(hlo.splitlines(), where):
        found = collectives(line)
        if found:
            (fallback if c in branches and c not in has_a2a else run).extend(found)
    return run, fallback


def moe_layer(model: str):
    """Layer 0's MoE tables of `model` (abstract, as the verify benchmark declares them), its config."""
    cfg = config(model, 2)
    weights = abstract_weights(cfg, EXPERT_FORMAT[model])
    mlp = weights.layers[0].mlp
    return cfg, mlp


def dispatch_hlo(model: str, width: int, mode: str, mesh) -> str:
    cfg, mlp = moe_layer(model)
    fam = family_of(cfg)
    shardings = weight_shardings(abstract_weights(cfg, EXPERT_FORMAT[model]), fam.sharded_declarations(cfg), mesh)
    mlp_sh = shardings.layers[0].mlp
    mlp = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), mlp, mlp_sh)
    h, k = cfg.hidden_size, cfg.moe.top_k
    x = jax.ShapeDtypeStruct((width, h), jnp.bfloat16)
    experts = jax.ShapeDtypeStruct((width, k), jnp.int32)
    weights = jax.ShapeDtypeStruct((width, k), jnp.float32)

    def layer(x, experts, weights, mlp):
        return moe.swiglu_experts(x, experts, weights, mlp.gate_up, mlp.down, implementation="xla",
                                  gate_up_bias=getattr(mlp, "gate_up_bias", None),
                                  down_bias=getattr(mlp, "down_bias", None), dispatch=mode)

    with jax.set_mesh(mesh):
        return jax.jit(layer).lower(x, experts, weights, mlp).compile().as_text()


def dispatch_row(model: str, width: int, mesh) -> dict:
    cfg, _ = moe_layer(model)
    e, k, h = cfg.moe.num_experts, cfg.moe.top_k, cfg.hidden_size
    shards = 1
    for a in moe.expert_axes(e, mesh):
        shards *= mesh.shape[a]
    row = {"model": model, "width": width, "mesh": describe(mesh), "experts": e, "top_k": k, "hidden": h,
           "shards": shards, "auto": moe.choose_dispatch("auto", width, h, k, shards, e // shards)}
    for mode in ("psum", "all_to_all"):
        t0 = time.perf_counter()
        run, fallback = dispatch_collectives(dispatch_hlo(model, width, mode, mesh))
        s = summarize(run)
        row[mode] = {"count": s["count"], "bytes": s["bytes"], "wire_bytes": s["wire_bytes"],
                     "ops": {op: v["count"] for op, v in s["by_op"].items()},
                     "fallback_count": len(fallback), "fallback_bytes": sum(c["bytes"] for c in fallback),
                     "nvlink_us": 1e6 * (s["count"] * moe.COLLECTIVE_LATENCY_S + s["wire_bytes"] / NVLINK_BYTES_PER_S),
                     "model_us": 1e6 * moe.dispatch_cost(mode, width, h, k, shards, e // shards),
                     "compile_s": time.perf_counter() - t0}
    log(f"dispatch {model} T={width}: psum {row['psum']['bytes'] / 1e3:.0f} KB / {row['psum']['nvlink_us']:.0f} us,"
        f" all_to_all {row['all_to_all']['bytes'] / 1e3:.0f} KB / {row['all_to_all']['nvlink_us']:.0f} us "
        f"-> auto {row['auto']}")
    return row


def dispatch_wall(widths: list[int], repeats: int, mesh, hidden: int = 256, inter: int = 128, experts: int = 64,
                  top_k: int = 4) -> list[dict]:
    """CPU wall time (median of `repeats`) of one MoE layer under each dispatch on the 8 CPU devices, at a
    scaled-down shape (the release tables do not fit this benchmark's time), and max |out - one device|."""
    import numpy as np

    keys = jax.random.split(jax.random.key(0), 4)
    gate_up = jax.random.normal(keys[0], (experts, hidden, 2 * inter), jnp.float32) * 0.05
    down = jax.random.normal(keys[1], (experts, inter, hidden), jnp.float32) * 0.05
    rows = []
    for width in widths:
        x = jax.random.normal(keys[2], (width, hidden), jnp.float32)
        top, ids = jax.lax.top_k(jax.random.normal(keys[3], (width, experts)), top_k)
        weights = jax.nn.softmax(top, -1)
        single = jax.jit(lambda x, i, w, gu, dn: moe.swiglu_experts(x, i, w, gu, dn, implementation="xla"))
        want = np.asarray(single(x, ids, weights, gate_up, down))
        row = {"width": width, "hidden": hidden, "inter": inter, "experts": experts, "top_k": top_k,
               "mesh": describe(mesh)}
        with jax.set_mesh(mesh):
            from dflash_jax.sharding import put
            from jax.sharding import NamedSharding, PartitionSpec as P
            gu = put(gate_up, NamedSharding(mesh, P(moe.expert_axes(experts, mesh))))
            dn = put(down, NamedSharding(mesh, P(moe.expert_axes(experts, mesh))))
            runs = {}
            for mode in ("psum", "all_to_all"):
                fn = jax.jit(lambda x, i, w, gu, dn, mode=mode: moe.swiglu_experts(
                    x, i, w, gu, dn, implementation="xla", dispatch=mode))
                row[mode] = {"max_abs_diff": float(np.max(np.abs(np.asarray(fn(x, ids, weights, gu, dn)) - want)))}
                runs[mode] = functools.partial(lambda fn: fn(x, ids, weights, gu, dn).block_until_ready(), fn)
            t = h.paired_runs(runs, repeats)  # both dispatches interleaved
            for mode in runs:
                row[mode]["ms"] = 1e3 * t.stat(mode, "wall", "median")
        row["ratio"] = row["all_to_all"]["ms"] / row["psum"]["ms"]
        log(f"wall T={width}: psum {row['psum']['ms']:.2f} ms, all_to_all {row['all_to_all']['ms']:.2f} ms "
            f"(x{row['ratio']:.2f}); |diff| {row['psum']['max_abs_diff']:.1e} / {row['all_to_all']['max_abs_diff']:.1e}")
        rows.append(row)
    return rows


def dispatch_markdown(result: dict) -> list[str]:
    d = result.get("dispatch")
    if not d:
        return []
    lines = [
        "", "## MoE dispatch by width: psum vs all-to-all", "",
        f"One MoE layer of the release configs on {d['mesh']} (8 expert shards), both dispatches of "
        "`nn.moe.swiglu_experts` compiled for 8 CPU devices; collectives read from the HLO (per device, the ones a "
        "layer runs when its routing fits the all-to-all capacity; the psum fallback for an overflowing layer "
        "is listed apart). HLO est.: the cost model above over those collectives as compiled for the CPU, "
        "which carries the all-to-all and the all-gather in f32 (XLA:CPU widens bf16 collectives); model: "
        "`nn.moe.dispatch_cost`, the same cost model with the rows in bf16 as a GPU program moves them, which is "
        "what `auto` (`nn.moe.choose_dispatch`) compares. T = tokens in the layer (verify: batch x block, 1..16 "
        f"for one sequence; prefill: the prompt chunk). All-to-all capacity factor {d['capacity_factor']}.",
        "",
    ]

    def ops(r, m):
        return ", ".join(f"{v} {k}" for k, v in sorted(r[m]["ops"].items()))

    lines += h.table(["model", "T", "psum: ops", "psum KB", "psum HLO est. / model (us)", "all-to-all: ops",
                      "all-to-all KB", "fallback (on overflow)", "all-to-all HLO est. / model (us)", "auto"],
                     [[r["model"], r["width"], ops(r, "psum"), f"{r['psum']['bytes'] / 1e3:.1f}",
                       f"{r['psum']['nvlink_us']:.1f} / {r['psum']['model_us']:.1f}", ops(r, "all_to_all"),
                       f"{a['bytes'] / 1e3:.1f}", f"{a['fallback_count']} op, {a['fallback_bytes'] / 1e3:.1f} KB",
                       f"{a['nvlink_us']:.1f} / {a['model_us']:.1f}", r["auto"]]
                      for r in d["rows"] for a in (r["all_to_all"],)])
    w = d.get("wall", [])
    if w:
        lines += [
            "", f"CPU wall time of one layer on 8 CPU devices ({w[0]['mesh']}), scaled-down shape H = "
            f"{w[0]['hidden']}, I = {w[0]['inter']}, E = {w[0]['experts']}, top-{w[0]['top_k']}, fp32; median of "
            f"{d['repeats']} runs, both dispatches in the same run; |diff| = max |output - one device|:",
            ""]
        lines += h.table(["T", "psum (ms)", "all-to-all (ms)", "all-to-all / psum", "psum |diff|", "all-to-all |diff|"],
                         [[r["width"], f"{r['psum']['ms']:.2f}", f"{r['all_to_all']['ms']:.2f}", f"{r['ratio']:.2f}",
                           f"{r['psum']['max_abs_diff']:.1e}", f"{r['all_to_all']['max_abs_diff']:.1e}"] for r in w])
    lines += [""] + d.get("notes", [])
    return lines


def dispatch_notes(rows: list[dict], wall: list[dict]) -> list[str]:
    out = []
    for model in sorted({r["model"] for r in rows}):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["width"])
        wins = [r["width"] for r in mine if r["all_to_all"]["model_us"] < r["psum"]["model_us"]]
        auto = [r["width"] for r in mine if r["auto"] == "all_to_all"]
        out.append(
            f"- {model}: the all-to-all runs {mine[0]['all_to_all']['count']} collectives per layer against the psum's "
            f"{mine[0]['psum']['count']}; by the cost model (bf16 rows) it is cheaper on NVLink at "
            f"{'T = ' + ', '.join(map(str, wins)) if wins else 'no width measured'}; `auto` picks it at "
            f"{'T = ' + ', '.join(map(str, auto)) if auto else 'no width measured'}.")
    if wall:
        out.append(
            f"- CPU wall time (8 CPU devices sharing this machine's cores; collectives are memory copies here, so "
            f"this measures the dispatch's work, not a link): all-to-all / psum from "
            f"{min(r['ratio'] for r in wall):.2f} to {max(r['ratio'] for r in wall):.2f}. Past a few tokens the "
            f"all-to-all is the faster one here because of compute, not communication: the psum path runs every "
            f"row of every token through each shard's grouped matmul (rows of other shards' experts go to local "
            f"group 0 and are masked), T x k rows per shard, the all-to-all about 2 T k / n; XLA:CPU's ragged_dot "
            f"costs rows x local groups. The all-to-all output "
            f"equals one device's up to {max(r['all_to_all']['max_abs_diff'] for r in wall):.1e} (the same k "
            f"products combined in the same order; the grouped matmul over a different row count may round "
            f"differently), the psum's up to {max(r['psum']['max_abs_diff'] for r in wall):.1e} (the same sum "
            f"reassociated).")
    return out


def main(argv=None) -> int:
    ap = h.parser(__doc__, {
        "--models": "gpt-oss-120b,Qwen3-Coder-30B-A3B", "--widths": "16,64",
        "--meshes": (",".join(m.replace(",", "+") for m in MESHES),
                     "meshes separated by commas, axes inside one mesh by '+' (expert=2+tensor=4)"),
        "--latency-us": 10.0,
        "--parts": ("verify,dispatch", "verify (the full verify forward per mesh), dispatch (the MoE dispatch by "
                                       "width); a part left out keeps its figures from the existing sharding.json "
                                       "(--parts none: re-render)"),
        "--dispatch-widths": "1,2,4,8,16,64,256,1024,4096", "--wall-widths": "1,4,16,64,256,1024"}, repeats=5)
    args = h.parse(ap, argv, quick=dict(models="Qwen3-Coder-30B-A3B", widths="16", meshes="expert=8+tensor=1",
                                        dispatch_widths="16", wall_widths="4", repeats=1))
    out = args.out_dir
    parts = set(args.parts.split(","))
    previous = {}
    if os.path.exists(os.path.join(out, "sharding.json")):
        with open(os.path.join(out, "sharding.json")) as fh:
            previous = json.load(fh)
    rows = previous.get("rows", [])
    meshes = [m.replace("+", ",") for m in args.meshes.split(",")]
    if "verify" in parts:
        rows = []
        for model in args.models.split(","):
            for width in map(int, args.widths.split(",")):
                for spec in meshes:
                    rows.append(measure(model, width, spec, args.latency_us * 1e-6))
    dispatch = previous.get("dispatch")
    if dispatch and "dispatch" not in parts:  # re-rendered from the stored figures
        dispatch["notes"] = dispatch_notes(dispatch["rows"], dispatch.get("wall", []))
    if "dispatch" in parts:
        moe.COLLECTIVE_LATENCY_S = args.latency_us * 1e-6
        mesh = make_mesh(DISPATCH_MESH)
        drows = [dispatch_row(model, width, mesh) for model in args.models.split(",")
                 for width in map(int, args.dispatch_widths.split(","))]
        wall = dispatch_wall([int(w) for w in args.wall_widths.split(",") if w], args.repeats, mesh)
        dispatch = {"mesh": DISPATCH_MESH, "rows": drows, "wall": wall, "repeats": args.repeats,
                    "capacity_factor": moe.CAPACITY_FACTOR, "notes": dispatch_notes(drows, wall)}
    result = {"latency_us": args.latency_us, "nvlink_bytes_per_s": NVLINK_BYTES_PER_S, "rows": rows,
              "jax": jax.__version__, "notes": notes(rows, args.latency_us) if rows else [],
              "dispatch": dispatch}
    h.Report(args, "sharding").write(result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
