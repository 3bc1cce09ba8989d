"""The capability matrix (docs/architecture.md): every proposer on every expert placement in every driver.

In each cell, greedy output equals the target's plain greedy output (`decode.greedy_generate`) token for token,
and proposals were accepted (more than one token per round); the tree cells commit more tokens per round than the
chain. The serving engine's cells are in tests/serve (test_engine_proposers.py, test_offload_engine.py), the DFlash 2
selector's in tests/spec/test_dflash2_generate.py. The
cheapest cell runs in the fast set, the rest with -m slow."""

from __future__ import annotations

import numpy as np
import pytest

import dflash_jax
from dflash_jax.api import CAPABILITIES, DRIVERS, EXPERTS, PROPOSERS, check_combination

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [300, 301, 302, 303, 17, 18]]
N = 24


@pytest.fixture(scope="module")
def pair():
    return dflash_jax.load()


@pytest.fixture(scope="module")
def budget_mb():
    """The smallest device expert cache that runs (one expert of each shape): every round fetches."""
    from dflash_jax.checkpoint import read_manifest
    from dflash_jax.offload.cache import min_budget_from_manifest

    minimum, total = min_budget_from_manifest(read_manifest(dflash_jax.SHIPPED_PAIR))
    assert minimum < total
    return minimum / 1e6


@pytest.fixture(scope="module")
def plain(pair):
    from dflash_jax.decode import greedy_generate

    return greedy_generate(pair.target, pair.target_cfg, PROMPTS, max_new_tokens=N)


@pytest.fixture(scope="module")
def chain_tau(pair):
    res = dflash_jax.generate(pair, PROMPTS, max_new_tokens=N)
    return float(np.mean([a for seq in res.acceptance_lengths for a in seq]))


# the selector needs a DFlash 2 draft (the shipped pair is DFlash 1): its cells are in tests/spec/test_dflash2_generate.py
CELLS = [(p, e, d) for p in PROPOSERS for e in EXPERTS for d in DRIVERS
         if CAPABILITIES[(p, e, d)] is None and p != "selector"]


@pytest.mark.parametrize("proposer,experts,driver", [
    pytest.param(*cell, marks=() if cell == ("chain", "device", "jit") else pytest.mark.slow) for cell in CELLS])
def test_cell_is_lossless_and_accepts(pair, plain, chain_tau, budget_mb, proposer, experts, driver):
    options = {"expert_budget_mb": budget_mb, "pin": False} if experts == "offload" else {}
    res = dflash_jax.generate(pair, PROMPTS, max_new_tokens=N, proposer=proposer, experts=experts, driver=driver,
                              **options)
    assert res.tokens == plain
    tau = float(np.mean([a for seq in res.acceptance_lengths for a in seq]))
    assert tau > 1.3, (proposer, experts, driver, tau)
    if proposer == "tree":
        assert tau > chain_tau, (tau, chain_tau)
    if experts == "offload":
        assert res.stats["route_ahead"]["summary"]["bytes_moved"] > 0  # the verify really fetched experts


def test_every_refused_cell_says_why():
    refused = [cell for cell, why in CAPABILITIES.items() if why is not None]
    assert refused == [(p, "offload", "jit") for p in PROPOSERS]
    with pytest.raises(ValueError, match="stepping driver"):
        check_combination("tree", "offload", "jit")
    with pytest.raises(ValueError, match="proposer must be one of"):
        check_combination("forest", "device", "jit")
    with pytest.raises(ValueError, match="expert_budget_mb"):
        dflash_jax.generate(None, PROMPTS, max_new_tokens=4, experts="offload")


def test_compaction_is_the_jitted_drivers():
    with pytest.raises(ValueError, match="compact=True compacts the jitted driver"):
        dflash_jax.generate(None, PROMPTS, max_new_tokens=4, driver="stepping", compact=True)
