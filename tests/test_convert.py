"""convert-weights: tiny random HF pairs -> dflash_jax checkpoint -> load -> forward equals the reference."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("dflash")
from safetensors.torch import load_file, save_file  # noqa: E402

import jax.numpy as jnp  # noqa: E402

import dflash_jax  # noqa: E402
from convert.cli import main  # noqa: E402
from dflash_jax.checkpoint import manifest_verifies  # noqa: E402
from convert.pipeline import convert  # noqa: E402
from dflash_jax.errors import CheckpointError, UsageError  # noqa: E402
from dflash_jax.config import ConfigError  # noqa: E402
from dflash_jax.models import qwen3  # noqa: E402
from dflash_jax.quant import MXFP4Tensor, NVFP4Tensor  # noqa: E402
from tests.hf_reference import (  # noqa: E402
    build_and_save, build_and_save_draft, hf_forward, reference_with_experts, tiny_draft_config,
    tiny_qwen3_moe_config,
)

TARGET_LAYERS = 3


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tdir, ddir = root / "target", root / "draft"
    target = build_and_save(tiny_qwen3_moe_config(num_hidden_layers=TARGET_LAYERS), tdir, seed=21)
    (tdir / "tokenizer.json").write_text('{"version": "1.0"}')
    draft = build_and_save_draft(tiny_draft_config(target_layers=TARGET_LAYERS), ddir, seed=22)
    return target, draft, tdir, ddir


@pytest.fixture(scope="module")
def converted(hf_pair, tmp_path_factory):
    _, _, tdir, ddir = hf_pair
    out = {}
    for fmt in ("mxfp4", "nvfp4", "bf16"):
        d = tmp_path_factory.mktemp("out") / fmt
        convert(str(tdir), str(ddir), str(d), expert_format=fmt, dtype="fp32", progress=False)
        out[fmt] = d
    return out


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "bf16"])
def test_round_trip_forward_equals_reference_on_stored_experts(hf_pair, converted, fmt):
    hf_target, _, _, _ = hf_pair
    pair = dflash_jax.load(converted[fmt])
    assert pair.expert_format == fmt
    kind = {"mxfp4": MXFP4Tensor, "nvfp4": NVFP4Tensor}.get(fmt)
    table = pair.target.layers[0].mlp.gate_up
    assert isinstance(table, kind) if kind else table.dtype == jnp.bfloat16
    ref = reference_with_experts(hf_target, pair)
    tokens = np.random.default_rng(0).integers(0, 160, 310)
    ref_logits, _, _ = hf_forward(ref, tokens)
    cfg = pair.target_cfg
    out = qwen3.forward_jit(pair.target, jnp.asarray(tokens[None]), qwen3.init_cache(cfg, 1, 320), cfg)
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-4, rtol=0)
    # FP4 is lossy: the unquantized reference differs, so the comparison above is not vacuous
    if kind:
        orig_logits, _, _ = hf_forward(hf_target, tokens)
        assert np.abs(orig_logits - ref_logits).max() > 1e-3


def test_draft_weights_and_manifest(hf_pair, converted):
    _, hf_draft, tdir, ddir = hf_pair
    pair = dflash_jax.load(converted["mxfp4"])
    np.testing.assert_array_equal(np.asarray(pair.draft.fc), hf_draft.fc.weight.detach().numpy().T)
    np.testing.assert_array_equal(np.asarray(pair.draft.layers[1].attn.q),
                                  hf_draft.layers[1].self_attn.q_proj.weight.detach().numpy().T)
    m = pair.manifest
    assert m["target_config"] == json.loads((tdir / "config.json").read_text())
    assert m["draft_config"] == json.loads((ddir / "config.json").read_text())
    assert m["converter_version"] and "tokenizer.json" in m["tokenizer_files"]
    assert "tokenizer.json" in m["checksums"]["files"] and manifest_verifies(m) is True  # covered, sealed
    assert pair.tokenizer_path and os.path.exists(pair.tokenizer_path)
    sha = hashlib.sha256((tdir / "model.safetensors").read_bytes()).hexdigest()
    assert m["sources"]["sha256"]["target/model.safetensors"] == sha
    assert m["tensors"]["target"]["layers.0.mlp.gate_up"] == {
        "format": "mxfp4", "shape": [8, 64, 64], "bytes": 8 * 64 * 64 // 2 + 8 * 64 * 2}
    # expert bytes are the MXFP4 size: 4.25 bits per weight (4-bit codes + one 8-bit scale per 32)
    cfg = pair.target_cfg
    moe_layers = sum(cfg.moe_layers)
    weights = moe_layers * cfg.moe.num_experts * 3 * cfg.hidden_size * cfg.moe.intermediate_size
    assert pair.expert_bytes == weights * 17 // 32 == m["expert_bytes"]
    bf16 = dflash_jax.load(converted["bf16"])
    assert bf16.expert_bytes == weights * 2


def test_expert_tables_can_live_in_pinned_host_memory(converted):
    pair = dflash_jax.load(converted["mxfp4"], expert_memory="pinned_host")
    assert pair.target.layers[0].mlp.gate_up.blocks.sharding.memory_kind == "pinned_host"
    assert pair.target.layers[0].attn.q.sharding.memory_kind == "device"
    with pytest.raises(ValueError, match="expert_memory must be"):
        dflash_jax.load(converted["mxfp4"], expert_memory="disk")


def _assert_nothing_written(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial")]


def _edited_copy(src, dst, config_patch=None, tensor_edit=None):
    shutil.copytree(src, dst)
    if config_patch:
        cfg = json.loads((dst / "config.json").read_text())
        for k, v in config_patch.items():
            if isinstance(v, dict) and isinstance(cfg.get(k), dict):
                cfg[k].update(v)
            else:
                cfg[k] = v
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensor_edit:
        tensors = load_file(dst / "model.safetensors")
        tensor_edit(tensors)
        save_file(tensors, dst / "model.safetensors")
    return dst


BAD_DRAFTS = [
    ({"dflash_config": {"target_layer_ids": [0, 5]}}, None, ConfigError, "the target's 3 layers"),
    ({"num_target_layers": 7}, None, ConfigError, "expects a target with 7 layers"),
    ({"dflash_config": {"mask_token_id": 999}}, None, ConfigError, "mask_token_id 999 is outside"),
    ({"hidden_size": 32}, None, ConfigError, "hidden size is 64"),
    ({"model_type": "mamba"}, None, ConfigError, "mamba"),
    (None, lambda t: t.pop("layers.1.mlp.up_proj.weight"), CheckpointError, "missing tensors"),
    (None, lambda t: t.update({"layers.0.mlp.down_proj.weight": torch.zeros(64, 95)}), CheckpointError, "has shape"),
]


@pytest.mark.parametrize("patch, edit, error, message", BAD_DRAFTS,
                         ids=["taps", "num-layers", "mask", "hidden", "model-type", "missing", "shape"])
def test_bad_pairs_fail_cleanly(hf_pair, tmp_path, patch, edit, error, message):
    _, _, tdir, ddir = hf_pair
    bad = _edited_copy(ddir, tmp_path / "bad_draft", patch, edit)
    out = tmp_path / "out"
    with pytest.raises(error) as e:
        convert(str(tdir), str(bad), str(out), progress=False)
    assert message in str(e.value)
    _assert_nothing_written(out)


def test_target_errors_fail_cleanly(hf_pair, tmp_path):
    _, _, tdir, ddir = hf_pair
    out = tmp_path / "out"
    dup = _edited_copy(tdir, tmp_path / "dup")
    save_file({"model.norm.weight": torch.ones(64)}, dup / "extra.safetensors")
    late = _edited_copy(tdir, tmp_path / "late", tensor_edit=lambda t: t.pop("model.norm.weight"))
    cases = [
        (str(tmp_path / "nope"), str(ddir), CheckpointError, "does not exist"),
        (str(ddir), str(tdir), ConfigError, "swap --target and --draft"),
        (str(tdir), str(tdir), ConfigError, "is not a DFlash draft"),
        (str(dup), str(ddir), CheckpointError, "appears in both"),
        (str(late), str(ddir), CheckpointError, "missing tensors for final_norm"),
    ]
    for target, draft, error, message in cases:
        with pytest.raises(error) as e:
            convert(target, draft, str(out), progress=False)
        assert message in str(e.value)
        _assert_nothing_written(out)


def test_existing_output_is_kept_unless_overwrite(hf_pair, tmp_path):
    _, _, tdir, ddir = hf_pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(CheckpointError, match="already exists"):
        convert(str(tdir), str(ddir), str(out), progress=False)
    # --overwrite replaces only a previous convert-weights output, never another directory
    with pytest.raises(UsageError, match="replaces only a dflash_jax checkpoint"):
        convert(str(tdir), str(ddir), str(out), overwrite=True, progress=False)
    assert (out / "keep").read_text() == "x"
    (out / "keep").unlink()
    out.rmdir()
    convert(str(tdir), str(ddir), str(out), expert_format="bf16", progress=False)
    (out / "extra").write_text("y")
    convert(str(tdir), str(ddir), str(out), overwrite=True, progress=False)
    assert (out / "manifest.json").exists() and not (out / "extra").exists()
    assert json.loads((out / "manifest.json").read_text())["expert_format"] == "mxfp4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial, old or lock files left


def test_cli_exit_codes_and_messages(hf_pair, tmp_path, capsys):
    _, _, tdir, ddir = hf_pair
    out = tmp_path / "cli"
    assert main(["--target", str(tdir), "--draft", str(ddir), "--out", str(out), "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["--target", str(tdir), "--draft", str(ddir), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err  # one line, no traceback
    with pytest.raises(SystemExit) as e:
        main(["--target", str(tdir), "--draft", str(ddir), "--out", str(out), "--expert-format", "int3"])
    assert e.value.code == 2
    with pytest.raises(CheckpointError, match="not a dflash_jax checkpoint"):
        dflash_jax.load(tdir)


def test_python_dash_m_convert(hf_pair, tmp_path):
    _, _, tdir, ddir = hf_pair
    r = subprocess.run([sys.executable, "-m", "convert", "--target", str(tdir), "--draft", str(ddir),
                        "--out", str(tmp_path / "m"), "--quiet", "--expert-format", "nvfp4"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    pair = dflash_jax.load(tmp_path / "m")  # a checkpoint that loads, in the format the flag asked for
    assert pair.expert_format == "nvfp4" and type(pair.target.layers[0].mlp.gate_up).__name__ == "NVFP4Tensor"
