"""HF config.json parsing: both rope schemas, strictness, unsupported families."""

from __future__ import annotations

import json

import pytest

from dflash_jax.config import ConfigError, MoEConfig, RopeConfig, from_hf_config
from dflash_jax.models.qwen3.config import Qwen3Config

# The fields of Qwen3-Coder-30B-A3B-Instruct's release config.json (older schema: top-level rope_theta).
QWEN3_CODER_30B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5472,
    "max_position_embeddings": 262144, "max_window_layers": 28, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000000, "router_aux_loss_coef": 0.0, "shared_expert_intermediate_size": 0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_release_config_qwen3_coder_30b():
    cfg = from_hf_config(QWEN3_CODER_30B)
    assert isinstance(cfg, Qwen3Config)
    assert cfg.moe == MoEConfig(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True)
    assert cfg.num_layers == 48 and all(cfg.moe_layers) and cfg.layer_windows == (None,) * 48
    assert cfg.rope == RopeConfig(theta=1e7, rotary_dim=128)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.eos_token_ids) == (128, 32, 4, (151645,))
    hash(cfg)  # usable as a static jit argument


def test_both_rope_schemas_agree():
    new = dict(QWEN3_CODER_30B)
    del new["rope_theta"], new["rope_scaling"]
    new["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000000}
    assert from_hf_config(new) == from_hf_config(QWEN3_CODER_30B)


def test_transformers_saved_config_roundtrip(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3MoeConfig(num_experts=16, num_experts_per_tok=2, mlp_only_layers=[0],
                                      decoder_sparse_step=2, num_hidden_layers=4)
    hf.save_pretrained(tmp_path)
    cfg = from_hf_config(tmp_path)
    # layer 0 is mlp-only; with decoder_sparse_step 2 only layers 1 and 3 are MoE
    assert cfg.moe_layers == (False, True, False, True)
    assert cfg.moe.num_experts == 16


def test_yarn_and_partial_rotary():
    raw = dict(QWEN3_CODER_30B, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32768},
               partial_rotary_factor=0.5)
    cfg = from_hf_config(raw)
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 4.0 and cfg.rope.rotary_dim == 64
    assert cfg.rope.original_max_position_embeddings == 32768


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"some_new_knob": 3}, "some_new_knob"),
        ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type 'longrope' is not supported"),
        ({"shared_expert_intermediate_size": 512}, "shared expert"),
        ({"num_experts_per_tok": 200}, "top_k=200"),
        ({"num_attention_heads": 30}, "not a multiple"),
        ({"model_type": "gpt_oss", "sliding_window": 128}, "not understood"),  # Qwen fields in a gpt_oss config
        ({"model_type": "llama"}, "unknown model_type 'llama'"),
        ({"vocab_size": None}, "required field 'vocab_size'"),
    ],
)
def test_bad_configs_raise_clear_errors(patch, message):
    with pytest.raises(ConfigError) as e:
        from_hf_config(dict(QWEN3_CODER_30B, **patch))
    assert message in str(e.value)


def test_missing_or_corrupt_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_CODER_30B))
    assert from_hf_config(tmp_path).hidden_size == 2048
