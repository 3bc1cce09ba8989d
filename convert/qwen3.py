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

from typing import Any

from convert.table import Placement, Target, attention_targets, rule
from dflash_jax.config import Qwen3Config
from dflash_jax.models import qwen3 as model

_L = r"model\.layers\.(\d+)\."
_T2 = (1, 0)


def targets(cfg: Qwen3Config) -> dict[str, Target]:
    h, d = cfg.hidden_size, cfg.head_dim
    out = {"embed": Target((cfg.vocab_size, h)), "final_norm": Target((h,))}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = Target((h, cfg.vocab_size))
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out.update({
            p + "input_norm": Target((h,)),
            p + "post_norm": Target((h,)),
        })
        out.update(attention_targets(p, hidden=h, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                     head_dim=d, bias=cfg.attention_bias))
        if cfg.moe_layers[i]:
            e, inter = cfg.moe.num_experts, cfg.moe.intermediate_size
            out.update({
                p + "mlp.router": Target((h, e)),
                p + "mlp.gate_up": Target((e, h, 2 * inter), coverage=(e, 2)),
                p + "mlp.down": Target((e, inter, h), coverage=(e,)),
            })
        else:
            out.update({
                p + "mlp.gate": Target((h, cfg.intermediate_size)),
                p + "mlp.up": Target((h, cfg.intermediate_size)),
                p + "mlp.down": Target((cfg.intermediate_size, h)),
            })
    return out


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


def attention_weights(g) -> model.AttentionWeights:
    """A Qwen3-style attention block from a getter of its flat target names (`attn.q`, ...)."""
    names = ("q", "k", "v", "o", "q_norm", "k_norm", "q_bias", "k_bias", "v_bias", "o_bias")
    return model.AttentionWeights(**{n: g(f"attn.{n}") for n in names})


def build_weights(flat: dict[str, Any], cfg: Qwen3Config) -> model.Qwen3Weights:
    layers = []
    for i in range(cfg.num_layers):
        g = lambda k: flat.get(f"layers.{i}.{k}")  # noqa: E731,B023
        attn = attention_weights(g)
        if cfg.moe_layers[i]:
            mlp = model.MoEWeights(router=g("mlp.router"), gate_up=g("mlp.gate_up"), down=g("mlp.down"))
        else:
            mlp = model.MLPWeights(gate=g("mlp.gate"), up=g("mlp.up"), down=g("mlp.down"))
        layers.append(model.DecoderLayerWeights(
            input_norm=g("input_norm"), attn=attn, post_norm=g("post_norm"), mlp=mlp))
    return model.Qwen3Weights(
        embed=flat["embed"], layers=tuple(layers), final_norm=flat["final_norm"], lm_head=flat.get("lm_head")
    )
