"""Fixtures shared by the loop tests that run the shipped pair: `pair` (the shipped pair, once per module) and
`prompts` (one held-out window of 40 tokens per entry of the module's `BUDGETS`). A module's own fixture of the
same name takes precedence."""

from __future__ import annotations

import pytest

import dflash_jax
from dflash_jax.train.data import file_windows


@pytest.fixture(scope="module")
def pair():
    return dflash_jax.load(dflash_jax.SHIPPED_PAIR)


@pytest.fixture(scope="module")
def prompts(request, pair):
    return file_windows(pair, "held_out", len(request.module.BUDGETS), 40)
