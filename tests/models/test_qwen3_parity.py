"""Qwen3 / Qwen3-MoE forwards against transformers on tiny random models saved to temp dirs."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from convert import load_hf_target  # noqa: E402
from dflash_jax.cache import rollback  # noqa: E402
from dflash_jax.models import qwen3  # noqa: E402
from tests.hf_reference import build_and_save, hf_forward, tiny_qwen3_config, tiny_qwen3_moe_config  # noqa: E402

FP32_TOL = 1e-4
PROMPT = 300


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_moe")
    hf = build_and_save(tiny_qwen3_moe_config(), d, seed=1)
    cfg, weights = load_hf_target(d)
    return hf, cfg, weights, d


@pytest.fixture(scope="module")
def dense_sliding_pair(tmp_path_factory):
    """Dense Qwen3 with one sliding-window layer narrower than the prompt."""
    d = tmp_path_factory.mktemp("qwen3_sliding")
    hf_cfg = tiny_qwen3_config(
        num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "full_attention"],
        sliding_window=48, use_sliding_window=True, attention_bias=True,
    )
    hf = build_and_save(hf_cfg, d, seed=2)
    cfg, weights = load_hf_target(d)
    assert cfg.layer_windows == (None, 48, None)
    return hf, cfg, weights, d


def _tokens(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def _topk_sets(router_logits, k):
    return np.sort(np.argsort(-router_logits, axis=-1)[..., :k], axis=-1)


@pytest.mark.parametrize("pair", ["moe_pair", "dense_sliding_pair"])
def test_prefill_logits_taps_and_routing(pair, request):
    hf, cfg, weights, _ = request.getfixturevalue(pair)
    tokens = _tokens(PROMPT + 17, cfg.vocab_size, 0)
    ref_logits, ref_hidden, ref_router = hf_forward(hf, tokens)
    cache = qwen3.init_cache(cfg, 1, 512)
    taps = tuple(range(cfg.num_layers))
    out = qwen3.forward_jit(weights, jnp.asarray(tokens[None]), cache, cfg, tap_layers=taps)
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=FP32_TOL, rtol=0)
    for i in taps:
        np.testing.assert_allclose(np.asarray(out.taps[i]), ref_hidden[i + 1], atol=FP32_TOL, rtol=0)
    assert int(out.cache.lengths[0]) == len(tokens)
    moe_layers = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]
    assert len(ref_router) == len(moe_layers)
    for r, i in zip(ref_router, moe_layers):
        ours = np.sort(np.asarray(out.router_experts[i])[0], axis=-1)
        np.testing.assert_array_equal(ours, _topk_sets(r, cfg.moe.top_k))
    for i in range(cfg.num_layers):
        assert (out.router_experts[i] is None) == (not cfg.moe_layers[i])


@pytest.mark.parametrize("pair", ["moe_pair", "dense_sliding_pair"])
def test_block_extensions_with_rollbacks(pair, request):
    """Prefill, then width-B blocks with a random number of rows kept after each (a speculative verify)."""
    hf, cfg, weights, _ = request.getfixturevalue(pair)
    rng = np.random.default_rng(3)
    committed = list(_tokens(PROMPT, cfg.vocab_size, 1))
    cache = qwen3.init_cache(cfg, 1, 512)
    out = qwen3.forward_jit(weights, jnp.asarray([committed]), cache, cfg, logits="last")
    cache = out.cache
    width = 6
    step = jax.jit(qwen3.forward, static_argnames=("cfg", "tap_layers", "logits", "implementation"))
    for round_ in range(5):
        block = list(rng.integers(0, cfg.vocab_size, width))
        out = step(weights, jnp.asarray([block], jnp.int32), cache, cfg, tap_layers=(0,))
        ref_logits, ref_hidden, _ = hf_forward(hf, np.array(committed + block))
        np.testing.assert_allclose(np.asarray(out.logits[0]), ref_logits[0, -width:], atol=FP32_TOL, rtol=0)
        np.testing.assert_allclose(np.asarray(out.taps[0][0]), ref_hidden[1][0, -width:], atol=FP32_TOL, rtol=0)
        keep = int(rng.integers(1, width + 1)) if round_ else 1  # first round keeps only the anchor
        committed += block[:keep]
        cache = rollback(out.cache, jnp.asarray([len(committed)]))
        assert int(cache.lengths[0]) == len(committed)
    # after the rollbacks, one-token decoding continues exactly
    nxt = [int(rng.integers(0, cfg.vocab_size))]
    out = step(weights, jnp.asarray([nxt], jnp.int32), cache, cfg)
    ref_logits, _, _ = hf_forward(hf, np.array(committed + nxt))
    np.testing.assert_allclose(np.asarray(out.logits[0, 0]), ref_logits[0, -1], atol=FP32_TOL, rtol=0)


def test_batched_prefill_and_extension_of_different_lengths(moe_pair):
    hf, cfg, weights, _ = moe_pair
    lengths = [PROMPT, 257, 131]
    seqs = [list(_tokens(n, cfg.vocab_size, 10 + i)) for i, n in enumerate(lengths)]
    t = max(lengths)
    padded = np.zeros((3, t), np.int32)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    cache = qwen3.init_cache(cfg, 3, 512)
    out = qwen3.forward_jit(weights, jnp.asarray(padded), cache, cfg, num_valid=jnp.asarray(lengths, jnp.int32))
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), lengths)
    for i, s in enumerate(seqs):
        ref_logits, _, _ = hf_forward(hf, np.array(s))
        np.testing.assert_allclose(np.asarray(out.logits[i, : len(s)]), ref_logits[0], atol=FP32_TOL, rtol=0)
    last = qwen3.forward_jit(weights, jnp.asarray(padded), qwen3.init_cache(cfg, 3, 512), cfg,
                             num_valid=jnp.asarray(lengths, jnp.int32), logits="last")
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(last.logits[i]), np.asarray(out.logits[i, n - 1]), atol=1e-6)
    # one width-4 extension for all three, then different rollbacks per sequence
    cache = out.cache
    rng = np.random.default_rng(4)
    for keep in ([1, 4, 2], [3, 1, 4]):
        block = rng.integers(0, cfg.vocab_size, (3, 4)).astype(np.int32)
        out = qwen3.forward_jit(weights, jnp.asarray(block), cache, cfg)
        for i, s in enumerate(seqs):
            ref_logits, _, _ = hf_forward(hf, np.array(s + list(block[i])))
            np.testing.assert_allclose(np.asarray(out.logits[i]), ref_logits[0, -4:], atol=FP32_TOL, rtol=0)
            seqs[i] = s + list(block[i, : keep[i]])
        cache = rollback(out.cache, jnp.asarray([len(s) for s in seqs]))


def test_bf16_within_dtype_tolerance(moe_pair, tmp_path):
    """bf16 weights and activations: our error against the fp32 reference is no worse than the
    reference's own bf16 error (the bf16 noise floor), measured on the same inputs."""
    hf, cfg, _, d = moe_pair
    tokens = _tokens(PROMPT, cfg.vocab_size, 5)
    ref32, _, _ = hf_forward(hf, tokens)
    hf16 = build_and_save(tiny_qwen3_moe_config(), tmp_path, seed=1, dtype=torch.bfloat16)
    ref16, _, _ = hf_forward(hf16, tokens)
    cfg16, w16 = load_hf_target(d, dtype="bf16")
    assert w16.embed.dtype == jnp.bfloat16
    cache = qwen3.init_cache(cfg16, 1, 512, dtype=jnp.bfloat16)
    ours = np.asarray(qwen3.forward_jit(w16, jnp.asarray(tokens[None]), cache, cfg16).logits)
    err_ours = np.abs(ours - ref32)
    err_ref = np.abs(ref16 - ref32)
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    scale = float(np.abs(ref32).max())
    assert err_ours.mean() <= 1.5 * err_ref.mean() + eps * scale * 0.01
    assert np.quantile(err_ours, 0.99) <= 1.5 * np.quantile(err_ref, 0.99) + eps * scale * 0.1
    # and it is a bf16 run, not an fp32 one in disguise
    assert err_ours.mean() > 1e-5


def test_sharded_checkpoint_and_tied_embeddings(tmp_path):
    hf_cfg = tiny_qwen3_moe_config(tie_word_embeddings=True, num_hidden_layers=2, mlp_only_layers=[])
    hf = build_and_save(hf_cfg, tmp_path, seed=7, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg, weights = load_hf_target(tmp_path)
    assert cfg.tie_word_embeddings and weights.lm_head is None
    tokens = _tokens(64, cfg.vocab_size, 6)
    ref_logits, _, _ = hf_forward(hf, tokens)
    out = qwen3.forward_jit(weights, jnp.asarray(tokens[None]), qwen3.init_cache(cfg, 1, 64), cfg)
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=FP32_TOL, rtol=0)
