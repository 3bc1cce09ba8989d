"""Fitting a draft's branch head (`models.draft.BranchHeadWeights`) on its pair's own greedy paths.

Data: the target's greedy continuations of training prompts (what the draft faces at inference); for
anchors s along each continuation, one teacher-forced draft forward over [x_s, MASK x (B-1)] with the
target's taps before s as context (`draft_forward_blocks`, exactly the inference view), keeping the draft's
final-normed hidden state h_k at every block position k = 1..B-1. An example is (h_k, x_{k-1}, x_k): the
head learns P(x_k | h_k, x_{k-1}) where the path up to k - 1 is the target's, the probability a token tree
ranks a node by. The draft and the target stay frozen; only the head's two matrices train.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode import greedy_generate
from dflash_jax.models import draft as draft_model
from dflash_jax.models.family import family_of
from dflash_jax.train.common import TrainConfig, batch_rng, train_loop


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(f"[branch-head] {msg}", flush=True)


def branch_head_data(pair, prompts: Sequence[Sequence[int]], *, continuation: int = 96, anchors_per_seq: int = 32,
                     seed: int = 0, chunk: int = 64, progress: bool = True) -> dict[str, np.ndarray]:
    """Teacher-forced examples from `prompts` (equal lengths): the target's greedy continuation of each, then
    `anchors_per_seq` random anchors per sequence in the continuation (0: every anchor). Returns
    {"hidden" [M, H] float16, "parent" [M] int32, "label" [M] int32} with M = sequences x anchors x (B-1)."""
    tcfg, dcfg = pair.target_cfg, pair.draft_cfg
    fam = family_of(tcfg)
    block = dcfg.block_size
    plen = len(prompts[0])
    if any(len(p) != plen for p in prompts):
        raise ValueError("branch_head_data needs prompts of one length")
    if continuation < block:
        raise ValueError(f"continuation {continuation} is shorter than the draft's block {block}")
    eos = tcfg.eos_token_ids[0] if getattr(tcfg, "eos_token_ids", None) else 0

    @jax.jit
    def hidden_at(tokens, anchors):
        cache = fam.init_cache(tcfg, tokens.shape[0], tokens.shape[1])
        out = fam.forward(pair.target, tokens, cache, tcfg, tap_layers=dcfg.target_layer_ids, logits="none")
        offsets = anchors[..., None] + jnp.arange(block)
        labels = jnp.take_along_axis(tokens[:, None, :], offsets, axis=-1)  # [n, A, B]
        blocks = jnp.where(jnp.arange(block) == 0, labels, dcfg.mask_token_id).astype(jnp.int32)
        _, hid = draft_model.draft_forward_blocks(
            pair.draft, dcfg, embed=pair.target.embed, lm_head=pair.target.lm_head, block_tokens=blocks,
            context_features=draft_model.context_features(out.taps), anchors=anchors)
        return hid[:, :, 1:], labels

    rng = np.random.default_rng(seed)
    hs, ps, ys = [], [], []
    t0 = time.time()
    for i in range(0, len(prompts), chunk):
        part = [list(p) for p in prompts[i: i + chunk]]
        outs = greedy_generate(pair.target, tcfg, part, max_new_tokens=continuation)
        toks = np.stack([np.asarray(p + (o + [eos] * continuation)[:continuation], np.int32)
                         for p, o in zip(part, outs)])
        lo, hi = plen - 1, plen + continuation - block  # anchors whose block lies in the continuation
        if anchors_per_seq == 0:
            anchors = np.broadcast_to(np.arange(lo, hi + 1, dtype=np.int32), (len(part), hi - lo + 1))
        else:
            anchors = rng.integers(lo, hi + 1, (len(part), anchors_per_seq)).astype(np.int32)
        hid, lab = hidden_at(jnp.asarray(toks), jnp.asarray(anchors))
        hid, lab = np.asarray(hid), np.asarray(lab)
        hs.append(hid.reshape(-1, hid.shape[-1]).astype(np.float16))
        ps.append(lab[..., :-1].reshape(-1))
        ys.append(lab[..., 1:].reshape(-1))
        _log(f"examples from {min(i + chunk, len(prompts))}/{len(prompts)} prompts ({time.time() - t0:.0f} s)",
             progress)
    return {"hidden": np.concatenate(hs), "parent": np.concatenate(ps).astype(np.int32),
            "label": np.concatenate(ys).astype(np.int32)}


def head_loss(head, dcfg, embed, lm_head, hidden, parent, label):
    """Mean cross-entropy of the head's distribution at the examples (and {"ce": it})."""
    logits = draft_model.branch_head_logits(head, hidden, parent, dcfg, embed=embed, lm_head=lm_head)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), label[:, None], axis=-1)[:, 0]
    ce = jnp.mean(nll)
    return ce, {"ce": ce}


def fit_branch_head(pair, data: dict[str, np.ndarray], *, steps: int = 3000, batch: int = 4096,
                    learning_rate: float = 3e-3, width: int | None = None, seed: int = 0,
                    progress: bool = True) -> tuple[draft_model.BranchHeadWeights, list[float]]:
    """Trains a fresh head (`init_branch_head`, starting as the marginals) on `branch_head_data` examples with
    AdamW (warm-up, cosine decay, clipped), minibatches drawn from the step's seed (deterministic). Returns
    (head, per-step losses)."""
    head = draft_model.init_branch_head(pair.draft_cfg.hidden_size, jax.random.key(seed), width=width)
    n = len(data["label"])

    def next_batch(step):
        ix = batch_rng(seed, step).integers(0, n, batch)
        return (pair.target.embed, pair.target.lm_head, jnp.asarray(data["hidden"][ix], jnp.float32),
                jnp.asarray(data["parent"][ix]), jnp.asarray(data["label"][ix]))

    cfg = TrainConfig(steps=steps, learning_rate=learning_rate, warmup_steps=min(100, steps // 10 + 1),
                      weight_decay=1e-4, seed=seed, log_every=max(steps // 20, 1))
    head, losses = train_loop(head, lambda p, b: head_loss(p, pair.draft_cfg, *b), next_batch, cfg, checkpoint_dir=None,
                              desc="branch head", progress=progress)
    return head, losses


def marginal_ce(pair, data: dict[str, np.ndarray], head=None, *, chunk: int = 65536) -> float:
    """Mean cross-entropy on `data` of the head (None: of the draft's marginals, i.e. a zero head)."""
    if head is None:
        head = draft_model.init_branch_head(pair.draft_cfg.hidden_size, jax.random.key(0), width=8)
    fn = jax.jit(lambda hw, e, lm, h, p, y: head_loss(hw, pair.draft_cfg, e, lm, h, p, y)[0] * y.shape[0])
    total = 0.0
    for i in range(0, len(data["label"]), chunk):
        total += float(fn(head, pair.target.embed, pair.target.lm_head, jnp.asarray(data["hidden"][i: i + chunk], jnp.float32),
                          jnp.asarray(data["parent"][i: i + chunk]), jnp.asarray(data["label"][i: i + chunk])))
    return total / len(data["label"])
