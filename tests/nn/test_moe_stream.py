"""The CPU's streamed MoE path ("stream": one (token, choice) row at a time, its expert's table read in place and FP4
codes decoded inside the product) against a per-token float64 reference and against the other CPU paths: dense and
FP4 tables, experts without rows poisoned (they must reach no output), slot pools, gpt-oss biases and clamped
activation, and edge E8M0 scales (0, 1, 254: subnormal, tiny and overflowing weights; 255: NaN) on routed experts,
where the non-finite outputs must match the dequantize-then-multiply path's."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.nn import moe
from dflash_jax.quant.mxfp4 import quantize_mxfp4
from dflash_jax.quant.nvfp4 import quantize_nvfp4
from pallas_kernels import cpu_kernels, target
from pallas_kernels.formats import MXFP4Tensor

from .test_moe_tiles import per_token, problem


@pytest.fixture(params=["kernel", "xla"])
def stream(request, monkeypatch):
    """The streamed path, jitted afresh: through the compiled MXFP4 kernel (skipped where it cannot be built) or,
    with the kernels turned off, through XLA alone."""
    if request.param == "xla":
        monkeypatch.setenv(cpu_kernels.ENV, "0")
    elif jax.default_backend() != "cpu" or not cpu_kernels.available():
        pytest.skip("the compiled CPU kernel is not available here")
    return lambda *args, **kw: jax.jit(partial(moe.swiglu_experts, implementation="stream", **kw))(*args)


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_stream_equals_per_token_reference_with_poisoned_experts_and_a_slot_pool(tokens, stream):
    x, experts, weights, gate_up, down = problem(tokens)
    ref = per_token(x, experts, weights, gate_up, down)
    dead = np.ones(8, bool)
    dead[[1, 5, 6]] = False
    gu = np.where(dead[:, None, None], np.nan, gate_up).astype(np.float32)
    dn = np.where(dead[:, None, None], np.inf, down).astype(np.float32)
    ours = stream(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), jnp.asarray(gu), jnp.asarray(dn))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5)
    perm = np.random.default_rng(tokens).permutation(8)
    slot_of = np.argsort(perm).astype(np.int32)
    pooled = stream(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), jnp.asarray(gu[perm]),
                    jnp.asarray(dn[perm]), slot_of=jnp.asarray(slot_of))
    np.testing.assert_allclose(np.asarray(pooled), ref, atol=1e-5)


def test_stream_with_biases_and_clamped_activation(stream):
    x, experts, weights, gate_up, down = problem(9, k=3, e=6, used=range(6), seed=3)
    rng = np.random.default_rng(4)
    gub = rng.standard_normal((6, gate_up.shape[2])).astype(np.float32)
    db = rng.standard_normal((6, down.shape[2])).astype(np.float32)
    act = partial(moe.clamped_swiglu, alpha=1.702, limit=1.5)
    ref = per_token(x, experts, weights, gate_up, down, gub, db,
                    activation=lambda g, u: np.asarray(act(jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32))))
    ours = stream(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), jnp.asarray(gate_up),
                  jnp.asarray(down), gate_up_bias=jnp.asarray(gub), down_bias=jnp.asarray(db), activation=act)
    np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-5)


def fp4_problem(fmt, tokens=6):
    x, experts, weights, gate_up, down = problem(tokens, h=64, inter=32)
    quantize = quantize_mxfp4 if fmt == "mxfp4" else quantize_nvfp4
    gu_q = quantize(jnp.asarray(np.swapaxes(gate_up, 1, 2)))
    dn_q = quantize(jnp.asarray(np.swapaxes(down, 1, 2)))
    return x, experts, weights, gu_q, dn_q


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_stream_reads_fp4_tables_as_stored(fmt, stream):
    x, experts, weights, gu_q, dn_q = fp4_problem(fmt)
    gu_dense = np.swapaxes(np.asarray(gu_q.dequantize(jnp.float32)), 1, 2)
    dn_dense = np.swapaxes(np.asarray(dn_q.dequantize(jnp.float32)), 1, 2)
    ref = per_token(x, experts, weights, gu_dense, dn_dense)
    if fmt == "mxfp4":  # scale byte 255 is NaN: poison expert 0, which has no rows
        gu_q = MXFP4Tensor(gu_q.blocks, gu_q.scales.at[0].set(255))
    ours = stream(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), gu_q, dn_q)
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)


@pytest.mark.parametrize("edge", [0, 1, 254, 255])
def test_stream_edge_scales_on_routed_experts_match_dequantized_tables(edge, stream):
    """E8M0 0 (2^-127: subnormal weights), 1, 254 (weights of 2^127 x 2 and up overflow to inf) and 255 (NaN) in
    a routed expert's blocks: the outputs, non-finite ones included, match the tiles path (which dequantizes the
    gathered tables, then multiplies)."""
    x, experts, weights, gu_q, dn_q = fp4_problem("mxfp4", tokens=16)
    used = int(experts[0, 0])
    scales = np.asarray(gu_q.scales).copy()
    scales[used, :5, 0] = edge
    scales[used, 7, 1] = edge
    gu_q = MXFP4Tensor(gu_q.blocks, jnp.asarray(scales))
    dn_scales = np.asarray(dn_q.scales).copy()
    dn_scales[used, 3, :] = edge
    dn_q = MXFP4Tensor(dn_q.blocks, jnp.asarray(dn_scales))
    args = (jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), gu_q, dn_q)
    ref = np.asarray(jax.jit(partial(moe.swiglu_experts, implementation="tiles"))(*args))
    ours = np.asarray(stream(*args))
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-5)


def test_the_cpu_streams_fp4_tables_of_real_shapes_at_small_widths(monkeypatch):
    """"auto" on a CPU: FP4 tables of real expert shapes (Qwen3-30B-A3B: 128 experts of 2048 -> 768, top-8) stream
    from 1 to 16 tokens; small FP4 tables (the shipped pair's), and dense tables where the compiled kernels are off,
    keep the dense / tiles choice."""
    def fp4(e, out, inp):
        return MXFP4Tensor(jax.ShapeDtypeStruct((e, out, inp // 32, 16), jnp.uint8),
                           jax.ShapeDtypeStruct((e, out, inp // 32), jnp.uint8))

    real, tiny = fp4(128, 1536, 2048), fp4(8, 512, 128)
    with target.compiling_for("cpu"):
        for tokens in (1, 4, 16):
            assert moe.routed_path("auto", real, jnp.float32, tokens, 8) == "stream"
        assert moe.routed_path("auto", real, jnp.float32, 64, 8) == "tiles"
        assert moe.routed_path("auto", tiny, jnp.float32, 1, 2) == "dense"
        monkeypatch.setenv(cpu_kernels.ENV, "0")
        assert moe.routed_path("auto", jax.ShapeDtypeStruct((128, 2048, 1536), jnp.bfloat16), jnp.bfloat16, 1,
                               8) == "tiles"
    with target.compiling_for("gpu"):
        assert moe.routed_path("auto", real, jnp.float32, 1, 8) != "stream"


def test_the_compiled_kernel_reads_mxfp4_codes_in_one_call_per_projection():
    """With the kernel, the streamed layer's program holds one kernel call per projection and no float table of
    an expert (nothing is dequantized outside the kernel)."""
    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        pytest.skip("the compiled CPU kernel is not available here")
    x, experts, weights, gu_q, dn_q = fp4_problem("mxfp4")
    text = jax.jit(partial(moe.swiglu_experts, implementation="stream")).lower(
        jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), gu_q, dn_q).compile().as_text()
    assert text.count(f'custom_call_target="{cpu_kernels.TARGET}"') == 2
    assert "f32[8,64,64]" not in text and "f32[64,64]" not in text and "f32[8,32,64]" not in text


def test_the_dense_kernel_multiplies_each_row_by_its_own_expert_alone():
    """`cpu_kernels.dense_rows` against float64 products: odd shapes (columns not a multiple of the register block,
    runs of 1 - 7 rows), experts with no rows poisoned with NaN (never read), an out-of-range expert id (a NaN row),
    a bf16 table in a call split over XLA's thread pool, and every row's result bit-identical to the same row
    multiplied alone (a row does not depend on its batch or on the split)."""
    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        pytest.skip("the compiled CPU kernel is not available here")
    rng = np.random.default_rng(7)
    e, k, n = 6, 37, 83
    run = jax.jit(cpu_kernels.dense_rows)
    # both tables' register blocks (bf16: 32-column loads split into even and odd columns), 1 - 7 rows a run
    for dtype in (jnp.float32, jnp.bfloat16):
        w = jnp.asarray(rng.standard_normal((e, k, n)), dtype).at[jnp.array([0, 4])].set(jnp.nan)  # no row names them
        expert = np.array([1, 1, 1, 1, 1, 1, 1, 2, 3, 3, 5, 5, 5, 6], np.int32)  # 6: out of range
        x = rng.standard_normal((len(expert), k)).astype(np.float32)
        y = np.asarray(run(jnp.asarray(x), w, jnp.asarray(expert)))
        ok = expert < e
        wide = np.asarray(w.astype(jnp.float32)).astype(np.float64)
        ref = np.stack([x[r].astype(np.float64) @ wide[expert[r]] for r in np.flatnonzero(ok)])
        np.testing.assert_allclose(y[ok], ref, rtol=1e-5, atol=1e-5)
        assert np.isnan(y[~ok]).all() and np.isfinite(y[ok]).all()
        for r in np.flatnonzero(ok):
            alone = np.asarray(run(jnp.asarray(x[r:r + 1]), w, jnp.asarray(expert[r:r + 1])))
            np.testing.assert_array_equal(alone[0], y[r])
    # a call large enough to be split over XLA's thread pool (runs x column ranges) gives the same sums, and a bf16
    # table the products of its exact float32 widening
    big_w = jnp.asarray(rng.standard_normal((3, 256, 650)), jnp.bfloat16)
    big_e = np.repeat(np.arange(3, dtype=np.int32), [5, 30, 29])
    big_x = rng.standard_normal((64, 256)).astype(np.float32)
    y = np.asarray(run(jnp.asarray(big_x), big_w, jnp.asarray(big_e)))
    wide = np.asarray(big_w.astype(jnp.float32)).astype(np.float64)
    np.testing.assert_allclose(y, np.einsum("rk,rkn->rn", big_x, wide[big_e]), rtol=1e-5, atol=1e-4)
    for r in (0, 5, 40, 63):
        alone = np.asarray(run(jnp.asarray(big_x[r:r + 1]), big_w, jnp.asarray(big_e[r:r + 1])))
        np.testing.assert_array_equal(alone[0], y[r])
    # matrices of 1 MB and more stream in storage order (real expert shapes), columns past the last whole vector
    # included: the same sums as a row alone, and float64's to rounding
    for dtype, n in ((jnp.float32, 517), (jnp.bfloat16, 1029)):
        big_w = jnp.asarray(rng.standard_normal((2, 512, n)), dtype)
        big_e = np.array([0, 0, 0, 0, 0, 1, 1], np.int32)
        big_x = rng.standard_normal((len(big_e), 512)).astype(np.float32)
        y = np.asarray(run(jnp.asarray(big_x), big_w, jnp.asarray(big_e)))
        wide = np.asarray(big_w.astype(jnp.float32)).astype(np.float64)
        np.testing.assert_allclose(y, np.einsum("rk,rkn->rn", big_x, wide[big_e]), rtol=1e-5, atol=1e-4)
        for r in (0, 4, 6):
            alone = np.asarray(run(jnp.asarray(big_x[r:r + 1]), big_w, jnp.asarray(big_e[r:r + 1])))
            np.testing.assert_array_equal(alone[0], y[r])


def test_the_cpu_streams_float32_tables_through_the_kernel_at_small_widths(monkeypatch):
    """"auto" on a CPU with the compiled kernels: float32 and bf16 tables take the kernel ("stream") up to
    `DENSE_STREAM_MAX_ROWS` rows, in one kernel call per projection; wider blocks and a machine without the kernels
    keep the dense / tiles choice."""
    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        pytest.skip("the compiled CPU kernel is not available here")
    table = jax.ShapeDtypeStruct((8, 128, 512), jnp.float32)
    with target.compiling_for("cpu"):
        for tokens in (1, 8, moe.DENSE_STREAM_MAX_ROWS // 2):
            assert moe.routed_path("auto", table, jnp.float32, tokens, 2) == "stream"
        assert moe.routed_path("auto", table, jnp.float32, moe.DENSE_STREAM_MAX_ROWS // 2 + 1, 2) == "tiles"
        assert moe.routed_path("auto", jax.ShapeDtypeStruct((8, 128, 512), jnp.bfloat16), jnp.bfloat16, 1,
                               2) == "stream"
        monkeypatch.setenv(cpu_kernels.ENV, "0")
        assert moe.routed_path("auto", table, jnp.float32, 1, 2) == "dense"
        monkeypatch.delenv(cpu_kernels.ENV)
    x, experts, weights, gate_up, down = problem(8)
    text = jax.jit(moe.swiglu_experts).lower(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights),
                                              jnp.asarray(gate_up), jnp.asarray(down)).compile().as_text()
    assert text.count(f'custom_call_target="{cpu_kernels.DENSE_TARGET}"') == 2


def test_the_dense_kernel_is_differentiable():
    """Training a MoE target on a CPU runs its experts through the kernel: gradients in x and the table equal those
    of the same product written in XLA (the backward pass is XLA's)."""
    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        pytest.skip("the compiled CPU kernel is not available here")
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((7, 20)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 20, 24)), jnp.float32)
    expert = jnp.asarray([0, 0, 1, 3, 3, 3, 2], jnp.int32)

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)) * jnp.arange(24.0))

    ours = jax.grad(loss(lambda x, w: cpu_kernels.dense_rows(x, w, expert)), argnums=(0, 1))(x, w)
    ref = jax.grad(loss(lambda x, w: jnp.einsum("rk,rkn->rn", x, w[expert])), argnums=(0, 1))(x, w)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_the_mxfp4_kernel_splits_a_large_call_with_the_same_sums():
    """A call large enough to be split over XLA's thread pool (each run's output rows in parts): every row equals
    the same row multiplied alone, bit for bit, and the dequantized table's products up to summation order."""
    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        pytest.skip("the compiled CPU kernel is not available here")
    rng = np.random.default_rng(5)
    table = quantize_mxfp4(jnp.asarray(rng.standard_normal((4, 515, 256)), jnp.float32))  # [E, N, K], N odd
    expert = np.repeat(np.arange(4, dtype=np.int32), [3, 9, 0, 12])
    x = rng.standard_normal((len(expert), 256)).astype(np.float32)
    run = jax.jit(cpu_kernels.mxfp4_rows)
    y = np.asarray(run(jnp.asarray(x), table, jnp.asarray(expert)))
    dense = np.asarray(table.dequantize(jnp.float32)).astype(np.float64)  # [E, N, K]
    np.testing.assert_allclose(y, np.einsum("rk,rnk->rn", x, dense[expert]), rtol=1e-5, atol=1e-4)
    for r in (0, 3, 11, 23):
        alone = np.asarray(run(jnp.asarray(x[r:r + 1]), table, jnp.asarray(expert[r:r + 1])))
        np.testing.assert_array_equal(alone[0], y[r])
