"""DFlash draft HuggingFace layout -> `dflash_jax.models.draft.DraftWeights`, and `load_hf_draft`.

Release layout (no `model.` prefix; a `model.` prefix is accepted too; `[out, in]` Linear weights,
transposed here to `[in, out]`):
  fc.weight [H, n_taps * H_target], hidden_norm.weight, norm.weight
  layers.{i}.{input_layernorm,post_attention_layernorm}.weight
  layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias when attention_bias), layers.{i}.self_attn.{q,k}_norm.weight
  layers.{i}.mlp.{gate,up,down}_proj.weight
The draft has no embedding and no lm_head: it borrows the target's.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from convert.errors import CheckpointError
from convert.loader import resolve_dtype
from convert.safetensors_io import HFCheckpoint
from convert.qwen3 import attention_weights
from convert.table import Placement, Target, assemble, attention_targets, iter_with_progress, rule
from dflash_jax.config import ConfigError, DraftConfig, from_hf_config
from dflash_jax.models import draft as model
from dflash_jax.models.qwen3 import DecoderLayerWeights, MLPWeights

_P = r"(?:model\.)?"
_L = _P + r"layers\.(\d+)\."
_T2 = (1, 0)


def targets(cfg: DraftConfig) -> dict[str, Target]:
    h = cfg.hidden_size
    out = {
        "fc": Target((cfg.num_taps * cfg.target_hidden_size, h)),
        "hidden_norm": Target((h,)),
        "final_norm": Target((h,)),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out.update({
            p + "input_norm": Target((h,)),
            p + "post_norm": Target((h,)),
            p + "mlp.gate": Target((h, cfg.intermediate_size)),
            p + "mlp.up": Target((h, cfg.intermediate_size)),
            p + "mlp.down": Target((cfg.intermediate_size, h)),
        })
        out.update(attention_targets(p, hidden=h, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                     head_dim=cfg.head_dim, bias=cfg.attention_bias))
    return out


def rules(cfg: DraftConfig):
    return [
        rule(_P + r"fc\.weight", lambda m: Placement("fc", transpose=_T2)),
        rule(_P + r"hidden_norm\.weight", lambda m: Placement("hidden_norm")),
        rule(_P + r"norm\.weight", lambda m: Placement("final_norm")),
        rule(_L + r"input_layernorm\.weight", lambda m: Placement(f"layers.{m[1]}.input_norm")),
        rule(_L + r"post_attention_layernorm\.weight", lambda m: Placement(f"layers.{m[1]}.post_norm")),
        rule(_L + r"self_attn\.([qkvo])_proj\.weight",
             lambda m: Placement(f"layers.{m[1]}.attn.{m[2]}", transpose=_T2)),
        rule(_L + r"self_attn\.([qkvo])_proj\.bias", lambda m: Placement(f"layers.{m[1]}.attn.{m[2]}_bias")),
        rule(_L + r"self_attn\.([qk])_norm\.weight", lambda m: Placement(f"layers.{m[1]}.attn.{m[2]}_norm")),
        rule(_L + r"mlp\.(gate|up|down)_proj\.weight",
             lambda m: Placement(f"layers.{m[1]}.mlp.{m[2]}", transpose=_T2)),
    ]


def build_weights(flat: dict[str, Any], cfg: DraftConfig) -> model.DraftWeights:
    layers = []
    for i in range(cfg.num_layers):
        g = lambda k: flat.get(f"layers.{i}.{k}")  # noqa: E731,B023
        attn = attention_weights(g)
        mlp = MLPWeights(gate=g("mlp.gate"), up=g("mlp.up"), down=g("mlp.down"))
        layers.append(DecoderLayerWeights(input_norm=g("input_norm"), attn=attn, post_norm=g("post_norm"), mlp=mlp))
    return model.DraftWeights(
        fc=flat["fc"], hidden_norm=flat["hidden_norm"], layers=tuple(layers), final_norm=flat["final_norm"]
    )


def load_hf_draft(directory: str | os.PathLike, dtype="fp32", *, progress: bool = False):
    """Reads a DFlash draft checkpoint directory into `(DraftConfig, DraftWeights)`, tensor by tensor.

    Unknown, duplicate, missing or wrongly shaped tensors raise `CheckpointError`; a config that is not a
    DFlash draft raises `ConfigError`.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise CheckpointError(f"draft checkpoint directory {directory} does not exist")
    np_dtype = resolve_dtype(dtype)
    cfg = from_hf_config(directory)
    if not isinstance(cfg, DraftConfig):
        raise ConfigError(f"{directory} holds a {type(cfg).__name__} checkpoint, not a DFlash draft "
                          "(config.json architectures should list DFlashDraftModel); pass the draft directory")
    ckpt = HFCheckpoint(directory)
    keys = ckpt.keys()
    flat = assemble(
        iter_with_progress(ckpt.items(), len(keys), "loading draft", progress),
        targets(cfg),
        rules(cfg),
        dtype=np_dtype,
        source=directory,
        on_complete=lambda name, arr: jax.device_put(arr),
    )
    return cfg, build_weights(flat, cfg)
