"""Training DFlash 2 drafts (docs/dflash2.md): their starting point and the upgrade of a trained DFlash 1 draft.

A fresh DFlash 2 draft computes what its DFlash 1 backbone computes:
  - every convolution starts as the identity: base kernel tap 0 = 1, every other tap 0, dynamic projection 0,
    so `conv(x) = x` before and after each sublayer;
  - the selector's successor codebook starts at 0, so every transition score is the draft's own logit and the
    selector chain is the draft's argmax chain (restricted to its top-K, which holds the argmax). The predecessor
    codebook and the hidden projection start random, so the successor codebook gets gradient from the first step.
So a trained DFlash 1 draft upgrades losslessly (`as_dflash2`), and training goes on from there with
`objectives.dflash2_loss`: the draft's block loss plus the selector's K-way cross-entropy over its top-K
candidates (the target's token injected when missing).

`train_dflash2_from_pair` does that for a converted pair: the same corpus recipe as the pair's own draft (the
target's greedy continuations of windows of the training files, `train.tiny_pair`), the pair's DFlash 1 draft as
the starting point.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp

from dflash_jax.models.draft.config import DraftConfig
from dflash_jax.models.draft import ConvWeights, DraftWeights, LayerConvs, SelectorWeights

#: The DFlash 2 fields the recipes use for the small pairs (4 taps, one dynamic kernel per 16 channels, rank-32
#: codebooks, 8 candidates per position).
DEFAULT_FIELDS = dict(conv_kernel_size=4, conv_group_size=16, selector_rank=32, selector_top_k=8)


def dflash2_config(cfg: DraftConfig, **fields) -> DraftConfig:
    """`cfg` as a DFlash 2 draft config (version 2) with `fields` over `DEFAULT_FIELDS`."""
    unknown = sorted(set(fields) - set(DEFAULT_FIELDS))
    if unknown:
        raise ValueError(f"{unknown}: the DFlash 2 fields are {sorted(DEFAULT_FIELDS)}")
    return dataclasses.replace(cfg, version=2, **{**DEFAULT_FIELDS, **fields})


def identity_conv(cfg: DraftConfig, dtype=jnp.float32) -> ConvWeights:
    """A convolution that returns its input (`prepare` and `finish` alike): tap 0 = 1, other taps and the
    dynamic projection 0."""
    h, k, groups = cfg.hidden_size, cfg.conv_kernel_size, cfg.hidden_size // cfg.conv_group_size
    return ConvWeights(base=jnp.zeros((2, k, h), dtype).at[:, 0].set(1.0),
                       projection=jnp.zeros((h, 2 * k * groups), dtype))


def init_selector(cfg: DraftConfig, key: jax.Array, dtype=jnp.float32) -> SelectorWeights:
    """A selector whose scores are the draft's logits (successor codebook 0), ready to learn."""
    r, h = cfg.selector_rank, cfg.hidden_size
    k1, k2 = jax.random.split(key)
    return SelectorWeights(predecessor=jax.random.normal(k1, (cfg.vocab_size, r), jnp.float32).astype(dtype),
                           successor=jnp.zeros((cfg.vocab_size, r), dtype),
                           projection=(jax.random.normal(k2, (h, r), jnp.float32) / h**0.5).astype(dtype))


def as_dflash2(weights: DraftWeights, cfg: DraftConfig, key: jax.Array) -> DraftWeights:
    """DFlash 1 draft weights as a DFlash 2 draft of config `cfg` (version 2) computing the same logits: identity
    convolutions and a fresh selector (`init_selector`); a branch head the weights carry is dropped (the selector
    takes its place)."""
    if not cfg.dflash2:
        raise ValueError("as_dflash2 needs a DFlash 2 config (dflash2_config(cfg))")
    if weights.convs is not None:
        raise ValueError("these weights are a DFlash 2 draft's already")
    dtype = weights.fc.dtype
    convs = tuple(LayerConvs(attention=identity_conv(cfg, dtype), mlp=identity_conv(cfg, dtype))
                  for _ in range(cfg.num_layers))
    return weights.replace(convs=convs, branch_head=init_selector(cfg, key, dtype))


def train_dflash2_from_pair(pair, work: str, *, recipe=None, progress: bool = True) -> dict:
    """Trains a DFlash 2 draft for a converted pair trained by `train.tiny_pair` (its tokenizer and split), starting
    from the pair's DFlash 1 draft (`as_dflash2`): the training files' token stream (`work/train_tokens.npy`), the
    pair's target's greedy continuations of `recipe.prompts` windows (`work/continuations.npy`), then
    `recipe.draft_steps` steps of `dflash2_loss` (resumable from `work/draft_ckpt`). The draft is written in the
    z-lab layout to `work/hf_draft` (`export.save_hf_draft`; `convert-weights` reads it back with the pair's HF
    target). Returns a summary (recipe, losses, seconds)."""
    import time

    from dflash_jax.train import tiny_pair
    from dflash_jax.train.export import save_hf_draft

    recipe = recipe or tiny_pair.Recipe(draft_version=2)
    if recipe.draft_version != 2:
        raise ValueError("train_dflash2_from_pair trains a DFlash 2 draft: Recipe(draft_version=2, ...)")
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    tok_path = os.path.join(work, "tokenizer.json")
    if not os.path.exists(tok_path):
        shutil.copy2(pair.tokenizer_path, tok_path)  # the pair's own tokenizer: build_tokens then only encodes
    _, streams = tiny_pair.build_tokens(work, progress)
    corpus = tiny_pair.greedy_corpus(work, pair.target, pair.target_cfg, streams["train"], recipe, progress)
    t_corpus = time.perf_counter() - t0
    cfg = recipe.draft_config(pair.draft_cfg)
    init = as_dflash2(pair.draft.replace(branch_head=None), cfg, jax.random.key(recipe.seed + 2))
    dcfg, draft, losses = tiny_pair.train_draft(work, pair.target, pair.target_cfg, corpus, recipe, progress,
                                                init=(cfg, init))
    save_hf_draft(draft, dcfg, os.path.join(work, "hf_draft"))
    return {"recipe": dataclasses.asdict(recipe), "draft_loss": {"first": losses[:1], "last": losses[-1:]},
            "corpus_rows": int(len(corpus)), "stage_seconds": {"tokens_and_corpus": round(t_corpus, 1),
                                                               "draft": round(time.perf_counter() - t0 - t_corpus, 1)}}


def train_dflash2_pair(pair, work: str, out: str, *, convert, recipe=None, progress: bool = True) -> dict:
    """`train_dflash2_from_pair`, then the DFlash 2 pair converted to `out` by `convert` (`convert.convert`: the
    `convert` package builds on `dflash_jax`, so it is passed in): the pair's target written back in the HF
    layout (it needs dense expert tables: load the pair with `dequantize_experts=True`; MXFP4 tables round-trip
    exactly) with the trained draft, the pair's tokenizer and split.json, and the summary as train_summary.json;
    made portable (`tiny_pair.make_portable`). Returns the summary."""
    import json

    from dflash_jax.train.export import save_hf_target
    from dflash_jax.train.tiny_pair import EOS_ID, make_portable

    summary = train_dflash2_from_pair(pair, work, recipe=recipe, progress=progress)
    hf_target = os.path.join(work, "hf_target")
    eos = pair.target_cfg.eos_token_ids[0] if pair.target_cfg.eos_token_ids else EOS_ID
    save_hf_target(pair.target, pair.target_cfg, hf_target, eos_token_id=eos)
    shutil.copy2(pair.tokenizer_path, os.path.join(hf_target, "tokenizer.json"))
    summary["started_from"] = os.path.basename(os.path.normpath(pair.directory))
    with open(os.path.join(work, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    convert(hf_target, os.path.join(work, "hf_draft"), out, expert_format=pair.expert_format, dtype="fp32",
            overwrite=True, progress=progress)
    shutil.copy2(os.path.join(pair.directory, "split.json"), os.path.join(out, "split.json"))
    shutil.copy2(os.path.join(work, "summary.json"), os.path.join(out, "train_summary.json"))
    make_portable(out)
    return summary
