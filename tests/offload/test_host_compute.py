"""Hybrid placement's host figures come from the library's own host pass at the pair's expert shape."""

import math

import pytest

import dflash_jax
from dflash_jax.offload import hybrid
from pallas_kernels import cpu_kernels


def test_host_pass_figures_are_measured_at_the_expert_shape():
    flops, rate = hybrid.measure_host_pass(64, 32, expert_format="mxfp4", experts=4, rows=4, repeats=1)
    assert math.isfinite(flops) and flops > 0 and math.isfinite(rate) and rate > 0
    flops, rate = hybrid.measure_host_pass(64, 32, expert_format="bf16", experts=2, rows=2, repeats=1)
    assert flops > 0 and rate > 0
    with pytest.raises(ValueError, match="expert_format must be mxfp4, bf16 or float32"):
        hybrid.measure_host_pass(64, 32, expert_format="int4")
    with pytest.raises(ValueError, match="rows >= 2"):
        hybrid.measure_host_pass(64, 32, rows=1)


def test_for_pair_times_the_pairs_tables_and_keeps_the_link():
    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR)
    figures = hybrid.HostCompute.for_pair(pair, 5e9, repeats=1, rows=2, experts=2)
    assert figures.link_bytes_per_s == 5e9 and figures.host_flops > 0 and figures.host_bytes_per_s > 0
    # the figures drive the per-expert choice: the host computes a missing expert only where that beats its copy
    import dataclasses

    import numpy as np

    rows, per_row = np.array([0, 3, 0, 0, 0, 0, 0, 0]), hybrid.flops_per_row(128, 256)
    slow_link = dataclasses.replace(figures, link_bytes_per_s=1e3)  # a 1 MB copy takes 1000 s
    fast_link = dataclasses.replace(figures, link_bytes_per_s=1e18)
    assert list(slow_link.choose(np.array([1]), rows, flops_per_row=per_row, expert_bytes=10**6)) == [1]
    assert list(fast_link.choose(np.array([1]), rows, flops_per_row=per_row, expert_bytes=10**6)) == []


def test_host_pass_at_a_real_fp4_expert_shape_streams_the_codes():
    """At Qwen3-30B-A3B's expert shape (2048 -> 768) with MXFP4 tables the host pass takes the streamed path (the
    rate it measures is the compiled kernel's, or XLA's per-row loop where the kernel cannot be built); small FP4
    tables keep the other CPU paths; bf16 tables stream through the dense kernel where it is built."""
    assert hybrid.host_path(2048, 768, expert_format="mxfp4", experts=8, rows=1) == "stream"
    assert hybrid.host_path(2048, 768, expert_format="mxfp4", experts=8, rows=16) == "stream"
    assert hybrid.host_path(128, 256, expert_format="mxfp4") != "stream"
    assert (hybrid.host_path(2048, 768, expert_format="bf16") == "stream") == cpu_kernels.available()
    flops, rate = hybrid.measure_host_pass(2048, 768, expert_format="mxfp4", experts=2, rows=2, repeats=1)
    assert math.isfinite(flops) and flops > 0 and math.isfinite(rate) and rate > 0
