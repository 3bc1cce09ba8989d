'''Generation from a compressed prefill: the target prefills only the kept tokens, at their original positions.

The kept tokens fill cache slots 0 .. m-1 in order; RoPE reads their original positions (`models.decoder.forward`
with explicit `positions`), and the prefill leaves the caches a per-sequence `position_offset` (n - m, for a
prompt of n tokens whose last token is kept), so every later draft / verify row at slot s sits at position
s + offset: decoding continues at position n, as after the full prefill. Masks stay by slot (the kept tokens are
in order, so slot order is position order); DeltaNet layers see the kept tokens in order; gpt-oss sliding windows
count slots (W kept tokens, which may span more than W original positions). The DFlash draft's context is the
kept rows' taps at the same positions. Everything after the prefill is the ordinary speculative round, so DFlash
over a compressed prefill equals plain greedy decoding over the same compressed prefill, token for token. Lossy
only in what the prefill drops.

Compression is a prefill strategy of every driver: `spec.session.prepare(kept=)` puts the kept tokens and their
positions in the prepared batch, `begin_prepared` prefills them (one-shot or by chunks in capacity mode), and
`spec.generate` / `generate_stepping(kept=)` run any proposer after it; the serving engine compresses with a
`Compressor`. `generate` here is `spec.generate(kept=)`.
'''

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dflash_jax.spec import requests as rq
from dflash_jax.spec.loop import GenerationResult, LOOP_BUCKETS
from dflash_jax.spec.loop import generate as spec_generate
from dflash_jax.spec.sampling import SamplingParams
from dflash_jax.spec.session import Prepared, SpecConfig, SpecState, begin_prepared, prepare


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


check_kept = rq.check_kept


def prepare_compressed(pair, prompts: Sequence[Sequence[int]], kept=None, *, block_size: int | None = None,
                       max_new_tokens, sampling=SamplingParams(), stop_ids=(), seed=0,
                       buckets: rq.Buckets | None = None) -> CompressedBatch:
    """`spec.session.prepare(kept=)`: validates the request and the kept indices (positions must stay inside the
    target's: original length + budget + block), buckets the kept tokens and pads their positions."""
    prep = prepare(pair, prompts, block_size=block_size, max_new_tokens=max_new_tokens, sampling=sampling,
                   stop_ids=stop_ids, seed=seed, buckets=LOOP_BUCKETS if buckets is None else buckets,
                   kept=[None] * len(prompts) if kept is None else kept)
    return CompressedBatch(prepared=prep, positions=prep.positions, prompt_lengths=prep.prompt_lengths)


def begin_compressed(pair, batch: CompressedBatch) -> SpecState:
    """The compressed prefill of a `prepare_compressed` batch: the state the speculative rounds continue from."""
    return begin_prepared(pair, batch.prepared)


def generate(pair, prompts: Sequence[Sequence[int]], kept=None, *, max_new_tokens, block_size: int | None = None,
             sampling=SamplingParams(), stop_ids=(), seed=0, warmup: bool = False,
             buckets: rq.Buckets | None = None, proposer=None) -> GenerationResult:
    """DFlash (block_size > 1) or plain (block_size 1) generation after a compressed prefill of each prompt's
    `kept` tokens (one index list per prompt, `pflash.compress`; None = every token, the full prefill at
    explicit positions), with any proposer: `spec.generate(..., kept=kept)`. `stats` has `prefill_s` (the
    compressed prefill and the first token, timed apart), `cpu_s` and `prefill_cpu_s` (the process's CPU seconds
    over the whole run and the prefill: the work, which a loaded machine does not inflate) and `pflash` (prompt
    and kept token counts)."""
    return spec_generate(pair, prompts, max_new_tokens=max_new_tokens, block_size=block_size, sampling=sampling,
                         stop_ids=stop_ids, seed=seed, warmup=warmup, buckets=buckets, proposer=proposer,
                         kept=[None] * len(prompts) if kept is None else kept)
