"""The CPU's routed-rows MoE path ("tiles") against a per-token float64 reference, and the CPU's choice of path.

Each (token, choice) row is multiplied by its own expert's weights only; the tiles pad each expert's rows to
whole tiles, so the checks cover experts spanning several tiles, experts without rows (poisoned with NaN: they
must reach no output), slot pools addressed through `slot_of`, gpt-oss biases and clamped activation, and FP4
tables (gathered as stored, dequantized per tile)."""

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


def per_token(x, experts, weights, gate_up, down, gate_up_bias=None, down_bias=None, activation=None):
    """sum_j weights[t, j] * down_e(act(gate_up_e(x_t))) in float64, one token and one choice at a time."""
    inter = gate_up.shape[2] // 2
    out = np.zeros((x.shape[0], down.shape[2]))
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = experts[t, j]
            gu = x[t].astype(np.float64) @ gate_up[e]
            if gate_up_bias is not None:
                gu = gu + gate_up_bias[e]
            g, u = gu[:inter], gu[inter:]
            a = g / (1 + np.exp(-g)) * u if activation is None else np.asarray(activation(g, u), np.float64)
            y = a @ down[e]
            if down_bias is not None:
                y = y + down_bias[e]
            out[t] += weights[t, j] * y
    return out


def problem(tokens, k=2, e=8, h=16, inter=12, used=(1, 5, 6), seed=0):
    rng = np.random.default_rng(seed + tokens)
    x = rng.standard_normal((tokens, h)).astype(np.float32)
    gate_up = (rng.standard_normal((e, h, 2 * inter)) / 4).astype(np.float32)
    down = (rng.standard_normal((e, inter, h)) / 4).astype(np.float32)
    experts = rng.choice(list(used), size=(tokens, k)).astype(np.int32)
    weights = rng.random((tokens, k)).astype(np.float32)
    return x, experts, weights, gate_up, down


@pytest.mark.parametrize("tokens", [1, 7, 33, 200])
def test_tiles_equal_per_token_reference_with_empty_experts_and_a_slot_pool(tokens):
    x, experts, weights, gate_up, down = problem(tokens)
    ref = per_token(x, experts, weights, gate_up, down)
    rows = tokens * experts.shape[1]
    assert moe.tile_rows(rows, 8) == {1: 1, 7: 1, 33: 8, 200: 32}[tokens]  # 3 routed experts: several tiles each
    dead = np.ones(8, bool)
    dead[[1, 5, 6]] = False
    poisoned_gu = np.where(dead[:, None, None], np.nan, gate_up).astype(np.float32)
    poisoned_dn = np.where(dead[:, None, None], np.inf, down).astype(np.float32)
    ours = moe.swiglu_experts(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights),
                              jnp.asarray(poisoned_gu), jnp.asarray(poisoned_dn), implementation="tiles")
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5)
    perm = np.random.default_rng(tokens).permutation(8)
    slot_of = np.argsort(perm).astype(np.int32)  # expert perm[s] lives in slot s
    pooled = jax.jit(partial(moe.swiglu_experts, implementation="tiles"))(
        jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), jnp.asarray(poisoned_gu[perm]),
        jnp.asarray(poisoned_dn[perm]), slot_of=jnp.asarray(slot_of))
    np.testing.assert_allclose(np.asarray(pooled), ref, atol=1e-5)


def test_tiles_with_biases_and_clamped_activation():
    x, experts, weights, gate_up, down = problem(41, k=3, e=6, used=range(6), seed=3)
    rng = np.random.default_rng(4)
    gub = rng.standard_normal((6, gate_up.shape[2])).astype(np.float32)
    db = rng.standard_normal((6, down.shape[2])).astype(np.float32)
    act = partial(moe.clamped_swiglu, alpha=1.702, limit=1.5)
    ref = per_token(x, experts, weights, gate_up, down, gub, db,
                    activation=lambda g, u: np.asarray(act(jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32))))
    ours = moe.swiglu_experts(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), jnp.asarray(gate_up),
                              jnp.asarray(down), implementation="tiles", gate_up_bias=jnp.asarray(gub),
                              down_bias=jnp.asarray(db), activation=act)
    np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-5)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_tiles_read_fp4_tables_as_stored(fmt):
    """FP4 tables (logical [E, out, in]) gathered per tile and dequantized there: the result equals the same
    rows through the dequantized tables, and a NaN scale on an expert without rows reaches no output."""
    x, experts, weights, gate_up, down = problem(24, h=64, inter=32)
    quantize = quantize_mxfp4 if fmt == "mxfp4" else quantize_nvfp4
    gu_q = quantize(jnp.asarray(np.swapaxes(gate_up, 1, 2)))
    dn_q = quantize(jnp.asarray(np.swapaxes(down, 1, 2)))
    gu_dense = np.swapaxes(np.asarray(gu_q.dequantize(jnp.float32)), 1, 2)
    dn_dense = np.swapaxes(np.asarray(dn_q.dequantize(jnp.float32)), 1, 2)
    ref = per_token(x, experts, weights, gu_dense, dn_dense)
    if fmt == "mxfp4":  # scale byte 255 is NaN: poison expert 0, which has no rows
        gu_q = MXFP4Tensor(gu_q.blocks, gu_q.scales.at[0].set(255))
    ours = jax.jit(partial(moe.swiglu_experts, implementation="tiles"))(
        jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), gu_q, dn_q)
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)


@pytest.fixture
def traced_for_cpu():
    """The CPU's choices are asserted whatever the machine's backend (a GPU run of the suite takes XLA's path)."""
    with target.compiling_for("cpu"):
        yield


def test_the_cpu_chooses_by_work(traced_for_cpu, monkeypatch):
    """"auto" on a CPU without the compiled kernels (with them, float32 tables stream through the kernel at small
    widths: test_moe_stream.py): every token through every expert only for a small table and few tokens (the
    shipped pair's 8 experts of 128 x 256 at a width-1 or width-8 step), the routed rows' tiles for wider steps and
    for real expert shapes (Qwen3-30B-A3B: 128 experts of 2048 -> 768, top-8) even at one token; XLA's grouped
    matmul on a GPU."""
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    tiny = jax.ShapeDtypeStruct((8, 128, 512), jnp.float32)
    real = jax.ShapeDtypeStruct((128, 2048, 1536), jnp.bfloat16)
    assert moe.routed_path("auto", tiny, jnp.float32, 1, 2) == "dense"
    assert moe.routed_path("auto", tiny, jnp.float32, 8, 2) == "dense"
    assert moe.routed_path("auto", tiny, jnp.float32, 16, 2) == "tiles"
    assert moe.routed_path("auto", tiny, jnp.float32, 512, 2) == "tiles"
    assert moe.routed_path("auto", real, jnp.bfloat16, 1, 8) == "tiles"
    assert moe.routed_path("xla", tiny, jnp.float32, 512, 2) == "xla"
    with target.compiling_for("gpu"):
        assert moe.routed_path("auto", tiny, jnp.float32, 512, 2) == "xla"


def test_the_cpu_path_can_be_forced_by_environment(monkeypatch, traced_for_cpu):
    tiny = jax.ShapeDtypeStruct((8, 128, 512), jnp.float32)
    monkeypatch.setenv(moe.CPU_PATH_ENV, "xla")
    assert moe.routed_path("auto", tiny, jnp.float32, 512, 2) == "xla"
    monkeypatch.setenv(moe.CPU_PATH_ENV, "tiles")
    assert moe.routed_path("auto", tiny, jnp.float32, 1, 2) == "tiles"
    assert moe.routed_path("xla", tiny, jnp.float32, 1, 2) == "xla"  # an explicit implementation wins
    monkeypatch.setenv(moe.CPU_PATH_ENV, "fast")
    with pytest.raises(ValueError, match="DFLASH_MOE_CPU_PATH='fast' is not one of"):
        moe.routed_path("auto", tiny, jnp.float32, 1, 2)


@pytest.mark.parametrize("implementation", ["dense", "tiles"])
def test_a_poisoned_slot_without_rows_reaches_no_output(implementation):
    """An offloaded pool's never-written slots may hold NaN / inf: neither CPU path lets them reach a row."""
    x, experts, weights, gate_up, down = problem(9)
    ref = per_token(x, experts, weights, gate_up, down)
    gate_up[0], down[7] = np.nan, np.inf  # experts 0 and 7 have no rows
    out = moe.swiglu_experts(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), jnp.asarray(gate_up),
                             jnp.asarray(down), implementation=implementation)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("fmt", ["dense", "mxfp4", "nvfp4"])
def test_all_experts_path_with_biases_fp4_and_poisoned_slots(tokens, fmt):
    """The all-experts path (one token: only its routed experts, sliced in place; more: every expert batched over
    the experts) equals the per-token reference with gpt-oss biases and clamped activation, for dense and FP4
    tables, and an unrouted expert holding NaN / inf reaches no output."""
    x, experts, weights, gate_up, down = problem(tokens, k=2, e=8, h=64, inter=32, used=(2, 3, 5), seed=11)
    rng = np.random.default_rng(5)
    gub = rng.standard_normal((8, gate_up.shape[2])).astype(np.float32)
    db = rng.standard_normal((8, down.shape[2])).astype(np.float32)
    act = partial(moe.clamped_swiglu, alpha=1.702, limit=1.5)
    np_act = lambda g, u: np.asarray(act(jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32)))  # noqa: E731
    if fmt == "dense":
        gate_up[0], down[7] = np.nan, np.inf  # experts 0 and 7 have no rows
        gu_w, dn_w = jnp.asarray(gate_up), jnp.asarray(down)
        ref = per_token(x, experts, weights, np.nan_to_num(gate_up), np.nan_to_num(down, posinf=0), gub, db, np_act)
    else:
        quantize = quantize_mxfp4 if fmt == "mxfp4" else quantize_nvfp4
        gu_w = quantize(jnp.asarray(np.swapaxes(gate_up, 1, 2)))
        dn_w = quantize(jnp.asarray(np.swapaxes(down, 1, 2)))
        ref = per_token(x, experts, weights, np.swapaxes(np.asarray(gu_w.dequantize(jnp.float32)), 1, 2),
                        np.swapaxes(np.asarray(dn_w.dequantize(jnp.float32)), 1, 2), gub, db, np_act)
        if fmt == "mxfp4":  # scale byte 255 is NaN: poison expert 0, which has no rows
            gu_w = MXFP4Tensor(gu_w.blocks, gu_w.scales.at[0].set(255))
    ours = jax.jit(partial(moe.swiglu_experts, implementation="dense", activation=act))(
        jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), gu_w, dn_w, gate_up_bias=jnp.asarray(gub),
        down_bias=jnp.asarray(db))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)
