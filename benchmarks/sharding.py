"""Communication per verify round on a (data, expert, tensor) mesh, read from the compiled HLO, and what it
costs on 8 x H200 over NVLink.

  python benchmarks/sharding.py [--models gpt-oss-120b,Qwen3-Coder-30B-A3B] [--widths 16,64] [--write-docs]

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

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from _output import add_output_args, output_dir  # noqa: E402

from dflash_jax.config import from_hf_config  # noqa: E402
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


def markdown(result: dict) -> str:
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
        "| model | T | mesh (data,expert,tensor) | collectives / round | per layer: ops | MB / device / round "
        "| wire MB / device | NVLink estimate (us) | of which bandwidth (us) | weights / device (GB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ops = ", ".join(f"{v['count']:.0f} {k}" for k, v in sorted(r["per_layer_ops"].items()) if v["count"])
        lines.append(
            f"| {r['model']} | {r['width']} | {r['mesh']} | {r['round']['count']:.0f} | {ops} | "
            f"{r['round']['bytes'] / 1e6:.2f} | {r['round']['wire_bytes'] / 1e6:.2f} | {r['nvlink_us']:.0f} | "
            f"{r['nvlink_bandwidth_us']:.1f} | {r['weights_per_device_gb']:.1f} |")
    lines += ["", _itemsize_note() + ".", "", "## What it means", ""]
    lines += result.get("notes", [])
    return "\n".join(lines) + "\n"


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
        f"- Dispatch choice: the MoE layers use all-gather-free dispatch + one psum per layer (tokens are already on "
        f"every expert shard after tensor-parallel attention). A ragged all-to-all would send each token's k rows to "
        f"their owners and back: two collectives per layer instead of one, i.e. {latency_us:.0f} us more per layer at "
        f"these widths, for at most a few hundred KB less; it only pays past the width where the psum's bytes cost "
        f"more than one collective's latency (the psum sends 7 T H bytes per device on 8 devices: about T > 220 "
        f"tokens for H = 2880 at 450 GB/s and 10 us): prefill, not verify.")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt-oss-120b,Qwen3-Coder-30B-A3B")
    ap.add_argument("--widths", default="16,64")
    ap.add_argument("--meshes", default=",".join(m.replace(",", "+") for m in MESHES),
                    help="meshes separated by commas, axes inside one mesh by '+' (expert=2+tensor=4)")
    ap.add_argument("--latency-us", type=float, default=10.0)
    add_output_args(ap)
    args = ap.parse_args(argv)
    out = output_dir(args)
    rows = []
    meshes = [m.replace("+", ",") for m in args.meshes.split(",")]
    for model in args.models.split(","):
        for width in map(int, args.widths.split(",")):
            for spec in meshes:
                rows.append(measure(model, width, spec, args.latency_us * 1e-6))
    result = {"latency_us": args.latency_us, "nvlink_bytes_per_s": NVLINK_BYTES_PER_S, "rows": rows,
              "jax": jax.__version__, "notes": notes(rows, args.latency_us)}
    with open(os.path.join(out, "sharding.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    with open(os.path.join(out, "sharding.md"), "w") as fh:
        fh.write(markdown(result))
    log(f"wrote {out}/sharding.json and sharding.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
