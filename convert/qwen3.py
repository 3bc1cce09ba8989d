"""Qwen3 / Qwen3-MoE HuggingFace layout -> `dflash_jax.models.qwen3.Qwen3Weights`.

Release layout (`[out, in]` Linear weights, transposed here to `[in, out]`):
  model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when tied)
  model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight
  model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias} and self_attn.{q,k}_norm.weight
  dense MLP: model.layers.{i}.mlp.{gate,up,down}_proj.weight
  MoE: model.layers.{i}.mlp.gate.weight (router [E, H]) and either per-expert
       model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight, or fused
       model.layers.{i}.mlp.experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I] (with or without
       a `.weight` suffix).
"""

from __future__ import annotations

from convert.table import Placement, rule
from dflash_jax.config import Qwen3Config
from dflash_jax.models import qwen3 as model

_L = r"model\.layers\.(\d+)\."
_T2 = (1, 0)


def per_expert_placement(inter: int):
    """Placement of `...experts.{e}.{gate,up,down}_proj.weight` (groups: layer, expert, part) into the
    stacked `gate_up [E, H, 2I]` (gate columns first) and `down [E, I, H]` tables."""

    def place(m):
        layer, e, part = m.group(1), int(m.group(2)), m.group(3)
        if part == "down":
            return Placement(f"layers.{layer}.mlp.down", region=e, cover=e, transpose=_T2)
        half = 0 if part == "gate" else 1
        cols = slice(half * inter, (half + 1) * inter)
        return Placement(f"layers.{layer}.mlp.gate_up", region=(e, slice(None), cols), cover=(e, half),
                         transpose=_T2)

    return place


def rules(cfg: Qwen3Config):
    expert_part = per_expert_placement(cfg.moe.intermediate_size if cfg.moe else 0)

    return [
        rule(r"model\.embed_tokens\.weight", lambda m: Placement("embed")),
        rule(r"model\.norm\.weight", lambda m: Placement("final_norm")),
        rule(r"lm_head\.weight", lambda m: Placement("lm_head", transpose=_T2)),
        rule(_L + r"input_layernorm\.weight", lambda m: Placement(f"layers.{m[1]}.input_norm")),
        rule(_L + r"post_attention_layernorm\.weight", lambda m: Placement(f"layers.{m[1]}.post_norm")),
        rule(_L + r"self_attn\.([qkvo])_proj\.weight", lambda m: Placement(f"layers.{m[1]}.attn.{m[2]}", transpose=_T2)),
        rule(_L + r"self_attn\.([qkvo])_proj\.bias", lambda m: Placement(f"layers.{m[1]}.attn.{m[2]}_bias")),
        rule(_L + r"self_attn\.([qk])_norm\.weight", lambda m: Placement(f"layers.{m[1]}.attn.{m[2]}_norm")),
        rule(_L + r"mlp\.(gate|up|down)_proj\.weight", lambda m: Placement(f"layers.{m[1]}.mlp.{m[2]}", transpose=_T2)),
        rule(_L + r"mlp\.gate\.weight", lambda m: Placement(f"layers.{m[1]}.mlp.router", transpose=_T2)),
        rule(_L + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", expert_part),
        rule(_L + r"mlp\.experts\.gate_up_proj(?:\.weight)?",
             lambda m: Placement(f"layers.{m[1]}.mlp.gate_up", cover=(slice(None), slice(None)), transpose=(0, 2, 1))),
        rule(_L + r"mlp\.experts\.down_proj(?:\.weight)?",
             lambda m: Placement(f"layers.{m[1]}.mlp.down", cover=slice(None), transpose=(0, 2, 1))),
    ]


def ignore(cfg: Qwen3Config):
    # A tied checkpoint may still carry lm_head.weight; the model uses the embedding, as HF does.
    return lambda name: cfg.tie_word_embeddings and name == "lm_head.weight"


# Declarations and the pytree builder live with the model (`dflash_jax.models.qwen3`).
targets = model.declare_weights
attention_weights = model.attention_weights_from
build_weights = model.weights_from_flat
