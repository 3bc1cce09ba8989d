"""The DFlash draft HuggingFace layout: the conversion table onto the declared names (`HF_TABLE`) and the writer
of trained drafts (`export_hf`).

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

from dflash_jax.models.declare import HFTable, Placement, rule
from dflash_jax.models.draft.config import DFLASH2_FIELDS, DraftConfig
from dflash_jax.models.hf_export import qwen_attention_tensors, rope_json, save_hf_directory, to_numpy

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


HF_TABLE = HFTable(rules=rules)


def export_hf(weights, cfg: DraftConfig, directory: str) -> None:
    """The z-lab draft layout: `DFlashDraftModel`, or `DFlash2DraftModel` for a DFlash 2 draft (its convolutions'
    `{attention_conv,mlp_conv}.base_kernel` / `.kernel_projection.weight` per layer and the release's
    `candidate_selector.{predecessor,successor}_codebook` / `.hidden_projection.weight`, with the four DFlash 2
    fields in `dflash_config`), as `convert.draft` reads it."""
    if any(w is not None for w in cfg.layer_windows) or any(cfg.layer_causal):
        raise ValueError("export writes full (non-causal) attention drafts")
    if cfg.dflash2 != (weights.convs is not None):
        raise ValueError("a DFlash 2 config needs weights with convolutions and a selector, a DFlash 1 config "
                         "weights without")
    tensors = {"fc.weight": to_numpy(weights.fc).T, "hidden_norm.weight": to_numpy(weights.hidden_norm),
               "norm.weight": to_numpy(weights.final_norm)}
    for i, layer in enumerate(weights.layers):
        p = f"layers.{i}."
        tensors[p + "input_layernorm.weight"] = to_numpy(layer.input_norm)
        tensors[p + "post_attention_layernorm.weight"] = to_numpy(layer.post_norm)
        tensors.update(qwen_attention_tensors(p, layer.attn))
        for name in ("gate", "up", "down"):
            tensors[p + f"mlp.{name}_proj.weight"] = to_numpy(getattr(layer.mlp, name)).T
        if cfg.dflash2:
            for name, conv in (("attention_conv", weights.convs[i].attention), ("mlp_conv", weights.convs[i].mlp)):
                tensors[p + f"{name}.base_kernel"] = to_numpy(conv.base)
                tensors[p + f"{name}.kernel_projection.weight"] = to_numpy(conv.projection).T
    dflash_config = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                     "block_size": cfg.block_size}
    if cfg.dflash2:
        selector = weights.branch_head
        tensors["candidate_selector.predecessor_codebook"] = to_numpy(selector.predecessor)
        tensors["candidate_selector.successor_codebook"] = to_numpy(selector.successor)
        tensors["candidate_selector.hidden_projection.weight"] = to_numpy(selector.projection).T
        dflash_config.update({name: getattr(cfg, name) for name in DFLASH2_FIELDS})
    config = {
        "architectures": ["DFlash2DraftModel" if cfg.dflash2 else "DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_parameters": rope_json(cfg.rope),
        "max_position_embeddings": cfg.max_position_embeddings, "attention_bias": cfg.attention_bias,
        "vocab_size": cfg.vocab_size, "num_target_layers": cfg.num_target_layers,
        "layer_types": ["full_attention"] * cfg.num_layers, "tie_word_embeddings": False,
        "dflash_config": dflash_config,
    }
    save_hf_directory(directory, config, tensors)
