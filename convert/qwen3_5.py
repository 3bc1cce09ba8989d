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

from convert.qwen3 import per_expert_placement
from convert.table import Placement, rule
from dflash_jax.config import FULL_ATTENTION, Qwen3_5Config
from dflash_jax.models import qwen3_5 as model

_P = r"model\.(?:language_model\.)?"
_L = _P + r"layers\.(\d+)\."
_T2 = (1, 0)
_IGNORED_PREFIXES = ("mtp.", "model.visual.")


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


# Declarations and the pytree builder live with the model (`dflash_jax.models.qwen3_5`).
targets = model.declare_weights
build_weights = model.weights_from_flat
