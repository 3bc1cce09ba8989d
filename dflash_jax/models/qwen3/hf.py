"""The Qwen3 / Qwen3-MoE HuggingFace layout: its conversion table onto the declared names (`HF_TABLE`) and the
writer of trained weights in it (`export_hf`).

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

from dflash_jax.models.declare import HFTable, Placement, rule
from dflash_jax.models.hf_export import qwen_attention_tensors, rope_json, save_hf_directory, to_numpy
from dflash_jax.models.qwen3.config import Qwen3Config

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


HF_TABLE = HFTable(rules=rules, ignore=ignore)


def export_hf(weights, cfg: Qwen3Config, directory: str, *, eos_token_id=None) -> None:
    """Writes full-attention Qwen3-MoE weights in the release layout (per-expert tensors), as transformers' `Qwen3MoeForCausalLM` loads them."""
    if cfg.model_type != "qwen3_moe" or any(w is not None for w in cfg.layer_windows):
        raise ValueError("export writes full-attention qwen3_moe targets")
    tensors = {"model.embed_tokens.weight": to_numpy(weights.embed), "model.norm.weight": to_numpy(weights.final_norm)}
    if weights.lm_head is not None:
        tensors["lm_head.weight"] = to_numpy(weights.lm_head).T
    mlp_only = []
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = to_numpy(layer.input_norm)
        tensors[p + "post_attention_layernorm.weight"] = to_numpy(layer.post_norm)
        tensors.update(qwen_attention_tensors(p, layer.attn))
        if hasattr(layer.mlp, "router"):
            inter = layer.mlp.gate_up.shape[-1] // 2
            gate_up, down = to_numpy(layer.mlp.gate_up), to_numpy(layer.mlp.down)
            tensors[p + "mlp.gate.weight"] = to_numpy(layer.mlp.router).T
            for e in range(gate_up.shape[0]):
                tensors[p + f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :, :inter].T
                tensors[p + f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, :, inter:].T
                tensors[p + f"mlp.experts.{e}.down_proj.weight"] = down[e].T
        else:
            mlp_only.append(i)
            for name in ("gate", "up", "down"):
                tensors[p + f"mlp.{name}_proj.weight"] = to_numpy(getattr(layer.mlp, name)).T
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope_json(cfg.rope), "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias, "use_sliding_window": False, "sliding_window": None,
        "decoder_sparse_step": 1, "mlp_only_layers": mlp_only, "num_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.top_k, "moe_intermediate_size": cfg.moe.intermediate_size,
        "norm_topk_prob": cfg.moe.norm_topk_prob, "eos_token_id": eos_token_id, "torch_dtype": "float32",
    }
    save_hf_directory(directory, config, tensors)
