"""Tiny configs and random weights for tests, examples and benchmarks (no torch needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.models import draft, gpt_oss, qwen3, qwen3_5
from dflash_jax.models.family import family_of

# Random weights are declared by each family (its `random_weights`); these names stay for tests and examples.
random_qwen3_weights = qwen3.random_weights
random_gpt_oss_weights = gpt_oss.random_weights
random_qwen3_5_weights = qwen3_5.random_weights
random_draft_weights = draft.random_weights
# Each family's tiny config is the family's own (`ModelFamily.tiny_config`); these names stay for tests and examples.
tiny_qwen3_moe_config = qwen3.tiny_config
tiny_gpt_oss_config = gpt_oss.tiny_config
tiny_qwen3_5_config = qwen3_5.tiny_config


tiny_draft_config = draft.tiny_config


def make_agreeable(target_w, draft_w: draft.DraftWeights, *, strength: float = 2.0, tokens: tuple[int, int] = (7, 9)):
    """(target, draft) weights that agree on something, so speculative rounds accept a mix of 0..B-1
    proposals: both final norms amplify hidden dim 0 and the target's lm_head (which the draft shares)
    maps its sign to one of two tokens. Needs an untied lm_head. Any target family: only `.final_norm` and
    `.lm_head` change, the norm's dim-0 weight raised by 29 (about 30x whether the norm scales by w or by a
    zero-centred 1 + w)."""
    head = target_w.lm_head.at[0, :].set(0.0).at[0, tokens[0]].set(strength).at[0, tokens[1]].set(-strength)
    target_w = target_w.replace(final_norm=target_w.final_norm.at[0].add(29.0), lm_head=head)
    return target_w, draft_w.replace(final_norm=draft_w.final_norm.at[0].set(30.0))


def quantize_experts(weights, expert_format: str = "mxfp4"):
    """The same Qwen3 / Qwen3.5 weights with every MoE layer's routed expert tables quantized to
    `expert_format` ("mxfp4" / "nvfp4"; logical `[E, out, in]` FP4 tensors, as `convert-weights` writes them)."""
    return qwen3.quantize_expert_tables(weights, expert_format)


def random_pair(cfg=None, *, seed: int = 0, agreeable: bool = True, expert_format: str = "dense",
                **draft_overrides):
    """A `dflash_jax.pair.Pair` of random tiny weights (`tiny_qwen3_moe_config()` by default; a
    `GptOssConfig` or `Qwen3_5Config` builds that family's target), made agreeable (`make_agreeable`) unless
    told otherwise, experts dense or quantized ("mxfp4" / "nvfp4" for the Qwen families; gpt-oss experts are
    "dense" or "mxfp4", the release's packed form, drawn directly in it)."""
    from dflash_jax.pair import Pair, check_pair  # pair sits above the models and this module's callers

    cfg = cfg or tiny_qwen3_moe_config()
    dcfg = tiny_draft_config(cfg, **draft_overrides)
    check_pair(cfg, dcfg)
    target_w = family_of(cfg).random_weights(cfg, jax.random.key(seed), expert_format=expert_format)
    draft_w = random_draft_weights(dcfg, jax.random.key(seed + 1))
    if agreeable:
        target_w, draft_w = make_agreeable(target_w, draft_w)
    return Pair(target_cfg=cfg, target=target_w, draft_cfg=dcfg, draft=draft_w,
                manifest={"expert_format": expert_format, "tensors": {"target": {}}}, directory="")
