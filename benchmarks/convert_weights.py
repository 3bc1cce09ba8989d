"""Benchmark: convert-weights on a synthetic multi-GB Qwen3-MoE checkpoint.

  python benchmarks/convert_weights.py [--gb 2] [--expert-format mxfp4] [--keep] [--quick] [--out DIR | --write-docs]

Writes a random bf16 checkpoint in the release layout (sharded safetensors + index, per-expert tensors),
runs `convert-weights` in a child process, and reports the child's peak RSS against the checkpoint size
and the largest tensor, and the conversion rate in MB/s of source bytes. Results go to
convert_weights.{json,md} in --out (default bench_out/, ignored by git) or, with --write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

import harness as h


def synthetic_config(gb: float) -> dict:
    hidden, inter, experts = 1024, 512, 64
    per_layer = experts * 3 * hidden * inter * 2
    layers = max(2, int(gb * 2**30 // per_layer))
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 32000,
        "hidden_size": hidden, "intermediate_size": 2816, "num_hidden_layers": layers, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": False, "num_experts": experts, "num_experts_per_tok": 8,
        "moe_intermediate_size": inter, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    }


def write_checkpoint(directory: str, cfg: dict, *, shard_bytes: int = 1 << 30) -> tuple[int, int]:
    """Random bf16 tensors in the release layout; returns (total bytes, largest tensor bytes)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    qd, kvd, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["moe_intermediate_size"]

    def t(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    def tensors():
        yield "model.embed_tokens.weight", t(v, h)
        yield "lm_head.weight", t(v, h)
        yield "model.norm.weight", np.ones(h, ml_dtypes.bfloat16)
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", np.ones(h, ml_dtypes.bfloat16)
            yield p + "post_attention_layernorm.weight", np.ones(h, ml_dtypes.bfloat16)
            for name, shape in (("q", (qd, h)), ("k", (kvd, h)), ("v", (kvd, h)), ("o", (h, qd))):
                yield p + f"self_attn.{name}_proj.weight", t(*shape)
            yield p + "self_attn.q_norm.weight", np.ones(d, ml_dtypes.bfloat16)
            yield p + "self_attn.k_norm.weight", np.ones(d, ml_dtypes.bfloat16)
            yield p + "mlp.gate.weight", t(cfg["num_experts"], h)
            for e in range(cfg["num_experts"]):
                yield p + f"mlp.experts.{e}.gate_proj.weight", t(inter, h)
                yield p + f"mlp.experts.{e}.up_proj.weight", t(inter, h)
                yield p + f"mlp.experts.{e}.down_proj.weight", t(h, inter)

    os.makedirs(directory, exist_ok=True)
    weight_map, shard, size, index, total, largest = {}, {}, 0, 0, 0, 0

    def flush():
        nonlocal shard, size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, os.path.join(directory, name))
            weight_map.update({k: name for k in shard})
            shard, size, index = {}, 0, index + 1

    for key, arr in tensors():
        shard[key] = arr
        size += arr.nbytes
        total += arr.nbytes
        largest = max(largest, arr.nbytes)
        if size >= shard_bytes:
            flush()
    flush()
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return total, largest


def write_draft(directory: str, target_cfg: dict) -> None:
    import jax

    from dflash_jax.config import RopeConfig
    from dflash_jax.models.draft.config import DraftConfig
    from dflash_jax.testing import random_draft_weights
    from dflash_jax.train.export import save_hf_draft

    h = target_cfg["hidden_size"]
    cfg = DraftConfig(model_type="qwen3", hidden_size=h, num_layers=1, num_heads=16, num_kv_heads=4, head_dim=64,
                      intermediate_size=2816, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6, rotary_dim=64),
                      target_layer_ids=(0, 1), mask_token_id=31999, block_size=8,
                      num_target_layers=target_cfg["num_hidden_layers"], vocab_size=target_cfg["vocab_size"])
    save_hf_draft(random_draft_weights(cfg, jax.random.key(0)), cfg, directory)


def synthetic_pair(work: str, gb: float) -> tuple[dict, int, int]:
    """A synthetic target of about `gb` GiB of experts and its draft under `work` (target/, draft/): (the target's
    config, its bytes, its largest tensor's bytes)."""
    cfg = synthetic_config(gb)
    t0 = time.perf_counter()
    total, largest = write_checkpoint(os.path.join(work, "target"), cfg)
    print(f"wrote a {total / 2**30:.2f} GiB synthetic target in {time.perf_counter() - t0:.0f} s", flush=True)
    write_draft(os.path.join(work, "draft"), cfg)
    return cfg, total, largest


def convert(work: str, *flags: str) -> float:
    """convert-weights of work/{target,draft} into work/out in a child process; returns its seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "convert", "--target", os.path.join(work, "target"), "--draft",
                    os.path.join(work, "draft"), "--out", os.path.join(work, "out"), *flags], check=True)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = h.parser(__doc__, {"--gb": (2.0, "approximate expert bytes of the synthetic target"),
                           "--expert-format": ("mxfp4", None, ("mxfp4", "nvfp4", "bf16")), "--workdir": None,
                           "--keep": False})
    args = h.parse(p, argv, quick=dict(gb=0.05))  # before the run: --out / --write-docs mistakes fail fast
    if args.gb <= 0:
        p.error("--gb must be > 0")
    with h.workdir(args, "convert_bench_") as work:
        cfg, total, largest = synthetic_pair(work, args.gb)
        seconds = convert(work, "--expert-format", args.expert_format, "--dtype", "bf16")
        peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux reports KiB
        with open(os.path.join(work, "out", "manifest.json")) as fh:
            out_expert = json.load(fh)["expert_bytes"]
    row = {
        "source_bytes": total, "largest_tensor_bytes": largest, "layers": cfg["num_hidden_layers"],
        "largest_chunk_bytes": cfg["num_experts"] * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2,
        "expert_format": args.expert_format, "seconds": round(seconds, 2),
        "mb_per_s": round(total / 2**20 / seconds, 1), "peak_rss_bytes": peak_rss,
        "peak_rss_over_source": round(peak_rss / total, 3), "output_expert_bytes": out_expert,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    report = h.Report(args, "convert_weights")
    rows = []
    if os.path.exists(report.path("json")):  # one row per (size, format): runs of other sizes are kept for the table
        with open(report.path("json")) as fh:
            old = json.load(fh)
        rows = [r for r in (old if isinstance(old, list) else [old])
                if (r["layers"], r["expert_format"]) != (row["layers"], row["expert_format"])]
    rows = sorted(rows + [row], key=lambda r: (r["expert_format"], r["source_bytes"]))
    with open(report.path("json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    md = ["# convert-weights on a synthetic Qwen3-MoE checkpoint", "",
          "Command: `python benchmarks/convert_weights.py --gb N --expert-format FORMAT --write-docs` "
          f"({row['machine']}). The child process's peak RSS includes the Python/JAX/orbax runtime (~0.5 GB).", ""]
    md += h.table(["source", "layers", "largest tensor", "one layer's experts (bf16)", "format", "time", "rate",
                   "peak RSS", "RSS / source"],
                  [[f"{r['source_bytes'] / 2**30:.2f} GiB", r["layers"], f"{r['largest_tensor_bytes'] / 2**20:.1f} MiB",
                    f"{r['largest_chunk_bytes'] / 2**20:.0f} MiB", r["expert_format"], f"{r['seconds']:.1f} s",
                    f"{r['mb_per_s']} MB/s", f"{r['peak_rss_bytes'] / 2**20:.0f} MiB", r["peak_rss_over_source"]]
                   for r in rows])
    md += ["", "Peak RSS stays flat as the checkpoint grows: conversion holds about one layer (source tensors are "
           "memory-mapped, each expert table is quantized expert by expert and written as soon as it is complete)."]
    report.markdown(md)
    print(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
