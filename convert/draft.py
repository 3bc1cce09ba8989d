"""DFlash draft HuggingFace layout -> `dflash_jax.models.draft.DraftWeights`, and `load_hf_draft`.

Release layout (no `model.` prefix; a `model.` prefix is accepted too; `[out, in]` Linear weights,
transposed here to `[in, out]`):
  fc.weight [H, n_taps * H_target], hidden_norm.weight, norm.weight
  layers.{i}.{input_layernorm,post_attention_layernorm}.weight
  layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias when attention_bias), layers.{i}.self_attn.{q,k}_norm.weight
  layers.{i}.mlp.{gate,up,down}_proj.weight
DFlash 2 drafts (`DFlash2DraftModel`) add, per layer, `{attention_conv,mlp_conv}.base_kernel` [2, K, H] and
`{attention_conv,mlp_conv}.kernel_projection.weight` [2 * K * G, H], and `candidate_selector.
{predecessor,successor}_codebook` [V, r] (release: no `.weight`) and `candidate_selector.hidden_projection.weight`
[r, H].
The draft has no embedding and no lm_head: it borrows the target's.
"""

from __future__ import annotations

import os

import jax

from convert.errors import CheckpointError
from convert.loader import resolve_dtype
from convert.safetensors_io import HFCheckpoint
from convert.table import Placement, assemble, iter_with_progress, rule
from dflash_jax.config import ConfigError, DraftConfig, from_hf_config
from dflash_jax.models import draft as model

_P = r"(?:model\.)?"
_L = _P + r"layers\.(\d+)\."
_T2 = (1, 0)


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
    ] + (dflash2_rules() if cfg.dflash2 else [])


def dflash2_rules():
    """A DFlash 2 draft's convolutions and candidate selector. The release stores the codebooks without the
    `.weight` of an embedding (z-lab's `from_pretrained` maps them back); `save_pretrained` writes it: both
    are read."""
    return [
        rule(_L + r"(attention_conv|mlp_conv)\.base_kernel", lambda m: Placement(f"layers.{m[1]}.{m[2]}.base")),
        rule(_L + r"(attention_conv|mlp_conv)\.kernel_projection\.weight",
             lambda m: Placement(f"layers.{m[1]}.{m[2]}.projection", transpose=_T2)),
        rule(_P + r"candidate_selector\.(predecessor|successor)_codebook(?:\.weight)?",
             lambda m: Placement(f"selector.{m[1]}")),
        rule(_P + r"candidate_selector\.hidden_projection\.weight",
             lambda m: Placement("selector.projection", transpose=_T2)),
    ]


# Declarations and the pytree builder live with the model (`dflash_jax.models.draft`).
targets = model.declare_weights
build_weights = model.weights_from_flat


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
