"""A DFlash 2 pair made with z-lab's classes, converted by `convert-weights` and run by `dflash_jax`: greedy output
equals transformers' greedy and z-lab's own `dflash_generate` (which proposes with the selector), round by round
the same proposals, proposals accepted; `dflash-generate` runs the selector chain by default."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
reference = pytest.importorskip("dflash.model")

import dflash_jax  # noqa: E402
from convert.cli import convert  # noqa: E402
from tests.hf_reference import (  # noqa: E402
    build_and_save, build_and_save_dflash2_draft, hf_greedy, make_agreeable_, save_dflash2_draft, tiny_dflash2_config,
    tiny_qwen3_moe_config,
)

LAYERS = 3
N = 32


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2_pair")
    target = build_and_save(tiny_qwen3_moe_config(num_hidden_layers=LAYERS), root / "t0", seed=1)
    draft = build_and_save_dflash2_draft(tiny_dflash2_config(target_layers=LAYERS, taps=(0, 1)), root / "d0", seed=2)
    make_agreeable_(target, draft)
    target.save_pretrained(root / "target")
    save_dflash2_draft(draft, root / "draft")  # the release layout
    out = root / "pair"
    convert(str(root / "target"), str(root / "draft"), str(out), expert_format="mxfp4", dtype="fp32", progress=False)
    return target, draft, out


@pytest.fixture(scope="module")
def converted(hf_pair):
    return dflash_jax.load(hf_pair[2])


def _prompts():
    return [np.random.default_rng(i).integers(0, 159, n).tolist() for i, n in enumerate((300, 64))]


def _reference_hf(target, pair):
    """The HF target with the experts the converted pair stores (MXFP4, dequantized)."""
    from tests.hf_reference import reference_with_experts

    return reference_with_experts(target, pair)


@pytest.mark.slow
def test_greedy_equals_transformers_and_reference_generate(hf_pair, converted):
    target, draft, _ = hf_pair
    assert converted.draft_cfg.dflash2
    prompts = _prompts()[:1]  # 300 tokens: RoPE far from position 0
    res = dflash_jax.generate(converted, prompts, max_new_tokens=N)  # the default: the selector chain
    hf_target = _reference_hf(target, converted)
    for prompt, tokens in zip(prompts, res.tokens):
        assert tokens == hf_greedy(hf_target, prompt, N)
        ids = reference.dflash_generate(draft, hf_target, torch.tensor([prompt]), max_new_tokens=N,
                                        stop_token_ids=None, temperature=0.0, return_stats=False)
        assert ids[0, len(prompt):].tolist() == tokens
    tau = float(np.mean([a for seq in res.acceptance_lengths for a in seq]))
    assert tau > 1.5, tau


@pytest.mark.slow
def test_stepping_rounds_propose_what_reference_proposes(hf_pair, converted, monkeypatch):
    """Round by round (the stepping loop's trace): our selector chain's proposals equal those z-lab's
    `DFlash2DraftModel.propose` returns in `dflash_generate` (greedy, full-width rounds)."""
    target, draft, _ = hf_pair
    prompt = _prompts()[0]
    hf_target = _reference_hf(target, converted)
    recorded = []
    original = draft.propose

    def recording(hidden, anchor_ids, output_head, temperature):
        out = original(hidden, anchor_ids, output_head, temperature)
        recorded.append(out[0][0].tolist())
        return out

    monkeypatch.setattr(draft, "propose", recording)
    reference.dflash_generate(draft, hf_target, torch.tensor([prompt]), max_new_tokens=N, stop_token_ids=None,
                              temperature=0.0, return_stats=False)
    res = dflash_jax.generate(converted, [prompt], max_new_tokens=N, proposer="selector", driver="stepping",
                              trace=True)
    ours = [r[0]["proposal"] for r in res.trace if r[0] is not None]
    full = [p for p in recorded if len(p) == converted.draft_cfg.block_size - 1]
    assert len(full) >= 3
    assert ours[:len(full)] == full


@pytest.mark.slow
def test_dflash_generate_cli_runs_the_selector_by_default(hf_pair, converted, capsys):
    from dflash_jax.cli.generate import main

    prompt = _prompts()[1]
    code = main(["--checkpoint", str(hf_pair[2]), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
                 str(N), "--json", "--ignore-eos"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    want = dflash_jax.generate(converted, [prompt], max_new_tokens=N, proposer="selector")
    assert result["tokens"] == want.tokens[0]
    assert result["acceptance_lengths"] == want.acceptance_lengths[0]
    assert result["stats"]["proposer"].startswith("head chain")  # a DFlash 2 draft's head is its selector
    marginal = dflash_jax.generate(converted, [prompt], max_new_tokens=N, proposer="chain")
    assert marginal.tokens == want.tokens  # lossless either way
