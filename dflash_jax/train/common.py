"""A small resumable optax training loop: orbax checkpoints every `save_every` steps, a fixed seed,
progress with the running loss."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    save_every: int = 200
    seed: int = 0
    log_every: int = 25


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, max(cfg.steps, 1),
                                                  cfg.learning_rate * 0.05)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))


def train_loop(
    params: Any,
    loss_fn: Callable[[Any, Any], tuple[jax.Array, dict]],
    next_batch: Callable[[int], Any],
    cfg: TrainConfig,
    *,
    checkpoint_dir: str | None,
    desc: str,
    progress: bool = True,
) -> tuple[Any, list[float]]:
    """Minimizes `loss_fn(params, batch)`; resumes from the latest checkpoint in `checkpoint_dir`.

    `next_batch(step)` must be a pure function of the step (seeded from it), so a resumed run sees the same
    batches as an uninterrupted one. Returns (params, per-step losses of this run).
    """
    opt = make_optimizer(cfg)
    opt_state = opt.init(params)
    start = 0
    manager = None
    if checkpoint_dir:
        manager = ocp.CheckpointManager(os.path.abspath(checkpoint_dir),
                                        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
        latest = manager.latest_step()
        if latest is not None:
            abstract = {"params": params, "opt_state": opt_state}
            restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
            params, opt_state, start = restored["params"], restored["opt_state"], latest

    @jax.jit
    def step_fn(params, opt_state, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, aux

    losses: list[float] = []
    bar = None
    if progress:
        bar = tqdm(total=cfg.steps, initial=start, desc=desc, unit="step")
    for step in range(start, cfg.steps):
        params, opt_state, loss, aux = step_fn(params, opt_state, next_batch(step))
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            losses.append(float(loss))
            if bar:
                bar.set_postfix(loss=f"{float(loss):.3f}", **{k: f"{float(v):.3f}" for k, v in aux.items()})
        if bar:
            bar.update(1)
        if manager and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps):
            manager.save(step + 1, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    if bar:
        bar.close()
    if manager:
        manager.wait_until_finished()
        manager.close()
    return params, losses


def batch_rng(seed: int, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, step])


def cast_tree(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)
