"""Hybrid placement: a cold expert is computed on the host (JAX's CPU backend) instead of being copied to the
device, when the cost model says that is faster, decided per expert and round.

For a missing expert e of a layer with n_e rows routed to it this round:
  copy  = expert_bytes / link_bytes_per_s                                  (then computed on the device)
  host  = n_e * 6 H I / host_flops + expert_bytes / host_bytes_per_s       (the host GEMMs read the weights once)
The expert goes to the host when host < copy; the layer's host experts form one pass on the CPU device (its
activations move there and its output back: `host_pass_s` per layer is charged against the saving, so a
layer sends experts to the host only when the summed saving exceeds it). Experts already resident are always
computed on the device. Both give the same numbers (the same jitted pass on the same inputs; tested equal).

`HostCompute.measure()` fills the figures from this machine (the link by `bandwidth`; the host's rates from the
library's own host pass timed at the pair's expert shape, `for_pair` / `measure_host_pass`, or numpy's matmul
and copy rates without one). The host pass is `nn.moe.swiglu_experts` on the CPU device as the offloaded layer
runs it: at real expert shapes with MXFP4 tables and up to `nn.moe.STREAM_MAX_ROWS` rows that is the streamed
path (the compiled kernel reading each routed expert's codes once as stored, about 0.4 - 0.8x this machine's
copy bandwidth in docs/benchmarks/moe_cpu.md, where the gathering path made 0.01 - 0.02x), so the measured
`host_bytes_per_s` is that rate and the placement sends more cold experts to the host; `for_link()` lets a caller state them (what `study.cost_model` assumes for an H200 + PCIe
5 host: the link ~58 GB/s, a host socket ~2 TFLOP/s and ~200 GB/s (assumed): a cold expert of Qwen3-30B (~2.5 MB
MXFP4, 6HI = 9.4 MFLOP per row) copies in ~43 us and computes on the host in ~12.5 us + 4.7 us per row, so it is
worth computing there while it has up to ~6 rows this round).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from dflash_jax.models.family import family_of


@dataclasses.dataclass(frozen=True)
class HostCompute:
    """The figures the per-expert decision reads (bytes/s, FLOP/s, seconds)."""

    link_bytes_per_s: float
    host_flops: float
    host_bytes_per_s: float
    host_pass_s: float = 0.0

    def copy_seconds(self, expert_bytes: int) -> float:
        return expert_bytes / self.link_bytes_per_s

    def host_seconds(self, rows: np.ndarray, flops_per_row: float, expert_bytes: int) -> np.ndarray:
        return np.asarray(rows, np.float64) * flops_per_row / self.host_flops + expert_bytes / self.host_bytes_per_s

    def choose(self, missing: np.ndarray, rows: np.ndarray, *, flops_per_row: float, expert_bytes: int) -> np.ndarray:
        """The experts of `missing` (ids) to compute on the host, given `rows` [E] (rows routed to each expert
        this round): those whose host time beats their copy, if their summed saving beats the pass overhead."""
        missing = np.asarray(missing, np.int64)
        if len(missing) == 0:
            return missing
        saving = self.copy_seconds(expert_bytes) - self.host_seconds(rows[missing], flops_per_row, expert_bytes)
        chosen = missing[saving > 0]
        if saving[saving > 0].sum() <= self.host_pass_s:
            return missing[:0]
        return chosen

    @classmethod
    def always(cls) -> "HostCompute":
        """Every missing expert on the host (tests: the host path runs whatever the machine)."""
        return cls(link_bytes_per_s=1e-9, host_flops=1e30, host_bytes_per_s=1e30)

    @classmethod
    def measure(cls, link_bytes_per_s: float, *, size: int = 512, repeats: int = 3, hidden: int | None = None,
                intermediate: int | None = None, expert_format: str = "mxfp4", experts: int = 8,
                rows: int = 16) -> "HostCompute":
        """The host's figures measured on this machine. With an expert shape (`hidden`, `intermediate`): the
        library's own host pass (`nn.moe.swiglu_experts` on the CPU device, tables in `expert_format`, "mxfp4"
        as the store keeps them or "bf16"/"float32") timed twice, `experts` experts with 1 row each and with `rows`
        rows each, and the cost model fitted to the two (the rate of extra rows gives `host_flops`, the rest
        of the 1-row time the rate of reading an expert, `host_bytes_per_s`; best of `repeats`). Without one:
        numpy's fp32 matmul rate and memory copy rate (upper bounds of what a host pass reaches)."""
        if hidden is not None and intermediate is not None:
            flops, rate = measure_host_pass(hidden, intermediate, expert_format=expert_format, experts=experts,
                                            rows=rows, repeats=repeats)
            return cls(link_bytes_per_s=float(link_bytes_per_s), host_flops=flops, host_bytes_per_s=rate)
        a = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - t0)
        flops = 2 * size ** 3 / best
        buf = np.ones(32 << 20, np.uint8)
        dst = np.empty_like(buf)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(dst, buf)
            best = min(best, time.perf_counter() - t0)
        return cls(link_bytes_per_s=float(link_bytes_per_s), host_flops=float(flops),
                   host_bytes_per_s=float(buf.nbytes / best), host_pass_s=0.0)

    @classmethod
    def for_pair(cls, pair, link_bytes_per_s: float, **kw) -> "HostCompute":
        """`measure` at the expert shape and table format of `pair`'s target (its MoE hidden size, expert
        intermediate size and expert format)."""
        cfg = pair.target_cfg
        if pair.expert_format in ("mxfp4", "nvfp4") and not pair.experts_dequantized:
            fmt = "mxfp4"  # FP4 tables as stored (NVFP4 reads and decodes alike, per 16 instead of 32 codes)
        elif pair.experts_dequantized:  # the dense tables' own dtype (bfloat16 for MXFP4: `dense_table_dtype`)
            fam = family_of(cfg)
            table = next(fam.expert_tables(layer.mlp)[0] for layer in pair.target.layers if fam.is_moe(layer))
            fmt = "float32" if table.dtype == np.float32 else "bf16"
        else:
            fmt = "float32" if pair.manifest.get("dtype") == "float32" else "bf16"
        return cls.measure(link_bytes_per_s, hidden=cfg.hidden_size, intermediate=cfg.moe.intermediate_size,
                           expert_format=fmt, **kw)


def measure_host_pass(hidden: int, intermediate: int, *, expert_format: str = "mxfp4", experts: int = 8,
                      rows: int = 16, repeats: int = 3) -> tuple[float, float]:
    """(FLOP/s, expert bytes read per s) of the host pass at one expert shape, fitted from two timed calls of
    `swiglu_experts` on the CPU device (random tables of `experts` experts; 1 and `rows` rows per expert), on the
    path the layer takes there (`host_path`)."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.nn.moe import swiglu_experts
    from pallas_kernels.formats import MXFP4Tensor

    if rows < 2 or experts < 1:
        raise ValueError(f"measure_host_pass needs rows >= 2 and experts >= 1, got rows={rows}, experts={experts}")
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    with jax.default_device(cpu):
        if expert_format == "mxfp4":
            def table(n, k):
                return MXFP4Tensor(jnp.asarray(rng.integers(0, 256, (experts, n, k // 32, 16), dtype=np.uint8)),
                                   jnp.asarray(rng.integers(118, 124, (experts, n, k // 32), dtype=np.uint8)))
            gate_up, down = table(2 * intermediate, hidden), table(hidden, intermediate)
        elif expert_format in ("bf16", "bfloat16", "float32"):
            dtype = jnp.float32 if expert_format == "float32" else jnp.bfloat16
            gate_up = jnp.asarray(rng.standard_normal((experts, hidden, 2 * intermediate), np.float32) * 0.02, dtype)
            down = jnp.asarray(rng.standard_normal((experts, intermediate, hidden), np.float32) * 0.02, dtype)
        else:
            raise ValueError(f"expert_format must be mxfp4, bf16 or float32, got {expert_format!r}")
        expert_bytes = sum(int(a.nbytes) for a in jax.tree.leaves((gate_up, down))) / experts
        layer = jax.jit(lambda x, e, w, gu, dn: swiglu_experts(x, e, w, gu, dn))

        def best(n_rows):
            tokens = experts * n_rows
            x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
            e = jnp.asarray(np.arange(tokens) % experts, jnp.int32)[:, None]
            w = jnp.ones((tokens, 1), jnp.float32)
            jax.block_until_ready(layer(x, e, w, gate_up, down))
            out = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(layer(x, e, w, gate_up, down))
                out = min(out, time.perf_counter() - t0)
            return out

        one, many = best(1), best(rows)
    flops = experts * (rows - 1) * flops_per_row(hidden, intermediate) / max(many - one, 1e-9)
    compute_one = experts * flops_per_row(hidden, intermediate) / flops
    rate = experts * expert_bytes / max(one - compute_one, 1e-9)
    return float(flops), float(rate)


def host_path(hidden: int, intermediate: int, *, expert_format: str = "mxfp4", experts: int = 8,
              rows: int = 16) -> str:
    """The CPU path (`nn.moe.routed_path`) the host pass takes at this expert shape and format for `rows` rows per
    expert over `experts` experts: what `measure_host_pass` times, and what the offloaded layer runs."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.nn.moe import routed_path
    from pallas_kernels import target
    from pallas_kernels.formats import MXFP4Tensor

    if expert_format == "mxfp4":
        gate_up = MXFP4Tensor(jax.ShapeDtypeStruct((experts, 2 * intermediate, hidden // 32, 16), jnp.uint8),
                              jax.ShapeDtypeStruct((experts, 2 * intermediate, hidden // 32), jnp.uint8))
    else:
        dtype = jnp.float32 if expert_format == "float32" else jnp.bfloat16
        gate_up = jax.ShapeDtypeStruct((experts, hidden, 2 * intermediate), dtype)
    with target.compiling_for("cpu"):
        return routed_path("auto", gate_up, jnp.float32, experts * rows, 1)


def flops_per_row(hidden: int, intermediate: int) -> float:
    """FLOPs of one routed row through one SwiGLU expert: gate + up [H, 2I] and down [I, H]."""
    return 6.0 * hidden * intermediate
