"""The conversion behind `convert-weights`: a HuggingFace z-lab draft + its target -> one dflash_jax checkpoint.

Tensors stream one at a time; a layer is written as soon as its last tensor arrives. Where the output goes
and how it never destroys anything is `convert.output`; the format is `dflash_jax.checkpoint`.

Precision: `dtype="auto"` (the default) stores every non-expert tensor in its source precision (bfloat16
stays bfloat16, float16 / float32 become float32); "bf16" / "fp32" force one dtype. Expert tables:
"mxfp4" / "nvfp4" quantize (lossy for unquantized sources), "bf16" / "fp32" store them dense, "keep" keeps
them as the source has them (MXFP4 stays packed, dense tables keep their precision). The manifest's
`experts` entry says what happened (`quantized`, `lossless`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

import ml_dtypes
import numpy as np

from convert.cli import DTYPES, EXPERT_FORMATS
from convert.checkpoint import ChunkWriter, checksum_files, write_json
from convert.loader import dtype_rule, source_precision, table_for
from convert.output import MARKER, StagedOutput, check_input_dir, naming_os_errors
from convert.safetensors_io import HFCheckpoint, trusted_file
from convert.table import FamilyTable, FP4Joiner, assemble, iter_with_progress, joined_keys, table_targets
from dflash_jax.checkpoint import (CHECKSUM, FORMAT_VERSION, MANIFEST, TOKENIZER_FILES, file_sha256, is_expert_table,
                                   seal_manifest)
from dflash_jax.config import ConfigError, from_hf_config, load_hf_config_dict
from dflash_jax.models.family import draft_family_of, family_of, family_of_draft_model_type
from dflash_jax.errors import UsageError, open_regular
from dflash_jax.pair import check_pair
from dflash_jax.quant import MXFP4Tensor, NVFP4Tensor, dequantize_mxfp4_np, quantize_mxfp4_np, quantize_nvfp4_np

CONVERTER_VERSION = "0.2.0"
_BLOCK = {"mxfp4": 32, "nvfp4": 16}
_BF16, _FP32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)


def _stderr_note(message: str) -> None:
    print(f"convert-weights: note: {message}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------------
# expert tables
# ----------------------------------------------------------------------------------------------------------


def _mxfp4_to_dense(table: MXFP4Tensor, dtype) -> np.ndarray:
    """A packed `[E, N, K]` MXFP4 table as the dense `[E, K, N]` table, one expert at a time (so the fp32
    intermediates stay one expert big). Exact: every MXFP4 value is a bf16 (and fp32) value."""
    blocks, scales = np.asarray(table.blocks), np.asarray(table.scales)
    e, n, k = table.shape
    out = np.empty((e, k, n), dtype)
    for i in range(e):
        out[i] = dequantize_mxfp4_np(blocks[i], scales[i], dtype).T
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


def _is_expert_key(key: str, ndim: int) -> bool:
    return key.endswith(("mlp.gate_up", "mlp.down")) and ndim == 3


def expert_finalizer(expert_format: str):
    """Turns a finished stacked expert table into its stored form; other arrays pass through.

    A dense `[E, K, N]` table is quantized to "mxfp4" / "nvfp4", cast to "bf16" / "fp32", or kept ("keep").
    A table that is MXFP4 in the source (gpt-oss releases) is kept packed for "mxfp4" / "keep", dequantized
    exactly for "bf16" / "fp32", and refused for "nvfp4" (quantizing FP4 values again loses precision for
    nothing).
    """

    def finalize(key: str, array: Any) -> Any:
        if not _is_expert_key(key, array.ndim):
            return array
        if isinstance(array, MXFP4Tensor):
            if expert_format in ("mxfp4", "keep"):
                return array
            if expert_format in ("bf16", "fp32"):
                return _mxfp4_to_dense(array, _BF16 if expert_format == "bf16" else _FP32)
            raise UsageError(f"{key}: the source experts are MXFP4 already; --expert-format {expert_format} would "
                             "quantize them twice. Use --expert-format mxfp4 (kept as shipped), bf16 or fp32")
        if expert_format == "keep":
            return array
        if expert_format == "bf16":
            return array.astype(_BF16)
        if expert_format == "fp32":
            return array.astype(_FP32)
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
                              "use --expert-format bf16 or fp32 for this model")


class _Precision:
    """The dtype rule `assemble` applies to a model's targets, recording each expert table's source dtypes."""

    def __init__(self, dtype: str, expert_format: str, expert_keys: set[str]):
        self.rest = dtype_rule(dtype)
        self.expert_format = expert_format
        self.expert_keys = expert_keys
        self.expert_sources: set[str] = set()
        self.other_sources: set[str] = set()

    def __call__(self, key: str, source_dtype) -> np.dtype:
        source_dtype = np.dtype(source_dtype)
        if key in self.expert_keys:
            self.expert_sources.add(source_dtype.name)
            if self.expert_format == "keep":
                return source_precision(source_dtype)
            return _BF16 if self.expert_format == "bf16" else _FP32  # quantizers read fp32, exact for bf16
        self.other_sources.add(source_dtype.name)
        return self.rest(key, source_dtype) if callable(self.rest) else self.rest


# ----------------------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------------------


def _read_config(directory: str) -> tuple[dict, Any]:
    path = os.path.join(directory, "config.json")
    if os.path.lexists(path):
        path = trusted_file(directory, "config.json")
    raw = load_hf_config_dict(path)
    return raw, from_hf_config(raw, source=path)


def _check_families(target_dir: str, draft_dir: str, target_cfg, draft_cfg) -> None:
    if draft_family_of(target_cfg) is not None:
        raise ConfigError(f"--target {target_dir} is a DFlash draft; pass the target model's directory "
                          "(did you swap --target and --draft?)")
    if draft_family_of(draft_cfg) is None:
        raise ConfigError(f"--draft {draft_dir} is not a DFlash draft (config.json architectures should list "
                          "DFlashDraftModel)")
    # A draft's model_type may name the family it was built for (`ModelFamily.draft_model_types`: z-lab ships
    # gpt-oss drafts with the target's config class); a `qwen3` draft config is the generic DFlash container
    # (Qwen3 layers), used for every family, so only the pair checks (sizes, layers, vocabulary) apply to it.
    built_for = family_of_draft_model_type(draft_cfg.model_type)
    if built_for is not None and family_of(target_cfg) is not built_for:
        raise ConfigError(f"--draft {draft_dir} was built for a {draft_cfg.model_type} target (its config.json "
                          f"model_type), but --target {target_dir} is {target_cfg.model_type}; pass the draft "
                          "trained for this target")


def _copy_regular(src: str, dst: str) -> None:
    """Copies a regular file; a failed read or write (a full disk) is an OSError naming the file."""
    with open_regular(src) as fin, naming_os_errors(dst), open(dst, "wb") as fout:
        while True:
            with naming_os_errors(src):
                block = fin.read(16 * 2**20)
            if not block:
                break
            fout.write(block)


def _hash_sources(paths: dict[str, str], progress: bool) -> dict[str, str]:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(os.path.getsize(p) for p in paths.values()), unit="B", unit_scale=True,
                   desc="hashing sources")
    try:
        return {name: file_sha256(path, on_read=bar.update if bar else None)[0] for name, path in paths.items()}
    finally:
        if bar:
            bar.close()


def _convert_model(src: HFCheckpoint, cfg, table, root: str, *, precision: _Precision, finalize, progress: bool,
                   desc: str, critical):
    targets = table_targets(table, cfg, src.keys())
    writer = ChunkWriter(root, joined_keys(targets), finalize, critical=critical)
    try:
        assemble(
            iter_with_progress(src.items(), len(src.keys()), desc, progress),
            targets,
            table.rules(cfg),
            dtype=precision,
            ignore=getattr(table, "ignore", lambda c: (lambda n: False))(cfg),
            source=src.directory,
            on_complete=FP4Joiner(writer.add),
        )
    finally:
        writer.close()
    return writer.manifest


def _experts_summary(expert_format: str, tensors: dict, precision: _Precision, packed_source: bool) -> dict:
    stored = sorted({v["format"] if v["format"] != "dense" else v["dtype"]
                     for k, v in tensors.items() if is_expert_table(k, v)})
    if not stored:
        return {"format": "none", "source": None, "quantized": False, "lossless": True}
    source = "mxfp4" if packed_source else "+".join(sorted(precision.expert_sources)) or None
    quantized = expert_format in ("mxfp4", "nvfp4") and not packed_source
    exact_sources = {"bfloat16", "float8_e4m3fn", "float8_e5m2"} if expert_format == "bf16" else None
    if quantized:
        lossless = False
    elif exact_sources is not None and not packed_source:
        lossless = precision.expert_sources <= exact_sources
    else:
        lossless = "float64" not in precision.expert_sources
    resolved = stored[0] if len(stored) == 1 else "+".join(stored)
    names = {"bfloat16": "bf16", "float32": "fp32"}
    return {"format": names.get(resolved, resolved), "source": source, "quantized": quantized, "lossless": lossless}


# ----------------------------------------------------------------------------------------------------------
# the conversion
# ----------------------------------------------------------------------------------------------------------


def convert(
    target_dir: str | os.PathLike,
    draft_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    expert_format: str = "mxfp4",
    dtype: str = "auto",
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = _stderr_note,
) -> dict[str, Any]:
    """Converts a (target, draft) pair; returns the manifest.

    Raises ConfigError / CheckpointError / UsageError (one line naming the cause and the fix) or OSError
    (naming the path); `Interrupted` on SIGINT / SIGTERM. Whatever happens, nothing outside this run's
    partial directory is removed, and `out_dir` either holds the complete new checkpoint or is as before.
    `overwrite` replaces only an existing dflash_jax checkpoint. `log` receives notes (stale partial
    directories removed or left)."""
    if expert_format not in EXPERT_FORMATS:
        raise UsageError(f"--expert-format must be one of {', '.join(EXPERT_FORMATS)}, got {expert_format!r}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    target_dir, draft_dir = os.fspath(target_dir), os.fspath(draft_dir)
    real_target, real_draft = check_input_dir("--target", target_dir), check_input_dir("--draft", draft_dir)
    stage = StagedOutput(out_dir, overwrite=overwrite, inputs={"--target": real_target, "--draft": real_draft},
                         log=log)

    target_raw, target_cfg = _read_config(target_dir)
    draft_raw, draft_cfg = _read_config(draft_dir)
    _check_families(target_dir, draft_dir, target_cfg, draft_cfg)
    check_pair(target_cfg, draft_cfg, fix=f"the --draft {draft_dir} was made for another target than --target "
               f"{target_dir} (their config.json files disagree): pass the draft trained for this target")
    _check_expert_dims(target_cfg, expert_format)
    target_table = table_for(target_cfg, target_dir)
    target_src, draft_src = HFCheckpoint(target_dir), HFCheckpoint(draft_dir)
    target_targets = table_targets(target_table, target_cfg, target_src.keys())
    packed_source = any("#" in k for k in target_targets)
    if expert_format == "nvfp4" and packed_source:
        raise UsageError(f"--target {target_dir} ships its experts in MXFP4; --expert-format nvfp4 would quantize them "
                         "twice. Use --expert-format mxfp4 (kept as shipped), bf16 or fp32")
    tokenizer_files = {name: trusted_file(target_dir, name) for name in TOKENIZER_FILES
                       if os.path.lexists(os.path.join(target_dir, name))}
    expert_keys = {k for k, t in target_targets.items() if _is_expert_key(k, len(t.shape))}
    target_precision = _Precision(dtype, expert_format, expert_keys)
    draft_precision = _Precision(dtype, expert_format, set())

    with stage:
        tmp = stage.path
        t0 = time.perf_counter()
        tensors = {
            "target": _convert_model(target_src, target_cfg, target_table, os.path.join(tmp, "target"),
                                     precision=target_precision, finalize=expert_finalizer(expert_format),
                                     progress=progress, desc="target", critical=stage.guard.critical),
            "draft": _convert_model(draft_src, draft_cfg, FamilyTable(draft_family_of(draft_cfg)), os.path.join(tmp, "draft"),
                                    precision=draft_precision, finalize=lambda k, a: a, progress=progress,
                                    desc="draft", critical=stage.guard.critical),
        }
        copied, read = [], {}
        for name, src in tokenizer_files.items():
            _copy_regular(src, os.path.join(tmp, name))
            copied.append(name)
            read[f"target/{name}"] = src
        for role, directory, ckpt in (("target", target_dir, target_src), ("draft", draft_dir, draft_src)):
            read[f"{role}/config.json"] = os.path.join(directory, "config.json")
            index = os.path.join(directory, "model.safetensors.index.json")
            if os.path.lexists(index):
                read[f"{role}/model.safetensors.index.json"] = index
            for path in ckpt.files:
                read[f"{role}/{os.path.relpath(path, directory)}"] = path
        source_hashes = _hash_sources(dict(sorted(read.items())), progress)
        expert_bytes = sum(v["bytes"] for k, v in tensors["target"].items() if is_expert_table(k, v))
        experts = _experts_summary(expert_format, tensors["target"], target_precision, packed_source)
        others = sorted({v["dtype"] for model in tensors.values() for k, v in model.items()
                         if v["format"] == "dense" and not is_expert_table(k, v)})
        manifest = {
            "format_version": FORMAT_VERSION,
            "converter_version": CONVERTER_VERSION,
            "expert_format": experts["format"] if experts["format"] != "none" else expert_format,
            "experts": experts,
            "dtype": "+".join(others),
            "dtype_requested": dtype,
            "target_config": target_raw,
            "draft_config": draft_raw,
            "tensors": tensors,
            "expert_bytes": expert_bytes,
            "tokenizer_files": copied,
            "sources": {"target": os.path.abspath(target_dir), "draft": os.path.abspath(draft_dir),
                        CHECKSUM: source_hashes},
            "checksums": checksum_files(tmp, skip=(MANIFEST, MARKER)),
            "seconds": round(time.perf_counter() - t0, 3),
        }
        manifest = seal_manifest(manifest)  # its own digest: what --overwrite and load recognise it by
        write_json(os.path.join(tmp, MANIFEST), manifest)
        stage.commit()
    return manifest


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def summary_line(out: str, manifest: dict[str, Any]) -> str:
    """The one line `convert-weights` prints: where, how the experts were stored (and whether that lost
    precision), the other weights' dtype, the time."""
    e = manifest["experts"]
    size = _human_bytes(manifest["expert_bytes"])
    if e["format"] == "none":
        experts = "no expert tables"
    elif e["quantized"]:
        experts = f"experts quantized to {e['format']} from {e['source']} (lossy), {size}"
    else:
        how = "exact" if e["lossless"] else f"rounded from {e['source']}"
        experts = f"experts {e['format']} ({how}), {size}"
    return f"wrote {out}: {experts}; other weights {manifest['dtype']}; {manifest['seconds']:.1f} s"


__all__ = ["CONVERTER_VERSION", "DTYPES", "EXPERT_FORMATS", "convert", "expert_finalizer", "summary_line"]
