"""The small trained pairs: an MoE target of any registered family (Qwen3-MoE for the shipped pair,
Qwen3.5-MoE for the hybrid one) trained on the Python standard library's source, and its DFlash draft
trained on the target's own greedy continuations.

Stages (each resumable: a finished stage's output is reused, an interrupted training resumes from its
last orbax checkpoint):
  1. tokenizer   byte-level BPE on the training files            -> work/tokenizer.json
  2. tokens      token streams of the training / held-out files   -> work/{train,heldout}_tokens.npy
  3. target      LM loss + load balancing, optax AdamW            -> work/hf_target (HF layout)
  4. corpus      the target's greedy continuations of training windows -> work/continuations.npy
  5. draft       the DFlash objective on those continuations      -> work/hf_draft (HF layout)
                 (`Recipe(draft_version=2)`: a DFlash 2 draft, its convolutions starting as the identity and its
                 candidate selector trained jointly, `train.dflash2`, `objectives.dflash2_loss`)
  6. convert     convert-weights (MXFP4 experts)                 -> out

Stage 6 runs the converter the caller passes (`convert=convert.convert`): the `convert` package builds on
`dflash_jax`, so `dflash_jax` never imports it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from dflash_jax.config import RopeConfig
from dflash_jax.models.draft.config import DraftConfig
from dflash_jax.decode import greedy_generate
from dflash_jax.models import draft as draft_model
from dflash_jax.models.family import families, family_named, family_of
from dflash_jax.testing import random_draft_weights, random_qwen3_weights
from dflash_jax.train import data
from dflash_jax.train.common import TrainConfig, batch_rng, train_loop
from dflash_jax.train.dflash2 import DEFAULT_FIELDS, as_dflash2, dflash2_config
from dflash_jax.train.export import save_hf_draft, save_hf_target
from dflash_jax.train.objectives import dflash2_loss, dflash_loss, lm_loss, sample_anchors

VOCAB = 1024
EOS_ID, MASK_ID = VOCAB - 2, VOCAB - 1


def target_config(num_experts: int = 8, top_k: int = 2, expert_intermediate: int = 256):
    """The shipped pair's Qwen3-MoE target shape (the qwen3 family's `small_config`)."""
    return family_named("qwen3").small_config(vocab_size=VOCAB, eos_id=EOS_ID, num_experts=num_experts, top_k=top_k,
                                             expert_intermediate=expert_intermediate)


def hybrid_target_config(num_experts: int = 8, top_k: int = 2, expert_intermediate: int = 256):
    """The hybrid pair's Qwen3.5-MoE target shape (the qwen3_5 family's `small_config`)."""
    return family_named("qwen3_5").small_config(vocab_size=VOCAB, eos_id=EOS_ID, num_experts=num_experts,
                                               top_k=top_k, expert_intermediate=expert_intermediate)


def draft_config(block_size: int = 16) -> DraftConfig:
    return DraftConfig(
        model_type="qwen3", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=384, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0, rotary_dim=32),
        target_layer_ids=(0, 1, 2), mask_token_id=MASK_ID, block_size=block_size, num_target_layers=4,
        vocab_size=VOCAB, max_position_embeddings=4096,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    target_steps: int = 1000
    target_batch: int = 8
    target_seq: int = 256
    target_lr: float = 3e-3
    prompts: int = 8192
    prompt_len: int = 64
    continuation: int = 192
    draft_steps: int = 3000
    draft_batch: int = 16
    anchors_per_seq: int = 16
    draft_lr: float = 3e-3
    gamma: float = 7.0
    block_widths: tuple[int, ...] = (4, 8, 16)  # each training block acts as one of these widths (uniform)
    seed: int = 0
    num_experts: int = 8
    top_k: int = 2
    expert_intermediate: int = 256
    moe_implementation: str = "auto"  # "dense" trains many small experts faster on CPU (`nn.moe`)
    family: str = "qwen3"  # the target's registered family (its `small_config` is the target's shape)
    # the draft: 1 (DFlashDraftModel) or 2 (DFlash2DraftModel: the four fields below, and the selector's K-way
    # cross-entropy added to the draft's loss with weight `selector_weight`)
    draft_version: int = 1
    conv_kernel_size: int = DEFAULT_FIELDS["conv_kernel_size"]
    conv_group_size: int = DEFAULT_FIELDS["conv_group_size"]
    selector_rank: int = DEFAULT_FIELDS["selector_rank"]
    selector_top_k: int = DEFAULT_FIELDS["selector_top_k"]
    selector_weight: float = 1.0

    def draft_config(self, base: DraftConfig | None = None) -> DraftConfig:
        """The draft's config: `base` (default: `draft_config()`) as this recipe's draft version."""
        base = base or draft_config()
        if self.draft_version == 1:
            return base
        if self.draft_version != 2:
            raise ValueError(f"Recipe.draft_version is 1 or 2, got {self.draft_version!r}")
        return dflash2_config(base, **{k: getattr(self, k) for k in DEFAULT_FIELDS})

    def target_config(self):
        trainable = sorted(f.name for f in families() if f.small_config_fn is not None)
        if self.family not in trainable:
            raise ValueError(f"Recipe.family must be one of {trainable}, got {self.family!r}")
        return family_named(self.family).small_config(vocab_size=VOCAB, eos_id=EOS_ID, num_experts=self.num_experts,
                                                      top_k=self.top_k, expert_intermediate=self.expert_intermediate)

    @classmethod
    def quick(cls) -> "Recipe":
        """A smoke-test recipe (seconds): the same stages at toy sizes."""
        return cls(target_steps=6, target_batch=2, target_seq=64, prompts=4, prompt_len=16, continuation=48,
                   draft_steps=6, draft_batch=2, anchors_per_seq=2)

    @classmethod
    def hybrid(cls) -> "Recipe":
        """The hybrid pair (`dflash_jax/assets/tiny_pair_qwen3_5`): a Qwen3.5-MoE target (DeltaNet + gated
        attention + shared expert) and its draft on the same corpus and tokenizer, with a much shorter
        schedule than the Qwen3-MoE pair's (300 target steps, 1024 greedy continuations, 300 draft steps:
        sized to finish in well under an hour on 2 shared CPU cores; see its train_summary.json)."""
        return cls(family="qwen3_5", target_steps=300, prompts=1024, draft_steps=1200)

    @classmethod
    def route_study(cls) -> "Recipe":
        """A pair with many small experts (64, top-4: the expert count / top-k ratio of the real MoE targets is
        what makes route prediction hard) for the route-ahead predictor study (`benchmarks/route_ahead.py`);
        shorter than the shipped pair's recipe (~20 minutes on 2 CPU cores)."""
        return cls(num_experts=64, top_k=4, expert_intermediate=32, moe_implementation="dense", target_steps=600,
                   prompts=1024, draft_steps=800)


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(f"[train_tiny_pair] {msg}", flush=True)


def build_tokens(work: str, progress: bool):
    tok_path = os.path.join(work, "tokenizer.json")
    train_files, held_files = data.stdlib_files()
    if not os.path.exists(tok_path):
        _log(f"training the BPE tokenizer on {len(train_files)} stdlib files ({len(held_files)} held out)", progress)
        data.train_tokenizer(train_files, VOCAB, tok_path)
    tok = Tokenizer.from_file(tok_path)
    streams = {}
    for name, files in (("train", train_files), ("heldout", held_files)):
        path = os.path.join(work, f"{name}_tokens.npy")
        if not os.path.exists(path):
            _log(f"encoding {len(files)} {name} files", progress)
            np.save(path, data.encode_files(tok, files))
        streams[name] = np.load(path)
    with open(os.path.join(work, "split.json"), "w") as fh:
        root = data.stdlib_root()
        json.dump({"held_out_files": sorted(os.path.relpath(f, root) for f in held_files),
                   "train_files": len(train_files)}, fh, indent=1)
    return tok, streams


def train_target(work: str, stream: np.ndarray, recipe: Recipe, progress: bool):
    cfg = recipe.target_config()
    if recipe.family == "qwen3":
        params = random_qwen3_weights(cfg, jax.random.key(recipe.seed), norm_jitter=0.0)
    else:
        params = family_of(cfg).random_weights(cfg, jax.random.key(recipe.seed))

    def next_batch(step):
        return jnp.asarray(data.random_windows(stream, batch_rng(recipe.seed, step), recipe.target_batch,
                                               recipe.target_seq))

    tc = TrainConfig(steps=recipe.target_steps, learning_rate=recipe.target_lr, seed=recipe.seed,
                     warmup_steps=min(100, recipe.target_steps // 10 + 1))
    params, losses = train_loop(params, lambda p, b: lm_loss(p, b, cfg, implementation=recipe.moe_implementation),
                                next_batch, tc,
                                checkpoint_dir=os.path.join(work, "target_ckpt"), desc="target", progress=progress)
    return cfg, params, losses


def greedy_corpus(work: str, params, cfg, stream: np.ndarray, recipe: Recipe, progress: bool):
    """The target's own greedy continuations of random training windows (what the draft will face)."""
    path = os.path.join(work, "continuations.npy")
    if os.path.exists(path):
        return np.load(path)
    rng = np.random.default_rng([recipe.seed, 10**6])
    prompts = data.random_windows(stream, rng, recipe.prompts, recipe.prompt_len)
    rows = []
    chunk = 256
    for i in range(0, len(prompts), chunk):
        _log(f"greedy continuations {i}/{len(prompts)}", progress)
        out = greedy_generate(params, cfg, prompts[i: i + chunk].tolist(), max_new_tokens=recipe.continuation,
                              implementation=recipe.moe_implementation)
        for p, o in zip(prompts[i: i + chunk], out):
            o = (o + [EOS_ID] * recipe.continuation)[: recipe.continuation]  # a stop token ends a row early
            rows.append(np.concatenate([p, o]))
    corpus = np.stack(rows).astype(np.int32)
    np.save(path, corpus)
    return corpus


def train_draft(work: str, target_params, tcfg, corpus: np.ndarray, recipe: Recipe, progress: bool, *, init=None):
    """The draft stage. init: (config, starting weights) (default: `recipe.draft_config()` and random DFlash 1
    weights, made a DFlash 2 draft with identity convolutions and a fresh selector when `recipe.draft_version` is
    2, `train.dflash2.as_dflash2`)."""
    if init is None:
        dcfg = recipe.draft_config()
        params = random_draft_weights(draft_config(), jax.random.key(recipe.seed + 1), norm_jitter=0.0)
        if dcfg.dflash2:
            params = as_dflash2(params, dcfg, jax.random.key(recipe.seed + 2))
    else:
        dcfg, params = init
        if dcfg.dflash2 != (params.convs is not None):
            raise ValueError("train_draft(init=(cfg, weights)): DFlash 2 weights need a DFlash 2 config and DFlash 1 "
                             "weights a DFlash 1 config")
    block = dcfg.block_size
    length = corpus.shape[1]

    fam = family_of(tcfg)

    @jax.jit
    def features(tokens):
        cache = fam.init_cache(tcfg, tokens.shape[0], tokens.shape[1])
        out = fam.forward(target_params, tokens, cache, tcfg, tap_layers=dcfg.target_layer_ids, logits="none",
                            implementation=recipe.moe_implementation)
        return draft_model.context_features(out.taps)

    # The target is frozen: its taps over the whole corpus are computed once (a few minutes), not per step.
    chunk = 64
    feats = np.empty((len(corpus), length, dcfg.num_taps * tcfg.hidden_size), np.float32)
    for i in range(0, len(corpus), chunk):
        if i % (chunk * 16) == 0:
            _log(f"target features {i}/{len(corpus)}", progress)
        feats[i: i + chunk] = np.asarray(features(jnp.asarray(corpus[i: i + chunk])))

    def next_batch(step):
        rng = batch_rng(recipe.seed + 1, step)
        rows = rng.integers(0, len(corpus), recipe.draft_batch)
        # anchors in the continuation: the text the draft proposes at inference is the target's own
        anchors = sample_anchors(rng, recipe.draft_batch, recipe.anchors_per_seq, recipe.prompt_len - 1, length - block)
        # one draft serves every block size <= its trained one: blocks are scored at mixed widths
        widths = rng.choice(np.asarray(recipe.block_widths, np.int32), (recipe.draft_batch, recipe.anchors_per_seq))
        return jnp.asarray(corpus[rows]), jnp.asarray(feats[rows]), jnp.asarray(anchors), jnp.asarray(widths)

    def loss(p, batch):
        tokens, taps, anchors, widths = batch
        if dcfg.dflash2:
            return dflash2_loss(p, target_params, tokens, taps, anchors, dcfg, block_size=block, gamma=recipe.gamma,
                                widths=widths, selector_weight=recipe.selector_weight)
        return dflash_loss(p, target_params, tokens, taps, anchors, dcfg, block_size=block, gamma=recipe.gamma,
                           widths=widths)

    tc = TrainConfig(steps=recipe.draft_steps, learning_rate=recipe.draft_lr, seed=recipe.seed + 1,
                     warmup_steps=min(100, recipe.draft_steps // 10 + 1))
    params, losses = train_loop(params, loss, next_batch, tc, checkpoint_dir=os.path.join(work, "draft_ckpt"),
                                desc="draft", progress=progress)
    return dcfg, params, losses


def train_tiny_pair(work: str, out: str | None, *, recipe: Recipe = Recipe(), progress: bool = True,
                    convert: Callable[..., Any] | None = None) -> dict:
    """Runs every stage; returns a summary (losses, sizes, timings). `out` gets the pair converted by `convert`
    (`convert.convert`, required with `out`; see the module doc)."""
    if out and convert is None:
        raise ValueError("train_tiny_pair(out=...) converts the trained pair: pass convert=convert.convert")
    block = draft_config().block_size
    bad = [w for w in recipe.block_widths if not 2 <= w <= block]
    if bad:
        raise ValueError(f"block_widths {bad} outside [2, {block}] (2 up to the draft's block size)")
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    stage_seconds = {}

    def stage_done(name, since):
        stage_seconds[name] = round(time.perf_counter() - since, 1)
        return time.perf_counter()

    tok, streams = build_tokens(work, progress)
    t = stage_done("tokens", t0)
    tcfg, target, target_losses = train_target(work, streams["train"], recipe, progress)
    t = stage_done("target", t)
    hf_target = os.path.join(work, "hf_target")
    save_hf_target(target, tcfg, hf_target, eos_token_id=EOS_ID)
    shutil.copy2(os.path.join(work, "tokenizer.json"), os.path.join(hf_target, "tokenizer.json"))
    corpus = greedy_corpus(work, target, tcfg, streams["train"], recipe, progress)
    t = stage_done("corpus", t)
    dcfg, draft, draft_losses = train_draft(work, target, tcfg, corpus, recipe, progress)
    t = stage_done("draft_with_features", t)
    hf_draft = os.path.join(work, "hf_draft")
    save_hf_draft(draft, dcfg, hf_draft)
    summary = {
        "recipe": dataclasses.asdict(recipe),
        "target_loss": {"first": target_losses[:1], "last": target_losses[-1:]},
        "draft_loss": {"first": draft_losses[:1], "last": draft_losses[-1:]},
        "train_tokens": int(len(streams["train"])), "heldout_tokens": int(len(streams["heldout"])),
        "seconds": round(time.perf_counter() - t0, 1),
        "stage_seconds": stage_seconds,  # of this run (a resumed run counts only what it redid)
    }
    with open(os.path.join(work, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    if out:
        convert(hf_target, hf_draft, out, expert_format="mxfp4", dtype="fp32", overwrite=True, progress=progress)
        shutil.copy2(os.path.join(work, "split.json"), os.path.join(out, "split.json"))
        shutil.copy2(os.path.join(work, "summary.json"), os.path.join(out, "train_summary.json"))
        make_portable(out)
    return summary


def make_portable(pair_dir: str) -> None:
    """Strips what names the machine a pair was converted on, so it can ship: the manifest's source paths
    become the source directories' names (their files' sha256 stay), and orbax's commit_success.txt
    markers (which hold the absolute write path; only object stores need them) are removed."""
    from dflash_jax.checkpoint import write_manifest

    path = os.path.join(pair_dir, "manifest.json")
    with open(path) as fh:
        manifest = json.load(fh)
    sources = manifest.get("sources", {})
    for key in ("target", "draft"):
        if isinstance(sources.get(key), str):
            sources[key] = os.path.basename(os.path.normpath(sources[key]))
    write_manifest(pair_dir, manifest)  # sealed again: its digest covers the rewritten sources
    for root, _, files in os.walk(pair_dir):
        if "commit_success.txt" in files:
            os.remove(os.path.join(root, "commit_success.txt"))
