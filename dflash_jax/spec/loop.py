"""Generation loops over the speculative round.

`generate` runs the whole decode as one jitted `lax.while_loop` (all weights resident): the state pytree
is donated and carried on the device; the host sees it again only at the end.
`generate_stepping` drives the same jitted draft/verify functions from Python, one round at a time: for
debugging, per-round traces, the draft/verify/host time split, and (later) host-side expert offload.
Both return a `GenerationResult`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import compile_cache
from dflash_jax.spec.requests import Buckets
from dflash_jax.spec.sampling import SamplingParams
from dflash_jax.spec.session import (
    Prepared, SpecConfig, SpecState, begin_prepared, draft_round_jit, prepare, spec_round, verify_round_jit,
)

# The loops pad the batch to its bucket (they slice the padding off the result).
LOOP_BUCKETS = Buckets(pad_batch=True)


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per sequence (first token included)
    acceptance_lengths: list[list[int]]  # tokens committed per round, per sequence
    stats: dict
    trace: list[dict] | None = None  # per round (sequence 0 ... b-1): proposal, accepted, bonus

    def mean_acceptance(self, i: int = 0) -> float:
        acc = self.acceptance_lengths[i]
        return float(np.mean(acc)) if acc else 0.0


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def run_loop(target_w, draft_w, state: SpecState, spec: SpecConfig) -> SpecState:
    """Rounds until every sequence is done (each round emits >= 1 token per live sequence)."""
    return jax.lax.while_loop(
        lambda s: ~jax.numpy.all(s.done),
        lambda s: spec_round(target_w, draft_w, s, spec),
        state,
    )


def _host(x) -> np.ndarray:
    """A result array on the host; on a mesh spanning several processes, gathered from all of them."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils  # only multi-process runs need it

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def generation_result(state: SpecState, stats: dict, trace=None, rows: int | None = None) -> GenerationResult:
    """The first `rows` sequences (default: all) of a finished state."""
    out, num = _host(state.output), _host(state.num_generated)
    acc, rounds = _host(state.acceptance), _host(state.rounds)
    rows = out.shape[0] if rows is None else rows
    out, num, acc, rounds = out[:rows], num[:rows], acc[:rows], rounds[:rows]
    tokens = [list(map(int, out[i, : num[i]])) for i in range(rows)]
    acceptance = [list(map(int, acc[i, : rounds[i]])) for i in range(rows)]
    total_rounds = int(rounds.sum())
    emitted = int(sum(len(t) - 1 for t in tokens))
    stats = dict(stats)
    stats.update(rounds=int(rounds.max()) if rounds.size else 0,
                 generated_tokens=int(num.sum()),
                 mean_acceptance=(emitted / total_rounds) if total_rounds else 0.0)
    if stats.get("seconds"):
        stats["tokens_per_second"] = int(num.sum()) / stats["seconds"]
    if trace is not None:
        trace = [r[:rows] for r in trace]
    return GenerationResult(tokens=tokens, acceptance_lengths=acceptance, stats=stats, trace=trace)


def _prepare(pair, prompts, max_new_tokens, block_size, sampling, stop_ids, seed, buckets,
             branch_head: bool = False) -> Prepared:
    compile_cache.ensure_enabled()
    if branch_head and getattr(pair.draft, "branch_head", None) is None:
        raise ValueError("branch_head=True proposes the chain from the draft's branch head, and this pair's draft has "
                         "none: load a pair shipped with branch_head.safetensors, or attach one "
                         "(dflash_jax.pair.with_branch_head)")
    prep = prepare(pair, prompts, block_size=block_size, max_new_tokens=max_new_tokens, sampling=sampling,
                   stop_ids=stop_ids, seed=seed, buckets=LOOP_BUCKETS if buckets is None else buckets)
    if branch_head:
        prep = dataclasses.replace(prep, spec=dataclasses.replace(prep.spec, chain_head=True))
    return prep


def shape_stats(prep: Prepared) -> dict:
    """The block size, acceptance method and compiled shapes of a prepared batch (the start of a run's stats)."""
    spec = prep.spec
    return {"block_size": spec.block_size, "method": spec.method,
            "shapes": {"batch": int(prep.tokens.shape[0]), "prompt": int(prep.tokens.shape[1]),
                       "output": spec.output_len, "cache": spec.max_len}}


def generate(pair, prompts: Sequence[Sequence[int]], *, max_new_tokens, block_size: int | None = None,
             sampling=SamplingParams(), stop_ids=(), seed=0, warmup: bool = False,
             buckets: Buckets | None = None, branch_head: bool = False) -> GenerationResult:
    """DFlash generation in one jitted while_loop.

    branch_head: propose the chain from the draft's branch head, position after position
    (`session.head_chain_draft`; the pair's draft must carry one) instead of the per-position argmax.

    max_new_tokens, sampling, stop_ids, seed: one value for every prompt, or one per prompt (stop_ids:
    one list of ids, or one list per prompt); they are traced, so requests that differ only in them (and
    in prompt lengths inside one bucket) reuse one compiled program. `warmup=True` compiles first (without
    running a round) so `stats.seconds` times only the run (prefill + decode)."""
    prep = _prepare(pair, prompts, max_new_tokens, block_size, sampling, stop_ids, seed, buckets, branch_head)
    if warmup:  # compile the prefill and the loop: a state with every sequence done runs no round
        state = begin_prepared(pair, prep)
        jax.block_until_ready(run_loop(pair.target, pair.draft, state.replace(done=jnp.ones_like(state.done)),
                                       prep.spec).output)
    t0 = time.perf_counter()
    state = begin_prepared(pair, prep)
    state = run_loop(pair.target, pair.draft, state, prep.spec)
    jax.block_until_ready(state.output)
    seconds = time.perf_counter() - t0
    return generation_result(state, dict(shape_stats(prep), loop="jit", seconds=seconds), rows=prep.num_prompts)


def generate_stepping(pair, prompts: Sequence[Sequence[int]], *, max_new_tokens, block_size: int | None = None,
                      sampling=SamplingParams(), stop_ids=(), seed=0, trace: bool = False, warmup: bool = False,
                      buckets: Buckets | None = None, branch_head: bool = False) -> GenerationResult:
    """The same rounds driven from Python; times draft and verify separately (each synchronized)."""
    prep = _prepare(pair, prompts, max_new_tokens, block_size, sampling, stop_ids, seed, buckets, branch_head)
    spec = prep.spec
    if warmup:  # one round compiles the prefill, the draft and the verify
        state = begin_prepared(pair, prep)
        jax.block_until_ready(verify_round_jit(pair.target, state, draft_round_jit(pair.target, pair.draft, state, spec),
                                               spec).output)
    t0 = time.perf_counter()
    state = begin_prepared(pair, prep)
    jax.block_until_ready(state.anchor)
    t_prefill = time.perf_counter() - t0
    t_draft = t_verify = 0.0
    rounds = []
    done = np.asarray(state.done)
    while not done.all():
        t1 = time.perf_counter()
        draft = draft_round_jit(pair.target, pair.draft, state, spec)
        jax.block_until_ready(draft.tokens)
        t2 = time.perf_counter()
        before = np.asarray(state.num_generated) if trace else None
        anchor = np.asarray(state.anchor) if trace else None
        state = verify_round_jit(pair.target, state, draft, spec)
        jax.block_until_ready(state.num_generated)
        t3 = time.perf_counter()
        t_draft += t2 - t1
        t_verify += t3 - t2
        if trace:
            after, out = np.asarray(state.num_generated), np.asarray(state.output)
            acc, bonus, proposals = np.asarray(state.last_accepted), np.asarray(state.last_bonus), np.asarray(draft.tokens)
            rows = []
            for i in range(len(before)):
                if done[i]:
                    rows.append(None)
                    continue
                rows.append({"anchor": int(anchor[i]), "proposal": list(map(int, proposals[i])),
                             "accepted": int(acc[i]), "bonus": int(bonus[i]),
                             "emitted": list(map(int, out[i, before[i]: after[i]]))})
            rounds.append(rows)
        done = np.asarray(state.done)
    seconds = time.perf_counter() - t0
    host = seconds - t_prefill - t_draft - t_verify
    stats = dict(shape_stats(prep), loop="python", seconds=seconds,
                 time_split={"prefill_s": t_prefill, "draft_s": t_draft, "verify_s": t_verify, "host_s": host})
    return generation_result(state, stats, trace=rounds if trace else None, rows=prep.num_prompts)
