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

Then, optionally, the selector refit (`SelectorRefit`): the draft frozen, a fresh selector is fit alone on
precomputed examples of the whole corpus (`selector_data`: the draft's hidden state, top-K logits and candidates,
and the target's tokens at every scored block slot; `selector_refit_loss` is `objectives.selector_loss` on them),
thousands of examples a step, as the branch head is fit. The joint stage sees 16 blocks a step, and its selector
overfits a small corpus before it has seen enough of it; the refit can use a larger corpus and more candidates
(`top_k`) than the joint stage at little cost.

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
import numpy as np

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


#: The fields of one selector-refit example (`selector_examples`, `selector_data`), in batch order.
EXAMPLE_FIELDS = ("hidden", "unary", "candidates", "label_logit", "parent", "label", "w")


def selector_examples(draft: DraftWeights, target_w, tokens: jax.Array, features: jax.Array, anchors: jax.Array,
                      dcfg: DraftConfig, *, gamma: float, widths: jax.Array | None = None) -> tuple:
    """The selector refit's examples of one batch of blocks (the arguments of `objectives.dflash2_loss`): the
    draft's training forward (`objectives.scored_blocks`), then per block slot k >= 1 the draft's final-normed
    hidden state at k ("hidden" [N, B-1, H]), its top-`dcfg.selector_top_k` logits and their tokens ("unary",
    "candidates" [N, B-1, K]), the logit of the target's token ("label_logit"), the target's tokens at k - 1 and k
    ("parent", "label") and the slot weight ("w", 0 where the slot is not scored): `EXAMPLE_FIELDS`. On the scored
    slots, `selector_refit_loss` of these is `objectives.selector_loss` of the same forward."""
    from dflash_jax.train.objectives import scored_blocks

    logits, hidden, labels, w = scored_blocks(draft, target_w, tokens, features, anchors, dcfg,
                                               block_size=dcfg.block_size, gamma=gamma, widths=widths)
    logits = logits[:, 1:]
    unary, candidates = jax.lax.top_k(logits, dcfg.selector_top_k)
    label_logit = jnp.take_along_axis(logits, labels[:, 1:, None], axis=-1)[..., 0]
    return hidden[:, 1:], unary, candidates.astype(jnp.int32), label_logit, labels[:, :-1], labels[:, 1:], w[:, 1:]


def selector_data(target_w, tcfg, draft: DraftWeights, dcfg: DraftConfig, corpus, *, anchors_per_seq: int,
                  widths, prompt_len: int, gamma: float, seed: int, chunk: int = 32, moe_implementation: str = "auto",
                  progress: bool = True) -> dict:
    """`selector_examples` over the corpus rows [n, L] with the draft frozen: `anchors_per_seq` anchors per row in
    the continuation (after `prompt_len` tokens), each block at one of `widths`; the scored slots kept, flattened
    into {field: [M, ...]} (`EXAMPLE_FIELDS`; "hidden" in fp16). Deterministic in `seed`."""
    import time

    from dflash_jax.models import draft as draft_model
    from dflash_jax.models.family import family_of
    from dflash_jax.train.objectives import sample_anchors

    fam = family_of(tcfg)
    block = dcfg.block_size

    @jax.jit
    def examples(tokens, anchors, block_widths):
        cache = fam.init_cache(tcfg, tokens.shape[0], tokens.shape[1])
        out = fam.forward(target_w, tokens, cache, tcfg, tap_layers=dcfg.target_layer_ids, logits="none",
                          implementation=moe_implementation)
        got = selector_examples(draft, target_w, tokens, draft_model.context_features(out.taps), anchors, dcfg,
                                gamma=gamma, widths=block_widths)
        return (got[0].astype(jnp.float16),) + got[1:]

    rng = np.random.default_rng([seed, 3])
    length = corpus.shape[1]
    parts = {k: [] for k in EXAMPLE_FIELDS}
    t0 = time.perf_counter()
    for i in range(0, len(corpus), chunk):
        rows = corpus[i: i + chunk]
        anchors = sample_anchors(rng, len(rows), anchors_per_seq, prompt_len - 1, length - block)
        block_widths = rng.choice(np.asarray(widths, np.int32), (len(rows), anchors_per_seq))
        got = [np.asarray(x) for x in examples(jnp.asarray(rows), jnp.asarray(anchors), jnp.asarray(block_widths))]
        keep = got[-1] > 0  # scored slots only
        for k, x in zip(EXAMPLE_FIELDS, got):
            parts[k].append(x[keep])
        if progress and (i // chunk) % 32 == 0:
            print(f"[dflash2] selector examples from {i + len(rows)}/{len(corpus)} rows "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return {k: np.concatenate(v) for k, v in parts.items()}


def selector_refit_loss(selector: SelectorWeights, batch):
    """`objectives.selector_loss` on precomputed examples (`selector_examples` / `selector_data`, the draft
    frozen; any leading shape): the K-way cross-entropy over the top-K candidates, the target's token (with its
    own logit) replacing the last one when it is missing, weighted by the slot weights; the same metrics."""
    from dflash_jax.models import draft as draft_model

    hidden, unary, candidates, label_logit, parent, label, w = batch
    present = jnp.any(candidates == label[..., None], axis=-1)
    last = jnp.where(present, candidates[..., -1], label)
    candidates = jnp.concatenate([candidates[..., :-1], last[..., None]], axis=-1)
    unary = jnp.concatenate([unary[..., :-1], jnp.where(present, unary[..., -1], label_logit)[..., None]], axis=-1)
    target = jnp.argmax(candidates == label[..., None], axis=-1)
    scores = unary + draft_model.selector_transition(selector, hidden.astype(jnp.float32), parent, candidates)
    nll = jax.nn.logsumexp(scores, axis=-1) - jnp.take_along_axis(scores, target[..., None], axis=-1)[..., 0]
    scored = w > 0
    mean = lambda x: jnp.sum(jnp.where(scored, x, 0.0)) / jnp.sum(scored)  # noqa: E731
    return jnp.sum(nll * w) / jnp.sum(w), {"sel_ce": mean(nll), "sel_acc": mean(jnp.argmax(scores, -1) == target),
                                           "sel_hit": mean(present)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectorRefit:
    """The second stage of a DFlash 2 draft's training (`train_dflash2_from_pair(refit=...)`): after the joint
    training, the draft is frozen and a fresh selector (`init_selector`) is fit alone on `selector_data` examples
    of the whole corpus (`anchors_per_seq` anchors per row at the recipe's block widths), `steps` AdamW steps of
    `batch` examples at `learning_rate`, as the branch head is fit. The joint stage trains the selector on 16
    blocks a step; the refit sees the corpus's examples thousands at a time, for a few seconds a hundred steps."""

    steps: int = 2000
    batch: int = 4096
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    anchors_per_seq: int = 16
    seed: int = 0
    # the refit's corpus: the first `prompts` greedy continuations (None: the joint stage's `recipe.prompts`; more
    # rows extend the corpus, whose first `recipe.prompts` rows stay the joint stage's: the same windows' prefix)
    prompts: int | None = None
    # the selector's candidates per position (None: the recipe's `selector_top_k`); the refit's selector is fresh,
    # so it may keep more candidates than the joint stage trained with
    top_k: int | None = None


def fit_selector(selector: SelectorWeights, data: dict, *, steps: int, batch: int, learning_rate: float,
                 weight_decay: float = 0.1, seed: int = 0, progress: bool = True):
    """Trains `selector` on `selector_data` examples (`selector_refit_loss`; AdamW with warm-up and cosine decay,
    minibatches drawn from the step's seed, like the branch head's fit). Returns (selector, per-step losses)."""
    from dflash_jax.train.common import TrainConfig, batch_rng, train_loop

    n = len(data["label"])

    def next_batch(step):
        ix = np.sort(batch_rng(seed, step).integers(0, n, batch))
        return tuple(jnp.asarray(data[k][ix]) for k in EXAMPLE_FIELDS)

    cfg = TrainConfig(steps=steps, learning_rate=learning_rate, warmup_steps=min(100, steps // 10 + 1),
                      weight_decay=weight_decay, seed=seed, log_every=max(steps // 20, 1))
    return train_loop(selector, selector_refit_loss, next_batch, cfg, checkpoint_dir=None, desc="selector",
                      progress=progress)


def train_dflash2_from_pair(pair, work: str, *, recipe=None, refit: SelectorRefit | None = None,
                            progress: bool = True) -> dict:
    """Trains a DFlash 2 draft for a converted pair trained by `train.tiny_pair` (its tokenizer and split), starting
    from the pair's DFlash 1 draft (`as_dflash2`): the training files' token stream (`work/train_tokens.npy`), the
    pair's target's greedy continuations of `recipe.prompts` windows (`work/continuations.npy`), then
    `recipe.draft_steps` steps of `dflash2_loss` (resumable from `work/draft_ckpt`), then, with `refit`, the
    selector refit on the frozen draft (`SelectorRefit`). The draft is written in the z-lab layout to
    `work/hf_draft` (`export.save_hf_draft`; `convert-weights` reads it back with the pair's HF target). Returns a
    summary (recipe, refit, losses, seconds)."""
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
    rows = max(recipe.prompts, (refit.prompts or 0) if refit is not None else 0)
    corpus = tiny_pair.greedy_corpus(work, pair.target, pair.target_cfg, streams["train"],
                                     dataclasses.replace(recipe, prompts=rows), progress)
    if len(corpus) < rows:
        raise ValueError(f"{work}/continuations.npy holds {len(corpus)} continuations, this run needs {rows}: "
                         "remove it to build the larger corpus (its first rows come out the same)")
    seconds = {"tokens_and_corpus": round(time.perf_counter() - t0, 1)}
    t = time.perf_counter()
    cfg = recipe.draft_config(pair.draft_cfg)
    init = as_dflash2(pair.draft.replace(branch_head=None), cfg, jax.random.key(recipe.seed + 2))
    dcfg, draft, losses = tiny_pair.train_draft(work, pair.target, pair.target_cfg, corpus[: recipe.prompts], recipe,
                                                progress, init=(cfg, init))
    seconds["draft"] = round(time.perf_counter() - t, 1)
    summary = {"recipe": dataclasses.asdict(recipe), "draft_loss": {"first": losses[:1], "last": losses[-1:]},
               "corpus_rows": int(recipe.prompts)}
    if refit is not None:
        t = time.perf_counter()
        if refit.top_k is not None:
            dcfg = dataclasses.replace(dcfg, selector_top_k=refit.top_k)
        data = selector_data(pair.target, pair.target_cfg, draft, dcfg, corpus[: refit.prompts or recipe.prompts],
                             anchors_per_seq=refit.anchors_per_seq, widths=recipe.block_widths,
                             prompt_len=recipe.prompt_len, gamma=recipe.gamma, seed=refit.seed,
                             moe_implementation=recipe.moe_implementation, progress=progress)
        seconds["selector_examples"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        fresh = init_selector(dcfg, jax.random.key(refit.seed + 7), draft.fc.dtype)
        selector, sel_losses = fit_selector(fresh, data, steps=refit.steps, batch=refit.batch,
                                            learning_rate=refit.learning_rate, weight_decay=refit.weight_decay,
                                            seed=refit.seed, progress=progress)
        draft = draft.replace(branch_head=selector)
        seconds["selector_refit"] = round(time.perf_counter() - t, 1)
        summary["selector_refit"] = {**dataclasses.asdict(refit), "corpus_rows": int(refit.prompts or recipe.prompts),
                                     "examples": int(len(data["label"])),
                                     "loss": {"first": sel_losses[:1], "last": sel_losses[-1:]}}
    save_hf_draft(draft, dcfg, os.path.join(work, "hf_draft"))
    summary["stage_seconds"] = seconds
    return summary


def train_dflash2_pair(pair, work: str, out: str, *, convert, recipe=None, refit: SelectorRefit | None = None,
                       progress: bool = True) -> dict:
    """`train_dflash2_from_pair`, then the DFlash 2 pair converted to `out` by `convert` (`convert.convert`: the
    `convert` package builds on `dflash_jax`, so it is passed in): the pair's target written back in the HF
    layout (it needs dense expert tables: load the pair with `dequantize_experts=True`; MXFP4 tables round-trip
    exactly) with the trained draft, the pair's tokenizer and split.json, and the summary as train_summary.json;
    made portable (`tiny_pair.make_portable`). Returns the summary."""
    import json

    from dflash_jax.train.export import save_hf_target
    from dflash_jax.train.tiny_pair import EOS_ID, make_portable

    summary = train_dflash2_from_pair(pair, work, recipe=recipe, refit=refit, progress=progress)
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
