"""Shared checks of sampled generation: the exact joint law of the first tokens by enumeration and a chi-square
p-value against it (test helpers, public so that any test module may use them)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dflash_jax.models.family import family_of
from dflash_jax.spec.sampling import sampling_probs


def exact_joint3(pair, prompt, params) -> np.ndarray:
    """p(x1, x2, x3 | prompt) [V, V, V] under the target's processed distribution (`params`), by enumerating every
    two-token prefix (a small vocabulary V)."""
    cfg = pair.target_cfg
    fam = family_of(cfg)
    v = cfg.vocab_size
    prefixes = np.array([[a, b] for a in range(v) for b in range(v)])
    seqs = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1).astype(np.int32)
    out = fam.forward_jit(pair.target, jnp.asarray(seqs), fam.init_cache(cfg, len(seqs), seqs.shape[1]), cfg)
    probs = np.asarray(sampling_probs(out.logits, params), np.float64)
    p1 = probs[0, len(prompt) - 1]
    p2 = probs[::v, len(prompt)]  # row a*V: prefix (a, 0) -> p(x2 | a)
    p3 = probs[:, len(prompt) + 1].reshape(v, v, v)  # p(x3 | a, b)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square p-value of `counts` against `expected` counts, the smallest cells merged until each
    bin expects at least 5."""
    from scipy.stats import chi2

    order = np.argsort(expected)
    bins_e, bins_c, acc_e, acc_c = [], [], 0.0, 0
    for e, c in zip(expected[order], counts[order]):
        acc_e += e
        acc_c += c
        if acc_e >= 5:
            bins_e.append(acc_e)
            bins_c.append(acc_c)
            acc_e, acc_c = 0.0, 0
    if acc_e > 0:
        bins_e[-1] += acc_e
        bins_c[-1] += acc_c
    bins_e, bins_c = np.array(bins_e), np.array(bins_c)
    return float(chi2.sf(np.sum((bins_c - bins_e) ** 2 / bins_e), len(bins_e) - 1))
