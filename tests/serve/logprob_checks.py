"""The reference the log-prob tests compare with: log_softmax of one plain target forward over a whole sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def plain_log_softmax(pair, tokens) -> np.ndarray:
    """[len(tokens), V]: log_softmax of the target's logits over `tokens` in one forward (row i scores token i + 1)."""
    from dflash_jax.models.family import family_of
    from dflash_jax.spec.session import init_target_cache

    cfg = pair.target_cfg
    ids = jnp.asarray([list(tokens)], jnp.int32)
    cache = init_target_cache(cfg, 1, len(tokens) + 8, pair.target.embed.dtype, verify_width=1)
    out = family_of(cfg).forward(pair.target, ids, cache, cfg, logits="all")
    return np.asarray(jax.nn.log_softmax(out.logits[0].astype(jnp.float32), axis=-1))


def tolerance(pair) -> float:
    """fp32 targets: the verify's and the plain forward's sums differ in order only; bf16: its rounding."""
    return 2e-3 if pair.target.embed.dtype == jnp.float32 else 5e-2
