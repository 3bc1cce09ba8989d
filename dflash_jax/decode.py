"""Plain (non-speculative) greedy decoding of a target: the baseline every speculative run is checked
against, and the reference for "greedy speculative output equals the target's own greedy output".

`prefill` runs a right-padded batch of prompts; `decode_loop` is one jitted `lax.while_loop` that feeds
one token per step with static shapes, writes into a fixed-size output buffer and stops per sequence at a
stop token or its budget. Shapes follow `spec.requests.Buckets` (batch, prompt, output, cache, stop ids);
budgets and stop ids are traced, so requests of one bucket share the compiled programs.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax.models.qwen3.config import Qwen3Config
from dflash_jax.spec import requests as rq
from dflash_jax.spec.sampling import greedy_tokens
from dflash_jax.stored import stored_jit


@struct.dataclass
class DecodeState:
    tokens: jax.Array  # [b, max_new] generated ids (-1 past the end)
    num_generated: jax.Array  # [b]
    done: jax.Array  # [b] bool
    cache: Any  # the target family's cache
    step: jax.Array  # scalar


def pad_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts into [b, T] int32 (T = the longest) and returns (tokens, lengths); validates the
    ids (integers inside the vocabulary: `spec.requests.check_prompts`)."""
    checked = rq.check_prompts(prompts, vocab_size)
    return rq.pad_prompts(checked, max(len(p) for p in checked), len(checked))


@stored_jit(static_argnames=("cfg", "max_len", "implementation"))
def prefill_cache(weights, tokens, lengths, cfg: Qwen3Config, max_len: int, implementation: str = "auto"):
    """A fresh target cache of `max_len` rows holding the right-padded prompts, and each row's first token."""
    from dflash_jax.spec.session import init_target_cache, target_family

    cache = init_target_cache(cfg, tokens.shape[0], max_len, weights.embed.dtype, verify_width=1)
    out = target_family(cfg).forward(weights, tokens, cache, cfg, num_valid=lengths, logits="last",
                                     implementation=implementation)
    return greedy_tokens(out.logits), out.cache


@stored_jit(static_argnames=("cfg", "output_len", "implementation"), donate_argnames=("cache",))
def decode_loop(weights, first, cache, stop_ids, budgets, cfg: Qwen3Config, output_len: int,
                 implementation: str = "auto"):
    """stop_ids [S] (-1 = unused), budgets [b] (tokens per sequence, the first included, <= output_len).
    The prefill's cache is donated and returned (the loop's carry reuses its buffers instead of holding a
    second copy); callers drop it."""
    from dflash_jax.spec.session import target_family

    fam = target_family(cfg)
    b = first.shape[0]
    is_stop = lambda tok: jnp.isin(tok, stop_ids)  # noqa: E731
    state = DecodeState(
        tokens=jnp.full((b, output_len), -1, jnp.int32).at[:, 0].set(first),
        num_generated=jnp.ones((b,), jnp.int32),
        done=is_stop(first) | (budgets <= 1),
        cache=cache,
        step=jnp.int32(1),
    )

    def cond(s: DecodeState):
        return (s.step < output_len) & ~jnp.all(s.done)

    def body(s: DecodeState):
        last = s.tokens[jnp.arange(b), s.num_generated - 1]
        out = fam.forward(weights, last[:, None], s.cache, cfg, num_valid=(~s.done).astype(jnp.int32),
                          logits="last", implementation=implementation)
        nxt = greedy_tokens(out.logits)
        col = jnp.where(s.done, output_len, s.num_generated)  # out of range: dropped
        tokens = s.tokens.at[jnp.arange(b), col].set(nxt, mode="drop")
        num = s.num_generated + (~s.done).astype(jnp.int32)
        done = s.done | is_stop(nxt) | (num >= budgets)
        return DecodeState(tokens=tokens, num_generated=num, done=done, cache=out.cache, step=s.step + 1)

    final = jax.lax.while_loop(cond, body, state)
    return final.tokens, final.num_generated, final.cache


def greedy_generate(
    weights,
    cfg: Qwen3Config,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens,
    stop_ids: Sequence[int] = (),
    implementation: str = "auto",
    buckets: rq.Buckets | None = None,
    lanes="auto",
) -> list[list[int]]:
    """Greedy continuation of each prompt (stop tokens included in the output, then generation stops).
    max_new_tokens: one budget or one per prompt (traced). `implementation`: the MoE experts' (see
    `nn.moe.swiglu_experts`). buckets: the compiled shapes (default: `spec.requests.Buckets` with the
    batch padded). lanes: "auto" (on a CPU, the rows split over the usable cores, each group's loop on its own
    thread, one compiled program: `spec.lanes`) or a positive integer (1: one loop)."""
    from dflash_jax import compile_cache
    from dflash_jax.spec.lanes import check_lanes, choose_lanes, lane_slices, run_lanes

    buckets = rq.Buckets(pad_batch=True) if buckets is None else buckets
    checked = rq.check_prompts(prompts, cfg.vocab_size)
    n = len(checked)
    budgets = rq.check_budgets(max_new_tokens, n)
    stops = rq.check_stop_ids(stop_ids, 1, cfg.vocab_size)[0]
    lengths_real = np.array([len(p) for p in checked])
    need = int((lengths_real + budgets).max())
    if need > cfg.max_position_embeddings:
        raise ValueError(f"prompt + max_new_tokens ({need}) exceeds the target's {cfg.max_position_embeddings} "
                         "positions")
    check_lanes(lanes)
    groups = lane_slices(n, choose_lanes(n, lanes, weights))
    batch = buckets.batch_size(max(len(g) for g in groups))  # every lane the same shapes: one program
    output_len = buckets.output_len(int(budgets.max()))
    prompt_len = buckets.prompt_len(int(lengths_real.max()))
    max_len = min(buckets.cache_len(prompt_len + output_len), cfg.max_position_embeddings)
    stop_arr = np.full((buckets.stops_len(len(stops)),), -1, np.int32)
    stop_arr[: len(stops)] = stops
    compile_cache.ensure_enabled()

    def lane(rows):
        tokens, lengths = rq.pad_prompts([checked[i] for i in rows], min(prompt_len, max_len), batch)
        lane_budgets = np.concatenate([budgets[rows], np.ones(batch - len(rows), np.int32)])
        first, cache = prefill_cache(weights, tokens, lengths, cfg, max_len, implementation)
        out, num, _ = decode_loop(weights, first, cache, stop_arr, lane_budgets, cfg, output_len, implementation)
        out, num = np.asarray(out), np.asarray(num)
        return [list(map(int, out[i, : num[i]])) for i in range(len(rows))]

    return [seq for part in run_lanes(lane, groups) for seq in part]


# ----------------------------------------------------------------------------------------------------------
# the default generation: plain decoding (this loop) or the draft's chain, whichever measures faster now
# ----------------------------------------------------------------------------------------------------------

def measured_policy(pair, prompts, *, block_size: int | None = None, max_new_tokens: int = 16, repeats: int = 2,
                    clock: str = "cpu", statistic: str = "median", margin: float = 0.05, buckets=None, log=None):
    """The default generation's choice, from figures measured now on the run's own prompts: plain decoding
    (`PLAIN`, run by the fastest plain loop, `decode.greedy_generate`) against the draft's chain of `block_size`
    (default: the draft's trained block, the jitted DFlash loop), each compiled first, then `repeats` interleaved
    runs of `max_new_tokens` (`timing.paired_runs`, whole calls, prefill included for both). A shape's seconds per
    round are its run's seconds over its rounds, its tokens per round the run's mean. The chain is kept only where
    its measured tokens per second beat plain decoding's by more than `margin` (the measurement's error), so the
    default is never slower than plain by more than that error. One shape is reachable (the calibration range is
    pinned at 1): run it with `generate_default`."""
    from dflash_jax.spec.calibrate import PLAIN
    from dflash_jax.spec.loop import generate
    from dflash_jax.spec.policy import AdaptivePolicy, VerifyCost
    from dflash_jax.spec.tree import TreeShape
    from dflash_jax.timing import CLOCKS, paired_runs

    if clock not in CLOCKS:
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    block = pair.draft_cfg.block_size if block_size is None else int(block_size)
    if block <= 1:
        return AdaptivePolicy((PLAIN,), VerifyCost((1.0,)), taus=(1.0,))
    chain = TreeShape(block, 1)
    extra = {} if buckets is None else {"buckets": buckets}
    runs = {"plain": lambda: greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=max_new_tokens,
                                             stop_ids=[], **extra),
            # the block's chain as the loop runs it with no proposer named (one compiled program for both)
            "chain": lambda: generate(pair, prompts, max_new_tokens=max_new_tokens, block_size=block, buckets=buckets)}
    first = {m: fn() for m, fn in runs.items()}  # compiled before any timing
    res = first["chain"]
    tau = float(np.mean([a for seq in res.acceptance_lengths for a in seq]))
    rounds = {"plain": max(1, max_new_tokens), "chain": max(1, int(res.stats["rounds"]))}
    timings = paired_runs(runs, repeats)
    secs = tuple(timings.stat(m, clock, statistic) / rounds[m] for m in ("plain", "chain"))
    if log:
        log(f"measured: plain {secs[0] * 1e3:.2f} ms/token, chain B={block} {secs[1] * 1e3:.2f} ms/round at "
            f"{tau:.2f} tokens/round")
    return AdaptivePolicy((PLAIN, chain), VerifyCost(secs), taus=(1.0, round(tau, 4)), calibration_range=(1.0, 1.0),
                          margin=margin)


def generate_default(pair, prompts, policy, *, max_new_tokens, sampling=None, stop_ids=(),
                     buckets=None, warmup: bool = False, **kwargs):
    """The run under `policy` (`measured_policy`'s): where plain decoding is its only reachable shape and the
    decoding is greedy with one stop list, the fastest plain loop (`decode.greedy_generate`, as the measurement
    ran it), wrapped as a `spec.loop.GenerationResult` (every round one token); else `spec.loop.generate`."""
    import time

    from dflash_jax.spec.loop import GenerationResult, generate
    from dflash_jax.spec.sampling import SamplingParams

    sampling = SamplingParams() if sampling is None else sampling
    one_stop_list = not stop_ids or not isinstance(stop_ids[0], (list, tuple))
    reach = policy.reachable()
    if len(reach) == 1 and policy.shapes[reach[0]].budget > 1 and policy.shapes[reach[0]].is_chain:
        kwargs["block_size"] = policy.shapes[reach[0]].budget  # the chain of the block, as `measured_policy` ran it
        return generate(pair, prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                        buckets=buckets, warmup=warmup, **kwargs)
    if not (len(reach) == 1 and policy.shapes[reach[0]].budget == 1 and getattr(sampling, "greedy", False)
            and one_stop_list and not kwargs.get("kept")):
        return generate(pair, prompts, max_new_tokens=max_new_tokens, proposer=policy, sampling=sampling,
                        stop_ids=stop_ids, buckets=buckets, warmup=warmup, **kwargs)
    extra = {} if buckets is None else {"buckets": buckets}
    run = functools.partial(greedy_generate, pair.target, pair.target_cfg, prompts, max_new_tokens=max_new_tokens,
                            stop_ids=list(stop_ids), **extra)
    if warmup:
        run()
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = run()
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    generated = sum(len(t) for t in tokens)
    stats = {"block_size": 1, "proposer": "plain (decode.greedy_generate)", "loop": "jit", "seconds": seconds,
             "cpu_s": cpu_s, "rounds": max((len(t) - 1 for t in tokens), default=0), "generated_tokens": generated,
             "mean_acceptance": 1.0, "tokens_per_second": generated / seconds if seconds else 0.0}
    return GenerationResult(tokens=tokens, acceptance_lengths=[[1] * (len(t) - 1) for t in tokens], stats=stats)
