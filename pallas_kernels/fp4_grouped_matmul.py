"""Grouped (per-expert) matmul with FP4 weights, as a Pallas kernel (Triton backend on GPU).

Math. Rows of `x` are sorted by group; group g owns rows `[start_g, end_g)` with
`end_g = sum_{h <= g} group_sizes[h]`, `start_g = end_g - group_sizes[g]`. With `W[g]` the `[N, K]`
weight of group g (HF `[out, in]` orientation, FP4 blocks along K):

    y[m, n] = sum_k x[m, k] * Wq[g(m), n, k]      for start_g <= m < end_g
    y[m, n] = 0                                   for m >= sum(group_sizes)

where `Wq = dequant(W).astype(x.dtype)`: the weight is dequantized exactly as `pallas_kernels.formats` does and
rounded once to the activation dtype, the products are accumulated in float32 and the sum is rounded once
to the output dtype (`preferred_element_type`, default `x.dtype`). Formats:

  MXFP4   Wq[n, 32b + j] = E2M1(code) * 2^(s[n, b] - 127)           (E8M0 byte s; s == 255 -> NaN)
  NVFP4   Wq[n, 16b + j] = (E2M1(code) * float(bs[n, b])) * ts       ts = tensor_scale: a scalar,
                                                                    per group [G] or per row [G, N]

The kernel's dequantized weights are bit-identical to `dequantize_mxfp4` / `dequantize_nvfp4` followed
by `.astype(x.dtype)` for every code and scale byte, with one exception: MXFP4 scale bytes 0 and 1 (block
scales 2^-127, 2^-126) give float32 subnormal products, which a GPU may flush to zero (the reference keeps
them; real checkpoints sit near 2^-10). Scale bytes 241..254 give the reference's values: finite where
`E2M1 * 2^(s - 127)` fits float32, inf where it does not, 0 for zero codes; 255 is NaN for every code, as
in the reference. NVFP4 is exact for every input (`E2M1 * bs` is exact in float32, then one rounding
multiply by the tensor scale, as the reference does).

Kernel design (the width-B verify regime: M = tokens x top-k is small, a group holds a few rows, the
kernel is bound by reading FP4 weight bytes).

  * Work items. The wrapper turns `group_sizes` into a static-length list of (group, row start, row end)
    work items: every non-empty group contributes `ceil(size / block_m)` tiles of `block_m` rows
    starting at its own first row. The list length is the static bound
    `W = min(M, (M + min(G, M) * (block_m - 1)) // block_m)` on the number of tiles; items past the real
    count are marked empty (row end == row start).
  * Grid `(W, cdiv(N, block_n))`. Program (w, j) reads the `[block_n, K]` FP4 slab of its group's
    weight, K tile by K tile (`block_k` elements = `block_k / 2` bytes per row), dequantizes it in
    registers and accumulates `x_tile @ Wq_tile^T` in float32. Empty items run zero K iterations, so
    a group without rows costs nothing and its bytes are never read: only the routed experts' weights
    move. A group with more than `block_m` rows re-reads its slab once per extra row tile (from L2,
    as the tiles of one group run back to back); the width heuristic picks `block_m` so that verify
    groups fit one tile.
  * No nibble interleave. Byte i of a weight row holds elements 2i (low nibble) and 2i+1 (high
    nibble), so `x @ Wq^T = x[:, 0::2] @ lo^T + x[:, 1::2] @ hi^T`: the wrapper splits the (small)
    activation into its even and odd columns once and the kernel runs two dots per K tile on the
    unpacked nibble planes, never shuffling the weight.
  * Dequantization in registers: a 4-bit code `c = s e e m` becomes the float16 bit pattern
    `s << 15 | (e e m) << 9`, which is exactly `E2M1(c) * 2^-14` (e == 0 lands on float16 subnormals);
    two float32 multiplies per element restore the value. MXFP4: `2^(min(s, 240) - 113)` (always finite)
    then `2^(max(s, 240) - 240)` (1 for every s <= 240; both powers of two, so the product is exact and
    overflows to inf exactly where the reference's value does). NVFP4: `2^14 * float(bs)` (exact) then
    the tensor scale, the reference's one rounding multiply.
  * Output rows are written only by the item owning them (masked stores); the output buffer starts as
    zeros (aliased input), so rows past `sum(group_sizes)` stay zero. Activations are padded by
    `block_m` rows and to a whole number of K tiles (cheap, they are small); weights are never copied
    and partial N / K tiles of the weight are masked loads.

Supported: activations bfloat16 (the model path) and float32 (testing; the in-kernel dot runs at
float32 "highest" precision); outputs bfloat16 / float32; NVFP4 tensor scales of shape (), [G] or [G, N].
Anything else raises NotImplementedError (`supports(w, x_dtype)` says so up front; the dispatcher's
"auto" asks it and falls back to XLA).
On CPU the kernel runs with `interpret=True` (the default off-GPU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import target
from pallas_kernels.formats import MXFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE, MXFP4Tensor, NVFP4Tensor

try:  # the Triton backend's Python API imports without a GPU; guard anyway (exotic builds)
    from jax.experimental.pallas import triton as _pl_triton
except ImportError:  # pragma: no cover
    _pl_triton = None

SUPPORTED_ACTIVATION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
SUPPORTED_OUTPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))

# float32 multiplier that undoes the 2^-14 of the float16 trick (see module doc).
_F16_TRICK_EXP = 14
_F16_TRICK_SCALE = float(2**_F16_TRICK_EXP)


# ----------------------------------------------------------------------------------------------------
# Tuning.
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP4GroupedMatmulTuning:
    """Block sizes of the kernel (all powers of two: Triton tensor shapes must be).

    block_m: rows per work item (>= 16, the smallest MMA tile). Rows of one group beyond `block_m`
      cost one more pass over that group's weight slab.
    block_n: output columns per program.
    block_k: contraction elements per K step (a multiple of the format's block: 32 MXFP4, 16 NVFP4;
      >= 32 so each half-dot has K >= 16).
    num_warps / num_stages: Triton launch parameters (ignored in interpret mode).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"FP4GroupedMatmulTuning.{name} must be a power of two >= 16; got {v}")
        if self.block_k < 32:
            raise ValueError(f"FP4GroupedMatmulTuning.block_k must be >= 32; got {self.block_k}")


def _pow2_at_most(v: int) -> int:
    return 1 << (max(int(v), 1).bit_length() - 1)


def default_tuning(m: int, k: int, n: int) -> FP4GroupedMatmulTuning:
    """Block sizes by width (M = rows = tokens x top-k) for a `[M, K] x [G, N, K]` grouped matmul.

    Verify widths (M <= 1024: <= 128 tokens x top-8) leave a handful of rows per group, so one 16-row
    tile holds a group, and 64 output columns per program keep >= 4 programs per SM busy even at one
    token (top-4 x N/64 programs). Wider calls (prefill) get taller row tiles to amortize the weight
    reads over more rows. K steps of 256 elements (128 bytes per weight row) keep loads coalesced;
    smaller K (tests) shrinks the step so tiles are not mostly padding.
    """
    block_m = 16 if m <= 1024 else 64
    block_n = 64 if m <= 1024 else 128
    block_n = max(16, min(block_n, _pow2_at_most(n)))
    block_k = max(32, min(256, _pow2_at_most(k)))
    return FP4GroupedMatmulTuning(block_m=block_m, block_n=block_n, block_k=block_k)


# ----------------------------------------------------------------------------------------------------
# Work items.
# ----------------------------------------------------------------------------------------------------


def max_work_items(m: int, g: int, block_m: int) -> int:
    """Static bound on `sum_g ceil(size_g / block_m)` over all group sizes with sum <= m.

    `ceil(s / b) <= (s + b - 1) / b` and at most `min(g, m)` groups are non-empty, so the sum is at most
    `(m + min(g, m) * (b - 1)) / b`; each tile also holds >= 1 row, so it is at most `m`.
    """
    if m <= 0:
        return 0
    return max(1, min(m, (m + min(g, m) * (block_m - 1)) // block_m))


def work_items(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(group, row_start, row_end) int32 `[W]` for the `W = max_work_items(...)` tiles of the kernel.

    Item i of the real ones covers rows `[row_start, row_end)` of group `group` (row_end - row_start <=
    block_m); the rest are empty (`row_start == row_end == 0`, group clamped into range). Groups in
    non-empty items are exactly the groups with rows: nothing else is read.
    """
    g = group_sizes.shape[0]
    w = max_work_items(m, g, block_m)
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    item = jnp.arange(w, dtype=jnp.int32)
    # one vectorized comparison (`compare_all`), not the default scan's while loop: on a GPU each of that loop's
    # log2(g) + 1 trips is a few kernel launches, in every MoE layer of every forward (the same indices)
    group = jnp.minimum(jnp.searchsorted(tile_end, item, side="right", method="compare_all").astype(jnp.int32), g - 1)
    valid = item < tile_end[-1]
    row_start = starts[group] + (item - tile_start[group]) * block_m
    row_end = jnp.minimum(row_start + block_m, ends[group])
    row_start = jnp.where(valid, row_start, 0)
    row_end = jnp.where(valid, row_end, 0)
    return group, row_start, row_end


# ----------------------------------------------------------------------------------------------------
# In-kernel dequantization helpers (plain jnp on register tiles).
# ----------------------------------------------------------------------------------------------------


def _e2m1_times_2m14(codes: jax.Array) -> jax.Array:
    """uint8 codes in [0, 16) -> float32 `E2M1(code) * 2^-14`, exactly (see module doc)."""
    c = codes.astype(jnp.uint16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


# The largest scale byte whose multiplier `2^14 * 2^(s - 127)` is a finite float32.
_MX_SPLIT = 254 - _F16_TRICK_EXP


def mx_block_multipliers(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """E8M0 bytes -> float32 `(2^14 * 2^(min(s, 240) - 127), 2^(max(s, 240) - 240))`, NaN first for 255.

    Both are finite powers of two whose product is `2^14 * 2^(s - 127)`; applied one after the other to
    `E2M1 * 2^-14` they give the exact value, inf where it overflows float32 (module doc).
    """
    s = s.astype(jnp.int32)
    lo = (jnp.minimum(s, _MX_SPLIT) + _F16_TRICK_EXP) << 23
    lo = jnp.where(s == 255, jnp.int32(0x7FC00000), lo)
    hi = (jnp.maximum(s, _MX_SPLIT) - _MX_SPLIT + 127) << 23
    return lax.bitcast_convert_type(lo, jnp.float32), lax.bitcast_convert_type(hi, jnp.float32)


def e4m3_to_f32(b: jax.Array) -> jax.Array:
    """float8_e4m3fn bytes -> float32, exactly (normals by bits, subnormals m * 2^-9, 0x7F/0xFF NaN)."""
    b = b.astype(jnp.int32)
    sign = (b >> 7) & 1
    e = (b >> 3) & 15
    m = b & 7
    normal = lax.bitcast_convert_type((sign << 31) | ((e + 120) << 23) | (m << 20), jnp.float32)
    sub = m.astype(jnp.float32) * jnp.float32(2.0**-9)
    sub = jnp.where(sign == 1, -sub, sub)
    val = jnp.where(e == 0, sub, normal)
    return jnp.where((e == 15) & (m == 7), jnp.float32(jnp.nan), val)


def dequantize_codes(codes: jax.Array, block_mult: jax.Array, second: jax.Array | None, dtype) -> jax.Array:
    """Codes -> weights in `dtype`: `((E2M1 * 2^-14) * block_mult) [* second]` in float32, rounded once.

    The first product is exact (E2M1 * block scale). `second` is MXFP4's high power of two (exact unless
    the value overflows) or NVFP4's tensor scale (the reference's one rounding float32 multiply, in the
    reference's order).
    """
    v = _e2m1_times_2m14(codes) * block_mult
    if second is not None:
        v = v * second
    return v.astype(dtype)


# ----------------------------------------------------------------------------------------------------
# The kernel.
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
    fmt: str  # "mxfp4" | "nvfp4"
    n: int
    row_scale: bool  # NVFP4 tensor scale per output row ([G, N]) instead of per group ([G])
    kp: int  # K // 2 (bytes per weight row)
    compute_dtype: Any
    tuning: FP4GroupedMatmulTuning

    @property
    def bytes_per_scale(self) -> int:
        return (MXFP4_BLOCK_SIZE if self.fmt == "mxfp4" else NVFP4_BLOCK_SIZE) // 2


def _load(ref, idx, mask):
    """Masked load of `ref[idx]` (zeros where masked) through the Triton API; plain indexing if no mask."""
    if mask is None:
        return ref[idx]
    return _pl_triton.load(ref.at[idx], mask=mask, other=0)


def _kernel(st: _Static, group_ref, row_start_ref, row_end_ref, ts_ref, xe_ref, xo_ref, q_ref, s_ref,
            _zeros_ref, o_ref):
    t = st.tuning
    bm, bn, bkp = t.block_m, t.block_n, t.block_k // 2
    bps = st.bytes_per_scale
    nsb = bkp // bps  # scale blocks per K step
    item, nt = pl.program_id(0), pl.program_id(1)
    g = group_ref[item]
    r0 = row_start_ref[item]
    r1 = row_end_ref[item]
    n0 = nt * bn
    cols = n0 + lax.broadcasted_iota(jnp.int32, (bn,), 0)
    n_mask = cols < st.n if st.n % bn else None
    k_ragged = st.kp % bkp != 0
    num_k = pl.cdiv(st.kp, bkp)
    if st.fmt == "nvfp4" and st.row_scale:  # [bn] scales of this tile's output rows, one per weight row
        ts = _load(ts_ref, (g, pl.ds(n0, bn)), n_mask)[:, None]
    elif st.fmt == "nvfp4":
        ts = ts_ref[g]
    rows = pl.ds(r0, bm)
    precision = lax.Precision.HIGHEST if st.compute_dtype == jnp.float32 else None

    def tile_mask(col0, width, limit):  # in-bounds part of a [bn, width] weight tile at column col0
        masks = []
        if n_mask is not None:
            masks.append(jnp.broadcast_to(n_mask[:, None], (bn, width)))
        if k_ragged:
            masks.append(col0 + lax.broadcasted_iota(jnp.int32, (bn, width), 1) < limit)
        if not masks:
            return None
        return functools.reduce(jnp.logical_and, masks)

    def dot_nt(a, b):  # [bm, k] x [bn, k] -> [bm, bn], float32 accumulation
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)

    def body(kt, acc):
        kb0 = kt * bkp
        packed = _load(q_ref, (g, pl.ds(n0, bn), pl.ds(kb0, bkp)), tile_mask(kb0, bkp, st.kp))
        sb0 = kt * nsb
        scales = _load(s_ref, (g, pl.ds(n0, bn), pl.ds(sb0, nsb)), tile_mask(sb0, nsb, st.kp // bps))
        def per_element(v):  # [bn, nsb] per-block values -> [bn, bkp]
            return jnp.broadcast_to(v[:, :, None], (bn, nsb, bps)).reshape(bn, bkp)

        if st.fmt == "mxfp4":
            mult, big = map(per_element, mx_block_multipliers(scales))
            second = big
        else:
            mult = per_element(e4m3_to_f32(scales) * jnp.float32(_F16_TRICK_SCALE))
            second = ts
        lo = dequantize_codes(packed & 0xF, mult, second, st.compute_dtype)
        hi = dequantize_codes(packed >> 4, mult, second, st.compute_dtype)
        xe = xe_ref[rows, pl.ds(kb0, bkp)]
        xo = xo_ref[rows, pl.ds(kb0, bkp)]
        return acc + dot_nt(xe, lo) + dot_nt(xo, hi)

    # Empty work items run no K step: their group's weight is never read.
    trips = jnp.where(r1 > r0, jnp.int32(num_k), jnp.int32(0))
    acc = lax.fori_loop(jnp.int32(0), trips, body, jnp.zeros((bm, bn), jnp.float32))
    row_ids = r0 + lax.broadcasted_iota(jnp.int32, (bm,), 0)
    mask = jnp.broadcast_to((row_ids < r1)[:, None], (bm, bn))
    if n_mask is not None:
        mask = mask & n_mask[None, :]
    _pl_triton.store(o_ref.at[rows, pl.ds(n0, bn)], acc.astype(o_ref.dtype), mask=mask)


def _tensor_scale_kind(w: NVFP4Tensor) -> str | None:
    """"group" for a scalar / [G] NVFP4 tensor scale, "row" for [G, N], None for anything else."""
    g, n = w.packed.shape[0], w.packed.shape[1]
    shape = tuple(jnp.shape(w.tensor_scale))
    if shape in ((), (g,)):
        return "group"
    if shape == (g, n):
        return "row"
    return None


def supports(w: Any, x_dtype: Any = None) -> bool:
    """Whether the kernel takes weight `w` (and activations of `x_dtype`, when given)."""
    if x_dtype is not None and jnp.dtype(x_dtype) not in SUPPORTED_ACTIVATION_DTYPES:
        return False
    if isinstance(w, MXFP4Tensor):
        return len(w.shape) == 3
    if isinstance(w, NVFP4Tensor):
        return len(w.shape) == 3 and _tensor_scale_kind(w) is not None
    return False


def _weight_operands(w: Any) -> tuple[str, jax.Array, jax.Array, jax.Array]:
    """(format, packed bytes [G, N, K//2] u8, scale bytes [G, N, K//blk] u8, tensor scale f32 [G] or
    [G, N])."""
    if isinstance(w, MXFP4Tensor):
        g, n, nb, half = w.blocks.shape
        packed = w.blocks.reshape(g, n, nb * half)
        return "mxfp4", packed, w.scales, jnp.ones((g,), jnp.float32)
    if isinstance(w, NVFP4Tensor):
        g = w.packed.shape[0]
        bs = w.block_scales
        if bs.dtype != jnp.uint8:
            bs = lax.bitcast_convert_type(bs, jnp.uint8)
        ts = jnp.asarray(w.tensor_scale, jnp.float32)
        kind = _tensor_scale_kind(w)
        if kind is None:
            raise NotImplementedError(
                f"fp4_grouped_matmul: NVFP4 tensor_scale must be a scalar, per group [{g}] or per output row "
                f"[{g}, {w.packed.shape[1]}]; got {ts.shape}. Use implementation='xla'."
            )
        if ts.ndim == 0:
            ts = jnp.broadcast_to(ts, (g,))
        return "nvfp4", w.packed, bs, ts
    raise TypeError(f"fp4_grouped_matmul: expected an MXFP4Tensor or NVFP4Tensor weight; got {type(w).__name__}")


def _check(x: jax.Array, w: Any, group_sizes: jax.Array, out_dtype) -> tuple[int, int, int]:
    if x.ndim != 2:
        raise ValueError(f"fp4_grouped_matmul: x must be [M, K]; got {x.shape}")
    if len(w.shape) != 3:
        raise ValueError(f"fp4_grouped_matmul: the weight must have logical shape [G, N, K]; got {w.shape}")
    g, n, k = w.shape
    if x.shape[1] != k or group_sizes.shape != (g,):
        raise ValueError(
            f"fp4_grouped_matmul shapes: x {x.shape} must be [M, {k}] and group_sizes {group_sizes.shape} "
            f"[{g}] for a weight of logical shape {w.shape}"
        )
    if jnp.dtype(x.dtype) not in SUPPORTED_ACTIVATION_DTYPES:
        raise NotImplementedError(
            f"fp4_grouped_matmul: activations must be bfloat16 or float32 (tested); got {x.dtype}. "
            "Use implementation='xla' for other dtypes."
        )
    if jnp.dtype(out_dtype) not in SUPPORTED_OUTPUT_DTYPES:
        raise NotImplementedError(
            f"fp4_grouped_matmul: preferred_element_type must be bfloat16 or float32; got {out_dtype}"
        )
    return g, n, k


def fp4_grouped_matmul(
    x: jax.Array,
    w: MXFP4Tensor | NVFP4Tensor,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    tuning: FP4GroupedMatmulTuning | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """`y[rows of g] = x[rows of g] @ dequant(W[g])^T` (see module doc). Returns `[M, N]`.

    x: `[M, K]` bfloat16/float32, rows sorted by group; w: MXFP4Tensor / NVFP4Tensor of logical shape
    `[G, N, K]`; group_sizes: `[G]` integer, sum <= M (zero sizes allowed). `interpret` defaults to
    True off-GPU. `tuning` defaults to `default_tuning(M, K, N)`.
    """
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    g, n, k = _check(x, w, group_sizes, out_dtype)
    m = x.shape[0]
    if interpret is None:
        interpret = target.platform() != "gpu"
    tuning = tuning or default_tuning(m, k, n)
    fmt = "mxfp4" if isinstance(w, MXFP4Tensor) else "nvfp4"
    blk = MXFP4_BLOCK_SIZE if fmt == "mxfp4" else NVFP4_BLOCK_SIZE
    if tuning.block_k % blk:
        raise ValueError(f"fp4_grouped_matmul: block_k {tuning.block_k} must be a multiple of {blk} for {fmt}")
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    return _fp4_grouped_matmul_jit(x, w, group_sizes, out_dtype=out_dtype, tuning=tuning, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("out_dtype", "tuning", "interpret"))
def _fp4_grouped_matmul_jit(x, w, group_sizes, *, out_dtype, tuning: FP4GroupedMatmulTuning, interpret: bool):
    fmt, packed, scales, ts = _weight_operands(w)
    g, n, kp = packed.shape
    m = x.shape[0]
    bm, bn, bkp = tuning.block_m, tuning.block_n, tuning.block_k // 2
    st = _Static(fmt=fmt, n=n, row_scale=ts.ndim == 2, kp=kp, compute_dtype=jnp.dtype(x.dtype), tuning=tuning)

    # Even / odd activation columns (module doc), padded by one row tile and to whole K tiles so the
    # kernel's activation loads need no masks.
    kp_pad = pl.cdiv(kp, bkp) * bkp
    pad = ((0, bm), (0, kp_pad - kp))
    x_even = jnp.pad(x[:, 0::2], pad)
    x_odd = jnp.pad(x[:, 1::2], pad)
    group, row_start, row_end = work_items(group_sizes, m, bm)
    w_items = group.shape[0]
    zeros = jnp.zeros((m + bm, n), out_dtype)

    compiler_params = None
    if not interpret:
        compiler_params = _triton_compiler_params(tuning)
    out = pl.pallas_call(
        functools.partial(_kernel, st),
        out_shape=jax.ShapeDtypeStruct((m + bm, n), out_dtype),
        grid=(w_items, pl.cdiv(n, bn)),
        input_output_aliases={8: 0},
        interpret=interpret,
        compiler_params=compiler_params,
        name=f"{fmt}_grouped_matmul",
    )(group, row_start, row_end, ts, x_even, x_odd, packed, scales, zeros)
    return out[:m]


def _triton_compiler_params(tuning: FP4GroupedMatmulTuning):
    if _pl_triton is None:  # pragma: no cover
        raise NotImplementedError("this jax build has no Pallas Triton backend; use implementation='xla'")
    cls = getattr(_pl_triton, "CompilerParams", None) or getattr(_pl_triton, "TritonCompilerParams")
    return cls(num_warps=tuning.num_warps, num_stages=tuning.num_stages)


# ----------------------------------------------------------------------------------------------------
# Reference.
# ----------------------------------------------------------------------------------------------------


def fp4_grouped_matmul_reference(x: jax.Array, w: MXFP4Tensor | NVFP4Tensor, group_sizes: jax.Array, *,
                                 preferred_element_type=None) -> jax.Array:
    """Pure-jnp reference: dequantize the whole table to `x.dtype`, then per-row matmul with its group.

    Reads every expert (it is a reference, not a kernel); float32 accumulation at highest precision.
    """
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    g, n, k = _check(x, w, group_sizes, out_dtype)
    m = x.shape[0]
    wq = w.dequantize(x.dtype)  # [G, N, K]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    row_group = jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")
    live = row_group < g
    per_row = wq[jnp.minimum(row_group, g - 1)]  # [M, N, K]
    y = jnp.einsum("mk,mnk->mn", x, per_row, precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
    return jnp.where(live[:, None], y, 0).astype(out_dtype)


def routed_weight_bytes(w: MXFP4Tensor | NVFP4Tensor, group_sizes: np.ndarray) -> int:
    """FP4 bytes (codes + block scales) of the groups with rows: what the kernel must read."""
    g, n, k = w.shape
    blk = MXFP4_BLOCK_SIZE if isinstance(w, MXFP4Tensor) else NVFP4_BLOCK_SIZE
    per_group = n * (k // 2 + k // blk)
    return int(np.count_nonzero(np.asarray(group_sizes) > 0)) * per_group
