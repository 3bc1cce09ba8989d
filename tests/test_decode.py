"""Plain greedy decoding equals transformers' greedy `generate`, batched, with stop tokens."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from convert import load_hf_target  # noqa: E402
from dflash_jax.decode import greedy_generate  # noqa: E402
from tests.hf_reference import build_and_save, hf_greedy, tiny_qwen3_moe_config  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    hf = build_and_save(tiny_qwen3_moe_config(), d, seed=11)
    cfg, weights = load_hf_target(d)
    return hf, cfg, weights


def test_greedy_equals_hf_generate_batched(pair):
    hf, cfg, weights = pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (300, 211, 17)]
    ours = greedy_generate(weights, cfg, prompts, max_new_tokens=32)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(hf, p, 32)


def test_stop_tokens_end_each_sequence(pair):
    hf, cfg, weights = pair
    prompts = [np.random.default_rng(1).integers(0, cfg.vocab_size, 40).tolist(), [5, 6, 7]]
    full = greedy_generate(weights, cfg, prompts, max_new_tokens=20)
    stop = full[0][6]
    cut = greedy_generate(weights, cfg, prompts, max_new_tokens=20, stop_ids=[stop])
    assert cut[0] == full[0][: full[0].index(stop) + 1]
    expect1 = full[1][: full[1].index(stop) + 1] if stop in full[1] else full[1]
    assert cut[1] == expect1


def test_bad_prompts(pair):
    _, cfg, weights = pair
    with pytest.raises(ValueError, match="at least one token"):
        greedy_generate(weights, cfg, [[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        greedy_generate(weights, cfg, [[1, cfg.vocab_size]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer, got 0"):
        greedy_generate(weights, cfg, [[1]], max_new_tokens=0)
    with pytest.raises(TypeError, match="max_new_tokens must be a positive integer, got float 4.0"):
        greedy_generate(weights, cfg, [[1]], max_new_tokens=4.0)
    with pytest.raises(TypeError, match="prompt 0: token 1 must be an integer id, got float 2.0"):
        greedy_generate(weights, cfg, [[1, 2.0]], max_new_tokens=4)
    with pytest.raises(ValueError, match="stop_ids entry must be a token id"):
        greedy_generate(weights, cfg, [[1]], max_new_tokens=4, stop_ids=[cfg.vocab_size])
