"""FP4 grouped matmul: one suite run against every implementation (XLA, Pallas, the jnp reference).

The expected output is computed in float64 numpy from the numpy dequantization twins (weights rounded to
the activation dtype, as every implementation does), so the only admissible differences are the float32
accumulation and the final rounding to the output dtype:

    |y - y_exact| <= u_out * |y_exact| + (K + 2) * u_acc * sum_k |x_mk| |w_nk|

with u the unit roundoff (2^-8 bfloat16, 2^-24 float32). Rows past sum(group_sizes) must be exactly zero.
On CPU the Pallas kernel runs in interpret mode; on a GPU the same tests run the Triton kernel.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax.quant import (
    MXFP4Tensor,
    NVFP4Tensor,
    dequantize_mxfp4_np,
    dequantize_nvfp4_np,
    quantize_mxfp4,
    quantize_nvfp4,
)
from pallas_kernels import fp4_grouped_matmul as fgm
from pallas_kernels import ops

IMPLEMENTATIONS = ("xla", "pallas", "reference")
FORMATS = ("mxfp4", "nvfp4")
DTYPES = (jnp.bfloat16, jnp.float32)
G, N, K = 8, 32, 64  # tiny: 2 MXFP4 / 4 NVFP4 blocks per row


# ----------------------------------------------------------------------------------------------------
# Fixtures and helpers.
# ----------------------------------------------------------------------------------------------------


def assert_bits_equal(got: np.ndarray, want: np.ndarray):
    """Equal bit for bit as float32 (so -0.0 differs from +0.0), every NaN equal to every NaN: a NaN's payload
    is the backend's (XLA:CPU gives the canonical quiet NaN, a GPU may give all ones)."""
    got, want = got.astype(np.float32), want.astype(np.float32)
    nan = np.isnan(got)
    np.testing.assert_array_equal(nan, np.isnan(want))
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def quantize(fmt: str, wf: np.ndarray, per_group_scale: bool = True):
    if fmt == "mxfp4":
        return quantize_mxfp4(wf)
    if per_group_scale:  # one tensor scale per expert, as NVFP4 checkpoints ship them
        return jax.vmap(quantize_nvfp4)(jnp.asarray(wf))
    return quantize_nvfp4(wf)


def dequant_np(w) -> np.ndarray:
    """float32 [G, N, K] from the numpy twins (independent of the kernels' in-register decode)."""
    if isinstance(w, MXFP4Tensor):
        return dequantize_mxfp4_np(np.asarray(w.blocks), np.asarray(w.scales), np.float32)
    ts = np.asarray(w.tensor_scale, np.float32)  # scalar or per-group prefix [G]
    return dequantize_nvfp4_np(np.asarray(w.packed), np.asarray(w.block_scales), ts, np.float32)


@functools.cache
def weights(fmt: str, g: int = G, n: int = N, k: int = K, seed: int = 0):
    rng = np.random.default_rng(seed)
    wf = (rng.standard_normal((g, n, k)) * 0.05).astype(np.float32)
    return quantize(fmt, wf)


def activations(m: int, k: int, dtype, seed: int = 1) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((m, k)).astype(np.float32), dtype)


def unit_roundoff(dtype) -> float:
    return float(jnp.finfo(dtype).eps) / 2


class Expected:
    """All-groups float64 products, so each routing pattern's expectation is a row selection."""

    def __init__(self, x: jax.Array, w):
        wq = dequant_np(w).astype(np.dtype(x.dtype)).astype(np.float64)  # rounded to x.dtype, as kernels do
        x64 = np.asarray(x.astype(jnp.float32)).astype(np.float64)
        self.y = np.einsum("mk,gnk->gmn", x64, wq)  # [G, M, N]
        self.s = np.einsum("mk,gnk->gmn", np.abs(x64), np.abs(wq))
        self.g, self.m = wq.shape[0], x.shape[0]
        self.k = x.shape[1]

    def rows(self, group_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(y_exact [M, N], abs-sum [M, N], live rows [M]) for one routing."""
        ends = np.cumsum(group_sizes)
        row_group = np.searchsorted(ends, np.arange(self.m), side="right")
        live = row_group < self.g
        gsel = np.minimum(row_group, self.g - 1)
        y = np.where(live[:, None], self.y[gsel, np.arange(self.m)], 0.0)
        s = np.where(live[:, None], self.s[gsel, np.arange(self.m)], 0.0)
        return y, s, live


def check(y, exp: Expected, group_sizes: np.ndarray, out_dtype, impl: str, x_dtype):
    y = np.asarray(jnp.asarray(y).astype(jnp.float32)).astype(np.float64)
    want, s, live = exp.rows(np.asarray(group_sizes))
    assert y.shape == want.shape
    assert np.all(y[~live] == 0), "rows past sum(group_sizes) must be zero"
    u_acc = unit_roundoff(jnp.float32)
    if impl == "xla" and jax.default_backend() == "gpu" and jnp.dtype(x_dtype) == jnp.float32:
        u_acc = 2.0**-11  # XLA:GPU float32 dots at default precision may use TF32
    tol = unit_roundoff(out_dtype) * np.abs(want) + (exp.k + 2) * u_acc * s + 1e-30
    err = np.abs(y - want)
    bad = ~(err <= tol)  # NaN anywhere is out of tolerance too
    assert not bad.any(), (
        f"{impl}: {bad.sum()} elements out of tolerance; worst err {np.nanmax(err):.3g} "
        f"({np.isnan(y).sum()} NaN), group_sizes {list(np.asarray(group_sizes))}"
    )


@functools.cache
def runner(impl: str, out_dtype=None):
    """A jitted `(x, w, group_sizes) -> y` per implementation; group sizes are traced, so one compile
    serves every routing pattern of a shape."""
    if impl == "reference":
        fn = functools.partial(fgm.fp4_grouped_matmul_reference, preferred_element_type=out_dtype)
    else:
        fn = functools.partial(ops.grouped_matmul, implementation=impl, preferred_element_type=out_dtype)
    return jax.jit(fn)


def random_sizes(rng: np.random.Generator, nonzero: np.ndarray, m: int, fill: bool | None = None) -> np.ndarray:
    """Group sizes with exactly the `nonzero` groups non-empty and sum <= m (== m when `fill`)."""
    nnz = int(nonzero.sum())
    sizes = np.zeros(len(nonzero), np.int32)
    if nnz == 0:
        return sizes
    fill = rng.random() < 0.5 if fill is None else fill
    total = m if fill else int(rng.integers(nnz, m + 1))
    cuts = np.sort(rng.choice(np.arange(1, total), size=nnz - 1, replace=False)) if nnz > 1 else np.array([], int)
    parts = np.diff(np.concatenate([[0], cuts, [total]]))
    sizes[np.flatnonzero(nonzero)] = parts
    return sizes


def run_patterns(impl: str, fmt: str, dtype, patterns: list[int], m: int = 24, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = weights(fmt)
    x = activations(m, K, dtype)
    exp = Expected(x, w)
    fn = runner(impl)
    for p in patterns:
        nonzero = np.array([(p >> i) & 1 for i in range(G)], bool)
        gs = random_sizes(rng, nonzero, m)
        check(fn(x, w, jnp.asarray(gs)), exp, gs, dtype, impl, dtype)


# ----------------------------------------------------------------------------------------------------
# The suite.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_all_zero_nonzero_patterns_of_8_groups(impl, fmt, dtype):
    # all 2^8 empty / non-empty patterns, random sizes (sum == M or < M); one compile per case (~0.5 s)
    run_patterns(impl, fmt, dtype, list(range(256)))


def _widths_case(impl: str, m: int):
    # rotate format x dtype across widths so each combination meets many widths without compiling all
    fmt, dtype = list(itertools.product(FORMATS, DTYPES))[m % 4]
    rng = np.random.default_rng(100 + m)
    w = weights(fmt)
    x = activations(m, K, dtype, seed=m)
    exp = Expected(x, w)
    fn = runner(impl)
    for _ in range(3):
        nonzero = rng.random(G) < rng.uniform(0.2, 1.0)
        if m < nonzero.sum():
            nonzero[np.flatnonzero(nonzero)[m:]] = False
        gs = random_sizes(rng, nonzero, m)
        check(fn(x, w, jnp.asarray(gs)), exp, gs, dtype, impl, dtype)
    # everything in one group: several row tiles of one expert
    gs = np.zeros(G, np.int32)
    gs[int(rng.integers(G))] = m
    check(fn(x, w, jnp.asarray(gs)), exp, gs, dtype, impl, dtype)


@pytest.mark.parametrize("m", [1, 2, 7, 16, 17, 40, 64])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_widths_sampled(impl, m):
    _widths_case(impl, m)


@pytest.mark.slow
@pytest.mark.parametrize("m", range(1, 65))
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_widths_all(impl, m):
    _widths_case(impl, m)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_fp32_output_from_bf16_activations(impl, fmt):
    w, x = weights(fmt), activations(20, K, jnp.bfloat16)
    gs = np.array([3, 0, 5, 0, 0, 7, 1, 0], np.int32)
    y = runner(impl, jnp.float32)(x, w, jnp.asarray(gs))
    assert y.dtype == jnp.float32
    check(y, Expected(x, w), gs, jnp.float32, impl, jnp.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pallas_ragged_tiles_and_scalar_tensor_scale(fmt):
    """N and K that are not multiples of the tile (masked weight loads), groups spanning row tiles."""
    g, n, k, m = 4, 48, 96, 40
    rng = np.random.default_rng(3)
    w = quantize(fmt, (rng.standard_normal((g, n, k)) * 0.05).astype(np.float32), per_group_scale=False)
    x = activations(m, k, jnp.bfloat16)
    tuning = fgm.FP4GroupedMatmulTuning(block_m=16, block_n=32, block_k=64)  # 48 % 32, (96/2) % 32 ragged
    gs = np.array([0, 21, 2, 14], np.int32)
    y = fgm.fp4_grouped_matmul(x, w, jnp.asarray(gs), tuning=tuning)
    check(y, Expected(x, w), gs, jnp.bfloat16, "pallas", jnp.bfloat16)
    if fmt == "nvfp4":  # per-row tensor scales through the masked last N tile
        ts = jnp.asarray(rng.uniform(0.5, 2.0, size=(g, n)).astype(np.float32))
        w = NVFP4Tensor(w.packed, w.block_scales, ts)
        y = fgm.fp4_grouped_matmul(x, w, jnp.asarray(gs), tuning=tuning)
        check(y, Expected(x, w), gs, jnp.bfloat16, "pallas", jnp.bfloat16)


def poison(fmt: str, w, dead: np.ndarray, value: str):
    """`w` with every weight of the `dead` groups NaN (`value="nan"`) or +-inf / NaN mixed ("inf")."""
    dead = jnp.asarray(dead)[:, None, None]
    if fmt == "mxfp4":
        if value == "nan":
            return MXFP4Tensor(w.blocks, jnp.where(dead, jnp.uint8(255), w.scales))
        # scale byte 254 with codes of |E2M1| >= 2 overflows to +-inf; the zero codes stay 0 (but 0 * x)
        big = jnp.where(dead[..., None], jnp.uint8(0x5F), w.blocks)  # codes 0xF (-6) and 0x5 (+3)
        return MXFP4Tensor(big, jnp.where(dead, jnp.uint8(254), w.scales))
    special = np.nan if value == "nan" else np.inf
    bad = jnp.asarray(np.array([special], ml_dtypes.float8_e4m3fn))[0]  # e4m3fn has no inf: NaN as well
    out = NVFP4Tensor(w.packed, jnp.where(dead, bad, w.block_scales), w.tensor_scale)
    if value == "inf":  # an infinite tensor scale for the dead experts, finite block scales
        ts = jnp.where(jnp.asarray(dead[:, 0, 0]), jnp.float32(np.inf), jnp.asarray(w.tensor_scale))
        out = NVFP4Tensor(w.packed, w.block_scales, ts)
    return out


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_non_finite_weights_of_unrouted_groups_reach_no_output(impl, fmt, value):
    """Experts without rows whose weights are NaN / inf must change no output row: neither the routed
    groups' rows nor the rows past sum(group_sizes), which stay exactly zero. (XLA's ragged_dot alone
    spreads them: it multiplies every group's weights by a 0/1 row mask.)"""
    w = weights(fmt)
    gs = np.array([0, 6, 0, 0, 9, 0, 3, 0], np.int32)  # sum 18 of 24 rows; the last group is dead too
    poisoned = poison(fmt, w, gs == 0, value)
    with np.errstate(invalid="ignore"):  # 0 x inf in the numpy decode of the poisoned experts
        assert not np.isfinite(dequant_np(poisoned)[gs == 0]).any()
    x = activations(24, K, jnp.bfloat16)
    y = runner(impl)(x, poisoned, jnp.asarray(gs))
    check(y, Expected(x, w), gs, jnp.bfloat16, impl, jnp.bfloat16)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_mxfp4_scale_bytes_241_to_252_are_finite_and_exact(impl):
    """Block scales 2^114 .. 2^125 keep every E2M1 value finite (the largest, 6 * 2^125, is below float32's
    max): each implementation must give the reference's values, not inf / NaN (0 x inf)."""
    g, n, k, m = 2, 16, 64, 12
    rng = np.random.default_rng(21)
    blocks = rng.integers(0, 256, size=(g, n, k // 32, 16), dtype=np.uint8)
    blocks[:, :, :, 0] = 0  # zero codes in every block (0 x 2^s must be 0)
    scales = rng.integers(241, 253, size=(g, n, k // 32), dtype=np.uint8)
    w = MXFP4Tensor(jnp.asarray(blocks), jnp.asarray(scales))
    assert np.isfinite(dequant_np(w)).all() and np.abs(dequant_np(w)).max() > 2.0**120
    x = activations(m, k, jnp.bfloat16) * jnp.bfloat16(2.0**-122)  # products back near 1
    gs = np.array([5, 6], np.int32)
    check(runner(impl)(x, w, jnp.asarray(gs)), Expected(x, w), gs, jnp.bfloat16, impl, jnp.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_nvfp4_per_row_tensor_scale(impl, dtype):
    """An NVFP4 tensor scale per output row ([G, N], a prefix of the leading shape) in every
    implementation; "auto" takes the kernel for it where the kernel runs."""
    rng = np.random.default_rng(22)
    base = weights("nvfp4")
    ts = jnp.asarray(rng.uniform(0.5, 3.0, size=(G, N)).astype(np.float32) * np.float32(1e-3))
    w = NVFP4Tensor(base.packed, base.block_scales, ts)
    x = activations(20, K, dtype)
    gs = np.array([3, 0, 5, 0, 0, 7, 1, 0], np.int32)
    check(runner(impl)(x, w, jnp.asarray(gs)), Expected(x, w), gs, dtype, impl, dtype)
    assert fgm.supports(w, dtype)


def test_auto_takes_the_kernel_only_for_what_it_supports(monkeypatch):
    monkeypatch.setattr(ops, "kernel_available", lambda: True)
    base = weights("nvfp4")
    per_row = NVFP4Tensor(base.packed, base.block_scales, jnp.ones((G, N), jnp.float32))
    scalar = NVFP4Tensor(base.packed, base.block_scales, jnp.float32(0.5))
    for w in (weights("mxfp4"), base, per_row, scalar):
        assert ops.resolve_implementation("auto", w, jnp.bfloat16) == "pallas"
        assert ops.resolve_implementation("auto", w, jnp.float16) == "xla"
    # a tensor scale the kernel cannot index (one per K element of a 2-D table) goes to XLA, not an error
    odd = NVFP4Tensor(base.packed[0], base.block_scales[0], jnp.ones((N,), jnp.float32))
    assert not fgm.supports(odd, jnp.bfloat16)
    assert ops.resolve_implementation("auto", odd, jnp.bfloat16) == "xla"
    assert ops.resolve_implementation("auto", jnp.ones((G, K, N), jnp.bfloat16), jnp.bfloat16) == "xla"


def test_in_kernel_decode_is_bit_exact():
    """The kernel's register decode equals the quant module's dequantization for every code x scale byte:
    MXFP4 scale bytes 2..255 (241..254 included: finite where the value fits, inf where it overflows, 0 for
    zero codes; 255 NaN; bytes 0..1 give subnormal products a backend may flush); every NVFP4 scale byte."""
    codes = np.arange(16, dtype=np.uint8)
    # MXFP4: one block per scale byte, the 16 codes twice
    s = np.arange(256, dtype=np.uint8)
    blocks = np.broadcast_to(np.tile(codes[0::2] | (codes[1::2] << 4), 2), (256, 16)).copy()
    want = dequantize_mxfp4_np(blocks, s, np.float32).reshape(256, 32)
    code_grid = np.broadcast_to(np.tile(codes, 2), (256, 32))
    lo, hi = fgm.mx_block_multipliers(jnp.asarray(s))
    for dtype in (np.float32, ml_dtypes.bfloat16):
        got = np.asarray(fgm.dequantize_codes(jnp.asarray(code_grid), lo[:, None], hi[:, None], dtype))
        ref = want.astype(dtype)
        domain = s >= 2  # bytes 0, 1: float32 subnormal products, flushed by XLA:CPU and maybe a GPU
        assert_bits_equal(got[domain], ref[domain])
    assert np.isinf(want[254]).any() and np.isfinite(want[252]).all() and (want[241:255, 0] == 0).all()
    # NVFP4: every E4M3 byte as a block scale, a few tensor scales, rounded to bf16 and f32
    packed = np.broadcast_to(codes[0::2] | (codes[1::2] << 4), (256, 8)).copy()
    bs = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    code_grid = np.broadcast_to(codes, (256, 16))
    for ts in (np.float32(1.0), np.float32(3.1e-3), np.float32(0.7)):
        for dtype in (np.float32, ml_dtypes.bfloat16):
            want = dequantize_nvfp4_np(packed, bs[:, None], ts, dtype)
            mult = fgm.e4m3_to_f32(jnp.asarray(bs.view(np.uint8))) * jnp.float32(2.0**14)
            got = np.asarray(fgm.dequantize_codes(jnp.asarray(code_grid), mult[:, None], jnp.float32(ts), dtype))
            same = (got == want) | (np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32)))
            assert same.all(), (ts, dtype, np.argwhere(~same)[:4])


# ----------------------------------------------------------------------------------------------------
# Work items: only routed groups are read, every live row is covered once.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_m", [16, 32])
def test_work_items_cover_rows_once_and_only_routed_groups(block_m):
    rng = np.random.default_rng(5)
    for m, g in [(1, 8), (8, 128), (64, 8), (100, 16), (512, 128)]:
        fn = jax.jit(functools.partial(fgm.work_items, m=m, block_m=block_m))
        # straight-line code: a loop here (`jnp.searchsorted`'s default scan) costs a GPU a few kernel launches a
        # trip, in every MoE layer of every forward
        assert "while" not in fn.lower(jax.ShapeDtypeStruct((g,), jnp.int32)).as_text()
        cases = [np.zeros(g, np.int32), np.full(g, m // g, np.int32)]
        cases += [np.bincount(rng.integers(0, g, size=int(rng.integers(0, m + 1))), minlength=g).astype(np.int32)
                  for _ in range(20)]
        one = np.zeros(g, np.int32)
        one[-1] = m
        cases.append(one)
        if m >= g:  # the bound is tight: every group one row past a tile boundary
            worst = np.zeros(g, np.int32)
            per = block_m + 1
            n_full = min(g, m // per)
            worst[:n_full] = per
            cases.append(worst)
        for gs in cases:
            group, r0, r1 = map(np.asarray, fn(jnp.asarray(gs)))
            assert len(group) == fgm.max_work_items(m, g, block_m)
            live = r1 > r0
            covered = np.zeros(m, int)
            ends = np.cumsum(gs)
            for grp, a, b in zip(group[live], r0[live], r1[live]):
                assert gs[grp] > 0 and b - a <= block_m
                assert ends[grp] - gs[grp] <= a and b <= ends[grp]
                covered[a:b] += 1
            assert np.all(covered[: ends[-1]] == 1) and np.all(covered[ends[-1]:] == 0)
            assert set(group[live].tolist()) == set(np.flatnonzero(gs).tolist())


# ----------------------------------------------------------------------------------------------------
# Dispatcher and errors.
# ----------------------------------------------------------------------------------------------------


def test_dispatch_auto_and_errors():
    w = weights("mxfp4")
    dense = jnp.ones((G, K, N), jnp.bfloat16)
    expected_auto = "pallas" if jax.default_backend() == "gpu" else "xla"
    assert ops.resolve_implementation("auto", w, jnp.bfloat16) == expected_auto
    assert ops.resolve_implementation("auto", dense, jnp.bfloat16) == "xla"
    assert ops.resolve_implementation("auto", w, jnp.float16) == "xla"
    gs = jnp.zeros((G,), jnp.int32)
    with pytest.raises(NotImplementedError, match="FP4"):
        ops.grouped_matmul(jnp.ones((4, K), jnp.bfloat16), dense, gs, implementation="pallas")
    with pytest.raises(NotImplementedError, match="bfloat16 or float32"):
        ops.grouped_matmul(jnp.ones((4, K), jnp.float16), w, gs, implementation="pallas")
    with pytest.raises(NotImplementedError, match="preferred_element_type"):
        fgm.fp4_grouped_matmul(jnp.ones((4, K), jnp.bfloat16), w, gs, preferred_element_type=jnp.float16)
    with pytest.raises(ValueError, match="shapes"):
        ops.grouped_matmul(jnp.ones((4, K + 32), jnp.bfloat16), w, gs, implementation="pallas")
    with pytest.raises(ValueError, match="power of two"):
        fgm.FP4GroupedMatmulTuning(block_m=24, block_n=32, block_k=64)
    assert fgm.fp4_grouped_matmul(jnp.ones((0, K), jnp.bfloat16), w, gs).shape == (0, N)


def test_default_tuning_by_width():
    verify = fgm.default_tuning(8 * 8, 2048, 1536)
    assert (verify.block_m, verify.block_n, verify.block_k) == (16, 64, 256)
    prefill = fgm.default_tuning(4096, 2048, 1536)
    assert prefill.block_m == 64 and prefill.block_n == 128
    tiny = fgm.default_tuning(4, 64, 32)
    assert (tiny.block_n, tiny.block_k) == (32, 64)


# ----------------------------------------------------------------------------------------------------
# The GPU program, checked on CPU as far as possible: lowering to a verified Triton module.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "dtype", "shape"), [
    ("mxfp4", jnp.bfloat16, (128, 1536, 2048, 64)),  # Qwen3-30B-A3B gate_up, 8 tokens x top-8
    ("nvfp4", jnp.bfloat16, (8, 2880, 2880, 4)),  # gpt-oss down-like, ragged K tiles
    ("mxfp4", jnp.float32, (8, 48, 96, 5)),  # ragged N and K
])
def test_triton_lowering_verifies(monkeypatch, fmt, dtype, shape):
    if jax.default_backend() == "gpu":
        pytest.skip("the GPU runs the compiled kernel in the suite above")
    g, n, k, m = shape
    w = jax.eval_shape(lambda: quantize(fmt, jnp.zeros((g, n, k), jnp.float32)))  # shapes only
    verified = []
    try:
        from jax._src.pallas.triton import lowering as triton_lowering
    except ImportError:  # pragma: no cover
        pytest.skip("no Pallas Triton lowering in this jax")
    original = getattr(triton_lowering, "lower_jaxpr_to_triton_module", None)
    if original is not None:
        def lower_and_verify(*args, **kwargs):
            result = original(*args, **kwargs)
            verified.append(result.module.operation.verify())
            return result
        monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    fn = jax.jit(lambda x, w, gs: fgm.fp4_grouped_matmul(x, w, gs, interpret=False))
    x = jax.ShapeDtypeStruct((m, k), dtype)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32)
    text = fn.trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    if original is not None:
        assert verified == [True]


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_layer_pallas_matches_xla(fmt):
    """The MoE expert FFN (sort by expert, gate_up, SwiGLU, down, unsort) through both paths."""
    from dflash_jax.nn.moe import swiglu_experts

    e, h, inter, t, k = 8, 64, 32, 6, 2
    rng = np.random.default_rng(11)
    gate_up = quantize(fmt, (rng.standard_normal((e, 2 * inter, h)) * 0.1).astype(np.float32))
    down = quantize(fmt, (rng.standard_normal((e, h, inter)) * 0.1).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]), jnp.int32)
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    outs = {impl: swiglu_experts(x, experts, weights, gate_up, down, implementation=impl)
            for impl in ("xla", "pallas")}
    np.testing.assert_allclose(np.asarray(outs["pallas"]), np.asarray(outs["xla"]), rtol=1e-5, atol=1e-6)
