"""`convert-weights`: a HuggingFace z-lab draft + its target -> one dflash_jax checkpoint.

  convert-weights --target HF_DIR --draft HF_DIR --out DIR [--expert-format mxfp4|nvfp4|bf16]
                  [--dtype bf16|fp32] [--overwrite]

The output is written to a temporary directory beside DIR and renamed at the end: an interrupted or
failed run leaves nothing at DIR. Tensors stream one at a time; a layer is written as soon as its last
tensor arrives.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from convert import checkpoint as ckpt_io
from convert.errors import CheckpointError
from convert.loader import resolve_dtype, table_for
from convert.safetensors_io import HFCheckpoint
from convert.table import FP4Joiner, assemble, iter_with_progress, joined_keys, table_targets
from dflash_jax.config import ConfigError, DraftConfig, from_hf_config, load_hf_config_dict
from dflash_jax.pair import check_pair
from dflash_jax.quant import MXFP4Tensor, NVFP4Tensor, dequantize_mxfp4_np, quantize_mxfp4_np, quantize_nvfp4_np

CONVERTER_VERSION = "0.1.0"
EXPERT_FORMATS = ("mxfp4", "nvfp4", "bf16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json", "chat_template.jinja")
_BLOCK = {"mxfp4": 32, "nvfp4": 16}


def _mxfp4_to_dense_bf16(table: MXFP4Tensor) -> np.ndarray:
    """A packed `[E, N, K]` MXFP4 table as the dense `[E, K, N]` bf16 table, one expert at a time (so the
    fp32 intermediates stay one expert big). Exact: every MXFP4 value is a bf16 value."""
    blocks, scales = np.asarray(table.blocks), np.asarray(table.scales)
    e, n, k = table.shape
    out = np.empty((e, k, n), ml_dtypes.bfloat16)
    for i in range(e):
        out[i] = dequantize_mxfp4_np(blocks[i], scales[i], ml_dtypes.bfloat16).T
    return out


def _quantize_per_expert(table: np.ndarray, expert_format: str):
    """Quantizes a dense `[E, K, N]` table expert by expert (temporaries stay one expert in size).

    MXFP4: OCP scale rule per 32-element block. NVFP4: a per-expert fp32 tensor scale `amax_e / (6 * 448)`
    (each expert is one tensor in NVFP4 releases), E4M3 block scales per 16 elements."""
    experts = table.shape[0]
    parts = []
    for e in range(experts):
        oriented = np.ascontiguousarray(table[e].T).astype(np.float32)  # [N, K]: blocks along K
        if expert_format == "mxfp4":
            parts.append(quantize_mxfp4_np(oriented))
        else:
            scale = np.float32(np.abs(oriented).max() / np.float32(6.0 * 448.0))
            parts.append(quantize_nvfp4_np(oriented, scale))
    stacked = [np.stack([p[i] for p in parts]) for i in range(len(parts[0]))]
    if expert_format == "mxfp4":
        return MXFP4Tensor(blocks=stacked[0], scales=stacked[1])
    return NVFP4Tensor(packed=stacked[0], block_scales=stacked[1], tensor_scale=stacked[2].reshape(experts))


def expert_finalizer(expert_format: str):
    """Turns a finished stacked expert table into its stored form; other arrays pass through.

    A dense `[E, K, N]` table is quantized to `expert_format` (or cast to bf16). A table that is already
    MXFP4 in the source (gpt-oss releases) is kept packed for "mxfp4", dequantized for "bf16", and refused
    for "nvfp4" (quantizing FP4 values a second time loses precision for nothing).
    """

    def finalize(key: str, array: Any) -> Any:
        if not (key.endswith(("mlp.gate_up", "mlp.down")) and array.ndim == 3):
            return array
        if isinstance(array, MXFP4Tensor):
            if expert_format == "mxfp4":
                return array
            if expert_format == "bf16":
                return _mxfp4_to_dense_bf16(array)
            raise ValueError(f"{key}: the source experts are MXFP4 already; --expert-format {expert_format} would "
                             "quantize them twice. Use --expert-format mxfp4 (kept as shipped) or bf16")
        if expert_format == "bf16":
            return array.astype(ml_dtypes.bfloat16)
        return _quantize_per_expert(array, expert_format)

    return finalize


def _check_expert_dims(cfg, expert_format: str) -> None:
    block = _BLOCK.get(expert_format)
    moe = getattr(cfg, "moe", None)
    if block is None or moe is None:
        return
    for name, dim in (("hidden_size", cfg.hidden_size), ("moe intermediate size", moe.intermediate_size)):
        if dim % block:
            raise ConfigError(f"{name} {dim} is not a multiple of the {expert_format} block size {block}; "
                              "use --expert-format bf16 for this model")


def sha256_files(paths: list[str], progress: bool) -> dict[str, str]:
    total = sum(os.path.getsize(p) for p in paths)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="hashing sources")
    out = {}
    for path in paths:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(16 * 2**20):
                h.update(chunk)
                if bar:
                    bar.update(len(chunk))
        out[path] = h.hexdigest()
    if bar:
        bar.close()
    return out


def _source_files(directory: str) -> list[str]:
    names = sorted(n for n in os.listdir(directory)
                   if n.endswith((".safetensors", ".json")) and os.path.isfile(os.path.join(directory, n)))
    return [os.path.join(directory, n) for n in names]


def _convert_model(src: HFCheckpoint, cfg, table, root: str, *, dtype, finalize, progress: bool, desc: str):
    targets = table_targets(table, cfg, src.keys())
    writer = ckpt_io.ChunkWriter(root, joined_keys(targets), finalize)
    try:
        assemble(
            iter_with_progress(src.items(), len(src.keys()), desc, progress),
            targets,
            table.rules(cfg),
            dtype=dtype,
            ignore=getattr(table, "ignore", lambda c: (lambda n: False))(cfg),
            source=src.directory,
            on_complete=FP4Joiner(writer.add),
        )
    finally:
        writer.close()
    return writer.manifest


def convert(
    target_dir: str,
    draft_dir: str,
    out_dir: str,
    *,
    expert_format: str = "mxfp4",
    dtype: str = "bf16",
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Converts a (target, draft) pair; returns the manifest. Raises ConfigError / CheckpointError /
    ValueError with a message naming the cause and the fix; leaves nothing at `out_dir` on failure."""
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"--expert-format must be one of {', '.join(EXPERT_FORMATS)}, got {expert_format!r}")
    np_dtype = resolve_dtype(dtype)
    for name, d in (("--target", target_dir), ("--draft", draft_dir)):
        if not os.path.isdir(d):
            raise CheckpointError(f"{name} directory {d} does not exist")
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise CheckpointError(f"--out {out_dir} already exists; pass --overwrite or choose another directory")
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent):
        raise CheckpointError(f"the parent directory of --out ({parent}) does not exist")

    target_raw, draft_raw = load_hf_config_dict(target_dir), load_hf_config_dict(draft_dir)
    target_cfg = from_hf_config(target_raw, source=os.path.join(target_dir, "config.json"))
    draft_cfg = from_hf_config(draft_raw, source=os.path.join(draft_dir, "config.json"))
    if isinstance(target_cfg, DraftConfig):
        raise ConfigError(f"--target {target_dir} is a DFlash draft; pass the target model's directory "
                          "(did you swap --target and --draft?)")
    if not isinstance(draft_cfg, DraftConfig):
        raise ConfigError(f"--draft {draft_dir} is not a DFlash draft (config.json architectures should list "
                          "DFlashDraftModel)")
    check_pair(target_cfg, draft_cfg)
    _check_expert_dims(target_cfg, expert_format)
    from convert import draft as draft_table

    target_table = table_for(target_cfg, target_dir)
    target_src, draft_src = HFCheckpoint(target_dir), HFCheckpoint(draft_dir)
    if expert_format == "nvfp4" and any("#" in k for k in table_targets(target_table, target_cfg, target_src.keys())):
        raise ValueError(f"--target {target_dir} ships its experts in MXFP4; --expert-format nvfp4 would quantize them "
                         "twice. Use --expert-format mxfp4 (kept as shipped) or bf16")

    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    t0 = time.perf_counter()
    try:
        tensors = {
            "target": _convert_model(target_src, target_cfg, target_table, os.path.join(tmp, "target"),
                                     dtype=np_dtype, finalize=expert_finalizer(expert_format), progress=progress,
                                     desc="target"),
            "draft": _convert_model(draft_src, draft_cfg, draft_table, os.path.join(tmp, "draft"),
                                    dtype=np_dtype, finalize=lambda k, a: a, progress=progress, desc="draft"),
        }
        copied = []
        for name in TOKENIZER_FILES:
            src = os.path.join(target_dir, name)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(tmp, name))
                copied.append(name)
        sources = {f"{role}/{os.path.basename(p)}": p for role, d in (("target", target_dir), ("draft", draft_dir))
                   for p in _source_files(d)}
        hashes = sha256_files(list(sources.values()), progress)
        expert_bytes = sum(v["bytes"] for k, v in tensors["target"].items() if ckpt_io.is_expert_table(k, v))
        manifest = {
            "format_version": ckpt_io.FORMAT_VERSION,
            "converter_version": CONVERTER_VERSION,
            "expert_format": expert_format,
            "dtype": np.dtype(np_dtype).name,
            "target_config": target_raw,
            "draft_config": draft_raw,
            "tensors": tensors,
            "expert_bytes": expert_bytes,
            "tokenizer_files": copied,
            "sources": {"target": os.path.abspath(target_dir), "draft": os.path.abspath(draft_dir),
                        "sha256": {name: hashes[p] for name, p in sources.items()}},
            "seconds": round(time.perf_counter() - t0, 3),
        }
        with open(os.path.join(tmp, ckpt_io.MANIFEST), "w") as fh:
            json.dump(manifest, fh, indent=1)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="convert-weights", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HF directory of the target model")
    parser.add_argument("--draft", required=True, help="HF directory of the z-lab DFlash draft")
    parser.add_argument("--out", required=True, help="output checkpoint directory (must not exist)")
    parser.add_argument("--expert-format", default="mxfp4", choices=EXPERT_FORMATS)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="dtype of non-expert weights")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        manifest = convert(args.target, args.draft, args.out, expert_format=args.expert_format, dtype=args.dtype,
                           overwrite=args.overwrite, progress=not args.quiet)
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"convert-weights: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("convert-weights: interrupted; nothing was written", file=sys.stderr)
        return 130
    mb = manifest["expert_bytes"] / 2**20
    print(f"wrote {args.out}: experts {manifest['expert_format']} ({mb:.1f} MiB), other weights "
          f"{manifest['dtype']}, {manifest['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
