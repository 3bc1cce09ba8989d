"""Checks that a DFlash draft belongs to a target: one clear error per mismatch."""

from __future__ import annotations

from dflash_jax.config import ConfigError, DraftConfig


def check_pair(target_cfg, draft_cfg: DraftConfig) -> None:
    """Raises ConfigError when the draft cannot condition on / read out through this target."""
    n = target_cfg.num_layers
    fix = "the draft was trained for another target: pass the matching --target/--draft pair"
    bad = [i for i in draft_cfg.target_layer_ids if not 0 <= i < n]
    if bad:
        raise ConfigError(f"draft target_layer_ids {list(draft_cfg.target_layer_ids)} name layers {bad} outside "
                          f"the target's {n} layers; {fix}")
    if draft_cfg.num_target_layers is not None and draft_cfg.num_target_layers != n:
        raise ConfigError(f"the draft expects a target with {draft_cfg.num_target_layers} layers, this target has "
                          f"{n}; {fix}")
    if draft_cfg.target_hidden_size != target_cfg.hidden_size:
        raise ConfigError(
            f"the draft's fc takes {draft_cfg.num_taps} x {draft_cfg.target_hidden_size} features but the target's "
            f"hidden size is {target_cfg.hidden_size}; {fix}")
    if not 0 <= draft_cfg.mask_token_id < target_cfg.vocab_size:
        raise ConfigError(f"the draft's mask_token_id {draft_cfg.mask_token_id} is outside the target's embedding "
                          f"({target_cfg.vocab_size} rows); {fix}")
    if draft_cfg.vocab_size is not None and draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(f"the draft's vocab_size {draft_cfg.vocab_size} differs from the target's "
                          f"{target_cfg.vocab_size}; {fix}")


import dataclasses  # noqa: E402
import os  # noqa: E402
from typing import Any  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Pair:
    """A loaded target + draft: configs, weight pytrees and the checkpoint manifest."""

    target_cfg: Any
    target: Any
    draft_cfg: DraftConfig
    draft: Any
    manifest: dict
    directory: str

    @property
    def expert_format(self) -> str:
        return self.manifest["expert_format"]

    @property
    def expert_bytes(self) -> int:
        """Bytes of the target's stacked expert tables as stored (FP4 blocks + scales when FP4)."""
        import jax

        from convert.checkpoint import is_expert_table

        total = 0
        for key, info in self.manifest["tensors"]["target"].items():
            if is_expert_table(key, info):
                total += info["bytes"]
        leaves_total = sum(int(x.nbytes) for x in jax.tree.leaves(self._expert_tables()))
        assert leaves_total == total, (leaves_total, total)
        return total

    def _expert_tables(self):
        # every family's routed MoE weights carry stacked `gate_up` / `down` tables (dense MLPs do not)
        return [(layer.mlp.gate_up, layer.mlp.down) for layer in self.target.layers
                if hasattr(layer.mlp, "gate_up")]

    @property
    def tokenizer_path(self) -> str | None:
        path = os.path.join(self.directory, "tokenizer.json")
        return path if os.path.exists(path) else None


def load(directory: str | os.PathLike, *, expert_memory: str = "device") -> Pair:
    """Loads a checkpoint written by `convert-weights`.

    expert_memory: "device" or "pinned_host" - where the target's stacked expert tables are placed (the
    host expert store of offloaded inference reads them from pinned host memory).
    """
    from convert import checkpoint as ckpt_io
    from convert import draft as draft_table
    from convert.loader import table_for
    from dflash_jax.config import from_hf_config

    if expert_memory not in ("device", "pinned_host"):
        raise ValueError(f"expert_memory must be 'device' or 'pinned_host', got {expert_memory!r}")
    directory = os.fspath(directory)
    manifest = ckpt_io.read_manifest(directory)
    target_cfg = from_hf_config(manifest["target_config"], source=f"{directory} (target config)")
    draft_cfg = from_hf_config(manifest["draft_config"], source=f"{directory} (draft config)")
    check_pair(target_cfg, draft_cfg)
    place = ckpt_io.ExpertPlacement(expert_memory)
    tensors = manifest["tensors"]
    target_flat = ckpt_io.read_model(os.path.join(directory, "target"), tensors["target"], place)
    draft_flat = ckpt_io.read_model(os.path.join(directory, "draft"), tensors["draft"], place)
    return Pair(
        target_cfg=target_cfg,
        target=table_for(target_cfg, directory).build_weights(target_flat, target_cfg),
        draft_cfg=draft_cfg,
        draft=draft_table.build_weights(draft_flat, draft_cfg),
        manifest=manifest,
        directory=directory,
    )


def load_hf_pair(target_dir: str | os.PathLike, draft_dir: str | os.PathLike, *, dtype="fp32") -> Pair:
    """A pair straight from the HuggingFace directories (dense experts, no conversion step)."""
    from convert.draft import load_hf_draft
    from convert.loader import load_hf_model

    target_cfg, target = load_hf_model(target_dir, dtype=dtype)
    draft_cfg, draft = load_hf_draft(draft_dir, dtype)
    check_pair(target_cfg, draft_cfg)
    return Pair(target_cfg=target_cfg, target=target, draft_cfg=draft_cfg, draft=draft,
                manifest={"expert_format": "dense", "tensors": {"target": {}}}, directory=os.fspath(target_dir))
