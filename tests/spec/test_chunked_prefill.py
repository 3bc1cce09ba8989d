"""Prefill by chunks (`spec.prefill`) builds the state the one-shot `begin` builds, on every target family:
Qwen3-MoE, gpt-oss (sliding window 16 < the prompt, sinks) and the Qwen3.5 hybrid (Gated DeltaNet conv and
recurrent state carried from chunk to chunk). fp32 tiny random pairs; two prompts of 53 and 21 tokens in chunks
of 16 (the first spans four chunks with a ragged last one; the second ends inside its second chunk, so its
later chunks are all padding). Same first token, the same live cache rows and DeltaNet states, the same greedy
continuation. The fast set checks Qwen3-MoE and gpt-oss's first token and caches; Qwen3.5 and the greedy
continuations (one more compiled loop each) are in the slow set."""

from __future__ import annotations

import numpy as np
import pytest

import jax

from dflash_jax import testing
from dflash_jax.cache import KVCache
from dflash_jax.spec import prefill
from dflash_jax.spec.loop import run_loop
from dflash_jax.spec.session import begin_arrays, prepare

CHUNK = 16
LENGTHS = (53, 21)
FAMILIES = {
    "qwen3_moe": testing.tiny_qwen3_moe_config,
    "gpt_oss": testing.tiny_gpt_oss_config,
    "qwen3_5": testing.tiny_qwen3_5_config,
}


@pytest.fixture(scope="module", params=[pytest.param(n, marks=[pytest.mark.slow] if n == "qwen3_5" else [])
                                        for n in FAMILIES], ids=list(FAMILIES))
def states(request):
    cfg = FAMILIES[request.param]()
    pair = testing.random_pair(cfg, seed=3, block_size=8, mask_token_id=cfg.vocab_size - 1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 100, n).tolist() for n in LENGTHS]
    prep = prepare(pair, prompts, max_new_tokens=24, stop_ids=[])
    args = (pair.target, pair.draft, prep.tokens, prep.lengths, prep.params, prep.key_data, prep.key_fold)
    whole = begin_arrays(*args, prep.spec)
    chunked = prefill.chunked_begin_jit(*args, prep.spec, chunk=CHUNK)
    return request.param, pair, prep, whole, chunked


def _rows(buf, lengths):
    return [np.asarray(buf[i, :, :n]) for i, n in enumerate(lengths)]  # [b, Hkv, S, d]: row i's first n slots


def _same_kv(a: KVCache, b: KVCache, lengths, what: str):
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths), err_msg=what)
    for layer, (ka, kb, va, vb) in enumerate(zip(a.keys, b.keys, a.values, b.values)):
        for i, (x, y) in enumerate(zip(_rows(ka, lengths) + _rows(va, lengths), _rows(kb, lengths) + _rows(vb, lengths))):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4, err_msg=f"{what} layer {layer} row {i % 2}")


def test_chunked_prefill_first_token_and_caches(states):
    name, pair, prep, whole, chunked = states
    assert prep.tokens.shape[1] > 3 * CHUNK  # several chunks, the last one ragged
    lengths = [int(n) for n in prep.lengths]
    np.testing.assert_array_equal(np.asarray(whole.output), np.asarray(chunked.output))
    np.testing.assert_array_equal(np.asarray(whole.done), np.asarray(chunked.done))
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(whole.key)),
                                  np.asarray(jax.random.key_data(chunked.key)))
    wt, ct = whole.target_cache, chunked.target_cache
    np.testing.assert_array_equal(np.asarray(wt.lengths), lengths)
    if name == "qwen3_5":
        from dflash_jax.models.qwen3_5 import committed_linear_states

        committed = jax.jit(committed_linear_states)
        for (sa, ta), (sb, tb) in zip(committed(wt), committed(ct)):
            np.testing.assert_allclose(np.asarray(sa), np.asarray(sb), rtol=1e-4, atol=1e-4, err_msg="DeltaNet state")
            np.testing.assert_allclose(np.asarray(ta), np.asarray(tb), rtol=1e-4, atol=1e-4, err_msg="conv tail")
        wt = KVCache(keys=wt.keys, values=wt.values, lengths=wt.lengths)
        ct = KVCache(keys=ct.keys, values=ct.values, lengths=ct.lengths)
    _same_kv(wt, ct, lengths, "target cache")
    _same_kv(whole.draft_cache, chunked.draft_cache, lengths, "draft context cache")


@pytest.mark.slow
def test_chunked_prefill_greedy_continuation(states):
    name, pair, prep, whole, chunked = states
    a = run_loop(pair.target, pair.draft, whole, prep.spec)
    b = run_loop(pair.target, pair.draft, chunked, prep.spec)
    out_a, out_b = np.asarray(a.output), np.asarray(b.output)
    assert (np.asarray(a.num_generated) == 24).all()
    np.testing.assert_array_equal(out_a, out_b)
    assert np.asarray(a.acceptance).max() >= 2  # proposals were accepted from the chunk-fed draft context


def test_chunked_prefill_rejects_a_bad_chunk():
    with pytest.raises(ValueError, match="chunk must be a positive"):
        prefill.chunked_begin(None, None, np.zeros((1, 4), np.int32), np.ones(1, np.int32), None, None, None, None,
                              chunk=0)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [8, 5])
def test_qwen3_5_chunks_within_the_rollback_width(chunk):
    """Chunks no wider than the DeltaNet rollback width (the verify block, 8) keep their rows instead of
    committing them, and the next chunk replays them from the checkpoint: still the one-shot state."""
    from dflash_jax.models.qwen3_5 import committed_linear_states

    cfg = testing.tiny_qwen3_5_config()
    pair = testing.random_pair(cfg, seed=3, block_size=8, mask_token_id=cfg.vocab_size - 1)
    rng = np.random.default_rng(0)
    prep = prepare(pair, [rng.integers(0, 100, n).tolist() for n in (29, 11)], max_new_tokens=16, stop_ids=[])
    args = (pair.target, pair.draft, prep.tokens, prep.lengths, prep.params, prep.key_data, prep.key_fold)
    whole = begin_arrays(*args, prep.spec)
    chunked = prefill.chunked_begin_jit(*args, prep.spec, chunk=chunk)
    committed = jax.jit(committed_linear_states)
    for (sa, ta), (sb, tb) in zip(committed(whole.target_cache), committed(chunked.target_cache)):
        np.testing.assert_allclose(np.asarray(sa), np.asarray(sb), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(ta), np.asarray(tb), rtol=1e-4, atol=1e-4)
    a = run_loop(pair.target, pair.draft, whole, prep.spec)
    b = run_loop(pair.target, pair.draft, chunked, prep.spec)
    np.testing.assert_array_equal(np.asarray(a.output), np.asarray(b.output))
