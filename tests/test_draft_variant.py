"""Draft variants (`checkpoint.TARGET_FROM`): a checkpoint that stores only its draft and reads its target from a
sibling checkpoint, checked against its own manifest's checksums."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

import dflash_jax
from dflash_jax import checkpoint as ckpt_io
from dflash_jax.errors import CheckpointError


def test_a_draft_variant_loads_its_siblings_target(tmp_path):
    base, variant = tmp_path / "base", tmp_path / "variant"
    shutil.copytree(dflash_jax.SHIPPED_PAIR, base)
    shutil.copytree(dflash_jax.SHIPPED_PAIR, variant)
    ckpt_io.make_draft_variant(variant, base)
    assert not (variant / "target").exists()
    assert json.load(open(variant / "manifest.json"))[ckpt_io.TARGET_FROM] == "base"
    got, want = dflash_jax.load(str(variant)), dflash_jax.load(str(base))
    for a, b in zip(jax.tree.leaves((got.target, got.draft)), jax.tree.leaves((want.target, want.draft))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # the sibling's target files are checked against the variant's own checksums
    victim = next(p for p in sorted((base / "target").rglob("*")) if p.is_file() and p.stat().st_size > 1000)
    data = bytearray(victim.read_bytes())
    data[100] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        dflash_jax.load(str(variant))
    shutil.rmtree(base)
    with pytest.raises(CheckpointError, match="draft variant.*'base'.*copy base next to it"):
        dflash_jax.load(str(variant))


def test_make_draft_variant_refuses_another_target_and_a_bad_name(tmp_path):
    base, other = tmp_path / "base", tmp_path / "other"
    shutil.copytree(dflash_jax.SHIPPED_PAIR, base)
    shutil.copytree(dflash_jax.SHIPPED_PAIRS["tiny_pair_qwen3_5"], other)
    with pytest.raises(ValueError, match="not the same target"):
        ckpt_io.make_draft_variant(other, base)
    manifest = ckpt_io.read_manifest(base)
    manifest[ckpt_io.TARGET_FROM] = "../elsewhere"
    ckpt_io.write_manifest(base, manifest)
    with pytest.raises(CheckpointError, match="must name a sibling checkpoint directory"):
        ckpt_io.read_manifest(base)
