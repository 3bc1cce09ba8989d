"""The pairs that ship with the package (`dflash_jax.SHIPPED_PAIRS`): the hybrid Qwen3.5-MoE pair loads (sha256
verified) and its DFlash greedy output is the plain greedy output, with real acceptance, on a held-out prompt;
`dflash-generate --pair NAME` picks a pair by name, and its misuse is one clear error."""

from __future__ import annotations

import json
import os

import pytest

import dflash_jax
from dflash_jax.cli.generate import main

HYBRID = "tiny_pair_qwen3_5"
NEW = 32


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_shipped_pairs_names_and_default():
    assert dflash_jax.SHIPPED_PAIRS["tiny_pair"] == dflash_jax.SHIPPED_PAIR
    for name, path in dflash_jax.SHIPPED_PAIRS.items():
        assert os.path.exists(os.path.join(path, "manifest.json")), name
        assert os.path.exists(os.path.join(path, "train_summary.json")), name


@pytest.mark.parametrize("argv, message", [
    (["--pair", "nope"], "--pair 'nope' is not a shipped pair; the shipped pairs are: tiny_pair, tiny_pair_qwen3_5, "
                        "tiny_pair_dflash2, tiny_pair_qwen3_5_dflash2"),
    (["--pair", HYBRID, "--checkpoint", "somewhere"], "--pair and --checkpoint both name a checkpoint"),
])
def test_pair_flag_errors(capsys, argv, message):
    code, out, err = _run(capsys, *argv, "--prompt-ids", "1,2")
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def hybrid():
    from dflash_jax.train.data import file_windows

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIRS[HYBRID])
    prompt = file_windows(pair, "held_out", 1, 64, seed=3)[0]
    return pair, prompt


def test_hybrid_pair_is_a_qwen3_5_target(hybrid):
    pair, _ = hybrid
    cfg = pair.target_cfg
    assert cfg.model_type == "qwen3_5_moe"
    assert "linear_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    assert cfg.moe.num_experts > 1 and cfg.shared_expert_intermediate_size > 0


@pytest.fixture(scope="module")
def plain_greedy(hybrid):
    from dflash_jax.decode import greedy_generate

    pair, prompt = hybrid
    return greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=NEW, stop_ids=[])[0]


def test_hybrid_pair_dflash_equals_plain_greedy_with_acceptance(hybrid, plain_greedy):
    """DFlash greedy == plain greedy on a held-out prompt, committing well over one token per round."""
    from dflash_jax.spec import generate

    pair, prompt = hybrid
    res = generate(pair, [prompt], max_new_tokens=NEW, stop_ids=[], block_size=8)
    assert res.tokens[0] == plain_greedy
    assert res.mean_acceptance() > 1.5, res.acceptance_lengths


@pytest.mark.slow
def test_cli_pair_runs_the_hybrid_pair(hybrid, plain_greedy, capsys):
    """`dflash-generate --pair tiny_pair_qwen3_5` runs that pair: the same tokens as its plain greedy."""
    _, prompt = hybrid
    code, out, _ = _run(capsys, "--pair", HYBRID, "--prompt-ids", ",".join(map(str, prompt)),
                        "--max-new-tokens", NEW, "--ignore-eos", "--json", "--block-size", 8)
    assert code == 0
    result = json.loads(out)
    assert result["tokens"] == plain_greedy and result["stats"]["mean_acceptance"] > 1.5


def test_hybrid_pair_is_small_and_portable():
    root = dflash_jax.SHIPPED_PAIRS[HYBRID]
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    assert 0 < size <= 10 * 2**20
    for _, _, fs in os.walk(root):
        assert "commit_success.txt" not in fs
    sources = json.load(open(os.path.join(root, "manifest.json")))["sources"]
    assert not os.path.isabs(sources["target"]) and not os.path.isabs(sources["draft"])
    split = json.load(open(os.path.join(root, "split.json")))
    shipped = json.load(open(os.path.join(dflash_jax.SHIPPED_PAIR, "split.json")))
    assert split["held_out_files"] == shipped["held_out_files"]  # same corpus split as the default pair


DFLASH2 = "tiny_pair_dflash2"
# the DFlash 2 variants and the pair whose target each reads
DFLASH2_VARIANTS = [(DFLASH2, "tiny_pair"), ("tiny_pair_qwen3_5_dflash2", HYBRID)]


@pytest.mark.parametrize("name, base", DFLASH2_VARIANTS)
def test_dflash2_pairs_are_small_draft_variants_of_their_targets_pairs(name, base):
    """A DFlash 2 pair ships its draft only: its target is its base pair's, read from beside it and checked
    against its own manifest; its default proposer is the selector chain."""
    from dflash_jax import checkpoint as ckpt_io
    from dflash_jax.api import default_proposer
    from dflash_jax.models.draft import is_selector

    root = dflash_jax.SHIPPED_PAIRS[name]
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    assert 0 < size <= 4 * 2**20 and not os.path.exists(os.path.join(root, "target"))
    assert json.load(open(os.path.join(root, "manifest.json")))[ckpt_io.TARGET_FROM] == base
    pair = dflash_jax.load(root)
    assert pair.draft_cfg.dflash2 and is_selector(pair.draft.branch_head)
    assert pair.target_cfg == dflash_jax.load(dflash_jax.SHIPPED_PAIRS[base]).target_cfg
    assert default_proposer(pair) == "selector"
    for d, _, fs in os.walk(root):
        assert "commit_success.txt" not in fs


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, _ in DFLASH2_VARIANTS])
def test_dflash2_pair_selector_chain_equals_plain_greedy_with_acceptance(name):
    from dflash_jax.decode import greedy_generate
    from dflash_jax.train.data import file_windows

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIRS[name])
    prompt = file_windows(pair, "held_out", 1, 64, seed=3)[0]
    want = greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=NEW, stop_ids=[])
    res = dflash_jax.generate(pair, [prompt], max_new_tokens=NEW, proposer="selector", block_size=8, stop_ids=[])
    assert res.tokens == want and res.mean_acceptance() > 1.5
