"""Writes trained weights in the HuggingFace release layouts (Qwen3-MoE and Qwen3.5-MoE targets, z-lab
DFlash draft), so a trained pair goes through `convert-weights` exactly like a downloaded one, and
transformers / the z-lab reference can load it. `save_hf_target` picks the writer by the config's
registered family (`EXPORTERS`)."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

from dflash_jax.config import DFLASH2_FIELDS, FULL_ATTENTION, DraftConfig, Qwen3_5Config, Qwen3Config
from dflash_jax.models import qwen3
from dflash_jax.models.family import family_of


def _np(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32))


def _rope_json(rope) -> dict:
    if rope.kind != "default":
        raise ValueError("export supports default RoPE only")
    return {"rope_type": "default", "rope_theta": rope.theta}


def _attention_tensors(prefix: str, attn: qwen3.AttentionWeights) -> dict[str, np.ndarray]:
    out = {}
    for name in "qkvo":
        out[f"{prefix}self_attn.{name}_proj.weight"] = _np(getattr(attn, name)).T
        bias = getattr(attn, f"{name}_bias")
        if bias is not None:
            out[f"{prefix}self_attn.{name}_proj.bias"] = _np(bias)
    out[f"{prefix}self_attn.q_norm.weight"] = _np(attn.q_norm)
    out[f"{prefix}self_attn.k_norm.weight"] = _np(attn.k_norm)
    return out


def _save(directory: str, config: dict, tensors: dict[str, np.ndarray]) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"))


def save_hf_target(weights, cfg, directory: str, *, eos_token_id=None) -> None:
    """Writes `weights` of any exportable family (`EXPORTERS`, keyed by registered family name)."""
    name = family_of(cfg).name
    if name not in EXPORTERS:
        raise ValueError(f"export writes {', '.join(sorted(EXPORTERS))} targets, not {name}")
    EXPORTERS[name](weights, cfg, directory, eos_token_id=eos_token_id)


def _save_qwen3(weights: qwen3.Qwen3Weights, cfg: Qwen3Config, directory: str, *, eos_token_id=None) -> None:
    if cfg.model_type != "qwen3_moe" or any(w is not None for w in cfg.layer_windows):
        raise ValueError("export writes full-attention qwen3_moe targets")
    tensors = {"model.embed_tokens.weight": _np(weights.embed), "model.norm.weight": _np(weights.final_norm)}
    if weights.lm_head is not None:
        tensors["lm_head.weight"] = _np(weights.lm_head).T
    mlp_only = []
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = _np(layer.input_norm)
        tensors[p + "post_attention_layernorm.weight"] = _np(layer.post_norm)
        tensors.update(_attention_tensors(p, layer.attn))
        if isinstance(layer.mlp, qwen3.MoEWeights):
            inter = layer.mlp.gate_up.shape[-1] // 2
            gate_up, down = _np(layer.mlp.gate_up), _np(layer.mlp.down)
            tensors[p + "mlp.gate.weight"] = _np(layer.mlp.router).T
            for e in range(gate_up.shape[0]):
                tensors[p + f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :, :inter].T
                tensors[p + f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, :, inter:].T
                tensors[p + f"mlp.experts.{e}.down_proj.weight"] = down[e].T
        else:
            mlp_only.append(i)
            for name in ("gate", "up", "down"):
                tensors[p + f"mlp.{name}_proj.weight"] = _np(getattr(layer.mlp, name)).T
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": _rope_json(cfg.rope), "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias, "use_sliding_window": False, "sliding_window": None,
        "decoder_sparse_step": 1, "mlp_only_layers": mlp_only, "num_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.top_k, "moe_intermediate_size": cfg.moe.intermediate_size,
        "norm_topk_prob": cfg.moe.norm_topk_prob, "eos_token_id": eos_token_id, "torch_dtype": "float32",
    }
    _save(directory, config, tensors)


_LINEAR_NAMES = {"qkv": "in_proj_qkv", "z": "in_proj_z", "a": "in_proj_a", "b": "in_proj_b", "out": "out_proj"}


def _save_qwen3_5(weights, cfg: Qwen3_5Config, directory: str, *, eos_token_id=None) -> None:
    """The layout transformers' `save_pretrained` writes for `Qwen3_5MoeForCausalLM` (prefix `model.`, routed
    experts fused as `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows first) / `down_proj [E, H, I]`)."""
    tensors = {"model.embed_tokens.weight": _np(weights.embed), "model.norm.weight": _np(weights.final_norm)}
    if weights.lm_head is not None:
        tensors["lm_head.weight"] = _np(weights.lm_head).T
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, weights.layers)):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = _np(layer.input_norm)
        tensors[p + "post_attention_layernorm.weight"] = _np(layer.post_norm)
        mixer = layer.mixer
        if kind == FULL_ATTENTION:
            for name in "qkvo":
                tensors[p + f"self_attn.{name}_proj.weight"] = _np(getattr(mixer, name)).T
            tensors[p + "self_attn.q_norm.weight"] = _np(mixer.q_norm)
            tensors[p + "self_attn.k_norm.weight"] = _np(mixer.k_norm)
        else:
            for ours, hf in _LINEAR_NAMES.items():
                tensors[p + f"linear_attn.{hf}.weight"] = _np(getattr(mixer, ours)).T
            tensors[p + "linear_attn.conv1d.weight"] = _np(mixer.conv).T[:, None, :]  # [K, C] -> [C, 1, K]
            tensors[p + "linear_attn.A_log"] = _np(mixer.a_log)
            tensors[p + "linear_attn.dt_bias"] = _np(mixer.dt_bias)
            tensors[p + "linear_attn.norm.weight"] = _np(mixer.norm)
        mlp = layer.mlp
        tensors[p + "mlp.gate.weight"] = _np(mlp.router).T
        tensors[p + "mlp.experts.gate_up_proj"] = _np(mlp.gate_up).transpose(0, 2, 1)
        tensors[p + "mlp.experts.down_proj"] = _np(mlp.down).transpose(0, 2, 1)
        for name in ("gate", "up", "down"):
            tensors[p + f"mlp.shared_expert.{name}_proj.weight"] = _np(getattr(mlp.shared, name)).T
        tensors[p + "mlp.shared_expert_gate.weight"] = _np(mlp.shared_gate).T
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
    _save(directory, config, tensors)


EXPORTERS = {"qwen3": _save_qwen3, "qwen3_5": _save_qwen3_5}


def save_hf_draft(weights, cfg: DraftConfig, directory: str) -> None:
    """The z-lab draft layout: `DFlashDraftModel`, or `DFlash2DraftModel` for a DFlash 2 draft (its convolutions'
    `{attention_conv,mlp_conv}.base_kernel` / `.kernel_projection.weight` per layer and the release's
    `candidate_selector.{predecessor,successor}_codebook` / `.hidden_projection.weight`, with the four DFlash 2
    fields in `dflash_config`), as `convert.draft` reads it."""
    if any(w is not None for w in cfg.layer_windows) or any(cfg.layer_causal):
        raise ValueError("export writes full (non-causal) attention drafts")
    if cfg.dflash2 != (weights.convs is not None):
        raise ValueError("a DFlash 2 config needs weights with convolutions and a selector, a DFlash 1 config "
                         "weights without")
    tensors = {"fc.weight": _np(weights.fc).T, "hidden_norm.weight": _np(weights.hidden_norm),
               "norm.weight": _np(weights.final_norm)}
    for i, layer in enumerate(weights.layers):
        p = f"layers.{i}."
        tensors[p + "input_layernorm.weight"] = _np(layer.input_norm)
        tensors[p + "post_attention_layernorm.weight"] = _np(layer.post_norm)
        tensors.update(_attention_tensors(p, layer.attn))
        for name in ("gate", "up", "down"):
            tensors[p + f"mlp.{name}_proj.weight"] = _np(getattr(layer.mlp, name)).T
        if cfg.dflash2:
            for name, conv in (("attention_conv", weights.convs[i].attention), ("mlp_conv", weights.convs[i].mlp)):
                tensors[p + f"{name}.base_kernel"] = _np(conv.base)
                tensors[p + f"{name}.kernel_projection.weight"] = _np(conv.projection).T
    dflash_config = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                     "block_size": cfg.block_size}
    if cfg.dflash2:
        selector = weights.branch_head
        tensors["candidate_selector.predecessor_codebook"] = _np(selector.predecessor)
        tensors["candidate_selector.successor_codebook"] = _np(selector.successor)
        tensors["candidate_selector.hidden_projection.weight"] = _np(selector.projection).T
        dflash_config.update({name: getattr(cfg, name) for name in DFLASH2_FIELDS})
    config = {
        "architectures": ["DFlash2DraftModel" if cfg.dflash2 else "DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_parameters": _rope_json(cfg.rope),
        "max_position_embeddings": cfg.max_position_embeddings, "attention_bias": cfg.attention_bias,
        "vocab_size": cfg.vocab_size, "num_target_layers": cfg.num_target_layers,
        "layer_types": ["full_attention"] * cfg.num_layers, "tie_word_embeddings": False,
        "dflash_config": dflash_config,
    }
    _save(directory, config, tensors)
