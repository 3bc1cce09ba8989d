"""Attention cost follows the live length: the chunked (flash-decoding) path of `nn.attention` equals the
dense path, never reads chunks past the live length, and serves every model family unchanged."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from dflash_jax.nn import attention  # noqa: E402
from dflash_jax.nn.attention import AttentionTuning, cached_causal_attention, kv_cache_attention  # noqa: E402

DENSE = AttentionTuning(dense_max_rows=None)
CHUNK = 16
CHUNKED = AttentionTuning(chunk=CHUNK, dense_max_rows=0)


def _tol(dtype, scale=32):
    return scale * float(jnp.finfo(dtype).eps)


def _case(rng, *, batch_starts, t, rows, hkv=2, g=2, d=16, dtype=jnp.float32):
    b = len(batch_starts)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    starts = jnp.asarray(batch_starts, jnp.int32)
    return dict(
        q=arr(b, t, hkv * g, d), k=arr(b, t, hkv, d), v=arr(b, t, hkv, d),
        k_buf=arr(b, rows, hkv, d), v_buf=arr(b, rows, hkv, d),
        positions=starts[:, None] + jnp.arange(t, dtype=jnp.int32),
        sinks=jnp.asarray(rng.standard_normal(hkv * g) * 2.0, jnp.float32),
    )


def _run(c, tuning, *, window=None, sinks=False):
    out, _, _ = cached_causal_attention(c["q"], c["k"], c["v"], c["k_buf"], c["v_buf"], c["positions"],
                                        window=window, scale=c["q"].shape[-1] ** -0.5,
                                        sinks=c["sinks"] if sinks else None, tuning=tuning)
    return np.asarray(out.astype(jnp.float32))


# batch rows at different lengths, ends straddling chunk boundaries (16): 0+T, 15+T, 16+T, 47+T, ...
STARTS = (0, 15, 16, 47, 90)


@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("window,sinks", [(None, False), (24, True), (5, True)])
def test_chunked_equals_dense(t, window, sinks):
    c = _case(np.random.default_rng(t), batch_starts=STARTS, t=t, rows=150)  # 150: not a multiple of 16
    dense, chunked = _run(c, DENSE, window=window, sinks=sinks), _run(c, CHUNKED, window=window, sinks=sinks)
    np.testing.assert_allclose(chunked, dense, rtol=_tol(jnp.float32), atol=_tol(jnp.float32))
    assert np.abs(dense).max() > 0.05  # real attention output, not all-zero rows


def test_buffer_end_not_multiple_of_chunk():
    """A sequence whose live rows reach the last, partial chunk: that chunk is read from `rows - chunk`,
    overlapping the previous one, whose rows must not count twice."""
    c = _case(np.random.default_rng(3), batch_starts=(130, 3), t=16, rows=150)
    np.testing.assert_allclose(_run(c, CHUNKED, sinks=True), _run(c, DENSE, sinks=True),
                               rtol=_tol(jnp.float32), atol=_tol(jnp.float32))


@pytest.mark.parametrize("window", [None, 24])
def test_garbage_past_live_length_never_leaks(window):
    """NaN / inf planted in every slot at or past each sequence's live length (including the rest of the
    chunk holding its last live row): the chunked output equals the dense output on a clean buffer."""
    rng = np.random.default_rng(7)
    t, rows = 16, 400
    c = _case(rng, batch_starts=STARTS, t=t, rows=rows)
    clean = _run(c, DENSE, window=window, sinks=True)
    ends = np.asarray(STARTS) + t
    slot = np.arange(rows)[None, :, None, None]
    past = slot >= ends[:, None, None, None]
    poison = np.where(rng.random(c["k_buf"].shape) < 0.5, np.nan, np.inf)
    dirty = dict(c, k_buf=jnp.where(past, poison, c["k_buf"]), v_buf=jnp.where(past, -poison, c["v_buf"]))
    out = _run(dirty, CHUNKED, window=window, sinks=True)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, clean, rtol=_tol(jnp.float32), atol=_tol(jnp.float32))


def test_reads_only_live_chunks(monkeypatch):
    """The chunked path reads exactly the chunks from the first one a window can see to the one holding the
    last live row: a 4096-row buffer with 40 live rows costs 3 chunk reads per buffer, not 256."""
    read = []
    original = attention.read_chunk

    def recording(buf, offset, chunk):
        jax.debug.callback(lambda o: read.append(int(o)), offset, ordered=True)
        return original(buf, offset, chunk)

    monkeypatch.setattr(attention, "read_chunk", recording)
    rng = np.random.default_rng(1)
    c = _case(rng, batch_starts=(24, 7), t=16, rows=4096)  # live lengths 40 and 23 -> chunks 0, 1, 2
    _run(c, CHUNKED)
    jax.effects_barrier()
    assert sorted(read) == [0, 0, 16, 16, 32, 32]  # K and V of each chunk
    read.clear()
    c = _case(rng, batch_starts=(100, 70), t=1, rows=4096)  # window 8: queries 70, 100 see keys from 63
    _run(c, CHUNKED, window=8)
    jax.effects_barrier()
    assert sorted(read) == [48, 48, 64, 64, 80, 80, 96, 96]  # chunks 3 (48..63) to 6 (96..111)


def test_live_chunks_bounds():
    first, stop = attention.live_chunks(jnp.array([[30], [50]]), jnp.array([31, 51]), rows=1000, chunk=16)
    assert (int(first), int(stop)) == (0, 4)
    first, stop = attention.live_chunks(jnp.array([[30], [50]]), jnp.array([31, 51]), rows=1000, chunk=16, window=8)
    assert (int(first), int(stop)) == (1, 4)  # earliest visible key: 30 - 8 + 1 = 23, in chunk 1
    first, stop = attention.live_chunks(jnp.array([[990]]), jnp.array([5000]), rows=1000, chunk=16)
    assert int(stop) == 63  # clamped to the buffer


def test_bf16_chunked_matches_dense():
    c32 = _case(np.random.default_rng(5), batch_starts=STARTS, t=16, rows=150)
    c16 = {k: (v.astype(jnp.bfloat16) if v.dtype == jnp.float32 and k != "sinks" else v) for k, v in c32.items()}
    reference = _run(c32, DENSE, window=24, sinks=True)
    dense, chunked = _run(c16, DENSE, window=24, sinks=True), _run(c16, CHUNKED, window=24, sinks=True)
    # each path rounds its probabilities (dense: normalized, chunked: running) and its output to bf16 once
    np.testing.assert_allclose(chunked, dense, rtol=_tol(jnp.bfloat16, 4), atol=_tol(jnp.bfloat16, 4))
    np.testing.assert_allclose(chunked, reference, rtol=_tol(jnp.bfloat16, 4), atol=_tol(jnp.bfloat16, 4))


def test_chunked_gradient_is_the_dense_gradient():
    c = _case(np.random.default_rng(2), batch_starts=(3, 40), t=16, rows=120)

    def loss(tuning):
        def f(q, k_buf, v_buf, sinks):
            out, _, _ = cached_causal_attention(q, c["k"], c["v"], k_buf, v_buf, c["positions"], window=24,
                                                scale=0.25, sinks=sinks, tuning=tuning)
            return jnp.sum(out * jnp.cos(out))
        return jax.grad(f, argnums=(0, 1, 2, 3))(c["q"], c["k_buf"], c["v_buf"], c["sinks"])

    for gc, gd in zip(loss(CHUNKED), loss(DENSE)):
        np.testing.assert_allclose(np.asarray(gc), np.asarray(gd), rtol=_tol(jnp.float32), atol=_tol(jnp.float32))
        assert np.abs(np.asarray(gd)).max() > 0


def test_extra_keys_and_non_causal_window():
    """The draft's form: non-causal windowed attention over the cache's live rows plus the block's own keys."""
    rng = np.random.default_rng(4)
    c = _case(rng, batch_starts=(9, 33), t=8, rows=100)
    q_pos, lengths = c["positions"], c["positions"][:, 0]
    block_mask = jnp.abs(q_pos[:, :, None] - q_pos[:, None, :]) < 3
    for window in (None, 20):
        outs = [kv_cache_attention(c["q"], c["k_buf"], c["v_buf"], q_pos, lengths, scale=0.25, causal=False,
                                   window=window, extra=(c["k"], c["v"], block_mask), tuning=tuning)
                for tuning in (DENSE, CHUNKED)]
        np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), rtol=_tol(jnp.float32),
                                   atol=_tol(jnp.float32))


def test_path_choice():
    tuning = AttentionTuning()  # chunk 256, buffers up to 512 rows dense
    assert not tuning.use_chunked(512, 1)
    assert tuning.use_chunked(1024, 16)
    assert not tuning.use_chunked(1024, 1024)  # the block fills the buffer (training, full prefill)
    assert not tuning.use_chunked(1024, 800)  # less than a chunk left to skip
    assert not DENSE.use_chunked(1 << 20, 1)


def test_draft_forward_chunked_equals_dense():
    """The draft's context attention (a causal sliding layer, a non-causal full one) over a context cache
    whose rows past the live length hold garbage."""
    from dflash_jax.models import draft as draft_model
    from dflash_jax.testing import random_draft_weights, tiny_draft_config, tiny_qwen3_moe_config

    tcfg = tiny_qwen3_moe_config()
    dcfg = tiny_draft_config(tcfg, layer_windows=(12, None), layer_causal=(True, False))
    w = random_draft_weights(dcfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    embed = jnp.asarray(rng.standard_normal((tcfg.vocab_size, tcfg.hidden_size)) * 0.1, jnp.float32)
    head = jnp.asarray(rng.standard_normal((tcfg.hidden_size, tcfg.vocab_size)) * 0.1, jnp.float32)
    b, width, rows = 3, dcfg.block_size, 300
    feat = dcfg.num_taps * tcfg.hidden_size
    cache = draft_model.init_draft_cache(dcfg, b, rows)
    lengths = np.array([5, 31, 60])  # context lengths straddling chunks of 16
    prompt = jnp.asarray(rng.standard_normal((b, 64, feat)), jnp.float32)
    append = jax.jit(draft_model.append_context, static_argnums=1)
    cache = append(w, dcfg, context_features=prompt, num_context=jnp.asarray(lengths, jnp.int32), cache=cache)
    new = jnp.asarray(rng.standard_normal((b, width, feat)), jnp.float32)
    num_new = jnp.array([3, 8, 1], jnp.int32)
    live = lengths + np.asarray(num_new)
    past = np.arange(rows)[None, :, None, None] >= live[:, None, None, None]
    dirty = cache.replace(keys=tuple(jnp.where(past, np.nan, k) for k in cache.keys),
                          values=tuple(jnp.where(past, np.inf, v) for v in cache.values))
    tokens = jnp.asarray(rng.integers(0, tcfg.vocab_size, (b, width)), jnp.int32)

    def run(tuning, c):
        with attention.attention_tuning(chunk=tuning.chunk, dense_max_rows=tuning.dense_max_rows):
            logits, hidden, out_cache = draft_model.draft_forward_jit(
                w, dcfg, embed=embed, lm_head=head, block_tokens=tokens, context_features=new, num_context=num_new,
                cache=c)
        return np.asarray(logits), np.asarray(out_cache.lengths)

    dense, dense_len = run(DENSE, cache)
    chunked, chunked_len = run(CHUNKED, dirty)
    assert np.isfinite(chunked).all()
    np.testing.assert_array_equal(chunked_len, live)
    np.testing.assert_array_equal(dense_len, live)
    np.testing.assert_allclose(chunked, dense, rtol=_tol(jnp.float32, 64), atol=_tol(jnp.float32, 64))


def _family_loop_case(cfg, *, full: bool):
    """The speculative (and, when `full`, plain) loop of a random pair on the chunked path (chunks of 8
    rows, so caches span several chunks and rows past the length are skipped) gives the dense path's plain
    greedy tokens, with real acceptance."""
    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec import generate
    from dflash_jax.testing import random_pair

    pair = random_pair(cfg)
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(0, 500, n)] for n in (11, 26)]
    plain = lambda: greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=24)  # noqa: E731
    with attention.attention_tuning(dense_max_rows=None):
        reference = plain()
    with attention.attention_tuning(chunk=8, dense_max_rows=0):
        spec = generate(pair, prompts, max_new_tokens=24)
        if full:
            assert plain() == reference
    assert spec.tokens == reference
    assert spec.mean_acceptance() > 1.5


def test_qwen3_spec_loop_chunked_equals_dense_plain():
    from dflash_jax.testing import tiny_qwen3_moe_config

    _family_loop_case(tiny_qwen3_moe_config(), full=False)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_5"])
def test_family_loops_chunked_equal_dense(family):
    from dflash_jax import testing

    _family_loop_case(getattr(testing, f"tiny_{family}_config")(), full=True)
