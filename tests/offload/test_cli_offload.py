"""`dflash-generate --offload`: same tokens as the resident run, route-ahead stats in --json, a per-round
--trace with the bytes each round moved, clear errors."""

from __future__ import annotations

import json

import pytest

import dflash_jax
from convert.cli import convert
from dflash_jax import testing
from dflash_jax.cli.generate import main
from dflash_jax.spec import generate, generate_stepping
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
                          "--predictor", "previous+draft_router+residual", "--trace")
    assert code == 0, err
    result = json.loads(out)
    want = generate_stepping(dflash_jax.load(checkpoint), [[int(t) for t in PROMPT.split(",")]], max_new_tokens=16,
                             block_size=4, trace=True)
    assert result["tokens"] == want.tokens[0]
    # the offloaded rounds propose and accept what the resident rounds do, and say what each moved
    assert [{k: r[k] for k in ("proposal", "accepted", "bonus")} for r in result["trace"]] == \
        [{k: row[0][k] for k in ("proposal", "accepted", "bonus")} for row in want.trace if row[0] is not None]
    moved = [r["bytes_moved"] for r in result["trace"]]
    assert sum(moved) == result["stats"]["route_ahead"]["summary"]["bytes_moved"] > 0
    stats = result["stats"]
    assert stats["loop"] == "offloaded" and stats["offload"]["predictor"] == "previous+draft_router+residual"
    assert stats["offload"]["cache_slots"] < stats["offload"]["num_experts"] * stats["offload"]["moe_layers"]
    assert stats["offload"]["pool_bytes"] <= stats["offload"]["budget_bytes"]
    for r in result["trace"]:  # per round: hits + misses = routed experts; misses fetched (no host compute here)
        assert r["misses"] == r["on_demand"] + r["host"] and r["host"] == 0 and 0 <= r["coverage"] <= 1
        assert r["passes"] >= stats["offload"]["moe_layers"]
    summary = stats["route_ahead"]["summary"]
    for key in ("coverage", "waste", "hit_rate", "bytes_moved", "prefetched_bytes", "on_demand_bytes",
                "exposed_transfer_s", "hide_window_s"):
        assert key in summary
    assert summary["rounds"] == len(result["acceptance_lengths"])


@pytest.mark.parametrize("argv, message", [
    (["--offload"], "--expert-budget-mb"),
    (["--offload", "--expert-budget-mb", "1", "--predictor", "oracle"], "--predictor must be one of"),
    (["--expert-budget-mb", "1"], "only applies with --experts offload"),
    (["--offload", "--expert-budget-mb", "0.001"], "below the minimum of"),
    (["--offload", "--expert-budget-mb", "1", "--pin-experts", "hot"], "--pin-experts must be"),
])
def test_offload_flag_errors(checkpoint, capsys, argv, message):
    code, _, err = _run(capsys, "--checkpoint", checkpoint, "--prompt-ids", PROMPT, "--max-new-tokens", 4, *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_any_budget_runs_and_a_budget_below_the_minimum_is_refused_at_once(checkpoint, capsys, monkeypatch):
    """The minimum budget (one expert) runs in passes with the resident tokens; one byte less is refused with
    the minimum in MB before the pair is loaded (loading is made to fail to prove it)."""
    from dflash_jax.offload import HostExpertStore

    pair = dflash_jax.load(checkpoint, expert_memory="pinned_host")
    store = HostExpertStore(pair.target)
    eb = store.expert_bytes(store.layer_ids[0])
    prompt = [int(t) for t in PROMPT.split(",")]
    want = generate(dflash_jax.load(checkpoint), [prompt], max_new_tokens=8, block_size=4)
    code, out, err = _run(capsys, "--checkpoint", checkpoint, "--prompt-ids", PROMPT, "--max-new-tokens", 8,
                          "--block-size", 4, "--json", "--ignore-eos", "--offload", "--expert-budget-mb", eb / 1e6,
                          "--pin-experts", "none", "--placement", "hybrid", "--trace")
    assert code == 0, err
    result = json.loads(out)
    assert result["tokens"] == want.tokens[0]
    assert result["stats"]["offload"]["cache_slots"] == 1 and result["stats"]["offload"]["placement"] == "hybrid"
    assert sum(r["passes"] for r in result["trace"]) > 3 * len(result["trace"])  # layers ran in passes

    def no_load(*a, **k):
        raise AssertionError("loaded the pair before checking the budget")

    monkeypatch.setattr(dflash_jax, "load", no_load)
    code, _, err = _run(capsys, "--checkpoint", checkpoint, "--prompt-ids", PROMPT, "--offload", "--expert-budget-mb",
                        (eb - 1) / 1e6)
    assert code == 2 and f"minimum of {eb / 1e6:.6g} MB" in err and "Traceback" not in err


@pytest.fixture(scope="module", params=["gpt_oss", "qwen3_5"])
def converted_family_pair(request, tmp_path_factory):
    """A converted pair of another target family, built by transformers (so through the real checkpoint
    path): gpt-oss in the release layout (MXFP4 experts kept packed, expert biases), Qwen3.5-MoE (DeltaNet +
    gated attention, shared expert; experts converted to MXFP4); 16 experts so a budget can hold part of them.
    Agreement is planted (`make_agreeable_`), so the draft's proposals are accepted (tau 2.14 and 1.88)."""
    pytest.importorskip("torch")
    pytest.importorskip("dflash")
    from tests.hf_reference import (
        build_and_save, build_and_save_draft, build_gpt_oss, make_agreeable_, save_gpt_oss_mxfp4_release,
        tiny_draft_config, tiny_gpt_oss_config, tiny_qwen3_5_moe_config,
    )

    root = tmp_path_factory.mktemp(f"offload_cli_{request.param}")
    if request.param == "gpt_oss":
        target = build_gpt_oss(tiny_gpt_oss_config(num_local_experts=16), seed=3)
    else:
        target = build_and_save(tiny_qwen3_5_moe_config(num_experts=16), root / "target", seed=3)
    draft = build_and_save_draft(tiny_draft_config(target_layers=4, taps=(0, 2)), root / "draft", seed=4)
    make_agreeable_(target, draft)
    draft.save_pretrained(root / "draft")
    if request.param == "gpt_oss":
        save_gpt_oss_mxfp4_release(target, root / "target")
    else:
        target.save_pretrained(root / "target")
    convert(str(root / "target"), str(root / "draft"), str(root / "pair"), expert_format="mxfp4", dtype="fp32",
            progress=False)
    return root / "pair"


@pytest.mark.slow
def test_offload_cli_on_every_family(converted_family_pair, capsys):
    from dflash_jax.offload import HostExpertStore

    pair = dflash_jax.load(converted_family_pair, expert_memory="pinned_host")
    store = HostExpertStore(pair.target)
    per_slot = sum(store.expert_bytes(layer) for layer in store.layer_ids)
    budget_mb = (12 * per_slot + 1) / 1e6  # 12 of 16 experts per layer on average
    prompt = [int(t) for t in PROMPT.split(",")]
    code, out, err = _run(capsys, "--checkpoint", converted_family_pair, "--prompt-ids", PROMPT, "--max-new-tokens",
                          16, "--block-size", 4, "--json", "--ignore-eos", "--offload", "--expert-budget-mb", budget_mb,
                          "--predictor", "previous+draft_router+residual")
    assert code == 0, err
    result = json.loads(out)
    want = generate(dflash_jax.load(converted_family_pair), [prompt], max_new_tokens=16, block_size=4)
    assert result["tokens"] == want.tokens[0]
    assert result["acceptance_lengths"] == want.acceptance_lengths[0]
    accepted = want.acceptance_lengths[0]
    assert want.stats["mean_acceptance"] >= 1.5 and min(accepted) == 1 and max(accepted) >= 2, accepted  # real rounds
    offload = result["stats"]["offload"]
    assert offload["cache_slots"] == 12 * offload["moe_layers"] and offload["num_experts"] == 16
    assert result["stats"]["route_ahead"]["summary"]["bytes_moved"] > 0
