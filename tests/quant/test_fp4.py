"""Tests for dflash_jax.quant: E2M1 codec, MXFP4 and NVFP4."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax.quant import (
    E2M1_VALUES,
    MXFP4Tensor,
    NVFP4Tensor,
    dequantize_mxfp4,
    dequantize_mxfp4_np,
    dequantize_nvfp4,
    dequantize_nvfp4_np,
    e2m1_decode,
    e2m1_decode_np,
    e2m1_encode,
    e2m1_encode_np,
    pack_fp4,
    pack_fp4_np,
    quantize_mxfp4,
    quantize_mxfp4_np,
    quantize_nvfp4,
    quantize_nvfp4_np,
    unpack_fp4,
    unpack_fp4_np,
)
from dflash_jax.quant.nvfp4 import round_to_e4m3_xp

F4 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16


def bits(a) -> np.ndarray:
    """Raw bit patterns of a float array (so -0.0 != 0.0 and NaN == NaN when identical)."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


# Magnitude grid of E2M1 (codes 0..7) and a float64 brute-force RNE reference that is
# independent of the implementation: nearest grid point, ties to the even code.
_GRID = np.array(E2M1_VALUES[:8], np.float64)


def brute_force_e2m1(y) -> np.ndarray:
    y = np.asarray(y, np.float64)
    a = np.abs(y)
    dist = np.abs(a[..., None] - _GRID)  # [..., 8]
    best = dist.min(-1, keepdims=True)
    cand = dist == best
    # among equidistant codes prefer the even one (there are at most two, adjacent)
    even_pref = np.where(cand & (np.arange(8) % 2 == 0), 1, 0) + cand
    mag = np.argmax(even_pref, axis=-1).astype(np.uint8)
    return mag | (np.signbit(y).astype(np.uint8) << 3)


def e2m1_half_ulp_bound(y) -> np.ndarray:
    """Largest |y - RNE_E2M1(y)| allowed: half the grid spacing at |y| (0.5 below 2,
    1 in [2, 4), 2 in [4, 6]) and, beyond the saturation point 6, exactly |y| - 6."""
    a = np.abs(np.asarray(y, np.float64))
    half = np.where(a < 2, 0.25, np.where(a < 4, 0.5, 1.0))
    return np.where(a <= 6, half, a - 6)


# ------------------------------------------------------------------------------------------
# E2M1 codec and packing
# ------------------------------------------------------------------------------------------


def test_decode_matches_table_and_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    table = np.array(E2M1_VALUES, np.float32)
    np.testing.assert_array_equal(bits(e2m1_decode(codes)), bits(table))
    np.testing.assert_array_equal(bits(e2m1_decode_np(codes)), bits(table))
    np.testing.assert_array_equal(bits(e2m1_decode(codes, jnp.bfloat16)), bits(table.astype(BF16)))
    # ml_dtypes' float4_e2m1fn interprets the same codes identically (sign of zero too).
    np.testing.assert_array_equal(bits(codes.view(F4).astype(np.float32)), bits(table))


# (input, expected code) worked out by hand from the table 0,.5,1,1.5,2,3,4,6.
HAND_ENCODE = [
    (0.0, 0),
    (0.1, 0),
    (0.25, 0),  # tie 0 | 0.5 -> even code 0
    (0.2500001, 1),
    (0.5, 1),
    (0.7499999, 1),
    (0.75, 2),  # tie 0.5 | 1 -> code 2 (1.0)
    (1.0, 2),
    (1.25, 2),  # tie 1 | 1.5 -> code 2 (1.0)
    (1.5, 3),
    (1.75, 4),  # tie 1.5 | 2 -> code 4 (2.0)
    (2.5, 4),  # tie 2 | 3 -> code 4 (2.0)
    (3.0, 5),
    (3.5, 6),  # tie 3 | 4 -> code 6 (4.0)
    (5.0, 6),  # tie 4 | 6 -> code 6 (4.0, even mantissa)
    (5.0001, 7),
    (6.0, 7),
    (7.0, 7),  # saturate
    (100.0, 7),
    (np.inf, 7),
    (-100.0, 15),
    (-np.inf, 15),
    (-0.0, 8),  # negative zero keeps its sign
    (-0.1, 8),
    (-0.25, 8),
    (-0.75, 10),
    (-1.75, 12),
    (-5.0, 14),
    (-6.0, 15),
]


def test_encode_rne_ties_saturation_signed_zero():
    x = np.array([v for v, _ in HAND_ENCODE], np.float32)
    want = np.array([c for _, c in HAND_ENCODE], np.uint8)
    np.testing.assert_array_equal(np.asarray(e2m1_encode(x)), want)
    np.testing.assert_array_equal(e2m1_encode_np(x), want)
    # Every table value maps back to its own code.
    np.testing.assert_array_equal(np.asarray(e2m1_encode(np.array(E2M1_VALUES, np.float32))), np.arange(16))


def test_dtype_cast_agrees_with_hand_table_and_encoder():
    """jnp.astype(float4_e2m1fn) rounds RNE and saturates, like our comparison encoder."""
    x = np.array([v for v, _ in HAND_ENCODE], np.float32)
    want = np.array([c for _, c in HAND_ENCODE], np.uint8)
    cast_codes = jax.lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float4_e2m1fn), jnp.uint4)
    np.testing.assert_array_equal(np.asarray(cast_codes.astype(jnp.uint8)), want)
    np.testing.assert_array_equal(x.astype(F4).view(np.uint8), want)
    # Dense sweep: all midpoints and their float32 neighbours, plus random values.
    mids = (_GRID[1:] + _GRID[:-1]) / 2
    pts = np.concatenate([mids, _GRID]).astype(np.float32)
    pts = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    rnd = np.random.default_rng(0).uniform(-9, 9, 20000).astype(np.float32)
    sweep = np.concatenate([pts, -pts, rnd])
    ours = np.asarray(e2m1_encode(sweep))
    np.testing.assert_array_equal(ours, sweep.astype(F4).view(np.uint8))
    np.testing.assert_array_equal(ours, brute_force_e2m1(sweep))


def test_pack_unpack_layout():
    codes = np.array([[1, 2, 3, 4, 15, 0]], np.uint8)
    want = np.array([[0x21, 0x43, 0x0F]], np.uint8)  # element 2i in the low nibble
    np.testing.assert_array_equal(np.asarray(pack_fp4(codes)), want)
    np.testing.assert_array_equal(pack_fp4_np(codes), want)
    np.testing.assert_array_equal(np.asarray(unpack_fp4(want)), codes)
    np.testing.assert_array_equal(unpack_fp4_np(want), codes)
    rnd = np.random.default_rng(1).integers(0, 16, (3, 5, 64), dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(unpack_fp4(pack_fp4(rnd))), rnd)
    with pytest.raises(ValueError, match="even length"):
        pack_fp4(np.zeros((2, 3), np.uint8))


def test_jax_bitcast_uint8_to_fp4_is_low_nibble_first():
    """On this jax, bitcast uint8[...] -> float4_e2m1fn[..., 2] puts the low nibble first,
    i.e. it agrees with our packing (useful for kernels that want the dtype path)."""
    rnd = np.random.default_rng(2).integers(0, 16, (4, 32), dtype=np.uint8)
    packed = pack_fp4_np(rnd)
    f4 = jax.lax.bitcast_convert_type(jnp.asarray(packed), jnp.float4_e2m1fn)
    assert f4.shape == (4, 16, 2)
    np.testing.assert_array_equal(
        bits(f4.reshape(4, 32).astype(jnp.float32)), bits(e2m1_decode_np(rnd))
    )


# ------------------------------------------------------------------------------------------
# MXFP4
# ------------------------------------------------------------------------------------------

EDGE_SCALES = np.array([0, 1, 2, 126, 127, 128, 252, 253, 254], np.uint8)


def _gpt_oss_like(seed, e=3, rows=8, g=6):
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (e, rows, g, 16), dtype=np.uint8)
    scales = rng.integers(110, 136, (e, rows, g), dtype=np.uint8)
    flat = scales.reshape(-1)
    flat[: len(EDGE_SCALES)] = EDGE_SCALES  # edge exponents incl. fp32 subnormal/overflow
    return blocks, flat.reshape(scales.shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_mxfp4_dequant_matches_transformers_bit_exact(dtype):
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = _gpt_oss_like(3)
    tdtype = getattr(torch, dtype)
    ref = hf.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=tdtype)
    # HF returns [E, K, rows] (transposed for its matmul); ours keeps [E, rows, K].
    assert tuple(ref.shape) == (3, 6 * 32, 8)
    ref_bits = ref.transpose(1, 2).contiguous().view(torch.int32 if dtype == "float32" else torch.int16).numpy()
    jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype]
    ours = dequantize_mxfp4(blocks, scales, jdtype)
    assert ours.shape == (3, 8, 6 * 32) and ours.dtype == jdtype
    np.testing.assert_array_equal(bits(ours), ref_bits.view(bits(ours).dtype))
    host = dequantize_mxfp4_np(blocks, scales, np.dtype(jdtype))
    np.testing.assert_array_equal(bits(host), ref_bits.view(bits(ours).dtype))
    if dtype != "float16":  # the edge scales really produced subnormals and infinities
        assert np.isinf(np.asarray(ours, np.float32)).any()
        vals = np.abs(np.asarray(ours, np.float32))
        assert ((vals > 0) & (vals < np.finfo(np.float32).tiny)).any()


def test_mxfp4_nan_scale():
    blocks = np.random.default_rng(4).integers(0, 256, (2, 1, 16), dtype=np.uint8)
    blocks[0] = 0  # even zero codes are NaN under a NaN scale
    scales = np.array([[255], [255]], np.uint8)
    assert np.isnan(np.asarray(dequantize_mxfp4(blocks, scales, jnp.float32))).all()
    assert np.isnan(np.asarray(dequantize_mxfp4(blocks, scales, jnp.bfloat16), np.float32)).all()
    assert np.isnan(dequantize_mxfp4_np(blocks, scales)).all()
    # A non-finite input makes its block scale NaN.
    x = np.ones((2, 32), np.float32)
    x[1, 3] = np.inf
    assert np.asarray(quantize_mxfp4(x).scales).tolist() == [[127 + 0 - 2], [255]]


def test_mxfp4_scale_rule_by_hand():
    """s = clamp(floor(log2 amax) - 2 + 127, 0, 254), hand-computed per block."""
    amaxes = [6.0, 7.99, 8.0, 0.3, 0.0, 1e-39, 2.0**-125, 2.0**-124, 3e38, 1.0]
    want = [127, 127, 128, 123, 0, 0, 0, 1, 252, 125]
    # floor(log2): 2, 2, 3, -2, -, -, -125, -124, 127, 0
    x = np.zeros((len(amaxes), 32), np.float32)
    x[:, 5] = -np.array(amaxes, np.float32)  # amax is taken over |x|
    q = quantize_mxfp4(x)
    assert np.asarray(q.scales)[:, 0].tolist() == want
    codes = np.asarray(unpack_fp4(q.blocks)).reshape(len(amaxes), 32)
    # amax/2^X: 6 -> -6 (15); 7.99 saturates to -6 (15); 8/2^1 = 4 -> -4 (14); 0.3*2^4 = 4.8 -> -4 (14);
    # 0 -> -0 (8); 1.0 / 2^-2 = 4 -> -4 (14).
    assert codes[[0, 1, 2, 3, 4, 9], 5].tolist() == [15, 15, 14, 14, 8, 14]
    assert (codes[:, [0, 31]] == 0).all()  # the +0 elements


def _random_mx_codes(rng, shape):
    """Random codes where every block holds at least one |value| >= 4 so the OCP rule
    reproduces the block scale exactly."""
    codes = rng.integers(0, 16, shape, dtype=np.uint8)
    *lead, k = shape
    blocks = codes.reshape(*lead, k // 32, 32)
    pos = rng.integers(0, 32, blocks.shape[:-1])
    big = rng.choice(np.array([6, 7, 14, 15], np.uint8), blocks.shape[:-1])
    np.put_along_axis(blocks, pos[..., None], big[..., None], axis=-1)
    return blocks.reshape(shape)


def test_mxfp4_roundtrip_bit_exact():
    rng = np.random.default_rng(5)
    codes = _random_mx_codes(rng, (4, 6, 128))
    scales = rng.integers(2, 253, (4, 6, 4), dtype=np.uint8)  # fp32-normal results only
    # one all-(signed)zero block: amax 0 -> scale byte 0
    codes[0, 0, :32] = rng.choice(np.array([0, 8], np.uint8), 32)
    scales[0, 0, 0] = 0
    blocks = pack_fp4_np(codes).reshape(4, 6, 4, 16)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = dequantize_mxfp4(blocks, scales, dtype)
        q = quantize_mxfp4(x)
        np.testing.assert_array_equal(np.asarray(q.blocks), blocks)
        np.testing.assert_array_equal(np.asarray(q.scales), scales)
        hb, hs = quantize_mxfp4_np(np.asarray(x))
        np.testing.assert_array_equal(hb, blocks)
        np.testing.assert_array_equal(hs, scales)


def _gaussian(seed, shape, spread=20):
    """N(0,1) rows scaled by 2^U[-spread, spread) so block scales vary."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    return (x * (2.0 ** rng.integers(-spread, spread, shape[:-1] + (1,)))).astype(np.float32)


def test_mxfp4_error_bounds_gaussian():
    x = _gaussian(6, (64, 512))
    q = quantize_mxfp4(x)
    deq = np.asarray(q.dequantize(jnp.float32), np.float64)
    scale = np.exp2(np.asarray(q.scales, np.float64) - 127)  # 2^X per block
    scale = np.repeat(scale, 32, axis=-1)
    y = x.astype(np.float64) / scale  # exact
    assert np.abs(y).max() < 8  # the OCP scale puts amax/2^X in [4, 8)
    blk_amax = np.abs(y).reshape(64, 16, 32).max(-1)
    assert (blk_amax >= 4).all()
    err = np.abs(x - deq)
    assert (err <= e2m1_half_ulp_bound(y) * scale).all()
    # codes equal an independent float64 nearest-grid (ties-to-even) reference
    codes = np.asarray(unpack_fp4(q.blocks)).reshape(x.shape)
    np.testing.assert_array_equal(codes, brute_force_e2m1(y))
    # Relative Frobenius error of N(0,1) blocks. Expected ~0.115: a 32-sample block has
    # amax ~2.1 sigma, so X = -1 and the grid spacing is 0.25 sigma on |x| < 1 sigma (68%
    # of elements), 0.5 on [1, 2) (27%), 1 beyond (5%): sqrt(sum p_i d_i^2 / 12) = 0.115.
    x1 = np.random.default_rng(7).standard_normal((64, 512)).astype(np.float32)
    d1 = np.asarray(quantize_mxfp4(x1).dequantize(jnp.float32))
    rel = np.linalg.norm(d1 - x1) / np.linalg.norm(x1)
    assert 0.10 < rel < 0.13, rel


# ------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------


def test_e4m3_rounding_matches_ml_dtypes_and_saturates():
    all_pos = np.arange(0x00, 0x7F, dtype=np.uint8).view(E4M3).astype(np.float32)  # 0 .. 448
    mids = (all_pos[1:] + all_pos[:-1]) / 2  # ties (exact in fp32)
    pts = np.concatenate([all_pos, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9))])
    pts = np.concatenate([pts, np.random.default_rng(8).uniform(0, 460, 5000).astype(np.float32)])
    pts = pts[pts < 464].astype(np.float32)  # above 464 ml_dtypes' cast gives NaN, not 448
    want = pts.astype(E4M3).astype(np.float32)
    np.testing.assert_array_equal(bits(round_to_e4m3_xp(jnp, jnp.asarray(pts))), bits(want))
    np.testing.assert_array_equal(bits(round_to_e4m3_xp(np, pts)), bits(want))
    big = np.array([464.0, 465.0, 1e6, np.inf], np.float32)
    np.testing.assert_array_equal(np.asarray(round_to_e4m3_xp(jnp, jnp.asarray(big))), [448.0] * 4)


def test_nvfp4_worked_by_hand():
    # Tensor amax = 10.5 -> tensor_scale = 10.5 / (6 * 448) = 10.5 / 2688 = 2^-8.
    # Block A: amax 10.5 -> block scale 10.5 / 6 / 2^-8 = 1.75 * 256 = 448 = e4m3 0x7E
    #   (S=0 E=1111 M=110), so denom = 448 * 2^-8 = 1.75 and y = x / 1.75:
    a = np.array([10.5, -10.5, 0, 0.875, 1.75, 2.625, 3.5, 5.25, 7, -0.4375, 1.3125, 4.375, 8.75, 6.125, 2.1875, -3.0625])
    # y =     [6, -6, 0, .5, 1, 1.5, 2, 3, 4, -.25(tie->-0), .75(tie->1), 2.5(tie->2),
    #          5(tie->4), 3.5(tie->4), 1.25(tie->1), -1.75(tie->-2)]
    a_codes = [7, 15, 0, 1, 2, 3, 4, 5, 6, 8, 2, 4, 6, 6, 2, 12]
    a_packed = [0xF7, 0x10, 0x32, 0x54, 0x86, 0x42, 0x66, 0xC2]
    # Block B: amax 1.0 -> 1 / 6 / 2^-8 = 42.67 in [32, 64) where e4m3 spacing is 4
    #   -> 44 (10.67 -> 11 quanta) = 1.011b * 2^5 = 0x63 (S=0 E=1100 M=011); denom = 0.171875.
    b = np.array([1.0, -1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, -0.375, 0.75, 0.625, 0.4375, -0.0, 0.3, 0.2, 0.9, -0.55])
    # y = [5.82, -5.82, 2.91, 1.45, .727, .364, .182, -2.18, 4.36, 3.64, 2.55, -0, 1.75-, 1.16, 5.24, -3.2]
    b_codes = [7, 15, 5, 3, 1, 1, 0, 12, 6, 6, 5, 8, 3, 2, 7, 13]
    b_packed = [0xF7, 0x35, 0x11, 0xC0, 0x66, 0x85, 0x23, 0xD7]
    # Block C: all zero -> block scale 0 (0x00), codes 0, no NaN.
    # Block D: amax 2^-20 -> 2^-20 / 6 * 256 = 1.6e-5 < 2^-10 (half the smallest e4m3
    #   subnormal) -> block scale 0 -> zero codes with x's sign.
    d = np.zeros(16)
    d[0], d[1] = 2.0**-20, -(2.0**-21)
    d_codes = [0, 8] + [0] * 14
    x = np.stack([np.concatenate([a, b]), np.concatenate([np.zeros(16), d])]).astype(np.float32)

    for packed, bs, ts in [
        (lambda q: (q.packed, q.block_scales, q.tensor_scale))(quantize_nvfp4(x)),
        quantize_nvfp4_np(x),
    ]:
        assert float(ts) == 2.0**-8
        np.testing.assert_array_equal(np.asarray(bs).view(np.uint8), [[0x7E, 0x63], [0x00, 0x00]])
        np.testing.assert_array_equal(
            np.asarray(packed),
            np.array([a_packed + b_packed, [0] * 8 + pack_fp4_np(np.array(d_codes, np.uint8)).tolist()], np.uint8),
        )
        np.testing.assert_array_equal(
            np.asarray(unpack_fp4(packed)), np.array([a_codes + b_codes, [0] * 16 + d_codes])
        )
    q = quantize_nvfp4(x)
    deq = np.asarray(q.dequantize(jnp.float32))
    want_a = np.array([6, -6, 0, 0.5, 1, 1.5, 2, 3, 4, -0.0, 1, 2, 4, 4, 1, -2]) * 1.75
    want_b = np.array([6, -6, 3, 1.5, 0.5, 0.5, 0, -2, 4, 4, 3, -0.0, 1.5, 1, 6, -3]) * 0.171875
    np.testing.assert_array_equal(bits(deq[0]), bits(np.concatenate([want_a, want_b]).astype(np.float32)))
    np.testing.assert_array_equal(bits(deq[1]), bits(np.array([0.0] * 17 + [-0.0] + [0.0] * 14, np.float32)))
    assert q.shape == (2, 32) and q.packed.shape == (2, 16) and q.block_scales.shape == (2, 2)


def test_nvfp4_saturation_and_zero_tensor():
    # Given tensor_scale 2^-8: amax 1e6 -> block scale 1e6/6*256 saturates at 448, then
    # 1e6 / 1.75 saturates to 6 (code 7) and -3 / 1.75 = -1.71 -> -1.5 (code 11).
    x = np.zeros((1, 16), np.float32)
    x[0, 0], x[0, 1] = 1e6, -3.0
    q = quantize_nvfp4(x, tensor_scale=2.0**-8)
    assert np.asarray(q.block_scales).view(np.uint8).tolist() == [[0x7E]]
    assert np.asarray(unpack_fp4(q.packed))[0, :2].tolist() == [7, 11]
    # All-zero (and -0) tensor: tensor_scale 0, no NaN anywhere, zeros keep their sign.
    z = np.zeros((2, 32), np.float32)
    z[1] = -0.0
    qz = quantize_nvfp4(z)
    assert float(qz.tensor_scale) == 0.0
    dz = np.asarray(qz.dequantize(jnp.float32))
    np.testing.assert_array_equal(bits(dz), bits(z))


def _random_nv(rng, shape, ts):
    """Random codes/scales that the NVIDIA recipe reproduces: each block holds a +-6,
    one block uses scale 448, and the tensor scale is a power of two."""
    *lead, k = shape
    g = k // 16
    codes = rng.integers(0, 16, (*lead, g, 16), dtype=np.uint8)
    pos = rng.integers(0, 16, (*lead, g))
    np.put_along_axis(codes, pos[..., None], rng.choice(np.array([7, 15], np.uint8), (*lead, g, 1)), axis=-1)
    scale_bytes = rng.integers(0x01, 0x7F, (*lead, g), dtype=np.uint8)  # all finite positive e4m3
    scale_bytes.reshape(-1)[0] = 0x7E  # 448
    return pack_fp4_np(codes.reshape(shape)), scale_bytes.view(E4M3), np.float32(ts)


def test_nvfp4_roundtrip_bit_exact():
    rng = np.random.default_rng(9)
    packed, bs, ts = _random_nv(rng, (4, 8, 64), 2.0**-7)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = dequantize_nvfp4(packed, bs, ts, dtype)
        for q in (quantize_nvfp4(x), quantize_nvfp4(x, tensor_scale=ts)):
            np.testing.assert_array_equal(np.asarray(q.packed), packed)
            np.testing.assert_array_equal(np.asarray(q.block_scales).view(np.uint8), bs.view(np.uint8))
            assert float(q.tensor_scale) == float(ts)
        hp, hbs, hts = quantize_nvfp4_np(np.asarray(x))
        np.testing.assert_array_equal(hp, packed)
        np.testing.assert_array_equal(hbs.view(np.uint8), bs.view(np.uint8))
        assert float(hts) == float(ts)
    # raw uint8 scale bytes are accepted by dequantize
    np.testing.assert_array_equal(
        bits(dequantize_nvfp4(packed, bs.view(np.uint8), ts, jnp.float32)),
        bits(dequantize_nvfp4(packed, bs, ts, jnp.float32)),
    )


def test_nvfp4_error_bounds_gaussian():
    # One tensor scale covers a limited dynamic range (448 / 2^-9 for the block scales),
    # so spread rows over 2^+-4 only; this keeps every block scale a normal e4m3 value.
    x = _gaussian(10, (64, 512), spread=4)
    q = quantize_nvfp4(x)
    ts = np.float32(q.tensor_scale)
    bs = np.asarray(q.block_scales).astype(np.float32)
    assert (bs > 0).all() and (bs <= 448).all() and bs.max() == 448
    denom = np.repeat((bs * ts).astype(np.float32), 16, axis=-1).astype(np.float64)  # as the recipe
    y = x.astype(np.float64) / denom
    codes = np.asarray(unpack_fp4(q.packed))
    vals = e2m1_decode_np(codes).astype(np.float64)
    # Elementwise: the code is within half an E2M1 ulp of x / (bs * ts) (or saturated);
    # 1e-6 slack covers the fp32 rounding of the division inside the recipe.
    assert (np.abs(y - vals) <= e2m1_half_ulp_bound(y) + 1e-6 * np.abs(y)).all()
    # And in x units, with the dequantized values themselves (one extra fp32 rounding).
    deq = np.asarray(q.dequantize(jnp.float32), np.float64)
    assert (np.abs(x - deq) <= (e2m1_half_ulp_bound(y) + 1e-6 * np.abs(y)) * denom + 1e-7 * np.abs(deq)).all()
    # e4m3 block-scale rounding (<= 2^-4 relative) can push |y| a little past 6 only.
    assert np.abs(y).max() < 6 * (1 + 2.0**-4) / (1 - 2.0**-4)
    # Relative Frobenius error for N(0,1): finer than MXFP4 because amax_block / 6 maps
    # exactly onto the top code (no power-of-two slack); measured 0.095 on 1e5+ samples.
    x1 = np.random.default_rng(11).standard_normal((64, 512)).astype(np.float32)
    d1 = np.asarray(quantize_nvfp4(x1).dequantize(jnp.float32))
    rel = np.linalg.norm(d1 - x1) / np.linalg.norm(x1)
    assert 0.085 < rel < 0.105, rel


# ------------------------------------------------------------------------------------------
# jit / vmap / pytree / numpy twins / errors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "jit", "vmap"])
def test_true_divide_is_correctly_rounded(mode):
    """XLA rewrites x / broadcast(d) into x * (1/d) (1-ulp errors); true_divide must not."""
    from dflash_jax.quant.fp4 import true_divide

    rng = np.random.default_rng(14)
    x = rng.uniform(0, 1000, (256, 16)).astype(np.float32)
    d = rng.uniform(0.1, 10, (256,)).astype(np.float32)
    f = {
        "eager": lambda x, d: true_divide(jnp, x, d[:, None]),
        "jit": jax.jit(lambda x, d: true_divide(jnp, x, d[:, None])),
        "vmap": jax.vmap(lambda x, d: true_divide(jnp, x, d)),
    }[mode]
    np.testing.assert_array_equal(bits(f(x, d)), bits(x / d[:, None]))
    np.testing.assert_array_equal(
        bits(jax.jit(lambda x: true_divide(jnp, x, jnp.float32(6)))(x)), bits(x / np.float32(6))
    )


def test_jit_matches_eager_and_numpy():
    """Public functions are jitted internally; disable_jit gives the op-by-op eager path."""
    x = _gaussian(12, (8, 256), spread=4)
    for quant, deq, host in [
        (quantize_mxfp4, lambda q: q.dequantize(jnp.bfloat16), quantize_mxfp4_np),
        (quantize_nvfp4, lambda q: q.dequantize(jnp.bfloat16), quantize_nvfp4_np),
    ]:
        with jax.disable_jit():
            qe = quant(x)
            de = deq(qe)
        qj = jax.jit(quant)(x)
        for le, lj, lh in zip(jax.tree.leaves(qe), jax.tree.leaves(qj), host(x), strict=True):
            np.testing.assert_array_equal(bits(le), bits(lj))
            np.testing.assert_array_equal(bits(le), bits(lh))
        np.testing.assert_array_equal(bits(de), bits(jax.jit(deq)(qj)))
    b, s = quantize_mxfp4_np(x)
    np.testing.assert_array_equal(
        bits(jax.jit(dequantize_mxfp4, static_argnums=2)(b, s, jnp.float32)), bits(dequantize_mxfp4_np(b, s))
    )
    p, bs, ts = quantize_nvfp4_np(x)
    np.testing.assert_array_equal(
        bits(jax.jit(dequantize_nvfp4, static_argnums=3)(p, bs, ts, jnp.bfloat16)),
        bits(dequantize_nvfp4_np(p, bs, ts, BF16)),
    )


def test_pytree_and_vmap_per_expert_tensor_scale():
    x = _gaussian(13, (3, 4, 64), spread=3)  # [E, N, K]
    q = jax.vmap(quantize_nvfp4)(x)
    assert isinstance(q, NVFP4Tensor) and q.tensor_scale.shape == (3,) and q.shape == (3, 4, 64)
    stacked = np.asarray(q.dequantize(jnp.float32))
    for e in range(3):
        qe = quantize_nvfp4(x[e])
        np.testing.assert_array_equal(bits(stacked[e]), bits(qe.dequantize(jnp.float32)))
    m = quantize_mxfp4(x)
    assert isinstance(m, MXFP4Tensor) and m.shape == (3, 4, 64) and m.ndim == 3
    assert m.blocks.shape == (3, 4, 2, 16) and m.scales.shape == (3, 4, 2)
    assert len(jax.tree.leaves(m)) == 2 and len(jax.tree.leaves(q)) == 3
    m2 = jax.jit(lambda t: t)(m)
    np.testing.assert_array_equal(np.asarray(m2.blocks), np.asarray(m.blocks))


def test_errors():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        quantize_mxfp4(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        quantize_mxfp4_np(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        quantize_nvfp4(np.zeros((2, 24), np.float32))
    with pytest.raises(ValueError, match="blocks"):
        dequantize_mxfp4(np.zeros((2, 3, 16), np.uint8), np.zeros((2, 4), np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        dequantize_mxfp4(np.zeros((2, 3, 16), np.int32), np.zeros((2, 3), np.uint8))
    with pytest.raises(ValueError, match="block_scales"):
        dequantize_nvfp4(np.zeros((2, 8), np.uint8), np.zeros((2, 2), E4M3), np.float32(1))
    with pytest.raises(ValueError, match="tensor_scale"):
        quantize_nvfp4(np.zeros((2, 16), np.float32), tensor_scale=np.ones(3, np.float32))
