"""Qwen3.5-MoE HuggingFace layouts -> `dflash_jax.models.qwen3_5.Qwen3_5Weights`.

Prefix: `model.language_model.` (the release, a multimodal wrapper) or `model.` (what transformers'
`save_pretrained` writes for `Qwen3_5MoeForCausalLM`); `lm_head.weight` at the top. Ignored: `mtp.*` (the
multi-token-prediction head) and `model.visual.*` (the vision tower). Linear weights are `[out, in]`,
transposed here to `[in, out]`.
  {p}embed_tokens.weight, {p}norm.weight, lm_head.weight (absent when tied)
  {p}layers.{i}.{input_layernorm,post_attention_layernorm}.weight
  linear_attention layers: {p}layers.{i}.linear_attn.{in_proj_qkv,in_proj_z,in_proj_a,in_proj_b,out_proj}.weight,
      linear_attn.conv1d.weight [C, 1, K], linear_attn.{A_log,dt_bias} [Hv], linear_attn.norm.weight [dv]
  full_attention layers: {p}layers.{i}.self_attn.{q,k,v,o}_proj.weight (q_proj [Hq*2d, H], per head
      [q_h | gate_h]), self_attn.{q,k}_norm.weight
  MoE: {p}layers.{i}.mlp.gate.weight [E, H]; mlp.shared_expert.{gate,up,down}_proj.weight;
      mlp.shared_expert_gate.weight [1, H]; routed experts fused without `.weight`:
      mlp.experts.gate_up_proj [E, 2I, H] (gate rows first), mlp.experts.down_proj [E, H, I] (a `.weight`
      suffix is accepted too), or per expert mlp.experts.{e}.{gate,up,down}_proj.weight.
"""

from __future__ import annotations

from typing import Any

from convert.qwen3 import per_expert_placement
from convert.table import Placement, Target, rule
from dflash_jax.config import FULL_ATTENTION, Qwen3_5Config
from dflash_jax.models import qwen3 as qwen3_model
from dflash_jax.models import qwen3_5 as model

_P = r"model\.(?:language_model\.)?"
_L = _P + r"layers\.(\d+)\."
_T2 = (1, 0)
_IGNORED_PREFIXES = ("mtp.", "model.visual.")


def targets(cfg: Qwen3_5Config) -> dict[str, Target]:
    h = cfg.hidden_size
    out = {"embed": Target((cfg.vocab_size, h)), "final_norm": Target((h,))}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = Target((h, cfg.vocab_size))
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    conv_dim = cfg.linear_conv_dim
    d = cfg.head_dim
    e, inter, shared = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.shared_expert_intermediate_size
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out[p + "input_norm"] = Target((h,))
        out[p + "post_norm"] = Target((h,))
        if cfg.layer_types[i] == FULL_ATTENTION:
            out.update({
                p + "mixer.q": Target((h, cfg.num_heads * 2 * d)),
                p + "mixer.k": Target((h, cfg.num_kv_heads * d)),
                p + "mixer.v": Target((h, cfg.num_kv_heads * d)),
                p + "mixer.o": Target((cfg.num_heads * d, h)),
                p + "mixer.q_norm": Target((d,)),
                p + "mixer.k_norm": Target((d,)),
            })
        else:
            out.update({
                p + "mixer.qkv": Target((h, conv_dim)),
                p + "mixer.z": Target((h, hv * dv)),
                p + "mixer.b": Target((h, hv)),
                p + "mixer.a": Target((h, hv)),
                p + "mixer.conv": Target((cfg.linear_conv_kernel, 1, conv_dim)),
                p + "mixer.a_log": Target((hv,)),
                p + "mixer.dt_bias": Target((hv,)),
                p + "mixer.norm": Target((dv,)),
                p + "mixer.out": Target((hv * dv, h)),
            })
        out.update({
            p + "mlp.router": Target((h, e)),
            p + "mlp.gate_up": Target((e, h, 2 * inter), coverage=(e, 2)),
            p + "mlp.down": Target((e, inter, h), coverage=(e,)),
            p + "mlp.shared.gate": Target((h, shared)),
            p + "mlp.shared.up": Target((h, shared)),
            p + "mlp.shared.down": Target((shared, h)),
            p + "mlp.shared_gate": Target((h, 1)),
        })
    return out


_LINEAR_PROJ = {"in_proj_qkv": "qkv", "in_proj_z": "z", "in_proj_a": "a", "in_proj_b": "b", "out_proj": "out"}


def rules(cfg: Qwen3_5Config):
    inter = cfg.moe.intermediate_size

    expert_part = per_expert_placement(inter)

    return [
        rule(_P + r"embed_tokens\.weight", lambda m: Placement("embed")),
        rule(_P + r"norm\.weight", lambda m: Placement("final_norm")),
        rule(r"lm_head\.weight", lambda m: Placement("lm_head", transpose=_T2)),
        rule(_L + r"input_layernorm\.weight", lambda m: Placement(f"layers.{m[1]}.input_norm")),
        rule(_L + r"post_attention_layernorm\.weight", lambda m: Placement(f"layers.{m[1]}.post_norm")),
        # gated full attention
        rule(_L + r"self_attn\.([qkvo])_proj\.weight",
             lambda m: Placement(f"layers.{m[1]}.mixer.{m[2]}", transpose=_T2)),
        rule(_L + r"self_attn\.([qk])_norm\.weight", lambda m: Placement(f"layers.{m[1]}.mixer.{m[2]}_norm")),
        # Gated DeltaNet
        rule(_L + r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)\.weight",
             lambda m: Placement(f"layers.{m[1]}.mixer.{_LINEAR_PROJ[m[2]]}", transpose=_T2)),
        rule(_L + r"linear_attn\.conv1d\.weight",
             lambda m: Placement(f"layers.{m[1]}.mixer.conv", transpose=(2, 1, 0))),
        rule(_L + r"linear_attn\.A_log", lambda m: Placement(f"layers.{m[1]}.mixer.a_log")),
        rule(_L + r"linear_attn\.dt_bias", lambda m: Placement(f"layers.{m[1]}.mixer.dt_bias")),
        rule(_L + r"linear_attn\.norm\.weight", lambda m: Placement(f"layers.{m[1]}.mixer.norm")),
        # MoE: router, shared expert and its gate, routed experts (per expert or fused)
        rule(_L + r"mlp\.gate\.weight", lambda m: Placement(f"layers.{m[1]}.mlp.router", transpose=_T2)),
        rule(_L + r"mlp\.shared_expert\.(gate|up|down)_proj\.weight",
             lambda m: Placement(f"layers.{m[1]}.mlp.shared.{m[2]}", transpose=_T2)),
        rule(_L + r"mlp\.shared_expert_gate\.weight",
             lambda m: Placement(f"layers.{m[1]}.mlp.shared_gate", transpose=_T2)),
        rule(_L + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", expert_part),
        rule(_L + r"mlp\.experts\.gate_up_proj(?:\.weight)?",
             lambda m: Placement(f"layers.{m[1]}.mlp.gate_up", cover=(slice(None), slice(None)),
                                 transpose=(0, 2, 1))),
        rule(_L + r"mlp\.experts\.down_proj(?:\.weight)?",
             lambda m: Placement(f"layers.{m[1]}.mlp.down", cover=slice(None), transpose=(0, 2, 1))),
    ]


def ignore(cfg: Qwen3_5Config):
    def ignored(name: str) -> bool:
        if name.startswith(_IGNORED_PREFIXES):
            return True
        # A tied checkpoint may still carry lm_head.weight; the model uses the embedding, as HF does.
        return cfg.tie_word_embeddings and name == "lm_head.weight"

    return ignored


def build_weights(flat: dict[str, Any], cfg: Qwen3_5Config) -> model.Qwen3_5Weights:
    layers = []
    for i in range(cfg.num_layers):
        g = lambda k: flat[f"layers.{i}.{k}"]  # noqa: E731,B023
        if cfg.layer_types[i] == FULL_ATTENTION:
            mixer = model.GatedAttentionWeights(
                q=g("mixer.q"), k=g("mixer.k"), v=g("mixer.v"), o=g("mixer.o"),
                q_norm=g("mixer.q_norm"), k_norm=g("mixer.k_norm"),
            )
        else:
            conv = g("mixer.conv")
            mixer = model.GatedDeltaNetWeights(
                qkv=g("mixer.qkv"), z=g("mixer.z"), b=g("mixer.b"), a=g("mixer.a"),
                conv=conv.reshape(conv.shape[0], conv.shape[2]), a_log=g("mixer.a_log"),
                dt_bias=g("mixer.dt_bias"), norm=g("mixer.norm"), out=g("mixer.out"),
            )
        mlp = model.SparseMoEWeights(
            router=g("mlp.router"), gate_up=g("mlp.gate_up"), down=g("mlp.down"),
            shared=qwen3_model.MLPWeights(gate=g("mlp.shared.gate"), up=g("mlp.shared.up"),
                                          down=g("mlp.shared.down")),
            shared_gate=g("mlp.shared_gate"),
        )
        layers.append(model.DecoderLayerWeights(
            input_norm=g("input_norm"), mixer=mixer, post_norm=g("post_norm"), mlp=mlp))
    return model.Qwen3_5Weights(
        embed=flat["embed"], layers=tuple(layers), final_norm=flat["final_norm"], lm_head=flat.get("lm_head")
    )
