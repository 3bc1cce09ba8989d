"""The load-time expert policy: FP4 experts dequantized once where no FP4 kernel runs (the CPU), kept FP4 where
the kernel runs; exact (the same values the XLA path dequantizes on every call)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax import pair as pair_mod
from dflash_jax.errors import UsageError
from dflash_jax.models.family import family_of
from pallas_kernels import ops

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64, 8, 21, 250, 3]


@functools.cache
def pairs():
    fp4 = dflash_jax.load(dequantize_experts=False)
    return fp4, pair_mod.with_dense_experts(fp4)


def test_auto_dequantizes_on_the_cpu_and_keeps_fp4_where_the_kernel_runs(monkeypatch):
    fp4, _ = pairs()
    assert fp4.expert_format == "mxfp4"
    # the CPU has no FP4 kernel: dequantize (the shipped pair's 12.6 MB dense tables fit); a GPU keeps FP4
    assert pair_mod.dense_experts_wanted(fp4, "auto") == (not ops.kernel_available())
    assert ops.kernel_available() == (jax.default_backend() == "gpu")
    monkeypatch.setattr(ops, "kernel_available", lambda: False)
    assert pair_mod.dense_experts_wanted(fp4, "auto")
    assert not pair_mod.dense_experts_wanted(fp4, "auto", expert_memory="pinned_host")  # offload moves FP4 bytes
    assert not pair_mod.dense_experts_wanted(fp4, False)
    monkeypatch.setattr(pair_mod, "DENSE_EXPERTS_MEMORY_SHARE", pair_mod.dense_expert_bytes(fp4) / 2**50)
    assert not pair_mod.dense_experts_wanted(fp4, "auto")  # does not fit: stays FP4
    assert pair_mod.dense_experts_wanted(fp4, True)  # forced
    monkeypatch.undo()
    monkeypatch.setattr(ops, "kernel_available", lambda: True)
    assert not pair_mod.dense_experts_wanted(fp4, "auto")  # the kernel reads FP4 directly
    with pytest.raises(UsageError, match="dequantize_experts"):
        pair_mod.dense_experts_wanted(fp4, "sometimes")
    with pytest.raises(UsageError, match="expert_memory='device'"):
        pair_mod.dense_experts_wanted(fp4, True, expert_memory="pinned_host")


def test_load_applies_the_policy():
    auto = dflash_jax.load(dequantize_experts="auto")
    kept = dflash_jax.load()  # the default keeps the tables as stored
    fam = family_of(auto.target_cfg)
    moe = [layer for layer in auto.target.layers if fam.is_moe(layer)]
    assert not kept.experts_dequantized
    assert auto.experts_dequantized == (not ops.kernel_available())
    if auto.experts_dequantized:
        assert all(isinstance(layer.mlp.gate_up, jax.Array) and layer.mlp.gate_up.dtype == auto.target.embed.dtype
                   for layer in moe)
    forced = dflash_jax.load(dequantize_experts=True)
    assert forced.experts_dequantized and not ops.is_fp4(forced.target.layers[0].mlp.gate_up)
    assert all(ops.is_fp4(layer.mlp.gate_up) for layer in kept.target.layers if fam.is_moe(layer))
    assert auto.expert_bytes == kept.expert_bytes  # as stored, from the manifest
    dense_moe = [layer for layer in forced.target.layers if fam.is_moe(layer)]
    assert pair_mod.dense_expert_bytes(kept) == sum(int(layer.mlp.gate_up.nbytes + layer.mlp.down.nbytes)
                                                    for layer in dense_moe)


def test_dense_tables_equal_the_per_call_dequantization():
    fp4, dense = pairs()
    fam = family_of(fp4.target_cfg)
    for a, b in zip(fp4.target.layers, dense.target.layers):
        if fam.is_moe(a):
            for t_fp4, t_dense in zip(fam.expert_tables(a.mlp), fam.expert_tables(b.mlp)):
                want = np.asarray(jnp.swapaxes(t_fp4.dequantize(jnp.float32), -1, -2))
                np.testing.assert_array_equal(np.asarray(t_dense, np.float32), want)


def test_the_target_forward_is_unchanged_by_dequantizing_at_load():
    """Bit-identical logits of a prompt through the XLA path: FP4 tables dequantized per call vs once at load."""
    fp4, dense = pairs()
    cfg = fp4.target_cfg
    fam = family_of(cfg)
    tokens = jnp.asarray([PROMPT], jnp.int32)

    def logits(weights):
        cache = fam.init_cache(cfg, 1, 32, weights.embed.dtype)
        fn = jax.jit(lambda w, t, c: fam.forward(w, t, c, cfg, logits="all", implementation="xla").logits)
        return np.asarray(fn(weights, tokens, cache))

    a, b = logits(fp4.target), logits(dense.target)
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
