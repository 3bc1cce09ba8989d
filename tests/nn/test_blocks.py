"""nn building blocks against transformers' own functions (RoPE, attention with sinks/windows, norms,
router) and against a direct per-token reference (MoE dispatch)."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dflash_jax.cache import init_kv_cache, rollback, write_rows  # noqa: E402
from dflash_jax.config import RopeConfig, rope_attention_factor  # noqa: E402
from dflash_jax.nn.attention import attention_mask, gqa_attention  # noqa: E402
from dflash_jax.nn.moe import softmax_topk_router, swiglu_experts  # noqa: E402
from dflash_jax.nn.norms import rms_norm  # noqa: E402
from dflash_jax.nn.rope import apply_rope, inverse_frequencies, rope_cos_sin  # noqa: E402

GPT_OSS_YARN = RopeConfig(theta=150000.0, rotary_dim=64, kind="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                          original_max_position_embeddings=4096, truncate=False)


def _hf_rope(rope_parameters, head_dim=64, partial=None, max_pos=131072):
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = PretrainedConfig()
    cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim = head_dim * 4, 4, head_dim
    cfg.max_position_embeddings = max_pos
    params = dict(rope_parameters)
    if partial:
        params["partial_rotary_factor"] = partial
    cfg.rope_parameters = params
    if params["rope_type"] == "default":
        base = params["rope_theta"]
        dim = int(head_dim * (partial or 1.0))
        return (1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))).numpy(), 1.0
    inv, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    return inv.numpy(), scale


def test_yarn_matches_transformers_and_gpt_oss_facts():
    inv, scale = _hf_rope({"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                           "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False})
    ours = inverse_frequencies(GPT_OSS_YARN)
    np.testing.assert_allclose(ours, inv, rtol=1e-6, atol=0)
    np.testing.assert_allclose(ours[:3], [1.0, 0.68904, 0.47478], atol=1e-5)
    assert rope_attention_factor(GPT_OSS_YARN) == pytest.approx(scale, rel=1e-12)
    assert scale == pytest.approx(0.1 * np.log(32) + 1)


def test_yarn_truncated_variant_matches_transformers():
    rope = RopeConfig(theta=1e6, rotary_dim=128, kind="yarn", factor=4.0, original_max_position_embeddings=32768)
    inv, scale = _hf_rope({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                           "original_max_position_embeddings": 32768}, head_dim=128)
    np.testing.assert_allclose(inverse_frequencies(rope), inv, rtol=1e-6)
    assert rope_attention_factor(rope) == pytest.approx(scale)


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_application_matches_transformers_at_long_positions(rotary_dim):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as qwen_rope

    rope = RopeConfig(theta=1e6, rotary_dim=rotary_dim)
    positions = np.array([[0, 1, 7, 299, 1023, 4095]], np.int32)
    x = np.random.default_rng(0).standard_normal((1, 6, 2, 64)).astype(np.float32)
    cos, sin = rope_cos_sin(rope, jnp.asarray(positions), jnp.float32)
    ours = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    inv = torch.from_numpy(inverse_frequencies(rope))
    freqs = torch.from_numpy(positions).float()[..., None] * inv
    emb = torch.cat([freqs, freqs], -1)
    xt = torch.from_numpy(x).transpose(1, 2)  # [b, heads, T, d]
    rot, rest = xt[..., :rotary_dim], xt[..., rotary_dim:]
    ref, _ = qwen_rope(rot, rot, emb.cos(), emb.sin())
    ref = torch.cat([ref, rest], -1).transpose(1, 2).numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    np.testing.assert_array_equal(ours[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("window", [None, 5])
def test_attention_with_sinks_matches_gpt_oss_eager(window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    rng = np.random.default_rng(1)
    b, t, s, hq, hkv, d = 2, 4, 12, 8, 2, 16
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32)
    qpos = np.broadcast_to(np.arange(s - t, s), (b, t)).astype(np.int32)
    kpos = np.broadcast_to(np.arange(s), (b, s)).astype(np.int32)
    mask = np.asarray(attention_mask(jnp.asarray(qpos), jnp.asarray(kpos), window=window))
    ours = gqa_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), scale=d**-0.5,
                         sinks=jnp.asarray(sinks))
    module = types.SimpleNamespace(num_key_value_groups=hq // hkv, sinks=torch.from_numpy(sinks), training=False)
    additive = torch.from_numpy(np.where(mask, 0.0, -np.inf).astype(np.float32))[:, None]
    ref, _ = eager_attention_forward(module, torch.from_numpy(q).transpose(1, 2), torch.from_numpy(k).transpose(1, 2),
                                     torch.from_numpy(v).transpose(1, 2), additive, d**-0.5)
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), atol=1e-5)


def test_attention_mask_semantics():
    q = jnp.array([[10]])
    k = jnp.arange(16)[None]
    m = np.asarray(attention_mask(q, k, window=4))[0, 0]
    assert list(np.nonzero(m)[0]) == [7, 8, 9, 10]  # window counts the query's own token
    m = np.asarray(attention_mask(q, k, causal=False, kv_length=jnp.array([12])))[0, 0]
    assert list(np.nonzero(m)[0]) == list(range(12))
    out = gqa_attention(jnp.ones((1, 1, 2, 4)), jnp.ones((1, 3, 1, 4)), jnp.ones((1, 3, 1, 4)),
                        jnp.zeros((1, 1, 3), bool), scale=1.0)
    np.testing.assert_array_equal(np.asarray(out), 0.0)  # nothing visible: zeros, not NaN


def test_norms_match_transformers():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 5, 32)).astype(np.float32) * 3
    w = rng.standard_normal(32).astype(np.float32)
    for zero_centered, cls in ((False, Qwen3RMSNorm), (True, Qwen3_5MoeRMSNorm)):
        mod = cls(32, eps=1e-6)
        with torch.no_grad():
            mod.weight.copy_(torch.from_numpy(w))
            for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
                ref = mod.to(dtype)(torch.from_numpy(x).to(dtype)).float().numpy()
                jdt = jnp.float32 if dtype == torch.float32 else jnp.bfloat16
                ours = rms_norm(jnp.asarray(x, jdt), jnp.asarray(w, jdt), 1e-6, zero_centered=zero_centered)
                assert ours.dtype == jdt
                np.testing.assert_allclose(np.asarray(ours, np.float32), ref, atol=tol, rtol=tol)


def test_router_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from tests.hf_reference import tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config()
    router = Qwen3MoeTopKRouter(cfg)
    rng = np.random.default_rng(3)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(rng.standard_normal((8, 64)).astype(np.float32) / 8))
    x = rng.standard_normal((50, 64)).astype(np.float32)
    with torch.no_grad():
        _, ref_w, ref_e = router(torch.from_numpy(x))
    w, e, _ = softmax_topk_router(jnp.asarray(x), jnp.asarray(router.weight.detach().numpy().T), 2, normalize=True)
    np.testing.assert_array_equal(np.asarray(e), ref_e.numpy())
    np.testing.assert_allclose(np.asarray(w), ref_w.numpy(), atol=1e-6)


def _moe_per_token(x, experts, weights, gate_up, down):
    inter = gate_up.shape[-1] // 2
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            gu = x[t].astype(np.float64) @ gate_up[experts[t, j]]
            g, u = gu[:inter], gu[inter:]
            out[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ down[experts[t, j]])
    return out


@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_swiglu_experts_against_per_token_reference(tokens):
    rng = np.random.default_rng(tokens)
    e, k, h, inter = 8, 2, 16, 12
    x = rng.standard_normal((tokens, h)).astype(np.float32)
    gate_up = (rng.standard_normal((e, h, 2 * inter)) / 4).astype(np.float32)
    down = (rng.standard_normal((e, inter, h)) / 4).astype(np.float32)
    # route only to experts {1, 5, 6}: most groups are empty
    experts = rng.choice([1, 5, 6], size=(tokens, k)).astype(np.int32)
    weights = rng.random((tokens, k)).astype(np.float32)
    ref = _moe_per_token(x, experts, weights, gate_up, down)
    ours = swiglu_experts(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), jnp.asarray(gate_up),
                          jnp.asarray(down))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5)
    # the same experts held in a permuted slot pool, addressed through slot_of
    perm = rng.permutation(e)
    slot_of = np.argsort(perm).astype(np.int32)  # expert perm[s] lives in slot s
    pooled = swiglu_experts(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights),
                            jnp.asarray(gate_up[perm]), jnp.asarray(down[perm]), slot_of=jnp.asarray(slot_of))
    np.testing.assert_allclose(np.asarray(pooled), ref, atol=1e-5)
    # every expert evaluated densely, combined by the routing weights: the same sum
    for kw in ({}, {"slot_of": jnp.asarray(slot_of)}):
        perm_ = perm if kw else np.arange(e)
        dense = swiglu_experts(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights),
                               jnp.asarray(gate_up[perm_]), jnp.asarray(down[perm_]), implementation="dense", **kw)
        np.testing.assert_allclose(np.asarray(dense), ref, atol=1e-5)


def test_grouped_matmul_dispatcher_rejects_bad_input():
    from pallas_kernels import ops

    x, w, gs = jnp.ones((4, 3)), jnp.ones((2, 3, 5)), jnp.array([1, 3], jnp.int32)
    assert ops.grouped_matmul(x, w, gs).shape == (4, 5)
    with pytest.raises(ValueError, match="implementation must be one of"):
        ops.grouped_matmul(x, w, gs, implementation="cuda")
    with pytest.raises(ValueError, match="shapes"):
        ops.grouped_matmul(x, jnp.ones((2, 4, 5)), gs)


def test_cache_rows_and_rollback():
    cache = init_kv_cache(num_layers=1, batch=2, max_len=6, num_kv_heads=1, head_dim=1, dtype=jnp.float32)
    rows = jnp.arange(1, 9, dtype=jnp.float32).reshape(2, 4, 1, 1)
    buf = write_rows(cache.keys[0], rows, jnp.array([0, 3]))
    np.testing.assert_array_equal(np.asarray(buf)[:, 0, :, 0], [[1, 2, 3, 4, 0, 0], [0, 0, 0, 5, 6, 7]])
    cache = cache.replace(lengths=jnp.array([4, 6]))
    rolled = rollback(cache, jnp.array([2, 9]))
    np.testing.assert_array_equal(np.asarray(rolled.lengths), [2, 6])  # never past what was written
    jax.jit(rollback)(cache, jnp.array([1, 1]))


def test_one_slot_writes_drop_past_the_end_and_stay_in_place():
    """A write of a single row (one row, one slot) drops a slot past the end like a wider write, and the forward
    of one token over the first row of a batched cache, written back (the serving engine's round at one row),
    updates the donated cache in place: XLA rewrote a one-element scatter into a select against the old value,
    and the program then copied every KV buffer of the cache (whole, twice) on every round."""
    import functools
    import re

    from dflash_jax.models.family import family_of
    from dflash_jax.serve.runner import head_rows, put_head_rows
    from dflash_jax.testing import random_pair

    buf = jnp.zeros((2, 1, 4, 1))
    one = jnp.ones((1, 1, 1, 1))
    np.testing.assert_array_equal(np.asarray(write_rows(buf[:1], one, jnp.array([2])))[0, 0, :, 0], [0, 0, 1, 0])
    np.testing.assert_array_equal(np.asarray(write_rows(buf[:1], one, jnp.array([4]))), np.zeros((1, 1, 4, 1)))
    np.testing.assert_array_equal(np.asarray(jax.jit(write_rows)(buf[:1], one, jnp.array([4]))), np.zeros((1, 1, 4, 1)))

    pair = random_pair(seed=0)
    cfg = pair.target_cfg
    fam = family_of(cfg)
    cache = fam.init_cache(cfg, 8, 64, jnp.float32)
    shape = "f32[%s]" % ",".join(map(str, cache.keys[0].shape))
    for rows, width in ((1, 1),):
        @functools.partial(jax.jit, donate_argnames=("cache",))
        def round_of(w, tokens, cache, rows=rows):
            out = fam.forward(w, tokens, head_rows(cache, rows), cfg, logits="all")
            return put_head_rows(cache, out.cache), out.logits

        hlo = round_of.lower(pair.target, jnp.zeros((rows, width), jnp.int32), cache).compile().as_text()
        copies = [line for line in hlo.splitlines() if re.search(re.escape(shape) + r"\{[0-9,]*\} copy\(", line)]
        assert not copies, (rows, width, copies[:2])


@pytest.mark.parametrize("slots", [200, 48])
def test_row_copies_move_only_the_live_slots(slots):
    """`put_rows` / `copy_row` (the serving engine's insert and compaction move) write a row's first slots, whole
    chunks of `COPY_CHUNK` up to the count (the last chunk overlapping the one before where the buffer ends mid-chunk),
    leave the rest of the row and every other row as it was, drop a destination past the last row, and run in place
    on a donated buffer (no copy of the whole buffer in the program)."""
    import functools
    import re

    from dflash_jax.cache import COPY_CHUNK, copy_row, put_rows

    rng = np.random.default_rng(0)
    big = rng.standard_normal((5, 2, slots, 3)).astype(np.float32)
    rows = rng.standard_normal((3, 2, slots, 3)).astype(np.float32)
    dst = np.array([4, 9, 1], np.int32)  # 9: past the last row, dropped
    for count in (0, 1, COPY_CHUNK, COPY_CHUNK + 1, slots, slots + 7):
        got = np.asarray(jax.jit(put_rows)(jnp.asarray(big), jnp.asarray(rows), jnp.asarray(dst), count))
        upto = min(slots, -(-min(count, slots) // COPY_CHUNK) * COPY_CHUNK) if count else 0
        want = big.copy()
        want[4, :, :upto], want[1, :, :upto] = rows[0, :, :upto], rows[2, :, :upto]
        np.testing.assert_array_equal(got, want, err_msg=str(count))
        moved = np.asarray(jax.jit(copy_row)(jnp.asarray(big), 3, 0, count))
        want = big.copy()
        want[0, :, :upto] = big[3, :, :upto]
        np.testing.assert_array_equal(moved, want, err_msg=str(count))
    shape = "f32[%s]" % ",".join(map(str, big.shape))
    for fn, args in ((put_rows, (jnp.asarray(rows), jnp.asarray(dst), 70)), (copy_row, (3, 0, 70))):
        hlo = jax.jit(functools.partial(fn), donate_argnums=0).lower(jnp.asarray(big), *args).compile().as_text()
        copies = [line for line in hlo.splitlines() if re.search(re.escape(shape) + r"\{[0-9,]*\} copy\(", line)]
        assert not copies, (fn.__name__, copies[:2])


def test_dense_experts_equal_grouped_with_biases_and_clamped_activation():
    from functools import partial

    from dflash_jax.nn.moe import clamped_swiglu

    rng = np.random.default_rng(3)
    e, k, h, inter, t = 6, 3, 16, 8, 11
    args = [jnp.asarray(rng.standard_normal((t, h)), jnp.float32),
            jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32), jnp.asarray(rng.random((t, k)), jnp.float32),
            jnp.asarray(rng.standard_normal((e, h, 2 * inter)) / 3, jnp.float32),
            jnp.asarray(rng.standard_normal((e, inter, h)) / 3, jnp.float32)]
    kw = dict(gate_up_bias=jnp.asarray(rng.standard_normal((e, 2 * inter)), jnp.float32),
              down_bias=jnp.asarray(rng.standard_normal((e, h)), jnp.float32),
              activation=partial(clamped_swiglu, alpha=1.702, limit=1.5))
    grouped = swiglu_experts(*args, implementation="xla", **kw)
    dense = swiglu_experts(*args, implementation="dense", **kw)
    np.testing.assert_allclose(np.asarray(dense), np.asarray(grouped), atol=2e-5)
