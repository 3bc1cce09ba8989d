"""Generation from a compressed prefill: the target prefills only the kept tokens, at their original positions.

The kept tokens fill cache slots 0 .. m-1 in order; RoPE reads their original positions (`models.decoder.forward`
with explicit `positions`), and the prefill leaves the caches a per-sequence `position_offset` (n - m, for a
prompt of n tokens whose last token is kept), so every later draft / verify row at slot s sits at position
s + offset: decoding continues at position n, as after the full prefill. Masks stay by slot (the kept tokens are
in order, so slot order is position order); DeltaNet layers see the kept tokens in order; gpt-oss sliding windows
count slots (W kept tokens, which may span more than W original positions). The DFlash draft's context is the
kept rows' taps at the same positions. Everything after the prefill is the ordinary speculative round
(`spec.session`), so DFlash over a compressed prefill equals plain greedy decoding over the same compressed
prefill, token for token. Lossy only in what the prefill drops.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import compile_cache
from dflash_jax.spec import requests as rq
from dflash_jax.spec.loop import LOOP_BUCKETS, GenerationResult, generation_result, run_loop, shape_stats
from dflash_jax.spec.sampling import SamplingParams
from dflash_jax.spec.session import Prepared, SpecConfig, SpecState, begin_arrays, prepare


@dataclasses.dataclass(frozen=True)
class CompressedBatch:
    """A prepared request batch of kept tokens (`prepared.tokens`, right-padded) with their original positions
    `positions` [b, T] int32 and each prompt's original length `prompt_lengths`."""

    prepared: Prepared
    positions: np.ndarray
    prompt_lengths: np.ndarray

    @property
    def spec(self) -> SpecConfig:
        return self.prepared.spec


def check_kept(prompts: Sequence[Sequence[int]], kept) -> list[np.ndarray]:
    """Each prompt's kept indices (None: every token), checked: strictly increasing, inside the prompt, the last
    token kept (decoding continues right after it)."""
    if kept is None:
        kept = [None] * len(prompts)
    if len(kept) != len(prompts):
        raise ValueError(f"kept must give one index list per prompt ({len(prompts)}), got {len(kept)}")
    out = []
    for i, (p, k) in enumerate(zip(prompts, kept)):
        n = len(p)
        k = np.arange(n, dtype=np.int64) if k is None else np.asarray(k).reshape(-1)
        if k.size == 0 or not np.issubdtype(k.dtype, np.integer):
            raise ValueError(f"kept[{i}] must be a non-empty list of integer token indices")
        if k[0] < 0 or k[-1] >= n or np.any(np.diff(k) <= 0):
            raise ValueError(f"kept[{i}] must be strictly increasing indices in [0, {n}) (pflash.compress gives them)")
        if k[-1] != n - 1:
            raise ValueError(f"kept[{i}] must keep the prompt's last token ({n - 1}): decoding continues after it")
        out.append(k.astype(np.int32))
    return out


def prepare_compressed(pair, prompts: Sequence[Sequence[int]], kept=None, *, block_size: int | None = None,
                       max_new_tokens, sampling=SamplingParams(), stop_ids=(), seed=0,
                       buckets: rq.Buckets | None = None) -> CompressedBatch:
    """Validates the request and the kept indices, buckets the kept tokens (`spec.session.prepare`) and pads their
    positions; positions must stay inside the target's (original length + budget + block)."""
    checked = rq.check_prompts(prompts, pair.target_cfg.vocab_size)
    kept = check_kept(checked, kept)
    budgets = rq.check_budgets(max_new_tokens, len(checked))
    bsz = pair.draft_cfg.block_size if block_size is None else block_size
    lengths = np.array([len(p) for p in checked])
    max_pos = pair.target_cfg.max_position_embeddings
    if rq.is_int(bsz) and int((lengths + budgets).max()) + int(bsz) > max_pos:
        raise ValueError(f"prompt ({int(lengths.max())}) + max_new_tokens ({int(budgets.max())}) exceeds the target's "
                         f"{max_pos} positions (with the block size {bsz}); compression keeps original positions")
    prep = prepare(pair, [p[k] for p, k in zip(checked, kept)], block_size=block_size, max_new_tokens=max_new_tokens,
                   sampling=sampling, stop_ids=stop_ids, seed=seed, buckets=LOOP_BUCKETS if buckets is None else buckets)
    b, t = prep.tokens.shape
    positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    for i, k in enumerate(kept):  # padding rows continue after the last kept position
        positions[i, :len(k)] = k
        positions[i, len(k):] = k[-1] + 1 + np.arange(t - len(k))
    return CompressedBatch(prepared=prep, positions=positions, prompt_lengths=lengths)


def begin_compressed(pair, batch: CompressedBatch) -> SpecState:
    """The compressed prefill of a `prepare_compressed` batch: the state the speculative rounds continue from."""
    compile_cache.ensure_enabled()
    prep = batch.prepared
    return begin_arrays(pair.target, pair.draft, prep.tokens, prep.lengths, prep.params, prep.key_data,
                        prep.key_fold, prep.spec, positions=batch.positions)


def generate(pair, prompts: Sequence[Sequence[int]], kept=None, *, max_new_tokens, block_size: int | None = None,
             sampling=SamplingParams(), stop_ids=(), seed=0, warmup: bool = False,
             buckets: rq.Buckets | None = None) -> GenerationResult:
    """DFlash (block_size > 1) or plain (block_size 1) generation after a compressed prefill of each prompt's
    `kept` tokens (one index list per prompt, `pflash.compress`; None = every token, the full prefill at
    explicit positions). Arguments as `spec.generate`. `stats` adds `prefill_s` (the compressed prefill and the
    first token, timed apart), `cpu_s` and `prefill_cpu_s` (the process's CPU seconds over the whole run and the
    prefill: the work, which a loaded machine does not inflate) and `pflash` (prompt and kept token counts)."""
    batch = prepare_compressed(pair, prompts, kept, block_size=block_size, max_new_tokens=max_new_tokens,
                               sampling=sampling, stop_ids=stop_ids, seed=seed, buckets=buckets)
    prep, spec = batch.prepared, batch.spec
    if warmup:
        state = begin_compressed(pair, batch)
        jax.block_until_ready(run_loop(pair.target, pair.draft, state.replace(done=jnp.ones_like(state.done)),
                                       spec).output)
    t0, c0 = time.perf_counter(), time.process_time()
    state = begin_compressed(pair, batch)
    jax.block_until_ready(state.anchor)
    prefill_s, prefill_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    state = run_loop(pair.target, pair.draft, state, spec)
    jax.block_until_ready(state.output)
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    n = prep.num_prompts
    stats = dict(shape_stats(prep), loop="jit", seconds=seconds, cpu_s=cpu_s, prefill_s=prefill_s,
                 prefill_cpu_s=prefill_cpu_s,
                 pflash={"prompt_tokens": batch.prompt_lengths.tolist(),
                         "kept_tokens": [int(x) for x in prep.lengths[:n]]})
    return generation_result(state, stats, rows=n)
