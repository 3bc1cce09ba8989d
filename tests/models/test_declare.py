"""Weights are declared once: each family's weight dataclasses carry their declarations, and the flat
declarations (`declare_weights`) and the pytree (`weights_from_flat`) are read off the same types. Checked on
every registered family and the draft (DFlash 1 and 2): the pytree built from arrays of the declared shapes
has the structure of the family's own random weights, and every declared array lands in it."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from dflash_jax.models.declare import Param, declare_tree, param
from dflash_jax.models.family import draft_family, families


def _cases():
    for fam in families():
        yield fam.name, fam, fam.tiny_config()
    drafts = draft_family()
    target = families()[0].tiny_config()
    base = drafts.tiny_config(target)
    yield "dflash", drafts, base
    yield "dflash2", drafts, dataclasses.replace(base, version=2, conv_kernel_size=3, conv_group_size=16,
                                                 selector_rank=8, selector_top_k=4)


@pytest.mark.parametrize("name,fam,cfg", list(_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_the_pytree_and_the_declarations_come_from_one_description(name, fam, cfg):
    declared = fam.declare_weights(cfg)
    if any("#" in k for k in declared):  # expert tables packed as released; these random weights are dense
        declared = fam.hf_table.targets_for_checkpoint(cfg, [])
    want = fam.random_weights(cfg, jax.random.key(0))
    flat = {key: np.zeros(target.shape, np.float32) for key, target in declared.items()}
    got = fam.weights_from_flat(flat, cfg)
    if name == "dflash2":  # a DFlash 2 draft's random weights carry the selector and convolutions too
        assert got.convs is not None and got.branch_head is not None
    assert jax.tree.structure(got) == jax.tree.structure(want)


def test_declarations_follow_the_config():
    """A field's declaration is a function of the config: optional fields vanish with their condition."""

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        width: int
        biased: bool

    @dataclasses.dataclass
    class Toy:
        w: object = param(lambda c: (c.width, 2 * c.width))
        b: object = param(lambda c: (2 * c.width,), when=lambda c: c.biased)

    assert {k: v.shape for k, v in declare_tree(Toy, Cfg(4, True)).items()} == {"w": (4, 8), "b": (8,)}
    assert list(declare_tree(Toy, Cfg(4, False))) == ["w"]
    assert isinstance(dataclasses.fields(Toy)[0].metadata["declare"], Param)
