"""The Qwen3.5-MoE HuggingFace layouts: the conversion table onto the declared names (`HF_TABLE`) and the writer
of trained weights (`export_hf`).

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

from dflash_jax.config import FULL_ATTENTION
from dflash_jax.models.declare import HFTable, Placement, rule
from dflash_jax.models.hf_export import save_hf_directory, to_numpy
from dflash_jax.models.qwen3.hf import per_expert_placement
from dflash_jax.models.qwen3_5.config import Qwen3_5Config

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


HF_TABLE = HFTable(rules=rules, ignore=ignore)


LINEAR_NAMES = {"qkv": "in_proj_qkv", "z": "in_proj_z", "a": "in_proj_a", "b": "in_proj_b", "out": "out_proj"}


def export_hf(weights, cfg: Qwen3_5Config, directory: str, *, eos_token_id=None) -> None:
    """The layout transformers' `save_pretrained` writes for `Qwen3_5MoeForCausalLM` (prefix `model.`, routed
    experts fused as `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows first) / `down_proj [E, H, I]`)."""
    tensors = {"model.embed_tokens.weight": to_numpy(weights.embed), "model.norm.weight": to_numpy(weights.final_norm)}
    if weights.lm_head is not None:
        tensors["lm_head.weight"] = to_numpy(weights.lm_head).T
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, weights.layers)):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = to_numpy(layer.input_norm)
        tensors[p + "post_attention_layernorm.weight"] = to_numpy(layer.post_norm)
        mixer = layer.mixer
        if kind == FULL_ATTENTION:
            for name in "qkvo":
                tensors[p + f"self_attn.{name}_proj.weight"] = to_numpy(getattr(mixer, name)).T
            tensors[p + "self_attn.q_norm.weight"] = to_numpy(mixer.q_norm)
            tensors[p + "self_attn.k_norm.weight"] = to_numpy(mixer.k_norm)
        else:
            for ours, hf in LINEAR_NAMES.items():
                tensors[p + f"linear_attn.{hf}.weight"] = to_numpy(getattr(mixer, ours)).T
            tensors[p + "linear_attn.conv1d.weight"] = to_numpy(mixer.conv).T[:, None, :]  # [K, C] -> [C, 1, K]
            tensors[p + "linear_attn.A_log"] = to_numpy(mixer.a_log)
            tensors[p + "linear_attn.dt_bias"] = to_numpy(mixer.dt_bias)
            tensors[p + "linear_attn.norm.weight"] = to_numpy(mixer.norm)
        mlp = layer.mlp
        tensors[p + "mlp.gate.weight"] = to_numpy(mlp.router).T
        tensors[p + "mlp.experts.gate_up_proj"] = to_numpy(mlp.gate_up).transpose(0, 2, 1)
        tensors[p + "mlp.experts.down_proj"] = to_numpy(mlp.down).transpose(0, 2, 1)
        for name in ("gate", "up", "down"):
            tensors[p + f"mlp.shared_expert.{name}_proj.weight"] = to_numpy(getattr(mlp.shared, name)).T
        tensors[p + "mlp.shared_expert_gate.weight"] = to_numpy(mlp.shared_gate).T
    if cfg.rope.kind != "default":
        raise ValueError("export supports default RoPE only")
    config = {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "layer_types": list(cfg.layer_types), "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel, "num_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.top_k, "moe_intermediate_size": cfg.moe.intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope.theta,
                            "partial_rotary_factor": cfg.rope.rotary_dim / cfg.head_dim},
        "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
        "eos_token_id": eos_token_id, "torch_dtype": "float32",
    }
    save_hf_directory(directory, config, tensors)
