"""DFlash over a hybrid Gated-DeltaNet target (Qwen3.5-MoE): greedy output equals the target's own for
200+ tokens at block sizes 4, 8, 16, so every verify's linear-attention rollback is exact."""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from convert import load_hf_target  # noqa: E402
from dflash_jax import testing  # noqa: E402
from dflash_jax.decode import greedy_generate  # noqa: E402
from dflash_jax.pair import Pair, check_pair  # noqa: E402
from dflash_jax.spec import generate  # noqa: E402
from tests.hf_reference import build_and_save, tiny_qwen3_5_moe_config  # noqa: E402


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5")
    hf = build_and_save(tiny_qwen3_5_moe_config(), d, seed=3)
    # something to agree on (see tests.hf_reference.make_agreeable_): zero-centred final norm, so 1 + 29
    with torch.no_grad():
        hf.model.norm.weight[0] = 29.0
        hf.lm_head.weight[:, 0] = 0.0
        hf.lm_head.weight[7, 0] = 2.0
        hf.lm_head.weight[9, 0] = -2.0
    hf.save_pretrained(d)
    cfg, weights = load_hf_target(d)
    dcfg = testing.tiny_draft_config(cfg, target_layer_ids=(0, 2), block_size=16, mask_token_id=159,
                                     num_target_layers=cfg.num_layers, vocab_size=cfg.vocab_size)
    draft = testing.random_draft_weights(dcfg, jax.random.key(4))
    draft = draft.replace(final_norm=draft.final_norm.at[0].set(30.0))
    check_pair(cfg, dcfg)
    return Pair(target_cfg=cfg, target=weights, draft_cfg=dcfg, draft=draft, manifest={"expert_format": "dense"},
                directory=str(d))


@pytest.mark.parametrize("block", [4, 8, 16])
def test_greedy_dflash_equals_plain_greedy_on_hybrid_target(hybrid_pair, block):
    pair = hybrid_pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 159, 300).tolist(), rng.integers(0, 159, 77).tolist()]
    n = 200
    plain = greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=n)
    spec = generate(pair, prompts, max_new_tokens=n, block_size=block)
    assert spec.tokens == plain
    accepted = [a for seq in spec.acceptance_lengths for a in seq]
    assert max(accepted) > 1 and min(accepted) == 1  # rollbacks of every kind happened


def test_converted_qwen3_5_pair_runs_losslessly(tmp_path):
    """convert-weights on a Qwen3.5 target (fused experts -> MXFP4) + a z-lab draft; DFlash on the result."""
    pytest.importorskip("dflash")
    import dflash_jax
    from convert.cli import convert
    from tests.hf_reference import build_and_save_draft, tiny_draft_config

    build_and_save(tiny_qwen3_5_moe_config(), tmp_path / "t", seed=3)
    build_and_save_draft(tiny_draft_config(target_layers=4, taps=(0, 2)), tmp_path / "d", seed=4)
    convert(str(tmp_path / "t"), str(tmp_path / "d"), str(tmp_path / "out"), expert_format="mxfp4", dtype="fp32",
            progress=False)
    pair = dflash_jax.load(tmp_path / "out")
    assert type(pair.target.layers[0].mlp.gate_up).__name__ == "MXFP4Tensor"
    cfg = pair.target_cfg
    assert pair.expert_bytes == cfg.num_layers * cfg.moe.num_experts * 3 * cfg.hidden_size * cfg.moe.intermediate_size * 17 // 32
    prompts = [np.random.default_rng(1).integers(0, 159, 120).tolist()]
    plain = greedy_generate(pair.target, cfg, prompts, max_new_tokens=40)
    assert generate(pair, prompts, max_new_tokens=40, block_size=8).tokens == plain
