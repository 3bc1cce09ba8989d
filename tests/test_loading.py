"""Loading HF checkpoints: layouts (per-expert, fused, sharded) and every bad-input case."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

import jax.numpy as jnp  # noqa: E402

from convert import load_hf_target  # noqa: E402
from dflash_jax import CheckpointError, ConfigError  # noqa: E402
from dflash_jax.models import qwen3  # noqa: E402
from tests.hf_reference import build_and_save, hf_forward, tiny_qwen3_moe_config  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    hf = build_and_save(tiny_qwen3_moe_config(num_hidden_layers=2, mlp_only_layers=[]), d, seed=3)
    return hf, d


def _copy(src, dst):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def _rewrite(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_fused_expert_layout_loads_identically(saved, tmp_path):
    """Fused `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]` (transformers' in-memory
    layout, used by some releases) gives the same model as the per-expert layout."""
    hf, src = saved
    d = _copy(src, tmp_path / "fused")
    (d / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, d / "model.safetensors")
    cfg, w_fused = load_hf_target(d)
    _, w_per = load_hf_target(src)
    for a, b in zip(w_fused.layers, w_per.layers):
        np.testing.assert_array_equal(np.asarray(a.mlp.gate_up), np.asarray(b.mlp.gate_up))
        np.testing.assert_array_equal(np.asarray(a.mlp.down), np.asarray(b.mlp.down))
    tokens = np.arange(40) % cfg.vocab_size
    ref, _, _ = hf_forward(hf, tokens)
    out = qwen3.forward_jit(w_fused, jnp.asarray(tokens[None]), qwen3.init_cache(cfg, 1, 64), cfg)
    np.testing.assert_allclose(np.asarray(out.logits), ref, atol=1e-4, rtol=0)


def test_bf16_source_loads_into_fp32(saved, tmp_path):
    hf, src = saved
    d = _copy(src, tmp_path / "bf16src")
    _rewrite(d, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    _, w = load_hf_target(d, dtype="fp32")
    assert w.embed.dtype == jnp.float32
    expected = hf.model.embed_tokens.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(w.embed), expected)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"), "missing tensors for layers.1.attn.k_norm"),
        (lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"), "missing tensors for layers.0.mlp.gate_up"),
        (lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": torch.zeros(2)}), "not part of the model"),
        (lambda t: t.update({"model.layers.7.input_layernorm.weight": torch.zeros(64)}), "config does not have"),
        (lambda t: t.update({"model.norm.weight": torch.zeros(65)}), "has shape (65,)"),
        (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 64, 64)}), "duplicate"),
    ],
    ids=["missing", "missing-expert", "unknown", "layer-out-of-range", "shape", "duplicate"],
)
def test_bad_checkpoints_raise_one_clear_error(saved, tmp_path, edit, message):
    _, src = saved
    d = _copy(src, tmp_path / "bad")
    _rewrite(d, edit)
    with pytest.raises(CheckpointError, match=None) as e:
        load_hf_target(d)
    assert message in str(e.value)


def test_config_that_does_not_match_weights(saved, tmp_path):
    _, src = saved
    d = _copy(src, tmp_path / "wrongcfg")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config does not match the weights"):
        load_hf_target(d)


def test_missing_directory_config_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_target(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        load_hf_target(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_qwen3_moe_config().to_dict()))
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_hf_target(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_hf_target(tmp_path)


def test_duplicate_tensor_across_shards(saved, tmp_path):
    _, src = saved
    d = _copy(src, tmp_path / "dup")
    save_file({"model.norm.weight": torch.ones(64)}, d / "extra.safetensors")
    with pytest.raises(CheckpointError, match="appears in both"):
        load_hf_target(d)


def test_unknown_dtype_argument(saved):
    _, src = saved
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_hf_target(src, dtype="int4")
