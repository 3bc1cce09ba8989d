"""Mixture-of-experts: router and expert dispatch through `pallas_kernels.ops.grouped_matmul`.

Dispatch: T tokens x top-k gives T*k (token, expert, weight) rows; rows are sorted by expert, the expert
FFN runs as grouped matmuls over the sorted rows (group g = rows routed to expert g), results are unsorted
and summed per token with the routing weights.

The weight operand is a *slot pool* `[S, ...]`: `slot_of[e]` says which pool slot holds expert e. With all
experts resident the pool is the expert table and `slot_of` is the identity (pass None); an offloaded
layer runs the same code on a smaller pool. Expert biases (gpt-oss) belong to the pool too: `[S, 2I]` and
`[S, H]`, indexed by slot, added after each grouped matmul.

Routers: `softmax_topk_router` (Qwen: softmax over all experts, top-k, optional renormalization) and
`topk_softmax_router` (gpt-oss: top-k of the biased logits, softmax over those k). Activations over the
gate/up halves: `silu_glu` (SwiGLU) and `clamped_swiglu` (gpt-oss).
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import cpu_kernels, ops, target
from pallas_kernels.formats import MXFP4Tensor


def softmax_topk_router(
    x: jax.Array, router_w: jax.Array, top_k: int, *, normalize: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Qwen router: `p = softmax(x @ W_r)` in fp32 over all experts, top-k of p, optionally renormalized.

    x: [T, H]; router_w: [H, E]. Returns (weights [T, k] fp32, experts [T, k] int32, logits [T, E] fp32).
    """
    logits = jnp.dot(x, router_w, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), logits


def topk_softmax_router(
    x: jax.Array, router_w: jax.Array, router_b: jax.Array | None, top_k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """gpt-oss router: `l = x @ W_r + b_r` in fp32, the top-k of the raw logits, `softmax` over those k.

    x: [T, H]; router_w: [H, E]; router_b: [E] or None. Returns (weights [T, k] fp32, experts [T, k] int32,
    logits [T, E] fp32).
    """
    logits = jnp.dot(x, router_w, preferred_element_type=jnp.float32)
    if router_b is not None:
        logits = logits + router_b.astype(jnp.float32)
    top, experts = jax.lax.top_k(logits, top_k)
    return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32), logits


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU: `silu(gate) * up`."""
    return jax.nn.silu(gate) * up


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """gpt-oss: `g = min(gate, limit)`, `u = clip(up, -limit, limit)`, `(u + 1) * g * sigmoid(alpha * g)`.

    The clamp is one-sided on the gate (large negative gates already give ~0) and two-sided on up.
    """
    g = jnp.minimum(gate, limit)
    u = jnp.clip(up, -limit, limit)
    return (u + 1) * (g * jax.nn.sigmoid(alpha * g))


def read_after(token: jax.Array, *tables):
    """`tables` unchanged, made to depend on `token` (this layer's routing) so that XLA cannot dequantize
    FP4 tables before the layer runs. Without it XLA hoists every layer's dequantization (it depends on
    the weights only) to the start of the program and holds all layers' dense tables at once (measured on
    CPU: temp memory = all layers' dense experts). The dependency adds `min(token) < 0` (never true for
    group sizes, but not provable by the compiler) to the packed uint8 parts (codes, E8M0 scales): exact,
    and fused into the dequantization."""
    if not any(ops.is_fp4(t) for t in tables):
        return tables
    never = (jnp.min(token) < 0).astype(jnp.uint8)

    def tie(leaf):
        return leaf + never if leaf.dtype == jnp.uint8 else leaf

    return tuple(jax.tree.map(tie, t) if ops.is_fp4(t) else t for t in tables)


def _expert(w, e):
    """Expert `e` (a traced int32 scalar) of a weight operand, as a one-group operand: a dynamic slice of each
    expert-leading part (an NVFP4 tensor scale shared by all experts kept as is), read in place by the product."""
    groups = ops.weight_dims(w)[0]
    return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, e, 1, axis=0) if a.ndim and a.shape[0] == groups
                        else a, w)


def _one_token_experts(x, slots, weights, gate_up, down, gate_up_bias, down_bias, activation):
    """`_dense_experts` for one token: only its k routed experts, each read by a dynamic slice and multiplied as a
    matrix-vector product (a plain decode step: about 1.5x faster than all experts, which read E / k times the
    bytes). Unrouted experts are never read."""
    gate_up, down = read_after(slots, gate_up, down)
    wide = jnp.promote_types(x.dtype, jnp.float32)
    v = x[0].astype(wide)
    out = jnp.zeros(x.shape[1:], jnp.float32)
    for j in range(slots.shape[1]):
        e = slots[0, j]
        gu = v @ ops.dense_weight(_expert(gate_up, e), wide)[0]
        if gate_up_bias is not None:
            gu = gu + lax.dynamic_index_in_dim(gate_up_bias, e, keepdims=False).astype(jnp.float32)
        inter = gu.shape[-1] // 2
        act = activation(gu[:inter], gu[inter:]).astype(x.dtype)
        y = act.astype(wide) @ ops.dense_weight(_expert(down, e), wide)[0]
        if down_bias is not None:
            y = y + lax.dynamic_index_in_dim(down_bias, e, keepdims=False).astype(jnp.float32)
        out = out + weights[0, j].astype(jnp.float32) * y
    return out[None].astype(x.dtype)


def _dense_experts(x, slots, weights, gate_up, down, num_slots, gate_up_bias, down_bias, activation):
    """Every token through every slot's expert, combined by the routing weights. A slot's outputs for tokens not
    routed to it are selected away (not multiplied by a zero weight): a NaN / inf slot without rows (a poisoned or
    never-written pool slot) reaches no output. FP4 tables are dequantized after this layer's routing
    (`read_after`)."""
    if x.shape[0] == 1:
        return _one_token_experts(x, slots, weights, gate_up, down, gate_up_bias, down_bias, activation)
    onehot = jax.nn.one_hot(slots, num_slots, dtype=jnp.float32)  # [T, k, S]
    combine = jnp.einsum("tk,tks->ts", weights.astype(jnp.float32), onehot)  # [T, S] routing weights
    routed = jnp.any(onehot > 0, axis=1)  # [T, S]
    gate_up, down = read_after(slots, gate_up, down)
    wide = jnp.promote_types(x.dtype, jnp.float32)  # float32 products (XLA's CPU lacks bf16 x bf16 -> f32 dots)
    # both products batched over the slots, [S, T, .] x [S, K, N] (the tokens broadcast to every slot): the
    # token-major form (`th,shn->tsn`) made XLA's CPU relayout the whole table into [H, S * N] on every call (never
    # hoisted out of the decode loop) and run the second product transposed, outside its fast GEMM: a plain step
    # of the shipped pair cost 1.6x more (docs/benchmarks/tiny_pair_dense.md)
    xs = jnp.broadcast_to(x.astype(wide)[None], (num_slots,) + x.shape)
    gu = jnp.einsum("sth,shn->stn", xs, ops.dense_weight(gate_up, wide))
    if gate_up_bias is not None:
        gu = gu + gate_up_bias.astype(jnp.float32)[:, None, :]
    inter = gu.shape[-1] // 2
    act = activation(gu[..., :inter], gu[..., inter:]).astype(x.dtype)
    y = jnp.einsum("sti,sih->sth", act.astype(wide), ops.dense_weight(down, wide))
    if down_bias is not None:
        y = y + down_bias.astype(jnp.float32)[:, None, :]
    y = jnp.where(routed.T[..., None], y, jnp.zeros((), y.dtype))
    return jnp.einsum("sth,ts->th", y, combine).astype(x.dtype)


def swiglu_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    slot_of: jax.Array | None = None,
    implementation: ops.Implementation = "auto",
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    activation: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    dispatch: str = "auto",
) -> jax.Array:
    """`sum_j weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t)))` with e = experts[t, j].

    x: [T, H]; experts, weights: [T, k]; gate_up: [S, H, 2I] (gate columns first); down: [S, I, H]
    (or FP4 tensors of logical shape [S, 2I, H] / [S, H, I]; see `pallas_kernels.ops`).
    gate_up_bias [S, 2I] / down_bias [S, H] (optional, gate half first like the columns): added to each
    row's grouped-matmul output, by the row's slot. activation(gate, up): `silu_glu` when None.
    implementation "dense": every token through every slot's expert, combined by the routing weights (the
    same sum; k-sparse FLOPs traded for dense einsums: for training small many-expert models on CPU, where
    `ragged_dot`'s cost grows with the number of groups). "tiles": only the routed rows' work, each expert's
    rows in whole tiles multiplied by that expert's gathered weights (`_tiled_experts`). "stream": only the
    routed experts' tables, read in place (`_streamed_experts`; MXFP4 through the compiled CPU kernel). "auto" off
    a mesh takes one of those three on a CPU (`routed_path`: "stream" for float32 / bf16 tables and FP4 tables of
    real expert shapes at small widths where the compiled CPU kernels are available, "dense" for other small tables
    and few tokens). Otherwise
    sorted dispatch + `ops.grouped_matmul`,
    and under a context mesh with an `expert` axis (`jax.set_mesh`, see `expert_parallel_mesh`) the same
    dispatch per expert shard under `shard_map` (a slot pool is split along its slots the same way: each
    shard computes the rows whose expert sits in one of its slots; `offload.sharded.ShardedExpertCache`).
    dispatch (on a mesh only): "psum" (every shard runs its experts' rows of all tokens, one psum),
    "all_to_all" (rows sent to their experts' owners and back, see `_expert_parallel`) or "auto"
    (`choose_dispatch` by the width; the environment variable DFLASH_MOE_DISPATCH overrides "auto").
    """
    num_slots = ops.weight_dims(gate_up)[0]
    slots = experts if slot_of is None else slot_of[experts]
    mesh = None if implementation in ("tiles", "dense", "stream") else expert_parallel_mesh()
    if mesh is not None and expert_axes(num_slots, mesh):
        return _expert_parallel(x, slots, weights, gate_up, down, mesh, implementation=implementation,
                                gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation,
                                dispatch=dispatch)
    path = implementation if implementation in ("tiles", "dense", "stream") else routed_path(
        implementation, gate_up, x.dtype, x.shape[0], slots.shape[1])
    if path in ("tiles", "dense", "stream"):
        run = {"tiles": _tiled_experts, "dense": _dense_experts, "stream": _streamed_experts}[path]
        return run(x, slots, weights, gate_up, down, num_slots, gate_up_bias, down_bias, activation or silu_glu)
    y = _routed_rows(x, slots, gate_up, down, num_slots, implementation, gate_up_bias, down_bias, activation)
    out = jnp.einsum("tkh,tk->th", y.astype(jnp.float32), weights.astype(jnp.float32))
    return out.astype(x.dtype)


# The CPU's choice between every token through every expert ("dense") and the routed rows only ("tiles"), in
# multiply-adds: the tiles' bookkeeping (a count, a scatter, gathers of rows and of each tile's weights) costs
# about TILE_OVERHEAD_MACS, measured on a 2-core x86 CPU in the decode loop (the shipped pair's plain greedy
# steps, process CPU ms per step, all experts batched over the experts: at 8 tokens dense 3.4 vs tiles 4.1, at 16
# tokens dense 4.8 - 5.3 vs tiles 4.5 - 4.6); the dense path wins only where all experts' work for every token is
# below the tiles' work plus that, i.e. for small tables and few tokens.
TILE_OVERHEAD_MACS = 5_000_000
# The CPU path "auto" takes, overridden for every layer traced afterwards (benchmarks compare the paths in separate
# processes: a compiled program keeps the path it was traced with): auto | tiles | dense | xla (`ragged_dot`).
CPU_PATH_ENV = "DFLASH_MOE_CPU_PATH"
CPU_PATHS = ("auto", "tiles", "dense", "xla", "stream")
# "stream" (`_streamed_experts`: one (token, choice) row at a time, its expert's table read in place) is taken for
# FP4 tables from STREAM_MIN_EXPERT_BYTES per expert (real expert shapes) up to STREAM_MAX_ROWS rows: there a
# routed expert's work is a matrix-vector product per row, bound by reading the table, and decoding the codes as
# the row reads them beats gathering whole tables first (docs/benchmarks/moe_cpu.md: about 20x at 1 - 16 tokens
# of Qwen3-30B-A3B and gpt-oss-20b shapes). Small tables stay on the cheaper of "dense" / "tiles".
STREAM_MAX_ROWS = 128
STREAM_MIN_EXPERT_BYTES = 1 << 20
# float32 / bf16 tables go through the compiled kernel (`cpu_kernels.dense_rows`: only the routed experts, read in
# place) up to this many rows. On the shipped pairs' tables (2-core x86, process CPU, paired runs) plain greedy decoding
# ran 1.7-2x faster at batch 1 - 4 than on the dense / tiles paths, and level with the tiles at batch 16 - 32; one
# layer cost 1.7x less than the tiles at 512 rows and the same at 2048 (docs/benchmarks/moe_cpu.md), and a serving
# round of 32 rows x 16 (1024 rows) 1.6x less (docs/benchmarks/round_cost.md). Wider blocks stay on the tiles,
# whose GEMMs reuse each expert's weights over many rows.
DENSE_STREAM_MAX_ROWS = 1024


def routed_path(implementation: str, gate_up, x_dtype, tokens: int | None = None, top_k: int | None = None) -> str:
    """How `swiglu_experts` runs its rows off a mesh, for `tokens` x `top_k` rows (static). Where "auto" resolves
    to XLA on a CPU: "stream" (`_streamed_experts`) for FP4 tables of real expert shapes at up to `STREAM_MAX_ROWS`
    rows and, with the compiled kernels, for float32 / bf16 tables at up to `DENSE_STREAM_MAX_ROWS` rows (only the
    routed experts read, in place: a plain decode step of the shipped pairs 1.7-2x faster than every expert
    batched); else "tiles" (`_tiled_experts`: only the routed rows' work) or, where every token through every
    expert costs less than the tiles' work plus their bookkeeping (`TILE_OVERHEAD_MACS`), "dense". Otherwise the
    grouped matmuls of `implementation` ("xla": `ragged_dot`, "pallas": the FP4 kernel). XLA's CPU `ragged_dot`
    runs every row through every group (a 0/1 mask per group), so its cost grows with the number of experts; on a
    GPU it does not, and the FP4 kernel reads only the routed experts."""
    impl = ops.resolve_implementation(implementation, gate_up, x_dtype)
    if implementation != "auto" or impl != "xla" or target.platform() != "cpu":
        return impl
    forced = os.environ.get(CPU_PATH_ENV, "auto") or "auto"
    if forced not in CPU_PATHS:
        raise ValueError(f"{CPU_PATH_ENV}={forced!r} is not one of {CPU_PATHS}")
    if forced != "auto":
        return forced
    if tokens is None or top_k is None:
        return "tiles"
    slots, hidden, two_inter = ops.weight_dims(gate_up)
    if (ops.is_fp4(gate_up) and tokens * top_k <= STREAM_MAX_ROWS
            and expert_bytes(gate_up) * 3 // 2 >= STREAM_MIN_EXPERT_BYTES):
        return "stream"
    if tokens * top_k <= DENSE_STREAM_MAX_ROWS and cpu_kernels.supports_dense(gate_up) and cpu_kernels.available():
        return "stream"
    per_row = hidden * two_inter * 3 // 2  # gate/up and down multiply-adds of one row
    rows = tokens * top_k
    tile = tile_rows(rows, slots)
    tiles = -(-(rows + min(rows, slots) * (tile - 1)) // tile)
    if tokens * slots * per_row <= tiles * tile * per_row + TILE_OVERHEAD_MACS:
        return "dense"
    return "tiles"


def expert_bytes(w) -> int:
    """Bytes of one expert of a grouped weight operand as stored (FP4: codes and scales)."""
    groups = ops.weight_dims(w)[0]
    leaves = jax.tree.leaves(w)
    return sum(int(a.size) * jnp.dtype(a.dtype).itemsize // groups for a in leaves if a.ndim and a.shape[0] == groups)


def tile_rows(rows: int, num_slots: int) -> int:
    """Rows per tile of `_tiled_experts` for `rows` (token, choice) rows over `num_slots` experts (static): about
    the rows an expert gets on average, a power of two in [1, 64]. Padding costs at most (tile - 1) rows for each
    routed expert, so the tiles hold at most `rows + min(rows, num_slots) * (tile - 1)` rows."""
    share = max(1, rows // max(1, min(rows, num_slots)))
    tile = 1
    while tile * 2 <= min(share, 64):
        tile *= 2
    return tile


def _tiled_experts(x, slots, weights, gate_up, down, num_slots, gate_up_bias, down_bias, activation):
    """`swiglu_experts` with only the routed rows' work: each expert's rows are laid out in whole tiles of
    `tile_rows` rows (its last tile padded with a zero row), each tile multiplies its rows by its own expert's
    weights (gathered per tile: an FP4 table is read and dequantized only for the routed experts), and every
    (token, choice) row reads its result back from its place in the tiles. Rows are independent in both
    matmuls, so padding rows (and tiles past the last routed expert) never reach a real row, and an expert
    without rows is never read. No sort: a row's place is its expert's first tile plus its rank among that
    expert's rows (a cumulative count)."""
    t, k = slots.shape
    rows = t * k
    tile = tile_rows(rows, num_slots)
    tiles = -(-(rows + min(rows, num_slots) * (tile - 1)) // tile)  # static bound on the tiles routing can fill
    flat = slots.reshape(-1)
    onehot = jax.nn.one_hot(flat, num_slots, dtype=jnp.int32)  # [R, S]
    sizes = jnp.sum(onehot, axis=0)
    padded = (sizes + tile - 1) // tile * tile
    ends = jnp.cumsum(padded)
    rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), flat[:, None], axis=1)[:, 0] - 1
    place = ends[flat] - padded[flat] + rank  # [R]: each row's position in the tiles
    row_at = jnp.full((tiles * tile,), rows, jnp.int32).at[place].set(jnp.arange(rows, dtype=jnp.int32))
    x_tiles = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[row_at // k].reshape(tiles, tile, -1)
    tile_slot = jnp.minimum(jnp.searchsorted(ends, jnp.arange(tiles, dtype=jnp.int32) * tile, side="right"),
                            num_slots - 1).astype(jnp.int32)
    # the products in float32 (XLA's CPU has no batched bf16 x bf16 -> f32 dot; bf16 products are exact in f32)
    wide = jnp.promote_types(x.dtype, jnp.float32)
    gu = jnp.einsum("tmh,thn->tmn", x_tiles.astype(wide), ops.dense_weight(ops.take_groups(gate_up, tile_slot), wide))
    if gate_up_bias is not None:
        gu = gu + jnp.take(gate_up_bias, tile_slot, axis=0)[:, None, :].astype(jnp.float32)
    inter = gu.shape[-1] // 2
    act = activation(gu[..., :inter], gu[..., inter:]).astype(x.dtype)
    y = jnp.einsum("tmi,tih->tmh", act.astype(wide), ops.dense_weight(ops.take_groups(down, tile_slot), wide))
    if down_bias is not None:
        y = y + jnp.take(down_bias, tile_slot, axis=0)[:, None, :].astype(jnp.float32)
    y = y.reshape(tiles * tile, -1)[place].reshape(t, k, -1)
    return jnp.einsum("tkh,tk->th", y, weights.astype(jnp.float32)).astype(x.dtype)


def _mxfp4_scale(s):
    """E8M0 bytes -> float32 2^(s - 127) exactly (s = 0: the subnormal 2^-127; s = 255: NaN)."""
    s = s.astype(jnp.uint32)
    bits = jnp.where(s == 0, jnp.uint32(0x00400000), jnp.where(s == 255, jnp.uint32(0x7FC00000), s << 23))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _e2m1(c):
    """E2M1 codes (uint8, 0 - 15) -> float32, by building the float's bits (no table lookup)."""
    c = c.astype(jnp.uint32)
    mag = c & 7
    exponent = jnp.where(mag >= 2, (mag >> 1) + 126, 126)
    mantissa = jnp.where(mag >= 2, (mag & 1) << 22, 0)
    bits = jnp.where(mag == 0, 0, (exponent << 23) | mantissa) | ((c & 8) << 28)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _row_product(v, w):
    """One row `v` [K] (float32) times one expert's weight `w`: a dense [K, N] array, or an FP4 tensor of logical
    shape [N, K]. MXFP4 is decoded as the product reads it: each code times its block's scale times the row's
    element, summed per output (one elementwise product and a reduction that XLA fuses with the decode; the same
    values as `dequantize` then a dot, summed in another order). NVFP4 is dequantized, then multiplied."""
    if isinstance(w, MXFP4Tensor):
        n, groups = w.scales.shape
        vr = v.reshape(groups, 16, 2)
        scale = _mxfp4_scale(w.scales)[..., None]
        low = _e2m1(w.blocks & 15) * scale
        high = _e2m1(w.blocks >> 4) * scale
        return jnp.sum(vr[None, :, :, 0] * low + vr[None, :, :, 1] * high, axis=(1, 2))
    return jnp.dot(v, ops.dense_weight(w, jnp.float32), preferred_element_type=jnp.float32)


def _stream_kernel(gate_up, down):
    """The compiled CPU kernel that multiplies rows by both tables as they are stored (`cpu_kernels.mxfp4_rows` for
    MXFP4, `cpu_kernels.dense_rows` for float32), or None (not on a CPU, other formats, kernels unavailable)."""
    if target.platform() != "cpu":
        return None
    if cpu_kernels.supports(gate_up) and cpu_kernels.supports(down) and cpu_kernels.available():
        return cpu_kernels.mxfp4_rows
    if cpu_kernels.supports_dense(gate_up) and cpu_kernels.supports_dense(down) and cpu_kernels.available():
        return cpu_kernels.dense_rows
    return None


def _streamed_experts(x, slots, weights, gate_up, down, num_slots, gate_up_bias, down_bias, activation):
    """`swiglu_experts` with only the routed experts' tables read, each once per run of rows, in place. MXFP4
    tables on a CPU with the compiled kernel (`pallas_kernels.cpu_kernels.mxfp4_rows`): the rows sorted by slot,
    each projection one kernel call that streams each routed expert's codes once, decoding them in registers for
    all of the expert's rows; float32 / bf16 tables the same way through `cpu_kernels.dense_rows`. Otherwise (no
    kernel, NVFP4, other dtypes) one (token, choice) row at a time in a loop over the sorted rows: the row's
    expert read by a dynamic slice (no gathered copy), FP4 codes decoded
    inside the product (`_row_product`), every product a matrix-vector product (XLA's CPU GEMM packs its weights
    for more than one row). Rows are independent: an expert without rows is never read."""
    t, k = slots.shape
    rows = t * k
    flat = slots.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    hidden = x.shape[1]
    inter = ops.weight_dims(gate_up)[2] // 2
    kernel = _stream_kernel(gate_up, down)
    if kernel is not None:
        # the compiled kernel: each projection one call over all rows, sorted so that an expert's rows are adjacent
        sorted_slots = flat[order]
        gu = kernel(jnp.take(x, order // k, axis=0), gate_up, sorted_slots)
        if gate_up_bias is not None:
            gu = gu + jnp.take(gate_up_bias, sorted_slots, axis=0).astype(jnp.float32)
        act = activation(gu[:, :inter], gu[:, inter:]).astype(x.dtype)
        y = kernel(act, down, sorted_slots)
        if down_bias is not None:
            y = y + jnp.take(down_bias, sorted_slots, axis=0).astype(jnp.float32)
        ys = jnp.zeros_like(y).at[order].set(y)
        return jnp.einsum("tkh,tk->th", ys.reshape(t, k, hidden), weights.astype(jnp.float32)).astype(x.dtype)

    def expert(w, s):
        groups = ops.weight_dims(w)[0]
        return jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, s, keepdims=False) if a.ndim and a.shape[0] == groups else a, w)

    def body(i, ys):
        r = order[i]
        s = flat[r]
        v = jax.lax.dynamic_index_in_dim(x, r // k, keepdims=False).astype(jnp.float32)
        gu = _row_product(v, expert(gate_up, s))
        if gate_up_bias is not None:
            gu = gu + jax.lax.dynamic_index_in_dim(gate_up_bias, s, keepdims=False).astype(jnp.float32)
        act = activation(gu[:inter], gu[inter:]).astype(x.dtype).astype(jnp.float32)
        y = _row_product(act, expert(down, s))
        if down_bias is not None:
            y = y + jax.lax.dynamic_index_in_dim(down_bias, s, keepdims=False).astype(jnp.float32)
        return jax.lax.dynamic_update_index_in_dim(ys, y, r, 0)

    ys = jax.lax.fori_loop(0, rows, body, jnp.zeros((rows, hidden), jnp.float32))
    return jnp.einsum("tkh,tk->th", ys.reshape(t, k, hidden), weights.astype(jnp.float32)).astype(x.dtype)


def _routed_rows(x, slots, gate_up, down, num_slots, implementation, gate_up_bias, down_bias, activation):
    """[T, k, H] expert outputs of every (token, choice) row: rows sorted by slot, grouped matmuls, unsorted."""
    t, k = slots.shape
    two_inter = ops.weight_dims(gate_up)[2]
    flat = slots.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of_row = order // k
    slot_of_row = flat[order]
    x_sorted = jnp.take(x, token_of_row, axis=0)
    group_sizes = jnp.bincount(flat, length=num_slots).astype(jnp.int32)
    if ops.resolve_implementation(implementation, gate_up, x.dtype) == "xla":  # dequantizes whole tables
        gate_up, down = read_after(group_sizes, gate_up, down)
    gu = ops.grouped_matmul(x_sorted, gate_up, group_sizes, implementation=implementation)
    if gate_up_bias is not None:
        gu = gu + jnp.take(gate_up_bias, slot_of_row, axis=0).astype(gu.dtype)
    inter = two_inter // 2
    act = (activation or silu_glu)(gu[:, :inter], gu[:, inter:])
    y_sorted = ops.grouped_matmul(act, down, group_sizes, implementation=implementation)
    if down_bias is not None:
        y_sorted = y_sorted + jnp.take(down_bias, slot_of_row, axis=0).astype(y_sorted.dtype)
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, -1)


# ----------------------------------------------------------------------------------------------------------
# expert parallelism: the same sum with the expert tables sharded along E over a device mesh
# ----------------------------------------------------------------------------------------------------------

EXPERT_AXIS, TENSOR_AXIS, DATA_AXIS = "expert", "tensor", "data"


def expert_parallel_mesh():
    """The mesh expert dispatch shards over: the context mesh (`jax.set_mesh`) when it has an `expert`
    axis and none of its axes is already manual (inside someone's `shard_map`); None otherwise. The
    context mesh is part of jit's cache key, so a program traced without a mesh is never reused with one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names or mesh.manual_axes:
        return None
    return mesh


def expert_axes(num_experts: int, mesh) -> tuple[str, ...]:
    """The mesh axes a table of `num_experts` experts shards its E dimension over: `expert` and `tensor`
    together when E divides by their product, else `expert` alone when it divides, else none (replicated).
    Axes of size 1 are left out. `dflash_jax.sharding` places the tables by the same rule."""
    sizes = dict(mesh.shape)
    for axes in ((EXPERT_AXIS, TENSOR_AXIS), (EXPERT_AXIS,)):
        if not all(a in sizes for a in axes):
            continue
        n = 1
        for a in axes:
            n *= sizes[a]
        if n > 1 and num_experts % n == 0:
            return tuple(a for a in axes if sizes[a] > 1)
    return ()


# The all-to-all dispatch's capacity: each shard sends at most `CAPACITY_FACTOR` x its even share of rows to
# one owner (rounded up to 8 rows); a layer where some shard would send more runs the psum path instead (the
# decision is the same on every shard: all of them see all routing), so the output never depends on it.
CAPACITY_FACTOR = 2.0
# Cost model for choosing the dispatch ("auto"): 8 x H200 over NVLink 4 (docs/benchmarks/sharding.md):
# ring collectives, 450 GB/s per direction per GPU, a fixed latency per collective.
LINK_BYTES_PER_S = 450e9
COLLECTIVE_LATENCY_S = 10e-6
DISPATCHES = ("psum", "all_to_all", "auto")
_DISPATCH_ENV = "DFLASH_MOE_DISPATCH"


def all_to_all_capacity(tokens_per_shard: int, top_k: int, shards: int, local_experts: int) -> int:
    """Rows one shard sends to one owner in the all-to-all dispatch (static): the worst case
    (`tokens x min(k, local experts)`: every row of every token to one owner) or CAPACITY_FACTOR x the even
    share, whichever is smaller."""
    worst = tokens_per_shard * min(top_k, local_experts)
    share = -(-int(CAPACITY_FACTOR * tokens_per_shard * top_k) // shards)
    return max(1, min(worst, -(-share // 8) * 8))


def dispatch_cost(mode: str, tokens: int, hidden: int, top_k: int, shards: int, local_experts: int,
                  itemsize: int = 2) -> float:
    """Seconds per MoE layer the cost model gives one dispatch's collectives (per device, ring algorithms):
    psum: one all-reduce of [T, H] fp32; all_to_all: the rows back to their tokens' shards ([shards, C, H]
    in the activation dtype) and an all-gather of the [T, H] output."""
    n = shards
    if n <= 1:
        return 0.0
    if mode == "psum":
        return COLLECTIVE_LATENCY_S + 2 * (n - 1) / n * tokens * hidden * 4 / LINK_BYTES_PER_S
    m = -(-tokens // n)
    c = all_to_all_capacity(m, top_k, n, local_experts)
    rows = (n - 1) / n * n * c * hidden * itemsize
    gather = (n - 1) / n * n * m * hidden * itemsize
    return 2 * COLLECTIVE_LATENCY_S + (rows + gather) / LINK_BYTES_PER_S


def choose_dispatch(dispatch: str, tokens: int, hidden: int, top_k: int, shards: int, local_experts: int,
                    itemsize: int = 2) -> str:
    """"psum" or "all_to_all": `dispatch` itself unless "auto"; "auto" takes DFLASH_MOE_DISPATCH when set
    (read at each trace), else the cheaper by `dispatch_cost` at this width."""
    if dispatch == "auto":
        dispatch = os.environ.get(_DISPATCH_ENV, "auto") or "auto"
    if dispatch not in DISPATCHES:
        raise ValueError(f"MoE dispatch {dispatch!r} (argument or {_DISPATCH_ENV}) is not one of {DISPATCHES}")
    if dispatch != "auto":
        return dispatch
    costs = {mode: dispatch_cost(mode, tokens, hidden, top_k, shards, local_experts, itemsize)
             for mode in ("psum", "all_to_all")}
    return min(costs, key=costs.get)


def _expert_parallel(x, experts, weights, gate_up, down, mesh, *, implementation, gate_up_bias, down_bias,
                     activation, dispatch="auto"):
    """`swiglu_experts` under `shard_map` with the tables sharded along E (`expert_axes`). Every shard holds
    all of its data shard's tokens and their routing (the layer input is replicated over the expert axes).

    psum: each shard runs its own experts' rows of all tokens through the local grouped matmuls (rows routed
    elsewhere are computed on local group 0 and masked to exactly zero), combines them with the routing
    weights in fp32, and one psum over the expert axes sums the shards' partial outputs (with top-k = 2 the
    same two products as the single-device combine; in general the same sum reassociated).

    all_to_all: the tokens are split evenly over the expert shards; each owner takes the rows routed to its
    experts in the [sender, C] layout of an all-to-all's receive buffer (read locally: every shard already
    holds every token, so the send leg moves nothing), runs them through its grouped matmuls and sends the
    results back to the tokens' shards (one `all_to_all` of [shards, C, H] in the activation dtype); each
    shard combines its tokens' k rows in fp32 exactly as the single-device path does, and an all-gather
    rebuilds [T, H].
    C is static (`all_to_all_capacity`); a layer whose routing would overflow it takes the psum path
    (`lax.cond` on a flag every shard computes alike), so the result never depends on the capacity."""
    from jax.sharding import PartitionSpec as P

    num_experts = ops.weight_dims(gate_up)[0]
    axes = expert_axes(num_experts, mesh)
    sizes = dict(mesh.shape)
    data = sizes.get(DATA_AXIS, 1)
    tokens = P(DATA_AXIS, None) if data > 1 and x.shape[0] % data == 0 else P(None, None)
    shards = 1
    for a in axes:
        shards *= sizes[a]
    local_experts = num_experts // shards
    local_tokens = x.shape[0] // (data if tokens[0] else 1)
    mode = choose_dispatch(dispatch, local_tokens, x.shape[1], experts.shape[1], shards, local_experts,
                           jnp.dtype(x.dtype).itemsize)

    def table(t):  # E-leading parts split along E; a part shared by all experts (NVFP4's tensor scale) replicated
        return jax.tree.map(lambda a: P(axes) if a.ndim and a.shape[0] == num_experts else P(), t)

    def psum_shard(x, experts, weights, gate_up, down, gate_up_bias, down_bias, index):
        local = experts - index * local_experts
        mine = (local >= 0) & (local < local_experts)
        y = _routed_rows(x, jnp.where(mine, local, 0), gate_up, down, local_experts, implementation,
                         gate_up_bias, down_bias, activation)
        y = jnp.where(mine[..., None], y.astype(jnp.float32), 0.0)
        part = jnp.einsum("tkh,tk->th", y, jnp.where(mine, weights.astype(jnp.float32), 0.0))
        return jax.lax.psum(part, axes).astype(x.dtype)

    def all_to_all_shard(x, experts, weights, gate_up, down, gate_up_bias, down_bias, index):
        t, k = experts.shape
        m = -(-t // shards)
        cap = all_to_all_capacity(m, k, shards, local_experts)
        pad = shards * m - t
        owner = jnp.pad(experts // local_experts, ((0, pad), (0, 0)), constant_values=shards)  # padding: no owner
        # rows per (sending shard, owner), the same on every shard: overflow -> the psum path
        sends = jax.nn.one_hot(owner.reshape(shards, m * k), shards, dtype=jnp.int32).sum(axis=1)
        overflow = jnp.max(sends) > cap
        if data > 1 and tokens[0]:  # one decision for the whole mesh
            overflow = jax.lax.pmax(overflow.astype(jnp.int32), DATA_AXIS) > 0

        # each row's slot in the buffer its sending shard would send its owner: the position among the rows
        # that sending shard routes to that owner (every shard computes all of them: all routing is replicated)
        senders = owner.reshape(shards, m * k)
        position = jnp.cumsum(jax.nn.one_hot(senders, shards, dtype=jnp.int32), axis=1) - 1
        position = jnp.take_along_axis(position, jnp.minimum(senders, shards - 1)[..., None], axis=2)[..., 0]

        def exchange(operands):
            x, experts, weights, gate_up, down, gate_up_bias, down_bias = operands
            # the rows routed to my experts, in the [sender, slot] layout of an all-to-all's receive buffer;
            # gathered locally: the layer input is replicated over the expert axes, so every owner already
            # holds every token and the send leg moves nothing (it would be an all-to-all of the same size as
            # the return leg if the tokens were split over the expert axes)
            slot = jnp.where(senders == index, position, cap)  # cap: not mine, dropped
            sender = jnp.arange(shards)[:, None]
            row = jnp.full((shards, cap), -1, jnp.int32).at[sender, slot].set(
                jnp.broadcast_to(jnp.arange(shards * m * k, dtype=jnp.int32).reshape(shards, m * k), slot.shape),
                mode="drop").reshape(-1)
            live = row >= 0
            flat_experts = jnp.pad(experts, ((0, pad), (0, 0))).reshape(-1)
            local = jnp.where(live, flat_experts[jnp.maximum(row, 0)] % local_experts, 0)
            got = jnp.pad(x, ((0, pad), (0, 0)))[jnp.maximum(row, 0) // k]
            y = _routed_rows(got, local[:, None], gate_up, down, local_experts, implementation, gate_up_bias,
                             down_bias, activation)
            y = jnp.where(live[:, None], y[:, 0], jnp.zeros((), y.dtype)).reshape(shards, cap, -1)
            back = jax.lax.all_to_all(y, axes, 0, 0)  # back[j]: my tokens' rows as their owner j computed them
            my_owner = jax.lax.dynamic_index_in_dim(senders, index, keepdims=False)
            my_position = jax.lax.dynamic_index_in_dim(position, index, keepdims=False)
            mine = back[jnp.minimum(my_owner, shards - 1), my_position].reshape(m, k, -1)
            valid = (my_owner < shards).reshape(m, k)
            my_weights = jax.lax.dynamic_slice_in_dim(jnp.pad(weights, ((0, pad), (0, 0))), index * m, m)
            return jnp.einsum("tkh,tk->th", mine.astype(jnp.float32),
                              jnp.where(valid, my_weights.astype(jnp.float32), 0.0)).astype(x.dtype)

        def fallback(operands):  # this shard's tokens of the psum path's output
            out = jnp.pad(psum_shard(*operands, index), ((0, pad), (0, 0)))
            return jax.lax.dynamic_slice_in_dim(out, index * m, m)

        return jax.lax.cond(overflow, fallback, exchange, (x, experts, weights, gate_up, down, gate_up_bias,
                                                            down_bias))

    def shard(x, experts, weights, gate_up, down, gate_up_bias, down_bias):
        index = 0
        for a in axes:  # the shard's position along the (major-to-minor) expert axes
            index = index * sizes[a] + jax.lax.axis_index(a)
        body = all_to_all_shard if mode == "all_to_all" else psum_shard
        return body(x, experts, weights, gate_up, down, gate_up_bias, down_bias, index)

    biases = (gate_up_bias, down_bias)
    # all_to_all: each shard returns its own tokens; the all-gather back to every shard is the partitioner's
    split = P(((DATA_AXIS,) if tokens[0] else ()) + axes, None) if mode == "all_to_all" else tokens
    out = jax.shard_map(
        shard, mesh=mesh,
        in_specs=(tokens, tokens, tokens, table(gate_up), table(down)) + tuple(
            None if b is None else table(b) for b in biases),
        out_specs=split,
    )(x, experts, weights, gate_up, down, *biases)
    if mode == "all_to_all":
        groups = data if tokens[0] else 1
        out = out.reshape(groups, -1, x.shape[1])[:, :local_tokens].reshape(x.shape)
        out = jax.lax.with_sharding_constraint(out, tokens)
    return out
