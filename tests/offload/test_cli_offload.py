"""`dflash-generate --offload`: same tokens as the resident run, route-ahead stats in --json, clear errors."""

from __future__ import annotations

import json

import pytest

import dflash_jax
from convert.cli import convert
from dflash_jax import testing
from dflash_jax.cli.generate import main
from dflash_jax.spec import generate
from dflash_jax.train.export import save_hf_draft, save_hf_target


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload_cli")
    pair = testing.random_pair(testing.tiny_qwen3_moe_config(num_layers=3), seed=5)
    save_hf_target(pair.target, pair.target_cfg, str(root / "target"))
    save_hf_draft(pair.draft, pair.draft_cfg, str(root / "draft"))
    convert(str(root / "target"), str(root / "draft"), str(root / "pair"), expert_format="mxfp4", dtype="fp32",
            progress=False)
    return root / "pair"


PROMPT = ",".join(str(i % 150) for i in range(1, 60))


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_offload_json_has_route_ahead_stats_and_the_resident_tokens(checkpoint, capsys):
    code, out, err = _run(capsys, "--checkpoint", checkpoint, "--prompt-ids", PROMPT, "--max-new-tokens", 16,
                          "--block-size", 4, "--json", "--ignore-eos", "--offload", "--expert-budget-mb", 0.05,
                          "--predictor", "previous+draft_router")
    assert code == 0, err
    result = json.loads(out)
    want = generate(dflash_jax.load(checkpoint), [[int(t) for t in PROMPT.split(",")]], max_new_tokens=16,
                    block_size=4)
    assert result["tokens"] == want.tokens[0]
    stats = result["stats"]
    assert stats["loop"] == "offloaded" and stats["offload"]["predictor"] == "previous+draft_router"
    assert stats["offload"]["slots_per_layer"] < stats["offload"]["num_experts"]
    summary = stats["route_ahead"]["summary"]
    for key in ("coverage", "waste", "hit_rate", "bytes_moved", "prefetched_bytes", "on_demand_bytes",
                "exposed_transfer_s", "hide_window_s"):
        assert key in summary
    assert summary["rounds"] == len(result["acceptance_lengths"])


@pytest.mark.parametrize("argv, message", [
    (["--offload"], "--expert-budget-mb"),
    (["--offload", "--expert-budget-mb", "1", "--predictor", "oracle"], "--predictor must be one of"),
    (["--expert-budget-mb", "1"], "only applies with --offload"),
    (["--offload", "--expert-budget-mb", "0.001"], "--expert-budget-mb"),
])
def test_offload_flag_errors(checkpoint, capsys, argv, message):
    code, _, err = _run(capsys, "--checkpoint", checkpoint, "--prompt-ids", PROMPT, "--max-new-tokens", 4, *argv)
    assert code == 2 and message in err and "Traceback" not in err
