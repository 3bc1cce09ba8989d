"""A shared check of the tree tests: a stepped tree run whose output must be the target's plain greedy output."""

from __future__ import annotations

import numpy as np

from dflash_jax.decode import greedy_generate
from dflash_jax.spec.loop import generate_tree_stepping
from dflash_jax.spec.tree import TreeShape


def lossless_tree_rounds(pair, prompts, max_new_tokens: int, shape: TreeShape):
    """`generate_tree_stepping` with `shape`, asserted equal to plain greedy decoding of the target. Returns
    (result, accepted, off_chain): the proposals accepted and whether the accepted path left the argmax chain,
    over the live rows of every round."""
    plain = greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=max_new_tokens)
    result, rounds = generate_tree_stepping(pair, prompts, max_new_tokens=max_new_tokens, shape=shape)
    assert result.tokens == plain
    live = np.concatenate([r["live"] for r in rounds])
    accepted = np.concatenate([r["accepted"] for r in rounds])[live]
    off_chain = np.concatenate([r["off_chain"] for r in rounds])[live]
    return result, accepted, off_chain
