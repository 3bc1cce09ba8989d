"""The load-time expert policy: FP4 experts dequantized once where no FP4 kernel runs (the CPU), kept FP4 where
the kernel runs; exact (the same values the XLA path dequantizes on every call)."""

from __future__ import annotations

import dataclasses
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
    if auto.experts_dequantized:  # MXFP4 tables of a float32 target: bfloat16 holds their values
        assert auto.target.embed.dtype == jnp.float32
        assert all(isinstance(layer.mlp.gate_up, jax.Array) and layer.mlp.gate_up.dtype == jnp.bfloat16
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


def _logits(pair, implementation: str, tokens=PROMPT):
    cfg = pair.target_cfg
    fam = family_of(cfg)
    cache = fam.init_cache(cfg, 1, 32, pair.target.embed.dtype)
    fn = jax.jit(lambda w, t, c: fam.forward(w, t, c, cfg, logits="all", implementation=implementation).logits)
    return np.asarray(fn(pair.target, jnp.asarray([tokens], jnp.int32), cache))


def test_the_target_forward_is_unchanged_by_dequantizing_at_load():
    """Bit-identical logits of a prompt through the XLA path: FP4 tables dequantized per call vs once at load."""
    fp4, dense = pairs()
    a, b = _logits(fp4, "xla"), _logits(dense, "xla")
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)


def _with_tables(pair, convert):
    fam = family_of(pair.target_cfg)
    layers = tuple(layer.replace(mlp=fam.with_expert_pool(layer.mlp, tuple(convert(t) for t in fam.expert_tables(
        layer.mlp)), layer.mlp.slot_of)) if fam.is_moe(layer) else layer for layer in pair.target.layers)
    return dataclasses.replace(pair, target=pair.target.replace(layers=layers))


@pytest.mark.parametrize("implementation", ["auto", "xla"])
def test_bfloat16_tables_multiply_as_their_float32_values(implementation):
    """MXFP4 tables of a float32 target are kept in bfloat16 (half the bytes a round reads): every value the same
    as the float32 dequantization, and the forward's logits bit-identical to float32 tables', through the compiled
    CPU kernels (auto, where they build) and through XLA."""
    fp4, dense = pairs()
    fam = family_of(fp4.target_cfg)
    tables = [t for layer in dense.target.layers if fam.is_moe(layer) for t in fam.expert_tables(layer.mlp)]
    assert tables and all(t.dtype == jnp.bfloat16 for t in tables)
    assert pair_mod.dense_expert_bytes(fp4) == sum(int(t.nbytes) for t in tables)
    wide = _with_tables(dense, lambda t: t.astype(jnp.float32))
    prompt = PROMPT * 4  # 48 tokens: every expert gets rows
    a, b = _logits(dense, implementation, prompt), _logits(wide, implementation, prompt)
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)


def test_a_table_the_narrow_dtype_cannot_hold_stays_in_the_compute_dtype(monkeypatch):
    """The narrow dtype is checked against the values: a table it would round keeps the compute dtype."""
    from dflash_jax.quant.mxfp4 import quantize_mxfp4

    big = quantize_mxfp4(jnp.full((2, 8, 32), 1e6, jnp.float32))  # 2^20-scale values: beyond float16
    small = quantize_mxfp4(jnp.full((2, 8, 32), 0.75, jnp.float32))
    monkeypatch.setattr(pair_mod, "dense_table_dtype", lambda table, dtype: jnp.dtype(jnp.float16))
    assert pair_mod.dense_table(big, jnp.float32).dtype == jnp.float32
    assert pair_mod.dense_table(small, jnp.float32).dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(pair_mod.dense_table(big, jnp.float32)),
                                  np.asarray(ops.dense_weight(big, jnp.float32)))
