"""Hybrid placement: a cold expert is computed on the host (JAX's CPU backend) instead of being copied to the
device, when the cost model says that is faster, decided per expert and round.

For a missing expert e of a layer with n_e rows routed to it this round:
  copy  = expert_bytes / link_bytes_per_s                                  (then computed on the device)
  host  = n_e * 6 H I / host_flops + expert_bytes / host_bytes_per_s       (the host GEMMs read the weights once)
The expert goes to the host when host < copy; the layer's host experts form one pass on the CPU device (its
activations move there and its output back: `host_pass_s` per layer is charged against the saving, so a
layer sends experts to the host only when the summed saving exceeds it). Experts already resident are always
computed on the device. Both give the same numbers (the same jitted pass on the same inputs; tested equal).

`HostCompute.measure()` fills the figures from this machine (the link by `bandwidth`, the host's matmul rate
by a timed product); `for_link()` lets a caller state them (what `study.cost_model` assumes for an H200 + PCIe
5 host: the link ~58 GB/s, a host socket ~2 TFLOP/s and ~200 GB/s (assumed): a cold expert of Qwen3-30B (~2.5 MB
MXFP4, 6HI = 9.4 MFLOP per row) copies in ~43 us and computes on the host in ~12.5 us + 4.7 us per row, so it is
worth computing there while it has up to ~6 rows this round).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np


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
    def measure(cls, link_bytes_per_s: float, *, size: int = 512, repeats: int = 3) -> "HostCompute":
        """The host's fp32 matmul rate and memory rate measured with numpy (timed, best of `repeats`)."""
        a = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - t0)
        flops = 2 * size ** 3 / best
        buf = np.ones(32 << 20, np.uint8)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.copy()
            best = min(best, time.perf_counter() - t0)
        return cls(link_bytes_per_s=float(link_bytes_per_s), host_flops=float(flops),
                   host_bytes_per_s=float(buf.nbytes / best), host_pass_s=0.0)


def flops_per_row(hidden: int, intermediate: int) -> float:
    """FLOPs of one routed row through one SwiGLU expert: gate + up [H, 2I] and down [I, H]."""
    return 6.0 * hidden * intermediate
