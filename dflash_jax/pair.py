"""Checks that a DFlash draft belongs to a target: one clear error per mismatch."""

from __future__ import annotations

from dflash_jax.config import ConfigError
from dflash_jax.models.draft.config import DraftConfig


#: what a pair mismatch means when the configs come from HuggingFace directories (convert-weights --target /
#: --draft, `convert.load_hf_pair`): the draft was built for another target
PAIR_FIX = "the draft was trained for another target: pass the matching --target/--draft pair"


def pair_mismatch(target_cfg, draft_cfg: DraftConfig) -> str | None:
    """Why the draft cannot condition on / read out through this target (one clause), or None."""
    n = target_cfg.num_layers
    bad = [i for i in draft_cfg.target_layer_ids if not 0 <= i < n]
    if bad:
        return (f"draft target_layer_ids {list(draft_cfg.target_layer_ids)} name layers {bad} outside the target's "
                f"{n} layers")
    if draft_cfg.num_target_layers is not None and draft_cfg.num_target_layers != n:
        return f"the draft expects a target with {draft_cfg.num_target_layers} layers, this target has {n}"
    if draft_cfg.target_hidden_size != target_cfg.hidden_size:
        return (f"the draft's fc takes {draft_cfg.num_taps} x {draft_cfg.target_hidden_size} features but the target's "
                f"hidden size is {target_cfg.hidden_size}")
    if not 0 <= draft_cfg.mask_token_id < target_cfg.vocab_size:
        return (f"the draft's mask_token_id {draft_cfg.mask_token_id} is outside the target's embedding "
                f"({target_cfg.vocab_size} rows)")
    if draft_cfg.vocab_size is not None and draft_cfg.vocab_size != target_cfg.vocab_size:
        return f"the draft's vocab_size {draft_cfg.vocab_size} differs from the target's {target_cfg.vocab_size}"
    return None


def check_pair(target_cfg, draft_cfg: DraftConfig, *, fix: str = PAIR_FIX) -> None:
    """Raises ConfigError when the draft cannot condition on / read out through this target: the mismatch,
    then `fix` (by default: the draft was trained for another target; `load` says instead that the
    checkpoint's manifest was edited, since convert-weights checked the pair before writing it)."""
    why = pair_mismatch(target_cfg, draft_cfg)
    if why is not None:
        raise ConfigError(f"{why}; {fix}")


import dataclasses  # noqa: E402
import os  # noqa: E402
from typing import Any  # noqa: E402

from dflash_jax import checkpoint as ckpt_io  # noqa: E402
from dflash_jax.models import draft as draft_model  # noqa: E402
from dflash_jax.models.family import family_of  # noqa: E402
from dflash_jax.errors import CheckpointError, UsageError  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Pair:
    """A loaded target + draft: configs, weight pytrees and the checkpoint manifest."""

    target_cfg: Any
    target: Any
    draft_cfg: DraftConfig
    draft: Any
    manifest: dict
    directory: str
    # the FP4 expert tables were dequantized at load (`dequantize_experts`): `target` holds dense tables
    experts_dequantized: bool = False

    @property
    def expert_format(self) -> str:
        return self.manifest["expert_format"]

    @property
    def expert_bytes(self) -> int:
        """Bytes of the target's stacked expert tables as stored (FP4 blocks + scales when FP4)."""
        import jax

        total = 0
        for key, info in self.manifest["tensors"]["target"].items():
            if ckpt_io.is_expert_table(key, info):
                total += info["bytes"]
        if not self.experts_dequantized:
            leaves_total = sum(int(x.nbytes) for x in jax.tree.leaves(self._expert_tables()))
            assert leaves_total == total, (leaves_total, total)
        return total

    def _expert_tables(self):
        # the stacked gate_up / down tables of every routed MoE layer (biases are not expert tables here)
        fam = family_of(self.target_cfg)
        return [(layer.mlp.gate_up, layer.mlp.down) for layer in self.target.layers if fam.is_moe(layer)]

    @property
    def tokenizer_path(self) -> str | None:
        """The checkpoint's tokenizer.json, verified against the manifest's checksums now (`side_file`)."""
        return self.side_file("tokenizer.json")

    def side_file(self, name: str) -> str | None:
        """The path of a file beside the pair's weights (`tokenizer.json`, `tokenizer_config.json`, ...) or
        None when there is none. For a pair loaded from a checkpoint the file is checked against the
        manifest's checksums at this call (`dflash_jax.checkpoint.verified_side_file`: CheckpointError when it
        was edited, or added after conversion); a pair built from HuggingFace directories has no manifest to
        check against."""
        if "format_version" in self.manifest:
            return ckpt_io.verified_side_file(self.directory, name, self.manifest)
        path = os.path.join(self.directory, name)
        return path if os.path.exists(path) else None


def _declared_shapes(targets: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """{stored name: dense `[.., K, N]` shape} of a table's targets; a packed MXFP4 pair `NAME#blocks` /
    `NAME#scales` (logical `[E, N, K]`, K = 32 per scale) counts as the dense table NAME."""
    shapes = {}
    for key, target in targets.items():
        base, _, part = key.partition("#")
        if not part:
            shapes[key] = tuple(target.shape)
        elif part == "scales":
            *lead, n, groups = target.shape
            shapes[base] = (*lead, groups * 32, n)
    return shapes


def _config_edited(manifest: dict) -> str:
    """The cause and fix when a manifest's configs disagree with its own tensor list or with each other:
    convert-weights writes all of them from one source and checks the pair first, so the manifest was
    changed afterwards."""
    if ckpt_io.manifest_verifies(manifest):
        return (f"its {ckpt_io.MANIFEST_DIGEST} verifies, so a tool other than convert-weights rewrote the manifest: "
                f"{ckpt_io.REDO}")
    return (f"the config was edited after convert-weights wrote the manifest (convert-weights writes both from the "
            f"same source): restore the original {ckpt_io.MANIFEST} or {ckpt_io.REDO}")


def _check_tensors_match_config(directory: str, model: str, cfg, declared_targets: dict, stored: dict[str, dict],
                                manifest: dict | None = None) -> None:
    """The manifest's config must describe exactly the stored tensors: an edited config (one layer fewer,
    a smaller vocabulary) would otherwise load and silently drop or misread weights."""
    where = os.path.join(directory, ckpt_io.MANIFEST)
    declared = _declared_shapes(declared_targets)
    extra, missing = sorted(set(stored) - set(declared)), sorted(set(declared) - set(stored))
    if extra or missing:
        parts = []
        if extra:
            parts.append(f"{len(extra)} stored tensors it does not describe (e.g. {', '.join(extra[:3])})")
        if missing:
            parts.append(f"{len(missing)} tensors it needs that are not stored (e.g. {', '.join(missing[:3])})")
        raise CheckpointError(f"{where}: the {model} config in it does not match the stored tensors: "
                              f"{'; '.join(parts)}; {_config_edited(manifest or {})}")
    for key, shape in declared.items():
        info = stored[key]
        want = list(shape) if info["format"] == "dense" else [*shape[:-2], shape[-1], shape[-2]]
        if info["shape"] != want:
            raise CheckpointError(f"{where}: {model} tensor {key} is stored with shape {info['shape']}, but the "
                                  f"{model} config in it implies {want}; {_config_edited(manifest or {})}")


def load(directory: str | os.PathLike, *, expert_memory: str = "device", verify: bool = True, mesh=None,
         dequantize_experts: str | bool = False, branch_head: bool = True) -> Pair:
    """Loads a checkpoint written by `convert-weights`.

    expert_memory: "device" or "pinned_host" - where the target's stacked expert tables are placed (the
    host expert store of offloaded inference reads them from pinned host memory).
    verify: check every file's sha256 against the manifest before reading it (docs/reliability.md has the
    measured cost per GB). With verify=False only the weight files' sizes are checked. Either way the
    manifest must verify its own digest (`manifest_sha256`, when it has one), the tokenizer and template
    files are hashed and one the manifest does not list is refused (`Pair.side_file` reads them later,
    checked again), the manifest's configs must describe exactly the stored tensors, and each restored
    tensor must have the manifest's shape, dtype and format.
    dequantize_experts: "auto", True or False (default: the tables as stored): whether FP4 (MXFP4 / NVFP4)
    expert tables are dequantized once here, to the target's compute dtype, instead of on every call of the
    XLA path ("auto": where no FP4 kernel runs and memory allows, see `dense_experts_wanted`; exact: the same
    values the per-call dequantization gives). `dflash-generate` loads with "auto".
    mesh: a `jax.sharding.Mesh` with axes (data, expert, tensor) (`dflash_jax.sharding.make_mesh`): every
    array is restored straight into the sharding its declaration gives it (`dflash_jax.sharding.place`);
    generate under `jax.set_mesh(mesh)`.
    branch_head: attach the branch head shipped beside the checkpoint (`BRANCH_HEAD_FILE`, checked against the
    pair by `load_branch_head`) to the draft weights; token trees are then built from it. False: the draft
    alone.
    """
    from dflash_jax.config import from_hf_config

    if expert_memory not in ("device", "pinned_host"):
        raise UsageError(f"expert_memory must be 'device' or 'pinned_host', got {expert_memory!r}")
    directory = os.fspath(directory)
    manifest = ckpt_io.read_manifest(directory)
    ckpt_io.verify_files(directory, manifest, checksums=verify)
    where = os.path.join(directory, ckpt_io.MANIFEST)
    target_cfg = from_hf_config(manifest["target_config"], source=f"{where} (target_config)")
    draft_cfg = from_hf_config(manifest["draft_config"], source=f"{where} (draft_config)")
    if not isinstance(draft_cfg, DraftConfig):
        raise CheckpointError(f"{where}: its draft_config is not a DFlash draft config; {_config_edited(manifest)}")
    why = pair_mismatch(target_cfg, draft_cfg)
    if why is not None:  # convert-weights refuses such a pair before writing anything
        raise CheckpointError(f"{where}: its draft_config does not fit its target_config ({why}); "
                              f"{_config_edited(manifest)}")
    family = family_of(target_cfg)
    tensors = manifest["tensors"]
    _check_tensors_match_config(directory, "target", target_cfg, family.declare_weights(target_cfg), tensors["target"],
                                manifest)
    _check_tensors_match_config(directory, "draft", draft_cfg, draft_model.declare_weights(draft_cfg),
                                tensors["draft"], manifest)
    place, shardings = ckpt_io.ExpertPlacement(expert_memory), {"target": None, "draft": None}
    if mesh is not None:
        from dflash_jax.sharding import checkpoint_shardings

        if expert_memory != "device":
            raise UsageError(f"expert_memory={expert_memory!r} with a mesh: sharded experts live on the devices; "
                             "load with expert_memory='device', or without a mesh for expert offload")
        place = lambda key, value, info: value  # noqa: E731  (restored in place already)
        shardings = {"target": checkpoint_shardings(family.sharded_declarations(target_cfg), mesh),
                     "draft": checkpoint_shardings(draft_model.declare_weights(draft_cfg), mesh)}
    target_flat = ckpt_io.read_model(os.path.join(ckpt_io.target_directory(directory, manifest), "target"),
                                     tensors["target"], place,
                                     sharding=shardings["target"])
    draft_flat = ckpt_io.read_model(os.path.join(directory, "draft"), tensors["draft"], place,
                                    sharding=shardings["draft"])
    pair = Pair(
        target_cfg=target_cfg,
        target=family.weights_from_flat(target_flat, target_cfg),
        draft_cfg=draft_cfg,
        draft=draft_model.weights_from_flat(draft_flat, draft_cfg),
        manifest=manifest,
        directory=directory,
    )
    head_file = os.path.join(directory, BRANCH_HEAD_FILE)
    if branch_head and os.path.exists(head_file):
        head = load_branch_head(head_file, pair)
        if mesh is not None:
            import jax

            head = jax.device_put(head, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        pair = with_branch_head(pair, head)
    if dense_experts_wanted(pair, dequantize_experts, expert_memory=expert_memory):
        pair = with_dense_experts(pair)
    return pair


#: The share of the machine's memory the dense expert tables may take for `dequantize_experts="auto"`.
DENSE_EXPERTS_MEMORY_SHARE = 0.25


def _fp4_expert_tables(pair: Pair) -> list:
    from pallas_kernels.ops import is_fp4

    fam = family_of(pair.target_cfg)
    return [t for layer in pair.target.layers if fam.is_moe(layer)
            for t in fam.expert_tables(layer.mlp) if is_fp4(t)]


def dense_table_dtype(table, compute_dtype):
    """The dtype an FP4 expert table is kept in once dequantized: bfloat16 for an MXFP4 table of a float32 target,
    else the compute dtype. Every MXFP4 value is a 1-bit-mantissa code times a power of two, so bfloat16 holds the
    float32 values exactly in half the bytes; the CPU kernels and the XLA path multiply a bfloat16 table in float32
    (`nn.moe`), so the products and sums are the float32 table's, bit for bit (tested), and a round reads half the
    expert bytes. `dense_table` checks the round trip anyway. NVFP4 tables keep the compute dtype: their per-tensor
    scale is any float32, so their values need not fit bfloat16."""
    import jax.numpy as jnp

    from pallas_kernels.formats import MXFP4Tensor

    if jnp.dtype(compute_dtype) == jnp.float32 and isinstance(table, MXFP4Tensor):
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(compute_dtype)


def dense_expert_bytes(pair: Pair) -> int:
    """Bytes the FP4 expert tables take once dequantized (`dense_table_dtype`: bfloat16 for MXFP4 tables of a
    float32 target, else the target's compute dtype)."""
    import numpy as np

    dtype = pair.target.embed.dtype
    return sum(int(np.prod(t.shape)) * dense_table_dtype(t, dtype).itemsize for t in _fp4_expert_tables(pair))


def _memory_bytes() -> int | None:
    """Memory of the default device: the host's RAM on the CPU, the device's limit where jax reports one."""
    import jax

    if jax.default_backend() == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def dense_experts_wanted(pair: Pair, option: str | bool, *, expert_memory: str = "device") -> bool:
    """The load-time expert policy. True / False force it; "auto" dequantizes the FP4 expert tables when the
    default backend has no FP4 kernel (`pallas_kernels.ops.kernel_available()`: on the CPU the XLA path would
    dequantize every table on every call), the experts live on one device (`expert_memory="device"`, not
    sharded; offload keeps FP4 bytes, which is what it moves) and the dense tables take at most
    `DENSE_EXPERTS_MEMORY_SHARE` (25%) of the device's memory (the host's RAM on the CPU). Where the kernel
    runs (a GPU) the experts stay FP4: the kernel reads 4.25 bits per weight instead of 16."""
    import jax

    from pallas_kernels.ops import kernel_available

    if option not in ("auto", True, False):
        raise UsageError(f"dequantize_experts must be 'auto', True or False, got {option!r}")
    tables = _fp4_expert_tables(pair)
    if option is False or not tables:
        return False
    if expert_memory != "device":
        if option is True:
            raise UsageError("dequantize_experts=True keeps dense experts on the device: load with "
                             "expert_memory='device' (offload moves the FP4 bytes)")
        return False
    if option is True:
        return True
    if kernel_available():
        return False
    if any(len(leaf.sharding.device_set) > 1 for t in tables for leaf in jax.tree.leaves(t)):
        return False
    memory = _memory_bytes()
    return memory is not None and dense_expert_bytes(pair) <= DENSE_EXPERTS_MEMORY_SHARE * memory


def with_dense_experts(pair: Pair) -> Pair:
    """The pair with every FP4 expert table dequantized (`[E, in, out]`, the dense layout), each table once, to
    `dense_table_dtype` when that holds every value exactly (checked here), else to the target's compute dtype;
    the FP4 arrays are released when the caller drops the old pair."""
    from pallas_kernels.ops import is_fp4

    fam = family_of(pair.target_cfg)
    dtype = pair.target.embed.dtype
    layers = []
    for layer in pair.target.layers:
        if fam.is_moe(layer):
            tables = tuple(dense_table(t, dtype) if is_fp4(t) else t for t in fam.expert_tables(layer.mlp))
            layer = layer.replace(mlp=fam.with_expert_pool(layer.mlp, tables, layer.mlp.slot_of))
        layers.append(layer)
    target = pair.target.replace(layers=tuple(layers))
    return dataclasses.replace(pair, target=target, experts_dequantized=True)


def dense_table(table, compute_dtype):
    """One FP4 table dequantized: in `dense_table_dtype` where the round trip through it is exact, else in the
    compute dtype."""
    import jax.numpy as jnp

    from pallas_kernels.ops import dense_weight

    dense = dense_weight(table, compute_dtype)
    narrow = dense_table_dtype(table, compute_dtype)
    if narrow == dense.dtype:
        return dense
    kept = dense.astype(narrow)
    return kept if bool(jnp.array_equal(kept.astype(dense.dtype), dense, equal_nan=True)) else dense


def __getattr__(name):
    if name == "load_hf_pair":  # moved: the runtime never imports the converter
        raise AttributeError("dflash_jax.pair.load_hf_pair moved to convert.load_hf_pair")
    raise AttributeError(f"module 'dflash_jax.pair' has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------------------
# the branch head shipped beside a pair's checkpoint
# ----------------------------------------------------------------------------------------------------------

BRANCH_HEAD_FILE = "branch_head.safetensors"
BRANCH_HEAD_FORMAT = "dflash_jax.branch_head/1"
_BRANCH_HEAD_FIX = ("refit it for this pair (python benchmarks/tree.py --fit-branch-head, or "
                    "dflash_jax.train.branch_head.fit_branch_head + save_branch_head), or delete the file")


def pair_fingerprint(pair) -> str | None:
    """sha256 over the manifest checksums of the pair's target and draft files (what a tree calibration or a
    branch head was fitted for); None when the manifest has no checksums."""
    import hashlib
    import json

    files = (getattr(pair, "manifest", None) or {}).get("checksums", {}).get("files")
    if not files:
        return None
    entries = sorted((k, v.get("sha256", "")) for k, v in files.items() if k.startswith(("target/", "draft/")))
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _branch_head_digest(arrays: dict, fingerprint: str | None, fitted_on: str) -> str:
    import hashlib

    import numpy as np

    h = hashlib.sha256(f"{BRANCH_HEAD_FORMAT}|{fingerprint}|{fitted_on}".encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"|{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save_branch_head(head: draft_model.BranchHeadWeights, path: str, *, pair=None,
                     fitted_on: dict | None = None) -> str:
    """Writes a branch head as safetensors (fp32) whose metadata carry the format, the pair's fingerprint, what
    it was fitted on and a sha256 over all of it; `path` a file or a pair's directory (then `BRANCH_HEAD_FILE`
    in it). Written to a temporary file and renamed: no half-written file is left. Returns the path."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    if os.path.isdir(path):
        path = os.path.join(path, BRANCH_HEAD_FILE)
    arrays = {"w_in": np.asarray(head.w_in, np.float32), "w_out": np.asarray(head.w_out, np.float32)}
    fingerprint = None if pair is None else pair_fingerprint(pair)
    fitted = json.dumps(fitted_on or {}, sort_keys=True)
    meta = {"format": BRANCH_HEAD_FORMAT, "pair_fingerprint": fingerprint or "", "fitted_on": fitted,
            "sha256": _branch_head_digest(arrays, fingerprint, fitted)}
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file(arrays, tmp, metadata=meta)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # an ordinary file's mode, whatever the writer created it with
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


_BRANCH_HEAD_TENSORS = ("w_in", "w_out")
_BRANCH_HEAD_MAX_HEADER = 1 << 20  # the header of a head file is a few hundred bytes


def _read_branch_head_file(path: str, hidden: int | None) -> tuple[dict, dict]:
    """(metadata, {"w_in", "w_out": fp32 arrays}) of a branch-head safetensors file, every header field checked
    before a tensor byte is read: a regular file (opened non-blocking: a FIFO is refused, never read), a header
    that fits the file, exactly the tensors w_in [2H, F] and w_out [F, H] as F32 (H: the draft's `hidden` size
    when given), their bytes inside the data section and not overlapping, string metadata, finite values."""
    import json
    import struct

    import numpy as np

    from dflash_jax.errors import open_regular

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"branch head {path} {why}; {_BRANCH_HEAD_FIX}")

    try:
        fh = open_regular(path, CheckpointError, what="branch head file (safetensors)",
                          fix=f"put the real file there, or {_BRANCH_HEAD_FIX}")
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror or e})") from None
    with fh:
        size = os.fstat(fh.fileno()).st_size
        raw = fh.read(8)
        if len(raw) < 8:
            raise bad(f"cannot be read (a {size}-byte file has no safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, _BRANCH_HEAD_MAX_HEADER):
            raise bad(f"cannot be read (its header length {n} does not fit the {size}-byte file: truncated or not "
                      f"a safetensors file)")
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise bad("cannot be read (its safetensors header is not JSON)") from None
        if not isinstance(header, dict):
            raise bad("cannot be read (its safetensors header is not a JSON object)")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise bad("cannot be read (its safetensors __metadata__ is not a map of strings)")
        if meta.get("format") != BRANCH_HEAD_FORMAT or set(header) != set(_BRANCH_HEAD_TENSORS):
            raise bad(f"is not a {BRANCH_HEAD_FORMAT} file (format {meta.get('format')!r}, tensors "
                      f"{sorted(header)[:4]}; it needs exactly {list(_BRANCH_HEAD_TENSORS)})")
        data_len = size - 8 - n
        spans, shapes = [], {}
        for name in _BRANCH_HEAD_TENSORS:
            info = header[name]
            if not isinstance(info, dict):
                raise bad(f"cannot be read (tensor {name}'s header entry is not a JSON object)")
            shape, offsets = info.get("shape"), info.get("data_offsets")
            if info.get("dtype") != "F32":
                raise bad(f"stores {name} as {info.get('dtype')!r}; a branch head is F32 (float32)")
            if (not isinstance(shape, list) or len(shape) != 2
                    or not all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 1 << 24 for d in shape)):
                raise bad(f"gives {name} the shape {shape!r}; it must be two sizes [rows, columns]")
            if (not isinstance(offsets, list) or len(offsets) != 2
                    or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                    or not 0 <= offsets[0] <= offsets[1] <= data_len
                    or offsets[1] - offsets[0] != shape[0] * shape[1] * 4):
                raise bad(f"cannot be read (tensor {name}'s data_offsets {offsets!r} do not hold {shape} float32 "
                          f"values inside the file's {data_len} data bytes: truncated or edited)")
            spans.append(tuple(offsets))
            shapes[name] = tuple(shape)
        (a0, a1), (b0, b1) = sorted(spans)
        if a1 > b0:
            raise bad("cannot be read (its tensors w_in and w_out share bytes: edited)")
        (h2, f), (f2, h) = shapes["w_in"], shapes["w_out"]
        if hidden is not None and (h2 != 2 * hidden or h != hidden or f2 != f):
            raise bad(f"has shapes w_in {list(shapes['w_in'])}, w_out {list(shapes['w_out'])}; the draft's hidden "
                      f"size {hidden} needs w_in [{2 * hidden}, F], w_out [F, {hidden}]")
        if h2 != 2 * h or f2 != f:
            raise bad(f"has shapes w_in {list(shapes['w_in'])}, w_out {list(shapes['w_out'])}, which do not fit "
                      f"together (w_in [2H, F], w_out [F, H])")
        data = fh.read(data_len)  # bounded by the file's size, checked against the offsets above
    if len(data) != data_len:
        raise bad("cannot be read (the file changed while it was read)")
    arrays = {}
    for name, (b, e) in zip(_BRANCH_HEAD_TENSORS, (header[k]["data_offsets"] for k in _BRANCH_HEAD_TENSORS)):
        arrays[name] = np.frombuffer(data, dtype="<f4", count=(e - b) // 4, offset=b).reshape(shapes[name])
    return meta, arrays


def load_branch_head(path: str, pair=None) -> draft_model.BranchHeadWeights:
    """A branch head from `save_branch_head`'s file: its header checked field by field before any tensor is
    read (`_read_branch_head_file`; a FIFO or a device is refused, never read), its sha256 checked and, with
    `pair`, its shapes against the draft's hidden size and its fingerprint (a head fitted for another target
    or draft is refused, with the fix). Every failure is a CheckpointError naming the file and the fix."""
    import jax.numpy as jnp
    import numpy as np

    hidden = None if pair is None else pair.draft_cfg.hidden_size
    meta, arrays = _read_branch_head_file(os.fspath(path), hidden)
    stored = meta.get("pair_fingerprint") or None
    if meta.get("sha256") != _branch_head_digest(arrays, stored, meta.get("fitted_on", "")):
        raise CheckpointError(f"branch head {path} fails its sha256 (edited or truncated); {_BRANCH_HEAD_FIX}")
    fingerprint = None if pair is None else pair_fingerprint(pair)
    if fingerprint is not None and stored not in (None, fingerprint):
        raise CheckpointError(f"branch head {path} was fitted for another target/draft (fingerprint "
                              f"{stored[:12]} vs the pair's {fingerprint[:12]}); {_BRANCH_HEAD_FIX}")
    if not all(np.isfinite(a).all() for a in arrays.values()):
        raise CheckpointError(f"branch head {path} holds NaN or infinite weights (a diverged fit); {_BRANCH_HEAD_FIX}")
    return draft_model.BranchHeadWeights(w_in=jnp.asarray(arrays["w_in"]), w_out=jnp.asarray(arrays["w_out"]))


def with_branch_head(pair: Pair, head: draft_model.BranchHeadWeights | None) -> Pair:
    """The pair with `head` carried by its draft weights (None removes it: trees build from the marginals).
    A DFlash 2 draft's conditional head is its candidate selector, which a branch head may not replace."""
    if draft_model.is_selector(pair.draft.branch_head) and not draft_model.is_selector(head):
        raise ValueError("this pair's draft is a DFlash 2 draft: its conditional head is its candidate selector, "
                         "which a branch head would replace; remove the branch head file beside the checkpoint "
                         "(or load with branch_head=False)")
    return dataclasses.replace(pair, draft=pair.draft.replace(branch_head=head))
